"""Kernel choice, in one place: which kernel, route and launch geometry each op of the Triton backend takes here.

Every choice the backends make (:mod:`~dsv4lab.engine.triton_backend` for the decode kernels,
:mod:`~dsv4lab.engine.triton_prefill` for the prefill ones) is a lookup in :class:`Dispatch`, in this order:

1. what the caller fixed — a verification variant's route or geometry (:mod:`~dsv4lab.engine.kernel_families`),
   a prefill setting set on the backend (``ops.prefill_moe_route = "fp8"``);
2. the **tuned table** of this GPU, ``kernels/dsv4lab_kernels/tuned/<gpu>.json`` (:func:`tuned_path`: the name
   ``torch.cuda.get_device_name()`` gives, lower case, without ``NVIDIA``, other characters as ``_`` —
   ``NVIDIA H200`` → ``h200.json``), written by the benchmarks (``dsv4lab bench kernels --suite decode|prefill``,
   :mod:`dsv4lab.tools.bench.tuned`) and used only on the GPU it names;
3. the documented **defaults** of the device (:data:`GPU_DEFAULTS`, :data:`INTERPRETER_DEFAULTS`,
   :data:`PREFILL_DEFAULTS`): what a GPU without a tuned file runs.

``DSV4LAB_TUNED`` names another tuned file (a GPU visit that measures and then runs ``bench e2e`` points it at the
fresh one; it too is used only on the GPU it names) or ``off`` (the defaults). It replaces the earlier
``DSV4LAB_DECODE_DISPATCH`` and ``DSV4LAB_PREFILL_CHOICES``, which are refused with a message naming it.

**The tuned file** (schema :data:`SCHEMA`)::

    {"schema": "dsv4lab.tuned/1",
     "gpu": "NVIDIA H200",                          # the device name the entries were measured on
     "sources": {"590cf92/decode-quick":            # each measurement an entry comes from
                   {"commit": "590cf92", "command": "dsv4lab bench kernels --suite decode --quick",
                    "gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0"}, …},
     "ops": {"decode.gemv": [{"shape": "1536x4096/1:fp8:aq", "rows": 1, "source": "590cf92/decode-quick",
                              "choice": {"impl": "triton", "route": "fma", "block_n": 32, …},
                              "us": 6.83, "alternatives": {…}}, …],
             "decode.moe": [{"rows": 1, "choice": {"route": "fma", "block_n_up": 8, …}, …}], …}}

Every entry has ``rows`` (the token rows it was measured at: the batch of a decode step, the tokens of a prefill
chunk, the prompt length for ``prefill.chunk``), ``choice`` and ``source`` (a key of ``sources``); ``shape`` for
the ops keyed by shape; anything else (``us``, ``alternatives``, ``why``) is the evidence, kept for the reader.
The ops (:data:`OPS`) and their choice fields:

===================== ===================================================================================
op                    choice
===================== ===================================================================================
``decode.gemv``       per projection ``shape`` (:func:`shape_key`): ``impl`` (``triton``/``cublas``),
                      ``route``, ``cublas_out`` and the fields of ``fp8_gemv.GemvGeometry`` (a cuBLAS entry's
                      geometry is what the own kernel runs when a caller fixes the route)
``decode.moe``        ``route`` (a route of ``kernel_families.MOE``: ``dot``, ``fma``, ``int8``, ``dot_scaled``,
                      ``fp8lut``) and the fields of ``fp4_moe_decode.MoeGeometry``
``decode.attention``  the fields of ``attention_decode.AttentionGeometry``
``decode.attention_split`` ``kernel`` (``slices``: ``decode.attention``'s kernel; ``split``: the split-KV
                      ``attention_split_decode`` where a query's selection lists ``≥ min_entries`` rows — window +
                      compressed —, ``decode.attention``'s kernel below) and the fields of
                      ``attention_split_decode.SplitKvGeometry``
``decode.indexer``    ``kernel`` (``fused``: ``indexer_decode``; ``split``: ``indexer_split_decode`` where the key
                      cache holds ``≥ min_entries`` keys, the fused kernel below) and the fields of
                      ``indexer_split_decode.IndexerSplitGeometry``
``decode.mhc_site``   the fields of ``mhc.MhcSiteGeometry`` (the one-launch site, ≤ ``mhc.SITE_MAX_ROWS`` rows)
``decode.fusion``     per fused path of the decode step (a name of ``kernel_families.FUSIONS``): ``true`` / ``false``
                      (a name the entry leaves out: the device default, ``Defaults.fusions``)
``prefill.moe``       ``route``, ``tag`` (a launch variant of :func:`~dsv4lab.engine.kernel_families.moe_tags`),
                      ``decode``, ``persistent``, ``scale_per_byte``
``prefill.moe_rows``  ``sorter_rows``
``prefill.gemm``      ``backend`` of the FP8 projections (``triton``/``cublas``)
``prefill.weight_gemm`` ``backend`` of the bf16-activation GEMMs (``triton``/``cublas``)
``prefill.mhc_rows``  ``enabled`` (the mHC rows kernel instead of the decode step's pair), ``geometry`` (a name
                      of ``mhc.ROWS_GEOMETRIES``)
``prefill.chunk``     ``chunk`` (tokens per prefill chunk; 0: the whole prompt at once)
===================== ===================================================================================

**Lookup** (one rule for every op): among the entries of the op (and shape), the one measured at the fewest rows
≥ the call's, else the one at the most rows; nothing for the op or shape → the default. A call without a row
count (a prefill setting asked for outside a call) takes the entry at the most rows.

**Defaults** (a GPU without a tuned file, a shape or op the file does not hold, or ``DSV4LAB_TUNED=off``): the own
kernels — the GEMV's ``dot`` route with K split until the grid has about two programs per SM
(:meth:`Dispatch.own_gemv`), the routed MoE's ``fma`` route on 8-row one-warp programs (the H200's fastest at
every batch tier, af2b4dc), the one-pass split attention, the fused indexer (the long-context split kernels,
``decode.attention_split`` and ``decode.indexer``'s ``split``, run only where a tuned entry or
:attr:`Defaults.attention_split` / :attr:`Defaults.indexer_split` chooses them: not measured yet); the prefill
settings of :data:`PREFILL_DEFAULTS` (the
bf16 MoE route at 64 sorter rows, cuBLAS where it applies, the mHC pair, one chunk up to 4,096 tokens). Under
Triton's interpreter (a machine without a GPU) :data:`INTERPRETER_DEFAULTS`: few, large programs and the CUDA-core
routes, whose fp32 sums are closest to the reference's exact ones; no tuned file is read.

This module imports neither torch nor triton; the backends build the kernels' geometry classes from a
:class:`Pick` (:meth:`Pick.build`, which names the file and entry of a field the class does not have).
"""
from __future__ import annotations

