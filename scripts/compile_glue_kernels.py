"""Compile every glue kernel of the decode step for a GPU target on a machine without one.

Each launcher of ``kernels/{mhc,norm_rope_quant,compressor_decode,router,indexer_decode,attention_decode}.py``, of the
long-context ``indexer_split_decode.py`` and ``attention_split_decode.py`` (and the
prefill kernels that are probed at run time: the mHC rows mix, the inline-PTX FP4 decode) is
called at DeepSeek-V4-Flash widths on small CPU tensors; its Triton launch is intercepted and the kernel compiled
(``triton.compile``, the wheel's own ptxas) for ``--target`` instead of run, its arguments specialized as the GPU's JIT
would (an integer 1 a constant, divisibility by 16 an attribute: ``compile_prefill_moe._source``; a split-K of 1
then compiles without its split branch, as on the GPU) — so a kernel that the interpreter
accepts but the GPU compiler rejects (a type mismatch, an op the backend lacks) fails here, in CI, not in a scarce
GPU session. Must run without ``TRITON_INTERPRET`` (the kernels are imported compiled).

    python scripts/compile_glue_kernels.py [--target cuda:90] [--json] [--no-registers]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
from compile_prefill_moe import _source  # noqa: E402 — each launch specialized as the GPU's JIT would
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "num_ctas", "launch_pdl")


def _describe(err: BaseException) -> str:
    """The error and its causes, innermost last (a Triton compilation error wraps the real one)."""
    parts = []
    while err is not None and len(parts) < 4:
        text = str(err).strip().splitlines()
        parts.append(f"{type(err).__name__}: " + " | ".join(text[-6:]))
        err = err.__cause__ or err.__context__
    return " <- ".join(parts)[:3000]


def _ptxas_usage(kernel, target: GPUTarget) -> dict:
    """Registers and spilled bytes per thread from ptxas's report (CUDA targets; empty otherwise)."""
    ptx = kernel.asm.get("ptx")
    if target.backend != "cuda" or not ptx:
        return {}
    import re
    import subprocess
    import tempfile
    from pathlib import Path
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(target.arch).path  # the assembler Triton itself uses for this target
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run([str(ptxas), f"-arch=sm_{target.arch}a" if target.arch >= 90 else f"-arch=sm_{target.arch}",
                              "-v", str(src), "-o", str(Path(tmp) / "k.cubin")], capture_output=True, text=True)
    text = out.stderr + out.stdout
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores", text)
    return dict(registers=int(regs.group(1)) if regs else None, spill_bytes=int(spill.group(1)) if spill else None)


def compile_launches(target: GPUTarget, calls, registers: bool = True) -> list[dict]:
    """Run ``calls`` (name, thunk) with every Triton launch compiled for ``target`` instead of executed; with
    ``registers``, each CUDA kernel's registers and spills from a second ptxas run."""
    rows = []
    original = JITFunction.run
    current = [""]  # the launcher being compiled (each row names it)

    def compile_only(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in _OPTIONS}
        t0 = time.perf_counter()
        try:
            k = triton.compile(_source(self, args, kwargs, target), target=target, options=options)
            rows.append(dict(kernel=self.__name__, call=current[0], ok=True,
                             seconds=round(time.perf_counter() - t0, 2),
                             shared=k.metadata.shared, **(_ptxas_usage(k, target) if registers else {})))
        except Exception as err:  # noqa: BLE001 — report every kernel, not only the first failure
            rows.append(dict(kernel=self.__name__, call=current[0], ok=False, error=_describe(err)))
        return None

    JITFunction.run = compile_only
    try:
        for name, thunk in calls:
            before, current[0] = len(rows), name
            try:
                thunk()
            except Exception as err:  # noqa: BLE001 — a launcher failing after a compiled launch is not a kernel error
                if len(rows) == before:
                    rows.append(dict(kernel=name, ok=False, error=f"launcher: {type(err).__name__}: {err}"[:2000]))
    finally:
        JITFunction.run = original
    return rows


