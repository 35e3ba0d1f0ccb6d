"""Bounds of the element-wise ops (RMSNorm, the heads' RMS, RoPE, SwiGLU, the router's scores, ``hc_post``) and of
mHC's pre/head mixing (first-order propagation through the Sinkhorn iterations, adjoints by autograd)."""
from __future__ import annotations

import torch

from dsv4lab.tools.verify.bounds import Interval, elementwise_roundoff, gamma, unit_roundoff
from dsv4lab.tools.verify.op_bounds.dot import routed_experts
from dsv4lab.tools.verify.op_bounds.intervals import as_f64, exp_error, gamma_elementwise, point, swiglu_interval


def swiglu(nm, acc, gate, up, limit, shared=False):
    return swiglu_interval(point(gate), point(up), limit, elementwise_roundoff(acc)).round(gate.dtype)


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
    y = x.mul(r).mul(as_f64(weight.to(nm.acc)))
    y = Interval(y.lo, y.hi, x.rule)  # the two products are one step of the account below
    rel = gamma(d / 2 + 16, acc)
    return y.widen(rel * y.mag, f"RMSNorm D={d}: γ(D/2+16, {acc})·|y|").round(nm.acc).round(out_dtype)


def rms_norm(nm, acc, x, weight, eps):
    return rms_norm_interval(nm, acc, point(x.to(nm.acc)), weight, eps, x.dtype)


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
    q64 = as_f64(q)
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
    c, s = as_f64(cos), as_f64(sin)
    if inverse:
        s = -s
    tail = Interval(x.lo[..., -r:], x.hi[..., -r:])
    mid, rad, mag = tail.mid, tail.rad, tail.mag
    m0, m1, r0, r1, a0, a1 = mid[..., 0::2], mid[..., 1::2], rad[..., 0::2], rad[..., 1::2], mag[..., 0::2], \
        mag[..., 1::2]
    g = gamma_elementwise(3, acc)
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
    return rope_interval(acc, point(x), cos, sin, inverse, x.dtype)


def router_scores(nm, acc, logits, score_func):
    u = elementwise_roundoff(acc)
    x = as_f64(logits)
    if score_func == "sqrtsoftplus":
        sp = torch.logaddexp(x, torch.zeros_like(x))  # softplus without cancellation
        d = exp_error(x, u) * sp + 4 * u  # log(1 + e^x): exp, the addition (absolute in the log), the log
        lo = torch.sqrt((sp - d).clamp_min(0))
        hi = torch.sqrt(sp + d)
        iv = Interval(lo, hi, f"√softplus: ((4+2|x|)·u·sp + 4u) through √").widen(2 * u * hi, "√ rounding")
    elif score_func == "sigmoid":
        v = torch.sigmoid(x)
        iv = Interval.around(v, (exp_error(x, u) + 3 * u) * v, "sigmoid")
    else:
        m = x.amax(-1, keepdim=True)
        v = torch.softmax(x, -1)
        rel = exp_error(x - m, u) + (x - m).abs() * u + gamma(x.shape[-1] + 2, acc)
        iv = Interval.around(v, rel * v, "softmax")
    return iv.round(nm.acc)


def hc_post(nm, acc, out, X, post, comb):
    """``post[k]·out + Σ_j comb[j,k]·X[j]``: n+1 products and sums, γ_{n+2}·Σ|terms|. ``out`` is the sub-layer's
    output, or an :class:`Interval` of them (the fused MoE site's, itself a bound): then ``post[k]·out`` is an
    interval (sign-aware) and the allowance is taken over its largest magnitudes."""
    Xf, pf, cf = as_f64(X), as_f64(post), as_f64(comb)
    mixed = torch.einsum("bsjk,bsjd->bskd", cf, Xf)
    mixed_mag = torch.einsum("bsjk,bsjd->bskd", cf.abs(), Xf.abs())
    p = pf[..., None]
    if isinstance(out, Interval):
        a, b = p * out.lo[..., None, :], p * out.hi[..., None, :]
        po_lo, po_hi = torch.minimum(a, b), torch.maximum(a, b)
    else:
        po_lo = po_hi = p * as_f64(out)[..., None, :]
    n = X.shape[-2]
    r = gamma(n + 2, acc) * (torch.maximum(po_lo.abs(), po_hi.abs()) + mixed_mag)
    return Interval(po_lo + mixed - r, po_hi + mixed + r,
                    f"mHC post: γ(n+2={n + 2}, {acc})·Σ|terms|").round(nm.acc).round(X.dtype)


