"""Row-parallel RMSNorm, RoPE and quantization-simulation kernels of the attention's glue: one launch per fused op,
one program per token row (and head block), so the same kernels serve ``b`` decode rows and thousands of prefill
rows.

========================= ========================================================== ===============================
launcher                  reference (:class:`dsv4lab.core.model.ops.ReferenceOps`)        where
========================= ========================================================== ===============================
:func:`rms_norm`          ``rms_norm``                                               q_norm, final norm, MTP norms
:func:`rope_rows`         ``rope``                                                   the attention output (inverse)
:func:`head_rms_rope`     ``head_rms_rope`` = ``rope(head_rms(q))``                  the query heads
:func:`kv_norm_rope`      ``kv_norm_rope`` = RMSNorm → RoPE → FP8 sim (→ ring)       the window KV row
:func:`indexer_query`     ``indexer_query`` = RoPE → Hadamard → FP4 sim              the indexer's query heads
:func:`attention_norms`   ``attention_norms`` = ``rms_norm`` ∥ ``kv_norm_rope``         q_norm and the window KV row
:func:`query_heads`       ``query_heads`` = ``head_rms_rope`` ∥ ``indexer_query``      the query and indexer heads
========================= ========================================================== ===============================

The last two are launches of two ops that read different tensors of the same rows (the decode step's fused paths
``attention_norms`` and ``query_heads``, ``dsv4lab/engine/kernel_families.py``): one grid whose programs are either
op's programs, each running that op's own body (``_rms_norm_row``, ``_kv_norm_rope_row``, ``_head_rms_rope_block``,
``_indexer_query_block``) — the same arithmetic, so the same bits as the two launches.

**Numerics and bound.** Each kernel evaluates the reference's formula with its rounding points (see
:mod:`.rowops`): the sums of squares of bf16/fp32 values in fp64 (every square exact, the sum exact unless its
terms span more than ~2^20 — never for activations of one row — or, for fp32 activations, within
γ_D(fp64)·Σx² ≈ D·1e-16·Σx²), the mean divided as torch divides, ``rsqrt`` in fp64, the rotation in separately
rounded fp32 products (no FMA contraction), the Hadamard transform as exact fp64 butterflies times the same fp64
constant ``D^-0.5``, the FP8 (E4M3, per 64) and FP4 (E2M1, per 32) round trips with the reference's power-of-two
scales computed from exponent bits. The result equals the reference bit for bit unless an intermediate's exact
value lies within that fp64 error of an fp32 rounding boundary. **Bound** (per element, what the tests check):
``|out − ref| ≤ ulps_out · ulp_act(ref)`` with one ulp of the activation dtype for the norms and the rotation
(one straddled rounding of the last step, the earlier ones propagating by at most a factor ``|w|·r ≤`` the
output's own magnitude), and for the quantization simulations one quantization step of the block
(``scale · 2^-3`` for E4M3, ``scale · 0.5`` for E2M1) where the pre-quantization value straddles a grid midpoint.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .formats import quantize_fp8_block
from .rowops import LAUNCH_EXACT, f64_to_act, fp4_qdq_blocks, fwht_rows, rotate_pair, rsqrt_f32, to_act
from .launch import pdl_args, pdl_prologue


def f64_bits(x: float) -> int:
    """The bits of the fp64 ``x`` as an int64 kernel argument (a float argument would be narrowed to fp32)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _rows(x: torch.Tensor, last: int) -> torch.Tensor:
    """``x`` as ``[rows, ...last dims]`` with a contiguous innermost dim."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, *x.shape[x.ndim - last:])


def _round_bf16(t: torch.Tensor) -> bool:
    if t.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"glue kernels take bf16 or fp32 activations, got {t.dtype}")
    return t.dtype == torch.bfloat16


# ============================================================================================ RMSNorm
@triton.jit
def _rms_norm_row(row, x_ptr, w_ptr, o_ptr, D, eps, sx, so, ROUND_BF16: tl.constexpr, BLOCK_D: tl.constexpr):
    """RMSNorm of row ``row`` (the body of :func:`_rms_norm_kernel` and of the fused attention norms)."""
    sq = tl.zeros((BLOCK_D,), tl.float64)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + row * sx + d, mask=d < D, other=0.0).to(tl.float32).to(tl.float64)
        sq += x * x
    r = rsqrt_f32((tl.sum(sq, axis=0) / D).to(tl.float32), eps)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + row * sx + d, mask=d < D, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        tl.store(o_ptr + row * so + d, to_act(w * (x * r), ROUND_BF16).to(o_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, o_ptr, D, eps, sx, so, ROUND_BF16: tl.constexpr, BLOCK_D: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    _rms_norm_row(tl.program_id(0).to(tl.int64), x_ptr, w_ptr, o_ptr, D, eps, sx, so, ROUND_BF16, BLOCK_D)


@dataclass
class _Launch:
    """A glue kernel's prepared call: its grid's first two dims, positional arguments and constexprs, and the output
    tensor (the same for the kernel alone and inside a fused launch)."""

    rows: int
    blocks: int
    args: tuple
    consts: dict
    out: torch.Tensor


def _rms_norm_launch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> _Launch:
    D = x.shape[-1]
    assert weight.shape == (D,), f"rms_norm: weight {list(weight.shape)} for width {D}"
    xr = _rows(x, 1)
    out = torch.empty(xr.shape, dtype=x.dtype, device=x.device)
    return _Launch(xr.shape[0], 1, (xr, weight.contiguous(), out, D, float(eps), xr.stride(0), out.stride(0)),
                   dict(ROUND_BF16=_round_bf16(x), BLOCK_D=min(4096, triton.next_power_of_2(D))), out)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x [..., D]`` (bf16/fp32) with an fp32 ``weight [D]``; returns ``x.dtype``."""
    L = _rms_norm_launch(x, weight, eps)
    if L.rows:
        _rms_norm_kernel[(L.rows,)](*L.args, **L.consts, num_warps=4, **LAUNCH_EXACT, **pdl_args(x.device))
    return L.out.view(x.shape)


