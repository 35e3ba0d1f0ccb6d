"""FP8 block-scaled GEMM for the dense projections at large M, and the reference's activation quantizer.

The reference applies an FP8 projection as ``act_qdq_fp8(x) @ dequant(W)ᵀ``: activations quantized per token per
128-wide K block to E4M3 with a power-of-two scale ``2^ceil(log2(max(amax, 1e-4)/448))``, weights E4M3 with one
E8M0 scale per 128×128 block. Both factors are exact, so

    y[m, n] = Σ_kb (x_q[m, kb] · W_q[n, kb]) · s_x[m, kb] · s_w[n // 128, kb]

with the inner dot on FP8 tensor cores (fp32 accumulation) and the two scales applied once per K block — the same
products as the reference, summed in another fp32 order. Partial edge blocks (K or N not multiples of 128, as in
the tiny model) are masked. The same kernel runs the grouped ``wo_a`` projection (:func:`grouped_bf16_fp8_gemm`),
whose bf16 activations the reference does not quantize: the E4M3 weight tile is upcast to bf16 (exact) instead.

:func:`quantize_activations` is the reference quantizer as a kernel. Besides ``x_q`` and the per-128 scales it can
emit the layouts the grouped FP4 MoE GEMM consumes (``kernels/fp4_moe_grouped.py``): the dequantized values in
bf16 (exact: an E4M3 value times a power of two fits bf16) with the even K columns first and the odd ones second
(so a packed FP4 byte's low nibble meets ``x[:, :K/2]`` and its high nibble ``x[:, K/2:]``), the FP8 values in
that split order, and the scales replicated per 32 as E8M0 bytes (``tl.dot_scaled``'s layout).

Exact device-side codecs come from ``kernels/formats.py``; :func:`pow2_exponent`, :func:`to_bf16` and
:func:`quantize_block_fp8` (the reference quantizer's pieces) are shared with the other prefill kernels.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .formats import e8m0_to_f32, fp8_act_exponent, pow2, round_to_bf16, round_to_e4m3

ACT_BLOCK = 128
FP8_MAX = 448.0


def interpreting() -> bool:
    """True under Triton's CPU interpreter, where bf16/fp8 dots must be fed fp32 operands."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ============================================================================================ shared helpers
@triton.jit
def pow2_exponent(amax):
    """Exponent ``e`` of the reference's activation scale ``2^ceil(log2(max(amax, 1e-4) / 448))`` (int32)."""
    return fp8_act_exponent(tl.maximum(amax, 1e-4))


@triton.jit
def to_bf16(x):
    """fp32 → bf16, round to nearest even on every target (the CPU interpreter's own cast truncates)."""
    return round_to_bf16(x).to(tl.bfloat16)


@triton.jit
def quantize_block_fp8(x, e):
    """``x · 2^-e`` clamped to ±448 and rounded to E4M3 (NaN stays NaN: the clamp is a comparison)."""
    y = x * pow2(-e)
    y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))
    return round_to_e4m3(y).to(tl.float8e4nv)


