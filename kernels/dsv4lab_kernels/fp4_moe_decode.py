"""Routed-MoE decode over each token's selected experts, reading packed FP4 (E2M1) weights and their E8M0
scales directly — no dequantized copy anywhere, no atomics (graph replay equals eager bit for bit).

Three launches per MoE layer (two with the token-major down projection):

1. **gate/up** — grid ``(T·k pairs, ⌈I/block_n_up⌉)``. The program of the *first* pair routed to an expert
   works for every token routed to it (each weight byte is read once per step however many tokens share the
   expert); the others exit at once. It streams ``block_n_up`` rows of ``w1`` **and** ``w3`` over the whole of
   ``D`` (no K split: 6 experts × 2048/32 = 384 programs of 2 warps at batch 1 keep 132 SMs busy, and the SwiGLU
   needs whole sums), rounds ``g`` and ``u`` to the activation dtype as the reference's Linear does and
   writes ``h = act(silu(min(g, L)) · clamp(u, ±L) · routing weight)``, the down projection's input.
2. **down** — expert-major (``slot_split=0``, the default): grid ``(T·k pairs, ⌈D/block_n_down⌉)``, again the
   first pair of an expert works for all its tokens and writes each slot's act-rounded output; then
3. **combine** — ``y[t] = Σ_slots out[t, slot]`` in fp64 (exact for act-rounded values, so the order of the
   slots cannot change a bit) — a few hundred KB that stay in L2, not a second pass over HBM.
   Token-major (``slot_split ≥ 1``): grid ``(T, slot_split, ⌈D/block_n_down⌉)``, a program sums its share of a
   token's slots in fp64 itself (``slot_split=1``: no third launch; an expert shared by two tokens is read twice).

Routes (how a chunk of weights meets the activations, ``route``):

* ``"dot"`` — the weights are decoded to **exact** bf16 (E2M1 value × E8M0 scale has ≤ 2 significant bits; the
  decode is a bit splice, the scale one bf16 multiply) and multiplied with the FP8-quantized activations (exact
  in bf16) on tensor cores with fp32 accumulation: tokens sharing an expert cost no extra weight traffic and
  almost no extra instructions. The reference's semantics.
* ``"fma"`` — the same decode, then fp32 FMAs on CUDA cores, one token at a time (a second token of the same
  expert re-reads the program's tile, normally from L2). The reference's semantics.
* ``"int8"`` — the paper's MI250 route: activations per 32 to INT8 (scale ``amax/127``), E2M1 → ``2·value``
  int8 (exact), an exact int8 tensor-core dot per 32-group, then ``E8M0 × activation scale / 2`` in fp32.
  Another activation quantization: judged against its own arithmetic (:func:`reference_stage1`,
  :func:`reference_stage2` with ``route="int8"``).
* ``"dot_scaled"`` — Triton's ``tl.dot_scaled`` (E2M1 weights with their E8M0 scales as given, bf16
  activations holding the FP8-quantized values): the reference's semantics; native on hardware with microscaled
  MMA, an upcast emulation elsewhere (sm_90).
* ``"fp8lut"`` — the grouped prefill's FP8 route in the decode's structure (:mod:`.fp4_moe_decode_fp8lut`): each
  weight tile turned into exact E4M3 bytes by a per-group byte table (one ``prmt`` per four weights), FP8 MMAs with
  the rows as the second operand (padded to 16), promoted per 128-wide K tile; the activations are the reference's
  own E4M3 values and scales, quantized once per stage. The reference's semantics within the ``fp8_mma``
  accumulation model, for banks whose scales lie within the byte table's window (``block_k`` 128, expert-major).

The E2M1 decode (``decode``): ``"asm"`` on NVIDIA GPUs — PTX on packed registers, 4 bytes (8 weights) at a
time: ``sign<<15 | magnitude<<6`` is the bf16 of ``value·2^-126`` for every code, and one ``mul.bf16x2`` by
``2^(s-1)`` applies the E8M0 byte ``s`` (exact for scales ≤ 2, i.e. ``s ≤ 128``, which the launcher checks
once per bank); ``"plain"`` — portable Triton (the interpreter, ROCm, scales above 2): fp16 bit splice, fp32
scale, exact cast to bf16 (E8M0 bytes 2..240). Both give the same bits. ``"bytewise"`` (the ``fma`` route with group
sums only) leaves the scale out of the decode: a code's fp16 ``value·2^-14`` is its high byte alone, so one
32-bit word decodes four codes at a time (per 4 packed bytes: 7 ALU operations and 4 byte permutes for 8 weights
against 22 for the bf16 splice with its multiplies), and each 32-group's dot is multiplied by its ``2^(s-113)``
in fp32 after its sum — a power of two, so every product and every sum rounds exactly as with the scaled weights:
the same bits as ``"asm"``/``"plain"``, for any E8M0 byte (no ``s ≤ 128`` limit).

Numerics: every product is exact in fp32, only sums round. ``fma`` and ``int8`` sum in IEEE fp32 on CUDA cores
(``int8`` also rounds each group's ``dot × scale`` product once); ``dot`` and ``dot_scaled`` accumulate inside
tensor cores (aligned, truncated partial sums), ``fp8lut`` in FP8 MMAs (~14 bits of the running sum) per 128-wide
K tile, the tiles' partials in fp32 — :data:`ACCUMULATION` states the per-route bound the tests use
(:func:`bound_args`).

Four files: this one (geometry, the bank's tensors, the launchers), the kernels
(:mod:`~dsv4lab_kernels.fp4_moe_decode_kernels`; the ``fp8lut`` route's in
:mod:`~dsv4lab_kernels.fp4_moe_decode_fp8lut`) and the exact oracles
(:mod:`~dsv4lab_kernels.fp4_moe_decode_reference`, whose names this module re-exports).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from . import fp4_moe_decode_fp8lut as lut_decode
from .fp4_moe_decode_kernels import (_act_qdq_kernel, _moe_combine_kernel, _moe_down_expert_kernel,
                                     _moe_down_token_kernel, _moe_output_kernel, _moe_up_kernel)
from .fp4_moe_decode_reference import (StageOracle, reference_int8_moe, reference_int8_route, reference_stage1,
                                       reference_stage2)
from .fp8_gemv import interpreting
from .launch import pdl_args

ROUTES = ("dot", "fma", "int8", "dot_scaled", "fp8lut")
DECODES = ("auto", "asm", "plain", "bytewise")
SAME_SEMANTICS = ("dot", "fma", "dot_scaled", "fp8lut")  # the reference's quantization; "int8" is the paper's
ACCUMULATION = {
    # route: (where the sums are done, the factor c in γ(c·n) over n = reduction length, fp32 unit roundoff — or
    # the name of a blocked accumulation model of dsv4lab.tools.verify.bounds, γ_n(model))
    "fma": ("fp32 FMA on CUDA cores, round to nearest", 1.0),
    "int8": ("exact int32 per 32-group, one fp32 product rounding per group, fp32 sums", 1.0),
    # Tensor cores align each step's addends to the largest and truncate (Fasi et al. 2021; Khattak & Mikaitis
    # 2025): a step of m products errs by ≤ (m+1)·2^-23 of its magnitude, so n terms by ≤ 2(1+1/m)·n·u ≤ 4·n·u.
    "dot": ("tensor-core fp32 accumulation (aligned, truncated)", 4.0),
    "dot_scaled": ("tensor-core fp32 accumulation (aligned, truncated)", 4.0),
    # exact E4M3 products; Hopper's FP8 MMA keeps ~14 bits of a 128-wide tile's sum, the partials promoted by exact
    # powers of two and summed in fp32: γ_min(n,128)(2^-13) + γ_⌈n/128⌉(2^-23) (op_bounds.dot.promoted_fp8_model)
    "fp8lut": ("FP8 MMA per 128-wide K tile (~14-bit running sum), partials promoted to fp32", "fp8_mma"),
}


def bound_args(route: str, n: int) -> tuple[float, object]:
    """``(c, acc)`` with ``γ(c, acc)`` (:func:`dsv4lab.tools.verify.bounds.gamma`) the bound of an ``n``-term
    reduction along ``route`` relative to its ``Σ|terms|``: ``(factor·n, fp32)``, or ``(n, model)`` for a route
    whose accumulation is a named blocked model."""
    c = ACCUMULATION[route][1]
    return (n, c) if isinstance(c, str) else (c * n, torch.float32)


@dataclass(frozen=True)
class MoeGeometry:
    """Launch geometry of the routed-MoE decode (see the module docstring).

    Attributes:
        block_n_up, block_n_down: weight rows per program of the gate/up and the down projection.
        block_k: K elements per loop step (a multiple of 128, the activation block); ``block_k/2`` bytes of each
            weight row are read per step (≥ 256 B keeps the reads near the copy bandwidth).
        slot_split: 0 — expert-major down projection + combine kernel; ≥ 1 — token-major, each token's slots
            split over that many programs.
        num_warps, num_stages: Triton launch options (``num_stages > 1`` software-pipelines the weight loads).
        decode: ``"auto"`` (asm on NVIDIA GPUs when every E8M0 scale is ≤ 2), ``"asm"``, ``"plain"`` or
            ``"bytewise"`` (the ``fma`` route with group sums: fp16 codes four at a time, each group's scale
            applied after its sum; see above).
        prequant: quantize ``x`` and ``h`` once per step in a small kernel each (exact bf16 values) instead of
            in every program's loop — two more launches, a third fewer instructions per byte at batch 8 (the
            FP8-activation routes only).
        fma_sums: the ``fma`` route's accumulators — ``"group"``: each chunk's 32-element group dots summed by
            a tree, then added to one accumulator per group; ``"element"``: one accumulator per weight position
            of the tile, two FFMAs per weight pair and no tree in the loop, reduced once after the last chunk
            (fewer instructions per weight byte — the route is issue-bound at batch 1 — for 32 more registers
            per matrix at 8 rows × 256). Either is an fp32 sum of the same exact products in another order.
        lut_ref: the ``fp8lut`` route's scale reference (:data:`.fp4_moe_fp8lut.REFS`): ``"row"`` — each weight
            row's largest scale byte of the K tile; ``"tile"`` — one per ``block_n × 128`` tile, precomputed per
            bank (one multiply fewer per accumulator element and tile; ~4 MB per stage of a 256-expert Flash bank
            at 16 rows); ``"auto"`` — tiles where the bank's scales allow it. (The route reads ``decode`` as its
            table decode: ``auto``, ``asm`` or ``plain``, the portable one; ``prequant`` is implied.)
    """

    block_n_up: int = 32
    block_n_down: int = 32
    block_k: int = 256
    slot_split: int = 0
    num_warps: int = 2
    num_stages: int = 3
    decode: str = "auto"
    prequant: bool = False
    fma_sums: str = "group"
    lut_ref: str = "row"


FMA_SUMS = ("group", "element")


def default_geometry(route: str) -> MoeGeometry:
    """The geometry a launch without one takes: :class:`MoeGeometry`'s defaults, with the ``fp8lut`` route's K step
    (its activation scale block, 128: the route refuses any other)."""
    return MoeGeometry(block_k=128) if route == lut_decode.ROUTE else MoeGeometry()


def act_qdq(x: torch.Tensor) -> torch.Tensor:
    """:func:`dsv4lab.core.quant.act_qdq_fp8` of a bf16 activation ``[..., K]`` on the device, as exact bf16 values."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    y = torch.empty_like(x2, dtype=torch.bfloat16)
    R = x2.shape[0]
    block_r = min(16, triton.next_power_of_2(max(R, 1)))
    _act_qdq_kernel[(triton.cdiv(R, block_r), triton.cdiv(K, 128))](x2, y, R, K, BLOCK_R=block_r, **pdl_args(x2.device))
    return y.view(x.shape)


