"""The value checks of a checkpoint: every stored value a model must not compute with, found without converting it.

:func:`scan_values` reads each tensor's bytes once, in chunks, straight from the shard (memory-mapped, nothing is
converted), and reports per tensor, with its count and first index:

* NaN or Inf in a floating tensor (BF16, F16, F32, F64: all exponent bits set);
* a NaN FP8 E4M3 byte (``0x7F`` / ``0xFF``);
* an E8M0 block scale that is NaN (``0xFF``) or so large that the weight it scales leaves the compute dtype's range
  once dequantized: a scale of ``2**(byte-127)`` times the largest value of the weight's format (448 for E4M3, 6 for
  packed E2M1) must stay below bf16's (and fp32's) largest finite value, 3.39e38, so the byte may be at most
  :func:`scale_byte_limit` (246 for FP8 weights, 252 for FP4 experts). Above it the dequantized weight is Inf and
  the logits NaN;
* an expert id outside ``[0, n_routed_experts)`` in a hash-routing table (``tid2eid``).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from dsv4lab.core.config import ModelArgs
from dsv4lab.core.safetensors_format import DTYPE_SIZE, TensorInfo

SCAN_CHUNK_BYTES = 64 << 20

# A floating value is NaN or Inf when its exponent bits are all ones: (unsigned view, exponent mask, mantissa mask).
_FLOAT_BITS = {
    "BF16": (np.uint16, 0x7F80, 0x007F),
    "F16": (np.uint16, 0x7C00, 0x03FF),
    "F32": (np.uint32, 0x7F80_0000, 0x007F_FFFF),
    "F64": (np.uint64, 0x7FF0_0000_0000_0000, 0x000F_FFFF_FFFF_FFFF),
}

BF16_MAX = (2 - 2 ** -7) * 2.0 ** 127
"""bf16's largest finite value (3.39e38); fp32's is within 0.4% of it, with the same exponent range."""
LARGEST_WEIGHT_VALUE = {"F8_E4M3": 448.0, "I8": 6.0}
"""The largest magnitude a scaled weight format stores: E4M3 (FP8 dense weights) and E2M1 packed in I8 (FP4 experts)."""


def scale_byte_limit(weight_dtype: str) -> int:
    """The largest E8M0 byte whose scale keeps every value of a ``weight_dtype`` weight finite in bf16 once
    dequantized (``largest value × 2**(byte−127) ≤ BF16_MAX``): 246 for E4M3, 252 for packed E2M1."""
    return 127 + math.floor(math.log2(BF16_MAX / LARGEST_WEIGHT_VALUE[weight_dtype]))


Check = tuple[Callable[[np.ndarray], tuple[np.ndarray, np.ndarray | None]], str, str]


def value_check(info: TensorInfo, args: ModelArgs, weight_dtype: str | None = None) -> Check | None:
    """What :func:`scan_tensor` looks for in one tensor: ``(test, words, split)`` — a function of a chunk →
    (bad mask, mask of the hits of the first kind or None), the words that describe a hit, and the names of the two
    kinds of hit; None for tensors with no invalid values (packed FP4, other integers). ``weight_dtype`` is the dtype
    of the weight an E8M0 scale belongs to (the looser FP4 limit when unknown)."""
    if info.dtype in _FLOAT_BITS:
        utype, exp, man = _FLOAT_BITS[info.dtype]

        def floats(raw):
            bits = raw.view(utype)
            bad = (bits & utype(exp)) == utype(exp)
            return bad, (bits & utype(man)) != 0
        return floats, f"non-finite {info.dtype} value(s)", "NaN/Inf"
    if info.dtype == "F8_E8M0":
        fmt = weight_dtype if weight_dtype in LARGEST_WEIGHT_VALUE else "I8"
        limit = scale_byte_limit(fmt)
        what = "FP8 E4M3" if fmt == "F8_E4M3" else "FP4 E2M1"
        return ((lambda raw: (raw > limit, raw == 0xFF)),
                f"scale byte(s) unusable: 0xFF is NaN, and above {limit} (2^{limit - 127}) the {what} weight "
                f"dequantizes beyond bf16's largest value {BF16_MAX:.3g}", "0xFF/overflow")
    if info.dtype == "F8_E4M3":
        return (lambda raw: ((raw & 0x7F) == 0x7F, None)), "FP8 byte(s) are NaN (0x7F/0xFF)", ""
    if info.dtype == "I64" and info.name.endswith(".gate.tid2eid"):
        n = args.n_routed_experts

        def expert_ids(raw):
            ids = raw.view("<i8")
            return (ids < 0) | (ids >= n), None
        return expert_ids, f"expert id(s) outside [0, {n})", ""
    return None


def scan_tensor(info: TensorInfo, data: np.ndarray, check: Check, bar) -> str | None:
    """One line describing the invalid values of a tensor (None when it has none), read chunk by chunk."""
    test, words, split = check
    item = DTYPE_SIZE[info.dtype]
    step = max(item, SCAN_CHUNK_BYTES // item * item)
    count = first_kind = 0
    first = None
    for at in range(info.begin, info.end, step):
        raw = data[at:min(at + step, info.end)]
        bad, kind = test(raw)
        hits = int(np.count_nonzero(bad))
        if hits:
            count += hits
            if kind is not None:
                first_kind += int(np.count_nonzero(bad & kind))
            if first is None:
                first = (at - info.begin) // item + int(np.flatnonzero(bad)[0])
        if bar is not None:
            bar.update(len(raw))
    if not count:
        return None
    pos = [int(p) for p in np.unravel_index(first, info.shape)] if info.shape else []
    if split == "NaN/Inf":
        words += f" ({first_kind} NaN, {count - first_kind} Inf)"
    elif split == "0xFF/overflow":
        words += f" ({first_kind} 0xFF, {count - first_kind} overflowing)"
    return f"{info.name}: {count} {words} in {info.file}, first at {pos}"


def scan_values(folder: Path, tensors: Iterable[TensorInfo], args: ModelArgs, progress: bool = False) -> list[str]:
    """One line per tensor of ``tensors`` (located in the shards of ``folder``) holding a value it must not (see
    the module doc). Each shard is memory-mapped once and read in file order; ``progress`` shows a bar over the
    bytes."""
    infos = sorted(tensors, key=lambda i: (i.file, i.begin))
    dtype_of = {i.name: i.dtype for i in infos}
    checks = []
    for info in infos:
        weight = dtype_of.get(info.name.removesuffix(".scale") + ".weight") if info.name.endswith(".scale") else None
        check = value_check(info, args, weight) if info.nbytes else None
        if check is not None:
            checks.append((info, check))
    bar = byte_progress(sum(info.nbytes for info, _ in checks), progress, f"scanning {folder.name}")
    out, files = [], {}
    try:
        for info, check in checks:
            if info.file not in files:
                files[info.file] = np.memmap(folder / info.file, dtype=np.uint8, mode="r")
            finding = scan_tensor(info, files[info.file], check, bar)
            if finding:
                out.append(finding)
    finally:
        if bar is not None:
            bar.close()
        files.clear()
    return out


def byte_progress(total: int, enabled: bool, desc: str):
    if not enabled or not total:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency, but progress must never be the reason a scan fails
        return None
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False)


__all__ = ["SCAN_CHUNK_BYTES", "BF16_MAX", "LARGEST_WEIGHT_VALUE", "scale_byte_limit", "value_check", "scan_tensor",
           "scan_values", "byte_progress"]
