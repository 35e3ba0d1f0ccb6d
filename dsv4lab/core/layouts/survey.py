"""Fingerprinting a whole checkpoint: per tensor class, which members are stored in which layout.

:func:`fingerprint_checkpoint` checks every quantized linear of a suspect checkpoint against a trusted checkpoint
or golden activation dumps (:func:`load_golden_dumps`), confirms a layout found on one member on every other member
of its class (layer and expert indices folded, e.g. ``layers.*.ffn.experts.*.w2``), diagnoses only the members no
known layout fits, and derives the :class:`~dsv4lab.core.layouts.repair.RepairSpec` that undoes what it found.
"""
from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import torch
from safetensors.torch import load_file

from dsv4lab.core import quant
from dsv4lab.core.checkpoint import Checkpoint
from dsv4lab.core.checkpoint import _progress as progress_bar
from dsv4lab.core.errors import CheckpointError, LayoutError
from dsv4lab.core.layouts.algebra import Layout
from dsv4lab.core.layouts.catalogue import checkpoint_linears
from dsv4lab.core.layouts.diagnose import Diagnosis, Recorded, ResidualEvaluator, diagnose_linear
from dsv4lab.core.layouts.formats import byte_view, linear_op, logical_shape, weight_format
from dsv4lab.core.layouts.repair import RepairRule, RepairSpec


def tensor_class(linear: str) -> str:
    """The class pattern of a linear: layer and expert indices replaced by ``*``
    (``layers.3.ffn.experts.7.w2`` → ``layers.*.ffn.experts.*.w2``)."""
    s = re.sub(r"^(layers|mtp)\.\d+\.", r"\1.*.", linear)
    return re.sub(r"\.experts\.\d+\.", ".experts.*.", s)


def class_regex(pattern: str) -> str:
    """The exact regex of a :func:`tensor_class` pattern (each ``*`` is one index)."""
    return re.escape(pattern).replace(r"\*", r"\d+")