def _mix_logits(nm, acc, X: Interval, fn, eps):
    """Mixing logits ``m = (x·fnᵀ)·rsqrt(mean(x²)+eps)`` for every ``x`` in the interval of the ``n`` streams, as a
    centre and a radius: the nD-term dot (an interval, with γ of its evaluation), the reciprocal root of the mean
    square (an interval, as in :func:`rms_norm_interval`), their product; the evaluation of the mean (γ, halved by
    the rsqrt), the rsqrt's 2 ulp and the product add ``γ(nD/2+6)·|m|``."""
    x = Interval(X.lo.flatten(-2), X.hi.flatten(-2))
    n_d = x.lo.shape[-1]
    proj = x.matmul(as_f64(fn), acc)
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
    rel = exp_error(a.abs() + da, u) + 3 * u
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
        c = probe(leaf.softmax(-1), (exp_error(dev.detach(), u) + dev.detach().abs() * u + (n + 2) * u))
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
    sc, bs = as_f64(scale), as_f64(base)
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
    return _hc_pre(nm, acc, point(X.to(nm.acc)), fn, base, scale, args, X.dtype)


def hc_head(nm, acc, X, fn, base, scale, args):
    u = elementwise_roundoff(acc)
    Xi = point(X.to(nm.acc))
    m, dm = _mix_logits(nm, acc, Xi, fn, args.norm_eps)
    pre = _sigmoid_gate(m, dm, float(as_f64(scale)[0]), as_f64(base), u).add(args.hc_eps)
    return _hc_weighted_streams(nm, acc, Xi, pre.widen(u * pre.mag, "+hc_eps"), X.dtype)


def hc_pre_norm(nm, acc, X, fn, base, scale, norm_weight, args):
    """:func:`hc_pre`, then the sub-layer's RMSNorm of ``u``'s interval (:func:`rms_norm_interval`)."""
    u, post, comb = _hc_pre(nm, acc, point(X.to(nm.acc)), fn, base, scale, args, X.dtype)
    return rms_norm_interval(nm, acc, u, norm_weight, args.norm_eps, X.dtype), post, comb


def hc_post_pre_norm(nm, acc, out, X, post, comb, fn, base, scale, norm_weight, args):
    """:func:`hc_post` (its interval ``X'``), then :func:`hc_pre` and the RMSNorm of every ``X'`` in that interval:
    ``(X', x, post', comb')``."""
    Xn = hc_post(nm, acc, out, X, post, comb)
    u, post2, comb2 = _hc_pre(nm, acc, Xn, fn, base, scale, args, X.dtype)
    return Xn, rms_norm_interval(nm, acc, u, norm_weight, args.norm_eps, X.dtype), post2, comb2


def moe_post_pre_norm(nm, acc, x, idx, weights, bank, limit, shared, X, post, comb, fn, base, scale, norm_weight,
                      args, all_reduce=None):
    """The fused MoE site as one chain of intervals: :func:`routed_experts`' interval of the routed sum, each
    shared expert's output added with one rounding in ``acc`` and the sum rounded to act (:func:`moe_output` on
    an interval), then :func:`hc_post_pre_norm` of every sub-layer output in that interval: ``(X', x, post',
    comb')``."""
    y, u = routed_experts(nm, acc, x, idx, weights, bank, limit), elementwise_roundoff(acc)
    for s in shared:
        y = y.add(point(s))
        y = y.widen(u * y.mag, "+ shared expert in acc")
    y = y.round(nm.act)
    shape = (*X.shape[:-2], X.shape[-1])
    out = Interval(y.lo.reshape(shape), y.hi.reshape(shape), y.rule)
    Xn = hc_post(nm, acc, out, X, post, comb)
    u2, post2, comb2 = _hc_pre(nm, acc, Xn, fn, base, scale, args, X.dtype)
    return Xn, rms_norm_interval(nm, acc, u2, norm_weight, args.norm_eps, X.dtype), post2, comb2
