"""``dsv4lab bench e2e`` — the whole model, end to end: a full-dims random DeepSeek-V4-Flash generated on the GPUs
(:class:`~dsv4lab.random_checkpoint.RandomCheckpoint`: native FP4/FP8 formats, no 160 GB file), split over
``--nproc`` ranks (``--tp``/``--ep``), measured as a user would see it.

* **decode**: for each batch size, ``--decode-tokens`` greedy steps after a short prompt, timed per round
  (device synchronised, ranks barriered); ``--rounds`` rounds after one dropped warm-up round, median reported.
  On GPUs every rank replays CUDA graphs of the static decode step
  (:class:`~dsv4lab.engine.decode_graph.GraphDecoder`, its all-reduces captured with it); on a CPU the step runs
  eagerly through ``runner.forward``; the row says which.
  **MBU** = tok/s × bytes one decode step moves per GPU per token (the cost model, :mod:`dsv4lab.perf.costmodel`,
  at the round's mean context) ÷ the copy bandwidth measured in the same run.
* **TTFT**: a ``--prompt-tokens`` prompt prefilled in chunks of each ``--chunks`` size until the first token;
  the fastest chunk is reported with every chunk's time.
* **oracle**: the trajectory hash of 32 greedy tokens from a fixed prompt (identical for every split of the same
  seed on the same device type: a correctness gate on the measured configuration).
* **ABBA** (more than one rank): batch-1 decode rounds alternating two all-reduce strategies A B B A.
* **breakdown** (CUDA): one eager decode step under the profiler, GPU time by kernel family, beside the
  roofline model's prediction for the same step on the H200 catalogue entry.

``--smoke`` runs the same code on the tiny preset on a CPU (gloo between ranks) in seconds.
"""
from __future__ import annotations

import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from ..config import get_preset
from ..engine.decode_graph import GraphDecoder
from ..engine.loader import load
from ..errors import UserError
from ..options import add_backend, add_preset
from ..parallel import init_distributed, load_parallel, make_site_reducer, run_parallel
from ..perf.costmodel import decode_step
from ..perf.hardware import load_hardware
from ..perf.roofline import time_step
from ..provenance import short_commit
from ..random_checkpoint import RandomCheckpoint
from ..verify.model import fixed_sequence, trajectory_hash
from .common import kernel_families, median_copy_us, write_json
from .engine import _ints

HELP = "end-to-end: decode tok/s and MBU at batch 1/2/4/8, TTFT of a 4,604-token prompt, oracle hash, ABBA, breakdown"


def add_arguments(p):
    add_preset(p, "flash", help="architecture of the generated model")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated weights")
    p.add_argument("--nproc", type=int, default=2, help="ranks (processes) on this host")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--ep", type=int, default=1)
    add_backend(p, "triton")
    p.add_argument("--collective", default="auto", help="all-reduce strategy: library, peer_read or auto")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3, help="measured rounds (one more is run first and dropped)")
    p.add_argument("--prompt-tokens", type=int, default=4604)
    p.add_argument("--chunks", default="2048,4096", help="prefill chunk sizes to measure (comma-separated)")
    p.add_argument("--abba", default="library,peer_read", help="two all-reduce strategies for the ABBA run "
                   "('' to skip)")
    p.add_argument("--smoke", action="store_true", help="tiny preset on the CPU, a few tokens: checks the script")
    p.add_argument("--out", default=None, help="JSON path (default runs/bench/e2e.json)")
    p.add_argument("--commit", default=None, help="commit to record (default: git describe of this tree)")


