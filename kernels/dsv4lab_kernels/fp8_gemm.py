"""Dense projections at prefill sizes: the reference's activation quantizer, the FP8 block-scaled GEMM (Triton or
cuBLAS), and the weight-stationary GEMM for bf16 activations (BF16 weights, or FP8 weights upcast in-kernel).

**FP8 projections** (``ReferenceOps.linear`` with activation quantization): the reference applies
``act_qdq_fp8(x) @ dequant(W)ᵀ`` — activations quantized per token per 128-wide K block to E4M3 with a power-of-two
scale ``2^ceil(log2(max(amax, 1e-4)/448))``, weights E4M3 with one E8M0 scale per 128×128 block. Both factors are
exact, so

    y[m, n] = Σ_kb (x_q[m, kb] · W_q[n, kb]) · s_x[m, kb] · s_w[n // 128, kb]

with the inner dot on FP8 tensor cores and the two scales applied to the fp32 partial once per 128-wide K block
(DeepSeek's block-FP8 scheme; the "promotion" that also bounds the error of Hopper's reduced-precision FP8
accumulator, see ``docs/kernels_prefill.md``, Numerics). :func:`fp8_linear` runs it on the Triton kernel below
or, ``backend="cublas"``, on ``torch._scaled_mm`` with the same scales (1×128 activation and 128×128 weight blocks,
cuBLAS ≥ 12.9 on sm_90): the same products promoted per 128-K block, so the same error bound holds.

**BF16 activations** (``linear`` of a BF16 weight or without activation quantization, ``linear_f32``, the grouped
``wo_a``): :func:`weight_gemm` computes ``yᵀ = W · xᵀ`` tile by tile — the weight tile is the MMA's first
operand, so an FP8 weight is upcast in registers (E4M3 × 2^s is exact in bf16) without a trip through shared
memory, and the activations stream in as the second operand. fp32 accumulation; bf16 (RNE) or fp32 out.
:func:`cublas_weight_gemm` is the same product on cuBLAS (an FP8 weight dequantized exactly to bf16 first, an
fp32-output GEMM rounded once), probed once per process by :func:`cublas_bf16_available`.

:func:`quantize_activations` is the reference quantizer as a kernel. Besides ``x_q`` and the per-128 scales (row-
or column-major: cuBLAS wants the latter) it can emit the layouts the grouped FP4 MoE GEMM consumes
(``kernels/dsv4lab_kernels/fp4_moe_grouped.py``): the dequantized values in bf16 (exact: an E4M3 value times a power of two fits
bf16) with the even K columns first and the odd ones second (so a packed FP4 byte's low nibble meets ``x[:, :K/2]``
and its high nibble ``x[:, K/2:]``), the FP8 values in that split order, and the scales replicated per 32 as E8M0
bytes (``tl.dot_scaled``'s layout).

Exact device-side codecs come from ``kernels/dsv4lab_kernels/formats.py``; :func:`pow2_exponent`, :func:`to_bf16` and
:func:`quantize_block_fp8` (the reference quantizer's pieces) are shared with the other prefill kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .formats import e8m0_to_f32, fp8_act_exponent, interpreting, pow2, round_to_bf16, round_to_e4m3
from .rowops import DeviceProbe

ACT_BLOCK = 128
FP8_MAX = 448.0
BACKENDS = ("triton", "cublas")


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
                      M, M_OUT, K, stride_x, stride_q, stride_sm, stride_sk, stride_ds, stride_qs, stride_s32,
                      BLOCK_M: tl.constexpr, WRITE_Q: tl.constexpr, WRITE_DEQ_SPLIT: tl.constexpr,
                      WRITE_Q_SPLIT: tl.constexpr, WRITE_S32: tl.constexpr):
    pid_m = tl.program_id(0)
    kb = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = kb * 128 + tl.arange(0, 128)
    row_in = rm < M  # rows M … M_OUT − 1 are padding the caller asked for: they quantize to zeros
    row_out = rm < M_OUT
    k_ok = rk < K
    x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + rk[None, :], mask=row_in[:, None] & k_ok[None, :],
                other=0.0).to(tl.float32)
    e = pow2_exponent(tl.max(tl.abs(x), axis=1))
    q = quantize_block_fp8(x, e[:, None])
    scale = pow2(e)
    tl.store(s_ptr + rm.to(tl.int64) * stride_sm + kb * stride_sk, scale, mask=row_out)
    m_out = row_out[:, None] & k_ok[None, :]
    if WRITE_Q:
        tl.store(q_ptr + rm[:, None].to(tl.int64) * stride_q + rk[None, :], q, mask=m_out)
    split_col = (rk % 2) * (K // 2) + rk // 2  # even column 2c → c, odd column 2c+1 → K/2 + c
    if WRITE_DEQ_SPLIT:
        tl.store(deq_split_ptr + rm[:, None].to(tl.int64) * stride_ds + split_col[None, :],
                 to_bf16(q.to(tl.float32) * scale[:, None]), mask=m_out)
    if WRITE_Q_SPLIT:
        tl.store(q_split_ptr + rm[:, None].to(tl.int64) * stride_qs + split_col[None, :], q, mask=m_out)
    if WRITE_S32:
        # the per-128 scale as E8M0 bytes, once per 32 columns (the layout tl.dot_scaled reads)
        sub = tl.arange(0, 4)
        byte = (e + 127).to(tl.uint8)
        m32 = row_out[:, None] & (kb * 128 + 32 * sub < K)[None, :]
        tl.store(s32_ptr + rm[:, None].to(tl.int64) * stride_s32 + kb * 4 + sub[None, :],
                 tl.broadcast_to(byte[:, None], (BLOCK_M, 4)), mask=m32)


def quantize_activations(x: torch.Tensor, *, q: bool = True, deq_split: bool = False, q_split: bool = False,
                         scales32: bool = False, scale_cols: bool = False, rows_out: int | None = None,
                         block_m: int = 32) -> dict[str, torch.Tensor]:
    """Quantize ``x [M, K]`` (bf16/fp32) per token per 128 columns, as ``dsv4lab.core.quant.act_quant_fp8``.

    Returns a dict with ``scale`` (fp32 ``[M, ceil(K/128)]``, powers of two; column-major storage when
    ``scale_cols``) and, as asked: ``q`` (E4M3 ``[M, K]``), ``deq_split`` (bf16 ``[M, K]``: dequantized values,
    even columns then odd columns), ``q_split`` (E4M3 in that split order), ``scale32`` (uint8 E8M0
    ``[M, ceil(K/32)]``, each per-128 scale repeated for its four 32-column groups). ``rows_out`` (≥ M) pads every
    output with zero rows (cuBLAS wants M a multiple of 4).
    """
    if x.ndim != 2:
        raise ValueError(f"quantize_activations: x must be [M, K], got {list(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"quantize_activations: x dtype {x.dtype}, expected bfloat16 or float32")
    if x.stride(-1) != 1:
        raise ValueError("quantize_activations: x must be contiguous along K")
    M, K = x.shape
    if (deq_split or q_split) and K % 2:
        raise ValueError(f"quantize_activations: split layouts need an even K, got {K}")
    M_out = M if rows_out is None else rows_out
    if M_out < M:
        raise ValueError(f"quantize_activations: rows_out {M_out} < M {M}")
    nkb = triton.cdiv(K, ACT_BLOCK)
    dev = x.device
    scale = torch.empty(nkb, M_out, dtype=torch.float32, device=dev).t() if scale_cols else \
        torch.empty(M_out, nkb, dtype=torch.float32, device=dev)
    out = {"scale": scale}
    if q:
        out["q"] = torch.empty(M_out, K, dtype=torch.float8_e4m3fn, device=dev)
    if deq_split:
        out["deq_split"] = torch.empty(M_out, K, dtype=torch.bfloat16, device=dev)
    if q_split:
        out["q_split"] = torch.empty(M_out, K, dtype=torch.float8_e4m3fn, device=dev)
    if scales32:
        out["scale32"] = torch.empty(M_out, triton.cdiv(K, 32), dtype=torch.uint8, device=dev)
    if M_out == 0:
        return out
    dummy = torch.empty(1, 1, dtype=torch.float32, device=dev)
    qt, ds, qs, s32 = (out.get(k, dummy) for k in ("q", "deq_split", "q_split", "scale32"))
    grid = (triton.cdiv(M_out, block_m), nkb)
    _act_quant_kernel[grid](x, qt, scale, ds, qs, s32, M, M_out, K, x.stride(0), qt.stride(0), scale.stride(0),
                            scale.stride(1), ds.stride(0), qs.stride(0), s32.stride(0),
                            BLOCK_M=block_m, WRITE_Q=q, WRITE_DEQ_SPLIT=deq_split, WRITE_Q_SPLIT=q_split,
                            WRITE_S32=scales32)
    return out


# ============================================================================================ FP8 × FP8 GEMM
@triton.jit
def _fp8_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, K,
                     stride_x, stride_xs, stride_w, stride_ws, stride_y,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     UPCAST: tl.constexpr, OUT_BF16: tl.constexpr):
    pid = tl.program_id(0)
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
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_x
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_w
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        x = tl.load(x_rows + (k0 + rk)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + (k0 + rk)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            part = tl.dot(x, tl.trans(w))
        kb = k0 // 128
        sw = e8m0_to_f32(tl.load(ws_ptr + (rn // 128) * stride_ws + kb, mask=n_ok, other=127).to(tl.int32))
        sx = tl.load(xs_ptr + rm.to(tl.int64) * stride_xs + kb, mask=m_ok, other=0.0)
        acc += part * sx[:, None] * sw[None, :]  # promotion: both scales once per 128-wide K block
    y = y_ptr + rm[:, None].to(tl.int64) * stride_y + rn[None, :]
    if OUT_BF16:
        tl.store(y, to_bf16(acc), mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(y, acc, mask=m_ok[:, None] & n_ok[None, :])


FP8_GEMM_CONFIGS = {
    # name: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages); BLOCK_K must divide the 128 scale block
    "m128n128": (128, 128, 128, 8, 8, 3),
    "m128n256": (128, 256, 128, 8, 8, 3),
    "m64n128": (64, 128, 128, 8, 4, 4),
    "small": (32, 64, 128, 4, 4, 2),
}


def fp8_block_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                   out_dtype: torch.dtype = torch.bfloat16, config: str = "m128n128") -> torch.Tensor:
    """``y [M, N] = (x_q · s_x) @ (W_q · s_w)ᵀ`` with fp32 accumulation (Triton).

    Args:
        xq: E4M3 activations ``[M, K]``; x_scale: fp32 ``[M, ceil(K/128)]`` (from :func:`quantize_activations`).
        w: E4M3 weight ``[N, K]``; w_scale: E8M0 ``[ceil(N/128), ceil(K/128)]`` (``float8_e8m0fnu`` or uint8).
        config: a key of :data:`FP8_GEMM_CONFIGS` (launch geometry).
    """
    M, K = xq.shape
    N, Kw = w.shape
    if Kw != K:
        raise ValueError(f"fp8_block_gemm: x is [.., {K}] but the weight is [{N}, {Kw}]")
    if xq.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_block_gemm: E4M3 operands expected, got {xq.dtype} and {w.dtype}")
    if xq.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("fp8_block_gemm: operands must be contiguous along K")
    if tuple(x_scale.shape) != (M, triton.cdiv(K, 128)):
        raise ValueError(f"fp8_block_gemm: x_scale {list(x_scale.shape)}, expected [{M}, {triton.cdiv(K, 128)}]")
    if tuple(w_scale.shape) != (triton.cdiv(N, 128), triton.cdiv(K, 128)):
        raise ValueError(f"fp8_block_gemm: w_scale {list(w_scale.shape)}, expected "
                         f"[{triton.cdiv(N, 128)}, {triton.cdiv(K, 128)}]")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"fp8_block_gemm: out_dtype {out_dtype}, expected bfloat16 or float32")
    bm, bn, bk, gm, warps, stages = FP8_GEMM_CONFIGS[config]
    if x_scale.stride(1) != 1:  # column-major scales (the cuBLAS layout) are read row-wise here
        x_scale = x_scale.contiguous()
    ws = w_scale.view(torch.uint8) if w_scale.dtype != torch.uint8 else w_scale
    y = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    if M == 0:
        return y
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _fp8_gemm_kernel[grid](xq, x_scale, w, ws, y, M, N, K, xq.stride(0), x_scale.stride(0), w.stride(0),
                           ws.stride(0), y.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm,
                           UPCAST=interpreting(), OUT_BF16=out_dtype == torch.bfloat16,
                           num_warps=warps, num_stages=stages)
    return y


# ============================================================================================ cuBLAS FP8 path
def cublas_block_fp8_available(device) -> bool:
    """Whether ``torch._scaled_mm`` takes DeepSeek's 1×128 / 128×128 block scales here (cuBLAS ≥ 12.9, sm_90).
    Probed once per process with a small product checked against the Triton kernel's."""
    if interpreting() or torch.device(device).type != "cuda":
        return False
    return _CUBLAS_PROBE.works(device)


