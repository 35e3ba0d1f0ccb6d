"""The error bound of every replaceable op (:class:`dsv4lab.model.ops.ReferenceOps`), computed from its inputs.

:data:`OP_BOUNDS` maps an op name to a function ``bound(nm, acc, *args, **kwargs) -> expectation | tuple`` — one
expectation per output of the op: an :class:`~dsv4lab.verify.bounds.Interval` the output must lie in, ``EXACT``
(integers, pure data movement) or a :class:`TopK` (a selection compared as a set, ties allowed). ``nm`` is the
reference's :class:`~dsv4lab.model.numerics.Numerics`, ``acc`` the accumulation the evaluated backend states
(:data:`~dsv4lab.verify.bounds.UNIT_ROUNDOFF`). Each function follows the reference's rounding points step by
step (the op's docstring in ``model/ops.py``); ``docs/verification.md`` derives each family:

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
* **selections** (``indexer_topk``): compared as sets; entries that differ must tie with the last one chosen.

An op with no entry here has **no bound defined**: the stage oracle reports it as a failure, never as a pass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import quant
from .bounds import BoundCheck, Interval, check_interval, gamma, unit_roundoff

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


def _exp_error(arg: torch.Tensor, u: float) -> torch.Tensor:
    """Relative error allowed to an fp32 ``exp(arg)``: ``(4 + 2|arg|)·u`` (ex2.approx ≤ 2 ulp, argument scaling)."""
    return (4 + 2 * arg.abs()) * u


# ============================================================================================ quantizers
def act_qdq_interval(iv: Interval, block: int = quant.ACT_BLOCK) -> Interval:
    """The FP8 activation quantizer (:func:`dsv4lab.quant.act_qdq_fp8`) applied to every value in ``iv``: per
    block of ``block`` along the last dim, the scale ``2^ceil(log2(amax/448))`` may be any power of two between
    those of the smallest and largest possible amax; for each, quantization is monotone, so the reachable values of
    an element lie between its ends' quantized values over those scales."""
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
    # the scale as the reference computes it (fp32 division, exact power of two): monotone in amax
    s_lo = quant.pow2_scale(mag_lo.amax(-1).to(torch.float32).clamp_min(1e-4), quant.FP8_E4M3_MAX).to(F64)
    s_hi = quant.pow2_scale(mag_hi.amax(-1).to(torch.float32).clamp_min(1e-4), quant.FP8_E4M3_MAX).to(F64)
    e_lo, e_hi = torch.log2(s_lo).round(), torch.log2(s_hi).round()
    out_lo = torch.full_like(lo, float("inf"))
    out_hi = torch.full_like(hi, float("-inf"))
    for e in range(int(e_lo.min()), int(e_hi.max()) + 1):
        ok = ((e_lo <= e) & (e <= e_hi))[..., None]
        s = 2.0 ** e

        def q(v):
            return (v / s).clamp(-quant.FP8_E4M3_MAX, quant.FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(F64) * s
        out_lo = torch.where(ok, torch.minimum(out_lo, q(lo)), out_lo)
        out_hi = torch.where(ok, torch.maximum(out_hi, q(hi)), out_hi)
    out_lo = out_lo.flatten(-2)[..., :k]
    out_hi = out_hi.flatten(-2)[..., :k]
    nan = torch.isnan(iv.lo)
    return iv._with(torch.where(nan, iv.lo, out_lo), torch.where(nan, iv.hi, out_hi), "FP8 act quant")


def act_int8_interval(iv: Interval, block: int = quant.FP4_BLOCK) -> Interval:
    """The paper's INT8 activation quantizer (:func:`dsv4lab.quant.act_quant_int8`: per ``block``, scale
    ``amax/127`` in fp32, round to nearest) on every value in ``iv``. The scale now varies continuously with amax:
    the integer ``round(v/s)`` is monotone in ``v`` and in ``s``, so its range over the box is spanned by the
    corners, and so is the range of the products ``n·s``."""
    lo = iv.lo.reshape(*iv.lo.shape[:-1], -1, block)
    hi = iv.hi.reshape(*iv.hi.shape[:-1], -1, block)
    straddles = (lo <= 0) & (hi >= 0)
    mag_lo = torch.where(straddles, torch.zeros_like(lo), torch.minimum(lo.abs(), hi.abs())).nan_to_num(0.0)
    mag_hi = torch.maximum(lo.abs(), hi.abs()).nan_to_num(0.0)
    s_lo = (mag_lo.amax(-1, keepdim=True).to(torch.float32).clamp_min(1e-8) / 127.0).to(F64)
    s_hi = (mag_hi.amax(-1, keepdim=True).to(torch.float32).clamp_min(1e-8) / 127.0).to(F64)

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
    u = unit_roundoff(acc)
    h = swiglu_interval(g, up, limit, u).mul(_f64(weights)[..., None])
    return h.widen(u * h.mag, "× routing weight").round(nm.acc)


def moe_activation(nm, acc, g, u, weights, limit):
    return _activation(nm, acc, _point(g), _point(u), weights, limit)


def moe_combine(nm, acc, out, idx, all_reduce=None):
    """Σ over the k slots (NaN slots skipped) in ``acc``."""
    return _point(out).sum(1, acc).round(nm.acc)


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
    u = unit_roundoff(acc)
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
    return swiglu_interval(_point(gate), _point(up), limit, unit_roundoff(acc)).round(gate.dtype)


def rms_norm(nm, acc, x, weight, eps):
    """``w·x/√(mean(x²)+eps)``: the mean of D positive terms has relative error γ_D, the reciprocal square root
    halves it and adds its own 2 ulp; eps, the two products and the reference's own roundings add a few ``u``."""
    xf = _f64(x.to(nm.acc))
    v = _f64(weight.to(nm.acc)) * xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + eps)
    rel = gamma(x.shape[-1] / 2 + 16, acc)
    return Interval.around(v, rel * v.abs(), f"RMSNorm D={x.shape[-1]}: γ(D/2+16, {acc})·|y|").round(nm.acc) \
        .round(x.dtype)


