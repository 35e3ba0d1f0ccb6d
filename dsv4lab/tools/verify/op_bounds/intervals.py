"""Intervals of the reference's elementary steps, shared by the op bounds: the FP8/FP4/INT8 block quantizers on
intervals (a value near a rounding boundary may flip), SiLU and the clamped SwiGLU, and the small helpers (fp64 views,
``γₙ`` of element-wise roundings, the error allowed to an fp32 ``exp``)."""
from __future__ import annotations

import math

import torch

from dsv4lab.core import quant
from dsv4lab.tools.verify.bounds import Interval, elementwise_roundoff


F64 = torch.float64
EXACT = "exact"
SILU_ARGMIN = -1.2784645427610738  # silu'(g) = 0: silu is decreasing below, increasing above
SILU_MIN = SILU_ARGMIN / (1 + math.exp(-SILU_ARGMIN))
FP32_MIN_NORMAL = 2.0 ** -126


def as_f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(F64)


def gamma_elementwise(n: int, acc) -> float:
    """``γₙ`` of ``n`` element-wise roundings beside the accumulation ``acc`` (fp32 ones for a named model)."""
    u = elementwise_roundoff(acc)
    return n * u / (1 - n * u)


def exp_error(arg: torch.Tensor, u: float) -> torch.Tensor:
    """Relative error allowed to an fp32 ``exp(arg)``: ``(4 + 2|arg|)·u`` (ex2.approx ≤ 2 ulp, argument scaling)."""
    return (4 + 2 * arg.abs()) * u


