"""Measure the reference backend's CPU decode speed on the shipped checkpoints → data/results/host/reference_decode.json.

    python scripts/measure_reference_speed.py [--tokens 64] [--repeats 3]

Greedy decode after a 5-token prompt, bf16 with every quantization simulation on (the defaults of dsv4lab.load);
the median of the repeats is reported, with the machine, thread count and load average at the time.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

import dsv4lab

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--tokens", type=int, default=64)
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--out", default="data/results/host/reference_decode.json")
a = p.parse_args()
root = Path(__file__).resolve().parents[1]
rows = []
for ck in ("tiny", "tiny-py"):
    m = dsv4lab.load(root / "data" / ck, max_batch=1)
    m.generate([5, 6, 7, 8, 9], 4)  # warm-up
    times = []
    for _ in range(a.repeats):
        m.reset()
        m.forward(torch.tensor([[5, 6, 7, 8, 9]]), 0)
        t0 = time.perf_counter()
        for i in range(a.tokens):
            m.forward(torch.tensor([[10 + i]]), 5 + i)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    rows.append(dict(checkpoint=ck, decode_tokens=a.tokens, seconds_median=round(med, 4),
                     tok_s=round(a.tokens / med, 2), seconds_all=[round(t, 4) for t in times]))
    print(f"{ck}: {a.tokens / med:.1f} tok/s (median of {a.repeats})")
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root).stdout.strip()
out = dict(what="reference backend CPU decode speed, bf16 with every simulation on, batch 1", rows=rows,
           cpu=cpu, cores=os.cpu_count(), torch_threads=torch.get_num_threads(), torch=torch.__version__,
           python=platform.python_version(), load_average=os.getloadavg(), commit=commit,
           command="python scripts/measure_reference_speed.py")
Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
print(f"wrote {a.out}")