def _round_or_not(iv: Interval, dtype) -> Interval:
    """Either rounded to ``dtype`` or kept wider (a fused kernel may skip an intermediate rounding)."""
    r = iv.round(dtype)
    return iv._with(torch.minimum(iv.lo, r.lo), torch.maximum(iv.hi, r.hi), f"round {dtype} or not")


def head_rms(nm, acc, q, eps):
    """Per-head RMS in act steps, as the reference: bf16 squares, their mean (γ_d), rounded to act, plus eps in
    act, reciprocal square root rounded to act, the product rounded to act. Intermediate roundings may be skipped
    by a fused kernel (both allowed); the last is not."""
    u = unit_roundoff(acc)
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


def rope(nm, acc, x, cos, sin, inverse=False):
    """Interleaved rotation of the last ``2·cos.shape[-1]`` dims in ``cos.dtype``: each output is two products and
    one sum, evaluated by either side (γ₃·(|x₀cos| + |x₁sin|) covers both); the other dims are copied exactly."""
    r = 2 * cos.shape[-1]
    xf = _f64(x)
    c, s = _f64(cos), _f64(sin)
    if inverse:
        s = -s
    x0, x1 = xf[..., -r:][..., 0::2], xf[..., -r:][..., 1::2]
    g = gamma(3, acc)
    r0, r1 = x0 * c - x1 * s, x0 * s + x1 * c
    m0, m1 = (x0 * c).abs() + (x1 * s).abs(), (x0 * s).abs() + (x1 * c).abs()
    rot = torch.stack((r0, r1), -1).flatten(-2)
    mag = torch.stack((m0, m1), -1).flatten(-2)
    rot, mag = torch.broadcast_tensors(rot, mag)
    center = torch.cat((xf[..., :-r].expand(*rot.shape[:-1], -1), rot), -1) if x.shape[-1] > r else rot
    radius = torch.cat((torch.zeros_like(xf[..., :-r]).expand(*rot.shape[:-1], -1), g * mag), -1) \
        if x.shape[-1] > r else g * mag
    return Interval.around(center, radius, f"RoPE: γ₃({acc})·(|x₀c|+|x₁s|), other dims exact").round(
        cos.dtype).round(x.dtype)


