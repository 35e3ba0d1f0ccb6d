"""``dsv4lab bench kernels --suite prefill`` — the prefill kernels at DeepSeek-V4-Flash shapes, on one GPU.

One command, in this order (a watchdog, ``--budget-s``, writes what was measured and stops; ``--quick`` keeps the
headline cases only, < 2 min):

1. **Ceilings** measured in the same run: device-to-device copy bandwidth, bf16 and FP8 (``torch._scaled_mm``,
   per-tensor scales) 8192³ matmuls. Every row reports ``pct_peak`` of the ceiling of the dtype its tensor cores
   compute in (``peak_kind``).
2. **Checks** of every timed variant on this GPU against :class:`~dsv4lab.core.model.ops.ReferenceOps` at real widths,
   each within the analytic bound of its accumulation (:func:`~dsv4lab.engine.triton_prefill.accumulation_bound`:
   reduction length and accumulation model stated per check); a variant that fails is not timed. The MoE and the
   shared expert are checked stage by stage (a last-bit difference of g or u may flip an FP8 rounding of h that the
   reference's re-quantization then amplifies), their fused epilogues against the reference composed from the
   kernel's own g and u.
3. **Grouped FP4 MoE** at 4,096 tokens (256 experts, top-6, uniform random routing): every route, the bf16
   route's decodes (``asm``/``f16``) and launch variants (``persistent``, 16 warps for gate/up: the names of
   :data:`~dsv4lab.engine.triton_prefill.MOE_GEOMETRY_TAGS`) at 128 sorter rows, sorter rows 64 and 128, then the
   **sorter-rows ablation** 16/32/64/128 at 2,048 (the paper's microbenchmark) and 4,096 tokens; total, gate/up,
   down, sort.
4. **Chunk size by measurement**: one real-dims CSA layer (and an HCA layer in a full run), random weights,
   ``TritonOps`` with the MoE variant just measured fastest, prefilling each prompt length in chunks of 512 …
   4,096 tokens and in one shot; **every op inside timed** (CUDA events; ``untimed_us`` is what lies between the
   ops: torch glue and waits for the host) and the attention / indexer roofline shares. The fastest chunk per
   prompt length becomes ``choices.chunk_by_prompt``.
5. **Dense GEMMs side by side** at 4,096 tokens: for each FP8 projection the activation quantizer alone, the
   Triton block GEMM per configuration, cuBLAS ``_scaled_mm`` with the same block scales, and the whole projection
   on each backend; the weight-stationary GEMM (grouped ``wo_a``, ``linear_f32`` of the head, compressor and
   router, the indexer's ``weights_proj``) beside cuBLAS as the backend runs it (bf16 weights, fp32 output); the
   fused shared expert.
6. **Glue** of a 4,096-row chunk: mHC pre/post on the decode step's kernels and on the rows kernel (checked against
   each other first), the attention output's RoPE on its kernel beside torch.
7. **Sparse attention and the indexer** (CSA: window 128 + top-512; HCA: window + every visible 1/128 entry;
   the causal indexer selection per configuration and the full score matrix), one chunk from position 0.
8. (full run) every family at the other token counts.

``choices`` in the JSON (chunk per prompt length, MoE route/variant/rows, FP8 and bf16 GEMM backends, the mHC rows
kernel) are read by :func:`~dsv4lab.engine.triton_prefill.load_choices` on the GPU they were measured on (from the
committed file, or the file ``$DSV4LAB_PREFILL_CHOICES`` names: a visit that measures and then runs ``bench e2e``
points it at the fresh result); ``targets`` states the
issue's targets as measured. Timing: CUDA events, median of repetitions after a warm-up (which compiles); the
256-expert weights (3.2 GB) are far larger than L2, the dense ones are flushed from L2 before every repetition.
FLOPs are the useful ones (rows padded by the sorter and masked attention slots are not counted). ``--smoke``
runs the same code at the tiny model's shapes (CPU interpreter included) to check the script itself.
"""
from __future__ import annotations

import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from dsv4lab.core.config import get_preset
from dsv4lab.engine.kernel_loader import kernel_module
from dsv4lab.engine.triton_prefill import (MOE_GEOMETRY_TAGS, TritonPrefillBackend, accumulation_bound,
                                     expert_stage_magnitude, linear_magnitude)
from dsv4lab.core.errors import UserError
from dsv4lab.core.model.block import Block
from dsv4lab.core.model.linear import ExpertBank, Linear
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.tools.perf import costmodel
from dsv4lab.tools.verify.bounds import check_within_bound
from dsv4lab.tools.verify.registry import _make_attention
from dsv4lab.tools.bench.common import (OP_NAMES, BenchRun, OpTimer, materialize_random, measure_ceilings, output_path, pick_sections,
                     random_bank, random_fp8_linear, random_routing, run_header, select_device, top_kernels,
                     write_json)

# The sections of a run, most important first (the watchdog cuts from the end); a full run adds the sweeps of moe,
# dense and attention. ``--sections`` narrows a run (e.g. ``glue`` alone: the mHC rows kernel's geometries).
SECTIONS = ("moe", "chunks", "dense", "glue", "attention")

HELP = ("prefill kernels: grouped FP4 MoE, FP8/BF16 GEMMs beside cuBLAS, sparse attention, indexer, chunk choice "
        "(writes JSON)")

MOE_ROUTES = ("bf16", "fp8", "scaled")
SORTER_ROWS = (16, 32, 64, 128)
TOKENS = (512, 1024, 2048, 4096, 8192)
PROMPTS = (1024, 2048, 4096, 4604, 8192)
CHUNKS = (512, 1024, 2048, 4096, 0)  # 0: the whole prompt in one chunk
GEMM_CONFIGS = ("m128n128", "m128n256", "m64n128")
WEIGHT_GEMM_CONFIGS = ("n128m64", "n128m256", "n256m128")
ATTENTION_CONFIGS = ("h64n32", "h64n32x", "h64n32d2")
INDEXER_CONFIGS = ("q2t64", "q2t64x8", "q2t128x4", "q4t64x8")
PEAK_OF_ROUTE = {"bf16": "bf16", "fp8": "fp8", "scaled": "bf16"}  # sm_90 has no MX cores: dot_scaled runs in bf16
ACCUMULATION_OF_ROUTE = {"bf16": "tc_bf16", "fp8": "tc_fp8", "scaled": "tc_bf16"}
# tag: MoEGeometry changes (the bf16 route's decode and scheduling, launch geometry), named as the backend reads them
MOE_TAGS = MOE_GEOMETRY_TAGS
QUICK_TAGS = ("f16", "persistent", "w16")  # the launch variants a --quick run times
TAG_ROWS = 128  # sorter rows of the launch variants: the fastest at 4,096 tokens (probe 1: 9.72 ms vs 10.76 at 64)
QUICK_ROUTES = ("bf16", "fp8")  # dot_scaled measured 2.2× slower than bf16 (probe 1): full runs only


def plan_variants(mode: str, routes, ablation_route: str) -> dict:
    """What a run of ``mode`` (smoke / quick / full) checks and times: the quick probe keeps the headline
    variants (every route, the bf16 route's decodes and scheduling, 64 and 128 rows, the default geometries)."""
    full = mode == "full"
    rows = {"quick": (64, 128), "smoke": (16, 64)}.get(mode, SORTER_ROWS)
    tags = [t for t in route_tags(ablation_route) if t and (full or (mode == "quick" and t in QUICK_TAGS))]
    tag_rows = 64 if mode == "smoke" else TAG_ROWS
    moe = sorted({(r, 64, "") for r in routes} | {(ablation_route, n, "") for n in rows}
                 | ({("bf16", 128, "")} if "bf16" in routes else set())
                 | {(ablation_route, tag_rows, t) for t in tags})
    return dict(moe=moe, rows=rows, tags=tags, tag_rows=tag_rows,
                gemm=GEMM_CONFIGS if full else GEMM_CONFIGS[:1],
                weight=WEIGHT_GEMM_CONFIGS if full else WEIGHT_GEMM_CONFIGS[:1],
                attention=ATTENTION_CONFIGS if full else ("h64n32", "h64n32x"),
                indexer=INDEXER_CONFIGS if full else ("q2t64x8",))


def add_suite_arguments(p) -> None:
    """Options of this suite beyond the dispatcher's common ``--out --quick --smoke --budget-s --commit``."""
    p.add_argument("--moe-routes", default=None, help="prefill: grouped-MoE routes to check and time (default: all; "
                   f"--quick: {','.join(QUICK_ROUTES)})")
    p.add_argument("--ablation-route", default="bf16", help="prefill: route of the sorter-rows ablation (and of the "
                   "launch-geometry variants)")


