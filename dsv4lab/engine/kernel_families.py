"""Every kernel family's variants, declared once: `verify kernels`, the benchmarks and the dispatch read these tables.

A **family** is one kernel module of ``dsv4lab_kernels`` (or one entry point of it) with the ops of
:class:`~dsv4lab.core.model.ops.ReferenceOps` it implements, its **routes** (code paths of different arithmetic)
with the accumulation model each is judged under (a name of :data:`dsv4lab.tools.verify.bounds.UNIT_ROUNDOFF`),
and its **variants**. A :class:`Variant` is a route plus launch fields (``geometry``: fields of the family's
geometry class, or a named configuration of the kernel module), the lists it belongs to (``runs``) and where it
applies:

=========== ======================================================================================================
run         who iterates the variants marked with it
=========== ======================================================================================================
``verify``  ``verify kernels`` (``TritonOps.variants``): each variant of an op is checked against the reference
            under its route's accumulation model; ``ops`` narrows a variant to some of the family's ops
``smoke``   ``bench kernels --smoke`` (tiny shapes, the interpreter included: checks the script)
``quick``   ``bench kernels --quick`` (a first probe of a GPU visit)
``full``    ``bench kernels`` (every variant the tuned file may choose from)
=========== ======================================================================================================

The fields of a verification variant are laid over the geometry the backend would otherwise launch: the device
default of :mod:`dsv4lab.engine.dispatch` for the routed MoE and the decode attention, the kernel's own defaults for
the GEMV (whose default is per shape). A benchmark variant's fields are laid over the kernel's defaults.

The kernels' launch geometries themselves (the dataclasses, the named configurations such as
``fp8_gemm.FP8_GEMM_CONFIGS``) stay in the kernel modules; ``tests/test_dispatch.py`` checks that every variant
here builds one and that the routes and accumulation models agree with the kernels' own tables. This module is
plain data: it imports neither torch nor triton.
"""
from __future__ import annotations

from dataclasses import dataclass, field

RUNS = ("verify", "smoke", "quick", "full")


@dataclass(frozen=True)
class Variant:
    """One way to run a family's kernel (see the module docstring).

    Attributes:
        name: unique within the family and route; benchmark rows and ``verify kernels`` name it so.
        route: the code path (None: any route, e.g. a launch variant shared by the routes).
        geometry: ``(field, value)`` pairs over the base geometry (:attr:`fields`).
        runs: the lists it belongs to (a subset of :data:`RUNS`).
        ops: the ops it is a verification variant of (empty: every op of its family).
        min_rows: fewest token rows it applies to (``prequant`` quantizes rows once: worth it from two).
        act_quant_only: applies only where activations are quantized.
    """

    name: str
    route: str | None = None
    geometry: tuple = ()
    runs: frozenset = frozenset()
    ops: tuple = ()
    min_rows: int = 1
    act_quant_only: bool = False

    @property
    def fields(self) -> dict:
        return dict(self.geometry)

    def applies(self, rows: int, act_quant: bool) -> bool:
        return rows >= self.min_rows and (act_quant or not self.act_quant_only)


def variant(name: str, route: str | None = None, runs: str = "full", ops: tuple = (), min_rows: int = 1,
            act_quant_only: bool = False, **geometry) -> Variant:
    """A :class:`Variant`; ``runs`` as space-separated names of :data:`RUNS`."""
    bad = set(runs.split()) - set(RUNS)
    if bad:
        raise ValueError(f"variant {name}: unknown run(s) {sorted(bad)}; known: {RUNS}")
    return Variant(name, route, tuple(sorted(geometry.items())), frozenset(runs.split()), tuple(ops), min_rows,
                   act_quant_only)


@dataclass(frozen=True)
class Family:
    """A kernel family: where it lives, what it implements, how its routes accumulate, its variants."""

    name: str
    kernel: str
    geometry_class: str | None
    ops: tuple
    accumulation: dict = field(hash=False)
    variants: tuple = ()

    def accumulation_of(self, route: str | None) -> str:
        """The accumulation model of ``route`` (a family without routes has one model, under ``"*"``)."""
        model = self.accumulation.get(route) if route is not None else None
        if model is None:
            model = self.accumulation.get("*")
        if model is None:
            raise ValueError(f"{self.name}: no accumulation model for route {route!r} "
                             f"(known: {sorted(self.accumulation)})")
        return model

    def runs(self, run: str, op: str | None = None) -> list[Variant]:
        """The variants of ``run`` in declaration order (for ``verify``: those of ``op``)."""
        return [v for v in self.variants if run in v.runs and (op is None or not v.ops or op in v.ops)]