def cublas_unavailable_reason(device) -> str:
    return _CUBLAS_PROBE.status(device)


def _probe_cublas(device) -> bool | str:
    if torch.cuda.get_device_capability(device) != (9, 0):
        return f"compute capability {torch.cuda.get_device_capability(device)}: the block-scaled path is sm_90's"
    g = torch.Generator(device=device).manual_seed(0)
    # K = 512: four 128-wide K blocks (see cublas_eligible); N = 384: an odd number of 128-row weight blocks
    x = torch.randn(8, 512, device=device, generator=g).to(torch.bfloat16)
    w = (torch.randn(384, 512, device=device, generator=g) * 32).to(torch.float8_e4m3fn)
    ws = torch.randint(118, 122, (3, 4), dtype=torch.uint8, device=device)
    try:
        qa = quantize_activations(x, scale_cols=True)
        got = _cublas_gemm(qa["q"], qa["scale"], w, weight_scale_f32(ws), torch.float32)
    except (RuntimeError, TypeError, ValueError) as err:
        return f"torch._scaled_mm refused block scales: {' '.join(str(err).split())[:200]}"
    want = fp8_block_gemm(qa["q"], qa["scale"], w, ws, torch.float32, config="small")
    # both accumulate 128-wide blocks on FP8 tensor cores (about 14 bits per add): twice γ₁₂₈ at 2^-13 of Σ|terms|
    xd = qa["q"].float() * qa["scale"].repeat_interleave(128, 1)
    wd = w.float() * weight_scale_f32(ws).t().repeat_interleave(128, 0).repeat_interleave(128, 1)
    if not bool(((got - want).abs() <= 2 ** -5 * (xd.abs() @ wd.abs().T)).all()):
        return "torch._scaled_mm block scales gave a different product than the Triton kernel"
    return True


