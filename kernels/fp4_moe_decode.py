"""Routed-MoE decode over each token's selected experts, reading packed FP4 (E2M1) weights and their E8M0
scales directly — no dequantized copy anywhere.

Two launches per MoE layer:

1. **gate/up** — grid ``(T·k pairs, I/BLOCK_N, token blocks)``. The program of the *first* pair routed to an
   expert does the work for every token routed to it (each weight byte is read once per step, however many
   tokens share the expert); the others exit at once. It computes ``g = x·W1ᵀ`` and ``u = x·W3ᵀ``, rounds
   them to the activation dtype as the reference's Linear does, and writes either ``(g, u)`` or
   ``h = act(silu(min(g, L)) · clamp(u, ±L) · routing_weight)``, the down projection's input.
2. **down** — grid ``(T, slot_split, D/BLOCK_N)``. A program takes ``k/slot_split`` of its token's slots,
   computes each slot's ``h·W2ᵀ`` (rounded to the activation dtype) and sums the slots in fp64 — exact for
   act-rounded values, so every ``slot_split`` gives the same bits as the reference's sum. ``slot_split > 1``
   spreads one token's slots over more programs and adds a tiny partial-sum kernel.

Routes (how a 128-wide K block of one weight row is multiplied, ``route``):

* ``"fma"`` — (a) decode E2M1 in registers (exact bit trick into fp16), fp32 FMA against the FP8-quantized
  activation (the reference's semantics), one E8M0 multiply per 32-group.
* ``"int8"`` — (b) the paper's MI250 route: activations per 32 to INT8 (scale amax/127), E2M1 → int8 as
  ``2·value`` (exact), int32 dot per group, then ``E8M0 × activation scale / 2``. Changes the activation
  quantization (per-32 INT8 instead of per-128 FP8): judged with the "int8" tolerance kind.
* ``"dot_scaled"`` — (c) Triton's ``tl.dot_scaled`` with BF16 activations (FP8-quantized values, exact in
  BF16) and the E2M1 weight + E8M0 scales as given; native on hardware with microscaled MMA, emulated by an
  upcast elsewhere (sm_90, gfx90a). Token rows are padded to 16.

Launch geometry (:class:`MoeGeometry`) is a parameter: rows per program of each stage, K per loop step and
how the top-k slots of the down projection are split across programs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .formats import RNE_MAGIC, e2m1_pair_times2_int, e2m1_pair_to_f32_scaled, quantize_fp8_block, round_to_bf16
from .fp8_gemv import sum_partials
from dsv4lab import quant

ROUTES = ("fma", "int8", "dot_scaled")


@dataclass(frozen=True)
class MoeGeometry:
    """Launch geometry of the routed-MoE decode (see the module docstring)."""

    block_n_up: int = 32
    block_n_down: int = 32
    block_k: int = 256
    slot_split: int = 1
    num_warps: int = 4


# ------------------------------------------------------------------------------------------------ device helpers
# (Few, flat helpers: each nested jit call costs Triton's CPU interpreter milliseconds per call.)
@triton.jit
def _load_weight_block(w_row_ptr, s_row_ptr, n_ok, stride_wn, stride_sn, k0, K, ROUTE: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """One 128-wide K block of ``BLOCK_N`` weight rows: the low/high nibbles of the packed bytes
    ``[BLOCK_N, 4, 16]`` (group g, byte j = elements ``k0+32g+2j`` and ``+1``) decoded for ``ROUTE``
    (fp32 ``value·2^-14`` or int32 ``2·value``), and the E8M0 group scales ``[BLOCK_N, 4]`` in fp32."""
    r = tl.arange(0, BLOCK_N)
    g = tl.arange(0, 4)
    j = tl.arange(0, 16)
    col = k0 // 2 + g[None, :, None] * 16 + j[None, None, :]
    wb = tl.load(w_row_ptr + r[:, None, None] * stride_wn + col,
                 mask=n_ok[:, None, None] & (col < K // 2), other=0).to(tl.int32)
    sg = k0 // 32 + g
    sb = tl.load(s_row_ptr + r[:, None] * stride_sn + sg[None, :], mask=n_ok[:, None] & (sg < K // 32)[None, :],
                 other=127).to(tl.int32)
    sc = tl.where(sb == 0, 0x00400000, sb << 23).to(tl.float32, bitcast=True)  # E8M0 → 2^(b-127)
    if ROUTE == 0:
        lo, hi = e2m1_pair_to_f32_scaled(wb)
    else:
        lo, hi = e2m1_pair_times2_int(wb)
    return lo, hi, sc


@triton.jit
def _load_token_block(x_row_ptr, valid, k0, K, ROUTE: tl.constexpr, ACT_QUANT: tl.constexpr):
    """One activation row's 128-wide K block as even/odd elements ``[4, 16]`` each, quantized for ``ROUTE``:
    FP8 per 128 (exact fp32 values; scale 1) or INT8 per 32 (int32 codes and the ``[4]`` group scales)."""
    g = tl.arange(0, 4)[:, None]
    j = tl.arange(0, 16)[None, :]
    k = k0 + g * 32 + 2 * j
    k_end = tl.where(valid, K, 0)  # (a vector mask & a scalar mask loses its bool dtype in the interpreter)
    xe = tl.load(x_row_ptr + k, mask=k < k_end, other=0.0).to(tl.float32)
    xo = tl.load(x_row_ptr + k + 1, mask=k + 1 < k_end, other=0.0).to(tl.float32)
    if ROUTE == 0:
        both = tl.join(xe, xo)  # [4, 16, 2]: quantize the block in one call
        both = quantize_fp8_block(both, tl.max(tl.max(tl.max(tl.abs(both), axis=2), axis=1), axis=0), ACT_QUANT)
        xe, xo = tl.split(both)
        return xe, xo, tl.full((4,), 1.0, tl.float32)
    else:
        amax = tl.maximum(tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1)), 1e-8)
        s = tl.math.div_rn(amax, tl.full((4,), 127.0, tl.float32))  # the paper's scale amax/127 (correctly rounded)
        sb = tl.broadcast_to(s[:, None], (4, 16))
        qe = tl.minimum(tl.maximum((tl.math.div_rn(xe, sb) + RNE_MAGIC) - RNE_MAGIC, -127.0), 127.0)
        qo = tl.minimum(tl.maximum((tl.math.div_rn(xo, sb) + RNE_MAGIC) - RNE_MAGIC, -127.0), 127.0)
        return qe.to(tl.int32), qo.to(tl.int32), s


@triton.jit
def _block_dot(lo, hi, sc, xe, xo, sx, ROUTE: tl.constexpr):
    """``[BLOCK_N]`` partial dot of a decoded weight block with one token's block."""
    t = tl.sum(lo * xe[None, :, :] + hi * xo[None, :, :], axis=2)  # [BLOCK_N, 4]: Σ over each 32-group
    if ROUTE == 0:
        return tl.sum((t * 16384.0) * sc, axis=1)  # 2^14 undoes the decode's offset
    else:
        return tl.sum(t.to(tl.float32) * sc * (sx * 0.5)[None, :], axis=1)  # exact int32 group dots, then scales


