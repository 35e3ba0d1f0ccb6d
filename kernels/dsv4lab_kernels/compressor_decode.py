"""The KV compressor's decode step in one launch (reference: ``ReferenceOps.compressor_step``).

One program per token row (a decode step of several tokens per sequence: one program per sequence, its tokens in
order — see the launcher): the token's projections (``kv``, ``score + ape[p mod r]``) go into row ``p mod 2r`` of
its slot's ring; when the token completes its block (``(p+1) mod r == 0`` — a branch inside the kernel, so a
captured graph always runs the same launch) the program pools the block's slots per channel (softmax over the
slots of the scores, in fp64; overlap mode for ratio 4: half A of the previous block, half B of this one), and
finishes the entry: RMSNorm, RoPE at the block's first position ``j·r``, then the indexer's Hadamard + FP4 or the
main cache's FP8 simulation, written to ``cache[slot, j]``. Tokens that complete nothing only write the ring, so
the HCA compressor (ratio 128: 128 slots to pool) costs its pooling once per 128 tokens, not every step.

The channels are pooled in chunks (a ratio-128 block is ``128 × 512`` values per half); each chunk's act-rounded
pooled values go to the entry's cache row, which the program re-reads after a barrier for the norm, the rotation
and the quantization of the whole row. The current token's ring row is taken from its inputs, not re-read, so
the ring store needs no barrier.

**Numerics and bound.** As :mod:`.mhc`: the softmax and the pooled sum in fp64 with the reference's fp32 roundings
(the weights rounded to fp32 before multiplying, the sum rounded once), the entry's norm, rotation, Hadamard and
quantization as in :mod:`.norm_rope_quant`. Bit-identical to the reference except where an exact intermediate lies
within ~1e-14 (relative) of an fp32 rounding boundary: then one ulp of the activation dtype on the entry, or one
quantization step of its block (E4M3: ``scale·2^-3``; E2M1: ``scale·0.5``) where that ulp moves a value across a
grid midpoint.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .formats import quantize_fp8_block
from .norm_rope_quant import _rope_tail, f64_bits
from .rowops import LAUNCH_EXACT, f64_to_act, fp4_qdq_blocks, fwht_rows, rsqrt_f32, to_act
from .launch import pdl_args, pdl_prologue


@triton.jit
def _compressor_token(row, slot, kv_ptr, sc_ptr, ape_ptr, pos_ptr, kvr_ptr, scr_ptr, cache_ptr, w_ptr,
                      cos_ptr, sin_ptr, R, C, WIDTH, CROWS, ROPE, NOPE, eps, hscale_bits,
                      s_in, s_ring_b, s_ring_r, s_cache_b, s_cache_r, s_cos,
                      OVERLAP: tl.constexpr, INDEXER: tl.constexpr, QUANT: tl.constexpr,
                      ROUND_BF16: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr,
                      BLOCK_C: tl.constexpr, BLOCK_CF: tl.constexpr, LOG2C: tl.constexpr):
    """The token of input row ``row`` into the compressor state of ``slot``: its ring row, and the entry of the
    block it completes (if it does)."""
    pos = tl.load(pos_ptr + row)
    ring_b = kvr_ptr + slot * s_ring_b
    sring_b = scr_ptr + slot * s_ring_b
    here = pos % (2 * R)
    ape_row = ape_ptr + (pos % R) * WIDTH
    for w0 in range(0, WIDTH, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        wm = w < WIDTH
        kv = tl.load(kv_ptr + row * s_in + w, mask=wm)
        sc = tl.load(sc_ptr + row * s_in + w, mask=wm) + tl.load(ape_row + w, mask=wm)
        tl.store(ring_b + here * s_ring_r + w, kv, mask=wm)
        tl.store(sring_b + here * s_ring_r + w, sc, mask=wm)

    block = pos // R
    if ((pos + 1) % R == 0) & (block < CROWS):
        NS = 2 * R if OVERLAP else R
        i = tl.arange(0, BLOCK_S)
        i_ok = i < NS
        if OVERLAP:  # slots 0..r-1: half A of block j-1; slots r..2r-1: half B of block j (this token's)
            ring_row = tl.where(i < R, (block * R - R + i + 2 * R) % (2 * R), (block * R + i - R) % (2 * R))
            col0 = tl.where(i < R, 0, C)
            is_here = (ring_row == here) & i_ok & (i >= R)
            cur0 = C
        else:
            ring_row = (block * R + i) % (2 * R)
            col0 = i * 0
            is_here = (ring_row == here) & i_ok
            cur0 = 0
        out_row = cache_ptr + slot * s_cache_b + block * s_cache_r
        sq = tl.zeros((BLOCK_C,), tl.float64)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            cm = c < C
            col = col0[:, None] + c[None, :]
            m2 = i_ok[:, None] & cm[None, :]
            kv = tl.load(ring_b + ring_row[:, None] * s_ring_r + col, mask=m2, other=0.0)
            sc = tl.load(sring_b + ring_row[:, None] * s_ring_r + col, mask=m2, other=float("-inf"))
            cur_col = cur0 + c
            cur_kv = tl.load(kv_ptr + row * s_in + cur_col, mask=cm, other=0.0)
            cur_sc = tl.load(sc_ptr + row * s_in + cur_col, mask=cm, other=0.0) + tl.load(ape_row + cur_col, mask=cm,
                                                                                           other=0.0)
            kv = tl.where(is_here[:, None], cur_kv[None, :], kv)
            sc = tl.where(is_here[:, None], cur_sc[None, :], sc)
            # per-channel softmax of the scores over the slots (fp64, rounded to fp32 as the reference's weights)
            sc64 = sc.to(tl.float64)
            e = tl.exp(sc64 - tl.max(sc64, axis=0)[None, :])
            wgt = (e / tl.sum(e, axis=0)[None, :]).to(tl.float32)
            pooled = f64_to_act(tl.sum(wgt.to(tl.float64) * kv.to(tl.float64), axis=0), ROUND_BF16)
            p64 = pooled.to(tl.float64)
            sq += tl.where(cm, p64 * p64, 0.0)
            tl.store(out_row + c, pooled.to(cache_ptr.dtype.element_ty), mask=cm)
        tl.debug_barrier()  # the pooled row, written by all of this program's threads, is read back whole
        r = rsqrt_f32((tl.sum(sq, axis=0) / C).to(tl.float32), eps)
        cf = tl.arange(0, BLOCK_CF)
        cfm = cf < C
        x = tl.load(out_row + cf, mask=cfm, other=0.0).to(tl.float32)
        y = to_act(tl.load(w_ptr + cf, mask=cfm, other=0.0) * (x * r), ROUND_BF16)
        y = tl.reshape(_rope_tail(y[None, :], cos_ptr, sin_ptr, block * R, s_cos, C, ROPE, False, ROUND_BF16, 1,
                                  BLOCK_CF), (BLOCK_CF,))
        if INDEXER:
            hscale = hscale_bits.to(tl.float64, bitcast=True)
            y = f64_to_act(tl.reshape(fwht_rows(y.to(tl.float64)[None, :], 1, BLOCK_CF, LOG2C), (BLOCK_CF,))
                           * hscale, ROUND_BF16)
            if QUANT:
                y = to_act(tl.reshape(fp4_qdq_blocks(tl.reshape(y, (1, BLOCK_CF // 32, 32))), (BLOCK_CF,)),
                           ROUND_BF16)
        elif QUANT:
            yb = tl.reshape(y, (BLOCK_CF // 64, 64))
            qb = quantize_fp8_block(yb, tl.max(tl.abs(yb), axis=1)[:, None], True)
            blk = tl.arange(0, BLOCK_CF // 64)
            y = tl.reshape(tl.where((blk < NOPE // 64)[:, None], to_act(qb, ROUND_BF16), yb), (BLOCK_CF,))
        tl.debug_barrier()  # every thread has read the pooled row before any overwrites it
        tl.store(out_row + cf, y.to(cache_ptr.dtype.element_ty), mask=cfm)


@triton.jit
def _compressor_seq(seq, n_tokens, kv_ptr, sc_ptr, ape_ptr, pos_ptr, slot_ptr, kvr_ptr, scr_ptr, cache_ptr, w_ptr,
                    cos_ptr, sin_ptr, R, C, WIDTH, CROWS, ROPE, NOPE, eps, hscale_bits,
                    s_in, s_ring_b, s_ring_r, s_cache_b, s_cache_r, s_cos,
                    OVERLAP: tl.constexpr, INDEXER: tl.constexpr, QUANT: tl.constexpr,
                    ROUND_BF16: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK_C: tl.constexpr, BLOCK_CF: tl.constexpr, LOG2C: tl.constexpr, MULTI: tl.constexpr):
    """Program ``seq``'s work (the body of :func:`_compressor_step_kernel` and of :func:`_compressor_pair_kernel`):
    one token row; with ``MULTI`` the ``n_tokens`` tokens of sequence ``seq`` (input rows ``n_tokens·seq …``) in
    order, a barrier after each (token ``t`` reads the ring rows earlier tokens wrote, and token ``t+1`` may
    overwrite a row token ``t`` pooled)."""
    slot = tl.load(slot_ptr + seq)
    if MULTI:
        for t in range(n_tokens):
            _compressor_token(seq * n_tokens + t, slot, kv_ptr, sc_ptr, ape_ptr, pos_ptr, kvr_ptr, scr_ptr,
                              cache_ptr, w_ptr, cos_ptr, sin_ptr, R, C, WIDTH, CROWS, ROPE, NOPE, eps, hscale_bits,
                              s_in, s_ring_b, s_ring_r, s_cache_b, s_cache_r, s_cos, OVERLAP, INDEXER, QUANT,
                              ROUND_BF16, BLOCK_W, BLOCK_S, BLOCK_C, BLOCK_CF, LOG2C)
            tl.debug_barrier()
    else:
        _compressor_token(seq, slot, kv_ptr, sc_ptr, ape_ptr, pos_ptr, kvr_ptr, scr_ptr, cache_ptr, w_ptr, cos_ptr,
                          sin_ptr, R, C, WIDTH, CROWS, ROPE, NOPE, eps, hscale_bits, s_in, s_ring_b, s_ring_r,
                          s_cache_b, s_cache_r, s_cos, OVERLAP, INDEXER, QUANT, ROUND_BF16, BLOCK_W, BLOCK_S,
                          BLOCK_C, BLOCK_CF, LOG2C)


@triton.jit
def _compressor_step_kernel(kv_ptr, sc_ptr, ape_ptr, pos_ptr, slot_ptr, kvr_ptr, scr_ptr, cache_ptr, w_ptr,
                            cos_ptr, sin_ptr, R, C, WIDTH, CROWS, ROPE, NOPE, eps, hscale_bits,
                            s_in, s_ring_b, s_ring_r, s_cache_b, s_cache_r, s_cos,
                            OVERLAP: tl.constexpr, INDEXER: tl.constexpr, QUANT: tl.constexpr,
                            ROUND_BF16: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr,
                            BLOCK_C: tl.constexpr, BLOCK_CF: tl.constexpr, LOG2C: tl.constexpr,
                            n_tokens=1, MULTI: tl.constexpr = False, PDL: tl.constexpr = False):
    """One program per token row; with ``MULTI`` one program per sequence: ``n_tokens`` successive one-token steps
    in one launch, one compiled kernel for every token count (:func:`_compressor_seq`)."""
    pdl_prologue(PDL)
    _compressor_seq(tl.program_id(0).to(tl.int64), n_tokens, kv_ptr, sc_ptr, ape_ptr, pos_ptr, slot_ptr, kvr_ptr,
                    scr_ptr, cache_ptr, w_ptr, cos_ptr, sin_ptr, R, C, WIDTH, CROWS, ROPE, NOPE, eps, hscale_bits,
                    s_in, s_ring_b, s_ring_r, s_cache_b, s_cache_r, s_cos, OVERLAP, INDEXER, QUANT, ROUND_BF16,
                    BLOCK_W, BLOCK_S, BLOCK_C, BLOCK_CF, LOG2C, MULTI)


@triton.jit
def _compressor_pair_kernel(
        kv_ptr, sc_ptr, ape_ptr, pos_ptr, slot_ptr, kvr_ptr, scr_ptr, cache_ptr, w_ptr, cos_ptr, sin_ptr, R, C, WIDTH,
        CROWS, ROPE, NOPE, eps, hscale_bits, s_in, s_ring_b, s_ring_r, s_cache_b, s_cache_r, s_cos,
        b_kv_ptr, b_sc_ptr, b_ape_ptr, b_pos_ptr, b_slot_ptr, b_kvr_ptr, b_scr_ptr, b_cache_ptr, b_w_ptr, b_cos_ptr,
        b_sin_ptr, b_R, b_C, b_WIDTH, b_CROWS, b_ROPE, b_NOPE, b_eps, b_hscale_bits, b_s_in, b_s_ring_b, b_s_ring_r,
        b_s_cache_b, b_s_cache_r, b_s_cos,
        OVERLAP: tl.constexpr, INDEXER: tl.constexpr, QUANT: tl.constexpr, ROUND_BF16: tl.constexpr,
        BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_CF: tl.constexpr,
        LOG2C: tl.constexpr,
        B_OVERLAP: tl.constexpr, B_INDEXER: tl.constexpr, B_QUANT: tl.constexpr, B_ROUND_BF16: tl.constexpr,
        B_BLOCK_W: tl.constexpr, B_BLOCK_S: tl.constexpr, B_BLOCK_C: tl.constexpr, B_BLOCK_CF: tl.constexpr,
        B_LOG2C: tl.constexpr,
        n_tokens=1, MULTI: tl.constexpr = False, PDL: tl.constexpr = False):
    """Grid ``(rows, 2)``: programs ``(r, 0)`` are the first compressor's :func:`_compressor_step_kernel`
    programs, ``(r, 1)`` the second's (``b_*``) — two compressors of one layer, different states, one launch."""
    pdl_prologue(PDL)
    seq = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        _compressor_seq(seq, n_tokens, kv_ptr, sc_ptr, ape_ptr, pos_ptr, slot_ptr, kvr_ptr, scr_ptr, cache_ptr,
                        w_ptr, cos_ptr, sin_ptr, R, C, WIDTH, CROWS, ROPE, NOPE, eps, hscale_bits, s_in, s_ring_b,
                        s_ring_r, s_cache_b, s_cache_r, s_cos, OVERLAP, INDEXER, QUANT, ROUND_BF16, BLOCK_W,
                        BLOCK_S, BLOCK_C, BLOCK_CF, LOG2C, MULTI)
    else:
        _compressor_seq(seq, n_tokens, b_kv_ptr, b_sc_ptr, b_ape_ptr, b_pos_ptr, b_slot_ptr, b_kvr_ptr, b_scr_ptr,
                        b_cache_ptr, b_w_ptr, b_cos_ptr, b_sin_ptr, b_R, b_C, b_WIDTH, b_CROWS, b_ROPE, b_NOPE, b_eps,
                        b_hscale_bits, b_s_in, b_s_ring_b, b_s_ring_r, b_s_cache_b, b_s_cache_r, b_s_cos, B_OVERLAP,
                        B_INDEXER, B_QUANT, B_ROUND_BF16, B_BLOCK_W, B_BLOCK_S, B_BLOCK_C, B_BLOCK_CF, B_LOG2C,
                        MULTI)