# ============================================================================================ activation quantizer
@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, deq_split_ptr, q_split_ptr, s32_ptr,
                      M, K, stride_x, stride_q, stride_s, stride_ds, stride_qs, stride_s32,
                      BLOCK_M: tl.constexpr, WRITE_Q: tl.constexpr, WRITE_DEQ_SPLIT: tl.constexpr,
                      WRITE_Q_SPLIT: tl.constexpr, WRITE_S32: tl.constexpr):
    pid_m = tl.program_id(0)
    kb = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    half = tl.arange(0, 64)
    col_even = kb * 128 + 2 * half
    row_ok = rm < M
    m_even = row_ok[:, None] & (col_even < K)[None, :]
    m_odd = row_ok[:, None] & (col_even + 1 < K)[None, :]
    x_row = x_ptr + rm[:, None].to(tl.int64) * stride_x
    xe = tl.load(x_row + col_even[None, :], mask=m_even, other=0.0).to(tl.float32)
    xo = tl.load(x_row + col_even[None, :] + 1, mask=m_odd, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))
    e = pow2_exponent(amax)
    qe = quantize_block_fp8(xe, e[:, None])
    qo = quantize_block_fp8(xo, e[:, None])
    scale = pow2(e)
    tl.store(s_ptr + rm.to(tl.int64) * stride_s + kb, scale, mask=row_ok)
    if WRITE_Q:
        q_row = q_ptr + rm[:, None].to(tl.int64) * stride_q
        tl.store(q_row + col_even[None, :], qe, mask=m_even)
        tl.store(q_row + col_even[None, :] + 1, qo, mask=m_odd)
    split_col = kb * 64 + half  # even column 2c → c, odd column 2c+1 → K/2 + c
    if WRITE_DEQ_SPLIT:
        d_row = deq_split_ptr + rm[:, None].to(tl.int64) * stride_ds
        tl.store(d_row + split_col[None, :], to_bf16(qe.to(tl.float32) * scale[:, None]), mask=m_even)
        tl.store(d_row + K // 2 + split_col[None, :], to_bf16(qo.to(tl.float32) * scale[:, None]), mask=m_odd)
    if WRITE_Q_SPLIT:
        qs_row = q_split_ptr + rm[:, None].to(tl.int64) * stride_qs
        tl.store(qs_row + split_col[None, :], qe, mask=m_even)
        tl.store(qs_row + K // 2 + split_col[None, :], qo, mask=m_odd)
    if WRITE_S32:
        # the per-128 scale as E8M0 bytes, once per 32 columns (the layout tl.dot_scaled reads)
        sub = tl.arange(0, 4)
        byte = (e + 127).to(tl.uint8)
        s32_row = s32_ptr + rm[:, None].to(tl.int64) * stride_s32
        m32 = row_ok[:, None] & (kb * 128 + 32 * sub < K)[None, :]
        tl.store(s32_row + kb * 4 + sub[None, :], tl.broadcast_to(byte[:, None], (BLOCK_M, 4)), mask=m32)


def quantize_activations(x: torch.Tensor, *, q: bool = True, deq_split: bool = False, q_split: bool = False,
                         scales32: bool = False, block_m: int = 32) -> dict[str, torch.Tensor]:
    """Quantize ``x [M, K]`` (bf16/fp32) per token per 128 columns, as ``dsv4lab.quant.act_quant_fp8``.

    Returns a dict with ``scale`` (fp32 ``[M, ceil(K/128)]``, powers of two) and, as asked: ``q`` (E4M3
    ``[M, K]``), ``deq_split`` (bf16 ``[M, K]``: dequantized values, even columns then odd columns),
    ``q_split`` (E4M3 in that split order), ``scale32`` (uint8 E8M0 ``[M, ceil(K/32)]``, each per-128 scale
    repeated for its four 32-column groups).
    """
    assert x.ndim == 2, f"quantize_activations: x must be [M, K], got {list(x.shape)}"
    assert x.dtype in (torch.bfloat16, torch.float32), f"quantize_activations: x dtype {x.dtype}"
    assert x.stride(-1) == 1, "quantize_activations: x must be contiguous along K"
    M, K = x.shape
    assert not (deq_split or q_split) or K % 2 == 0, f"split layouts need an even K, got {K}"
    nkb = triton.cdiv(K, ACT_BLOCK)
    dev = x.device
    out = {"scale": torch.empty(M, nkb, dtype=torch.float32, device=dev)}
    dummy = out["scale"]
    if q:
        out["q"] = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=dev)
    if deq_split:
        out["deq_split"] = torch.empty(M, K, dtype=torch.bfloat16, device=dev)
    if q_split:
        out["q_split"] = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=dev)
    if scales32:
        out["scale32"] = torch.empty(M, triton.cdiv(K, 32), dtype=torch.uint8, device=dev)
    if M == 0:
        return out
    qt, ds, qs, s32 = (out.get(k, dummy) for k in ("q", "deq_split", "q_split", "scale32"))
    grid = (triton.cdiv(M, block_m), nkb)
    _act_quant_kernel[grid](x, qt, out["scale"], ds, qs, s32, M, K, x.stride(0), qt.stride(0),
                            out["scale"].stride(0), ds.stride(0), qs.stride(0), s32.stride(0),
                            BLOCK_M=block_m, WRITE_Q=q, WRITE_DEQ_SPLIT=deq_split, WRITE_Q_SPLIT=q_split,
                            WRITE_S32=scales32)
    return out