import importlib.util
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from dsv4lab.core.errors import DSV4LabError
from dsv4lab.core.paths import KERNELS_DIR, display_path, read_json
from dsv4lab.engine.kernel_families import FUSION_NAMES, MOE, moe_tags

log = logging.getLogger("dsv4lab.triton")

SCHEMA = "dsv4lab.tuned/1"
ENV = "DSV4LAB_TUNED"
RETIRED_ENV = ("DSV4LAB_DECODE_DISPATCH", "DSV4LAB_PREFILL_CHOICES")

OPS = {
    # op: (keyed by shape, its own choice fields, the kernel geometry class whose fields it also takes)
    "decode.gemv": (True, ("impl", "route", "cublas_out"), "fp8_gemv.GemvGeometry"),
    "decode.moe": (False, ("route",), "fp4_moe_decode.MoeGeometry"),
    "decode.attention": (False, (), "attention_decode.AttentionGeometry"),
    "decode.attention_split": (False, ("kernel", "min_entries"), "attention_split_decode.SplitKvGeometry"),
    "decode.indexer": (False, ("kernel", "min_entries"), "indexer_split_decode.IndexerSplitGeometry"),
    "decode.mhc_site": (False, (), "mhc.MhcSiteGeometry"),
    "decode.fusion": (False, FUSION_NAMES, None),
    "prefill.moe": (False, ("route", "tag", "decode", "persistent", "scale_per_byte"), None),
    "prefill.moe_rows": (False, ("sorter_rows",), None),
    "prefill.gemm": (False, ("backend",), None),
    "prefill.weight_gemm": (False, ("backend",), None),
    "prefill.mhc_rows": (False, ("enabled", "geometry"), None),
    "prefill.chunk": (False, ("chunk",), None),
}
"""op → (keyed by shape, its own choice fields, the kernel geometry class (``module.Class`` of ``dsv4lab_kernels``)
whose fields a choice may also hold — checked when the backend builds it, :meth:`Pick.build`)."""

