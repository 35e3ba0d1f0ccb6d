"""Measure each shipped checkpoint's rounding-noise floor against a layout fault → data/results/host/noise_floor.json.

    python scripts/measure_noise_floor.py

On the golden teacher-forced ids of each checkpoint: per-position KL between the reference and (a) the same
reference with fp32 instead of exact reductions (summation order only: what a correct, not bit-exact backend
changes) and (b) the reference on a copy with the paper's W2 permutation injected (a real bug). The ratio of the
two tells how well a KL bound on that checkpoint separates rounding from a fault.
"""
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

import dsv4lab
from dsv4lab.core import layouts
from dsv4lab.tools.verify.model import golden_path_for, kl_per_position, load_golden, rounding_noise_floor

root = Path(__file__).resolve().parents[1]
rows = []


def stats(kl):
    return dict(mean_kl=sum(kl) / len(kl), max_kl=max(kl), positions_above_0_01=sum(k > 0.01 for k in kl))


for name in ("tiny", "tiny-py"):
    ck = root / "data" / name
    ids = load_golden(golden_path_for(ck))["teacher_forced"]["ids"]
    ref = dsv4lab.load(ck, max_batch=1)
    t = torch.tensor([ids])
    ref.reset([0])
    good = ref.forward(t, 0, slots=[0])[0]
    floor = rounding_noise_floor(ref, ids, good)
    with tempfile.TemporaryDirectory() as tmp:
        layouts.inject_fault_into_checkpoint(ck, "paper_w2_blocks", Path(tmp) / "bad")
        bad = dsv4lab.load(Path(tmp) / "bad", max_batch=1).forward(t, 0)[0]
    fault = kl_per_position(good, bad)
    row = dict(checkpoint=name, positions=len(ids), rounding_floor=stats(floor), paper_w2_fault=stats(fault),
               fault_over_floor_mean=stats(fault)["mean_kl"] / stats(floor)["mean_kl"])
    rows.append(row)
    print(f"{name}: floor mean {row['rounding_floor']['mean_kl']:.3g} max {row['rounding_floor']['max_kl']:.3g}; "
          f"W2 fault mean {row['paper_w2_fault']['mean_kl']:.3g}; ratio {row['fault_over_floor_mean']:.0f}x")
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                        cwd=root).stdout.strip()
out = dict(what="teacher-forced KL: rounding-order-only change of the reference vs the paper's W2 fault, bf16 with "
                "every simulation on", rows=rows, torch=torch.__version__, python=platform.python_version(),
           cores=os.cpu_count(), commit=commit, command="python scripts/measure_noise_floor.py")
dest = root / "data" / "results" / "host" / "noise_floor.json"
dest.write_text(json.dumps(out, indent=2) + "\n")
print(f"wrote {dest.relative_to(root)}")
