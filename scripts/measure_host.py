"""Measure this machine's memory-copy bandwidth and fp32 matmul rate with torch; write a results JSON.

    python scripts/measure_host.py [--out data/results/host/host_cpu.json] [--copy-mib 512] [--matmul-n 2048]

The catalogue entry ``data/hardware/host-cpu.yaml`` cites the file this writes. Copy bandwidth counts bytes read
plus bytes written (the convention of the GPU results), best of several repetitions after a warm-up; the matmul
rate is 2·n³ FLOP per call, best of several. The JSON records the CPU, thread count, torch version and commit.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def best_time(fn, repeats: int) -> tuple[float, list[float]]:
    fn()  # warm-up: page faults, allocator, thread pool start-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), times


def measure_copy(mib: int, repeats: int) -> dict:
    import torch
    n = mib * 1024 * 1024 // 4
    src = torch.rand(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    best, times = best_time(lambda: dst.copy_(src), repeats)
    moved = 2 * src.numel() * src.element_size()  # read + write
    return dict(bytes_moved=moved, working_set_mib=mib, repeats=repeats, best_s=best,
                median_s=sorted(times)[len(times) // 2], gbps=moved / best / 1e9,
                gbps_median=moved / sorted(times)[len(times) // 2] / 1e9)


def measure_matmul(n: int, repeats: int) -> dict:
    import torch
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen)
    b = torch.randn(n, n, generator=gen)
    best, times = best_time(lambda: a @ b, repeats)
    flop = 2 * n ** 3
    return dict(n=n, flop=flop, repeats=repeats, best_s=best, median_s=sorted(times)[len(times) // 2],
                gflops=flop / best / 1e9, gflops_median=flop / sorted(times)[len(times) // 2] / 1e9)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="data/results/host/host_cpu.json")
    p.add_argument("--copy-mib", type=int, default=512, help="source buffer size (much larger than the caches)")
    p.add_argument("--matmul-n", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)

    import torch
    copy = measure_copy(args.copy_mib, args.repeats)
    print(f"copy   {copy['gbps']:8.2f} GB/s (read+write, {args.copy_mib} MiB, best of {args.repeats})", file=sys.stderr)
    mm = measure_matmul(args.matmul_n, args.repeats)
    print(f"matmul {mm['gflops']:8.2f} GFLOP/s (fp32 {args.matmul_n}^3, best of {args.repeats})", file=sys.stderr)
    result = dict(
        what="host CPU memory-copy bandwidth and fp32 matmul rate, measured with torch",
        cpu=cpu_model(), logical_cpus=os.cpu_count(), torch_threads=torch.get_num_threads(),
        torch=torch.__version__, python=platform.python_version(), commit=git_commit(),
        date=dt.date.today().isoformat(), copy=copy, matmul_fp32=mm,
        copy_bw_gbps=round(copy["gbps"], 2), fp32_matmul_gflops=round(mm["gflops"], 2),
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}: copy {result['copy_bw_gbps']} GB/s, fp32 matmul {result['fp32_matmul_gflops']} GFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