def load_golden_dumps(path: str | Path) -> dict[str, Recorded]:
    """Recorded linear activations: a ``.safetensors``, ``.pt`` or ``.npz`` file holding ``{linear}.input``
    ``[n, in]`` and ``{linear}.output`` ``[n, out]`` for each recorded linear (e.g. ``layers.0.ffn.experts.3.w2``)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: golden dump file not found")
    if path.suffix == ".safetensors":
        arrays = load_file(str(path))
    elif path.suffix == ".npz":
        with np.load(path) as z:
            arrays = {k: torch.from_numpy(z[k]) for k in z.files}
    elif path.suffix in (".pt", ".pth"):
        arrays = torch.load(path, map_location="cpu", weights_only=True)
    else:
        raise LayoutError(f"{path}: golden dumps must be .safetensors, .npz or .pt")
    out: dict[str, Recorded] = {}
    for key in arrays:
        if key.endswith(".input"):
            base = key[: -len(".input")]
            if base + ".output" not in arrays:
                raise LayoutError(f"{path}: {key} has no matching {base}.output")
            x, y = arrays[key], arrays[base + ".output"]
            if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
                raise LayoutError(f"{path}: {base}: input {list(x.shape)} and output {list(y.shape)} must be "
                                  f"[n, in] and [n, out]")
            out[base] = Recorded(x.float(), y.float())
    if not out:
        raise LayoutError(f"{path}: no '<linear>.input' / '<linear>.output' pairs found")
    return out


@dataclass
class ClassReport:
    """The verdict for one tensor class: which members are stored in which layout."""

    pattern: str
    members: int
    by_layout: list[tuple[Layout | None, list[str]]] = field(default_factory=list)
    unexplained: list[Diagnosis] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)
    diagnoses: list[Diagnosis] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        parts = []
        for lay, names in self.by_layout:
            what = "as reference" if lay is None else lay.describe()
            parts.append(what if len(names) == self.members else f"{what} ×{len(names)}")
        if self.unexplained:
            parts.append(f"UNEXPLAINED ×{len(self.unexplained)}")
        if self.unverified:
            parts.append(f"no recorded activations ×{len(self.unverified)}")
        return "; ".join(parts)

    def to_json(self) -> dict:
        return dict(pattern=self.pattern, members=self.members, verdict=self.verdict,
                    layouts=[dict(layout=None if lay is None else lay.to_json(),
                                  description="as reference" if lay is None else lay.describe(),
                                  count=len(names), names=names if len(names) <= 32 else names[:32] + ["..."])
                             for lay, names in self.by_layout],
                    unexplained=[dict(name=d.name, best=d.description, residual_before=d.residual_before,
                                      residual_after=d.residual_after, tried=d.tried) for d in self.unexplained],
                    unverified=self.unverified,
                    fingerprints=[dict(name=d.name, description=d.description, exact=d.exact,
                                       residual_before=d.residual_before, residual_after=d.residual_after,
                                       rows=d.rows.to_json() if d.rows else None,
                                       cols=d.cols.to_json() if d.cols else None) for d in self.diagnoses])


@dataclass
class CheckpointFingerprint:
    """The result of :func:`fingerprint_checkpoint`: per-class reports and the repair spec they imply."""

    suspect: str
    reference: str
    classes: list[ClassReport]
    spec: RepairSpec

    @property
    def ok(self) -> bool:
        """Every fingerprinted linear is either as the reference or exactly explained by a repair rule."""
        return not any(c.unexplained for c in self.classes)

    def summary(self) -> str:
        width = max((len(c.pattern) for c in self.classes), default=10)
        lines = [f"suspect    {self.suspect}", f"reference  {self.reference}"]
        lines += [f"  {c.pattern:<{width}}  {c.members:>5}  {c.verdict}" for c in self.classes]
        lines.append(f"{len(self.spec.rules)} repair rule(s)" + ("" if self.ok else "; some linears are UNEXPLAINED"))
        return "\n".join(lines)

    def to_json(self) -> dict:
        return dict(suspect=self.suspect, reference=self.reference, ok=self.ok,
                    classes=[c.to_json() for c in self.classes], spec=self.spec.to_json())


_NO_FIT = object()


def _undoes_to(layout: Layout | None, w, s, w_ref, s_ref) -> bool:
    """Whether undoing ``layout`` on the stored pair gives exactly the reference bytes."""
    try:
        w2, s2 = (w, s) if layout is None else layout.invert(w, s)
    except LayoutError:
        return False
    return (w2.shape == w_ref.shape and s2.shape == s_ref.shape and torch.equal(byte_view(w2), byte_view(w_ref))
            and torch.equal(byte_view(s2), byte_view(s_ref)))


def _residual_after(layout: Layout | None, w, s, ev: "ResidualEvaluator") -> float:
    try:
        w2, s2 = (w, s) if layout is None else layout.invert(w, s)
        return ev.residual(w2, s2)
    except (LayoutError, quant.QuantError, RuntimeError, IndexError):
        return math.inf


def fingerprint_checkpoint(suspect: str | Path, *, reference: str | Path | None = None,
                           golden: str | Path | Mapping[str, Recorded] | None = None,
                           only: Sequence[str] | None = None, tol: float | None = None, seed: int = 0,
                           progress: bool = False) -> CheckpointFingerprint:
    """Fingerprint every quantized linear of a suspect checkpoint and derive a repair spec.

    The reference is a trusted checkpoint (each linear as ``x ↦ x @ dequant(W_ref)ᵀ``; default ``tol=1e-6``,
    since both sides are exact in fp64) or golden dumps (:func:`load_golden_dumps`; default ``tol=0.1``, since
    recorded activations carry the trusted run's rounding). Per tensor class (:func:`tensor_class`) each member
    is first checked against the layouts already found in its class — against a trusted checkpoint by undoing
    the layout and comparing bytes (no dequantization), against dumps by the residual on the recorded
    activations — and fully diagnosed (:func:`diagnose_linear`) only when none fits. A layout that fits every
    member becomes one rule for the class (a glob, or an exact regex if the glob would also match linears of
    another class), one that fits some members a rule naming them. ``only`` restricts the linears (globs).
    """
    if (reference is None) == (golden is None):
        raise LayoutError("fingerprint_checkpoint: give exactly one of reference= (a trusted checkpoint) or "
                          "golden= (recorded activations)")
    sus = Checkpoint(suspect)
    ref = Checkpoint(reference) if reference is not None else None
    dumps = (golden if isinstance(golden, Mapping) else load_golden_dumps(golden)) if golden is not None else None
    tol = tol if tol is not None else (1e-6 if ref is not None else 0.1)
    all_linears = checkpoint_linears(sus, quantized_only=False)
    linears = checkpoint_linears(sus)
    if only:
        linears = [lin for lin in linears if any(fnmatch.fnmatchcase(lin, g) for g in only)]
        if not linears:
            raise LayoutError(f"{suspect}: no quantized linear matches {list(only)}")
    classes: dict[str, list[str]] = {}
    for lin in linears:
        classes.setdefault(tensor_class(lin), []).append(lin)
    reports: list[ClassReport] = []
    rules: list[RepairRule] = []
    bar = progress_bar(range(len(linears)), progress, "fingerprinting")
    ticks = iter(bar)
    for pattern, members in classes.items():
        rep = ClassReport(pattern, len(members))
        found: list[Layout | None] = [None]
        assigned: dict[str, Layout | None] = {}
        residuals: dict[str, float] = {}
        for lin in members:
            next(ticks, None)
            w, s = sus.get(lin + ".weight"), sus.get(lin + ".scale")
            if ref is not None:
                if lin + ".weight" not in ref or lin + ".scale" not in ref:
                    raise CheckpointError(reference, [f"{lin}: in the suspect but not in the reference"])
                wr, sr = ref.get(lin + ".weight"), ref.get(lin + ".scale")
                # a layout found on another member is confirmed the strictest way: undone, the bytes are the
                # reference's; only members no known layout fits are fingerprinted
                fit = next((lay for lay in found if _undoes_to(lay, w, s, wr, sr)), _NO_FIT)
                if fit is not _NO_FIT:
                    assigned[lin] = fit
                    residuals[lin] = 0.0
                    continue
                source: Callable | Recorded = linear_op(wr, sr)
            else:
                if lin not in dumps:
                    rep.unverified.append(lin)
                    continue
                source = dumps[lin]
                ev = ResidualEvaluator(source, logical_shape(w.shape, weight_format(w))[1])
                fit = next((lay for lay in found if _residual_after(lay, w, s, ev) <= tol), _NO_FIT)
                if fit is not _NO_FIT:
                    assigned[lin] = fit
                    residuals[lin] = _residual_after(fit, w, s, ev)
                    continue
            diag = diagnose_linear(w, s, source, name=lin, tol=tol, seed=seed)
            rep.diagnoses.append(diag)
            if diag.exact:
                if diag.layout not in found:
                    found.append(diag.layout)
                assigned[lin] = diag.layout
                residuals[lin] = diag.residual_after
            else:
                rep.unexplained.append(diag)
        for lay in found:
            names = [lin for lin in members if lin in assigned and assigned[lin] == lay]
            if not names:
                continue
            rep.by_layout.append((lay, names))
            if lay is None:
                continue
            covers_class = len(names) == len(members) or (dumps is not None and len(names) + len(rep.unverified)
                                                          == len(members))
            evidence = dict(linears=len(names), class_members=len(members),
                            max_residual_after=max(residuals[n] for n in names),
                            verified_against="reference checkpoint" if ref is not None else "golden dumps")
            d = next((x for x in rep.diagnoses if x.layout == lay), None)
            if d is not None:
                evidence.update(example=d.name, residual_before=d.residual_before)
                if d.rows is not None:
                    evidence.update(fingerprint_confidence=d.rows.confidence, probe_calls=d.rows.probe_calls)
            if covers_class and any(fnmatch.fnmatchcase(x, pattern) for x in all_linears if tensor_class(x) != pattern):
                rules.append(RepairRule(lay, regex=class_regex(pattern), evidence=evidence))
            elif covers_class:
                rules.append(RepairRule(lay, glob=pattern, evidence=evidence))
            else:
                rules.append(RepairRule(lay, names=tuple(names), evidence=evidence))
        reports.append(rep)
    for _ in ticks:
        pass
    spec = RepairSpec(rules, dict(tool="dsv4lab fingerprint", suspect=str(suspect),
                                  reference=str(reference) if reference is not None else None,
                                  golden=str(golden) if golden is not None and not isinstance(golden, Mapping)
                                  else None, tol=tol))
    source = (str(reference) if reference is not None else
              f"golden dumps ({len(dumps)} linears)" if isinstance(golden, Mapping) else f"golden dumps {golden}")
    return CheckpointFingerprint(str(suspect), source, reports, spec)


__all__ = ["tensor_class", "class_regex", "load_golden_dumps", "ClassReport", "CheckpointFingerprint",
           "fingerprint_checkpoint"]
