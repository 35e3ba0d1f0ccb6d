"""The fault catalogue: real bug classes as layouts, and faulted checkpoint copies for drills.

:data:`FAULTS` maps a name to a :class:`Fault` — what a bug does to the stored tensors of the linears it hits (the
paper's W2 block permutation, a pre-shuffled W1 read as row-major, swapped FP4 nibbles, scales that did not follow
their rows, a gate/up interleave applied to W2). :func:`inject_fault_into_checkpoint` writes a faulted copy (the
original is never touched); :func:`dsv4lab.core.layouts.survey.fingerprint_checkpoint` finds them again.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from dsv4lab.core.checkpoint import Checkpoint
from dsv4lab.core.errors import LayoutError
from dsv4lab.core.layouts.algebra import PRESHUFFLE_16x16, GateUpInterleave, Layout, NibbleSwap, paper_w2_permutation
from dsv4lab.core.layouts.formats import format_of_dtype_code, logical_shape
from dsv4lab.core.layouts.repair import RepairRule, linear_name, natural_key, rewrite_checkpoint


@dataclass(frozen=True)
class Fault:
    """A real bug class: ``layout`` is what the bug does to the stored tensors of the linears matching
    ``tensors`` (a glob on linear names), by default only in ``layers`` / ``experts`` when given."""

    name: str
    description: str
    tensors: str
    layout: Layout
    layers: tuple[int, ...] | None = None
    experts: tuple[int, ...] | None = None

    def inject(self, weight: torch.Tensor, scale: torch.Tensor | None = None):
        """Fault a native ``(weight, scale)`` pair."""
        return self.layout.apply(weight, scale)

    def repair(self, weight: torch.Tensor, scale: torch.Tensor | None = None):
        """Undo :meth:`inject`."""
        return self.layout.invert(weight, scale)

    def repair_rule(self) -> RepairRule:
        return RepairRule(self.layout, glob=self.tensors, description=f"undo fault {self.name}")

    def targets(self, linears: Iterable[str], *, tensors: str | None = None, layers=None, experts=None) -> list[str]:
        """The linears this fault hits among ``linears`` (overrides replace the fault's defaults)."""
        glob = tensors or self.tensors
        layers = self.layers if layers is None else tuple(layers)
        experts = self.experts if experts is None else tuple(experts)
        out = []
        for lin in linears:
            if not fnmatch.fnmatchcase(lin, glob):
                continue
            m = re.match(r"^(?:layers|mtp)\.(\d+)\.", lin)
            if layers is not None and not (m and lin.startswith("layers.") and int(m.group(1)) in layers):
                continue
            e = re.search(r"\.experts\.(\d+)\.", lin)
            if experts is not None and not (e and int(e.group(1)) in experts):
                continue
            out.append(lin)
        return out


FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("paper_w2_blocks",
          "The paper's bug: the routed-expert down projection (W2) read through a mismatched pre-shuffled layout, "
          "so 16-row blocks inside each 128-row tile come out in the order [0,2,4,6,1,3,5,7] (weights and scales "
          "alike). Stage 1 stays correct, stage 2 does not.",
          "*.ffn.experts.*.w2", paper_w2_permutation()),
    Fault("writer_preshuffle",
          "A converter stored the routed-expert gate projection (W1) pre-shuffled into (N/16, K/32, 2, 16, 16) "
          "tiles for a kernel, and the reader used it as row-major.",
          "*.ffn.experts.*.w1", PRESHUFFLE_16x16),
    Fault("swapped_nibbles",
          "One expert's FP4 bytes were packed with the high nibble first (element 2c in the high nibble): every "
          "pair of adjacent columns of w1/w2/w3 is exchanged.",
          "layers.*.ffn.experts.*.w[123]", NibbleSwap(), layers=(1,), experts=(5,)),
    Fault("scales_not_permuted",
          "W2's rows were permuted (the paper's block permutation) but its E8M0 scales were left in place, so each "
          "row is decoded with another row's scales.",
          "*.ffn.experts.*.w2", paper_w2_permutation(scales="keep")),
    Fault("paper_w2_one_expert",
          "The paper's W2 block permutation confined to one expert of one layer (layers.1, expert 5): only the "
          "tokens routed to that expert see a wrong stage 2, so a model-level KL barely moves.",
          "layers.*.ffn.experts.*.w2", paper_w2_permutation(), layers=(1,), experts=(5,)),
    Fault("gate_up_interleave_w2",
          "The gate/up row interleave meant for the fused w1‖w3 was also applied to W2: its two row halves "
          "alternate row by row.",
          "*.ffn.experts.*.w2", GateUpInterleave("rows", 1)),
)}
"""The fault catalogue: name → :class:`Fault`."""


def checkpoint_linears(checkpoint, quantized_only: bool = True) -> list[str]:
    """Linear names of a checkpoint (a ``.weight`` with a ``.scale``, or any 2-D ``.weight`` when
    ``quantized_only`` is false), in natural order."""
    out = []
    for name, info in checkpoint.tensors.items():
        base, role = linear_name(name)
        if role != "weight" or len(info.shape) != 2:
            continue
        if not quantized_only or base + ".scale" in checkpoint.tensors:
            out.append(base)
    return sorted(out, key=natural_key)


def inject_fault_into_checkpoint(src: str | Path, fault: Fault | str, out: str | Path, *, layers=None, experts=None,
                                 tensors: str | None = None, overwrite: bool = False,
                                 progress: bool = False) -> list[str]:
    """Write a copy of ``src`` with ``fault`` injected (the original is never touched); returns the linears hit.

    ``layers`` / ``experts`` / ``tensors`` override the fault's defaults (layer indices refer to ``layers.N``).
    """
    if isinstance(fault, str):
        if fault not in FAULTS:
            raise LayoutError(f"unknown fault {fault!r} (known: {', '.join(FAULTS)})")
        fault = FAULTS[fault]
    ck = Checkpoint(src)
    hit = fault.targets(checkpoint_linears(ck, quantized_only=False), tensors=tensors, layers=layers, experts=experts)
    if not hit:
        raise LayoutError(f"fault {fault.name}: no linear of {src} matches {tensors or fault.tensors!r} "
                          f"(layers={layers if layers is not None else fault.layers}, "
                          f"experts={experts if experts is not None else fault.experts})")
    targets = set(hit)

    def info_of(name):
        base, role = linear_name(name)
        w = ck.tensors[base + ".weight"]
        return base, role, format_of_dtype_code(w.dtype), w.shape

    def transform(name, t):
        base, role = linear_name(name)
        if base not in targets or role is None:
            return t
        _, _, fmt, wshape = info_of(name)
        return fault.layout.transform(t, role, fmt, logical_shape(wshape, fmt), inverse=False)

    def shape_of(name, shape):
        base, role = linear_name(name)
        if base not in targets or role is None:
            return shape
        return fault.layout.shape_after(shape, role, info_of(name)[2], inverse=False)

    rewrite_checkpoint(src, out, transform, shape_of, overwrite=overwrite, progress=progress)
    return hit


__all__ = ["Fault", "FAULTS", "checkpoint_linears", "inject_fault_into_checkpoint"]