# ------------------------------------------------------------------------------------------------ launchers
@dataclass
class ExpertTensors:
    """The native buffers of an expert bank: ``w1, w3 [E, I, D/2]``, ``w2 [E, D, I/2]`` (uint8 views) and their
    E8M0 scales (uint8 views), plus the bank's first global expert id and whether every scale is ≤ 2 (the
    asm decode's exact range), checked once here."""

    w1: torch.Tensor
    w1_scale: torch.Tensor
    w3: torch.Tensor
    w3_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    expert_offset: int = 0
    scales_le_2: bool | None = None

    def __post_init__(self):
        if self.scales_le_2 is None:  # 0xFF is E8M0's NaN: both decodes map it to NaN, so it does not count
            self.scales_le_2 = bool(max(int(s.masked_fill(s == 255, 0).max()) if s.numel() else 0
                                        for s in (self.w1_scale, self.w3_scale, self.w2_scale)) <= 128)

    @classmethod
    def of(cls, bank) -> "ExpertTensors":
        """The kernel view of an :class:`~dsv4lab.core.model.linear.ExpertBank`, cached on the bank (the scale check
        reads the device once; decode steps — and CUDA-graph captures — reuse it)."""
        u8 = lambda t: t.view(torch.uint8)  # noqa: E731 — int8 / e8m0 storage read as raw bytes
        key = tuple(t.data_ptr() for t in (bank.w1, bank.w1_scale, bank.w3, bank.w3_scale, bank.w2, bank.w2_scale))
        hit = getattr(bank, "_kernel_view", None)
        if hit is not None and hit[0] == key:
            return hit[1]
        view = cls(u8(bank.w1), u8(bank.w1_scale), u8(bank.w3), u8(bank.w3_scale), u8(bank.w2), u8(bank.w2_scale),
                   int(bank.expert_offset))
        bank._kernel_view = (key, view)
        return view

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
            if tuple(t.shape) != shape:
                raise ValueError(f"expert {name}: shape {tuple(t.shape)}, expected {shape}")
            if not t.is_contiguous() or t.dtype != torch.uint8:
                raise ValueError(f"expert {name} must be a contiguous uint8 view")
        if D % 32 or I % 32:
            raise ValueError(f"expert dims D={D}, I={I} must be multiples of 32 (the E8M0 group)")


