"""The Triton kernels of the routed-MoE decode (:mod:`dsv4lab_kernels.fp4_moe_decode` has the launchers, the
geometry and the module's account of the design; :mod:`~dsv4lab_kernels.fp4_moe_decode_reference` the oracles): the
E2M1 decodes (inline PTX on NVIDIA GPUs, portable Triton elsewhere, the scale-free byte-wise one), the per-chunk
arithmetic of each route, the gate/up, down (expert- and token-major) and combine kernels, the activations'
quantize-dequantize and the MoE's output sum."""
from __future__ import annotations

import triton
import triton.language as tl

from .formats import (RNE_MAGIC, e2m1_pair_times2_int, e2m1_pair_to_f32_scaled, e8m0_to_f32, quantize_fp8_block,
                      round_to_bf16)
from .launch import pdl_prologue


# ------------------------------------------------------------------------------------------------ E2M1 decode
# PTX on 4 packed bytes ($4) and two bf16x2 scale multipliers ($5: bytes 0,1; $6: bytes 2,3): the low nibbles
# become bf16 pairs $0 (bytes 0,1) and $1 (bytes 2,3), the high nibbles $2 and $3. prmt spreads two bytes into
# the two 16-bit halves; a code s·e1·e0·m lands as bf16 bits s<<15 | e1e0m<<6 = value·2^-126 (code 1, 0.5,
# becomes the subnormal 2^-127); mul.bf16x2 by 2^(s-1) is exact (≤ 2 significant bits, no overflow for s ≤ 128).
_E2M1_BF16_ASM = tl.constexpr("""
{
.reg .b32 v, t, m;
prmt.b32 v, $4, 0, 0x4140;
shl.b32 t, v, 6;
and.b32 m, t, 0x01C001C0;
shl.b32 t, v, 12;
lop3.b32 $0, t, 0x80008000, m, 0xEA;
mul.rn.bf16x2 $0, $0, $5;
shl.b32 t, v, 2;
and.b32 m, t, 0x01C001C0;
shl.b32 t, v, 8;
lop3.b32 $2, t, 0x80008000, m, 0xEA;
mul.rn.bf16x2 $2, $2, $5;
prmt.b32 v, $4, 0, 0x4342;
shl.b32 t, v, 6;
and.b32 m, t, 0x01C001C0;
shl.b32 t, v, 12;
lop3.b32 $1, t, 0x80008000, m, 0xEA;
mul.rn.bf16x2 $1, $1, $6;
shl.b32 t, v, 2;
and.b32 m, t, 0x01C001C0;
shl.b32 t, v, 8;
lop3.b32 $3, t, 0x80008000, m, 0xEA;
mul.rn.bf16x2 $3, $3, $6;
}
""")


# PTX on 4 packed bytes ($4), no scale: per byte the low nibble's code s·e1·e0·m becomes s<<7 | e1e0m<<1, the high
# byte of the fp16 E2M1·2^-14 (the low byte is zero: code 1, 0.5, is the subnormal 2^-15), four codes per operation;
# prmt moves bytes 0,1 / 2,3 into the high bytes of the fp16 pairs $0 / $1. The high nibbles: shift right by 3,
# sign in place, into $2 / $3.
_E2M1_F16_ASM = tl.constexpr("""
{
.reg .b32 t, m, r;
shl.b32 t, $4, 1;
shl.b32 m, $4, 4;
and.b32 m, m, 0x80808080;
lop3.b32 r, t, 0x0E0E0E0E, m, 0xEA;
prmt.b32 $0, r, 0, 0x1404;
prmt.b32 $1, r, 0, 0x3424;
shr.b32 t, $4, 3;
and.b32 m, $4, 0x80808080;
lop3.b32 r, t, 0x0E0E0E0E, m, 0xEA;
prmt.b32 $2, r, 0, 0x1404;
prmt.b32 $3, r, 0, 0x3424;
}
""")


