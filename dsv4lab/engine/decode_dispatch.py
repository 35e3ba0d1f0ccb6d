"""Which implementation runs each decode projection and the routed MoE, per shape and batch — measured, not guessed.

``dsv4lab bench kernels --suite decode`` times, on the GPU, every FP8/BF16 projection of the decode step with the
own Triton GEMV (routes × launch geometries) and with cuBLAS (``torch._scaled_mm`` with 1×128 activation and
128×128 weight block scales; ``torch.mm(..., out_dtype=float32)`` for BF16 weights), checks each against the exact
reference within the analytic bound of its own kernel (:mod:`dsv4lab.tools.verify.bounds`), and writes the fastest
choice that passed per ``(shape, batch)`` — and the fastest routed-MoE route and geometry per batch — to a JSON
file committed as ``data/results/h200/decode_dispatch.json``. The Triton backend reads it here. Per batch it also
holds the fastest passing geometry of the sparse attention (``attention``) and of the one-launch mHC site
(``mhc_site``) — the fields of the kernels' ``AttentionGeometry`` and ``MhcSiteGeometry``, checked against those
classes where the backend builds them (this module does not import the kernels).

Lookup: an entry matches the projection's ``(out_features, in_features per group, groups, weight format,
activation quantization)`` and is taken at the smallest measured batch ≥ the call's rows (the largest measured
batch above that). cuBLAS is only ever chosen where its numerics passed the same bound as the own kernel in the
run that wrote the file.

**Default when absent** (no file, another GPU than the file was measured on, a shape or batch not in it, or
``DSV4LAB_DECODE_DISPATCH=off``): the own kernels — GEMV route ``"dot"`` with K split until the grid has about
two programs per SM (:meth:`~dsv4lab.engine.triton_backend.DecodeConfig.gemv_geometry`), the routed MoE's
``"dot"`` route with :class:`~dsv4lab_kernels.fp4_moe_decode.MoeGeometry`'s defaults. ``DSV4LAB_DECODE_DISPATCH``
may also name another file.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields
from pathlib import Path

from dsv4lab.core.errors import DSV4LabError
from dsv4lab.core.paths import RESULTS_DIR, read_json

log = logging.getLogger("dsv4lab.triton")

FORMAT = "dsv4lab.decode-dispatch/1"
GEOMETRY_TIERS = ("attention", "mhc_site")
DEFAULT_PATH = RESULTS_DIR / "h200" / "decode_dispatch.json"
ENV = "DSV4LAB_DECODE_DISPATCH"


class DispatchError(DSV4LabError, ValueError):
    """A dispatch file is malformed; the message names the file and the field."""


@dataclass(frozen=True)
class GemvChoice:
    """One projection at one batch: ``impl`` ``"triton"`` (with its route and geometry) or ``"cublas"`` (with
    the output dtype its block-scaled ``_scaled_mm`` takes here: ``cublas_out``)."""

    impl: str = "triton"
    route: str = "dot"
    block_n: int = 32
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    unroll: int = 1
    prequant: bool = False
    cublas_out: str = "float32"


@dataclass(frozen=True)
class MoeChoice:
    """The routed MoE at one batch: route and launch geometry (the fields of ``MoeGeometry``)."""

    route: str = "dot"
    block_n_up: int = 32
    block_n_down: int = 32
    block_k: int = 256
    slot_split: int = 0
    num_warps: int = 2
    num_stages: int = 3
    decode: str = "auto"
    prequant: bool = False
    fma_sums: str = "group"

    def geometry(self, moe_module):
        return moe_module.MoeGeometry(**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "route"})


def shape_key(n: int, k: int, groups: int, weight: str, act_quant: bool) -> str:
    """The key of a projection in the dispatch file: ``"N×K/G:fmt:aq"``."""
    return f"{n}x{k}/{groups}:{weight}:{'aq' if act_quant else 'noaq'}"


def _build(cls, d: dict, where: str):
    names = {f.name for f in fields(cls)}
    bad = set(d) - names
    if bad:
        raise DispatchError(f"{where}: unknown field(s) {', '.join(sorted(bad))} (known: {', '.join(sorted(names))})")
    try:
        return cls(**d)
    except TypeError as err:
        raise DispatchError(f"{where}: {err}") from None


class DecodeDispatch:
    """The measured choices of one dispatch file (or none: every lookup returns ``None``, the default)."""

    def __init__(self, doc: dict | None = None, source: str = "defaults"):
        self.source = source
        self.gpu = (doc or {}).get("gpu")
        self._gemv: dict[str, dict[int, GemvChoice]] = {}
        self._moe: dict[int, MoeChoice] = {}
        self._geometries: dict[str, dict[int, dict]] = {name: {} for name in GEOMETRY_TIERS}
        if not doc:
            return
        if doc.get("format") != FORMAT:
            raise DispatchError(f"{source}: format {doc.get('format')!r}, expected {FORMAT!r}")
        for i, e in enumerate(doc.get("gemv", [])):
            where = f"{source}: gemv[{i}]"
            try:
                key, batch, choice = e["shape"], int(e["batch"]), e["choice"]
            except (KeyError, TypeError, ValueError):
                raise DispatchError(f"{where}: needs 'shape', 'batch' and 'choice'") from None
            self._gemv.setdefault(key, {})[batch] = _build(GemvChoice, choice, where)
        for i, e in enumerate(doc.get("moe", [])):
            where = f"{source}: moe[{i}]"
            try:
                batch, choice = int(e["batch"]), e["choice"]
            except (KeyError, TypeError, ValueError):
                raise DispatchError(f"{where}: needs 'batch' and 'choice'") from None
            self._moe[batch] = _build(MoeChoice, choice, where)
        for name in GEOMETRY_TIERS:
            for i, e in enumerate(doc.get(name, [])):
                where = f"{source}: {name}[{i}]"
                try:
                    batch, choice = int(e["batch"]), e["choice"]
                except (KeyError, TypeError, ValueError):
                    raise DispatchError(f"{where}: needs 'batch' and 'choice'") from None
                if not isinstance(choice, dict):
                    raise DispatchError(f"{where}: 'choice' must be an object of geometry fields")
                self._geometries[name][batch] = dict(choice)

    @staticmethod
    def _tier(table: dict, rows: int):
        if not table:
            return None
        above = [b for b in table if b >= rows]
        return table[min(above)] if above else table[max(table)]

    def gemv(self, n: int, k: int, groups: int, weight: str, act_quant: bool, rows: int) -> GemvChoice | None:
        return self._tier(self._gemv.get(shape_key(n, k, groups, weight, act_quant), {}), rows)

    def moe(self, rows: int) -> MoeChoice | None:
        return self._tier(self._moe, rows)

    def geometry(self, name: str, rows: int) -> dict | None:
        """The measured geometry fields of ``name`` (one of :data:`GEOMETRY_TIERS`) at ``rows`` rows, or None."""
        return self._tier(self._geometries[name], rows)

    def __len__(self) -> int:
        return (sum(len(v) for v in self._gemv.values()) + len(self._moe)
                + sum(len(v) for v in self._geometries.values()))

    def describe(self) -> str:
        if not len(self):
            return f"decode dispatch: defaults ({self.source})"
        tiers = "".join(f", {len(v)} {name} tiers" for name, v in self._geometries.items() if v)
        return (f"decode dispatch: {len(self._gemv)} projection shapes, {len(self._moe)} MoE batch tiers{tiers} from "
                f"{self.source} (measured on {self.gpu})")

    @classmethod
    def load(cls, path: str | Path | None = None, device_name: str | None = None) -> "DecodeDispatch":
        """The dispatch for this process: ``path``, else ``$DSV4LAB_DECODE_DISPATCH``, else the committed H200
        file — used only when it was measured on ``device_name`` (the current GPU's name); defaults otherwise."""
        env = os.environ.get(ENV)
        if env == "off":
            return cls(None, f"{ENV}=off")
        p = Path(path or env or DEFAULT_PATH)
        if not p.exists():
            if path or env:
                raise DispatchError(f"decode dispatch file {p} does not exist")
            return cls(None, f"no {p.name}")
        doc = read_json(p, DispatchError)
        if device_name is not None and doc.get("gpu") and doc["gpu"] != device_name:
            log.info("decode dispatch %s was measured on %s, this is %s: using the defaults", p, doc["gpu"],
                     device_name)
            return cls(None, f"{p.name} is for {doc['gpu']}")
        return cls(doc, str(p))


__all__ = ["FORMAT", "GEOMETRY_TIERS", "DEFAULT_PATH", "ENV", "DispatchError", "GemvChoice", "MoeChoice",
           "DecodeDispatch", "shape_key"]
