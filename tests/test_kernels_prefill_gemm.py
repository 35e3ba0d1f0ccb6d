"""Dense prefill GEMMs (issue 18) against the reference, within the analytic bound of their accumulation:
the activation quantizer (also in cuBLAS's column-major, row-padded layout), the FP8 block GEMM, the
weight-stationary GEMM of bf16 activations (BF16 weights, FP8 weights upcast in registers, grouped ``wo_a``, fp32
out for ``linear_f32``) and the fused shared expert.

Interpreter tests use small irregular shapes inside NaN-filled buffers (a read past an edge poisons the output);
``gpu`` tests repeat them at real widths, cuBLAS's ``_scaled_mm`` path included.
"""
from __future__ import annotations

import pytest
import torch

from dsv4lab.core import quant
from dsv4lab.engine.triton_prefill import accumulation_bound, linear_magnitude
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.tools.verify.bounds import check_within_bound
from dsv4lab.tools.verify.registry import fp8_linear_case, grouped_wo_a_case, make_linear

pytest.importorskip("triton")
fg = pytest.importorskip("dsv4lab_kernels.fp8_gemm")

REF = ReferenceOps(Numerics())
FP8_NAN = 0x7F


def _within(name, out, ref, mag, terms, accumulation, out_dtype):
    res = check_within_bound(out, ref, mag, out_dtype=out_dtype, name=name, **accumulation_bound(terms, accumulation))
    assert res.ok, res.line()
    return res


def _poisoned_fp8(w: torch.Tensor, pad_rows: int, pad_cols: int) -> torch.Tensor:
    """``w`` as a view into a larger E4M3 buffer filled with NaN (0x7F)."""
    buf = torch.full((w.shape[0] + pad_rows, w.shape[1] + pad_cols), FP8_NAN, dtype=torch.uint8,
                     device=w.device).view(torch.float8_e4m3fn)
    buf[: w.shape[0], : w.shape[1]] = w
    return buf[: w.shape[0], : w.shape[1]]


def _poisoned_x(M: int, K: int, g, scale=3.0, device="cpu") -> torch.Tensor:
    buf = torch.full((M, K + 32), float("nan"), dtype=torch.bfloat16, device=device)
    buf[:, :K] = (torch.randn(M, K, generator=g) * scale).to(device, torch.bfloat16)
    return buf[:, :K]