def _check_route(route: str) -> int:
    if route not in ROUTES:
        raise ValueError(f"unknown routed-MoE route {route!r}; known: {', '.join(ROUTES)}")
    return ROUTES.index(route)


def _use_asm(geo: MoeGeometry, ex: ExpertTensors, device: torch.device) -> bool:
    if geo.decode not in DECODES:
        raise ValueError(f"unknown E2M1 decode {geo.decode!r}; known: {', '.join(DECODES)}")
    nvidia = device.type == "cuda" and torch.version.hip is None and not interpreting()
    if geo.decode == "bytewise":  # its PTX has no scale limit: the scales apply after each group's sum, in fp32
        return nvidia
    if geo.decode == "asm":
        if not nvidia:
            raise ValueError("the asm E2M1 decode needs an NVIDIA GPU (use decode='plain')")
        if not ex.scales_le_2:
            raise ValueError("the asm E2M1 decode is exact for E8M0 scales ≤ 2 only; this bank has larger ones")
        return True
    return geo.decode == "auto" and nvidia and ex.scales_le_2


def _token_block(T: int, route: str) -> int:
    tp = triton.next_power_of_2(max(T, 1))
    return max(tp, 16) if route in ("dot", "int8", "dot_scaled") else tp


def _launch_opts(geo: MoeGeometry, route: str) -> dict:
    """The launch options and the geometry's constexprs other than the tile sizes."""
    if geo.fma_sums not in FMA_SUMS:
        raise ValueError(f"MoeGeometry.fma_sums={geo.fma_sums!r}; known: {', '.join(FMA_SUMS)}")
    if geo.decode == "bytewise" and (route != "fma" or geo.fma_sums != "group"):
        raise ValueError(f"MoeGeometry.decode='bytewise' scales each 32-group's sum: the 'fma' route with "
                         f"fma_sums='group' only (got route {route!r}, fma_sums {geo.fma_sums!r})")
    return dict(num_warps=geo.num_warps, num_stages=geo.num_stages, FMA_ELEM=geo.fma_sums == "element",
                BYTEWISE=geo.decode == "bytewise")


