"""Routed-MoE decode over each token's selected experts, reading packed FP4 (E2M1) weights and their E8M0
scales directly — no dequantized copy anywhere, no atomics (graph replay equals eager bit for bit).

Three launches per MoE layer (two with the token-major down projection):

1. **gate/up** — grid ``(T·k pairs, ⌈I/block_n_up⌉)``. The program of the *first* pair routed to an expert
   works for every token routed to it (each weight byte is read once per step however many tokens share the
   expert); the others exit at once. It streams ``block_n_up`` rows of ``w1`` **and** ``w3`` over the whole of
   ``D`` (no K split: 6 experts × 2048/32 = 384 programs of 2 warps at batch 1 keep 132 SMs busy, and the SwiGLU
   needs whole sums), rounds ``g`` and ``u`` to the activation dtype as the reference's Linear does and
   writes ``h = act(silu(min(g, L)) · clamp(u, ±L) · routing weight)``, the down projection's input.
2. **down** — expert-major (``slot_split=0``, the default): grid ``(T·k pairs, ⌈D/block_n_down⌉)``, again the
   first pair of an expert works for all its tokens and writes each slot's act-rounded output; then
3. **combine** — ``y[t] = Σ_slots out[t, slot]`` in fp64 (exact for act-rounded values, so the order of the
   slots cannot change a bit) — a few hundred KB that stay in L2, not a second pass over HBM.
   Token-major (``slot_split ≥ 1``): grid ``(T, slot_split, ⌈D/block_n_down⌉)``, a program sums its share of a
   token's slots in fp64 itself (``slot_split=1``: no third launch; an expert shared by two tokens is read twice).

Routes (how a chunk of weights meets the activations, ``route``):

* ``"dot"`` — the weights are decoded to **exact** bf16 (E2M1 value × E8M0 scale has ≤ 2 significant bits; the
  decode is a bit splice, the scale one bf16 multiply) and multiplied with the FP8-quantized activations (exact
  in bf16) on tensor cores with fp32 accumulation: tokens sharing an expert cost no extra weight traffic and
  almost no extra instructions. The reference's semantics.
* ``"fma"`` — the same decode, then fp32 FMAs on CUDA cores, one token at a time (a second token of the same
  expert re-reads the program's tile, normally from L2). The reference's semantics.
* ``"int8"`` — the paper's MI250 route: activations per 32 to INT8 (scale ``amax/127``), E2M1 → ``2·value``
  int8 (exact), an exact int8 tensor-core dot per 32-group, then ``E8M0 × activation scale / 2`` in fp32.
  Another activation quantization: judged against its own arithmetic (:func:`reference_stage1`,
  :func:`reference_stage2` with ``route="int8"``).
* ``"dot_scaled"`` — Triton's ``tl.dot_scaled`` (E2M1 weights with their E8M0 scales as given, bf16
  activations holding the FP8-quantized values): the reference's semantics; native on hardware with microscaled
  MMA, an upcast emulation elsewhere (sm_90).

The E2M1 decode (``decode``): ``"asm"`` on NVIDIA GPUs — PTX on packed registers, 4 bytes (8 weights) at a
time: ``sign<<15 | magnitude<<6`` is the bf16 of ``value·2^-126`` for every code, and one ``mul.bf16x2`` by
``2^(s-1)`` applies the E8M0 byte ``s`` (exact for scales ≤ 2, i.e. ``s ≤ 128``, which the launcher checks
once per bank); ``"plain"`` — portable Triton (the interpreter, ROCm, scales above 2): fp16 bit splice, fp32
scale, exact cast to bf16 (E8M0 bytes 2..240). Both give the same bits. ``"bytewise"`` (the ``fma`` route with group
sums only) leaves the scale out of the decode: a code's fp16 ``value·2^-14`` is its high byte alone, so one
32-bit word decodes four codes at a time (per 4 packed bytes: 7 ALU operations and 4 byte permutes for 8 weights
against 22 for the bf16 splice with its multiplies), and each 32-group's dot is multiplied by its ``2^(s-113)``
in fp32 after its sum — a power of two, so every product and every sum rounds exactly as with the scaled weights:
the same bits as ``"asm"``/``"plain"``, for any E8M0 byte (no ``s ≤ 128`` limit).

Numerics: every product is exact in fp32, only sums round. ``fma`` and ``int8`` sum in IEEE fp32 on CUDA cores
(``int8`` also rounds each group's ``dot × scale`` product once); ``dot`` and ``dot_scaled`` accumulate inside
tensor cores (aligned, truncated partial sums) — :data:`ACCUMULATION` states the per-route bound the tests use.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .formats import (RNE_MAGIC, e2m1_pair_times2_int, e2m1_pair_to_f32_scaled, e8m0_to_f32, quantize_fp8_block,
                      round_to_bf16)
from .launch import pdl_args, pdl_prologue
from .fp8_gemv import interpreting
from dsv4lab.core import quant

ROUTES = ("dot", "fma", "int8", "dot_scaled")
DECODES = ("auto", "asm", "plain", "bytewise")
SAME_SEMANTICS = ("dot", "fma", "dot_scaled")  # the reference's quantization; "int8" is the paper's
ACCUMULATION = {
    # route: (where the sums are done, the factor c in γ(c·n) over n = reduction length, fp32 unit roundoff)
    "fma": ("fp32 FMA on CUDA cores, round to nearest", 1.0),
    "int8": ("exact int32 per 32-group, one fp32 product rounding per group, fp32 sums", 1.0),
    # Tensor cores align each step's addends to the largest and truncate (Fasi et al. 2021; Khattak & Mikaitis
    # 2025): a step of m products errs by ≤ (m+1)·2^-23 of its magnitude, so n terms by ≤ 2(1+1/m)·n·u ≤ 4·n·u.
    "dot": ("tensor-core fp32 accumulation (aligned, truncated)", 4.0),
    "dot_scaled": ("tensor-core fp32 accumulation (aligned, truncated)", 4.0),
}


@dataclass(frozen=True)
class MoeGeometry:
    """Launch geometry of the routed-MoE decode (see the module docstring).

    Attributes:
        block_n_up, block_n_down: weight rows per program of the gate/up and the down projection.
        block_k: K elements per loop step (a multiple of 128, the activation block); ``block_k/2`` bytes of each
            weight row are read per step (≥ 256 B keeps the reads near the copy bandwidth).
        slot_split: 0 — expert-major down projection + combine kernel; ≥ 1 — token-major, each token's slots
            split over that many programs.
        num_warps, num_stages: Triton launch options (``num_stages > 1`` software-pipelines the weight loads).
        decode: ``"auto"`` (asm on NVIDIA GPUs when every E8M0 scale is ≤ 2), ``"asm"``, ``"plain"`` or
            ``"bytewise"`` (the ``fma`` route with group sums: fp16 codes four at a time, each group's scale
            applied after its sum; see above).
        prequant: quantize ``x`` and ``h`` once per step in a small kernel each (exact bf16 values) instead of
            in every program's loop — two more launches, a third fewer instructions per byte at batch 8 (the
            FP8-activation routes only).
        fma_sums: the ``fma`` route's accumulators — ``"group"``: each chunk's 32-element group dots summed by
            a tree, then added to one accumulator per group; ``"element"``: one accumulator per weight position
            of the tile, two FFMAs per weight pair and no tree in the loop, reduced once after the last chunk
            (fewer instructions per weight byte — the route is issue-bound at batch 1 — for 32 more registers
            per matrix at 8 rows × 256). Either is an fp32 sum of the same exact products in another order.
    """

    block_n_up: int = 32
    block_n_down: int = 32
    block_k: int = 256
    slot_split: int = 0
    num_warps: int = 2
    num_stages: int = 3
    decode: str = "auto"
    prequant: bool = False
    fma_sums: str = "group"


FMA_SUMS = ("group", "element")


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


def act_qdq(x: torch.Tensor) -> torch.Tensor:
    """:func:`dsv4lab.core.quant.act_qdq_fp8` of a bf16 activation ``[..., K]`` on the device, as exact bf16 values."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    y = torch.empty_like(x2, dtype=torch.bfloat16)
    R = x2.shape[0]
    block_r = min(16, triton.next_power_of_2(max(R, 1)))
    _act_qdq_kernel[(triton.cdiv(R, block_r), triton.cdiv(K, 128))](x2, y, R, K, BLOCK_R=block_r, **pdl_args(x2.device))
    return y.view(x.shape)


