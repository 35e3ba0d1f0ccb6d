"""Grouped FP4 MoE GEMM for prefill: gate/up (+ clamped SwiGLU, routing weight, FP8 re-quantization) and down.

The slots (token, top-k position) are first grouped by expert into blocks of ``rows`` rows
(``kernels/dsv4lab_kernels/moe_sort.py``). One program computes a ``BLOCK_N``-wide output tile for one block: it unpacks each
packed E2M1 weight tile (with its 1×32 E8M0 scales) **once** and multiplies it with all ``rows`` activation rows of
the block on tensor cores, so the unpack cost is divided by ``rows`` — the paper's "unpack reuse across rows" and
the reason its 64-row sorter beat the 32-row one.

Operands are swapped (``accᵀ[N, rows] = W[N, K] · Xᵀ[K, rows]``): the unpacked weight tile is the MMA's first
operand and the block's rows its second, so 16…128-row blocks all map onto the MMA shapes.

Four routes, all computing the reference's products exactly (E2M1 × 2^s and E4M3 × 2^s are exact in bf16 and
fp32) and differing only in fp32 summation order:

* ``bf16`` — weights unpacked to bf16 (value × scale), activations pre-dequantized to bf16;
* ``fp8`` — weights upcast exactly to E4M3 relative to the largest 1×32 scale of each K tile (exact while a
  tile's scales span at most :data:`FP8_ROUTE_MAX_SPREAD` binades, which :func:`fp8_route_exact` checks), FP8
  dots, and the two remaining scales applied to the fp32 partial once per K tile (the block-FP8 scheme of the
  dense GEMM);
* ``scaled`` — ``tl.dot_scaled`` with the packed E2M1 weights and their E8M0 scales as they are stored, and the
  FP8 activations with their per-128 scale repeated per 32 (Triton emulates it where the hardware has no MX
  tensor cores, e.g. through bf16 on sm_90);
* ``fp8lut`` — FP8 tensor cores with the weights turned into E4M3 by a per-group byte table, gate and up in one
  MMA operand, its own kernels and layouts (:mod:`.fp4_moe_fp8lut`, exact within 11 binades per reference block).

For the ``bf16``/``fp8`` routes the activations are stored with the even K columns first and the odd ones second
(``quantize_activations(..., deq_split/q_split)``), so a weight byte's low nibble meets the first half and its
high nibble the second and no interleave is needed.

**Decode** (``bf16`` route, :class:`MoEGeometry` ``decode``): ``"asm"`` turns four packed bytes into eight bf16
values with a few integer instructions and one ``mul.bf16x2`` per pair (the bits ``sign<<15 | magnitude<<6`` read
as bf16 are the E2M1 value times 2^-126 for every code, subnormal 0.5 included, so multiplying by ``2^(s−1)``
gives ``value · 2^(s−127)`` exactly; needs every scale byte ≤ 128, i.e. scales ≤ 2, which
:func:`asm_decode_exact` checks once per bank) — inline PTX, GPUs only, and checked at first use against the
portable decode by :func:`asm_decode_works`; ``"f16"`` is the portable form (the fp16 codec of
``kernels/dsv4lab_kernels/formats.py`` and an fp32 multiply), which the CPU interpreter runs; ``"auto"`` picks ``"asm"`` where it
is exact and works.

**Work order**: work items are (block, N tile) pairs numbered expert by expert — within an expert, tile by tile,
and within a tile its blocks — so the programs that run together share each weight tile through L2 (an expert
with 96 rows in 64-row blocks reads its weights from DRAM once, not twice) and an expert's activation rows stay in
L2 across its tiles. ``persistent=True`` launches a fixed grid (one program per SM) that walks the items;
otherwise one program per possible item, the unused ones returning at once.

Stage 1 with ``fuse=True`` ends in the reference's activation: each of g, u rounded to bf16, clamped SwiGLU (SiLU
evaluated in fp64 and rounded once, as the reference), times the routing weight, rounded to bf16, then
FP8-quantized per row over its 128 columns (``BLOCK_N = 128`` is the
quantization block), written per sorted row in the layout stage 2 reads. Stage 2 writes each slot's bf16 output;
:func:`combine_slots` sums a token's slots exactly (fp64) and rounds once, as ``ReferenceOps.moe_combine``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from . import fp4_moe_fp8lut as fp8lut
from .formats import e2m1_pair_to_f32_scaled, e8m0_to_f32, pow2
from .fp8_gemm import interpreting, quantize_activations, to_bf16
from .rowops import DeviceProbe, once_per_tensors
from .moe_sort import SortedRouting, expert_work_item, sort_by_expert
from .swiglu import routed_swiglu_fp8

ROUTES = ("bf16", "fp8", "scaled", fp8lut.ROUTE)
FP8_SPLIT_ROUTES = ("fp8", fp8lut.ROUTE)  # E4M3 activations in the split layout, h with fp32 scales per 128
DECODES = ("auto", "asm", "f16")
FP8_ROUTE_MAX_SPREAD = 14  # binades of 1×32 scales one K tile may span for the exact E2M1 → E4M3 upcast
ASM_MAX_SCALE_BYTE = 128  # the asm decode multiplies by 2^(s−1) in bf16: s ≤ 128 (scales ≤ 2) keeps it finite
ROUTE_ID = {name: i for i, name in enumerate(ROUTES)}  # the routes of the kernels below (fp8lut has its own)


# ============================================================================================ unpacking
@triton.jit
def _load_weight_halves(w_ptr, s_ptr, e, rn, n_ok, k0, K, stride_we, stride_wn, stride_se, stride_sn,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The packed tile ``W[e, rn, k0:k0+BLOCK_K]`` decoded: the even columns (low nibbles) and the odd columns
    (high nibbles) as ``value · 2^-14`` fp32 ``[BLOCK_N, BLOCK_K/32, 16]``, and the scale bytes
    ``[BLOCK_N, BLOCK_K/32]`` (int32)."""
    G: tl.constexpr = BLOCK_K // 32
    gi = tl.arange(0, G)
    bj = tl.arange(0, 16)
    g_ok = (k0 + 32 * gi) < K
    byte = (k0 // 2) + gi[:, None] * 16 + bj[None, :]
    w_row = w_ptr + e.to(tl.int64) * stride_we + rn[:, None, None].to(tl.int64) * stride_wn
    wb = tl.load(w_row + byte[None, :, :], mask=n_ok[:, None, None] & g_ok[None, :, None], other=0).to(tl.int32)
    sc = tl.load(s_ptr + e.to(tl.int64) * stride_se + rn[:, None].to(tl.int64) * stride_sn + k0 // 32 + gi[None, :],
                 mask=n_ok[:, None] & g_ok[None, :], other=0).to(tl.int32)  # 0: never the tile's largest scale
    lo, hi = e2m1_pair_to_f32_scaled(wb & 0xFF)
    return lo, hi, sc


# Four packed bytes ($4) and their four bf16 scale multipliers 2^(s−1) ($5: elements 0-1, $6: elements 2-3) → the
# low nibbles' values ($0: elements 0-1, $1: 2-3) and the high nibbles' ($2, $3). prmt spreads the bytes to the
# two 16-bit halves; each nibble's magnitude goes to bits 6-8 and its sign to bit 15 of its half (value · 2^-126 as
# bf16, subnormal 0.5 included), and one mul.bf16x2 applies the scale (exact: a power of two).
# (a tl.constexpr: a @jit function may read no other global)
_DECODE_BF16_PTX = tl.constexpr("""
{
.reg .b32 z, w0, w1, t0, t1;
mov.b32 z, 0;
prmt.b32 w0, $4, z, 0x4140;
prmt.b32 w1, $4, z, 0x4342;
and.b32 t0, w0, 0x00070007;
shl.b32 t0, t0, 6;
and.b32 t1, w0, 0x00080008;
shl.b32 t1, t1, 12;
or.b32 t0, t0, t1;
mul.rn.bf16x2 $0, t0, $5;
and.b32 t0, w1, 0x00070007;
shl.b32 t0, t0, 6;
and.b32 t1, w1, 0x00080008;
shl.b32 t1, t1, 12;
or.b32 t0, t0, t1;
mul.rn.bf16x2 $1, t0, $6;
and.b32 t0, w0, 0x00700070;
shl.b32 t0, t0, 2;
and.b32 t1, w0, 0x00800080;
shl.b32 t1, t1, 8;
or.b32 t0, t0, t1;
mul.rn.bf16x2 $2, t0, $5;
and.b32 t0, w1, 0x00700070;
shl.b32 t0, t0, 2;
and.b32 t1, w1, 0x00800080;
shl.b32 t1, t1, 8;
or.b32 t0, t0, t1;
mul.rn.bf16x2 $3, t0, $6;
}
""")


@triton.jit
def _decode_bf16_tile(wb, sc, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr,
                      SCALE_PER_BYTE: tl.constexpr):
    """Packed bytes ``wb [BLOCK_N, BLOCK_K/2]`` (uint8) with their E8M0 scale bytes ``sc`` (int32: one per 32
    weights ``[BLOCK_N, BLOCK_K/32]``, or ``SCALE_PER_BYTE``: already one per byte ``[BLOCK_N, BLOCK_K/2]``) → the
    even-column (low nibble) and odd-column (high nibble) values, bf16 ``[BLOCK_N, BLOCK_K/2]`` each, exact
    (value × 2^(s−127))."""
    G: tl.constexpr = BLOCK_K // 32
    if ASM:
        mult = ((sc + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 2^(s−1) = 2^(s−127) · 2^126
        if not SCALE_PER_BYTE:
            mult = tl.reshape(tl.broadcast_to(mult[:, :, None], (BLOCK_N, G, 16)), (BLOCK_N, BLOCK_K // 2))
        lo, hi = tl.inline_asm_elementwise(_DECODE_BF16_PTX, "=r,=r,=r,=r,r,r,r", [wb, mult],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        f = e8m0_to_f32(sc) * 16384.0  # × 2^14: the fp16 codec returns value · 2^-14
        if not SCALE_PER_BYTE:
            f = tl.reshape(tl.broadcast_to(f[:, :, None], (BLOCK_N, G, 16)), (BLOCK_N, BLOCK_K // 2))
        lo, hi = e2m1_pair_to_f32_scaled(wb.to(tl.int32))
        lo = (lo * f).to(tl.bfloat16)  # exact: E2M1 × 2^s fits bf16
        hi = (hi * f).to(tl.bfloat16)
    return lo, hi


@triton.jit
def _unpack_fp8(w_ptr, s_ptr, e, rn, n_ok, k0, K, stride_we, stride_wn, stride_se, stride_sn,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The tile as two E4M3 halves times ``2^(s − ref)`` per 32-group, and ``2^ref`` per row (fp32).

    ``ref`` = the row's largest scale in the tile − 6: E2M1 values (0.5 … 6) times ``2^-8 … 2^6`` are all exact
    in E4M3 (384 ≤ 448 at the top, 2^-9 is its smallest subnormal), so up to 14 binades of scale spread are exact.
    """
    lo, hi, sc = _load_weight_halves(w_ptr, s_ptr, e, rn, n_ok, k0, K, stride_we, stride_wn, stride_se, stride_sn,
                                     BLOCK_N, BLOCK_K)
    ref = tl.max(sc, axis=1) - 6
    rel = pow2(tl.maximum(sc - ref[:, None] + 14, -126))[:, :, None]  # + 14: the codec gives value · 2^-14
    w_lo = tl.reshape((lo * rel).to(tl.float8e4nv), (BLOCK_N, BLOCK_K // 2))
    w_hi = tl.reshape((hi * rel).to(tl.float8e4nv), (BLOCK_N, BLOCK_K // 2))
    return w_lo, w_hi, e8m0_to_f32(ref)


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr):
    if UPCAST:  # the CPU interpreter computes bf16/fp8 dots wrongly: feed it fp32
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _accumulate_tile(acc, w_ptr, s_ptr, e, rn, n_ok, x_ptr, xs_ptr, xrow, row_ok, k0, K,
                     stride_we, stride_wn, stride_se, stride_sn, stride_xm, stride_xs,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr, ROUTE: tl.constexpr,
                     DECODE_ASM: tl.constexpr, SCALE_PER_BYTE: tl.constexpr, UPCAST: tl.constexpr):
    """``acc[BLOCK_N, ROWS] += W[e, rn, k0:k0+BLOCK_K] · X[xrow, k0:k0+BLOCK_K]ᵀ`` for one route."""
    x_rows = x_ptr + xrow[None, :].to(tl.int64) * stride_xm
    if ROUTE == 2:  # tl.dot_scaled on the stored E2M1 bytes and E8M0 scales
        G: tl.constexpr = BLOCK_K // 32
        kk = tl.arange(0, BLOCK_K)
        kj = tl.arange(0, BLOCK_K // 2)
        gi = tl.arange(0, G)
        k_ok = (k0 + kk) < K
        xt = tl.load(x_rows + (k0 + kk)[:, None], mask=k_ok[:, None] & row_ok[None, :], other=0.0)
        xsc = tl.load(xs_ptr + xrow[:, None].to(tl.int64) * stride_xs + k0 // 32 + gi[None, :],
                      mask=row_ok[:, None] & ((k0 + 32 * gi) < K)[None, :], other=127)
        w_row = w_ptr + e.to(tl.int64) * stride_we + rn[:, None].to(tl.int64) * stride_wn
        wb = tl.load(w_row + (k0 // 2 + kj)[None, :], mask=n_ok[:, None] & ((k0 + 2 * kj) < K)[None, :], other=0)
        wsc = tl.load(s_ptr + e.to(tl.int64) * stride_se + rn[:, None].to(tl.int64) * stride_sn + k0 // 32
                      + gi[None, :], mask=n_ok[:, None] & ((k0 + 32 * gi) < K)[None, :], other=127)
        acc = tl.dot_scaled(wb, wsc, "e2m1", xt, xsc, "e4m3", acc)
    else:
        kj = tl.arange(0, BLOCK_K // 2)
        k_ok = (k0 // 2 + kj) < K // 2
        m = k_ok[:, None] & row_ok[None, :]
        xe = tl.load(x_rows + (k0 // 2 + kj)[:, None], mask=m, other=0.0)
        xo = tl.load(x_rows + K // 2 + (k0 // 2 + kj)[:, None], mask=m, other=0.0)
        if ROUTE == 0:
            w_row = w_ptr + e.to(tl.int64) * stride_we + rn[:, None].to(tl.int64) * stride_wn
            wb = tl.load(w_row + (k0 // 2 + kj)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
            s_row = s_ptr + e.to(tl.int64) * stride_se + rn[:, None].to(tl.int64) * stride_sn + k0 // 32
            if SCALE_PER_BYTE:  # each byte's scale loaded where it is used (16 bytes share one: cached)
                sc = tl.load(s_row + (kj // 16)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=127)
            else:  # one per 32 weights, broadcast in registers
                gi = tl.arange(0, BLOCK_K // 32)
                sc = tl.load(s_row + gi[None, :], mask=n_ok[:, None] & ((k0 + 32 * gi) < K)[None, :], other=127)
            w_lo, w_hi = _decode_bf16_tile(wb, sc.to(tl.int32), BLOCK_N, BLOCK_K, DECODE_ASM, SCALE_PER_BYTE)
            acc = _mma(w_lo, xe, acc, UPCAST)
            acc = _mma(w_hi, xo, acc, UPCAST)
        else:
            w_lo, w_hi, w_top = _unpack_fp8(w_ptr, s_ptr, e, rn, n_ok, k0, K, stride_we, stride_wn, stride_se,
                                            stride_sn, BLOCK_N, BLOCK_K)
            part = _mma(w_lo, xe, tl.zeros((BLOCK_N, ROWS), dtype=tl.float32), UPCAST)
            part = _mma(w_hi, xo, part, UPCAST)
            sx = tl.load(xs_ptr + xrow.to(tl.int64) * stride_xs + k0 // 128, mask=row_ok, other=0.0)
            acc += part * w_top[:, None] * sx[None, :]
    return acc


# ============================================================================================ stage 1: gate/up
@triton.jit
def _gate_up_kernel(x_ptr, xs_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, sorted_ptr, block_expert_ptr, first_block_ptr,
                    expert_blocks_ptr, used_blocks_ptr, rw_ptr, out0_ptr, out1_ptr, D, I, TOPK, limit,
                    stride_xm, stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_o0, stride_o1,
                    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROUTE: tl.constexpr,
                    FUSE: tl.constexpr, DECODE_ASM: tl.constexpr, SCALE_PER_BYTE: tl.constexpr, UPCAST: tl.constexpr):
    n_tiles = tl.cdiv(I, BLOCK_N)
    total = tl.load(used_blocks_ptr) * n_tiles
    for w in range(tl.program_id(0), total, tl.num_programs(0)):  # one item per program unless persistent
        blk, tile, e = expert_work_item(w, n_tiles, block_expert_ptr, first_block_ptr, expert_blocks_ptr)
        rows = blk * ROWS + tl.arange(0, ROWS)
        slot = tl.load(sorted_ptr + rows)
        valid = slot >= 0
        tok = tl.where(valid, slot // TOPK, 0)
        rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < I
        acc_g = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            acc_g = _accumulate_tile(acc_g, w1_ptr, s1_ptr, e, rn, n_ok, x_ptr, xs_ptr, tok, valid, k0, D,
                                     stride_we, stride_wn, stride_se, stride_sn, stride_xm, stride_xs,
                                     BLOCK_N, BLOCK_K, ROWS, ROUTE, DECODE_ASM, SCALE_PER_BYTE, UPCAST)
            acc_u = _accumulate_tile(acc_u, w3_ptr, s3_ptr, e, rn, n_ok, x_ptr, xs_ptr, tok, valid, k0, D,
                                     stride_we, stride_wn, stride_se, stride_sn, stride_xm, stride_xs,
                                     BLOCK_N, BLOCK_K, ROWS, ROUTE, DECODE_ASM, SCALE_PER_BYTE, UPCAST)
        # the reference's Linear outputs bf16: round g and u before the activation
        g = to_bf16(acc_g).to(tl.float32)
        u = to_bf16(acc_u).to(tl.float32)
        keep = n_ok[:, None] & valid[None, :]
        if FUSE:
            q, ex = routed_swiglu_fp8(g, u, tl.load(rw_ptr + slot, mask=valid, other=0.0), limit, keep)
            row_off = rows[None, :].to(tl.int64) * stride_o0
            if ROUTE == 2:
                tl.store(out0_ptr + row_off + rn[:, None], q, mask=keep)
                sub = tl.arange(0, 4)
                byte = tl.broadcast_to((ex + 127).to(tl.uint8)[:, None], (ROWS, 4))
                tl.store(out1_ptr + rows[:, None].to(tl.int64) * stride_o1 + tile * 4 + sub[None, :], byte,
                         mask=valid[:, None] & ((tile * BLOCK_N + 32 * sub) < I)[None, :])
            else:
                split = (rn % 2) * (I // 2) + rn // 2
                if ROUTE == 0:
                    tl.store(out0_ptr + row_off + split[:, None], (q.to(tl.float32) * pow2(ex)[None, :]).to(
                        tl.bfloat16), mask=keep)
                else:
                    tl.store(out0_ptr + row_off + split[:, None], q, mask=keep)
                    tl.store(out1_ptr + rows.to(tl.int64) * stride_o1 + tile, pow2(ex), mask=valid)
        else:
            off = slot[None, :].to(tl.int64) * stride_o0 + rn[:, None]
            tl.store(out0_ptr + off, g, mask=keep)
            tl.store(out1_ptr + off, u, mask=keep)


# ============================================================================================ stage 2: down
@triton.jit
def _down_kernel(x_ptr, xs_ptr, w2_ptr, s2_ptr, sorted_ptr, block_expert_ptr, first_block_ptr, expert_blocks_ptr,
                 used_blocks_ptr, out_ptr, D, I,
                 stride_xm, stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_o,
                 ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROUTE: tl.constexpr,
                 X_SORTED: tl.constexpr, DECODE_ASM: tl.constexpr, SCALE_PER_BYTE: tl.constexpr,
                 UPCAST: tl.constexpr):
    n_tiles = tl.cdiv(D, BLOCK_N)
    total = tl.load(used_blocks_ptr) * n_tiles
    for w in range(tl.program_id(0), total, tl.num_programs(0)):
        blk, tile, e = expert_work_item(w, n_tiles, block_expert_ptr, first_block_ptr, expert_blocks_ptr)
        rows = blk * ROWS + tl.arange(0, ROWS)
        slot = tl.load(sorted_ptr + rows)
        valid = slot >= 0
        if X_SORTED:
            xrow = rows
        else:
            xrow = tl.where(valid, slot, 0)
        rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < D
        acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            acc = _accumulate_tile(acc, w2_ptr, s2_ptr, e, rn, n_ok, x_ptr, xs_ptr, xrow, valid, k0, I,
                                   stride_we, stride_wn, stride_se, stride_sn, stride_xm, stride_xs,
                                   BLOCK_N, BLOCK_K, ROWS, ROUTE, DECODE_ASM, SCALE_PER_BYTE, UPCAST)
        off = slot[None, :].to(tl.int64) * stride_o + rn[:, None]
        tl.store(out_ptr + off, to_bf16(acc), mask=n_ok[:, None] & valid[None, :])


# ============================================================================================ combine
@triton.jit
def _combine_kernel(out_ptr, idx_ptr, y_ptr, T, D, TOPK, expert_lo, expert_hi, stride_o, stride_y,
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, OUT_F64: tl.constexpr):
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok = rt < T
    d_ok = d < D
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float64)  # a sum of k bf16 values is exact in fp64: order-free
    for j in range(0, TOPK):
        slot = rt.to(tl.int64) * TOPK + j
        ex = tl.load(idx_ptr + slot, mask=t_ok, other=-1)
        own = (ex >= expert_lo) & (ex < expert_hi)  # slots of other ranks: read nothing
        v = tl.load(out_ptr + slot[:, None] * stride_o + d[None, :], mask=own[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float64)
        acc += tl.where(v != v, 0.0, v)  # the reference skips NaN slots (nan_to_num)
    y = y_ptr + rt[:, None].to(tl.int64) * stride_y + d[None, :]
    if OUT_F64:
        tl.store(y, acc, mask=t_ok[:, None] & d_ok[None, :])
    else:
        tl.store(y, acc.to(tl.float32), mask=t_ok[:, None] & d_ok[None, :])


# ============================================================================================ launchers
@dataclass(frozen=True)
class MoEGeometry:
    """Launch geometry of the two grouped GEMMs (stage 1 needs ``block_n1 = 128``: the FP8 block of h)."""

    rows: int = 64
    block_n1: int = 128
    block_k1: int = 128
    warps1: int = 8
    stages1: int = 3
    block_n2: int = 128
    block_k2: int = 128
    warps2: int = 8
    stages2: int = 3
    decode: str = "auto"  # bf16 route's weight decode: "asm" (GPU), "f16" (portable) or "auto" (see the docstring)
    persistent: bool = False  # one program per SM walking the work items, instead of one program per item
    scale_per_byte: bool = False  # bf16 route: load each byte's scale (a cached gather) instead of broadcasting
    lut_ref: str = "auto"  # fp8lut route: one scale reference per weight row ("row") or per tile ("tile"), or "auto"

    def replace(self, **kw) -> "MoEGeometry":
        return replace(self, **kw)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _check_bank(bank) -> None:
    assert bank.fmt == "fp4", f"grouped FP4 MoE: expert bank format is {bank.fmt!r}, expected 'fp4'"
    E, I, D = bank.n_experts, bank.inter, bank.dim
    for name, shape in (("w1", (E, I, D // 2)), ("w3", (E, I, D // 2)), ("w2", (E, D, I // 2)),
                        ("w1_scale", (E, I, D // 32)), ("w3_scale", (E, I, D // 32)), ("w2_scale", (E, D, I // 32))):
        t = getattr(bank, name)
        assert tuple(t.shape) == shape, f"expert bank {name}: shape {list(t.shape)}, expected {list(shape)}"
        assert t.is_contiguous(), f"expert bank {name} must be contiguous"


_SCALES = ("w1_scale", "w3_scale", "w2_scale")


def _per_bank(kind, bank, compute) -> bool:
    """``compute(scales)`` once per bank's scale tensors (:func:`~.rowops.once_per_tensors`: a stale "exact" once
    sent a later bank, at the freed memory of an earlier one, down a route its scales do not allow)."""
    return once_per_tensors(kind, [getattr(bank, n) for n in _SCALES], compute)


def fp8_route_exact(bank, block_k: int = 128) -> bool:
    """Whether every ``block_k``-wide K tile of every expert weight has 1×32 scales within
    :data:`FP8_ROUTE_MAX_SPREAD` binades, so the ``fp8`` route's upcast to E4M3 is exact."""
    per = block_k // 32

    def spread_ok(scales) -> bool:
        for t in scales:
            s = _u8(t).to(torch.int16)
            pad = -s.shape[-1] % per
            hi = torch.nn.functional.pad(s, (0, pad), value=0).view(*s.shape[:-1], -1, per).amax(-1)
            lo = torch.nn.functional.pad(s, (0, pad), value=255).view(*s.shape[:-1], -1, per).amin(-1)
            if not bool(((hi - lo) <= FP8_ROUTE_MAX_SPREAD).all()):
                return False
        return True
    return _per_bank(("fp8", block_k), bank, spread_ok)


def asm_decode_exact(bank) -> bool:
    """Whether every 1×32 scale byte of ``bank`` lies in [2, :data:`ASM_MAX_SCALE_BYTE`], where the ``asm``
    decode's bf16 multiply by 2^(s−1) is exact (no overflow above, no bf16 subnormal result below)."""
    return _per_bank("asm", bank, lambda scales: all(
        bool(((_u8(t) >= 2) & (_u8(t) <= ASM_MAX_SCALE_BYTE)).all()) for t in scales))


@triton.jit
def _decode_probe_kernel(w_ptr, s_ptr, lo_ptr, hi_ptr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         ASM: tl.constexpr):
    G: tl.constexpr = BLOCK_K // 32
    rn = tl.arange(0, BLOCK_N)
    kj = tl.arange(0, BLOCK_K // 2)
    wb = tl.load(w_ptr + rn[:, None] * (BLOCK_K // 2) + kj[None, :])
    sc = tl.load(s_ptr + rn[:, None] * G + tl.arange(0, G)[None, :]).to(tl.int32)
    lo, hi = _decode_bf16_tile(wb, sc, BLOCK_N, BLOCK_K, ASM, False)
    tl.store(lo_ptr + rn[:, None] * (BLOCK_K // 2) + kj[None, :], lo)
    tl.store(hi_ptr + rn[:, None] * (BLOCK_K // 2) + kj[None, :], hi)


def _probe_asm_decode(dev: torch.device) -> bool | str:
    bn, bk = 32, 128
    w = torch.arange(bn * bk // 2, device=dev).remainder(256).to(torch.uint8).view(bn, bk // 2)
    sc = torch.linspace(2, ASM_MAX_SCALE_BYTE, bn * bk // 32, device=dev).round().to(torch.uint8).view(bn, -1)
    outs = []
    for asm in (True, False):
        lo, hi = (torch.empty(bn, bk // 2, dtype=torch.bfloat16, device=dev) for _ in range(2))
        _decode_probe_kernel[(1,)](w, sc, lo, hi, BLOCK_N=bn, BLOCK_K=bk, ASM=asm)
        outs.append(torch.cat((lo, hi), 1))
    ok = torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    return True if ok else "the inline-PTX decode differs from the portable decode"


_ASM_PROBE = DeviceProbe(_probe_asm_decode)


def asm_decode_works(device) -> bool:
    """Whether the inline-PTX decode compiles and reproduces the portable decode bit for bit on ``device``: every
    byte value under scale bytes 2 … 128, checked once per process (never in the CPU interpreter)."""
    if torch.device(device).type != "cuda" or interpreting():
        return False
    return _ASM_PROBE.works(device)


def asm_decode_status(device) -> str:
    """Why :func:`asm_decode_works` said what it said (for logs and benchmark records)."""
    return _ASM_PROBE.status(device)


def _decode_asm(route: str, geo: "MoEGeometry", bank, device) -> bool:
    """Resolve ``geo.decode`` for a launch: True to run the inline-PTX decode."""
    if route != "bf16":
        return False
    if geo.decode not in DECODES:
        raise ValueError(f"unknown MoE decode {geo.decode!r}; known: {', '.join(DECODES)}")
    if geo.decode == "f16":
        return False
    usable = asm_decode_exact(bank) and asm_decode_works(device)
    if geo.decode == "asm" and not usable:
        raise ValueError(f"MoE decode 'asm' is not usable here (scale bytes in [2, {ASM_MAX_SCALE_BYTE}]: "
                         f"{asm_decode_exact(bank)}; {asm_decode_status(device)})")
    return usable


def _grid(routing: SortedRouting, n_tiles: int, geo: "MoEGeometry", device) -> tuple[int]:
    """One program per possible work item, or (persistent) one per SM — never more than there are items."""
    items = routing.max_blocks * n_tiles
    if not geo.persistent:
        return (items,)
    if torch.device(device).type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 3  # the interpreter: a few programs, each walking several items
    return (max(1, min(items, sms)),)


def _activation_operands(x: torch.Tensor, route: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` quantized as the reference does, in the layout ``route`` reads: (values, scales)."""
    if route == "bf16":
        qa = quantize_activations(x, q=False, deq_split=True)
        return qa["deq_split"], qa["scale"]
    if route in FP8_SPLIT_ROUTES:
        qa = quantize_activations(x, q=False, q_split=True)
        return qa["q_split"], qa["scale"]
    qa = quantize_activations(x, q=True, scales32=True)
    return qa["q"], qa["scale32"]


def _h_buffers(n_rows: int, inter: int, route: str, device, poison: bool):
    """Stage 1's fused output (h, FP8-quantized per 128 columns) in the layout of ``route``."""
    nan_fill = float("nan") if poison else None
    if route == "bf16":
        h = torch.empty(n_rows, inter, dtype=torch.bfloat16, device=device)
        hs = torch.empty(1, 1, dtype=torch.float32, device=device)
        if poison:
            h.fill_(nan_fill)
        return h, hs
    h = torch.empty(n_rows, inter, dtype=torch.float8_e4m3fn, device=device)
    if poison:
        h.view(torch.uint8).fill_(0x7F)  # E4M3 NaN
    if route in FP8_SPLIT_ROUTES:  # fp8lut reads a column block's rows contiguously: stored column block-major
        hs = torch.empty(n_rows, triton.cdiv(inter, 128), dtype=torch.float32, device=device) if route == "fp8" \
            else torch.empty(triton.cdiv(inter, 128), n_rows, dtype=torch.float32, device=device).t()
        if poison:
            hs.fill_(nan_fill)
    else:
        hs = torch.empty(n_rows, triton.cdiv(inter, 32), dtype=torch.uint8, device=device)
        if poison:
            hs.fill_(255)  # E8M0 NaN
    return h, hs


def _check_route(route: str, bank, geo: MoEGeometry) -> None:
    assert route in ROUTES, f"unknown MoE route {route!r}; known: {', '.join(ROUTES)}"
    assert geo.block_k1 % 32 == 0 and geo.block_k2 % 32 == 0, "BLOCK_K must be a multiple of the FP4 group (32)"
    if route in FP8_SPLIT_ROUTES:
        assert 128 % geo.block_k1 == 0 and 128 % geo.block_k2 == 0, f"{route} route: BLOCK_K must divide 128"
    if route == "fp8":
        assert fp8_route_exact(bank, max(geo.block_k1, geo.block_k2)), \
            f"fp8 route: some K tile's FP4 scales span more than {FP8_ROUTE_MAX_SPREAD} binades (the E4M3 upcast " \
            "would not be exact)"
    if route == fp8lut.ROUTE:
        assert fp8lut.lut_route_exact(bank, max(geo.block_k1, geo.block_k2)), \
            f"fp8lut route: some weight row's K tile has FP4 scales spanning more than {fp8lut.LUT_MAX_SPREAD} " \
            f"binades or outside bytes {fp8lut.LUT_SCALE_BYTES} (its E4M3 weights would not be exact)"


def gate_up(xv: torch.Tensor, xs: torch.Tensor, bank, routing: SortedRouting, route: str, geo: MoEGeometry,
            weights: torch.Tensor | None = None, limit: float = 0.0, fuse: bool = True, poison: bool = False):
    """Stage 1 on pre-quantized activations ``(xv, xs)`` (see :func:`_activation_operands`).

    ``fuse=True``: returns ``(h, h_scale)`` per sorted row (stage 2's input); ``weights [T·k]`` fp32 needed.
    ``fuse=False``: returns ``(g, u)`` fp32 ``[T·k, I]`` (bf16-rounded; rows of unowned slots are NaN).
    """
    E, I, D = bank.n_experts, bank.inter, bank.dim
    rows = routing.rows
    n_slots = xv.shape[0] * routing.top_k
    dev = xv.device
    if fuse:
        assert geo.block_n1 == 128, "fused stage 1 quantizes h per 128 columns: block_n1 must be 128"
        assert weights is not None and weights.dtype == torch.float32 and weights.is_contiguous()
        out0, out1 = _h_buffers(routing.sorted_slots.shape[0], I, route, dev, poison)
        so0, so1 = out0.stride(0), out1.stride(0)
        rw = weights
    else:
        out0 = torch.full((n_slots, I), float("nan"), dtype=torch.float32, device=dev)
        out1 = torch.full_like(out0, float("nan"))
        so0 = so1 = I
        rw = routing.sorted_slots  # unused
    grid = _grid(routing, triton.cdiv(I, geo.block_n1), geo, dev)
    w1, w3 = _u8(bank.w1), _u8(bank.w3)
    s1, s3 = _u8(bank.w1_scale), _u8(bank.w3_scale)
    if route == fp8lut.ROUTE:
        fp8lut.gate_up(xv, xs, bank, routing, geo, rw, out0, out1, limit, fuse, grid, dev)
        return out0, out1
    _gate_up_kernel[grid](xv, xs, w1, w3, s1, s3, routing.sorted_slots, routing.block_expert,
                          routing.expert_first_block, routing.expert_blocks, routing.used_blocks, rw, out0, out1,
                          D, I, routing.top_k, float(limit), xv.stride(0), xs.stride(0), w1.stride(0), w1.stride(1),
                          s1.stride(0), s1.stride(1), so0, so1, ROWS=rows, BLOCK_N=geo.block_n1,
                          BLOCK_K=geo.block_k1, ROUTE=ROUTE_ID[route], FUSE=fuse,
                          DECODE_ASM=_decode_asm(route, geo, bank, dev), SCALE_PER_BYTE=geo.scale_per_byte,
                          UPCAST=interpreting(), num_warps=geo.warps1, num_stages=geo.stages1)
    return out0, out1


def down(hv: torch.Tensor, hs: torch.Tensor, bank, routing: SortedRouting, route: str, geo: MoEGeometry,
         n_slots: int, x_sorted: bool = True) -> torch.Tensor:
    """Stage 2: bf16 per-slot outputs ``[n_slots, D]`` (rows of slots not in the bank are left unwritten).

    ``x_sorted``: ``hv`` rows are sorted rows (stage 1's fused output) rather than slot ids."""
    E, I, D = bank.n_experts, bank.inter, bank.dim
    out = torch.empty(n_slots, D, dtype=torch.bfloat16, device=hv.device)
    w2, s2 = _u8(bank.w2), _u8(bank.w2_scale)
    grid = _grid(routing, triton.cdiv(D, geo.block_n2), geo, hv.device)
    if route == fp8lut.ROUTE:
        fp8lut.down(hv, hs, bank, routing, geo, out, x_sorted, grid)
        return out
    _down_kernel[grid](hv, hs, w2, s2, routing.sorted_slots, routing.block_expert, routing.expert_first_block,
                       routing.expert_blocks, routing.used_blocks, out, D, I, hv.stride(0),
                       hs.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), out.stride(0),
                       ROWS=routing.rows, BLOCK_N=geo.block_n2, BLOCK_K=geo.block_k2, ROUTE=ROUTE_ID[route],
                       X_SORTED=x_sorted, DECODE_ASM=_decode_asm(route, geo, bank, hv.device),
                       SCALE_PER_BYTE=geo.scale_per_byte, UPCAST=interpreting(), num_warps=geo.warps2,
                       num_stages=geo.stages2)
    return out


def combine_slots(out: torch.Tensor, idx: torch.Tensor, expert_lo: int, expert_hi: int, all_reduce=None,
                  block_d: int = 512, block_t: int = 8) -> torch.Tensor:
    """``Σ`` over each token's owned slots ``[T·k, D]`` (bf16) → ``[T, D]`` fp32, as ``ReferenceOps.moe_combine``:
    the exact sum (fp64) rounded once, after ``all_reduce`` (expert parallelism) adds the other ranks' sums."""
    T, k = idx.shape
    D = out.shape[1]
    idx32 = idx.to(torch.int32).contiguous()
    y = torch.empty(T, D, dtype=torch.float64 if all_reduce is not None else torch.float32, device=out.device)
    if T:
        block_d = min(block_d, triton.next_power_of_2(D))
        _combine_kernel[(triton.cdiv(T, block_t), triton.cdiv(D, block_d))](
            out, idx32, y, T, D, k, expert_lo, expert_hi, out.stride(0), y.stride(0), BLOCK_T=block_t,
            BLOCK_D=block_d, OUT_F64=all_reduce is not None)
    if all_reduce is not None:
        y = all_reduce(y).to(torch.float32)
    return y


def routed_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, bank, limit: float,
                   route: str = "bf16", geo: MoEGeometry = MoEGeometry(), poison: bool = False,
                   routing: SortedRouting | None = None, all_reduce=None) -> torch.Tensor:
    """The routed MoE of ``x [T, D]`` (bf16): sort, quantize, gate/up + SwiGLU, down, combine → ``[T, D]`` fp32.

    ``poison`` fills the intermediate buffers with NaN first (tests: a read of a padding row shows up).
    """
    _check_bank(bank)
    _check_route(route, bank, geo)
    assert x.dtype == torch.bfloat16 and x.is_contiguous(), "routed_experts: x must be contiguous bf16 [T, D]"
    T, k = idx.shape
    if routing is None:
        routing = sort_by_expert(idx, bank.n_experts, geo.rows, bank.expert_offset)
    xv, xs = _activation_operands(x, route)
    h, hs = gate_up(xv, xs, bank, routing, route, geo, weights.reshape(-1).float().contiguous(), limit,
                    fuse=True, poison=poison)
    out = down(h, hs, bank, routing, route, geo, T * k, x_sorted=True)
    return combine_slots(out, idx, bank.expert_offset, bank.expert_offset + bank.n_experts, all_reduce)


def _owned(idx: torch.Tensor, bank) -> torch.Tensor:
    return (idx >= bank.expert_offset) & (idx < bank.expert_offset + bank.n_experts)


def moe_stage1(x: torch.Tensor, idx: torch.Tensor, bank, route: str = "bf16",
               geo: MoEGeometry = MoEGeometry()) -> tuple[torch.Tensor, torch.Tensor]:
    """``ReferenceOps.moe_stage1``: ``(g, u) [T, k, I]`` fp32, bf16-rounded, NaN for slots of other ranks."""
    _check_bank(bank)
    _check_route(route, bank, geo)
    T, k = idx.shape
    routing = sort_by_expert(idx, bank.n_experts, geo.rows, bank.expert_offset)
    xv, xs = _activation_operands(x.contiguous(), route)
    g, u = gate_up(xv, xs, bank, routing, route, geo, fuse=False)
    return g.view(T, k, -1), u.view(T, k, -1)


def moe_stage2(h: torch.Tensor, idx: torch.Tensor, bank, route: str = "bf16",
               geo: MoEGeometry = MoEGeometry()) -> torch.Tensor:
    """``ReferenceOps.moe_stage2``: ``h [T, k, I]`` fp32 → ``[T, k, D]`` fp32 (bf16-rounded; NaN for other ranks)."""
    _check_bank(bank)
    _check_route(route, bank, geo)
    T, k, I = h.shape
    routing = sort_by_expert(idx, bank.n_experts, geo.rows, bank.expert_offset)
    hv, hsc = _activation_operands(h.reshape(T * k, I).to(torch.bfloat16).contiguous(), route)
    out = down(hv, hsc, bank, routing, route, geo, T * k, x_sorted=False)
    out = torch.where(_owned(idx, bank).reshape(-1, 1), out.float(), float("nan"))
    return out.view(T, k, -1)