def moe_gate_up(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor | None, ex: ExpertTensors, limit: float,
                route: str = "dot", geometry: MoeGeometry | None = None, act_quant: bool = True,
                act_dtype: torch.dtype = torch.bfloat16, write_gu: bool = False):
    """Stage 1. ``x [T, D]``, ``idx [T, k]`` global expert ids, ``weights [T, k]`` fp32.

    Returns ``h [T, k, I]`` in ``act_dtype`` (slots of experts not in the bank are left unwritten), or with
    ``write_gu`` the act-rounded ``(g, u)`` in fp32 with NaN in such slots (the reference's ``moe_stage1``).
    """
    r = _check_route(route)
    geo = geometry or default_geometry(route)
    if geo.block_k % 128:
        raise ValueError(f"MoeGeometry.block_k={geo.block_k} must be a multiple of 128 (the activation block)")
    T, D = x.shape
    k = idx.shape[1]
    if idx.shape != (T, k) or D != ex.dim:
        raise ValueError(f"routed MoE: x {tuple(x.shape)} and idx {tuple(idx.shape)} do not fit experts of dim "
                         f"{ex.dim}")
    x = x.contiguous()
    idx = idx.contiguous()
    I = ex.inter
    if write_gu:
        g = torch.full((T, k, I), float("nan"), dtype=torch.float32, device=x.device)
        u = torch.full_like(g, float("nan"))
        h = rw = g
    else:
        if weights is None or weights.shape != (T, k):
            raise ValueError(f"routed MoE: routing weights must be [{T}, {k}]")
        rw = weights.to(torch.float32).contiguous()
        h = torch.empty(T, k, I, dtype=act_dtype, device=x.device)
        g = u = h
    if route == lut_decode.ROUTE:
        lut_decode.gate_up(x, idx, rw, ex, limit, geo, act_quant, act_dtype, h, g, u, write_gu)
        return (g, u) if write_gu else h
    bn = min(geo.block_n_up, triton.next_power_of_2(I))
    grid = (T * k, triton.cdiv(I, bn))
    _moe_up_kernel[grid](x, idx, rw, ex.w1, ex.w3, ex.w1_scale, ex.w3_scale, h, g, u,
                         T, D, I, ex.expert_offset, ex.n_experts, float(limit),
                         ex.w1.stride(0), ex.w1.stride(1), ex.w1_scale.stride(0), ex.w1_scale.stride(1),
                         TOPK=k, TQ=triton.next_power_of_2(T), TP=_token_block(T, route),
                         KP=triton.next_power_of_2(k),
                         PP=triton.next_power_of_2(T * k), ROUTE=r, ASM=_use_asm(geo, ex, x.device),
                         ACT_QUANT=act_quant, WRITE_GU=write_gu, ROUND_ACT=act_dtype == torch.bfloat16,
                         HAS_LIMIT=limit > 0, DOT_FP32=interpreting(), BN=bn, BK=geo.block_k,
                         **_launch_opts(geo, route),
                         **pdl_args(x.device))
    return (g, u) if write_gu else h


