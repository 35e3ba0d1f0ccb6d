"""Block-scaled FP8 GEMV / small-M GEMM for the decode step (wq_a, wq_b, wkv, wo_a, wo_b, shared expert,
indexer wq_b), plus the same kernel over BF16 weights (router, compressor, LM head in fp32).

``y[m, n] = Σ_k xq[m, k] · W[n, k]`` with ``W`` E4M3 ``[N, K]`` and one E8M0 scale per 128×128 block (partial
edge blocks allowed), and — when ``act_quant`` is on — ``xq`` the reference's activation quantization
(per token, per 128-wide K block, E4M3 values × power-of-two scale) computed inside the kernel. Every product
is exact in fp32; only the fp32 accumulation order differs from the reference's correctly rounded sum.

Routes (``route``):

* ``"fma"`` — CUDA-core GEMV: dequantize the weight tile in registers, one FMA per weight per token.
* ``"dot"`` — tensor cores: E4M3 × E4M3 ``tl.dot`` per 128-wide K block (BF16 × BF16 when the activation is
  not quantized, e.g. ``wo_a``), then both block scales applied to the fp32 block product. M is padded to 16.

Grouped projections (``wo_a``: ``x [M, G, K_g]``, ``W [G·R, K_g]`` → ``[M, G, R]``) are the same kernel with
``groups=G``. Split-K writes fp32 partials that a second kernel sums in a fixed order (deterministic: graph
replay equals eager, bit for bit).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .formats import e8m0_to_f32, quantize_fp8_block, round_to_bf16

ROUTES = ("fma", "dot")


@dataclass(frozen=True)
class GemvGeometry:
    """Launch geometry: output rows per program, K elements per loop step (a multiple of 128), K splits."""

    block_n: int = 32
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr,
                     M, N, K, n_per_group, stride_xm, stride_xg, stride_wn, stride_sn, SPLIT_K,
                     W_FP8: tl.constexpr, ACT_QUANT: tl.constexpr, ROUTE: tl.constexpr,
                     OUT_BF16: tl.constexpr, DOT_FP32: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    group = (pid_n * BLOCK_N) // n_per_group  # the launcher makes BLOCK_N divide n_per_group when grouped
    xg_ptr = x_ptr + group * stride_xg
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    kk = tl.arange(0, 128)

    n_chunks = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(n_chunks, SPLIT_K)
    c_lo = pid_k * per_split
    c_hi = tl.minimum(c_lo + per_split, n_chunks)

    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for c in range(c_lo, c_hi):
        for b in tl.static_range(BLOCK_K // 128):
            k0 = c * BLOCK_K + b * 128
            k = k0 + kk
            k_ok = k < K
            w_mask = n_ok[:, None] & k_ok[None, :]
            if W_FP8:
                w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=w_mask, other=0.0)
                sw = e8m0_to_f32(tl.load(s_ptr + (n // 128) * stride_sn + k0 // 128, mask=n_ok & (n * 0 + k0 < K),
                                         other=127).to(tl.int32))
            else:
                w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=w_mask, other=0.0).to(tl.float32)
                sw = tl.full((BLOCK_N,), 1.0, tl.float32)
            if ROUTE == 0:
                wf = w.to(tl.float32)
                for mi in tl.static_range(BLOCK_M):
                    m = pid_m * BLOCK_M + mi
                    xr = tl.load(xg_ptr + m * stride_xm + k, mask=k < tl.where(m < M, K, 0), other=0.0).to(tl.float32)
                    xq = quantize_fp8_block(xr, tl.max(tl.abs(xr), axis=0), ACT_QUANT)
                    part = tl.sum(wf * xq[None, :], axis=1) * sw
                    acc += tl.where(tl.arange(0, BLOCK_M)[:, None] == mi, part[None, :], 0.0)
            else:
                xm = (rows[:, None] < M) & k_ok[None, :]
                xr = tl.load(xg_ptr + rows[:, None] * stride_xm + k[None, :], mask=xm, other=0.0).to(tl.float32)
                xq = quantize_fp8_block(xr, tl.max(tl.abs(xr), axis=1)[:, None], ACT_QUANT)
                if DOT_FP32:  # the interpreter's bf16/fp8 arithmetic is unreliable: exact values in fp32 there
                    blk = tl.dot(xq, tl.trans(w.to(tl.float32)), input_precision="ieee")
                elif ACT_QUANT and W_FP8:
                    blk = tl.dot(xq.to(tl.float8e4nv), tl.trans(w))
                else:
                    blk = tl.dot(xq.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
                acc += blk * sw[None, :]

    out_mask = (rows[:, None] < M) & n_ok[None, :]
    if SPLIT_K == 1:
        if OUT_BF16:
            tl.store(out_ptr + rows[:, None] * N + n[None, :], round_to_bf16(acc).to(tl.bfloat16), mask=out_mask)
        else:
            tl.store(out_ptr + rows[:, None] * N + n[None, :], acc, mask=out_mask)
    else:
        tl.store(part_ptr + (pid_k * M + rows[:, None]) * N + n[None, :], acc, mask=out_mask)


@triton.jit
def _sum_partials_kernel(part_ptr, out_ptr, numel, S: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """``out[i] = Σ_s part[s, i]`` in slice order (fp32 partials; fp64 partials summed in fp64)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < numel
    acc = tl.load(part_ptr + i, mask=ok, other=0.0)
    for s in tl.static_range(1, S):
        acc += tl.load(part_ptr + s * numel + i, mask=ok, other=0.0)
    if OUT_BF16:
        tl.store(out_ptr + i, round_to_bf16(acc.to(tl.float32)).to(tl.bfloat16), mask=ok)
    else:
        tl.store(out_ptr + i, acc.to(tl.float32), mask=ok)