# ============================================================================================ decode
def _gemv(route: str, bn: int, bk: int, warps: int, stages: int = 3, unroll: int = 1, prequant: bool = False,
          runs: str = "full") -> Variant:
    """A benchmarked GEMV configuration (K split per shape to about two programs per SM by the benchmark)."""
    name = f"{route}:n{bn}k{bk}w{warps}p{stages}" + (f"u{unroll}" if unroll > 1 else "") + (":pq" if prequant else "")
    return variant(name, route, runs, min_rows=2 if prequant else 1, act_quant_only=prequant, block_n=bn,
                   block_k=bk, num_warps=warps, num_stages=stages, unroll=unroll, prequant=prequant)


GEMV = Family(
    "decode.gemv", "fp8_gemv", "GemvGeometry", ("linear", "linear_f32", "grouped_wo_a", "linear_group",
                                                "linear_f32_group"),
    # fma: fp32 FMA (c = 1); dot: tensor-core blocks summed in fp32, cuBLAS bf16/fp32-out (c = 4)
    {"fma": "fp32", "dot": "fp32_tc4", "cublas": "fp32_tc4"},
    (variant("fma", "fma", "verify", ops=("linear", "linear_f32", "grouped_wo_a")),
     variant("dot", "dot", "verify", ops=("linear", "linear_f32", "grouped_wo_a")),
     variant("fma_split3", "fma", "verify", ops=("linear",), block_n=32, block_k=128, split_k=3),
     variant("dot_split3", "dot", "verify", ops=("linear",), block_n=32, block_k=128, split_k=3),
     _gemv("dot", 16, 128, 1, 1, runs="smoke"), _gemv("fma", 32, 128, 4, 1, runs="smoke"),
     _gemv("fma", 16, 128, 4, 1, unroll=2, runs="smoke"), _gemv("dot", 16, 128, 1, 1, prequant=True, runs="smoke"),
     # the quick five: the fma route's tiles and unrolls trade bytes in flight per SM at batch 1; dot plain and
     # with the rows quantized once (prequant, batch > 1)
     _gemv("fma", 32, 256, 4, runs="quick full"), _gemv("fma", 16, 256, 4, unroll=2, runs="quick full"),
     _gemv("fma", 64, 256, 8, runs="quick full"), _gemv("dot", 16, 256, 1, runs="quick full"),
     _gemv("dot", 64, 256, 4, prequant=True, runs="quick full"),
     _gemv("fma", 32, 512, 4), _gemv("fma", 32, 256, 4, unroll=2), _gemv("fma", 16, 512, 4),
     _gemv("fma", 64, 256, 4, unroll=2), _gemv("dot", 32, 256, 2), _gemv("dot", 64, 256, 4, 4),
     _gemv("dot", 32, 256, 2, prequant=True)))
"""The decode projections (``fp8_gemv``: FP8 and BF16 weights, one to 63 rows), beside cuBLAS."""


def _moe(route: str, name: str, bn: int, bk: int, warps: int, stages: int, runs: str = "full", **kw) -> Variant:
    return variant(name, route, runs, block_n_up=bn, block_n_down=bn, block_k=bk, num_warps=warps,
                   num_stages=stages, **kw)


MOE_SAME_SEMANTICS = ("dot", "fma", "dot_scaled")
"""The routes that evaluate the reference's quantization; ``int8`` is the paper's (judged by its own oracle)."""

