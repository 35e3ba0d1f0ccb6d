"""Measure self-speculative decoding with the MTP block (issue 23).

CPU, data/tiny-py → data/results/host/speculative.json (acceptance rate, tok/s with and without speculation):

    OMP_NUM_THREADS=1 python scripts/measure_speculative.py [--tokens 64] [--repeats 3]

Greedy generation of ``--tokens`` new tokens (EOS ignored) after each of the checkpoint's oracle prompts, plain and
with ``--draft-tokens`` 1, 2, 3, interleaved within each repeat so all configurations share the machine's load;
the medians of the repeats are reported, with ratios from this one run. Every speculative output is checked equal
to the plain one (lossless). Times include each prompt's prefill (≤ 7 tokens). Both wall time and the process's
CPU time are recorded: on a shared machine the one-thread CPU time is the steadier measure, and the headline
``tok_s`` / ``speedup`` use it (``wall_tok_s`` / ``wall_speedup`` beside them).

GPU, the cost of a verify step → data/results/h200/speculative_steps.json (about 1–2 minutes on one H200):

    python scripts/measure_speculative.py --gpu-step-cost [--layers 30] [--out FILE]

A full-width DeepSeek-V4-Flash cut to ``--layers`` main layers (plus the MTP block) is generated on the GPU with
random weights (:class:`~dsv4lab.core.random_checkpoint.RandomCheckpoint`) and loaded with the Triton backend. At batch
1 after a 32-token prompt it times, eagerly through ``runner.forward``: the plain 1-token step, the ``(k+1)``-token
verify step with the MTP block (``mtp=True``) for k = 1, 2, 3, and the 1-token MTP-only step (a chained draft or the
re-run after a rejection); and the 1-token step replayed from a CUDA graph (``Decoder``). Weights are random,
so it reports step costs and the **break-even acceptance rate** α* of each k — where the modelled speed-up
``E(α)·C_1 / C_cycle(α)`` is 1, with ``E = (1 − α^{k+1})/(1 − α)`` tokens per cycle (each draft accepted with
probability α) and ``C_cycle = C_verify(k) + (k − 1)·C_mtp + (1 − α^k)·C_mtp`` — not a speed-up. ``--smoke`` runs the
same code on the tiny preset on the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

import dsv4lab
from dsv4lab.core.config import get_preset
from dsv4lab.engine.speculative import generate_speculative
from dsv4lab.core.provenance import short_commit
from dsv4lab.core.random_checkpoint import RandomCheckpoint

ROOT = Path(__file__).resolve().parents[1]
DRAFTS = (1, 2, 3)


def commit() -> str:
    # the package's provenance: honours DSV4LAB_COMMIT on a GPU machine's copy, whose git history is not this tree's
    # (a plain `git rev-parse` there once recorded an older commit than the one that ran)
    return short_commit() or "unknown"


# ============================================================================================ CPU: tiny-py
def measure_cpu(tokens: int, repeats: int) -> dict:
    m = dsv4lab.load(ROOT / "data" / "tiny-py", max_batch=1)
    oracles = json.loads((ROOT / "data" / "tiny-py" / "oracles.json").read_text())["oracles"]
    prompts = [o["prompt_ids"] for o in oracles]
    m.generate(prompts[0], 4)  # warm-up
    configs = [0, *DRAFTS]
    seconds = {k: [] for k in configs}
    cpu_seconds = {k: [] for k in configs}
    stats, lossless = {}, {k: True for k in DRAFTS}
    plain_ids = [m.generate(p, tokens, stop_at_eos=False) for p in prompts]
    for _ in range(repeats):
        for k in configs:
            t0, c0 = time.perf_counter(), time.process_time()
            if k == 0:
                for p in prompts:
                    m.generate(p, tokens, stop_at_eos=False)
            else:
                agg = dict(drafted=0, accepted=0, emitted=0, cycles=0)
                for p, want in zip(prompts, plain_ids):
                    (out,), st = generate_speculative(m, [p], tokens, k, stop_at_eos=False)
                    lossless[k] &= out == want
                    for f in agg:
                        agg[f] += getattr(st, f)
                stats[k] = agg
            seconds[k].append(time.perf_counter() - t0)
            cpu_seconds[k].append(time.process_time() - c0)
    n = tokens * len(prompts)

    def timing(k):
        return dict(tok_s=round(n / statistics.median(cpu_seconds[k]), 2),
                    wall_tok_s=round(n / statistics.median(seconds[k]), 2),
                    cpu_seconds=[round(s, 3) for s in cpu_seconds[k]], wall_seconds=[round(s, 3) for s in seconds[k]])
    plain = timing(0)
    rows = [dict(config="plain greedy", draft_tokens=0, **plain)]
    for k in DRAFTS:
        t, st = timing(k), stats[k]
        rows.append(dict(config=f"speculative mtp, {k} draft token(s)", draft_tokens=k,
                         speedup=round(t["tok_s"] / plain["tok_s"], 3),
                         wall_speedup=round(t["wall_tok_s"] / plain["wall_tok_s"], 3),
                         acceptance_rate=round(st["accepted"] / st["drafted"], 4),
                         tokens_per_cycle=round(st["emitted"] / st["cycles"], 3), lossless=lossless[k], **t))
        print(f"k={k}: {t['tok_s']:.1f} tok/s vs plain {plain['tok_s']:.1f} ({rows[-1]['speedup']:.2f}x; wall "
              f"{rows[-1]['wall_speedup']:.2f}x), acceptance {st['accepted'] / st['drafted']:.3f}, "
              f"{st['emitted'] / st['cycles']:.2f} tokens/cycle, lossless {lossless[k]}")
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    return dict(what="self-speculative greedy decoding with the MTP block vs plain greedy decoding, reference "
                     "backend, bf16 with every simulation on, batch 1",
                checkpoint="data/tiny-py", prompts=[o.get("prompt") for o in oracles], new_tokens_per_prompt=tokens,
                repeats=repeats, rows=rows, cpu=cpu, cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
                torch=torch.__version__, python=platform.python_version(), load_average=os.getloadavg(),
                commit=commit(), command="OMP_NUM_THREADS=1 python scripts/measure_speculative.py",
                note="tok_s from the process's CPU time (one thread), wall_tok_s from wall time; times include "
                     "each prompt's prefill; ratios come from this one run (configurations interleaved within each "
                     "repeat)")


# ============================================================================================ GPU: step costs
def _timed(fn, device, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t0)
    return out


def break_even(c1: float | None, cv: float, cm: float, k: int) -> float | None:
    """The acceptance rate α at which ``E(α)·c1 = C_cycle(α)`` (the modelled speed-up is 1); None if even α = 1
    does not pay."""
    def gain(a: float) -> float:
        tokens = k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
        return tokens * c1 - (cv + (k - 1) * cm + (1 - a ** k) * cm)
    if c1 is None or gain(1.0) <= 0:
        return None
    if gain(0.0) >= 0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if gain(mid) >= 0 else (mid, hi)
    return round(hi, 4)


def measure_step_costs(layers: int, reps: int, smoke: bool) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    base = get_preset("tiny" if smoke else "flash")
    args = base.replace(n_layers=layers, n_hash_layers=min(base.n_hash_layers, layers),
                        compress_ratios=tuple(base.compress_ratios[:layers]) + tuple(base.compress_ratios[-1:]),
                        max_seq_len=512)
    t0 = time.perf_counter()
    backend = "reference" if device.type == "cpu" else "triton"
    m = dsv4lab.load(RandomCheckpoint(args, seed=0, device=device, name=f"flash-{layers}"), device=device,
                     backend=backend, max_batch=1)
    build_s = time.perf_counter() - t0
    print(f"model: {args.n_layers} layers + MTP on {device} ({backend}), built in {build_s:.1f} s")
    prompt = torch.arange(2, 34, device=device)[None]  # 32 tokens

    def fresh():
        m.reset()
        m.forward(prompt, 0, mtp=True)
        return prompt.shape[1]

    rows = []

    def row(name, tokens, times):
        ms = [t * 1e3 for t in times]
        rows.append(dict(step=name, tokens=tokens, ms_median=round(statistics.median(ms), 3),
                         ms_all=[round(v, 3) for v in ms]))
        print(f"{name:<44} {statistics.median(ms):9.3f} ms")

    pos = fresh()
    tok = torch.tensor([[7]], device=device)
    for _ in range(2):  # warm-up (kernel compilation)
        m.forward(tok, pos)
        pos += 1
    times = []
    for _ in range(reps):
        times += _timed(lambda: m.forward(tok, pos), device, 1)
        pos += 1
    row("main 1-token step (eager)", 1, times)
    for k in DRAFTS:
        pos = fresh()
        ids = torch.full((1, k + 1), 7, device=device)
        times = []
        for i in range(reps + 1):
            t = _timed(lambda: m.forward(ids, pos, mtp=True), device, 1)
            pos += k + 1
            if i:  # the first call compiles the (k+1)-row kernels
                times += t
        row(f"verify step, {k} draft(s): {k + 1} tokens + MTP (eager)", k + 1, times)
    pos = fresh()
    _, _, X, _ = m.forward(tok, pos, mtp=True, return_hidden=True)
    pos += 1
    times = []
    for i in range(reps + 1):
        t = _timed(lambda: m.forward_mtp(X, [[7]], pos), device, 1)  # the MTP block runs ahead of the main one
        pos += 1
        if i:
            times += t
    row("MTP-only 1-token step (eager)", 1, times)
    graph_ms = None
    if device.type == "cuda":
        from dsv4lab.engine.decode_graph import Decoder
        dec = Decoder(m, graphs=True, tiers=(1,)).capture()
        fresh()
        for _ in range(2):
            dec.decode([7], [0])
        times = _timed(lambda: dec.decode([7], [0]), device, reps)
        row("main 1-token step (CUDA graph replay)", 1, times)
        graph_ms = rows[-1]["ms_median"]
    c1 = rows[0]["ms_median"]
    cm = next(r["ms_median"] for r in rows if r["step"].startswith("MTP-only"))
    be = []
    for k in DRAFTS:
        cv = next(r["ms_median"] for r in rows if r["step"].startswith(f"verify step, {k} "))
        be.append(dict(draft_tokens=k, verify_over_step=round(cv / c1, 3),
                       break_even_acceptance_vs_eager_step=break_even(c1, cv, cm, k),
                       break_even_acceptance_vs_graph_step=break_even(graph_ms, cv, cm, k)))
        print(f"k={k}: verify/step {cv / c1:.2f}, break-even acceptance vs eager step "
              f"{be[-1]['break_even_acceptance_vs_eager_step']}, vs graph step "
              f"{be[-1]['break_even_acceptance_vs_graph_step']}")
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return dict(what="cost of a (k+1)-token verify step (with the MTP block) against a 1-token step, batch 1, "
                     "random weights", model=f"DeepSeek-V4-Flash dims, {args.n_layers} main layers + MTP"
                     if not smoke else "tiny preset (smoke)",
                compress_ratios=list(args.compress_ratios), context=f"{prompt.shape[1]}-token prompt, then growing",
                backend=backend, reps=reps, build_seconds=round(build_s, 1), rows=rows, break_even=be,
                break_even_model="modelled: tokens per cycle (1 − α^(k+1))/(1 − α); cycle cost C_verify(k) + "
                                 "(k − 1)·C_mtp + (1 − α^k)·C_mtp; break-even where tokens·C_1 = cycle cost",
                gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None, torch=torch.__version__,
                triton=triton_version, commit=commit(),
                command=f"python scripts/measure_speculative.py --gpu-step-cost --layers {layers}"
                        + (" --smoke" if smoke else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64, help="CPU: new tokens per prompt")
    p.add_argument("--repeats", type=int, default=3, help="CPU: repeats (median reported)")
    p.add_argument("--gpu-step-cost", action="store_true", help="time verify steps on the GPU instead")
    p.add_argument("--layers", type=int, default=30, help="GPU: main layers of the Flash cut")
    p.add_argument("--reps", type=int, default=10, help="GPU: timed repetitions per step")
    p.add_argument("--smoke", action="store_true", help="GPU mode on the tiny preset on the CPU (checks the script)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.gpu_step_cost:
        if not a.smoke and not torch.cuda.is_available():
            raise SystemExit("--gpu-step-cost needs a GPU (use --smoke to check the script on a CPU)")
        doc = measure_step_costs(a.layers if not a.smoke else 2, a.reps, a.smoke)
        out = Path(a.out or ("runs/speculative_steps_smoke.json" if a.smoke
                             else ROOT / "data/results/h200/speculative_steps.json"))
    else:
        doc = measure_cpu(a.tokens, a.repeats)
        out = Path(a.out or ROOT / "data/results/host/speculative.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
