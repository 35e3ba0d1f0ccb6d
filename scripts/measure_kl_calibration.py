"""Calibrate the model tier's KL bound → data/results/host/kl_calibration.json.

    OMP_NUM_THREADS=1 python scripts/measure_kl_calibration.py      # ≈ 10–16 min on one core

How far apart do *correct* evaluations of one checkpoint drift, in teacher-forced KL, relative to the checkpoint's
rounding floor (the reference against itself with fp32 instead of exact reductions, ``verify.model.
rounding_noise_floor``)? For data/tiny and data/tiny-py, on the golden teacher-forced ids and three more fixed
sequences, the exact reference is compared with each legitimate rounding variant (``verify.variants``: fp32
reductions, split-K fp32 projections, kernel-like online-softmax attention, FP8-MMA-like projections as the H200's
prefill GEMM accumulates), with a chunked prefill (chunks of
window+5) and a batch of two in fp32, and a variant's own decode path with its prefill (what ``cached_vs_recompute``
compares for a fast backend). Each mean KL is divided by the floor of the same sequence; the largest ratio seen sets
``k`` (``verify.model.KL_FLOOR_FACTOR``), with a margin of 2 for sequences not measured. The faults of the catalogue
are measured the same way, to show which of them the KL tier alone separates (all of them fail ``verify model``
through the stage and checkpoint tiers regardless).
"""
import json
import math
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import dsv4lab
from dsv4lab.core import layouts
from dsv4lab.tools.verify.backend_faults import inject_backend_fault
from dsv4lab.tools.verify.model import (fixed_sequence, golden_path_for, kl_per_position, load_golden,
                                  rounding_noise_floor, teacher_forced_length)
from dsv4lab.tools.verify.variants import VARIANTS

root = Path(__file__).resolve().parents[1]
MARGIN = 2.0


def stats(kl: list[float]) -> dict:
    i = max(range(len(kl)), key=kl.__getitem__)
    return dict(mean_kl=sum(kl) / len(kl), max_kl=kl[i], max_position=i)


def logits(runner, ids, chunk=None, batch_with=None):
    runner.reset()
    t = torch.tensor([ids])
    if batch_with is not None:  # the sequence as row 1 of a batch of two
        other = torch.tensor([batch_with[:len(ids)]])
        return runner.forward(torch.cat((other, t)), 0, slots=[0, 1])[1]
    out = runner.prefill(t, chunk, slots=[0], logits="all")[0]
    runner.reset()
    return out


def decode_logits(runner, ids):
    runner.reset()
    t = torch.tensor([ids])
    out = torch.stack([runner.forward(t[:, p:p + 1], p, slots=[0])[0, 0] for p in range(len(ids))])
    runner.reset()
    return out


rows, fault_rows = [], []
t0 = time.time()
for name in ("tiny", "tiny-py"):
    ck = root / "data" / name
    golden = load_golden(golden_path_for(ck))
    ref = dsv4lab.load(ck, max_batch=2)
    args = ref.args
    seqs = {"golden": golden["teacher_forced"]["ids"]}
    for seed in (1, 2, 3):
        seqs[f"seed {seed}"] = fixed_sequence(args, teacher_forced_length(args), seed=seed)
    other = fixed_sequence(args, teacher_forced_length(args), seed=99)
    nm = ref.ops.numerics
    for sname, ids in seqs.items():
        exact = logits(ref, ids)
        floor = stats(rounding_noise_floor(ref, ids, exact))
        row = dict(checkpoint=name, sequence=sname, positions=len(ids), floor=floor, variants={})

        def add(label, kl):
            s = stats(kl)
            s["mean_over_floor"] = s["mean_kl"] / floor["mean_kl"]
            s["max_over_floor_max"] = s["max_kl"] / floor["max_kl"]
            row["variants"][label] = s

        for vname, cls in VARIANTS.items():
            v = dsv4lab.load(ck, max_batch=2)
            v.ops = cls(nm)
            add(f"{vname} vs exact", kl_per_position(exact, logits(v, ids)))
            if vname == "fp32-reductions":
                add("fp32 chunked prefill vs exact", kl_per_position(exact, logits(v, ids, chunk=args.window_size + 5)))
                add("fp32 batch of two vs exact", kl_per_position(exact, logits(v, ids, batch_with=other)))
            if vname == "kernel-like":
                add("kernel-like decode vs its prefill", kl_per_position(logits(v, ids), decode_logits(v, ids)))
        rows.append(row)
        worst = max(row["variants"].values(), key=lambda s: s["mean_over_floor"])
        print(f"{name} {sname}: floor mean {floor['mean_kl']:.3g} max {floor['max_kl']:.3g}; largest variant ratio "
              f"{worst['mean_over_floor']:.2f} ({time.time() - t0:.0f} s)", flush=True)
    # faults, on the golden sequence
    ids = seqs["golden"]
    exact = logits(ref, ids)
    floor = stats(rounding_noise_floor(ref, ids, exact))
    with tempfile.TemporaryDirectory() as tmp:
        for fault in ("paper_w2_blocks", "paper_w2_one_expert", "scales_not_permuted"):
            layouts.inject_fault_into_checkpoint(ck, fault, Path(tmp) / fault)
            s = stats(kl_per_position(exact, logits(dsv4lab.load(Path(tmp) / fault, max_batch=2), ids)))
            fault_rows.append(dict(checkpoint=name, fault=fault, kind="checkpoint", floor_mean=floor["mean_kl"], **s,
                                   mean_over_floor=s["mean_kl"] / floor["mean_kl"]))
    for fault in ("w2_one_expert", "bf16_accumulation"):
        s = stats(kl_per_position(exact, logits(inject_backend_fault(dsv4lab.load(ck, max_batch=2), fault), ids)))
        fault_rows.append(dict(checkpoint=name, fault=fault, kind="backend", floor_mean=floor["mean_kl"], **s,
                               mean_over_floor=s["mean_kl"] / floor["mean_kl"]))
    for r in fault_rows[-5:]:
        print(f"  fault {r['fault']}: mean KL {r['mean_kl']:.3g} = {r['mean_over_floor']:.3g}x the floor", flush=True)

largest_mean = max(s["mean_over_floor"] for r in rows for s in r["variants"].values())
largest_max = max(s["max_over_floor_max"] for r in rows for s in r["variants"].values())
k_mean = math.ceil(MARGIN * largest_mean)
k_max = math.ceil(MARGIN * largest_max)
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                        cwd=root).stdout.strip()
out = dict(
    what="teacher-forced KL of legitimate rounding variants against the exact reference, over the checkpoint's "
         "rounding floor (fp32 vs exact reductions) of the same sequence; bf16, every simulation on",
    rows=rows, faults=fault_rows, largest_mean_over_floor=largest_mean, largest_max_over_floor_max=largest_max,
    margin=MARGIN, k_mean=k_mean, k_max=k_max,
    rule=f"mean KL ≤ k_mean × floor mean and max KL ≤ k_max × floor max, k = ceil({MARGIN:g} × largest ratio)",
    torch=torch.__version__, python=platform.python_version(), cores=os.cpu_count(), commit=commit,
    seconds=round(time.time() - t0), command="OMP_NUM_THREADS=1 python scripts/measure_kl_calibration.py")
dest = root / "data" / "results" / "host" / "kl_calibration.json"
dest.write_text(json.dumps(out, indent=2) + "\n")
print(f"largest ratios: mean {largest_mean:.2f}, max {largest_max:.2f} → k_mean {k_mean}, k_max {k_max}")
print(f"wrote {dest.relative_to(root)}")