MOE = Family(
    "decode.moe", "fp4_moe_decode", "MoeGeometry", ("routed_experts", "moe_stage1", "moe_stage2"),
    {"dot": "fp32_tc4", "fma": "fp32", "int8": "fp32", "dot_scaled": "fp32_tc4"},
    (*(variant(r, r, "verify") for r in MOE_SAME_SEMANTICS),
     variant("fma_slot_split2", "fma", "verify", ops=("routed_experts",), slot_split=2, block_k=128),
     variant("dot_token_major", "dot", "verify", ops=("routed_experts",), slot_split=1),
     *(_moe(r, "n16k128w1s1", 16, 128, 1, 1, runs="smoke") for r in ("dot", "fma", "int8", "dot_scaled")),
     _moe("dot", "n32k256w2s3", 32, 256, 2, 3, runs="quick full"), _moe("dot", "n16k256w1s2", 16, 256, 1, 2),
     _moe("dot", "n64k256w4s2", 64, 256, 4, 2), _moe("dot", "n16k512w1s2", 16, 512, 1, 2),
     _moe("dot", "n32k512w2s2", 32, 512, 2, 2), _moe("dot", "n32k256w2s3:token", 32, 256, 2, 3, slot_split=1),
     _moe("dot", "n32k256w2s3:plain", 32, 256, 2, 3, decode="plain"),
     _moe("dot", "n64k256w4s2:prequant", 64, 256, 4, 2, prequant=True),
     _moe("dot", "n32k256w2s3:prequant", 32, 256, 2, 3, prequant=True),
     # fma's first is the fastest the full suite measured (af2b4dc): at batch 1 the 16-row one-warp programs fill
     # each SM with only ~6 warps; more programs (8 rows), more warps, a deeper pipeline or longer K steps trade
     # bytes in flight against instructions per byte
     _moe("fma", "n8k256w1s2", 8, 256, 1, 2, runs="quick full"), _moe("fma", "n16k256w1s2", 16, 256, 1, 2),
     _moe("fma", "n32k256w2s2", 32, 256, 2, 2), _moe("fma", "n16k256w2s2", 16, 256, 2, 2),
     _moe("fma", "n16k256w1s3", 16, 256, 1, 3), _moe("fma", "n16k512w1s2", 16, 512, 1, 2),
     # continuing the direction the sweep pointed: 4 rows, a deeper pipeline, activations quantized once
     _moe("fma", "n4k256w1s2", 4, 256, 1, 2), _moe("fma", "n8k256w1s3", 8, 256, 1, 3),
     _moe("fma", "n8k256w1s2:prequant", 8, 256, 1, 2, prequant=True),
     # the route is issue-bound at batch 1 (scripts/kernel_sass.py: ~19 instructions per weight byte for ≲ 8 at
     # the copy bandwidth); position-wise accumulators drop the per-group sum tree from the loop
     _moe("fma", "n8k256w1s2:elem", 8, 256, 1, 2, fma_sums="element"),
     _moe("fma", "n8k256w1s2:elem:prequant", 8, 256, 1, 2, fma_sums="element", prequant=True),
     _moe("fma", "n16k256w1s2:elem", 16, 256, 1, 2, fma_sums="element"),
     # the fp16 codes four per 32-bit operation, each group's scale after its sum: ~12 / 15 instructions per weight
     # byte for gate/up / down with prequant against ~16 / 19 (scripts/kernel_sass.py, Triton 3.6); the first is
     # the batch-1 choice of the tuned H200 file, so a quick run times it too
     _moe("fma", "n8k256w1s2:bytewise:prequant", 8, 256, 1, 2, runs="quick full", decode="bytewise", prequant=True),
     _moe("fma", "n8k256w1s2:bytewise", 8, 256, 1, 2, decode="bytewise"),
     _moe("fma", "n16k256w1s2:bytewise:prequant", 16, 256, 1, 2, decode="bytewise", prequant=True),
     _moe("int8", "n16k256w1s2", 16, 256, 1, 2, runs="quick full"), _moe("int8", "n32k256w2s2", 32, 256, 2, 2),
     _moe("dot_scaled", "n16k256w1s2", 16, 256, 1, 2, runs="quick full"),
     _moe("dot_scaled", "n32k256w2s3", 32, 256, 2, 3)))
"""The routed FP4 MoE of the decode step (``fp4_moe_decode``): every route × launch geometry."""


def _attn(name: str, block_r: int, splits: int, warps: int = 8, two_pass: bool = True, runs: str = "full"):
    return variant(name, None, runs, block_h=16, block_r=block_r, splits=splits, num_warps=warps, two_pass=two_pass)


