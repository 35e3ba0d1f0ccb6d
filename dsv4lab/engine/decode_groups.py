"""Projections of one input, stored side by side so that the decode step computes them in one launch.

At batch 1 a decode projection of a few MB costs about as much in launch, ramp-up and tail as in reading its bytes;
the step has several that read the same input:

========================== ================================================= ============ =========================
input                      projections                                       format       op
========================== ================================================= ============ =========================
the attention input ``x``  ``wq_a``, ``wkv``                                 FP8          ``linear_group``
the attention input ``x``  each compressor's ``wkv``, ``wgate`` (index, main) BF16 → fp32  ``linear_f32_group``
the query latent ``qr``    ``wq_b``, the indexer's ``wq_b`` (CSA)            FP8          ``linear_group``
the MoE input              the shared expert's ``w1``, ``w3``                 FP8          (inside ``expert_mlp``)
========================== ================================================= ============ =========================

:func:`group_projections` concatenates each set's weights (and FP8 block scales) once and makes every member's
buffers views of its rows of the result — the same values, the same memory, so every other path (the reference,
prefill kernels, a state dict) sees nothing different. A backend finds the set of its arguments with
:func:`group_of` and runs one GEMV over the whole weight, writing each member's output to its own contiguous block
(:func:`dsv4lab_kernels.fp8_gemv.fp8_gemv` ``segments``). A set is formed only where it is exact to do so: members of
one format, one input width, one activation quantization; FP8 members whose row counts are multiples of 128 (so the
block scales stack); at most 4 members. Anything else stays a separate projection.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4lab.core.model.linear import Linear

MAX_MEMBERS = 4


@dataclass(frozen=True)
class ProjectionGroup:
    """Weights of ``members`` stacked along the output dimension (``sizes`` rows each)."""

    members: tuple[Linear, ...]
    weight: torch.Tensor
    scale: torch.Tensor | None
    sizes: tuple[int, ...]

    def intact(self) -> bool:
        """Whether every member still holds its rows of the stacked weight (not replaced since grouping)."""
        row = self.weight.stride(0) * self.weight.element_size()
        start = 0
        for lin, n in zip(self.members, self.sizes):
            if lin.weight.data_ptr() != self.weight.data_ptr() + start * row:
                return False
            start += n
        return True


def groupable(lins: tuple[Linear, ...]) -> str | None:
    """Why ``lins`` cannot share one launch (None if they can)."""
    if not 2 <= len(lins) <= MAX_MEMBERS:
        return f"{len(lins)} members (2 to {MAX_MEMBERS} are grouped)"
    first = lins[0]
    for lin in lins:
        if (lin.fmt, lin.in_features, lin.act_quant, lin.weight.dtype, lin.weight.device) != (
                first.fmt, first.in_features, first.act_quant, first.weight.dtype, first.weight.device):
            return "members differ in format, input width, activation quantization or device"
        if lin.fmt not in ("fp8", "bf16", "f32") or lin.weight.device.type == "meta":
            return f"{lin.fmt} weights"
        if lin.fmt == "fp8" and lin.out_features % 128:
            return f"FP8 rows {lin.out_features} not a multiple of 128 (the block scales would not stack)"
    return None


@torch.no_grad()
def group(lins: tuple[Linear, ...]) -> ProjectionGroup | None:
    """Stack the weights of ``lins`` (see the module doc); returns the group, or None where they cannot share a
    launch. Grouping an already grouped set returns its group."""
    existing = group_of(lins)
    if existing is not None:
        return existing
    if groupable(lins) is not None:
        return None
    weight = torch.cat([lin.weight for lin in lins])
    scale = torch.cat([lin.scale for lin in lins]) if lins[0].scale is not None else None
    row, srow = 0, 0
    for lin in lins:
        n = lin.out_features
        lin._buffers["weight"] = weight[row:row + n]
        if scale is not None:
            ns = lin.scale.shape[0]
            lin._buffers["scale"] = scale[srow:srow + ns]
            srow += ns
        row += n
    g = ProjectionGroup(tuple(lins), weight, scale, tuple(lin.out_features for lin in lins))
    for lin in lins:
        lin.__dict__["decode_group"] = g  # a plain attribute: not a submodule, not in the state dict
    return g


def group_of(lins: tuple[Linear, ...]) -> ProjectionGroup | None:
    """The group made of exactly ``lins``, in this order, still intact — or None."""
    g = lins[0].__dict__.get("decode_group") if lins else None
    if g is None or len(g.members) != len(lins) or any(a is not b for a, b in zip(g.members, lins)):
        return None
    return g if g.intact() else None


def step_groups(blk) -> list[tuple[Linear, ...]]:
    """The sets of one block the decode step computes together (see the module doc's table)."""
    attn = blk.attn
    sets = [(attn.wq_a, attn.wkv)]
    if attn.indexer is not None:
        sets.append((attn.wq_b, attn.indexer.wq_b))
    comps = [c for c in (attn.indexer.compressor if attn.indexer is not None else None, attn.compressor) if c]
    if comps:
        sets.append(tuple(lin for c in comps for lin in (c.wkv, c.wgate)))
    shared = blk.ffn.shared_experts
    for se in shared if isinstance(shared, torch.nn.ModuleList) else [shared]:
        if se is not None:
            sets.append((se.w1, se.w3))
    return sets


def group_projections(model) -> int:
    """Group every set of every block of ``model`` that can be grouped; returns how many groups exist. The runner
    does it when it is built (:class:`~dsv4lab.engine.runner.ModelRunner`): stacking allocates the stacks and frees
    the members' own weights, so it must come before any CUDA graph records a weight's address."""
    made = 0
    blocks = model.blocks() if hasattr(model, "blocks") else model.layers  # (a one-layer bench model)
    for blk in blocks:
        for lins in step_groups(blk):
            made += group(lins) is not None
    return made


__all__ = ["ProjectionGroup", "MAX_MEMBERS", "groupable", "group", "group_of", "step_groups", "group_projections"]
