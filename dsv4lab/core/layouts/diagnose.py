"""One stored linear against its reference: which layout, if any, explains the difference.

:func:`diagnose_linear` tries the hypotheses in order — as stored; the output-row fingerprint with the scales
following, then with the scales left in place; the catalogue's layouts; the input-column fingerprint — each by
undoing it on the stored bytes and measuring the residual against a reference op or :class:`Recorded` arrays.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from dsv4lab.core import quant
from dsv4lab.core.errors import LayoutError
from dsv4lab.core.layouts.algebra import PRESHUFFLE_16x16, PRESHUFFLE_32x16, Inverse, KMajor, Layout, NibbleSwap
from dsv4lab.core.layouts.catalogue import FAULTS
from dsv4lab.core.layouts.fingerprint import FingerprintResult, fingerprint, fingerprint_recorded, probe_inputs, relative_error
from dsv4lab.core.layouts.formats import FP4_GROUP, FP8_BLOCK, Side, linear_op, logical_shape, weight_format


@dataclass
class Recorded:
    """Recorded inputs ``[n, in]`` and outputs ``[n, out]`` of one linear from a trusted run."""

    inputs: torch.Tensor
    outputs: torch.Tensor


@dataclass
class Diagnosis:
    """How a stored linear relates to its reference.

    ``layout`` is how the suspect is stored (``None``: as the reference); ``exact`` means that undoing it gives a
    residual within tolerance. ``tried`` lists each hypothesis checked with its residual.
    """

    name: str
    layout: Layout | None
    exact: bool
    residual_before: float
    residual_after: float
    rows: FingerprintResult | None = None
    cols: FingerprintResult | None = None
    tried: list[tuple[str, float]] = field(default_factory=list)

    @property
    def description(self) -> str:
        if self.layout is None:
            return "as the reference" if self.exact else "unexplained"
        return self.layout.describe()

    def summary(self) -> str:
        verdict = "exact" if self.exact else "NOT explained"
        return (f"{self.name}: {self.description} — {verdict} (residual {self.residual_before:.3g} → "
                f"{self.residual_after:.3g})")


class ResidualEvaluator:
    """The residual of a candidate stored linear against a reference op or recorded arrays."""

    def __init__(self, reference, in_features: int, n_eval: int = 64, seed: int = 1):
        if isinstance(reference, Recorded):
            self.x, self.y = reference.inputs, reference.outputs.to(torch.float64)
        else:
            self.x = probe_inputs(in_features, n_eval, 1, seed)
            self.y = reference(self.x).to(torch.float64)

    def residual(self, weight, scale) -> float:
        return relative_error(linear_op(weight, scale)(self.x), self.y)


def catalogue_candidates(fmt: str, stored_shape: Sequence[int]) -> list[Layout]:
    """The non-permutation layouts worth trying on a stored weight of this format and shape."""
    r, c = stored_shape
    out: list[Layout] = []
    if fmt == "fp4":
        out.append(NibbleSwap())
    for pre in (PRESHUFFLE_16x16, PRESHUFFLE_32x16):
        if r % pre.bn == 0 and c % pre.bk == 0:
            out += [pre, Inverse(pre)]
    if fmt != "fp4" and r == c:
        out.append(KMajor())
    # the fault catalogue's layouts are the bug classes seen in real ports: cheap hypotheses that need no
    # fingerprint, so a "scales not moved" W2 is explained even from dumps with too few rows to match per group
    for fault in FAULTS.values():
        if fault.layout not in out:
            out.append(fault.layout)
    return out


def _row_probe_groups(fmt: str, in_features: int) -> int:
    if fmt == "fp4":
        return in_features // FP4_GROUP
    if fmt == "fp8" and in_features % FP8_BLOCK == 0:
        return in_features // FP8_BLOCK
    return 1


def diagnose_linear(weight: torch.Tensor, scale: torch.Tensor | None,
                    reference: Callable[[torch.Tensor], torch.Tensor] | Recorded, *, name: str = "linear",
                    tol: float = 1e-6, seed: int = 0) -> Diagnosis:
    """Explain a stored linear (packed FP4, FP8 or dense weight + scale) against its reference.

    ``reference`` is an op ``x ↦ x @ W_refᵀ`` or :class:`Recorded` arrays. Hypotheses, each checked by undoing it
    on the stored bytes and measuring the residual: as-is; the output-row fingerprint with scales following, then
    with scales left in place; catalogue layouts (nibble swap, tile pre-shuffles and their inverses, K-major,
    the fault catalogue's layouts); the input-column fingerprint (scales following / in place). The first within
    ``tol`` wins; otherwise the closest is reported with ``exact=False``. Only this one linear is dequantized.
    """
    fmt = weight_format(weight)
    _, k = logical_shape(weight.shape, fmt)
    ev = ResidualEvaluator(reference, k)
    r0 = ev.residual(weight, scale)
    diag = Diagnosis(name, None, r0 <= tol, r0, r0, tried=[("as stored", r0)])
    if diag.exact:
        return diag
    suspect = linear_op(weight, scale)
    best: tuple[float, Layout | None] = (r0, None)

    def fingerprints(side: Side) -> FingerprintResult | None:
        try:
            groups = _row_probe_groups(fmt, k) if side == "rows" else 1
            if isinstance(reference, Recorded):
                enough = reference.inputs.shape[0] >= 8 * groups  # subspace matching needs n ≫ groups
                return fingerprint_recorded(reference.inputs, reference.outputs, suspect, side=side,
                                            groups=groups if enough else 1)
            return fingerprint(reference, suspect, k, side=side, groups=groups,
                               n_probes=max(8, min(64, 1024 // groups)), seed=seed)
        except LayoutError as err:
            diag.tried.append((f"{side} fingerprint: {err}", math.inf))
            return None

    def candidates() -> Iterator[Layout]:
        diag.rows = fingerprints("rows")
        if diag.rows is not None and not diag.rows.is_identity:
            yield diag.rows.layout("follow")
            if fmt != "dense":
                yield diag.rows.layout("keep")
        yield from catalogue_candidates(fmt, weight.shape)
        diag.cols = fingerprints("cols")
        if diag.cols is not None and not diag.cols.is_identity:
            yield diag.cols.layout("follow")
            if fmt != "dense":
                yield diag.cols.layout("keep")

    for cand in candidates():
        try:
            w, s = cand.invert(weight, scale)
            res = ev.residual(w, s)
        except (LayoutError, quant.QuantError, RuntimeError, IndexError) as err:
            diag.tried.append((f"{cand.describe()}: not applicable ({err})", math.inf))
            continue
        diag.tried.append((cand.describe(), res))
        if res < best[0]:
            best = (res, cand)
        if res <= tol:
            break
    diag.residual_after, diag.layout = best
    diag.exact = best[0] <= tol
    return diag


__all__ = ["Recorded", "Diagnosis", "ResidualEvaluator", "catalogue_candidates", "diagnose_linear"]