# ============================================================================================ rotation helper
@triton.jit
def _rope_tail(y, cos_ptr, sin_ptr, pos, s_cos, D, R, INVERSE: tl.constexpr, ROUND_BF16: tl.constexpr,
               ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotate the last ``R`` of the ``D`` dims of each row of ``y [ROWS, BLOCK_D]`` (fp32, act-valued) as
    interleaved pairs at position ``pos``; the other dims pass through. Returns act-rounded fp32."""
    y0, y1 = tl.split(tl.reshape(y, (ROWS, BLOCK_D // 2, 2)))
    i = tl.arange(0, BLOCK_D // 2)
    first = (D - R) // 2
    is_rope = (i >= first) & (i < D // 2)
    c = tl.load(cos_ptr + pos * s_cos + (i - first), mask=is_rope, other=1.0)
    s = tl.load(sin_ptr + pos * s_cos + (i - first), mask=is_rope, other=0.0)
    r0, r1 = rotate_pair(y0, y1, c[None, :], s[None, :], INVERSE)
    r0 = tl.where(is_rope[None, :], to_act(r0, ROUND_BF16), y0)
    r1 = tl.where(is_rope[None, :], to_act(r1, ROUND_BF16), y1)
    return tl.reshape(tl.join(r0, r1), (ROWS, BLOCK_D))


# ============================================================================================ RoPE alone
@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, o_ptr, H, D, R, sx_r, sx_h, so_r, so_h, s_cos, INVERSE: tl.constexpr,
                 ROUND_BF16: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    m = (h < H)[:, None] & (d < D)[None, :]
    y = tl.load(x_ptr + row * sx_r + h[:, None] * sx_h + d[None, :], mask=m, other=0.0).to(tl.float32)
    y = _rope_tail(y, cos_ptr, sin_ptr, row, s_cos, D, R, INVERSE, ROUND_BF16, BLOCK_H, BLOCK_D)
    tl.store(o_ptr + row * so_r + h[:, None] * so_h + d[None, :], y.to(o_ptr.dtype.element_ty), mask=m)


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor | None:
    """``ReferenceOps.rope``: the last ``R = 2·cos.shape[-1]`` dims of ``x [..., D]`` rotated (interleaved pairs),
    the others copied, into a new tensor of ``x.dtype``. ``cos, sin`` hold one row of angles per leading index of
    ``x`` up to some dim and broadcast (size 1) over the dims after it (e.g. the attention output ``[b, n, H, d]``
    with ``cos [b, n, 1, R/2]``: every head of a token shares its angles). Returns None for any other broadcast
    pattern (the caller runs the reference)."""
    D, R = x.shape[-1], 2 * cos.shape[-1]
    lead, c_lead = tuple(x.shape[:-1]), tuple(cos.shape[:-1])
    if cos.shape != sin.shape or len(c_lead) != len(lead) or R > D or D % 2:
        return None
    k = len(c_lead)
    while k and c_lead[k - 1] == 1:
        k -= 1
    if c_lead[:k] != lead[:k]:
        return None
    rows = 1
    for n in lead[:k]:
        rows *= n
    xr = x.reshape(rows, -1, D)
    if xr.stride(-1) != 1:
        xr = xr.contiguous()
    c = cos.reshape(rows, R // 2).float().contiguous()
    s = sin.reshape(rows, R // 2).float().contiguous()
    out = torch.empty(xr.shape, dtype=x.dtype, device=x.device)
    H = xr.shape[1]
    block_d = triton.next_power_of_2(D)
    block_h = max(1, min(triton.next_power_of_2(H), 8192 // block_d))
    if rows and H:
        _rope_kernel[(rows, triton.cdiv(H, block_h))](
            xr, c, s, out, H, D, R, xr.stride(0), xr.stride(1), out.stride(0), out.stride(1), c.stride(0),
            INVERSE=inverse, ROUND_BF16=_round_bf16(x), BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
            **LAUNCH_EXACT, **pdl_args(xr.device))
    return out.view(x.shape)


# ============================================================================================ query heads
@triton.jit
def _head_rms_rope_block(row, hb, q_ptr, cos_ptr, sin_ptr, pos_ptr, o_ptr, H, D, R, eps, sq_r, sq_h, so_r, so_h,
                         s_cos, ROUND_BF16: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Heads ``hb·BLOCK_H …`` of row ``row`` (the body of :func:`_head_rms_rope_kernel` and of the fused query
    heads)."""
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    m = (h < H)[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + row * sq_r + h[:, None] * sq_h + d[None, :], mask=m, other=0.0).to(tl.float32)
    # head_rms in act tensors: bf16 squares, their mean (fp64 → fp32 → act), + eps in act, rsqrt → act, product
    sq = to_act(q * q, ROUND_BF16).to(tl.float64)
    ms = f64_to_act(tl.sum(sq, axis=1) / D, ROUND_BF16)
    r = to_act(rsqrt_f32(to_act(ms + eps, ROUND_BF16), 0.0), ROUND_BF16)
    y = to_act(q * r[:, None], ROUND_BF16)
    pos = tl.load(pos_ptr + row)
    y = _rope_tail(y, cos_ptr, sin_ptr, pos, s_cos, D, R, False, ROUND_BF16, BLOCK_H, BLOCK_D)
    tl.store(o_ptr + row * so_r + h[:, None] * so_h + d[None, :], y.to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def _head_rms_rope_kernel(q_ptr, cos_ptr, sin_ptr, pos_ptr, o_ptr, H, D, R, eps, sq_r, sq_h, so_r, so_h, s_cos,
                          ROUND_BF16: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                          PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    _head_rms_rope_block(tl.program_id(0).to(tl.int64), tl.program_id(1), q_ptr, cos_ptr, sin_ptr, pos_ptr, o_ptr,
                         H, D, R, eps, sq_r, sq_h, so_r, so_h, s_cos, ROUND_BF16, BLOCK_H, BLOCK_D)


def _head_rms_rope_launch(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                          eps: float) -> _Launch:
    H, D = q.shape[-2:]
    qr = _rows(q, 2)
    pos = positions.reshape(-1).contiguous()
    assert pos.numel() == qr.shape[0], f"head_rms_rope: {pos.numel()} positions for {qr.shape[0]} rows"
    out = torch.empty(qr.shape, dtype=q.dtype, device=q.device)
    block_h = min(16, triton.next_power_of_2(H))
    return _Launch(qr.shape[0], triton.cdiv(H, block_h),
                   (qr, cos, sin, pos, out, H, D, 2 * cos.shape[-1], float(eps), qr.stride(0), qr.stride(1),
                    out.stride(0), out.stride(1), cos.stride(0)),
                   dict(ROUND_BF16=_round_bf16(q), BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(D)), out)


def head_rms_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """Per-head RMS (no weight) then RoPE of the last ``2·cos.shape[-1]`` dims: ``q [..., H, D]``, ``positions``
    of shape ``q.shape[:-2]`` indexing the fp32 tables ``cos, sin [P, R/2]``."""
    L = _head_rms_rope_launch(q, cos, sin, positions, eps)
    if L.rows:
        _head_rms_rope_kernel[(L.rows, L.blocks)](*L.args, **L.consts, num_warps=4, **LAUNCH_EXACT,
                                                  **pdl_args(q.device))
    return L.out.view(q.shape)


# ============================================================================================ window KV row
@triton.jit
def _kv_norm_rope_row(row, x_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, o_ptr, ring_ptr, slot_ptr, D, R, NOPE, W, eps,
                      sx, so, s_cos, s_ring_b, s_ring_w, FP8: tl.constexpr, WRITE_RING: tl.constexpr,
                      ROUND_BF16: tl.constexpr, BLOCK_D: tl.constexpr):
    """The window KV row ``row`` (the body of :func:`_kv_norm_rope_kernel` and of the fused attention norms)."""
    d = tl.arange(0, BLOCK_D)
    x = tl.load(x_ptr + row * sx + d, mask=d < D, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0)
    xd = x.to(tl.float64)
    r = rsqrt_f32((tl.sum(xd * xd, axis=0) / D).to(tl.float32), eps)
    y = to_act(w * (x * r), ROUND_BF16)
    pos = tl.load(pos_ptr + row)
    y = tl.reshape(_rope_tail(y[None, :], cos_ptr, sin_ptr, pos, s_cos, D, R, False, ROUND_BF16, 1, BLOCK_D),
                   (BLOCK_D,))
    if FP8:  # E4M3 round trip of the non-rope dims, one power-of-two scale per 64
        yb = tl.reshape(y, (BLOCK_D // 64, 64))
        amax = tl.max(tl.abs(yb), axis=1)
        qb = quantize_fp8_block(yb, amax[:, None], True)
        blk = tl.arange(0, BLOCK_D // 64)
        y = tl.reshape(tl.where((blk < NOPE // 64)[:, None], to_act(qb, ROUND_BF16), yb), (BLOCK_D,))
    out = y.to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + row * so + d, out, mask=d < D)
    if WRITE_RING:  # the window ring: token p of a sequence lives in row p mod W of its slot
        slot = tl.load(slot_ptr + row)
        tl.store(ring_ptr + slot * s_ring_b + (pos % W) * s_ring_w + d, y.to(ring_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _kv_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, o_ptr, ring_ptr, slot_ptr, D, R, NOPE, W, eps,
                         sx, so, s_cos, s_ring_b, s_ring_w, FP8: tl.constexpr, WRITE_RING: tl.constexpr,
                         ROUND_BF16: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    _kv_norm_rope_row(tl.program_id(0).to(tl.int64), x_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, o_ptr, ring_ptr,
                      slot_ptr, D, R, NOPE, W, eps, sx, so, s_cos, s_ring_b, s_ring_w, FP8, WRITE_RING, ROUND_BF16,
                      BLOCK_D)


def _kv_norm_rope_launch(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                         positions: torch.Tensor, nope: int, fp8: bool, ring: torch.Tensor | None,
                         slots: torch.Tensor | None) -> _Launch:
    D = kv.shape[-1]
    assert nope % 64 == 0 and 2 * cos.shape[-1] == D - nope, f"kv_norm_rope: nope {nope}, rope {2 * cos.shape[-1]}"
    xr = _rows(kv, 1)
    pos = positions.reshape(-1).contiguous()  # read as ptr + row (a stride-0 view would not be)
    assert pos.numel() == xr.shape[0]
    out = torch.empty(xr.shape, dtype=kv.dtype, device=kv.device)
    write = ring is not None
    if write:
        assert ring.stride(-1) == 1 and ring.shape[-1] == D and slots.numel() == xr.shape[0]
        slots = slots.reshape(-1).contiguous()
    rg = ring if write else out
    return _Launch(xr.shape[0], 1,
                   (xr, weight, cos, sin, pos, out, rg, slots if write else pos, D, D - nope, nope,
                    ring.shape[1] if write else 1, float(eps), xr.stride(0), out.stride(0), cos.stride(0),
                    rg.stride(0), rg.stride(1) if write else 0),
                   dict(FP8=fp8, WRITE_RING=write, ROUND_BF16=_round_bf16(kv), BLOCK_D=max(64, triton.next_power_of_2(D))),
                   out)


def kv_norm_rope(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor, nope: int, fp8: bool, ring: torch.Tensor | None = None,
                 slots: torch.Tensor | None = None) -> torch.Tensor:
    """``kv [..., D]`` → RMSNorm (``weight``) → RoPE of the last ``D − nope`` dims at ``positions`` → (``fp8``) the
    E4M3 round trip of the first ``nope`` dims per 64. With ``ring [slots, W, D]``, row ``i`` (one token per row)
    is also written to ``ring[slots[i], positions[i] mod W]``."""
    L = _kv_norm_rope_launch(kv, weight, eps, cos, sin, positions, nope, fp8, ring, slots)
    if L.rows:
        _kv_norm_rope_kernel[(L.rows,)](*L.args, **L.consts, num_warps=4, **LAUNCH_EXACT, **pdl_args(kv.device))
    return L.out.view(kv.shape)


# ============================================================================================ indexer queries
@triton.jit
def _indexer_query_block(row, hb, q_ptr, cos_ptr, sin_ptr, pos_ptr, o_ptr, H, R, hscale_bits, sq_r, sq_h, so_r,
                         so_h, s_cos, FP4: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK_H: tl.constexpr,
                         D: tl.constexpr, LOG2D: tl.constexpr):
    """Heads ``hb·BLOCK_H …`` of row ``row`` (the body of :func:`_indexer_query_kernel` and of the fused query
    heads)."""
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    m = (h < H)[:, None]
    q = tl.load(q_ptr + row * sq_r + h[:, None] * sq_h + d[None, :], mask=m, other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr + row)
    q = _rope_tail(q, cos_ptr, sin_ptr, pos, s_cos, D, R, False, ROUND_BF16, BLOCK_H, D)
    hscale = hscale_bits.to(tl.float64, bitcast=True)
    y = f64_to_act(fwht_rows(q.to(tl.float64), BLOCK_H, D, LOG2D) * hscale, ROUND_BF16)
    if FP4:
        y = to_act(tl.reshape(fp4_qdq_blocks(tl.reshape(y, (BLOCK_H, D // 32, 32))), (BLOCK_H, D)), ROUND_BF16)
    tl.store(o_ptr + row * so_r + h[:, None] * so_h + d[None, :], y.to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def _indexer_query_kernel(q_ptr, cos_ptr, sin_ptr, pos_ptr, o_ptr, H, R, hscale_bits, sq_r, sq_h, so_r, so_h,
                          s_cos, FP4: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK_H: tl.constexpr,
                          D: tl.constexpr, LOG2D: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    _indexer_query_block(tl.program_id(0).to(tl.int64), tl.program_id(1), q_ptr, cos_ptr, sin_ptr, pos_ptr, o_ptr,
                         H, R, hscale_bits, sq_r, sq_h, so_r, so_h, s_cos, FP4, ROUND_BF16, BLOCK_H, D, LOG2D)


def _indexer_query_launch(qi: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                          fp4: bool) -> _Launch:
    H, D = qi.shape[-2:]
    assert D & (D - 1) == 0 and D % 32 == 0, f"indexer_query: head dim {D} must be a power of two, ≥ 32"
    qr = _rows(qi, 2)
    pos = positions.reshape(-1).contiguous()
    assert pos.numel() == qr.shape[0]
    out = torch.empty(qr.shape, dtype=qi.dtype, device=qi.device)
    block_h = min(16, triton.next_power_of_2(H))
    return _Launch(qr.shape[0], triton.cdiv(H, block_h),
                   (qr, cos, sin, pos, out, H, 2 * cos.shape[-1], f64_bits(D ** -0.5), qr.stride(0), qr.stride(1),
                    out.stride(0), out.stride(1), cos.stride(0)),
                   dict(FP4=fp4, ROUND_BF16=_round_bf16(qi), BLOCK_H=block_h, D=D, LOG2D=D.bit_length() - 1), out)


def indexer_query(qi: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  fp4: bool) -> torch.Tensor:
    """The indexer's query heads ``qi [..., H, D]``: RoPE of the last ``2·cos.shape[-1]`` dims at ``positions``,
    the Hadamard transform ``· D^-0.5``, and (``fp4``) the E2M1 round trip per 32."""
    L = _indexer_query_launch(qi, cos, sin, positions, fp4)
    if L.rows:
        _indexer_query_kernel[(L.rows, L.blocks)](*L.args, **L.consts, num_warps=4, **LAUNCH_EXACT,
                                                  **pdl_args(qi.device))
    return L.out.view(qi.shape)


# ============================================================================================ fused launches
@triton.jit
def _attention_norms_kernel(
        q_ptr, qw_ptr, qo_ptr, DQ, q_eps, sq, sqo,
        kv_ptr, kvw_ptr, cos_ptr, sin_ptr, pos_ptr, kvo_ptr, ring_ptr, slot_ptr, D, R, NOPE, W, eps, sx, so, s_cos,
        s_ring_b, s_ring_w,
        Q_ROUND_BF16: tl.constexpr, Q_BLOCK_D: tl.constexpr, FP8: tl.constexpr, WRITE_RING: tl.constexpr,
        ROUND_BF16: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """Grid ``(rows, 2)``: program ``(r, 0)`` is :func:`_rms_norm_kernel`'s of the query latent's row ``r``,
    program ``(r, 1)`` :func:`_kv_norm_rope_kernel`'s of the window KV row ``r`` — the same bodies."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        _rms_norm_row(row, q_ptr, qw_ptr, qo_ptr, DQ, q_eps, sq, sqo, Q_ROUND_BF16, Q_BLOCK_D)
    else:
        _kv_norm_rope_row(row, kv_ptr, kvw_ptr, cos_ptr, sin_ptr, pos_ptr, kvo_ptr, ring_ptr, slot_ptr, D, R, NOPE,
                          W, eps, sx, so, s_cos, s_ring_b, s_ring_w, FP8, WRITE_RING, ROUND_BF16, BLOCK_D)


def attention_norms(q_a: torch.Tensor, q_weight: torch.Tensor, kv: torch.Tensor, kv_weight: torch.Tensor,
                    eps: float, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, nope: int, fp8: bool,
                    ring: torch.Tensor | None = None,
                    slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rms_norm` of the query latent ``q_a [..., Dq]`` and :func:`kv_norm_rope` of the window KV row
    ``kv [..., D]`` (the same rows) in one launch: ``(q_norm(q_a), kv')``, with the ring write of ``kv_norm_rope``."""
    Lq = _rms_norm_launch(q_a, q_weight, eps)
    Lk = _kv_norm_rope_launch(kv, kv_weight, eps, cos, sin, positions, nope, fp8, ring, slots)
    assert Lq.rows == Lk.rows, f"attention_norms: {Lq.rows} query rows, {Lk.rows} KV rows"
    if Lq.rows:
        _attention_norms_kernel[(Lq.rows, 2)](
            *Lq.args, *Lk.args, Q_ROUND_BF16=Lq.consts["ROUND_BF16"], Q_BLOCK_D=Lq.consts["BLOCK_D"], **Lk.consts,
            num_warps=4, **LAUNCH_EXACT, **pdl_args(kv.device))
    return Lq.out.view(q_a.shape), Lk.out.view(kv.shape)


@triton.jit
def _query_heads_kernel(
        q_ptr, cos_ptr, sin_ptr, pos_ptr, qo_ptr, H, D, R, eps, sq_r, sq_h, so_r, so_h, s_cos,
        i_ptr, icos_ptr, isin_ptr, ipos_ptr, io_ptr, HI, RI, hscale_bits, si_r, si_h, sio_r, sio_h, si_cos,
        Q_BLOCKS, ROUND_BF16: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP4: tl.constexpr,
        I_ROUND_BF16: tl.constexpr, I_BLOCK_H: tl.constexpr, I_D: tl.constexpr, I_LOG2D: tl.constexpr,
        PDL: tl.constexpr = False):
    """Grid ``(rows, Q_BLOCKS + indexer head blocks)``: the first ``Q_BLOCKS`` programs of a row are
    :func:`_head_rms_rope_kernel`'s, the others :func:`_indexer_query_kernel`'s — the same bodies."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    if hb < Q_BLOCKS:
        _head_rms_rope_block(row, hb, q_ptr, cos_ptr, sin_ptr, pos_ptr, qo_ptr, H, D, R, eps, sq_r, sq_h, so_r, so_h,
                             s_cos, ROUND_BF16, BLOCK_H, BLOCK_D)
    else:
        _indexer_query_block(row, hb - Q_BLOCKS, i_ptr, icos_ptr, isin_ptr, ipos_ptr, io_ptr, HI, RI, hscale_bits,
                             si_r, si_h, sio_r, sio_h, si_cos, FP4, I_ROUND_BF16, I_BLOCK_H, I_D, I_LOG2D)


def query_heads(q: torch.Tensor, qi: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                eps: float, fp4: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`head_rms_rope` of the query heads ``q [..., H, D]`` and :func:`indexer_query` of the indexer's
    ``qi [..., HI, DI]`` (the same rows and positions) in one launch: ``(q', qi')``."""
    Lq = _head_rms_rope_launch(q, cos, sin, positions, eps)
    Li = _indexer_query_launch(qi, cos, sin, positions, fp4)
    assert Lq.rows == Li.rows, f"query_heads: {Lq.rows} query rows, {Li.rows} indexer rows"
    if Lq.rows:
        _query_heads_kernel[(Lq.rows, Lq.blocks + Li.blocks)](
            *Lq.args, *Li.args, Lq.blocks, **Lq.consts, FP4=Li.consts["FP4"],
            I_ROUND_BF16=Li.consts["ROUND_BF16"], I_BLOCK_H=Li.consts["BLOCK_H"], I_D=Li.consts["D"],
            I_LOG2D=Li.consts["LOG2D"], num_warps=4, **LAUNCH_EXACT, **pdl_args(q.device))
    return Lq.out.view(q.shape), Li.out.view(qi.shape)


__all__ = ["rms_norm", "rope_rows", "head_rms_rope", "kv_norm_rope", "indexer_query", "attention_norms",
           "query_heads", "f64_bits"]
