"""``dsv4lab generate`` — greedy or sampled generation from a checkpoint.

The text is printed as it is generated, followed by the output ids, the trajectory hash and why generation stopped
(``eos``: the model wrote EOS; ``length``: ``--max-new-tokens`` reached; ``context``: the cache is full). With
``--json`` it prints one JSON object instead, with ``output_ids``, ``hash`` (the trajectory hash: first 16 hex
digits of sha256 over the output ids as little-endian int32), ``finish_reason``, the prompt ids, text and timing.
The JSON also carries the decode path the engine took (``decode``: ``graph`` — CUDA-graph replay of the fused static
step, the default on a GPU with the Triton backend, with the seconds each batch tier's capture took — ``static`` or
``eager``). Under ``torchrun`` with ``--tp``/``--ep`` only rank 0 prints. ``--speculative mtp`` decodes greedily with
the MTP block drafting ``--draft-tokens`` tokens per forward (the same ids and hash; the JSON adds the acceptance
counters). On the CPU, torch runs ``--threads`` threads (default 1 unless ``OMP_NUM_THREADS`` is set; the JSON's
``threads``).
"""
from __future__ import annotations

import json
import sys
import time

from dsv4lab.engine import MAX_TEMPERATURE, SEED_RANGE
from dsv4lab.core.errors import UserError
from dsv4lab.tools.options import (add_backend, add_device, add_dtype, add_threads, float_range, int_range,
                                   resolve_device, set_cpu_threads, torch_dtype)

NAME = "generate"
HELP = "generate tokens from a checkpoint, printing the text as it goes (--json: output_ids and the trajectory hash)"