@triton.jit
def _rows_dot_scaled(acc, x_ptr, rows, row_ok, stride_x, k0, K, w_row_ptr, s_row_ptr, n_ok, stride_wn, stride_sn,
                     ACT_QUANT: tl.constexpr, BLOCK_N: tl.constexpr):
    """``acc += x[rows, k0:k0+128] · Wᵀ`` through ``tl.dot_scaled`` (E2M1 weight, E8M0 scales)."""
    k = k0 + tl.arange(0, 128)
    xr = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=row_ok[:, None] & (k < K)[None, :],
                 other=0.0).to(tl.float32)
    xq = quantize_fp8_block(xr, tl.max(tl.abs(xr), axis=1)[:, None], ACT_QUANT)
    r = tl.arange(0, BLOCK_N)
    c = k0 // 2 + tl.arange(0, 64)
    w = tl.load(w_row_ptr + r[None, :] * stride_wn + c[:, None], mask=n_ok[None, :] & (c < K // 2)[:, None],
                other=0)
    sg = k0 // 32 + tl.arange(0, 4)
    sc = tl.load(s_row_ptr + r[:, None] * stride_sn + sg[None, :], mask=n_ok[:, None] & (sg < K // 32)[None, :],
                 other=127)
    return tl.dot_scaled(xq.to(tl.bfloat16), None, "bf16", w, sc, "e2m1", acc)  # FP8 values: exact in bf16


# ------------------------------------------------------------------------------------------------ stage 1
@triton.jit
def _gate_up_kernel(x_ptr, idx_ptr, rw_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, g_ptr, u_ptr, h_ptr,
                    T, D, I, expert_offset, n_local, limit,
                    stride_we, stride_wn, stride_se, stride_sn,
                    TOPK: tl.constexpr, P_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr,
                    ROUTE: tl.constexpr, ACT_QUANT: tl.constexpr, WRITE_GU: tl.constexpr, ROUND_ACT: tl.constexpr,
                    HAS_LIMIT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_p = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_m = tl.program_id(2)
    e = tl.load(idx_ptr + pid_p)
    q = tl.arange(0, P_BLOCK)
    pair_expert = tl.load(idx_ptr + q, mask=q < T * TOPK, other=-1)
    n_earlier = tl.sum(((q < pid_p) & (pair_expert == e)).to(tl.int32), axis=0)
    local = e - expert_offset
    if (n_earlier == 0) & (local >= 0) & (local < n_local):
        t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        s = tl.arange(0, K_BLOCK)
        slot_ok = (t[:, None] < T) & (s[None, :] < TOPK)
        match = (tl.load(idx_ptr + t[:, None] * TOPK + s[None, :], mask=slot_ok, other=-1) == e) & slot_ok
        has = tl.max(match.to(tl.int32), axis=1) > 0  # [BLOCK_M]: token routed to this expert
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < I
        w1e = w1_ptr + local * stride_we + pid_n * BLOCK_N * stride_wn
        w3e = w3_ptr + local * stride_we + pid_n * BLOCK_N * stride_wn
        s1e = s1_ptr + local * stride_se + pid_n * BLOCK_N * stride_sn
        s3e = s3_ptr + local * stride_se + pid_n * BLOCK_N * stride_sn
        acc1 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc3 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        rows_m = tl.arange(0, BLOCK_M)
        for c in range(0, tl.cdiv(D, BLOCK_K)):
            for b in tl.static_range(BLOCK_K // 128):
                k0 = c * BLOCK_K + b * 128
                if ROUTE == 2:
                    acc1 = _rows_dot_scaled(acc1, x_ptr, t, has, D, k0, D, w1e, s1e, n_ok, stride_wn, stride_sn,
                                            ACT_QUANT, BLOCK_N)
                    acc3 = _rows_dot_scaled(acc3, x_ptr, t, has, D, k0, D, w3e, s3e, n_ok, stride_wn, stride_sn,
                                            ACT_QUANT, BLOCK_N)
                else:
                    lo1, hi1, sc1 = _load_weight_block(w1e, s1e, n_ok, stride_wn, stride_sn, k0, D, ROUTE, BLOCK_N)
                    lo3, hi3, sc3 = _load_weight_block(w3e, s3e, n_ok, stride_wn, stride_sn, k0, D, ROUTE, BLOCK_N)
                    for mi in tl.static_range(BLOCK_M):
                        tok = pid_m * BLOCK_M + mi
                        has_m = tl.sum(tl.where(rows_m == mi, has.to(tl.int32), 0), axis=0) > 0
                        if has_m:
                            xe, xo, sx = _load_token_block(x_ptr + tok * D, has_m, k0, D, ROUTE, ACT_QUANT)
                            p1 = _block_dot(lo1, hi1, sc1, xe, xo, sx, ROUTE)
                            p3 = _block_dot(lo3, hi3, sc3, xe, xo, sx, ROUTE)
                            acc1 += tl.where(rows_m[:, None] == mi, p1[None, :], 0.0)
                            acc3 += tl.where(rows_m[:, None] == mi, p3[None, :], 0.0)
        g = acc1
        u = acc3
        if ROUND_ACT:  # the reference's Linear returns bf16
            g = round_to_bf16(g)
            u = round_to_bf16(u)
        if not WRITE_GU:
            if HAS_LIMIT:
                u = tl.minimum(tl.maximum(u, -limit), limit)
                g = tl.minimum(g, limit)
            g64 = g.to(tl.float64)  # the reference evaluates transcendentals in fp64, rounded once to fp32
            act = (g64 / (1.0 + tl.exp(-g64))).to(tl.float32) * u
        for si in tl.static_range(TOPK):
            to_slot = tl.sum(tl.where(s[None, :] == si, match.to(tl.int32), 0), axis=1) > 0  # [BLOCK_M]
            out_off = (t[:, None] * TOPK + si) * I + n[None, :]
            out_mask = to_slot[:, None] & n_ok[None, :]
            if WRITE_GU:
                tl.store(g_ptr + out_off, g, mask=out_mask)
                tl.store(u_ptr + out_off, u, mask=out_mask)
            else:
                rw = tl.load(rw_ptr + t * TOPK + si, mask=to_slot, other=0.0)
                hv = act * rw[:, None]
                if ROUND_ACT:
                    tl.store(h_ptr + out_off, round_to_bf16(hv).to(tl.bfloat16), mask=out_mask)
                else:
                    tl.store(h_ptr + out_off, hv, mask=out_mask)


# ------------------------------------------------------------------------------------------------ stage 2
@triton.jit
def _down_kernel(h_ptr, idx_ptr, w2_ptr, s2_ptr, y_ptr, part_ptr, slot_out_ptr,
                 T, D, I, expert_offset, n_local,
                 stride_we, stride_wn, stride_se, stride_sn, SLOT_SPLIT,
                 TOPK: tl.constexpr, PER_SLOT_OUT: tl.constexpr, ROUTE: tl.constexpr,
                 ACT_QUANT: tl.constexpr, ROUND_ACT: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    split = tl.program_id(1)
    pid_n = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < D
    total = tl.zeros((BLOCK_N,), tl.float64)
    pad_rows = tl.arange(0, 16)
    for si in range(split, TOPK, SLOT_SPLIT):
        e = tl.load(idx_ptr + t * TOPK + si)
        local = e - expert_offset
        if (local >= 0) & (local < n_local):
            h_row = h_ptr + (t * TOPK + si) * I
            w2e = w2_ptr + local * stride_we + pid_n * BLOCK_N * stride_wn
            s2e = s2_ptr + local * stride_se + pid_n * BLOCK_N * stride_sn
            if ROUTE == 2:
                acc2 = tl.zeros((16, BLOCK_N), tl.float32)
            else:
                acc = tl.zeros((BLOCK_N,), tl.float32)
            for c in range(0, tl.cdiv(I, BLOCK_K)):
                for b in tl.static_range(BLOCK_K // 128):
                    k0 = c * BLOCK_K + b * 128
                    if ROUTE == 2:
                        acc2 = _rows_dot_scaled(acc2, h_row, pad_rows, pad_rows == 0, 0, k0, I, w2e, s2e, n_ok,
                                                stride_wn, stride_sn, ACT_QUANT, BLOCK_N)
                    else:
                        lo, hi, sc = _load_weight_block(w2e, s2e, n_ok, stride_wn, stride_sn, k0, I, ROUTE, BLOCK_N)
                        xe, xo, sx = _load_token_block(h_row, True, k0, I, ROUTE, ACT_QUANT)
                        acc += _block_dot(lo, hi, sc, xe, xo, sx, ROUTE)
            if ROUTE == 2:
                acc = tl.sum(tl.where(pad_rows[:, None] == 0, acc2, 0.0), axis=0)
            if ROUND_ACT:
                acc = round_to_bf16(acc)
            total += acc.to(tl.float64)
            if PER_SLOT_OUT:
                tl.store(slot_out_ptr + (t * TOPK + si) * D + n, acc, mask=n_ok)
    if not PER_SLOT_OUT:
        if SLOT_SPLIT == 1:
            tl.store(y_ptr + t * D + n, total.to(tl.float32), mask=n_ok)
        else:
            tl.store(part_ptr + (split * T + t) * D + n, total, mask=n_ok)


# ------------------------------------------------------------------------------------------------ launchers
@dataclass
class ExpertTensors:
    """The native buffers of an expert bank: ``w1, w3 [E, I, D/2]``, ``w2 [E, D, I/2]`` (uint8 views) and their
    E8M0 scales (uint8 views), plus the bank's first global expert id."""

    w1: torch.Tensor
    w1_scale: torch.Tensor
    w3: torch.Tensor
    w3_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    expert_offset: int = 0

    @classmethod
    def of(cls, bank) -> "ExpertTensors":
        u8 = lambda t: t.view(torch.uint8)  # noqa: E731 — int8 / e8m0 storage read as raw bytes
        return cls(u8(bank.w1), u8(bank.w1_scale), u8(bank.w3), u8(bank.w3_scale), u8(bank.w2), u8(bank.w2_scale),
                   int(bank.expert_offset))

    @property
    def n_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def inter(self) -> int:
        return self.w1.shape[1]

    @property
    def dim(self) -> int:
        return self.w2.shape[1]

    def check(self) -> None:
        E, I, half_d = self.w1.shape
        D = 2 * half_d
        for name, t, shape in (("w1", self.w1, (E, I, D // 2)), ("w3", self.w3, (E, I, D // 2)),
                               ("w2", self.w2, (E, D, I // 2)), ("w1_scale", self.w1_scale, (E, I, D // 32)),
                               ("w3_scale", self.w3_scale, (E, I, D // 32)),
                               ("w2_scale", self.w2_scale, (E, D, I // 32))):
            assert tuple(t.shape) == shape, f"expert {name}: shape {tuple(t.shape)}, expected {shape}"
            assert t.is_contiguous() and t.dtype == torch.uint8, f"expert {name} must be a contiguous uint8 view"
        assert D % 32 == 0 and I % 32 == 0, "D and I must be multiples of 32 (the E8M0 group)"


def _check_route(route: str) -> int:
    if route not in ROUTES:
        raise ValueError(f"unknown routed-MoE route {route!r}; known: {', '.join(ROUTES)}")
    return ROUTES.index(route)


def moe_gate_up(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor | None, ex: ExpertTensors, limit: float,
                route: str = "fma", geometry: MoeGeometry | None = None, act_quant: bool = True,
                act_dtype: torch.dtype = torch.bfloat16, write_gu: bool = False):
    """Stage 1. ``x [T, D]``, ``idx [T, k]`` global expert ids, ``weights [T, k]`` fp32.

    Returns ``h [T, k, I]`` in ``act_dtype`` (slots of experts not in the bank are left unwritten), or with
    ``write_gu`` the act-rounded ``(g, u)`` in fp32 with NaN in such slots (the reference's ``moe_stage1``).
    """
    r = _check_route(route)
    geo = geometry or MoeGeometry()
    assert geo.block_k % 128 == 0
    T, D = x.shape
    k = idx.shape[1]
    assert idx.shape == (T, k) and D == ex.dim
    x = x.contiguous()
    idx = idx.contiguous()
    I = ex.inter
    if write_gu:
        g = torch.full((T, k, I), float("nan"), dtype=torch.float32, device=x.device)
        u = torch.full_like(g, float("nan"))
        h = g
        rw = g
    else:
        assert weights is not None and weights.shape == (T, k)
        rw = weights.to(torch.float32).contiguous()
        h = torch.empty(T, k, I, dtype=act_dtype, device=x.device)
        g = u = h
    bm = 16 if route == "dot_scaled" else min(triton.next_power_of_2(T), 8)
    bn = min(geo.block_n_up, triton.next_power_of_2(I))
    grid = (T * k, triton.cdiv(I, bn), triton.cdiv(T, bm))
    _gate_up_kernel[grid](x, idx, rw, ex.w1, ex.w3, ex.w1_scale, ex.w3_scale, g, u, h,
                          T, D, I, ex.expert_offset, ex.n_experts, float(limit),
                          ex.w1.stride(0), ex.w1.stride(1), ex.w1_scale.stride(0), ex.w1_scale.stride(1),
                          TOPK=k, P_BLOCK=triton.next_power_of_2(T * k), K_BLOCK=triton.next_power_of_2(k),
                          ROUTE=r, ACT_QUANT=act_quant, WRITE_GU=write_gu, ROUND_ACT=act_dtype == torch.bfloat16,
                          HAS_LIMIT=limit > 0, BLOCK_M=bm, BLOCK_N=bn,
                          BLOCK_K=geo.block_k, num_warps=geo.num_warps)
    return (g, u) if write_gu else h


def moe_down(h: torch.Tensor, idx: torch.Tensor, ex: ExpertTensors, route: str = "fma",
             geometry: MoeGeometry | None = None, act_quant: bool = True, act_dtype: torch.dtype = torch.bfloat16,
             per_slot: bool = False) -> torch.Tensor:
    """Stage 2. ``h [T, k, I]`` → ``y [T, D]`` fp32 (the slot sum), or with ``per_slot`` the act-rounded slot
    outputs ``[T, k, D]`` fp32 with NaN in slots of experts not in the bank (the reference's ``moe_stage2``)."""
    r = _check_route(route)
    geo = geometry or MoeGeometry()
    T, k, I = h.shape
    assert I == ex.inter and idx.shape == (T, k)
    D = ex.dim
    h = h.contiguous()
    idx = idx.contiguous()
    split = 1 if per_slot else max(1, min(geo.slot_split, k))
    y = torch.empty(T, D, dtype=torch.float32, device=h.device)
    part = torch.empty(split, T, D, dtype=torch.float64, device=h.device) if split > 1 else y
    slot_out = torch.full((T, k, D), float("nan"), dtype=torch.float32, device=h.device) if per_slot else y
    bn = min(geo.block_n_down, triton.next_power_of_2(D))
    grid = (T, split, triton.cdiv(D, bn))
    _down_kernel[grid](h, idx, ex.w2, ex.w2_scale, y, part, slot_out, T, D, I, ex.expert_offset, ex.n_experts,
                       ex.w2.stride(0), ex.w2.stride(1), ex.w2_scale.stride(0), ex.w2_scale.stride(1), split,
                       TOPK=k, PER_SLOT_OUT=per_slot, ROUTE=r, ACT_QUANT=act_quant,
                       ROUND_ACT=act_dtype == torch.bfloat16, BLOCK_N=bn,
                       BLOCK_K=geo.block_k, num_warps=geo.num_warps)
    if per_slot:
        return slot_out
    if split > 1:
        sum_partials(part, y)
    return y


def routed_moe_decode(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, ex: ExpertTensors, limit: float,
                      route: str = "fma", geometry: MoeGeometry | None = None, act_quant: bool = True,
                      act_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The whole routed MoE of a decode step: ``Σ_slots w2(act(w1·x, w3·x)·weight)`` → ``[T, D]`` fp32."""
    h = moe_gate_up(x, idx, weights, ex, limit, route, geometry, act_quant, act_dtype)
    return moe_down(h, idx, ex, route, geometry, act_quant, act_dtype)


def reference_int8_route(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Oracle of the INT8 route for one weight: ``x [M, K]`` → ``[M, N]`` fp64, computed as the paper describes
    (per-32 INT8 activations, ``2·E2M1`` int8 weights, exact integer group dots, then both scales / 2)."""
    xq, xs = quant.act_quant_int8(x.float(), 32)
    codes = quant.unpack_fp4(w_packed).long()
    w2x = torch.tensor(quant.E2M1_TIMES2_INT8, dtype=torch.int64, device=codes.device)[codes]
    M, K = xq.shape
    N = w2x.shape[0]
    dots = torch.einsum("mgk,ngk->mng", xq.long().view(M, K // 32, 32).double(), w2x.view(N, K // 32, 32).double())
    ws = quant.e8m0_decode(w_scale, torch.float64)
    return (dots * ws[None] * xs.double()[:, None, :] * 0.5).sum(-1)


def reference_int8_moe(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, ex: ExpertTensors,
                       limit: float) -> torch.Tensor:
    """Oracle of the whole routed MoE along the INT8 route: :func:`reference_int8_route` for each projection with
    the reference's rounding points (bf16 projection outputs, SwiGLU in fp32 with the silu in fp64, a bf16 input
    to the down projection, an exact sum over slots). Experts outside ``ex`` are skipped. Returns ``[T, D]`` fp32."""
    T, k = idx.shape
    y = torch.zeros(T, ex.dim, dtype=torch.float64, device=x.device)
    for t in range(T):
        for s in range(k):
            e = int(idx[t, s]) - ex.expert_offset
            if not 0 <= e < ex.n_experts:
                continue
            g = reference_int8_route(x[t:t + 1], ex.w1[e], ex.w1_scale[e]).float().bfloat16().float()
            u = reference_int8_route(x[t:t + 1], ex.w3[e], ex.w3_scale[e]).float().bfloat16().float()
            if limit > 0:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            h = torch.nn.functional.silu(g.double()).float() * u * weights[t, s].float()
            y[t] += reference_int8_route(h.bfloat16(), ex.w2[e], ex.w2_scale[e]).float().bfloat16().double()[0]
    return y.float()