def router_scores(nm, acc, logits, score_func):
    u = unit_roundoff(acc)
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
def _mix_logits(nm, acc, X, fn, eps):
    """Exact mixing logits ``m = (x·fnᵀ)·rsqrt(mean(x²)+eps)`` and their error bound: the nD-term dot (γ), the
    mean (γ, halved by the rsqrt), the rsqrt's 2 ulp and the product."""
    u = unit_roundoff(acc)
    x = _f64(X.to(nm.acc)).flatten(-2)
    f = _f64(fn)
    n_d = x.shape[-1]
    r = torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
    proj = x @ f.T
    m = proj * r
    dm = gamma(n_d, acc) * (x.abs() @ f.abs().T) * r + (gamma(n_d / 2 + 6, acc)) * m.abs()
    return m, dm


def _sigmoid_gate(m, dm, scale, base, u):
    """``σ(m·scale + base)`` on ``m ± dm``: σ is increasing, its fp32 evaluation adds (4+2|a|)·u + 2u."""
    a = m * scale + base
    da = dm * abs(scale) + 2 * u * (m * scale).abs() + 2 * u * a.abs()
    lo, hi = torch.sigmoid(a - da), torch.sigmoid(a + da)
    rel = _exp_error(a.abs() + da, u) + 3 * u
    return Interval(lo * (1 - rel), hi * (1 + rel), "σ(m·scale+base)")


def _sinkhorn_first_order(c0: torch.Tensor, dc0: torch.Tensor, iters: int, eps: float, u: float):
    """Sinkhorn of ``c0 [R, n, n]`` (the reference's :func:`dsv4lab.model.mhc.sinkhorn`) and a first-order bound
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


def _hc_weighted_streams(nm, acc, X, pre: Interval) -> Interval:
    """``Σ_j pre_j·X_j`` over the n streams (fp32 products, an n-term sum), rounded to fp32 then X's dtype."""
    u = unit_roundoff(acc)
    terms = Interval(pre.lo[..., None], pre.hi[..., None], pre.rule).mul(_f64(X))
    terms = terms.widen(u * terms.mag, "products")
    return terms.sum(-2, acc).round(nm.acc).round(X.dtype)


def hc_pre(nm, acc, X, fn, base, scale, args):
    """mHC pre: mixing logits → pre/post gates (sigmoids) and the Sinkhorn-normalised ``comb``; the sub-layer
    input ``Σ_j pre_j·X_j``. Returns ``(u, post, comb)``."""
    u = unit_roundoff(acc)
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
                                        args.hc_eps, u)
    comb_iv = Interval.around(comb.reshape(*lead, n, n), dcomb.reshape(*lead, n, n),
                              "Sinkhorn, first order ×2").round(nm.acc)
    return _hc_weighted_streams(nm, acc, X, pre), post, comb_iv


def hc_head(nm, acc, X, fn, base, scale, args):
    u = unit_roundoff(acc)
    m, dm = _mix_logits(nm, acc, X, fn, args.norm_eps)
    pre = _sigmoid_gate(m, dm, float(_f64(scale)[0]), _f64(base), u).add(args.hc_eps)
    return _hc_weighted_streams(nm, acc, X, pre.widen(u * pre.mag, "+hc_eps"))


