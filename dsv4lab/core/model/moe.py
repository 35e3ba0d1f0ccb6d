"""Mixture of experts (spec §3.8): sqrt-softplus router, hash routing in the first layers, clamped SwiGLU.

Router (fp32): ``s = sqrt(softplus(x·Wᵀ))``; selection ``top-k(s + bias)`` (``noaux_tc``: the bias steers the
choice only) or, in hash layers, ``tid2eid[token id]``; weights ``s[idx]`` renormalised to sum 1, times
``route_scale``. Routed experts are FP4; the shared expert is FP8; both use the SwiGLU clamp.
"""
from __future__ import annotations

import torch
from torch import nn

from dsv4lab.core.config import ModelArgs
from dsv4lab.core.model.linear import ExpertBank, Linear


class Gate(Linear):
    """The router: a bf16 ``weight [E, D]`` applied in fp32, plus ``bias`` (selection only) or ``tid2eid``."""

    def __init__(self, args: ModelArgs, hash_routed: bool):
        super().__init__(args.dim, args.n_routed_experts, "bf16")
        self.args, self.hash_routed = args, hash_routed
        if hash_routed:
            self.register_buffer("tid2eid", torch.empty(args.vocab_size, args.n_activated_experts,
                                                        dtype=torch.int64, device="meta"))
            self.bias = None
        else:
            self.register_buffer("bias", torch.empty(args.n_routed_experts, dtype=torch.float32, device="meta"))
            self.tid2eid = None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, ops) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, D]``, ``ids [T]`` → ``(idx [T, k] expert ids, weights [T, k] in acc)``."""
        # scores, selection (stable: exact ties go to the lower expert id on every backend) and weights
        return ops.router_topk(ops.linear_f32(x, self), self, ids)


class SharedExpert(nn.Module):
    def __init__(self, dim: int, inter: int, fmt: str):
        super().__init__()
        self.w1 = Linear(dim, inter, fmt)
        self.w2 = Linear(inter, dim, fmt)
        self.w3 = Linear(dim, inter, fmt)


class MoE(nn.Module):
    """Router + routed expert bank + shared expert(s). Under expert parallelism the bank holds a range of
    experts and the routed sum is all-reduced; the shared expert is replicated."""

    def __init__(self, args: ModelArgs, layer: int, n_local_experts: int | None = None, expert_offset: int = 0):
        super().__init__()
        self.args, self.layer = args, layer
        self.gate = Gate(args, args.is_hash_layer(layer))
        self.experts = ExpertBank(n_local_experts or args.n_routed_experts, args.dim, args.moe_inter_dim,
                                  args.expert_dtype, expert_offset)
        if args.n_shared_experts == 1:
            self.shared_experts = SharedExpert(args.dim, args.moe_inter_dim, args.dtype)
        else:
            self.shared_experts = nn.ModuleList(SharedExpert(args.dim, args.moe_inter_dim, args.dtype)
                                                for _ in range(args.n_shared_experts))

    def shared_outputs(self, x: torch.Tensor, ops) -> torch.Tensor:
        """Each shared expert's output ``[S, T, D]`` (act): what ``ops.moe_output`` adds to the routed sum, in this
        order, in acc, before rounding to act (the decode step ends its MoE the same way)."""
        shared = self.shared_experts if isinstance(self.shared_experts, nn.ModuleList) else [self.shared_experts]
        outs = [ops.expert_mlp(x, se.w1, se.w2, se.w3, self.args.swiglu_limit, shared=True) for se in shared]
        return outs[0][None] if len(outs) == 1 else torch.stack(outs)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, ops, all_reduce=None, trace=None) -> torch.Tensor:
        """``x [T, D]`` (normed, act), ``ids [T]`` → ``[T, D]`` in act."""
        nm, a = ops.numerics, self.args
        if trace is not None:
            trace("input", x)
        idx, weights = self.gate(x, ids, ops)
        if trace is not None:
            trace("router_idx", idx)
            trace("router_weights", weights)
        y = ops.routed_experts(x, idx, weights, self.experts, a.swiglu_limit, trace=trace, all_reduce=all_reduce)
        shared = self.shared_outputs(x, ops)
        if trace is not None:
            trace("routed_out", y)
            trace("shared_out", shared.to(nm.acc).sum(0))
        out = ops.moe_output(y, shared)
        if trace is not None:
            trace("moe_out", out)
        return out
