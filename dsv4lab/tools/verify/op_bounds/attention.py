"""Bounds of the softmax-weighted sums (``sparse_attention``, ``compressor_pool``, the indexer's scores) and of the
fused glue chains of the decode step (``head_rms_rope``, ``kv_norm_rope``, ``indexer_query``, ``compressor_step``,
``attention_from_caches``): each part takes the previous part's interval as its input."""
from __future__ import annotations

import torch

from dsv4lab.core import quant
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.tools.verify.bounds import Interval, elementwise_roundoff, gamma, unit_roundoff
from dsv4lab.tools.verify.op_bounds.elementwise import head_rms, rms_norm, rms_norm_interval, rope_interval
from dsv4lab.tools.verify.op_bounds.intervals import (EXACT, F64, FP32_MIN_NORMAL, as_f64, exp_error, fp4_qdq_interval,
                                                      fp8_qdq_interval, point)
from dsv4lab.tools.verify.op_outputs import private_arguments


def compressor_pool(nm, acc, kv_slots, sc_slots):
    """Per channel, softmax over the slots then ``Σ w·kv``: each weight's relative error is its exp's
    ``(4+2|s−max|)·u`` plus the n-term sum (in ``acc``), the division and the reference's own rounding of w
    (5u); then γ_n."""
    u = elementwise_roundoff(acc)
    sc, kv = as_f64(sc_slots), as_f64(kv_slots)
    n = sc.shape[1]
    w = torch.softmax(sc, 1)
    dev = (sc - sc.amax(1, keepdim=True)).abs()
    rel = torch.where(w > 0, exp_error(dev, u) + dev * u + n * unit_roundoff(acc) + 5 * u, torch.zeros_like(w))
    wkv = (w * kv.abs()).nan_to_num(0.0)
    radius = (rel * wkv).sum(1) + gamma(n, acc) * wkv.sum(1)
    return Interval.around((w * kv).nan_to_num(0.0).sum(1), radius, f"softmax pool of {n} slots").round(nm.acc)


def sparse_attention(nm, acc, q, kv, idx, sink, scale):
    """Attention with a sink over gathered rows. Derivation (docs/verification.md): score errors
    ``Δz = γ_d·scale·Σ|q||kv| + 2u|z|`` and the max's ``Δm`` make each probability's relative error
    ``ρ = e^{Δz+Δm} − 1 + (6 + 3|z−m|)·u`` plus the online rescaling's ``(5K + 2·(z_max−z_min))·u``; the numerator
    adds one bf16 rounding of each probability (either side may round against another maximum) and γ_K; the
    denominator γ_{K+1}; the quotient ``(δN + |o|·δD)/(D − δD)``."""
    K = idx.shape[-1]
    return _attention_interval(nm, acc, q, kv, idx, sink, scale, rescales=K, num_gamma=gamma(K, acc),
                               den_gamma=gamma(K + 1, acc), rule="bf16 probabilities either side")