PREFILL_SETTINGS = {
    # a TritonPrefillOps setting (prefill_<name>) → (op, field of its choice)
    "moe_route": ("prefill.moe", "route"), "moe_tag": ("prefill.moe", "tag"),
    "moe_decode": ("prefill.moe", "decode"), "moe_persistent": ("prefill.moe", "persistent"),
    "moe_scale_per_byte": ("prefill.moe", "scale_per_byte"), "moe_rows": ("prefill.moe_rows", "sorter_rows"),
    "gemm_backend": ("prefill.gemm", "backend"), "weight_gemm_backend": ("prefill.weight_gemm", "backend"),
    "mhc_rows": ("prefill.mhc_rows", "enabled"), "mhc_rows_geometry": ("prefill.mhc_rows", "geometry"),
    "chunk": ("prefill.chunk", "chunk"),
}

PREFILL_DEFAULTS = {
    "moe_route": "bf16", "moe_tag": "", "moe_rows": 64, "gemm_backend": "auto", "weight_gemm_backend": "auto",
    "mhc_rows": False, "mhc_rows_geometry": "",
    # moe_decode / moe_persistent / moe_scale_per_byte: the launch variant's (moe_tag) fields, else the kernel's
    # chunk: None = one chunk up to Defaults.prefill_max_chunk tokens, chunks of that size beyond
    # the launch configurations the prefill kernels take by name (set on the backend; never tuned so far)
    "gemm_config": "m128n128", "weight_gemm_config": "n128m64", "attention_config": "h64n32x",
    "indexer_config": "q2t64x8",
}
"""The prefill settings where nothing was measured (``auto``: cuBLAS where its probe passed on this device)."""


class DispatchError(DSV4LabError, ValueError):
    """A tuned file is malformed, or names a field its kernel does not have; the message names the file."""


@dataclass(frozen=True)
class Defaults:
    """What a device runs where its tuned file holds nothing.

    Attributes:
        name: ``"gpu"`` or ``"interpreter"``.
        gemv_route: the decode GEMV's route; gemv_block_n, gemv_block_k: its tile; gemv_target_programs: K is
            split until a projection's grid has about this many programs (the partials summed in a fixed order).
        moe_route, moe_geometry: the routed MoE's route and ``MoeGeometry`` fields (over the kernel's defaults).
        attention_geometry: ``AttentionGeometry`` fields of the decode attention (None: the kernel's default).
        attention_split: the split-KV attention's choice where nothing is tuned — ``min_entries`` and
            ``SplitKvGeometry`` fields (None: never).
        indexer_split: the split indexer's choice where nothing is tuned — ``min_entries`` and
            ``IndexerSplitGeometry`` fields (None: the fused kernel). Both are the device's override of the
            long-context kernels (a test or a GPU visit may force them: :func:`dataclasses.replace` of a default).
        decode_max_rows: token rows up to which the decode kernels run.
        prefill_min_tokens: fewest token rows for the prefill kernels.
        prefill_max_chunk: the prefill chunk where none was measured (one chunk up to it, chunks of it beyond;
            4,096: one real-dims CSA layer prefilled fastest in 4,096-token chunks, docs/kernels_prefill.md).
        fusions: the decode step's fused paths on where nothing was measured (names of
            ``kernel_families.FUSIONS``): all of them under the interpreter (fewer launches, the same bits), none on
            a GPU until a visit has timed the step with them (``docs/kernels_decode.md``, "Fused paths").
    """

    name: str
    gemv_route: str
    gemv_block_n: int
    gemv_block_k: int
    gemv_target_programs: int
    moe_route: str
    moe_geometry: dict = field(default_factory=dict, hash=False)
    attention_geometry: dict | None = field(default=None, hash=False)
    attention_split: dict | None = field(default=None, hash=False)
    indexer_split: dict | None = field(default=None, hash=False)
    decode_max_rows: int = 63
    prefill_min_tokens: int = 64
    prefill_max_chunk: int = 4096
    fusions: tuple = ()