def sum_partials(part: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Sum ``part [S, ...]`` over its first dim into ``out`` (same trailing numel), in a fixed order."""
    numel = out.numel()
    assert part.is_contiguous() and out.is_contiguous() and part.numel() == part.shape[0] * numel
    BLOCK = 1024
    _sum_partials_kernel[(triton.cdiv(numel, BLOCK),)](part, out, numel, S=part.shape[0],
                                                        OUT_BF16=out.dtype == torch.bfloat16, BLOCK=BLOCK)
    return out


def _block_m(M: int, route: str) -> int:
    bm = triton.next_power_of_2(max(M, 1))
    if route == "dot":
        return max(16, min(bm, 64))
    return min(bm, 8)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, act_quant: bool = True,
             out_dtype: torch.dtype = torch.bfloat16, groups: int = 1, route: str = "fma",
             geometry: GemvGeometry | None = None) -> torch.Tensor:
    """``x [..., G·K_g] @ Wᵀ`` for an E4M3 (``scale`` given) or BF16/fp32 (``scale=None``) weight ``[N, K_g]``.

    ``groups > 1``: ``x`` is ``[..., G, K_g]`` flattened, row block ``g`` of ``W`` (``N/G`` rows) applies to
    group ``g``; the result is ``[..., N]``. Output in ``out_dtype`` (bf16 or fp32).
    """
    if route not in ROUTES:
        raise ValueError(f"fp8_gemv: unknown route {route!r}; known: {', '.join(ROUTES)}")
    g = geometry or GemvGeometry()
    assert g.block_k % 128 == 0, "block_k must be a multiple of 128 (the activation quantization block)"
    N, Kg = weight.shape
    lead = x.shape[:-1]
    assert x.shape[-1] == groups * Kg, f"x has {x.shape[-1]} features, weight expects {groups}×{Kg}"
    assert N % groups == 0, f"{N} output rows do not split into {groups} groups"
    x2 = x.reshape(-1, groups * Kg)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    M = x2.shape[0]
    assert weight.is_contiguous()
    w_fp8 = scale is not None
    if w_fp8:
        assert weight.dtype == torch.float8_e4m3fn, f"FP8 weight expected, got {weight.dtype}"
        assert tuple(scale.shape) == (triton.cdiv(N, 128), triton.cdiv(Kg, 128)), \
            f"scale {tuple(scale.shape)} does not match weight {tuple(weight.shape)} (128×128 blocks)"
        s = scale.view(torch.uint8).contiguous()
        stride_sn = s.shape[1]
    else:
        assert weight.dtype in (torch.bfloat16, torch.float32), f"unsupported weight dtype {weight.dtype}"
        s, stride_sn = weight, 0  # unused
    n_per_group = N // groups
    block_n = min(g.block_n, triton.next_power_of_2(N))
    if groups > 1:
        while n_per_group % block_n:
            block_n //= 2
    bm = _block_m(M, route)
    out = torch.empty(M, N, dtype=out_dtype, device=x.device)
    split = max(1, min(g.split_k, triton.cdiv(Kg, g.block_k)))
    part = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else out
    grid = (triton.cdiv(N, block_n), split, triton.cdiv(M, bm))
    _fp8_gemv_kernel[grid](x2, weight, s, out, part, M, N, Kg, n_per_group, x2.stride(0), Kg, weight.stride(0),
                           stride_sn, split, W_FP8=w_fp8, ACT_QUANT=act_quant, ROUTE=ROUTES.index(route),
                           OUT_BF16=out_dtype == torch.bfloat16, DOT_FP32=interpreting(), BLOCK_M=bm,
                           BLOCK_N=block_n, BLOCK_K=g.block_k, num_warps=g.num_warps)
    if split > 1:
        sum_partials(part, out)
    return out.reshape(*lead, N)
