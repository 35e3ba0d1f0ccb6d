"""Roofline bounds, penalty terms and step-time attribution: the timing model of one step on one machine.

For one op of a :class:`~dsv4lab.tools.perf.costmodel.StepCost` on one catalogue entry the time is built up in named
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

:func:`compare_kernel_results` sets predictions beside a ``data/results/h200/decode_kernels.json`` file. The
account of the paper's numbers built on this model is :mod:`dsv4lab.tools.perf.account`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4lab.core.config import ConfigError, ModelArgs, get_preset
from dsv4lab.core.errors import PerfError
from dsv4lab.core.paths import read_json
from dsv4lab.tools.perf.costmodel import Op, StepCost, decode_step, prefill
from dsv4lab.tools.perf.hardware import Hardware, HardwareError, Quantity, load_hardware

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
    """Predicted time, bytes and FLOPs of one call of each benchmarked decode kernel (one GPU, full shapes)."""
    args = args or get_preset("flash")
    step = decode_step(args, tp=1, batch=batch, context=context)
    st = time_step(step, hw)
    out = {}
    for kernel, names in _KERNEL_OPS.items():
        ops = [st.op(n) for n in names]
        calls = ops[0].launches
        out[kernel] = dict(time_us=sum(o.total_us for o in ops) / calls, bytes=sum(o.bytes_rank for o in ops) / calls,
                           floor_us=sum(o.memory for o in ops) / calls, flops=sum(o.flops_rank for o in ops) / calls)
    # one CSA layer: its share of every per-layer op (ops on a subset of layers counted per launch)
    layer_t = layer_b = layer_f = layer_flops = 0.0
    for o in st.ops:
        if o.launches >= 1 and o.name not in ("embed", "final.hc_head", "final.norm", "head", "sample"):
            layer_t += o.total_us / o.launches
            layer_b += o.bytes_rank / o.launches
            layer_f += o.memory / o.launches
            layer_flops += o.flops_rank / o.launches
    out["decode_layer"] = dict(time_us=layer_t, bytes=layer_b, floor_us=layer_f, flops=layer_flops)
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
           "time_collective", "time_step", "roofline_report", "kernel_predictions", "compare_kernel_results",
           "with_values"]
