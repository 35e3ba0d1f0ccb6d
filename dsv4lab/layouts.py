"""Kernel-native weight layouts, output/input fingerprinting, and load-time repair of permuted weights.

The paper's decisive bug: a kernel library's pre-shuffled layout for the routed-expert down projection (W2)
disagreed with the loader, so the 16-row blocks inside each 128-row tile came out permuted
(fast → reference ``[0,2,4,6,1,3,5,7]``). Stage 1 matched the oracle, stage 2 did not; output-column
fingerprinting found the permutation and permuting W2 **and its scales** once at load time fixed it. This
module makes that detective work a tool:

* **Layouts as data** — :class:`Layout` subclasses describe how a kernel (or a buggy writer) stores a native
  weight: :class:`Permutation` / :class:`BlockPermutation` / :class:`GateUpInterleave` (rows or columns),
  :class:`TilePreshuffle` (the ``(N/BN, K/BK, BK/Ke, BN, Ke)`` tile order), :class:`NibbleSwap`, :class:`KMajor`
  and :class:`Inverse`. Each transforms a packed FP4 weight (int8 ``[N, K/2]``, element ``2c`` in the low
  nibble, E8M0 scale ``[N, K/32]``), an FP8 weight (E4M3 ``[N, K]``, E8M0 scale ``[⌈N/128⌉, ⌈K/128⌉]``) or a
  dense one **and** its scale consistently, on the stored bytes, and has an exact inverse. Permutations the
  128×128 FP8 block scales cannot follow are refused with :class:`LayoutError`.
* **Fingerprinting** — :func:`fingerprint` compares two ops (callables ``[n, in] → [n, out]``) and returns the
  permutation ``perm`` with ``suspect(x)[:, i] == reference(x)[:, perm[i]]`` (``side="rows"``) or the input-side
  one (``side="cols"``), its block structure ("16-row blocks in 128-row tiles: [0,2,4,6,1,3,5,7]"), the residual
  after alignment and a confidence. :func:`fingerprint_recorded` does the same against recorded arrays (golden
  activation dumps) instead of a reference op. :func:`diagnose_linear` explains one stored linear against a
  reference: a row/column permutation (scales following or not) or a catalogue layout, checked by residual.
* **Repair specs** — :class:`RepairSpec` (JSON: tensor-name pattern → the layout the tensors are stored in; the
  repair undoes it on the weight and its ``.scale``), applied per tensor while loading (:func:`apply_repairs`,
  :meth:`RepairSpec.bind`) or by :func:`repair_checkpoint`, which writes a corrected copy (never in place).
* **Fault catalogue** — :data:`FAULTS` reproduces real bug classes; :func:`inject_fault_into_checkpoint`
  writes a faulted copy. :func:`fingerprint_checkpoint` finds them per tensor class and writes the repair spec.

Conventions: a layout maps *native* → *stored*. For permutations ``stored[i] = native[perm[i]]`` along the
side, which is exactly the fingerprint's ``perm`` (suspect index ``i`` holds reference index ``perm[i]``), so
the fingerprint of a stored layout is the layout itself and the repair is its inverse. All work is on packed
bytes; only one linear at a time is ever dequantized (for fingerprinting), never a whole checkpoint.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Iterator, Literal, Mapping, Sequence

import torch

from . import quant

Side = Literal["rows", "cols"]
ScalePolicy = Literal["follow", "keep"]
FORMATS = ("fp4", "fp8", "dense")
FP4_GROUP = quant.FP4_BLOCK          # E8M0 scale per 32 elements of a row
FP8_BLOCK = quant.FP8_WEIGHT_BLOCK   # E8M0 scale per 128×128 block
SPEC_FORMAT = "dsv4lab.repair-spec/1"


class LayoutError(ValueError):
    """A layout cannot be applied (shape, dtype, or a permutation the block scales cannot follow), or a repair
    spec is malformed; the message names the tensor or field."""


# ============================================================================================ formats
def weight_format(weight: torch.Tensor) -> str:
    """``"fp4"`` (packed int8/uint8 bytes), ``"fp8"`` (E4M3) or ``"dense"`` (any other float) from the dtype."""
    if weight.dtype in (torch.int8, torch.uint8) or weight.dtype == getattr(torch, "float4_e2m1fn_x2", None):
        return "fp4"
    if weight.dtype == torch.float8_e4m3fn:
        return "fp8"
    if weight.is_floating_point():
        return "dense"
    raise LayoutError(f"weight dtype {weight.dtype} is not a packed FP4, FP8 or dense float weight")


def format_of_dtype_code(code: str) -> str:
    """The format of a weight stored with safetensors dtype ``code`` (``I8`` → fp4, ``F8_E4M3`` → fp8, ...)."""
    return {"I8": "fp4", "U8": "fp4", "F4": "fp4", "F8_E4M3": "fp8"}.get(code, "dense")


def logical_shape(stored_shape: Sequence[int], fmt: str) -> tuple[int, int]:
    """``(N, K)`` of a weight stored with ``stored_shape`` (FP4 bytes hold two elements)."""
    if len(stored_shape) != 2:
        raise LayoutError(f"expected a 2-D weight, got shape {list(stored_shape)}")
    n, k = int(stored_shape[0]), int(stored_shape[1])
    return (n, 2 * k) if fmt == "fp4" else (n, k)


def dequantize(weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The logical ``[N, K]`` weight of one linear (exact in fp64). Used on one tensor at a time only."""
    fmt = weight_format(weight)
    if fmt == "fp4":
        return quant.fp4_dequant(weight, scale, dtype)
    if fmt == "fp8":
        return quant.fp8_block_dequant(weight, scale, dtype)
    return weight.to(dtype)


