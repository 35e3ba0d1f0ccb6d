"""Sparse attention decode with an attention sink, over KV rows gathered by index from up to two caches
(the sliding-window ring and the compressed entries) — no concatenated copy of the caches is ever made.

For one query row ``r`` and head ``h`` (K = V, one shared latent head):
``z_t = (q_h · kv_t) · scale`` over the selected rows ``t``; ``M = max_t z_t``;
``o_h = Σ_t act(exp(z_t − M)) · kv_t / (Σ_t exp(z_t − M) + exp(sink_h − M))`` — the reference's
:meth:`~dsv4lab.core.model.ops.ReferenceOps.sparse_attention` term for term (the probabilities are rounded to the
activation dtype before P·V, as the reference kernel does).

A program owns one query row, ``BLOCK_H`` heads and one of ``splits`` contiguous slices of the selected rows.
With ``two_pass`` it makes two passes over its rows — the first finds the slice's max score, the second
accumulates with that max — so with ``splits=1`` every probability is taken relative to the true maximum exactly
as in the reference. Without it, one pass with a running max rescales the partial sums as the max grows (online
softmax: half the dependent gathers). With ``splits > 1`` (flash-decoding: more programs for long selections)
each slice writes ``(max, denominator, numerator)`` and a combine kernel — one program per query row, head block
and column block, every slice's partials loaded at once — rescales them to the global max. Either
deviation moves only the bf16 rounding of each probability (it is rounded relative to a slice's or a running
max instead of the global one): a rounding-level difference, checked with the "attention" tolerance.

Given the layer's RoPE tables and the rows' positions, the store (of the single slice, or of the combine) applies
the inverse rotation of the last ``r`` dims to the rounded output — ``ReferenceOps.rope(o, ..., inverse=True)``
term for term (launched without FMA contraction), so the decode step needs no separate launch for it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .formats import round_to_bf16
from .fp8_gemv import interpreting
from .norm_rope_quant import _rope_tail
from .rowops import LAUNCH_EXACT
from .tickets import counters, take_ticket
from .launch import pdl_args, pdl_prologue


@dataclass(frozen=True)
class AttentionGeometry:
    """Heads per program, KV rows per step, slices of the selected rows (programs per query and head block), warps,
    two passes or one; ``combine_columns``: columns per program of the split combine (0: as many as keep its
    slices × heads × columns tile at 16 K fp32); ``combine_in_kernel``: the combine made by the last slice program of
    each query row and head block (a ticket, :mod:`.tickets`), column block after column block, instead of a second
    launch — the same arithmetic in the same order, so the same bits (the decode step's fused path
    ``attention_combine``)."""

    block_h: int = 16
    block_r: int = 16
    splits: int = 1
    num_warps: int = 8
    two_pass: bool = True
    combine_columns: int = 0
    combine_in_kernel: bool = False


@triton.jit
def _gather_rows(j0, Ka, Ktot, rows_a, rows_b, kva_row0, kvb_row0, stride_na, stride_nb, d, d_ok,
                 BLOCK_R: tl.constexpr):
    """KV rows for selection positions ``j0..j0+BLOCK_R``: positions ``< Ka`` index cache A, the rest cache B."""
    j = j0 + tl.arange(0, BLOCK_R)
    in_a = j < Ka
    in_b = (j >= Ka) & (j < Ktot)
    ra = tl.load(rows_a + j, mask=in_a, other=-1)
    rb = tl.load(rows_b + (j - Ka), mask=in_b, other=-1)
    row = tl.where(in_a, ra, rb)
    valid = row >= 0
    ptr = tl.where(in_a, kva_row0 + tl.maximum(ra, 0) * stride_na, kvb_row0 + tl.maximum(rb, 0) * stride_nb)
    kv = tl.load(ptr[:, None] + d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    return kv, valid


@triton.jit
def _scores(q, kv, valid, scale, DOT_FP32: tl.constexpr):
    """``q·kvᵀ · scale`` for a block of rows, −inf where the row is masked."""
    if DOT_FP32:
        z = tl.dot(q, tl.trans(kv), input_precision="ieee") * scale
    else:
        z = tl.dot(q, tl.trans(kv.to(tl.bfloat16))) * scale
    return tl.where(valid[None, :], z, float("-inf"))


@triton.jit
def _store_output(out_ptr, o, r, h, h_ok, d, d_ok, stride_qr, stride_qh, cos_ptr, sin_ptr, pos_ptr, s_cos, D, R,
                  ROUND_ACT: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Round ``o [BLOCK_H, BLOCK_D]`` to the activation dtype and, with ``ROPE``, apply the inverse rotation of its
    last ``R`` dims at the row's position (``ReferenceOps.rope(..., inverse=True)`` of the rounded output)."""
    if ROUND_ACT:
        o = round_to_bf16(o)
    if ROPE:
        o = _rope_tail(o, cos_ptr, sin_ptr, tl.load(pos_ptr + r), s_cos, D, R, True, ROUND_ACT, BLOCK_H, BLOCK_D)
    tl.store(out_ptr + r * stride_qr + h[:, None] * stride_qh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & d_ok[None, :])