def options(args) -> dict:
    """The run's settings as plain data (what every rank receives)."""
    o = dict(preset=args.preset, seed=args.seed, nproc=args.nproc, tp=args.tp, ep=args.ep, backend=args.backend,
             collective=args.collective, batches=_ints(args.batches, "--batches"), decode_tokens=args.decode_tokens,
             rounds=args.rounds, prompt_tokens=args.prompt_tokens, chunks=_ints(args.chunks, "--chunks"),
             abba=[s for s in args.abba.split(",") if s], smoke=args.smoke, commit=args.commit)
    if args.smoke:
        o.update(preset="tiny", decode_tokens=min(o["decode_tokens"], 4), rounds=1, prompt_tokens=40,
                 chunks=[16, 40], batches=[b for b in o["batches"] if b <= 2] or [1])
        if not torch.cuda.is_available():
            o["backend"] = "reference"  # the Triton backend on a CPU is the interpreter: minutes per token
            if o["abba"]:
                o["abba"] = ["library", "library"]  # peer-read needs GPUs; the ABBA code path still runs
    if o["nproc"] < 1 or o["nproc"] % o["tp"] or o["nproc"] % o["ep"]:
        raise UserError(f"--nproc {o['nproc']}: --tp {o['tp']} and --ep {o['ep']} must both divide it")
    if o["decode_tokens"] < 2 or o["rounds"] < 1:
        raise UserError("--decode-tokens must be >= 2 and --rounds >= 1")
    if o["abba"] and len(o["abba"]) != 2:
        raise UserError(f"--abba {args.abba!r}: expected two strategies, e.g. library,peer_read")
    return o