def sparse_attention_split(nm, acc, q, kv, idx, sink, scale, chunk: int, block_r: int):
    """:func:`sparse_attention` as the split-KV kernel evaluates it (``dsv4lab_kernels.attention_split_decode``):
    the selection cut into ``S = ⌈K/chunk⌉`` chunks of ``chunk`` positions, each an online softmax over blocks of
    ``block_r`` rows, then the chunks rescaled to the global max and summed in fp32. Against the general bound,
    three terms change (docs/verification.md, "Split-KV attention"):

    * the rescaling chain of a probability: at most ``⌈chunk/block_r⌉ − 1`` rescalings inside its chunk and one
      in the combine (each an exp and a product: ``(5 + 2|Δm|)·u``, the ``Δm`` summing to at most
      ``z_max − z_min``) — ``(5⌈chunk/block_r⌉ + 2(z_max − z_min))·u`` instead of ``(5K + …)·u``;
    * the numerator: a chunk's sum of at most ``chunk`` terms in ``acc`` (γ_chunk), the chunks' sum in fp32 on
      CUDA cores (γ_S) — instead of γ_K;
    * the denominator: γ_chunk for a chunk's sum, γ_{S+1} for the chunks' and the sink's — instead of γ_{K+1}.

    The exp of each probability's own argument, taken against its chunk's running max (no farther from it than the
    global max), and the bf16 rounding of each probability on either side are as in the general bound."""
    K = idx.shape[-1]
    n = max(1, min(chunk, K))
    S = max(1, -(-K // chunk))
    return _attention_interval(nm, acc, q, kv, idx, sink, scale, rescales=-(-n // block_r),
                               num_gamma=gamma(n, acc) + gamma(S, "fp32"),  # the combine: CUDA cores, fp32
                               den_gamma=gamma(n, acc) + gamma(S + 1, "fp32"),
                               rule=f"split-KV, {S} chunk(s) of {chunk}")


def _attention_interval(nm, acc, q, kv, idx, sink, scale, rescales: int, num_gamma: float, den_gamma: float,
                        rule: str):
    """The interval of :func:`sparse_attention`'s derivation, given the evaluation's longest rescaling chain
    (``rescales`` exp-and-product steps besides the range term), the relative error of its numerator's sums
    (``num_gamma``) and of its denominator's (``den_gamma``)."""
    u = elementwise_roundoff(acc)
    u_act = unit_roundoff(nm.act) if nm.act in (torch.bfloat16, torch.float16) else 0.0
    b, s, h, d = q.shape
    K = idx.shape[-1]
    valid = idx >= 0
    g = torch.gather(kv, 1, idx.clamp_min(0).reshape(b, -1, 1).expand(-1, -1, d)).reshape(b, s, K, d)
    g = torch.where(valid[..., None], as_f64(g), torch.zeros((), dtype=F64, device=q.device))
    qf = as_f64(q)
    z = torch.einsum("bshd,bskd->bshk", qf, g) * scale
    zabs = torch.einsum("bshd,bskd->bshk", qf.abs(), g.abs()) * abs(scale)
    vmask = valid[:, :, None, :]
    dz = torch.where(vmask, gamma(d, acc) * zabs + 2 * u * z.abs(), torch.zeros_like(z))
    z = z.masked_fill(~vmask, float("-inf"))
    m = z.amax(-1, keepdim=True)
    dm = dz.amax(-1, keepdim=True)
    zmin = torch.where(vmask, z, torch.full_like(z, float("inf"))).amin(-1, keepdim=True)
    chain = (5 * rescales + 2 * (m - zmin).clamp_min(0)) * u
    p = torch.exp(z - m)
    dev = torch.where(vmask, (z - m).abs(), torch.zeros_like(z))
    rho = torch.where(vmask, torch.expm1(dz + dm) + (6 + 3 * dev) * u + chain, torch.zeros_like(z))
    sk = as_f64(sink)[None, None, :, None]
    ps = torch.exp(sk - m)
    rho_s = torch.expm1(dm) + (6 + 3 * (sk - m).abs()) * u + chain
    num = torch.einsum("bshk,bskd->bshd", p, g)
    mag = torch.einsum("bshk,bskd->bshd", p, g.abs())
    mag_rho = torch.einsum("bshk,bskd->bshd", p * rho, g.abs())
    gmax = g.abs().amax((-2, -1))[:, :, None, None]
    den = p.sum(-1, keepdim=True) + ps
    d_num = mag_rho + (u_act + num_gamma) * (mag + mag_rho) * (1 + u_act) + K * FP32_MIN_NORMAL * gmax
    d_den = (p * rho).sum(-1, keepdim=True) + rho_s * ps + den_gamma * den * (1 + rho.amax(-1, keepdim=True)) \
        + K * FP32_MIN_NORMAL
    o = num / den
    err = (d_num + o.abs() * d_den) / (den - d_den).clamp_min(den * 0.5)
    err = err + 2 * u * (o.abs() + err)
    return Interval.around(o, err, f"attention over K={K} rows, d={d} ({rule})").round(nm.act)


def attention_from_caches(nm, acc, q, win_kv, win_rows, cmp_kv, cmp_rows, slots, sink, scale, cos=None, sin=None,
                          positions=None, cmp_ratio=0):
    """:func:`sparse_attention` over the selected rows of both caches, then (given the tables) the inverse RoPE of
    its interval (:func:`rope_interval`). ``cmp_ratio`` only tells a kernel which rows may be skipped."""
    return _from_caches(sparse_attention, nm, acc, q, win_kv, win_rows, cmp_kv, cmp_rows, slots, sink, scale, cos,
                        sin, positions)


def attention_from_caches_split(nm, acc, q, win_kv, win_rows, cmp_kv, cmp_rows, slots, sink, scale, cos=None,
                                sin=None, positions=None, cmp_ratio=0, *, chunk: int, block_r: int):
    """:func:`attention_from_caches` as the split-KV kernel evaluates it (:func:`sparse_attention_split`)."""
    def attention(nm, acc, q, kv, idx, sink, scale):
        return sparse_attention_split(nm, acc, q, kv, idx, sink, scale, chunk, block_r)
    return _from_caches(attention, nm, acc, q, win_kv, win_rows, cmp_kv, cmp_rows, slots, sink, scale, cos, sin,
                        positions)


def _from_caches(attention, nm, acc, q, win_kv, win_rows, cmp_kv, cmp_rows, slots, sink, scale, cos, sin,
                 positions):
    kv, rows = win_kv[slots], win_rows
    if cmp_kv is not None:
        kv = torch.cat((kv, cmp_kv[slots].to(kv.dtype)), 1)
        rows = torch.cat((win_rows, torch.where(cmp_rows >= 0, cmp_rows + win_kv.shape[1], -1)), 1)
    iv = attention(nm, acc, q[:, None], kv, rows[:, None], sink, scale)
    iv = Interval(iv.lo[:, 0], iv.hi[:, 0], iv.rule)
    if cos is None:
        return iv
    return rope_interval(acc, iv, cos[positions][:, None], sin[positions][:, None], inverse=True, out_dtype=q.dtype)


def indexer_scores(nm, acc, qi, w, keys, all_reduce=None):
    """``Σ_h act(relu(act(qi_h·K_t))·w_h)`` as a chain: each head's d-term dot (γ_d) rounded to fp32 then act (a
    flip allowed where the interval straddles), relu, the product with the head weight rounded to act, the sum over
    heads in ``acc`` (γ_H), rounded to fp32 then act."""
    qf, kf = as_f64(qi), as_f64(keys)
    d = qi.shape[-1]
    dots = torch.einsum("bshd,btd->bsht", qf, kf)
    mag = torch.einsum("bshd,btd->bsht", qf.abs(), kf.abs())
    iv = Interval.around(dots, (gamma(d, acc) + gamma(d, F64)) * mag, f"head dots d={d}")
    iv = iv.round(nm.acc).round(nm.act).relu().mul(as_f64(w)[..., None]).round(nm.act)
    return iv.sum(2, acc, f"Σ over {qi.shape[2]} heads").round(nm.acc).round(nm.act)


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
    iv = rms_norm_interval(nm, acc, point(kv.to(nm.acc)), weight, eps, kv.dtype)
    iv = rope_interval(acc, iv, cos[positions], sin[positions], out_dtype=kv.dtype)
    if nm.kv_fp8_sim:
        nope = kv.shape[-1] - 2 * cos.shape[-1]
        q = fp8_qdq_interval(Interval(iv.lo[..., :nope], iv.hi[..., :nope], iv.rule)).round(kv.dtype)
        iv = iv._with(torch.cat((q.lo, iv.lo[..., nope:]), -1), torch.cat((q.hi, iv.hi[..., nope:]), -1), q.rule)
    if ring is None:
        return iv
    rows = (slots, positions.reshape(-1) % ring.shape[1])
    w = iv.round(ring.dtype)
    lo, hi = as_f64(ring).clone(), as_f64(ring).clone()
    lo[rows], hi[rows] = w.lo.reshape(slots.shape[0], -1), w.hi.reshape(slots.shape[0], -1)
    return iv, Interval(lo, hi, f"ring: written rows {w.rule}, others unchanged")


def indexer_query(nm, acc, qi, cos, sin, positions):
    """RoPE at ``positions`` (rounded to act) → the Hadamard transform of its interval → the FP4 simulation."""
    iv = rope_interval(acc, point(qi), cos[positions][..., None, :], sin[positions][..., None, :], out_dtype=qi.dtype)
    iv = hadamard_interval(acc, iv, qi.dtype)
    return fp4_qdq_interval(iv, 32).round(qi.dtype) if nm.indexer_fp4_sim else iv


def compressor_pair(nm, acc, comp_a, kv_a, score_a, cache_a, comp_b, kv_b, score_b, cache_b, positions, slots, cos,
                    sin):
    """:func:`compressor_step`'s state of each compressor, in :data:`IN_PLACE`'s order: both caches, then the first
    compressor's rings, then the second's."""
    ca, *rings_a = compressor_step(nm, acc, comp_a, kv_a, score_a, positions, slots, cache_a, cos, sin)
    cb, *rings_b = compressor_step(nm, acc, comp_b, kv_b, score_b, positions, slots, cache_b, cos, sin)
    return (ca, cb, *rings_a, *rings_b)


def attention_norms(nm, acc, q_a, q_weight, kv, kv_weight, eps, cos, sin, positions, ring=None, slots=None):
    """Its parts' bounds side by side: :func:`~.elementwise.rms_norm` of the query latent, then
    :func:`kv_norm_rope`'s (the KV row, and the ring after the write when there is one)."""
    kv_part = kv_norm_rope(nm, acc, kv, kv_weight, eps, cos, sin, positions, ring, slots)
    return (rms_norm(nm, acc, q_a, q_weight, eps), *(kv_part if isinstance(kv_part, tuple) else (kv_part,)))


def query_heads(nm, acc, q, qi, cos, sin, positions, eps):
    """Its parts' bounds side by side: :func:`head_rms_rope` of the query heads, :func:`indexer_query` of the
    indexer's."""
    return head_rms_rope(nm, acc, q, cos, sin, positions, eps), indexer_query(nm, acc, qi, cos, sin, positions)


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
    lo, hi = as_f64(cache).clone(), as_f64(cache).clone()
    lo[slots[done], block[done]], hi[slots[done], block[done]] = entry.lo[done], entry.hi[done]
    return Interval(lo, hi, f"completed entries: {entry.rule}; other rows unchanged"), EXACT, EXACT
