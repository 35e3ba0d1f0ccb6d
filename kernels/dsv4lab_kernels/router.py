"""The MoE router after its projection, in one launch (reference: ``ReferenceOps.router_topk``).

One program per token row over all ``E`` experts: scores ``sqrt(softplus(logit))`` (or ``sigmoid``) in fp64 rounded to
fp32; the selection — the hash layers' ``tid2eid[token]``, or the top ``k`` of ``score + bias`` as one descending
sort of 64-bit keys ``(order-preserving fp32 bits) << 32 | (2^31−1−e)`` (ties to the lower expert id, ``−0 = +0``,
as torch's stable sort); the picked scores (recomputed from their logits) renormalised by their fp64 sum rounded to
fp32, divided correctly rounded, times ``route_scale``.

**Numerics and bound.** Scores are two fp64 evaluations (``log1p`` to a few ulps by Goldberg's correction) of the
reference's formula, rounded to fp32: identical except within ~1e-15 relative of an fp32 rounding boundary
(one fp32 ulp). The selection is exact given the scores (compare as sets; a tie between two experts whose biased
scores are equal is broken identically). The weights are then bit-identical, or within 3 fp32 ulps when a score
moved by one ulp (``w = s/Σs``: the ulp of ``s``, its share of the sum, and the final division).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rowops import LAUNCH_EXACT, log1p_f64, sigmoid_f64
from .launch import pdl_args, pdl_prologue

SCORE_FUNCS = {"sqrtsoftplus": 0, "sigmoid": 1}


@triton.jit
def _score(logit, SCORE: tl.constexpr):
    """fp32 logits → fp32 scores through fp64 (torch's softplus: ``x`` above 20, ``log1p(exp(x))`` below)."""
    x = logit.to(tl.float64)
    if SCORE == 0:
        s = tl.sqrt(tl.where(x > 20.0, x, log1p_f64(tl.exp(tl.minimum(x, 20.0)))))
    else:
        s = sigmoid_f64(x)
    return s.to(tl.float32)


@triton.jit
def _router_kernel(logits_ptr, bias_ptr, tid_ptr, ids_ptr, idx_ptr, w_ptr, E, K, V, route_scale, s_logit, s_out,
                   HASH: tl.constexpr, SCORE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    lrow = logits_ptr + row * s_logit
    if HASH:
        j = tl.arange(0, BLOCK_K)
        tok = tl.minimum(tl.maximum(tl.load(ids_ptr + row), 0), V - 1)
        sel = tl.load(tid_ptr + tok * K + j, mask=j < K, other=0)
    else:
        j = tl.arange(0, BLOCK_E)
        em = j < E
        s = _score(tl.load(lrow + j, mask=em, other=0.0), SCORE)
        biased = s + tl.load(bias_ptr + j, mask=em, other=0.0) + 0.0  # + 0.0: −0 and +0 compare equal
        bits = biased.to(tl.int32, bitcast=True)
        order = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # order-preserving as a signed integer
        order = tl.where(em, order, -2147483648)
        key = tl.sort((order.to(tl.int64) << 32) | (2147483647 - j).to(tl.int64), descending=True)
        sel = (2147483647 - (key & 0xFFFFFFFF)).to(tl.int64)
    picked = j < K
    w = _score(tl.load(lrow + sel, mask=picked, other=0.0), SCORE)
    w = tl.where(picked, w, 0.0)
    total = tl.sum(w.to(tl.float64), axis=0).to(tl.float32)
    w = tl.math.div_rn(w, tl.full(w.shape, 1.0, tl.float32) * total) * route_scale
    tl.store(idx_ptr + row * s_out + j, sel, mask=picked)
    tl.store(w_ptr + row * s_out + j, w, mask=picked)


def router_topk(logits: torch.Tensor, k: int, route_scale: float, score_func: str,
                bias: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
                ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` (fp32) → ``(idx [T, k] int64, weights [T, k] fp32)``; ``tid2eid [V, k]`` with ``ids [T]``
    for a hash-routed layer, else ``bias [E]``."""
    T, E = logits.shape
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"router kernel: score function {score_func!r} (kernels for {', '.join(SCORE_FUNCS)})")
    hashed = tid2eid is not None
    assert logits.dtype == torch.float32 and logits.stride(-1) == 1
    if hashed:
        tid2eid = tid2eid.contiguous()  # the kernel reads row t at t·k (a sliced table would be misread)
    idx = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    w = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    if T:
        _router_kernel[(T,)](logits, bias if not hashed else logits, tid2eid if hashed else idx,
                             ids if hashed else idx, idx, w, E, k, tid2eid.shape[0] if hashed else 1,
                             float(route_scale), logits.stride(0), idx.stride(0), HASH=hashed,
                             SCORE=SCORE_FUNCS[score_func], BLOCK_E=triton.next_power_of_2(E),
                             BLOCK_K=max(2, triton.next_power_of_2(k)), num_warps=4, **LAUNCH_EXACT,
                             **pdl_args(logits.device))
    return idx, w


__all__ = ["router_topk", "SCORE_FUNCS"]
