"""Repair specs: which stored tensors are in which layout, undone one tensor at a time as it is read.

A :class:`RepairSpec` (JSON, format :data:`SPEC_FORMAT`) is an ordered list of :class:`RepairRule` — a selector on
linear names and the layout those tensors are stored in. There is one way to use one: ``spec =
RepairSpec.load(path_or_json)``, then ``spec.apply(name, tensor, checkpoint)`` on each tensor as it is read (what
``dsv4lab.load(..., repairs=spec)`` does, so a repaired layout costs nothing on the hot path), or
:func:`repair_checkpoint` to write a corrected copy of a whole checkpoint (never in place).
"""
from __future__ import annotations

import fnmatch
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from dsv4lab.core.checkpoint import INDEX_NAME, Checkpoint, TensorSpec, write_checkpoint
from dsv4lab.core.errors import CheckpointError, LayoutError
from dsv4lab.core.paths import read_json
from dsv4lab.core.layouts.algebra import Layout, layout_from_json
from dsv4lab.core.layouts.formats import format_of_dtype_code, logical_shape, weight_format

SPEC_FORMAT = "dsv4lab.repair-spec/1"


def linear_name(tensor_name: str) -> tuple[str, str | None]:
    """``("layers.0.ffn.experts.3.w2", "weight")`` for ``layers.0.ffn.experts.3.w2.weight``; role ``None`` for
    tensors that are neither a ``.weight`` nor a ``.scale``."""
    for role in ("weight", "scale"):
        if tensor_name.endswith("." + role):
            return tensor_name[: -len(role) - 1], role
    return tensor_name, None


@dataclass
class RepairRule:
    """Tensors matching this rule are stored in ``layout``; the repair undoes it on the weight and its scale.

    Exactly one of ``glob`` (``fnmatch`` on the linear name, i.e. the tensor name without ``.weight`` /
    ``.scale``), ``regex`` (``re.fullmatch``) or ``names`` (exact linear names) selects the tensors.
    """

    layout: Layout
    glob: str | None = None
    regex: str | None = None
    names: tuple[str, ...] = ()
    description: str = ""
    evidence: dict = field(default_factory=dict)

    def __post_init__(self):
        given = [k for k in ("glob", "regex", "names") if getattr(self, k)]
        if len(given) != 1:
            raise LayoutError(f"repair rule: give exactly one of glob, regex, names (got {given or 'none'})")
        self.names = tuple(self.names)
        self._names = frozenset(self.names)
        try:
            self._re = re.compile(self.regex) if self.regex else None
        except re.error as err:
            raise LayoutError(f"repair rule: bad regex {self.regex!r}: {err}") from None
        if not self.description:
            self.description = self.layout.describe()

    @property
    def selector(self) -> str:
        if self.glob:
            return f"glob {self.glob}"
        if self.regex:
            return f"regex {self.regex}"
        return f"{len(self.names)} named linear(s)" if len(self.names) > 1 else f"name {self.names[0]}"

    def matches(self, linear: str) -> bool:
        if self.glob:
            return fnmatch.fnmatchcase(linear, self.glob)
        if self._re is not None:
            return self._re.fullmatch(linear) is not None
        return linear in self._names

    def to_json(self) -> dict:
        sel = {"glob": self.glob} if self.glob else {"regex": self.regex} if self.regex else {"names": list(self.names)}
        return {"match": sel, "stored_as": self.layout.to_json(), "description": self.description,
                **({"evidence": self.evidence} if self.evidence else {})}

    @classmethod
    def from_json(cls, d: Mapping, where: str = "rule") -> "RepairRule":
        if not isinstance(d, Mapping):
            raise LayoutError(f"{where}: expected an object, got {type(d).__name__}")
        for key in ("match", "stored_as"):
            if key not in d:
                raise LayoutError(f"{where}: missing field {key!r} (a rule is {{'match': {{'glob'|'regex'|'names': "
                                  f"...}}, 'stored_as': {{'layout': NAME, ...}}}})")
        sel = d["match"]
        if not isinstance(sel, Mapping) or len(sel) != 1 or next(iter(sel)) not in ("glob", "regex", "names"):
            raise LayoutError(f"{where}.match: expected exactly one of 'glob', 'regex', 'names', got {sel!r}")
        layout = layout_from_json(d["stored_as"], f"{where}.stored_as")
        kind, value = next(iter(sel.items()))
        kw = {kind: tuple(value) if kind == "names" else value}
        return cls(layout=layout, description=d.get("description", ""), evidence=dict(d.get("evidence", {})), **kw)


