"""Where the MoE sorter's time goes at prefill sizes, for the kernel sorter (``sort_by_expert``) and the previous
torch-op sorter (``sort_by_expert_torch``): the CUDA-event time of one call (what the prefill suite's ``moe_sort``
rows report), the host time to issue it, and the GPU kernels the profiler sees (name, count, summed µs) — whether
a row measures GPU work or launch gaps. Exit 0 always (a diagnostic);
``--out`` writes the rows as JSON.

    python scripts/diag_moe_sort.py [--tokens 4096,4604] [--rows 64] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from dsv4lab.core.provenance import short_commit
from dsv4lab_kernels.moe_sort import sort_by_expert, sort_by_expert_torch

N_EXPERTS, TOP_K = 256, 6


def measure(sorter, tokens: int, rows: int, repeats: int = 20) -> dict:
    g = torch.Generator(device="cuda").manual_seed(tokens)
    idx = torch.rand(tokens, N_EXPERTS, device="cuda", generator=g).topk(TOP_K, dim=-1).indices.to(torch.int32)
    for _ in range(3):
        sorter(idx, N_EXPERTS, rows)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(repeats):
        sorter(idx, N_EXPERTS, rows)
    host_us = (time.perf_counter() - t0) / repeats * 1e6
    end.record()
    torch.cuda.synchronize()
    event_us = start.elapsed_time(end) / repeats * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            sorter(idx, N_EXPERTS, rows)
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name[:90], [0, 0.0])
            k[0] += 1
            k[1] += e.device_time
    gpu_us = sum(v[1] for v in kernels.values()) / repeats
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:12]
    row = dict(sorter=sorter.__name__, tokens=tokens, rows=rows, event_us=round(event_us, 1),
               host_issue_us=round(host_us, 1), gpu_kernel_us=round(gpu_us, 1),
               kernels_per_call=round(sum(v[0] for v in kernels.values()) / repeats, 1),
               top_kernels=[dict(name=n, per_call=round(c / repeats, 1), us_per_call=round(t / repeats, 1))
                            for n, (c, t) in top])
    print(f"{sorter.__name__}: tokens {tokens} rows {rows}: events {event_us:.1f} us/call, "
          f"host issue {host_us:.1f} us/call, GPU kernels {gpu_us:.1f} us in {row['kernels_per_call']} launches")
    for k in row["top_kernels"]:
        print(f"    {k['us_per_call']:8.1f} us  x{k['per_call']:<4} {k['name']}")
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="4096,4604")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--out")
    a = p.parse_args()
    rows = [measure(fn, int(t), a.rows) for t in a.tokens.split(",")
            for fn in (sort_by_expert, sort_by_expert_torch)]
    if a.out:
        doc = dict(diagnostic="moe_sort", gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                   commit=short_commit(), rows=rows)
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
