"""Weight formats and the byte-level helpers every layout room shares.

A stored linear is a packed FP4 weight (int8 ``[N, K/2]``, element ``2c`` in the low nibble, E8M0 scale
``[N, K/32]``), an FP8 weight (E4M3 ``[N, K]``, E8M0 scale ``[⌈N/128⌉, ⌈K/128⌉]``) or a dense one. Only one
linear at a time is ever dequantized (:func:`dequantize`, for fingerprinting), never a whole checkpoint.
"""
from __future__ import annotations

from typing import Callable, Literal, Sequence

import torch

from dsv4lab.core import quant
from dsv4lab.core.errors import LayoutError

Side = Literal["rows", "cols"]
ScalePolicy = Literal["follow", "keep"]
FORMATS = ("fp4", "fp8", "dense")
FP4_GROUP = quant.FP4_BLOCK          # E8M0 scale per 32 elements of a row
FP8_BLOCK = quant.FP8_WEIGHT_BLOCK   # E8M0 scale per 128×128 block


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


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """1-byte tensors as uint8 (copy/index kernels for fp8/e8m0 are not available everywhere)."""
    return quant.as_bytes(t) if t.element_size() == 1 else t


__all__ = ["Side", "ScalePolicy", "FORMATS", "FP4_GROUP", "FP8_BLOCK", "weight_format", "format_of_dtype_code",
           "logical_shape", "dequantize", "linear_op", "invert_permutation", "check_permutation", "byte_view"]