_CUBLAS_PROBE = DeviceProbe(_probe_cublas, ok_word="available")


def weight_scale_f32(w_scale: torch.Tensor) -> torch.Tensor:
    """E8M0 weight scales ``[N/128, K/128]`` as the fp32 operand ``torch._scaled_mm`` reads (``[K/128, N/128]``,
    a transposed view). Exact: every E8M0 value is an fp32 power of two."""
    b = w_scale.view(torch.uint8) if w_scale.dtype != torch.uint8 else w_scale
    return torch.ldexp(torch.ones_like(b, dtype=torch.float32), b.to(torch.int32) - 127).t()


def _cublas_gemm(xq, x_scale_cols, w, w_scale_f32_t, out_dtype):
    y = torch._scaled_mm(xq, w.t(), scale_a=x_scale_cols, scale_b=w_scale_f32_t, out_dtype=out_dtype,
                         use_fast_accum=False)
    return y[0] if isinstance(y, tuple) else y


def cublas_eligible(M: int, N: int, K: int) -> bool:
    """Shapes cuBLAS's block-scaled path takes as they are: N a multiple of 128 and K of 512. cuBLASLt reads the
    weight's 128×128 scales K-block-major with that dimension padded to a multiple of 4, which is the unpadded
    layout exactly when K/128 is a multiple of 4 (every projection of DeepSeek-V4 is: K ∈ {1024, 2048, 4096,
    8192}). (The first probe used K = 256 and read its 2×2 scales misaligned: "a different product".)"""
    return N % 128 == 0 and K % 512 == 0 and M > 0


