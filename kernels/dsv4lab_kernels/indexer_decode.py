"""The lightning indexer's decode step — scores and top-k in one launch that never touches an invisible key
(reference: ``ReferenceOps.indexer_select`` = ``indexer_scores`` then ``indexer_topk``).

Grid ``(rows, key blocks of the cache)``. A program whose block starts at or after the row's visible count
``(p+1)//4`` does no work; the others score their ``BLOCK_T`` keys for all heads at once —
``Σ_h bf16(relu(bf16(q_h·k_t))·w_h)`` with the head sum in fp64, rounded to fp32 then bf16 as the reference — and
store them. Each of these programs then counts itself in (an atomic per row, after a barrier so the block's stores
are released with it; the programs past the visible keys return at once, so a short context in a long cache costs
no atomics); the **last** of them selects: the ``k``-th largest score by a binary search over the
scores' order-preserving bit patterns (16 bits for bf16 scores; up to 2,048 visible keys held in registers, more
streamed from L2 once per bit), the entries above it plus the first ties in index
order, then one bitonic sort of the ≤ ``k`` picks by (score descending, index ascending) — the reference's stable
descending sort, ``−1`` after the visible ones. It resets the row's counter for the next launch, so a captured
graph replays it as is. The counter only decides *which* program selects; the selection reads the same scores
whoever it is, so the result is deterministic.

**Numerics and bound.** Query and keys hold FP4 values times power-of-two block scales (exact in bf16); their
products are exact in fp32 and the 128-term dot product is exact unless the block scales of one head span more
than ~2^10, so each dot — and hence every score — is bit-identical to the reference's fp64 evaluation; otherwise a
dot is within ``γ_d(fp32)·Σ|q·k|`` before its bf16 rounding (one bf16 ulp after it) and a score within
``Σ_h |w_h|·(that)`` plus one bf16 ulp. The top-k is exact given the scores (compare as sets; equal scores go to
the lower entry index on every backend).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .formats import round_to_bf16
from .rowops import interpreting
from .launch import pdl_args, pdl_prologue

_COUNTERS: dict = {}


def _counters(n: int, device) -> torch.Tensor:
    """Per-row arrival counters, zero between launches (each launch's selecting program resets its row's)."""
    key = (str(device), n)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def arrival_counters() -> list[torch.Tensor]:
    """Every per-row arrival counter buffer made in this process (a check that each launch left them at zero)."""
    return list(_COUNTERS.values())


@triton.jit
def _count_at_least(sc_ptr, n, cand, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """How many of the ``n`` stored scores have an order key ``≥ cand``."""
    total = n * 0
    for t0 in range(0, n, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        u = _order_key(tl.load(sc_ptr + t, mask=t < n, other=0.0, cache_modifier=".cg"), SHIFT)
        total += tl.sum(((u >= cand) & (t < n)).to(tl.int64), axis=0)
    return total


@triton.jit
def _order_key(score, SHIFT: tl.constexpr):
    """fp32 scores → non-negative int64 keys in score order (``−0 = +0``), the low ``SHIFT`` bits dropped."""
    bits = (score + 0.0).to(tl.int32, bitcast=True)
    order = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64) + 2147483648
    return order >> SHIFT


@triton.jit
def _sort_key(score, t):
    """One int64 per (score, entry) in the selection's order: larger for a larger score and, among equal scores,
    for the lower entry ``t`` (the reference's stable descending sort) — score order key high, ``2³¹−1−t`` low;
    every key is above int64's minimum, which marks "no entry". The entry is ``2147483647 − (key & 0xFFFFFFFF)``."""
    return (_order_key(score, 0) - 2147483648 << 32) | (2147483647 - t).to(tl.int64)


@triton.jit
def _query(q_ptr, w_ptr, b, H, DI, w_scale, sq_b, sq_h, sw_b, ROUND_BF16: tl.constexpr, BLOCK_H: tl.constexpr,
           BLOCK_D: tl.constexpr):
    """Row ``b``'s prepared query ``[BLOCK_H, BLOCK_D]`` (its dtype) and head weights ``w · w_scale`` (fp32,
    rounded to bf16 as the reference's act product when ``ROUND_BF16``); zero past ``H`` heads and ``DI`` dims."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hm = h < H
    q = tl.load(q_ptr + b * sq_b + h[:, None] * sq_h + d[None, :], mask=hm[:, None] & (d < DI)[None, :], other=0.0)
    w = tl.load(w_ptr + b * sw_b + h, mask=hm, other=0.0).to(tl.float32) * w_scale
    if ROUND_BF16:  # the head weights are the act tensor weights_proj(x) · scale
        w = round_to_bf16(w)
    return q, w


@triton.jit
def _score_keys(q, w, krow, t, tm, DI, sk_t, ROUND_BF16: tl.constexpr, UPCAST: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """The scores ``Σ_h bf16(relu(bf16(q_h·k_t))·w_h)`` of the keys ``t`` (valid where ``tm``; the others are never
    read) of one cache slot (``krow``: its first key), as fp32 holding act values — the head sum in fp64, rounded
    once, as the reference."""
    d = tl.arange(0, BLOCK_D)
    keys = tl.load(krow + t[:, None] * sk_t + d[None, :], mask=tm[:, None] & (d < DI)[None, :], other=0.0)
    if UPCAST or not ROUND_BF16:  # the interpreter's bf16 dot is wrong; fp32 dots of these values are exact
        dots = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee")
    else:
        dots = tl.dot(q, tl.trans(keys))
    if ROUND_BF16:
        dots = round_to_bf16(dots)
        term = round_to_bf16(tl.maximum(dots, 0.0) * w[:, None])
    else:
        term = tl.maximum(dots, 0.0) * w[:, None]
    score = tl.sum(term.to(tl.float64), axis=0).to(tl.float32)  # exact head sum, rounded once
    if ROUND_BF16:
        score = round_to_bf16(score)
    return score


@triton.jit
def _indexer_select_kernel(q_ptr, w_ptr, k_ptr, slot_ptr, pos_ptr, sc_ptr, cnt_ptr, buf_ptr, out_ptr,
                           H, DI, T, KOUT, TOPK, RATIO, w_scale, sq_b, sq_h, sw_b, sk_b, sk_t, s_sc, s_buf, s_out,
                           ROUND_BF16: tl.constexpr, UPCAST: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_SEL: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    b = tl.program_id(0).to(tl.int64)
    tb = tl.program_id(1)
    pos = tl.load(pos_ptr + b)
    n_vis = tl.minimum((pos + 1) // RATIO, T)
    n_active = tl.cdiv(n_vis, BLOCK_T)  # the programs with visible keys; the others return at once
    sc_row = sc_ptr + b * s_sc
    t0 = tb * BLOCK_T
    if (n_vis == 0) & (tb == 0):  # nothing visible yet: no picks
        j = tl.arange(0, BLOCK_K)
        tl.store(out_ptr + b * s_out + j, tl.full((BLOCK_K,), -1, tl.int64), mask=j < KOUT)
    if t0 < n_vis:
        q, w = _query(q_ptr, w_ptr, b, H, DI, w_scale, sq_b, sq_h, sw_b, ROUND_BF16, BLOCK_H, BLOCK_D)
        t = t0 + tl.arange(0, BLOCK_T)
        tm = t < n_vis
        score = _score_keys(q, w, k_ptr + tl.load(slot_ptr + b) * sk_b, t, tm, DI, sk_t, ROUND_BF16, UPCAST,
                            BLOCK_D)
        tl.store(sc_row + t, score, mask=tm)
        tl.debug_barrier()  # this program's scores are stored before it counts itself in
        if tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel") == n_active - 1:
            _select(sc_row, buf_ptr + b * s_buf, out_ptr + b * s_out, n_vis, TOPK, KOUT, ROUND_BF16, BLOCK_K,
                    BLOCK_SEL)
            tl.atomic_xchg(cnt_ptr + b, 0)  # ready for the next launch (graph replay)


@triton.jit
def _pick_block(s, t, tm, tau, take_ties, placed, ties, buf, SHIFT: tl.constexpr):
    """Store the picks among scores ``s`` (entries ``t``, valid ``tm``) — keys above ``tau`` and the first
    ``take_ties`` ties in entry order — as sort keys into ``buf`` after the ``placed`` ones; returns the updated
    ``(placed, ties)`` counts."""
    u = _order_key(s, SHIFT)
    tie = (u == tau) & tm
    tie_rank = ties + tl.cumsum(tie.to(tl.int64), axis=0) - 1
    sel = ((u > tau) & tm) | (tie & (tie_rank < take_ties))
    slot_i = placed + tl.cumsum(sel.to(tl.int64), axis=0) - 1
    key = _sort_key(s, t)
    tl.store(buf + slot_i, key, mask=sel)
    return placed + tl.sum(sel.to(tl.int64), axis=0), ties + tl.sum(tie.to(tl.int64), axis=0)


@triton.jit
def _sorted_picks(buf, out, k_sel, KOUT, BLOCK: tl.constexpr):
    """The ``k_sel ≤ BLOCK`` picks in ``buf`` sorted (score descending, index ascending) into ``out[:BLOCK]``, −1
    after them (entries below ``KOUT`` only)."""
    j = tl.arange(0, BLOCK)
    key = tl.load(buf + j, mask=j < k_sel, other=-9223372036854775807 - 1)
    key = tl.sort(key, descending=True)
    picked = 2147483647 - (key & 0xFFFFFFFF)
    tl.store(out + j, tl.where(j < k_sel, picked, -1), mask=j < KOUT)


@triton.jit
def _select(sc_row, buf, out, n_vis, TOPK, KOUT, ROUND_BF16: tl.constexpr, BLOCK_K: tl.constexpr,
            BLOCK_SEL: tl.constexpr):
    """The top ``min(TOPK, n_vis)`` of the row's ``n_vis`` stored scores, sorted (score descending, index
    ascending), −1 after them, into ``out[:KOUT]``; ``buf`` holds the unsorted picks.

    Up to ``BLOCK_SEL`` visible scores (contexts up to 4·BLOCK_SEL tokens) are read once and searched in
    registers; more are streamed from L2 once per bit of the search. Few picks (early in a sequence) are sorted in
    a 64-wide network instead of the ``BLOCK_K``-wide one."""
    SHIFT: tl.constexpr = 16 if ROUND_BF16 else 0
    NBITS: tl.constexpr = 32 - SHIFT
    k_sel = tl.minimum(TOPK, n_vis)
    tau = n_vis * 0  # the k_sel-th largest key (0 = the smallest possible: everything qualifies)
    placed = k_sel * 0
    ties = k_sel * 0
    if n_vis <= BLOCK_SEL:
        t = tl.arange(0, BLOCK_SEL)
        tm = t < n_vis
        s = tl.load(sc_row + t, mask=tm, other=0.0, cache_modifier=".cg")
        u = _order_key(s, SHIFT)
        if n_vis > TOPK:
            step = (tau + 1) << (NBITS - 1)
            for _ in range(NBITS):  # the highest key with at least k_sel scores at or above it, bit by bit
                cand = tau + step
                if tl.sum(((u >= cand) & tm).to(tl.int64), axis=0) >= k_sel:
                    tau = cand
                step = step >> 1
        take_ties = k_sel - tl.sum(((u > tau) & tm).to(tl.int64), axis=0)
        placed, ties = _pick_block(s, t, tm, tau, take_ties, placed, ties, buf, SHIFT)
    else:
        if n_vis > TOPK:
            step = (tau + 1) << (NBITS - 1)
            for _ in range(NBITS):
                cand = tau + step
                if _count_at_least(sc_row, n_vis, cand, SHIFT, BLOCK_SEL) >= k_sel:
                    tau = cand
                step = step >> 1
        take_ties = k_sel - _count_at_least(sc_row, n_vis, tau + 1, SHIFT, BLOCK_SEL)
        for c0 in range(0, n_vis, BLOCK_SEL):
            t = c0 + tl.arange(0, BLOCK_SEL)
            tm = t < n_vis
            s = tl.load(sc_row + t, mask=tm, other=0.0, cache_modifier=".cg")
            placed, ties = _pick_block(s, t, tm, tau, take_ties, placed, ties, buf, SHIFT)
    tl.debug_barrier()  # the picks, stored by all of this program's threads, are read back whole
    SMALL: tl.constexpr = 64 if BLOCK_K > 64 else BLOCK_K
    if k_sel <= SMALL:
        _sorted_picks(buf, out, k_sel, KOUT, SMALL)
        if BLOCK_K > SMALL:
            j = SMALL + tl.arange(0, BLOCK_K)
            tl.store(out + j, tl.full((BLOCK_K,), -1, tl.int64), mask=j < KOUT)
    else:
        _sorted_picks(buf, out, k_sel, KOUT, BLOCK_K)


def _selection_outputs(qi: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, topk: int):
    """The launchers' shared prologue (this one and :func:`.indexer_split_decode.indexer_select_split`): the shapes,
    strides and dtypes checked, and the outputs allocated. Returns ``B, H, DI, T, kout, out [B, kout] int64,
    scores [B, T] fp32``."""
    B, H, DI = qi.shape
    T = keys.shape[1]
    assert keys.shape[2] == DI and w.shape == (B, H) and keys.stride(-1) == 1 and qi.stride(-1) == 1
    assert qi.dtype == keys.dtype == w.dtype and qi.dtype in (torch.bfloat16, torch.float32)
    kout = min(topk, T)
    out = torch.empty(B, kout, dtype=torch.long, device=qi.device)
    scores = torch.empty(B, T, dtype=torch.float32, device=qi.device)
    return B, H, DI, T, kout, out, scores


def indexer_select(qi: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor,
                   positions: torch.Tensor, topk: int, ratio: int = 4, w_scale: float = 1.0,
                   block_t: int | None = None, return_scores: bool = False, block_sel: int | None = None):
    """``qi [b, H, d]`` (prepared queries), head weights ``w [b, H] · w_scale`` (rounded to act as the reference
    scales them), the index-key cache ``keys [slots, T, d]`` read at ``slots [b]``, ``positions [b]`` →
    ``[b, min(topk, T)]`` int64 entry indices (−1 = none); with ``return_scores`` also the scores ``[b, T]`` (fp32
    holding act values; only the visible ones are written). ``block_t``: keys scored per program; ``block_sel``:
    scores the selection holds at once (default: the cache's length up to 2,048; a power of two ≥ ``block_t``)."""
    slots, positions = slots.contiguous(), positions.contiguous()  # read as ptr + row
    B, H, DI, T, kout, out, scores = _selection_outputs(qi, w, keys, topk)
    if B == 0 or kout == 0:
        return (out, scores) if return_scores else out
    block_t = block_t or (256 if interpreting() else 64)
    block_sel = block_sel or max(block_t, min(2048, triton.next_power_of_2(T)))
    if block_sel & (block_sel - 1) or block_sel < block_t:
        raise ValueError(f"indexer_select: block_sel={block_sel} must be a power of two ≥ block_t={block_t}")
    block_k = max(2, triton.next_power_of_2(kout))
    picks = torch.empty(B, block_k, dtype=torch.int64, device=qi.device)
    grid = (B, triton.cdiv(T, block_t))
    _indexer_select_kernel[grid](qi, w, keys, slots, positions, scores, _counters(B, qi.device), picks, out,
                                 H, DI, T, kout, topk, ratio, float(w_scale), qi.stride(0), qi.stride(1), w.stride(0),
                                 keys.stride(0), keys.stride(1), scores.stride(0), picks.stride(0), out.stride(0),
                                 ROUND_BF16=qi.dtype == torch.bfloat16, UPCAST=interpreting(),
                                 BLOCK_H=max(16, triton.next_power_of_2(H)),
                                 BLOCK_D=max(16, triton.next_power_of_2(DI)), BLOCK_T=block_t, BLOCK_K=block_k,
                                 BLOCK_SEL=block_sel, num_warps=4, **pdl_args(qi.device))
    return (out, scores) if return_scores else out


__all__ = ["indexer_select"]
