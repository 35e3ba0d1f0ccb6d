"""The routed-MoE decode's ``fp8lut`` route: the decode's structure (:mod:`.fp4_moe_decode`) with the grouped
prefill's arithmetic (:mod:`.fp4_moe_fp8lut`) — each weight tile turned into exact E4M3 bytes by a per-group byte
table and multiplied with the expert's rows on FP8 tensor cores.

**Structure (the decode's).** Gate/up: grid ``(T·k pairs, ⌈I/block_n_up⌉)``; down: ``(T·k pairs,
⌈D/block_n_down⌉)``. The program of an expert's first pair (``_expert_of_pair``) works for every row routed to that
expert (``_tokens_of``), the others exit: each weight byte is read once per step, with no sort launch and no atomics.
The down projection writes each slot's act-rounded output and the combine is the decode's (a third launch, or the
mHC site's prologue: ``routed_moe_slots``).

**Arithmetic (the prefill route's, shared code).** The rows are the second MMA operand (``accᵀ[N, rows] = W·Xᵀ``),
padded to ``max(16, next power of two)`` — the MMA's smallest N: a padding row reads the expert's first routed row
(a row that exists and belongs to it), reaches only its own MMA column and is never stored. Gate and up are one
operand of ``2·block_n_up`` weight rows (:func:`.fp4_moe_fp8lut.gate_up_tile`), the down projection one of
``block_n_down`` (:func:`.fp4_moe_fp8lut.project_rows`); an MMA's M is at least 16, so ``block_n_up ≥ 8`` and
``block_n_down ≥ 16``. The K loop steps by the activation's 128-wide scale block (``block_k = 128``): per tile the
packed bytes are decoded to E4M3 by the byte table (inline-PTX ``prmt``, four bytes of one group per call; the
portable decode in the interpreter) and two FP8 MMAs (even and odd columns) give a fresh partial, promoted into the
fp32 accumulator by exact powers of two. The activations are the reference's own E4M3 values and per-128 scales
(``fp8_gemm.quantize_activations(q_split=True)``: one launch per stage, as the decode's ``prequant``), so the route
evaluates the reference's quantization: ``x`` per token, ``h`` per slot after its bf16 rounding.

**Numerics.** Every product is exact (E4M3 × E4M3 times powers of two); the sums are Hopper's FP8 MMA inside a
128-wide tile (~14 bits of the running sum) and fp32 across tiles: the ``fp8_mma`` accumulation model
(:func:`dsv4lab.tools.verify.op_bounds.dot.promoted_fp8_model`), ``γ_min(n,128)(2^-13) + γ_⌈n/128⌉(2^-23)`` of
``Σ|terms|`` per output before its bf16 rounding (with fewer than four warps Triton lowers the dot to ``mma.sync``
on f16 operands — E4M3 values are exact in f16 — with fp32 accumulation: tighter still). It holds where the bank's
scales lie within the table's window — :data:`.fp4_moe_fp8lut.LUT_MAX_SPREAD` binades per weight row and 128-wide
K tile, bytes 7 … 254 — besides E8M0's NaN byte, which poisons its row's tile (NaN, as the reference's weight):
:func:`refusal` names a bank outside it
(the launchers raise that line; the Triton backend falls back to its default route).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import fp4_moe_fp8lut as lut
from .formats import interpreting, round_to_bf16
from .fp4_moe_decode_kernels import _expert_of_pair, _tokens_of
from .fp8_gemm import quantize_activations
from .launch import pdl_args, pdl_prologue

ROUTE = lut.ROUTE
BLOCK_K = 128
"""K elements per loop step: the activation's scale block (one promotion per tile)."""
_TILE_K = tl.constexpr(BLOCK_K)  # the same, as the kernels may read it
MIN_MMA_M = 16
"""An MMA operand's fewest rows (weight rows here: ``2·block_n_up``, ``block_n_down``) and fewest columns (the
token rows, padded)."""
DECODES = {"auto": "auto", "asm": "asm", "plain": "portable"}
"""``MoeGeometry.decode`` → the table decode (:data:`.fp4_moe_fp8lut.DECODES`); ``bytewise`` is the fma route's."""


