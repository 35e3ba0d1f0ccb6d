"""``dsv4lab bench kernels --suite decode`` — the decode kernels at DeepSeek-V4-Flash shapes, batch 1/2/4/8, on
one GPU, against cuBLAS and torch baselines measured in the same run; writes the results and the measured
dispatch the Triton backend reads (:mod:`dsv4lab.engine.decode_dispatch`).

One command, in this order (a watchdog stops at ``--budget-s`` and writes what was measured):

1. **Ceilings**: device-to-device copy bandwidth (bytes read + written), bf16 and FP8 (``torch._scaled_mm``)
   8192³ matmuls. Every row reports GB/s and ``pct_copy_bw`` of the copy bandwidth measured here.
2. **Correctness** on this GPU at real widths, each within the analytic bound of its arithmetic
   (:mod:`dsv4lab.tools.verify.bounds`, ``γ(c·n)·Σ|terms| + 1 ulp`` with the route's ``c``): every routed-MoE route
   stage by stage (the INT8 route against its own arithmetic); every FP8 projection at 1 and 8 rows with each
   GEMV route and with cuBLAS (``torch._scaled_mm``, 1×128 activation and 128×128 weight block scales — which
   scale layouts this torch accepts is probed and recorded), plus an *accumulation probe* (per 128-block one
   product 2^15 times the others: lost by a reduced-precision accumulator, kept by fp32); the BF16 projections
   the same way with ``torch.mm(..., out_dtype=float32)``; (full run) the attention geometries and the static
   decode step on the tiny model, graph replay against eager. A variant that fails is not timed, and cuBLAS is
   dispatched only for shapes where it passed.
3. **Routed MoE** (``moe_decode``): 256 experts (3.4 GB, far beyond L2), top-6 uniform random routing drawn
   afresh for every call; routes ``dot`` / ``fma`` / ``int8`` / ``dot_scaled`` × launch geometries at batch 1,
   each route's best (and every ``dot`` geometry) at 2/4/8; baselines ``torch_sum_read`` (a plain read of the
   same bytes) and, in a full run, ``bf16_resident`` and ``torch_dequant_matmul``. Bytes = unique experts ×
   13,369,344.
4. **FP8 GEMV** (``fp8_gemv_<proj>``) for the projections as the decode step launches them — ``wq_a+wkv``,
   ``wq_b`` (HCA) and ``wq_b+idx_wq_b`` (CSA), wo_a (grouped, bf16 activation), wo_b, ``shared_w1+w3`` and
   shared_w2 (stacked sets: :mod:`dsv4lab.engine.decode_groups`); **BF16 GEMV** (``bf16_gemv_<proj>``, fp32
   output) for the LM head, the router gate, the compressors' stacked wkv/wgate (CSA, HCA) and the indexer
   weights: own code paths (:class:`GemvVariant`: route, tile, unroll, prequant) × geometries (K split to about
   two programs per SM) and ``cublas`` side by side, weights rotating among copies totalling ≥ 256 MB.
5. (full run) **Sparse attention decode** and **one real-dims CSA layer decode step** (graph-replayed, the static
   step on the Triton backend, with a per-kernel breakdown from the profiler).

Timing: every measured call is captured in a CUDA graph with its rotated inputs (decode runs graph-replayed, so
no Python launch cost is timed), replayed after a warm-up; CUDA events; the median replay divided by the calls.
``--quick`` (about 2 minutes, a first probe; most of it compiling kernels): the MoE routes' first variants and
five GEMV variants (:func:`gemv_variants`), batch 1 and 8.
``--smoke`` runs the same code at tiny shapes (the CPU interpreter included, plain timing). The harness is
shared with the prefill suite: :mod:`dsv4lab.tools.bench.common`.
"""
from __future__ import annotations

import statistics
import types
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from dsv4lab.core import quant
from dsv4lab.core.config import get_preset
from dsv4lab.engine.decode_dispatch import FORMAT, DecodeDispatch, shape_key
from dsv4lab.engine.decode_graph import DecodeGraphs, StaticDecodeStep
from dsv4lab.engine.loader import load
from dsv4lab.core.errors import UserError
from dsv4lab.core.model.block import Block
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.core.paths import DATA_DIR, read_json
from dsv4lab.tools.verify.bounds import BoundCheck, check_within_bound, gamma, ulp
from dsv4lab.tools.verify.model import fp32_reduction_ops, kl_per_position, kl_rule
from dsv4lab.tools.verify.registry import _make_attention
from dsv4lab.tools.bench.common import (BenchRun, kernel_families, materialize_random, measure_ceilings, output_path, pick_sections,
                     random_bank, random_fp8_linear, random_routing, run_header, select_device, write_json)

HELP = "decode kernels: routed FP4 MoE, FP8/BF16 GEMV vs cuBLAS, attention, one layer (writes JSON + dispatch)"

BATCHES = (1, 2, 4, 8)
QUICK_BATCHES = (1, 8)
EXPERT_BYTES = 13_369_344  # one real routed expert: 3 × 4 MiB FP4 + 3 × 256 KiB E8M0
ROTATE_BYTES = 256 << 20
QUICK_BUDGET_S = 140.0


SECTIONS = ("moe", "gemv", "mhc", "attention", "layer")
QUICK_SECTIONS = ("moe", "gemv", "mhc")


def add_suite_arguments(p) -> None:
    p.add_argument("--dispatch-out", default=None,
                   help="where the measured dispatch goes (default: decode_dispatch.json beside --out)")
    p.add_argument("--dispatch-base", default=None,
                   help="a dispatch file (same GPU) whose entries this run does not measure are kept in the one it "
                        "writes, each naming its commit — for a run its budget cuts short")


# ============================================================================================ rows and checks
class DecodeBench(BenchRun):
    """One decode run: rows per batch with GB/s and % of the copy bandwidth measured here."""

    suite = "decode"

    def __init__(self, device, budget_s: float, smoke: bool):
        super().__init__(device, budget_s, smoke)
        self.copy_bw = None
        self.cublas: dict = {}

    def record_ceilings(self) -> None:
        """Copy bandwidth and matmul peaks, graph-timed (the decode rows' ceilings); nothing without a GPU."""
        if not self.cuda:
            return
        ceilings = measure_ceilings(self, timing="graph")
        self.copy_bw = ceilings.pop("copy_gbps")
        self.peaks = ceilings

    def add(self, kernel: str, variant: str, batch: int, time_us: float, nbytes: float, **extra) -> dict:
        gbps = nbytes / (time_us * 1e-6) / 1e9 if time_us else None
        row = dict(kernel=kernel, variant=variant, batch=batch, time_us=round(time_us, 2), bytes=int(nbytes),
                   gbps=None if gbps is None else round(gbps, 1),
                   pct_copy_bw=None if (gbps is None or not self.copy_bw) else round(100 * gbps / self.copy_bw, 1),
                   **extra)
        self.rows.append(row)
        self.log(f"{kernel:<22} {variant:<34} b={batch} {time_us:9.2f} µs {row['gbps'] or 0:8.1f} GB/s "
                 f"{row['pct_copy_bw'] or 0:5.1f}%")
        return row

    def check_record(self, c, gating: bool) -> dict:
        return dict(name=c.name, ok=c.ok, max_abs=c.max_abs, rel_l2=c.rel_l2, cosine=c.cosine,
                    bitwise=c.bitwise_equal, line=c.line())

    def record_bound(self, res, **extra) -> bool:
        """Record one :class:`~dsv4lab.tools.verify.bounds.BoundCheck` (or a dict with ``name, ok, line``)."""
        d = res.to_dict() if hasattr(res, "to_dict") else dict(res)
        d["line"] = res.line() if hasattr(res, "line") else d.get("line", "")
        d.update(extra)
        self.checks.append(d)
        self.log(d["line"])
        return bool(d["ok"])