@dataclass
class RepairSpec:
    """An ordered list of :class:`RepairRule`; every matching rule is undone, in file order.

    ``RepairSpec.load(path)`` reads one; the loader calls :meth:`apply` on each tensor as it is read, so the
    corrected layout is what the kernels see and the hot path pays nothing.
    """

    rules: list[RepairRule] = field(default_factory=list)
    source: dict = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.rules)

    def rules_for(self, tensor_name: str) -> list[RepairRule]:
        linear, role = linear_name(tensor_name)
        return [r for r in self.rules if r.matches(linear)] if role else []

    def apply(self, name: str, tensor: torch.Tensor, checkpoint=None, *,
              weight_dtype: str | torch.dtype | None = None, weight_shape: Sequence[int] | None = None) -> torch.Tensor:
        """Undo every matching rule on one tensor as it is read (a no-op for tensors no rule matches).

        A ``.weight`` carries its own format. A ``.scale`` needs its weight's stored dtype (torch dtype or
        safetensors code) and shape: from ``checkpoint``'s headers (a :class:`~dsv4lab.core.checkpoint.Checkpoint`,
        what the loader passes) or given as ``weight_dtype`` / ``weight_shape``."""
        rules = self.rules_for(name)
        if not rules:
            return tensor
        base, role = linear_name(name)
        if role == "weight":
            fmt, shape = weight_format(tensor), tuple(tensor.shape)
        else:
            if weight_dtype is None and checkpoint is not None:
                w = checkpoint.tensors.get(base + ".weight")
                if w is None:
                    raise LayoutError(f"{name}: a repair rule matches it but {base}.weight is not in {checkpoint.path}")
                weight_dtype, weight_shape = w.dtype, w.shape
            if weight_dtype is None or weight_shape is None:
                raise LayoutError(f"{name}: repairing a scale needs its weight's dtype and shape (pass the "
                                  f"checkpoint, or weight_dtype= and weight_shape=)")
            fmt = (format_of_dtype_code(weight_dtype) if isinstance(weight_dtype, str)
                   else weight_format(torch.empty(0, dtype=weight_dtype)))
            shape = tuple(weight_shape)
        for rule in reversed(rules):
            try:
                tensor = rule.layout.transform(tensor, role, fmt, logical_shape(shape, fmt), inverse=True)
            except LayoutError as err:
                raise LayoutError(f"{name}: repair rule ({rule.selector}) failed: {err}") from None
            shape = rule.layout.shape_after(shape, "weight", fmt, inverse=True)
        return tensor

    def repaired_shape(self, name: str, stored_shape: Sequence[int], weight_dtype: str,
                       weight_shape: Sequence[int]) -> tuple[int, ...]:
        """The shape ``name`` has after repair (differs from the stored one only for transposing layouts)."""
        _, role = linear_name(name)
        fmt = format_of_dtype_code(weight_dtype)
        shape = tuple(stored_shape)
        for rule in reversed(self.rules_for(name)):
            shape = rule.layout.shape_after(shape, role, fmt, inverse=True)
        return shape

    def to_json(self) -> dict:
        return {"format": SPEC_FORMAT, "source": self.source, "rules": [r.to_json() for r in self.rules]}

    @classmethod
    def from_json(cls, d: Mapping, where: str = "repair spec") -> "RepairSpec":
        if not isinstance(d, Mapping):
            raise LayoutError(f"{where}: expected a JSON object")
        if d.get("format") != SPEC_FORMAT:
            raise LayoutError(f"{where}: field 'format' is {d.get('format')!r}, expected {SPEC_FORMAT!r}")
        if not isinstance(d.get("rules"), list):
            raise LayoutError(f"{where}: field 'rules' must be a list")
        rules = [RepairRule.from_json(r, f"{where}: rules[{i}]") for i, r in enumerate(d["rules"])]
        return cls(rules, dict(d.get("source", {})))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(_json_compact_lists(json.dumps(self.to_json(), indent=1)) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, source: "RepairSpec | str | Path | Mapping") -> "RepairSpec":
        """A spec from a JSON file, its parsed JSON, or a spec (returned as it is)."""
        if isinstance(source, RepairSpec):
            return source
        if isinstance(source, Mapping):
            return cls.from_json(source)
        return cls.from_json(read_json(source, LayoutError), str(source))