# ============================================================================================ rows and checks
class PrefillBench(BenchRun):
    """One prefill run: rows with TFLOP/s and % of the measured peak of the dtype the tensor cores compute in."""

    suite = "prefill"

    def record_ceilings(self) -> None:
        """Copy bandwidth and matmul peaks, event-timed (the prefill rows' ceilings); ``None`` each on a CPU."""
        self.peaks = measure_ceilings(self, timing="events")

    def add(self, kernel: str, variant: str, time_us: float, flops: float = 0.0, peak_kind: str = "bf16",
            **extra) -> dict:
        peak = self.peaks.get(f"{peak_kind}_tflops")
        tflops = flops / (time_us * 1e-6) / 1e12 if flops and time_us else None
        row = dict(kernel=kernel, variant=variant, tokens=extra.pop("tokens", None),
                   sorter_rows=extra.pop("sorter_rows", None), chunk=extra.pop("chunk", None),
                   time_us=round(time_us, 2), tflops=None if tflops is None else round(tflops, 2),
                   pct_peak=None if (tflops is None or not peak) else round(100 * tflops / peak, 1),
                   peak_kind=peak_kind, **extra)
        self.rows.append(row)
        return row

    def check_record(self, c, gating: bool) -> dict:
        return dict(name=c.name, ok=c.ok, gating=gating, max_abs=c.max_abs, rel_l2=c.rel_l2, cosine=c.cosine,
                    n_bad=c.n_bad, numel=c.numel, line=c.line())

    def check_ulps(self, name: str, out, ref, out_dtype, ulps: float) -> bool:
        """``|out − ref| ≤ ulps · ulp(out_dtype)`` element-wise (two evaluations of the same formula that differ
        only where a value lies on a rounding boundary), recorded as a check."""
        c = check_within_bound(out, ref, 0.0, terms=1, acc_dtype=torch.float32, out_dtype=out_dtype, ulps=ulps,
                               name=name)
        self.checks.append(dict(name=name, ok=c.ok, gating=True, kind="bound", max_ratio=c.max_ratio,
                                n_violations=c.n_violations, nan_mismatch=c.nan_mismatch, numel=c.numel,
                                bitwise_equal=c.bitwise_equal, rule=c.rule, line=c.line()))
        self.log(c.line())
        return c.ok

    def check_bound(self, name: str, out, ref, magnitude, terms: int, accumulation: str, out_dtype,
                    gating: bool = True, rounded_terms: bool = False) -> bool:
        """``|out − ref| ≤ γ·Σ|terms| + 1 ulp(out_dtype)`` for a ``terms``-long reduction accumulated as
        ``accumulation`` (:func:`~dsv4lab.engine.triton_prefill.accumulation_bound`), recorded as a check.
        ``rounded_terms``: ``out`` is an exact sum of partial results each rounded to bf16 on both sides (the MoE
        combine of its slots), which may straddle a bf16 rounding each: ``+ 2^-7·Σ|terms|`` (one bf16 ulp of a
        value is at most 2^-7 of it, and a slot's value at most its ``Σ|terms|``)."""
        kw = accumulation_bound(terms, accumulation)
        if rounded_terms:
            kw["c"] += 2.0 ** -7 / 2.0 ** -24
        c = check_within_bound(out, ref, magnitude, out_dtype=out_dtype, name=name, **kw)
        self.checks.append(dict(name=name, ok=c.ok, gating=gating, kind="bound", max_ratio=c.max_ratio,
                                n_violations=c.n_violations, nan_mismatch=c.nan_mismatch, numel=c.numel,
                                bitwise_equal=c.bitwise_equal, rule=c.rule, line=c.line()))
        self.log(c.line() + ("" if gating else " (information)"))
        return c.ok


# ============================================================================================ inputs
def bank_slice(bank, n_experts: int):
    part = ExpertBank(n_experts, bank.dim, bank.inter, "fp4")
    for name in ("w1", "w3", "w2", "w1_scale", "w3_scale", "w2_scale"):
        part._buffers[name] = getattr(bank, name)[:n_experts]
    return part


def random_bf16_linear(n: int, k: int, device, gen):
    """A BF16 ``Linear`` (``k`` → ``n``) with weights of the model's scale (router, compressor, head)."""
    lin = Linear(k, n, "bf16")
    lin._buffers["weight"] = (torch.randn(n, k, device=device, generator=gen) * k ** -0.5).to(torch.bfloat16)
    return lin


def dense_projections(a) -> dict[str, tuple[int, int]]:
    """``name: (N, K)`` of the FP8 projections a prefill runs per layer (the indexer's wq_b in CSA layers)."""
    return {"wq_a": (a.q_lora_rank, a.dim), "wq_b": (a.n_heads * a.head_dim, a.q_lora_rank),
            "wkv": (a.head_dim, a.dim), "wo_b": (a.dim, a.o_groups * a.o_lora_rank),
            "indexer.wq_b": (a.index_n_heads * a.index_head_dim, a.q_lora_rank),
            "shared.w1": (a.moe_inter_dim, a.dim), "shared.w2": (a.dim, a.moe_inter_dim)}


def bf16_projections(a) -> dict[str, tuple[int, int]]:
    """``name: (N, K)`` of the BF16-weight projections of a prefill (``linear_f32`` except ``weights_proj``)."""
    return {"compressor.wkv": (2 * a.head_dim, a.dim), "indexer.compressor.wkv": (2 * a.index_head_dim, a.dim),
            "gate": (a.n_routed_experts, a.dim), "indexer.weights_proj": (a.index_n_heads, a.dim),
            "head": (a.vocab_size, a.dim)}


# ============================================================================================ checks
def run_checks(b: PrefillBench, args, gen, plan: dict) -> set[str]:
    """Correctness of every planned variant at real widths (within its analytic bound); returns the names that
    passed."""
    passed: set[str] = set()
    for section in (check_moe_variants, check_dense, check_attention_side):
        b.guard(section.__name__, lambda: section(b, args, gen, passed, plan))
    return passed


def check_moe_variants(b: PrefillBench, a, gen, passed: set[str], plan: dict) -> None:
    """Real widths, fewer experts so each gets about as many rows as at 4,096 tokens with 256 experts."""
    from dsv4lab_kernels import fp4_moe_grouped as fm
    ref = ReferenceOps(Numerics())
    dev = b.device
    E = 8 if b.smoke else 32
    T = 48 if b.smoke else 512
    limit = a.swiglu_limit
    bank = bank_slice(random_bank(E, a.dim, a.moe_inter_dim, dev, gen), E)
    idx, w = random_routing(T, E, a.n_activated_experts, dev, gen)
    x = (torch.randn(T, a.dim, device=dev, generator=gen) * 2).to(torch.bfloat16)
    want_g, want_u = ref.moe_stage1(x, idx, bank)
    h_in = ref.moe_activation(want_g, want_u, w, limit)
    want_down = ref.moe_stage2(h_in, idx, bank)
    want_total = ref.routed_experts(x, idx, w, bank, limit)
    mag_g, mag_u = (expert_stage_magnitude(x, idx, bank, n, True) for n in ("w1", "w3"))
    mag_down = expert_stage_magnitude(h_in, idx, bank, "w2", True)
    b.log(f"MoE decode: asm {fm.asm_decode_status(dev) if b.cuda else 'interpreter: f16'}")

    def check(route: str, rows: int, tag: str) -> bool:
        name, geo = moe_variant_name(route, rows, tag), fm.MoEGeometry(rows=rows, **MOE_TAGS[tag])
        acc = ACCUMULATION_OF_ROUTE[route]
        g, u = fm.moe_stage1(x, idx, bank, route=route, geo=geo)
        ok = b.check_bound(f"{name}:stage1.g", g, want_g, mag_g, a.dim, acc, torch.bfloat16)
        ok = b.check_bound(f"{name}:stage1.u", u, want_u, mag_u, a.dim, acc, torch.bfloat16) and ok
        ok = b.check_bound(f"{name}:stage2", fm.moe_stage2(h_in, idx, bank, route=route, geo=geo), want_down,
                           mag_down, a.moe_inter_dim, acc, torch.bfloat16) and ok
        y = fm.routed_experts(x, idx, w, bank, limit, route=route, geo=geo, poison=True)
        h_k = ref.moe_activation(g, u, w, limit)
        composed = ref.moe_combine(ref.moe_stage2(h_k, idx, bank), idx)
        # the combine sums k bf16 slot outputs exactly: the bound is k times a slot's
        mag = torch.nan_to_num(expert_stage_magnitude(h_k, idx, bank, "w2", True)).sum(1)
        ok = b.check_bound(f"{name}:fused", y, composed, mag, a.moe_inter_dim, acc, torch.float32,
                           rounded_terms=True) and ok
        b.check(f"{name}:end_to_end", y, want_total, "quantized", gating=False)
        return ok

    for route, rows, tag in plan["moe"]:
        name = moe_variant_name(route, rows, tag)
        if tag in ("f16", "persistent", "sbyte", "w16p") and route != "bf16":
            continue
        if b.guard(name, lambda: check(route, rows, tag)):
            passed.add(name)


