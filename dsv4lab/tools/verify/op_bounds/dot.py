"""Bounds of the dot-product ops: the projections (``linear``, ``linear_f32``, their stacked groups, the grouped
``wo_a``) and the routed and shared experts stage by stage — exact products, ``γ_K(acc)·Σ|terms|`` for the K-term
sum, then the reference's roundings, intervals carried through the activation quantizer between stages."""
from __future__ import annotations

import torch

from dsv4lab.core import quant
from dsv4lab.tools.verify.bounds import BLOCKED, Interval, elementwise_roundoff
from dsv4lab.tools.verify.op_bounds.intervals import (F64, act_int8_interval, as_f64, maybe_act_quant, point,
                                                      swiglu_interval)


def linear(nm, acc, x, lin, all_reduce=None):
    """Activation quantization (same input, same quantizer: exact), a K-term dot product in ``acc``, rounded to
    fp32 then to ``act``."""
    xq = quant.act_qdq_fp8(x) if nm.act_quant and lin.act_quant else x
    return point(xq).matmul(lin.dequantized(F64), acc).round(nm.acc).round(nm.act)


def linear_f32(nm, acc, x, lin):
    return point(x).matmul(lin.dequantized(F64), acc).round(nm.acc)


def linear_group(nm, acc, x, lins):
    """Each projection's :func:`linear` bound (one input, several weights)."""
    return tuple(linear(nm, acc, x, lin) for lin in lins)


def linear_f32_group(nm, acc, x, lins):
    return tuple(linear_f32(nm, acc, x, lin) for lin in lins)


def projections(nm, acc, x, calls):
    """Every call's bound, flattened as the op flattens its outputs (a group's members one after the other)."""
    parts = {"linear": linear, "linear_f32": linear_f32, "linear_group": linear_group,
             "linear_f32_group": linear_f32_group}
    out: list = []
    for op, w in calls:
        b = parts[op](nm, acc, x, w)
        out += list(b) if isinstance(b, tuple) else [b]
    return tuple(out)


def grouped_wo_a(nm, acc, o, lin, groups):
    w = lin.dequantized(F64).view(groups, -1, o.shape[-1])
    parts = [point(o[..., g, :]).matmul(w[g], acc) for g in range(groups)]
    iv = Interval(torch.stack([p.lo for p in parts], -2), torch.stack([p.hi for p in parts], -2), parts[0].rule)
    return iv.round(nm.acc).round(nm.act)


def promoted_fp8_model(block_k: int, k: int) -> str:
    """The accumulation model of a ``k``-term dot product evaluated as the FP8 kernels evaluate it, derived: the
    grouped MoE's ``fp8`` and ``fp8lut`` routes (``kernels/dsv4lab_kernels/fp4_moe_grouped.py``,
    ``fp4_moe_fp8lut.py``) and the FP8 block GEMM, each promoting its MMA partial once per ``block_k``-wide K tile.
    Returns ``"fp8_mma"``, whose bound (:func:`~dsv4lab.tools.verify.bounds.gamma`,
    :data:`~dsv4lab.tools.verify.bounds.BLOCKED`) is ``γ_min(k,128)(2^-13) + γ_⌈k/128⌉(2^-23)`` of ``Σ|terms|``.

    Per output and K tile:

    1. every operand is exact: the weight as E4M3 times a power of two (``fp8lut``: ``e2m1 · 2^(s − top + 6)`` is
       a normal E4M3 value or zero for ``s − top`` in [−11, 0], which the route checks per bank; ``fp8``: the same
       within 14 binades), the activation as the reference's own ``x_q · s_x`` (E4M3 times a power of two);
    2. so every product ``e4m3 · x_q`` is exact (4 × 4 significant bits), and the tile's ``block_k`` products are
       summed in the FP8 MMA, which keeps about 14 significant bits of its running sum: ``γ_block_k(2^-13)``;
    3. the partial is multiplied by powers of two (the weight's unit, the activation's scale): exact while it stays
       in fp32's normal range, which the routes' scale checks keep (``fp8lut``: scale bytes 7 … 254) — a tile must
       not straddle two activation blocks, so ``block_k`` divides 128;
    4. the ⌈k/block_k⌉ partials are added in fp32 on CUDA cores (RN: u = 2^-24, within the model's 2^-23).

    For ``block_k = 128`` that is the model term by term. A narrower tile ``b`` gives ``γ_b(2^-13) +
    γ_⌈k/b⌉(2^-23)``: against the model its inner term is smaller by at least ``(min(k,128) − b)·2^-13``
    (``≥ 2^-8`` whenever ``k > b``) and its outer term larger by at most ``⌈k/b⌉·2^-23·(1+ε) ≤ k·2^-28`` (``b ≥
    32``), so the model still holds for ``k ≤ 2^20`` (every width of the model: 4,096 at most).

    Raises ValueError for a tile or a length the model does not cover."""
    block, _ = BLOCKED["fp8_mma"]
    if block_k < 32 or block % block_k:
        raise ValueError(f"an FP8 partial of {block_k} terms per promotion: the fp8_mma model covers tiles of 32, "
                         f"64 or {block} (dividing the {block}-wide activation block)")
    if block_k < block and k > 2 ** 20:
        raise ValueError(f"{k} terms promoted every {block_k}: beyond the fp8_mma model's outer sum (k ≤ 2^20)")
    return "fp8_mma"


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
    xq = quantizer(x_iv) if quantizer is not None else maybe_act_quant(x_iv, nm)

    def proj(which):
        def rows(e, tok, slot):
            sub = Interval(xq.lo[tok], xq.hi[tok], xq.rule)
            return sub.matmul(bank.dequantized(which, e, F64), acc, terms=terms).round(nm.acc).round(nm.act)
        return _per_expert((T, k, bank.inter), idx, bank, rows)
    return proj("w1"), proj("w3")


