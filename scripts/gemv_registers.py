"""Compile the decode GEMV at three tuned H200 geometries for sm_90 (no GPU) and print registers and spills, from
the kernels folder given — ``python scripts/gemv_registers.py KERNELS_DIR`` (an older checkout's, to compare)."""
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, sys.argv[1])  # the kernels folder whose dsv4lab_kernels is compiled
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

import dsv4lab_kernels  # noqa: E402
from compile_glue_kernels import compile_launches  # noqa: E402
from dsv4lab_kernels import fp8_gemv  # noqa: E402

print("kernels from", dsv4lab_kernels.__file__)
bf, D = torch.bfloat16, 4096


def fp8w(n, k):
    return torch.zeros(n, k, dtype=torch.float8_e4m3fn), torch.zeros(-(-n // 128), -(-k // 128), dtype=torch.uint8)


geo = fp8_gemv.GemvGeometry
w, s = fp8w(1536, D)
calls = [("qkv fma", lambda: fp8_gemv.fp8_gemv(torch.zeros(1, D, dtype=bf), w, s, segments=(1024, 512),
                                               geometry=geo(block_n=32, block_k=256, split_k=6))),
         ("w2 fma nw8", lambda: fp8_gemv.fp8_gemv(torch.zeros(1, 2048, dtype=bf), *fp8w(D, 2048),
                                                  geometry=geo(block_n=64, block_k=256, split_k=5, num_warps=8))),
         ("dot rows8", lambda: fp8_gemv.fp8_gemv(torch.zeros(8, D, dtype=bf), w, s, route="dot",
                                                 geometry=geo(block_n=64, block_k=256, split_k=11)))]
for r in compile_launches(GPUTarget("cuda", 90, 32), calls):
    print(r["call"], r["kernel"], r.get("registers"), r.get("spill_bytes"), r["ok"])