def check_dense(b: PrefillBench, a, gen, passed: set[str], plan: dict) -> None:
    """FP8 projections (Triton configs, cuBLAS), the weight-stationary GEMM, the fused shared expert."""
    from dsv4lab_kernels import fp8_gemm as fg
    ref = ReferenceOps(Numerics())
    dev = b.device
    M = 64 if b.smoke else 301  # odd: cuBLAS's row padding is exercised
    lin = random_fp8_linear(a.q_lora_rank, a.dim, dev, gen)
    x = (torch.randn(M, a.dim, device=dev, generator=gen) * 2).to(torch.bfloat16)
    want, mag = ref.linear(x, lin), linear_magnitude(x, lin, True)
    for cfg in plan["gemm"]:
        name = f"fp8_gemm:{cfg}"
        if b.guard(name, lambda: b.check_bound(name, fg.fp8_linear(x, lin.weight, lin.scale, config=cfg), want, mag,
                                               a.dim, "tc_fp8", torch.bfloat16)):
            passed.add(name)
    if b.cuda and fg.cublas_block_fp8_available(dev):
        if b.guard("fp8_gemm:cublas", lambda: b.check_bound("fp8_gemm:cublas", fg.fp8_linear(
                x, lin.weight, lin.scale, backend="cublas"), want, mag, a.dim, "tc_fp8", torch.bfloat16)):
            passed.add("fp8_gemm:cublas")
    elif b.cuda:
        b.log(f"cuBLAS block-scaled FP8: {fg.cublas_unavailable_reason(dev)}")
    # grouped wo_a: bf16 activations × FP8 weight upcast in registers
    G = a.o_groups
    wo_a = random_fp8_linear(G * a.o_lora_rank, a.wo_a_in_per_group, dev, gen, act_quant=False)
    o = torch.randn(1, M, G, a.wo_a_in_per_group, device=dev, generator=gen).to(torch.bfloat16)
    want = ref.grouped_wo_a(o, wo_a, G)
    w3 = wo_a.dequantized(torch.float64).view(G, -1, a.wo_a_in_per_group)
    mag = torch.einsum("bsgd,grd->bsgr", o.double().abs(), w3.abs())
    for cfg in plan["weight"]:
        name = f"weight_gemm:{cfg}"
        if b.guard(name, lambda: b.check_bound(name, fg.weight_gemm(
                o.reshape(M, G, -1), wo_a.weight, wo_a.scale, torch.bfloat16, G, config=cfg).view(want.shape), want,
                mag, a.wo_a_in_per_group, "tc_bf16", torch.bfloat16)):
            passed.add(name)
    # linear_f32 of a BF16 weight (fp32 out)
    lb = random_bf16_linear(2 * a.head_dim, a.dim, dev, gen)
    name = "weight_gemm_f32"
    want_f32, mag_f32 = ref.linear_f32(x, lb), linear_magnitude(x, lb, False)
    if b.guard(name, lambda: b.check_bound(name, fg.weight_gemm(x, lb.weight, None, torch.float32), want_f32,
                                           mag_f32, a.dim, "tc_bf16", torch.float32)):
        passed.add(name)
    # both on cuBLAS (bf16 tensor cores, fp32 output rounded once), as the backend dispatches them
    if b.cuda and fg.cublas_bf16_available(dev):
        def check_cublas_bf16() -> bool:
            y = fg.cublas_weight_gemm(o.reshape(M, G, -1), wo_a.weight, wo_a.scale, torch.bfloat16, G)
            ok = b.check_bound("weight_gemm:cublas:wo_a", y.view(want.shape), want, mag, a.wo_a_in_per_group,
                               "tc_bf16", torch.bfloat16)
            return b.check_bound("weight_gemm:cublas:f32", fg.cublas_weight_gemm(x, lb.weight, None, torch.float32),
                                 want_f32, mag_f32, a.dim, "tc_bf16", torch.float32) and ok
        if b.guard("weight_gemm:cublas", check_cublas_bf16):
            passed.add("weight_gemm:cublas")
    elif b.cuda:
        b.log(f"cuBLAS bf16 with fp32 output: {fg.cublas_bf16_reason(dev)}")
    # the fused shared expert, stage by stage
    w1, w3_, w2 = (random_fp8_linear(n, k, dev, gen) for n, k in ((a.moe_inter_dim, a.dim), (a.moe_inter_dim, a.dim),
                                                                  (a.dim, a.moe_inter_dim)))
    limit = a.swiglu_limit

    def check_shared() -> bool:
        g, u = fg.fp8_gate_up(x, w1.weight, w1.scale, w3_.weight, w3_.scale, limit, fuse=False)
        ok = b.check_bound("shared:gate", g, ref.linear(x, w1).float(), linear_magnitude(x, w1, True), a.dim,
                           "tc_fp8", torch.bfloat16)
        ok = b.check_bound("shared:up", u, ref.linear(x, w3_).float(), linear_magnitude(x, w3_, True), a.dim,
                           "tc_fp8", torch.bfloat16) and ok
        h = ref.swiglu(g, u, limit, shared=True).to(torch.bfloat16)
        composed = ref.linear(h, w2)
        for backend in ("triton", "cublas") if b.cuda else ("triton",):
            y = fg.fp8_swiglu_mlp(x, w1.weight, w1.scale, w3_.weight, w3_.scale, w2.weight, w2.scale, limit,
                                  backend=backend)
            ok = b.check_bound(f"shared:fused[{backend}]", y, composed, linear_magnitude(h, w2, True),
                               a.moe_inter_dim, "tc_fp8", torch.bfloat16) and ok
        return ok
    if b.guard("shared_expert", check_shared):
        passed.add("shared_expert")