def flash_calls():
    """(name, thunk) per launcher at DeepSeek-V4-Flash widths (bf16 activations; fp32 where the op allows it)."""
    from dsv4lab.core.config import get_preset
    from dsv4lab_kernels import (attention_decode, compressor_decode, fp4_moe_decode, greedy, indexer_decode, mhc,
                                 norm_rope_quant, router, swiglu)
    a = get_preset("flash")
    b, D, hc, d, R = 2, a.dim, a.hc_mult, a.head_dim, a.rope_head_dim
    bf, f32 = torch.bfloat16, torch.float32
    cos = torch.zeros(64, R // 2)
    pos, slots = torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long)
    X = torch.zeros(b, 1, hc, D, dtype=bf)
    fn, base, scale, w = torch.zeros(a.mix_hc, a.hc_dim), torch.zeros(a.mix_hc), torch.ones(3), torch.ones(D)
    post, comb = torch.zeros(b, 1, hc), torch.zeros(b, 1, hc, hc)
    calls = []
    for dtype in (bf, f32):
        calls += [
            (f"hc_pre_norm[{dtype}]", lambda dt=dtype: mhc.hc_pre_norm(X.to(dt), fn, base, scale, w, 20, 1e-6, 1e-6)),
            (f"hc_post_pre_norm[{dtype}]", lambda dt=dtype: mhc.hc_post_pre_norm(
                torch.zeros(b, 1, D, dtype=dt), X.to(dt), post, comb, fn, base, scale, w, 20, 1e-6, 1e-6)),
            (f"rms_norm[{dtype}]", lambda dt=dtype: norm_rope_quant.rms_norm(torch.zeros(b, a.q_lora_rank, dtype=dt),
                                                                              torch.ones(a.q_lora_rank), 1e-6)),
            (f"head_rms_rope[{dtype}]", lambda dt=dtype: norm_rope_quant.head_rms_rope(
                torch.zeros(b, 1, a.n_heads, d, dtype=dt), cos, cos, pos[:, None], 1e-6)),
        ]
    calls += [
        ("hc_post", lambda: mhc.hc_post(torch.zeros(b, 1, D, dtype=bf), X, post, comb)),
        ("swiglu", lambda: swiglu.swiglu(torch.zeros(b, a.moe_inter_dim, dtype=bf),
                                         torch.zeros(b, a.moe_inter_dim, dtype=bf), 10.0)),
        ("hc_head", lambda: mhc.hc_head(X, fn[:hc], base[:hc], scale[:1], 1e-6, 1e-6)),
        ("hc_post_pre_norm two finishers", lambda: mhc.hc_post_pre_norm(
            torch.zeros(b, 1, D, dtype=bf), X, post, comb, fn, base, scale, w, 20, 1e-6, 1e-6,
            geometry=mhc.MhcSiteGeometry(split_tail=True))),
        ("hc_post_pre_norm with the MoE's parts (moe_site)", lambda: mhc.hc_post_pre_norm(
            None, X, post, comb, fn, base, scale, w, 20, 1e-6, 1e-6, moe=fp4_moe_decode.MoeOutput(
                torch.zeros(b, a.n_activated_experts, D), torch.zeros(b, a.n_activated_experts, dtype=torch.long),
                torch.zeros(1, b, D, dtype=bf)))),
        ("hc_pre_norm prefill rows", lambda: mhc.hc_pre_norm(torch.zeros(64, 1, hc, D, dtype=bf), fn, base, scale,
                                                             w, 20, 1e-6, 1e-6)),
        ("kv_norm_rope+ring", lambda: norm_rope_quant.kv_norm_rope(
            torch.zeros(b, 1, d, dtype=bf), torch.ones(d), 1e-6, cos, cos, pos[:, None], d - R, True,
            torch.zeros(3, a.window_size, d, dtype=bf), slots)),
        ("indexer_query", lambda: norm_rope_quant.indexer_query(
            torch.zeros(b, 1, a.index_n_heads, a.index_head_dim, dtype=bf), cos, cos, pos[:, None], True)),
        ("router sqrtsoftplus", lambda: router.router_topk(torch.zeros(b, a.n_routed_experts), 6, 1.5,
                                                           "sqrtsoftplus", bias=torch.zeros(a.n_routed_experts))),
        ("router hash", lambda: router.router_topk(torch.zeros(b, a.n_routed_experts), 6, 1.5, "sqrtsoftplus",
                                                   tid2eid=torch.zeros(16, 6, dtype=torch.long), ids=pos)),
        ("indexer_select", lambda: indexer_decode.indexer_select(
            torch.zeros(b, a.index_n_heads, a.index_head_dim, dtype=bf), torch.zeros(b, a.index_n_heads, dtype=bf),
            torch.zeros(3, 4096, a.index_head_dim, dtype=bf), slots, pos, a.index_topk)),
        ("indexer_select fp32", lambda: indexer_decode.indexer_select(
            torch.zeros(b, a.index_n_heads, a.index_head_dim), torch.zeros(b, a.index_n_heads),
            torch.zeros(3, 4096, a.index_head_dim), slots, pos, a.index_topk)),
        ("attention+rope split", lambda: attention_decode.sparse_attention_decode(
            torch.zeros(b, a.n_heads, d, dtype=bf), torch.zeros(3, a.window_size, d, dtype=bf),
            torch.zeros(b, a.window_size, dtype=torch.long), slots, torch.zeros(a.n_heads), d ** -0.5,
            kv_b=torch.zeros(3, 1024, d, dtype=bf), rows_b=torch.zeros(b, 512, dtype=torch.long), batch_b=slots,
            geometry=attention_decode.AttentionGeometry(16, 32, 16, 8, False), cos=cos, sin=cos, positions=pos)),
        ("attention+rope split, combined in the kernel (attention_combine)", lambda:
            attention_decode.sparse_attention_decode(
                torch.zeros(b, a.n_heads, d, dtype=bf), torch.zeros(3, a.window_size, d, dtype=bf),
                torch.zeros(b, a.window_size, dtype=torch.long), slots, torch.zeros(a.n_heads), d ** -0.5,
                kv_b=torch.zeros(3, 1024, d, dtype=bf), rows_b=torch.zeros(b, 512, dtype=torch.long), batch_b=slots,
                geometry=attention_decode.AttentionGeometry(16, 32, 16, 8, False, combine_in_kernel=True), cos=cos,
                sin=cos, positions=pos)),
        ("attention+rope one slice", lambda: attention_decode.sparse_attention_decode(
            torch.zeros(b, a.n_heads, d, dtype=bf), torch.zeros(3, a.window_size, d, dtype=bf),
            torch.zeros(b, a.window_size, dtype=torch.long), slots, torch.zeros(a.n_heads), d ** -0.5,
            geometry=attention_decode.AttentionGeometry(16, 16, 1, 8, True), cos=cos, sin=cos, positions=pos)),
    ]
    # the long-context kernels at their benchmark geometries: a 65,536-token context's 16,384 index keys, HCA's
    # 512 entries beside the window
    from dsv4lab_kernels import attention_split_decode, indexer_split_decode
    for v in indexer_split_decode_variants():
        calls.append((f"indexer_select_split {v}", lambda v=v: indexer_split_decode.indexer_select_split(
            torch.zeros(b, a.index_n_heads, a.index_head_dim, dtype=bf), torch.zeros(b, a.index_n_heads, dtype=bf),
            torch.zeros(3, 16384, a.index_head_dim, dtype=bf), slots, pos, a.index_topk,
            geometry=indexer_split_decode.IndexerSplitGeometry(**v))))
    for v in attention_split_decode_variants():
        calls.append((f"attention_split+rope {v}", lambda v=v: attention_split_decode.sparse_attention_split(
            torch.zeros(b, a.n_heads, d, dtype=bf), torch.zeros(3, a.window_size, d, dtype=bf),
            torch.zeros(b, a.window_size, dtype=torch.long), slots, torch.zeros(a.n_heads), d ** -0.5,
            kv_b=torch.zeros(3, 512, d, dtype=bf), rows_b=torch.zeros(b, 512, dtype=torch.long), batch_b=slots,
            geometry=attention_split_decode.SplitKvGeometry(**v), cos=cos, sin=cos, positions=pos,
            prefix_ratio_b=128)))
    calls.append(("indexer_select_split fp32", lambda: indexer_split_decode.indexer_select_split(
        torch.zeros(b, a.index_n_heads, a.index_head_dim), torch.zeros(b, a.index_n_heads),
        torch.zeros(3, 4096, a.index_head_dim), slots, pos, a.index_topk)))
    for ratio, ch, idx in ((4, d, False), (4, a.index_head_dim, True), (128, d, False)):
        width = (2 if ratio == 4 else 1) * ch
        calls.append((f"compressor_step r{ratio} c{ch}", lambda ratio=ratio, ch=ch, idx=idx, width=width:
                      compressor_decode.compressor_step(
                          torch.zeros(b, width), torch.zeros(b, width), torch.zeros(ratio, width), pos, slots,
                          torch.zeros(3, 2 * ratio, width), torch.zeros(3, 2 * ratio, width),
                          torch.zeros(3, 16, ch, dtype=bf), torch.ones(ch), cos, cos, ratio, ratio == 4, 1e-6, idx,
                          True)))
    # the fused paths of the decode step (kernel_families.FUSIONS) at Flash widths, and the single GEMV beside the
    # GEMV jobs launch (x_projections) to compare their registers: the jobs kernel holds every projection's path
    calls += [
        ("attention_norms+ring", lambda: norm_rope_quant.attention_norms(
            torch.zeros(b, 1, a.q_lora_rank, dtype=bf), torch.ones(a.q_lora_rank), torch.zeros(b, 1, d, dtype=bf),
            torch.ones(d), 1e-6, cos, cos, pos[:, None], d - R, True, torch.zeros(3, a.window_size, d, dtype=bf),
            slots)),
        ("greedy", lambda: greedy.greedy_ids(torch.zeros(b, a.vocab_size))),
        ("query_heads", lambda: norm_rope_quant.query_heads(
            torch.zeros(b, 1, a.n_heads, d, dtype=bf), torch.zeros(b, 1, a.index_n_heads, a.index_head_dim, dtype=bf),
            cos, cos, pos[:, None], 1e-6, True)),
        ("compressor_pair (CSA)", lambda: compressor_decode.compressor_pair(*(
            compressor_decode.CompressorCall(
                torch.zeros(b, 2 * ch), torch.zeros(b, 2 * ch), torch.zeros(4, 2 * ch), pos, slots,
                torch.zeros(3, 8, 2 * ch), torch.zeros(3, 8, 2 * ch), torch.zeros(3, 16, ch, dtype=bf),
                torch.ones(ch), cos, cos, 4, True, 1e-6, idx, True)
            for ch, idx in ((a.index_head_dim, True), (d, False))))),
    ]
    from dsv4lab_kernels import fp8_gemv
    xg = torch.zeros(1, D, dtype=bf)
    def fp8w(n, k):  # an E4M3 weight and its E8M0 block scales
        return torch.zeros(n, k, dtype=torch.float8_e4m3fn), torch.zeros(-(-n // 128), -(-k // 128), dtype=torch.uint8)

    geo = fp8_gemv.GemvGeometry
    qkv = dict(x=xg, weight=fp8w(a.q_lora_rank + d, D)[0], scale=fp8w(a.q_lora_rank + d, D)[1],
               segments=(a.q_lora_rank, d), geometry=geo(block_n=32, block_k=256, split_k=6))
    comp_n = 2 * 2 * d + 2 * 2 * a.index_head_dim
    comps = dict(x=xg, weight=torch.zeros(comp_n, D, dtype=bf), scale=None, act_quant=False, out_dtype=f32,
                 segments=(2 * d, 2 * d, 2 * a.index_head_dim, 2 * a.index_head_dim),
                 geometry=geo(block_n=32, block_k=256, split_k=4))
    head_w = dict(x=xg, weight=torch.zeros(a.index_n_heads, D, dtype=bf), scale=None, act_quant=False,
                  geometry=geo(block_n=32, block_k=256, split_k=16))
    calls += [
        ("GEMV q/KV alone (fma)", lambda: fp8_gemv.fp8_gemv(**qkv)),
        ("GEMV jobs: q/KV, compressors, head weights (x_projections, CSA)", lambda: fp8_gemv.fp8_gemv_jobs(
            [fp8_gemv.gemv_plan(**c) for c in (qkv, comps, head_w)])),
        ("GEMV wq_b, 4 rows of a verify step on one weight tile (fma_rows 4)", lambda: fp8_gemv.fp8_gemv(
            torch.zeros(4, a.q_lora_rank, dtype=bf), *fp8w(a.n_heads * d, a.q_lora_rank),
            geometry=geo(block_n=16, block_k=128, split_k=1, fma_rows=4))),
        ("GEMV compressors, 2 rows (fma_rows 2)", lambda: fp8_gemv.fp8_gemv(
            **(comps | dict(x=torch.zeros(2, D, dtype=bf), geometry=geo(block_n=16, block_k=256, split_k=4,
                                                                         fma_rows=2))))),
        ("GEMV shared w2 alone", lambda: fp8_gemv.fp8_gemv(
            torch.zeros(1, a.moe_inter_dim, dtype=bf), *fp8w(D, a.moe_inter_dim),
            geometry=geo(block_n=64, block_k=256, split_k=5, num_warps=8))),
        ("GEMV shared w2 with the SwiGLU prologue (shared_swiglu)", lambda: fp8_gemv.fp8_gemv(
            torch.zeros(1, a.moe_inter_dim, dtype=bf), *fp8w(D, a.moe_inter_dim),
            geometry=geo(block_n=64, block_k=256, split_k=5, num_warps=8),
            swiglu=(torch.zeros(1, a.moe_inter_dim, dtype=bf), 10.0))),
    ]
    # prefill-side kernels with a run-time probe and a fallback: a compile error here is a silent loss on the GPU
    from dsv4lab_kernels import fp4_moe_grouped
    rows = torch.zeros(64, hc, D, dtype=bf)
    calls.append(("mHC mix rows (prefill, fp64)", lambda: mhc._mix_rows(
        rows, None, None, None, fn, False, a.mix_hc, mhc.MhcRowsGeometry(splits=2))))
    # the indexer's scores / causal selection and the compressor's pooling: the per-op path runs them at any row
    # count (a speculative verify step's 2–4 rows), so they are compiled at such a shape too
    from dsv4lab_kernels import attention_prefill
    qi = torch.zeros(1, 3, a.index_n_heads, a.index_head_dim, dtype=bf)
    wi = torch.zeros(1, 3, a.index_n_heads, dtype=bf)
    keys = torch.zeros(1, 40, a.index_head_dim, dtype=bf)
    calls.append(("indexer scores (prefill kernel, 3 rows)", lambda: attention_prefill.indexer_scores(qi, wi, keys)))
    calls.append(("indexer select (prefill kernel, 3 rows)", lambda: attention_prefill.indexer_select(
        qi, wi, keys, torch.tensor([[160, 161, 162]]), 4, a.index_topk)))
    # Flash's top-512 of a long row: the width every prompt of ≥ 512 entries runs (one compiled kernel for all)
    calls.append(("indexer top-k (prefill kernel, 512 of 4,096 entries)", lambda: attention_prefill.indexer_topk(
        torch.zeros(1, 3, 4096, dtype=bf), torch.tensor([[16000, 16001, 16002]]), 4, a.index_topk)))
    calls.append(("compressor pool (prefill kernel, 1 entry)", lambda: attention_prefill.compressor_pool(
        torch.zeros(1, 8, 2 * d), torch.zeros(1, 8, 2 * d))))
    bn, bk = 32, 128
    for asm in (True, False):
        calls.append((f"FP4 decode probe asm={asm}", lambda asm=asm: fp4_moe_grouped._decode_probe_kernel[(1,)](
            torch.zeros(bn, bk // 2, dtype=torch.uint8), torch.full((bn, bk // 32), 100, dtype=torch.uint8),
            torch.empty(bn, bk // 2, dtype=bf), torch.empty(bn, bk // 2, dtype=bf), BLOCK_N=bn, BLOCK_K=bk,
            ASM=asm)))
    return calls


def indexer_split_decode_variants() -> list[dict]:
    """The split indexer's benchmarked geometries (``kernel_families.INDEXER_SPLIT``, the full run's)."""
    from dsv4lab.engine.kernel_families import INDEXER_SPLIT
    return [v.fields for v in INDEXER_SPLIT.runs("full")]


def attention_split_decode_variants() -> list[dict]:
    """The split-KV attention's benchmarked geometries (``kernel_families.ATTENTION_SPLIT``, the full run's)."""
    from dsv4lab.engine.kernel_families import ATTENTION_SPLIT
    return [v.fields for v in ATTENTION_SPLIT.runs("full")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="cuda:90", help="backend:arch, e.g. cuda:90 (H200) or hip:gfx90a")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-registers", action="store_true",
                   help="skip the register report (a second ptxas run per CUDA kernel); the compile is checked as before")
    args = p.parse_args(argv)
    backend, arch = args.target.split(":")
    target = GPUTarget(backend, int(arch) if arch.isdigit() else arch, 32 if backend == "cuda" else 64)
    rows = compile_launches(target, flash_calls(), registers=not args.no_registers)
    if args.json:
        print(json.dumps(dict(target=args.target, triton=triton.__version__, kernels=rows), indent=1))
    else:
        for r in rows:
            usage = f"  registers {r.get('registers')}  spilled {r.get('spill_bytes')} B" if "registers" in r else ""
            print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['kernel']:<28} "
                  + (f"{r['seconds']:>6.2f} s  smem {r['shared']} B{usage}" if r["ok"] else r["error"]))
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