ATTENTION = Family(
    "decode.attention", "attention_decode", "AttentionGeometry",
    ("sparse_attention", "attention_from_caches", "indexer_select_decode"),
    {"*": "fp32_tc4"},  # bf16 dots on tensor cores, as the MoE's dot route
    (variant("splits1", None, "verify", ops=("sparse_attention",), splits=1, block_r=16, two_pass=True),
     variant("splits3", None, "verify", ops=("sparse_attention",), splits=3, block_r=16, two_pass=True),
     variant("online_splits3", None, "verify", ops=("sparse_attention",), splits=3, block_r=16, two_pass=False),
     _attn("h16r16_s1_2p", 16, 1, runs="smoke"), _attn("h16r16_s4_1p", 16, 4, two_pass=False, runs="smoke"),
     # s: slices of the selected rows, 1p: one pass with a running max, 2p: two passes
     _attn("h16r16_s1_2p", 16, 1), _attn("h16r32_s8_2p", 32, 8), _attn("h16r32_s8_1p", 32, 8, two_pass=False),
     _attn("h16r32_s16_1p", 32, 16, two_pass=False), _attn("h16r64_s16_1p", 64, 16, two_pass=False),
     _attn("h16r32_s32_1p", 32, 32, 4, two_pass=False),
     # the combine no longer walks the slices one after another: more, shorter slices may pay now
     _attn("h16r16_s32_1p", 16, 32, two_pass=False), _attn("h16r32_s32_1p_w8", 32, 32, 8, two_pass=False)))
"""The sparse attention of the decode step (``attention_decode``)."""


def _site(n: int, d: int, f: int, w: int, split_tail: bool = False) -> Variant:
    return variant(f"n{n}d{d}f{f}w{w}" + (":split_tail" if split_tail else ""), None, "full", splits=n, block_d=d,
                   block_dn=f, num_warps=w, **({"split_tail": True} if split_tail else {}))


MHC_SITE = Family(
    "decode.mhc_site", "mhc", "MhcSiteGeometry", ("hc_pre_norm", "hc_post_pre_norm", "hc_head"), {"*": "fp32"},
    # "default": no fields, the kernel's geometry for the row count (MhcSiteGeometry.for_rows)
    (variant("default", None, "smoke full"),
     *(_site(n, d, f, w) for n, d, f, w in ((64, 32, 2048, 8), (32, 32, 2048, 8), (256, 16, 2048, 8),
                                            (128, 32, 1024, 8), (128, 32, 512, 4), (128, 32, 2048, 4))),
     # the Sinkhorn beside the rows (≈ 4 µs of the default's 14, 196c88c)
     _site(128, 32, 2048, 8, split_tail=True), _site(64, 32, 2048, 8, split_tail=True)))
"""The one-launch mHC site of the decode step (``mhc``, up to ``mhc.SITE_MAX_ROWS`` rows)."""

# ============================================================================================ prefill
PREFILL_MOE = Family(
    "prefill.moe", "fp4_moe_grouped", "MoEGeometry", ("routed_experts", "moe_stage1", "moe_stage2"),
    {"bf16": "fp32_tc", "fp8": "fp8_mma", "scaled": "fp32_tc"},  # scaled: bf16 MMA emulation on sm_90
    (variant("prefill_bf16_rows16", "bf16", "verify", ops=("routed_experts",), rows=16),
     variant("prefill_bf16_rows64_persistent", "bf16", "verify", ops=("routed_experts",), rows=64, persistent=True),
     variant("prefill_fp8_rows32", "fp8", "verify", ops=("routed_experts",), rows=32),
     variant("prefill_scaled_rows16", "scaled", "verify", ops=("routed_experts",), rows=16),
     *(variant(f"prefill_{r}", r, "verify", ops=("moe_stage1", "moe_stage2"), rows=16)
       for r in ("bf16", "fp8", "scaled")),
     # launch variants ("tags", the benchmark's `bf16+<tag>` rows; the tuned file names the fastest): route None
     # for any route, "bf16" for the bf16 route's decode, scheduling and scale loads
     variant("", None, "quick full"), variant("f16", "bf16", "quick full", decode="f16"),
     variant("persistent", "bf16", "quick full", persistent=True),
     variant("sbyte", "bf16", "full", scale_per_byte=True), variant("w4", None, "full", warps1=4, warps2=4),
     variant("k64", None, "full", block_k1=64, block_k2=64), variant("w16", None, "quick full", warps1=16),
     variant("w16p", "bf16", "full", warps1=16, persistent=True)))
"""The grouped FP4 MoE of a prefill chunk (``fp4_moe_grouped``): its routes and launch variants."""

SORTER_ROWS = (16, 32, 64, 128)
"""The sorter rows (the grouped GEMM's block height) the prefill benchmark's ablation times."""


def moe_tags(route: str | None = None) -> dict[str, dict]:
    """The grouped MoE's launch variants (name → ``MoEGeometry`` fields) a ``route`` can run (None: all): the bf16
    route's own ones only on it, and on the fp8 route no K tile wider than its 128-wide scale block."""
    return {v.name: v.fields for v in PREFILL_MOE.variants if "full" in v.runs
            and (route is None or v.route in (None, route))
            and not (route == "fp8" and v.fields.get("block_k1", 128) > 128)}