# ============================================================================================ variants
def moe_variants(smoke: bool, quick: bool) -> list[tuple[str, str, object]]:
    """``(route, name, MoeGeometry)``: every route's launch geometries (the first of each route is its quick one).
    Names: ``n<rows>k<K step>w<warps>s<stages>``, ``:token`` token-major down projection, ``:plain`` the
    portable E2M1 decode instead of the asm one, ``:prequant`` activations quantized once per step, ``:elem``
    the fma route's position-wise accumulators (``MoeGeometry.fma_sums``), ``:bytewise`` the fp16 decode with the
    scales after the group sums (``MoeGeometry.decode``)."""
    from dsv4lab_kernels import fp4_moe_decode as moe
    G = moe.MoeGeometry

    def geo(bn, bk, w, s, **kw):
        return G(block_n_up=bn, block_n_down=bn, block_k=bk, num_warps=w, num_stages=s, **kw)

    if smoke:
        return [(r, "n16k128w1s1", geo(16, 128, 1, 1)) for r in moe.ROUTES]
    full = [
        ("dot", "n32k256w2s3", geo(32, 256, 2, 3)), ("dot", "n16k256w1s2", geo(16, 256, 1, 2)),
        ("dot", "n64k256w4s2", geo(64, 256, 4, 2)), ("dot", "n16k512w1s2", geo(16, 512, 1, 2)),
        ("dot", "n32k512w2s2", geo(32, 512, 2, 2)), ("dot", "n32k256w2s3:token", geo(32, 256, 2, 3, slot_split=1)),
        ("dot", "n32k256w2s3:plain", geo(32, 256, 2, 3, decode="plain")),
        ("dot", "n64k256w4s2:prequant", geo(64, 256, 4, 2, prequant=True)),
        ("dot", "n32k256w2s3:prequant", geo(32, 256, 2, 3, prequant=True)),
        # fma's first (its quick variant) is the fastest the full suite measured (af2b4dc): at batch 1 the 16-row
        # one-warp programs fill each SM with only ~6 warps; more programs (8 rows), more warps per program, a
        # deeper pipeline or longer K steps trade bytes in flight against instructions per byte
        ("fma", "n8k256w1s2", geo(8, 256, 1, 2)), ("fma", "n16k256w1s2", geo(16, 256, 1, 2)),
        ("fma", "n32k256w2s2", geo(32, 256, 2, 2)), ("fma", "n16k256w2s2", geo(16, 256, 2, 2)),
        ("fma", "n16k256w1s3", geo(16, 256, 1, 3)), ("fma", "n16k512w1s2", geo(16, 512, 1, 2)),
        # continuing the direction the sweep pointed: 4 rows, a deeper pipeline, activations quantized once
        ("fma", "n4k256w1s2", geo(4, 256, 1, 2)), ("fma", "n8k256w1s3", geo(8, 256, 1, 3)),
        ("fma", "n8k256w1s2:prequant", geo(8, 256, 1, 2, prequant=True)),
        # the route is issue-bound at batch 1 (scripts/kernel_sass.py: ~19 instructions per weight byte for ≲ 8
        # at the copy bandwidth); position-wise accumulators drop the per-group sum tree from the loop
        ("fma", "n8k256w1s2:elem", geo(8, 256, 1, 2, fma_sums="element")),
        ("fma", "n8k256w1s2:elem:prequant", geo(8, 256, 1, 2, fma_sums="element", prequant=True)),
        ("fma", "n16k256w1s2:elem", geo(16, 256, 1, 2, fma_sums="element")),
        # the fp16 codes four per 32-bit operation, each group's scale after its sum: ~12 / 15 instructions per
        # weight byte for gate/up / down with prequant against ~16 / 19 (scripts/kernel_sass.py, Triton 3.6)
        ("fma", "n8k256w1s2:bytewise:prequant", geo(8, 256, 1, 2, decode="bytewise", prequant=True)),
        ("fma", "n8k256w1s2:bytewise", geo(8, 256, 1, 2, decode="bytewise")),
        ("fma", "n16k256w1s2:bytewise:prequant", geo(16, 256, 1, 2, decode="bytewise", prequant=True)),
        ("int8", "n16k256w1s2", geo(16, 256, 1, 2)), ("int8", "n32k256w2s2", geo(32, 256, 2, 2)),
        ("dot_scaled", "n16k256w1s2", geo(16, 256, 1, 2)), ("dot_scaled", "n32k256w2s3", geo(32, 256, 2, 3)),
    ]
    if quick:  # each route's first, and the batch-1 dispatch's candidate not yet timed on the GPU
        seen, out = set(), []
        for v in full:
            if v[0] not in seen or v[1] in QUICK_EXTRA:
                seen.add(v[0])
                out.append(v)
        return out
    return full


QUICK_EXTRA = ("n8k256w1s2:bytewise:prequant",)


@dataclass(frozen=True)
class GemvVariant:
    """One own-GEMV configuration timed on every projection (K split to ~2 programs per SM at each shape)."""

    route: str
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 3
    unroll: int = 1
    prequant: bool = False

    @property
    def structure(self) -> str:
        """What the bound check covers: the code path (geometries of one path differ only in fp32 order)."""
        return self.route + (f"-u{self.unroll}" if self.unroll > 1 else "") + ("-pq" if self.prequant else "")

    def name(self, bn: int, split: int) -> str:
        return (f"{self.route}:n{bn}k{self.block_k}s{split}w{self.num_warps}p{self.num_stages}"
                + (f"u{self.unroll}" if self.unroll > 1 else "") + (":pq" if self.prequant else ""))

    def applies(self, batch: int, aq: bool) -> bool:
        """``prequant`` only quantizes rows once where there are several rows to quantize."""
        return not self.prequant or (aq and batch > 1)


def gemv_variants(smoke: bool, quick: bool) -> list[GemvVariant]:
    """The own GEMV's configurations: the ``fma`` route's tile shapes and unrolls (batch 1: bytes in flight per SM
    is what they trade), the ``dot`` route plain and with the rows quantized once (``prequant``, batch > 1)."""
    V = GemvVariant
    if smoke:
        return [V("dot", 16, 128, 1, 1), V("fma", 32, 128, 4, 1), V("fma", 16, 128, 4, 1, unroll=2),
                V("dot", 16, 128, 1, 1, prequant=True)]
    quick_set = [V("fma", 32, 256, 4), V("fma", 16, 256, 4, unroll=2), V("fma", 64, 256, 8),
                 V("dot", 16, 256, 1), V("dot", 64, 256, 4, prequant=True)]
    if quick:  # five: the quick run (≤ 140 s with the MoE) times each on 12 projections at batches 1 and 8
        return quick_set
    return quick_set + [V("fma", 32, 512, 4), V("fma", 32, 256, 4, unroll=2), V("fma", 16, 512, 4),
                        V("fma", 64, 256, 4, unroll=2),
                        V("dot", 32, 256, 2), V("dot", 64, 256, 4, 4), V("dot", 32, 256, 2, prequant=True)]


def projections(a) -> dict[str, tuple[int, int, int, bool]]:
    """name → (N, K per group, groups, act_quant) of the decode step's FP8 projections, as it launches them: the
    sets of one input stacked (:mod:`dsv4lab.engine.decode_groups`; ``wq_b`` alone in HCA layers)."""
    G = a.o_groups
    idx_q = a.index_n_heads * a.index_head_dim
    return {"wq_a+wkv": (a.q_lora_rank + a.head_dim, a.dim, 1, True),
            "wq_b": (a.n_heads * a.head_dim, a.q_lora_rank, 1, True),
            "wq_b+idx_wq_b": (a.n_heads * a.head_dim + idx_q, a.q_lora_rank, 1, True),
            "wo_a": (G * a.o_lora_rank, a.wo_a_in_per_group, G, False),
            "wo_b": (a.dim, G * a.o_lora_rank, 1, True),
            "shared_w1+w3": (2 * a.moe_inter_dim, a.dim, 1, True),
            "shared_w2": (a.dim, a.moe_inter_dim, 1, True)}


def bf16_projections(a) -> dict[str, tuple[int, int]]:
    """name → (N, K) of the decode step's BF16 weights projected to fp32: the router, every compressor's
    ``wkv``/``wgate`` of a CSA layer (main ratio 4 and the indexer's, stacked) and of an HCA layer, the indexer's
    head weights (a bf16 output, the same GEMV) and the LM head (first: the largest, measured before any budget
    cut)."""
    csa = 2 * (2 * a.head_dim) + 2 * (2 * a.index_head_dim)  # ratio 4 overlaps: 2× the channels, kv and score
    hca = 2 * a.head_dim
    return {"head": (a.vocab_size, a.dim), "router": (a.n_routed_experts, a.dim), "compressors_csa": (csa, a.dim),
            "compressors_hca": (hca, a.dim), "idx_weights": (a.index_n_heads, a.dim)}


