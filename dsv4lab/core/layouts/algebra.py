"""Layouts as data: how a kernel (or a buggy writer) stores a native weight, as exact invertible maps on bytes.

:class:`Layout` subclasses — :class:`Permutation` / :class:`BlockPermutation` / :class:`GateUpInterleave` (rows or
columns), :class:`TilePreshuffle` (the ``(N/BN, K/BK, BK/Ke, BN, Ke)`` tile order), :class:`NibbleSwap`,
:class:`KMajor` and :class:`Inverse` — each transform a packed FP4, an FP8 or a dense weight **and** its scale
consistently, on the stored bytes, with an exact inverse. Permutations the 128×128 FP8 block scales cannot follow
are refused with :class:`~dsv4lab.core.errors.LayoutError`. A layout maps *native* → *stored*; for permutations
``stored[i] = native[perm[i]]`` along the side, and the repair is the inverse.

:class:`BlockStructure` / :func:`detect_block_structure` describe a permutation in words ("16-row blocks in
128-row tiles: [0,2,4,6,1,3,5,7]"); :func:`layout_from_perm` picks the most compact layout for one.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch

from dsv4lab.core import quant
from dsv4lab.core.errors import LayoutError
from dsv4lab.core.layouts.formats import (FP4_GROUP, FP8_BLOCK, ScalePolicy, Side, byte_view, check_permutation, invert_permutation,
                      logical_shape, weight_format)


# ============================================================================================ byte gathers
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


def _restore(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(like.dtype) if like.element_size() == 1 else t.contiguous()


def _gather(t: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    return _restore(byte_view(t).index_select(dim, index.to(t.device)), t)


def _gather_fp4_columns(w: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Gather logical columns of packed FP4 bytes; whole bytes move when pairs stay pairs, else codes move."""
    b = byte_view(w)
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
        b = byte_view(tensor)
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
        b = byte_view(tensor)
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
            return _restore(byte_view(tensor).T, tensor)
        codes = quant.unpack_fp4(byte_view(tensor))
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


__all__ = ["Layout", "LAYOUTS", "Permutation", "BlockPermutation", "GateUpInterleave", "TilePreshuffle", "NibbleSwap",
           "KMajor", "Inverse", "PRESHUFFLE_16x16", "PRESHUFFLE_32x16", "paper_w2_permutation", "layout_from_json",
           "BlockStructure", "detect_block_structure", "layout_from_perm"]