def moe_down(h: torch.Tensor, idx: torch.Tensor, ex: ExpertTensors, route: str = "dot",
             geometry: MoeGeometry | None = None, act_quant: bool = True, act_dtype: torch.dtype = torch.bfloat16,
             per_slot: bool = False, combine: bool = True) -> torch.Tensor:
    """Stage 2. ``h [T, k, I]`` → ``y [T, D]`` fp32 (the slot sum), or with ``per_slot`` the act-rounded slot
    outputs ``[T, k, D]`` fp32 with NaN in slots of experts not in the bank (the reference's ``moe_stage2``).
    ``combine=False`` (expert-major only): the slot outputs without the combine launch, slots of experts not in the
    bank left unwritten (a consumer that sums them itself reads only the bank's: :class:`MoeOutput`)."""
    r = _check_route(route)
    geo = geometry or default_geometry(route)
    if geo.block_k % 128:
        raise ValueError(f"MoeGeometry.block_k={geo.block_k} must be a multiple of 128 (the activation block)")
    T, k, I = h.shape
    if I != ex.inter or idx.shape != (T, k):
        raise ValueError(f"routed MoE: h {tuple(h.shape)} and idx {tuple(idx.shape)} do not fit experts of "
                         f"inter dim {ex.inter}")
    D = ex.dim
    h = h.contiguous()
    idx = idx.contiguous()
    y = torch.empty(T, D, dtype=torch.float32, device=h.device)
    if route == lut_decode.ROUTE:  # expert-major only (the route's check says so for slot_split ≥ 1)
        out = torch.full((T, k, D), float("nan"), dtype=torch.float32, device=h.device) if per_slot else \
            torch.empty(T, k, D, dtype=torch.float32, device=h.device)  # per slot: other banks' slots NaN
        lut_decode.down(h, idx, ex, geo, act_quant, act_dtype, out)
        return out if per_slot or not combine else _combine(out, None, idx, y, ex, from_slots=True)
    asm = _use_asm(geo, ex, h.device)
    bn = min(geo.block_n_down, triton.next_power_of_2(D))
    common = dict(ROUTE=r, ASM=asm, ACT_QUANT=act_quant, ROUND_ACT=act_dtype == torch.bfloat16,
                  DOT_FP32=interpreting(), BN=bn, BK=geo.block_k, **_launch_opts(geo, route))
    strides = (ex.w2.stride(0), ex.w2.stride(1), ex.w2_scale.stride(0), ex.w2_scale.stride(1))
    if not combine and geo.slot_split != 0:
        raise ValueError(f"moe_down: slot outputs without the combine need the expert-major down projection "
                         f"(slot_split=0), not slot_split={geo.slot_split}")
    if per_slot or geo.slot_split == 0:
        if per_slot:  # slots of other banks' experts stay NaN, as the reference's
            out = torch.full((T, k, D), float("nan"), dtype=torch.float32, device=h.device)
        else:  # the combine reads only the slots this bank owns
            out = torch.empty(T, k, D, dtype=torch.float32, device=h.device)
        _moe_down_expert_kernel[(T * k, triton.cdiv(D, bn))](
            h, idx, ex.w2, ex.w2_scale, out, T, D, I, ex.expert_offset, ex.n_experts, *strides,
            TOPK=k, TQ=triton.next_power_of_2(T), TP=_token_block(T, route), KP=triton.next_power_of_2(k),
            PP=triton.next_power_of_2(T * k), **common, **pdl_args(h.device))
        if per_slot or not combine:
            return out
        return _combine(out, None, idx, y, ex, from_slots=True)
    split = max(1, min(geo.slot_split, k))
    part = torch.empty(split, T, D, dtype=torch.float64, device=h.device) if split > 1 else y
    _moe_down_token_kernel[(T, split, triton.cdiv(D, bn))](
        h, idx, ex.w2, ex.w2_scale, y, part, T, D, I, ex.expert_offset, ex.n_experts, *strides, split,
        TOPK=k, TP=_token_block(1, route), **common, **pdl_args(h.device))
    if split > 1:
        _combine(None, part, idx, y, ex, from_slots=False)
    return y


