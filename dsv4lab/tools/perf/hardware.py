"""The hardware catalogue: ``data/hardware/<name>.yaml``, one accelerator (or host) per file.

Every number in a catalogue file is a mapping ``{value: ..., source: KEY, note: ..., range: [lo, hi]}`` where
``KEY`` names an entry of the file's ``sources:`` table (a datasheet, the paper, or one of the project's own
measurement files). ``value: null`` marks a path the hardware does not have (FP8 on CDNA2) or a figure nobody
has measured yet; the loader keeps it as ``None`` so the models can say "unknown" instead of guessing.

Units are fixed by the key name: ``*_gbps`` GB/s (10⁹ bytes), ``*_tflops`` / ``*_tops`` 10¹² per second,
``*_us`` microseconds, ``*_gb`` / ``*_mb`` 10⁹ / 10⁶ bytes, ``*_kib`` KiB.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4lab.core.errors import HardwareError
from dsv4lab.core.paths import DATA_DIR, HARDWARE_DIR, read_yaml


DTYPES = ("fp64", "fp32", "tf32", "fp16", "bf16", "int8", "fp8", "fp4")


@dataclass(frozen=True)
class Quantity:
    """One catalogue number with its provenance."""

    value: float | None
    source: str
    source_text: str
    note: str = ""
    range: tuple[float, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(value=self.value, source=self.source_text)
        if self.range:
            d["range"] = list(self.range)
        if self.note:
            d["note"] = self.note
        return d


@dataclass(frozen=True)
class Hardware:
    """A parsed catalogue entry. Numbers are looked up by dotted key, e.g. ``memory.bw_peak_gbps``."""

    name: str
    title: str
    kind: str
    vendor: str
    arch: str
    path: Path
    quantities: dict[str, Quantity] = field(repr=False)
    extras: dict[str, Any] = field(repr=False)
    sources: dict[str, str] = field(repr=False)

    # ------------------------------------------------------------------ generic access
    def quantity(self, key: str) -> Quantity:
        if key not in self.quantities:
            raise HardwareError(f"{self.path}: no entry {key!r}")
        return self.quantities[key]

    def get(self, key: str) -> float | None:
        """The value at ``key``, or None when the entry is absent or null."""
        q = self.quantities.get(key)
        return None if q is None else q.value

    def require(self, key: str, why: str) -> float:
        """The value at ``key``; a clear error when it is missing or null (``why`` says which model needs it)."""
        value = self.get(key)
        if value is None:
            q = self.quantities.get(key)
            note = f" ({q.note})" if q is not None and q.note else ""
            raise HardwareError(f"{self.path}: {key} is not known{note}; it is needed for {why}")
        return float(value)

    # ------------------------------------------------------------------ the numbers the models use
    def bandwidth_gbps(self, which: str = "peak") -> float:
        """Memory bandwidth: ``peak`` (datasheet), ``achievable`` (measured / reported); each falls back to the
        other when unknown (the host CPU has only a measured figure)."""
        if which not in ("peak", "achievable"):
            raise ValueError(f"bandwidth kind {which!r}: expected 'peak' or 'achievable'")
        first, second = ("memory.bw_peak_gbps", "memory.bw_achievable_gbps")[:: 1 if which == "peak" else -1]
        value = self.get(first) or self.get(second)
        if value is None:
            raise HardwareError(f"{self.path}: neither {first} nor {second} is known")
        return float(value)

    def matrix_tflops(self, dtype: str, measured: bool = False) -> float | None:
        """Dense matrix-engine rate for ``dtype`` (None if the hardware has no such path). ``measured`` prefers
        a measured ceiling (``matrix_tflops_measured``) where the catalogue has one."""
        if measured:
            m = self.get(f"matrix_tflops_measured.{dtype}")
            if m is not None:
                return float(m)
        v = self.get(f"matrix_tflops.{dtype}")
        return None if v is None else float(v)

    def vector_tflops(self, dtype: str = "fp32") -> float | None:
        v = self.get(f"vector_tflops.{dtype}")
        return None if v is None else float(v)

    def dot_tops(self, instruction: str) -> float | None:
        v = self.get(f"dot_tops.{instruction}")
        return None if v is None else float(v)

    @property
    def lane_ops_per_s(self) -> float:
        """Simple vector instructions per second summed over lanes (FP32 FMA rate / 2): what unpacking and
        converting weights in software costs."""
        return self.require("vector_tflops.fp32", "format-conversion costs") * 1e12 / 2

    @property
    def min_tile_m(self) -> int:
        v = self.get("matrix_tile.min_m")
        return int(v) if v else 1

    def allreduce_us(self, method: str = "library") -> float | None:
        v = self.get(f"collectives.allreduce_small_us.{method}")
        return None if v is None else float(v)

    @property
    def kernel_overhead_us(self) -> float | None:
        return self.get("launch.kernel_overhead_us")

    def has_matrix(self, dtype: str) -> bool:
        return self.matrix_tflops(dtype) is not None

    def summary(self) -> dict[str, Any]:
        """The headline numbers (for JSON output and tables)."""
        out: dict[str, Any] = dict(name=self.name, title=self.title)
        for key in ("memory.bw_peak_gbps", "memory.bw_achievable_gbps", "memory.capacity_gb",
                    "matrix_tflops.bf16", "matrix_tflops.fp8", "matrix_tflops.fp4", "matrix_tflops.int8",
                    "launch.kernel_overhead_us"):
            if key in self.quantities:
                out[key] = self.quantities[key].value
        return out

    def table(self) -> list[dict[str, Any]]:
        """Every number as a row: key, value, range, source, note."""
        return [dict(key=k, **q.to_dict()) for k, q in self.quantities.items()]


# ============================================================================================ loading
def _parse(path: Path) -> Hardware:
    raw = read_yaml(path, HardwareError)
    if not isinstance(raw, dict):
        raise HardwareError(f"{path}: expected a mapping at the top level")
    for key in ("name", "title", "kind", "sources"):
        if key not in raw:
            raise HardwareError(f"{path}: missing top-level key {key!r}")
    if raw["name"] != path.stem:
        raise HardwareError(f"{path}: name {raw['name']!r} differs from the file name {path.stem!r}")
    sources = raw["sources"]
    if not isinstance(sources, dict) or not sources:
        raise HardwareError(f"{path}: 'sources' must map source keys to descriptions")

    quantities: dict[str, Quantity] = {}
    extras: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and "value" in node:
            value, src = node["value"], node.get("source")
            if src is None:
                raise HardwareError(f"{path}: {prefix}: every number needs a 'source'")
            if src not in sources:
                raise HardwareError(f"{path}: {prefix}: source {src!r} is not in the file's sources "
                                    f"({', '.join(sources)})")
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise HardwareError(f"{path}: {prefix}: value {value!r} is not a number or null")
            rng = node.get("range")
            if rng is not None:
                if (not isinstance(rng, list) or len(rng) != 2
                        or not all(isinstance(x, (int, float)) for x in rng) or rng[0] > rng[1]):
                    raise HardwareError(f"{path}: {prefix}: range must be [low, high], got {rng!r}")
                if value is not None and not rng[0] <= value <= rng[1]:
                    raise HardwareError(f"{path}: {prefix}: value {value} lies outside its range {rng}")
            unknown = set(node) - {"value", "source", "note", "range"}
            if unknown:
                raise HardwareError(f"{path}: {prefix}: unknown field(s) {sorted(unknown)}")
            quantities[prefix] = Quantity(None if value is None else float(value), src, sources[src],
                                          str(node.get("note", "")), tuple(rng) if rng else None)
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            raise HardwareError(f"{path}: {prefix}: bare number {node!r}; write {{value: {node}, source: ...}}")
        else:
            extras[prefix] = node

    for key, node in raw.items():
        if key in ("name", "title", "kind", "vendor", "arch", "sources"):
            continue
        walk(node, key)
    return Hardware(name=raw["name"], title=raw["title"], kind=raw["kind"], vendor=str(raw.get("vendor", "")),
                    arch=str(raw.get("arch", "")), path=path, quantities=quantities, extras=extras,
                    sources=dict(sources))


def list_hardware(directory: Path | None = None) -> list[str]:
    """Names of the catalogue entries (file stems)."""
    d = directory or HARDWARE_DIR
    return sorted(p.stem for p in d.glob("*.yaml"))


@functools.lru_cache(maxsize=None)
def _load_cached(path: Path) -> Hardware:
    return _parse(path)


def load_hardware(name: str | Path) -> Hardware:
    """Load a catalogue entry by name (``mi250-gcd``) or by path to a YAML file."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml"):
        if not p.exists():
            raise HardwareError(f"{p}: no such hardware file")
        return _load_cached(p.resolve())
    path = HARDWARE_DIR / f"{name}.yaml"
    if not path.exists():
        raise HardwareError(f"unknown hardware {str(name)!r}; the catalogue ({HARDWARE_DIR}) has: "
                            f"{', '.join(list_hardware())}")
    return _load_cached(path)


def catalogue() -> dict[str, Hardware]:
    """Every catalogue entry, by name."""
    return {name: load_hardware(name) for name in list_hardware()}


__all__ = ["Hardware", "HardwareError", "Quantity", "load_hardware", "list_hardware", "catalogue",
           "HARDWARE_DIR", "DATA_DIR", "DTYPES"]