# ============================================================================================ FP8 GEMM
@triton.jit
def _fp8_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, K,
                     stride_x, stride_xg, stride_xs, stride_w, stride_ws, stride_y, stride_yg,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     X_BF16: tl.constexpr, UPCAST: tl.constexpr, OUT_BF16: tl.constexpr):
    pid = tl.program_id(0)
    grp = tl.program_id(1)  # weight group (grouped wo_a): rows grp·N … grp·N + N − 1 of the weight
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row tiles share each weight column tile while it is in L2
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    w_row = grp * N + rn
    x_rows = x_ptr + grp.to(tl.int64) * stride_xg + rm[:, None].to(tl.int64) * stride_x
    w_rows = w_ptr + w_row[:, None].to(tl.int64) * stride_w
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        x = tl.load(x_rows + (k0 + rk)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + (k0 + rk)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if X_BF16:
            w = w.to(tl.bfloat16)  # E4M3 values are exact in bf16
        if UPCAST:
            part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            part = tl.dot(x, tl.trans(w))
        kb = k0 // 128
        sw = e8m0_to_f32(tl.load(ws_ptr + (w_row // 128) * stride_ws + kb, mask=n_ok, other=127).to(tl.int32))
        if X_BF16:
            acc += part * sw[None, :]
        else:
            sx = tl.load(xs_ptr + rm.to(tl.int64) * stride_xs + kb, mask=m_ok, other=0.0)
            acc += part * sx[:, None] * sw[None, :]
    y = y_ptr + grp.to(tl.int64) * stride_yg + rm[:, None].to(tl.int64) * stride_y + rn[None, :]
    if OUT_BF16:
        tl.store(y, to_bf16(acc), mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(y, acc, mask=m_ok[:, None] & n_ok[None, :])


FP8_GEMM_CONFIGS = {
    # name: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)
    "m128n128": (128, 128, 128, 8, 8, 3),
    "m128n256": (128, 256, 128, 8, 8, 3),
    "m64n128": (64, 128, 128, 8, 4, 4),
    "small": (32, 64, 128, 4, 4, 2),
}


def fp8_block_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                   out_dtype: torch.dtype = torch.bfloat16, config: str = "m128n128") -> torch.Tensor:
    """``y [M, N] = (x_q · s_x) @ (W_q · s_w)ᵀ`` with fp32 accumulation.

    Args:
        xq: E4M3 activations ``[M, K]``; x_scale: fp32 ``[M, ceil(K/128)]`` (from :func:`quantize_activations`).
        w: E4M3 weight ``[N, K]``; w_scale: E8M0 ``[ceil(N/128), ceil(K/128)]`` (``float8_e8m0fnu`` or uint8).
        config: a key of :data:`FP8_GEMM_CONFIGS` (launch geometry).
    """
    M, K = xq.shape
    N, Kw = w.shape
    assert Kw == K, f"fp8_block_gemm: x is [.., {K}] but the weight is [{N}, {Kw}]"
    assert xq.dtype == torch.float8_e4m3fn and w.dtype == torch.float8_e4m3fn, "fp8_block_gemm: E4M3 operands"
    assert xq.stride(-1) == 1 and w.stride(-1) == 1, "fp8_block_gemm: operands must be contiguous along K"
    assert tuple(x_scale.shape) == (M, triton.cdiv(K, 128)), f"x_scale {list(x_scale.shape)}"
    assert tuple(w_scale.shape) == (triton.cdiv(N, 128), triton.cdiv(K, 128)), f"w_scale {list(w_scale.shape)}"
    assert out_dtype in (torch.bfloat16, torch.float32), f"fp8_block_gemm: out_dtype {out_dtype}"
    bm, bn, bk, gm, warps, stages = FP8_GEMM_CONFIGS[config]
    assert 128 % bk == 0, "BLOCK_K must divide the 128-wide scale block"
    ws = w_scale.view(torch.uint8) if w_scale.dtype != torch.uint8 else w_scale
    y = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    if M == 0:
        return y
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), 1)
    _fp8_gemm_kernel[grid](xq, x_scale, w, ws, y, M, N, K, xq.stride(0), 0, x_scale.stride(0), w.stride(0),
                           ws.stride(0), y.stride(0), 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm,
                           X_BF16=False, UPCAST=interpreting(), OUT_BF16=out_dtype == torch.bfloat16,
                           num_warps=warps, num_stages=stages)
    return y


def grouped_bf16_fp8_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, groups: int,
                          config: str = "m128n128") -> torch.Tensor:
    """The grouped output projection ``wo_a`` at large M: ``x [M, G, K]`` (bf16, not quantized: the reference
    applies ``wo_a`` as a bf16 einsum) times ``W[g·N:(g+1)·N, :]ᵀ`` per group, FP8 weight upcast exactly to bf16
    in-kernel with its 128×128 scale applied per K block; fp32 accumulation, ``[M, G, N]`` bf16 out."""
    M, G, K = x.shape
    assert G == groups and w.shape[0] % groups == 0 and w.shape[1] == K, \
        f"grouped GEMM: x {list(x.shape)}, weight {list(w.shape)}, groups {groups}"
    assert x.dtype == torch.bfloat16 and w.dtype == torch.float8_e4m3fn, "grouped GEMM: bf16 x, E4M3 weight"
    assert x.stride(-1) == 1 and w.stride(-1) == 1, "grouped GEMM: operands contiguous along K"
    N = w.shape[0] // groups
    bm, bn, bk, gm, warps, stages = FP8_GEMM_CONFIGS[config]
    ws = w_scale.view(torch.uint8) if w_scale.dtype != torch.uint8 else w_scale
    y = torch.empty(M, G, N, dtype=torch.bfloat16, device=x.device)
    if M == 0:
        return y
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), G)
    _fp8_gemm_kernel[grid](x, x, w, ws, y, M, N, K, x.stride(0), x.stride(1), 0, w.stride(0), ws.stride(0),
                           y.stride(0), y.stride(1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, X_BF16=True,
                           UPCAST=interpreting(), OUT_BF16=True, num_warps=warps, num_stages=stages)
    return y


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, config: str = "m128n128") -> torch.Tensor:
    """The reference's FP8 projection ``x [..., K] → [..., N]`` (bf16 out): quantize, then the block GEMM."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # a view when the rows are evenly strided (padding columns are never read)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    qa = quantize_activations(x2)
    y = fp8_block_gemm(qa["q"], qa["scale"], w, w_scale, config=config)
    return y.reshape(*lead, w.shape[0])