# ------------------------------------------------------------------------------------------ quantizer
def test_quantizer_column_major_scales_and_padded_rows_are_the_reference():
    g = torch.Generator().manual_seed(1)
    M, K = 11, 320  # a partial third 128-block
    x = (torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-10, 10, (M, 1), generator=g).float()))
    x = x.to(torch.bfloat16)
    out = fg.quantize_activations(x, scale_cols=True, rows_out=16)
    q, s = quant.act_quant_fp8(x)
    assert out["scale"].stride() == (1, 16)  # column-major: cuBLAS's 1×128 block-scale layout
    assert torch.equal(out["q"][:M].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(out["scale"][:M], s)
    assert torch.equal(out["q"][M:].view(torch.uint8), torch.zeros(5, K, dtype=torch.uint8))
    with pytest.raises(ValueError, match="rows_out"):
        fg.quantize_activations(x, rows_out=M - 1)


# ------------------------------------------------------------------------------------------ FP8 GEMM
@pytest.mark.parametrize("M,N,K", [(37, 200, 192), (70, 96, 256)])
def test_fp8_linear_within_the_fp8_mma_bound_and_never_reads_padding(M, N, K):
    g = torch.Generator().manual_seed(M)
    lin = make_linear("fp8", N, K, g)
    x = _poisoned_x(M, K, g)
    w = _poisoned_fp8(lin.weight, 7, 64)
    ref = REF.linear(x.contiguous(), lin)
    mag = linear_magnitude(x.contiguous(), lin, True)
    _within("fp8_linear", fg.fp8_linear(x, w, lin.scale, config="small"), ref, mag, K, "tc_fp8", torch.bfloat16)
    # a tensor-parallel partial: the unrounded fp32 product, rounded by the caller after the all-reduce
    y32 = fg.fp8_linear(x, w, lin.scale, config="small", out_dtype=torch.float32)
    assert y32.dtype == torch.float32
    _within("fp8_linear fp32", y32, (quant.act_qdq_fp8(x.contiguous()).double()
                                     @ lin.dequantized(torch.float64).T).float(), mag, K, "tc_fp8", torch.float32)


def test_the_fp8_bound_still_catches_a_missing_k_block():
    """The FP8-MMA bound (γ₁₂₈ at 2^-13 per 128-K block, 1/64 of Σ|terms|) is loose; it must still fail a real
    bug: a third of the reduction dropped puts about a fifth of the outputs beyond it."""
    g = torch.Generator().manual_seed(5)
    M, N, K = 16, 64, 384
    lin = make_linear("fp8", N, K, g)
    x = (torch.randn(M, K, generator=g) * 3).to(torch.bfloat16)
    qa = fg.quantize_activations(x)
    partial = fg.fp8_block_gemm(qa["q"][:, :256].contiguous(), qa["scale"][:, :2].contiguous(),
                                lin.weight[:, :256].contiguous(), lin.scale[:, :2].contiguous(), config="small")
    res = check_within_bound(partial, REF.linear(x, lin), linear_magnitude(x, lin, True), out_dtype=torch.bfloat16,
                             **accumulation_bound(K, "tc_fp8"))
    assert not res.ok and res.n_violations > M * N // 10, res.line()


def test_accumulation_bound_constants():
    assert accumulation_bound(100, "fp32")["c"] == 100
    assert accumulation_bound(100, "tc_bf16")["c"] == 200  # truncating fp32 adds: u = 2^-23
    assert accumulation_bound(4096, "tc_fp8")["c"] == 128 * 2 ** 11 + 32  # 2^-13 within a block, fp32 across
    with pytest.raises(ValueError, match="accumulation kind"):
        accumulation_bound(8, "tf32")


# ------------------------------------------------------------------------------------------ weight-stationary GEMM
@pytest.mark.parametrize("fmt,out_dtype", [("bf16", torch.bfloat16), ("bf16", torch.float32), ("fp8", torch.bfloat16)])
def test_weight_gemm_matches_the_reference_projection(fmt, out_dtype):
    g = torch.Generator().manual_seed(7)
    M, N, K = 45, 136, 192
    lin = make_linear(fmt, N, K, g, act_quant=False)
    x = _poisoned_x(M, K, g)
    if fmt == "fp8":
        w = _poisoned_fp8(lin.weight, 5, 64)
    else:
        buf = torch.full((N + 5, K + 64), float("nan"), dtype=torch.bfloat16)
        buf[:N, :K] = lin.weight
        w = buf[:N, :K]
    y = fg.weight_gemm(x, w, lin.scale, out_dtype, config="small")
    ref = REF.linear_f32(x.contiguous(), lin) if out_dtype == torch.float32 else REF.linear(x.contiguous(), lin)
    _within(f"weight_gemm[{fmt}]", y, ref, linear_magnitude(x.contiguous(), lin, False), K, "tc_bf16", out_dtype)


def test_grouped_weight_gemm_is_the_reference_wo_a():
    g = torch.Generator().manual_seed(9)
    G, R, K, M = 3, 40, 160, 29
    lin = make_linear("fp8", G * R, K, g, act_quant=False)
    o = torch.randn(1, M, G, K, generator=g).to(torch.bfloat16)
    ref = REF.grouped_wo_a(o, lin, G)
    y = fg.grouped_bf16_fp8_gemm(o.reshape(M, G, K), lin.weight, lin.scale, G, config="small")
    w3 = lin.dequantized(torch.float64).view(G, R, K)
    mag = torch.einsum("bsgd,grd->bsgr", o.double().abs(), w3.abs())
    _within("grouped wo_a", y.view(ref.shape), ref, mag, K, "tc_bf16", torch.bfloat16)
    with pytest.raises(ValueError, match="groups"):
        fg.weight_gemm(o.reshape(M, G, K), lin.weight, lin.scale, groups=2)


def test_fp8_weight_dequantized_exactly_for_cublas():
    """The bf16 copy cuBLAS multiplies (an FP8 weight times its 128×128 scales) is the reference's, bit for bit —
    partial blocks in both dims included."""
    g = torch.Generator().manual_seed(10)
    lin = make_linear("fp8", 200, 300, g, act_quant=False)
    assert torch.equal(fg.dequant_fp8_weight(lin.weight, lin.scale), lin.dequantized(torch.bfloat16))
    assert fg.cublas_eligible(64, 1024, 4096) and not fg.cublas_eligible(64, 1024, 256)  # K/128 a multiple of 4


# ------------------------------------------------------------------------------------------ shared expert
def test_fused_shared_expert_is_the_reference_and_its_stages_check_alone():
    g = torch.Generator().manual_seed(11)
    M, D, I = 33, 256, 200  # a partial 128-column block of h
    w1, w3 = make_linear("fp8", I, D, g), make_linear("fp8", I, D, g)
    w2 = make_linear("fp8", D, I, g)
    x = (torch.randn(M, D, generator=g) * 3).to(torch.bfloat16)
    y = fg.fp8_swiglu_mlp(x, w1.weight, w1.scale, w3.weight, w3.scale, w2.weight, w2.scale, 2.0, config="small")
    assert torch.equal(y, REF.expert_mlp(x, w1, w2, w3, 2.0, shared=True))  # the interpreter: the same fp32 sums
    gk, uk = fg.fp8_gate_up(x, w1.weight, w1.scale, w3.weight, w3.scale, 2.0, fuse=False, config="small")
    assert torch.equal(gk, REF.linear(x, w1).float()) and torch.equal(uk, REF.linear(x, w3).float())


def test_shared_expert_h_scales_in_cublas_layout_are_the_row_major_ones():
    # the cuBLAS down projection reads h's scales column-major with padded rows; the kernel once wrote them with the
    # row-major column stride (1) into that layout — a wrong product only the H200 showed (no cuBLAS on a CPU)
    g = torch.Generator().manual_seed(12)
    M, D, I = 33, 256, 384
    w1, w3 = make_linear("fp8", I, D, g), make_linear("fp8", I, D, g)
    x = (torch.randn(M, D, generator=g) * 3).to(torch.bfloat16)
    h, hs = fg.fp8_gate_up(x, w1.weight, w1.scale, w3.weight, w3.scale, 2.0, config="small")
    hc, hsc = fg.fp8_gate_up(x, w1.weight, w1.scale, w3.weight, w3.scale, 2.0, config="small", scale_cols=True,
                             rows_out=36)
    assert hsc.stride() == (1, 36) and hsc.shape == (36, 3)
    assert torch.equal(hc[:M].view(torch.uint8), h.view(torch.uint8)) and torch.equal(hsc[:M], hs)
    assert torch.equal(hsc[M:], torch.ones(3, 3)) and not hc[M:].view(torch.uint8).any()


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(1024, 4096), (4096, 2048), (512, 4096)])
def test_gpu_fp8_linear_triton_and_cublas_within_bound(N, K):
    dev = "cuda"
    x, lin, ref, mag = fp8_linear_case(torch.Generator().manual_seed(N), N, K, dev)
    for cfg in fg.FP8_GEMM_CONFIGS:
        _within(f"gpu fp8 {cfg}", fg.fp8_linear(x, lin.weight, lin.scale, config=cfg), ref, mag, K, "tc_fp8",
                torch.bfloat16)
    if fg.cublas_block_fp8_available(dev):
        _within("gpu fp8 cublas", fg.fp8_linear(x, lin.weight, lin.scale, backend="cublas"), ref, mag, K, "tc_fp8",
                torch.bfloat16)
    else:  # stated, not silently skipped: the dispatcher then uses the Triton kernel
        print(f"cuBLAS block-scaled FP8 unavailable: {fg.cublas_unavailable_reason(dev)}")


