"""The safetensors file format as dsv4lab reads it: dtype codes, and one shard's header parsed and checked by hand.

:func:`read_safetensors_header` reads a shard's header without touching its data and checks what the safetensors
library will check when the shard is opened (the header is JSON, each entry has a known dtype, a shape and offsets
that agree, and the entries tile the data exactly to the file's end), so a truncated or corrupt shard is reported
with its name and the reason instead of crashing a reader later. :class:`~dsv4lab.core.checkpoint.Checkpoint` reads
its shards through it; the value checks of :mod:`dsv4lab.core.checkpoint_values` scan the data it locates.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

DTYPE_SIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1,
              "I16": 2, "I32": 4, "I64": 8, "BOOL": 1, "F4": 1}
"""Bytes per element of each safetensors dtype code."""
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    begin: int  # absolute byte offset of the data in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class ShardHeader:
    """One shard's header as read without touching its data.

    ``problem`` is set when the safetensors library would refuse the whole file (it is missing, truncated, its
    header is not JSON, or the header does not tile the data exactly); then ``tensors`` is empty, because none
    of them can be read.
    """

    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    problem: str | None = None


def read_safetensors_header(path: Path) -> ShardHeader:
    """Parse and check one shard's header the way the safetensors library will when the shard is opened."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return ShardHeader(problem=f"truncated ({size} bytes, no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                return ShardHeader(problem=f"header length {n} does not fit the file size {size} (truncated or "
                                           "corrupt)")
            raw = fh.read(n)
    except OSError as err:
        return ShardHeader(problem=f"cannot read ({err.strerror or err})")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        return ShardHeader(problem=f"header is not valid JSON ({err})")
    if not isinstance(header, dict):
        return ShardHeader(problem=f"header is a JSON {type(header).__name__}, expected an object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        return ShardHeader(problem="header __metadata__ must map names to strings")
    data_start = 8 + n
    tensors: dict[str, TensorInfo] = {}
    problems: list[str] = []
    for name, entry in header.items():
        info = _tensor_info(name, entry, path.name, data_start)
        if isinstance(info, str):
            problems.append(info)
        else:
            tensors[name] = info
    problems += _tiling_problems(sorted(tensors.values(), key=lambda i: (i.begin, i.end)), data_start, size)
    if problems:
        more = f" (and {len(problems) - 1} more header problem(s))" if len(problems) > 1 else ""
        return ShardHeader(metadata=meta, problem=problems[0] + more)
    return ShardHeader(tensors, meta)


def _tensor_info(name: str, entry, file: str, data_start: int) -> TensorInfo | str:
    """The entry of one tensor, or what is wrong with it."""
    if not isinstance(entry, dict):
        return f"header entry of {name} is not an object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_SIZE:
        return f"header gives {name} the unknown dtype {dtype!r}"
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        return f"header gives {name} the shape {shape!r}, expected a list of non-negative integers"
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        return f"header gives {name} the data_offsets {offsets!r}, expected [begin, end] with 0 <= begin <= end"
    info = TensorInfo(name, dtype, tuple(shape), file, data_start + offsets[0], data_start + offsets[1])
    numel = 1
    for d in info.shape:
        numel *= d
    if numel * DTYPE_SIZE[dtype] != info.nbytes:
        return (f"header gives {name} {info.nbytes} bytes for {dtype}{list(shape)} "
                f"({numel * DTYPE_SIZE[dtype]} expected)")
    return info


def _tiling_problems(infos: list[TensorInfo], data_start: int, size: int) -> list[str]:
    """The data must be the tensors end to end, from the header's end to the file's end, as safetensors requires."""
    at = data_start
    for info in infos:
        if info.begin != at:
            kind = "overlaps the previous tensor" if info.begin < at else "leaves a gap after the previous tensor"
            return [f"{info.name} starts at byte {info.begin} and {kind} (which ends at {at})"]
        at = info.end
    if at > size:
        beyond = [i.name for i in infos if i.end > size]
        return [f"truncated: {size:,} bytes, the header describes {at:,} ({len(beyond)} tensor(s) end beyond the "
                f"file, first {beyond[0]})"]
    if at < size:
        return [f"{size - at:,} bytes after the last tensor's data that the header does not describe"]
    return []


__all__ = ["DTYPE_SIZE", "MAX_HEADER_BYTES", "TensorInfo", "ShardHeader", "read_safetensors_header"]
