"""Block-scaled FP8 GEMV / small-M GEMM for the decode step (wq_a, wq_b, wkv, wo_a, wo_b, shared expert,
indexer wq_b), the same kernel over BF16 weights (router, compressor, indexer weights, LM head in fp32), and the
cuBLAS alternative the backend's dispatch may pick instead (:func:`cublas_linear`).

``y[m, n] = Σ_k xq[m, k] · W[n, k]`` with ``W`` E4M3 ``[N, K]`` and one E8M0 scale per 128×128 block (partial
edge blocks allowed), and — when ``act_quant`` is on — ``xq`` the reference's activation quantization (per token,
per 128-wide K block, E4M3 values × a power-of-two scale, :func:`dsv4lab.core.quant.act_qdq_fp8` bit for bit)
computed in the kernel's prologue. Every product is exact in fp32; only the sums round.

Routes (``route``):

* ``"fma"`` — CUDA cores, one token row per program: a ``[block_n, block_k]`` tile of weights per step (16 contiguous
  bytes per thread and load), each weight converted in registers and multiplied by its activation with both
  power-of-two block scales folded into the activation (``q·s_x·s_w``: exact, so every product is the reference's
  term), accumulated element-wise in fp32 and reduced once at the end. About 2.5 instructions per weight byte, no
  shuffles in the loop: the tile size sets the bytes in flight. A second row re-reads the weights (from L2).
* ``"dot"`` — tensor cores: one ``[block_n, 128] × [128, 16]`` fp16 MMA per 128-block (E4M3 weights and the
  activation's E4M3 values are exact in fp16; a bf16 activation — ``wo_a`` — meets the weights in bf16), the
  two power-of-two scales applied to the fp32 block product.
  The batch is free up to 16 rows. (Triton's own FP8 MMA is not offered: Hopper accumulates FP8 products in a
  ~13-bit accumulator, outside the fp32 bound below.)

Split-K (``GemvGeometry.split_k``): each program stores its fp32 partial of the output tile and takes a ticket
(:mod:`.tickets`); the last program of the tile sums the partials in split order and writes the output — one
launch, deterministic (the order does not depend on which program finished last), so graph replay equals eager bit
for bit. Grouped projections (``wo_a``: ``x [M, G, K_g]``, ``W [G·R, K_g]`` → ``[M, G, R]``) are the same kernel
with ``groups=G``.

Numerics (``ACCUMULATION``): ``fma`` sums in IEEE fp32 (``γ(n)`` over the ``n = K`` terms); ``dot`` accumulates each
128-block inside tensor cores (aligned, truncated) and the blocks in fp32: ``γ(4n)``. cuBLAS's block-scaled FP8 GEMM
(``torch._scaled_mm``) is another model: measured on an H200 (the benchmark's accumulation probe) it keeps the
precision of Hopper's FP8 MMA inside each 128-wide K block — a small term after a 2^15-times larger one in the same
block is lost — so it is judged by the ``fp8_mma`` bound (:data:`dsv4lab.tools.verify.bounds.BLOCKED`), the model of the
prefill FP8 GEMMs, not by the fp32 one of the own routes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .formats import RNE_MAGIC, e8m0_to_f32, interpreting, round_to_bf16
from .tickets import counters, take_ticket
from .launch import pdl_args, pdl_prologue
from .rowops import to_act
from .swiglu import shared_swiglu
from dsv4lab.core import quant

ROUTES = ("fma", "dot")
ACCUMULATION = {"fma": ("fp32 FMA on CUDA cores, round to nearest", 1.0),
                "dot": ("fp16 tensor-core products per 128-block (aligned, truncated), blocks summed in fp32", 4.0),
                "cublas": ("cuBLAS bf16 GEMM with fp32 output (tensor cores)", 4.0)}
"""route → (description, ``c`` of the fp32 bound ``γ(c·K)``). cuBLAS's FP8 GEMM is judged by :data:`CUBLAS_FP8_ACC`."""
CUBLAS_FP8_ACC = "fp8_mma"
"""The accumulation model (:data:`dsv4lab.tools.verify.bounds.UNIT_ROUNDOFF`) cuBLAS's block-scaled FP8 GEMM is held to."""


@dataclass(frozen=True)
class GemvGeometry:
    """Launch geometry: output rows per program, K elements per tile (a multiple of 128), K splits, warps, stages;
    ``unroll`` tiles loaded per loop step (``fma``: more bytes in flight for the same accumulator), ``prequant``
    (``dot`` with activation quantization): the rows quantized once per launch by a small kernel instead of by
    every program (what a batch costs otherwise: each program quantizes all its rows); ``rows_per_program``
    (``dot``): token rows one program multiplies with each weight tile it reads — a step of up to that many rows
    (a batch, or a speculative verify step's ``b·(k+1)`` rows) reads every weight byte once, more rows split into
    programs that each read it again (16: one tensor-core operand; up to 64); ``fma_rows`` (``fma``): token rows one
    program multiplies with each weight tile it reads (1, 2 or 4; a verify step's ``k+1`` rows of one sequence read
    the weights once, each row summed exactly as alone)."""

    block_n: int = 32
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    unroll: int = 1
    prequant: bool = False
    rows_per_program: int = 16
    fma_rows: int = 1


FMA_ROWS = (1, 2, 4)
"""Token rows one ``fma`` program may take (:attr:`GemvGeometry.fma_rows`)."""


MULTI_ROW_VARIANTS = {"dot_rows64": ("dot", GemvGeometry(rows_per_program=64))}
"""Variants for steps of many token rows (name → (route, geometry)), for the dispatch's table: the ``dot`` route
with one program per weight tile for up to 64 rows (each weight byte read once by a step of ≤ 64 rows)."""