@triton.jit
def _rows_of(idx_ptr, e, T, TOPK: tl.constexpr, KP: tl.constexpr, TP: tl.constexpr):
    """The ``TP`` columns of expert ``e``'s MMA: per token ``0 … TP``, the token, its slot row ``t·k + s`` and
    whether it is routed to ``e``; a column without a routed token takes the first routed token's token and row."""
    has, s = _tokens_of(idx_ptr, e, T, TOPK, KP, TP)
    t = tl.arange(0, TP)
    first = tl.min(tl.where(has, t, TP), axis=0)
    first_row = first * TOPK + tl.sum(tl.where(t == first, s, 0), axis=0)
    return tl.where(has, t, first), tl.where(has, t * TOPK + s, first_row), has


@triton.jit
def _moe_up_lut_kernel(xq_ptr, xs_ptr, idx_ptr, rw_ptr, w1_ptr, s1_ptr, w3_delta, s3_delta, tops_ptr, h_ptr, g_ptr,
                       u_ptr, T, D, I, expert_offset, n_local, limit, stride_we, stride_wn, stride_se, stride_sn,
                       stride_te, stride_tn, stride_xsr, stride_xsk,
                       TOPK: tl.constexpr, KP: tl.constexpr, PP: tl.constexpr, TP: tl.constexpr, BN: tl.constexpr,
                       EVEN_K: tl.constexpr, FUSE: tl.constexpr, ASM: tl.constexpr, TILE_REF: tl.constexpr,
                       UPCAST: tl.constexpr, PDL: tl.constexpr = False):
    """Gate/up of ``BN`` columns for every row routed to the pair's expert: ``FUSE``, ``h [T, k, I]`` (bf16, the
    reference's activation times the routing weight), else the act-rounded ``g``, ``u`` (fp32) at each slot."""
    pdl_prologue(PDL)
    pid_n = tl.program_id(1)
    e, local, works = _expert_of_pair(idx_ptr, tl.program_id(0), T, expert_offset, n_local, TOPK, PP)
    if works:
        tok, row, has = _rows_of(idx_ptr, e, T, TOPK, KP, TP)
        if FUSE:
            rw = tl.load(rw_ptr + row, mask=has, other=0.0)
        else:
            rw = tl.zeros((TP,), dtype=tl.float32)
        top = tops_ptr + local.to(tl.int64) * stride_te + pid_n * stride_tn
        h = lut.gate_up_tile(xq_ptr, xs_ptr, w1_ptr, s1_ptr, w3_delta, s3_delta, top, local, tok, tok, has, row, rw,
                             g_ptr, u_ptr, pid_n * BN, D, I, limit, D, stride_xsr, stride_xsk, stride_we, stride_wn,
                             stride_se, stride_sn, I, BN, TP, _TILE_K, EVEN_K, FUSE, ASM, TILE_REF, UPCAST)
        if FUSE:
            n = pid_n * BN + tl.arange(0, BN)
            tl.store(h_ptr + row[None, :].to(tl.int64) * I + n[:, None], h.to(tl.bfloat16),  # bf16 values: exact
                     mask=(n < I)[:, None] & has[None, :])


