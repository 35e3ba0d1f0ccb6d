"""Roofline bounds, penalty terms and step-time attribution; the account of the paper's MI250 numbers.

For one op of a :class:`~dsv4lab.perf.costmodel.StepCost` on one catalogue entry the time is built up in named
terms, each the extra time over the previous one (so they add up to the op's time):

* ``memory``  — bytes the busiest rank moves / bandwidth;
* ``compute`` — extra when FLOPs at the full matrix (or vector) rate take longer than the bytes;
* ``low_m``   — extra when only ``m`` of the matrix engine's ``min_tile_m`` rows carry data (batch-1 decode
  fills 1 of 16 MFMA rows on CDNA2), unless a per-lane dot instruction is faster;
* ``format``  — extra for unpacking/converting weights the hardware cannot multiply natively (FP4 on CDNA2 or
  Hopper, FP8 on CDNA2), at the vector-lane rate; counts per value are the assumed instruction sequences in
  :data:`CONVERT_OPS_PER_VALUE`;
* ``overhead`` — a fixed cost per kernel launch (catalogue ``launch.kernel_overhead_us``);
* ``latency`` — for decode kernels that are a chain of dependent steps (``Op.latency_bound``), the extra needed
  to reach the measured floor of such a kernel (catalogue ``launch.latency_kernel_us``).

Collectives cost their small-message latency (catalogue ``collectives.allreduce_small_us``) plus payload over the
slowest link. The *bound* of a step is the sum over ops of max(memory, compute) at peak rates — no penalties,
no launches, no collectives.

:func:`paper_account` rebuilds the paper's final TP4 decode step from the component times the paper reports
(data/paper/microbenchmarks.yaml) plus this model for everything the paper did not time;
:func:`predict_account` does the same from the model alone (H200: what our kernels should reach);
:func:`compare_kernel_results` sets predictions beside a ``data/results/h200/decode_kernels.json`` file.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import ConfigError, ModelArgs, get_preset
from ..errors import PerfError
from .costmodel import Op, StepCost, decode_step, prefill
from ..paths import PAPER_DIR, display_path, read_json, read_yaml
from .hardware import Hardware, HardwareError, Quantity, load_hardware

# Instructions per weight value to turn a stored format into one the hardware multiplies (assumed sequences):
#   fp4 -> int8 / fp8: a byte-permute lookup (v_perm_b32 / prmt) maps 4 nibbles to 4 bytes, after one shift/mask
#                      per 8 nibbles: ~0.5 per value (the paper's E2M1 -> value x 2 in int8 route);
#   fp4 -> 16-bit, fp8 -> 16-bit (no FP8 conversion instructions on CDNA2): ~1 per value (lookup or bit-splice
#                      of two values per 32-bit register, plus the scale);
#   bf16 -> fp32: a shift, half a register op per value.
CONVERT_OPS_PER_VALUE = {
    ("fp4", "int8"): 0.5, ("fp4", "fp8"): 0.5, ("fp4", "bf16"): 1.0, ("fp4", "fp16"): 1.0, ("fp4", "fp32"): 1.0,
    ("fp8", "bf16"): 1.0, ("fp8", "fp16"): 1.0, ("fp8", "fp32"): 1.0, ("bf16", "fp32"): 0.5,
}
# A GEMM converts each weight value once per block of this many activation rows (prefill tiles).
CONVERT_REUSE_ROWS = 128

TERMS = ("memory", "compute", "low_m", "format", "overhead", "latency")


# ============================================================================================ paper data
def load_paper(name: str) -> dict[str, Any]:
    """One transcription file of ``data/paper/`` (``headline``, ``decode_milestones``, ``prefill_milestones``,
    ``microbenchmarks``, ``rejected_directions``), checked to carry its ``source``."""
    path = PAPER_DIR / f"{name}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in PAPER_DIR.glob("*.yaml")))
        raise PerfError(f"{path}: no such paper data file (have: {known})")
    data = read_yaml(path, PerfError)
    if not isinstance(data, dict) or not str(data.get("source", "")).strip():
        raise PerfError(f"{path}: every paper data file needs a top-level 'source:'")
    return data


def _micro(entry: str, field_name: str) -> float:
    data = load_paper("microbenchmarks")
    try:
        return float(data["entries"][entry][field_name])
    except (KeyError, TypeError, ValueError):
        raise PerfError(f"{PAPER_DIR / 'microbenchmarks.yaml'}: entries.{entry}.{field_name} is missing") from None


def _milestones() -> list[dict[str, Any]]:
    return list(load_paper("decode_milestones")["milestones"])


# ============================================================================================ hardware overrides
def with_values(hw: Hardware, values: dict[str, float | None]) -> Hardware:
    """A copy of ``hw`` with some catalogue values replaced (sensitivity ranges, what-if questions)."""
    q = dict(hw.quantities)
    for key, value in values.items():
        old = q.get(key)
        rng = old.range if old else None
        if rng and value is not None:  # keep the documented range, widened to hold the new value
            rng = (min(rng[0], value), max(rng[1], value))
        q[key] = Quantity(value, "override", "set by the caller", note=(old.note if old else ""), range=rng)
    return dataclasses.replace(hw, quantities=q)


# ============================================================================================ op timing
@dataclass(frozen=True)
class Route:
    """How a matmul runs on a hardware: the multiply dtype, and the conversion cost per weight value."""

    compute: str
    convert_ops: float
    description: str


def matmul_route(weight_format: str | None, hw: Hardware) -> Route:
    """The cheapest native path for weights stored in ``weight_format`` on ``hw``."""
    fmt = weight_format or "f32"
    if fmt == "fp4":
        for dtype, why in (("fp4", "native FP4"), ("fp8", "FP4 unpacked to FP8 in registers"),
                           ("int8", "FP4 nibbles looked up as int8 (value x 2), integer dot (the paper's route)"),
                           ("bf16", "FP4 unpacked to BF16 in registers")):
            if hw.has_matrix(dtype):
                return Route(dtype, CONVERT_OPS_PER_VALUE.get(("fp4", dtype), 0.0), why)
    elif fmt == "fp8":
        if hw.has_matrix("fp8"):
            return Route("fp8", 0.0, "native FP8")
        for dtype in ("bf16", "fp16"):
            if hw.has_matrix(dtype):
                return Route(dtype, CONVERT_OPS_PER_VALUE[("fp8", dtype)], f"FP8 converted to {dtype.upper()}")
    elif fmt == "bf16":
        if hw.has_matrix("bf16"):
            return Route("bf16", 0.0, "native BF16")
    elif fmt in ("f32", "i64"):
        return Route("fp32", 0.0, "FP32")
    return Route("fp32", CONVERT_OPS_PER_VALUE.get((fmt, "fp32"), 1.0), f"{fmt} converted to FP32")


def _rate(hw: Hardware, dtype: str, measured: bool) -> float:
    """Peak rate for ``dtype`` (FLOP/s): its matrix engine; for fp32 also TF32 tensor cores or the vector units."""
    candidates = [hw.matrix_tflops(dtype, measured)]
    if dtype == "fp32":
        candidates += [hw.matrix_tflops("tf32", measured), hw.vector_tflops("fp32")]
    for r in candidates:
        if r:
            return r * 1e12
    raise HardwareError(f"{hw.path}: no compute rate for {dtype} in the catalogue")


def _vector_rate(hw: Hardware) -> float | None:
    """FP32 vector FLOP/s, or None when the catalogue does not know it (vector ops then cost bytes only)."""
    v = hw.vector_tflops("fp32") or hw.matrix_tflops("fp32")
    return v * 1e12 if v else None


def _alt_rate(hw: Hardware, dtype: str) -> float:
    """Rate of the best per-lane path that wastes nothing at M = 1 (dot instructions, plain vector FMA)."""
    alt = {"int8": hw.dot_tops("v_dot4_i32_i8"), "fp16": hw.dot_tops("v_dot2_f32_f16"),
           "bf16": hw.dot_tops("v_dot2_f32_f16")}.get(dtype)
    return (alt or hw.vector_tflops("fp32") or 0.0) * 1e12


@dataclass
class OpTime:
    """Time of one op (µs, summed over its launches), split into the named terms."""

    name: str
    kind: str
    component: str
    launches: float
    bytes_rank: float
    flops_rank: float
    memory: float = 0.0
    compute: float = 0.0
    low_m: float = 0.0
    format: float = 0.0
    overhead: float = 0.0
    latency: float = 0.0
    bound_us: float = 0.0        # max(memory, compute) at peak rates: the op's roofline time
    route: str = ""

    @property
    def total_us(self) -> float:
        return self.memory + self.compute + self.low_m + self.format + self.overhead + self.latency

    @property
    def limiter(self) -> str:
        terms = {t: getattr(self, t) for t in TERMS}
        return max(terms, key=terms.get)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["total_us"] = self.total_us
        d["limiter"] = self.limiter
        d["intensity_flop_per_byte"] = self.flops_rank / self.bytes_rank if self.bytes_rank else 0.0
        return d


def time_op(op: Op, hw: Hardware, *, bandwidth: str = "achievable", measured_compute: bool = True,
            overheads: bool = True) -> OpTime:
    """Time of one compute op on ``hw`` with every penalty term (see the module doc)."""
    bw_peak = hw.bandwidth_gbps("peak") * 1e3           # bytes per µs
    bw = hw.bandwidth_gbps(bandwidth) * 1e3
    t = OpTime(op.name, op.kind, op.component, op.launches, op.bytes_rank, op.flops_rank)
    if op.kind == "matmul":
        route = matmul_route(op.weight_format, hw)
        peak_bound, peak = _rate(hw, route.compute, False), _rate(hw, route.compute, measured_compute)
        util = min(1.0, op.m / hw.min_tile_m)
        effective = max(peak * util, _alt_rate(hw, route.compute))
        per_value = route.convert_ops * max(1, math.ceil(op.m / CONVERT_REUSE_ROWS))
        lanes = _vector_rate(hw)
        convert = op.weight_values_rank * per_value / (lanes / 2) * 1e6 if per_value and lanes else 0.0
        t.route = f"{route.compute}: {route.description}"
    elif op.kind in ("attention", "indexer"):
        dtype = next((d for d in ("bf16", "fp16") if hw.has_matrix(d)), "fp32")
        peak_bound, peak = _rate(hw, dtype, False), _rate(hw, dtype, measured_compute)
        effective = max(peak * min(1.0, op.m / hw.min_tile_m), _alt_rate(hw, dtype))
        convert = 0.0
        t.route = f"{dtype} (heads as matrix rows)"
    else:
        peak_bound = peak = effective = _vector_rate(hw) or math.inf  # unknown rate: bytes only
        convert = 0.0
        t.route = "fp32 vector"
    full = op.flops_rank / peak * 1e6
    lowm = op.flops_rank / effective * 1e6 if effective else full
    t.memory = op.bytes_rank / bw
    b0 = max(t.memory, full)
    b1 = max(t.memory, lowm)
    b2 = max(t.memory, lowm + convert)
    t.compute, t.low_m, t.format = b0 - t.memory, b1 - b0, b2 - b1
    t.bound_us = max(op.bytes_rank / bw_peak, op.flops_rank / peak_bound * 1e6)
    if overheads:
        per_launch = hw.kernel_overhead_us or 0.0
        t.overhead = op.launches * per_launch
        floor = hw.get("launch.latency_kernel_us")
        if op.latency_bound and floor:
            t.latency = max(0.0, op.launches * floor - (b2 + t.overhead))
    return t


def time_collective(op: Op, hw: Hardware, *, method: str = "library", group: int = 2) -> OpTime:
    """Collective time: small-message latency (``method``: library / peer_read) + payload over the slowest link."""
    t = OpTime(op.name, op.kind, "collective", op.launches, op.other_bytes_rank, 0.0)
    latency = hw.allreduce_us(method)
    if latency is None:
        latency = hw.allreduce_us("library") or 0.0
    link = hw.get("links.cross_package_gbps") or hw.get("links.peer_gbps")
    wire = 0.0
    if link:
        wire = op.message_bytes * 2 * (group - 1) / group / (link * 1e3)
    t.latency = op.launches * latency
    t.memory = op.launches * wire
    t.route = method
    return t


@dataclass
class StepTime:
    """A costed step on one hardware: op times, collective times and their totals."""

    step: StepCost
    hardware: Hardware
    ops: list[OpTime]
    collectives: list[OpTime]
    assumptions: list[str] = field(default_factory=list)

    @property
    def step_us(self) -> float:
        return sum(o.total_us for o in self.ops) + sum(c.total_us for c in self.collectives)

    @property
    def bound_us(self) -> float:
        return sum(o.bound_us for o in self.ops)

    def terms_us(self) -> dict[str, float]:
        """The step split into penalty terms (they sum to :attr:`step_us`)."""
        out = {t: sum(getattr(o, t) for o in self.ops) for t in TERMS}
        out["collectives"] = sum(c.total_us for c in self.collectives)
        return out

    def op(self, name: str) -> OpTime:
        for o in self.ops + self.collectives:
            if o.name == name:
                return o
        raise KeyError(name)


def time_step(step: StepCost, hw: Hardware, *, bandwidth: str = "achievable", allreduce: str = "library",
              measured_compute: bool = True, overheads: bool = True) -> StepTime:
    """Cost every op and collective of ``step`` on ``hw``."""
    ops = [time_op(o, hw, bandwidth=bandwidth, measured_compute=measured_compute, overheads=overheads)
           for o in step.compute_ops]
    colls = [time_collective(c, hw, method=allreduce, group=step.tp) for c in step.collectives]
    notes = []
    if overheads and hw.kernel_overhead_us is None:
        notes.append(f"{hw.name}: no kernel overhead in the catalogue; launches are charged nothing")
    if overheads and hw.get("launch.latency_kernel_us") is None:
        notes.append(f"{hw.name}: no latency-bound kernel floor in the catalogue; such kernels get the plain overhead")
    if _vector_rate(hw) is None:
        notes.append(f"{hw.name}: no FP32 vector rate in the catalogue; vector ops cost their bytes only")
    if step.collectives and hw.allreduce_us(allreduce) is None:
        notes.append(f"{hw.name}: no {allreduce} all-reduce latency in the catalogue"
                     + ("; using the library figure" if hw.allreduce_us("library") else "; collectives cost 0"))
    return StepTime(step, hw, ops, colls, notes)


# ============================================================================================ roofline report
def roofline_report(args: ModelArgs, hw: Hardware, *, tp: int = 1, ep: int = 1, batch: int = 1,
                    context: int = 4096, phase: str = "decode", chunk: int | None = None, kv_format: str = "fp8",
                    sharding: str = "ideal", allreduce: str = "library") -> dict[str, Any]:
    """Bytes, FLOPs, the roofline bound and the penalty model for one step, as a JSON-ready dict.

    ``bytes_per_token`` is the §5.1 weight traffic per token of the whole model; ``bytes_per_token_per_rank``
    everything the busiest rank moves per token (its weight share, the KV cache it reads — all of it under MQA —
    and activations); ``bound_tok_s`` the per-op roofline at peak bandwidth and peak compute."""
    if phase == "decode":
        step = decode_step(args, tp=tp, ep=ep, batch=batch, context=context, kv_format=kv_format, sharding=sharding)
    elif phase == "prefill":
        step = prefill(args, tokens=context, tp=tp, ep=ep, batch=batch, chunk=chunk, kv_format=kv_format,
                       sharding=sharding)
    else:
        raise ConfigError(f"phase {phase!r}: expected 'decode' or 'prefill'")
    st = time_step(step, hw, allreduce=allreduce)
    tokens = step.tokens
    kv = sum(o.other_bytes_rank for o in step.compute_ops if o.kind in ("attention", "indexer"))
    bw_peak = hw.bandwidth_gbps("peak") * 1e9
    bytes_rank_tok = step.bytes_rank / tokens
    bound_tok_s = tokens / (st.bound_us / 1e6)
    predicted_tok_s = tokens / (st.step_us / 1e6)
    terms = st.terms_us()
    comps = {c: v / tokens for c, v in step.by_component("weight_bytes").items()}
    return dict(
        model=args.summary(), hardware=hw.name, hardware_title=hw.title, phase=phase, tp=tp, ep=ep, batch=batch,
        context=context, chunk=chunk, kv_format=kv_format, sharding=sharding, tokens_per_step=tokens,
        bytes_per_token=step.weight_bytes / tokens,
        components=comps,
        bytes_per_token_per_rank=bytes_rank_tok,
        weight_bytes_per_token_per_rank=step.weight_bytes_rank / tokens,
        kv_bytes_per_token_per_rank=kv / tokens,
        flops_per_token=step.total("flops") / tokens,
        flops_per_token_per_rank=step.flops_rank / tokens,
        bandwidth_gbps_peak=hw.bandwidth_gbps("peak"), bandwidth_gbps_achievable=hw.bandwidth_gbps("achievable"),
        bound_tok_s=bound_tok_s,
        bandwidth_bound_tok_s=tokens / (step.bytes_rank / bw_peak),
        bandwidth_bound_tok_s_achievable=tokens / (step.bytes_rank / (hw.bandwidth_gbps("achievable") * 1e9)),
        kernel_launches=step.launches, collectives=step.total("launches", step.collectives),
        predicted=dict(step_us=st.step_us, tok_s=predicted_tok_s, components_us=terms,
                       mbu_pct=100.0 * predicted_tok_s * bytes_rank_tok / bw_peak,
                       allreduce=allreduce, assumptions=st.assumptions),
        ops=[dict(o.to_dict(), weight_bytes_rank=op.weight_bytes_rank, weight_format=op.weight_format, m=op.m,
                  replicated=op.replicated, latency_bound=op.latency_bound, note=op.note)
             for o, op in zip(st.ops, step.compute_ops)],
        collective_ops=[dict(c.to_dict(), message_bytes=op.message_bytes, note=op.note)
                        for c, op in zip(st.collectives, step.collectives)],
    )


# ============================================================================================ accounts
# How an account groups ops into the components it reports (in the paper's language).
ACCOUNT_GROUPS = {
    "routed_moe": ("routed.w13", "routed.act", "routed.w2"),
    "attention": ("attn.core",),
}


def _account_components(st: StepTime, replaced: dict[str, float]) -> tuple[dict[str, float], list[dict]]:
    """Group op times into account components; ``replaced`` gives measured times for whole groups."""
    grouped = {op for ops in ACCOUNT_GROUPS.values() for op in ops}
    latency_bound = {op.name for op in st.step.compute_ops if op.latency_bound}
    comp = {"routed_moe": 0.0, "attention": 0.0, "latency_bound_kernels": 0.0, "weight_streaming": 0.0,
            "format_and_low_m": 0.0, "kernel_overhead": 0.0, "collectives": 0.0}
    detail = []
    for group, names in ACCOUNT_GROUPS.items():
        if group in replaced:
            comp[group] = replaced[group]
        else:
            comp[group] = sum(st.op(n).total_us for n in names if any(o.name == n for o in st.ops))
    for o in st.ops:
        if o.name in grouped:
            continue
        if o.name in latency_bound:
            comp["latency_bound_kernels"] += o.total_us
        else:
            comp["weight_streaming"] += o.memory + o.compute
            comp["format_and_low_m"] += o.format + o.low_m
            comp["kernel_overhead"] += o.overhead
        detail.append(dict(op=o.name, us=o.total_us, limiter=o.limiter, launches=o.launches))
    comp["collectives"] = sum(c.total_us for c in st.collectives)
    return comp, detail


def predict_account(hardware: str | Hardware = "h200-sxm", *, tp: int = 2, ep: int = 1, batch: int = 1,
                    context: int = 4096, sharding: str = "reference", allreduce: str = "library",
                    args: ModelArgs | None = None) -> dict[str, Any]:
    """A decode-step account from the model alone: what kernels on ``hardware`` should reach.

    The defaults describe this project's own target: two H200s, TP2 with DeepSeek's reference sharding (what
    ``dsv4lab.parallel`` loads), graph-captured library all-reduce at its measured latency."""
    hw = hardware if isinstance(hardware, Hardware) else load_hardware(hardware)
    args = args or get_preset("flash")
    step = decode_step(args, tp=tp, ep=ep, batch=batch, context=context, sharding=sharding)
    st = time_step(step, hw, allreduce=allreduce)
    comp, detail = _account_components(st, {})
    step_us = sum(comp.values())
    bytes_rank = step.bytes_rank / step.tokens
    tok_s = step.tokens / (step_us / 1e6)
    bound = roofline_report(args, hw, tp=tp, ep=ep, batch=batch, context=context, sharding=sharding)
    return dict(
        hardware=hw.name, tp=tp, ep=ep, batch=batch, context=context, sharding=sharding, allreduce=allreduce,
        predicted_tok_s=tok_s, step_us=step_us, components_us=comp,
        components_share={k: v / step_us for k, v in comp.items()},
        bytes_per_token_per_rank=bytes_rank, bound_tok_s=bound["bound_tok_s"],
        mbu_pct=100.0 * tok_s * bytes_rank / (hw.bandwidth_gbps("achievable") * 1e9),
        mbu_basis="measured copy bandwidth" if hw.get("memory.bw_achievable_gbps") else "peak bandwidth",
        kernel_launches=step.launches, collectives=step.total("launches", step.collectives),
        assumptions=st.assumptions, ops=detail,
        what_if={"no overhead on streaming kernels": step.tokens / ((step_us - comp["kernel_overhead"]) / 1e6),
                 "no overhead on streaming kernels, no collectives": step.tokens / (
                     (step_us - comp["kernel_overhead"] - comp["collectives"]) / 1e6)},
    )


def paper_account(*, context: int = 140, args: ModelArgs | None = None,
                  hardware: Hardware | None = None) -> dict[str, Any]:
    """The paper's final TP4 batch-1 decode step (74.5 tok/s, reported) rebuilt from components.

    Reported component times replace the model where the paper measured them (routed-MoE stage, attention
    kernel); every other op is costed by the model on the ``mi250-gcd`` catalogue entry with the paper
    system's weight layout (``sglang``), peer-read all-reduce latency, the per-kernel overhead derived from
    the paper's wo_a GEMV and the latency floor of its attention kernel. ``context`` defaults to the mean
    position of the paper's 256-token run after a short prompt."""
    hw = hardware or load_hardware("mi250-gcd")
    args = args or get_preset("flash")
    L = args.n_layers
    headline = load_paper("headline")
    reported_tok_s = float(headline["decode"]["tok_s"])
    routed_us = _micro("routed_moe_stage_decode", "us_per_layer")
    attn_us = _micro("attention_decode", "us_per_call")
    attn_lo, attn_hi = load_paper("microbenchmarks")["entries"]["attention_decode"]["us_per_call_range"]

    def account(hw_: Hardware, attention_us: float, bandwidth: str = "achievable", sharding: str = "sglang",
                latency_ops: set[str] | None = None) -> tuple[dict, StepTime]:
        step = decode_step(args, tp=4, ep=1, batch=1, context=context, sharding=sharding)
        if latency_ops is not None:  # structural what-if: which kernels are latency-bound
            for op in step.compute_ops:
                op.latency_bound = op.name in latency_ops
        st = time_step(step, hw_, bandwidth=bandwidth, allreduce="peer_read")
        comp, _ = _account_components(st, {"routed_moe": routed_us * L, "attention": attention_us * L})
        return comp, st

    comp, st = account(hw, attn_us)
    step_us = sum(comp.values())
    predicted = 1e6 / step_us

    # sensitivity: every input at the fast end, then at the slow end of its reported range
    def q(key: str) -> Quantity:
        return hw.quantity(key)

    fast_hw = with_values(hw, {"launch.kernel_overhead_us": q("launch.kernel_overhead_us").range[0],
                               "launch.latency_kernel_us": q("launch.latency_kernel_us").range[0],
                               "collectives.allreduce_small_us.peer_read":
                                   q("collectives.allreduce_small_us.peer_read").range[0],
                               "memory.bw_achievable_gbps": q("memory.bw_achievable_gbps").range[1]})
    slow_hw = with_values(hw, {"launch.kernel_overhead_us": q("launch.kernel_overhead_us").range[1],
                               "launch.latency_kernel_us": q("launch.latency_kernel_us").range[1],
                               "collectives.allreduce_small_us.peer_read":
                                   q("collectives.allreduce_small_us.peer_read").range[1],
                               "memory.bw_achievable_gbps": q("memory.bw_achievable_gbps").range[0]})
    fast = sum(account(fast_hw, attn_lo)[0].values())
    slow = sum(account(slow_hw, attn_hi)[0].values())
    # the structural choices, one at a time (tok/s): these move the prediction more than the input ranges
    structure = {
        "only the attention kernel latency-bound": 1e6 / sum(account(hw, attn_us, latency_ops={"attn.core"})[0]
                                                             .values()),
        "no per-kernel overhead": 1e6 / sum(account(with_values(hw, {"launch.kernel_overhead_us": 0.0}),
                                                    attn_us)[0].values()),
        "ideal weight layout instead of the paper's": 1e6 / sum(account(hw, attn_us, sharding="ideal")[0].values()),
        "library (RCCL) latency instead of peer-read": 1e6 / (step_us + st.step.total("launches", st.step.collectives)
                                                              * ((hw.allreduce_us("library") or 0)
                                                                 - (hw.allreduce_us("peer_read") or 0))),
    }

    # bandwidth: the roofline of the same TP4 step and what 74.5 tok/s uses of it
    ideal = roofline_report(args, hw, tp=4, context=context, sharding="ideal")
    paper_layout = roofline_report(args, hw, tp=4, context=context, sharding="sglang")
    bw_peak = hw.bandwidth_gbps("peak")
    util = reported_tok_s * ideal["bytes_per_token_per_rank"] / (bw_peak * 1e9)
    util_layout = reported_tok_s * paper_layout["bytes_per_token_per_rank"] / (bw_peak * 1e9)
    routed_floor = st.op("routed.w13").memory + st.op("routed.act").memory + st.op("routed.w2").memory

    inputs = [
        dict(name="routed-MoE stage", value=routed_us, unit="us/layer", source="reported by the paper",
             file="data/paper/microbenchmarks.yaml"),
        dict(name="attention decode kernel", value=attn_us, range=[attn_lo, attn_hi], unit="us/call",
             source="reported by the paper", file="data/paper/microbenchmarks.yaml"),
    ] + [dict(name=k, value=hw.get(k), range=list(hw.quantity(k).range or []), source=hw.quantity(k).source_text,
              file=display_path(hw.path))
         for k in ("launch.kernel_overhead_us", "launch.latency_kernel_us",
                   "collectives.allreduce_small_us.peer_read", "memory.bw_achievable_gbps", "memory.bw_peak_gbps")]

    return dict(
        what="the paper's final TP4/EP1 batch-1 decode step on MI250 rebuilt from reported component times",
        hardware=hw.name, tp=4, ep=1, batch=1, context=context, sharding="sglang", allreduce="peer_read",
        reported_tok_s=reported_tok_s, reported_step_us=1e6 / reported_tok_s,
        predicted_tok_s=predicted, step_us=step_us, error_pct=100.0 * (predicted / reported_tok_s - 1.0),
        components_us=comp, components_share={k: v / step_us for k, v in comp.items()},
        range_tok_s=dict(fast=1e6 / fast, slow=1e6 / slow),
        structural_what_if_tok_s=structure,
        kernel_launches=st.step.launches, collectives=st.step.total("launches", st.step.collectives),
        routed_moe=dict(reported_us_per_layer=routed_us,
                        bandwidth_floor_us_per_layer=routed_floor / L,
                        excess_us_per_layer=routed_us - routed_floor / L,
                        note="excess over the bytes at achievable bandwidth: FP4 format mismatch, low-M use, the "
                             "stage's own launches"),
        bandwidth=dict(
            bound_tok_s=ideal["bound_tok_s"], bound_tok_s_achievable=ideal["bandwidth_bound_tok_s_achievable"],
            bytes_per_token_per_rank=ideal["bytes_per_token_per_rank"], peak_gbps=bw_peak,
            utilization_pct=100.0 * util,
            paper_layout=dict(bytes_per_token_per_rank=paper_layout["bytes_per_token_per_rank"],
                              bound_tok_s=paper_layout["bound_tok_s"], utilization_pct=100.0 * util_layout),
            statement=(f"At {reported_tok_s} tok/s (reported) the busiest GCD moves "
                       f"{reported_tok_s * ideal['bytes_per_token_per_rank'] / 1e9:.0f} GB/s, "
                       f"{100 * util:.1f}% of its {bw_peak / 1e3:.1f} TB/s peak; the TP4 bandwidth roofline "
                       f"allows {ideal['bound_tok_s']:.0f} tok/s at peak, "
                       f"{ideal['bandwidth_bound_tok_s_achievable']:.0f} at the achievable "
                       f"{hw.bandwidth_gbps('achievable') / 1e3:.2f} TB/s."),
        ),
        milestones=milestone_account(comp, st, args),
        prefill=paper_prefill_account(args, hw),
        inputs=inputs, assumptions=st.assumptions + [
            "kernel inventory: one launch per op of the cost model (dsv4lab.perf.costmodel), which is leaner than "
            "the paper's SGLang path",
            f"context {context} tokens (mean position of a 256-token run after a short prompt)",
        ],
    )


