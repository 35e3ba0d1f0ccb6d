"""Split-KV sparse attention decode: the selected rows (the window ring, then the compressed entries — CSA's top-k
picks or every completed HCA entry) cut into chunks of a fixed number of rows, one program per (query row, head
block, chunk), partials combined in a fixed order — the same op as :mod:`.attention_decode`
(``ReferenceOps.attention_from_caches`` / ``sparse_attention``), for long selections.

Why: :mod:`.attention_decode` splits a row's selection into a fixed number of slices, so its programs grow longer
with the selection (HCA reads every completed entry: 512 after 65,536 tokens, 8,192 after a million) and its
combine holds every slice at once. Here the grid follows the bytes: ``chunk`` rows per program, as many chunks as
the caches can list (``(W + entries) / chunk``); a program past its row's visible rows (``prefix_ratio_b``: CSA's
sorted picks and HCA's completed entries are a prefix) returns at once and the combine never reads it.

* **Chunk programs** — ``q·kvᵀ`` for ``block_r`` rows at a time (bf16 tensor-core dots on a GPU), a running max over
  the chunk's blocks (an online softmax; none when ``chunk == block_r``), probabilities rounded to the activation
  dtype before ``P·V`` as the reference rounds them; each writes its ``(max, denominator, numerator)`` in fp32.
* **Combine** — one program per (query row, head block, column block): the maximum over the row's active chunks
  (a first pass over the maxima only), then ``Σ_c e^{m_c − M}·(den_c, num_c)`` over the chunks in blocks of
  ``combine_block``, block after block, the same order on every launch — deterministic, no atomics; then the sink,
  the division, the rounding and (given the RoPE tables) the inverse rotation of the last ``r`` dims, as
  :mod:`.attention_decode`'s epilogue.

**Numerics.** Each probability is rounded to bf16 against its chunk's running maximum instead of the reference's
(a rounding-level difference, as :mod:`.attention_decode`'s split slices); a chunk's sums err by ``γ_chunk`` of
the tensor-core accumulation, the combine adds one rescaling (an exp and a product) per chunk and an fp32 sum
over the chunks. The bound of exactly this evaluation is
:func:`dsv4lab.tools.verify.op_bounds.attention.sparse_attention_split` (derived there); the op's general bound
(``sparse_attention``, which allows any maximum and any order) holds too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attention_decode import AttentionInputs, _gather_rows, _scores, _store_output
from .formats import round_to_bf16
from .launch import pdl_args, pdl_prologue
from .rowops import LAUNCH_EXACT, interpreting


@dataclass(frozen=True)
class SplitKvGeometry:
    """Heads per program (``block_h``), KV rows per step (``block_r``), selected rows per program (``chunk``, a
    multiple of ``block_r``), warps of the chunk programs; the combine's partials per step (``combine_block``, a
    power of two) and columns per program (``combine_columns``, 0: as many as keep its ``combine_block × block_h ×
    columns`` tile at 16 K fp32)."""

    block_h: int = 16
    block_r: int = 32
    chunk: int = 32
    num_warps: int = 4
    combine_block: int = 16
    combine_columns: int = 0


@triton.jit
def _visible_rows(pos_ptr, r, Ka, Kb, RATIO_B, PREFIX_B: tl.constexpr):
    """How many selection positions row ``r`` may read: all of cache A's, and cache B's first ``(p+1)//RATIO_B``
    (``PREFIX_B``) or all of them."""
    if PREFIX_B:
        return Ka + tl.minimum(Kb, ((tl.load(pos_ptr + r) + 1) // RATIO_B).to(tl.int32))
    return Ka + Kb


@triton.jit
def _attn_chunk_kernel(q_ptr, kva_ptr, rows_a_ptr, bat_a_ptr, kvb_ptr, rows_b_ptr, bat_b_ptr, pos_ptr,
                       pm_ptr, pl_ptr, pacc_ptr, H, D, Ka, Kb, scale, RATIO_B, N_CAP,
                       stride_qr, stride_qh, stride_ba, stride_na, stride_bb, stride_nb, stride_ra, stride_rb,
                       ROUND_ACT: tl.constexpr, DOT_FP32: tl.constexpr, PREFIX_B: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
                       PDL: tl.constexpr = False):
    """Program ``(r, head block, c)``: the partial softmax of selection positions ``[c·CHUNK, (c+1)·CHUNK)``."""
    pdl_prologue(PDL)
    r = tl.program_id(0)
    hb = tl.program_id(1)
    c = tl.program_id(2)
    k_vis = _visible_rows(pos_ptr, r, Ka, Kb, RATIO_B, PREFIX_B)
    j_lo = c * CHUNK
    if j_lo < k_vis:
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = h < H
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        q = tl.load(q_ptr + r * stride_qr + h[:, None] * stride_qh + d[None, :],
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        if not DOT_FP32:
            q = q.to(tl.bfloat16)
        kva_row0 = kva_ptr + tl.load(bat_a_ptr + r) * stride_ba
        kvb_row0 = kvb_ptr + tl.load(bat_b_ptr + r) * stride_bb
        rows_a = rows_a_ptr + r * stride_ra
        rows_b = rows_b_ptr + r * stride_rb
        m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        den = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
        # CHUNK is a multiple of BLOCK_R: a block never reaches into the next chunk, only past the visible rows
        for j0 in range(j_lo, tl.minimum(j_lo + CHUNK, k_vis), BLOCK_R):
            kv, valid = _gather_rows(j0, Ka, k_vis, rows_a, rows_b, kva_row0, kvb_row0, stride_na, stride_nb, d,
                                     d_ok, BLOCK_R)
            z = _scores(q, kv, valid, scale, DOT_FP32)
            m_old = m
            m = tl.maximum(m, tl.max(z, axis=1))
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            alpha = tl.where(m_old == float("-inf"), 0.0, tl.exp(m_old - m_safe))
            p = tl.exp(z - m_safe[:, None])
            den = den * alpha + tl.sum(p, axis=1)
            if ROUND_ACT:
                p = round_to_bf16(p)
            if DOT_FP32:
                acc = acc * alpha[:, None] + tl.dot(p, kv, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), kv.to(tl.bfloat16))
        part = (r * N_CAP + c) * H + h
        tl.store(pm_ptr + part, m, mask=h_ok)
        tl.store(pl_ptr + part, den, mask=h_ok)
        tl.store(pacc_ptr + part[:, None] * D + d[None, :], acc, mask=h_ok[:, None] & d_ok[None, :])


@triton.jit
def _attn_chunk_combine_kernel(pm_ptr, pl_ptr, pacc_ptr, sink_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, H, D, Ka,
                               Kb, RATIO_B, N_CAP, R, s_cos, stride_qr, stride_qh, ROUND_ACT: tl.constexpr,
                               ROPE: tl.constexpr, PREFIX_B: tl.constexpr, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr,
                               BLOCK_S: tl.constexpr, BLOCK_DC: tl.constexpr, PDL: tl.constexpr = False):
    """Program ``(r, head block, column block)``: the row's active chunks, combined block after block."""
    pdl_prologue(PDL)
    r = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    d0 = tl.program_id(2) * BLOCK_DC
    d = d0 + tl.arange(0, BLOCK_DC)
    d_ok = d < D
    n_chunks = tl.cdiv(_visible_rows(pos_ptr, r, Ka, Kb, RATIO_B, PREFIX_B), CHUNK)
    sp = tl.arange(0, BLOCK_S)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    for c0 in range(0, n_chunks, BLOCK_S):  # the global max first: every chunk is then rescaled once
        ok = ((c0 + sp) < n_chunks)[:, None] & h_ok[None, :]
        ms = tl.load(pm_ptr + (r * N_CAP + c0 + sp[:, None]) * H + h[None, :], mask=ok, other=float("-inf"))
        m = tl.maximum(m, tl.max(ms, axis=0))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_DC), tl.float32)
    for c0 in range(0, n_chunks, BLOCK_S):
        part = (r * N_CAP + c0 + sp[:, None]) * H + h[None, :]  # [BLOCK_S, BLOCK_H]
        ok = ((c0 + sp) < n_chunks)[:, None] & h_ok[None, :]
        ms = tl.load(pm_ptr + part, mask=ok, other=float("-inf"))
        ls = tl.load(pl_ptr + part, mask=ok, other=0.0)
        accs = tl.load(pacc_ptr + part[:, :, None] * D + d[None, None, :], mask=ok[:, :, None] & d_ok[None, None, :],
                       other=0.0)
        w = tl.exp(ms - m_safe[None, :])  # 0 for a chunk with no visible row (max −inf) and past the last chunk
        den += tl.sum(w * ls, axis=0)
        acc += tl.sum(w[:, :, None] * accs, axis=0)
    sink = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
    o = acc / (den + tl.exp(sink - m_safe))[:, None]
    # the rotation seen from this column block: pairs numbered from d0 (see attention_decode's combine)
    _store_output(out_ptr + d0, o, r, h, h_ok, d - d0, d_ok, stride_qr, stride_qh, cos_ptr, sin_ptr, pos_ptr, s_cos,
                  D - d0, R, ROUND_ACT, ROPE, BLOCK_H, BLOCK_DC)