def _combine(out, part, idx, y, ex: ExpertTensors, from_slots: bool) -> torch.Tensor:
    T, D = y.shape
    block = min(1024, triton.next_power_of_2(D))
    _moe_combine_kernel[(T, triton.cdiv(D, block))](
        out if from_slots else y, part if part is not None else y, idx, y, T, D, ex.expert_offset, ex.n_experts,
        0 if part is None else part.shape[0], TOPK=idx.shape[1], FROM_SLOTS=from_slots, BLOCK=block,
        **pdl_args(y.device))
    return y


@dataclass(frozen=True)
class MoeOutput:
    """The parts of a MoE's output, for a site to sum itself (``mhc.hc_post_pre_norm``'s ``moe``, :func:`routed_moe_slots`): the routed
    slot outputs ``slots [M, k, D]`` (fp32, act-rounded; slots of experts outside ``[expert_offset,
    expert_offset + n_local)`` are not read), the expert ids ``idx [M, k]`` and the shared experts' outputs
    ``shared [S, M, D]`` (act) — ``moe_output(moe_combine(slots), shared)``, computed in the site's prologue."""

    slots: torch.Tensor
    idx: torch.Tensor
    shared: torch.Tensor
    expert_offset: int = 0
    n_local: int = 1 << 30

    def check(self, M: int, D: int, act: torch.dtype) -> None:
        k = self.idx.shape[-1]
        if (self.slots.shape != (M, k, D) or self.slots.dtype != torch.float32 or self.idx.shape != (M, k)
                or self.shared.shape[1:] != (M, D) or self.shared.dtype != act):
            raise ValueError(f"mHC site: MoE parts slots {self.slots.dtype} {list(self.slots.shape)}, idx "
                             f"{list(self.idx.shape)}, shared {self.shared.dtype} {list(self.shared.shape)} do not "
                             f"fit {M} rows of width {D} in {act}")