def add_arguments(p):
    p.add_argument("--checkpoint", required=True, help="checkpoint folder")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer.json)")
    g.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 5,6,7")
    p.add_argument("--max-new-tokens", type=int_range(1), default=32,
                   help="tokens to generate at most (default 32; generation also stops at EOS or a full cache)")
    p.add_argument("--temperature", type=float_range(0, MAX_TEMPERATURE), default=0.0,
                   help=f"0 = greedy (default), at most {MAX_TEMPERATURE:g}")
    p.add_argument("--top-p", type=float_range(0, 1, lo_open=True), default=1.0,
                   help="nucleus sampling: the probability mass kept, in (0, 1] (default 1)")
    p.add_argument("--seed", type=int_range(*SEED_RANGE), default=None)
    p.add_argument("--no-bos", action="store_true", help="do not prepend BOS to --prompt text")
    add_backend(p)
    add_dtype(p)
    add_device(p)
    add_threads(p)
    p.add_argument("--prefill-chunk", type=int_range(1), default=None,
                   help="prefill the prompt in chunks of this many tokens")
    p.add_argument("--decode-path", default="auto", choices=("auto", "graph", "static", "eager"),
                   help="auto (default): CUDA-graph replay of the static decode step on a GPU with the triton "
                        "backend, the eager per-op forward otherwise")
    p.add_argument("--prefill-path", default="auto", choices=("auto", "graph", "static", "eager"),
                   help="auto (default): the static prefill step per chunk bucket, CUDA-graph replayed, on a GPU "
                        "with the triton backend; the eager per-op forward otherwise")
    p.add_argument("--warmup", action="store_true",
                   help="before generating, compile every prefill bucket and decode tier (with a progress bar), as "
                        "a server does at start: the prompt then compiles nothing (with --speculative, its prefill "
                        "and cycles too)")
    p.add_argument("--speculative", default=None, choices=("mtp",),
                   help="self-speculative greedy decoding: the MTP block drafts, the model verifies (lossless)")
    p.add_argument("--draft-tokens", type=int_range(1), default=1,
                   help="tokens the MTP block drafts per forward (default 1)")
    p.add_argument("--tp", type=int_range(1), default=1, help="tensor-parallel ranks (run under torchrun)")
    p.add_argument("--ep", type=int_range(1), default=1, help="expert-parallel ranks (run under torchrun)")
    p.add_argument("--collective", default="auto", choices=("auto", "library", "peer_read"),
                   help="all-reduce strategy under --tp/--ep (auto: peer-read inside CUDA graphs, else library)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UserError(f"--prompt-ids {text!r}: expected comma-separated integers") from None
    if not ids:
        raise UserError("--prompt-ids is empty")
    return ids


class TextStream:
    """Prints generated text as each token completes it (``on_token`` of ``generate``), bold on a terminal."""

    def __init__(self, tokenizer, out=None):
        from dsv4lab.tools.serve.detokenizer import IncrementalDetokenizer  # the tokenizers library: only when text is shown
        self.detok = IncrementalDetokenizer(tokenizer)
        self.out = out or sys.stdout
        self.tty = self.out.isatty()

    def start(self, prompt_text: str) -> None:
        self.out.write(prompt_text + ("\033[1m" if self.tty else ""))
        self.out.flush()

    def __call__(self, token_id: int) -> None:
        self.out.write(self.detok.add(token_id))
        self.out.flush()

    def end(self) -> None:
        self.out.write(self.detok.flush() + ("\033[0m" if self.tty else "") + "\n")
        self.out.flush()


def run(args) -> int:
    from dsv4lab.engine.loader import load  # torch and the model: imported when the command runs, not to parse it
    from dsv4lab.engine.sampling import FINISH_REASONS, check_generation, finish_reason, trajectory_hash
    from dsv4lab.engine.speculative import check_speculative, max_draft_tokens

    dtype = torch_dtype(args.dtype)
    device = resolve_device(args.device)
    threads = set_cpu_threads(args.threads, device)
    if args.speculative is not None:
        try:
            check_speculative(args.speculative, args.temperature)
        except ValueError as err:
            raise UserError(f"--speculative: {err}") from None
    if args.tp > 1 or args.ep > 1:
        from dsv4lab.engine.parallel import load_parallel
        m, rank = load_parallel(args.checkpoint, tp=args.tp, ep=args.ep, dtype=dtype, backend=args.backend,
                                collective=args.collective)
    else:
        m, rank = load(args.checkpoint, device=device, dtype=dtype, backend=args.backend, max_batch=1), 0
    try:
        m.decode_path = args.decode_path
    except ValueError as err:
        raise UserError(f"--decode-path {args.decode_path}: {err}") from None
    try:
        m.prefill_path = args.prefill_path
    except ValueError as err:
        raise UserError(f"--prefill-path {args.prefill_path}: {err}") from None
    if args.speculative is not None:
        limit = max_draft_tokens(m.model) if len(m.model.mtp) else 0
        if not limit:
            raise UserError(f"--speculative: {args.checkpoint} has no MTP block")
        if not 1 <= args.draft_tokens <= limit:
            raise UserError(f"--draft-tokens must be in [1, {limit}] for this model, got {args.draft_tokens}")
    # with --speculative: its prefill and cycles of up to --draft-tokens drafts too
    warmup = m.warmup(progress=None if rank == 0 else False,
                      draft_tokens=args.draft_tokens if args.speculative is not None else 0) if args.warmup else None
    if warmup is not None and rank == 0 and not args.json:
        print(warmup.describe(), file=sys.stderr)
    if args.prompt is not None:
        if m.tokenizer is None:
            raise UserError(f"{args.checkpoint} has no tokenizer.json: use --prompt-ids")
        ids = m.tokenizer.encode(args.prompt, add_bos=not args.no_bos)
        outside = m.tokenizer.ids_outside(ids, m.args.vocab_size)
        if outside:
            raise UserError(f"--prompt: the tokenizer gives ids outside the vocabulary [0, {m.args.vocab_size}) "
                            f"(position, id: {outside})")
    else:
        ids = parse_ids(args.prompt_ids)
        bad = [i for i in ids if not 0 <= i < m.args.vocab_size]
        if bad:
            raise UserError(f"--prompt-ids: ids {bad} outside the vocabulary [0, {m.args.vocab_size})")
    cache = m.args.max_seq_len
    check_generation(len(ids), args.max_new_tokens, cache, args.temperature, args.top_p, args.seed)
    if rank == 0 and len(ids) + args.max_new_tokens > cache:
        print(f"note: the cache holds {cache} positions, so at most {cache - len(ids)} of the {args.max_new_tokens} "
              f"new tokens fit after the {len(ids)}-token prompt", file=sys.stderr)
    stream = TextStream(m.tokenizer) if rank == 0 and not args.json and m.tokenizer is not None else None
    if stream is not None:
        stream.start(m.tokenizer.decode(ids))
    t0 = time.perf_counter()
    out = m.generate(ids, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                     prefill_chunk=args.prefill_chunk, speculative=args.speculative, draft_tokens=args.draft_tokens,
                     on_token=stream)
    dt = time.perf_counter() - t0
    if stream is not None:
        stream.end()
    if rank != 0:
        return 0
    reason = finish_reason(out, len(ids), args.max_new_tokens, cache, m.args.eos_token_id)
    text = m.tokenizer.decode(out) if m.tokenizer is not None else None
    res = dict(prompt_ids=ids, output_ids=out, hash=trajectory_hash(out), text=text, finish_reason=reason,
               backend=m.backend, dtype=args.dtype, seconds=round(dt, 4), decode=m.decode_info(), threads=threads,
               prefill_path=m.prefill_path)
    if warmup is not None:
        res["warmup"] = warmup.to_dict()
    if args.speculative is not None:
        res["speculative"] = dict(method=args.speculative, draft_tokens=args.draft_tokens,
                                  **m.last_speculative_stats.to_dict())
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"output_ids {out}")
    print(f"hash {res['hash']}  ({len(out)} tokens in {dt:.2f} s, backend {m.backend}, {args.dtype})")
    print(f"decode path: {describe_decode(res['decode'])}")
    if args.speculative is not None:
        st = m.last_speculative_stats
        print(f"speculative {args.speculative}, {args.draft_tokens} draft token(s): acceptance "
              f"{st.acceptance_rate:.3f}, {st.tokens_per_cycle:.2f} tokens per model forward")
    print(f"stopped: {FINISH_REASONS[reason]}")
    return 0


def describe_decode(info: dict) -> str:
    """One line for :meth:`ModelRunner.decode_info`: the path, and for graphs the tiers captured and their cost."""
    text = info["path"]
    if info.get("captured"):
        text += " (captured batch " + ", ".join(f"{b} in {s:.2f} s" for b, s in info["captured"].items()) + ")"
    if info.get("note"):
        text += f"; {info['note']}"
    return text