def sparse_attention_split(q: torch.Tensor, kv_a: torch.Tensor, rows_a: torch.Tensor, batch_a: torch.Tensor,
                           sink: torch.Tensor, scale: float, kv_b: torch.Tensor | None = None,
                           rows_b: torch.Tensor | None = None, batch_b: torch.Tensor | None = None,
                           geometry: SplitKvGeometry | None = None, cos: torch.Tensor | None = None,
                           sin: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                           prefix_ratio_b: int = 0) -> torch.Tensor:
    """:func:`.attention_decode.sparse_attention_decode` (same arguments but the geometry, same op) with the
    selection cut into chunks of ``geometry.chunk`` rows. Returns ``[R, H, d]`` in ``q.dtype``."""
    g = geometry or SplitKvGeometry()
    if g.chunk % g.block_r or g.block_r < 16 or g.block_h < 16 or g.combine_block & (g.combine_block - 1):
        raise ValueError(f"SplitKvGeometry {g}: chunk must be a multiple of block_r, block_r and block_h ≥ 16, "
                         "combine_block a power of two")
    a = AttentionInputs.of(q, kv_a, rows_a, batch_a, sink, kv_b, rows_b, batch_b, cos, positions, prefix_ratio_b)
    q, kv_a, rows_a, batch_a, kv_b, rows_b, batch_b, sink, positions = (
        a.q, a.kv_a, a.rows_a, a.batch_a, a.kv_b, a.rows_b, a.batch_b, a.sink, a.positions)
    R, H, D, Ka, Kb = a.R, a.H, a.D, a.Ka, a.Kb
    n_cap = max(1, triton.cdiv(Ka + Kb, g.chunk))
    out = torch.empty_like(q)
    pm = torch.empty(R, n_cap, H, dtype=torch.float32, device=q.device)
    pl = torch.empty_like(pm)
    pacc = torch.empty(R, n_cap, H, D, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(D)
    rope = cos is not None
    pos = positions if positions is not None else batch_a
    bf16 = q.dtype == torch.bfloat16
    _attn_chunk_kernel[(R, triton.cdiv(H, g.block_h), n_cap)](
        q, kv_a, rows_a, batch_a, kv_b, rows_b, batch_b, pos, pm, pl, pacc, H, D, Ka, Kb, float(scale),
        int(prefix_ratio_b), n_cap, q.stride(0), q.stride(1), kv_a.stride(0), kv_a.stride(1), kv_b.stride(0),
        kv_b.stride(1), rows_a.stride(0), max(rows_b.stride(0), 1), ROUND_ACT=bf16, DOT_FP32=interpreting(),
        PREFIX_B=prefix_ratio_b > 0, BLOCK_H=g.block_h, BLOCK_R=g.block_r, BLOCK_D=block_d, CHUNK=g.chunk,
        num_warps=g.num_warps, **pdl_args(q.device))
    block_s = min(g.combine_block, triton.next_power_of_2(n_cap))
    block_dc = g.combine_columns or max(16, min(block_d, 16384 // (block_s * g.block_h)))
    if block_dc & (block_dc - 1) or block_dc < 2:
        raise ValueError(f"SplitKvGeometry.combine_columns={block_dc}: a power of two ≥ 2 is required")
    tables = (cos if rope else sink, sin if rope else sink)
    rope_args = (2 * cos.shape[-1], cos.stride(0)) if rope else (0, 0)
    _attn_chunk_combine_kernel[(R, triton.cdiv(H, g.block_h), triton.cdiv(D, block_dc))](
        pm, pl, pacc, sink, out, *tables, pos, H, D, Ka, Kb, int(prefix_ratio_b), n_cap, *rope_args, out.stride(0),
        out.stride(1), ROUND_ACT=bf16, ROPE=rope, PREFIX_B=prefix_ratio_b > 0, CHUNK=g.chunk, BLOCK_H=g.block_h,
        BLOCK_S=block_s, BLOCK_DC=block_dc, num_warps=4, **(LAUNCH_EXACT if rope else {}), **pdl_args(q.device))
    return out


__all__ = ["SplitKvGeometry", "sparse_attention_split"]