# ============================================================================================ FP8 linear
def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, config: str = "m128n128",
               backend: str = "triton", out_dtype: torch.dtype = torch.bfloat16,
               w_scale_f32: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's FP8 projection ``x [..., K] → [..., N]``: quantize, then the block GEMM.

    ``backend="cublas"`` runs the GEMM on ``torch._scaled_mm`` (where :func:`cublas_block_fp8_available` and
    :func:`cublas_eligible`; the Triton kernel otherwise) with ``w_scale_f32`` = :func:`weight_scale_f32` of the
    weight (computed here when not given: cache it per weight). ``out_dtype=float32`` returns the unrounded fp32
    result (a tensor-parallel partial sum is rounded after the all-reduce)."""
    if backend not in BACKENDS:
        raise ValueError(f"fp8_linear: backend {backend!r}, expected one of {', '.join(BACKENDS)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # a view when the rows are evenly strided (padding columns are never read)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, K = x2.shape
    N = w.shape[0]
    if backend == "cublas" and cublas_eligible(M, N, K) and cublas_block_fp8_available(x.device):
        M4 = -(-M // 4) * 4  # cuBLASLt wants M a multiple of 4: zero rows, sliced off
        qa = quantize_activations(x2, scale_cols=True, rows_out=M4)
        sw = w_scale_f32 if w_scale_f32 is not None else weight_scale_f32(w_scale)
        y = _cublas_gemm(qa["q"], qa["scale"], w, sw, out_dtype)[:M]
    else:
        qa = quantize_activations(x2)
        y = fp8_block_gemm(qa["q"], qa["scale"], w, w_scale, out_dtype=out_dtype, config=config)
    return y.reshape(*lead, N)


# ============================================================================================ shared expert
@triton.jit
def _fp8_gate_up_kernel(x_ptr, xs_ptr, w1_ptr, ws1_ptr, w3_ptr, ws3_ptr, h_ptr, hs_ptr, M, N, K, limit,
                        stride_x, stride_xs, stride_w, stride_ws, stride_h, stride_hs, stride_hs_n,
                        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        FUSE: tl.constexpr, UPCAST: tl.constexpr):
    """g = x·W1ᵀ and u = x·W3ᵀ for a 128-column tile, then the reference's SwiGLU and the FP8 quantization of h
    for the down projection (the tile is the 128-wide quantization block). ``FUSE=False`` stores the bf16-rounded
    g (to ``h_ptr``) and u (to ``hs_ptr``) as fp32 instead: the stages checked one by one."""
    BLOCK_N: tl.constexpr = 128
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
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
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_x
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        x = tl.load(x_rows + (k0 + rk)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w1 = tl.load(w1_ptr + rn[:, None].to(tl.int64) * stride_w + (k0 + rk)[None, :],
                     mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        w3 = tl.load(w3_ptr + rn[:, None].to(tl.int64) * stride_w + (k0 + rk)[None, :],
                     mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            pg = tl.dot(x.to(tl.float32), tl.trans(w1.to(tl.float32)))
            pu = tl.dot(x.to(tl.float32), tl.trans(w3.to(tl.float32)))
        else:
            pg = tl.dot(x, tl.trans(w1))
            pu = tl.dot(x, tl.trans(w3))
        kb = k0 // 128
        sx = tl.load(xs_ptr + rm.to(tl.int64) * stride_xs + kb, mask=m_ok, other=0.0)
        s1 = e8m0_to_f32(tl.load(ws1_ptr + pid_n * stride_ws + kb).to(tl.int32))  # one 128×128 block per tile
        s3 = e8m0_to_f32(tl.load(ws3_ptr + pid_n * stride_ws + kb).to(tl.int32))
        acc_g += pg * (sx * s1)[:, None]
        acc_u += pu * (sx * s3)[:, None]
    # the reference: g, u rounded to bf16 (Linear outputs); clamped SwiGLU in fp32 with SiLU in fp64 rounded once
    # (ReferenceOps.elementwise); h rounded to bf16; then act_quant_fp8(h) per 128 columns for W2
    g = to_bf16(acc_g).to(tl.float32)
    u = to_bf16(acc_u).to(tl.float32)
    keep = m_ok[:, None] & n_ok[None, :]
    if FUSE:
        if limit > 0:
            u = tl.minimum(tl.maximum(u, -limit), limit)
            g = tl.minimum(g, limit)
        gd = g.to(tl.float64)
        silu = (gd / (1.0 + tl.exp(-gd))).to(tl.float32)
        h = tl.where(keep, to_bf16(silu * u).to(tl.float32), 0.0)
        e = pow2_exponent(tl.max(tl.abs(h), axis=1))
        tl.store(h_ptr + rm[:, None].to(tl.int64) * stride_h + rn[None, :], quantize_block_fp8(h, e[:, None]),
                 mask=keep)
        tl.store(hs_ptr + rm.to(tl.int64) * stride_hs + pid_n * stride_hs_n, pow2(e), mask=m_ok)
    else:
        tl.store(h_ptr + rm[:, None].to(tl.int64) * stride_h + rn[None, :], g, mask=keep)
        tl.store(hs_ptr + rm[:, None].to(tl.int64) * stride_hs + rn[None, :] * stride_hs_n, u, mask=keep)


def fp8_gate_up(x: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor,
                limit: float, fuse: bool = True, config: str = "m128n128", scale_cols: bool = False,
                rows_out: int | None = None):
    """The shared expert's gate/up projections of ``x [M, D]`` (bf16). ``fuse=True``: ``(h_q, h_scale)``, the
    clamped-SwiGLU output FP8-quantized per 128 columns as the reference's ``w2`` input (``h_scale`` column-major
    when ``scale_cols``, cuBLAS's layout; ``rows_out`` ≥ M pads both with zero rows of scale 1);
    ``fuse=False``: ``(g, u)`` fp32 ``[M, N]`` (each bf16-rounded)."""
    if x.ndim != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"fp8_gate_up: x must be bf16 [M, D], got {x.dtype} {list(x.shape)}")
    M, D = x.shape
    N = w1.shape[0]
    if tuple(w1.shape) != (N, D) or tuple(w3.shape) != (N, D):
        raise ValueError(f"fp8_gate_up: w1 {list(w1.shape)}, w3 {list(w3.shape)} for x [{M}, {D}]")
    bm, _, bk, gm, warps, stages = FP8_GEMM_CONFIGS[config]
    x = x if x.stride(-1) == 1 else x.contiguous()
    dev = x.device
    if fuse:
        M_out = rows_out or M
        h = torch.empty(M_out, N, dtype=torch.float8_e4m3fn, device=dev)
        if scale_cols:
            hs = torch.empty(triton.cdiv(N, 128), M_out, dtype=torch.float32, device=dev).t()
        else:
            hs = torch.empty(M_out, triton.cdiv(N, 128), dtype=torch.float32, device=dev)
        if M_out > M:
            h[M:].view(torch.uint8).zero_()
            hs[M:] = 1.0
    else:
        h, hs = (torch.full((M, N), float("nan"), dtype=torch.float32, device=dev) for _ in range(2))
    if M == 0:
        return h, hs
    qa = quantize_activations(x)
    u8 = [t.view(torch.uint8) if t.dtype != torch.uint8 else t for t in (s1, s3)]
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, 128),)
    _fp8_gate_up_kernel[grid](qa["q"], qa["scale"], w1, u8[0], w3, u8[1], h, hs, M, N, D, float(limit),
                              qa["q"].stride(0), qa["scale"].stride(0), w1.stride(0), u8[0].stride(0), h.stride(0),
                              hs.stride(0), hs.stride(1), BLOCK_M=bm, BLOCK_K=bk, GROUP_M=gm, FUSE=fuse,
                              UPCAST=interpreting(), num_warps=warps, num_stages=stages)
    return h, hs


def fp8_swiglu_mlp(x: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor,
                   w2: torch.Tensor, s2: torch.Tensor, limit: float, config: str = "m128n128",
                   backend: str = "triton", w2_scale_f32: torch.Tensor | None = None) -> torch.Tensor:
    """``ReferenceOps.expert_mlp`` of an FP8 expert (the shared expert) at prefill sizes: ``x [M, D]`` bf16 →
    ``[M, D]`` bf16. Gate/up in one kernel ending in the clamped SwiGLU and the FP8 quantization of h
    (:func:`fp8_gate_up`), then the down projection on :func:`fp8_block_gemm` (or cuBLAS, ``backend="cublas"``,
    as :func:`fp8_linear`)."""
    M, D = x.shape
    N = w1.shape[0]
    if tuple(w2.shape) != (D, N):
        raise ValueError(f"fp8_swiglu_mlp: w2 {list(w2.shape)}, expected [{D}, {N}]")
    if M == 0:
        return torch.empty(0, D, dtype=torch.bfloat16, device=x.device)
    use_cublas = backend == "cublas" and cublas_eligible(M, D, N) and cublas_block_fp8_available(x.device)
    # cuBLASLt wants M a multiple of 4: zero rows, sliced off
    h, hs = fp8_gate_up(x, w1, s1, w3, s3, limit, config=config, scale_cols=use_cublas,
                        rows_out=-(-M // 4) * 4 if use_cublas else None)
    if use_cublas:
        sw = w2_scale_f32 if w2_scale_f32 is not None else weight_scale_f32(s2)
        return _cublas_gemm(h, hs, w2, sw, torch.bfloat16)[:M]
    return fp8_block_gemm(h, hs, w2, s2, config=config)


# ============================================================================================ weight-stationary GEMM
@triton.jit
def _weight_gemm_kernel(x_ptr, w_ptr, ws_ptr, y_ptr, M, N, K,
                        stride_xm, stride_xg, stride_wn, stride_ws, stride_ym, stride_yg,
                        BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
                        W_FP8: tl.constexpr, UPCAST: tl.constexpr, OUT_BF16: tl.constexpr):
    """``yᵀ[n, m] = Σ_k W[grp·N + n, k] · x[m, grp, k]``: the weight tile is the MMA's first operand."""
    pid = tl.program_id(0)
    grp = tl.program_id(1)  # weight group (grouped wo_a): rows grp·N … grp·N + N − 1 of the weight
    num_n = tl.cdiv(N, BLOCK_N)
    num_m = tl.cdiv(M, BLOCK_M)
    # GROUP_N weight tiles visit every token tile before the next ones start: each weight tile is read from DRAM
    # once while the activations (far smaller than L2 at prefill sizes) are re-read from L2
    group = GROUP_N * num_m
    first_n = (pid // group) * GROUP_N
    size_n = tl.minimum(num_n - first_n, GROUP_N)
    pid_n = first_n + (pid % group) % size_n
    pid_m = (pid % group) // size_n
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    w_row = grp * N + rn
    w_rows = w_ptr + w_row[:, None].to(tl.int64) * stride_wn
    x_cols = x_ptr + grp.to(tl.int64) * stride_xg + rm[None, :].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        w = tl.load(w_rows + (k0 + rk)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        xt = tl.load(x_cols + (k0 + rk)[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        if W_FP8:
            # E4M3 × 2^s is exact in bf16 (3 → 8 mantissa bits, the scale a power of two): fold the 128×128 block
            # scale into the upcast and the K loop keeps one fp32 accumulator with no per-block promotion
            sw = e8m0_to_f32(tl.load(ws_ptr + (w_row // 128) * stride_ws + k0 // 128, mask=n_ok,
                                     other=127).to(tl.int32))
            w = (w.to(tl.float32) * sw[:, None]).to(tl.bfloat16)
        if UPCAST:  # the CPU interpreter computes bf16 dots wrongly: feed it fp32 (the values are bf16-exact)
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc)
        else:
            acc = tl.dot(w, xt, acc)
    y = y_ptr + grp.to(tl.int64) * stride_yg + rm[None, :].to(tl.int64) * stride_ym + rn[:, None]
    if OUT_BF16:
        tl.store(y, to_bf16(acc), mask=n_ok[:, None] & m_ok[None, :])
    else:
        tl.store(y, acc, mask=n_ok[:, None] & m_ok[None, :])


WEIGHT_GEMM_CONFIGS = {
    # name: (BLOCK_N (weight rows), BLOCK_M (tokens), BLOCK_K, GROUP_N, num_warps, num_stages); BLOCK_K | 128
    # (128, 128, 64, 8, 8, 3) is not offered: on the H200 (triton 3.6) it returned different, non-finite bits on
    # each of 20 calls with one input while these four returned one result (scripts/diag_gemm_determinism.py,
    # data/results/h200/gemm_determinism.json) — a race in the generated code; the kernel has no cross-program
    # communication
    "n128m256": (128, 256, 64, 8, 8, 3),
    "n256m128": (256, 128, 64, 4, 8, 3),
    "n128m64": (128, 64, 64, 8, 4, 4),
    "small": (64, 32, 64, 4, 4, 2),
}


def weight_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.bfloat16, groups: int = 1, config: str = "n128m64") -> torch.Tensor:
    """``y = x @ Wᵀ`` for bf16 activations: ``x [M, K]`` (or ``[M, G, K]`` with ``groups = G``, the grouped
    ``wo_a``: group ``g`` uses weight rows ``g·N … g·N + N − 1``), ``w`` bf16 ``[G·N, K]`` or E4M3 with E8M0
    ``w_scale [ceil(G·N/128), ceil(K/128)]``. fp32 accumulation; ``out_dtype`` bf16 (RNE) or fp32.
    Returns ``[M, N]`` (``[M, G, N]`` when grouped)."""
    grouped = x.ndim == 3
    if not (x.ndim == 2 or grouped):
        raise ValueError(f"weight_gemm: x must be [M, K] or [M, G, K], got {list(x.shape)}")
    G = x.shape[1] if grouped else 1
    if G != groups:
        raise ValueError(f"weight_gemm: x has {G} groups, expected {groups}")
    M, K = x.shape[0], x.shape[-1]
    if w.shape[0] % groups or w.shape[1] != K:
        raise ValueError(f"weight_gemm: x {list(x.shape)} and weight {list(w.shape)} with {groups} group(s)")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"weight_gemm: x dtype {x.dtype}, expected bfloat16")
    w_fp8 = w.dtype == torch.float8_e4m3fn
    if not (w_fp8 or w.dtype == torch.bfloat16):
        raise ValueError(f"weight_gemm: weight dtype {w.dtype}, expected bfloat16 or float8_e4m3fn")
    if w_fp8 and (w_scale is None or tuple(w_scale.shape) != (triton.cdiv(w.shape[0], 128), triton.cdiv(K, 128))):
        raise ValueError(f"weight_gemm: an E4M3 weight {list(w.shape)} needs its 128×128 scales, got "
                         f"{None if w_scale is None else list(w_scale.shape)}")
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("weight_gemm: x and the weight must be contiguous along K")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"weight_gemm: out_dtype {out_dtype}, expected bfloat16 or float32")
    N = w.shape[0] // groups
    bn, bm, bk, gn, warps, stages = WEIGHT_GEMM_CONFIGS[config]
    y = torch.empty((M, groups, N) if grouped else (M, N), dtype=out_dtype, device=x.device)
    if M == 0:
        return y
    ws = w if not w_fp8 else (w_scale.view(torch.uint8) if w_scale.dtype != torch.uint8 else w_scale)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), groups)
    _weight_gemm_kernel[grid](x, w, ws, y, M, N, K, x.stride(0), x.stride(1) if grouped else 0, w.stride(0),
                              ws.stride(0) if w_fp8 else 0, y.stride(0), y.stride(1) if grouped else 0,
                              BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk, GROUP_N=gn, W_FP8=w_fp8, UPCAST=interpreting(),
                              OUT_BF16=out_dtype == torch.bfloat16, num_warps=warps, num_stages=stages)
    return y


