"""``dsv4lab train-small`` — train, quantize and evaluate the small DeepSeek-V4 model shipped as ``data/tiny-py``.

Four steps, each a sub-command (``docs/training.md`` has the exact commands that built ``data/tiny-py``)::

    dsv4lab train-small prepare --out .carry/pystdlib-tokens          # tokenize the stdlib corpus (CPU)
    dsv4lab train-small train --tokens .carry/pystdlib-tokens --out runs/tiny-py-weights --device cuda
    dsv4lab train-small export --weights runs/tiny-py-weights --tokens .carry/pystdlib-tokens --out data/tiny-py
    dsv4lab train-small ablation --weights runs/tiny-py-weights --tokens .carry/pystdlib-tokens

``train`` writes the trained weights (safetensors shards ≤ 15 MiB: float32, bf16 where the checkpoint stores
BF16) and ``train_log.json``; ``export`` quantizes them into the native format, validates the checkpoint,
evaluates held-out perplexity and records the greedy oracles; ``ablation`` re-quantizes the trained weights in
other formats (see :mod:`dsv4lab.tools.train.quant_ablation`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from dsv4lab.core.errors import UserError
from dsv4lab.tools.options import add_device, float_range, int_range
from dsv4lab.core.provenance import refuse_replacing_committed, write_json

NAME = "train-small"
HELP = "train the small DeepSeek-V4 model on the stdlib corpus, quantize it natively, evaluate, ablate"
DESCRIPTION = __doc__


def add_arguments(p):
    sub = p.add_subparsers(dest="step", metavar="STEP", required=True)

    prep = sub.add_parser("prepare", help="tokenize the corpus into tokens.npz + tokens.json")
    prep.add_argument("--out", required=True, help="output folder")
    prep.add_argument("--tokenizer", default=None,
                      help="tokenizer.json (default: data/tokenizers/pystdlib-bpe-4096.json)")
    prep.add_argument("--packed-corpus", default=None,
                      help="a dsv4lab.tools.train.corpus.pack_corpus JSON file instead of this interpreter's stdlib")

    tr = sub.add_parser("train", help="train with the reference modules (autograd) and save the weights")
    tr.add_argument("--tokens", required=True, help="folder written by `prepare`")
    tr.add_argument("--out", required=True, help="output folder for weights-*.safetensors and train_log.json")
    add_device(tr)
    tr.add_argument("--steps", type=int_range(0), default=None,
                    help="optimizer steps (default 0: chosen from --time-budget after timing the first steps)")
    tr.add_argument("--stop-at", type=int_range(1), default=None,
                    help="stop after N steps of a longer schedule (repeats a run the time budget ended early)")
    tr.add_argument("--time-budget", type=float_range(0, lo_open=True), default=None,
                    help="seconds for the training loop (steps=0)")
    tr.add_argument("--batch-size", type=int_range(1), default=None)
    tr.add_argument("--seq-len", type=int_range(2), default=None)
    tr.add_argument("--lr", type=float_range(0, lo_open=True), default=None)
    tr.add_argument("--seed", type=int_range(0), default=None)
    tr.add_argument("--eval-every", type=int_range(1), default=None)
    tr.add_argument("--limit-train-tokens", type=int_range(1), default=None,
                    help="use only the first N training tokens (smoke runs)")
    tr.add_argument("--limit-heldout-tokens", type=int_range(1), default=None,
                    help="evaluate on the first N held-out tokens")

    ex = sub.add_parser("export", help="quantize to the native format, validate, evaluate, record oracles")
    ex.add_argument("--weights", required=True, help="folder written by `train`")
    ex.add_argument("--tokens", required=True, help="folder written by `prepare`")
    ex.add_argument("--out", required=True, help="checkpoint folder to write (e.g. data/tiny-py)")
    ex.add_argument("--tokenizer", default=None)
    ex.add_argument("--eval-windows", type=int_range(1), default=None,
                    help="held-out windows of max_seq_len tokens, spread evenly (default: all)")
    ex.add_argument("--max-new-tokens", type=int_range(1), default=40, help="greedy tokens per oracle prompt")
    ex.add_argument("--overwrite", action="store_true")

    ab = sub.add_parser("ablation", help="weight-format ablation of the trained model (CPU)")
    ab.add_argument("--weights", required=True, help="folder written by `train`")
    ab.add_argument("--tokens", required=True, help="folder written by `prepare`")
    ab.add_argument("--out", default="data/results/quant_ablation.json",
                    help="result JSON (default: the committed data/results/quant_ablation.json, replaced only with "
                         "--force)")
    ab.add_argument("--force", action="store_true", help="replace an existing committed result named by --out")
    ab.add_argument("--eval-windows", type=int_range(1), default=24,
                    help="held-out windows of max_seq_len tokens, spread evenly")
    ab.add_argument("--batch-size", type=int_range(1), default=4)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args) -> int:
    if args.step == "prepare":
        from dsv4lab.tools.train.trainer import DEFAULT_TOKENIZER, prepare_tokens
        out = prepare_tokens(args.out, args.tokenizer or DEFAULT_TOKENIZER, args.packed_corpus)
        meta = json.loads((out / "tokens.json").read_text())
        print(f"wrote {out}/tokens.npz: {meta['n_tokens']} tokens, corpus digest "
              f"{meta['corpus_manifest']['digest'][:16]}")
        return 0

    if args.step == "train":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA starts

        import torch

        from dsv4lab.tools.train.trainer import TrainConfig, load_tokens, save_weights, train
        if args.device == "auto":
            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise UserError("--device cuda: no CUDA device is available (pass --device cpu)")
        streams, meta = load_tokens(args.tokens)
        if args.limit_train_tokens:
            streams["train"] = streams["train"][: args.limit_train_tokens]
        if args.limit_heldout_tokens:
            streams["heldout"] = streams["heldout"][: args.limit_heldout_tokens]
        given = dict(steps=args.steps, stop_at=args.stop_at, time_budget_s=args.time_budget,
                     batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, seed=args.seed,
                     eval_every=args.eval_every)
        changes = {k: v for k, v in given.items() if v is not None}
        cfg = dataclasses.replace(TrainConfig(), **changes)
        if args.device.startswith("cuda"):
            torch.use_deterministic_algorithms(True, warn_only=True)
        model, report = train(cfg, streams, args.device, log=_log)
        out = Path(args.out)
        paths = save_weights(model, out, max_shard_bytes=15 << 20)  # files of at most 16 MiB travel back
        report["tokens"] = meta
        write_json(out / "train_log.json", report)
        print(f"wrote {len(paths)} weight shards and train_log.json to {out}: {report['steps']} steps in "
              f"{report['train_seconds']:.0f} s, held-out ppl (float32) {report['heldout_ppl_f32']:.3f}")
        return 0

    if args.step == "export":
        from dsv4lab.tools.train.trainer import DEFAULT_TOKENIZER, export_checkpoint
        rep = export_checkpoint(args.weights, args.out, args.tokens, args.tokenizer or DEFAULT_TOKENIZER,
                                eval_windows=args.eval_windows, max_new_tokens=args.max_new_tokens,
                                overwrite=args.overwrite, log=_log)
        print(f"wrote {args.out}: held-out ppl bf16 {rep['heldout_ppl_bf16']:.3f}, quantized "
              f"{rep['heldout_ppl_quantized']:.3f}, unigram {rep['unigram_ppl']:.2f} "
              f"(acceptance {'passed' if rep['acceptance']['passed'] else 'FAILED'})")
        return 0 if rep["acceptance"]["passed"] else 1

    if args.step == "ablation":
        from dsv4lab.tools.train.quant_ablation import run_ablation
        refuse_replacing_committed(args.out, args.force)
        res = run_ablation(args.weights, args.tokens, args.out, eval_windows=args.eval_windows,
                           batch_size=args.batch_size, log=_log)
        for row in res["points"]:
            print(f"{row['name']:<34} ppl {row['heldout_ppl']:8.3f}  KL {row['kl_vs_bf16']:.5f}  "
                  f"rel.err {row['weight_rel_error']:.4f}  {row['bytes_per_param']:.4f} B/param")
        print(f"wrote {args.out}")
        return 0
    raise UserError(f"unknown step {args.step!r}")