def moe_output(routed: torch.Tensor, shared: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
    """The MoE's output in one launch: ``routed [T, D]`` fp32 plus ``shared [S, T, D]`` (each shared expert's
    output in act), summed in fp32 in expert order and rounded to ``act_dtype`` — what the three torch kernels of
    ``y + s.float()`` then ``.to(act)`` compute, bit for bit (:meth:`ReferenceOps.moe_output`)."""
    assert routed.dtype == torch.float32 and shared.dtype == act_dtype and shared.shape[1:] == routed.shape, \
        f"moe_output: routed {routed.dtype} {list(routed.shape)}, shared {shared.dtype} {list(shared.shape)}"
    y, s = routed.contiguous(), shared.contiguous()
    out = torch.empty(routed.shape, dtype=act_dtype, device=routed.device)
    n = y.numel()
    if n:
        block = min(1024, triton.next_power_of_2(n))
        _moe_output_kernel[(triton.cdiv(n, block),)](y, s, out, n, s.shape[0],
                                                     ROUND_BF16=act_dtype == torch.bfloat16, BLOCK=block,
                                                     **pdl_args(y.device))
    return out


def routed_moe_decode(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, ex: ExpertTensors, limit: float,
                      route: str = "dot", geometry: MoeGeometry | None = None, act_quant: bool = True,
                      act_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The whole routed MoE of a decode step: ``Σ_slots w2(act(w1·x, w3·x)·weight)`` → ``[T, D]`` fp32."""
    geo = geometry or default_geometry(route)
    if geo.prequant and act_quant and act_dtype == torch.bfloat16 and route != lut_decode.ROUTE:
        if route == "int8":
            raise ValueError("MoeGeometry.prequant applies to the FP8-activation routes, not to 'int8'")
        h = moe_gate_up(act_qdq(x), idx, weights, ex, limit, route, geo, False, act_dtype)
        return moe_down(act_qdq(h), idx, ex, route, geo, False, act_dtype)
    h = moe_gate_up(x, idx, weights, ex, limit, route, geo, act_quant, act_dtype)
    return moe_down(h, idx, ex, route, geo, act_quant, act_dtype)


def routed_moe_slots(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, ex: ExpertTensors, limit: float,
                     route: str = "dot", geometry: MoeGeometry | None = None, act_quant: bool = True,
                     act_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """:func:`routed_moe_decode` up to the slot outputs: ``[T, k, D]`` fp32 (act-rounded; slots of experts not in the
    bank unwritten), the combine left to the consumer (the mHC site after the MoE: :class:`MoeOutput`) — one launch
    fewer. The expert-major down projection only (``slot_split=0``)."""
    geo = geometry or default_geometry(route)
    if geo.prequant and act_quant and act_dtype == torch.bfloat16 and route != lut_decode.ROUTE:
        if route == "int8":
            raise ValueError("MoeGeometry.prequant applies to the FP8-activation routes, not to 'int8'")
        h = moe_gate_up(act_qdq(x), idx, weights, ex, limit, route, geo, False, act_dtype)
        return moe_down(act_qdq(h), idx, ex, route, geo, False, act_dtype, combine=False)
    h = moe_gate_up(x, idx, weights, ex, limit, route, geo, act_quant, act_dtype)
    return moe_down(h, idx, ex, route, geo, act_quant, act_dtype, combine=False)


__all__ = ["ROUTES", "DECODES", "SAME_SEMANTICS", "ACCUMULATION", "bound_args", "MoeGeometry", "FMA_SUMS", "act_qdq",
           "ExpertTensors",
           "moe_gate_up", "moe_down", "moe_output", "MoeOutput", "routed_moe_decode", "routed_moe_slots",
           # the oracles, from fp4_moe_decode_reference
           "StageOracle", "reference_int8_route", "reference_int8_moe", "reference_stage1", "reference_stage2"]