def paper_prefill_account(args: ModelArgs, hw: Hardware) -> dict[str, Any]:
    """The paper's 4,604-token prefill against the model: FLOP rate achieved overall and in the MoE kernels."""
    headline = load_paper("headline")["prefill"]
    tokens, ttft = int(headline["prompt_tokens"]), float(headline["ttft_s"])
    micro = load_paper("microbenchmarks")["entries"]["routed_moe_prefill_m2048"]
    gate_up_ms, down_ms = float(micro["gate_up_ms"][1]), float(micro["down_ms"][1])
    chunk = 2048
    report = roofline_report(args, hw, tp=4, phase="prefill", context=tokens, chunk=chunk, sharding="sglang",
                             allreduce="peer_read")
    tp = 4
    flops_token = report["flops_per_token"]
    achieved = tokens * flops_token / ttft
    int8_peak = hw.matrix_tflops("int8") * 1e12
    moe = prefill(args, tokens=chunk, tp=tp, sharding="sglang")
    moe_flops_rank = (moe.op("routed.w13").flops_rank + moe.op("routed.w2").flops_rank) / args.n_layers
    moe_rate = moe_flops_rank / ((gate_up_ms + down_ms) / 1e3)
    return dict(
        reported_ttft_s=ttft, reported_input_tok_s=tokens / ttft, prompt_tokens=tokens, chunk=chunk,
        flops_per_token=flops_token, achieved_tflops_all_gcds=achieved / 1e12,
        mfma_utilization_pct=100.0 * achieved / (tp * (hw.matrix_tflops("bf16") or 0) * 1e12),
        bound_input_tok_s=report["bound_tok_s"], model_input_tok_s=report["predicted"]["tok_s"],
        moe_m2048=dict(reported_ms_per_layer=gate_up_ms + down_ms, tflops_per_gcd=moe_rate / 1e12,
                       pct_of_int8_mfma_peak=100.0 * moe_rate / int8_peak),
        note="the model's GEMMs run at peak matrix rates; the paper's M=2048 routed-MoE kernels reach the fraction "
             "of INT8 MFMA peak given here, which is most of the gap between the model and the reported TTFT",
    )


