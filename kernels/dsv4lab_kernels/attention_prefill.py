"""Prefill kernels of the attention side: sparse attention with a sink, the indexer's scores and causal top-k,
and the compressor's softmax pooling.

**Sparse attention** (``ReferenceOps.sparse_attention``). Every query attends to its own set of KV rows
(``idx [b, s, k]``, −1 = masked: the window, then the indexer-selected (CSA) or all visible (HCA) compressed
entries), and all heads of a query share that set — DeepSeek-V4 has one latent K=V head. So one program takes one
query and ``BLOCK_H`` of its heads as the MMA's M dimension, gathers ``BLOCK_N`` KV rows at a time (each a
contiguous ``d``-wide row) and runs an online softmax over them: ``S = Q·KVᵀ·scale`` (fp32), running max ``m``,
``l = Σ exp(S−m)`` in fp32, ``acc += bf16(exp(S−m))·KV``; at the end ``out = acc / (l + exp(sink − m))``. The
reference takes the exponentials against the final max and rounds them to bf16 for the numerator only; the online
form rounds against the running max, a difference within bf16 rounding; ``EXACT_MAX`` configurations (names
ending in ``x``) first find the final max in a scores-only pass and then round exactly as the reference does, for
a third more MMA work. Masked slots are never loaded (a NaN row they alias stays invisible). ``SPLIT_D`` > 1 gives
each program a ``d/SPLIT_D`` slice of the output (fewer registers for ``d = 512``; the scores are recomputed per
slice).

**Indexer scores** (``ReferenceOps.indexer_scores``): ``Σ_h bf16(relu(bf16(q_h·K_t))·w_h)`` → bf16. A program
takes ``BLOCK_Q`` queries × all heads as the MMA's M (``BLOCK_Q·BLOCK_H`` rows), loads them once and walks
``tiles`` key tiles of ``BLOCK_T`` keys, reducing over heads exactly (fp64) and rounding once to fp32 and then
bf16, as the reference.

**Indexer selection** (``ReferenceOps.indexer_select`` = scores then top-k): the same scores kernel in its causal
form — a query block stops at the last key any of its queries may see (``t < (p+1)//ratio``), so about half the
scores of a prefill are never computed — into a scratch the top-k kernel reads; the op returns only the selection.

**Indexer top-k** (``select_topk``): per query row, the visible entries (``t < (p+1)//ratio``) sorted by score,
ties to the lower index, through 64-bit keys ``(order-preserving score bits) << 32 | (2^31−1−t)`` (−0 and +0 compare
equal, as in torch; every key of a row is distinct, so the order is total). The row is read in tiles as wide as the
selection (``KP = next_pow2(topk)``, 512 for Flash): a running top-``KP`` is joined with each tile and the ``2·KP``
keys sorted, the upper half kept — the same first ``topk`` as one sort of the whole row, for any context length,
from one compiled kernel (one sort of the row compiled a bitonic network per power of two of ``T``, tens of seconds
for the long rows on the first prompt of that length — ``docs/kernels_prefill.md`` — and rows over 8,192 did not
fit a program).

**Compressor pooling** (``ReferenceOps.compressor_pool``): per channel softmax over an entry's slots, in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_gemm import interpreting, to_bf16

# ============================================================================================ sparse attention
@triton.jit
def _sparse_attention_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, o_ptr, S, H, DIM, NKV, K, scale,
                             sq_b, sq_s, sq_h, skv_b, skv_n, si_b, si_s, so_b, so_s, so_h,
                             BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                             SPLIT_D: tl.constexpr, EXACT_MAX: tl.constexpr, UPCAST: tl.constexpr):
    pid_q = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_d = tl.program_id(2)
    b = pid_q // S
    s = pid_q % S
    rh = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    rd = tl.arange(0, BLOCK_D)
    h_ok = rh < H
    d_ok = rd < DIM
    q = tl.load(q_ptr + b.to(tl.int64) * sq_b + s.to(tl.int64) * sq_s + rh[:, None] * sq_h + rd[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    OUT_D: tl.constexpr = BLOCK_D // SPLIT_D
    ro = pid_d * OUT_D + tl.arange(0, OUT_D)
    o_ok = ro < DIM
    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, OUT_D), dtype=tl.float32)
    idx_row = idx_ptr + b.to(tl.int64) * si_b + s.to(tl.int64) * si_s
    kv_base = kv_ptr + b.to(tl.int64) * skv_b
    if EXACT_MAX:  # a first pass for the final max, so every exponential is taken against it (the reference's)
        for j0 in range(0, K, BLOCK_N):
            rj = j0 + tl.arange(0, BLOCK_N)
            row = tl.load(idx_row + rj, mask=rj < K, other=-1)
            valid = row >= 0
            kv = tl.load(kv_base + row[:, None].to(tl.int64) * skv_n + rd[None, :],
                         mask=valid[:, None] & d_ok[None, :], other=0.0)
            if UPCAST:
                kv = kv.to(tl.float32)
            z = tl.where(valid[None, :], tl.dot(q, tl.trans(kv)) * scale, float("-inf"))
            m = tl.maximum(m, tl.max(z, axis=1))
    for j0 in range(0, K, BLOCK_N):
        rj = j0 + tl.arange(0, BLOCK_N)
        row = tl.load(idx_row + rj, mask=rj < K, other=-1)
        valid = row >= 0
        kv_rows = kv_base + row[:, None].to(tl.int64) * skv_n
        kv = tl.load(kv_rows + rd[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            kv = kv.to(tl.float32)
        z = tl.dot(q, tl.trans(kv)) * scale
        z = tl.where(valid[None, :], z, float("-inf"))
        if EXACT_MAX:
            m_new = m
        else:
            m_new = tl.maximum(m, tl.max(z, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible row yet: keep exp() finite
        alpha = tl.exp(m - m_ref)
        p = tl.exp(z - m_ref[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if SPLIT_D == 1:
            v = kv
        else:
            v = tl.load(kv_rows + ro[None, :], mask=valid[:, None] & o_ok[None, :], other=0.0)
            if UPCAST:
                v = v.to(tl.float32)
        pb = to_bf16(p)
        if UPCAST:
            pb = pb.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(pb, v)
        m = m_new
    sink = tl.load(sink_ptr + rh, mask=h_ok, other=0.0)
    denom = l + tl.exp(sink - m)
    out = acc / denom[:, None]
    o = o_ptr + b.to(tl.int64) * so_b + s.to(tl.int64) * so_s + rh[:, None] * so_h + ro[None, :]
    tl.store(o, to_bf16(out), mask=h_ok[:, None] & o_ok[None, :])


ATTENTION_CONFIGS = {
    # name: (BLOCK_H cap, BLOCK_N, SPLIT_D, EXACT_MAX, num_warps, num_stages)
    "h64n32": (64, 32, 1, False, 8, 2),
    "h64n64": (64, 64, 1, False, 8, 2),
    "h64n32d2": (64, 32, 2, False, 8, 2),
    "h32n32": (32, 32, 1, False, 4, 2),
    "h64n32x": (64, 32, 1, True, 8, 2),
    "h16n16": (16, 16, 1, False, 4, 2),
    "h16n16x": (16, 16, 1, True, 4, 2),
    "h16n64x": (16, 64, 1, True, 4, 2),
}


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, scale: float,
                     config: str = "h64n32") -> torch.Tensor:
    """``q [b, s, h, d]`` bf16, ``kv [b, n, d]`` bf16, ``idx [b, s, k]`` (−1 masked), ``sink [h]`` fp32 →
    ``[b, s, h, d]`` bf16 (see the module docstring)."""
    b, S, H, DIM = q.shape
    assert kv.ndim == 3 and kv.shape[0] == b and kv.shape[2] == DIM, f"kv {list(kv.shape)} vs q {list(q.shape)}"
    assert idx.shape[:2] == (b, S), f"idx {list(idx.shape)} vs q {list(q.shape)}"
    assert q.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16, "sparse_attention: bf16 q and kv"
    assert q.stride(-1) == 1 and kv.stride(-1) == 1, "sparse_attention: q and kv contiguous along d"
    cap, block_n, split_d, exact_max, warps, stages = ATTENTION_CONFIGS[config]
    block_h = max(16, min(cap, triton.next_power_of_2(H)))
    block_d = triton.next_power_of_2(DIM)
    split_d = split_d if block_d // split_d >= 16 else 1
    idx = idx.contiguous()
    if idx.dtype != torch.int32:
        idx = idx.to(torch.int32)
    sink = sink.float().contiguous()
    out = torch.empty(b, S, H, DIM, dtype=torch.bfloat16, device=q.device)
    K = idx.shape[2]
    if b * S == 0:
        return out
    grid = (b * S, triton.cdiv(H, block_h), split_d)
    _sparse_attention_kernel[grid](q, kv, idx, sink, out, S, H, DIM, kv.shape[1], K, float(scale),
                                   q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1),
                                   idx.stride(0), idx.stride(1), out.stride(0), out.stride(1), out.stride(2),
                                   BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=block_n, SPLIT_D=split_d,
                                   EXACT_MAX=exact_max, UPCAST=interpreting(), num_warps=warps, num_stages=stages)
    return out


# ============================================================================================ indexer scores
@triton.jit
def _indexer_scores_kernel(q_ptr, w_ptr, k_ptr, pos_ptr, o_ptr, S, H, DIM, T, ratio,
                           sq_b, sq_s, sq_h, sw_b, sw_s, sk_b, sk_t, sp_b, so_b, so_s,
                           BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_T: tl.constexpr, TILES: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
    pid_q = tl.program_id(0)
    pid_t = tl.program_id(1)
    n_qb = tl.cdiv(S, BLOCK_Q)
    b = pid_q // n_qb
    q0 = (pid_q % n_qb) * BLOCK_Q
    r = tl.arange(0, BLOCK_Q * BLOCK_H)  # row r = (query r // BLOCK_H, head r % BLOCK_H)
    rq = q0 + r // BLOCK_H
    rh = r % BLOCK_H
    row_ok = (rq < S) & (rh < H)
    rd = tl.arange(0, BLOCK_D)
    d_ok = rd < DIM
    q = tl.load(q_ptr + b.to(tl.int64) * sq_b + rq[:, None].to(tl.int64) * sq_s + rh[:, None] * sq_h + rd[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    w = tl.load(w_ptr + b.to(tl.int64) * sw_b + rq.to(tl.int64) * sw_s + rh, mask=row_ok, other=0.0).to(tl.float32)
    oq = q0 + tl.arange(0, BLOCK_Q)
    t_end = T
    if CAUSAL:  # keys no query of this block may see are never scored (the top-k never reads them)
        p = tl.load(pos_ptr + b.to(tl.int64) * sp_b + oq, mask=oq < S, other=0).to(tl.int32)
        t_end = tl.minimum(tl.max((p + 1) // ratio, axis=0), T)
    t_lo = pid_t * TILES * BLOCK_T
    t_hi = tl.minimum(t_lo + TILES * BLOCK_T, t_end)
    for t0 in range(t_lo, t_hi, BLOCK_T):
        rt = t0 + tl.arange(0, BLOCK_T)
        t_ok = rt < t_hi
        keys = tl.load(k_ptr + b.to(tl.int64) * sk_b + rt[:, None].to(tl.int64) * sk_t + rd[None, :],
                       mask=t_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            keys = keys.to(tl.float32)
        dots = to_bf16(tl.dot(q, tl.trans(keys))).to(tl.float32)  # each head's dot rounded to bf16, as the reference
        # relu as torch's: a NaN (a poisoned, not yet written cache entry) stays NaN, as in the reference
        weighted = to_bf16(tl.maximum(dots, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[:, None]).to(tl.float64)
        # the head sum of bf16 terms is exact in fp64, then rounded to fp32 and bf16 as the reference does
        score = tl.sum(tl.reshape(weighted, (BLOCK_Q, BLOCK_H, BLOCK_T)), axis=1).to(tl.float32)
        o = o_ptr + b.to(tl.int64) * so_b + oq[:, None].to(tl.int64) * so_s + rt[None, :]
        tl.store(o, to_bf16(score), mask=(oq < S)[:, None] & t_ok[None, :])


INDEXER_CONFIGS = {
    # name: (queries per program (or 0: fill 128 MMA rows), BLOCK_T, key tiles per program, num_warps)
    "q2t64": (0, 64, 1, 4),
    "q2t64x8": (0, 64, 8, 4),
    "q2t128x4": (0, 128, 4, 8),
    "q4t64x8": (4, 64, 8, 8),
}


def _indexer_launch(qi, w, keys, positions, ratio, causal: bool, block_q, block_t, tiles, num_warps, out=None):
    b, S, H, DIM = qi.shape
    T = keys.shape[1]
    if keys.shape[0] != b or keys.shape[2] != DIM:
        raise ValueError(f"indexer: keys {list(keys.shape)} vs qi {list(qi.shape)}")
    if tuple(w.shape) != (b, S, H):
        raise ValueError(f"indexer: w {list(w.shape)} vs qi {list(qi.shape)}")
    if not (qi.dtype == keys.dtype == w.dtype == torch.bfloat16):
        raise ValueError(f"indexer: bf16 qi, w and keys expected, got {qi.dtype}, {w.dtype}, {keys.dtype}")
    if qi.stride(-1) != 1 or keys.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("indexer: qi, w and keys must be contiguous in their last dim")
    block_h = triton.next_power_of_2(H)
    if not block_q:
        block_q = max(1, 128 // block_h)
    block_q = max(block_q, -(-16 // block_h))  # the MMA needs at least 16 rows
    block_d = max(16, triton.next_power_of_2(DIM))
    if out is None:
        out = torch.empty(b, S, T, dtype=torch.bfloat16, device=qi.device)
    if b * S * T == 0:
        return out
    pos = positions if positions is not None else out  # unread unless causal
    grid = (b * triton.cdiv(S, block_q), triton.cdiv(T, block_t * tiles))
    _indexer_scores_kernel[grid](qi, w, keys, pos, out, S, H, DIM, T, ratio, qi.stride(0), qi.stride(1),
                                 qi.stride(2), w.stride(0), w.stride(1), keys.stride(0), keys.stride(1),
                                 pos.stride(0), out.stride(0), out.stride(1), BLOCK_Q=block_q, BLOCK_H=block_h,
                                 BLOCK_D=block_d, BLOCK_T=block_t, TILES=tiles, CAUSAL=causal,
                                 UPCAST=interpreting(), num_warps=num_warps)
    return out


def indexer_scores(qi: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, block_q: int | None = None,
                   block_t: int = 64, num_warps: int = 4, tiles: int = 1) -> torch.Tensor:
    """``qi [b, s, h, d]``, ``w [b, s, h]``, ``keys [b, T, d]`` (bf16) → every score ``[b, s, T]`` bf16."""
    return _indexer_launch(qi, w, keys, None, 1, False, block_q, block_t, tiles, num_warps)


def indexer_select(qi: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, ratio: int,
                   topk: int, config: str = "q2t64x8") -> torch.Tensor:
    """``ReferenceOps.indexer_select``: the causal top-``topk`` entries of each query ``[b, s, min(topk, T)]``
    (int64, −1 = none), scoring only the keys some query of a block may see (``config``: :data:`INDEXER_CONFIGS`)."""
    b, S = qi.shape[:2]
    if tuple(positions.shape) != (b, S):
        raise ValueError(f"indexer_select: positions {list(positions.shape)} vs qi {list(qi.shape)}")
    block_q, block_t, tiles, warps = INDEXER_CONFIGS[config]
    pos = positions.to(torch.int64).contiguous()
    scores = _indexer_launch(qi, w, keys, pos, ratio, True, block_q, block_t, tiles, warps)
    return indexer_topk(scores, pos, ratio, topk)


# ============================================================================================ indexer top-k
# Lengths, strides and row counts vary with every prompt: not specialized (a value divisible by 16 would otherwise
# compile a second variant of the kernel).
@triton.jit(do_not_specialize=["ROWS", "S", "T", "KOUT", "ss_b", "ss_s", "so_b", "so_s"])
def _topk_kernel(scores_ptr, pos_ptr, out_ptr, ROWS, S, T, KOUT, ratio, ss_b, ss_s, so_b, so_s,
                 BLOCK_S: tl.constexpr, KP: tl.constexpr):
    row = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)  # BLOCK_S query rows, each selected on its own
    row_ok = row < ROWS
    b = row // S
    s = row % S
    p = tl.load(pos_ptr + row, mask=row_ok, other=0)
    visible = tl.minimum((p + 1) // ratio, T).to(tl.int32)  # never past the cache
    base = b.to(tl.int64) * ss_b + s.to(tl.int64) * ss_s
    t = tl.arange(0, KP)
    # the running top-KP, sorted descending; filled with keys below any entry's (order −2^31, index 2^31−1 → −1)
    best = tl.full((BLOCK_S, KP), -9223372036854775808, tl.int64)
    n_tiles = tl.cdiv(tl.max(tl.where(row_ok, visible, 0), axis=0), KP)  # tiles no row of the program sees: skipped
    for i in range(0, n_tiles):
        tt = i * KP + t
        seen = row_ok[:, None] & (tt[None, :] < visible[:, None])  # invisible: never read
        sc = tl.load(scores_ptr + base[:, None] + tt[None, :], mask=seen, other=0.0)
        sc = sc.to(tl.float32) + 0.0  # −0 → +0: torch orders them as equal
        bits = sc.to(tl.int32, bitcast=True)
        order = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # order-preserving as a signed integer
        order = tl.where(seen, order, -2147483648)  # invisible entries last (→ −1)
        key = (order.to(tl.int64) << 32) | (2147483647 - tt[None, :]).to(tl.int64)
        both = tl.sort(tl.reshape(tl.join(best, key), (BLOCK_S, 2 * KP)), descending=True)
        best, _ = tl.split(tl.permute(tl.reshape(both, (BLOCK_S, 2, KP)), (0, 2, 1)))  # the upper KP
    picked = 2147483647 - (best & 0xFFFFFFFF).to(tl.int32)
    picked = tl.where(picked < visible[:, None], picked, -1)
    o = out_ptr + (b.to(tl.int64) * so_b + s.to(tl.int64) * so_s)[:, None] + t[None, :]
    tl.store(o, picked.to(tl.int64), mask=row_ok[:, None] & (t < KOUT)[None, :])


def indexer_topk(scores: torch.Tensor, positions: torch.Tensor, ratio: int, topk: int,
                 rows_per_program: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """``select_topk``: ``scores [b, s, T]``, ``positions [b, s]`` → ``[b, s, min(topk, T)]`` int64 (−1 = none).

    Any ``T``; ``rows_per_program`` query rows share a program (default: as many as fill 2,048 sorted keys, at
    most 16)."""
    b, S, T = scores.shape
    assert tuple(positions.shape) == (b, S), f"positions {list(positions.shape)} vs scores {list(scores.shape)}"
    assert scores.stride(-1) == 1, "indexer_topk: scores contiguous along T"
    k = min(topk, T)
    out = torch.empty(b, S, k, dtype=torch.long, device=scores.device)
    if b * S * k == 0:
        return out
    pos = positions.to(torch.int64).contiguous()
    kp = max(16, triton.next_power_of_2(k))  # the selection's width: one kernel for every T ≥ topk
    block_s = rows_per_program or max(1, min(16, 2048 // (2 * kp)))
    grid = (triton.cdiv(b * S, block_s),)
    _topk_kernel[grid](scores, pos, out, b * S, S, T, k, ratio, scores.stride(0), scores.stride(1), out.stride(0),
                       out.stride(1), BLOCK_S=block_s, KP=kp, num_warps=num_warps)
    return out


# ============================================================================================ compressor pooling
@triton.jit
def _pool_kernel(kv_ptr, sc_ptr, o_ptr, NB, R, C, skv_b, skv_r, ssc_b, ssc_r, so_b,
                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    e = tl.program_id(0)
    rc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rr = tl.arange(0, BLOCK_R)
    msk = (rr < R)[:, None] & (rc < C)[None, :]
    sc = tl.load(sc_ptr + e.to(tl.int64) * ssc_b + rr[:, None] * ssc_r + rc[None, :], mask=msk,
                 other=float("-inf")).to(tl.float32)
    kv = tl.load(kv_ptr + e.to(tl.int64) * skv_b + rr[:, None] * skv_r + rc[None, :], mask=msk,
                 other=0.0).to(tl.float32)
    top = tl.max(sc, axis=0)
    ex = tl.exp(sc - top[None, :])
    wgt = ex / tl.sum(ex, axis=0)[None, :]
    pooled = tl.sum(wgt * kv, axis=0)
    tl.store(o_ptr + e.to(tl.int64) * so_b + rc, pooled, mask=rc < C)


def compressor_pool(kv_slots: torch.Tensor, sc_slots: torch.Tensor, block_c: int = 128) -> torch.Tensor:
    """``[nb, slots, c]`` × 2 (fp32) → ``[nb, c]`` fp32: per channel softmax of the scores over the slots."""
    NB, R, C = kv_slots.shape
    assert sc_slots.shape == kv_slots.shape, f"sc_slots {list(sc_slots.shape)} vs kv_slots {list(kv_slots.shape)}"
    kv_slots = kv_slots.contiguous()
    sc_slots = sc_slots.contiguous()
    out = torch.empty(NB, C, dtype=torch.float32, device=kv_slots.device)
    if NB * C == 0:
        return out
    block_c = min(block_c, triton.next_power_of_2(C))
    block_r = max(2, triton.next_power_of_2(R))
    _pool_kernel[(NB, triton.cdiv(C, block_c))](kv_slots, sc_slots, out, NB, R, C, kv_slots.stride(0),
                                                kv_slots.stride(1), sc_slots.stride(0), sc_slots.stride(1),
                                                out.stride(0), BLOCK_R=block_r, BLOCK_C=block_c)
    return out