def moe_stage1(nm, acc, x, idx, bank):
    """Per routed slot, the w1 and w3 dot products (K = dim) of the quantized token, each rounded to act."""
    return _stage1(nm, acc, point(x), idx, bank)


def _stage2(nm, acc, h_iv: Interval, idx, bank, quantizer=None, terms=None):
    """``h`` rounded to act and FP8-quantized (an interval: flips allowed), the w2 dot (K = inter), rounded."""
    T, k, _ = h_iv.lo.shape
    h_act = h_iv.round(nm.act)
    hq = quantizer(h_act) if quantizer is not None else maybe_act_quant(h_act, nm)

    def rows(e, tok, slot):
        sub = Interval(hq.lo[tok, slot], hq.hi[tok, slot], hq.rule)
        return sub.matmul(bank.dequantized("w2", e, F64), acc, terms=terms).round(nm.acc).round(nm.act)
    return _per_expert((T, k, bank.dim), idx, bank, rows)


def moe_stage2(nm, acc, h, idx, bank):
    return _stage2(nm, acc, point(h), idx, bank)


def _activation(nm, acc, g: Interval, up: Interval, weights, limit):
    u = elementwise_roundoff(acc)
    h = swiglu_interval(g, up, limit, u).mul(as_f64(weights)[..., None])
    return h.widen(u * h.mag, "× routing weight").round(nm.acc)


def moe_activation(nm, acc, g, u, weights, limit):
    return _activation(nm, acc, point(g), point(u), weights, limit)


def moe_combine(nm, acc, out, idx, all_reduce=None):
    """Σ over the k slots (NaN slots skipped) in ``acc``."""
    return point(out).sum(1, acc).round(nm.acc)


def moe_output(nm, acc, routed, shared):
    """The routed sum plus each shared expert's output, one rounding in ``acc`` per addition, then act."""
    y, u = point(routed), elementwise_roundoff(acc)
    for s in shared:
        y = y.add(point(s))
        y = y.widen(u * y.mag, "+ shared expert in acc")
    return y.round(nm.act)


def routed_experts(nm, acc, x, idx, weights, bank, limit, trace=None, all_reduce=None):
    """The whole routed MoE as one chain of intervals: stage 1 → activation → act rounding and FP8 quantization
    of ``h`` (where a last-bit difference in ``g`` or ``u`` may flip a bf16 and then an FP8 rounding) → stage 2 →
    the sum over slots."""
    g, up = _stage1(nm, acc, point(x), idx, bank)
    h = _activation(nm, acc, g, up, weights, limit)
    out = _stage2(nm, acc, h, idx, bank)
    return out.sum(1, acc, "Σ slots").round(nm.acc)


def moe_stage1_int8(nm, acc, x, idx, bank):
    """Stage 1 along the paper's INT8 route (see :func:`routed_experts_int8`)."""
    return _stage1(nm, acc, point(x), idx, bank, act_int8_interval, terms=bank.dim // 32 + 3)


def routed_experts_int8(nm, acc, x, idx, weights, bank, limit):
    """The routed MoE along the paper's INT8 route (its own quantization: per-32 INT8 activations with scale
    amax/127), with the reference's rounding points — the bound of ``fp4_moe_decode.reference_int8_moe``. Each
    projection sums K/32 exact integer group dots, each scaled by three fp32 factors: ``K/32 + 3`` roundings."""
    q = act_int8_interval
    g, up = _stage1(nm, acc, point(x), idx, bank, q, terms=bank.dim // 32 + 3)
    h = _activation(nm, acc, g, up, weights, limit)
    out = _stage2(nm, acc, h, idx, bank, q, terms=bank.inter // 32 + 3)
    return out.sum(1, acc, "Σ slots").round(nm.acc)


def expert_down(nm, acc, g, u, w2, limit):
    """:func:`expert_mlp`'s second half from the projections' act outputs: SwiGLU in fp32, act rounding and FP8
    quantization of its output (flips allowed), the w2 projection."""
    h = swiglu_interval(point(g), point(u), limit, elementwise_roundoff(acc))
    h = maybe_act_quant(h.round(nm.acc).round(nm.act), nm, w2.act_quant)
    return h.matmul(w2.dequantized(F64), acc).round(nm.acc).round(nm.act)


def expert_mlp(nm, acc, x, w1, w2, w3, limit, weight=None, shared=False):
    """The shared expert as a chain: two projections rounded to act, SwiGLU in fp32, act rounding and FP8
    quantization of its output (flips allowed), the w2 projection."""
    u = elementwise_roundoff(acc)
    xq = maybe_act_quant(point(x), nm, w1.act_quant)
    g = xq.matmul(w1.dequantized(F64), acc).round(nm.acc).round(nm.act)
    up = xq.matmul(w3.dequantized(F64), acc).round(nm.acc).round(nm.act)
    h = swiglu_interval(g, up, limit, u)
    if weight is not None:
        h = h.mul(as_f64(weight))
        h = h.widen(u * h.mag, "× weight")
    h = maybe_act_quant(h.round(nm.acc).round(nm.act), nm, w2.act_quant)
    return h.matmul(w2.dequantized(F64), acc).round(nm.acc).round(nm.act)