@triton.jit
def _moe_down_lut_kernel(hq_ptr, hs_ptr, idx_ptr, w2_ptr, s2_ptr, tops_ptr, out_ptr, T, D, I, expert_offset, n_local,
                         stride_we, stride_wn, stride_se, stride_sn, stride_te, stride_tn, stride_xsr, stride_xsk,
                         TOPK: tl.constexpr, KP: tl.constexpr, PP: tl.constexpr, TP: tl.constexpr, BN: tl.constexpr,
                         EVEN_K: tl.constexpr, ASM: tl.constexpr, TILE_REF: tl.constexpr, UPCAST: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Expert-major down projection of ``BN`` output columns: each routed slot's act-rounded output ``out [T, k,
    D]`` (fp32) from the quantized ``h`` (E4M3 split layout ``[T·k, I]``, scales ``[T·k, I/128]``)."""
    pdl_prologue(PDL)
    pid_n = tl.program_id(1)
    e, local, works = _expert_of_pair(idx_ptr, tl.program_id(0), T, expert_offset, n_local, TOPK, PP)
    if works:
        _, row, has = _rows_of(idx_ptr, e, T, TOPK, KP, TP)
        n = pid_n * BN + tl.arange(0, BN)
        n_ok = n < D
        w_rows = w2_ptr + local.to(tl.int64) * stride_we + n.to(tl.int64) * stride_wn
        s_rows = s2_ptr + local.to(tl.int64) * stride_se + n.to(tl.int64) * stride_sn
        top = tops_ptr + local.to(tl.int64) * stride_te + pid_n * stride_tn
        acc = lut.project_rows(hq_ptr, hs_ptr, row, row, w_rows, s_rows, n_ok, top, I, I, stride_xsr, stride_xsk,
                               BN, _TILE_K, TP, EVEN_K, ASM, TILE_REF, UPCAST)
        tl.store(out_ptr + row[None, :].to(tl.int64) * D + n[:, None], round_to_bf16(acc),
                 mask=n_ok[:, None] & has[None, :])


# ------------------------------------------------------------------------------------------------ host side
def refusal(ex, act_quant: bool, act_dtype: torch.dtype) -> str | None:
    """Why the route cannot evaluate the reference on this bank and these numerics (None: it can) — one line."""
    if not act_quant or act_dtype != torch.bfloat16:
        act = str(act_dtype).replace("torch.", "")
        return (f"the fp8lut routed-MoE route multiplies the reference's E4M3 activations and bf16 h: it needs "
                f"act_quant on and bf16 activations (got act_quant={act_quant}, {act})")
    if not lut.lut_route_exact(ex, BLOCK_K, nan_scales=True):
        lo, hi = lut.LUT_SCALE_BYTES
        return (f"fp8lut routed-MoE route: some expert weight row's {BLOCK_K}-wide K tile has FP4 scales spanning more "
                f"than {lut.LUT_MAX_SPREAD} binades or outside E8M0 bytes {lo}…{hi} (its E4M3 weights would not be "
                f"exact)")
    return None


def check_geometry(geo) -> None:
    """The launch fields the route takes (a ``MoeGeometry``): one-line ``ValueError`` otherwise."""
    if geo.block_k != BLOCK_K:
        raise ValueError(f"MoeGeometry.block_k={geo.block_k}: the fp8lut route steps K by the activation's "
                         f"{BLOCK_K}-wide scale block (block_k={BLOCK_K})")
    if 2 * geo.block_n_up < MIN_MMA_M or geo.block_n_down < MIN_MMA_M:
        raise ValueError(f"MoeGeometry block_n_up={geo.block_n_up}, block_n_down={geo.block_n_down}: the fp8lut "
                         f"route's MMA operand needs ≥ {MIN_MMA_M} weight rows (block_n_up ≥ {MIN_MMA_M // 2}, "
                         f"block_n_down ≥ {MIN_MMA_M})")
    if geo.slot_split != 0:
        raise ValueError(f"MoeGeometry.slot_split={geo.slot_split}: the fp8lut route runs the expert-major down "
                         f"projection only (slot_split=0)")
    if geo.decode not in DECODES:
        raise ValueError(f"MoeGeometry.decode={geo.decode!r}: the fp8lut route's table decode is one of "
                         f"{', '.join(DECODES)}")


def _setup(ex, geo, act_quant: bool, act_dtype: torch.dtype, device) -> bool:
    """Check a launch; returns whether the inline-PTX decode runs."""
    check_geometry(geo)
    why = refusal(ex, act_quant, act_dtype)
    if why is not None:
        raise ValueError(why)
    return lut.decode_asm(DECODES[geo.decode], device)


def _common(T: int, k: int) -> dict:
    return dict(TOPK=k, KP=triton.next_power_of_2(k), PP=triton.next_power_of_2(T * k),
                TP=max(MIN_MMA_M, triton.next_power_of_2(T)), UPCAST=interpreting())


def gate_up(x: torch.Tensor, idx: torch.Tensor, rw: torch.Tensor, ex, limit: float, geo, act_quant: bool,
            act_dtype: torch.dtype, out: torch.Tensor, g: torch.Tensor, u: torch.Tensor, write_gu: bool) -> None:
    """Stage 1 into ``out`` (``h [T, k, I]`` bf16) or, ``write_gu``, ``g`` and ``u`` (``moe_gate_up`` allocates
    them): ``x [T, D]`` quantized once (E4M3 split layout and per-128 scales), then one launch."""
    asm = _setup(ex, geo, act_quant, act_dtype, x.device)
    T, D = x.shape
    k, I = idx.shape[1], ex.inter
    bn = geo.block_n_up
    tile_ref, tops = lut.scale_reference(geo.lut_ref, (ex.w1_scale, ex.w3_scale), bn, BLOCK_K)
    qa = quantize_activations(x, q=False, q_split=True)
    xq, xs = qa["q_split"], qa["scale"]
    _moe_up_lut_kernel[(T * k, triton.cdiv(I, bn))](
        xq, xs, idx, rw, ex.w1, ex.w1_scale, ex.w3.data_ptr() - ex.w1.data_ptr(),
        ex.w3_scale.data_ptr() - ex.w1_scale.data_ptr(), tops, out, g, u, T, D, I, ex.expert_offset, ex.n_experts,
        float(limit), ex.w1.stride(0), ex.w1.stride(1), ex.w1_scale.stride(0), ex.w1_scale.stride(1),
        tops.stride(0), tops.stride(1), xs.stride(0), xs.stride(1), BN=bn, EVEN_K=D % BLOCK_K == 0,
        FUSE=not write_gu, ASM=asm, TILE_REF=tile_ref, **_common(T, k), num_warps=geo.num_warps,
        num_stages=geo.num_stages, **pdl_args(x.device))


def down(h: torch.Tensor, idx: torch.Tensor, ex, geo, act_quant: bool, act_dtype: torch.dtype,
         out: torch.Tensor) -> None:
    """Stage 2 into ``out [T, k, D]`` (fp32, act-rounded; only the slots of the bank's experts written): ``h [T, k,
    I]`` (bf16) quantized once per slot, then one launch."""
    asm = _setup(ex, geo, act_quant, act_dtype, h.device)
    T, k, I = h.shape
    D = ex.dim
    bn = geo.block_n_down
    tile_ref, tops = lut.scale_reference(geo.lut_ref, (ex.w2_scale,), bn, BLOCK_K)
    qa = quantize_activations(h.reshape(T * k, I), q=False, q_split=True)
    hq, hs = qa["q_split"], qa["scale"]
    _moe_down_lut_kernel[(T * k, triton.cdiv(D, bn))](
        hq, hs, idx, ex.w2, ex.w2_scale, tops, out, T, D, I, ex.expert_offset, ex.n_experts, ex.w2.stride(0),
        ex.w2.stride(1), ex.w2_scale.stride(0), ex.w2_scale.stride(1), tops.stride(0), tops.stride(1), hs.stride(0),
        hs.stride(1), BN=bn, EVEN_K=I % BLOCK_K == 0, ASM=asm, TILE_REF=tile_ref, **_common(T, k),
        num_warps=geo.num_warps, num_stages=geo.num_stages, **pdl_args(h.device))


__all__ = ["ROUTE", "BLOCK_K", "MIN_MMA_M", "DECODES", "refusal", "check_geometry", "gate_up", "down"]