def split_for(n: int, k: int, bn: int, bk: int, programs: int) -> int:
    """K splits that bring an ``[n, k]`` projection's grid to about ``programs`` programs."""
    row_blocks = -(-n // bn)
    return max(1, min(-(-programs // row_blocks), -(-k // bk)))


# ============================================================================================ bound checks
def gemv_bound(out, x, weight, scale, route: str, act_quant: bool = True, groups: int = 1, out_dtype=None,
               name: str = ""):
    """``out`` of a projection (own kernel route ``"fma"``/``"dot"``, or ``"cublas"``) against the exact
    reference within ``γ(c·K)·Σ|xq·w| + 1 ulp(out dtype)``, K per group, fp32 accumulation, the route's ``c`` —
    except cuBLAS's FP8 GEMM, held to the blocked ``fp8_mma`` model (``γ_128`` of a ~14-bit accumulator inside
    each 128-wide K block, the blocks in fp32: :data:`~dsv4lab.tools.verify.bounds.BLOCKED`)."""
    from dsv4lab_kernels import fp8_gemv as gemv
    out_dtype = out_dtype or out.dtype
    x = x.to(weight.device)  # the exact reference where the weight lives (fp64 on the GPU: the head is 0.5 G terms)
    ref = gemv.reference_fp8_gemv(x, weight, scale, act_quant, torch.float64, groups)
    mag = gemv.reference_magnitude(x, weight, scale, act_quant, groups)
    K = weight.shape[1]
    if route == "cublas" and scale is not None:
        return check_within_bound(out.cpu(), ref.to(torch.float32).to(out_dtype), mag, terms=K,
                                  acc_dtype=gemv.CUBLAS_FP8_ACC, out_dtype=out_dtype, name=name or "gemv[cublas fp8]")
    c = gemv.ACCUMULATION[route][1]
    return check_within_bound(out.cpu(), ref.to(torch.float32).to(out_dtype), mag, terms=K, c=c * K,
                              acc_dtype=torch.float32, out_dtype=out_dtype, name=name or f"gemv[{route}]")


def accumulation_probe(n: int, k: int, rows: int, device, bf16_weight: bool = False):
    """Inputs that separate an fp32 accumulator from a narrower one: ``x`` all ones; in every 128-block of each
    weight row one product of ±64 (the sign alternating by block, so they cancel) and 127 of 2^-9 — 2^15 times
    smaller, lost by an accumulator of ≤ 14 significant bits and kept by fp32. Exact result ``(K/128)·127·2^-9``."""
    w = torch.full((n, k), 2.0 ** -9, device=device)
    blk = torch.arange(0, k, 128, device=device)
    pos = blk[None, :] + (torch.arange(n, device=device) % 128)[:, None]  # the big term moves across lanes
    sign = torch.where((torch.arange(len(blk), device=device) % 2) == 0, 64.0, -64.0)
    w.scatter_(1, pos.clamp(max=k - 1), sign.expand(n, -1).contiguous())
    x = torch.ones(rows, k, device=device, dtype=torch.bfloat16)
    if bf16_weight:
        return x, w.to(torch.bfloat16), None
    scale = torch.full((-(-n // 128), -(-k // 128)), 127, dtype=torch.uint8, device=device)
    return x, w.to(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu)


def moe_stage_checks(x, idx, w, ex, route: str, geo, limit: float, act_quant: bool = True,
                     name: str = "") -> list:
    """Every stage of a routed-MoE route within its bound, in isolation: gate/up (``g``, ``u``) against their
    exact oracles, the fused SwiGLU·weight against the reference's activation of the kernel's own ``(g, u)``
    (one bf16 ulp: a different fp64 silu formula may round one fp32 ulp apart), the down projection against the
    oracle of the kernel's own ``h``, and the combined output against the sum of the slot oracles within the
    sum of the slots' bounds (plus one fp32 ulp). Returns :class:`~dsv4lab.tools.verify.bounds.BoundCheck` results
    (the last two as equivalent records)."""
    from dsv4lab_kernels import fp4_moe_decode as moe
    name = name or route
    c = moe.ACCUMULATION[route][1]

    def stage(out, oracle, what):
        return check_within_bound(out, oracle.ref, oracle.magnitude.nan_to_num(0.0), terms=oracle.terms,
                                  c=c * oracle.terms, acc_dtype=torch.float32, out_dtype=torch.bfloat16,
                                  name=f"{name} {what}")

    def record(what, ok, ratio, numel, line):
        return BoundCheck(name=f"{name} {what}", ok=ok, numel=numel, n_violations=0 if ok else 1, nan_mismatch=0,
                          max_ratio=ratio, bitwise_equal=False, rule=line)

    out = []
    g, u = moe.moe_gate_up(x, idx, None, ex, limit, route, geo, act_quant, write_gu=True)
    og, ou = moe.reference_stage1(x, idx, ex, route, act_quant)
    out += [stage(g, og, "stage1 g"), stage(u, ou, "stage1 u")]
    h = moe.moe_gate_up(x, idx, w, ex, limit, route, geo, act_quant)
    want = ReferenceOps(Numerics()).moe_activation(g, u, w, limit)
    owned = torch.isfinite(g[..., 0])
    d = (h[owned].double() - want[owned].to(torch.bfloat16).double()).abs()
    lim = ulp(want[owned], torch.bfloat16)
    ratio = float((d / lim).max()) if d.numel() else 0.0
    out.append(record("activation", ratio <= 1, ratio, d.numel(), "≤ 1 bf16 ulp of the reference's activation"))
    o2 = moe.reference_stage2(h, idx, ex, route, act_quant)
    out.append(stage(moe.moe_down(h, idx, ex, route, geo, act_quant, per_slot=True), o2, "stage2"))
    y = moe.routed_moe_decode(x, idx, w, ex, limit, route, geo, act_quant)
    slot = gamma(int(c * o2.terms), torch.float32) * o2.magnitude + ulp(o2.ref, torch.bfloat16)
    ref = o2.ref.nan_to_num(0.0).sum(1)
    bound = slot.nan_to_num(0.0).sum(1) + ulp(ref, torch.float32)
    err = (y.double() - ref).abs()
    ratio = float((err / bound).max())
    ok = bool(torch.isfinite(y).all()) and ratio <= 1
    out.append(record("combined", ok, ratio, y.numel(), "Σ slot bounds + 1 ulp fp32"))
    return out


# ============================================================================================ checks in the run
def moe_structure(route: str, geo) -> tuple:
    """The code path a routed-MoE variant runs: geometries with the same path differ only in the order of fp32
    sums, so one check covers them all."""
    return route, geo.slot_split > 0, geo.decode, geo.prequant, geo.fma_sums


def check_moe(b: DecodeBench, a, gen, variants) -> set[str]:
    """Each route's structures (expert-major, token-major, portable decode, prequant) at real widths (8 experts), one
    token and eight tokens sharing experts, stage by stage within bound. Geometries of one structure
    (:func:`moe_structure`) differ only in the order of fp32 sums, which the bound does not depend on: a variant
    is timed if its structure passed."""
    from dsv4lab_kernels import fp4_moe_decode as moe
    dev = b.device
    E = 8
    bank = random_bank(E, a.dim, a.moe_inter_dim, dev, gen)
    ex = moe.ExpertTensors.of(bank)
    structures = {}
    for route, name, geo in variants:
        structures.setdefault(moe_structure(route, geo), (name, geo))
    passed_structures = set()
    for T in (1, 8):  # one token, and eight sharing the eight experts (the batches timed: no extra compiles)
        idx, w = random_routing(T, E, a.n_activated_experts, dev, gen)
        x = (torch.randn(T, a.dim, device=dev, generator=gen) * 2).to(torch.bfloat16)
        for key, (name, geo) in structures.items():
            label = f"moe:{key[0]}:{name}:T{T}"
            res = b.guard(label, lambda: moe_stage_checks(x, idx, w, ex, key[0], geo, a.swiglu_limit, name=label))
            ok = bool(res) and all(b.record_bound(r) for r in res)
            if ok and (T == 1 or key in passed_structures):
                passed_structures.add(key)
            elif not ok:
                passed_structures.discard(key)
    del bank
    return {name for route, name, geo in variants if moe_structure(route, geo) in passed_structures}


def check_gemv(b: DecodeBench, a, gen, variants) -> dict[str, bool]:
    """Every FP8 and BF16 projection at 1 and 8 rows with each own code path (route × unroll × prequant: its
    first geometry; others of the path differ only in the order of fp32 sums) and with cuBLAS, plus the
    accumulation probe, within the bound of its arithmetic (own routes: fp32, ``γ(c·K)``; cuBLAS bf16: ``γ(4K)``;
    cuBLAS FP8: ``fp8_mma``). Returns ``{"<proj>:<structure>": passed}``; also records which block-scale layout
    ``torch._scaled_mm`` accepted (``b.cublas``)."""
    from dsv4lab_kernels import fp8_gemv as gemv
    dev = b.device
    ok: dict[str, bool] = {}
    shapes = [(name, N, Kg, G, aq, True) for name, (N, Kg, G, aq) in projections(a).items()]
    shapes += [(name, N, K, 1, False, False) for name, (N, K) in bf16_projections(a).items()]
    if b.smoke:
        shapes = [(n, min(N, 256), min(K, 384), G, aq, f8) for n, N, K, G, aq, f8 in shapes[:2]]
    for name, N, Kg, G, aq, f8 in shapes:
        if b.over_budget(f"gemv checks {name}"):
            break
        if f8:
            lin = random_fp8_linear(N, Kg, dev, gen, act_quant=aq)
            weight, scale = lin.weight, lin.scale
        else:
            weight = (torch.randn(N, Kg, device=dev, generator=gen) * Kg ** -0.5).to(torch.bfloat16)
            scale = None
        out_dtype = torch.bfloat16 if f8 else torch.float32
        first: dict[str, GemvVariant] = {}
        for v in variants:  # each path's first timed geometry: its compile is reused
            if v.applies(8, aq and f8):
                first.setdefault(v.structure, v)
        cublas_ok = b.cuda and G == 1 and (not f8 or (aq and b.cublas.get("used")))
        impls = list(first) + (["cublas"] if cublas_ok else [])
        for impl in impls:
            key = f"{name}:{impl}"
            v = first.get(impl)
            geo = None if v is None else gemv.GemvGeometry(block_n=min(v.block_n, N // G), block_k=v.block_k,
                                                           split_k=4, num_warps=v.num_warps,
                                                           num_stages=v.num_stages, unroll=v.unroll,
                                                           prequant=v.prequant)
            results = []
            for rows in (1, 8) if v is None or not v.prequant else (8,):
                x = (torch.randn(rows, Kg * G, device=dev, generator=gen) * 2).to(torch.bfloat16)
                results.append((x, weight, scale, rows))
            px, pw, ps = accumulation_probe(N, Kg * G if G == 1 else Kg, 1, dev, bf16_weight=not f8)
            if G == 1 and (aq or not f8) and (v is None or not v.prequant):  # quantized ones, or a bf16 one
                results.append((px, pw, ps, "probe"))
            good = True
            for x, w_, s_, tag in results:
                label = f"gemv:{key}:{'M' + str(tag) if tag != 'probe' else 'probe'}"

                def run(x=x, w_=w_, s_=s_, v=v, geo=geo):
                    if v is None:
                        return gemv.cublas_linear(x, w_, s_, aq, out_dtype, mm_out_dtype=cublas_mm_out(b))
                    return gemv.fp8_gemv(x, w_, s_, aq, out_dtype, G, v.route, geo)
                route = "cublas" if v is None else v.route
                res = b.guard(label, lambda: gemv_bound(run(), x, w_, s_, route, aq, G, out_dtype, label))
                good &= res is not None and b.record_bound(res, shape=[N, Kg, G], impl=impl)
            ok[key] = good
        del weight, scale
    return ok


def probe_scaled_mm(b: DecodeBench) -> None:
    """Which block-scale layouts ``torch._scaled_mm`` accepts on this GPU and torch (recorded in the JSON):
    1×128 activation × 128×128 weight scales (fp32) with an fp32 and a bf16 output."""
    from dsv4lab_kernels import fp8_gemv as gemv
    if not b.cuda:
        return
    x = torch.randn(16, 256, device=b.device).to(torch.bfloat16)
    w = torch.randn(128, 256, device=b.device).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.full((1, 2), 127, dtype=torch.uint8, device=b.device).view(torch.float8_e8m0fnu)
    q, sx = gemv.act_quant_fp8(x, 16)
    sw = gemv.e8m0_scales_f32(s)
    for out_dtype in (torch.float32, torch.bfloat16):
        key = f"blockwise_1x128_128x128_out_{str(out_dtype).replace('torch.', '')}"
        try:
            torch._scaled_mm(q, w.t(), scale_a=sx, scale_b=sw.t(), out_dtype=out_dtype)
            torch.cuda.synchronize()
            b.cublas[key] = "accepted"
        except Exception as err:  # noqa: BLE001 — recorded: what this torch/cuBLAS accepts is the finding
            b.cublas[key] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
    accepted = [d for d in ("float32", "bfloat16") if b.cublas.get(f"blockwise_1x128_128x128_out_{d}") == "accepted"]
    b.cublas["used"] = accepted[0] if accepted else None
    b.log(f"torch._scaled_mm block scaling: {b.cublas}")


def cublas_mm_out(b: DecodeBench):
    """The output dtype of the block-scaled ``_scaled_mm`` this torch accepts (fp32 preferred: one rounding,
    ours); probed by :func:`probe_scaled_mm`."""
    return torch.bfloat16 if b.cublas.get("used") == "bfloat16" else torch.float32


def check_attention(b: DecodeBench, a) -> set[str]:
    """The attention geometries on this GPU against the reference (the tolerance of their kind)."""
    from dsv4lab_kernels import attention_decode as attn
    dev, passed = b.device, set()
    ref = ReferenceOps(Numerics())
    shape = dict(b=2, s=1, h=a.n_heads, d=a.head_dim, n_kv=700 if not b.smoke else 80,
                 k=(a.window_size + a.index_topk) if not b.smoke else 40, masked=0.2)
    q, kv, aidx, sink, scale = _make_attention(shape, torch.Generator().manual_seed(1), "cpu", Numerics())
    want = ref.sparse_attention(q, kv, aidx, sink, scale)
    q, kv, aidx, sink = q.to(dev), kv.to(dev), aidx.to(dev), sink.to(dev)
    for gname, geo in attention_geometries(b.smoke):
        name = f"attn:{gname}"
        kind = "reduction" if geo.splits == 1 and geo.two_pass else "attention"
        rows = torch.arange(2, device=dev)

        def out(geo=geo):
            return attn.sparse_attention_decode(q[:, 0], kv, aidx[:, 0], rows, sink, scale, geometry=geo)[:, None]
        if b.guard(name, lambda: b.check(name, out(), want, kind)):
            passed.add(name)
    return passed


def attention_geometries(smoke: bool):
    """(name, geometry): ``s`` row slices, ``1p`` one pass with a running max, ``2p`` two passes."""
    from dsv4lab_kernels import attention_decode as attn
    A = attn.AttentionGeometry
    if smoke:
        return [("h16r16_s1_2p", A(16, 16, 1)), ("h16r16_s4_1p", A(16, 16, 4, two_pass=False))]
    return [("h16r16_s1_2p", A(16, 16, 1, 8)), ("h16r32_s8_2p", A(16, 32, 8, 8)),
            ("h16r32_s8_1p", A(16, 32, 8, 8, False)), ("h16r32_s16_1p", A(16, 32, 16, 8, False)),
            ("h16r64_s16_1p", A(16, 64, 16, 8, False)), ("h16r32_s32_1p", A(16, 32, 32, 4, False)),
            # the combine no longer walks the slices one after another: more, shorter slices may pay now
            ("h16r16_s32_1p", A(16, 16, 32, 8, False)), ("h16r32_s32_1p_w8", A(16, 32, 32, 8, False))]


def check_static_decode(b: DecodeBench, tiny_path: Path) -> None:
    """Teacher-forced decode of two ragged rows on the tiny model: the static step (Triton backend) vs the
    reference decode, judged as ``verify model`` judges a backend that is not bit-exact — every position's KL within
    ``KL_FLOOR_FACTOR_MAX`` × the largest KL of the reference against itself with fp32 instead of exact reductions
    on the same steps (measured here), the mean within ``KL_FLOOR_FACTOR_MEAN`` × that floor's mean; and (on a GPU)
    the graph replay vs the eager static step, bit for bit."""
    dev = b.device
    ref = load(tiny_path, device=dev, backend="reference", max_batch=2, max_seq_len=128)
    tri = load(tiny_path, device=dev, backend="triton", max_batch=2, max_seq_len=128)
    ids = torch.randint(2, 4096, (2, 24), generator=torch.Generator().manual_seed(5)).to(dev)
    lens = torch.tensor([17, 9])
    steps = 2 if b.smoke else 6
    exact_ops = ref.ops

    def prefill(m):
        m.reset()
        kernels, m.ops = m.ops, ReferenceOps(m.ops.numerics)
        m.forward(ids[:, :17], 0, slots=[0, 1], lengths=lens.tolist())
        m.ops = kernels

    def reference_steps(ops) -> list[torch.Tensor]:
        ref.ops = ops
        prefill(ref)
        out = []
        for t in range(steps):
            pos = lens + t
            out.append(ref.forward(ids[torch.arange(2), pos.to(dev)][:, None], pos, slots=[0, 1])[:, 0])
        ref.ops = exact_ops
        return out

    want = reference_steps(exact_ops)
    floor = [k for w, r in zip(want, reference_steps(fp32_reduction_ops(exact_ops.numerics)))
             for k in kl_per_position(w, r)]
    prefill(tri)
    step = StaticDecodeStep(tri)
    eager, kls, same_argmax = [], [], 0
    slots = torch.arange(2, device=dev)
    for t in range(steps):
        pos = lens + t
        got = step(ids[torch.arange(2), pos.to(dev)], pos.to(dev), slots)
        eager.append(got)
        kls += kl_per_position(want[t], got)
        same_argmax += int((got.argmax(-1) == want[t].argmax(-1)).sum())
    rule = kl_rule(floor, None)  # verify model's calibrated rule, on this run's floor
    mean = sum(kls) / len(kls)
    ok = max(kls) <= rule["max_kl"] and mean <= rule["mean_kl"]
    b.checks.append(dict(name="static_decode_vs_reference", ok=ok, max_kl=max(kls), mean_kl=mean, rule=rule,
                         same_argmax=f"{same_argmax}/{len(kls)}"))
    b.log(f"static decode step vs reference decode (tiny, {steps} steps × 2 rows): max KL {max(kls):.2e} (bound "
          f"{rule['max_kl']:.2e} = {rule['k_max']} × the fp32-reduction floor's max {rule['floor_max']:.2e}), mean "
          f"{mean:.2e} (bound {rule['mean_kl']:.2e} = {rule['k_mean']} × its mean); greedy tokens equal at "
          f"{same_argmax}/{len(kls)} — {'ok' if ok else 'FAIL'}")
    if not b.cuda:
        return
    prefill(tri)
    graphs = DecodeGraphs(tri, tiers=(2,)).capture()  # resets the caches: prefill again
    prefill(tri)
    bitwise = True
    for t in range(steps):
        pos = lens + t
        tok = ids[torch.arange(2), pos.to(dev)]
        bitwise &= bool(torch.equal(graphs.replay(tok, pos.to(dev), slots), eager[t]))
    b.checks.append(dict(name="graph_replay_equals_eager", ok=bitwise))
    b.log(f"graph replay vs eager static step: {'bitwise equal' if bitwise else 'DIFFERENT'}")




# ============================================================================================ MoE
def bench_moe(b: DecodeBench, a, gen, passed: set[str], batches, variants) -> None:
    from dsv4lab_kernels import fp4_moe_decode as moe
    dev = b.device
    E, k, D, I = (16, 4, 256, 128) if b.smoke else (a.n_routed_experts, a.n_activated_experts, a.dim,
                                                    a.moe_inter_dim)
    bank = random_bank(E, D, I, dev, gen)
    ex = moe.ExpertTensors.of(bank)
    per_expert = 3 * (I * D // 2 + I * D // 32)
    n_rot = 1 if b.smoke else 16
    best: dict[str, str] = {}
    for T in batches:
        if b.over_budget(f"moe batch {T}"):
            return
        routings = [random_routing(T, E, k, dev, gen) for _ in range(n_rot)]
        xs = [(torch.randn(T, D, device=dev, generator=gen) * 2).to(torch.bfloat16) for _ in range(n_rot)]
        nbytes = statistics.mean(len(torch.unique(i)) for i, _ in routings) * per_expert
        for route, name, geo in variants:
            if name not in passed:
                continue
            if T != batches[0] and best.get(route) != name and not (route == "dot" and T == batches[-1]):
                continue  # past batch 1: each route's best geometry, and every dot geometry at the largest batch
            calls = [lambda r=r, geo=geo, route=route: moe.routed_moe_decode(
                xs[r], routings[r][0], routings[r][1], ex, a.swiglu_limit, route, geo) for r in range(n_rot)]
            t = b.guard(f"moe {route} {name} b{T}", lambda: b.time_graph_us(calls))
            if t is not None:
                b.add("moe_decode", f"{route}:{name}", T, t, nbytes, route=route, geometry=name,
                      geometry_fields=asdict(geo))
        if T == batches[0]:
            for route in moe.ROUTES:
                mine = [r for r in b.rows if r["kernel"] == "moe_decode" and r.get("route") == route
                        and r["batch"] == T]
                if mine:
                    best[route] = min(mine, key=lambda r: r["time_us"])["geometry"]
        host_routes = [r[0].tolist() for r in routings]
        b.guard(f"moe baselines b{T}", lambda: moe_baselines(b, bank, xs, host_routes, routings, T, nbytes,
                                                             a.swiglu_limit, quant, full=not b.quick))
    del bank


def moe_baselines(b, bank, xs, host_routes, routings, T, nbytes, limit, quant, full: bool = True) -> None:
    # a plain torch read of the same bytes, rotated through 4 copies (the "as fast as reading them")
    flat = [torch.empty(int(nbytes) // 4, dtype=torch.float32, device=b.device).uniform_() for _ in range(4)]
    t = b.time_graph_us([lambda f=f: f.sum() for f in flat], replays=7)
    b.add("moe_decode", "torch_sum_read", T, t, nbytes, route="baseline")
    del flat
    if not full:
        return

    def swiglu(g, u):
        return F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)

    def dequant_matmul(r):
        y = torch.zeros(T, bank.dim, device=b.device, dtype=torch.float32)
        for t_, experts in enumerate(host_routes[r]):
            for s, e in enumerate(experts):
                w1 = quant.fp4_dequant(bank.w1[e], bank.w1_scale[e], torch.bfloat16)
                w3 = quant.fp4_dequant(bank.w3[e], bank.w3_scale[e], torch.bfloat16)
                w2 = quant.fp4_dequant(bank.w2[e], bank.w2_scale[e], torch.bfloat16)
                h = swiglu(xs[r][t_:t_ + 1] @ w1.T, xs[r][t_:t_ + 1] @ w3.T) * routings[r][1][t_, s]
                y[t_] += (h.to(torch.bfloat16) @ w2.T)[0].float()
        return y

    n = len(host_routes)
    t = b.time_graph_us([lambda r=r: dequant_matmul(r) for r in range(min(n, 4))], replays=3)
    b.add("moe_decode", "torch_dequant_matmul", T, t, nbytes, route="baseline")
    # BF16-resident: a BF16 copy of the first experts (the routings are remapped onto them, same count)
    n_res = min(bank.n_experts, 64)
    res = {w: torch.stack([quant.fp4_dequant(getattr(bank, w)[e], getattr(bank, w + "_scale")[e], torch.bfloat16)
                           for e in range(n_res)]) for w in ("w1", "w3", "w2")}

    def bf16_resident(r):
        y = torch.zeros(T, bank.dim, device=b.device, dtype=torch.float32)
        for t_, experts in enumerate(host_routes[r]):
            for s, e in enumerate(experts):
                e = e % n_res
                h = swiglu(xs[r][t_:t_ + 1] @ res["w1"][e].T, xs[r][t_:t_ + 1] @ res["w3"][e].T) * routings[r][1][t_, s]
                y[t_] += (h.to(torch.bfloat16) @ res["w2"][e].T)[0].float()
        return y

    t = b.time_graph_us([lambda r=r: bf16_resident(r) for r in range(n)], replays=5)
    unique = nbytes / (3 * (bank.inter * bank.dim // 2 + bank.inter * bank.dim // 32))
    b.add("moe_decode", "bf16_resident", T, t, unique * 3 * bank.inter * bank.dim * 2, route="baseline")
    del res


# ============================================================================================ GEMV
def bench_gemv(b: DecodeBench, a, gen, checks: dict[str, bool], batches, variants) -> None:
    """Every projection × batch: the own GEMV variants whose route passed here and cuBLAS where it passed."""
    from dsv4lab_kernels import fp8_gemv as gemv
    dev = b.device
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if b.cuda else 4
    shapes = [(f"fp8_gemv_{name}", N, Kg, G, aq, True) for name, (N, Kg, G, aq) in projections(a).items()]
    shapes += [(f"bf16_gemv_{name}", N, K, 1, False, False) for name, (N, K) in bf16_projections(a).items()]
    if b.smoke:
        shapes = [(n, min(N, 256), min(K, 384), G, aq, f8) for n, N, K, G, aq, f8 in shapes[:2]]
    for kernel, N, Kg, G, aq, f8 in shapes:
        name = kernel.split("_gemv_")[1]
        if b.over_budget(f"gemv {name}"):
            return
        K = Kg * G
        w_bytes = N * Kg * (1 if f8 else 2) + ((-(-N // 128)) * (-(-Kg // 128)) if f8 else 0)
        n_rot = 1 if b.smoke else max(2, min(32, ROTATE_BYTES // w_bytes))
        if f8:
            lins = [random_fp8_linear(N, Kg, dev, gen, act_quant=aq) for _ in range(n_rot)]
            ws = [(lin.weight, lin.scale) for lin in lins]
            sw32 = [gemv.e8m0_scales_f32(lin.scale) for lin in lins]
        else:
            ws = [((torch.randn(N, Kg, device=dev, generator=gen) * Kg ** -0.5).to(torch.bfloat16), None)
                  for _ in range(n_rot)]
        out_dtype = torch.bfloat16 if f8 else torch.float32
        for T in batches:
            xs = [(torch.randn(T, K, device=dev, generator=gen) * 2).to(torch.bfloat16) for _ in range(n_rot)]
            nbytes = w_bytes + T * K * 2 + T * N * (2 if f8 else 4)
            for v in variants:
                if not checks.get(f"{name}:{v.structure}") or not v.applies(T, aq and f8):
                    continue
                bn_ = min(v.block_n, N // G) if G > 1 else v.block_n
                split = split_for(N, Kg, bn_, v.block_k, 2 * sms)
                geo = gemv.GemvGeometry(block_n=bn_, block_k=v.block_k, split_k=split, num_warps=v.num_warps,
                                        num_stages=v.num_stages, unroll=v.unroll, prequant=v.prequant)
                calls = [lambda r=r, geo=geo, route=v.route: gemv.fp8_gemv(xs[r], ws[r][0], ws[r][1], aq, out_dtype,
                                                                           G, route, geo) for r in range(n_rot)]
                t = b.guard(f"gemv {name} {v.name(bn_, split)} b{T}", lambda: b.time_graph_us(calls))
                if t is not None:
                    b.add(kernel, v.name(bn_, split), T, t, nbytes, route=v.route, impl="triton",
                          choice=dict(impl="triton", route=v.route, block_n=bn_, block_k=v.block_k, split_k=split,
                                      num_warps=v.num_warps, num_stages=v.num_stages, unroll=v.unroll,
                                      prequant=v.prequant))
            if checks.get(f"{name}:cublas"):
                if f8:
                    calls = [lambda r=r: gemv.cublas_linear(xs[r], ws[r][0], ws[r][1], aq, out_dtype,
                                                            weight_scale_f32=sw32[r], mm_out_dtype=cublas_mm_out(b))
                             for r in range(n_rot)]
                    variant = "cublas_scaled_mm_blockwise"
                else:
                    calls = [lambda r=r: gemv.cublas_linear(xs[r], ws[r][0], None, False, out_dtype)
                             for r in range(n_rot)]
                    variant = "cublas_mm_f32out"
                t = b.guard(f"gemv {name} cublas b{T}", lambda: b.time_graph_us(calls))
                if t is not None:
                    b.add(kernel, variant, T, t, nbytes, route="cublas", impl="cublas",
                          choice=dict(impl="cublas", cublas_out=str(cublas_mm_out(b)).replace("torch.", "")
                                      if f8 else "float32"))
            elif b.cuda and G == 1 and T == batches[0]:
                b.skipped.append(f"{kernel}: cuBLAS not timed ({'failed its bound' if f'{name}:cublas' in checks else 'not applicable'})")
        del ws


# ============================================================================================ attention
def bench_attention(b: DecodeBench, a, gen, passed: set[str], batches) -> None:
    from dsv4lab_kernels import attention_decode as attn
    dev = b.device
    H, d, W = a.n_heads, a.head_dim, a.window_size
    C, topk = (64, 16) if b.smoke else (1024, a.index_topk)
    n_rot = 1 if b.smoke else 8
    for T in batches:
        if b.over_budget(f"attention b{T}"):
            return
        caches = [((torch.randn(T, W, d, device=dev, generator=gen)).to(torch.bfloat16),
                   (torch.randn(T, C, d, device=dev, generator=gen)).to(torch.bfloat16)) for _ in range(n_rot)]
        q = (torch.randn(T, H, d, device=dev, generator=gen)).to(torch.bfloat16)
        sink = torch.randn(H, device=dev, generator=gen)
        win_rows = torch.arange(W, device=dev).expand(T, W).contiguous()
        cmp_rows = torch.stack([torch.randperm(C, device=dev, generator=gen)[:topk] for _ in range(T)])
        slots = torch.arange(T, device=dev)
        nbytes = T * (W + topk) * d * 2 + 2 * T * H * d * 2 + T * (W + topk) * 8
        for gname, geo in attention_geometries(b.smoke):
            if f"attn:{gname}" not in passed:
                continue
            calls = [lambda c=c, geo=geo: attn.sparse_attention_decode(q, c[0], win_rows, slots, sink, d ** -0.5,
                                                                       kv_b=c[1], rows_b=cmp_rows, batch_b=slots,
                                                                       geometry=geo) for c in caches]
            t = b.guard(f"attention {gname} b{T}", lambda: b.time_graph_us(calls))
            if t is not None:
                b.add("attn_decode", gname, T, t, nbytes, route="triton", geometry_fields=asdict(geo))

        def torch_gather(c):
            kv = torch.cat((c[0], torch.gather(c[1], 1, cmp_rows[..., None].expand(-1, -1, d))), 1)  # [T, n, d]
            z = torch.einsum("thd,tnd->thn", q, kv).float() * d ** -0.5
            m = z.amax(-1, keepdim=True)
            e = torch.exp(z - m)
            den = e.sum(-1, keepdim=True) + torch.exp(sink[None, :, None] - m)
            return (torch.einsum("thn,tnd->thd", e.to(torch.bfloat16), kv).float() / den).to(torch.bfloat16)

        t = b.guard(f"attention torch b{T}", lambda: b.time_graph_us([lambda c=c: torch_gather(c) for c in caches]))
        if t is not None:
            b.add("attn_decode", "torch_gather", T, t, nbytes, route="baseline")


# ============================================================================================ mHC sites
def mhc_site_variants(smoke: bool) -> list[tuple[str, object]]:
    """``(name, MhcSiteGeometry)`` of the one-launch decode site (``n``: programs across ``D`` per row, ``d``:
    their column step, ``f``: the finishing program's column step, ``w``: warps, ``:split_tail``: two programs
    finish a row); ``None`` is the default geometry for the batch (:meth:`MhcSiteGeometry.for_rows`)."""
    from dsv4lab_kernels.mhc import MhcSiteGeometry as S
    if smoke:
        return [("default", None)]
    return [("default", None)] + [(f"n{n}d{d}f{f}w{w}", S(splits=n, block_d=d, block_dn=f, num_warps=w))
                                  for n, d, f, w in ((64, 32, 2048, 8), (32, 32, 2048, 8), (256, 16, 2048, 8),
                                                     (128, 32, 1024, 8), (128, 32, 512, 4), (128, 32, 2048, 4))] + \
        [(f"n{n}d32f2048w8:split_tail", S(splits=n, block_d=32, block_dn=2048, num_warps=8, split_tail=True))
         for n in (128, 64)]  # the Sinkhorn beside the rows (≈ 4 µs of the default's 14, 196c88c)


def mhc_site_checks(b: DecodeBench, name: str, outs, refs) -> bool:
    """The site kernel's stated bound (:mod:`dsv4lab_kernels.mhc`): ``post`` and ``comb`` one fp32 ulp, ``X'`` one
    ulp, the normed input ``x`` three (two chained act roundings and the rare fp32 boundary case of ``pre``)."""
    ok = True
    for n, o, r in zip(("X'", "x", "post", "comb"), outs, refs):
        od = torch.float32 if n in ("post", "comb") else torch.bfloat16
        res = check_within_bound(o, r, 0.0, terms=1, acc_dtype=torch.float32, out_dtype=od,
                                 ulps=3.0 if n == "x" else 1.0, name=f"{name}.{n}")
        ok = b.record_bound(res) and ok
    return ok


def bench_mhc(b: DecodeBench, a, gen, batches) -> None:
    """The mHC decode site at real width — ``hc_post_pre_norm``, the end of one sub-layer and the normed input of
    the next in one launch, as the decode step runs it at every site but the first and the head. Each geometry is
    checked against the reference (:func:`mhc_site_checks`) and graph-timed with the 1.6 MB mixing matrix
    rotated past L2 (the step reads it from HBM). Beside them, what the default's time is made of: the same launch
    with one Sinkhorn iteration instead of ``hc_sinkhorn_iters`` (other results: timing only), the head
    collapse (no Sinkhorn, no norm, no ``X'``), the two-launch mix/finish pair, and an empty launch."""
    from dsv4lab_kernels import mhc
    dev = b.device
    HC, D = a.hc_mult, a.dim
    it, ne, he = a.hc_sinkhorn_iters, a.norm_eps, a.hc_eps
    fn_bytes = a.mix_hc * a.hc_dim * 4
    n_rot = 1 if b.smoke else max(2, -(-64 * 2 ** 20 // fn_bytes))  # > the H200's 50 MB of L2
    fns = [torch.randn(a.mix_hc, a.hc_dim, device=dev, generator=gen) * a.hc_dim ** -0.5 for _ in range(n_rot)]
    base = torch.randn(a.mix_hc, device=dev, generator=gen) * 0.5
    scale = torch.rand(3, device=dev, generator=gen) + 0.5
    w = (1 + 0.1 * torch.randn(D, device=dev, generator=gen)).to(torch.bfloat16)
    ref_ops = ReferenceOps(Numerics())
    variants = mhc_site_variants(b.smoke)
    passed = {name for name, _ in variants}
    for T in batches:
        if b.over_budget(f"mhc b{T}"):
            return
        X = (torch.randn(T, 1, HC, D, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
        h = torch.randn(T, 1, D, device=dev, generator=gen).to(torch.bfloat16)
        _, post, comb = mhc.hc_pre_norm(X, fns[0], base, scale, w, it, ne, he)
        nbytes = fn_bytes + T * (2 * HC * D + 2 * D) * 2  # fn; X and X'; the sub-layer output and x

        def site(fn, geo, iters=it):
            return mhc.hc_post_pre_norm(h, X, post, comb, fn, base, scale, w, iters, ne, he, geometry=geo)

        if T in (batches[0], batches[-1]):  # the geometries' shared code path, at the smallest and largest batch
            refs = ref_ops.hc_post_pre_norm(h, X, post, comb, fns[0], base, scale, w, a)
            for name, geo in variants:
                ok = b.guard(f"mhc check {name} b{T}",
                             lambda: mhc_site_checks(b, f"mhc:{name}:T{T}", site(fns[0], geo), refs))
                if not ok:
                    passed.discard(name)
        for name, geo in variants:
            if name not in passed:
                continue
            t = b.guard(f"mhc {name} b{T}", lambda: b.time_graph_us([lambda f=f: site(f, geo) for f in fns]))
            if t is not None:
                b.add("mhc_site", name, T, t, nbytes, route="triton",
                      geometry_fields=asdict(geo or mhc.MhcSiteGeometry.for_rows(T, D)))
        if "default" not in passed:
            continue
        parts = {"sinkhorn_1_iteration": lambda f: site(f, None, 1),
                 "head_collapse": lambda f: mhc.hc_head(X, f[:HC], base, scale, ne, he),
                 "mix_finish_pair": lambda f: site(f, mhc.MhcGeometry.for_rows(T, D))}
        for part, fn_call in parts.items():
            t = b.guard(f"mhc {part} b{T}", lambda: b.time_graph_us([lambda f=f: fn_call(f) for f in fns]))
            if t is not None:
                b.add("mhc_site", part, T, t, nbytes, route="part")
        one = torch.zeros(1, device=dev)
        t = b.guard("empty launch", lambda: b.time_graph_us([lambda: one.add_(0)] * n_rot))
        if t is not None:
            b.add("mhc_site", "empty_launch", T, t, 0, route="floor")


# ============================================================================================ one layer
def build_layer(a, layer: int, max_batch: int, max_seq_len: int, position: int, device, gen):
    """One real-dims block with random weights and caches filled as at ``position`` (compressed entries and
    index keys written below it, NaN above), plus a runner-like object for :class:`StaticDecodeStep`."""
    from dsv4lab.engine.triton_backend import TritonOps  # imports triton
    blk = Block(a, layer)
    materialize_random(blk, device, gen)
    attn = blk.attn
    attn.allocate(max_batch, max_seq_len, torch.bfloat16, torch.float32, device)
    attn.win_kv.copy_(torch.randn(attn.win_kv.shape, device=device, generator=gen))
    n_written = (position + 1) // attn.ratio if attn.ratio else 0
    if attn.ckv is not None:
        attn.ckv[:, :n_written] = torch.randn(attn.ckv[:, :n_written].shape, device=device, generator=gen).bfloat16()
    if attn.ikv is not None:
        attn.ikv[:, :(position + 1) // 4] = torch.randn(attn.ikv[:, :(position + 1) // 4].shape, device=device,
                                                        generator=gen).bfloat16()
    ops = TritonOps(Numerics())
    model = types.SimpleNamespace(layers=[blk])
    runner = types.SimpleNamespace(model=model, ops=ops, args=a, plan=None)
    return blk, runner


def layer_bytes(blk, batch: int, idx_unique: float, position: int) -> int:
    """Bytes one decode step of ``blk`` reads: every weight once (routed experts: the ones picked), plus the
    cache rows the attention and the indexer read per row."""
    a = blk.args
    total = 0
    for name, buf in blk.named_buffers():
        if buf is None or ".experts." in f".{name}" or name.startswith("attn.") and name.split(".")[-1] in (
                "win_kv", "ckv", "ikv", "cos", "sin", "kv_ring", "score_ring"):
            continue
        if "tid2eid" in name:
            continue
        total += buf.numel() * buf.element_size()
    total += int(idx_unique * EXPERT_BYTES)
    rows = a.window_size + (min(a.index_topk, (position + 1) // 4) if blk.attn.indexer is not None
                            else (position + 1) // max(blk.attn.ratio, 1) if blk.attn.ratio else 0)
    keys = (position + 1) // 4 if blk.attn.indexer is not None else 0
    return total + batch * (rows * a.head_dim * 2 + keys * a.index_head_dim * 2)


def bench_layer(b: DecodeBench, a, gen, batches) -> None:
    dev = b.device
    layer = 4 if not b.smoke else 3  # a CSA layer with biased top-k routing
    max_seq = 4096 if not b.smoke else 64
    position = 2047 if not b.smoke else 40
    blk, runner = build_layer(a, layer, max(batches), max_seq, position, dev, gen)
    step = StaticDecodeStep(runner)
    n_rot = 1 if b.smoke else 4
    for T in batches:
        if b.over_budget(f"layer b{T}"):
            return
        Xs = [(torch.randn(T, 1, a.hc_mult, a.dim, device=dev, generator=gen)).to(torch.bfloat16)
              for _ in range(n_rot)]
        tokens = torch.randint(0, a.vocab_size, (T,), device=dev, generator=gen)
        positions = torch.full((T,), position, device=dev, dtype=torch.long)
        slots = torch.arange(T, device=dev)
        with torch.inference_mode():
            idx, _ = blk.ffn.gate(runner.ops.rms_norm(Xs[0][:, :, 0].reshape(T, -1), blk.ffn_norm.weight,
                                                      a.norm_eps), tokens, runner.ops)
            unique = len(torch.unique(idx))
            calls = [lambda X=X: step._block(blk, X, tokens, positions, slots) for X in Xs]
            t = b.time_graph_us(calls, replays=5)
        nbytes = layer_bytes(blk, T, unique, position)
        row = b.add("decode_layer", f"csa_layer{layer}:graph", T, t, nbytes, route="triton", context=position + 1)
        if b.cuda and not b.smoke:
            row["kernel_us"] = b.guard(f"layer profile b{T}", lambda: profile_breakdown(calls))
            if row["kernel_us"]:
                b.log("layer kernels (µs per step): " + ", ".join(f"{k} {v}" for k, v in row["kernel_us"].items()))
    b.log("backend report (layer):\n" + runner.ops.report())


def profile_breakdown(calls) -> dict:
    """Per-kernel GPU time (µs per call) of ``calls`` replayed from a CUDA graph, grouped into op families."""
    g = torch.cuda.CUDAGraph()
    with torch.inference_mode():
        with torch.cuda.graph(g):
            for c in calls:
                c()
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
    return kernel_families(prof, 3 * len(calls))




# ============================================================================================ dispatch
def build_dispatch(doc: dict, a) -> dict:
    """The measured dispatch (:mod:`dsv4lab.engine.decode_dispatch`): per projection shape and batch the fastest
    implementation that passed its bound in this run (own GEMV variant or cuBLAS), per batch the fastest
    routed-MoE variant of the reference's semantics and the fastest sparse-attention and mHC-site geometries;
    each entry keeps the times it was chosen from."""
    from dsv4lab_kernels import fp4_moe_decode as moe
    shapes = {f"fp8_gemv_{n}": (N, Kg, G, "fp8", aq) for n, (N, Kg, G, aq) in projections(a).items()}
    shapes.update({f"bf16_gemv_{n}": (N, K, 1, "bf16", False) for n, (N, K) in bf16_projections(a).items()})
    gemv_entries, moe_entries = [], []
    for kernel, (N, Kg, G, fmt, aq) in shapes.items():
        for T in sorted({r["batch"] for r in doc["rows"] if r["kernel"] == kernel}):
            cands = [r for r in doc["rows"] if r["kernel"] == kernel and r["batch"] == T and r.get("choice")]
            if not cands:
                continue
            best = min(cands, key=lambda r: r["time_us"])
            gemv_entries.append(dict(shape=shape_key(N, Kg, G, fmt, aq), n=N, k=Kg, groups=G, weight=fmt,
                                     act_quant=aq, batch=T, kernel=kernel, choice=best["choice"],
                                     us=best["time_us"], pct_copy_bw=best["pct_copy_bw"],
                                     alternatives={r["variant"]: r["time_us"] for r in cands}))
    for T in sorted({r["batch"] for r in doc["rows"] if r["kernel"] == "moe_decode"}):
        cands = [r for r in doc["rows"] if r["kernel"] == "moe_decode" and r["batch"] == T
                 and r.get("route") in moe.SAME_SEMANTICS]
        if cands:
            best = min(cands, key=lambda r: r["time_us"])
            moe_entries.append(dict(batch=T, choice=dict(route=best["route"], **best["geometry_fields"]),
                                    us=best["time_us"], pct_copy_bw=best["pct_copy_bw"],
                                    alternatives={r["variant"]: r["time_us"] for r in cands}))
    geometry_entries = {name: geometry_tier_entries(doc, kernel) for name, kernel in GEOMETRY_KERNELS.items()}
    for e in gemv_entries + moe_entries + [e for es in geometry_entries.values() for e in es]:
        e["commit"] = doc["commit"]  # what a merge (merge_dispatch) carries with each entry
    return dict(format=FORMAT, gpu=doc["gpu"], torch=doc["torch"], triton=doc["triton"], commit=doc["commit"],
                source="dsv4lab bench kernels --suite decode" + (" --quick" if doc.get("quick") else ""),
                copy_bw_gbps=doc.get("copy_bw_gbps"), cublas_scaled_mm=doc.get("cublas_scaled_mm"),
                gemv=gemv_entries, moe=moe_entries, **geometry_entries)


GEOMETRY_KERNELS = {"attention": "attn_decode", "mhc_site": "mhc_site"}
"""The dispatch's geometry tiers (:data:`~dsv4lab.engine.decode_dispatch.GEOMETRY_TIERS`) and the kernel of the
result rows each is chosen from."""


def geometry_tier_entries(doc: dict, kernel: str) -> list[dict]:
    """Per batch, the fastest own-kernel geometry of ``kernel``'s rows (only geometries whose check passed are
    timed): ``{batch, choice: geometry fields, us, alternatives}``."""
    out = []
    rows = [r for r in doc["rows"] if r["kernel"] == kernel and r.get("route") == "triton" and r.get("geometry_fields")]
    for T in sorted({r["batch"] for r in rows}):
        cands = [r for r in rows if r["batch"] == T]
        best = min(cands, key=lambda r: r["time_us"])
        out.append(dict(batch=T, variant=best["variant"], choice=best["geometry_fields"], us=best["time_us"],
                        alternatives={r["variant"]: r["time_us"] for r in cands}))
    return out


def merge_dispatch(base: dict, fresh: dict, base_name: str = "the base dispatch") -> dict:
    """``fresh`` (a run's :func:`build_dispatch`) completed by the entries of ``base`` it did not measure — the
    projection shapes and batch tiers a run cut short by its budget never reached. Every entry names the commit it
    was measured at (``commit``; a base entry without one gets the base file's); ``merged_from`` lists both files'
    commits and how many entries each gave. Both must come from the same GPU model."""
    if not isinstance(base, dict):
        raise UserError(f"{base_name}: not a decode dispatch (a JSON object of format {FORMAT!r})")
    DecodeDispatch(base, base_name)  # a malformed file is refused naming its field
    if base.get("gpu") != fresh.get("gpu"):
        raise UserError(f"{base_name}: measured on {base.get('gpu')!r}, this run on {fresh.get('gpu')!r}: "
                        "a dispatch only holds for the GPU it was measured on")
    out = dict(fresh, gemv=list(fresh["gemv"]))
    have_gemv = {(e["shape"], int(e["batch"])) for e in fresh["gemv"]}
    carried = [dict(e, commit=e.get("commit", base.get("commit"))) for e in base.get("gemv", [])
               if (e["shape"], int(e["batch"])) not in have_gemv]
    out["gemv"] += carried
    fresh_entries = len(fresh["gemv"])
    for tier in ("moe", *GEOMETRY_KERNELS):  # per batch tier
        have = {int(e["batch"]) for e in fresh.get(tier, [])}
        kept = [dict(e, commit=e.get("commit", base.get("commit"))) for e in base.get(tier, [])
                if int(e["batch"]) not in have]
        out[tier] = list(fresh.get(tier, [])) + kept
        carried += kept
        fresh_entries += len(fresh.get(tier, []))
    out["merged_from"] = [dict(commit=fresh.get("commit"), source=fresh.get("source"), entries=fresh_entries),
                          dict(commit=base.get("commit"), source=base.get("source"), entries=len(carried))]
    return out


# ============================================================================================ driver
def chosen_sections(spec: str | None, quick: bool) -> tuple[str, ...]:
    """The sections a run times, in :data:`SECTIONS` order: ``spec`` (comma-separated names), else the mode's."""
    return pick_sections(spec, SECTIONS, QUICK_SECTIONS if quick else SECTIONS)


def run_suite(args) -> int:
    smoke = getattr(args, "smoke", False)
    quick = getattr(args, "quick", False)
    chosen = chosen_sections(getattr(args, "sections", None), quick)  # a misspelt name is refused before any work
    device = select_device("decode", smoke)
    from dsv4lab.engine import triton_backend  # noqa: F401 — registers dsv4lab_kernels, sets the interpreter on a CPU
    budget = getattr(args, "budget_s", 160.0)
    b = DecodeBench(device, min(budget, QUICK_BUDGET_S) if quick else budget, smoke)
    b.quick = quick or smoke
    gen = torch.Generator(device=device).manual_seed(0)
    a = get_preset("tiny" if smoke else "flash")
    tiny = DATA_DIR / "tiny"
    batches = (1,) if smoke else (QUICK_BATCHES if quick else BATCHES)
    mv = moe_variants(smoke, quick)
    gv = gemv_variants(smoke, quick)
    base_path = getattr(args, "dispatch_base", None)
    base = read_json(base_path, UserError) if base_path else None  # read now: --dispatch-out may be the same file
    doc = run_header(b, args, smoke) | dict(quick=quick)
    if base is not None and b.cuda and base.get("gpu") != doc["gpu"]:  # refused before the run, not after it
        raise UserError(f"{base_path}: measured on {base.get('gpu')!r}, this GPU is {doc['gpu']!r}: a dispatch "
                        "only holds for the GPU it was measured on")
    out = output_path(args, "decode")
    dispatch_out = Path(getattr(args, "dispatch_out", None) or out.with_name("decode_dispatch.json"))
    doc["sections"] = list(chosen)
    writes_dispatch = b.cuda and bool({"moe", "gemv", "mhc", "attention"} & set(chosen))

    def write() -> None:  # after every section: a run stopped from outside still leaves its measurements
        doc.update(copy_bw_gbps=b.copy_bw, peaks=b.peaks, cublas_scaled_mm=b.cublas, checks=b.checks, rows=b.rows,
                   skipped=b.skipped, errors=b.errors, elapsed_s=round(b.elapsed(), 1))
        doc["targets"] = targets(doc)
        write_json(out, doc)
        if writes_dispatch:
            fresh = build_dispatch(doc, a)
            write_json(dispatch_out, merge_dispatch(base, fresh, base_path) if base is not None else fresh)

    def after_section() -> None:
        if b.cuda:
            torch.cuda.empty_cache()
        write()

    b.guard("ceilings", b.record_ceilings)
    b.guard("scaled_mm probe", lambda: probe_scaled_mm(b))
    b.log(f"checks ({b.elapsed():.0f} s)")
    passed_moe, gemv_ok = set(), {}
    if "moe" in chosen:
        passed_moe = b.guard("moe checks", lambda: check_moe(b, a, gen, mv)) or set()
    if "gemv" in chosen:
        gemv_ok = b.guard("gemv checks", lambda: check_gemv(b, a, gen, gv)) or {}
    write()

    def attention():
        passed = check_attention(b, a)
        b.guard("static decode step (tiny)", lambda: check_static_decode(b, tiny))
        bench_attention(b, a, gen, passed, batches)
    sections = {"moe": lambda: bench_moe(b, a, gen, passed_moe, batches, mv),
                "gemv": lambda: bench_gemv(b, a, gen, gemv_ok, batches, gv),
                "mhc": lambda: bench_mhc(b, a, gen, batches),
                "attention": attention,
                "layer": lambda: bench_layer(b, a, gen, batches)}
    b.run_sections([(name, sections[name]) for name in SECTIONS if name in chosen], after=after_section)
    write()
    print_table(doc)
    print(f"wrote {out}" + (f" and {dispatch_out}" if writes_dispatch else ""))
    return 0 if all(c["ok"] for c in b.checks) and not b.errors else 1


def targets(doc: dict) -> dict:
    """The issue's targets, measured: routed MoE at batch 1 ≥ 60% of the copy bandwidth and batch 8 ≤ 3× batch 1
    (best variant of the reference's semantics each); every projection's dispatched choice at least as fast as
    the faster of cuBLAS and the own kernel in this run (true by construction of the dispatch: the row says by how
    much each lost)."""
    out: dict = {}
    moe = [r for r in doc["rows"] if r["kernel"] == "moe_decode" and r.get("route") in ("dot", "fma", "dot_scaled")]
    best = {}
    for r in moe:
        if r["batch"] not in best or r["time_us"] < best[r["batch"]]["time_us"]:
            best[r["batch"]] = r
    if 1 in best:
        b1 = best[1]
        out["moe_decode_b1"] = dict(variant=b1["variant"], time_us=b1["time_us"], pct_copy_bw=b1["pct_copy_bw"],
                                    target_pct=60, met=bool(b1["pct_copy_bw"] and b1["pct_copy_bw"] >= 60))
        if 8 in best:
            ratio = best[8]["time_us"] / b1["time_us"]
            out["moe_decode_b8_over_b1"] = dict(variant=best[8]["variant"], time_us=best[8]["time_us"],
                                                ratio=round(ratio, 2), bytes_ratio=round(best[8]["bytes"] / b1["bytes"], 2),
                                                target=3.0, met=ratio <= 3.0)
    int8 = [r for r in doc["rows"] if r["kernel"] == "moe_decode" and r.get("route") == "int8" and r["batch"] == 1]
    checks = [c for c in doc["checks"] if str(c.get("name", "")).startswith("moe:int8")]
    if checks:
        out["int8_own_arithmetic_check"] = dict(checks=len(checks), passed=sum(bool(c["ok"]) for c in checks),
                                                met=all(c["ok"] for c in checks),
                                                time_us_b1=min((r["time_us"] for r in int8), default=None))
    for kernel in sorted({r["kernel"] for r in doc["rows"] if "_gemv_" in r["kernel"]}):
        for T in sorted({r["batch"] for r in doc["rows"] if r["kernel"] == kernel}):
            rows = [r for r in doc["rows"] if r["kernel"] == kernel and r["batch"] == T]
            own = [r for r in rows if r.get("impl") == "triton"]
            cub = [r for r in rows if r.get("impl") == "cublas"]
            if not own:
                continue
            o = min(own, key=lambda r: r["time_us"])
            c = min(cub, key=lambda r: r["time_us"]) if cub else None
            chosen = o if c is None or o["time_us"] <= c["time_us"] else c
            out[f"{kernel}_b{T}"] = dict(dispatched=chosen["variant"], time_us=chosen["time_us"],
                                         own_us=o["time_us"], cublas_us=c["time_us"] if c else None,
                                         pct_copy_bw=chosen["pct_copy_bw"], met=True)
    return out


def print_table(doc: dict) -> None:
    print(f"\ndecode kernels on {doc['gpu']} (torch {doc['torch']}, triton {doc['triton']}, commit {doc['commit']}"
          f"{', quick' if doc.get('quick') else ''})")
    print(f"copy bandwidth {doc['copy_bw_gbps']} GB/s; {doc.get('peaks')}; checks "
          f"{sum(bool(c['ok']) for c in doc['checks'])}/{len(doc['checks'])} ok; {len(doc['errors'])} errors; "
          f"{doc['elapsed_s']} s; _scaled_mm block scales: {doc.get('cublas_scaled_mm')}")
    failed = [c.get("name") for c in doc["checks"] if not c["ok"]]
    if failed:
        print(f"FAILED checks ({len(failed)}): {', '.join(map(str, failed[:12]))}{' …' if len(failed) > 12 else ''}")
    best: dict = {}
    for r in doc["rows"]:
        key = (r["kernel"], r["batch"], r.get("route"))
        if key not in best or r["time_us"] < best[key]["time_us"]:
            best[key] = r
    print(f"{'kernel':<26}{'best variant of its route':<36}{'batch':>6}{'time_us':>10}{'GB/s':>9}{'%copy':>7}")
    for r in sorted(best.values(), key=lambda r: (r["kernel"], r["batch"], r["time_us"])):
        print(f"{r['kernel']:<26}{r['variant'][:35]:<36}{r['batch']:>6}{r['time_us']:>10.2f}"
              f"{r['gbps'] or 0:>9.1f}{r['pct_copy_bw'] or 0:>7.1f}")
    for k, v in doc.get("targets", {}).items():
        print(f"target {k}: {v}")