@pytest.mark.gpu
def test_gpu_weight_gemm_and_shared_expert_at_real_widths():
    dev = "cuda"
    g = torch.Generator().manual_seed(13)
    o, lin, ref, mag = grouped_wo_a_case(g, dev)
    M, G, K = o.shape
    for cfg in fg.WEIGHT_GEMM_CONFIGS:
        y = fg.weight_gemm(o, lin.weight, lin.scale, torch.bfloat16, G, config=cfg)
        _within(f"gpu wo_a {cfg}", y.view(ref.shape), ref, mag, K, "tc_bf16", torch.bfloat16)
    head = make_linear("bf16", 4099, 4096, g, dev)
    x = (torch.randn(M, 4096, generator=g) * 2).to(dev, torch.bfloat16)
    _within("gpu linear_f32", fg.weight_gemm(x, head.weight, None, torch.float32), REF.linear_f32(x, head),
            linear_magnitude(x, head, False), 4096, "tc_bf16", torch.float32)
    w1, w3 = make_linear("fp8", 2048, 4096, g, dev), make_linear("fp8", 2048, 4096, g, dev)
    w2 = make_linear("fp8", 4096, 2048, g, dev)
    gk, uk = fg.fp8_gate_up(x, w1.weight, w1.scale, w3.weight, w3.scale, 10.0, fuse=False)
    _within("gpu shared gate", gk, REF.linear(x, w1).float(), linear_magnitude(x, w1, True), 4096, "tc_fp8",
            torch.bfloat16)
    _within("gpu shared up", uk, REF.linear(x, w3).float(), linear_magnitude(x, w3, True), 4096, "tc_fp8",
            torch.bfloat16)
    h = REF.swiglu(gk, uk, 10.0, shared=True).to(torch.bfloat16)
    composed = REF.linear(h, w2)
    for backend in ("triton", "cublas"):
        y = fg.fp8_swiglu_mlp(x, w1.weight, w1.scale, w3.weight, w3.scale, w2.weight, w2.scale, 10.0,
                              backend=backend)
        _within(f"gpu shared fused [{backend}]", y, composed, linear_magnitude(h, w2, True), 2048, "tc_fp8",
                torch.bfloat16)