@triton.jit
def decode_e2m1_unscaled(wb, ASM: tl.constexpr):
    """Packed bytes ``wb`` (uint8) → ``(lo, hi)`` fp32: ``E2M1 · 2^-14`` of the low and the high nibble, unscaled
    (the caller multiplies by :func:`e2m1_scale_operand` ``(sb, False)`` = ``2^(s-113)``). ``ASM``: the PTX above,
    else the portable fp16 codec (``formats.e2m1_pair_to_f32_scaled``)."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_E2M1_F16_ASM, "=r,=r,=r,=r,r", [wb], dtype=(tl.float16, tl.float16),
                                           is_pure=True, pack=4)
        return lo.to(tl.float32), hi.to(tl.float32)
    return e2m1_pair_to_f32_scaled(wb.to(tl.int32))


@triton.jit
def e2m1_scale_operand(sb, ASM: tl.constexpr):
    """E8M0 scale bytes (int32) → the operand :func:`decode_e2m1_bf16` multiplies by: bf16 ``2^(s-1)`` for the
    asm decode, fp32 ``2^(s-113)`` for the portable one; NaN for E8M0's NaN byte 255 (a poisoned scale poisons
    every weight it scales). Computed once per 32-group, before it is broadcast over the group's bytes."""
    if ASM:
        return tl.where(sb == 255, 0x7FC0, (sb + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return tl.where(sb == 255, 0x7FC00000, (sb + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def decode_e2m1_bf16(wb, scale, ASM: tl.constexpr):
    """Packed bytes ``wb`` (uint8) and their :func:`e2m1_scale_operand` (broadcast to ``wb``'s shape) →
    ``(lo, hi)`` bf16: the weights of the low and the high nibble (elements ``2c`` and ``2c+1``), exactly
    ``E2M1 × 2^(s-127)``. ``ASM`` needs an NVIDIA GPU and every scale byte ``s ≤ 128`` (or 255); the portable
    form holds for ``2 ≤ s ≤ 240`` (normal results; Triton's interpreter flushes subnormal bf16 to zero)."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_E2M1_BF16_ASM, "=r,=r,=r,=r,r,r,r", [wb, scale],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        lo, hi = e2m1_pair_to_f32_scaled(wb.to(tl.int32))
        lo = (lo * scale).to(tl.bfloat16)  # value·2^-14 · 2^14·2^(s-127): exact, ≤ 2 significant bits, in range
        hi = (hi * scale).to(tl.bfloat16)
    return lo, hi


# ------------------------------------------------------------------------------------------------ chunk loads
@triton.jit
def _weight_chunk(w_base, s_base, n_ok, stride_wn, stride_sn, k0, K, BN: tl.constexpr, G: tl.constexpr):
    """``BN`` weight rows × ``G`` groups of 32 elements from K element ``k0``: packed bytes ``[BN, G, 16]``
    (byte ``j`` of group ``g`` holds elements ``k0+32g+2j`` and ``+1``) and E8M0 bytes ``[BN, G]`` (int32)."""
    r = tl.arange(0, BN)
    g = tl.arange(0, G)
    j = tl.arange(0, 16)
    col = k0 // 2 + g[None, :, None] * 16 + j[None, None, :]
    wb = tl.load(w_base + r[:, None, None] * stride_wn + col, mask=n_ok[:, None, None] & (col < K // 2), other=0)
    sg = k0 // 32 + g
    sb = tl.load(s_base + r[:, None] * stride_sn + sg[None, :], mask=n_ok[:, None] & (sg < K // 32)[None, :],
                 other=127).to(tl.int32)
    return wb, sb


@triton.jit
def _act_chunk_fp8(a_ptr, rows, row_ok, k0, K, ACT_QUANT: tl.constexpr, TQ: tl.constexpr, TP: tl.constexpr,
                   BK: tl.constexpr):
    """Rows ``rows`` (element offsets, ``[TQ]``) of an activation at K ``k0..k0+BK``, FP8-quantized per 128 as
    the reference (exact fp32 values), split into even and odd elements: ``(xe, xo)`` ``[TP, BK/2]`` with
    ``xe[:, 16g+j] = x[k0+32g+2j]`` — the order of the decoded weight bytes. Only the ``TQ`` real rows are
    quantized; rows ``TQ..TP`` (a tensor-core operand needs 16) are zero."""
    NB: tl.constexpr = BK // 128
    b = tl.arange(0, NB)
    i = tl.arange(0, 64)
    e = tl.arange(0, 2)
    k = k0 + b[None, :, None, None] * 128 + i[None, None, :, None] * 2 + e[None, None, None, :]
    k_end = tl.where(row_ok, K, 0)  # (a vector mask & a scalar mask loses its bool dtype in the interpreter)
    x = tl.load(a_ptr + rows[:, None, None, None] + k, mask=k < k_end[:, None, None, None], other=0.0)
    x = x.to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=3), axis=2)  # [TQ, NB]
    xq = quantize_fp8_block(x, amax[:, :, None, None], ACT_QUANT)
    xe, xo = tl.split(xq)
    xe = tl.reshape(xe, (TQ, BK // 2))
    xo = tl.reshape(xo, (TQ, BK // 2))
    if TP > TQ:
        pad = (tl.arange(0, TP) < TQ)[:, None]
        xe = tl.where(pad, tl.reshape(tl.broadcast_to(xe[None, :, :], (TP // TQ, TQ, BK // 2)), (TP, BK // 2)), 0.0)
        xo = tl.where(pad, tl.reshape(tl.broadcast_to(xo[None, :, :], (TP // TQ, TQ, BK // 2)), (TP, BK // 2)), 0.0)
    return xe, xo


@triton.jit
def _act_chunk_int8(a_ptr, rows, row_ok, k0, K, TQ: tl.constexpr, TP: tl.constexpr, G: tl.constexpr):
    """The paper's activation quantization of a chunk: per 32 elements ``q = rint(x/s)`` clamped to ±127 with
    ``s = max(amax, 1e-8)/127`` correctly rounded. Returns ``q`` int8 ``[TP, G, 32]`` (natural order) and ``s``
    fp32 ``[TP, G]`` (rows ≥ ``TQ`` zero)."""
    g = tl.arange(0, G)
    i = tl.arange(0, 32)
    k = k0 + g[None, :, None] * 32 + i[None, None, :]
    k_end = tl.where(row_ok, K, 0)
    x = tl.load(a_ptr + rows[:, None, None] + k, mask=k < k_end[:, None, None], other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=2), 1e-8)
    s = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
    q = (tl.math.div_rn(x, tl.broadcast_to(s[:, :, None], x.shape)) + RNE_MAGIC) - RNE_MAGIC
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    if TP > TQ:
        pad = tl.arange(0, TP) < TQ
        q = tl.where(pad[:, None, None], tl.reshape(tl.broadcast_to(q[None], (TP // TQ, TQ, G, 32)), (TP, G, 32)), 0.0)
        s = tl.where(pad[:, None], tl.reshape(tl.broadcast_to(s[None], (TP // TQ, TQ, G)), (TP, G)), 0.0)
    return q.to(tl.int32).to(tl.int8), s


# ------------------------------------------------------------------------------------------------ one chunk
@triton.jit
def _chunk_dot(acc, wb, sb, xe, xo, ASM: tl.constexpr, DOT_FP32: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr):
    """``acc [BN, TP] += W·xᵀ`` on tensor cores: weights decoded to exact bf16, even and odd elements apart."""
    lo, hi = decode_e2m1_bf16(wb, tl.broadcast_to(e2m1_scale_operand(sb, ASM)[:, :, None], wb.shape), ASM)
    lo = tl.reshape(lo, (BN, BK // 2))
    hi = tl.reshape(hi, (BN, BK // 2))
    if DOT_FP32:  # the interpreter's bf16 arithmetic is unreliable: the same exact values in fp32
        acc = tl.dot(lo.to(tl.float32), tl.trans(xe), acc, input_precision="ieee")
        acc = tl.dot(hi.to(tl.float32), tl.trans(xo), acc, input_precision="ieee")
    else:
        acc = tl.dot(lo, tl.trans(xe.to(tl.bfloat16)), acc)
        acc = tl.dot(hi, tl.trans(xo.to(tl.bfloat16)), acc)
    return acc


@triton.jit
def _chunk_fma(acc, wb, sb, xe, xo, ASM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, ELEM: tl.constexpr,
               BYTEWISE: tl.constexpr = False):
    """``acc +=`` the products of one token's chunk (``xe, xo [1, BK/2]``) on CUDA cores: ``acc [BN, G, 16]``
    position by position (``ELEM``: no reduction in the loop), else ``acc [BN, G, 1]`` per 32-group dot (``BYTEWISE``:
    of the unscaled fp16 weights, times the group's scale after the sum)."""
    xe3 = tl.reshape(xe, (1, G, 16))
    xo3 = tl.reshape(xo, (1, G, 16))
    if BYTEWISE:
        lo, hi = decode_e2m1_unscaled(wb, ASM)
        dots = tl.sum(lo * xe3 + hi * xo3, axis=2, keep_dims=True)
        return acc + dots * e2m1_scale_operand(sb, False)[:, :, None]
    lo, hi = decode_e2m1_bf16(wb, tl.broadcast_to(e2m1_scale_operand(sb, ASM)[:, :, None], wb.shape), ASM)
    if ELEM:
        return acc + lo.to(tl.float32) * xe3 + hi.to(tl.float32) * xo3
    return acc + tl.sum(lo.to(tl.float32) * xe3 + hi.to(tl.float32) * xo3, axis=2, keep_dims=True)


@triton.jit
def _chunk_int8(acc, wb, sb, q, sx, BN: tl.constexpr, G: tl.constexpr, TP: tl.constexpr):
    """The paper's route: ``acc [BN, TP] += Σ_g dot_g · 2^(s-127) · sx / 2`` with ``dot_g`` the exact int32 dot
    of the 32-group ``g`` (``2·E2M1`` int8 weights × int8 activations)."""
    lo, hi = e2m1_pair_times2_int(wb.to(tl.int32))
    w = tl.reshape(tl.join(lo, hi), (BN, G, 32)).to(tl.int8)  # natural K order
    d = tl.dot(tl.permute(w, (1, 0, 2)), tl.permute(q, (1, 2, 0)), out_dtype=tl.int32)  # [G, BN, TP]
    sw = e8m0_to_f32(sb)
    f = tl.permute(sw, (1, 0))[:, :, None] * (tl.permute(sx, (1, 0)) * 0.5)[:, None, :]  # [G, BN, TP], exact
    return acc + tl.sum(d.to(tl.float32) * f, axis=0)


@triton.jit
def _act_chunk_natural(a_ptr, rows, row_ok, k0, K, ACT_QUANT: tl.constexpr, TQ: tl.constexpr, TP: tl.constexpr,
                       BK: tl.constexpr):
    """As :func:`_act_chunk_fp8` in natural K order: ``[TP, BK]`` exact fp32 values (rows ≥ ``TQ`` zero)."""
    NB: tl.constexpr = BK // 128
    b = tl.arange(0, NB)
    i = tl.arange(0, 128)
    k = k0 + b[None, :, None] * 128 + i[None, None, :]
    k_end = tl.where(row_ok, K, 0)
    x = tl.load(a_ptr + rows[:, None, None] + k, mask=k < k_end[:, None, None], other=0.0).to(tl.float32)
    xq = tl.reshape(quantize_fp8_block(x, tl.max(tl.abs(x), axis=2)[:, :, None], ACT_QUANT), (TQ, BK))
    if TP > TQ:
        xq = tl.where((tl.arange(0, TP) < TQ)[:, None],
                      tl.reshape(tl.broadcast_to(xq[None, :, :], (TP // TQ, TQ, BK)), (TP, BK)), 0.0)
    return xq


@triton.jit
def _chunk_dot_scaled(acc_t, xq, w_base, s_base, n_ok, stride_wn, stride_sn, k0, K, BN: tl.constexpr,
                      BK: tl.constexpr):
    """``acc_t [TP, BN] += x·Wᵀ`` through ``tl.dot_scaled`` (E2M1 weight and E8M0 scales as stored)."""
    r = tl.arange(0, BN)
    c = k0 // 2 + tl.arange(0, BK // 2)
    w = tl.load(w_base + r[None, :] * stride_wn + c[:, None], mask=n_ok[None, :] & (c < K // 2)[:, None], other=0)
    sg = k0 // 32 + tl.arange(0, BK // 32)
    sc = tl.load(s_base + r[:, None] * stride_sn + sg[None, :], mask=n_ok[:, None] & (sg < K // 32)[None, :],
                 other=127)
    return tl.dot_scaled(xq.to(tl.bfloat16), None, "bf16", w, sc, "e2m1", acc_t)  # FP8 values: exact in bf16


# ------------------------------------------------------------------------------------------------ projection
@triton.jit
def _project(a_ptr, rows, row_ok, w_base, s_base, v_base, t_base, n_ok, stride_wn, stride_sn, K,
             TWO: tl.constexpr, ROUTE: tl.constexpr, ASM: tl.constexpr, ACT_QUANT: tl.constexpr,
             DOT_FP32: tl.constexpr, TQ: tl.constexpr, TP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             FMA_ELEM: tl.constexpr, BYTEWISE: tl.constexpr = False):
    """``[BN, TP]`` fp32: the ``BN`` weight rows at ``w_base`` (scales ``s_base``) times the activation rows
    ``rows`` (``[TQ]`` element offsets, ``row_ok`` masks padding) over all of K, by ``ROUTE`` (0 dot, 1 fma,
    2 int8, 3 dot_scaled); with ``TWO`` also the rows at ``v_base`` (scales ``t_base``) in the same loop,
    sharing each activation chunk (w1 and w3). The fma route reads its tiles once per valid row, summing by
    32-element groups or (``FMA_ELEM``) position by position (:attr:`MoeGeometry.fma_sums`)."""
    G: tl.constexpr = BK // 32
    acc = tl.zeros((BN, TP), tl.float32)
    acc2 = tl.zeros((BN, TP), tl.float32)
    if ROUTE == 0:
        for c in range(0, tl.cdiv(K, BK)):
            xe, xo = _act_chunk_fp8(a_ptr, rows, row_ok, c * BK, K, ACT_QUANT, TQ, TP, BK)
            wb, sb = _weight_chunk(w_base, s_base, n_ok, stride_wn, stride_sn, c * BK, K, BN, G)
            acc = _chunk_dot(acc, wb, sb, xe, xo, ASM, DOT_FP32, BN, BK)
            if TWO:
                wb, sb = _weight_chunk(v_base, t_base, n_ok, stride_wn, stride_sn, c * BK, K, BN, G)
                acc2 = _chunk_dot(acc2, wb, sb, xe, xo, ASM, DOT_FP32, BN, BK)
    elif ROUTE == 1:
        for r in range(0, tl.sum(row_ok.to(tl.int32), axis=0)):
            pick = (tl.cumsum(row_ok.to(tl.int32), axis=0) == r + 1) & row_ok  # the r-th valid row
            row = tl.zeros((1,), rows.dtype) + tl.sum(tl.where(pick, rows, 0), axis=0)
            AW: tl.constexpr = 16 if FMA_ELEM else 1  # accumulators per 32-group: per position or one
            acc_f = tl.zeros((BN, G, AW), tl.float32)
            acc_f2 = tl.zeros((BN, G, AW), tl.float32)
            for c in range(0, tl.cdiv(K, BK)):
                xe, xo = _act_chunk_fp8(a_ptr, row, tl.arange(0, 1) == 0, c * BK, K, ACT_QUANT, 1, 1, BK)
                wb, sb = _weight_chunk(w_base, s_base, n_ok, stride_wn, stride_sn, c * BK, K, BN, G)
                acc_f = _chunk_fma(acc_f, wb, sb, xe, xo, ASM, BN, G, FMA_ELEM, BYTEWISE)
                if TWO:
                    wb, sb = _weight_chunk(v_base, t_base, n_ok, stride_wn, stride_sn, c * BK, K, BN, G)
                    acc_f2 = _chunk_fma(acc_f2, wb, sb, xe, xo, ASM, BN, G, FMA_ELEM, BYTEWISE)
            acc_g = tl.sum(acc_f, axis=2)
            acc_g2 = tl.sum(acc_f2, axis=2)
            acc += tl.where(pick[None, :], tl.sum(acc_g, axis=1)[:, None], 0.0)
            acc2 += tl.where(pick[None, :], tl.sum(acc_g2, axis=1)[:, None], 0.0)
    elif ROUTE == 2:
        for c in range(0, tl.cdiv(K, BK)):
            q, sx = _act_chunk_int8(a_ptr, rows, row_ok, c * BK, K, TQ, TP, G)
            wb, sb = _weight_chunk(w_base, s_base, n_ok, stride_wn, stride_sn, c * BK, K, BN, G)
            acc = _chunk_int8(acc, wb, sb, q, sx, BN, G, TP)
            if TWO:
                wb, sb = _weight_chunk(v_base, t_base, n_ok, stride_wn, stride_sn, c * BK, K, BN, G)
                acc2 = _chunk_int8(acc2, wb, sb, q, sx, BN, G, TP)
    else:
        acc_t = tl.zeros((TP, BN), tl.float32)
        acc_t2 = tl.zeros((TP, BN), tl.float32)
        for c in range(0, tl.cdiv(K, BK)):
            xq = _act_chunk_natural(a_ptr, rows, row_ok, c * BK, K, ACT_QUANT, TQ, TP, BK)
            acc_t = _chunk_dot_scaled(acc_t, xq, w_base, s_base, n_ok, stride_wn, stride_sn, c * BK, K, BN, BK)
            if TWO:
                acc_t2 = _chunk_dot_scaled(acc_t2, xq, v_base, t_base, n_ok, stride_wn, stride_sn, c * BK, K,
                                           BN, BK)
        acc = tl.trans(acc_t)
        acc2 = tl.trans(acc_t2)
    return acc, acc2


@triton.jit
def _expert_of_pair(idx_ptr, pid_p, T, expert_offset, n_local, TOPK: tl.constexpr, PP: tl.constexpr):
    """For the program of pair ``pid_p`` (token ``pid_p // TOPK``, slot ``pid_p % TOPK``): its global expert,
    the expert's index in this bank, and whether this program does the expert's work (the first pair routed to
    it, and the expert lives in this bank)."""
    e = tl.load(idx_ptr + pid_p)
    q = tl.arange(0, PP)
    pair_expert = tl.load(idx_ptr + q, mask=q < T * TOPK, other=-1)
    n_earlier = tl.sum(((q < pid_p) & (pair_expert == e)).to(tl.int32), axis=0)
    local = e - expert_offset
    return e, local, (n_earlier == 0) & (local >= 0) & (local < n_local)


@triton.jit
def _tokens_of(idx_ptr, e, T, TOPK: tl.constexpr, KP: tl.constexpr, N: tl.constexpr):
    """For tokens ``0..N``: whether each is routed to expert ``e`` and through which slot (``[N]`` each)."""
    t = tl.arange(0, N)
    s = tl.arange(0, KP)
    ok = (t[:, None] < T) & (s[None, :] < TOPK)
    match = (tl.load(idx_ptr + t[:, None] * TOPK + s[None, :], mask=ok, other=-1) == e) & ok
    return tl.max(match.to(tl.int32), axis=1) > 0, tl.sum(tl.where(match, s[None, :], 0), axis=1)


# ------------------------------------------------------------------------------------------------ kernels
@triton.jit
def _moe_up_kernel(x_ptr, idx_ptr, rw_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, g_ptr, u_ptr,
                   T, D, I, expert_offset, n_local, limit,
                   stride_we, stride_wn, stride_se, stride_sn,
                   TOPK: tl.constexpr, TQ: tl.constexpr, TP: tl.constexpr, KP: tl.constexpr, PP: tl.constexpr,
                   ROUTE: tl.constexpr, ASM: tl.constexpr, ACT_QUANT: tl.constexpr, WRITE_GU: tl.constexpr,
                   ROUND_ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, DOT_FP32: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, FMA_ELEM: tl.constexpr, BYTEWISE: tl.constexpr = False,
                   PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    pid_p = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, local, works = _expert_of_pair(idx_ptr, pid_p, T, expert_offset, n_local, TOPK, PP)
    if works:
        has_q, _ = _tokens_of(idx_ptr, e, T, TOPK, KP, TQ)
        has, slot = _tokens_of(idx_ptr, e, T, TOPK, KP, TP)
        n = pid_n * BN + tl.arange(0, BN)
        n_ok = n < I
        w_off = local.to(tl.int64) * stride_we + pid_n * BN * stride_wn
        s_off = local.to(tl.int64) * stride_se + pid_n * BN * stride_sn
        g, u = _project(x_ptr, tl.arange(0, TQ).to(tl.int64) * D, has_q, w1_ptr + w_off, s1_ptr + s_off,
                        w3_ptr + w_off, s3_ptr + s_off, n_ok, stride_wn, stride_sn, D,
                        True, ROUTE, ASM, ACT_QUANT, DOT_FP32, TQ, TP, BN, BK, FMA_ELEM, BYTEWISE)  # [BN, TP] each
        if ROUND_ACT:  # the reference's Linear returns bf16
            g = round_to_bf16(g)
            u = round_to_bf16(u)
        t = tl.arange(0, TP)
        out_off = (t[None, :] * TOPK + slot[None, :]) * I + n[:, None]  # [BN, TP]
        out_mask = has[None, :] & n_ok[:, None]
        if WRITE_GU:
            tl.store(g_ptr + out_off, g, mask=out_mask)
            tl.store(u_ptr + out_off, u, mask=out_mask)
        else:
            if HAS_LIMIT:
                u = tl.minimum(tl.maximum(u, -limit), limit)
                g = tl.minimum(g, limit)
            g64 = g.to(tl.float64)  # the reference evaluates transcendentals in fp64, rounded once to fp32
            act = (g64 / (1.0 + tl.exp(-g64))).to(tl.float32) * u
            rw = tl.load(rw_ptr + t * TOPK + slot, mask=has, other=0.0)
            hv = act * rw[None, :]
            if ROUND_ACT:
                tl.store(h_ptr + out_off, round_to_bf16(hv).to(tl.bfloat16), mask=out_mask)
            else:
                tl.store(h_ptr + out_off, hv, mask=out_mask)


@triton.jit
def _moe_down_expert_kernel(h_ptr, idx_ptr, w2_ptr, s2_ptr, out_ptr,
                            T, D, I, expert_offset, n_local,
                            stride_we, stride_wn, stride_se, stride_sn,
                            TOPK: tl.constexpr, TQ: tl.constexpr, TP: tl.constexpr, KP: tl.constexpr,
                            PP: tl.constexpr, ROUTE: tl.constexpr, ASM: tl.constexpr, ACT_QUANT: tl.constexpr,
                            ROUND_ACT: tl.constexpr, DOT_FP32: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                            FMA_ELEM: tl.constexpr, BYTEWISE: tl.constexpr = False, PDL: tl.constexpr = False):
    """Expert-major down projection: each slot's act-rounded output ``out [T, k, D]`` (fp32)."""
    pdl_prologue(PDL)
    pid_p = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, local, works = _expert_of_pair(idx_ptr, pid_p, T, expert_offset, n_local, TOPK, PP)
    if works:
        has_q, slot_q = _tokens_of(idx_ptr, e, T, TOPK, KP, TQ)
        has, slot = _tokens_of(idx_ptr, e, T, TOPK, KP, TP)
        rows = (tl.arange(0, TQ).to(tl.int64) * TOPK + slot_q) * I  # each token's row of h for this expert
        n = pid_n * BN + tl.arange(0, BN)
        n_ok = n < D
        w_base = w2_ptr + local.to(tl.int64) * stride_we + pid_n * BN * stride_wn
        s_base = s2_ptr + local.to(tl.int64) * stride_se + pid_n * BN * stride_sn
        y, _ = _project(h_ptr, rows, has_q, w_base, s_base, w_base, s_base, n_ok, stride_wn, stride_sn, I,
                        False, ROUTE, ASM, ACT_QUANT, DOT_FP32, TQ, TP, BN, BK, FMA_ELEM, BYTEWISE)
        if ROUND_ACT:
            y = round_to_bf16(y)
        t = tl.arange(0, TP)
        out_off = (t[None, :] * TOPK + slot[None, :]) * D + n[:, None]
        tl.store(out_ptr + out_off, y, mask=has[None, :] & n_ok[:, None])


@triton.jit
def _moe_down_token_kernel(h_ptr, idx_ptr, w2_ptr, s2_ptr, y_ptr, part_ptr,
                           T, D, I, expert_offset, n_local,
                           stride_we, stride_wn, stride_se, stride_sn, SLOT_SPLIT,
                           TOPK: tl.constexpr, TP: tl.constexpr, ROUTE: tl.constexpr, ASM: tl.constexpr,
                           ACT_QUANT: tl.constexpr, ROUND_ACT: tl.constexpr, DOT_FP32: tl.constexpr,
                           BN: tl.constexpr, BK: tl.constexpr, FMA_ELEM: tl.constexpr, BYTEWISE: tl.constexpr = False,
                           PDL: tl.constexpr = False):
    """Token-major down projection: a program sums slots ``split, split+S, …`` of token ``t`` in fp64 (exact for
    act-rounded values) and writes ``y`` (one split) or its fp64 partial."""
    pdl_prologue(PDL)
    t = tl.program_id(0)
    split = tl.program_id(1)
    pid_n = tl.program_id(2)
    n = pid_n * BN + tl.arange(0, BN)
    n_ok = n < D
    r = tl.arange(0, TP)
    total = tl.zeros((BN,), tl.float64)
    for si in range(split, TOPK, SLOT_SPLIT):
        local = tl.load(idx_ptr + t * TOPK + si) - expert_offset
        if (local >= 0) & (local < n_local):
            w_base = w2_ptr + local.to(tl.int64) * stride_we + pid_n * BN * stride_wn
            s_base = s2_ptr + local.to(tl.int64) * stride_se + pid_n * BN * stride_sn
            rows = tl.zeros((1,), tl.int64) + (t * TOPK + si).to(tl.int64) * I
            y, _ = _project(h_ptr, rows, tl.arange(0, 1) == 0, w_base, s_base, w_base, s_base, n_ok, stride_wn,
                            stride_sn, I, False, ROUTE, ASM, ACT_QUANT, DOT_FP32, 1, TP, BN, BK, FMA_ELEM, BYTEWISE)
            y = tl.sum(tl.where(r[None, :] == 0, y, 0.0), axis=1)
            if ROUND_ACT:
                y = round_to_bf16(y)
            total += y.to(tl.float64)
    if SLOT_SPLIT == 1:
        tl.store(y_ptr + t * D + n, total.to(tl.float32), mask=n_ok)
    else:
        tl.store(part_ptr + (split * T + t) * D + n, total, mask=n_ok)


@triton.jit
def _moe_combine_kernel(out_ptr, part_ptr, idx_ptr, y_ptr, T, D, expert_offset, n_local, N_PART,
                        TOPK: tl.constexpr, FROM_SLOTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """``y[t] = Σ`` over the slots owned by this bank of ``out[t, slot]`` (``FROM_SLOTS``) or over ``N_PART``
    fp64 partials, in a fixed order and in fp64: the result does not depend on how the work was split."""
    pdl_prologue(PDL)
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < D
    acc = tl.zeros((BLOCK,), tl.float64)
    if FROM_SLOTS:
        for s in tl.static_range(TOPK):
            local = tl.load(idx_ptr + t * TOPK + s) - expert_offset
            if (local >= 0) & (local < n_local):
                acc += tl.load(out_ptr + (t * TOPK + s) * D + n, mask=ok, other=0.0).to(tl.float64)
    else:
        for p in range(0, N_PART):
            acc += tl.load(part_ptr + (p * T + t) * D + n, mask=ok, other=0.0)
    tl.store(y_ptr + t * D + n, acc.to(tl.float32), mask=ok)


@triton.jit
def _act_qdq_kernel(x_ptr, y_ptr, R, K, BLOCK_R: tl.constexpr, PDL: tl.constexpr = False):
    """``y = act_qdq_fp8(x)`` for ``x [R, K]`` (bf16 in, the exact quantized values in bf16 out): the reference's
    per-row, per-128 activation quantization done once for all programs (``MoeGeometry.prequant``)."""
    pdl_prologue(PDL)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k = tl.program_id(1) * 128 + tl.arange(0, 128)
    ok = (r < R)[:, None] & (k < K)[None, :]
    x = tl.load(x_ptr + r[:, None].to(tl.int64) * K + k[None, :], mask=ok, other=0.0).to(tl.float32)
    q = quantize_fp8_block(x, tl.max(tl.abs(x), axis=1)[:, None], True)
    tl.store(y_ptr + r[:, None].to(tl.int64) * K + k[None, :], q.to(tl.bfloat16), mask=ok)  # exact in bf16



@triton.jit
def _moe_output_kernel(y_ptr, s_ptr, out_ptr, N, S, ROUND_BF16: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = False):
    """``out = act(((y + s₀) + s₁) …)``: the routed sum (fp32) plus each shared expert's output (act, widened
    exactly), added in fp32 in that order — one rounding per addition, as torch's — then rounded to act."""
    pdl_prologue(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < N
    acc = tl.load(y_ptr + i, mask=ok, other=0.0)
    for e in range(0, S):
        acc = acc + tl.load(s_ptr + e * N + i, mask=ok, other=0.0).to(tl.float32)
    if ROUND_BF16:
        acc = round_to_bf16(acc)  # round to nearest even (the interpreter's cast would truncate)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)
