"""Faults in a *backend* (a kernel that reads the wrong layout, an accumulation in bf16), for the verification tests.

A faulted checkpoint makes the reference and every backend agree with each other; it is caught by comparing the
reference run with the golden digests (``verify.layers``). A faulted backend computes the wrong thing from the
right weights; it is caught by the stage-isolated replay (``verify.stages``). :func:`inject_backend_fault` turns a
loaded runner's backend — any backend — into a faulted one:

* ``w2_one_expert`` — the routed-expert down projection of one expert of one layer is read through the paper's
  mismatched pre-shuffled layout (16-row blocks inside each 128-row tile in the order ``[0,2,4,6,1,3,5,7]``,
  scales alike), by every op that reads that bank (``routed_experts``, ``moe_stage2``);
* ``bf16_accumulation`` — one projection (``attn.wo_b`` of one layer) accumulates its dot products in bf16,
  rounding the running sum every 32 terms, as a kernel with a bf16 accumulator would.
"""
from __future__ import annotations

import copy

import torch

from dsv4lab.core import quant
from dsv4lab.core.layouts import FAULTS

BACKEND_FAULTS = {
    "w2_one_expert": "routed-expert W2 of one expert of one layer read through the paper's permuted tile layout",
    "bf16_accumulation": "one projection (attn.wo_b of one layer) accumulated in bf16, rounded every 32 terms",
}
DEFAULT_TARGET = dict(layer=1, expert=5)


def permuted_w2_bank(bank, expert: int):
    """A shallow copy of ``bank`` whose W2 (and its scales) for global ``expert`` has the paper's row permutation."""
    layout = FAULTS["paper_w2_blocks"].layout
    local = expert - bank.expert_offset
    w2, s2 = bank.w2.clone(), bank.w2_scale.clone()
    w, s = layout.apply(bank.w2[local], bank.w2_scale[local])
    w2[local], s2[local] = w.view(w2.dtype), s.view(s2.dtype)
    faulted = copy.copy(bank)
    faulted._buffers = dict(bank._buffers, w2=w2, w2_scale=s2)
    faulted._deq = {}
    return faulted


def bf16_accumulated_linear(x: torch.Tensor, lin, numerics, chunk: int = 32) -> torch.Tensor:
    """The reference's ``linear`` with its K-sum held in bf16 (rounded every ``chunk`` terms)."""
    xq = quant.act_qdq_fp8(x) if numerics.act_quant and lin.act_quant else x.float()
    w = lin.dequantized(torch.float32)
    acc = torch.zeros(*x.shape[:-1], lin.out_features, dtype=torch.bfloat16, device=x.device)
    for k0 in range(0, lin.in_features, chunk):
        part = xq[..., k0:k0 + chunk].float() @ w[:, k0:k0 + chunk].T
        acc = (acc.float() + part).to(torch.bfloat16)
    return acc.to(numerics.act)


def inject_backend_fault(runner, fault: str, layer: int | None = None, expert: int | None = None):
    """Replace ``runner.ops`` by a faulted copy of itself (its class subclassed); returns the runner."""
    if fault not in BACKEND_FAULTS:
        raise ValueError(f"unknown backend fault {fault!r}; known: {', '.join(BACKEND_FAULTS)}")
    layer = DEFAULT_TARGET["layer"] if layer is None else layer
    expert = DEFAULT_TARGET["expert"] if expert is None else expert
    if not 0 <= layer < len(runner.model.layers):
        raise ValueError(f"backend fault {fault}: layer {layer} is not in [0, {len(runner.model.layers)})")
    base = type(runner.ops)
    ffn = runner.model.layers[layer].ffn
    if fault == "w2_one_expert":
        if not ffn.experts.owns(expert):
            raise ValueError(f"backend fault {fault}: expert {expert} is not held by layer {layer}'s bank")
        target, faulted_bank = ffn.experts, permuted_w2_bank(ffn.experts, expert)

        class Faulted(base):
            def routed_experts(self, x, idx, weights, bank, *args, **kwargs):
                return super().routed_experts(x, idx, weights, faulted_bank if bank is target else bank, *args,
                                              **kwargs)

            def moe_stage2(self, h, idx, bank, *args, **kwargs):
                return super().moe_stage2(h, idx, faulted_bank if bank is target else bank, *args, **kwargs)
    else:
        target = runner.model.layers[layer].attn.wo_b

        class Faulted(base):
            def linear(self, x, lin, *args, **kwargs):
                if lin is target:
                    return bf16_accumulated_linear(x, lin, self.numerics)
                return super().linear(x, lin, *args, **kwargs)

    faulted = copy.copy(runner.ops)
    faulted.__class__ = Faulted
    Faulted.__name__ = f"{base.__name__}+{fault}"
    faulted.name = f"{runner.ops.name}+{fault}"
    faulted.fault = dict(name=fault, layer=layer, expert=expert if fault == "w2_one_expert" else None)
    runner.ops = faulted
    return runner


__all__ = ["BACKEND_FAULTS", "inject_backend_fault", "permuted_w2_bank", "bf16_accumulated_linear"]