# ============================================================================================ softmax-weighted
def compressor_pool(nm, acc, kv_slots, sc_slots):
    """Per channel, softmax over the slots then ``Σ w·kv``: each weight's relative error is its exp's
    ``(4+2|s−max|)·u`` plus the sum and division (n+3)·u, plus the reference's own rounding of w; then γ_n."""
    u = unit_roundoff(acc)
    sc, kv = _f64(sc_slots), _f64(kv_slots)
    n = sc.shape[1]
    w = torch.softmax(sc, 1)
    dev = (sc - sc.amax(1, keepdim=True)).abs()
    rel = torch.where(w > 0, _exp_error(dev, u) + dev * u + (n + 5) * u, torch.zeros_like(w))
    wkv = (w * kv.abs()).nan_to_num(0.0)
    radius = (rel * wkv).sum(1) + gamma(n, acc) * wkv.sum(1)
    return Interval.around((w * kv).nan_to_num(0.0).sum(1), radius, f"softmax pool of {n} slots").round(nm.acc)


def sparse_attention(nm, acc, q, kv, idx, sink, scale):
    """Attention with a sink over gathered rows. Derivation (docs/verification.md): score errors
    ``Δz = γ_d·scale·Σ|q||kv| + 2u|z|`` and the max's ``Δm`` make each probability's relative error
    ``ρ = e^{Δz+Δm} − 1 + (6 + 3|z−m|)·u`` plus the online rescaling's ``(5K + 2·(z_max−z_min))·u``; the numerator
    adds one bf16 rounding of each probability (either side may round against another maximum) and γ_K; the
    denominator γ_{K+1}; the quotient ``(δN + |o|·δD)/(D − δD)``."""
    u = unit_roundoff(acc)
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


def attention_from_caches(nm, acc, q, win_kv, win_rows, cmp_kv, cmp_rows, slots, sink, scale):
    kv, rows = win_kv[slots], win_rows
    if cmp_kv is not None:
        kv = torch.cat((kv, cmp_kv[slots].to(kv.dtype)), 1)
        rows = torch.cat((win_rows, torch.where(cmp_rows >= 0, cmp_rows + win_kv.shape[1], -1)), 1)
    iv = sparse_attention(nm, acc, q[:, None], kv, rows[:, None], sink, scale)
    return Interval(iv.lo[:, 0], iv.hi[:, 0], iv.rule)


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


# ============================================================================================ integers
def indexer_topk(nm, acc, scores, positions, ratio, topk):
    return TopK(scores, positions, ratio)


def compressed_rope_position(nm, acc, block, ratio):
    return EXACT


OP_BOUNDS = {
    "linear": linear, "linear_f32": linear_f32, "grouped_wo_a": grouped_wo_a, "linear_group": linear_group,
    "linear_f32_group": linear_f32_group,
    "moe_stage1": moe_stage1, "moe_activation": moe_activation, "moe_stage2": moe_stage2,
    "moe_combine": moe_combine, "routed_experts": routed_experts, "expert_mlp": expert_mlp,
    "swiglu": swiglu, "rms_norm": rms_norm, "head_rms": head_rms, "rope": rope, "router_scores": router_scores,
    "hc_pre": hc_pre, "hc_post": hc_post, "hc_head": hc_head,
    "compressor_pool": compressor_pool, "sparse_attention": sparse_attention,
    "attention_from_caches": attention_from_caches, "indexer_scores": indexer_scores,
    "indexer_topk": indexer_topk, "compressed_rope_position": compressed_rope_position,
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


def check_expectation(out, ref, expect, name: str = "") -> BoundCheck:
    """Check one output against its expectation (an :class:`Interval`, ``EXACT`` or a :class:`TopK`)."""
    if isinstance(expect, Interval):
        return check_interval(out, ref, expect, name)
    if isinstance(expect, TopK):
        return check_topk(out, ref, expect, name)
    if expect == EXACT:
        eq = torch.equal(out.detach().cpu(), ref.detach().cpu())
        return BoundCheck(name, eq, ref.numel(), 0 if eq else int((out.cpu() != ref.cpu()).sum()), 0,
                          0.0 if eq else float("inf"), eq, {}, "exact")
    raise TypeError(f"{name}: unknown expectation {type(expect).__name__}")


__all__ = ["OP_BOUNDS", "EXACT", "TopK", "check_expectation", "check_topk", "act_qdq_interval", "act_int8_interval",
           "swiglu_interval", "routed_experts_int8", "moe_stage1_int8"]