# ------------------------------------------------------------------------------------------------ launchers
@dataclass
class ExpertTensors:
    """The native buffers of an expert bank: ``w1, w3 [E, I, D/2]``, ``w2 [E, D, I/2]`` (uint8 views) and their
    E8M0 scales (uint8 views), plus the bank's first global expert id and whether every scale is ≤ 2 (the
    asm decode's exact range), checked once here."""

    w1: torch.Tensor
    w1_scale: torch.Tensor
    w3: torch.Tensor
    w3_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    expert_offset: int = 0
    scales_le_2: bool | None = None

    def __post_init__(self):
        if self.scales_le_2 is None:  # 0xFF is E8M0's NaN: both decodes map it to NaN, so it does not count
            self.scales_le_2 = bool(max(int(s.masked_fill(s == 255, 0).max()) if s.numel() else 0
                                        for s in (self.w1_scale, self.w3_scale, self.w2_scale)) <= 128)

    @classmethod
    def of(cls, bank) -> "ExpertTensors":
        """The kernel view of an :class:`~dsv4lab.core.model.linear.ExpertBank`, cached on the bank (the scale check
        reads the device once; decode steps — and CUDA-graph captures — reuse it)."""
        u8 = lambda t: t.view(torch.uint8)  # noqa: E731 — int8 / e8m0 storage read as raw bytes
        key = tuple(t.data_ptr() for t in (bank.w1, bank.w1_scale, bank.w3, bank.w3_scale, bank.w2, bank.w2_scale))
        hit = getattr(bank, "_kernel_view", None)
        if hit is not None and hit[0] == key:
            return hit[1]
        view = cls(u8(bank.w1), u8(bank.w1_scale), u8(bank.w3), u8(bank.w3_scale), u8(bank.w2), u8(bank.w2_scale),
                   int(bank.expert_offset))
        bank._kernel_view = (key, view)
        return view

    @property
    def n_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def inter(self) -> int:
        return self.w1.shape[1]

    @property
    def dim(self) -> int:
        return self.w2.shape[1]

    def check(self) -> None:
        E, I, half_d = self.w1.shape
        D = 2 * half_d
        for name, t, shape in (("w1", self.w1, (E, I, D // 2)), ("w3", self.w3, (E, I, D // 2)),
                               ("w2", self.w2, (E, D, I // 2)), ("w1_scale", self.w1_scale, (E, I, D // 32)),
                               ("w3_scale", self.w3_scale, (E, I, D // 32)),
                               ("w2_scale", self.w2_scale, (E, D, I // 32))):
            if tuple(t.shape) != shape:
                raise ValueError(f"expert {name}: shape {tuple(t.shape)}, expected {shape}")
            if not t.is_contiguous() or t.dtype != torch.uint8:
                raise ValueError(f"expert {name} must be a contiguous uint8 view")
        if D % 32 or I % 32:
            raise ValueError(f"expert dims D={D}, I={I} must be multiples of 32 (the E8M0 group)")


def _check_route(route: str) -> int:
    if route not in ROUTES:
        raise ValueError(f"unknown routed-MoE route {route!r}; known: {', '.join(ROUTES)}")
    return ROUTES.index(route)


def _use_asm(geo: MoeGeometry, ex: ExpertTensors, device: torch.device) -> bool:
    if geo.decode not in DECODES:
        raise ValueError(f"unknown E2M1 decode {geo.decode!r}; known: {', '.join(DECODES)}")
    nvidia = device.type == "cuda" and torch.version.hip is None and not interpreting()
    if geo.decode == "bytewise":  # its PTX has no scale limit: the scales apply after each group's sum, in fp32
        return nvidia
    if geo.decode == "asm":
        if not nvidia:
            raise ValueError("the asm E2M1 decode needs an NVIDIA GPU (use decode='plain')")
        if not ex.scales_le_2:
            raise ValueError("the asm E2M1 decode is exact for E8M0 scales ≤ 2 only; this bank has larger ones")
        return True
    return geo.decode == "auto" and nvidia and ex.scales_le_2


def _token_block(T: int, route: str) -> int:
    tp = triton.next_power_of_2(max(T, 1))
    return max(tp, 16) if route in ("dot", "int8", "dot_scaled") else tp


def _launch_opts(geo: MoeGeometry, route: str) -> dict:
    """The launch options and the geometry's constexprs other than the tile sizes."""
    if geo.fma_sums not in FMA_SUMS:
        raise ValueError(f"MoeGeometry.fma_sums={geo.fma_sums!r}; known: {', '.join(FMA_SUMS)}")
    if geo.decode == "bytewise" and (route != "fma" or geo.fma_sums != "group"):
        raise ValueError(f"MoeGeometry.decode='bytewise' scales each 32-group's sum: the 'fma' route with "
                         f"fma_sums='group' only (got route {route!r}, fma_sums {geo.fma_sums!r})")
    return dict(num_warps=geo.num_warps, num_stages=geo.num_stages, FMA_ELEM=geo.fma_sums == "element",
                BYTEWISE=geo.decode == "bytewise")


def moe_gate_up(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor | None, ex: ExpertTensors, limit: float,
                route: str = "dot", geometry: MoeGeometry | None = None, act_quant: bool = True,
                act_dtype: torch.dtype = torch.bfloat16, write_gu: bool = False):
    """Stage 1. ``x [T, D]``, ``idx [T, k]`` global expert ids, ``weights [T, k]`` fp32.

    Returns ``h [T, k, I]`` in ``act_dtype`` (slots of experts not in the bank are left unwritten), or with
    ``write_gu`` the act-rounded ``(g, u)`` in fp32 with NaN in such slots (the reference's ``moe_stage1``).
    """
    r = _check_route(route)
    geo = geometry or MoeGeometry()
    if geo.block_k % 128:
        raise ValueError(f"MoeGeometry.block_k={geo.block_k} must be a multiple of 128 (the activation block)")
    T, D = x.shape
    k = idx.shape[1]
    if idx.shape != (T, k) or D != ex.dim:
        raise ValueError(f"routed MoE: x {tuple(x.shape)} and idx {tuple(idx.shape)} do not fit experts of dim "
                         f"{ex.dim}")
    x = x.contiguous()
    idx = idx.contiguous()
    I = ex.inter
    if write_gu:
        g = torch.full((T, k, I), float("nan"), dtype=torch.float32, device=x.device)
        u = torch.full_like(g, float("nan"))
        h = rw = g
    else:
        if weights is None or weights.shape != (T, k):
            raise ValueError(f"routed MoE: routing weights must be [{T}, {k}]")
        rw = weights.to(torch.float32).contiguous()
        h = torch.empty(T, k, I, dtype=act_dtype, device=x.device)
        g = u = h
    bn = min(geo.block_n_up, triton.next_power_of_2(I))
    grid = (T * k, triton.cdiv(I, bn))
    _moe_up_kernel[grid](x, idx, rw, ex.w1, ex.w3, ex.w1_scale, ex.w3_scale, h, g, u,
                         T, D, I, ex.expert_offset, ex.n_experts, float(limit),
                         ex.w1.stride(0), ex.w1.stride(1), ex.w1_scale.stride(0), ex.w1_scale.stride(1),
                         TOPK=k, TQ=triton.next_power_of_2(T), TP=_token_block(T, route),
                         KP=triton.next_power_of_2(k),
                         PP=triton.next_power_of_2(T * k), ROUTE=r, ASM=_use_asm(geo, ex, x.device),
                         ACT_QUANT=act_quant, WRITE_GU=write_gu, ROUND_ACT=act_dtype == torch.bfloat16,
                         HAS_LIMIT=limit > 0, DOT_FP32=interpreting(), BN=bn, BK=geo.block_k,
                         **_launch_opts(geo, route),
                         **pdl_args(x.device))
    return (g, u) if write_gu else h


def moe_down(h: torch.Tensor, idx: torch.Tensor, ex: ExpertTensors, route: str = "dot",
             geometry: MoeGeometry | None = None, act_quant: bool = True, act_dtype: torch.dtype = torch.bfloat16,
             per_slot: bool = False) -> torch.Tensor:
    """Stage 2. ``h [T, k, I]`` → ``y [T, D]`` fp32 (the slot sum), or with ``per_slot`` the act-rounded slot
    outputs ``[T, k, D]`` fp32 with NaN in slots of experts not in the bank (the reference's ``moe_stage2``)."""
    r = _check_route(route)
    geo = geometry or MoeGeometry()
    if geo.block_k % 128:
        raise ValueError(f"MoeGeometry.block_k={geo.block_k} must be a multiple of 128 (the activation block)")
    T, k, I = h.shape
    if I != ex.inter or idx.shape != (T, k):
        raise ValueError(f"routed MoE: h {tuple(h.shape)} and idx {tuple(idx.shape)} do not fit experts of "
                         f"inter dim {ex.inter}")
    D = ex.dim
    h = h.contiguous()
    idx = idx.contiguous()
    asm = _use_asm(geo, ex, h.device)
    bn = min(geo.block_n_down, triton.next_power_of_2(D))
    y = torch.empty(T, D, dtype=torch.float32, device=h.device)
    common = dict(ROUTE=r, ASM=asm, ACT_QUANT=act_quant, ROUND_ACT=act_dtype == torch.bfloat16,
                  DOT_FP32=interpreting(), BN=bn, BK=geo.block_k, **_launch_opts(geo, route))
    strides = (ex.w2.stride(0), ex.w2.stride(1), ex.w2_scale.stride(0), ex.w2_scale.stride(1))
    if per_slot or geo.slot_split == 0:
        if per_slot:  # slots of other banks' experts stay NaN, as the reference's
            out = torch.full((T, k, D), float("nan"), dtype=torch.float32, device=h.device)
        else:  # the combine reads only the slots this bank owns
            out = torch.empty(T, k, D, dtype=torch.float32, device=h.device)
        _moe_down_expert_kernel[(T * k, triton.cdiv(D, bn))](
            h, idx, ex.w2, ex.w2_scale, out, T, D, I, ex.expert_offset, ex.n_experts, *strides,
            TOPK=k, TQ=triton.next_power_of_2(T), TP=_token_block(T, route), KP=triton.next_power_of_2(k),
            PP=triton.next_power_of_2(T * k), **common, **pdl_args(h.device))
        if per_slot:
            return out
        return _combine(out, None, idx, y, ex, from_slots=True)
    split = max(1, min(geo.slot_split, k))
    part = torch.empty(split, T, D, dtype=torch.float64, device=h.device) if split > 1 else y
    _moe_down_token_kernel[(T, split, triton.cdiv(D, bn))](
        h, idx, ex.w2, ex.w2_scale, y, part, T, D, I, ex.expert_offset, ex.n_experts, *strides, split,
        TOPK=k, TP=_token_block(1, route), **common, **pdl_args(h.device))
    if split > 1:
        _combine(None, part, idx, y, ex, from_slots=False)
    return y


def _combine(out, part, idx, y, ex: ExpertTensors, from_slots: bool) -> torch.Tensor:
    T, D = y.shape
    block = min(1024, triton.next_power_of_2(D))
    _moe_combine_kernel[(T, triton.cdiv(D, block))](
        out if from_slots else y, part if part is not None else y, idx, y, T, D, ex.expert_offset, ex.n_experts,
        0 if part is None else part.shape[0], TOPK=idx.shape[1], FROM_SLOTS=from_slots, BLOCK=block,
        **pdl_args(y.device))
    return y


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


def moe_output(routed: torch.Tensor, shared: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
    """The MoE's output in one launch: ``routed [T, D]`` fp32 plus ``shared [S, T, D]`` (each shared expert's
    output in act), summed in fp32 in expert order and rounded to ``act_dtype`` — what the three torch kernels of
    ``y + s.float()`` then ``.to(act)`` compute, bit for bit (:meth:`ReferenceOps.moe_output`)."""
    assert routed.dtype == torch.float32 and shared.dtype == act_dtype and shared.shape[1:] == routed.shape, \
        f"moe_output: routed {routed.dtype} {list(routed.shape)}, shared {shared.dtype} {list(shared.shape)}"
    y, s = routed.contiguous(), shared.contiguous()
    out = torch.empty(routed.shape, dtype=act_dtype, device=routed.device)
    n = y.numel()
    if n:
        block = min(1024, triton.next_power_of_2(n))
        _moe_output_kernel[(triton.cdiv(n, block),)](y, s, out, n, s.shape[0],
                                                     ROUND_BF16=act_dtype == torch.bfloat16, BLOCK=block,
                                                     **pdl_args(y.device))
    return out


def routed_moe_decode(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, ex: ExpertTensors, limit: float,
                      route: str = "dot", geometry: MoeGeometry | None = None, act_quant: bool = True,
                      act_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The whole routed MoE of a decode step: ``Σ_slots w2(act(w1·x, w3·x)·weight)`` → ``[T, D]`` fp32."""
    geo = geometry or MoeGeometry()
    if geo.prequant and act_quant and act_dtype == torch.bfloat16:
        if route == "int8":
            raise ValueError("MoeGeometry.prequant applies to the FP8-activation routes, not to 'int8'")
        h = moe_gate_up(act_qdq(x), idx, weights, ex, limit, route, geo, False, act_dtype)
        return moe_down(act_qdq(h), idx, ex, route, geo, False, act_dtype)
    h = moe_gate_up(x, idx, weights, ex, limit, route, geo, act_quant, act_dtype)
    return moe_down(h, idx, ex, route, geo, act_quant, act_dtype)


# ------------------------------------------------------------------------------------------------ oracles
def reference_int8_route(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Oracle of the INT8 route for one weight: ``x [M, K]`` → ``[M, N]`` fp64, computed as the paper describes
    (per-32 INT8 activations, ``2·E2M1`` int8 weights, exact integer group dots, then both scales / 2)."""
    xq, xs = quant.act_quant_int8(x.float(), 32)
    codes = quant.unpack_fp4(w_packed).long()
    w2x = torch.tensor(quant.E2M1_TIMES2_INT8, dtype=torch.int64, device=codes.device)[codes]
    M, K = xq.shape
    N = w2x.shape[0]
    dots = torch.einsum("mgk,ngk->mng", xq.long().view(M, K // 32, 32).double(), w2x.view(N, K // 32, 32).double())
    ws = quant.e8m0_decode(w_scale, torch.float64)
    return (dots * ws[None] * xs.double()[:, None, :] * 0.5).sum(-1)


def reference_int8_moe(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, ex: ExpertTensors,
                       limit: float) -> torch.Tensor:
    """Oracle of the whole routed MoE along the INT8 route: :func:`reference_int8_route` for each projection with
    the reference's rounding points (bf16 projection outputs, SwiGLU in fp32 with the silu in fp64, a bf16 input
    to the down projection, an exact sum over slots). Experts outside ``ex`` are skipped. Returns ``[T, D]`` fp32."""
    T, k = idx.shape
    y = torch.zeros(T, ex.dim, dtype=torch.float64, device=x.device)
    for t in range(T):
        for s in range(k):
            e = int(idx[t, s]) - ex.expert_offset
            if not 0 <= e < ex.n_experts:
                continue
            g = reference_int8_route(x[t:t + 1], ex.w1[e], ex.w1_scale[e]).float().bfloat16().float()
            u = reference_int8_route(x[t:t + 1], ex.w3[e], ex.w3_scale[e]).float().bfloat16().float()
            if limit > 0:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            h = torch.nn.functional.silu(g.double()).float() * u * weights[t, s].float()
            y[t] += reference_int8_route(h.bfloat16(), ex.w2[e], ex.w2_scale[e]).float().bfloat16().double()[0]
    return y.float()


@dataclass
class StageOracle:
    """A stage's exact oracle for each ``[T, k]`` slot: ``ref`` (the act-rounded output the kernel must
    reproduce), ``magnitude`` ``Σ|terms|`` of each output (fp64) and ``terms`` (the reduction length), NaN where
    the slot's expert is not in the bank — what :func:`dsv4lab.tools.verify.bounds.check_within_bound` needs."""

    ref: torch.Tensor
    magnitude: torch.Tensor
    terms: int


def _slot_projection(a: torch.Tensor, w: torch.Tensor, s: torch.Tensor, route: str, act_quant: bool):
    """One slot's projection oracle: ``(value fp64, Σ|terms| fp64, terms)`` for activation rows ``a [M, K]``."""
    if route == "int8":
        xq, xs = quant.act_quant_int8(a.float(), 32)
        codes = quant.unpack_fp4(w).long()
        w2x = torch.tensor(quant.E2M1_TIMES2_INT8, dtype=torch.int64, device=codes.device)[codes]
        M, K = xq.shape
        N = w2x.shape[0]
        dots = torch.einsum("mgk,ngk->mng", xq.long().view(M, K // 32, 32).double(),
                            w2x.view(N, K // 32, 32).double())
        terms = dots * quant.e8m0_decode(s, torch.float64)[None] * xs.double()[:, None, :] * 0.5
        return terms.sum(-1), terms.abs().sum(-1), K // 32 + 1  # one fp32 product rounding per group term
    xq = (quant.act_qdq_fp8(a.float()) if act_quant else a.float()).double()
    wd = quant.fp4_dequant(w, s, torch.float64)
    return xq @ wd.T, xq.abs() @ wd.abs().T, a.shape[-1]


def reference_stage1(x: torch.Tensor, idx: torch.Tensor, ex: ExpertTensors, route: str = "dot",
                     act_quant: bool = True) -> tuple[StageOracle, StageOracle]:
    """Oracles of ``(g, u)`` ``[T, k, I]`` for :func:`moe_gate_up` (``write_gu``): the route's arithmetic
    evaluated exactly, rounded to fp32 then bf16 as the reference's Linear."""
    T, k = idx.shape
    shape = (T, k, ex.inter)
    out = [torch.full(shape, float("nan"), dtype=torch.float64, device=x.device) for _ in range(4)]
    terms = ex.dim
    for t in range(T):
        for j in range(k):
            e = int(idx[t, j]) - ex.expert_offset
            if not 0 <= e < ex.n_experts:
                continue
            for o, (w, s) in enumerate(((ex.w1[e], ex.w1_scale[e]), (ex.w3[e], ex.w3_scale[e]))):
                v, mag, terms = _slot_projection(x[t:t + 1], w, s, route, act_quant)
                out[2 * o][t, j] = v[0].float().bfloat16().double()
                out[2 * o + 1][t, j] = mag[0]
    return StageOracle(out[0], out[1], terms), StageOracle(out[2], out[3], terms)


def reference_stage2(h: torch.Tensor, idx: torch.Tensor, ex: ExpertTensors, route: str = "dot",
                     act_quant: bool = True) -> StageOracle:
    """Oracle of the per-slot down projection ``[T, k, D]`` for :func:`moe_down` (``per_slot``) of a given
    ``h [T, k, I]`` (bf16, as the kernel reads it)."""
    T, k, _ = h.shape
    ref = torch.full((T, k, ex.dim), float("nan"), dtype=torch.float64, device=h.device)
    mag = ref.clone()
    terms = ex.inter
    for t in range(T):
        for j in range(k):
            e = int(idx[t, j]) - ex.expert_offset
            if not 0 <= e < ex.n_experts:
                continue
            v, m, terms = _slot_projection(h[t, j:j + 1].bfloat16(), ex.w2[e], ex.w2_scale[e], route, act_quant)
            ref[t, j] = v[0].float().bfloat16().double()
            mag[t, j] = m[0]
    return StageOracle(ref, mag, terms)