GPU_DEFAULTS = Defaults(
    "gpu", gemv_route="dot", gemv_block_n=32, gemv_block_k=512, gemv_target_programs=264, moe_route="fma",
    # the routed MoE: what the H200 measured fastest at every batch tier (af2b4dc: 8-row one-warp FMA programs,
    # 72.6 µs at batch 1 against 122.8 for the dot route's default geometry)
    moe_geometry=dict(block_n_up=8, block_n_down=8, num_warps=1, num_stages=2),
    # one-pass split attention: the exact two-pass single-slice form is latency-bound at decode sizes
    attention_geometry=dict(block_h=16, block_r=32, splits=16, two_pass=False))
INTERPRETER_DEFAULTS = Defaults(
    "interpreter", gemv_route="fma", gemv_block_n=256, gemv_block_k=256, gemv_target_programs=1, moe_route="fma",
    moe_geometry=dict(block_n_up=128, block_n_down=256, block_k=256),
    attention_geometry=dict(block_h=16, block_r=64), fusions=FUSION_NAMES)


def shape_key(n: int, k: int, groups: int, weight: str, act_quant: bool) -> str:
    """The key of a decode projection in the tuned file: ``"N×K/G:fmt:aq"`` (N all groups' rows, K per group)."""
    return f"{n}x{k}/{groups}:{weight}:{'aq' if act_quant else 'noaq'}"


def parse_shape_key(key: str) -> tuple[int, int, int, str, bool]:
    """``(N, K, groups, weight, act_quant)`` of a :func:`shape_key` (a malformed key: :class:`DispatchError`)."""
    m = re.fullmatch(r"(\d+)x(\d+)/(\d+):(\w+):(aq|noaq)", key)
    if m is None:
        raise DispatchError(f"shape key {key!r}: expected N×K/G:weight:aq|noaq, e.g. 1536x4096/1:fp8:aq")
    return int(m[1]), int(m[2]), int(m[3]), m[4], m[5] == "aq"