def milestone_account(final_components: dict[str, float], st: StepTime, args: ModelArgs) -> list[dict[str, Any]]:
    """The decode milestones walked back from the modelled final step.

    Each earlier milestone changes one component. Where the paper reports no isolated component time, the
    change is *implied* by the reported pair of milestones and labelled so; the EP4 step combines such implied
    costs with the model's own EP load imbalance. ``independent`` says whether a row is a prediction."""
    ms = {m["id"]: m for m in _milestones()}
    step = st.step
    n_coll = step.total("launches", step.collectives)
    L = args.n_layers

    def rs(mid: str) -> float:
        return 1e6 / float(ms[mid]["tok_s"])

    hw = st.hardware
    t_peer = hw.allreduce_us("peer_read") or 0.0
    t_lib = hw.allreduce_us("library") or 0.0
    rccl_gap = (rs("int8_dot_moe") - rs("peer_read_allreduce")) / n_coll            # µs per collective
    cktile_gap = (rs("ep1_no_alltoall") - rs("int8_dot_moe")) / L                   # µs per layer
    routed_us = _micro("routed_moe_stage_decode", "us_per_layer")
    from .costmodel import ep_load_imbalance
    imbalance = ep_load_imbalance(args.n_routed_experts, args.n_activated_experts, 1, 4)

    rows = []
    comps = dict(final_components)

    def row(mid: str, basis: str, independent: bool, **more) -> None:
        reported = float(ms[mid]["tok_s"])
        step_us = sum(comps.values())
        rows.append(dict(id=mid, label=ms[mid]["label"], reported_tok_s=reported, reported_step_us=1e6 / reported,
                         predicted_tok_s=1e6 / step_us, step_us=step_us, basis=basis, independent=independent,
                         components_us=dict(comps), **more))

    row("final", "model (reported components + cost model)", True)
    row("router_launch_geometry", "no component time reported for this change: not modelled", False)
    row("peer_read_allreduce", "no component time reported for the later changes: not modelled", False)
    extra_rccl = n_coll * rccl_gap
    comps["rccl_serialization"] = extra_rccl
    row("int8_dot_moe", "RCCL in place of peer-read; its per-collective cost is implied by this milestone pair",
        False, implied=dict(rccl_effective_us_per_collective=t_peer + rccl_gap, isolated_rccl_latency_us=t_lib,
                            isolated_latency_explains_pct=100.0 * n_coll * (t_lib - t_peer) / extra_rccl))
    comps["cktile_moe"] = L * cktile_gap
    row("ep1_no_alltoall", "CKTile routed stage in place of the INT8-dot stage; its time is implied by this "
        "milestone pair", False, implied=dict(cktile_stage_us_per_layer=routed_us + cktile_gap))
    # EP4: the busiest rank holds whole experts (model: expected max/mean group load) and the MoE combine becomes
    # dispatch + combine all-to-all at the RCCL-class effective collective cost
    stage_ck = routed_us + cktile_gap
    comps["ep4_imbalance_and_alltoall"] = L * stage_ck * (imbalance - 1.0) + L * (t_peer + rccl_gap)
    row("ep4_alltoall", "model: EP4 load imbalance of the routed stage + one more collective per layer, using the "
        "implied CKTile stage and RCCL-class collective costs", True, ep4_imbalance=imbalance)
    return rows