def check_attention_side(b: PrefillBench, a, gen, passed: set[str], plan: dict) -> None:
    """Sparse attention (the attention tolerance policy), indexer scores, selection and pooling."""
    from dsv4lab_kernels import attention_prefill as ap
    ref = ReferenceOps(Numerics())
    dev = b.device
    shape = dict(b=1, s=8 if b.smoke else 48, h=a.n_heads, d=a.head_dim, n_kv=300 if b.smoke else 1200,
                 k=(a.window_size + a.index_topk), masked=0.3)
    q, kv, aidx, sink, scale = _make_attention(shape, torch.Generator().manual_seed(1), "cpu", Numerics())
    q, kv, aidx, sink = q.to(dev), kv.to(dev), aidx.to(dev), sink.to(dev)
    want = ref.sparse_attention(q, kv, aidx, sink, scale)
    for cfg in plan["attention"]:
        name = f"attn:{cfg}"
        if b.guard(name, lambda: b.check(name, ap.sparse_attention(q, kv, aidx, sink, scale, config=cfg), want,
                                         "attention")):
            passed.add(name)
    S, Tk = (16, 40) if b.smoke else (64, 1024)
    qi = torch.randn(1, S, a.index_n_heads, a.index_head_dim, device=dev, generator=gen).to(torch.bfloat16)
    wi = (torch.randn(1, S, a.index_n_heads, device=dev, generator=gen) * 0.1).to(torch.bfloat16)
    keys = torch.randn(1, Tk, a.index_head_dim, device=dev, generator=gen).to(torch.bfloat16)
    scores = ref.indexer_scores(qi, wi, keys)
    if b.guard("indexer_scores", lambda: b.check("indexer_scores", ap.indexer_scores(qi, wi, keys), scores,
                                                 "attention")):
        passed.add("indexer_scores")
    pos = (torch.arange(S, device=dev) * (4 * Tk // S) + 3)[None]
    if b.guard("indexer_topk", lambda: b.check("indexer_topk", ap.indexer_topk(scores, pos, 4, a.index_topk),
                                               ref.indexer_topk(scores, pos, 4, a.index_topk), "exact")):
        passed.add("indexer_topk")
    want_sel = ref.indexer_topk(scores, pos, 4, a.index_topk)
    for cfg in plan["indexer"]:
        name = f"indexer_select:{cfg}"
        # scores of bf16 MMAs may differ from the exact reference in a last bit, so near-ties may pick another
        # entry: the selection is judged by the reference scores of what it picked (sorted), not by the indices
        if b.guard(name, lambda: b.check(name, _picked_scores(scores, ap.indexer_select(
                qi, wi, keys, pos, 4, a.index_topk, config=cfg)), _picked_scores(scores, want_sel), "attention")):
            passed.add(name)
    kvs = torch.randn(64, 8, a.head_dim, device=dev, generator=gen)
    scs = torch.randn(64, 8, a.head_dim, device=dev, generator=gen)
    if b.guard("compressor_pool", lambda: b.check("compressor_pool", ap.compressor_pool(kvs, scs),
                                                  ref.compressor_pool(kvs, scs), "reduction")):
        passed.add("compressor_pool")


def _picked_scores(scores, sel):
    """The scores of the selected entries, sorted descending (−inf where nothing was selected)."""
    got = torch.gather(scores.float(), -1, sel.clamp_min(0))
    return torch.where(sel >= 0, got, float("-inf")).sort(-1, descending=True).values


# ============================================================================================ MoE
def moe_variant_name(route: str, rows: int, tag: str = "") -> str:
    return f"moe:{route}:{rows}" + (f":{tag}" if tag else "")


def route_tags(route: str) -> list[str]:
    """The variants a route can run: decode and scheduling belong to bf16; the fp8 route's K tile must divide its
    128-wide scale block."""
    return [t for t in MOE_TAGS if not (route != "bf16" and t in ("f16", "persistent", "sbyte", "w16p"))
            and not (route == "fp8" and MOE_TAGS[t].get("block_k1", 128) > 128)]


class MoEBench:
    """The 256-expert bank at real shapes and the timing of one (route, sorter rows, tokens, tag) case."""

    def __init__(self, b: PrefillBench, args, gen, passed: set[str]):
        self.b, self.a, self.gen, self.passed = b, args, gen, passed
        self.bank = random_bank(args.n_routed_experts, args.dim, args.moe_inter_dim, b.device, gen)
        self.inputs: dict[int, tuple] = {}

    def _inputs(self, T: int):
        if T not in self.inputs:
            idx, w = random_routing(T, self.a.n_routed_experts, self.a.n_activated_experts, self.b.device, self.gen)
            x = torch.randn(T, self.a.dim, device=self.b.device, generator=self.gen).to(torch.bfloat16)
            self.inputs[T] = (idx, w, x)
        return self.inputs[T]

    def run(self, route: str, rows: int, T: int, stages: bool, tag: str = "") -> float | None:
        from dsv4lab_kernels import fp4_moe_grouped as fm
        from dsv4lab_kernels.moe_sort import sort_by_expert, sort_by_expert_torch
        b, a, bank = self.b, self.a, self.bank
        name = moe_variant_name(route, rows, tag)
        if name not in self.passed:
            b.skipped.append(f"{name} @{T} (not checked or failed its check)")
            return None
        E, k, D, I = a.n_routed_experts, a.n_activated_experts, a.dim, a.moe_inter_dim
        geo = fm.MoEGeometry(rows=rows, **MOE_TAGS[tag])
        route_tag = route + (f"+{tag}" if tag else "")
        idx, w, x = self._inputs(T)
        f_up, f_down = 2.0 * T * k * 2 * I * D, 2.0 * T * k * D * I
        kind, limit = PEAK_OF_ROUTE[route], a.swiglu_limit
        t = b.time_events_us(lambda: fm.routed_experts(x, idx, w, bank, limit, route=route, geo=geo), name=name)
        routing = sort_by_expert(idx, E, rows)
        padded = int(((routing.counts + rows - 1) // rows * rows).sum())
        b.add("moe_grouped_gemm", f"{route_tag}:total", t, f_up + f_down, kind, tokens=T, sorter_rows=rows,
              row_efficiency=round(T * k / padded, 3))
        if stages:
            xv, xs = fm._activation_operands(x, route)
            w_flat = w.reshape(-1).contiguous()
            h = fm.gate_up(xv, xs, bank, routing, route, geo, w_flat, limit)
            t_up = b.time_events_us(lambda: fm.gate_up(xv, xs, bank, routing, route, geo, w_flat, limit))
            b.add("moe_grouped_gemm", f"{route_tag}:gate_up", t_up, f_up, kind, tokens=T, sorter_rows=rows)
            t_dn = b.time_events_us(lambda: fm.down(h[0], h[1], bank, routing, route, geo, T * k))
            b.add("moe_grouped_gemm", f"{route_tag}:down", t_dn, f_down, kind, tokens=T, sorter_rows=rows)
            t_sort = b.time_events_us(lambda: sort_by_expert(idx, E, rows))
            b.add("moe_sort", "sort", t_sort, tokens=T, sorter_rows=rows, peak_kind="copy")
            t_sort = b.time_events_us(lambda: sort_by_expert_torch(idx, E, rows))  # the previous sorter
            b.add("moe_sort", "sort_torch", t_sort, tokens=T, sorter_rows=rows, peak_kind="copy")
        return t


def bench_moe_headline(b: PrefillBench, moe: MoEBench, routes, headline: int, plan: dict, ablation_tokens,
                       ablation_route, quick: bool) -> None:
    """Every route at the headline token count, the bf16 route's variants and 128 rows, then the sorter-rows
    ablation at the paper's M = 2048 and at the headline count."""
    cases = [(r, 64, "") for r in routes] + [("bf16", 128, "")] * ("bf16" in routes)
    cases += [(ablation_route, plan["tag_rows"], t) for t in plan["tags"]]
    rows_list = plan["rows"]
    for route, rows, tag in cases:
        if not b.over_budget(f"moe {moe_variant_name(route, rows, tag)} @{headline}"):
            b.guard(f"moe {route} {rows} {tag}", lambda: moe.run(route, rows, headline, True, tag))
    for T in (headline,) if quick else (ablation_tokens, headline):
        for rows in rows_list:
            if T == headline and rows in (64, 128):
                continue  # timed above
            if not b.over_budget(f"sorter ablation {ablation_route} rows {rows} @{T}"):
                b.guard(f"moe ablation {rows} @{T}", lambda: moe.run(ablation_route, rows, T, True))


def bench_moe_sweep(b: PrefillBench, moe: MoEBench, routes, tokens, headline: int) -> None:
    for T in tokens:
        for route in routes:
            if T == headline or b.over_budget(f"moe {route} @{T}"):
                continue
            b.guard(f"moe {route} @{T}", lambda: moe.run(route, 64, T, False))


# ============================================================================================ dense GEMMs
def bench_dense(b: PrefillBench, a, gen, passed: set[str], T: int) -> None:
    """FP8 projections (quantizer, Triton per config, cuBLAS, whole projection per backend), BF16-activation
    GEMMs beside cuBLAS bf16, and the shared expert."""
    from dsv4lab_kernels import fp8_gemm as fg
    dev = b.device
    cublas = b.cuda and "fp8_gemm:cublas" in passed
    configs = [c for c in GEMM_CONFIGS if f"fp8_gemm:{c}" in passed]
    for name, (n, k) in dense_projections(a).items():
        if b.over_budget(f"fp8 {name} @{T}"):
            return
        lin = random_fp8_linear(n, k, dev, gen)
        x = torch.randn(T, k, device=dev, generator=gen).to(torch.bfloat16)
        flops, meta = 2.0 * T * n * k, dict(tokens=T, n=n, k=k)
        t = b.time_events_us(lambda: fg.quantize_activations(x), name="act_quant", flush_l2=True)
        b.add("fp8_gemm", f"{name}:act_quant", t, 0.0, "copy", gbps=round(3 * T * k / (t * 1e-6) / 1e9, 1), **meta)
        qa = fg.quantize_activations(x)
        for cfg in configs:
            t = b.time_events_us(lambda: fg.fp8_block_gemm(qa["q"], qa["scale"], lin.weight, lin.scale, config=cfg),
                                 name=f"fp8:{cfg}", flush_l2=True)
            b.add("fp8_gemm", f"{name}:triton:{cfg}", t, flops, "fp8", **meta)
        if cublas and fg.cublas_eligible(T, n, k):
            qc, sw = fg.quantize_activations(x, scale_cols=True), fg.weight_scale_f32(lin.scale)
            t = b.time_events_us(lambda: fg._cublas_gemm(qc["q"], qc["scale"], lin.weight, sw, torch.bfloat16),
                                 name="fp8:cublas", flush_l2=True)
            b.add("fp8_gemm", f"{name}:cublas", t, flops, "fp8", **meta)
            t = b.time_events_us(lambda: fg.fp8_linear(x, lin.weight, lin.scale, backend="cublas", w_scale_f32=sw),
                                 flush_l2=True)
            b.add("fp8_gemm", f"{name}:linear:cublas", t, flops, "fp8", **meta)
        if configs:
            t = b.time_events_us(lambda: fg.fp8_linear(x, lin.weight, lin.scale, config=configs[0]), flush_l2=True)
            b.add("fp8_gemm", f"{name}:linear:triton", t, flops, "fp8", **meta)
    wcfgs = [c for c in WEIGHT_GEMM_CONFIGS if f"weight_gemm:{c}" in passed]
    if not wcfgs or b.over_budget(f"weight gemms @{T}"):
        return
    G = a.o_groups
    wo_a = random_fp8_linear(G * a.o_lora_rank, a.wo_a_in_per_group, dev, gen, act_quant=False)
    o = torch.randn(T, G, a.wo_a_in_per_group, device=dev, generator=gen).to(torch.bfloat16)
    flops = 2.0 * T * G * a.o_lora_rank * a.wo_a_in_per_group
    for cfg in wcfgs:
        t = b.time_events_us(lambda: fg.weight_gemm(o, wo_a.weight, wo_a.scale, torch.bfloat16, G, config=cfg),
                             name=f"weight:{cfg}", flush_l2=True)
        b.add("weight_gemm", f"wo_a:{cfg}", t, flops, "bf16", tokens=T)
    if b.cuda:  # cuBLAS bf16 on the dequantized weight: the speed reference (the same products, exact weights)
        wd = wo_a.dequantized(torch.bfloat16).view(G, -1, a.wo_a_in_per_group)
        ot = o.transpose(0, 1)
        t = b.time_events_us(lambda: torch.bmm(ot, wd.transpose(1, 2)), flush_l2=True)
        b.add("weight_gemm", "wo_a:cublas_bf16", t, flops, "bf16", tokens=T)
    if "weight_gemm:cublas" in passed:  # what the backend runs: dequantize, fp32-output bmm, round once
        t = b.time_events_us(lambda: fg.cublas_weight_gemm(o, wo_a.weight, wo_a.scale, torch.bfloat16, G),
                             name="weight:cublas", flush_l2=True)
        b.add("weight_gemm", "wo_a:cublas", t, flops, "bf16", tokens=T)
    x = torch.randn(T, a.dim, device=dev, generator=gen).to(torch.bfloat16)
    for name, (n, k) in bf16_projections(a).items():
        if b.over_budget(f"bf16 {name} @{T}"):
            return
        lb = random_bf16_linear(n, k, dev, gen)
        out = torch.bfloat16 if name.endswith("weights_proj") else torch.float32
        flops = 2.0 * T * n * k
        t = b.time_events_us(lambda: fg.weight_gemm(x, lb.weight, None, out, config=wcfgs[0]), flush_l2=True)
        b.add("weight_gemm", f"{name}:{wcfgs[0]}", t, flops, "bf16", tokens=T, n=n, k=k)
        if b.cuda:
            t = b.time_events_us(lambda: torch.mm(x, lb.weight.t()), flush_l2=True)
            b.add("weight_gemm", f"{name}:cublas_bf16", t, flops, "bf16", tokens=T, n=n, k=k)
        if "weight_gemm:cublas" in passed:
            t = b.time_events_us(lambda: fg.cublas_weight_gemm(x, lb.weight, None, out), flush_l2=True)
            b.add("weight_gemm", f"{name}:cublas", t, flops, "bf16", tokens=T, n=n, k=k)
    if "shared_expert" in passed and not b.over_budget(f"shared expert @{T}"):
        w1, w3, w2 = (random_fp8_linear(n, k, dev, gen) for n, k in ((a.moe_inter_dim, a.dim),
                                                                     (a.moe_inter_dim, a.dim),
                                                                     (a.dim, a.moe_inter_dim)))
        flops = 2.0 * T * 3 * a.dim * a.moe_inter_dim
        for backend in ("triton", "cublas") if cublas else ("triton",):
            t = b.time_events_us(lambda: fg.fp8_swiglu_mlp(x, w1.weight, w1.scale, w3.weight, w3.scale, w2.weight,
                                                           w2.scale, a.swiglu_limit, backend=backend), flush_l2=True)
            b.add("shared_expert", f"fused:{backend}", t, flops, "fp8", tokens=T)


# ============================================================================================ glue
MHC_OPS = ("hc_pre_norm", "hc_post_pre_norm", "hc_post")


def bench_glue(b: PrefillBench, a, gen, T: int) -> None:
    """The glue of a ``T``-token prefill chunk: mHC on the decode step's kernels and on the rows kernel (checked
    against each other first — both evaluate the reference's sums in fp64, so at most one output ulp apart where a
    value lies on a rounding boundary; a failed check keeps the rows kernel untimed), and the RoPE of the attention
    output on its kernel beside the reference's torch ops."""
    from dsv4lab_kernels import mhc
    from dsv4lab_kernels import norm_rope_quant as nrq
    dev = b.device
    X = (torch.randn(T, a.hc_mult, a.dim, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
    fn = torch.randn(a.mix_hc, a.hc_dim, device=dev, generator=gen) * a.hc_dim ** -0.5
    base = torch.randn(a.mix_hc, device=dev, generator=gen) * 0.5
    scale = torch.rand(3, device=dev, generator=gen) + 0.5
    w = 1 + 0.1 * torch.randn(a.dim, device=dev, generator=gen)
    h = torch.randn(T, a.dim, device=dev, generator=gen).to(torch.bfloat16)
    it, ne, he = a.hc_sinkhorn_iters, a.norm_eps, a.hc_eps
    _, post, comb = mhc.hc_pre_norm(X, fn, base, scale, w, it, ne, he)
    kernels = {
        "hc_pre_norm": (lambda: mhc.hc_pre_norm(X, fn, base, scale, w, it, ne, he),
                        lambda g: mhc.hc_pre_norm_rows(X, fn, base, scale, w, it, ne, he, g)),
        "hc_post_pre_norm": (lambda: mhc.hc_post_pre_norm(h, X, post, comb, fn, base, scale, w, it, ne, he),
                             lambda g: mhc.hc_post_pre_norm_rows(h, X, post, comb, fn, base, scale, w, it, ne, he,
                                                                 g)),
        "hc_post": (lambda: (mhc.hc_post(h, X, post, comb),), lambda g: (mhc.hc_post_rows(h, X, post, comb, g),)),
    }
    rows_ok = mhc.rows_kernel_works(dev)
    if not rows_ok:
        b.log(f"mHC rows kernel not used: {mhc.rows_kernel_status(dev)}")
    geometries = list(mhc.ROWS_GEOMETRIES.values())[:1 if b.smoke else None]

    def kernels_of(fn) -> list[dict]:
        """What one call's time is made of, on a GPU: its kernels (the mix, the finish, a widening copy…)."""
        if not b.cuda:
            return []
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fn()
            b.sync()
        top = top_kernels(prof, 3, n=6)
        b.log("  kernels per call: " + ", ".join(f"{k['name'][:48]} {k['us']:.0f} µs" for k in top))
        return top
    for op, (decode_fn, rows_fn) in kernels.items():
        t = b.time_events_us(decode_fn, name=f"{op}:decode")
        b.add("glue", f"{op}:decode_kernel", t, 0.0, "copy", tokens=T, kernels=kernels_of(decode_fn))
        want = decode_fn() if rows_ok else ()  # what every geometry is checked against (one call, not one each)
        for geo in geometries if rows_ok else ():
            def check(geo=geo) -> bool:
                ok = True
                for i, (o, r) in enumerate(zip(rows_fn(geo), want)):
                    od = torch.float32 if o.dtype == torch.float32 else torch.bfloat16
                    ok = b.check_ulps(f"mhc_rows:{op}:{geo.name}.{i}", o, r, od, 3.0 if (
                        op != "hc_post" and o.ndim == 2 and od != torch.float32) else 1.0) and ok
                return ok
            if b.guard(f"mhc rows {op} {geo.name}", check):
                t = b.time_events_us(lambda geo=geo: rows_fn(geo), name=f"{op}:rows {geo.name}")
                b.add("glue", f"{op}:rows_kernel:{geo.name}", t, 0.0, "copy", tokens=T, geometry=geo.name,
                      kernels=kernels_of(lambda geo=geo: rows_fn(geo)))
    # the attention output's inverse RoPE: [T, heads, head_dim], angles per token
    o = torch.randn(T, a.n_heads, a.head_dim, device=dev, generator=gen).to(torch.bfloat16)
    ang = torch.rand(T, 1, a.rope_head_dim // 2, device=dev, generator=gen) * 6.28
    c, sn = ang.cos(), ang.sin()
    ref = ReferenceOps(Numerics(exact_reductions=False))
    if b.guard("rope", lambda: b.check_ulps("rope", nrq.rope_rows(o, c, sn, True), ref.rope(o, c, sn, True),
                                            torch.bfloat16, 1.0)):
        t = b.time_events_us(lambda: nrq.rope_rows(o, c, sn, True), name="rope")
        b.add("glue", "rope:kernel", t, 0.0, "copy", tokens=T, gbps=round(2 * o.numel() * 2 / (t * 1e-6) / 1e9, 1))
    t = b.time_events_us(lambda: ref.rope(o, c, sn, True))
    b.add("glue", "rope:torch", t, 0.0, "copy", tokens=T)


# ============================================================================================ attention side
def prefill_attention_inputs(a, T: int, ratio: int, device, gen):
    """q, kv_all, idx, sink for one chunk of ``T`` tokens from position 0 laid out as the model does: window
    history (empty), the chunk's own rows, then the compressed entries; CSA picks ``index_topk`` of the
    visible entries at random, HCA attends to every visible one."""
    W, H, d = a.window_size, a.n_heads, a.head_dim
    n_ent = T // ratio
    q = torch.randn(1, T, H, d, device=device, generator=gen).to(torch.bfloat16)
    kv = torch.randn(1, W + T + n_ent, d, device=device, generator=gen).to(torch.bfloat16)
    p = torch.arange(T, device=device)
    u = torch.arange(W, device=device)
    win = torch.where((p[:, None] - (W - 1) + u[None]) >= 0, p[:, None] + 1 + u[None], -1)
    visible = (p + 1) // ratio
    if ratio == 4:
        k = min(a.index_topk, n_ent)
        keys = torch.rand(T, max(n_ent, 1), device=device, generator=gen)
        keys = keys.masked_fill(torch.arange(max(n_ent, 1), device=device)[None] >= visible[:, None], -1.0)
        sel = keys.topk(k, dim=-1)
        ent = torch.where(sel.values >= 0, sel.indices + W + T, -1)
    else:
        e = torch.arange(n_ent, device=device)
        ent = torch.where(e[None] < visible[:, None], e[None] + W + T, -1)
    idx = torch.cat((win, ent), -1)[None].to(torch.int32)
    sink = torch.randn(H, device=device, generator=gen)
    return q, kv, idx, sink


def bench_attention(b: PrefillBench, args, gen, passed: set[str], tokens) -> None:
    from dsv4lab_kernels import attention_prefill as ap
    a, dev = args, b.device
    configs = [c for c in ATTENTION_CONFIGS if f"attn:{c}" in passed]
    for T in tokens:
        if b.over_budget(f"attention @{T}"):
            return
        for ratio, kind in ((4, "csa"), (max(a.compress_ratios), "hca")):
            q, kv, idx, sink = prefill_attention_inputs(a, T, ratio, dev, gen)
            valid = float((idx >= 0).sum())
            flops = 4.0 * a.n_heads * a.head_dim * valid
            for cfg in configs:
                t = b.guard(f"attn {cfg}", lambda: b.time_events_us(
                    lambda: ap.sparse_attention(q, kv, idx, sink, a.softmax_scale, config=cfg), name=f"attn:{cfg}"))
                if t:
                    b.add("attn_prefill", f"{kind}:{cfg}", t, flops, "bf16", tokens=T, attended_rows=int(valid))
        # the indexer of a CSA layer: the causal selection (visible keys only), and the full score matrix
        n_keys = T // 4
        qi = torch.randn(1, T, a.index_n_heads, a.index_head_dim, device=dev, generator=gen).to(torch.bfloat16)
        wi = (torch.randn(1, T, a.index_n_heads, device=dev, generator=gen) * 0.1).to(torch.bfloat16)
        keys = torch.randn(1, n_keys, a.index_head_dim, device=dev, generator=gen).to(torch.bfloat16)
        pos = torch.arange(T, device=dev)[None]
        visible_pairs = float(((torch.arange(T, device=dev) + 1) // 4).sum())
        useful = 2.0 * a.index_n_heads * a.index_head_dim * visible_pairs
        for cfg in INDEXER_CONFIGS:
            if f"indexer_select:{cfg}" not in passed:
                continue
            t = b.guard("indexer_select", lambda: b.time_events_us(
                lambda: ap.indexer_select(qi, wi, keys, pos, 4, a.index_topk, config=cfg), name=f"select:{cfg}"))
            if t:
                b.add("indexer", f"select:{cfg}", t, useful, "bf16", tokens=T, entries=n_keys)
        if "indexer_scores" in passed:
            t = b.guard("indexer_scores", lambda: b.time_events_us(lambda: ap.indexer_scores(qi, wi, keys),
                                                                   name="indexer_scores"))
            if t:
                b.add("indexer", "scores:all_keys", t, 2.0 * T * a.index_n_heads * n_keys * a.index_head_dim,
                      "bf16", tokens=T)
        if "indexer_topk" in passed:
            scores = ap.indexer_scores(qi, wi, keys)
            t = b.guard("indexer_topk", lambda: b.time_events_us(lambda: ap.indexer_topk(scores, pos, 4, a.index_topk),
                                                                 name=f"topk:{n_keys}"))
            if t:
                b.add("indexer", "topk", t, 0.0, "copy", tokens=T, entries=n_keys,
                      gbps=round(scores.numel() * 2 / (t * 1e-6) / 1e9, 1))
        if "compressor_pool" in passed:
            nb = T // 4
            kvs = torch.randn(nb, 8, a.head_dim, device=dev, generator=gen)
            scs = torch.randn(nb, 8, a.head_dim, device=dev, generator=gen)
            t = b.guard("pool", lambda: b.time_events_us(lambda: ap.compressor_pool(kvs, scs), name="pool"))
            if t:
                b.add("compressor_pool", "csa_main", t, 0.0, "copy", tokens=T,
                      gbps=round(2 * kvs.numel() * 4 / (t * 1e-6) / 1e9, 1))


# ============================================================================================ chunked layers
# the ops of the interface a layer's forward calls (helpers and state hygiene are not ops of their own)
def layer_roofline(a, tokens: int, chunk: int, peaks: dict, ratio: int) -> dict:
    """Roofline time of each op of one layer's prefill (cost model), and the attention / indexer shares."""
    one = a.replace(n_layers=1, n_mtp_layers=0, n_hash_layers=0, compress_ratios=(ratio,))
    cost = costmodel.prefill(one, tokens=tokens, chunk=chunk)
    bw = peaks["copy_gbps"] * 1e9
    per_op = {}
    for op in cost.compute_ops:
        if op.name in ("embed", "head", "sample") or op.name.startswith("final."):
            continue
        if op.kind == "matmul":
            peak = peaks["fp8_tflops"] if op.weight_format in ("fp8", "fp4") else peaks["bf16_tflops"]
        elif op.kind in ("attention", "indexer"):
            peak = peaks["bf16_tflops"]
        else:
            peak = None
        t_flops = op.flops_rank / (peak * 1e12) if peak else 0.0
        per_op[op.name] = max(t_flops, op.bytes_rank / bw)
    total = sum(per_op.values())
    idx_t = per_op.get("indexer.score", 0.0) + per_op.get("indexer.topk", 0.0)
    return dict(layer_us=total * 1e6, attention_us=per_op.get("attn.core", 0.0) * 1e6, indexer_us=idx_t * 1e6,
                attention_share=per_op.get("attn.core", 0.0) / total, indexer_share=idx_t / total)


class LayerBench:
    """One real-dims layer (random weights) through ``TritonOps``, prefilled in chunks, op times by CUDA event.

    Every op call the layer makes is timed (an op called inside another — a composite's parts — counts in its
    caller's time), so ``untimed_us`` = the layer's time − the ops' is the torch glue between the ops (index
    arithmetic, concatenations, cache writes) and any time the GPU waited for the host; ``host_us`` is how long
    the host took to issue the layer (near the layer's time: the host is the limit)."""

    def __init__(self, b: PrefillBench, args, gen, ratio: int, max_tokens: int, settings: dict | None = None):
        self.b, self.torch = b, torch
        self.a = args.replace(max_seq_len=-(-max(max_tokens, args.max_seq_len) // 128) * 128)
        a, dev = self.a, b.device
        self.layer = next(i for i in range(a.n_layers) if a.compress_ratios[i] == ratio and not a.is_hash_layer(i))
        self.ratio = ratio
        self.blk = Block(a, self.layer)
        materialize_random(self.blk, dev, gen)
        nm = Numerics(exact_reductions=False)  # production semantics; torch's fp32 reductions for the glue ops
        from dsv4lab.engine.triton_backend import TritonOps  # imports triton
        self.ops = TritonOps(nm)
        for key, value in (settings or {}).items():  # prefill settings measured earlier in this run
            setattr(self.ops, f"prefill_{key}", value)
        self.blk.attn.allocate(1, a.max_seq_len, nm.act, nm.acc, dev)
        self.X = (torch.randn(1, max_tokens, a.hc_mult, a.dim, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
        self.ids = torch.zeros(1, max_tokens, dtype=torch.long, device=dev)
        self.host_us = 0.0
        self.timer = OpTimer(self.ops, OP_NAMES, cuda=b.cuda).install()  # every op, for the layer's lifetime

    def prefill(self, total: int, chunk: int) -> None:
        torch, dev = self.torch, self.b.device
        self.blk.attn.reset(None, self.ops)
        for p in range(0, total, chunk):
            c = min(chunk, total - p)
            self.blk(self.X[:, p:p + c], torch.tensor([p], device=dev), torch.tensor([c], device=dev),
                     torch.tensor([0], device=dev), self.ids[:, p:p + c], self.ops)

    def time(self, total: int, chunk: int) -> tuple[float, dict, float]:
        """One prefill of ``total`` tokens: its time in µs, the time of each op inside it, and the host's time to
        issue it (µs)."""
        torch, b = self.torch, self.b
        self.timer.clear()
        if not b.cuda:
            t = time.perf_counter()
            self.prefill(total, chunk)
            return (time.perf_counter() - t) * 1e6, {}, (time.perf_counter() - t) * 1e6
        b.l2_flush_buffer().zero_()
        b.sync()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        t_host = time.perf_counter()
        self.prefill(total, chunk)
        self.host_us = (time.perf_counter() - t_host) * 1e6
        e.record()
        b.sync()
        return s.elapsed_time(e) * 1e3, self.timer.totals_us(), self.host_us


def measured_moe_settings(b: PrefillBench, headline: int) -> dict:
    """The grouped-MoE settings the rows measured so far pick (route, launch variant, sorter rows), as
    ``TritonPrefillOps`` settings: the layers of this run use them before the choices are written."""
    c = choices(b, headline)
    if "moe_route" not in c:
        return {}
    rows = dict(c.get("moe_rows_by_tokens", [])).get(headline)
    # the variant's decode/scheduling/scale fields too: unset, they would come from the committed choices
    return dict(moe_route=c["moe_route"], moe_tag=c["moe_tag"], moe_decode=c["moe_decode"],
                moe_persistent=c["moe_persistent"], moe_scale_per_byte=c["moe_scale_per_byte"],
                **({"moe_rows": rows} if rows else {}))


def bench_chunks(b: PrefillBench, args, gen, prompts, chunks, ratios, reps: int, headline: int) -> None:
    """Each prompt length in each chunk size (0: one shot) through one layer per compression ratio."""
    settings = measured_moe_settings(b, headline)
    if settings:
        b.log(f"layers with the MoE settings measured above: {settings}")
    for ratio in ratios:
        if b.over_budget(f"chunked layer ratio {ratio}"):
            return
        lb = LayerBench(b, args, gen, ratio, max(prompts), settings)
        kind = {4: "csa", 0: "swa"}.get(ratio, "hca")
        for total in prompts:
            for chunk in chunks:
                c = total if chunk == 0 else chunk
                if (chunk and chunk >= total) or b.over_budget(f"layer {kind} {total} chunk {chunk}"):
                    continue
                if b.guard(f"layer warm-up {kind} {total}/{c}", lambda: lb.time(total, c)) is None:
                    continue
                runs = [b.guard(f"layer {kind} {total}/{c}", lambda: lb.time(total, c)) for _ in range(reps)]
                runs = sorted((r for r in runs if r is not None), key=lambda r: r[0])
                if not runs:
                    continue
                t, per_op, host = runs[len(runs) // 2]
                row = b.add("chunked_prefill", f"{kind}_layer{lb.layer}", t, 0.0, "bf16", tokens=total, chunk=chunk,
                            tok_per_s=round(total / (t * 1e-6)), host_us=round(host, 1),
                            untimed_us=round(t - sum(per_op.values()), 1),
                            op_us={k: round(v, 1) for k, v in sorted(per_op.items(), key=lambda kv: -kv[1])})
                if b.peaks.get("copy_gbps"):
                    roof = layer_roofline(args, total, c, b.peaks, ratio)
                    att = per_op.get("sparse_attention", 0.0)
                    idx_t = per_op.get("indexer_select", 0.0)
                    row.update(roofline_layer_us=round(roof["layer_us"], 1),
                               attention_share=round(att / t, 4),
                               attention_roofline_share=round(roof["attention_share"], 4),
                               indexer_share=round(idx_t / t, 4),
                               indexer_roofline_share=round(roof["indexer_share"], 4))
                b.log(f"{kind} layer, {total} tokens in chunks of {c}: {t / 1e3:.2f} ms (host {host / 1e3:.2f} ms); "
                      f"between the ops {row['untimed_us']:.0f} µs; ops (µs): "
                      + ", ".join(f"{k} {v:.0f}" for k, v in row["op_us"].items()))
        b.log("backend report:\n" + lb.ops.report())
        del lb
        if b.cuda:
            torch.cuda.empty_cache()


# ============================================================================================ driver
def run_suite(args) -> int:
    smoke = getattr(args, "smoke", False)
    quick = getattr(args, "quick", False) and not smoke
    device = select_device("prefill", smoke)
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    for name in ("fp8_gemm", "moe_sort", "fp4_moe_grouped", "attention_prefill"):
        kernel_module(name)  # registers dsv4lab_kernels from the source tree when it is not installed
    b = PrefillBench(device, getattr(args, "budget_s", 160.0), smoke)
    gen = torch.Generator(device=device).manual_seed(0)
    a = get_preset("tiny" if smoke else "flash")
    mode = "smoke" if smoke else ("quick" if quick else "full")
    if smoke:
        tokens, abl, prompts, chunks, headline, reps = (64,), 64, (64,), (32, 0), 64, 1
    elif quick:
        tokens, abl, prompts, chunks, headline, reps = (4096,), 2048, (2048, 4604), (2048, 4096, 0), 4096, 2
    else:
        tokens, abl, prompts, chunks, headline, reps = TOKENS, 2048, PROMPTS, CHUNKS, 4096, 3
    doc = run_header(b, args, smoke)
    routes_arg = getattr(args, "moe_routes", None) or ",".join(QUICK_ROUTES if quick else MOE_ROUTES)
    routes = tuple(r for r in routes_arg.split(",") if r)
    abl_route = getattr(args, "ablation_route", "bf16")
    if abl_route not in routes:
        raise UserError(f"--ablation-route {abl_route!r} is not among --moe-routes {','.join(routes)}")
    bad = [r for r in routes if r not in MOE_ROUTES]
    if bad:
        raise UserError(f"--moe-routes: unknown route(s) {', '.join(bad)}; known: {', '.join(MOE_ROUTES)}")
    plan = plan_variants(mode, routes, abl_route)
    chosen = pick_sections(getattr(args, "sections", None), SECTIONS, SECTIONS)
    b.record_ceilings()
    b.log(f"checks ({b.elapsed():.0f} s)")
    # the glue checks its own kernels and the chunk choice runs the backend as the engine does; the other sections
    # time only what these checks passed
    passed = run_checks(b, a, gen, plan) if set(chosen) - {"glue", "chunks"} else set()
    moe: dict = {}

    def moe_bench() -> MoEBench:
        if "bench" not in moe:
            moe["bench"] = MoEBench(b, a, gen, passed)
        return moe["bench"]

    def release_moe() -> None:
        moe.clear()  # the 3.2 GB bank: the layers below bring their own
        if b.cuda:
            torch.cuda.empty_cache()

    ratios = (4,) if (quick or smoke) else (4, max(a.compress_ratios))
    # most important first: the watchdog cuts from the end
    sections = [  # (section of --sections, name in the log, work)
        ("moe", "moe", lambda: bench_moe_headline(b, moe_bench(), routes, headline, plan, abl, abl_route,
                                                  quick or smoke)),
        ("moe", "release", release_moe),
        ("chunks", "chunk choice", lambda: bench_chunks(b, a, gen, prompts, chunks, ratios, reps, headline)),
        ("dense", "dense gemms", lambda: bench_dense(b, a, gen, passed, headline)),
        # smoke: 24 rows (a partial 16-row block) — the interpreter's cost is per row, and the script is what it checks
        ("glue", "glue", lambda: bench_glue(b, a, gen, 24 if smoke else headline)),
        ("attention", "attention", lambda: bench_attention(b, a, gen, passed, (headline,))),
    ]
    if not (quick or smoke):
        sections += [
            ("moe", "moe sweep", lambda: bench_moe_sweep(b, moe_bench(), routes, tokens, headline)),
            ("moe", "release", release_moe),
            ("dense", "dense sweep", lambda: [bench_dense(b, a, gen, passed, T) for T in tokens if T != headline]),
            ("attention", "attention sweep",
             lambda: bench_attention(b, a, gen, passed, [t for t in tokens if t != headline])),
        ]
    # forward-only, as the engine runs: tensors one section caches (made in inference mode by the layer timings)
    # are updated in place by the next (on the H200 the dense GEMMs failed on such an inference tensor)
    with torch.inference_mode():
        b.run_sections([(name, work) for section, name, work in sections if section in chosen])
    doc.update(mode=mode, sections=list(chosen), peaks=b.peaks, checks=b.checks,
               rows=b.rows, skipped=b.skipped, errors=b.errors, compile_s=b.compile_s,
               elapsed_s=round(b.elapsed(), 1), diagnostics=diagnostics(b), choices=choices(b, headline),
               targets=targets(b, headline))
    out = output_path(args, "prefill")
    write_json(out, doc)
    print_summary(doc)
    print(f"wrote {out}")
    return 0 if all(c["ok"] for c in b.checks if c["gating"]) and not b.errors else 1


# ============================================================================================ conclusions
def diagnostics(b: PrefillBench) -> dict:
    """What this GPU supports of the fast paths (and why not), for whoever reads the result file next."""
    if not b.cuda:
        return dict(note="CPU interpreter: the inline-PTX decode and cuBLAS are GPU-only")
    from dsv4lab_kernels import fp4_moe_grouped as fm
    from dsv4lab_kernels import fp8_gemm as fg
    from dsv4lab_kernels import mhc
    return dict(moe_asm_decode=fm.asm_decode_status(b.device), cublas_block_fp8=fg.cublas_unavailable_reason(b.device),
                cublas_bf16_fp32_out=fg.cublas_bf16_reason(b.device), mhc_rows_kernel=mhc.rows_kernel_status(b.device))


def _rows(b: PrefillBench, kernel: str, **match) -> list[dict]:
    return [r for r in b.rows if r["kernel"] == kernel and all(r.get(k) == v for k, v in match.items())]


def choices(b: PrefillBench, headline: int) -> dict:
    """The settings the measurements pick (read back by ``triton_prefill.load_choices``); ``why`` says from what."""
    out: dict = {"why": {}}
    moe = [r for r in _rows(b, "moe_grouped_gemm", tokens=headline) if r["variant"].endswith(":total")]
    if moe:
        best = min(moe, key=lambda r: r["time_us"])
        route_tag = best["variant"].split(":")[0]
        route, _, tag = route_tag.partition("+")
        out.update(moe_route=route, moe_tag=tag, moe_decode=MOE_TAGS[tag].get("decode", "auto"),
                   moe_persistent=MOE_TAGS[tag].get("persistent", False),
                   moe_scale_per_byte=MOE_TAGS[tag].get("scale_per_byte", False))
        out["why"]["moe"] = f"fastest at {headline} tokens: {best['variant']} rows {best['sorter_rows']} " \
                            f"{best['time_us'] / 1e3:.2f} ms"
    rows_table = []
    for T in sorted({r["tokens"] for r in moe} | {r["tokens"] for r in _rows(b, "moe_grouped_gemm")}):
        cands = [r for r in _rows(b, "moe_grouped_gemm", tokens=T) if r["variant"].endswith(":total")
                 and r["variant"].split(":")[0] == out.get("moe_route", "bf16")]
        if cands:
            rows_table.append([T, min(cands, key=lambda r: r["time_us"])["sorter_rows"]])
    if rows_table:
        out["moe_rows_by_tokens"] = rows_table
    lin = {}
    for r in _rows(b, "fp8_gemm", tokens=headline):
        name, _, impl = r["variant"].partition(":")
        if impl in ("linear:cublas", "linear:triton"):
            lin.setdefault(impl.split(":")[1], 0.0)
            lin[impl.split(":")[1]] += r["time_us"]
    if len(lin) == 2:
        out["gemm_backend"] = min(lin, key=lin.get)
        out["why"]["gemm_backend"] = ", ".join(f"{k} {v / 1e3:.2f} ms" for k, v in lin.items()) + \
            f" for the FP8 projections of a layer at {headline} tokens"
    # bf16-activation GEMMs: cuBLAS (as the backend runs it) against the first Triton configuration, in total over
    # the projections both timed
    wg: dict[str, dict[str, float]] = {}
    for r in _rows(b, "weight_gemm", tokens=headline):
        name, _, impl = r["variant"].partition(":")
        if impl == "cublas" or impl == WEIGHT_GEMM_CONFIGS[0]:
            wg.setdefault(name, {})["cublas" if impl == "cublas" else "triton"] = r["time_us"]
    both = {k: v for k, v in wg.items() if len(v) == 2}
    if both:
        tot = {impl: sum(v[impl] for v in both.values()) for impl in ("cublas", "triton")}
        out["weight_gemm_backend"] = min(tot, key=tot.get)
        out["why"]["weight_gemm_backend"] = ", ".join(f"{k} {v / 1e3:.2f} ms" for k, v in tot.items()) + \
            f" for {', '.join(sorted(both))} at {headline} tokens"
    glue_tokens = max((r["tokens"] for r in _rows(b, "glue")), default=headline)  # a smoke run's chunk is smaller
    glue = {r["variant"]: r["time_us"] for r in _rows(b, "glue", tokens=glue_tokens)}
    dec = [glue.get(f"{op}:decode_kernel") for op in MHC_OPS]
    rows_total = {}  # geometry → the three ops' time, for the geometries every op was timed at
    for r in _rows(b, "glue", tokens=glue_tokens):
        geo = r.get("geometry")
        if geo and all(f"{op}:rows_kernel:{geo}" in glue for op in MHC_OPS):
            rows_total[geo] = sum(glue[f"{op}:rows_kernel:{geo}"] for op in MHC_OPS)
    if all(v is not None for v in dec) and rows_total:
        best = min(rows_total, key=rows_total.get)
        out["mhc_rows"] = rows_total[best] < sum(dec)
        out["mhc_rows_geometry"] = best
        out["why"]["mhc_rows"] = f"mHC of a {glue_tokens}-row chunk: rows kernel " + ", ".join(
            f"{g} {v / 1e3:.2f} ms" for g, v in sorted(rows_total.items(), key=lambda kv: kv[1])) + \
            f"; decode kernels {sum(dec) / 1e3:.2f} ms"
    chunk_rows = _rows(b, "chunked_prefill")
    table = []
    for total in sorted({r["tokens"] for r in chunk_rows}):
        per_chunk: dict = {}
        for r in chunk_rows:
            if r["tokens"] == total:
                per_chunk.setdefault(r["chunk"], []).append(r["time_us"])
        n_kinds = max(len(v) for v in per_chunk.values())
        full = {c: sum(v) for c, v in per_chunk.items() if len(v) == n_kinds}  # every layer kind measured
        if full:
            table.append([total, min(full, key=full.get)])
    if table:
        out["chunk_by_prompt"] = table
        out["why"]["chunk"] = "fastest chunk (0 = one shot) per prompt length, summed over the measured layer kinds"
    return out


def targets(b: PrefillBench, headline: int) -> dict:
    """The issue's targets, measured: grouped MoE %-of-peak at 4,096 tokens; FP8 GEMM vs cuBLAS; attention and
    indexer shares of a layer against their roofline shares."""
    moe = [r for r in _rows(b, "moe_grouped_gemm", tokens=headline) if r["variant"].endswith(":total")]
    best = max((r for r in moe if r["pct_peak"] is not None), key=lambda r: r["pct_peak"], default=None)
    fastest = min(moe, key=lambda r: r["time_us"], default=None)
    out = dict(moe_best_pct=None if best is None else dict(
        tokens=headline, variant=best["variant"], sorter_rows=best["sorter_rows"], pct_peak=best["pct_peak"],
        peak_kind=best["peak_kind"], tflops=best["tflops"], time_ms=round(best["time_us"] / 1e3, 3),
        met=best["pct_peak"] >= 50), moe_fastest=None if fastest is None else dict(
        tokens=headline, variant=fastest["variant"], sorter_rows=fastest["sorter_rows"],
        time_ms=round(fastest["time_us"] / 1e3, 3), pct_peak=fastest["pct_peak"], peak_kind=fastest["peak_kind"]))
    gemm = []
    for r in _rows(b, "fp8_gemm", tokens=headline):
        name, _, impl = r["variant"].partition(":")
        if impl == "cublas":
            tri = [t["time_us"] for t in _rows(b, "fp8_gemm", tokens=headline)
                   if t["variant"].startswith(f"{name}:triton:")]
            if tri:
                gemm.append(dict(projection=name, cublas_us=r["time_us"], triton_best_us=min(tri),
                                 triton_over_cublas=round(min(tri) / r["time_us"], 3), met=min(tri) <= r["time_us"]))
    out["fp8_gemm_vs_cublas"] = gemm
    out["layer_shares"] = [dict(layer=r["variant"], tokens=r["tokens"], chunk=r["chunk"],
                                attention=r["attention_share"], attention_roofline=r["attention_roofline_share"],
                                indexer=r["indexer_share"], indexer_roofline=r["indexer_roofline_share"],
                                met=r["attention_share"] <= r["attention_roofline_share"]
                                and r["indexer_share"] <= r["indexer_roofline_share"])
                           for r in _rows(b, "chunked_prefill") if "attention_share" in r]
    return out


def print_summary(doc: dict) -> None:
    """A summary a reader without the code can act on: ceilings, failed checks, headline rows, choices, targets."""
    p = doc["peaks"]
    checks = [c for c in doc["checks"] if c["gating"]]
    print(f"\nprefill kernels ({doc['mode']} run) on {doc['gpu']} (torch {doc['torch']}, triton {doc['triton']}, "
          f"commit {doc['commit']}), {doc['elapsed_s']} s")
    print(f"ceilings measured now: copy {p.get('copy_gbps')} GB/s, bf16 {p.get('bf16_tflops')} TFLOP/s, fp8 "
          f"{p.get('fp8_tflops')} TFLOP/s (8192³, per-tensor scales)")
    print(f"fast paths here: {doc.get('diagnostics')}")
    print(f"checks: {sum(c['ok'] for c in checks)}/{len(checks)} within their bounds; errors {len(doc['errors'])}; "
          f"skipped {len(doc['skipped'])}")
    for c in checks:
        if not c["ok"]:
            print("  FAILED " + c["line"])
    for e in doc["errors"]:
        print("  ERROR " + e[:300])
    print(f"\n{'kernel':<17}{'variant':<34}{'tokens':>7}{'rows':>5}{'chunk':>6}{'time_us':>11}{'TFLOP/s':>9}"
          f"{'% peak':>12}")
    head = max((r["tokens"] or 0) for r in doc["rows"]) if doc["rows"] else 0
    head = 4096 if any(r["tokens"] == 4096 for r in doc["rows"]) else head
    for r in doc["rows"]:
        if r["tokens"] != head and r["kernel"] not in ("chunked_prefill",) and not (
                r["kernel"] == "moe_grouped_gemm" and r["variant"].endswith(":total")):
            continue
        tflops = f"{r['tflops']:.1f}" if r["tflops"] is not None else ""
        pct = f"{r['pct_peak']:.1f} {r['peak_kind']}" if r["pct_peak"] is not None else ""
        print(f"{r['kernel']:<17}{r['variant'][:33]:<34}{r['tokens'] or '':>7}{r['sorter_rows'] or '':>5}"
              f"{'' if r['chunk'] is None else r['chunk']:>6} {r['time_us']:>10.1f}{tflops:>9}{pct:>12}")
    c = doc.get("choices", {})
    print("\nchoices (read by dsv4lab.engine.triton_prefill.load_choices on this GPU):")
    for k, v in c.items():
        if k != "why":
            print(f"  {k} = {v}")
    for k, v in c.get("why", {}).items():
        print(f"  ({k}: {v})")
    t = doc.get("targets", {})
    m = t.get("moe_best_pct")
    if m:
        print(f"\ntarget grouped MoE @{m['tokens']} ≥ 50% of the peak of its dtype: {m['pct_peak']}% "
              f"{m['peak_kind']} ({m['variant']}, rows {m['sorter_rows']}, {m['time_ms']} ms) → "
              f"{'met' if m['met'] else 'MISSED'}")
    f = t.get("moe_fastest")
    if f:
        print(f"fastest grouped MoE @{f['tokens']}: {f['variant']} rows {f['sorter_rows']}, {f['time_ms']} ms")
    for g in t.get("fp8_gemm_vs_cublas", []):
        print(f"target FP8 GEMM {g['projection']}: Triton best {g['triton_best_us']:.1f} µs vs cuBLAS "
              f"{g['cublas_us']:.1f} µs → {'met' if g['met'] else 'slower: the backend dispatches to cuBLAS'}")
    for s in t.get("layer_shares", []):
        print(f"target shares, {s['layer']} {s['tokens']} tokens chunk {s['chunk']}: attention {s['attention']:.3f} "
              f"(roofline {s['attention_roofline']:.3f}), indexer {s['indexer']:.3f} (roofline "
              f"{s['indexer_roofline']:.3f}) → {'met' if s['met'] else 'MISSED'}")
