"""Exact oracles of the routed-MoE decode (:mod:`dsv4lab_kernels.fp4_moe_decode`): the INT8 route's own arithmetic
as the paper describes it, and each stage's exact value, ``Σ|terms|`` and reduction length per ``[T, k]`` slot for
every route — what the tests and the benchmark check the kernels against (within the bound of
``fp4_moe_decode.ACCUMULATION``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsv4lab.core import quant

if TYPE_CHECKING:
    from .fp4_moe_decode import ExpertTensors


def _int8_group_terms(a: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The INT8 route's per-group terms ``[M, N, K/32]`` (fp64) of activation rows ``a [M, K]``: per-32 INT8
    activations, ``2·E2M1`` int8 weights, exact integer group dots, times both scales / 2."""
    xq, xs = quant.act_quant_int8(a.float(), 32)
    codes = quant.unpack_fp4(w_packed).long()
    w2x = torch.tensor(quant.E2M1_TIMES2_INT8, dtype=torch.int64, device=codes.device)[codes]
    M, K = xq.shape
    N = w2x.shape[0]
    dots = torch.einsum("mgk,ngk->mng", xq.long().view(M, K // 32, 32).double(), w2x.view(N, K // 32, 32).double())
    return dots * quant.e8m0_decode(w_scale, torch.float64)[None] * xs.double()[:, None, :] * 0.5


def reference_int8_route(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Oracle of the INT8 route for one weight: ``x [M, K]`` → ``[M, N]`` fp64, computed as the paper describes
    (per-32 INT8 activations, ``2·E2M1`` int8 weights, exact integer group dots, then both scales / 2)."""
    return _int8_group_terms(x, w_packed, w_scale).sum(-1)


def reference_int8_moe(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, ex: ExpertTensors,
                       limit: float) -> torch.Tensor:
    """Oracle of the whole routed MoE along the INT8 route: :func:`reference_int8_route` for each projection with
    the reference's rounding points (bf16 projection outputs, SwiGLU in fp32 with the silu in fp64, a bf16 input
    to the down projection, an exact sum over slots). Experts outside ``ex`` are skipped. Returns ``[T, D]`` fp32."""
    T, k = idx.shape
    y = torch.zeros(T, ex.dim, dtype=torch.float64, device=x.device)
    for t in range(T):
        for s in range(k):
            e = int(idx[t, s]) - ex.expert_offset
            if not 0 <= e < ex.n_experts:
                continue
            g = reference_int8_route(x[t:t + 1], ex.w1[e], ex.w1_scale[e]).float().bfloat16().float()
            u = reference_int8_route(x[t:t + 1], ex.w3[e], ex.w3_scale[e]).float().bfloat16().float()
            if limit > 0:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            h = torch.nn.functional.silu(g.double()).float() * u * weights[t, s].float()
            y[t] += reference_int8_route(h.bfloat16(), ex.w2[e], ex.w2_scale[e]).float().bfloat16().double()[0]
    return y.float()


@dataclass
class StageOracle:
    """A stage's exact oracle for each ``[T, k]`` slot: ``ref`` (the act-rounded output the kernel must
    reproduce), ``magnitude`` ``Σ|terms|`` of each output (fp64) and ``terms`` (the reduction length), NaN where
    the slot's expert is not in the bank — what :func:`dsv4lab.tools.verify.bounds.check_within_bound` needs."""

    ref: torch.Tensor
    magnitude: torch.Tensor
    terms: int


def _slot_projection(a: torch.Tensor, w: torch.Tensor, s: torch.Tensor, route: str, act_quant: bool):
    """One slot's projection oracle: ``(value fp64, Σ|terms| fp64, terms)`` for activation rows ``a [M, K]``."""
    if route == "int8":
        terms = _int8_group_terms(a, w, s)
        return terms.sum(-1), terms.abs().sum(-1), a.shape[-1] // 32 + 1  # one fp32 product rounding per group
    xq = (quant.act_qdq_fp8(a.float()) if act_quant else a.float()).double()
    wd = quant.fp4_dequant(w, s, torch.float64)
    return xq @ wd.T, xq.abs() @ wd.abs().T, a.shape[-1]


def reference_stage1(x: torch.Tensor, idx: torch.Tensor, ex: ExpertTensors, route: str = "dot",
                     act_quant: bool = True) -> tuple[StageOracle, StageOracle]:
    """Oracles of ``(g, u)`` ``[T, k, I]`` for :func:`moe_gate_up` (``write_gu``): the route's arithmetic
    evaluated exactly, rounded to fp32 then bf16 as the reference's Linear."""
    T, k = idx.shape
    shape = (T, k, ex.inter)
    out = [torch.full(shape, float("nan"), dtype=torch.float64, device=x.device) for _ in range(4)]
    terms = ex.dim
    for t in range(T):
        for j in range(k):
            e = int(idx[t, j]) - ex.expert_offset
            if not 0 <= e < ex.n_experts:
                continue
            for o, (w, s) in enumerate(((ex.w1[e], ex.w1_scale[e]), (ex.w3[e], ex.w3_scale[e]))):
                v, mag, terms = _slot_projection(x[t:t + 1], w, s, route, act_quant)
                out[2 * o][t, j] = v[0].float().bfloat16().double()
                out[2 * o + 1][t, j] = mag[0]
    return StageOracle(out[0], out[1], terms), StageOracle(out[2], out[3], terms)


def reference_stage2(h: torch.Tensor, idx: torch.Tensor, ex: ExpertTensors, route: str = "dot",
                     act_quant: bool = True) -> StageOracle:
    """Oracle of the per-slot down projection ``[T, k, D]`` for :func:`moe_down` (``per_slot``) of a given
    ``h [T, k, I]`` (bf16, as the kernel reads it)."""
    T, k, _ = h.shape
    ref = torch.full((T, k, ex.dim), float("nan"), dtype=torch.float64, device=h.device)
    mag = ref.clone()
    terms = ex.inter
    for t in range(T):
        for j in range(k):
            e = int(idx[t, j]) - ex.expert_offset
            if not 0 <= e < ex.n_experts:
                continue
            v, m, terms = _slot_projection(h[t, j:j + 1].bfloat16(), ex.w2[e], ex.w2_scale[e], route, act_quant)
            ref[t, j] = v[0].float().bfloat16().double()
            mag[t, j] = m[0]
    return StageOracle(ref, mag, terms)
