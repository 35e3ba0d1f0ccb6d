"""Legitimate rounding variants of the reference: the same semantics, evaluated in another order or precision.

They calibrate the model tier (``scripts/measure_kl_calibration.py``: how far apart correct evaluations of one
checkpoint drift, in teacher-forced KL, relative to the checkpoint's rounding floor) and they exercise the stage
bounds (a correct evaluation must pass every stage). Each is a :class:`~dsv4lab.core.model.ops.ReferenceOps` subclass:

* :class:`Fp32Reductions` — every reduction in fp32 in torch's order instead of correctly rounded (the floor);
* :class:`SplitKFp32` — as above, with every projection's K-sum split in two halves added in fp32 (a split-K
  kernel's order);
* :class:`KernelLike` — as above, plus attention by online softmax over blocks of 16 rows (each probability rounded
  to bf16 against a running maximum, the partial sums rescaled), as the decode and prefill kernels do;
* :class:`Fp8MmaLike` — as above, with every FP8 projection accumulated as Hopper's FP8 tensor cores do (the
  prefill FP8 GEMM on an H200): inside each 128-wide K block the running sum keeps 14 significant bits (truncated
  after each 32-product step), then is promoted to fp32.
"""
from __future__ import annotations

import dataclasses

import torch

from dsv4lab.core import quant
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps


def _fp32(numerics: Numerics) -> Numerics:
    return dataclasses.replace(numerics, exact_reductions=False)


class Fp32Reductions(ReferenceOps):
    """The reference with fp32 instead of exact (fp64) reductions — what ``noise_floor`` measures."""

    name = "variant:fp32-reductions"

    def __init__(self, numerics: Numerics):
        super().__init__(_fp32(numerics))


def _split_k(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ wᵀ`` as two K halves (a multiple of 32) added in the operands' precision."""
    k = x.shape[-1]
    h = max(32, (k // 2) // 32 * 32) if k > 32 else k
    if h >= k:
        return x @ w.T
    return x[..., :h] @ w[:, :h].T + x[..., h:] @ w[:, h:].T


class SplitKFp32(Fp32Reductions):
    name = "variant:split-k-fp32"

    def linear(self, x, lin, all_reduce=None):
        nm = self.numerics
        xq = quant.act_qdq_fp8(x) if nm.act_quant and lin.act_quant else x
        y = _split_k(xq.to(nm.calc), lin.dequantized(nm.calc))
        if all_reduce is not None:
            y = all_reduce(y)
        return y.to(nm.acc).to(nm.act)

    def _matmul(self, x, w):
        nm = self.numerics
        return _split_k(x.to(nm.calc), w.to(nm.calc)).to(nm.acc)

    def grouped_wo_a(self, o, lin, groups):
        nm = self.numerics
        w = lin.dequantized(nm.calc).view(groups, -1, o.shape[-1])
        y = torch.stack([_split_k(o[..., g, :].to(nm.calc), w[g]) for g in range(groups)], -2)
        return y.to(nm.acc).to(nm.act)


class KernelLike(SplitKFp32):
    """Split-K projections and online-softmax attention (bf16 probabilities against a running max)."""

    name = "variant:kernel-like"
    block = 16

    def sparse_attention(self, q, kv, idx, sink, scale):
        nm = self.numerics
        b, s, h, d = q.shape
        valid = idx >= 0
        g = torch.gather(kv, 1, idx.clamp_min(0).reshape(b, -1, 1).expand(-1, -1, d)).reshape(b, s, -1, d)
        g = torch.where(valid[..., None], g.to(nm.acc), 0.0)
        z = torch.einsum("bshd,bskd->bshk", q.to(nm.acc), g) * scale
        z = z.masked_fill(~valid[:, :, None, :], float("-inf"))
        m = torch.full((b, s, h, 1), float("-inf"), dtype=nm.acc, device=q.device)
        den = torch.zeros_like(m)
        num = torch.zeros(b, s, h, d, dtype=nm.acc, device=q.device)
        for j0 in range(0, z.shape[-1], self.block):
            zb = z[..., j0:j0 + self.block]
            m_new = torch.maximum(m, zb.amax(-1, keepdim=True))
            safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            alpha = torch.where(m == float("-inf"), torch.zeros_like(m), torch.exp(m - safe))
            p = torch.exp(zb - safe)
            den = den * alpha + p.sum(-1, keepdim=True)
            pb = p.to(nm.act).to(nm.acc)
            num = num * alpha + torch.einsum("bshk,bskd->bshd", pb, g[:, :, j0:j0 + self.block])
            m = m_new
        safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
        den = den + torch.exp(sink.to(nm.acc)[None, None, :, None] - safe)
        return (num / den).to(nm.act)


def truncate_bits(v: torch.Tensor, bits: int) -> torch.Tensor:
    """``v`` truncated (towards zero) to ``bits`` significant bits."""
    m, e = torch.frexp(v)  # v = m·2^e, |m| in [0.5, 1)
    return torch.ldexp(torch.trunc(m * 2.0 ** bits) / 2.0 ** bits, e)


def fp8_mma_matmul(x: torch.Tensor, w: torch.Tensor, block: int = 128, step: int = 32, bits: int = 14):
    """``x @ wᵀ`` (fp32) accumulated as an FP8 MMA: per ``block`` of K, ``step`` products at a time added to a
    running sum truncated to ``bits`` significant bits; the blocks' sums added in fp32."""
    k = x.shape[-1]
    total = torch.zeros(*x.shape[:-1], w.shape[0], dtype=torch.float32, device=x.device)
    for b0 in range(0, k, block):
        acc = torch.zeros_like(total)
        for s0 in range(b0, min(b0 + block, k), step):
            s1 = min(s0 + step, b0 + block, k)
            acc = truncate_bits(acc + x[..., s0:s1] @ w[:, s0:s1].T, bits)
        total = total + acc
    return total


class Fp8MmaLike(KernelLike):
    """Kernel-like, with the FP8 projections accumulated as on Hopper's FP8 tensor cores."""

    name = "variant:fp8-mma-like"
    # its FP8 projections, alone, side by side (linear_group, projections) or inside the expert
    accumulation = {"linear": "fp8_mma", "linear_group": "fp8_mma", "expert_mlp": "fp8_mma", "projections": "fp8_mma",
                    "expert_down": "fp8_mma"}

    def linear(self, x, lin, all_reduce=None):
        nm = self.numerics
        if not (lin.fmt == "fp8" and nm.act_quant and lin.act_quant):
            return super().linear(x, lin, all_reduce)
        y = fp8_mma_matmul(quant.act_qdq_fp8(x).to(torch.float32), lin.dequantized(torch.float32))
        if all_reduce is not None:
            y = all_reduce(y)
        return y.to(nm.acc).to(nm.act)


VARIANTS = {"fp32-reductions": Fp32Reductions, "split-k-fp32": SplitKFp32, "kernel-like": KernelLike,
            "fp8-mma-like": Fp8MmaLike}
"""name → ops class (constructed from the reference's :class:`Numerics`)."""

__all__ = ["VARIANTS", "Fp32Reductions", "SplitKFp32", "KernelLike", "Fp8MmaLike", "fp8_mma_matmul"]