# ============================================================================================ kernel results
_KERNEL_OPS = {
    "moe_decode": ("routed.w13", "routed.act", "routed.w2"),
    "fp8_gemv_wq_b": ("attn.wq_b",),
    "fp8_gemv_wo_a": ("attn.wo_a",),
    "fp8_gemv_wo_b": ("attn.wo_b",),
    "fp8_gemv_wq_a": ("attn.wq_a",),
    "fp8_gemv_wkv": ("attn.wkv",),
    "attn_decode": ("attn.core",),
}
RESULT_FIELDS = ("gpu", "torch", "triton", "commit", "copy_bw_gbps", "rows")
ROW_FIELDS = ("kernel", "variant", "batch", "time_us", "bytes", "gbps", "pct_copy_bw")


def kernel_predictions(hw: Hardware, *, batch: int = 1, context: int = 4096,
                       args: ModelArgs | None = None) -> dict[str, dict[str, float]]:
    """Predicted time and bytes of one call of each benchmarked decode kernel (one GPU, full shapes)."""
    args = args or get_preset("flash")
    step = decode_step(args, tp=1, batch=batch, context=context)
    st = time_step(step, hw)
    out = {}
    for kernel, names in _KERNEL_OPS.items():
        ops = [st.op(n) for n in names]
        calls = ops[0].launches
        out[kernel] = dict(time_us=sum(o.total_us for o in ops) / calls, bytes=sum(o.bytes_rank for o in ops) / calls,
                           floor_us=sum(o.memory for o in ops) / calls)
    # one CSA layer: its share of every per-layer op (ops on a subset of layers counted per launch)
    layer_t = layer_b = layer_f = 0.0
    for o in st.ops:
        if o.launches >= 1 and o.name not in ("embed", "final.hc_head", "final.norm", "head", "sample"):
            layer_t += o.total_us / o.launches
            layer_b += o.bytes_rank / o.launches
            layer_f += o.memory / o.launches
    out["decode_layer"] = dict(time_us=layer_t, bytes=layer_b, floor_us=layer_f)
    return out


