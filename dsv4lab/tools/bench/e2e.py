"""``dsv4lab bench e2e`` — the whole model, end to end: a full-dims random DeepSeek-V4-Flash generated on the GPUs
(:class:`~dsv4lab.core.random_checkpoint.RandomCheckpoint`: native FP4/FP8 formats, no 160 GB file), optionally cut to
its first ``--layers`` main layers (every dimension and the real SWA/CSA/HCA pattern kept: the cut that fits one
H200 at 30 layers), split over ``--nproc`` ranks (``--tp``/``--ep``), measured as a user would see it. Every
decode goes through ``runner.forward`` — the engine's decode path (on a GPU with the Triton backend: CUDA-graph
replay of the fused static step, :mod:`dsv4lab.engine.decode_graph`), the one ``generate`` and ``serve`` use.

* **oracle**: the trajectory hash of 32 greedy tokens from a fixed prompt (identical for every split of the same
  seed on the same device type: a correctness gate on the measured configuration).
* **graph check** (GPU): teacher-forced steps through the graphs (batch 1, and batch 3 padded to tier 4) equal the
  same steps through the eager static step, bit for bit.
* **decode**: for each batch size (default 1, 2, 4, 8, 16, 32), ``--decode-tokens`` greedy steps after a 16-token
  prompt, timed per round (device synchronised, ranks barriered); ``--rounds`` rounds after one dropped warm-up
  round (which captures the tier's graph), median reported. **MBU** = tok/s × the weight bytes one decode step
  reads per GPU per token (the cost model, :mod:`dsv4lab.tools.perf.costmodel`) ÷ the copy bandwidth measured in
  the same run (``mbu_all_bytes``: every byte the step moves at the round's mean context, KV reads included);
  ``bytes_per_step`` / ``weight_bytes_per_step``: what one step of the batch reads per GPU (modelled).
* **contexts**: batch-1 decode after a prompt of each ``--contexts`` length (prefilled in ``--context-chunk``
  chunks, its time reported), ``--context-tokens`` steps — how decode cost grows with context — and, at each, the
  first step through the graph against the eager static step (bitwise, from a snapshot of the slot's caches) and
  against the eager per-op forward and the reference's per-op forward (relative error, greedy token); the per-op
  forward's own distance from the reference says how far rounding alone moves these random weights' logits.
* **TTFT**: a ``--prompt-tokens`` prompt prefilled in chunks of each ``--chunks`` size until the first token;
  then, at the fastest chunk, one more prefill with every backend op timed (summed over the layers, the glue
  between them apart) beside the cost model's prediction of that prefill (``prefill_breakdown``).
* **warmup** and **first prompt**: the warm-up at load, then the TTFT of the first prompt of each
  ``--first-prompts`` length against the same prompt warm (:mod:`dsv4lab.tools.bench.e2e_warmup`; ``--no-warmup``
  measures the cold first prompts instead).
* **ABBA** (more than one rank): batch-1 decode rounds alternating two all-reduce strategies A B B A.
* **verify** and **speculative** (one rank): the speculative verify step of ``k+1`` tokens (``--draft-tokens``)
  against the one-token step and against its bytes ratio; speculative decoding's tok/s with injected acceptance
  (``--alphas``) against plain greedy's, every output checked equal to it (one that differs fails the run, listed
  under ``failed`` as ``speculative``) — :mod:`dsv4lab.tools.bench.e2e_multitoken`
  (``--smoke`` adds the natural acceptance of ``data/tiny-py``'s trained MTP block). On CUDA the verify steps'
  time by kernel family against the one-token step's (``verify_profile``).
* **fusions** (one rank, Triton backend): at each ``--fusion-batches`` batch (default 1 and 8 where ``--batches``
  reaches them), decode tok/s, launches per step and per layer and the token ids with every fused path of the decode
  step off, each alone on and all on, timed off C C off; the paths a visit should turn on and their ready tuned
  ``decode.fusion`` entries (``--tuned-out`` merges them into a tuned file) —
  :mod:`dsv4lab.tools.bench.e2e_fusions`.
* **breakdown** (CUDA): one graph replay of the batch-1 step under the profiler — GPU time by kernel family and
  the number of kernel launches per step and per layer — beside the roofline model's prediction on the H200
  catalogue entry; the same for each ``--breakdown-batches`` batch (``breakdown_by_batch``: where a batch's step
  spends the time its bytes do not explain).

The parts run in the order warm-up and first prompts, decode rows, verify, speculative, TTFT — the headline rows,
seconds each — then the profiles that explain them (breakdown, fusions, the verify step's profile, the prefill's
per-op breakdown: tens of seconds each), ABBA, contexts — what a tight budget should keep first. Every part's
wall time is recorded (``timing_s``); parts that would start after
``--budget-s`` are skipped and listed (``skipped``), and on one rank a part still running ``--overrun-s`` past the
budget is stopped and listed under ``failed`` ("timed out"), so the JSON is always written inside a fixed time.
``--smoke`` runs the same code on the tiny preset on a CPU
(gloo between ranks) in seconds.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dsv4lab.core.config import get_preset
from dsv4lab.engine.decode_graph import Decoder
from dsv4lab.engine.kernel_loader import PDL_ENV, kernel_module
from dsv4lab.engine.loader import load
from dsv4lab.core.errors import UserError
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.tools.options import add_backend, add_preset, positive_ints
from dsv4lab.engine.parallel import init_distributed, load_parallel, make_site_reducer, run_parallel
from dsv4lab.tools.perf.costmodel import decode_step
from dsv4lab.tools.perf.costmodel import prefill as prefill_cost  # context_row has a local prefill()
from dsv4lab.tools.perf.hardware import load_hardware
from dsv4lab.tools.perf.roofline import time_step
from dsv4lab.core.provenance import short_commit
from dsv4lab.core.random_checkpoint import RandomCheckpoint
from dsv4lab.tools.verify.model import fixed_sequence, trajectory_hash
from dsv4lab.tools.bench.e2e_parts import Parts, log
# count_launches: tests import it from here
from dsv4lab.tools.bench.common import (OP_NAMES, OpTimer, clock_us, count_launches, kernel_profile,  # noqa: F401
                                        median_copy_us, pdl_off, profiled, top_kernels, write_json)
from dsv4lab.tools.bench.e2e_multitoken import (natural_acceptance, speculative_mismatches, speculative_rows,
                                                verify_profile, verify_rows)
from dsv4lab.tools.bench.e2e_report import format_summary, targets
from dsv4lab.tools.bench.e2e_fusions import (fusion_batches, fusion_names, fusion_rows, fusion_section, smoke_runner,
                                             tuned_ops)
from dsv4lab.tools.bench.tuned import TunedWriter, add_tuned_arguments
from dsv4lab.tools.bench.e2e_warmup import first_prompt_rows, format_first_prompts, warmup_part
from dsv4lab.core.paths import DATA_DIR
from dsv4lab.engine.speculative import max_draft_tokens

HELP = ("end-to-end: decode tok/s and MBU at batch 1…32 and after long prompts, the speculative verify step and "
        "throughput, TTFT, oracle hash, graph checks, ABBA, kernel breakdown, the fused paths timed on and off")



def add_arguments(p):
    add_preset(p, "flash", help="architecture of the generated model")
    p.add_argument("--layers", type=int, default=0,
                   help="keep the first N main layers (real layer-kind pattern, MTP kept); 0 = all")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated weights")
    p.add_argument("--nproc", type=int, default=1, help="ranks (processes) on this host")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks (default: nproc / ep)")
    p.add_argument("--ep", type=int, default=1)
    add_backend(p, "triton")
    p.add_argument("--collective", default="auto", help="all-reduce strategy: library, peer_read or auto")
    p.add_argument("--batches", default="1,2,4,8,16,32")
    p.add_argument("--breakdown-batches", default=None,
                   help="batches whose step is profiled too, beside batch 1's (comma-separated; '' to skip; each "
                        "within --batches' largest; default 8 where --batches reaches it)")
    p.add_argument("--fusion-batches", default=None,
                   help="batches at which the decode step is timed with each fused path off, alone on and all on "
                        "(A-B-B-A against off; launches and token ids compared; the recommended decode.fusion "
                        "entries in the JSON's 'fusions'); comma-separated, '' to skip; default 1,8 where --batches "
                        "reaches them on a GPU run of one rank with the Triton backend (--smoke: only when given)")
    p.add_argument("--fusions", default=None,
                   help="the fused paths timed alone at --fusion-batches (comma-separated names of "
                        "dsv4lab/engine/kernel_families.py's FUSIONS; default every one; off and all on are always "
                        "timed; a path not timed is never recommended)")
    add_tuned_arguments(p, "merge the recommended decode.fusion entries into this tuned file (over --tuned-base); "
                           "a GPU run only; default: no tuned file written", ops=False)
    p.add_argument("--draft-tokens", default="1,2,3",
                   help="draft counts k of the verify and speculative rows (comma-separated; '' to skip them)")
    p.add_argument("--alphas", default="0.5,0.7,0.8,0.9",
                   help="injected acceptance probabilities of the speculative rows (comma-separated)")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="measured rounds (one more is run first and dropped)")
    p.add_argument("--contexts", default="512,4096,16384,65536",
                   help="prompt lengths before batch-1 decode rows ('' to skip)")
    p.add_argument("--context-tokens", type=int, default=32, help="decode steps timed after each context prompt")
    p.add_argument("--context-chunk", type=int, default=8192, help="prefill chunk of the context prompts")
    p.add_argument("--prompt-tokens", type=int, default=4604)
    p.add_argument("--chunks", default="2048,4096", help="prefill chunk sizes to measure (comma-separated)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="warm up right after load: every prefill bucket and decode tier compiled and captured "
                        "(--no-warmup: the first prompts below measure a cold start)")
    p.add_argument("--first-prompts", default="1,100,1000,4604,8192",
                   help="prompt lengths whose first TTFT is measured against their warm TTFT ('' to skip)")
    p.add_argument("--abba", default="library,peer_read", help="two all-reduce strategies for the ABBA run "
                   "('' to skip)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="skip the parts that would start after this many seconds (recorded as skipped)")
    p.add_argument("--overrun-s", type=float, default=30.0,
                   help="one rank: stop a part still running this many seconds past --budget-s (recorded as failed, "
                        "'timed out'), so the JSON is written (default 30)")
    p.add_argument("--no-pdl", action="store_true", help="launch the decode kernels without programmatic dependent "
                   "launch, which is on by default on Hopper or later (sets DSV4LAB_PDL=0 in every rank — "
                   "kernels/dsv4lab_kernels/launch.py)")
    p.add_argument("--smoke", action="store_true", help="tiny preset on the CPU, a few tokens: checks the script")
    p.add_argument("--out", default=None, help="JSON path (default runs/bench/e2e.json)")
    p.add_argument("--force", action="store_true", help="replace an existing committed file (under data/ or the "
                   "tuned tables) named by --out")
    p.add_argument("--commit", default=None, help="commit to record (default: git describe of this tree)")


DEFAULT_BREAKDOWN_BATCHES = (8,)


def _breakdown_batches(args) -> list[int]:
    """``--breakdown-batches``: the batches given ('' none), else batch 8 where ``--batches`` reaches it."""
    if args.breakdown_batches is None:
        most = max(positive_ints(args.batches, "--batches"))
        return [b for b in DEFAULT_BREAKDOWN_BATCHES if b <= most]
    return positive_ints(args.breakdown_batches, "--breakdown-batches") if args.breakdown_batches.strip() else []


def options(args) -> dict:
    """The run's settings as plain data (what every rank receives)."""
    tp = args.tp if args.tp is not None else max(1, args.nproc // max(args.ep, 1))
    o = dict(preset=args.preset, layers=args.layers, seed=args.seed, nproc=args.nproc, tp=tp, ep=args.ep,
             backend=args.backend, collective=args.collective, batches=positive_ints(args.batches, "--batches"),
             breakdown_batches=_breakdown_batches(args),
             decode_tokens=args.decode_tokens, rounds=args.rounds,
             contexts=positive_ints(args.contexts, "--contexts") if args.contexts.strip() else [],
             context_tokens=args.context_tokens, context_chunk=args.context_chunk,
             prompt_tokens=args.prompt_tokens, chunks=positive_ints(args.chunks, "--chunks"),
             abba=[s for s in args.abba.split(",") if s], budget_s=args.budget_s, overrun_s=args.overrun_s,
             smoke=args.smoke,
             draft_tokens=positive_ints(args.draft_tokens, "--draft-tokens") if args.draft_tokens.strip() else [],
             alphas=_alphas(args.alphas), warmup=args.warmup,
             first_prompts=positive_ints(args.first_prompts, "--first-prompts") if args.first_prompts.strip() else [],
             commit=args.commit, pdl=not getattr(args, "no_pdl", False) and os.environ.get(PDL_ENV) != "0",
             out=args.out or "runs/bench/e2e.json")
    if args.smoke:
        o.update(preset="tiny", layers=0, decode_tokens=min(o["decode_tokens"], 4), rounds=1, prompt_tokens=40,
                 chunks=[16, 40], batches=[b for b in o["batches"] if b <= 2] or [1], breakdown_batches=[],
                 alphas=o["alphas"][:2], draft_tokens=o["draft_tokens"][:2],
                 contexts=[24, 48] if o["contexts"] else [], context_tokens=2, context_chunk=32,
                 first_prompts=[1, 17] if o["first_prompts"] else [])
        if not torch.cuda.is_available():
            o["backend"] = "reference"  # the Triton backend on a CPU is the interpreter: minutes per token
            if o["abba"]:
                o["abba"] = ["library", "library"]  # peer-read needs GPUs; the ABBA code path still runs
    if o["nproc"] < 1 or o["nproc"] % o["tp"] or o["nproc"] % o["ep"]:
        raise UserError(f"--nproc {o['nproc']}: --tp {o['tp']} and --ep {o['ep']} must both divide it")
    if o["decode_tokens"] < 2 or o["rounds"] < 1 or o["context_tokens"] < 1:
        raise UserError("--decode-tokens must be >= 2, --rounds and --context-tokens >= 1")
    if o["layers"] < 0:
        raise UserError(f"--layers {o['layers']}: expected 0 (all layers) or a positive count")
    if o["abba"] and len(o["abba"]) != 2:
        raise UserError(f"--abba {args.abba!r}: expected two strategies, e.g. library,peer_read")
    o["fusion_batches"] = fusion_batches(getattr(args, "fusion_batches", None), o)
    o["fusions"] = fusion_names(getattr(args, "fusions", None))
    o["fusion_tokens"] = 1 if o["smoke"] else o["decode_tokens"]  # the interpreter: seconds per step
    if o["breakdown_batches"] and max(o["breakdown_batches"]) > max(o["batches"]):
        raise UserError(f"--breakdown-batches {args.breakdown_batches!r}: each must be at most the largest of "
                        f"--batches ({max(o['batches'])})")
    return o


def _alphas(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or not all(0.0 <= x <= 1.0 for x in out):
        raise UserError(f"--alphas {text!r}: expected comma-separated probabilities in [0, 1], e.g. 0.5,0.8")
    return out


def _pdl_active(device) -> bool:
    """Whether the decode kernels launch with PDL here: ``kernels/dsv4lab_kernels/launch.py``'s rule (a GPU run has the kernels)."""
    return device.type == "cuda" and kernel_module("launch").pdl_enabled(device)


def cut_layers(args, layers: int):
    """``args`` with only its first ``layers`` main layers: their compression ratios (the real SWA/CSA/HCA pattern),
    the MTP blocks' ratios, hash routing for the first ones; every width unchanged. ``0`` keeps all."""
    if not layers or layers == args.n_layers:
        return args
    if layers > args.n_layers:
        raise UserError(f"--layers {layers}: the {args.n_layers}-layer model has no more")
    ratios = args.compress_ratios[:layers] + args.compress_ratios[args.n_layers:]
    return args.replace(n_layers=layers, compress_ratios=ratios, n_hash_layers=min(args.n_hash_layers, layers))


def run(args) -> int:

    o = options(args)
    if not o["smoke"] and not torch.cuda.is_available():
        raise UserError("bench e2e measures GPUs (use --smoke to check the script on a CPU)")
    if not o["smoke"] and torch.cuda.device_count() < o["nproc"]:
        raise UserError(f"--nproc {o['nproc']} but {torch.cuda.device_count()} GPU(s) are visible")
    if o["fusion_batches"] and not torch.cuda.is_available():  # --smoke's fused paths run in the interpreter:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # set before anything imports triton (identity() does)
    out = Path(o["out"])
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not o["smoke"] else None
    tuned = TunedWriter(args, out, gpu, enabled=bool(getattr(args, "tuned_out", None)))  # a base: read, checked now
    doc = run_parallel(worker, o["nproc"], o)[0] if o["nproc"] > 1 else worker(0, 1, o)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, doc)
    print(format_summary(doc))
    for line in format_first_prompts(doc):
        print(line)
    print(f"wrote {out}")
    if getattr(args, "tuned_out", None):
        written = tuned.write(*tuned_ops(doc)) if tuned.enabled and (doc.get("fusions") or {}).get("rows") else None
        print(f"wrote {written} (decode.fusion: {doc['fusions']['recommended']})" if written else
              "--tuned-out: nothing written (no fused path timed on a GPU in this run)")
    if doc.get("failed"):
        print(f"FAILED parts: {', '.join(f'{k} ({v})' for k, v in doc['failed'].items())}")
        return 1
    return 0


# ============================================================================================ one rank
class _Clock:
    """Device-synchronised, rank-barriered wall time."""

    def __init__(self, device, world: int):
        self.torch, self.device, self.world = torch, device, world

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
        if self.world > 1:
            dist.barrier()

    def time(self, fn) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0


def worker(rank: int, world: int, o: dict) -> dict | None:

    t_start = time.perf_counter()
    if not o.get("pdl", True):
        os.environ[PDL_ENV] = "0"  # read at every kernel launch (kernels/dsv4lab_kernels/launch.py), graph capture included
    args = cut_layers(get_preset(o["preset"]), o["layers"])
    max_len = max([o["prompt_tokens"], 16 + o["decode_tokens"], 48]
                  + [c + o["context_tokens"] for c in o["contexts"]] + o["first_prompts"]) + 8
    if world > 1:
        _, _, device = init_distributed()
        ck = RandomCheckpoint(args, o["seed"], device, name=o["preset"])
        runner, _ = load_parallel(ck, o["tp"], o["ep"], backend=o["backend"], collective=o["collective"],
                                  device=device, max_batch=max(o["batches"]), verbose=rank == 0, max_seq_len=max_len,
                                  validate=False)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() and not o["smoke"] else "cpu")
        ck = RandomCheckpoint(args, o["seed"], device, name=o["preset"])
        runner = load(ck, device=device, backend=o["backend"], max_batch=max(o["batches"]),
                              max_seq_len=max_len, validate=False)
    ck.close()
    if o["draft_tokens"]:
        check_draft_tokens(runner, o["draft_tokens"])
    clock = _Clock(device, world)
    load_s = time.perf_counter() - t_start
    log(rank, f"model generated and loaded in {load_s:.1f} s ({args.n_layers} layers, max_seq_len {max_len}, "
              f"decode path {runner.decode_path})")
    parts = Parts(rank, t_start, o["budget_s"], world, recover=runner.reset, overrun_s=o.get("overrun_s"))
    copy_gbps = parts.run("copy_bandwidth", lambda: copy_bandwidth(device))
    doc = dict(benchmark="e2e", model=o["preset"], layers=args.n_layers, layer_kinds=_kinds(args), seed=o["seed"],
               ranks=world, tp=o["tp"], ep=o["ep"], backend=o["backend"], collective=o["collective"],
               decode_path=runner.decode_path, prefill_path=runner.prefill_path, load_s=round(load_s, 1),
               copy_bw_gbps=copy_gbps,
               max_seq_len=max_len, smoke=o["smoke"], pdl=_pdl_active(device), **identity(device, o.get("commit")))
    if o["warmup"]:  # first: no part has compiled anything yet
        doc["warmup"] = parts.run("warmup", lambda: warmup_part(runner))
    if o["first_prompts"]:  # before any other part runs a prompt of these lengths
        doc["first_prompt"] = parts.run("first_prompt", lambda: first_prompt_rows(
            runner, clock, o["first_prompts"], o["rounds"], after_warmup=bool(doc.get("warmup"))))
    doc["oracle"] = parts.run("oracle", lambda: oracle(runner))
    doc["oracle_hash"] = (doc["oracle"] or {}).get("hash")
    log(rank, f"oracle hash {doc['oracle_hash']}" + (f" (eager prefill: {doc['oracle']['hash_eager_prefill']})"
                                                     if "hash_eager_prefill" in (doc["oracle"] or {}) else ""))
    if runner.decode_path == "graph":
        doc["graph_check"] = parts.run("graph_check", lambda: graph_check(runner))
    doc["decode"] = []
    for b in o["batches"]:
        row = parts.run(f"decode_b{b}", lambda b=b: decode_row(runner, clock, b, o, copy_gbps))
        if row is not None:
            doc["decode"].append(row)
            log(rank, f"decode b={b}: {row['tok_s']:.1f} tok/s ({row['path']}), MBU {row['mbu']}")
    # the parts in the order a tight budget should keep them: the headline rows first (verify and speculative, the
    # TTFT: seconds each), then the profiles that explain them (the step's breakdowns, the fused paths' A/B, the
    # verify step's and the prefill's profiles: tens of seconds each), the long contexts last (a 65,536-token
    # prefill at full width takes about a minute)
    if world == 1 and o["draft_tokens"]:  # (the multi-token steps are measured on one rank)
        doc["verify"] = parts.run("verify", lambda: verify_rows(runner, o)) or []
        doc["speculative"], doc["speculative_natural"] = parts.run(
            "speculative", lambda: speculative_rows(runner, clock, o, decode_round)) or ([], [])
        if o["smoke"]:
            doc["speculative_natural"] += parts.run("speculative_tiny_py",
                                                    lambda: natural_acceptance(DATA_DIR / "tiny-py", o)) or []
        differ = speculative_mismatches(doc["speculative"] + doc["speculative_natural"])
        if differ:  # greedy speculation is lossless by construction: an output unlike plain greedy's is a failure
            parts.failed["speculative"] = "output differs from plain greedy: " + ", ".join(differ)
            log(rank, f"SPECULATIVE: {parts.failed['speculative']}")
    doc["prefill"] = parts.run("ttft", lambda: prefill_rows(runner, clock, o)) or []
    if doc["prefill"]:
        best = min(doc["prefill"], key=lambda r: r["ttft_s"])
        doc["ttft"] = dict(prompt_tokens=o["prompt_tokens"], ttft_s=best["ttft_s"], chunk=best["chunk"])
        log(rank, f"TTFT {best['ttft_s']:.3f} s for {o['prompt_tokens']} tokens (chunk {best['chunk']})")
    if device.type == "cuda":
        doc["breakdown"] = parts.run("breakdown", lambda: breakdown(runner, o, device))
        doc["breakdown_by_batch"] = {}
        for b in o["breakdown_batches"]:  # where a batch's step spends its time (batch 1 is the breakdown above)
            doc["breakdown_by_batch"][str(b)] = parts.run(f"breakdown_b{b}",
                                                          lambda b=b: breakdown(runner, o, device, b))
    if world == 1 and o["fusion_batches"]:  # the fused paths of the decode step, off / alone / all (one rank)
        fuse = runner if runner.backend == "triton" else parts.run("fusions_model", lambda: smoke_runner(o))
        rows = [parts.run(f"fusions_b{b}", lambda b=b: fusion_rows(fuse, clock, b, o)) for b in
                o["fusion_batches"]] if fuse is not None else []
        if any(rows):
            doc["fusions"] = fusion_section([r for rs in rows if rs for r in rs], doc, o)
            f = doc["fusions"]
            why = [f"token ids differ: {', '.join(f['mismatches'])}"] if f["mismatches"] else []
            why += [f"{name} failed ({err})" for name, err in f["errors"].items()]
            if why:  # the fused paths claim the unfused step's bits and must run: a failure either way
                parts.failed["fusions"] = "; ".join(why)
                log(rank, f"FUSIONS: {parts.failed['fusions']}")
    if world == 1 and o["draft_tokens"] and device.type == "cuda":  # (a profile of GPU kernels)
        doc["verify_profile"] = parts.run("verify_profile", lambda: verify_profile(runner, o)) or {}
    if doc["prefill"]:
        doc["prefill_breakdown"] = parts.run("prefill_breakdown",
                                             lambda: prefill_breakdown(runner, o, doc["ttft"]["chunk"]))
    if world > 1 and o["abba"]:
        doc["abba"] = parts.run("abba", lambda: abba(runner, clock, o, device))
    doc["contexts"] = []
    for n in o["contexts"]:
        row = parts.run(f"context_{n}", lambda n=n: context_row(runner, clock, n, o, copy_gbps))
        if row is not None:
            doc["contexts"].append(row)
            log(rank, f"decode after {n} tokens: {row['tok_s']:.1f} tok/s, prefill {row['prefill_s']:.2f} s, "
                      f"graph = eager step: {row.get('graph_equals_static')}")
    doc["decode_info"] = runner.decode_info()
    doc["targets"] = targets(doc)
    b1 = next((r for r in doc["decode"] if r["batch"] == 1), doc["decode"][0] if doc["decode"] else None)
    ttft = doc.get("ttft", {})
    doc["summary"] = dict(decode_tok_s=b1["tok_s"] if b1 else None, decode_batch=b1["batch"] if b1 else None,
                          mbu=b1["mbu"] if b1 else None, ttft_s=ttft.get("ttft_s"),
                          prefill_input_tok_s=round(o["prompt_tokens"] / ttft["ttft_s"], 1) if ttft else None)
    doc["timing_s"], doc["skipped"], doc["failed"] = parts.timing, parts.skipped, parts.failed
    doc["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    return doc if rank == 0 else None


def check_draft_tokens(runner, ks: list[int]) -> None:
    """``--draft-tokens`` against what the model supports: a one-line error naming the limit."""
    if not len(runner.model.mtp):
        raise UserError("--draft-tokens: this model has no MTP block (n_mtp_layers = 0); pass --draft-tokens ''")
    limit = max_draft_tokens(runner.model)
    if max(ks) > limit:
        raise UserError(f"--draft-tokens {max(ks)}: this model verifies at most {limit} drafts per cycle (its "
                        f"smallest ring cache and the step size the caches were sized for)")


def _kinds(args) -> str:
    return "".join({"swa": "S", "csa": "C", "hca": "H"}[args.layer_kind(i)] for i in range(args.n_layers))


def identity(device, commit: str | None) -> dict:


    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return dict(gpu=gpu, torch=torch.__version__, triton=triton_version, python=platform.python_version(),
                commit=commit or short_commit())


def copy_bandwidth(device) -> float | None:
    """GB/s of a 1 GiB fp32 copy (bytes read + written), median of 10 after a warm-up; None on a CPU."""

    if device.type != "cuda":
        return None
    src = torch.empty(1 << 28, dtype=torch.float32, device=device).uniform_()
    us = median_copy_us(src, torch.empty_like(src))
    return round(2 * src.numel() * 4 / (us * 1e-6) / 1e9, 1)


# ============================================================================================ measurements
def _prompt(args, n: int, seed: int) -> list[int]:
    return fixed_sequence(args, n, seed=seed)


def oracle(runner) -> dict:
    """32 greedy tokens from a fixed 16-token prompt: ids and trajectory hash. Where the prompt runs through the
    captured prefill step, the same tokens with the eager per-op prefill too (``hash_eager_prefill``,
    ``prefill_paths_equal``): whether the oracle hash depends on the prefill path — where the two differ, the stage
    tier (``verify model``) tells which op rounds otherwise."""
    prompt = [runner.args.bos_token_id] + _prompt(runner.args, 15, seed=4604)
    ids = runner.generate(prompt, 32, stop_at_eos=False)
    runner.reset()
    out = dict(prompt_ids=prompt, ids=ids, hash=trajectory_hash(ids), prefill_path=runner.prefill_path)
    if runner.prefill_path != "eager":
        path, runner.prefill_path = runner.prefill_path, "eager"
        try:
            eager_ids = runner.generate(prompt, 32, stop_at_eos=False)
            runner.reset()
        finally:
            runner.prefill_path = path
        out.update(hash_eager_prefill=trajectory_hash(eager_ids), prefill_paths_equal=eager_ids == ids)
    return out


def _teacher_forced(runner, steps, batch: int, prompt, tokens) -> list:
    """Prefill ``prompt`` into slots ``0..batch-1`` and run ``steps`` (a callable per step) on ``tokens``."""
    slots = list(range(batch))
    runner.prefill([prompt] * batch, slots=slots)
    out = []
    for i, t in enumerate(tokens):
        out.append(steps(torch.full((batch,), t), torch.full((batch,), len(prompt) + i), torch.tensor(slots)))
    runner.reset()
    return out


def graph_check(runner) -> dict:
    """Teacher-forced steps through the graphs (batch 1, and batch 3 padded to tier 4) and through the eager static
    step: bitwise equal?"""

    prompt = _prompt(runner.args, 16, seed=3)
    tokens = _prompt(runner.args, 4, seed=9)
    graph = Decoder(runner, graphs=True)
    eager = Decoder(runner, graphs=False)
    out = {}
    for b in (1, 3):
        if b > runner.max_batch:
            continue
        g = _teacher_forced(runner, graph, b, prompt, tokens)
        e = _teacher_forced(runner, eager, b, prompt, tokens)
        out[f"b{b}_bitwise"] = all(torch.equal(x, y) for x, y in zip(g, e))
    out["capture_s"] = {b: round(s, 3) for b, s in graph.graphs.capture_s.items()}
    return out


def decode_round(runner, batch: int, n: int, prompt: list[int]) -> tuple[float, list[int]]:
    """Prefill ``batch`` copies of ``prompt``, then ``n`` greedy steps through ``runner.decode_greedy`` (the engine's
    decode path, what ``generate`` runs: each step's ids read on the host while the next step runs); returns
    (decode seconds, row 0's ids: the prefill's choice and the ``n`` steps')."""
    slots = list(range(batch))
    runner.reset()
    first = runner.prefill([prompt] * batch, slots=slots).argmax(-1).cpu()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    t0 = time.perf_counter()
    rows = runner.decode_greedy(first, n, slots=slots)  # every step's ids come back to the host, as a server's
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - t0, [int(first[0])] + rows[0]


def _mbu(runner, o: dict, batch: int, context: int, tok_s: float, copy_gbps: float | None) -> dict:
    """MBU = tok/s × the weight bytes one step reads per GPU per token (the cost model's count for this model and
    split) ÷ the copy bandwidth of this run; ``mbu_all_bytes`` counts every byte the step moves (KV and index-key
    reads included, which grow with the context)."""
    step = decode_step(runner.args, tp=o["tp"], ep=o["ep"], batch=batch, context=context)
    weights, total = step.weight_bytes_rank / batch, step.bytes_rank / batch
    bw = copy_gbps * 1e9 if copy_gbps else None
    return dict(mbu=round(tok_s * weights / bw, 4) if bw else None,
                mbu_all_bytes=round(tok_s * total / bw, 4) if bw else None,
                weight_bytes_per_token_per_gpu=round(weights), bytes_per_token_per_gpu=round(total),
                weight_bytes_per_step=round(step.weight_bytes_rank), bytes_per_step=round(step.bytes_rank))


def decode_row(runner, clock, batch: int, o: dict, copy_gbps: float | None) -> dict:
    prompt = _prompt(runner.args, 16, seed=batch)
    seconds = []
    for _ in range(o["rounds"] + 1):
        clock.sync()
        s, _ = decode_round(runner, batch, o["decode_tokens"], prompt)
        seconds.append(s)
    runner.reset()
    measured = seconds[1:]  # the first round compiles, captures the tier's graph and warms up
    tok_s = batch * o["decode_tokens"] / statistics.median(measured)
    context = len(prompt) + o["decode_tokens"] // 2
    return dict(batch=batch, tok_s=round(tok_s, 2), **_mbu(runner, o, batch, context, tok_s, copy_gbps),
                path=runner.decode_path, decode_tokens=o["decode_tokens"],
                rounds_tok_s=[round(batch * o["decode_tokens"] / s, 2) for s in measured],
                dropped_round_tok_s=round(batch * o["decode_tokens"] / seconds[0], 2), context=context)


def _slot_state(runner, slot: int) -> list:
    """Copies of every per-sequence buffer of ``slot`` (window ring, compressed caches, compressor rings)."""
    bufs = []
    for blk in runner.model.blocks():
        attn = blk.attn
        comps = [c for c in (attn.compressor, attn.indexer.compressor if attn.indexer else None) if c is not None]
        for t in [attn.win_kv, attn.ckv, attn.ikv] + [r for c in comps for r in (c.kv_ring, c.score_ring)]:
            if t is not None:
                bufs.append((t, t[slot].clone()))
    return bufs


def context_row(runner, clock, n: int, o: dict, copy_gbps: float | None) -> dict:
    """Batch-1 decode after an ``n``-token prompt: prefill time, decode tok/s over ``context_tokens`` steps, and the
    first step through the engine's path against the eager static step (bitwise) and the per-op forward."""

    ids = torch.tensor([_prompt(runner.args, n, seed=n)], device=runner.device)
    chunk = o["context_chunk"]
    runner.reset()

    def prefill():
        last.append(runner.prefill(ids, chunk))
    last: list = []
    prefill_s = clock.time(prefill)
    row = dict(context=n, prefill_s=round(prefill_s, 3), prefill_chunk=chunk, path=runner.decode_path)
    # the first step three ways from one snapshot of the slot's state, the engine's last (the timed steps go on)
    state = _slot_state(runner, 0)
    tok = last[-1].argmax(-1).cpu()
    ways = {}
    for way in ("static", "forward", "reference", "engine"):
        for t, saved in state:
            t[0].copy_(saved)
        runner.positions[0] = n
        if way == "static":
            ways[way] = Decoder(runner, graphs=False)(tok, torch.tensor([n]), torch.tensor([0]))
        elif way in ("forward", "reference"):  # the per-op forward on the backend's ops, then on the reference's
            path, runner.decode_path = runner.decode_path, "eager"
            ops = runner.ops
            if way == "reference":
                runner.ops = ReferenceOps(ops.numerics)
            try:
                ways[way] = runner.forward(tok[:, None], n, slots=[0])[:, 0]
            finally:
                runner.decode_path, runner.ops = path, ops
        else:
            ways[way] = runner.forward(tok[:, None], n, slots=[0])[:, 0]
    e, s, f, r = ways["engine"], ways["static"], ways["forward"], ways["reference"]

    def rel(a, b):
        return float((a - b).norm() / b.norm())
    # on random weights a rounding-only difference can grow through the layers: the per-op forward against the
    # reference (both legitimate) is the scale the engine's distance from either is read against
    row.update(graph_equals_static=bool(torch.equal(e, s)), forward_rel=rel(e, f),
               forward_same_argmax=bool(torch.equal(e.argmax(-1), f.argmax(-1))), reference_rel=rel(e, r),
               forward_vs_reference_rel=rel(f, r), reference_same_argmax=bool(torch.equal(e.argmax(-1),
                                                                                          r.argmax(-1))))
    nxt = e.argmax(-1).cpu()
    clock.sync()
    t0 = time.perf_counter()
    runner.decode_greedy(nxt, o["context_tokens"], slots=[0])  # the engine's decode loop, as decode_round's
    clock.sync()
    dt = time.perf_counter() - t0
    runner.reset()
    tok_s = o["context_tokens"] / dt
    row.update(tok_s=round(tok_s, 2), **_mbu(runner, o, 1, n + o["context_tokens"] // 2, tok_s, copy_gbps),
               decode_tokens=o["context_tokens"], decode_s=round(dt, 3))
    return row


def prefill_rows(runner, clock, o: dict) -> list[dict]:
    """TTFT per chunk size: chunked prefill of the prompt, then the first token's argmax read on the host."""
    ids = torch.tensor([_prompt(runner.args, o["prompt_tokens"], seed=7)], device=runner.device)
    n = ids.shape[1]
    rows = []
    for chunk in o["chunks"]:
        first: list[int] = []

        def once():
            runner.reset()
            first.append(int(runner.prefill(ids, chunk)[0].argmax()))  # the head on the last token only
        times = [clock.time(once) for _ in range(o["rounds"] + 1)][1:]
        rows.append(dict(chunk=chunk, prompt_tokens=n, ttft_s=round(statistics.median(times), 4),
                         rounds_s=[round(t, 4) for t in times], first_token=first[-1]))
    runner.reset()
    return rows


def prefill_breakdown(runner, o: dict, chunk: int) -> dict:
    """One chunked prefill of the TTFT prompt with every backend op timed (:class:`~dsv4lab.tools.bench.common.OpTimer`:
    CUDA events, outermost calls, summed over the layers), the time between the ops (``untimed_us``: torch glue,
    cache writes, host waits), beside the cost model's prediction of the same prefill on the H200 catalogue entry
    (µs per op kind, and its terms). A graph's replay calls no op: on the graph prefill path the same static step
    runs eagerly here (``path``)."""

    ids = torch.tensor([_prompt(runner.args, o["prompt_tokens"], seed=7)], device=runner.device)
    n = ids.shape[1]
    cuda = runner.device.type == "cuda"
    runner.reset()  # the TTFT rounds at this chunk ran just before: compiles and autotuning are done
    path = runner.prefill_path
    if path == "graph":
        runner.prefill_path = "static"
    with OpTimer(runner.ops, OP_NAMES, cuda=cuda) as timer:
        if cuda:
            torch.cuda.synchronize(runner.device)
        t0 = time.perf_counter()
        runner.prefill(ids, chunk)
        if cuda:
            torch.cuda.synchronize(runner.device)
        wall_us = (time.perf_counter() - t0) * 1e6
        ops_us = timer.totals_us()
    runner.prefill_path = path
    runner.reset()
    pred = _predicted(prefill_cost(runner.args, tokens=n, chunk=chunk, tp=o["tp"], ep=o["ep"]))
    return dict(chunk=chunk, prompt_tokens=n, path="static" if path == "graph" else path,
                measured_total_us=round(wall_us, 1),
                measured_op_us={k: round(v, 1) for k, v in sorted(ops_us.items(), key=lambda kv: -kv[1])},
                untimed_us=round(wall_us - sum(ops_us.values()), 1), predicted_us_by_kind=pred["by_kind"],
                predicted_total_us=pred["total"], predicted_terms_us=pred["terms"])


def _predicted(step) -> dict:
    """The cost model's time of ``step`` on the H200 catalogue entry: µs by op kind, in total and by term."""
    st = time_step(step, load_hardware("h200-sxm"))
    by_kind: dict[str, float] = {}
    for op in st.ops:
        by_kind[op.kind] = by_kind.get(op.kind, 0.0) + op.total_us
    by_kind["collective"] = sum(c.total_us for c in st.collectives)
    return dict(by_kind={k: round(v, 1) for k, v in by_kind.items()}, total=round(st.step_us, 1),
                terms={k: round(v, 1) for k, v in st.terms_us().items()})


def abba(runner, clock, o: dict, device) -> dict:
    """Batch-1 decode rounds in the order A B B A for two all-reduce strategies: the switch's effect with drift
    cancelled. Every rank swaps its strategy together (the reducers are collective to create); each strategy has its
    own decode path (a captured graph holds the reducer it was captured with)."""
    plan = runner.plan
    reducers = {s: make_site_reducer(plan.layout, device, s) for s in o["abba"]}
    original = runner._all_reduce
    prompt = _prompt(runner.args, 16, seed=1)
    times: dict[str, list[float]] = {s: [] for s in o["abba"]}
    a, b = o["abba"]
    decoders = {}
    try:
        for s in (a, b):
            runner._all_reduce = reducers[s]
            runner.drop_decoders()  # a fresh decoder (and graphs) under this strategy
            decode_round(runner, 1, 2, prompt)  # builds and captures it
            decoders[s] = runner.decoder
        for s in (a, b, b, a) * max(1, o["rounds"] // 2):
            runner._all_reduce = reducers[s]
            if decoders[s] is not None:
                runner.decoder = decoders[s]
            clock.sync()
            times[s].append(decode_round(runner, 1, o["decode_tokens"], prompt)[0])
    finally:
        runner._all_reduce = original
        runner.drop_decoders()
        runner.reset()
    tok = {s: [o["decode_tokens"] / t for t in ts] for s, ts in times.items()}
    return dict(order=f"{a} {b} {b} {a}", tok_s={s: round(statistics.median(v), 2) for s, v in tok.items()},
                rounds_tok_s={s: [round(x, 2) for x in v] for s, v in tok.items()},
                speedup=round(statistics.median(tok[b]) / statistics.median(tok[a]), 4))


def breakdown(runner, o: dict, device, batch: int = 1) -> dict:
    """The decode step of ``batch`` sequences as the engine runs it — one graph replay of its tier (or one eager
    step when the engine does not use graphs) under the profiler: GPU µs and kernel launches by family and per
    kernel (:func:`top_kernels`), launches per layer; beside the roofline model's prediction of the same step (µs by
    op kind) on the H200 catalogue entry."""

    prompt = _prompt(runner.args, 16, seed=2)
    slots = torch.arange(batch)
    nxt = runner.prefill([prompt] * batch, slots=slots.tolist()).argmax(-1).cpu()
    pos = torch.full((batch,), len(prompt))
    graphs = runner.decoder.graphs if runner.decoder is not None else None
    if graphs is not None:
        runner.decoder(nxt, pos, slots)  # captures the tier on first use; its inputs now hold these rows
        step = graphs.graphs[graphs.tier(batch)][0].replay  # the same step again: its state rewritten
    else:
        step = lambda: runner.forward(nxt[:, None], pos, slots=slots)  # noqa: E731 — eager: one step only
    reps = 3 if graphs is not None else 1
    pdl = _pdl_active(device)
    step()
    replay_us = clock_us(step, device, reps) if graphs is not None else None
    replay_no_pdl_us = replay_us
    plain = None
    if pdl and graphs is not None:  # the per-kernel profile from the same step captured without PDL (pdl_off), by
        # a decoder of its own (as graph_check does: a graph is never re-captured into the engine's pool), replaying
        # the same last step
        with pdl_off():
            plain = Decoder(runner, graphs=True)
            plain(nxt, pos, slots)
            step = plain.graphs.graphs[plain.graphs.tier(batch)][0].replay
            step()
            replay_no_pdl_us = clock_us(step, device, reps)
    prof, _ = profiled(step, device, reps)
    profiled_without_pdl = not pdl or plain is not None
    del plain, step
    runner.reset()
    measured, launches = kernel_profile(prof, reps)
    total_launches = sum(launches.values())
    pred = _predicted(decode_step(runner.args, tp=o["tp"], ep=o["ep"], batch=batch, context=len(prompt)))
    return dict(batch=batch, source="graph replay" if graphs is not None else "eager step",
                profiled_without_pdl=profiled_without_pdl, replay_us=replay_us, replay_without_pdl_us=replay_no_pdl_us, pdl=pdl,
                measured_gpu_us=measured, measured_total_us=round(sum(measured.values()), 1),
                kernel_launches=launches, kernels=top_kernels(prof, reps), launches_per_step=round(total_launches, 1),
                launches_per_layer=round(total_launches / runner.args.n_layers, 1),
                predicted_us_by_kind=pred["by_kind"], predicted_step_us=pred["total"], predicted_terms_us=pred["terms"])
