"""The error bound of every replaceable op (:class:`dsv4lab.core.model.ops.ReferenceOps`), computed from its inputs.

:data:`OP_BOUNDS` maps an op name to a function ``bound(nm, acc, *args, **kwargs) -> expectation | tuple`` — one
expectation per output of the op (for the ops that write in place, per written tensor: see
:mod:`~dsv4lab.tools.verify.op_outputs`): an :class:`~dsv4lab.tools.verify.bounds.Interval` the output must lie in, ``EXACT``
(integers, pure data movement), a :class:`TopK` / :class:`TopKInterval` (a selection compared as a set) — or one
joint expectation over all outputs (:class:`RouterChoice`: weights that belong to the experts chosen). ``nm`` is the
reference's :class:`~dsv4lab.core.model.numerics.Numerics`, ``acc`` the accumulation model of the evaluated call, as the
backend names it (:data:`~dsv4lab.tools.verify.bounds.UNIT_ROUNDOFF`); element-wise steps are fp32 whatever the
accumulation (:func:`~dsv4lab.tools.verify.bounds.elementwise_roundoff`). Each function follows the reference's rounding
points step by step (the op's docstring in ``model/ops.py``); ``docs/verification.md`` derives each family:

* **dot products** (``linear``, ``linear_f32``, ``grouped_wo_a``, ``moe_stage1``, ``moe_stage2``): exact products,
  ``γ_K(acc)·Σ|terms|`` for the K-term sum, then the reference's roundings (fp32, then bf16);
* **elementwise** (``rms_norm``, ``head_rms``, ``rope``, ``swiglu``, ``moe_activation``, ``router_scores``,
  ``hc_post``): a relative error per evaluation step, with transcendental functions allowed ``(4 + 2|x|)·u``
  (a GPU's ``exp2`` approximation is within 2 ulp; scaling the argument by log₂e adds ``|x|·u``);
* **softmax-weighted sums** (``sparse_attention``, ``compressor_pool``): score errors become relative errors of the
  probabilities, plus one bf16 rounding of each probability on either side (a kernel may round it against a
  running or per-slice maximum), plus the sums;
* **Sinkhorn / mHC** (``hc_pre``, ``hc_head``): first-order propagation of the mixing logits' error and of every
  normalisation step's rounding through the Sinkhorn iterations (adjoints by autograd), doubled for higher orders;
* **quantizer chains** (``routed_experts``, ``expert_mlp``, ``indexer_scores``): intervals through every
  rounding and through the FP8 activation quantizer, so a value near a rounding boundary may flip;
* **selections** (``indexer_topk``): compared as sets; entries that differ must tie with the last one chosen;
  from scores a kernel computes itself (``indexer_select``, ``router_topk``): any set some scores inside the score
  intervals make the top k;
* **fused ops** (``hc_pre_norm``, ``hc_post_pre_norm``, ``head_rms_rope``, ``kv_norm_rope``, ``indexer_query``,
  ``indexer_select_decode``, ``router_topk``, ``compressor_step``, ``attention_from_caches``): the chain of their
  parts' bounds, each part taking the previous part's interval as its input (``*_interval`` helpers: RMSNorm, RoPE,
  the Hadamard transform and the FP8/FP4 block quantizers on intervals).

An op with no entry here has **no bound defined**: the stage oracle reports it as a failure, never as a pass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsv4lab.core import quant
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.tools.verify.bounds import BoundCheck, Interval, check_interval, elementwise_roundoff, gamma, unit_roundoff
from dsv4lab.tools.verify.op_outputs import private_arguments

F64 = torch.float64
EXACT = "exact"
SILU_ARGMIN = -1.2784645427610738  # silu'(g) = 0: silu is decreasing below, increasing above
SILU_MIN = SILU_ARGMIN / (1 + math.exp(-SILU_ARGMIN))
FP32_MIN_NORMAL = 2.0 ** -126


@dataclass
class TopK:
    """A causal top-k selection: ``out`` and ``ref`` must select the same entries, except that entries whose score
    equals the last one chosen (ties) may be exchanged — reported as ties, not mismatches."""

    scores: torch.Tensor  # [b, s, T]
    positions: torch.Tensor  # [b, s]
    ratio: int


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(F64)


def _gamma_elementwise(n: int, acc) -> float:
    """``γₙ`` of ``n`` element-wise roundings beside the accumulation ``acc`` (fp32 ones for a named model)."""
    u = elementwise_roundoff(acc)
    return n * u / (1 - n * u)


def _exp_error(arg: torch.Tensor, u: float) -> torch.Tensor:
    """Relative error allowed to an fp32 ``exp(arg)``: ``(4 + 2|arg|)·u`` (ex2.approx ≤ 2 ulp, argument scaling)."""
    return (4 + 2 * arg.abs()) * u


# ============================================================================================ quantizers
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


def _maybe_act_quant(iv: Interval, nm, lin_act_quant: bool = True) -> Interval:
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
    rel = _exp_error(g.mag, u) + 4 * u
    return h.widen(rel * h.mag, "silu·up in fp32")


# ============================================================================================ dot products
def _point(x: torch.Tensor) -> Interval:
    return Interval.point(_f64(x))


def linear(nm, acc, x, lin, all_reduce=None):
    """Activation quantization (same input, same quantizer: exact), a K-term dot product in ``acc``, rounded to
    fp32 then to ``act``."""
    xq = quant.act_qdq_fp8(x) if nm.act_quant and lin.act_quant else x
    return _point(xq).matmul(lin.dequantized(F64), acc).round(nm.acc).round(nm.act)


def linear_f32(nm, acc, x, lin):
    return _point(x).matmul(lin.dequantized(F64), acc).round(nm.acc)


def linear_group(nm, acc, x, lins):
    """Each projection's :func:`linear` bound (one input, several weights)."""
    return tuple(linear(nm, acc, x, lin) for lin in lins)


def linear_f32_group(nm, acc, x, lins):
    return tuple(linear_f32(nm, acc, x, lin) for lin in lins)


def grouped_wo_a(nm, acc, o, lin, groups):
    w = lin.dequantized(F64).view(groups, -1, o.shape[-1])
    parts = [_point(o[..., g, :]).matmul(w[g], acc) for g in range(groups)]
    iv = Interval(torch.stack([p.lo for p in parts], -2), torch.stack([p.hi for p in parts], -2), parts[0].rule)
    return iv.round(nm.acc).round(nm.act)


def _per_expert(shape, idx, bank, rows_fn):
    """An interval ``[T, k, N]`` filled expert by expert (NaN: slots of experts another rank holds)."""
    lo = torch.full(shape, float("nan"), dtype=F64, device=idx.device)
    hi = lo.clone()
    rule = ""
    for e in torch.unique(idx).tolist():
        if not bank.owns(e):
            continue
        tok, slot = (idx == e).nonzero(as_tuple=True)
        iv = rows_fn(e, tok, slot)
        lo[tok, slot], hi[tok, slot], rule = iv.lo, iv.hi, iv.rule
    return Interval(lo, hi, rule)