def linear_op(weight: torch.Tensor, scale: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x ↦ x @ Wᵀ`` in fp64 for a stored linear (the weight is dequantized once, here)."""
    w = dequantize(weight, scale)
    return lambda x: x.to(torch.float64) @ w.T


# ============================================================================================ permutations
def invert_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[i]] = i``."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(len(perm), dtype=perm.dtype, device=perm.device)
    return inv


def check_permutation(perm: torch.Tensor, n: int | None = None, what: str = "permutation") -> torch.Tensor:
    """Return ``perm`` as a LongTensor, or raise :class:`LayoutError` if it is not a permutation of ``range(n)``."""
    p = torch.as_tensor(perm, dtype=torch.long).flatten()
    if n is not None and len(p) != n:
        raise LayoutError(f"{what}: has length {len(p)}, the tensor dimension is {n}")
    if len(p) and not torch.equal(torch.sort(p).values, torch.arange(len(p))):
        raise LayoutError(f"{what}: is not a permutation of 0..{len(p) - 1}")
    return p


def _scale_block_index(perm: torch.Tensor, block: int, n_scale: int, what: str) -> torch.Tensor:
    """The gather index for block scales along a permuted dimension, or an error when rows leave their block.

    Stored block ``b`` must take all its rows from one native block ``src[b]`` (rows may move freely *within*
    a block, and whole blocks may move); then ``stored_scale[b] = native_scale[src[b]]``.
    """
    n = len(perm)
    if n_scale != -(-n // block):
        raise LayoutError(f"{what}: scale has {n_scale} blocks along the permuted dimension, "
                          f"expected ⌈{n}/{block}⌉ = {-(-n // block)}")
    src_block = perm // block
    src = src_block[torch.arange(0, n, block)]
    dst = torch.arange(n) // block
    bad = (src_block != src[dst]).nonzero()
    if len(bad) or not torch.equal(torch.sort(src).values, torch.arange(n_scale)):
        i = int(bad[0]) if len(bad) else 0
        raise LayoutError(
            f"{what}: the permutation moves rows across {block}-wide scale blocks (stored index {i} comes from "
            f"block {int(src_block[i])}, its block's first index from block {int(src[dst[i]])}); block scales "
            f"can only follow permutations that keep {block}-wide blocks intact or move whole blocks")
    return src


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """1-byte tensors as uint8 (copy/index kernels for fp8/e8m0 are not available everywhere)."""
    return quant.as_bytes(t) if t.element_size() == 1 else t


def _restore(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(like.dtype) if like.element_size() == 1 else t.contiguous()


def _gather(t: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    return _restore(_byte_view(t).index_select(dim, index.to(t.device)), t)


def _gather_fp4_columns(w: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Gather logical columns of packed FP4 bytes; whole bytes move when pairs stay pairs, else codes move."""
    b = _byte_view(w)
    even, odd = index[0::2], index[1::2]
    if bool((even % 2 == 0).all()) and torch.equal(odd, even + 1):
        return _restore(b.index_select(1, (even // 2).to(w.device)), w)
    codes = quant.unpack_fp4(b).index_select(1, index.to(w.device))  # codes only: nothing is dequantized
    return _restore(quant.pack_fp4(codes), w)


# ============================================================================================ layouts
class Layout:
    """How a native weight (and its scale) is stored by a kernel or a writer; an exact, invertible map.

    Subclasses are frozen dataclasses (their fields are the JSON parameters) and implement
    :meth:`transform`. ``native → stored`` is :meth:`apply`; ``stored → native`` (the repair) is :meth:`invert`.
    """

    name: ClassVar[str] = ""

    def transform(self, tensor: torch.Tensor, role: str, fmt: str, shape: tuple[int, int],
                  inverse: bool = False) -> torch.Tensor:
        """Transform one tensor. ``role`` is ``"weight"`` or ``"scale"``; ``fmt`` the weight format; ``shape``
        the logical ``(N, K)`` of the weight as it is before this transform."""
        raise NotImplementedError

    def shape_after(self, stored_shape: tuple[int, ...], role: str, fmt: str, inverse: bool = False) -> tuple[int, ...]:
        """The stored shape of a tensor after :meth:`transform` (only transposing layouts change it)."""
        return tuple(stored_shape)

    def apply(self, weight: torch.Tensor, scale: torch.Tensor | None = None):
        """``native → stored`` for a weight and its scale; returns ``(weight, scale)``."""
        return self._both(weight, scale, inverse=False)

    def invert(self, weight: torch.Tensor, scale: torch.Tensor | None = None):
        """``stored → native`` for a weight and its scale (the repair); returns ``(weight, scale)``."""
        return self._both(weight, scale, inverse=True)

    def _both(self, weight, scale, inverse):
        fmt = weight_format(weight)
        shape = logical_shape(weight.shape, fmt)
        w = self.transform(weight, "weight", fmt, shape, inverse)
        s = None if scale is None else self.transform(scale, "scale", fmt, shape, inverse)
        return w, s

    def params(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def to_json(self) -> dict[str, Any]:
        return {"layout": self.name, **self.params()}

    def describe(self) -> str:
        return self.name

    def __str__(self) -> str:
        return self.describe()


def _jsonable(v):
    if isinstance(v, Layout):
        return v.to_json()
    if isinstance(v, tuple):
        return list(v)
    return v


LAYOUTS: dict[str, type[Layout]] = {}
"""Layout name → class; :func:`layout_from_json` builds any of them from its JSON form."""


def _register(cls):
    LAYOUTS[cls.name] = cls
    return cls


def layout_from_json(d: Mapping[str, Any], where: str = "layout") -> Layout:
    """Build a layout from ``{"layout": NAME, **params}`` (the form :meth:`Layout.to_json` writes)."""
    if not isinstance(d, Mapping) or "layout" not in d:
        raise LayoutError(f"{where}: expected an object with a 'layout' key, got {d!r}"[:300])
    cls = LAYOUTS.get(d["layout"])
    if cls is None:
        raise LayoutError(f"{where}: unknown layout {d['layout']!r} (known: {', '.join(sorted(LAYOUTS))})")
    names = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in d.items():
        if k == "layout":
            continue
        if k not in names:
            raise LayoutError(f"{where}: layout {d['layout']!r} has no parameter {k!r} (has: {', '.join(names)})")
        if isinstance(v, Mapping) and "layout" in v:
            v = layout_from_json(v, f"{where}.{k}")
        elif isinstance(v, list):
            v = tuple(v)
        kwargs[k] = v
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise LayoutError(f"{where}: bad parameters for layout {d['layout']!r}: {err}") from None


class _IndexLayout(Layout):
    """A permutation of rows or columns: ``stored[i] = native[index(n)[i]]`` along ``side``.

    Scales follow the permutation (``scales="follow"``: FP4 scale rows with their rows, 32-column groups with
    their columns, FP8 128-blocks only when whole blocks move) or stay where they are (``scales="keep"``,
    the bug where a writer permuted weights but not their scales).
    """

    side: Side
    scales: ScalePolicy

    def _validate_common(self):
        if self.side not in ("rows", "cols"):
            raise LayoutError(f"{self.name}: side must be 'rows' or 'cols', got {self.side!r}")
        if self.scales not in ("follow", "keep"):
            raise LayoutError(f"{self.name}: scales must be 'follow' or 'keep', got {self.scales!r}")

    def index(self, n: int) -> torch.Tensor:
        raise NotImplementedError

    @property
    def unit(self) -> str:
        return "row" if self.side == "rows" else "column"

    def transform(self, tensor, role, fmt, shape, inverse=False):
        n = shape[0] if self.side == "rows" else shape[1]
        idx = self.index(n)
        if inverse:
            idx = invert_permutation(idx)
        dim = 0 if self.side == "rows" else 1
        if role == "weight":
            if fmt == "fp4" and dim == 1:
                return _gather_fp4_columns(tensor, idx)
            return _gather(tensor, dim, idx)
        if self.scales == "keep" or fmt == "dense":
            return tensor
        group = FP8_BLOCK if fmt == "fp8" else (1 if dim == 0 else FP4_GROUP)
        if group == 1:
            if tensor.shape[dim] != n:
                raise LayoutError(f"{self.describe()}: FP4 scale {list(tensor.shape)} does not have the weight's "
                                  f"{n} rows")
            return _gather(tensor, dim, idx)
        what = f"{self.describe()} on an {fmt.upper()} scale {list(tensor.shape)}"
        return _gather(tensor, dim, _scale_block_index(idx, group, tensor.shape[dim], what))


@_register
@dataclass(frozen=True)
class Permutation(_IndexLayout):
    """An explicit permutation: ``stored[i] = native[perm[i]]`` along ``side``."""

    name: ClassVar[str] = "permutation"
    side: Side
    perm: tuple[int, ...]
    scales: ScalePolicy = "follow"

    def __post_init__(self):
        self._validate_common()
        object.__setattr__(self, "perm", tuple(int(i) for i in self.perm))
        check_permutation(torch.tensor(self.perm, dtype=torch.long), what=f"{self.name}.perm")

    def index(self, n):
        if n != len(self.perm):
            raise LayoutError(f"{self.name}: permutation of {len(self.perm)} {self.unit}s applied to a tensor with "
                              f"{n} {self.unit}s")
        return torch.tensor(self.perm, dtype=torch.long)

    def describe(self):
        bs = detect_block_structure(torch.tensor(self.perm), self.side)
        tail = "" if self.scales == "follow" else " (scales not moved)"
        return (bs.description if bs else "identity") + tail


@_register
@dataclass(frozen=True)
class BlockPermutation(_IndexLayout):
    """``block``-wide blocks permuted inside every ``tile``-wide tile by ``tile_perm`` (stored block ``p`` of a
    tile is native block ``tile_perm[p]``). The paper's W2 fault is ``BlockPermutation("rows", 16, 128,
    (0,2,4,6,1,3,5,7))``; it applies to any dimension that is a multiple of ``tile``."""

    name: ClassVar[str] = "block_permutation"
    side: Side
    block: int
    tile: int
    tile_perm: tuple[int, ...]
    scales: ScalePolicy = "follow"

    def __post_init__(self):
        self._validate_common()
        object.__setattr__(self, "tile_perm", tuple(int(i) for i in self.tile_perm))
        if self.block < 1 or self.tile % self.block or self.tile // self.block != len(self.tile_perm):
            raise LayoutError(f"{self.name}: tile {self.tile} must hold len(tile_perm)={len(self.tile_perm)} "
                              f"blocks of {self.block}")
        check_permutation(torch.tensor(self.tile_perm), what=f"{self.name}.tile_perm")

    def index(self, n):
        if n % self.tile:
            raise LayoutError(f"{self.name}: dimension {n} is not a multiple of the {self.tile}-{self.unit} tile")
        per_tile = torch.arange(n).view(n // self.tile, len(self.tile_perm), self.block)
        return per_tile[:, list(self.tile_perm), :].reshape(n)

    def describe(self):
        tail = "" if self.scales == "follow" else " (scales not moved)"
        return (f"{self.block}-{self.unit} blocks in {self.tile}-{self.unit} tiles: "
                f"[{','.join(map(str, self.tile_perm))}]{tail}")


@_register
@dataclass(frozen=True)
class GateUpInterleave(_IndexLayout):
    """Gate/up interleaving: the two halves of the dimension alternate in ``group``-wide groups
    (stored = ``[a0, b0, a1, b1, ...]`` for halves ``a``, ``b``), as fused gate‖up kernels store ``w1‖w3``."""

    name: ClassVar[str] = "gate_up_interleave"
    side: Side = "rows"
    group: int = 1
    scales: ScalePolicy = "follow"

    def __post_init__(self):
        self._validate_common()
        if self.group < 1:
            raise LayoutError(f"{self.name}: group must be ≥ 1, got {self.group}")

    def index(self, n):
        if n % (2 * self.group):
            raise LayoutError(f"{self.name}: dimension {n} is not a multiple of 2×group = {2 * self.group}")
        return torch.arange(n).view(2, n // (2 * self.group), self.group).permute(1, 0, 2).reshape(n)

    def describe(self):
        tail = "" if self.scales == "follow" else " (scales not moved)"
        return f"gate/up interleave of {self.group}-{self.unit} groups{tail}"


@_register
@dataclass(frozen=True)
class TilePreshuffle(Layout):
    """Tile pre-shuffle of the stored bytes: ``[R, C]`` viewed as ``(R/BN, BN, C/BK, BK/Ke, Ke)`` and stored in
    ``(R/BN, C/BK, BK/Ke, BN, Ke)`` order (``bn`` rows × ``ke`` bytes sub-tiles, ``bk`` bytes per K tile), as
    MFMA/MMA kernels pre-shuffle weights. The scales keep their row-major layout."""

    name: ClassVar[str] = "preshuffle"
    bn: int = 16
    bk: int = 32
    ke: int = 16

    def __post_init__(self):
        if min(self.bn, self.bk, self.ke) < 1 or self.bk % self.ke:
            raise LayoutError(f"{self.name}: need bn, bk, ke ≥ 1 and bk a multiple of ke (got {self.bn}, "
                              f"{self.bk}, {self.ke})")

    def transform(self, tensor, role, fmt, shape, inverse=False):
        if role != "weight":
            return tensor
        r, c = tensor.shape
        if r % self.bn or c % self.bk:
            raise LayoutError(f"{self.describe()}: stored weight {[r, c]} is not a multiple of "
                              f"[{self.bn}, {self.bk}]")
        b = _byte_view(tensor)
        nt, kt, ks = r // self.bn, c // self.bk, self.bk // self.ke
        if not inverse:
            out = b.reshape(nt, self.bn, kt, ks, self.ke).permute(0, 2, 3, 1, 4)
        else:
            out = b.reshape(nt, kt, ks, self.bn, self.ke).permute(0, 3, 1, 2, 4)
        return _restore(out.reshape(r, c), tensor)

    def describe(self):
        return f"tile pre-shuffle (N/{self.bn}, K/{self.bk}, {self.bk}/{self.ke}, {self.bn}, {self.ke})"


@_register
@dataclass(frozen=True)
class NibbleSwap(Layout):
    """FP4 nibble order swapped (element ``2c`` in the high nibble): adjacent columns exchanged; self-inverse."""

    name: ClassVar[str] = "nibble_swap"

    def transform(self, tensor, role, fmt, shape, inverse=False):
        if fmt != "fp4":
            raise LayoutError(f"{self.name}: only packed FP4 weights have nibbles (got an {fmt} weight)")
        if role != "weight":
            return tensor
        b = _byte_view(tensor)
        return _restore((b >> 4) | (b << 4), tensor)

    def describe(self):
        return "FP4 nibble order swapped (adjacent columns exchanged)"


@_register
@dataclass(frozen=True)
class KMajor(Layout):
    """K-major storage: the weight stored transposed (``[K, N]``; FP4 packed along N, so N must be even) and
    its scale transposed with it."""

    name: ClassVar[str] = "k_major"

    def transform(self, tensor, role, fmt, shape, inverse=False):
        if role == "scale" or fmt != "fp4":
            return _restore(_byte_view(tensor).T, tensor)
        codes = quant.unpack_fp4(_byte_view(tensor))
        if codes.shape[0] % 2:
            raise LayoutError(f"{self.name}: FP4 weight with an odd row count {codes.shape[0]} cannot be packed "
                              f"along N")
        return _restore(quant.pack_fp4(codes.T), tensor)

    def shape_after(self, stored_shape, role, fmt, inverse=False):
        r, c = stored_shape
        if role == "weight" and fmt == "fp4":
            return (2 * c, r // 2)
        return (c, r)

    def describe(self):
        return "K-major (transposed) storage"


@_register
@dataclass(frozen=True)
class Inverse(Layout):
    """The inverse of another layout (a reader that un-shuffled a weight that had never been shuffled)."""

    name: ClassVar[str] = "inverse"
    of: Layout

    def __post_init__(self):
        if isinstance(self.of, Mapping):
            object.__setattr__(self, "of", layout_from_json(self.of, "inverse.of"))

    def transform(self, tensor, role, fmt, shape, inverse=False):
        return self.of.transform(tensor, role, fmt, shape, not inverse)

    def shape_after(self, stored_shape, role, fmt, inverse=False):
        return self.of.shape_after(stored_shape, role, fmt, not inverse)

    def describe(self):
        return f"inverse of {self.of.describe()}"


PRESHUFFLE_16x16 = TilePreshuffle(bn=16, bk=32, ke=16)
PRESHUFFLE_32x16 = TilePreshuffle(bn=32, bk=32, ke=16)


def paper_w2_permutation(block: int = 16, tile: int = 128, side: Side = "rows",
                         scales: ScalePolicy = "follow") -> BlockPermutation:
    """The paper's W2 fault, scaled to any ``tile/block``: even blocks first, then odd ones (8 blocks:
    ``[0,2,4,6,1,3,5,7]``, reported by the paper as fast → reference)."""
    m = tile // block
    return BlockPermutation(side, block, tile, tuple(range(0, m, 2)) + tuple(range(1, m, 2)), scales)


# ============================================================================================ block structure
@dataclass(frozen=True)
class BlockStructure:
    """The structure of a permutation: ``block``-wide contiguous blocks moved inside ``tile``-wide tiles.

    ``tile_perm`` is the common within-tile block permutation when every tile uses the same one (else
    ``None``); ``block_perm`` is the full block-level permutation (``stored block b = native block_perm[b]``).
    """

    side: Side
    length: int
    block: int
    tile: int
    tile_perm: tuple[int, ...] | None
    block_perm: tuple[int, ...]

    @property
    def unit(self) -> str:
        return "row" if self.side == "rows" else "column"

    def expand(self) -> torch.Tensor:
        """The element-level permutation this structure describes."""
        bp = torch.tensor(self.block_perm, dtype=torch.long)
        return (bp[:, None] * self.block + torch.arange(self.block)).reshape(-1)

    @property
    def description(self) -> str:
        u, b, t = self.unit, self.block, self.tile
        named = _named_description(self)
        if named:
            return named
        if t < self.length and self.tile_perm is not None:
            return f"{b}-{u} blocks in {t}-{u} tiles: [{','.join(map(str, self.tile_perm))}]"
        if t < self.length:
            return f"{b}-{u} blocks permuted within {t}-{u} tiles (a different permutation per tile)"
        moved = sum(1 for i, j in enumerate(self.block_perm) if i != j)
        if b > 1:
            shown = ",".join(map(str, self.block_perm[:32])) + (",..." if len(self.block_perm) > 32 else "")
            return f"{b}-{u} blocks permuted: [{shown}] ({moved} of {len(self.block_perm)} blocks moved)"
        return f"unstructured {u} permutation ({moved} of {self.length} {u}s moved)"


def _named_description(bs: BlockStructure) -> str | None:
    if bs.side == "cols" and bs.block == 1 and bs.tile == 2 and bs.tile_perm == (1, 0):
        return "adjacent column pairs swapped (FP4 nibble order)"
    perm = bs.expand()
    for g in _divisors(bs.length // 2) if bs.length % 2 == 0 else ():
        if torch.equal(GateUpInterleave(bs.side, g).index(bs.length), perm):
            return f"gate/up interleave of {g}-{bs.unit} groups"
    return None


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def detect_block_structure(perm: torch.Tensor, side: Side = "rows") -> BlockStructure | None:
    """The largest contiguous block size a permutation moves intact, and the smallest tile its blocks stay in.

    Returns ``None`` for the identity.
    """
    p = torch.as_tensor(perm, dtype=torch.long)
    n = len(p)
    if n == 0 or torch.equal(p, torch.arange(n)):
        return None
    block = 1
    for d in reversed(_divisors(n)):
        v = p.view(n // d, d)
        if bool((v[:, 0] % d == 0).all()) and torch.equal(v - v[:, :1], torch.arange(d).expand_as(v)):
            block = d
            break
    bp = p[::block] // block
    m = len(bp)
    tiles = next(t for t in _divisors(m) if torch.equal(bp // t, torch.arange(m) // t))
    local = (bp % tiles).view(m // tiles, tiles)
    uniform = bool((local == local[:1]).all())
    return BlockStructure(side, n, block, block * tiles, tuple(local[0].tolist()) if uniform else None,
                          tuple(bp.tolist()))


def layout_from_perm(perm: torch.Tensor, side: Side = "rows", scales: ScalePolicy = "follow") -> Layout | None:
    """The most compact layout for ``stored[i] = native[perm[i]]``: ``None`` (identity), a
    :class:`GateUpInterleave`, a :class:`BlockPermutation` (uniform tiles), else an explicit :class:`Permutation`."""
    p = torch.as_tensor(perm, dtype=torch.long)
    bs = detect_block_structure(p, side)
    if bs is None:
        return None
    n = len(p)
    if n % 2 == 0:
        for g in _divisors(n // 2):
            if torch.equal(GateUpInterleave(side, g).index(n), p):
                return GateUpInterleave(side, g, scales)
    if bs.tile_perm is not None and not (bs.block == 1 and bs.tile == n):
        return BlockPermutation(side, bs.block, bs.tile, bs.tile_perm, scales)
    return Permutation(side, tuple(p.tolist()), scales)


# ============================================================================================ fingerprinting
@dataclass
class FingerprintResult:
    """What :func:`fingerprint` found.

    Attributes:
        side: ``"rows"`` (output side) or ``"cols"`` (input side).
        perm: suspect index ``i`` holds reference index ``perm[i]`` (rows: ``suspect(x)[:, i] ==
            reference(x)[:, perm[i]]``; cols: ``suspect(x) == reference(x')`` with ``x'[:, perm[i]] = x[:, i]``).
        block: the permutation's block structure (``None`` for the identity).
        residual: ``‖suspect − aligned reference‖ / ‖reference‖`` after alignment (0 for an exact
            permutation).
        residual_unaligned: the same before alignment.
        confidence: the smallest gap, over all suspect indices, between the matched similarity (cosine, 1 for
            an exact match) and the best alternative; 0 means some index is indistinguishable from another.
        ambiguous: suspect indices whose match is not unique (gap below ``1e-6``).
        probe_calls: calls made to the ops; probe_rows: input rows per call.
    """

    side: Side
    perm: torch.Tensor
    block: BlockStructure | None
    residual: float
    residual_unaligned: float
    confidence: float
    ambiguous: list[int]
    probe_calls: int
    probe_rows: int

    @property
    def is_identity(self) -> bool:
        return self.block is None

    @property
    def exact(self) -> bool:
        """Unique matches and (near-)zero residual: the ops differ by exactly this permutation."""
        return not self.ambiguous and self.residual < 1e-6

    @property
    def description(self) -> str:
        return "no permutation" if self.block is None else self.block.description

    def layout(self, scales: ScalePolicy = "follow") -> Layout | None:
        """The stored layout this permutation describes (its inverse is the repair)."""
        return layout_from_perm(self.perm, self.side, scales)

    def summary(self) -> str:
        return (f"{self.side}: {self.description}; residual {self.residual:.3g} (unaligned "
                f"{self.residual_unaligned:.3g}); confidence {self.confidence:.3f}"
                + (f"; {len(self.ambiguous)} ambiguous" if self.ambiguous else "")
                + f"; {self.probe_calls} probe calls × {self.probe_rows} rows")

    def to_json(self) -> dict:
        return dict(side=self.side, description=self.description, identity=self.is_identity,
                    residual=self.residual, residual_unaligned=self.residual_unaligned,
                    confidence=self.confidence, ambiguous=self.ambiguous[:100], probe_calls=self.probe_calls,
                    probe_rows=self.probe_rows,
                    layout=(lay.to_json() if (lay := self.layout()) is not None else None))


def _unit_columns(m: torch.Tensor) -> torch.Tensor:
    norm = m.norm(dim=0, keepdim=True)
    return torch.where(norm > 0, m / norm.clamp_min(1e-300), torch.zeros_like(m))


def match_columns(suspect: Sequence[torch.Tensor],
                  reference: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Match the columns of suspect matrices to those of reference matrices by mean cosine similarity.

    ``suspect`` and ``reference`` are lists of ``[n_g, m]`` matrices (one per probe group; the score of a pair is
    the mean over groups of the column cosines, so a per-group rescaling does not hide a match). See
    :func:`match_scores` for the assignment and the margins.
    """
    widths = {t.shape[1] for t in list(suspect) + list(reference)}
    if len(widths) != 1 or len(suspect) != len(reference):
        raise LayoutError(f"match_columns: suspect and reference must be the same number of [n, m] matrices with "
                          f"one m (got widths {sorted(widths)})")
    m, g = widths.pop(), len(suspect)
    # sum over groups of Sgᵀ·Rg is one product of the stacked unit columns
    s_t = torch.cat([_unit_columns(t.to(torch.float64)) for t in suspect]).T.contiguous()
    r = torch.cat([_unit_columns(t.to(torch.float64)) for t in reference])
    return match_scores(lambda rows: (s_t[rows] @ r) / g, m)


def match_subspaces(parts: torch.Tensor, reference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Match suspect items to reference columns when each suspect item is known only up to per-group scales.

    ``parts`` ``[G, n, m]`` holds each suspect item's per-group contributions (e.g. a row's output on inputs
    restricted to one scale group); ``reference`` ``[n, m]``. The score of a pair is the cosine between the
    reference column and the span of the item's ``G`` contributions (1 when some per-group scaling of the item
    reproduces it), so a scale tensor that did not follow its rows cannot hide the match. Needs ``n`` well
    above ``G``.
    """
    g, n, m = parts.shape
    basis = parts.to(torch.float64).permute(2, 1, 0)  # [m, n, G]
    q, r = torch.linalg.qr(basis)
    diag = r.diagonal(dim1=-2, dim2=-1).abs()
    q = q * (diag > 1e-12 * diag.amax(dim=-1, keepdim=True).clamp_min(1e-300))[:, None, :]  # drop empty groups
    ref = _unit_columns(reference.to(torch.float64))
    return match_scores(lambda rows: torch.einsum("ing,nj->igj", q[rows], ref).norm(dim=1), m)


def match_scores(scores: Callable[[torch.Tensor], torch.Tensor], m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Assign each of ``m`` suspect items a distinct reference item from a score function.

    ``scores(rows)`` gives the ``[len(rows), m]`` similarities of some suspect items to every reference item.
    Each suspect item takes its best reference item; when several claim the same one the best keeps it and the
    others take their best free item, repeatedly (greedy, no Hungarian solve). Returns ``(perm, margin)``:
    ``margin[i]`` is the matched score minus the best score of any other reference item (≤ 0 for an item that
    lost a conflict).
    """
    chunk = max(1, (1 << 24) // max(m, 1))
    top1 = torch.empty(m, dtype=torch.long)
    top1_val = torch.empty(m, dtype=torch.float64)
    top2_val = torch.full((m,), math.inf, dtype=torch.float64)  # m == 1: nothing else to confuse it with
    for start in range(0, m, chunk):
        rows = torch.arange(start, min(m, start + chunk))
        v, i = scores(rows).topk(min(2, m), dim=1)
        top1[rows], top1_val[rows] = i[:, 0], v[:, 0]
        if m > 1:
            top2_val[rows] = v[:, 1]
    perm = top1.clone()
    first_won = _claim_winners(top1, top1_val, m)
    lost = (~first_won).nonzero().flatten()
    margin = torch.where(torch.isfinite(top2_val), top1_val - top2_val, torch.ones_like(top1_val))
    if len(lost):
        taken = torch.zeros(m, dtype=torch.bool)
        taken[top1[first_won]] = True
        if len(lost) * m > (1 << 26):  # degenerate (e.g. every output zero): hand out free columns in order
            perm[lost] = (~taken).nonzero().flatten()[: len(lost)]
            margin[lost] = 0.0
        else:
            sc = scores(lost)
            pending = torch.arange(len(lost))
            while len(pending):
                val, cand = sc[pending].masked_fill(taken[None, :], -math.inf).max(dim=1)
                won = _claim_winners(cand, val, m)
                perm[lost[pending[won]]] = cand[won]
                taken[cand[won]] = True
                pending = pending[~won]
            margin[lost] = sc.gather(1, perm[lost][:, None])[:, 0] - top1_val[lost]
    return perm, margin


def _claim_winners(claimed: torch.Tensor, score: torch.Tensor, m: int) -> torch.Tensor:
    """Which claimants win: for each claimed item, the claimant with the highest score (ties: lowest position)."""
    order = torch.sort(-score, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order))
    best = torch.full((m,), len(order), dtype=torch.long)
    best.scatter_reduce_(0, claimed, rank, reduce="amin")
    return best[claimed] == rank


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(b.to(torch.float64).norm())
    num = float((a.to(torch.float64) - b.to(torch.float64)).norm())
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def _result(side, perm, margin, residual, residual0, calls, rows, ambiguity_tol=1e-6) -> FingerprintResult:
    amb = (margin < ambiguity_tol).nonzero().flatten().tolist()
    conf = float(margin.min().clamp(0.0, 1.0)) if len(margin) else 1.0
    return FingerprintResult(side, perm, detect_block_structure(perm, side), residual, residual0, conf, amb,
                             calls, rows)


class _Counted:
    def __init__(self, fn, what):
        self.fn, self.what, self.calls = fn, what, 0

    def __call__(self, x):
        self.calls += 1
        y = self.fn(x)
        if not isinstance(y, torch.Tensor) or y.dim() != 2 or y.shape[0] != x.shape[0]:
            raise LayoutError(f"fingerprint: the {self.what} op returned {getattr(y, 'shape', type(y))} for an "
                              f"input of shape {list(x.shape)}; expected [{x.shape[0]}, out_features]")
        return y.to(torch.float64)


def probe_inputs(in_features: int, n_probes: int, groups: int = 1, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random normal probes ``[groups·n_probes, in_features]``; with ``groups > 1`` probe block ``g`` is non-zero
    only on input columns of group ``g`` (so per-group output rescalings can be seen through)."""
    if groups < 1 or in_features % groups:
        raise LayoutError(f"probe groups: {in_features} input features cannot be split into {groups} groups")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(groups * n_probes, in_features, generator=gen, dtype=torch.float64)
    if groups > 1:
        width = in_features // groups
        mask = (torch.arange(in_features)[None, :] // width) == (torch.arange(groups * n_probes)[:, None] // n_probes)
        x = x * mask
    return x.to(dtype)


def fingerprint(reference: Callable[[torch.Tensor], torch.Tensor], suspect: Callable[[torch.Tensor], torch.Tensor],
                in_features: int, *, out_features: int | None = None, side: Side = "rows", n_probes: int = 64,
                groups: int = 1, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> FingerprintResult:
    """Find the permutation between two ops (callables ``[n, in_features] → [n, out_features]``).

    ``side="rows"`` (output side): **2 probe calls** (one per op) on one batch of ``groups·n_probes`` random
    inputs; each suspect output column is matched to the reference column with the highest mean cosine over the
    probe groups. ``side="cols"`` (input side): **2 probe calls** on the ``in_features`` unit inputs; each
    suspect input's response is matched to a reference input's response. Exact for any permutation of an op
    whose rows (columns) are distinguishable; indistinguishable ones are reported in ``ambiguous`` and drive the
    confidence to 0. An identical pair gives the identity ("no permutation").
    """
    ref, sus = _Counted(reference, "reference"), _Counted(suspect, "suspect")
    if side == "rows":
        x = probe_inputs(in_features, n_probes, groups, seed, dtype).to(device)
        r, s = ref(x).cpu(), sus(x).cpu()
        if r.shape != s.shape or (out_features is not None and r.shape[1] != out_features):
            raise LayoutError(f"fingerprint: reference gives {list(r.shape)}, suspect {list(s.shape)}"
                              + (f", expected out_features={out_features}" if out_features else ""))
        perm, margin = match_columns(s.split(n_probes), r.split(n_probes))
        res, res0 = _rel_err(s, r[:, perm]), _rel_err(s, r)
        return _result(side, perm, margin, res, res0, ref.calls + sus.calls, x.shape[0])
    if side == "cols":
        x = torch.eye(in_features, dtype=dtype, device=device)
        r, s = ref(x).cpu(), sus(x).cpu()  # row j = the op's response to input j alone
        if r.shape != s.shape:
            raise LayoutError(f"fingerprint: reference gives {list(r.shape)}, suspect {list(s.shape)}")
        perm, margin = match_columns([s.T], [r.T])
        res, res0 = _rel_err(s, r[perm]), _rel_err(s, r)
        return _result(side, perm, margin, res, res0, ref.calls + sus.calls, x.shape[0])
    raise LayoutError(f"fingerprint: side must be 'rows' or 'cols', got {side!r}")


def fingerprint_recorded(inputs: torch.Tensor, outputs: torch.Tensor,
                         suspect: Callable[[torch.Tensor], torch.Tensor], *, side: Side = "rows",
                         groups: int = 1) -> FingerprintResult:
    """Fingerprint a suspect op against recorded arrays (golden activation dumps of a trusted run).

    ``inputs`` ``[n, in]`` and ``outputs`` ``[n, out]`` are what the trusted op saw and produced. Rows: **1
    probe call** (the suspect on the recorded inputs), columns matched by cosine over the ``n`` recorded rows —
    distinct outputs separate once ``n`` is a few dozen. With ``groups > 1`` the call holds the recorded inputs
    restricted to each of ``groups`` contiguous input groups (``groups·n`` rows) and each recorded output is
    matched to the span of a suspect output's per-group parts (:func:`match_subspaces`), which sees through
    scales that did not follow their rows; it needs ``n`` well above ``groups``. Columns: the suspect's response
    to the unit inputs (**1 call**), then either the reference's responses solved by least squares (needs
    ``n ≥ in`` independent rows) or, for ``out ≥ in``, the permuted inputs solved from the suspect's responses;
    **1 more call** measures the residual.
    """
    x, y = inputs, outputs.to(torch.float64)
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise LayoutError(f"fingerprint_recorded: inputs {list(x.shape)} and outputs {list(y.shape)} must be "
                          f"[n, in] and [n, out] with the same n")
    sus = _Counted(suspect, "suspect")
    if side == "rows":
        if groups > 1:
            n, k = x.shape
            if k % groups:
                raise LayoutError(f"fingerprint_recorded: {k} input features cannot be split into {groups} groups")
            mask = (torch.arange(k)[None, :] // (k // groups)) == torch.arange(groups)[:, None]
            parts = sus((x[None] * mask[:, None, :].to(x.dtype)).reshape(groups * n, k)).cpu()
            parts = parts.view(groups, n, -1)
            s = parts.sum(0)  # the op is linear: the parts add up to its output on the recorded inputs
        else:
            s = sus(x).cpu()
        if s.shape != y.shape:
            raise LayoutError(f"fingerprint_recorded: suspect gives {list(s.shape)}, recorded outputs are "
                              f"{list(y.shape)}")
        perm, margin = match_subspaces(parts, y) if groups > 1 else match_columns([s], [y])
        return _result(side, perm, margin, _rel_err(s, y[:, perm]), _rel_err(s, y), sus.calls,
                       groups * x.shape[0])
    if side != "cols":
        raise LayoutError(f"fingerprint_recorded: side must be 'rows' or 'cols', got {side!r}")
    n, k = x.shape
    xd = x.to(torch.float64)
    m_s = sus(torch.eye(k, dtype=x.dtype)).cpu()  # [in, out]: response to each input alone
    if n >= k and int(torch.linalg.matrix_rank(xd)) == k:
        m_r = torch.linalg.lstsq(xd, y).solution  # [in, out]: the trusted op's response to each input
        perm, margin = match_columns([m_s.T], [m_r.T])
    elif y.shape[1] >= k and int(torch.linalg.matrix_rank(m_s)) == k:
        permuted_inputs = y @ torch.linalg.pinv(m_s)  # = x[:, perm], since reference(x) = suspect(x[:, perm])
        perm, margin = match_columns([permuted_inputs], [xd])
    else:
        raise LayoutError(f"fingerprint_recorded: an input-side fingerprint needs ≥ {k} independent recorded rows "
                          f"(got {n}) or an op with out_features ≥ in_features of full rank")
    s = sus(x[:, perm]).cpu()
    return _result(side, perm, margin, _rel_err(s, y), _rel_err(sus(x).cpu(), y), sus.calls, k)


# ============================================================================================ one linear
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


class _Evaluator:
    """The residual of a candidate stored linear against a reference op or recorded arrays."""

    def __init__(self, reference, in_features: int, n_eval: int = 64, seed: int = 1):
        if isinstance(reference, Recorded):
            self.x, self.y = reference.inputs, reference.outputs.to(torch.float64)
        else:
            self.x = probe_inputs(in_features, n_eval, 1, seed)
            self.y = reference(self.x).to(torch.float64)

    def residual(self, weight, scale) -> float:
        return _rel_err(linear_op(weight, scale)(self.x), self.y)


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
    ev = _Evaluator(reference, k)
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


# ============================================================================================ repair specs
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

    The loader calls :meth:`repair` (or the callable from :meth:`bind`) on each tensor as it is read, so the
    corrected layout is what the kernels see and the hot path pays nothing.
    """

    rules: list[RepairRule] = field(default_factory=list)
    source: dict = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.rules)

    def rules_for(self, tensor_name: str) -> list[RepairRule]:
        linear, role = linear_name(tensor_name)
        return [r for r in self.rules if r.matches(linear)] if role else []

    def repair(self, name: str, tensor: torch.Tensor, *, weight_dtype: str | torch.dtype | None = None,
               weight_shape: Sequence[int] | None = None) -> torch.Tensor:
        """Undo every matching rule on one tensor. A ``.weight`` carries its own format; a ``.scale`` needs its
        weight's stored dtype (torch dtype or safetensors code) and shape."""
        rules = self.rules_for(name)
        if not rules:
            return tensor
        _, role = linear_name(name)
        if role == "weight":
            fmt, shape = weight_format(tensor), tuple(tensor.shape)
        else:
            if weight_dtype is None or weight_shape is None:
                raise LayoutError(f"{name}: repairing a scale needs its weight's dtype and shape "
                                  f"(pass weight_dtype= and weight_shape=, or use RepairSpec.bind(checkpoint))")
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

    def apply(self, name: str, tensor: torch.Tensor, checkpoint) -> torch.Tensor:
        """Repair one tensor of ``checkpoint`` (a :class:`~dsv4lab.checkpoint.Checkpoint`) as it is read — what
        ``dsv4lab.load(..., repairs=SPEC)`` calls; a scale learns its weight's format from the headers."""
        if not self.rules_for(name):
            return tensor
        base, _ = linear_name(name)
        w = checkpoint.tensors.get(base + ".weight")
        if w is None:
            raise LayoutError(f"{name}: a repair rule matches it but {base}.weight is not in {checkpoint.path}")
        return self.repair(name, tensor, weight_dtype=w.dtype, weight_shape=w.shape)

    def bind(self, checkpoint) -> Callable[[str, torch.Tensor], torch.Tensor]:
        """:meth:`apply` bound to ``checkpoint``: a ``(name, tensor) → tensor`` repair function."""
        return lambda name, tensor: self.apply(name, tensor, checkpoint)

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
    def load(cls, path: str | Path) -> "RepairSpec":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: repair spec not found") from None
        except json.JSONDecodeError as err:
            raise LayoutError(f"{path}: not valid JSON ({err})") from None
        return cls.from_json(d, str(path))


def _json_compact_lists(text: str) -> str:
    """Put arrays of numbers on one line (permutations would otherwise take a line per index)."""
    return re.sub(r"\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]", lambda m: "[" + re.sub(r"\s+", "", m.group(1)) + "]", text)


def load_repairs(spec: "RepairSpec | str | Path | Mapping | None") -> RepairSpec | None:
    """Accept a spec, a path to one, its JSON dict or ``None`` (what ``dsv4lab.load(..., repairs=)`` takes)."""
    if spec is None or isinstance(spec, RepairSpec):
        return spec
    if isinstance(spec, Mapping):
        return RepairSpec.from_json(spec)
    return RepairSpec.load(spec)


def apply_repairs(name: str, tensor: torch.Tensor, spec: RepairSpec | None, *,
                  weight_dtype: str | torch.dtype | None = None,
                  weight_shape: Sequence[int] | None = None) -> torch.Tensor:
    """Repair one tensor as it is loaded (a no-op for tensors no rule matches, or ``spec=None``)."""
    return tensor if not spec else spec.repair(name, tensor, weight_dtype=weight_dtype, weight_shape=weight_shape)


# ============================================================================================ checkpoint copies
def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _rewrite_checkpoint(src: str | Path, out: str | Path, transform: Callable[[str, torch.Tensor], torch.Tensor],
                        shape_of: Callable[[str, tuple], tuple], *, overwrite: bool, progress: bool) -> Path:
    """Copy ``src`` to ``out`` tensor by tensor through ``transform``, keeping names, dtypes, sharding and every
    non-weight file; written to a temporary folder and renamed (never in place)."""
    from .checkpoint import INDEX_NAME, Checkpoint, CheckpointError, TensorSpec, write_checkpoint

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
    from .checkpoint import Checkpoint

    spec = load_repairs(spec)
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
    repair = spec.bind(ck)

    def shape_of(name, shape):
        base, _ = linear_name(name)
        w = ck.tensors.get(base + ".weight")
        return spec.repaired_shape(name, shape, w.dtype, w.shape) if w is not None and spec.rules_for(name) else shape

    _rewrite_checkpoint(src, out, repair, shape_of, overwrite=overwrite, progress=progress)
    return counts


# ============================================================================================ fault catalogue
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
    return sorted(out, key=_natural_key)


def inject_fault_into_checkpoint(src: str | Path, fault: Fault | str, out: str | Path, *, layers=None, experts=None,
                                 tensors: str | None = None, overwrite: bool = False,
                                 progress: bool = False) -> list[str]:
    """Write a copy of ``src`` with ``fault`` injected (the original is never touched); returns the linears hit.

    ``layers`` / ``experts`` / ``tensors`` override the fault's defaults (layer indices refer to ``layers.N``).
    """
    from .checkpoint import Checkpoint

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

    _rewrite_checkpoint(src, out, transform, shape_of, overwrite=overwrite, progress=progress)
    return hit


# ============================================================================================ whole checkpoints
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
        from safetensors.torch import load_file
        arrays = load_file(str(path))
    elif path.suffix == ".npz":
        import numpy as np
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
    return (w2.shape == w_ref.shape and s2.shape == s_ref.shape and torch.equal(_byte_view(w2), _byte_view(w_ref))
            and torch.equal(_byte_view(s2), _byte_view(s_ref)))


def _residual_after(layout: Layout | None, w, s, ev: "_Evaluator") -> float:
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
    from .checkpoint import Checkpoint, CheckpointError
    from .checkpoint import _progress as progress_bar

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
                ev = _Evaluator(source, logical_shape(w.shape, weight_format(w))[1])
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


__all__ = [
    "LayoutError", "Layout", "LAYOUTS", "Permutation", "BlockPermutation", "GateUpInterleave", "TilePreshuffle",
    "NibbleSwap", "KMajor", "Inverse", "PRESHUFFLE_16x16", "PRESHUFFLE_32x16", "paper_w2_permutation",
    "layout_from_json", "layout_from_perm", "weight_format", "dequantize", "linear_op", "invert_permutation",
    "BlockStructure", "detect_block_structure", "FingerprintResult", "fingerprint", "fingerprint_recorded",
    "match_columns", "match_subspaces", "match_scores", "probe_inputs", "Recorded", "Diagnosis", "diagnose_linear",
    "RepairRule", "RepairSpec", "apply_repairs", "load_repairs", "repair_checkpoint", "Fault", "FAULTS",
    "inject_fault_into_checkpoint", "checkpoint_linears", "tensor_class", "class_regex", "load_golden_dumps",
    "fingerprint_checkpoint", "CheckpointFingerprint", "ClassReport",
]
