"""The lightning indexer's decode step split over the key axis, for long contexts — the same selection as
:mod:`.indexer_decode` (the reference's ``indexer_scores`` then ``indexer_topk``, ties to the lower entry), with no
program that walks the whole context.

Why: the fused kernel's last-arriving program selects alone. Beyond the 2,048 scores it holds in registers it
streams all the row's scores from L2 once per bit of its threshold search (16 passes over 16,384 scores after a
65,536-token prompt, then the picks), a serial tail of roughly 200 µs per CSA layer on an H200 while the keys it
scores take a few µs to read. Here the work is cut along the key axis into pieces of bounded size:

1. **Candidates** — grid ``(rows, splits of the cache)``. Program ``(b, s)`` scores the ``split`` keys of its slice
   that row ``b`` can see (the fused kernel's arithmetic, :func:`.indexer_decode._score_keys`: the same bits),
   stores them, sorts them by the selection's key (:func:`.indexer_decode._sort_key`: score descending, entry
   ascending — a total order, every key distinct) and keeps the first ``min(split, k)`` as its candidate list,
   padded with int64's minimum ("no entry"). A slice wholly past the visible keys does nothing.
2. **Merge by rank** — grid ``(rows, splits, candidate blocks)``. Every entry of the top ``k`` is a candidate of its
   slice (fewer than ``k`` keys of its slice beat it), and every key that beats it is in the top ``k`` too, so its
   rank among all the candidates is its rank among all the visible keys: its position in its own list plus, for
   every other list, how many of that list's keys are larger — a branchless binary search, all lists at once
   (``log₂(min(split, k)) + 1`` dependent loads). Before that, a floor under the ``k``-th largest key read off
   the lists themselves (``m`` lists holding a ``(j+1)``-th key, ``m·(j+1) ≥ k``: the smallest of those keys)
   leaves out the candidates that cannot be picks — after 65,536 tokens (32 lists of 512 scores) all but a few
   per list, so most merge programs return after one load. A candidate of rank ``< k`` is written at ``out[rank]``: the
   picks land sorted (score descending, entry ascending), each slot written by exactly one program, ``−1`` after
   ``min(k, visible)`` (program ``(b, 0, 0)``). No atomics, no order-dependent sums: the result is the reference's
   selection bit for bit whatever the scheduling.

Work per program is bounded by ``split`` keys (1) and by ``block_e`` candidates × the row's lists × one search
(2); the lists grow with the context, so a longer context is more programs, not a longer program. Two launches
instead of one (a kernel boundary, ~3–4 µs in a graph).

**Numerics.** The scores are :mod:`.indexer_decode`'s (same helper, same rounding points; its docstring derives
when they are bit-identical to the reference's); the selection is exact given the scores — set and order, ties
to the lower entry.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .indexer_decode import _query, _score_keys, _selection_outputs, _sort_key
from .launch import pdl_args, pdl_prologue
from .rowops import interpreting

NO_ENTRY = tl.constexpr(-9223372036854775807 - 1)  # int64 minimum: below every sort key


@dataclass(frozen=True)
class IndexerSplitGeometry:
    """``split``: keys per candidate program (a power of two ≥ ``block_t``); ``block_t``: keys per scoring dot;
    ``block_e``: candidates ranked per merge program (a power of two); ``num_warps`` / ``merge_warps``: warps of
    the two launches."""

    split: int = 1024
    block_t: int = 64
    block_e: int = 64
    num_warps: int = 4
    merge_warps: int = 4


@triton.jit
def _indexer_select_candidates_kernel(q_ptr, w_ptr, k_ptr, slot_ptr, pos_ptr, sc_ptr, cand_ptr,
                                      H, DI, T, RATIO, w_scale, sq_b, sq_h, sw_b, sk_b, sk_t, s_sc, S_CAP,
                                      ROUND_BF16: tl.constexpr, UPCAST: tl.constexpr, BLOCK_H: tl.constexpr,
                                      BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, SPLIT: tl.constexpr,
                                      KC: tl.constexpr, PDL: tl.constexpr = False):
    """Program ``(b, s)``: the sorted top ``KC`` of the visible keys ``[s·SPLIT, (s+1)·SPLIT)`` of row ``b``."""
    pdl_prologue(PDL)
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    n_vis = tl.minimum((tl.load(pos_ptr + b) + 1) // RATIO, T)
    t_lo = s * SPLIT
    if t_lo < n_vis:
        t_hi = tl.minimum(t_lo + SPLIT, n_vis)
        sc_row = sc_ptr + b * s_sc
        q, w = _query(q_ptr, w_ptr, b, H, DI, w_scale, sq_b, sq_h, sw_b, ROUND_BF16, BLOCK_H, BLOCK_D)
        krow = k_ptr + tl.load(slot_ptr + b) * sk_b
        for t0 in range(t_lo, t_hi, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tm = t < t_hi
            tl.store(sc_row + t, _score_keys(q, w, krow, t, tm, DI, sk_t, ROUND_BF16, UPCAST, BLOCK_D), mask=tm)
        tl.debug_barrier()  # the slice's scores, stored by all of this program's threads, are read back whole
        t = t_lo + tl.arange(0, SPLIT)
        tm = t < t_hi
        score = tl.load(sc_row + t, mask=tm, other=0.0, cache_modifier=".cg")
        key = tl.where(tm, _sort_key(score, t), tl.full((SPLIT,), NO_ENTRY, tl.int64))
        key = tl.sort(key, descending=True)
        j = tl.arange(0, SPLIT)
        tl.store(cand_ptr + (b * S_CAP + s) * KC + j, key, mask=j < KC)


@triton.jit
def _indexer_select_merge_kernel(cand_ptr, pos_ptr, out_ptr, T, TOPK, KOUT, RATIO, S_CAP, s_out,
                                 SPLIT: tl.constexpr, KC: tl.constexpr, LOG2_KC: tl.constexpr,
                                 BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
                                 PDL: tl.constexpr = False):
    """Program ``(b, s, e)``: candidates ``e·BLOCK_E …`` of row ``b``'s list ``s``, each written at its rank."""
    pdl_prologue(PDL)
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    e = tl.program_id(2)
    n_vis = tl.minimum((tl.load(pos_ptr + b) + 1) // RATIO, T)
    n_lists = tl.cdiv(n_vis, SPLIT)
    out_row = out_ptr + b * s_out
    if (s == 0) & (e == 0):  # the slots past the picks
        j = tl.arange(0, BLOCK_K)
        tl.store(out_row + j, tl.full((BLOCK_K,), -1, tl.int64), mask=(j >= tl.minimum(TOPK, n_vis)) & (j < KOUT))
    if (s < n_lists) & (e * BLOCK_E < TOPK):
        lists = cand_ptr + b * S_CAP * KC
        other = tl.arange(0, BLOCK_S)
        active = other < n_lists
        # A floor under the k-th largest key: if m lists each hold a (j+1)-th key, those m·(j+1) keys are all at
        # least the smallest of the m (j+1)-th keys, so with m·(j+1) ≥ k that smallest key is ≤ the k-th largest.
        # j from all lists but one (the last may be short); without such a floor every candidate is ranked.
        j = other * 0 + tl.cdiv(TOPK, tl.maximum(n_lists - 1, 1)) - 1  # the same j for every list
        jth = tl.load(lists + other * KC + j, mask=active & (j < KC), other=NO_ENTRY)
        holds = jth != NO_ENTRY
        m = tl.sum(holds.to(tl.int32), axis=0)
        floor = tl.min(tl.where(holds, jth, -(NO_ENTRY + 1)), axis=0)
        floor = tl.where(m * (tl.max(j, axis=0) + 1) >= TOPK, floor, NO_ENTRY)
        i = e * BLOCK_E + tl.arange(0, BLOCK_E)
        mine = tl.load(lists + s * KC + i, mask=i < KC, other=NO_ENTRY)
        live = (mine != NO_ENTRY) & (mine >= floor)  # below the floor: k keys are larger, never a pick
        if tl.sum(live.to(tl.int32), axis=0) > 0:
            searched = (active & (other != s))[None, :] & live[:, None]
            # per (candidate, other list): how many of the list's keys are larger — the lists are sorted
            # descending, so the largest prefix of larger keys, found with steps KC, KC/2, …, 1 (a probe past the
            # list is "no")
            larger = tl.zeros((BLOCK_E, BLOCK_S), tl.int32)
            for k in tl.static_range(LOG2_KC + 1):
                probe = larger + ((KC >> k) - 1)
                v = tl.load(lists + other[None, :] * KC + probe, mask=searched & (probe < KC), other=NO_ENTRY)
                larger = tl.where(v > mine[:, None], larger + (KC >> k), larger)
            rank = i + tl.sum(larger, axis=1)  # its own list's keys before it are all larger
            tl.store(out_row + rank, 2147483647 - (mine & 0xFFFFFFFF), mask=live & (rank < TOPK))


def indexer_select_split(qi: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor,
                         positions: torch.Tensor, topk: int, ratio: int = 4, w_scale: float = 1.0,
                         geometry: IndexerSplitGeometry | None = None, return_scores: bool = False):
    """:func:`.indexer_decode.indexer_select` (same arguments, same result) split over the key axis: ``qi [b, H,
    d]``, ``w [b, H] · w_scale``, the key cache ``keys [slots, T, d]`` read at ``slots [b]``, ``positions [b]`` →
    ``[b, min(topk, T)]`` int64 entries (−1 = none); with ``return_scores`` also the scores ``[b, T]`` (fp32, only
    the visible ones written)."""
    slots, positions = slots.contiguous(), positions.contiguous()  # read as ptr + row
    g = geometry or IndexerSplitGeometry()
    if g.split & (g.split - 1) or g.split < g.block_t or g.block_e & (g.block_e - 1) or g.block_t < 16:
        raise ValueError(f"IndexerSplitGeometry {g}: split must be a power of two ≥ block_t ≥ 16, block_e a power "
                         "of two")
    B, H, DI, T, kout, out, scores = _selection_outputs(qi, w, keys, topk)
    if B == 0 or kout == 0:
        return (out, scores) if return_scores else out
    s_cap = triton.cdiv(T, g.split)
    kc = min(g.split, triton.next_power_of_2(topk))  # ≥ min(split, topk): every top-k entry is a candidate
    cand = torch.empty(B, s_cap, kc, dtype=torch.int64, device=qi.device)
    bf16 = qi.dtype == torch.bfloat16
    _indexer_select_candidates_kernel[(B, s_cap)](
        qi, w, keys, slots, positions, scores, cand, H, DI, T, ratio, float(w_scale), qi.stride(0), qi.stride(1),
        w.stride(0), keys.stride(0), keys.stride(1), scores.stride(0), s_cap, ROUND_BF16=bf16, UPCAST=interpreting(),
        BLOCK_H=max(16, triton.next_power_of_2(H)), BLOCK_D=max(16, triton.next_power_of_2(DI)), BLOCK_T=g.block_t,
        SPLIT=g.split, KC=kc, num_warps=g.num_warps, **pdl_args(qi.device))
    block_e = min(g.block_e, kc)
    _indexer_select_merge_kernel[(B, s_cap, triton.cdiv(kc, block_e))](
        cand, positions, out, T, topk, kout, ratio, s_cap, out.stride(0), SPLIT=g.split, KC=kc,
        LOG2_KC=kc.bit_length() - 1, BLOCK_E=block_e, BLOCK_S=max(2, triton.next_power_of_2(s_cap)),
        BLOCK_K=max(2, triton.next_power_of_2(kout)), num_warps=g.merge_warps, **pdl_args(qi.device))
    return (out, scores) if return_scores else out


__all__ = ["IndexerSplitGeometry", "indexer_select_split"]