def run(args) -> int:
    o = options(args)
    if not o["smoke"] and not torch.cuda.is_available():
        raise UserError("bench e2e measures GPUs (use --smoke to check the script on a CPU)")
    if not o["smoke"] and torch.cuda.device_count() < o["nproc"]:
        raise UserError(f"--nproc {o['nproc']} but {torch.cuda.device_count()} GPU(s) are visible")
    doc = run_parallel(worker, o["nproc"], o)[0] if o["nproc"] > 1 else worker(0, 1, o)
    out = Path(args.out or "runs/bench/e2e.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, doc)
    print(format_summary(doc))
    print(f"wrote {out}")
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


def log(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[bench e2e] {msg}", file=sys.stderr, flush=True)


def worker(rank: int, world: int, o: dict) -> dict | None:
    t_start = time.perf_counter()
    args = get_preset(o["preset"])
    max_len = max(o["prompt_tokens"], 16 + o["decode_tokens"], 48) + 8
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
    clock = _Clock(device, world)
    load_s = time.perf_counter() - t_start
    log(rank, f"model generated and loaded in {load_s:.1f} s")
    copy_gbps = copy_bandwidth(device)
    doc = dict(benchmark="e2e", model=o["preset"], seed=o["seed"], ranks=world, tp=o["tp"], ep=o["ep"],
               backend=o["backend"], collective=o["collective"], load_s=round(load_s, 1), copy_bw_gbps=copy_gbps,
               smoke=o["smoke"], **identity(device, o.get("commit")))
    doc["oracle"] = oracle(runner)
    doc["oracle_hash"] = doc["oracle"]["hash"]
    log(rank, f"oracle hash {doc['oracle']['hash']}")
    doc["decode"] = [decode_row(runner, clock, b, o, copy_gbps) for b in o["batches"]]
    for r in doc["decode"]:
        log(rank, f"decode b={r['batch']}: {r['tok_s']:.1f} tok/s ({r['path']}), MBU {r['mbu']}")
    doc["prefill"] = prefill_rows(runner, clock, o)
    best = min(doc["prefill"], key=lambda r: r["ttft_s"])
    doc["ttft"] = dict(prompt_tokens=o["prompt_tokens"], ttft_s=best["ttft_s"], chunk=best["chunk"])
    log(rank, f"TTFT {best['ttft_s']:.3f} s for {o['prompt_tokens']} tokens (chunk {best['chunk']})")
    if world > 1 and o["abba"]:
        doc["abba"] = abba(runner, clock, o, device)
    if device.type == "cuda":
        doc["breakdown"] = breakdown(runner, o, device)
    doc["targets"] = targets(doc)
    b1 = next((r for r in doc["decode"] if r["batch"] == 1), doc["decode"][0])
    doc["summary"] = dict(decode_tok_s=b1["tok_s"], decode_batch=b1["batch"], mbu=b1["mbu"], ttft_s=best["ttft_s"],
                          prefill_input_tok_s=round(o["prompt_tokens"] / best["ttft_s"], 1))  # what figures read
    doc["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    return doc if rank == 0 else None


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
    """32 greedy tokens from a fixed 16-token prompt: ids and trajectory hash."""
    prompt = [runner.args.bos_token_id] + _prompt(runner.args, 15, seed=4604)
    ids = runner.generate(prompt, 32, stop_at_eos=False)
    runner.reset()
    return dict(prompt_ids=prompt, ids=ids, hash=trajectory_hash(ids))


def _decoder(runner, batch: int):
    """Graph replay on a GPU (every rank captures the same step, collectives included); eager ``runner.forward``
    steps otherwise. Returns the step and the path's name."""
    if runner.device.type == "cuda":
        return GraphDecoder(runner, graphs=True, tiers=(batch,)), "graph"

    def step(tokens, slots):
        pos = runner.positions[torch.as_tensor(slots)].tolist()
        assert len(set(pos)) == 1, "eager decode rows advance together"
        return runner.forward(torch.as_tensor(tokens, device=runner.device)[:, None], pos[0],
                              slots=list(slots))[:, -1]
    return step, "eager"


def decode_round(runner, decode, batch: int, n: int, prompt: list[int]) -> tuple[float, list[int]]:
    """Prefill ``batch`` copies of ``prompt``, then ``n`` greedy steps; returns (decode seconds, row 0's ids)."""
    slots = list(range(batch))
    runner.reset()
    logits = runner.forward(torch.tensor([prompt] * batch, device=runner.device), 0, slots=slots)[:, -1]
    nxt = logits.argmax(-1)
    ids = []
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    t0 = time.perf_counter()
    for _ in range(n):
        ids.append(int(nxt[0]))  # one host read per step: what a server does to stream tokens
        nxt = decode(nxt, slots).argmax(-1)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - t0, ids


def decode_row(runner, clock, batch: int, o: dict, copy_gbps: float | None) -> dict:
    prompt = _prompt(runner.args, 16, seed=batch)
    decode, path = _decoder(runner, batch)
    seconds = []
    for _ in range(o["rounds"] + 1):
        clock.sync()
        s, _ = decode_round(runner, decode, batch, o["decode_tokens"], prompt)
        seconds.append(s)
    runner.reset()
    measured = seconds[1:]  # the first round compiles and warms up
    tok_s = batch * o["decode_tokens"] / statistics.median(measured)
    context = len(prompt) + o["decode_tokens"] // 2
    step = decode_step(runner.args, tp=o["tp"], ep=o["ep"], batch=batch, context=context)
    bytes_per_token = step.bytes_rank / batch
    mbu = round(tok_s * bytes_per_token / (copy_gbps * 1e9), 4) if copy_gbps else None
    return dict(batch=batch, tok_s=round(tok_s, 2), mbu=mbu, path=path, decode_tokens=o["decode_tokens"],
                rounds_tok_s=[round(batch * o["decode_tokens"] / s, 2) for s in measured],
                dropped_round_tok_s=round(batch * o["decode_tokens"] / seconds[0], 2),
                bytes_per_token_per_gpu=round(bytes_per_token), context=context)


def prefill_rows(runner, clock, o: dict) -> list[dict]:
    """TTFT per chunk size: chunked prefill of the prompt, then the first token's argmax read on the host."""
    ids = torch.tensor([_prompt(runner.args, o["prompt_tokens"], seed=7)], device=runner.device)
    n = ids.shape[1]
    rows = []
    for chunk in o["chunks"]:
        first: list[int] = []

        def once():
            runner.reset()
            for p in range(0, n, chunk):
                logits = runner.forward(ids[:, p:p + chunk], p)
            first.append(int(logits[0, -1].argmax()))
        times = [clock.time(once) for _ in range(o["rounds"] + 1)][1:]
        rows.append(dict(chunk=chunk, prompt_tokens=n, ttft_s=round(statistics.median(times), 4),
                         rounds_s=[round(t, 4) for t in times], first_token=first[-1]))
    runner.reset()
    return rows


def abba(runner, clock, o: dict, device) -> dict:
    """Batch-1 decode rounds in the order A B B A for two all-reduce strategies: the switch's effect with drift
    cancelled. Every rank swaps its strategy together (the reducers are collective to create)."""
    plan = runner.plan
    reducers = {s: make_site_reducer(plan.layout, device, s) for s in o["abba"]}
    original = runner._all_reduce
    prompt = _prompt(runner.args, 16, seed=1)
    times: dict[str, list[float]] = {s: [] for s in o["abba"]}
    a, b = o["abba"]
    try:
        decoders = {}
        for s in (a, b):  # a captured graph holds the reducer it was captured with: one decoder per strategy
            runner._all_reduce = reducers[s]
            decoders[s] = _decoder(runner, 1)[0]
        for s in (a, b, b, a) * max(1, o["rounds"] // 2):
            runner._all_reduce = reducers[s]
            clock.sync()
            times[s].append(decode_round(runner, decoders[s], 1, o["decode_tokens"], prompt)[0])
    finally:
        runner._all_reduce = original
        runner.reset()
    tok = {s: [o["decode_tokens"] / t for t in ts] for s, ts in times.items()}
    return dict(order=f"{a} {b} {b} {a}", tok_s={s: round(statistics.median(v), 2) for s, v in tok.items()},
                rounds_tok_s={s: [round(x, 2) for x in v] for s, v in tok.items()},
                speedup=round(statistics.median(tok[b]) / statistics.median(tok[a]), 4))


def breakdown(runner, o: dict, device) -> dict:
    """One eager batch-1 decode step under the profiler (GPU µs by kernel family) and the roofline model's
    prediction of the same step (µs by op kind) on the H200 catalogue entry."""
    prompt = _prompt(runner.args, 16, seed=2)
    runner.reset()
    nxt = runner.forward(torch.tensor([prompt], device=device), 0)[:, -1].argmax(-1)
    step = lambda: runner.forward(nxt[:, None], len(prompt))  # noqa: E731
    step()
    runner.reset()
    runner.forward(torch.tensor([prompt], device=device), 0)
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    runner.reset()
    measured = kernel_families(prof, 1)
    st = time_step(decode_step(runner.args, tp=o["tp"], ep=o["ep"], batch=1, context=len(prompt)),
                   load_hardware("h200-sxm"))
    by_kind: dict[str, float] = {}
    for op in st.ops:
        by_kind[op.kind] = by_kind.get(op.kind, 0.0) + op.total_us
    by_kind["collective"] = sum(c.total_us for c in st.collectives)
    return dict(measured_gpu_us=measured, measured_total_us=round(sum(measured.values()), 1),
                predicted_us_by_kind={k: round(v, 1) for k, v in by_kind.items()},
                predicted_step_us=round(st.step_us, 1), predicted_terms_us={k: round(v, 1) for k, v in
                                                                           st.terms_us().items()})


def targets(doc: dict) -> dict:
    """The issue's two targets, as measured (None where this run cannot say)."""
    b1 = next((r for r in doc["decode"] if r["batch"] == 1), None)
    mbu = b1["mbu"] if b1 else None
    ttft = doc["ttft"]["ttft_s"] if doc["ttft"]["prompt_tokens"] == 4604 else None
    return dict(batch1_mbu=dict(value=mbu, target=0.40, met=None if mbu is None else mbu >= 0.40),
                ttft_4604=dict(value=ttft, target=0.4, met=None if ttft is None else ttft <= 0.4))


def format_summary(doc: dict) -> str:
    lines = [f"{doc['model']} seed {doc['seed']} on {doc['ranks']} × {doc['gpu']} (tp {doc['tp']}, ep {doc['ep']}, "
             f"{doc['backend']}), oracle hash {doc['oracle']['hash']}",
             f"{'batch':>6} {'tok/s':>10} {'MBU':>7}  path"]
    for r in doc["decode"]:
        mbu = "-" if r["mbu"] is None else f"{100 * r['mbu']:.1f}%"
        lines.append(f"{r['batch']:>6} {r['tok_s']:>10.2f} {mbu:>7}  {r['path']}")
    t = doc["ttft"]
    lines.append(f"TTFT {t['ttft_s']:.3f} s for {t['prompt_tokens']} tokens (chunk {t['chunk']}; "
                 + ", ".join(f"{r['chunk']}: {r['ttft_s']:.3f} s" for r in doc["prefill"]) + ")")
    if "abba" in doc:
        a = doc["abba"]
        lines.append(f"ABBA ({a['order']}): " + ", ".join(f"{s} {v} tok/s" for s, v in a["tok_s"].items())
                     + f"; speedup {a['speedup']}")
    return "\n".join(lines)