@triton.jit
def _attn_decode_kernel(q_ptr, kva_ptr, rows_a_ptr, bat_a_ptr, kvb_ptr, rows_b_ptr, bat_b_ptr, sink_ptr,
                        out_ptr, pm_ptr, pl_ptr, pacc_ptr, cos_ptr, sin_ptr, pos_ptr,
                        H, D, Ka, Kb, scale, R, s_cos, RATIO_B,
                        stride_qr, stride_qh, stride_ba, stride_na, stride_bb, stride_nb, stride_ra, stride_rb, SPLITS,
                        cnt_ptr, ROUND_ACT: tl.constexpr, DOT_FP32: tl.constexpr, TWO_PASS: tl.constexpr,
                        ROPE: tl.constexpr, PREFIX_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_D: tl.constexpr, COMBINE: tl.constexpr = False, BLOCK_S: tl.constexpr = 2,
                        BLOCK_DC: tl.constexpr = 2, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    r = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + r * stride_qr + h[:, None] * stride_qh + d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                other=0.0).to(tl.float32)
    if not DOT_FP32:
        q = q.to(tl.bfloat16)
    if PREFIX_B:  # cache B's rows past the first (p+1)//RATIO_B are −1 for this query: never visit them
        Ktot = Ka + tl.minimum(Kb, ((tl.load(pos_ptr + r) + 1) // RATIO_B).to(tl.int32))
    else:
        Ktot = Ka + Kb
    per = tl.cdiv(tl.cdiv(Ktot, SPLITS), BLOCK_R) * BLOCK_R
    j_lo = sp * per
    j_hi = tl.minimum(j_lo + per, Ktot)
    kva_row0 = kva_ptr + tl.load(bat_a_ptr + r) * stride_ba
    kvb_row0 = kvb_ptr + tl.load(bat_b_ptr + r) * stride_bb
    rows_a = rows_a_ptr + r * stride_ra
    rows_b = rows_b_ptr + r * stride_rb

    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    den = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    if TWO_PASS:
        for j0 in range(j_lo, j_hi, BLOCK_R):
            kv, valid = _gather_rows(j0, Ka, Ktot, rows_a, rows_b, kva_row0, kvb_row0, stride_na, stride_nb, d, d_ok,
                                     BLOCK_R)
            z = _scores(q, kv, valid, scale, DOT_FP32)
            m = tl.maximum(m, tl.max(z, axis=1))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    for j0 in range(j_lo, j_hi, BLOCK_R):
        kv, valid = _gather_rows(j0, Ka, Ktot, rows_a, rows_b, kva_row0, kvb_row0, stride_na, stride_nb, d, d_ok,
                                 BLOCK_R)
        z = _scores(q, kv, valid, scale, DOT_FP32)
        if not TWO_PASS:  # online: raise the running max, rescale what was accumulated
            m_old = m
            m = tl.maximum(m, tl.max(z, axis=1))
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            alpha = tl.where(m_old == float("-inf"), 0.0, tl.exp(m_old - m_safe))
            den = den * alpha
            acc = acc * alpha[:, None]
        p = tl.exp(z - m_safe[:, None])
        den += tl.sum(p, axis=1)
        if ROUND_ACT:
            p = round_to_bf16(p)
        if DOT_FP32:
            acc += tl.dot(p, kv, input_precision="ieee")
        else:
            acc += tl.dot(p.to(tl.bfloat16), kv.to(tl.bfloat16))
    if SPLITS == 1:
        sink = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
        o = acc / (den + tl.exp(sink - m_safe))[:, None]
        _store_output(out_ptr, o, r, h, h_ok, d, d_ok, stride_qr, stride_qh, cos_ptr, sin_ptr, pos_ptr, s_cos, D, R,
                      ROUND_ACT, ROPE, BLOCK_H, BLOCK_D)
    else:
        part = (r * SPLITS + sp) * H + h
        tl.store(pm_ptr + part, m, mask=h_ok)
        tl.store(pl_ptr + part, den, mask=h_ok)
        tl.store(pacc_ptr + part[:, None] * D + d[None, :], acc, mask=h_ok[:, None] & d_ok[None, :])
        if COMBINE:  # the last slice program of (r, hb) combines, column block after column block
            counter = cnt_ptr + r * tl.num_programs(1) + hb
            if take_ticket(counter) == SPLITS - 1:
                for d0 in range(0, D, BLOCK_DC):
                    _combine_block(pm_ptr, pl_ptr, pacc_ptr, sink_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, H, D, R,
                                   s_cos, stride_qr, stride_qh, SPLITS, r, hb, d0, ROUND_ACT, ROPE, BLOCK_H, BLOCK_S,
                                   BLOCK_DC, ".cg")
                tl.store(counter, 0)


@triton.jit
def _combine_block(pm_ptr, pl_ptr, pacc_ptr, sink_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, H, D, R, s_cos, stride_qr,
                   stride_qh, SPLITS, r, hb, d0, ROUND_ACT: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_DC: tl.constexpr, CACHE: tl.constexpr):
    """Query row ``r``, head block ``hb``, columns ``d0 … d0+BLOCK_DC`` of the split combine: every slice's
    ``(max, denominator, numerator)`` loaded at once (``CACHE``: ``.cg`` where other programs of the same launch
    wrote them), rescaled to the global max and summed over the slices, stored with the rotation of its columns."""
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    d = d0 + tl.arange(0, BLOCK_DC)
    d_ok = d < D
    sp = tl.arange(0, BLOCK_S)
    part = (r * SPLITS + sp[:, None]) * H + h[None, :]  # [BLOCK_S, BLOCK_H]
    ok = (sp < SPLITS)[:, None] & h_ok[None, :]
    ms = tl.load(pm_ptr + part, mask=ok, other=float("-inf"), cache_modifier=CACHE)
    ls = tl.load(pl_ptr + part, mask=ok, other=0.0, cache_modifier=CACHE)
    accs = tl.load(pacc_ptr + part[:, :, None] * D + d[None, None, :], mask=ok[:, :, None] & d_ok[None, None, :],
                   other=0.0, cache_modifier=CACHE)
    m = tl.max(ms, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(ms - m_safe[None, :])  # 0 for an empty slice (max −inf) and for the padding slices
    den = tl.sum(w * ls, axis=0)
    acc = tl.sum(w[:, :, None] * accs, axis=0)
    sink = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
    o = acc / (den + tl.exp(sink - m_safe))[:, None]
    # the rotation of the last R dims seen from this column block: pairs are numbered from d0, so the block
    # passes D − d0 as its width (its rotated pairs then take the right angles; none if it ends before them)
    _store_output(out_ptr + d0, o, r, h, h_ok, d - d0, d_ok, stride_qr, stride_qh, cos_ptr, sin_ptr, pos_ptr, s_cos,
                  D - d0, R, ROUND_ACT, ROPE, BLOCK_H, BLOCK_DC)


@triton.jit
def _attn_combine_kernel(pm_ptr, pl_ptr, pacc_ptr, sink_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, H, D, R, s_cos,
                         stride_qr, stride_qh, SPLITS, ROUND_ACT: tl.constexpr, ROPE: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DC: tl.constexpr,
                         PDL: tl.constexpr = False):
    """One program per (query row, head block, ``BLOCK_DC`` columns): every slice's ``(max, denominator,
    numerator)`` loaded at once — the loads do not wait on each other, so the combine costs about one trip to L2
    whatever the number of slices — rescaled to the global max and summed over the slices."""
    pdl_prologue(PDL)
    _combine_block(pm_ptr, pl_ptr, pacc_ptr, sink_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, H, D, R, s_cos, stride_qr,
                   stride_qh, SPLITS, tl.program_id(0), tl.program_id(1), tl.program_id(2) * BLOCK_DC, ROUND_ACT,
                   ROPE, BLOCK_H, BLOCK_S, BLOCK_DC, "")


@dataclass
class AttentionInputs:
    """The decode attention's operands as both launchers (this one and the split-KV one) take them: contiguous
    where the kernels read by row (``ptr + row``), the second cache defaulted to an empty selection of the first,
    the sink in fp32, and the shapes ``R, H, D, Ka, Kb``."""

    q: torch.Tensor
    kv_a: torch.Tensor
    rows_a: torch.Tensor
    batch_a: torch.Tensor
    kv_b: torch.Tensor
    rows_b: torch.Tensor
    batch_b: torch.Tensor
    sink: torch.Tensor
    positions: torch.Tensor | None
    R: int
    H: int
    D: int
    Ka: int
    Kb: int

    @classmethod
    def of(cls, q, kv_a, rows_a, batch_a, sink, kv_b, rows_b, batch_b, cos, positions,
           prefix_ratio_b: int) -> "AttentionInputs":
        q = q.contiguous()
        R, H, D = q.shape
        assert q.stride(2) == 1 and kv_a.stride(2) == 1 and kv_a.shape[2] == D
        assert rows_a.shape[0] == R and batch_a.shape == (R,)
        if kv_b is None:
            kv_b, rows_b, batch_b = kv_a, rows_a[:, :0], batch_a
        assert kv_b.stride(2) == 1 and kv_b.shape[2] == D and rows_b.shape[0] == R and kv_b.dtype == kv_a.dtype
        if cos is not None or prefix_ratio_b:
            assert positions is not None and positions.shape == (R,)
        if cos is not None:
            assert cos.stride(-1) == 1 and 2 * cos.shape[-1] <= D
        rows_a, rows_b = rows_a.contiguous(), rows_b.contiguous()
        batch_a, batch_b = batch_a.contiguous(), batch_b.contiguous()  # read as ptr + row
        positions = positions.contiguous() if positions is not None else None
        return cls(q, kv_a, rows_a, batch_a, kv_b, rows_b, batch_b, sink.to(torch.float32).contiguous(), positions,
                   R, H, D, rows_a.shape[1], rows_b.shape[1])


def sparse_attention_decode(q: torch.Tensor, kv_a: torch.Tensor, rows_a: torch.Tensor, batch_a: torch.Tensor,
                            sink: torch.Tensor, scale: float, kv_b: torch.Tensor | None = None,
                            rows_b: torch.Tensor | None = None, batch_b: torch.Tensor | None = None,
                            geometry: AttentionGeometry | None = None, cos: torch.Tensor | None = None,
                            sin: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                            prefix_ratio_b: int = 0) -> torch.Tensor:
    """Attention with a sink for query rows ``q [R, H, d]`` over rows gathered from one or two caches.

    ``kv_a [B_a, n_a, d]`` with ``rows_a [R, K_a]`` (row indices into ``kv_a[batch_a[r]]``, −1 = masked) and
    optionally ``kv_b``/``rows_b``/``batch_b`` likewise; ``sink [H]`` fp32. With the RoPE tables ``cos, sin
    [P, r/2]`` and ``positions [R]`` the (rounded) output gets the inverse rotation of its last ``r`` dims in the
    kernel's epilogue. ``prefix_ratio_b > 0`` promises that only the first ``(positions[r] + 1) // prefix_ratio_b``
    entries of ``rows_b[r]`` can be valid (CSA's top-k picks, HCA's completed entries): the rest are not visited.
    Returns ``[R, H, d]`` in ``q.dtype``.
    """
    g = geometry or AttentionGeometry()
    a = AttentionInputs.of(q, kv_a, rows_a, batch_a, sink, kv_b, rows_b, batch_b, cos, positions, prefix_ratio_b)
    q, kv_a, rows_a, batch_a, kv_b, rows_b, batch_b, sink, positions = (
        a.q, a.kv_a, a.rows_a, a.batch_a, a.kv_b, a.rows_b, a.batch_b, a.sink, a.positions)
    R, H, D, Ka, Kb = a.R, a.H, a.D, a.Ka, a.Kb
    splits = max(1, min(g.splits, triton.cdiv(max(Ka + Kb, 1), g.block_r)))
    out = torch.empty_like(q)
    if splits > 1:
        pm = torch.empty(R, splits, H, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        pacc = torch.empty(R, splits, H, D, dtype=torch.float32, device=q.device)
    else:
        pm = pl = pacc = out
    block_d = triton.next_power_of_2(D)
    rope = cos is not None
    tables = (cos if rope else sink, sin if rope else sink, positions if positions is not None else batch_a)
    rope_args = (2 * cos.shape[-1], cos.stride(0)) if rope else (0, 0)
    exact = LAUNCH_EXACT if rope else {}  # the rotation's products rounded as torch rounds them
    grid = (R, triton.cdiv(H, g.block_h), splits)
    block_s = triton.next_power_of_2(splits)
    # one program's slices × heads × columns tile of the combine, held at once: ≤ 16 K fp32 (64 registers a thread,
    # 8 warps)
    block_dc = g.combine_columns or max(16, min(block_d, 16384 // (block_s * g.block_h)))
    if splits > 1 and (block_dc & (block_dc - 1) or block_dc < 2):
        raise ValueError(f"AttentionGeometry.combine_columns={block_dc}: a power of two ≥ 2 is required")
    in_kernel = splits > 1 and g.combine_in_kernel
    cnt = counters(q.device, grid[0] * grid[1]) if in_kernel else out
    _attn_decode_kernel[grid](q, kv_a, rows_a, batch_a, kv_b, rows_b, batch_b, sink, out, pm, pl, pacc, *tables,
                              H, D, Ka, Kb, float(scale), *rope_args, int(prefix_ratio_b), q.stride(0), q.stride(1),
                              kv_a.stride(0), kv_a.stride(1), kv_b.stride(0), kv_b.stride(1), rows_a.stride(0),
                              max(rows_b.stride(0), 1), splits, cnt, ROUND_ACT=q.dtype == torch.bfloat16,
                              DOT_FP32=interpreting(), TWO_PASS=g.two_pass, ROPE=rope, PREFIX_B=prefix_ratio_b > 0,
                              BLOCK_H=g.block_h, BLOCK_R=g.block_r, BLOCK_D=block_d, COMBINE=in_kernel,
                              BLOCK_S=max(2, block_s), BLOCK_DC=block_dc, num_warps=g.num_warps, **exact,
                              **pdl_args(q.device))
    if splits > 1 and not in_kernel:
        _attn_combine_kernel[(R, triton.cdiv(H, g.block_h), triton.cdiv(D, block_dc))](
            pm, pl, pacc, sink, out, *tables, H, D, *rope_args, out.stride(0), out.stride(1), splits,
            ROUND_ACT=q.dtype == torch.bfloat16, ROPE=rope, BLOCK_H=g.block_h, BLOCK_S=block_s, BLOCK_DC=block_dc,
            num_warps=g.num_warps, **exact, **pdl_args(pm.device))
    return out