def _stage1(nm, acc, x_iv: Interval, idx, bank, quantizer=None, terms=None):
    T, k = idx.shape
    xq = quantizer(x_iv) if quantizer is not None else _maybe_act_quant(x_iv, nm)

    def proj(which):
        def rows(e, tok, slot):
            sub = Interval(xq.lo[tok], xq.hi[tok], xq.rule)
            return sub.matmul(bank.dequantized(which, e, F64), acc, terms=terms).round(nm.acc).round(nm.act)
        return _per_expert((T, k, bank.inter), idx, bank, rows)
    return proj("w1"), proj("w3")


def moe_stage1(nm, acc, x, idx, bank):
    """Per routed slot, the w1 and w3 dot products (K = dim) of the quantized token, each rounded to act."""
    return _stage1(nm, acc, _point(x), idx, bank)


def _stage2(nm, acc, h_iv: Interval, idx, bank, quantizer=None, terms=None):
    """``h`` rounded to act and FP8-quantized (an interval: flips allowed), the w2 dot (K = inter), rounded."""
    T, k, _ = h_iv.lo.shape
    h_act = h_iv.round(nm.act)
    hq = quantizer(h_act) if quantizer is not None else _maybe_act_quant(h_act, nm)

    def rows(e, tok, slot):
        sub = Interval(hq.lo[tok, slot], hq.hi[tok, slot], hq.rule)
        return sub.matmul(bank.dequantized("w2", e, F64), acc, terms=terms).round(nm.acc).round(nm.act)
    return _per_expert((T, k, bank.dim), idx, bank, rows)


def moe_stage2(nm, acc, h, idx, bank):
    return _stage2(nm, acc, _point(h), idx, bank)


def _activation(nm, acc, g: Interval, up: Interval, weights, limit):
    u = elementwise_roundoff(acc)
    h = swiglu_interval(g, up, limit, u).mul(_f64(weights)[..., None])
    return h.widen(u * h.mag, "× routing weight").round(nm.acc)


def moe_activation(nm, acc, g, u, weights, limit):
    return _activation(nm, acc, _point(g), _point(u), weights, limit)


def moe_combine(nm, acc, out, idx, all_reduce=None):
    """Σ over the k slots (NaN slots skipped) in ``acc``."""
    return _point(out).sum(1, acc).round(nm.acc)


def moe_output(nm, acc, routed, shared):
    """The routed sum plus each shared expert's output, one rounding in ``acc`` per addition, then act."""
    y, u = _point(routed), elementwise_roundoff(acc)
    for s in shared:
        y = y.add(_point(s))
        y = y.widen(u * y.mag, "+ shared expert in acc")
    return y.round(nm.act)


def routed_experts(nm, acc, x, idx, weights, bank, limit, trace=None, all_reduce=None):
    """The whole routed MoE as one chain of intervals: stage 1 → activation → act rounding and FP8 quantization
    of ``h`` (where a last-bit difference in ``g`` or ``u`` may flip a bf16 and then an FP8 rounding) → stage 2 →
    the sum over slots."""
    g, up = _stage1(nm, acc, _point(x), idx, bank)
    h = _activation(nm, acc, g, up, weights, limit)
    out = _stage2(nm, acc, h, idx, bank)
    return out.sum(1, acc, "Σ slots").round(nm.acc)