def split_k_for(n: int, k: int, block_n: int, block_k: int, programs: int) -> int:
    """K splits that bring an ``[n, k]`` projection's GEMV grid to about ``programs`` programs (the partials are
    summed in a fixed order: deterministic)."""
    row_blocks = -(-n // block_n)
    return max(1, min(-(-programs // row_blocks), -(-k // block_k)))


def gpu_slug(device_name: str) -> str:
    """``"NVIDIA H200"`` → ``"h200"``: the file name of a GPU's tuned table."""
    name = re.sub(r"^nvidia\s+", "", device_name.strip().lower())
    return re.sub(r"[^a-z0-9]+", "_", name).strip("_") or "unknown"


def tuned_dir() -> Path:
    """``dsv4lab_kernels/tuned/`` where the kernels are imported from (the checkout's ``kernels/`` or a wheel)."""
    spec = importlib.util.find_spec("dsv4lab_kernels")
    root = Path(spec.origin).parent if spec is not None and spec.origin else KERNELS_DIR
    return root / "tuned"


def tuned_path(device_name: str) -> Path:
    """The tuned file of the GPU named ``device_name`` (it may not exist)."""
    return tuned_dir() / f"{gpu_slug(device_name)}.json"


# ============================================================================================ the tuned table
class Tuned:
    """The entries of one tuned file (or none: every lookup finds nothing), validated on construction."""

    def __init__(self, doc: dict | None = None, where: str = "no tuned file"):
        self.where = where
        doc = doc or {}
        self.gpu = doc.get("gpu")
        self.sources: dict = dict(doc.get("sources") or {})
        self._ops: dict[str, dict[str | None, list[dict]]] = {}
        if not doc:
            return
        if doc.get("schema") != SCHEMA:
            raise DispatchError(f"{where}: schema {doc.get('schema')!r}, expected {SCHEMA!r}")
        if not isinstance(doc.get("ops"), dict):
            raise DispatchError(f"{where}: 'ops' must be an object of op → entries")
        for op, entries in doc["ops"].items():
            if op not in OPS:
                raise DispatchError(f"{where}: unknown op {op!r} (known: {', '.join(OPS)})")
            for i, e in enumerate(entries):
                self._add(op, e, f"{where}: {op}[{i}]")

    def _add(self, op: str, e, at: str) -> None:
        keyed, own, geometry = OPS[op]
        if not isinstance(e, dict) or not isinstance(e.get("choice"), dict) or "rows" not in e:
            raise DispatchError(f"{at}: needs 'rows' and a 'choice' object")
        try:
            rows = int(e["rows"])
        except (TypeError, ValueError):
            raise DispatchError(f"{at}: 'rows' must be an integer, got {e['rows']!r}") from None
        if keyed != ("shape" in e):
            raise DispatchError(f"{at}: {'needs' if keyed else 'takes no'} 'shape'")
        if e.get("source") not in self.sources:
            raise DispatchError(f"{at}: source {e.get('source')!r} is not among 'sources'")
        if geometry is None and set(e["choice"]) - set(own):
            bad = ", ".join(sorted(set(e["choice"]) - set(own)))
            raise DispatchError(f"{at}: unknown choice field(s) {bad} (known: {', '.join(own)})")
        if op == "decode.fusion" and not all(isinstance(v, bool) for v in e["choice"].values()):
            raise DispatchError(f"{at}: each fused path is true or false, got {e['choice']}")
        if op == "decode.moe" and e["choice"].get("route", "dot") not in MOE.accumulation:
            raise DispatchError(f"{at}: unknown routed-MoE route {e['choice']['route']!r} (known: "
                                f"{', '.join(MOE.accumulation)})")
        table = self._ops.setdefault(op, {}).setdefault(e.get("shape"), [])
        table.append(dict(e, rows=rows, at=at))
        table.sort(key=lambda x: x["rows"])

    def lookup(self, op: str, rows: int | None, shape: str | None = None) -> dict | None:
        """The entry of ``op`` (and ``shape``) at ``rows`` rows by the module's rule, or None."""
        table = self._ops.get(op, {}).get(shape)
        if not table:
            return None
        if rows is None:
            return table[-1]
        return next((e for e in table if e["rows"] >= rows), table[-1])

    def entries(self, op: str) -> list[dict]:
        return [e for table in self._ops.get(op, {}).values() for e in table]

    def __len__(self) -> int:
        return sum(len(t) for tables in self._ops.values() for t in tables.values())

    def describe(self) -> str:
        if not len(self):
            return f"no tuned entries ({self.where})"
        ops = ", ".join(f"{op} {len(self.entries(op))}" for op in OPS if self.entries(op))
        return f"tuned for {self.gpu}: {ops} entries from {self.where}"


def read_tuned(path: str | Path) -> Tuned:
    """The tuned file at ``path`` (a missing file, bad JSON or a bad entry: :class:`DispatchError` naming it)."""
    p = Path(path)
    if not p.is_file():
        raise DispatchError(f"tuned file {p} does not exist")
    return Tuned(read_json(p, DispatchError), display_path(p))


def load_tuned(device_name: str | None, path: str | Path | None = None) -> Tuned:
    """The tuned table for the GPU named ``device_name``: ``path``, else ``$DSV4LAB_TUNED``, else
    :func:`tuned_path` — used only when it was measured on that GPU (none for ``None``: no GPU)."""
    for old in RETIRED_ENV:
        if os.environ.get(old):
            raise DispatchError(f"{old} is no longer read: point {ENV} at a tuned file (kernels/dsv4lab_kernels/"
                                f"tuned/<gpu>.json, or one a benchmark wrote), or set {ENV}=off for the defaults")
    env = os.environ.get(ENV)
    if env == "off" and path is None:
        return Tuned(None, f"{ENV}=off")
    if device_name is None:
        return Tuned(None, "no GPU")
    p = Path(path or env or tuned_path(device_name))
    if not p.is_file():
        if path or env:
            raise DispatchError(f"tuned file {p} does not exist ({'named by ' + ENV if env and not path else 'given'})")
        return Tuned(None, f"no {display_path(p)}")
    tuned = read_tuned(p)
    if tuned.gpu != device_name:
        log.info("tuned file %s was measured on %s, this is %s: using the defaults", p, tuned.gpu, device_name)
        return Tuned(None, f"{p.name} is for {tuned.gpu}")
    return tuned


# ============================================================================================ choices
@dataclass(frozen=True)
class Pick:
    """One choice: the implementation (``triton``; ``cublas`` or ``cublas:bfloat16`` for the GEMV's cuBLAS with
    that output), the route, the launch fields and where they came from (``tuned …`` or ``default``)."""

    impl: str
    route: str | None
    fields: dict = field(hash=False)
    where: str = "default"

    def build(self, cls):
        """``cls(**fields)`` — a kernel geometry class; a field it does not have names the tuned entry."""
        try:
            return cls(**self.fields)
        except TypeError as err:
            raise DispatchError(f"{self.where}: {cls.__name__}: {err}") from None


class Dispatch:
    """Kernel choice on one device: the tuned table (possibly empty) over the device's defaults."""

    def __init__(self, tuned: Tuned | None = None, defaults: Defaults = GPU_DEFAULTS):
        self.tuned = tuned if tuned is not None else Tuned()
        self.defaults = defaults

    @classmethod
    def for_device(cls, device_name: str | None, interpreting: bool) -> "Dispatch":
        """This process's dispatch: the interpreter's defaults under Triton's interpreter, else the tuned table of
        the GPU named ``device_name`` over :data:`GPU_DEFAULTS`."""
        if interpreting:
            return cls(Tuned(None, "the interpreter"), INTERPRETER_DEFAULTS)
        return cls(load_tuned(device_name), GPU_DEFAULTS)

    @property
    def max_rows(self) -> int:
        return self.defaults.decode_max_rows

    def _tuned(self, op: str, rows: int | None, shape: str | None = None) -> dict | None:
        return self.tuned.lookup(op, rows, shape)

    @staticmethod
    def _where(e: dict) -> str:
        return f"tuned {e['at']} ({e['source']})"

    # ------------------------------------------------------------------ decode
    def gemv(self, n: int, k: int, rows: int = 1, groups: int = 1, weight: str = "fp8",
             act_quant: bool = True) -> Pick:
        """An ``[n, k]`` projection per group (``groups`` of them: the grouped ``wo_a``) at ``rows`` rows: the
        tuned entry of its shape, else :meth:`own_gemv`."""
        e = self._tuned("decode.gemv", rows, shape_key(n * groups, k, groups, weight, act_quant))
        if e is None:
            return self.own_gemv(n, k)
        c = dict(e["choice"])
        impl, route, out = c.pop("impl", "triton"), c.pop("route", "dot"), c.pop("cublas_out", "float32")
        if impl == "cublas" and out != "float32":
            impl = f"cublas:{out}"
        return Pick(impl, route, c, self._where(e))

    def own_gemv(self, n: int, k: int) -> Pick:
        """The own GEMV where nothing was measured: the default route and tile (no wider than the projection), K
        split until the grid has about ``gemv_target_programs`` programs."""
        d = self.defaults
        bn = min(d.gemv_block_n, 1 << max(n - 1, 1).bit_length())
        bk = min(d.gemv_block_k, 128 * -(-k // 128))
        return Pick("triton", d.gemv_route,
                    dict(block_n=bn, block_k=bk, split_k=split_k_for(n, k, bn, bk, d.gemv_target_programs)))

    def moe(self, rows: int | None = None) -> Pick:
        """The routed MoE at ``rows`` rows (None: the default, as its separate stages take)."""
        e = self._tuned("decode.moe", rows) if rows is not None else None
        if e is None:
            return Pick("triton", self.defaults.moe_route, dict(self.defaults.moe_geometry))
        c = dict(e["choice"])
        return Pick("triton", c.pop("route", "dot"), c, self._where(e))

    def attention(self, rows: int | None = None) -> Pick | None:
        """The decode attention's fields at ``rows`` query rows (``rows`` None: the default; None: the kernel's)."""
        e = self._tuned("decode.attention", rows) if rows is not None else None
        if e is not None:
            return Pick("triton", None, dict(e["choice"]), self._where(e))
        g = self.defaults.attention_geometry
        return None if g is None else Pick("triton", None, dict(g))

    def attention_split(self, rows: int, entries: int) -> Pick | None:
        """The split-KV attention's geometry fields for ``rows`` query rows whose selection lists ``entries`` rows
        (the window's and the compressed cache's, as the call is shaped: a captured graph keeps its kernel), when
        the tuned entry's ``kernel`` (else :attr:`Defaults.attention_split`) is ``split`` and ``entries ≥
        min_entries``; None: the kernel of :meth:`attention`."""
        return self._long_context("decode.attention_split", rows, entries, self.defaults.attention_split)

    def indexer(self, rows: int, keys: int) -> Pick | None:
        """The split indexer's geometry fields for ``rows`` rows over a key cache of ``keys`` entries, when the
        tuned entry's ``kernel`` (else :attr:`Defaults.indexer_split`) is ``split`` and ``keys ≥ min_entries``;
        None: the fused kernel (``indexer_decode``)."""
        return self._long_context("decode.indexer", rows, keys, self.defaults.indexer_split)

    def _long_context(self, op: str, rows: int, entries: int, default: dict | None) -> Pick | None:
        """A long-context kernel's choice: the tuned entry at ``rows`` (else ``default``) when its ``kernel`` is
        ``split`` (the default) and ``entries`` reach its ``min_entries``; None: today's kernel."""
        e = self._tuned(op, rows)
        c, where = (dict(e["choice"]), self._where(e)) if e is not None else (dict(default or {}), "default")
        if not c or c.pop("kernel", "split") != "split":
            return None
        if entries < int(c.pop("min_entries", 0)):
            return None
        return Pick("triton", None, c, where)

    def fused(self, name: str, rows: int) -> bool:
        """Whether the decode step's fused path ``name`` (:data:`~dsv4lab.engine.kernel_families.FUSIONS`) runs at
        ``rows`` token rows: the tuned ``decode.fusion`` entry's choice where it names it, else the device's
        default (:attr:`Defaults.fusions`)."""
        if name not in FUSION_NAMES:
            raise ValueError(f"unknown fused path {name!r}; known: {', '.join(FUSION_NAMES)}")
        e = self._tuned("decode.fusion", rows)
        if e is not None and name in e["choice"]:
            return bool(e["choice"][name])
        return name in self.defaults.fusions

    def mhc_site(self, rows: int) -> Pick | None:
        """The one-launch mHC site's fields at ``rows`` rows when tuned (None: the kernel's for the row count)."""
        e = self._tuned("decode.mhc_site", rows)
        return None if e is None else Pick("triton", None, dict(e["choice"]), self._where(e))

    # ------------------------------------------------------------------ prefill
    def prefill(self, setting: str, tokens: int | None = None):
        """The tuned value of a prefill setting (a key of :data:`PREFILL_SETTINGS`) at ``tokens`` rows, else its
        default (:data:`PREFILL_DEFAULTS`; None where the kernel's own applies). A launch variant the families do
        not declare counts as not measured."""
        op, name = PREFILL_SETTINGS[setting]
        e = self._tuned(op, tokens)
        value = None if e is None else e["choice"].get(name)
        if setting == "moe_tag" and value is not None and value not in moe_tags():
            value = None
        return PREFILL_DEFAULTS.get(setting) if value is None else value

    def chunk(self, prompt_tokens: int) -> int:
        """The prefill chunk for a prompt of ``prompt_tokens`` tokens: the tuned one (0 there: one chunk), else one
        chunk up to ``prefill_max_chunk`` tokens and chunks of that size beyond. Returns tokens (≥ 1)."""
        if prompt_tokens < 1:
            raise ValueError(f"prefill chunk: prompt_tokens must be ≥ 1, got {prompt_tokens}")
        chunk = self.prefill("chunk", prompt_tokens)
        if chunk is None:
            chunk = min(prompt_tokens, self.defaults.prefill_max_chunk)
        return prompt_tokens if chunk == 0 else min(chunk, prompt_tokens)

    def describe(self) -> str:
        return f"kernel dispatch: {self.tuned.describe()} over the {self.defaults.name} defaults"


__all__ = ["SCHEMA", "ENV", "OPS", "PREFILL_SETTINGS", "PREFILL_DEFAULTS", "DispatchError", "Defaults",
           "GPU_DEFAULTS", "INTERPRETER_DEFAULTS", "shape_key", "parse_shape_key", "split_k_for", "gpu_slug",
           "tuned_dir", "tuned_path", "Tuned", "read_tuned", "load_tuned", "Pick", "Dispatch"]