def compare_kernel_results(path: str | Path, hardware: str | Hardware = "h200-sxm", *,
                           context: int = 4096) -> dict[str, Any]:
    """Predicted vs measured per kernel for a ``decode_kernels.json`` results file.

    The file needs top-level ``gpu, torch, triton, commit, copy_bw_gbps, rows``, each row ``kernel, variant,
    batch, time_us, bytes, gbps, pct_copy_bw`` (an optional ``context`` per row overrides ``context``).
    Predictions use the file's measured copy bandwidth as the bandwidth."""
    path = Path(path)
    data = read_json(path, PerfError)
    missing = [f for f in RESULT_FIELDS if f not in data]
    if missing:
        raise PerfError(f"{path}: missing top-level field(s) {missing}; expected {list(RESULT_FIELDS)}")
    hw = hardware if isinstance(hardware, Hardware) else load_hardware(hardware)
    copy_bw = float(data["copy_bw_gbps"])
    hw = with_values(hw, {"memory.bw_achievable_gbps": copy_bw})
    cache: dict[tuple[int, int], dict] = {}
    rows = []
    for i, r in enumerate(data["rows"]):
        lacking = [f for f in ROW_FIELDS if f not in r]
        if lacking:
            raise PerfError(f"{path}: rows[{i}] lacks {lacking}; expected {list(ROW_FIELDS)}")
        batch, ctx = int(r["batch"]), int(r.get("context", context))
        if (batch, ctx) not in cache:
            cache[(batch, ctx)] = kernel_predictions(hw, batch=batch, context=ctx)
        pred = cache[(batch, ctx)].get(r["kernel"])
        out = dict(kernel=r["kernel"], variant=r["variant"], batch=batch, measured_us=float(r["time_us"]),
                   measured_bytes=float(r["bytes"]), pct_copy_bw=float(r["pct_copy_bw"]),
                   floor_us_at_copy_bw=float(r["bytes"]) / (copy_bw * 1e3))
        if pred is None:
            out.update(predicted_us=None, note=f"no model for kernel {r['kernel']!r}")
        else:
            out.update(predicted_us=pred["time_us"], predicted_bytes=pred["bytes"],
                       bytes_ratio=float(r["bytes"]) / pred["bytes"] if pred["bytes"] else None,
                       measured_over_predicted=float(r["time_us"]) / pred["time_us"])
        rows.append(out)
    return dict(file=str(path), gpu=data["gpu"], torch=data["torch"], triton=data["triton"], commit=data["commit"],
                copy_bw_gbps=copy_bw, hardware=hw.name, rows=rows)


__all__ = ["CONVERT_OPS_PER_VALUE", "TERMS", "PerfError", "Route", "OpTime", "StepTime", "matmul_route", "time_op",
           "time_collective", "time_step", "roofline_report", "paper_account", "predict_account",
           "milestone_account", "kernel_predictions", "compare_kernel_results", "load_paper", "with_values"]
