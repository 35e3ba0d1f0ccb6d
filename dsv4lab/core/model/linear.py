"""Projections held in their checkpoint format, and the routed-expert bank.

A :class:`Linear` keeps the native bytes (FP8 E4M3 + 128×128 E8M0 block scales, packed FP4 E2M1 + 1×32 E8M0
scales, or BF16) so fast paths can read them directly; the reference dequantizes on use (memoised per dtype
when ``cache_dequant`` is on, which the loader enables for small models).

The routed experts of a layer are stacked into an :class:`ExpertBank` (``w1/w3 [E, I, D/2]``,
``w2 [E, D, I/2]`` and their scales) so a kernel can index experts by id; under expert parallelism a rank holds
the contiguous range ``[expert_offset, expert_offset + E)``.
"""
from __future__ import annotations

import torch
from torch import nn

from dsv4lab.core import quant

FORMATS = ("fp8", "fp4", "bf16", "f32")


class Linear(nn.Module):
    """``y = x @ Wᵀ`` with ``W [out_features, in_features]`` stored natively.

    Args:
        in_features, out_features: logical shape (FP4 storage is ``[out, in/2]``).
        fmt: ``"fp8"``, ``"fp4"``, ``"bf16"`` or ``"f32"``.
        act_quant: whether the reference quantizes this projection's input (true for FP8/FP4 projections except
            ``wo_a``, which the reference applies as a bf16 einsum).
    """

    def __init__(self, in_features: int, out_features: int, fmt: str, act_quant: bool | None = None):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"unknown weight format {fmt!r}")
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.act_quant = fmt in ("fp8", "fp4") if act_quant is None else act_quant
        if fmt == "fp8":
            w = torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device="meta")
            s = torch.empty(-(-out_features // 128), -(-in_features // 128), dtype=torch.float8_e8m0fnu, device="meta")
        elif fmt == "fp4":
            w = torch.empty(out_features, in_features // 2, dtype=torch.int8, device="meta")
            s = torch.empty(out_features, in_features // 32, dtype=torch.float8_e8m0fnu, device="meta")
        else:
            w = torch.empty(out_features, in_features, dtype=torch.bfloat16 if fmt == "bf16" else torch.float32,
                            device="meta")
            s = None
        self.register_buffer("weight", w)
        self.register_buffer("scale", s)
        self.cache_dequant = False
        self._deq: dict[torch.dtype, torch.Tensor] = {}

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.fmt}, act_quant={self.act_quant}"

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The logical weight ``[out, in]`` in ``dtype`` (exact: FP8/FP4 × power of two fits fp32)."""
        hit = self._deq.get(dtype)
        if hit is not None:
            return hit
        if self.fmt == "fp8":
            w = quant.fp8_block_dequant(self.weight, self.scale, dtype)
        elif self.fmt == "fp4":
            w = quant.fp4_dequant(self.weight, self.scale, dtype)
        else:
            w = self.weight.to(dtype)
        if self.cache_dequant:
            self._deq[dtype] = w
        return w

    def clear_cache(self) -> None:
        self._deq.clear()

    @property
    def native_bytes(self) -> int:
        n = self.weight.numel() * self.weight.element_size()
        return n + (self.scale.numel() if self.scale is not None else 0)


class ExpertBank(nn.Module):
    """The routed experts of one MoE layer (or of one expert-parallel rank), stacked.

    Buffers: ``w1, w3 [E, I, D/2]`` int8 packed E2M1 with ``w1_scale, w3_scale [E, I, D/32]``; ``w2 [E, D, I/2]``
    with ``w2_scale [E, D, I/32]`` (FP8 experts: ``[E, N, K]`` E4M3 with block scales; ``"f32"``: ``[E, N, K]``
    float32 without scales, the trainable form used by :mod:`dsv4lab.tools.train.trainer`).
    """

    def __init__(self, n_experts: int, dim: int, inter: int, fmt: str = "fp4", expert_offset: int = 0):
        super().__init__()
        self.n_experts, self.dim, self.inter, self.fmt = n_experts, dim, inter, fmt
        self.expert_offset = expert_offset
        for name, (n, k) in (("w1", (inter, dim)), ("w3", (inter, dim)), ("w2", (dim, inter))):
            if fmt == "fp4":
                w = torch.empty(n_experts, n, k // 2, dtype=torch.int8, device="meta")
                s = torch.empty(n_experts, n, k // 32, dtype=torch.float8_e8m0fnu, device="meta")
            elif fmt == "f32":  # float master weights (training): no scales
                w = torch.empty(n_experts, n, k, dtype=torch.float32, device="meta")
                s = None
            else:
                w = torch.empty(n_experts, n, k, dtype=torch.float8_e4m3fn, device="meta")
                s = torch.empty(n_experts, -(-n // 128), -(-k // 128), dtype=torch.float8_e8m0fnu, device="meta")
            self.register_buffer(name, w)
            self.register_buffer(name + "_scale", s)
        self.cache_dequant = False
        self._deq: dict[tuple[str, int, torch.dtype], torch.Tensor] = {}

    def extra_repr(self) -> str:
        return (f"experts [{self.expert_offset}, {self.expert_offset + self.n_experts}), dim {self.dim}, "
                f"inter {self.inter}, {self.fmt}")

    def owns(self, expert: int) -> bool:
        return self.expert_offset <= expert < self.expert_offset + self.n_experts

    def dequantized(self, which: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Logical weight of ``which`` ∈ {w1, w2, w3} of global expert id ``expert``."""
        key = (which, expert, dtype)
        hit = self._deq.get(key)
        if hit is not None:
            return hit
        local = expert - self.expert_offset
        if self.fmt == "f32":  # the weight itself (a view), so gradients reach a trainable bank
            return getattr(self, which)[local].to(dtype)
        w, s = getattr(self, which)[local], getattr(self, which + "_scale")[local]
        out = quant.fp4_dequant(w, s, dtype) if self.fmt == "fp4" else quant.fp8_block_dequant(w, s, dtype)
        if self.cache_dequant:
            self._deq[key] = out
        return out

    def clear_cache(self) -> None:
        self._deq.clear()