@pytest.mark.gpu
def test_gpu_cublas_paths_are_available_and_within_bound():
    """Both cuBLAS paths the prefill dispatch may take pass their probes on this GPU (the block-scaled FP8 GEMM:
    its first probe's K = 256 misread the scales; the bf16 GEMM with fp32 output) and agree with the reference at
    real widths within the bound of their accumulation."""
    dev = "cuda"
    assert fg.cublas_block_fp8_available(dev), fg.cublas_unavailable_reason(dev)
    assert fg.cublas_bf16_available(dev), fg.cublas_bf16_reason(dev)
    g = torch.Generator().manual_seed(14)
    G, R, K, M = 8, 1024, 4096, 301
    lin = make_linear("fp8", G * R, K, g, dev, act_quant=False)
    o = torch.randn(1, M, G, K, generator=g).to(dev, torch.bfloat16)
    ref = REF.grouped_wo_a(o, lin, G)
    mag = torch.einsum("bsgd,grd->bsgr", o.double().abs(), lin.dequantized(torch.float64).view(G, R, K).abs())
    y = fg.cublas_weight_gemm(o.reshape(M, G, K), lin.weight, lin.scale, torch.bfloat16, G)
    _within("gpu wo_a cublas", y.view(ref.shape), ref, mag, K, "tc_bf16", torch.bfloat16)
    head = make_linear("bf16", 4099, 4096, g, dev)
    x = (torch.randn(M, 4096, generator=g) * 2).to(dev, torch.bfloat16)
    _within("gpu linear_f32 cublas", fg.cublas_weight_gemm(x, head.weight, None, torch.float32),
            REF.linear_f32(x, head), linear_magnitude(x, head, False), 4096, "tc_bf16", torch.float32)
    wq = make_linear("fp8", 1024, 4096, g, dev)
    _within("gpu fp8 cublas wq_a", fg.fp8_linear(x, wq.weight, wq.scale, backend="cublas"), REF.linear(x, wq),
            linear_magnitude(x, wq, True), 4096, "tc_fp8", torch.bfloat16)
