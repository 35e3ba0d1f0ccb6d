"""Numerics switches of the reference forward, visible in one place.

The reference follows DeepSeek's dtype boundaries (spec §3.10): tensors the reference keeps in bf16 are held
in ``act`` (bf16, or the compute dtype when running in float32/float64), math the reference does in fp32 is
done in ``acc`` (fp32, or fp64 when the compute dtype is float64). So ``dtype=torch.float64`` with every
simulation off is the exact-math oracle, and ``dtype=torch.bfloat16`` with every simulation on reproduces the
reference's rounding points.

Reductions (every matmul, einsum, sum and mean) are evaluated in ``calc`` = float64 and rounded to ``acc`` where
the reference has an fp32 result. Any fp32 accumulation order is a valid reading of "fp32 accumulation"; taking
the (almost always) correctly rounded one makes the reference's output independent of batch size, kernel
choice and CPU instruction set — a row computed alone equals the same row in a batch, bit for bit, and a hash
recorded on one machine holds on another. ``exact_reductions=False`` uses plain ``acc`` arithmetic instead.

Sparse attention rounds its probabilities to ``act`` the way DeepSeek's kernel does: relative to the running
maximum of each block of ``attention_block`` (64) selected indices, an online softmax (see
:meth:`~dsv4lab.core.model.ops.ReferenceOps.sparse_attention`). ``attention_block=0`` rounds them relative to the one
final maximum instead — the reference's rounding before issue 23, kept so that older results stay reproducible.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Numerics:
    """Compute dtype and the three quantization simulations of the reference.

    Attributes:
        dtype: compute dtype of the tensors the reference holds in bf16 (bfloat16, float32 or float64).
        act_quant: quantize the input of every FP8/FP4 Linear per token, per 128 wide block, to E4M3 with a
            power-of-two scale (the real kernels' activation path).
        kv_fp8_sim: FP8 round trip of the non-rope dims of window and compressed KV (block 64).
        indexer_fp4_sim: FP4 round trip of the indexer's queries and keys after the Hadamard rotation (block 32).
        exact_reductions: evaluate every reduction in float64 and round once (see the module doc).
        attention_block: selected indices per online-softmax block of sparse attention (DeepSeek's kernel: 64);
            0 takes every probability relative to the final maximum.
    """

    dtype: torch.dtype = torch.bfloat16
    act_quant: bool = True
    kv_fp8_sim: bool = True
    indexer_fp4_sim: bool = True
    exact_reductions: bool = True
    attention_block: int = 64

    def __post_init__(self):
        if self.dtype not in (torch.bfloat16, torch.float32, torch.float64):
            raise ValueError(f"compute dtype must be bfloat16, float32 or float64, got {self.dtype}")
        if not isinstance(self.attention_block, int) or self.attention_block < 0:
            raise ValueError(f"attention_block must be a non-negative integer, got {self.attention_block!r}")

    @property
    def act(self) -> torch.dtype:
        """Where the reference holds bf16 tensors."""
        return self.dtype

    @property
    def acc(self) -> torch.dtype:
        """Where the reference computes in fp32."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    @property
    def calc(self) -> torch.dtype:
        """Where reductions are evaluated before rounding to ``acc``."""
        return torch.float64 if self.exact_reductions else self.acc

    @classmethod
    def exact(cls, dtype: torch.dtype = torch.float64) -> "Numerics":
        """All quantization simulations off (the transformers-parity and self-consistency setting)."""
        return cls(dtype=dtype, act_quant=False, kv_fp8_sim=False, indexer_fp4_sim=False)