# ============================================================================================ cuBLAS bf16 path
@triton.jit
def _dequant_fp8_kernel(w_ptr, ws_ptr, o_ptr, N, K, stride_w, stride_ws, stride_o, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    m = (rn < N)[:, None] & (rk < K)[None, :]
    w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_w + rk[None, :], mask=m, other=0.0).to(tl.float32)
    sw = e8m0_to_f32(tl.load(ws_ptr + (rn // 128)[:, None] * stride_ws + (rk // 128)[None, :], mask=m,
                             other=127).to(tl.int32))
    tl.store(o_ptr + rn[:, None].to(tl.int64) * stride_o + rk[None, :], (w * sw).to(tl.bfloat16), mask=m)


def dequant_fp8_weight(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """An E4M3 weight ``[N, K]`` with its E8M0 128×128 block scales as bf16 — exact (3 → 8 mantissa bits, the
    scale a power of two), the operand of :func:`cublas_weight_gemm`."""
    N, K = w.shape
    ws = w_scale.view(torch.uint8) if w_scale.dtype != torch.uint8 else w_scale
    out = torch.empty(N, K, dtype=torch.bfloat16, device=w.device)
    if N and K:
        _dequant_fp8_kernel[(triton.cdiv(N, 64), triton.cdiv(K, 128))](w, ws, out, N, K, w.stride(0), ws.stride(0),
                                                                       out.stride(0), BLOCK_N=64, BLOCK_K=128)
    return out


def cublas_weight_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None = None,
                       out_dtype: torch.dtype = torch.bfloat16, groups: int = 1) -> torch.Tensor:
    """:func:`weight_gemm` on cuBLAS: the bf16 weight (an FP8 one dequantized exactly first,
    :func:`dequant_fp8_weight`) in an fp32-output GEMM — ``torch.mm``/``torch.bmm(..., out_dtype=float32)``: bf16
    tensor cores with an fp32 accumulator, the ``tc_bf16`` bound of the Triton kernel — rounded to ``out_dtype``
    once. (A bf16-output cuBLAS GEMM may reduce split-K partials in bf16 when torch allows reduced-precision
    reductions, its default: that would not be the reference's fp32 accumulation.) Same shapes as
    :func:`weight_gemm`."""
    wb = dequant_fp8_weight(w, w_scale) if w.dtype == torch.float8_e4m3fn else w
    if x.ndim == 2:
        y = torch.mm(x, wb.t(), out_dtype=torch.float32)
        return y if out_dtype == torch.float32 else y.to(out_dtype)
    M, G, K = x.shape
    N = wb.shape[0] // groups
    y = torch.bmm(x.transpose(0, 1), wb.view(groups, N, K).transpose(1, 2), out_dtype=torch.float32)  # [G, M, N]
    out = torch.empty(M, G, N, dtype=out_dtype, device=x.device)
    out.transpose(0, 1).copy_(y)
    return out


def cublas_bf16_available(device) -> bool:
    """Whether :func:`cublas_weight_gemm` runs here (``torch.mm``/``bmm`` with ``out_dtype=float32``) and agrees
    with :func:`weight_gemm` within twice the ``tc_bf16`` bound — probed once per process on small plain and
    grouped products with an FP8 weight."""
    if interpreting() or torch.device(device).type != "cuda":
        return False
    return _CUBLAS_BF16_PROBE.works(device)


def cublas_bf16_reason(device) -> str:
    return _CUBLAS_BF16_PROBE.status(device)


def _probe_cublas_bf16(device) -> bool | str:
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(40, 3, 256, device=device, generator=g).to(torch.bfloat16)
    w = (torch.randn(3 * 96, 256, device=device, generator=g) * 32).to(torch.float8_e4m3fn)
    ws = torch.randint(118, 122, (3, 2), dtype=torch.uint8, device=device)
    try:
        got = [cublas_weight_gemm(x, w, ws, torch.float32, 3), cublas_weight_gemm(x[:, 0], w, ws, torch.float32)]
    except (RuntimeError, TypeError, ValueError) as err:
        return f"torch.mm/bmm with out_dtype=float32 refused: {' '.join(str(err).split())[:200]}"
    want = [weight_gemm(x, w, ws, torch.float32, 3, config="small"), weight_gemm(x[:, 0], w, ws, torch.float32,
                                                                                 config="small")]
    wd = dequant_fp8_weight(w, ws).float()
    mags = [torch.einsum("mgk,gnk->mgn", x.float().abs(), wd.abs().view(3, 96, 256)), x[:, 0].float().abs()
            @ wd.abs().T]
    for a, b, mag in zip(got, want, mags):  # each within γ(2n, 2^-24)·Σ|terms|: twice that between the two
        if a.shape != b.shape or not bool(((a - b).abs() <= 4 * 256 * 2.0 ** -24 * mag + 1e-30).all()):
            return "torch.mm/bmm (bf16 in, fp32 out) gave a different product than the Triton kernel"
    return True


_CUBLAS_BF16_PROBE = DeviceProbe(_probe_cublas_bf16, ok_word="available")


def grouped_bf16_fp8_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, groups: int,
                          config: str = "n128m64") -> torch.Tensor:
    """The grouped output projection ``wo_a`` at large M: ``x [M, G, K]`` (bf16, not quantized: the reference
    applies ``wo_a`` as a bf16 einsum) times ``W[g·N:(g+1)·N, :]ᵀ`` per group → ``[M, G, N]`` bf16
    (:func:`weight_gemm`). The old FP8-GEMM configuration names map to the closest weight-stationary one."""
    cfg = config if config in WEIGHT_GEMM_CONFIGS else {"small": "small"}.get(config, "n128m64")
    return weight_gemm(x, w, w_scale, torch.bfloat16, groups, cfg)