def _e4m3_grid(v: torch.Tensor) -> torch.Tensor:
    return v.clamp(-quant.FP8_E4M3_MAX, quant.FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(F64)


def _e2m1_grid(v: torch.Tensor) -> torch.Tensor:
    nan = torch.isnan(v)
    codes = quant.e2m1_encode(v.clamp(-quant.E2M1_MAX, quant.E2M1_MAX).masked_fill(nan, 0.0), check_nan=False)
    return quant.e2m1_decode(codes, F64).masked_fill(nan, float("nan"))


def _pow2_block_qdq_interval(iv: Interval, block: int, qmax: float, amax_floor: float, grid, step: str) -> Interval:
    """A power-of-two block quantizer applied to every value in ``iv``: per block of ``block`` along the last dim
    the scale ``2^ceil(log2(max(amax, floor)/qmax))`` may be any power of two between those of the smallest and
    largest possible amax (computed as the reference does, in fp32: monotone in amax); for each, quantization
    (``grid``: round to the format's nearest value, saturating) is monotone, so the reachable values of an element
    lie between its ends' quantized values over those scales. A partial last block is padded with zeros."""
    k = iv.lo.shape[-1]
    pad = -k % block
    lo, hi = iv.lo, iv.hi
    if pad:
        lo = torch.nn.functional.pad(lo, (0, pad))
        hi = torch.nn.functional.pad(hi, (0, pad))
    lo = lo.reshape(*lo.shape[:-1], -1, block)
    hi = hi.reshape(*hi.shape[:-1], -1, block)
    straddles = (lo <= 0) & (hi >= 0)
    # NaN rows (slots another rank holds) stay NaN below; they must not pick a scale
    mag_lo = torch.where(straddles, torch.zeros_like(lo), torch.minimum(lo.abs(), hi.abs())).nan_to_num(0.0)
    mag_hi = torch.maximum(lo.abs(), hi.abs()).nan_to_num(0.0)
    s_lo = quant.pow2_scale(mag_lo.amax(-1).to(torch.float32).clamp_min(amax_floor), qmax).to(F64)
    s_hi = quant.pow2_scale(mag_hi.amax(-1).to(torch.float32).clamp_min(amax_floor), qmax).to(F64)
    e_lo, e_hi = torch.log2(s_lo).round(), torch.log2(s_hi).round()
    out_lo = torch.full_like(lo, float("inf"))
    out_hi = torch.full_like(hi, float("-inf"))
    if lo.numel():
        for e in range(int(e_lo.min()), int(e_hi.max()) + 1):
            ok = ((e_lo <= e) & (e <= e_hi))[..., None]
            sc = 2.0 ** e
            out_lo = torch.where(ok, torch.minimum(out_lo, grid(lo / sc) * sc), out_lo)
            out_hi = torch.where(ok, torch.maximum(out_hi, grid(hi / sc) * sc), out_hi)
    out_lo = out_lo.flatten(-2)[..., :k]
    out_hi = out_hi.flatten(-2)[..., :k]
    nan = torch.isnan(iv.lo)
    return iv._with(torch.where(nan, iv.lo, out_lo), torch.where(nan, iv.hi, out_hi), step)


def act_qdq_interval(iv: Interval, block: int = quant.ACT_BLOCK) -> Interval:
    """The FP8 activation quantizer (:func:`dsv4lab.core.quant.act_qdq_fp8`: E4M3, amax floored at 1e-4) on every value
    in ``iv`` (see :func:`_pow2_block_qdq_interval`)."""
    return _pow2_block_qdq_interval(iv, block, quant.FP8_E4M3_MAX, 1e-4, _e4m3_grid, "FP8 act quant")


def fp8_qdq_interval(iv: Interval, block: int = 64) -> Interval:
    """The KV FP8 simulation (:func:`dsv4lab.core.quant.fp8_qdq`: E4M3 per ``block``) on every value in ``iv``."""
    return _pow2_block_qdq_interval(iv, block, quant.FP8_E4M3_MAX, 1e-4, _e4m3_grid, f"KV FP8 sim /{block}")


def fp4_qdq_interval(iv: Interval, block: int = quant.FP4_BLOCK) -> Interval:
    """The indexer FP4 simulation (:func:`dsv4lab.core.quant.fp4_qdq`: E2M1 per ``block``, amax floored at
    6·2⁻¹²⁶) on every value in ``iv``."""
    return _pow2_block_qdq_interval(iv, block, quant.E2M1_MAX, quant.E2M1_MAX * 2.0 ** -126, _e2m1_grid,
                                    f"FP4 sim /{block}")


def act_int8_interval(iv: Interval, block: int = quant.FP4_BLOCK) -> Interval:
    """The paper's INT8 activation quantizer (:func:`dsv4lab.core.quant.act_quant_int8`: per ``block``, scale
    ``amax/127`` in fp32, round to nearest) on every value in ``iv``. The scale now varies continuously with amax:
    the integer ``round(v/s)`` is monotone in ``v`` and in ``s``, so its range over the box is spanned by the
    corners, and so is the range of the products ``n·s``."""
    lo = iv.lo.reshape(*iv.lo.shape[:-1], -1, block)
    hi = iv.hi.reshape(*iv.hi.shape[:-1], -1, block)
    straddles = (lo <= 0) & (hi >= 0)
    mag_lo = torch.where(straddles, torch.zeros_like(lo), torch.minimum(lo.abs(), hi.abs())).nan_to_num(0.0)
    mag_hi = torch.maximum(lo.abs(), hi.abs()).nan_to_num(0.0)
    s_lo = quant.div_exact(mag_lo.amax(-1, keepdim=True).to(torch.float32).clamp_min(1e-8), 127.0).to(F64)
    s_hi = quant.div_exact(mag_hi.amax(-1, keepdim=True).to(torch.float32).clamp_min(1e-8), 127.0).to(F64)

    def n(v, sc):
        return torch.round(v.to(torch.float32) / sc.to(torch.float32)).clamp(-127, 127).to(F64)
    n_lo = torch.minimum(n(lo, s_lo), n(lo, s_hi))
    n_hi = torch.maximum(n(hi, s_lo), n(hi, s_hi))
    corners_lo = torch.minimum(n_lo * s_lo, n_lo * s_hi)
    corners_hi = torch.maximum(n_hi * s_lo, n_hi * s_hi)
    return iv._with(corners_lo.flatten(-2), corners_hi.flatten(-2), "INT8 act quant")


def maybe_act_quant(iv: Interval, nm, lin_act_quant: bool = True) -> Interval:
    return act_qdq_interval(iv) if nm.act_quant and lin_act_quant else iv


def silu_interval(g: Interval) -> Interval:
    """``silu`` on an interval (its one minimum at ``SILU_ARGMIN`` handled), exact in float64."""
    def silu(t):
        return t * torch.sigmoid(t)
    a, b = silu(g.lo), silu(g.hi)
    lo = torch.where((g.lo < SILU_ARGMIN) & (g.hi > SILU_ARGMIN), torch.full_like(a, SILU_MIN), torch.minimum(a, b))
    return g._with(lo, torch.maximum(a, b), "silu")


def swiglu_interval(g: Interval, up: Interval, limit: float, u: float) -> Interval:
    """Clamped SwiGLU ``silu(min(g, L)) · clamp(up, ±L)`` evaluated in fp32: ``silu = g/(1+exp(−g))`` has relative
    error ``(4 + 2|g|)·u + 2u`` (exp, the addition, the division), the product one more ``u``."""
    if limit > 0:
        up = up.clamp(-limit, limit)
        g = g.clamp(None, limit)
    h = silu_interval(g).mul(up)
    rel = exp_error(g.mag, u) + 4 * u
    return h.widen(rel * h.mag, "silu·up in fp32")


def point(x: torch.Tensor) -> Interval:
    return Interval.point(as_f64(x))