@dataclass(frozen=True)
class CompressorCall:
    """One compressor's step as :func:`compressor_step` takes it (its arguments, by the same names)."""

    kv: torch.Tensor
    score: torch.Tensor
    ape: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    kv_ring: torch.Tensor
    score_ring: torch.Tensor
    cache: torch.Tensor
    norm_weight: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    ratio: int
    overlap: bool
    eps: float
    indexer: bool
    quantize: bool


@dataclass
class _Launch:
    programs: int
    tokens: int
    multi: bool
    args: tuple
    consts: dict


def _prepare(c: CompressorCall) -> _Launch:
    """Check one compressor's step and lay out its kernel arguments (see :func:`compressor_step`)."""
    kv, score, positions, slots, cache, ratio, overlap = c.kv, c.score, c.positions, c.slots, c.cache, c.ratio, c.overlap
    slots = slots.contiguous()  # read as ptr + row
    tokens, multi = 1, kv.ndim == 3
    if multi:
        tokens = kv.shape[1]
        assert positions.shape == kv.shape[:2] and slots.shape == kv.shape[:1], "positions [b, T], slots [b]"
        kv, score, positions = kv.flatten(0, 1), score.flatten(0, 1), positions.flatten().contiguous()
    b, width = kv.shape
    channels = cache.shape[-1]
    assert width == (2 if overlap else 1) * channels and score.shape == kv.shape and c.ape.shape == (ratio, width)
    assert c.kv_ring.shape[1:] == (2 * ratio, width) and c.kv_ring.stride() == c.score_ring.stride()
    assert c.kv_ring.dtype == c.score_ring.dtype == torch.float32 and kv.dtype == torch.float32
    assert cache.dtype in (torch.bfloat16, torch.float32) and cache.stride(-1) == 1
    if c.indexer:
        assert channels & (channels - 1) == 0 and channels % 32 == 0, "indexer keys: a power-of-two width ≥ 32"
    else:
        assert (channels - 2 * c.cos.shape[-1]) % 64 == 0
    kv, score = kv.contiguous(), score.contiguous()
    block_cf = channels if c.indexer else max(64, triton.next_power_of_2(channels))  # the Hadamard spans all
    block_s = triton.next_power_of_2((2 if overlap else 1) * ratio)
    block_c = max(16, min(block_cf, 4096 // block_s))
    args = (kv, score, c.ape.contiguous(), positions, slots, c.kv_ring, c.score_ring, cache, c.norm_weight, c.cos,
            c.sin, ratio, channels, width, cache.shape[1], 2 * c.cos.shape[-1], channels - 2 * c.cos.shape[-1],
            float(c.eps), f64_bits(channels ** -0.5), kv.stride(0), c.kv_ring.stride(0), c.kv_ring.stride(1),
            cache.stride(0), cache.stride(1), c.cos.stride(0))
    consts = dict(OVERLAP=overlap, INDEXER=c.indexer, QUANT=c.quantize, ROUND_BF16=cache.dtype == torch.bfloat16,
                  BLOCK_W=min(1024, triton.next_power_of_2(width)), BLOCK_S=block_s, BLOCK_C=block_c,
                  BLOCK_CF=block_cf, LOG2C=block_cf.bit_length() - 1)
    return _Launch(b // tokens, tokens, multi, args, consts)


def compressor_step(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
                    slots: torch.Tensor, kv_ring: torch.Tensor, score_ring: torch.Tensor, cache: torch.Tensor,
                    norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ratio: int, overlap: bool,
                    eps: float, indexer: bool, quantize: bool) -> None:
    """One token per row into a compressor: ``kv, score [b, width]`` (fp32 projections, ``ape [ratio, width]``
    not yet added), ``positions, slots [b]``; the rings ``[slots, 2·ratio, width]`` (fp32) and the entry cache
    ``[slots, C, channels]`` are updated in place. ``quantize``: the indexer's FP4 (``indexer``) or the main cache's
    FP8 simulation.

    Several tokens per row: ``kv, score [b, T, width]`` and ``positions [b, T]`` (each row's tokens in order, its
    slot ``slots[i]``) — one program per row runs them in order, exactly ``T`` successive one-token launches (a
    row may repeat a token at the same position: the repeat rewrites what the first wrote)."""
    L = _prepare(CompressorCall(kv, score, ape, positions, slots, kv_ring, score_ring, cache, norm_weight, cos, sin,
                                ratio, overlap, eps, indexer, quantize))
    if L.programs == 0:
        return
    _compressor_step_kernel[(L.programs,)](*L.args, **L.consts, n_tokens=L.tokens, MULTI=L.multi, num_warps=4,
                                           **LAUNCH_EXACT, **pdl_args(kv.device))


def compressor_pair(first: CompressorCall, second: CompressorCall) -> None:
    """:func:`compressor_step` of two compressors of the same rows (a CSA layer's indexer keys and main entries) in
    one launch; the same writes as the two steps one after the other (their states are disjoint)."""
    A, B = _prepare(first), _prepare(second)
    assert (A.programs, A.tokens, A.multi) == (B.programs, B.tokens, B.multi), \
        f"compressor_pair: {A.programs}×{A.tokens} and {B.programs}×{B.tokens} token rows"
    if A.programs == 0:
        return
    _compressor_pair_kernel[(A.programs, 2)](*A.args, *B.args, **A.consts,
                                             **{f"B_{k}": v for k, v in B.consts.items()}, n_tokens=A.tokens,
                                             MULTI=A.multi, num_warps=4, **LAUNCH_EXACT, **pdl_args(first.kv.device))


__all__ = ["compressor_step", "compressor_pair", "CompressorCall"]