# ------------------------------------------------------------------------------------------------ device helpers
@triton.jit
def quantize_e4m3_split(x, amax):
    """The reference's activation quantization of blocks whose ``amax`` is given (broadcastable): the E4M3 grid
    values ``q`` (fp32, |q| ≤ 448) and the power-of-two scale ``s = 2^ceil(log2(max(amax, 1e-4)/448))``, with
    ``q·s`` = :func:`dsv4lab.core.quant.act_qdq_fp8` exactly. Both are exact in fp16 (``s`` is not: it stays fp32)."""
    abits = tl.maximum(amax, 1e-4).to(tl.int32, bitcast=True)
    ex = ((abits >> 23) & 0xFF) - 135 + ((abits & 0x7FFFFF) > 0x600000).to(tl.int32)  # ceil(log2(amax/448))
    xs = x * ((127 - ex) << 23).to(tl.float32, bitcast=True)
    xs = tl.minimum(tl.maximum(xs, -448.0), 448.0)
    bits = tl.abs(xs).to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # E4M3 subnormals share the quantum of exponent -6
    q = ((xs * ((130 - e) << 23).to(tl.float32, bitcast=True) + RNE_MAGIC) - RNE_MAGIC) \
        * ((e + 124) << 23).to(tl.float32, bitcast=True)
    return q, ((ex + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _x_block(x_ptr, m, m_ok, stride_xm, k0, K, ACT_QUANT: tl.constexpr, NB: tl.constexpr):
    """Activation rows ``m`` at K ``k0..k0+128·NB`` as ``[TQ, NB, 128]`` fp32 and per-128 scales ``[TQ, NB]``:
    E4M3 grid values and their power-of-two scales when ``ACT_QUANT``, else the values and ones."""
    b = tl.arange(0, NB)
    i = tl.arange(0, 128)
    k = k0 + b[None, :, None] * 128 + i[None, None, :]
    k_end = tl.where(m_ok, K, 0)  # (a vector mask & a scalar mask loses its bool dtype in the interpreter)
    x = tl.load(x_ptr + m[:, None, None] * stride_xm + k, mask=k < k_end[:, None, None], other=0.0)
    x = x.to(tl.float32)
    if ACT_QUANT:
        q, s = quantize_e4m3_split(x, tl.max(tl.abs(x), axis=2)[:, :, None])
        return q, tl.reshape(s, (s.shape[0], NB))
    else:
        return x, tl.full((x.shape[0], NB), 1.0, tl.float32)


@triton.jit
def _x_in(x_ptr, u_ptr, m, m_ok, stride_xm, k0, K, limit, ACT_QUANT: tl.constexpr, SWIGLU: tl.constexpr,
          CLAMP: tl.constexpr, ROUND_BF16: tl.constexpr, NB: tl.constexpr):
    """:func:`_x_block` of the kernel's input: ``x`` itself, or (``SWIGLU``) the shared expert's activation
    ``act(silu(min(g, L)) · clamp(u, ±L))`` of the gate ``g`` at ``x_ptr`` and the up projection ``u`` at ``u_ptr``
    (:func:`.swiglu.shared_swiglu`, rounded to act as :func:`.swiglu.swiglu` stores it), then quantized as ``x``."""
    if SWIGLU:
        b = tl.arange(0, NB)
        i = tl.arange(0, 128)
        k = k0 + b[None, :, None] * 128 + i[None, None, :]
        k_end = tl.where(m_ok, K, 0)
        off = m[:, None, None] * stride_xm + k
        keep = k < k_end[:, None, None]
        g = tl.load(x_ptr + off, mask=keep, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + off, mask=keep, other=0.0).to(tl.float32)
        x = to_act(shared_swiglu(g, u, limit, CLAMP), ROUND_BF16)
        if ACT_QUANT:
            q, s = quantize_e4m3_split(x, tl.max(tl.abs(x), axis=2)[:, :, None])
            return q, tl.reshape(s, (s.shape[0], NB))
        else:
            return x, tl.full((x.shape[0], NB), 1.0, tl.float32)
    else:
        return _x_block(x_ptr, m, m_ok, stride_xm, k0, K, ACT_QUANT, NB)


@triton.jit
def _row_in(x_ptr, u_ptr, row0, r: tl.constexpr, M, stride_xm, k0, k_end, limit, sw, W_FP8: tl.constexpr,
            ACT_QUANT: tl.constexpr, SWIGLU: tl.constexpr, CLAMP: tl.constexpr, ROUND_BF16: tl.constexpr,
            NB: tl.constexpr, BK: tl.constexpr):
    """Row ``row0 + r`` as the fma route multiplies it into a weight tile: ``[BK]`` fp32, both power-of-two scales
    folded in (the activation's and, ``W_FP8``, the weight's ``sw [NB]``); zeros past ``M``."""
    mr = row0 + r + tl.arange(0, 1)
    x, sx = _x_in(x_ptr, u_ptr, mr, mr < M, stride_xm, k0, k_end, limit, ACT_QUANT, SWIGLU, CLAMP, ROUND_BF16, NB)
    if W_FP8:
        sx = sx * sw[None, :]
    return tl.reshape(x * sx[:, :, None], (BK,))


@triton.jit
def _xq_block(q_ptr, sq_ptr, m, m_ok, stride_qm, stride_sk, k0, K, NB: tl.constexpr):
    """:func:`_x_block` of rows quantized beforehand (:func:`act_quant_fp8`): E4M3 values ``q [M, K]`` and scales
    ``[K/128, M]`` (``stride_sk`` between 128-blocks)."""
    b = tl.arange(0, NB)
    i = tl.arange(0, 128)
    k = k0 + b[None, :, None] * 128 + i[None, None, :]
    k_end = tl.where(m_ok, K, 0)
    q = tl.load(q_ptr + m[:, None, None] * stride_qm + k, mask=k < k_end[:, None, None], other=0.0)
    kb = k0 // 128 + b
    sx = tl.load(sq_ptr + kb[None, :] * stride_sk + m[:, None], mask=m_ok[:, None] & (kb * 128 < K)[None, :],
                 other=0.0)
    return q.to(tl.float32), sx


@triton.jit
def _w_block(w_ptr, s_ptr, n, n_ok, stride_wn, stride_sn, k0, K, W_FP8: tl.constexpr, NB: tl.constexpr):
    """Weight rows ``n`` at K ``k0..k0+128·NB`` as ``[BN, NB, 128]`` (E4M3 or bf16, as stored) and the block
    scales ``[BN, NB]`` fp32 (ones for BF16 weights)."""
    b = tl.arange(0, NB)
    i = tl.arange(0, 128)
    k = k0 + b[None, :, None] * 128 + i[None, None, :]
    w = tl.load(w_ptr + n[:, None, None] * stride_wn + k, mask=n_ok[:, None, None] & (k < K), other=0.0)
    if W_FP8:
        kb = k0 // 128 + b
        sb = tl.load(s_ptr + (n // 128)[:, None] * stride_sn + kb[None, :], mask=n_ok[:, None] & (kb * 128 < K),
                     other=127).to(tl.int32)
        return w, e8m0_to_f32(sb)
    else:
        return w, tl.full((n.shape[0], NB), 1.0, tl.float32)


# ------------------------------------------------------------------------------------------------ kernels
@triton.jit
def _gemv_program(pid_n, pid_k, pid_m, num_n, x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, part_ptr, cnt_ptr,
                  M, N, K, n_per_group, stride_xm, stride_xg, stride_xs, stride_wn, stride_sn, SPLIT_K, B1, B2, B3,
                  u_ptr, limit,
                  W_FP8: tl.constexpr, ACT_QUANT: tl.constexpr, PREQUANT: tl.constexpr, ROUTE: tl.constexpr,
                  OUT_BF16: tl.constexpr, DOT_FP32: tl.constexpr, TQ: tl.constexpr, TP: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, KU: tl.constexpr, BLOCK_S: tl.constexpr,
                  SWIGLU: tl.constexpr, CLAMP: tl.constexpr, X_BF16: tl.constexpr):
    """Program ``(pid_n, pid_k, pid_m)`` of a grid of ``num_n`` output tiles × ``SPLIT_K`` splits × row blocks:
    the body of :func:`_fp8_gemv_kernel` and of each projection of :func:`_gemv_jobs_kernel`."""
    NB: tl.constexpr = BK // 128
    n = pid_n * BN + tl.arange(0, BN)
    n_ok = n < N
    group = (pid_n * BN) // n_per_group  # the launcher makes BN divide n_per_group when grouped
    xg_ptr = x_ptr + group * stride_xg
    xsg_ptr = xs_ptr + (group * stride_xg // 128) * stride_xs  # PREQUANT: the group's first scale block
    m = pid_m * TQ + tl.arange(0, TQ)
    m_ok = m < M

    n_chunks = tl.cdiv(K, BK)
    per_split = tl.cdiv(n_chunks, SPLIT_K)
    c_lo = pid_k * per_split
    c_hi = tl.minimum(c_lo + per_split, n_chunks)

    if ROUTE == 0:
        # TQ token rows (1, 2 or 4): a [BN, BK] weight tile per step, read once for all of them; both power-of-two
        # scales are folded into the activation (q·s_x·s_w, exact), each product exact in fp32, accumulated
        # element-wise, reduced once. Each row has an accumulator of its own, fed and summed exactly as the one-row
        # program's (TQ = 1): a row's result does not depend on the rows beside it
        kk = tl.arange(0, BK)
        acc0 = tl.zeros((BN, BK), tl.float32)
        acc1 = tl.zeros((BN, BK), tl.float32)
        acc2 = tl.zeros((BN, BK), tl.float32)
        acc3 = tl.zeros((BN, BK), tl.float32)
        srow = (pid_n * BN) // 128  # FP8: the launcher makes BN divide 128, so the tile has one scale row
        row0 = pid_m * TQ
        for c0 in range(c_lo, c_hi, KU):
            for u in tl.static_range(KU):  # KU independent tiles per step: their loads are in flight together
                k0 = (c0 + u) * BK
                k_end = tl.where(c0 + u < c_hi, K, 0)  # a tile past the split's end reads nothing
                k = k0 + kk
                w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & (k < k_end)[None, :],
                            other=0.0).to(tl.float32)
                sw = tl.full((NB,), 1.0, tl.float32)
                if W_FP8:
                    kb = k0 // 128 + tl.arange(0, NB)
                    sw = e8m0_to_f32(tl.load(s_ptr + srow * stride_sn + kb, mask=kb * 128 < k_end,
                                             other=127).to(tl.int32))
                acc0 += w * _row_in(xg_ptr, u_ptr, row0, 0, M, stride_xm, k0, k_end, limit, sw, W_FP8, ACT_QUANT,
                                    SWIGLU, CLAMP, X_BF16, NB, BK)[None, :]
                if TQ > 1:
                    acc1 += w * _row_in(xg_ptr, u_ptr, row0, 1, M, stride_xm, k0, k_end, limit, sw, W_FP8, ACT_QUANT,
                                        SWIGLU, CLAMP, X_BF16, NB, BK)[None, :]
                if TQ > 2:
                    acc2 += w * _row_in(xg_ptr, u_ptr, row0, 2, M, stride_xm, k0, k_end, limit, sw, W_FP8, ACT_QUANT,
                                        SWIGLU, CLAMP, X_BF16, NB, BK)[None, :]
                    acc3 += w * _row_in(xg_ptr, u_ptr, row0, 3, M, stride_xm, k0, k_end, limit, sw, W_FP8, ACT_QUANT,
                                        SWIGLU, CLAMP, X_BF16, NB, BK)[None, :]
        if TQ == 1:
            y = tl.reshape(tl.sum(acc0, axis=1), (BN, 1))
        else:  # the rows' sums side by side, [BN, TQ] (selected, not added: a −0 stays −0)
            tq = tl.arange(0, TQ)[None, :]
            y = tl.where(tq == 0, tl.sum(acc0, axis=1)[:, None], tl.sum(acc1, axis=1)[:, None])
            if TQ > 2:
                y = tl.where(tq == 2, tl.sum(acc2, axis=1)[:, None],
                             tl.where(tq == 3, tl.sum(acc3, axis=1)[:, None], y))
    else:
        acc = tl.zeros((BN, TP), tl.float32)
        for c in range(c_lo, c_hi):
            for b in tl.static_range(NB):
                k0 = c * BK + b * 128
                w, sw = _w_block(w_ptr, s_ptr, n, n_ok, stride_wn, stride_sn, k0, K, W_FP8, 1)
                if PREQUANT:
                    x, sx = _xq_block(xg_ptr, xsg_ptr, m, m_ok, stride_xm, stride_xs, k0, K, 1)
                else:
                    x, sx = _x_in(xg_ptr, u_ptr, m, m_ok, stride_xm, k0, K, limit, ACT_QUANT, SWIGLU, CLAMP, X_BF16, 1)
                w2 = tl.reshape(w, (BN, 128))
                x2 = tl.reshape(x, (TQ, 128))
                sx1 = tl.reshape(sx, (TQ,))
                if TP > TQ:  # a tensor-core operand needs 16 rows: padding rows are zero
                    tp = tl.arange(0, TP)
                    x2 = tl.where((tp < TQ)[:, None],
                                  tl.reshape(tl.broadcast_to(x2[None], (TP // TQ, TQ, 128)), (TP, 128)), 0.0)
                    sx1 = tl.where(tp < TQ, tl.reshape(tl.broadcast_to(sx1[None], (TP // TQ, TQ)), (TP,)), 0.0)
                if DOT_FP32:  # the interpreter's fp16/bf16 arithmetic is unreliable: the same exact values in fp32
                    blk = tl.dot(w2.to(tl.float32), tl.trans(x2), input_precision="ieee")
                elif W_FP8 and (ACT_QUANT or PREQUANT):
                    blk = tl.dot(w2.to(tl.float16), tl.trans(x2.to(tl.float16)))  # E4M3 values: exact in fp16
                else:  # a bf16 activation (wo_a, BF16 weights): bf16 operands, E4M3 weights exact in bf16
                    blk = tl.dot(w2.to(tl.bfloat16), tl.trans(x2.to(tl.bfloat16)))
                acc += blk * (tl.reshape(sw, (BN,))[:, None] * sx1[None, :])
        y = acc

    # output segments [0, B1), [B1, B2), [B2, B3), [B3, N) (unused boundaries = N), each stored as its own
    # [M, size] block one after the other; a tile lies in one segment (the launcher's block_n divides them)
    n0 = pid_n * BN
    lo = tl.where(n0 >= B3, B3, tl.where(n0 >= B2, B2, tl.where(n0 >= B1, B1, 0)))
    hi = tl.where(n0 < B1, B1, tl.where(n0 < B2, B2, tl.where(n0 < B3, B3, N)))
    o_ptr = out_ptr + (M * lo - lo)  # element (r, n) of the segment at o_ptr + r·(hi − lo) + n
    tt = tl.arange(0, y.shape[1])
    rows = pid_m * TQ + tt
    out_mask = n_ok[:, None] & (rows < M)[None, :] & (tt < TQ)[None, :]
    if SPLIT_K == 1:
        if OUT_BF16:
            tl.store(o_ptr + rows[None, :] * (hi - lo) + n[:, None], round_to_bf16(y).to(tl.bfloat16), mask=out_mask)
        else:
            tl.store(o_ptr + rows[None, :] * (hi - lo) + n[:, None], y, mask=out_mask)
    else:
        tl.store(part_ptr + (pid_k * M + rows[None, :]) * N + n[:, None], y, mask=out_mask)
        tile = pid_m * num_n + pid_n
        if take_ticket(cnt_ptr + tile) == SPLIT_K - 1:
            # the tile's last program: the partials in split order (not arrival order), one rounding
            sp = tl.arange(0, BLOCK_S)
            r2 = pid_m * TQ + tl.arange(0, TQ)
            ok2 = n_ok[:, None] & (r2 < M)[None, :]
            parts = tl.load(part_ptr + (sp[:, None, None] * M + r2[None, None, :]) * N + n[None, :, None],
                            mask=(sp < SPLIT_K)[:, None, None] & ok2[None], other=0.0, cache_modifier=".cg")
            total = tl.sum(parts, axis=0)
            if OUT_BF16:
                tl.store(o_ptr + r2[None, :] * (hi - lo) + n[:, None], round_to_bf16(total).to(tl.bfloat16),
                         mask=ok2)
            else:
                tl.store(o_ptr + r2[None, :] * (hi - lo) + n[:, None], total, mask=ok2)
            tl.store(cnt_ptr + tile, 0)


@triton.jit
def _fp8_gemv_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, part_ptr, cnt_ptr,
                     M, N, K, n_per_group, stride_xm, stride_xg, stride_xs, stride_wn, stride_sn, SPLIT_K, B1, B2, B3,
                     u_ptr, limit,
                     W_FP8: tl.constexpr, ACT_QUANT: tl.constexpr, PREQUANT: tl.constexpr, ROUTE: tl.constexpr,
                     OUT_BF16: tl.constexpr, DOT_FP32: tl.constexpr, TQ: tl.constexpr, TP: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, KU: tl.constexpr, BLOCK_S: tl.constexpr,
                     SWIGLU: tl.constexpr = False, CLAMP: tl.constexpr = False, X_BF16: tl.constexpr = False,
                     PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    _gemv_program(tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(0), x_ptr, xs_ptr, w_ptr,
                  s_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, n_per_group, stride_xm, stride_xg, stride_xs, stride_wn,
                  stride_sn, SPLIT_K, B1, B2, B3, u_ptr, limit, W_FP8, ACT_QUANT, PREQUANT, ROUTE, OUT_BF16, DOT_FP32,
                  TQ, TP, BN, BK, KU, BLOCK_S, SWIGLU, CLAMP, X_BF16)


@triton.jit(noinline=True)
def _gemv_job(pid_n, pid_k, pid_m, num_n, x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, n_per_group,
              stride_xm, stride_xg, stride_xs, stride_wn, stride_sn, SPLIT_K, B1, B2, B3, u_ptr, limit,
              W_FP8: tl.constexpr, ACT_QUANT: tl.constexpr, PREQUANT: tl.constexpr, ROUTE: tl.constexpr,
              OUT_BF16: tl.constexpr, DOT_FP32: tl.constexpr, TQ: tl.constexpr, TP: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr, KU: tl.constexpr, BLOCK_S: tl.constexpr, SWIGLU: tl.constexpr, CLAMP: tl.constexpr,
              X_BF16: tl.constexpr):
    """One projection's program of :func:`_gemv_jobs_kernel`, compiled as a function of its own (not inlined).
    Inlined, the projections of one launch share their index ranges (``tl.arange`` values are merged), and the
    compiler then gives all their weight loads one register layout — the widest any of them wants (an FP8 tile's
    16 bytes a thread); a BF16 tile of the same shape then reduces in another order than in its own launch (max
    |Δ| 0.95e-6 to 1.9e-6 on the H100: ``data/results/h100/diag_prefill_after_decode_f3de19f.json``, the ``gemv``
    rows). In a function of its own each projection gets the layout of its own launch."""
    _gemv_program(pid_n, pid_k, pid_m, num_n, x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K,
                  n_per_group, stride_xm, stride_xg, stride_xs, stride_wn, stride_sn, SPLIT_K, B1, B2, B3, u_ptr, limit,
                  W_FP8, ACT_QUANT, PREQUANT, ROUTE, OUT_BF16, DOT_FP32, TQ, TP, BN, BK, KU, BLOCK_S, SWIGLU, CLAMP,
                  X_BF16)


@triton.jit
def _gemv_jobs_kernel(
        a_x_ptr, a_xs_ptr, a_w_ptr, a_s_ptr, a_out_ptr, a_part_ptr, a_cnt_ptr, a_M, a_N, a_K, a_n_per_group,
        a_stride_xm, a_stride_xg, a_stride_xs, a_stride_wn, a_stride_sn, a_SPLIT_K, a_B1, a_B2, a_B3, a_u_ptr,
        a_limit, a_num_n, a_num_k, a_programs, b_x_ptr, b_xs_ptr, b_w_ptr, b_s_ptr, b_out_ptr, b_part_ptr, b_cnt_ptr,
        b_M, b_N, b_K, b_n_per_group, b_stride_xm, b_stride_xg, b_stride_xs, b_stride_wn, b_stride_sn, b_SPLIT_K,
        b_B1, b_B2, b_B3, b_u_ptr, b_limit, b_num_n, b_num_k, b_programs, c_x_ptr, c_xs_ptr, c_w_ptr, c_s_ptr,
        c_out_ptr, c_part_ptr, c_cnt_ptr, c_M, c_N, c_K, c_n_per_group, c_stride_xm, c_stride_xg, c_stride_xs,
        c_stride_wn, c_stride_sn, c_SPLIT_K, c_B1, c_B2, c_B3, c_u_ptr, c_limit, c_num_n, c_num_k, c_programs,
        d_x_ptr, d_xs_ptr, d_w_ptr, d_s_ptr, d_out_ptr, d_part_ptr, d_cnt_ptr, d_M, d_N, d_K, d_n_per_group,
        d_stride_xm, d_stride_xg, d_stride_xs, d_stride_wn, d_stride_sn, d_SPLIT_K, d_B1, d_B2, d_B3, d_u_ptr,
        d_limit, d_num_n, d_num_k, A_W_FP8: tl.constexpr, A_ACT_QUANT: tl.constexpr, A_PREQUANT: tl.constexpr,
        A_ROUTE: tl.constexpr, A_OUT_BF16: tl.constexpr, A_DOT_FP32: tl.constexpr, A_TQ: tl.constexpr,
        A_TP: tl.constexpr, A_BN: tl.constexpr, A_BK: tl.constexpr, A_KU: tl.constexpr, A_BLOCK_S: tl.constexpr,
        A_SWIGLU: tl.constexpr, A_CLAMP: tl.constexpr, A_X_BF16: tl.constexpr, B_W_FP8: tl.constexpr,
        B_ACT_QUANT: tl.constexpr, B_PREQUANT: tl.constexpr, B_ROUTE: tl.constexpr, B_OUT_BF16: tl.constexpr,
        B_DOT_FP32: tl.constexpr, B_TQ: tl.constexpr, B_TP: tl.constexpr, B_BN: tl.constexpr, B_BK: tl.constexpr,
        B_KU: tl.constexpr, B_BLOCK_S: tl.constexpr, B_SWIGLU: tl.constexpr, B_CLAMP: tl.constexpr,
        B_X_BF16: tl.constexpr, C_W_FP8: tl.constexpr, C_ACT_QUANT: tl.constexpr, C_PREQUANT: tl.constexpr,
        C_ROUTE: tl.constexpr, C_OUT_BF16: tl.constexpr, C_DOT_FP32: tl.constexpr, C_TQ: tl.constexpr,
        C_TP: tl.constexpr, C_BN: tl.constexpr, C_BK: tl.constexpr, C_KU: tl.constexpr, C_BLOCK_S: tl.constexpr,
        C_SWIGLU: tl.constexpr, C_CLAMP: tl.constexpr, C_X_BF16: tl.constexpr, D_W_FP8: tl.constexpr,
        D_ACT_QUANT: tl.constexpr, D_PREQUANT: tl.constexpr, D_ROUTE: tl.constexpr, D_OUT_BF16: tl.constexpr,
        D_DOT_FP32: tl.constexpr, D_TQ: tl.constexpr, D_TP: tl.constexpr, D_BN: tl.constexpr, D_BK: tl.constexpr,
        D_KU: tl.constexpr, D_BLOCK_S: tl.constexpr, D_SWIGLU: tl.constexpr, D_CLAMP: tl.constexpr,
        D_X_BF16: tl.constexpr, PDL: tl.constexpr = False):
    """Up to four projections of one step in one 1-D grid (the fused path ``x_projections``): programs
    ``0 … a_programs−1`` are the first projection's :func:`_fp8_gemv_kernel` programs (in its grid's order, the
    output tile fastest), the next ``b_programs`` the second's, and so on (``c_*``, ``d_*``) — each program runs
    :func:`_gemv_program` with its own projection's arguments, so each output has the bits of its own launch."""
    pdl_prologue(PDL)
    p = tl.program_id(0)
    if p < a_programs:
        _gemv_job(p % a_num_n, (p // a_num_n) % a_num_k, p // (a_num_n * a_num_k), a_num_n, a_x_ptr, a_xs_ptr,
                  a_w_ptr, a_s_ptr, a_out_ptr, a_part_ptr, a_cnt_ptr, a_M, a_N, a_K, a_n_per_group, a_stride_xm,
                  a_stride_xg, a_stride_xs, a_stride_wn, a_stride_sn, a_SPLIT_K, a_B1, a_B2, a_B3, a_u_ptr,
                  a_limit, A_W_FP8, A_ACT_QUANT, A_PREQUANT, A_ROUTE, A_OUT_BF16, A_DOT_FP32, A_TQ, A_TP, A_BN,
                  A_BK, A_KU, A_BLOCK_S, A_SWIGLU, A_CLAMP, A_X_BF16)
    elif p < a_programs + b_programs:
        q = p - (a_programs)
        _gemv_job(q % b_num_n, (q // b_num_n) % b_num_k, q // (b_num_n * b_num_k), b_num_n, b_x_ptr, b_xs_ptr,
                  b_w_ptr, b_s_ptr, b_out_ptr, b_part_ptr, b_cnt_ptr, b_M, b_N, b_K, b_n_per_group, b_stride_xm,
                  b_stride_xg, b_stride_xs, b_stride_wn, b_stride_sn, b_SPLIT_K, b_B1, b_B2, b_B3, b_u_ptr,
                  b_limit, B_W_FP8, B_ACT_QUANT, B_PREQUANT, B_ROUTE, B_OUT_BF16, B_DOT_FP32, B_TQ, B_TP, B_BN,
                  B_BK, B_KU, B_BLOCK_S, B_SWIGLU, B_CLAMP, B_X_BF16)
    elif p < a_programs + b_programs + c_programs:
        q = p - (a_programs + b_programs)
        _gemv_job(q % c_num_n, (q // c_num_n) % c_num_k, q // (c_num_n * c_num_k), c_num_n, c_x_ptr, c_xs_ptr,
                  c_w_ptr, c_s_ptr, c_out_ptr, c_part_ptr, c_cnt_ptr, c_M, c_N, c_K, c_n_per_group, c_stride_xm,
                  c_stride_xg, c_stride_xs, c_stride_wn, c_stride_sn, c_SPLIT_K, c_B1, c_B2, c_B3, c_u_ptr,
                  c_limit, C_W_FP8, C_ACT_QUANT, C_PREQUANT, C_ROUTE, C_OUT_BF16, C_DOT_FP32, C_TQ, C_TP, C_BN,
                  C_BK, C_KU, C_BLOCK_S, C_SWIGLU, C_CLAMP, C_X_BF16)
    else:
        q = p - (a_programs + b_programs + c_programs)
        _gemv_job(q % d_num_n, (q // d_num_n) % d_num_k, q // (d_num_n * d_num_k), d_num_n, d_x_ptr, d_xs_ptr,
                  d_w_ptr, d_s_ptr, d_out_ptr, d_part_ptr, d_cnt_ptr, d_M, d_N, d_K, d_n_per_group, d_stride_xm,
                  d_stride_xg, d_stride_xs, d_stride_wn, d_stride_sn, d_SPLIT_K, d_B1, d_B2, d_B3, d_u_ptr,
                  d_limit, D_W_FP8, D_ACT_QUANT, D_PREQUANT, D_ROUTE, D_OUT_BF16, D_DOT_FP32, D_TQ, D_TP, D_BN,
                  D_BK, D_KU, D_BLOCK_S, D_SWIGLU, D_CLAMP, D_X_BF16)


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, MP, BLOCK_M: tl.constexpr, PDL: tl.constexpr = False):
    """``x [M, K]`` → E4M3 ``q [MP, K]`` and fp32 scales ``s [K/128, MP]`` (rows ``M..MP``: zeros, scale 1) —
    the reference's per-token, per-128 activation quantization in the layouts ``torch._scaled_mm`` takes for
    1×128 block scaling (scales outer-dim-major)."""
    pdl_prologue(PDL)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.program_id(1)
    m_ok = m < M
    x, s = _x_block(x_ptr, m, m_ok, K, kb * 128, K, True, 1)
    k = kb * 128 + tl.arange(0, 128)
    keep = (m < MP)[:, None] & (k < K)[None, :]
    tl.store(q_ptr + m[:, None] * K + k[None, :], tl.reshape(x, (BLOCK_M, 128)).to(tl.float8e4nv), mask=keep)
    tl.store(s_ptr + kb * MP + m, tl.where(m_ok, tl.reshape(s, (BLOCK_M,)), 1.0), mask=m < MP)


# ------------------------------------------------------------------------------------------------ launchers
def token_blocks(M: int, route: str, rows_per_program: int = 16, fma_rows: int = 1) -> tuple[int, int]:
    """``(TQ, TP)``: token rows a program quantizes and the rows of its tensor-core operand (≥ 16), at most
    ``rows_per_program`` (a power of two, 16 to 64). The fma route takes up to ``fma_rows`` rows per program (1, 2
    or 4: each its own accumulator beside the weight tile, read once for them all), TP = TQ."""
    if route == "fma":
        if fma_rows not in FMA_ROWS:
            raise ValueError(f"GemvGeometry.fma_rows={fma_rows}: expected one of {FMA_ROWS}")
        tq = min(triton.next_power_of_2(max(M, 1)), fma_rows)
        return tq, tq
    if rows_per_program not in (16, 32, 64):
        raise ValueError(f"GemvGeometry.rows_per_program={rows_per_program}: expected 16, 32 or 64")
    tq = min(triton.next_power_of_2(max(M, 1)), rows_per_program)
    return tq, max(tq, 16)


@dataclass
class GemvPlan:
    """One :func:`fp8_gemv` call laid out for its kernel: the grid ``(output tiles, splits, row blocks)``, the
    kernel's positional arguments and constexprs, the launch options, and how its flat output becomes the result."""

    grid: tuple[int, int, int]
    args: list
    consts: dict
    num_warps: int
    num_stages: int
    out: torch.Tensor
    lead: tuple
    starts: list | None  # the segments' bounds (None: one projection)

    @property
    def programs(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def tiles(self) -> int:
        """Ticket counters it needs (one per output tile and row block, when split)."""
        return self.grid[0] * self.grid[2] if self.grid[1] > 1 else 0

    def result(self):
        M, N = self.args[7], self.args[8]  # the kernel arguments M, N (after cnt_ptr)
        if self.starts is None:
            return self.out.view(*self.lead, N)
        return tuple(self.out[M * lo:M * hi].view(*self.lead, hi - lo)
                     for lo, hi in zip(self.starts[:-1], self.starts[1:]))


def gemv_plan(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, act_quant: bool = True,
             out_dtype: torch.dtype = torch.bfloat16, groups: int = 1, route: str = "fma",
             geometry: GemvGeometry | None = None, segments: tuple[int, ...] | None = None,
             swiglu: tuple[torch.Tensor, float] | None = None) -> GemvPlan:
    """:func:`fp8_gemv`'s checks and layout, without the launch (its arguments and raises)."""
    if route not in ROUTES:
        raise ValueError(f"fp8_gemv: unknown route {route!r}; known: {', '.join(ROUTES)}")
    g = geometry or GemvGeometry()
    if g.block_k % 128:
        raise ValueError(f"GemvGeometry.block_k={g.block_k} must be a multiple of 128 (the activation block)")
    N, Kg = weight.shape
    lead = x.shape[:-1]
    if x.shape[-1] != groups * Kg:
        raise ValueError(f"fp8_gemv: x has {x.shape[-1]} features, the weight expects {groups}×{Kg}")
    if N % groups:
        raise ValueError(f"fp8_gemv: {N} output rows do not split into {groups} groups")
    x2 = x.reshape(-1, groups * Kg)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    M = x2.shape[0]
    u2, limit = x2, 0.0
    if swiglu is not None:
        up, limit = swiglu
        if up.shape != x.shape or up.dtype != x.dtype or x.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"fp8_gemv: the swiglu prologue takes gate and up of one shape and dtype (bf16 or fp32), "
                             f"got {tuple(x.shape)} {x.dtype} and {tuple(up.shape)} {up.dtype}")
        if groups > 1 or segments is not None:
            raise ValueError("fp8_gemv: the swiglu prologue computes one projection (no groups, no segments)")
        u2 = up.reshape(-1, Kg).contiguous()
    if not weight.is_contiguous():
        raise ValueError("fp8_gemv: the weight must be contiguous")
    w_fp8 = scale is not None
    if w_fp8:
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"fp8_gemv: FP8 weight expected, got {weight.dtype}")
        if tuple(scale.shape) != (triton.cdiv(N, 128), triton.cdiv(Kg, 128)):
            raise ValueError(f"fp8_gemv: scale {tuple(scale.shape)} does not match weight {tuple(weight.shape)} "
                             f"(one per 128×128 block)")
        s = scale.view(torch.uint8).contiguous()
        stride_sn = s.shape[1]
    else:
        if weight.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"fp8_gemv: unsupported weight dtype {weight.dtype}")
        s, stride_sn = weight, 0  # unused
    n_per_group = N // groups
    sizes = tuple(segments) if segments is not None else (N,)
    if len(sizes) > 4 or sum(sizes) != N or min(sizes) < 1 or (len(sizes) > 1 and groups > 1):
        raise ValueError(f"fp8_gemv: segments {sizes} must be 1 to 4 positive sizes summing to the weight's {N} "
                         f"rows (and not with groups)")
    bounds = [sum(sizes[:i + 1]) for i in range(len(sizes) - 1)]
    block_n = min(g.block_n, triton.next_power_of_2(N))
    if route == "fma" and w_fp8:
        block_n = min(triton.next_power_of_2(block_n), 128)  # divides 128: one weight-scale row per tile
    if groups > 1:
        while n_per_group % block_n:
            block_n //= 2
    while block_n > 1 and any(bd % block_n for bd in bounds):  # a tile never straddles two projections
        block_n //= 2
    if route == "dot" and block_n < 16:
        if bounds:
            raise ValueError(f"fp8_gemv: the dot route needs segment sizes that are multiples of 16, got {sizes}")
        block_n = 16
    tq, tp = token_blocks(M, route, g.rows_per_program, g.fma_rows)
    out = torch.empty(M * N, dtype=out_dtype, device=x.device)
    split = max(1, min(g.split_k, triton.cdiv(Kg, g.block_k)))
    grid = (triton.cdiv(N, block_n), split, triton.cdiv(M, tq))
    part = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else out
    cnt = counters(x.device, grid[0] * grid[2]) if split > 1 else out  # (fp8_gemv_jobs gives each its own)
    prequant = g.prequant and act_quant and route == "dot"
    if prequant and swiglu is not None:
        raise ValueError("fp8_gemv: the swiglu prologue does not run with prequant (the quantization kernel would "
                         "read the gate, not the activation)")
    if prequant:
        if groups > 1 and Kg % 128:
            raise ValueError(f"fp8_gemv: prequant of a grouped projection needs K per group a multiple of 128 "
                             f"(got {Kg})")
        x2, xs = act_quant_fp8(x2)  # q [M, K] E4M3, scales [K/128, M] (a transposed view)
        xs = xs.t()
    else:
        xs = x2
    b1, b2, b3 = (bounds + [N, N, N])[:3]
    args = [x2, xs, weight, s, out, part, cnt, M, N, Kg, n_per_group, x2.stride(0), Kg, M, weight.stride(0),
            stride_sn, split, b1, b2, b3, u2, float(limit)]
    consts = dict(W_FP8=w_fp8, ACT_QUANT=act_quant and not prequant, PREQUANT=prequant, ROUTE=ROUTES.index(route),
                  OUT_BF16=out_dtype == torch.bfloat16, DOT_FP32=interpreting(), TQ=tq, TP=tp, BN=block_n,
                  BK=g.block_k, KU=max(1, g.unroll), BLOCK_S=max(2, triton.next_power_of_2(split)),
                  SWIGLU=swiglu is not None, CLAMP=limit > 0, X_BF16=x.dtype == torch.bfloat16)
    return GemvPlan(grid, args, consts, g.num_warps, g.num_stages, out, tuple(lead),
                    None if segments is None else [0] + bounds + [N])


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, act_quant: bool = True,
             out_dtype: torch.dtype = torch.bfloat16, groups: int = 1, route: str = "fma",
             geometry: GemvGeometry | None = None, segments: tuple[int, ...] | None = None,
             swiglu: tuple[torch.Tensor, float] | None = None):
    """``x [..., G·K_g] @ Wᵀ`` for an E4M3 (``scale`` given) or BF16/fp32 (``scale=None``) weight ``[N, K_g]``.

    ``groups > 1``: ``x`` is ``[..., G, K_g]`` flattened, row block ``g`` of ``W`` (``N/G`` rows) applies to
    group ``g``; the result is ``[..., N]``. Output in ``out_dtype`` (bf16 or fp32).

    ``segments`` (sizes summing to ``N``, at most 4): ``W`` is several projections of the same input stored one
    after the other (:mod:`dsv4lab.engine.decode_groups`); one launch computes them all and returns a tuple of
    contiguous ``[..., size]`` outputs, one per projection.

    ``swiglu = (u, limit)``: the input is the shared expert's activation of the gate ``x`` and the up projection
    ``u`` (same shape and dtype, bf16 or fp32), computed in the prologue exactly as :func:`.swiglu.swiglu` computes
    it (no routing weight) — the down projection without the activation's own launch. One group, no segments, not
    with ``prequant`` (its separate quantization kernel reads ``x`` as it is).
    """
    plan = gemv_plan(x, weight, scale, act_quant, out_dtype, groups, route, geometry, segments, swiglu)
    _fp8_gemv_kernel[plan.grid](*plan.args, **plan.consts, num_warps=plan.num_warps, num_stages=plan.num_stages,
                                **pdl_args(x.device))
    return plan.result()


JOBS = 4
"""Projections one :func:`fp8_gemv_jobs` launch takes at most."""
_CNT_ARG = 6
"""The position of ``cnt_ptr`` (the ticket counters) in a plan's arguments (:func:`gemv_plan`)."""


def fp8_gemv_jobs(plans: list[GemvPlan]) -> list:
    """Two to :data:`JOBS` plans (:func:`gemv_plan`) in one launch (:func:`_gemv_jobs_kernel`): each projection's
    programs run its own body with its own arguments, so each result equals its own launch's bit for bit. The plans
    share the launch's ``num_warps`` and ``num_stages`` (a kernel has one of each) and may not ``prequant`` (that
    quantizes in a launch of its own); their split-K tickets come from disjoint ranges of the workspace."""
    if not 2 <= len(plans) <= JOBS:
        raise ValueError(f"fp8_gemv_jobs: {len(plans)} projections (2 to {JOBS} share a launch)")
    first = plans[0]
    for pl in plans:
        if (pl.num_warps, pl.num_stages) != (first.num_warps, first.num_stages):
            raise ValueError(f"fp8_gemv_jobs: num_warps/num_stages {pl.num_warps}/{pl.num_stages} and "
                             f"{first.num_warps}/{first.num_stages}: one launch has one of each")
        if pl.consts["PREQUANT"]:
            raise ValueError("fp8_gemv_jobs: a prequant projection quantizes in a launch of its own")
    device = first.out.device
    workspace = counters(device, sum(pl.tiles for pl in plans))
    args, consts, offset = [], {}, 0
    padded = plans + [plans[-1]] * (JOBS - len(plans))  # the jobs past the last are never reached: its arguments
    for i, (pl, tag) in enumerate(zip(padded, "abcd")):
        a = list(pl.args)
        if i < len(plans) and pl.tiles:
            a[_CNT_ARG] = workspace[offset:]
            offset += pl.tiles
        programs = pl.programs if i < len(plans) else 0
        args += a + [pl.grid[0], pl.grid[1]] + ([programs] if i < JOBS - 1 else [])
        consts.update({f"{tag.upper()}_{k}": v for k, v in pl.consts.items()})
    total = sum(pl.programs for pl in plans)
    _gemv_jobs_kernel[(total,)](*args, **consts, num_warps=first.num_warps, num_stages=first.num_stages,
                                **pdl_args(device))
    return [pl.result() for pl in plans]


def act_quant_fp8(x: torch.Tensor, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's activation quantization on the device: ``x [M, K]`` → ``(q [rows, K] E4M3,
    scale [rows, ⌈K/128⌉] fp32)`` with ``q·scale`` = :func:`dsv4lab.core.quant.act_qdq_fp8` exactly; rows past ``M``
    (padding to ``rows``) are zero with scale 1. ``scale`` is a transposed view (outer-dim-major), the layout
    ``torch._scaled_mm`` wants for 1×128 block scales."""
    M, K = x.shape
    rows = rows or M
    x = x.contiguous()
    q = torch.empty(rows, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(triton.cdiv(K, 128), rows, dtype=torch.float32, device=x.device)
    block_m = min(16, triton.next_power_of_2(rows))
    _act_quant_kernel[(triton.cdiv(rows, block_m), triton.cdiv(K, 128))](x, q, s, M, K, rows, BLOCK_M=block_m,
                                                                         **pdl_args(x.device))
    return q, s.t()


def cublas_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, act_quant: bool = True,
                  out_dtype: torch.dtype = torch.bfloat16, weight_scale_f32: torch.Tensor | None = None,
                  mm_out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The cuBLAS form of :func:`fp8_gemv` (one group): an FP8 weight with ``act_quant`` → the activation
    quantized on the device (:func:`act_quant_fp8`, rows padded to 16) and ``torch._scaled_mm`` with 1×128
    activation and 128×128 weight block scales (fp32, as cuBLAS takes them; pass ``weight_scale_f32`` to reuse
    a converted copy); a BF16 weight → ``torch.mm(..., out_dtype=torch.float32)``. The fp32 result is rounded to
    ``out_dtype`` once, as the kernel's (``mm_out_dtype=torch.bfloat16``: cuBLAS rounds it itself — for a torch
    whose block-scaled ``_scaled_mm`` has no fp32 output; the benchmark records which it accepts). Raises where cuBLAS cannot express the projection (e.g. an FP8 weight
    with a bf16 activation, or dims that are not multiples of 16)."""
    N, K = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if scale is None:
        y = torch.mm(x2.to(weight.dtype), weight.t(), out_dtype=torch.float32)
        return y.to(out_dtype).reshape(*lead, N)
    if not act_quant:
        raise ValueError("cuBLAS FP8 GEMM needs an FP8 activation (this projection keeps it in bf16)")
    if K % 16 or N % 16:
        raise ValueError(f"cuBLAS FP8 GEMM needs K and N multiples of 16 (got {K}, {N})")
    rows = max(16, -(-M // 16) * 16)
    q, sx = act_quant_fp8(x2, rows)
    sw = weight_scale_f32 if weight_scale_f32 is not None else e8m0_scales_f32(scale)
    y = torch._scaled_mm(q, weight.t(), scale_a=sx, scale_b=sw.t(), out_dtype=mm_out_dtype)
    return y[:M].to(out_dtype).reshape(*lead, N)


def e8m0_scales_f32(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 block scales ``[⌈N/128⌉, ⌈K/128⌉]`` as contiguous fp32 (the form cuBLAS block scaling takes)."""
    b = scale.view(torch.uint8).to(torch.int32)
    return torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23).view(torch.float32).contiguous()


def reference_fp8_gemv(x, weight, scale, act_quant=True, out_dtype=torch.bfloat16, groups=1):
    """Plain-torch twin (fp64 exact sum rounded to fp32, then ``out_dtype``) used by the tests and the bench."""
    N, Kg = weight.shape
    w = quant.fp8_block_dequant(weight, scale, torch.float64) if scale is not None else weight.double()
    xs = x.reshape(*x.shape[:-1], groups, Kg)
    if act_quant:
        xs = quant.act_qdq_fp8(xs.float())
    y = torch.einsum("...gk,grk->...gr", xs.double(), w.view(groups, N // groups, Kg))
    return y.reshape(*x.shape[:-1], N).float().to(out_dtype)


def reference_magnitude(x, weight, scale, act_quant=True, groups=1) -> torch.Tensor:
    """``Σ_k |xq[m,k]·W[n,k]|`` per output (fp64): the magnitude of the terms of :func:`reference_fp8_gemv`, for
    the analytic bound of :mod:`dsv4lab.tools.verify.bounds`."""
    N, Kg = weight.shape
    w = quant.fp8_block_dequant(weight, scale, torch.float64) if scale is not None else weight.double()
    xs = x.reshape(*x.shape[:-1], groups, Kg)
    if act_quant:
        xs = quant.act_qdq_fp8(xs.float())
    y = torch.einsum("...gk,grk->...gr", xs.double().abs(), w.abs().view(groups, N // groups, Kg))
    return y.reshape(*x.shape[:-1], N)