PREFILL_GEMM = Family(
    "prefill.gemm", "fp8_gemm", None, ("linear", "expert_mlp"),
    {"fp8": "fp8_mma", "bf16": "fp32_tc"},  # FP8 tensor cores promoted per 128-K block; bf16 ones
    (variant("prefill_gemm", None, "verify", ops=("linear",), config="small"),
     variant("prefill_swiglu_mlp", "fp8", "verify", ops=("expert_mlp",), config="small"),
     variant("m128n128", "fp8", "quick full", config="m128n128"), variant("m128n256", "fp8", config="m128n256"),
     variant("m64n128", "fp8", config="m64n128")))
"""The FP8 block-scaled GEMM of the prefill projections (``fp8_gemm.fp8_linear``; cuBLAS beside it)."""

WEIGHT_GEMM = Family(
    "prefill.weight_gemm", "fp8_gemm", None, ("linear", "linear_f32", "grouped_wo_a"), {"*": "fp32_tc"},
    (variant("prefill_weight_gemm", None, "verify", ops=("linear_f32", "grouped_wo_a"), config="small"),
     variant("n128m64", None, "quick full", config="n128m64"), variant("n128m256", None, config="n128m256"),
     variant("n256m128", None, config="n256m128")))
"""The weight-stationary GEMM of bf16 activations at prefill sizes (``fp8_gemm.weight_gemm``; cuBLAS beside it)."""

PREFILL_ATTENTION = Family(
    "prefill.attention", "attention_prefill", None, ("sparse_attention",), {"*": "fp32_tc"},
    (*(variant(f"prefill_{c}", None, "verify", config=c) for c in ("h16n16", "h16n16x", "h64n32d2")),
     variant("h64n32", None, "quick full", config="h64n32"), variant("h64n32x", None, "quick full", config="h64n32x"),
     variant("h64n32d2", None, "full", config="h64n32d2")))
"""The sparse attention of a prefill chunk (``attention_prefill.sparse_attention``)."""

INDEXER = Family(
    "prefill.indexer", "attention_prefill", None, ("indexer_select", "indexer_scores"), {"*": "fp32_tc"},
    (variant("prefill", None, "verify", ops=("indexer_select",), config="q2t64x8"),
     variant("prefill", None, "verify", ops=("indexer_scores",)),
     variant("q2t64", None, "full", config="q2t64"), variant("q2t64x8", None, "quick full", config="q2t64x8"),
     variant("q2t128x4", None, "full", config="q2t128x4"), variant("q4t64x8", None, "full", config="q4t64x8")))
"""The indexer's scores and causal selection at prefill sizes (``attention_prefill``)."""

SELECTIONS = Family(
    "prefill.selections", "attention_prefill", None, ("indexer_topk", "compressor_pool"), {"*": "fp32"},
    (variant("prefill", None, "verify"),))
"""The indexer's top-k and the compressor's pooling (``attention_prefill``: CUDA-core fp32)."""

FAMILIES = (GEMV, MOE, ATTENTION, MHC_SITE, PREFILL_MOE, PREFILL_GEMM, WEIGHT_GEMM, PREFILL_ATTENTION, INDEXER,
            SELECTIONS)
DECODE_FAMILIES = (GEMV, MOE, ATTENTION)
"""The families whose variants ``TritonOps.variants`` offers for the decode kernels (the prefill ones come from
``TritonPrefillOps.prefill_variants``)."""
PREFILL_FAMILIES = (PREFILL_MOE, PREFILL_GEMM, WEIGHT_GEMM, PREFILL_ATTENTION, INDEXER, SELECTIONS)


def verify_variants(families, op: str) -> list[tuple[Family, Variant]]:
    """``(family, variant)`` of every verification variant of ``op`` among ``families``, in declaration order."""
    return [(f, v) for f in families if op in f.ops for v in f.runs("verify", op)]


__all__ = ["RUNS", "Variant", "variant", "Family", "GEMV", "MOE", "MOE_SAME_SEMANTICS", "ATTENTION", "MHC_SITE",
           "PREFILL_MOE", "SORTER_ROWS", "moe_tags", "PREFILL_GEMM", "WEIGHT_GEMM",
           "PREFILL_ATTENTION", "INDEXER", "SELECTIONS", "FAMILIES", "DECODE_FAMILIES", "PREFILL_FAMILIES",
           "verify_variants"]