def moe_stage1_int8(nm, acc, x, idx, bank):
    """Stage 1 along the paper's INT8 route (see :func:`routed_experts_int8`)."""
    return _stage1(nm, acc, _point(x), idx, bank, act_int8_interval, terms=bank.dim // 32 + 3)


def routed_experts_int8(nm, acc, x, idx, weights, bank, limit):
    """The routed MoE along the paper's INT8 route (its own quantization: per-32 INT8 activations with scale
    amax/127), with the reference's rounding points — the bound of ``fp4_moe_decode.reference_int8_moe``. Each
    projection sums K/32 exact integer group dots, each scaled by three fp32 factors: ``K/32 + 3`` roundings."""
    q = act_int8_interval
    g, up = _stage1(nm, acc, _point(x), idx, bank, q, terms=bank.dim // 32 + 3)
    h = _activation(nm, acc, g, up, weights, limit)
    out = _stage2(nm, acc, h, idx, bank, q, terms=bank.inter // 32 + 3)
    return out.sum(1, acc, "Σ slots").round(nm.acc)


def expert_mlp(nm, acc, x, w1, w2, w3, limit, weight=None, shared=False):
    """The shared expert as a chain: two projections rounded to act, SwiGLU in fp32, act rounding and FP8
    quantization of its output (flips allowed), the w2 projection."""
    u = elementwise_roundoff(acc)
    xq = _maybe_act_quant(_point(x), nm, w1.act_quant)
    g = xq.matmul(w1.dequantized(F64), acc).round(nm.acc).round(nm.act)
    up = xq.matmul(w3.dequantized(F64), acc).round(nm.acc).round(nm.act)
    h = swiglu_interval(g, up, limit, u)
    if weight is not None:
        h = h.mul(_f64(weight))
        h = h.widen(u * h.mag, "× weight")
    h = _maybe_act_quant(h.round(nm.acc).round(nm.act), nm, w2.act_quant)
    return h.matmul(w2.dequantized(F64), acc).round(nm.acc).round(nm.act)


# ============================================================================================ elementwise
def swiglu(nm, acc, gate, up, limit, shared=False):
    return swiglu_interval(_point(gate), _point(up), limit, elementwise_roundoff(acc)).round(gate.dtype)


def rms_norm_interval(nm, acc, x: Interval, weight, eps: float, out_dtype) -> Interval:
    """``w·x/√(mean(x²)+eps)`` for every ``x`` in the interval, evaluated as the reference does (in ``nm.acc``,
    rounded to ``out_dtype``). The exact value's range: ``mean(x²)`` lies between the means of the smallest and the
    largest squares the interval allows, so the reciprocal root lies in an interval, and each output is the product
    of three intervals (a safe enclosure: the dependence of the root on ``x_i`` is ignored). The evaluation error:
    the mean of D positive terms has relative error γ_D, the reciprocal square root halves it and adds its own
    2 ulp; eps, the two products and the reference's own roundings add a few ``u``: ``γ(D/2+16)·|y|``."""
    d = x.lo.shape[-1]
    sq_hi = torch.maximum(x.lo * x.lo, x.hi * x.hi)
    sq_lo = torch.where((x.lo <= 0) & (x.hi >= 0), torch.zeros_like(sq_hi), torch.minimum(x.lo * x.lo, x.hi * x.hi))
    r = Interval(torch.rsqrt(sq_hi.mean(-1, keepdim=True) + eps), torch.rsqrt(sq_lo.mean(-1, keepdim=True) + eps))
    y = x.mul(r).mul(_f64(weight.to(nm.acc)))
    y = Interval(y.lo, y.hi, x.rule)  # the two products are one step of the account below
    rel = gamma(d / 2 + 16, acc)
    return y.widen(rel * y.mag, f"RMSNorm D={d}: γ(D/2+16, {acc})·|y|").round(nm.acc).round(out_dtype)


def rms_norm(nm, acc, x, weight, eps):
    return rms_norm_interval(nm, acc, _point(x.to(nm.acc)), weight, eps, x.dtype)


def _round_or_not(iv: Interval, dtype) -> Interval:
    """Either rounded to ``dtype`` or kept wider (a fused kernel may skip an intermediate rounding)."""
    r = iv.round(dtype)
    return iv._with(torch.minimum(iv.lo, r.lo), torch.maximum(iv.hi, r.hi), f"round {dtype} or not")


def head_rms(nm, acc, q, eps):
    """Per-head RMS in act steps, as the reference: bf16 squares, their mean (γ_d), rounded to act, plus eps in
    act, reciprocal square root rounded to act, the product rounded to act. Intermediate roundings may be skipped
    by a fused kernel (both allowed); the last is not."""
    u = elementwise_roundoff(acc)
    act = q.dtype
    q64 = _f64(q)
    sq = _round_or_not(Interval.point(q64 * q64), act)
    ms = sq.sum(-1, acc)
    d = q.shape[-1]
    ms = Interval(ms.lo[..., None] / d, ms.hi[..., None] / d, ms.rule)
    ms = ms.widen(u * ms.mag, "/d")
    ms = _round_or_not(ms.round(nm.acc), act).add(eps)
    ms = _round_or_not(ms.widen(u * ms.mag, "+eps"), act)
    r = ms.monotone(lambda t: torch.rsqrt(t.clamp_min(0)), increasing=False, step="rsqrt")
    r = _round_or_not(r.widen(4 * u * r.mag, "rsqrt 2 ulp"), act)
    return r.mul(q64).round(act)


def rope_interval(acc, x: Interval, cos, sin, inverse: bool = False, out_dtype=None) -> Interval:
    """Interleaved rotation of the last ``2·cos.shape[-1]`` dims of every ``x`` in the interval, in ``cos.dtype``
    then rounded to ``out_dtype``: each rotated output is two products and one sum of the table values, so the
    interval's centre rotates, its radius spreads by ``rad₀|c| + rad₁|s|``, and either side's evaluation adds
    ``γ₃·(|x₀c| + |x₁s|)`` at the interval's largest magnitudes; the other dims are copied exactly."""
    r = 2 * cos.shape[-1]
    c, s = _f64(cos), _f64(sin)
    if inverse:
        s = -s
    tail = Interval(x.lo[..., -r:], x.hi[..., -r:])
    mid, rad, mag = tail.mid, tail.rad, tail.mag
    m0, m1, r0, r1, a0, a1 = mid[..., 0::2], mid[..., 1::2], rad[..., 0::2], rad[..., 1::2], mag[..., 0::2], \
        mag[..., 1::2]
    g = _gamma_elementwise(3, acc)
    c_abs, s_abs = c.abs(), s.abs()
    rot = torch.stack((m0 * c - m1 * s, m0 * s + m1 * c), -1).flatten(-2)
    spread = torch.stack((r0 * c_abs + r1 * s_abs + g * (a0 * c_abs + a1 * s_abs),
                          r0 * s_abs + r1 * c_abs + g * (a0 * s_abs + a1 * c_abs)), -1).flatten(-2)
    rot, spread = torch.broadcast_tensors(rot, spread)
    lead = rot.shape[:-1]
    head_lo, head_hi = x.lo[..., :-r].expand(*lead, -1), x.hi[..., :-r].expand(*lead, -1)
    out = Interval(torch.cat((head_lo, rot - spread), -1), torch.cat((head_hi, rot + spread), -1), x.rule)
    out = out._with(out.lo, out.hi, f"RoPE{' (inverse)' if inverse else ''}: γ₃·(|x₀c|+|x₁s|), other dims exact")
    out = out.round(cos.dtype)
    return out.round(out_dtype) if out_dtype is not None else out


def rope(nm, acc, x, cos, sin, inverse=False):
    return rope_interval(acc, _point(x), cos, sin, inverse, x.dtype)


def router_scores(nm, acc, logits, score_func):
    u = elementwise_roundoff(acc)
    x = _f64(logits)
    if score_func == "sqrtsoftplus":
        sp = torch.logaddexp(x, torch.zeros_like(x))  # softplus without cancellation
        d = _exp_error(x, u) * sp + 4 * u  # log(1 + e^x): exp, the addition (absolute in the log), the log
        lo = torch.sqrt((sp - d).clamp_min(0))
        hi = torch.sqrt(sp + d)
        iv = Interval(lo, hi, f"√softplus: ((4+2|x|)·u·sp + 4u) through √").widen(2 * u * hi, "√ rounding")
    elif score_func == "sigmoid":
        v = torch.sigmoid(x)
        iv = Interval.around(v, (_exp_error(x, u) + 3 * u) * v, "sigmoid")
    else:
        m = x.amax(-1, keepdim=True)
        v = torch.softmax(x, -1)
        rel = _exp_error(x - m, u) + (x - m).abs() * u + gamma(x.shape[-1] + 2, acc)
        iv = Interval.around(v, rel * v, "softmax")
    return iv.round(nm.acc)


def hc_post(nm, acc, out, X, post, comb):
    """``post[k]·out + Σ_j comb[j,k]·X[j]``: n+1 products and sums, γ_{n+2}·Σ|terms|."""
    Xf, pf, cf, of = _f64(X), _f64(post), _f64(comb), _f64(out)
    mixed = torch.einsum("bsjk,bsjd->bskd", cf, Xf)
    mixed_mag = torch.einsum("bsjk,bsjd->bskd", cf.abs(), Xf.abs())
    po = pf[..., None] * of[..., None, :]
    n = X.shape[-2]
    return Interval.around(po + mixed, gamma(n + 2, acc) * (po.abs() + mixed_mag),
                           f"mHC post: γ(n+2={n + 2}, {acc})·Σ|terms|").round(nm.acc).round(X.dtype)


# ============================================================================================ mHC pre / head
def _mix_logits(nm, acc, X: Interval, fn, eps):
    """Mixing logits ``m = (x·fnᵀ)·rsqrt(mean(x²)+eps)`` for every ``x`` in the interval of the ``n`` streams, as a
    centre and a radius: the nD-term dot (an interval, with γ of its evaluation), the reciprocal root of the mean
    square (an interval, as in :func:`rms_norm_interval`), their product; the evaluation of the mean (γ, halved by
    the rsqrt), the rsqrt's 2 ulp and the product add ``γ(nD/2+6)·|m|``."""
    x = Interval(X.lo.flatten(-2), X.hi.flatten(-2))
    n_d = x.lo.shape[-1]
    proj = x.matmul(_f64(fn), acc)
    sq_hi = torch.maximum(x.lo * x.lo, x.hi * x.hi)
    sq_lo = torch.where((x.lo <= 0) & (x.hi >= 0), torch.zeros_like(sq_hi), torch.minimum(x.lo * x.lo, x.hi * x.hi))
    r = Interval(torch.rsqrt(sq_hi.mean(-1, keepdim=True) + eps), torch.rsqrt(sq_lo.mean(-1, keepdim=True) + eps))
    m = proj.mul(r)
    return m.mid, m.rad + gamma(n_d / 2 + 6, acc) * m.mag


def _sigmoid_gate(m, dm, scale, base, u):
    """``σ(m·scale + base)`` on ``m ± dm``: σ is increasing, its fp32 evaluation adds (4+2|a|)·u + 2u."""
    a = m * scale + base
    da = dm * abs(scale) + 2 * u * (m * scale).abs() + 2 * u * a.abs()
    lo, hi = torch.sigmoid(a - da), torch.sigmoid(a + da)
    rel = _exp_error(a.abs() + da, u) + 3 * u
    return Interval(lo * (1 - rel), hi * (1 + rel), "σ(m·scale+base)")


def _sinkhorn_first_order(c0: torch.Tensor, dc0: torch.Tensor, iters: int, eps: float, u: float):
    """Sinkhorn of ``c0 [R, n, n]`` (the reference's :func:`dsv4lab.core.model.mhc.sinkhorn`) and a first-order bound
    on the error of any evaluation in ``u``: the input's ``dc0`` and every step's relative rounding (softmax:
    exp error + the sum; each normalisation: the n-term sum, +eps, the division) propagated to the output through
    the exact adjoints of the remaining steps (Sinkhorn contracts errors, so the adjoints stay small). Doubled to
    cover second-order terms, which are ~(n·u·‖adjoint‖)² smaller."""
    n = c0.shape[-1]
    probes, rel = [], []

    def probe(v, r):
        z = torch.zeros_like(v, requires_grad=True)
        probes.append(z)
        rel.append(r)
        return v * (1 + z)

    with torch.inference_mode(False), torch.enable_grad():  # callers may run under inference mode
        leaf = c0.detach().clone().requires_grad_(True)
        dc0 = dc0.detach().clone()
        dev = leaf - leaf.amax(-1, keepdim=True)
        c = probe(leaf.softmax(-1), (_exp_error(dev.detach(), u) + dev.detach().abs() * u + (n + 2) * u))
        c = probe(c + eps, torch.full_like(c0, u))
        c = probe(c / (c.sum(-2, keepdim=True) + eps), torch.full_like(c0, (n + 3) * u))
        for _ in range(iters - 1):
            c = probe(c / (c.sum(-1, keepdim=True) + eps), torch.full_like(c0, (n + 3) * u))
            c = probe(c / (c.sum(-2, keepdim=True) + eps), torch.full_like(c0, (n + 3) * u))
        bound = torch.zeros(c0.shape, dtype=c0.dtype, device=c0.device)
        for i in range(n):
            for j in range(n):
                grads = torch.autograd.grad(c[:, i, j].sum(), [leaf] + probes, retain_graph=True)
                total = grads[0].abs().mul(dc0).sum((-2, -1))
                for gz, r in zip(grads[1:], rel):
                    total = total + gz.abs().mul(r).sum((-2, -1))
                bound[:, i, j] = total
        return c.detach().clone(), 2 * bound.detach().clone()


def _hc_weighted_streams(nm, acc, X: Interval, pre: Interval, out_dtype) -> Interval:
    """``Σ_j pre_j·X_j`` over the n streams (fp32 products, an n-term sum), rounded to fp32 then ``out_dtype``."""
    u = elementwise_roundoff(acc)
    terms = Interval(pre.lo[..., None], pre.hi[..., None], pre.rule).mul(X)
    terms = terms.widen(u * terms.mag, "products")
    return terms.sum(-2, acc).round(nm.acc).round(out_dtype)


def _hc_pre(nm, acc, X: Interval, fn, base, scale, args, out_dtype):
    """mHC pre of every ``X`` in the interval: ``(u, post, comb)`` intervals (see :func:`hc_pre`)."""
    u = elementwise_roundoff(acc)
    n = args.hc_mult
    m, dm = _mix_logits(nm, acc, X, fn, args.norm_eps)
    sc, bs = _f64(scale), _f64(base)
    pre = _sigmoid_gate(m[..., :n], dm[..., :n], float(sc[0]), bs[:n], u).add(args.hc_eps)
    pre = pre.widen(u * pre.mag, "+hc_eps")
    post = _sigmoid_gate(m[..., n:2 * n], dm[..., n:2 * n], float(sc[1]), bs[n:2 * n], u).mul(2.0).round(nm.acc)
    a = m[..., 2 * n:] * sc[2] + bs[2 * n:]
    da = dm[..., 2 * n:] * sc[2].abs() + 2 * u * (m[..., 2 * n:] * sc[2]).abs() + 2 * u * a.abs()
    lead = a.shape[:-1]
    comb, dcomb = _sinkhorn_first_order(a.reshape(-1, n, n), da.reshape(-1, n, n), args.hc_sinkhorn_iters,
                                        args.hc_eps, unit_roundoff(acc))
    comb_iv = Interval.around(comb.reshape(*lead, n, n), dcomb.reshape(*lead, n, n),
                              "Sinkhorn, first order ×2").round(nm.acc)
    return _hc_weighted_streams(nm, acc, X, pre, out_dtype), post, comb_iv


def hc_pre(nm, acc, X, fn, base, scale, args):
    """mHC pre: mixing logits → pre/post gates (sigmoids) and the Sinkhorn-normalised ``comb``; the sub-layer
    input ``Σ_j pre_j·X_j``. Returns ``(u, post, comb)``."""
    return _hc_pre(nm, acc, _point(X.to(nm.acc)), fn, base, scale, args, X.dtype)


def hc_head(nm, acc, X, fn, base, scale, args):
    u = elementwise_roundoff(acc)
    Xi = _point(X.to(nm.acc))
    m, dm = _mix_logits(nm, acc, Xi, fn, args.norm_eps)
    pre = _sigmoid_gate(m, dm, float(_f64(scale)[0]), _f64(base), u).add(args.hc_eps)
    return _hc_weighted_streams(nm, acc, Xi, pre.widen(u * pre.mag, "+hc_eps"), X.dtype)


def hc_pre_norm(nm, acc, X, fn, base, scale, norm_weight, args):
    """:func:`hc_pre`, then the sub-layer's RMSNorm of ``u``'s interval (:func:`rms_norm_interval`)."""
    u, post, comb = _hc_pre(nm, acc, _point(X.to(nm.acc)), fn, base, scale, args, X.dtype)
    return rms_norm_interval(nm, acc, u, norm_weight, args.norm_eps, X.dtype), post, comb


def hc_post_pre_norm(nm, acc, out, X, post, comb, fn, base, scale, norm_weight, args):
    """:func:`hc_post` (its interval ``X'``), then :func:`hc_pre` and the RMSNorm of every ``X'`` in that interval:
    ``(X', x, post', comb')``."""
    Xn = hc_post(nm, acc, out, X, post, comb)
    u, post2, comb2 = _hc_pre(nm, acc, Xn, fn, base, scale, args, X.dtype)
    return Xn, rms_norm_interval(nm, acc, u, norm_weight, args.norm_eps, X.dtype), post2, comb2


# ============================================================================================ softmax-weighted
def compressor_pool(nm, acc, kv_slots, sc_slots):
    """Per channel, softmax over the slots then ``Σ w·kv``: each weight's relative error is its exp's
    ``(4+2|s−max|)·u`` plus the n-term sum (in ``acc``), the division and the reference's own rounding of w
    (5u); then γ_n."""
    u = elementwise_roundoff(acc)
    sc, kv = _f64(sc_slots), _f64(kv_slots)
    n = sc.shape[1]
    w = torch.softmax(sc, 1)
    dev = (sc - sc.amax(1, keepdim=True)).abs()
    rel = torch.where(w > 0, _exp_error(dev, u) + dev * u + n * unit_roundoff(acc) + 5 * u, torch.zeros_like(w))
    wkv = (w * kv.abs()).nan_to_num(0.0)
    radius = (rel * wkv).sum(1) + gamma(n, acc) * wkv.sum(1)
    return Interval.around((w * kv).nan_to_num(0.0).sum(1), radius, f"softmax pool of {n} slots").round(nm.acc)


def sparse_attention(nm, acc, q, kv, idx, sink, scale):
    """Attention with a sink over gathered rows. Derivation (docs/verification.md): score errors
    ``Δz = γ_d·scale·Σ|q||kv| + 2u|z|`` and the max's ``Δm`` make each probability's relative error
    ``ρ = e^{Δz+Δm} − 1 + (6 + 3|z−m|)·u`` plus the online rescaling's ``(5K + 2·(z_max−z_min))·u``; the numerator
    adds one bf16 rounding of each probability (either side may round against another maximum) and γ_K; the
    denominator γ_{K+1}; the quotient ``(δN + |o|·δD)/(D − δD)``."""
    u = elementwise_roundoff(acc)
    u_act = unit_roundoff(nm.act) if nm.act in (torch.bfloat16, torch.float16) else 0.0
    b, s, h, d = q.shape
    K = idx.shape[-1]
    valid = idx >= 0
    g = torch.gather(kv, 1, idx.clamp_min(0).reshape(b, -1, 1).expand(-1, -1, d)).reshape(b, s, K, d)
    g = torch.where(valid[..., None], _f64(g), torch.zeros((), dtype=F64, device=q.device))
    qf = _f64(q)
    z = torch.einsum("bshd,bskd->bshk", qf, g) * scale
    zabs = torch.einsum("bshd,bskd->bshk", qf.abs(), g.abs()) * abs(scale)
    vmask = valid[:, :, None, :]
    dz = torch.where(vmask, gamma(d, acc) * zabs + 2 * u * z.abs(), torch.zeros_like(z))
    z = z.masked_fill(~vmask, float("-inf"))
    m = z.amax(-1, keepdim=True)
    dm = dz.amax(-1, keepdim=True)
    zmin = torch.where(vmask, z, torch.full_like(z, float("inf"))).amin(-1, keepdim=True)
    chain = (5 * K + 2 * (m - zmin).clamp_min(0)) * u
    p = torch.exp(z - m)
    dev = torch.where(vmask, (z - m).abs(), torch.zeros_like(z))
    rho = torch.where(vmask, torch.expm1(dz + dm) + (6 + 3 * dev) * u + chain, torch.zeros_like(z))
    sk = _f64(sink)[None, None, :, None]
    ps = torch.exp(sk - m)
    rho_s = torch.expm1(dm) + (6 + 3 * (sk - m).abs()) * u + chain
    num = torch.einsum("bshk,bskd->bshd", p, g)
    mag = torch.einsum("bshk,bskd->bshd", p, g.abs())
    mag_rho = torch.einsum("bshk,bskd->bshd", p * rho, g.abs())
    gmax = g.abs().amax((-2, -1))[:, :, None, None]
    den = p.sum(-1, keepdim=True) + ps
    d_num = mag_rho + (u_act + gamma(K, acc)) * (mag + mag_rho) * (1 + u_act) + K * FP32_MIN_NORMAL * gmax
    d_den = (p * rho).sum(-1, keepdim=True) + rho_s * ps + gamma(K + 1, acc) * den * (1 + rho.amax(-1, keepdim=True)) \
        + K * FP32_MIN_NORMAL
    o = num / den
    err = (d_num + o.abs() * d_den) / (den - d_den).clamp_min(den * 0.5)
    err = err + 2 * u * (o.abs() + err)
    return Interval.around(o, err, f"attention over K={K} rows, d={d} (bf16 probabilities either side)").round(nm.act)


def attention_from_caches(nm, acc, q, win_kv, win_rows, cmp_kv, cmp_rows, slots, sink, scale, cos=None, sin=None,
                          positions=None, cmp_ratio=0):
    """:func:`sparse_attention` over the selected rows of both caches, then (given the tables) the inverse RoPE of
    its interval (:func:`rope_interval`). ``cmp_ratio`` only tells a kernel which rows may be skipped."""
    kv, rows = win_kv[slots], win_rows
    if cmp_kv is not None:
        kv = torch.cat((kv, cmp_kv[slots].to(kv.dtype)), 1)
        rows = torch.cat((win_rows, torch.where(cmp_rows >= 0, cmp_rows + win_kv.shape[1], -1)), 1)
    iv = sparse_attention(nm, acc, q[:, None], kv, rows[:, None], sink, scale)
    iv = Interval(iv.lo[:, 0], iv.hi[:, 0], iv.rule)
    if cos is None:
        return iv
    return rope_interval(acc, iv, cos[positions][:, None], sin[positions][:, None], inverse=True, out_dtype=q.dtype)


def indexer_scores(nm, acc, qi, w, keys, all_reduce=None):
    """``Σ_h act(relu(act(qi_h·K_t))·w_h)`` as a chain: each head's d-term dot (γ_d) rounded to fp32 then act (a
    flip allowed where the interval straddles), relu, the product with the head weight rounded to act, the sum over
    heads in ``acc`` (γ_H), rounded to fp32 then act."""
    qf, kf = _f64(qi), _f64(keys)
    d = qi.shape[-1]
    dots = torch.einsum("bshd,btd->bsht", qf, kf)
    mag = torch.einsum("bshd,btd->bsht", qf.abs(), kf.abs())
    iv = Interval.around(dots, (gamma(d, acc) + gamma(d, F64)) * mag, f"head dots d={d}")
    iv = iv.round(nm.acc).round(nm.act).relu().mul(_f64(w)[..., None]).round(nm.act)
    return iv.sum(2, acc, f"Σ over {qi.shape[2]} heads").round(nm.acc).round(nm.act)


# ============================================================================================ glue chains
def hadamard_interval(acc, x: Interval, out_dtype) -> Interval:
    """``x @ H · n^-0.5`` (:func:`dsv4lab.core.quant.hadamard_transform`) for every ``x`` in the interval: the ±1 matrix
    maps the centre and spreads the radius by ``Σ rad``; an evaluation in ``acc`` errs by ``γ_{n+2}·n^-0.5·Σ|x|``
    whatever its order (n terms, butterflies or a matmul; the scaling and its rounded constant are the +2); rounded
    to fp32, then ``out_dtype``."""
    n = x.lo.shape[-1]
    h = quant.hadamard_matrix(n, F64, str(x.lo.device)) * n ** -0.5
    return x.matmul(h, acc, f"Hadamard n={n} ({n + 2} roundings) in {acc}", terms=n + 2).round(torch.float32) \
        .round(out_dtype)


def head_rms_rope(nm, acc, q, cos, sin, positions, eps):
    """:func:`head_rms` (rounded to act, as the reference), then RoPE of its interval at ``positions``."""
    return rope_interval(acc, head_rms(nm, acc, q, eps), cos[positions][..., None, :], sin[positions][..., None, :],
                         out_dtype=q.dtype)


def kv_norm_rope(nm, acc, kv, weight, eps, cos, sin, positions, ring=None, slots=None):
    """RMSNorm (rounded to act) → RoPE of its interval → the KV FP8 simulation of the non-rope dims (flips allowed
    where the interval straddles a grid midpoint). With ``ring``: the ring after the write — the written rows that
    interval rounded to the ring's dtype, every other row unchanged (exact)."""
    iv = rms_norm_interval(nm, acc, _point(kv.to(nm.acc)), weight, eps, kv.dtype)
    iv = rope_interval(acc, iv, cos[positions], sin[positions], out_dtype=kv.dtype)
    if nm.kv_fp8_sim:
        nope = kv.shape[-1] - 2 * cos.shape[-1]
        q = fp8_qdq_interval(Interval(iv.lo[..., :nope], iv.hi[..., :nope], iv.rule)).round(kv.dtype)
        iv = iv._with(torch.cat((q.lo, iv.lo[..., nope:]), -1), torch.cat((q.hi, iv.hi[..., nope:]), -1), q.rule)
    if ring is None:
        return iv
    rows = (slots, positions.reshape(-1) % ring.shape[1])
    w = iv.round(ring.dtype)
    lo, hi = _f64(ring).clone(), _f64(ring).clone()
    lo[rows], hi[rows] = w.lo.reshape(slots.shape[0], -1), w.hi.reshape(slots.shape[0], -1)
    return iv, Interval(lo, hi, f"ring: written rows {w.rule}, others unchanged")


def indexer_query(nm, acc, qi, cos, sin, positions):
    """RoPE at ``positions`` (rounded to act) → the Hadamard transform of its interval → the FP4 simulation."""
    iv = rope_interval(acc, _point(qi), cos[positions][..., None, :], sin[positions][..., None, :], out_dtype=qi.dtype)
    iv = hadamard_interval(acc, iv, qi.dtype)
    return fp4_qdq_interval(iv, 32).round(qi.dtype) if nm.indexer_fp4_sim else iv


class _Capture(ReferenceOps):
    """The reference, recording the arguments of the calls of one op it makes (the inner parts of a composite)."""

    def __init__(self, numerics, op: str):
        super().__init__(numerics)
        self.captured: list[tuple] = []
        inner = getattr(self, op)

        def record(*args):
            self.captured.append(args)
            return inner(*args)
        setattr(self, op, record)


def finish_interval(nm, acc, comp, pooled: Interval, blocks, cos, sin) -> Interval:
    """The compressor's entry finish (:meth:`dsv4lab.core.model.compressor.Compressor.finish`) on an interval of pooled
    values: rounded to act, RMSNorm, RoPE at the block's first position ``j·r``, then the indexer's Hadamard and
    FP4 simulation or the main cache's FP8 simulation of the non-rope dims."""
    act = nm.act
    iv = rms_norm_interval(nm, acc, pooled.round(act), comp.norm.weight, comp.args.norm_eps, act)
    rpos = blocks * comp.ratio
    iv = rope_interval(acc, iv, cos[rpos], sin[rpos], out_dtype=act)
    if comp.is_indexer:
        iv = hadamard_interval(acc, iv, act)
        return fp4_qdq_interval(iv, 32).round(act) if nm.indexer_fp4_sim else iv
    if nm.kv_fp8_sim:
        nope = comp.channels - comp.args.rope_head_dim
        q = fp8_qdq_interval(Interval(iv.lo[..., :nope], iv.hi[..., :nope], iv.rule)).round(act)
        iv = iv._with(torch.cat((q.lo, iv.lo[..., nope:]), -1), torch.cat((q.hi, iv.hi[..., nope:]), -1), q.rule)
    return iv


def compressor_step(nm, acc, comp, kv, score, positions, slots, cache, cos, sin):
    """The state after one decode step of a compressor, as :data:`~dsv4lab.tools.verify.op_outputs.IN_PLACE` lists it:
    ``(cache, kv_ring, score_ring)``. The rings are exact (a copy, and ``score + ape`` — one fp32 addition, the same
    rounding everywhere). The cache rows of the blocks this step completes hold the finished entry of the pooled
    block (:func:`compressor_pool` on the slots the reference pools — the rings after the write, exact values —
    then :func:`finish_interval`, rounded to the cache's dtype); every other row is unchanged (exact)."""
    ref = _Capture(nm, "compressor_pool")
    args, _ = private_arguments("compressor_step", (comp, kv, score, positions, slots, cache, cos, sin), {})
    ref.compressor_step(*args)
    kv_slots, sc_slots = ref.captured[0]
    block = positions // comp.ratio
    entry = finish_interval(nm, acc, comp, compressor_pool(nm, acc, kv_slots, sc_slots), block, cos, sin) \
        .round(cache.dtype)
    done = ((positions + 1) % comp.ratio == 0).nonzero(as_tuple=True)[0]
    lo, hi = _f64(cache).clone(), _f64(cache).clone()
    lo[slots[done], block[done]], hi[slots[done], block[done]] = entry.lo[done], entry.hi[done]
    return Interval(lo, hi, f"completed entries: {entry.rule}; other rows unchanged"), EXACT, EXACT


# ============================================================================================ selections
@dataclass
class TopKInterval:
    """A causal top-k selection from scores known only up to an interval (``lo``, ``hi`` ``[..., T]``; entry ``t``
    visible where ``visible``): the output must pick ``min(k, visible count)`` distinct visible entries, and some
    scores inside the intervals must make exactly that set the top k — every picked entry's upper end at least
    every unpicked visible entry's lower end. Compared as sets (the order of near-equal picks may differ)."""

    lo: torch.Tensor
    hi: torch.Tensor
    visible: torch.Tensor
    k: int


def _causal_visible(n_entries: int, positions, ratio: int) -> torch.Tensor:
    return torch.arange(n_entries, device=positions.device) < ((positions + 1) // ratio)[..., None]


def _topk_interval(scores: Interval, positions, ratio: int, topk: int) -> TopKInterval:
    return TopKInterval(scores.lo, scores.hi, _causal_visible(scores.lo.shape[-1], positions, ratio), topk)


def indexer_select(nm, acc, qi, w, keys, positions, ratio, topk, all_reduce=None):
    """The scores' interval (:func:`indexer_scores`) and the selections it allows (:class:`TopKInterval`)."""
    return _topk_interval(indexer_scores(nm, acc, qi, w, keys), positions, ratio, topk)


def indexer_select_decode(nm, acc, qi, w, keys, slots, positions, topk, all_reduce=None, w_scale=1.0):
    """:func:`indexer_select` of one query per row over its slot's key cache (the head weights scaled in act, as
    the reference scales them: the same product on both sides)."""
    w = w * w_scale if w_scale != 1.0 else w
    return _topk_interval(indexer_scores(nm, acc, qi[:, None], w[:, None], keys[slots]), positions[:, None], 4, topk)


@dataclass
class RouterChoice:
    """The router's ``(idx, weights)``, judged together: the choice must be one that some scores inside the
    biased scores' intervals make (``biased`` None: hash routing, the choice is exact), and each weight must lie in
    the interval of ``score_i / Σ_{chosen} score_j · route_scale`` **for the experts that output chose**."""

    scores: Interval  # [T, E]
    biased: Interval | None
    k: int
    route_scale: float
    normalise: bool
    acc: object

    def weights(self, idx: torch.Tensor) -> Interval:
        """The weights' interval for the choice ``idx [T, k]``: ``w_i = s_i/(s_i + R_i)`` grows with ``s_i`` and falls
        with the rest ``R_i`` of the sum, so ``[lo_i/(lo_i + R_hi), hi_i/(hi_i + R_lo)]``; the sum (γ_k), its fp32
        rounding, the division and the product with ``route_scale`` add ``γ_k + 3u``."""
        i = idx.to(self.scores.lo.device)
        lo, hi = torch.gather(self.scores.lo, 1, i), torch.gather(self.scores.hi, 1, i)
        if self.normalise:
            rest_lo, rest_hi = lo.sum(-1, keepdim=True) - lo, hi.sum(-1, keepdim=True) - hi
            lo, hi = lo / (lo + rest_hi), hi / (hi + rest_lo)
        iv = Interval(lo * self.route_scale, hi * self.route_scale, f"{self.scores.rule} → s/Σs × route_scale")
        rel = gamma(self.k, self.acc) + 3 * elementwise_roundoff(self.acc)
        return iv.widen(rel * iv.mag, "Σ, division, scale").round(torch.float32)

    def check(self, outs, refs, names) -> list[BoundCheck]:
        (idx_o, w_o), (idx_r, w_r) = outs, refs
        if self.biased is None:
            choice = check_expectation(idx_o, idx_r, EXACT, names[0])
        else:
            t = TopKInterval(self.biased.lo, self.biased.hi, torch.ones_like(self.biased.lo, dtype=torch.bool), self.k)
            choice = check_topk_interval(idx_o, idx_r, t, names[0])
        same = (idx_o.cpu() == idx_r.cpu()).all(-1, keepdim=True)
        iv_o = self.weights(idx_o)
        own = check_interval(w_r, w_r, self.weights(idx_r), names[1])  # the reference inside its own bound
        # rows whose choice differs (legitimately or not — the choice check judges that) are judged on out's side
        ref_like = w_r if bool(same.all()) else torch.where(same.to(w_r.device), w_r, iv_o.mid.to(w_r))
        weights = check_interval(w_o, ref_like, iv_o, names[1])
        weights.bound_defect = weights.bound_defect or own.bound_defect
        weights.ok = weights.ok and not own.bound_defect
        return [choice, weights]


def router_topk(nm, acc, logits, gate, ids):
    """The scores' interval (:func:`router_scores`), ``+ bias`` in fp32 for the choice, and the weights of the
    chosen experts (:class:`RouterChoice`)."""
    a = gate.args
    sc = router_scores(nm, acc, logits, a.score_func)
    biased = None if gate.hash_routed else sc.add(_f64(gate.bias.to(torch.float32))).round(torch.float32)
    return RouterChoice(sc, biased, a.n_activated_experts, a.route_scale, a.score_func != "softmax", acc)


# ============================================================================================ integers
def indexer_topk(nm, acc, scores, positions, ratio, topk):
    return TopK(scores, positions, ratio)


def compressed_rope_position(nm, acc, block, ratio):
    return EXACT


OP_BOUNDS = {
    "linear": linear, "linear_f32": linear_f32, "grouped_wo_a": grouped_wo_a, "linear_group": linear_group,
    "linear_f32_group": linear_f32_group,
    "moe_stage1": moe_stage1, "moe_activation": moe_activation, "moe_stage2": moe_stage2,
    "moe_combine": moe_combine, "moe_output": moe_output, "routed_experts": routed_experts, "expert_mlp": expert_mlp,
    "swiglu": swiglu, "rms_norm": rms_norm, "head_rms": head_rms, "rope": rope, "router_scores": router_scores,
    "hc_pre": hc_pre, "hc_post": hc_post, "hc_head": hc_head,
    "compressor_pool": compressor_pool, "sparse_attention": sparse_attention,
    "attention_from_caches": attention_from_caches, "indexer_scores": indexer_scores,
    "indexer_topk": indexer_topk, "compressed_rope_position": compressed_rope_position,
    # fused ops (kernels/dsv4lab_kernels/mhc.py, norm_rope_quant.py, compressor_decode.py, router.py, indexer_decode.py)
    "hc_pre_norm": hc_pre_norm, "hc_post_pre_norm": hc_post_pre_norm, "head_rms_rope": head_rms_rope,
    "kv_norm_rope": kv_norm_rope, "indexer_query": indexer_query, "indexer_select": indexer_select,
    "indexer_select_decode": indexer_select_decode, "router_topk": router_topk, "compressor_step": compressor_step,
}
"""op name → bound function. A new op needs one entry (and, for a fused op, the chain of its parts)."""


# ============================================================================================ checking
def check_topk(out: torch.Tensor, ref: torch.Tensor, t: TopK, name: str = "") -> BoundCheck:
    """Same selected set per query, or a difference made only of entries tied with the last score chosen."""
    o, r = out.detach().cpu(), ref.detach().cpu()
    if o.shape != r.shape:
        return BoundCheck(name, False, r.numel(), r.numel(), 0, float("inf"), False,
                          dict(note=f"shape {list(o.shape)} != {list(r.shape)}"), "top-k set")
    sc = t.scores.detach().cpu().to(F64)
    bad, ties, worst = 0, 0, {}
    rows = o.reshape(-1, o.shape[-1]).tolist()
    refs = r.reshape(-1, r.shape[-1]).tolist()
    scores = sc.reshape(-1, sc.shape[-1])
    for i, (ro, rr) in enumerate(zip(rows, refs)):
        so, sr = {x for x in ro if x >= 0}, {x for x in rr if x >= 0}
        if so == sr and ro.count(-1) == rr.count(-1):
            continue
        diff = so ^ sr
        kth = min(float(scores[i, j]) for j in sr) if sr else None
        tied = (len(so) == len(sr) and all(0 <= j < scores.shape[1] for j in diff)
                and all(float(scores[i, j]) == kth for j in diff))
        if tied:
            ties += 1
        else:
            bad += 1
            if not worst:
                idx = [int(v) for v in torch.unravel_index(torch.tensor(i), o.shape[:-1])]
                worst = dict(index=idx, out=None, ref=None, bound=0.0, ratio=float("inf"),
                             only_out=sorted(so - sr), only_ref=sorted(sr - so))
    return BoundCheck(name, bad == 0, len(rows), bad, 0, 0.0 if bad == 0 else float("inf"), bool(torch.equal(o, r)),
                      worst, f"top-k set ({ties} row(s) differ only among tied scores)")


def _picks_mask(idx: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask [R, n] of the entries picked, malformed [R])`` for rows of entry indices (−1 = none): a row is
    malformed when it repeats an entry or names one outside ``[0, n)``."""
    valid = idx >= 0
    bad = (idx >= n).any(-1)
    mask = torch.zeros(idx.shape[0], n, dtype=torch.bool)
    rows = torch.arange(idx.shape[0])[:, None].expand_as(idx)
    ok = valid & (idx < n)
    mask[rows[ok], idx[ok]] = True
    return mask, bad | (mask.sum(-1) != ok.sum(-1))


def _legal_picks(idx: torch.Tensor, t: TopKInterval, lo, hi, visible) -> torch.Tensor:
    """Per row: ``idx`` picks ``min(k, visible)`` distinct visible entries and no unpicked visible entry's lower end
    exceeds a picked entry's upper end."""
    n = lo.shape[-1]
    mask, malformed = _picks_mask(idx, n)
    need = torch.clamp(visible.sum(-1), max=t.k)
    count_ok = (mask.sum(-1) == need) & ((idx >= 0).sum(-1) == need) & ~(mask & ~visible).any(-1)
    low_pick = torch.where(mask, hi, torch.full_like(hi, float("inf"))).amin(-1)
    high_rest = torch.where(visible & ~mask, lo, torch.full_like(lo, float("-inf"))).amax(-1)
    return ~malformed & count_ok & (low_pick >= high_rest)


def check_topk_interval(out: torch.Tensor, ref: torch.Tensor, t: TopKInterval, name: str = "") -> BoundCheck:
    """A selection against :class:`TopKInterval` (rows are the leading dims of ``out``); the reference's own
    selection must be legal too, else the bound is reported as defective."""
    o, r = out.detach().cpu().long(), ref.detach().cpu().long()
    if o.shape != r.shape:
        return BoundCheck(name, False, r.numel(), r.numel(), 0, float("inf"), False,
                          dict(note=f"shape {list(o.shape)} != {list(r.shape)}"), "top-k set (score intervals)")
    n = t.lo.shape[-1]
    lo, hi = t.lo.detach().cpu().reshape(-1, n), t.hi.detach().cpu().reshape(-1, n)
    visible = torch.broadcast_to(t.visible.detach().cpu(), t.lo.shape).reshape(-1, n)
    o2, r2 = o.reshape(lo.shape[0], -1), r.reshape(lo.shape[0], -1)
    ok_o, ok_r = _legal_picks(o2, t, lo, hi, visible), _legal_picks(r2, t, lo, hi, visible)
    same = _picks_mask(o2, n)[0].eq(_picks_mask(r2, n)[0]).all(-1)
    bad = int((~ok_o).sum())
    worst, defect = {}, ""
    if bad:
        i = int((~ok_o).nonzero()[0])
        so, sr = {int(x) for x in o2[i] if x >= 0}, {int(x) for x in r2[i] if x >= 0}
        idx = [int(v) for v in torch.unravel_index(torch.tensor(i), o.shape[:-1])]
        worst = dict(index=idx, out=None, ref=None, bound=0.0, ratio=float("inf"), only_out=sorted(so - sr),
                     only_ref=sorted(sr - so))
    if not bool(ok_r.all()):
        i = int((~ok_r).nonzero()[0])
        defect = f"the reference's own selection of row {i} is not a top-{t.k} of its score intervals"
    differ = int((ok_o & ~same).sum())
    return BoundCheck(name, bad == 0 and not defect, lo.shape[0], bad, 0, 0.0 if bad == 0 else float("inf"),
                      bool(torch.equal(o, r)), worst,
                      f"top-k set from score intervals ({differ} row(s) differ within the intervals)", defect)


def check_expectation(out, ref, expect, name: str = "") -> BoundCheck:
    """Check one output against its expectation (an :class:`Interval`, ``EXACT``, a :class:`TopK` or a
    :class:`TopKInterval`)."""
    if isinstance(expect, Interval):
        return check_interval(out, ref, expect, name)
    if isinstance(expect, TopK):
        return check_topk(out, ref, expect, name)
    if isinstance(expect, TopKInterval):
        return check_topk_interval(out, ref, expect, name)
    if expect == EXACT:
        o, r = out.detach().cpu(), ref.detach().cpu()
        if o.shape != r.shape or o.dtype != r.dtype:
            return BoundCheck(name, False, r.numel(), r.numel(), 0, float("inf"), False,
                              dict(note=f"{o.dtype}{list(o.shape)} != {r.dtype}{list(r.shape)}"), "exact")
        same = (o == r) | (torch.isnan(o) & torch.isnan(r)) if o.is_floating_point() else o == r
        eq = bool(same.all())
        worst = {}
        if not eq:
            i = int((~same).flatten().nonzero()[0])
            worst = dict(index=[int(v) for v in torch.unravel_index(torch.tensor(i), r.shape)],
                         out=float(o.flatten()[i]), ref=float(r.flatten()[i]), bound=0.0, ratio=float("inf"))
        return BoundCheck(name, eq, r.numel(), int((~same).sum()), 0, 0.0 if eq else float("inf"), eq, worst, "exact")
    raise TypeError(f"{name}: unknown expectation {type(expect).__name__}")


def check_outputs(outs: tuple, refs: tuple, expects, names: list[str]) -> list[BoundCheck]:
    """Check every output of a call: ``expects`` is what the op's bound function returned — one expectation per
    output (a tuple, or a bare one for a single output), or a joint expectation (with a ``check`` method)."""
    if hasattr(expects, "check"):
        return expects.check(outs, refs, names)
    expects = expects if isinstance(expects, tuple) else (expects,)
    if len(expects) != len(refs):
        raise ValueError(f"{names[0]}: the bound has {len(expects)} expectations for {len(refs)} outputs")
    return [check_expectation(o, r, e, n) for o, r, e, n in zip(outs, refs, expects, names)]


__all__ = ["OP_BOUNDS", "EXACT", "TopK", "TopKInterval", "RouterChoice", "check_expectation", "check_outputs",
           "check_topk", "check_topk_interval", "act_qdq_interval", "fp8_qdq_interval", "fp4_qdq_interval",
           "act_int8_interval", "swiglu_interval", "rms_norm_interval", "rope_interval", "hadamard_interval",
           "finish_interval", "routed_experts_int8", "moe_stage1_int8"]
