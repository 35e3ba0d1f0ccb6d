"""Does each projection of a GEMV jobs launch reduce in the register layout of its own launch, and each row of a
several-row fma program in the one-row program's? (No GPU needed.)

``fp8_gemv_jobs`` promises each projection the bits of its own ``fp8_gemv`` launch. The FMA route sums a
``[BN, BK]`` tile of products along K with ``tl.sum``, whose order follows the tile's register layout — so the
promise holds only if the compiler gives each projection's tile in the jobs kernel the layout it gets alone. On the
H100 it did not (``data/results/h100/diag_prefill_after_decode_f3de19f.json``: the BF16 projection off by up to 1.9e-6
beside an FP8 one of the same tile shape; the inlined bodies shared their index ranges and the compiler gave every
weight load the FP8 load's 16-byte layout). This script compiles — for ``--target`` (sm_90 by default), with
Triton's own argument specialization, on a machine without a GPU — the CSA layer's attention-input projections
(``x_projections``: the FP8 q/KV pair, the four BF16 compressor weights, the BF16 head weights) at
DeepSeek-V4-Flash widths, alone and as one jobs launch, and compares the layouts of their K reductions; and the FP8
and BF16 ones (and the FP8 pair at the GEMV quick list's 64-row, 8-warp tile) at 4 rows with
``GemvGeometry.fma_rows`` 2 and 4 against one row per program (each row has an
accumulator of its own, summed as the one-row program sums: the same layout means the same bits). Must run
without ``TRITON_INTERPRET``.

    python scripts/check_gemv_jobs_layouts.py [--rows 1,8] [--target cuda:90]     # exit 1 on a mismatch
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import replace
from pathlib import Path

if __name__ == "__main__":  # before triton and any kernel module are imported: the kernels must compile
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the GPU machine's Triton (3.6) fuses by default
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

REDUCE = re.compile(r'"tt\.reduce"\(%[\w.#]+\) <\{axis = (\d+) : i32\}>')
OPERAND = re.compile(r'\}\) : \(tensor<([\dx]+)xf32, (#\w+)>\)')


def k_reduction_layouts(ttgir: str) -> list[str]:
    """The layout (its definition) of every 2-D fp32 tile summed along its second axis: the FMA route's K sums."""
    defs = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, re.M))
    out = []
    for m in REDUCE.finditer(ttgir):
        operand = OPERAND.search(ttgir, m.end())  # the op's signature, after its combining region
        if operand and m.group(1) == "1" and operand.group(1).count("x") == 1:
            out.append(defs.get(operand.group(2), operand.group(2)))
    return sorted(out)


def compiled(launch, target: GPUTarget) -> list[str]:
    """Run ``launch()`` with its Triton launches compiled for ``target`` instead of run, each specialized as the
    GPU's JIT would (``compile_prefill_moe._source``); the TTGIR of each, in launch order."""
    from compile_prefill_moe import _OPTIONS, _source  # (imported here: importing it pops TRITON_INTERPRET)
    out = []
    original = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in _OPTIONS}
        out.append(triton.compile(_source(self, args, kwargs, target), target=target, options=options).asm["ttgir"])

    JITFunction.run = compile_only
    try:
        launch()
    finally:
        JITFunction.run = original
    return out


def projections(rows: int):
    """The three ``fp8_gemv`` calls of a CSA layer's attention input at the tuned H200 geometries (CPU tensors)."""
    from dsv4lab.core.config import get_preset
    from dsv4lab.tools.verify.registry import make_linear
    from dsv4lab_kernels import fp8_gemv as gemv
    a = get_preset("flash")
    d, geo, g = a.head_dim, gemv.GemvGeometry, torch.Generator().manual_seed(rows)
    x = torch.randn(rows, a.dim, generator=g).to(torch.bfloat16)
    qkv = make_linear("fp8", a.q_lora_rank + d, a.dim, g)
    comps = make_linear("bf16", 2 * 2 * d + 2 * 2 * a.index_head_dim, a.dim, g)
    head_w = make_linear("bf16", a.index_n_heads, a.dim, g)
    return [dict(x=x, weight=qkv.weight, scale=qkv.scale, segments=(a.q_lora_rank, d),
                 geometry=geo(block_n=32, block_k=256, split_k=6)),
            dict(x=x, weight=comps.weight, scale=None, act_quant=False, out_dtype=torch.float32,
                 segments=(2 * d, 2 * d, 2 * a.index_head_dim, 2 * a.index_head_dim),
                 geometry=geo(block_n=32, block_k=256, split_k=4)),
            dict(x=x, weight=head_w.weight, scale=None, act_quant=False, geometry=geo(block_n=32, split_k=16))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8")
    p.add_argument("--target", default="cuda:90")
    args = p.parse_args(argv)
    backend, arch = args.target.split(":")
    target = GPUTarget(backend, int(arch), 32 if backend == "cuda" else 64)
    from dsv4lab_kernels import fp8_gemv as gemv
    report, ok = [], True
    for rows in map(int, args.rows.split(",")):
        calls = projections(rows)
        # as sets: projections of one specialization share one function in the jobs kernel (its padding job too)
        alone = sorted({lay for c in calls for ir in compiled(lambda c=c: gemv.fp8_gemv(**c), target)
                        for lay in k_reduction_layouts(ir)})
        (jobs_ir,) = compiled(lambda: gemv.fp8_gemv_jobs([gemv.gemv_plan(**c) for c in calls]), target)
        jobs = sorted(set(k_reduction_layouts(jobs_ir)))
        report.append(dict(rows=rows, alone=alone, jobs=jobs, same=alone == jobs))
        ok &= alone == jobs
    fma_rows = []  # the fma route with several rows per program: each row's K sum in the one-row program's layout
    qkv = projections(4)[0]  # and the q/KV pair at the GEMV quick list's widest 2-row tile (64 rows, 8 warps)
    wide = dict(qkv, geometry=replace(qkv["geometry"], block_n=64, num_warps=8))
    for c in projections(4)[:2] + [wide]:  # the FP8 q/KV pair and the BF16 compressors, 4 token rows
        one = dict(c, geometry=replace(c["geometry"], fma_rows=1))
        per_row = {r: sorted(set(k_reduction_layouts(compiled(lambda r=r: gemv.fp8_gemv(
            **dict(c, geometry=replace(c["geometry"], fma_rows=r))), target)[0]))) for r in (2, 4)}
        single = sorted(set(k_reduction_layouts(compiled(lambda: gemv.fp8_gemv(**one), target)[0])))
        same = all(v == single for v in per_row.values())
        fma_rows.append(dict(weight=str(c["weight"].dtype), block_n=c["geometry"].block_n, one_row=single,
                             fma_rows_2=per_row[2],
                             fma_rows_4=per_row[4], same=same))
        ok &= same
    from dsv4lab.core.provenance import short_commit
    print(json.dumps(dict(target=args.target, triton=triton.__version__, commit=short_commit() or "unknown", ok=ok,
                          cases=report, fma_rows=fma_rows), indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