def _json_compact_lists(text: str) -> str:
    """Put arrays of numbers on one line (permutations would otherwise take a line per index)."""
    return re.sub(r"\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]", lambda m: "[" + re.sub(r"\s+", "", m.group(1)) + "]", text)


# ============================================================================================ checkpoint copies
def natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def rewrite_checkpoint(src: str | Path, out: str | Path, transform: Callable[[str, torch.Tensor], torch.Tensor],
                        shape_of: Callable[[str, tuple], tuple], *, overwrite: bool, progress: bool) -> Path:
    """Copy ``src`` to ``out`` tensor by tensor through ``transform``, keeping names, dtypes, sharding and every
    non-weight file; written to a temporary folder and renamed (never in place)."""
    src, out = Path(src), Path(out)
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise LayoutError(f"{out}: refusing to write inside the source checkpoint {src} (copies are never in place)")
    ck = Checkpoint(src)
    if ck.problems:
        raise CheckpointError(src, ck.problems)
    shards = []
    for f in ck.files:
        infos = sorted((i for i in ck.tensors.values() if i.file == f), key=lambda i: i.begin)
        shards.append([TensorSpec(i.name, i.dtype, shape_of(i.name, i.shape), "", None) for i in infos])
    weight_files = set(ck.files) | {INDEX_NAME}
    extra = {p.name: p for p in sorted(src.iterdir()) if p.is_file() and p.name not in weight_files}

    def make(spec):
        return transform(spec.name, ck.get(spec.name))

    try:
        return write_checkpoint(out, ck.args, make, shards=shards, extra_files=extra, overwrite=overwrite,
                                progress=progress)
    finally:
        ck.close()


def repair_checkpoint(src: str | Path, spec: RepairSpec | str | Path, out: str | Path, *, overwrite: bool = False,
                      progress: bool = False) -> dict[str, int]:
    """Write a repaired copy of ``src`` to ``out`` (never in place): every tensor a rule matches is undone on its
    packed bytes, everything else is copied byte for byte. Returns the number of tensors each rule changed;
    a rule that matches nothing is an error (a typo would otherwise write a silent copy)."""
    spec = RepairSpec.load(spec)
    ck = Checkpoint(src)
    counts = {f"{i}: {r.selector}": 0 for i, r in enumerate(spec.rules)}
    for name in ck.tensors:
        base, role = linear_name(name)
        for i, r in enumerate(spec.rules):
            if role and r.matches(base):
                counts[f"{i}: {r.selector}"] += 1
    unused = [k for k, v in counts.items() if v == 0]
    if unused:
        raise LayoutError(f"{spec.source.get('path', 'repair spec')}: rule(s) {unused} match no tensor of {src}")

    def repair(name, tensor):
        return spec.apply(name, tensor, ck)

    def shape_of(name, shape):
        base, _ = linear_name(name)
        w = ck.tensors.get(base + ".weight")
        return spec.repaired_shape(name, shape, w.dtype, w.shape) if w is not None and spec.rules_for(name) else shape

    rewrite_checkpoint(src, out, repair, shape_of, overwrite=overwrite, progress=progress)
    return counts


__all__ = ["SPEC_FORMAT", "RepairRule", "RepairSpec", "linear_name", "repair_checkpoint", "rewrite_checkpoint",
           "natural_key"]
