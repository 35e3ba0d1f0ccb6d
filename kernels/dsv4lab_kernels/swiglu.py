"""The shared expert's activation in one launch: ``act(silu(min(g, L)) · clamp(u, ±L) · weight)`` from the two
projections' act outputs (reference: ``ReferenceOps.swiglu`` inside ``ReferenceOps.expert_mlp``, then the
``.to(act)`` of the down projection's input). The routed experts fuse the same activation into their gate/up kernel
(:mod:`.fp4_moe_decode`); this is the shared expert's, between two FP8 GEMVs. :func:`routed_swiglu` and
:func:`routed_swiglu_fp8` are the activation of the grouped prefill MoE's gate/up epilogue (:mod:`.fp4_moe_grouped`,
:mod:`.fp4_moe_fp8lut`), which ends in the FP8 quantization of the down projection's input.

**Numerics and bound.** ``silu`` in fp64 (``x / (1 + exp(−x))``) rounded to fp32, the clamps exact, the products in
fp32 as the reference: bit-identical except where the fp64 ``silu`` lies within ~1e-15 (relative) of an fp32 rounding
boundary — then one fp32 ulp before the final rounding, i.e. **one ulp of the activation dtype**.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_gemm import pow2_exponent, quantize_block_fp8, to_bf16
from .rowops import LAUNCH_EXACT, to_act
from .launch import pdl_args, pdl_prologue


@triton.jit
def shared_swiglu(g, u, limit, CLAMP: tl.constexpr):
    """``silu(min(g, L)) · clamp(u, ±L)`` in fp32 (before any routing weight and the rounding to act) from fp32
    ``g, u``: the body of :func:`_swiglu_kernel` and of the shared down projection's prologue
    (:mod:`.fp8_gemv`, ``SWIGLU``) — one definition, so the two agree bit for bit."""
    if CLAMP:
        u = tl.minimum(tl.maximum(u, -limit), limit)
        g = tl.minimum(g, limit)
    g64 = g.to(tl.float64)
    return (g64 / (1.0 + tl.exp(-g64))).to(tl.float32) * u


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, w_ptr, o_ptr, N, limit, HAS_WEIGHT: tl.constexpr, CLAMP: tl.constexpr,
                   ROUND_BF16: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    g = tl.load(g_ptr + i, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + i, mask=m, other=0.0).to(tl.float32)
    h = shared_swiglu(g, u, limit, CLAMP)
    if HAS_WEIGHT:
        h = tl.load(w_ptr + i, mask=m, other=0.0) * h
    tl.store(o_ptr + i, to_act(h, ROUND_BF16).to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def routed_swiglu(g, u, rw, limit, keep):
    """A routed expert's activation on a gate/up tile, as the reference: ``g, u [N, R]`` (fp32, each already rounded
    to bf16: the Linear outputs), ``rw [R]`` the routing weights of the tile's rows, ``keep`` the valid (column, row)
    entries → h = bf16(silu(min(g, L)) · clamp(u, ±L) · rw) as fp32, 0 outside ``keep``. The clamps apply for
    ``limit > 0``."""
    if limit > 0:
        u = tl.minimum(tl.maximum(u, -limit), limit)
        g = tl.minimum(g, limit)
    # SiLU in fp64, rounded once to fp32, as ReferenceOps.elementwise: an fp32 exp's last-bit differences would flip
    # bf16/FP8 roundings of h downstream
    gd = g.to(tl.float64)
    silu = (gd / (1.0 + tl.exp(-gd))).to(tl.float32)
    h = silu * u * rw[None, :]
    return tl.where(keep, to_bf16(h).to(tl.float32), 0.0)


@triton.jit
def routed_swiglu_fp8(g, u, rw, limit, keep):
    """:func:`routed_swiglu` up to the down projection's FP8 input: ``(q, ex)``, h quantized to E4M3 per row over
    the tile's ``N`` columns (the tile is the 128-column quantization block) with the scale ``2^ex`` of ``ex [R]``."""
    h = routed_swiglu(g, u, rw, limit, keep)
    ex = pow2_exponent(tl.max(tl.abs(h), axis=0))  # per row, over this 128-column quantization block
    return quantize_block_fp8(h, ex[None, :]), ex

def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``g, u [..., I]`` (act) → ``[..., I]`` in ``g.dtype``; ``weight`` (fp32, broadcast to ``g``) multiplies after."""
    assert g.shape == u.shape and g.dtype == u.dtype and g.dtype in (torch.bfloat16, torch.float32)
    g, u = g.contiguous(), u.contiguous()
    out = torch.empty_like(g)
    w = None if weight is None else torch.broadcast_to(weight.float(), g.shape).contiguous()
    n = g.numel()
    if n:
        block = 1024
        _swiglu_kernel[(triton.cdiv(n, block),)](g, u, w if w is not None else g, out, n, float(limit),
                                                 HAS_WEIGHT=w is not None, CLAMP=limit > 0,
                                                 ROUND_BF16=g.dtype == torch.bfloat16, BLOCK=block, num_warps=4,
                                                 **LAUNCH_EXACT, **pdl_args(g.device))
    return out


__all__ = ["swiglu", "shared_swiglu", "routed_swiglu", "routed_swiglu_fp8"]
