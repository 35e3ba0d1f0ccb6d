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
the GEMV (whose default is per shape) and for the long-context kernels (the split indexer, the split-KV attention). A benchmark variant's fields are laid over the kernel's defaults.

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
        min_entries: fewest cache entries it applies to — the long-context kernels (the split indexer: keys in the
            index-key cache; the split-KV attention: rows a query's selection lists); the benchmarks time it only
            from there on, and a tuned choice of it names the threshold the measurement found
            (:mod:`dsv4lab.engine.dispatch`: ``min_entries``).
    """

    name: str
    route: str | None = None
    geometry: tuple = ()
    runs: frozenset = frozenset()
    ops: tuple = ()
    min_rows: int = 1
    act_quant_only: bool = False
    min_entries: int = 0

    @property
    def fields(self) -> dict:
        return dict(self.geometry)

    def applies(self, rows: int, act_quant: bool, entries: int | None = None) -> bool:
        return rows >= self.min_rows and (act_quant or not self.act_quant_only) and (
            entries is None or entries >= self.min_entries)


def variant(name: str, route: str | None = None, runs: str = "full", ops: tuple = (), min_rows: int = 1,
            act_quant_only: bool = False, min_entries: int = 0, **geometry) -> Variant:
    """A :class:`Variant`; ``runs`` as space-separated names of :data:`RUNS`."""
    bad = set(runs.split()) - set(RUNS)
    if bad:
        raise ValueError(f"variant {name}: unknown run(s) {sorted(bad)}; known: {RUNS}")
    return Variant(name, route, tuple(sorted(geometry.items())), frozenset(runs.split()), tuple(ops), min_rows,
                   act_quant_only, min_entries)


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
          fma_rows: int = 1, runs: str = "full") -> Variant:
    """A benchmarked GEMV configuration (K split per shape to about two programs per SM by the benchmark);
    ``fma_rows`` > 1 applies from ``fma_rows // 2 + 1`` rows (fewer would leave most of its rows empty)."""
    name = f"{route}:n{bn}k{bk}w{warps}p{stages}" + (f"u{unroll}" if unroll > 1 else "") + (
        ":pq" if prequant else "") + (f":r{fma_rows}" if fma_rows > 1 else "")
    geometry = dict(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, unroll=unroll, prequant=prequant)
    if fma_rows > 1:
        geometry["fma_rows"] = fma_rows
    return variant(name, route, runs, min_rows=2 if prequant else fma_rows // 2 + 1, act_quant_only=prequant,
                   **geometry)


GEMV = Family(
    "decode.gemv", "fp8_gemv", "GemvGeometry", ("linear", "linear_f32", "grouped_wo_a", "linear_group",
                                                "linear_f32_group"),
    # fma: fp32 FMA (c = 1); dot: tensor-core blocks summed in fp32, cuBLAS bf16/fp32-out (c = 4)
    {"fma": "fp32", "dot": "fp32_tc4", "cublas": "fp32_tc4"},
    (variant("fma", "fma", "verify", ops=("linear", "linear_f32", "grouped_wo_a")),
     variant("dot", "dot", "verify", ops=("linear", "linear_f32", "grouped_wo_a")),
     variant("fma_split3", "fma", "verify", ops=("linear",), block_n=32, block_k=128, split_k=3),
     variant("dot_split3", "dot", "verify", ops=("linear",), block_n=32, block_k=128, split_k=3),
     variant("fma_rows4", "fma", "verify", ops=("linear",), block_n=16, block_k=128, fma_rows=4),
     _gemv("dot", 16, 128, 1, 1, runs="smoke"), _gemv("fma", 32, 128, 4, 1, runs="smoke"),
     _gemv("fma", 16, 128, 4, 1, unroll=2, runs="smoke"), _gemv("dot", 16, 128, 1, 1, prequant=True, runs="smoke"),
     _gemv("fma", 16, 128, 4, 1, fma_rows=4, runs="smoke"),
     # the quick five: the fma route's tiles and unrolls trade bytes in flight per SM at batch 1; dot plain and
     # with the rows quantized once (prequant, batch > 1)
     _gemv("fma", 32, 256, 4, runs="quick full"), _gemv("fma", 16, 256, 4, unroll=2, runs="quick full"),
     _gemv("fma", 64, 256, 8, runs="quick full"), _gemv("dot", 16, 256, 1, runs="quick full"),
     _gemv("dot", 64, 256, 4, prequant=True, runs="quick full"),
     # a verify step's 2–4 rows of one sequence: the fma route reading each weight tile once for all of them.
     # Quick: the wider tiles, whose per-row activation work is shared by more weight rows — compiled for sm_90
     # (scripts/kernel_sass.py, data/results/host/logs/kernel_sass_gemv_1a5b918.log; instruction counts, not
     # times) n32k256w4 / n64k256w8 at 2 rows 6.3 / 5.9 SASS per weight byte against 8.7 for n16k256w4 (4.3 / 4.1
     # at one row); every 4-row tile counted 12.9–20.8
     # (shuffles through shared memory, or spills), and n16k128w4 r4 measured 2× the one-row kernel run per row
     # on an H100 (decode_kernels_a008e9d_gemv_quick.json): full runs only
     _gemv("fma", 32, 256, 4, fma_rows=2, runs="quick full"), _gemv("fma", 64, 256, 8, fma_rows=2, runs="quick full"),
     _gemv("fma", 16, 256, 4, fma_rows=2), _gemv("fma", 16, 128, 4, fma_rows=4),
     _gemv("fma", 32, 128, 4, fma_rows=2), _gemv("fma", 32, 256, 8, fma_rows=4),
     _gemv("fma", 32, 512, 4), _gemv("fma", 32, 256, 4, unroll=2), _gemv("fma", 16, 512, 4),
     _gemv("fma", 64, 256, 4, unroll=2), _gemv("dot", 32, 256, 2), _gemv("dot", 64, 256, 4, 4),
     _gemv("dot", 32, 256, 2, prequant=True)))
"""The decode projections (``fp8_gemv``: FP8 and BF16 weights, one to 63 rows), beside cuBLAS."""


def _moe(route: str, name: str, bn: int, bk: int, warps: int, stages: int, runs: str = "full", **kw) -> Variant:
    return variant(name, route, runs, block_n_up=bn, block_n_down=bn, block_k=bk, num_warps=warps,
                   num_stages=stages, **kw)


MOE_SAME_SEMANTICS = ("dot", "fma", "dot_scaled", "fp8lut")
"""The routes that evaluate the reference's quantization; ``int8`` is the paper's (judged by its own oracle)."""

MOE = Family(
    "decode.moe", "fp4_moe_decode", "MoeGeometry", ("routed_experts", "moe_stage1", "moe_stage2"),
    # fp8lut: exact E4M3 products in FP8 MMAs promoted per 128-wide K tile (op_bounds.dot.promoted_fp8_model)
    {"dot": "fp32_tc4", "fma": "fp32", "int8": "fp32", "dot_scaled": "fp32_tc4", "fp8lut": "fp8_mma"},
    (*(variant(r, r, "verify") for r in ("dot", "fma", "dot_scaled")),
     # the route steps K by the activation's 128-wide block and needs ≥ 16 weight rows per MMA operand
     variant("fp8lut", "fp8lut", "verify", block_n_up=16, block_n_down=32, block_k=128, slot_split=0),
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
     _moe("dot_scaled", "n32k256w2s3", 32, 256, 2, 3),
     # the grouped prefill's table decode to E4M3 and FP8 MMAs in the decode's structure (fp4_moe_decode_fp8lut).
     # Compiled for sm_90 (scripts/compile_decode_moe.py, Triton 3.9; compiled instruction counts, not times): the
     # tuned fma bytewise route's K loop 10.4 / 11.8 SASS per weight byte (gate/up / down) and once more per row;
     # fp8lut with a warp group per program (wgmma E4M3) 7.4 / 9.5 (n64 w4), 8.6 / 8.7 (n32x64 w4, one reference
     # per tile), the same for up to 16 rows; one or two warps lower to mma.sync through f16 (11–13 per byte)
     _moe("fp8lut", "n16k128w1s1", 16, 128, 1, 1, runs="smoke"),
     _moe("fp8lut", "n64k128w4s3", 64, 128, 4, 3, runs="quick full"),
     variant("n32x64k128w4s3:tile", "fp8lut", "quick full", block_n_up=32, block_n_down=64, block_k=128,
             num_warps=4, num_stages=3, lut_ref="tile"),
     variant("n32x64k128w4s3", "fp8lut", "full", block_n_up=32, block_n_down=64, block_k=128, num_warps=4,
             num_stages=3),
     variant("n64x128k128w8s3", "fp8lut", "full", block_n_up=64, block_n_down=128, block_k=128, num_warps=8,
             num_stages=3),
     _moe("fp8lut", "n64k128w4s4", 64, 128, 4, 4), _moe("fp8lut", "n64k128w4s3:tile", 64, 128, 4, 3, lut_ref="tile"),
     _moe("fp8lut", "n16k128w1s3", 16, 128, 1, 3), _moe("fp8lut", "n32k128w2s3", 32, 128, 2, 3)))
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


LONG_CONTEXTS = (4096, 16384, 65536)
"""The prompt lengths at which the decode suite's ``attention`` section times the long-context kernels beside
today's (the split indexer over ``context/4`` keys, HCA over ``context/128`` entries, CSA over its top-k picks)."""


def _split_kv(name: str, block_h: int, block_r: int, chunk: int, warps: int = 4, runs: str = "full",
              min_entries: int = 128) -> Variant:
    return variant(name, None, runs, min_entries=min_entries, block_h=block_h, block_r=block_r, chunk=chunk,
                   num_warps=warps)


ATTENTION_SPLIT = Family(
    "decode.attention_split", "attention_split_decode", "SplitKvGeometry",
    ("sparse_attention", "attention_from_caches"),
    # bf16 dots on tensor cores (a chunk's sums); the combine's fp32 sums on CUDA cores are tighter than that model.
    # Its own bound (op_bounds.attention.sparse_attention_split) is tighter than the op's, which holds as well.
    {"*": "fp32_tc4"},
    (variant("split_kv_c16", None, "verify", ops=("sparse_attention", "attention_from_caches"), block_h=16,
             block_r=16, chunk=16, combine_block=2),
     variant("split_kv_c32_online", None, "verify", ops=("sparse_attention", "attention_from_caches"), block_h=16,
             block_r=16, chunk=32, combine_block=4),
     _split_kv("h16r16c16", 16, 16, 16, runs="smoke", min_entries=0),
     # h: heads per program, r: rows per step, c: rows per program (chunk); one step per chunk: no rescaling
     _split_kv("h16r32c32", 16, 32, 32, runs="quick full"), _split_kv("h16r16c16", 16, 16, 16),
     _split_kv("h16r32c64", 16, 32, 64), _split_kv("h16r64c64", 16, 64, 64, warps=8),
     _split_kv("h32r32c32", 32, 32, 32, warps=8), _split_kv("h16r32c128", 16, 32, 128)))
"""The split-KV attention of the decode step for long selections (``attention_split_decode``)."""


def _ixs(name: str, split: int, block_t: int = 64, warps: int = 4, merge_warps: int = 4, block_e: int = 64,
         runs: str = "full", min_entries: int = 1024) -> Variant:
    return variant(name, None, runs, min_entries=min_entries, split=split, block_t=block_t, block_e=block_e,
                   num_warps=warps, merge_warps=merge_warps)


INDEXER_SPLIT = Family(
    "decode.indexer", "indexer_split_decode", "IndexerSplitGeometry", ("indexer_select_decode",),
    {"*": "fp32_tc4"},  # the fused kernel's scores (the same helper); the selection is exact given them
    (variant("split16", None, "verify", split=16, block_t=16, block_e=16),
     variant("split32", None, "verify", split=32, block_t=16, block_e=8),
     _ixs("s16", 16, block_t=16, block_e=16, runs="smoke", min_entries=0),
     # s: keys per candidate program; t: keys per dot; w/m: warps of the candidate and merge launches
     _ixs("s512t64w4m4", 512, runs="quick full"), _ixs("s256t64w4m4", 256), _ixs("s1024t64w4m4", 1024),
     _ixs("s1024t64w8m4", 1024, warps=8), _ixs("s2048t64w8m4", 2048, warps=8),
     _ixs("s512t32w4m4", 512, block_t=32), _ixs("s512t64w4m8", 512, merge_warps=8, block_e=128)))
"""The indexer's decode selection split over the key axis for long contexts (``indexer_split_decode``); the
fused kernel (``indexer_decode``) is the default and the baseline its rows are timed beside."""


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


@dataclass(frozen=True)
class Fusion:
    """A fused path of the decode step: one launch (or a constexpr-gated path of an existing kernel) computing what
    several launches computed, with the same arithmetic in the same order, so its result equals the unfused path's
    bit for bit (``tests/test_kernels_fusion.py``; on a GPU the same tests marked ``gpu``).

    Attributes:
        name: the key of the dispatch's ``decode.fusion`` choice (``Dispatch.fused``).
        op: the :class:`~dsv4lab.core.model.ops.ReferenceOps` op whose reference composition it replaces.
        kernel: ``module.function`` of ``dsv4lab_kernels`` that runs it.
        replaces: the launches it replaces (kernel names, once per use).
        saved: launches saved per use.
    """

    name: str
    op: str
    kernel: str
    replaces: tuple
    saved: int


FUSIONS = (
    Fusion("moe_site", "moe_post_pre_norm", "mhc.hc_post_pre_norm", ("_moe_combine_kernel", "_moe_output_kernel"), 2),
    Fusion("greedy", "greedy", "greedy.greedy_ids", ("argmax", "isfinite", "all", "where"), 3),
    Fusion("attention_norms", "attention_norms", "norm_rope_quant.attention_norms",
           ("_rms_norm_kernel", "_kv_norm_rope_kernel"), 1),
    Fusion("query_heads", "query_heads", "norm_rope_quant.query_heads",
           ("_head_rms_rope_kernel", "_indexer_query_kernel"), 1),
    Fusion("shared_swiglu", "expert_mlp", "fp8_gemv.fp8_gemv", ("_swiglu_kernel",), 1),
    Fusion("compressor_pair", "compressor_pair", "compressor_decode.compressor_pair",
           ("_compressor_step_kernel", "_compressor_step_kernel"), 1),
    Fusion("x_projections", "projections", "fp8_gemv.fp8_gemv_jobs", ("_fp8_gemv_kernel", "_fp8_gemv_kernel"), 1),
    Fusion("attention_combine", "attention_from_caches", "attention_decode.sparse_attention_decode",
           ("_attn_combine_kernel",), 1),
)
"""The decode step's fused paths (the dispatch turns each on or off per device: ``Defaults.fusions`` and the tuned
file's ``decode.fusion``): ``moe_site`` sums the routed slots and the shared experts' outputs in the prologue of the
mHC site after a MoE (per layer but the last); ``greedy`` makes the step's greedy choice in one kernel instead of
torch's four (once per step, inside the captured graph either way); ``attention_norms`` runs q_norm and the window
KV row's norm, RoPE and ring write in one grid (every layer), ``query_heads`` the query heads' RMS and RoPE with the
indexer's query RoPE, Hadamard and FP4 simulation (every CSA layer) — each program one op's own body;
``shared_swiglu`` computes the shared expert's activation in the prologue of its down projection's GEMV (every layer,
where that projection takes the own GEMV without a separate quantization launch); ``compressor_pair`` steps a CSA
layer's two compressors (the indexer's keys and the main entries) in one grid; ``x_projections`` computes the
projections of one input in one launch of the GEMV, each projection's programs with its own route and geometry: the
attention input's — q/KV (FP8), the compressors' (BF16), the indexer's head weights — (one launch fewer per
compressed layer, two per CSA layer) and the MoE input's — the router logits, the shared expert's w1/w3 — (one per
layer, where their tuned geometries share warps and stages); ``attention_combine`` makes the split attention's
combine in its last slice program per query row and head block (a ticket) instead of a second launch (every layer,
where the attention is split)."""
FUSION_NAMES = tuple(f.name for f in FUSIONS)

# ============================================================================================ prefill
PREFILL_MOE = Family(
    "prefill.moe", "fp4_moe_grouped", "MoEGeometry", ("routed_experts", "moe_stage1", "moe_stage2"),
    # scaled: bf16 MMA emulation on sm_90; fp8 and fp8lut: FP8 MMA promoted to fp32 every 128-K block
    {"bf16": "fp32_tc", "fp8": "fp8_mma", "scaled": "fp32_tc", "fp8lut": "fp8_mma"},
    (variant("prefill_bf16_rows16", "bf16", "verify", ops=("routed_experts",), rows=16),
     variant("prefill_bf16_rows64_persistent", "bf16", "verify", ops=("routed_experts",), rows=64, persistent=True),
     variant("prefill_fp8_rows32", "fp8", "verify", ops=("routed_experts",), rows=32),
     variant("prefill_scaled_rows16", "scaled", "verify", ops=("routed_experts",), rows=16),
     variant("prefill_fp8lut_rows16", "fp8lut", "verify", ops=("routed_experts",), rows=16),
     variant("prefill_fp8lut_rows32_persistent_row_ref", "fp8lut", "verify", ops=("routed_experts",), rows=32,
             persistent=True, lut_ref="row"),
     *(variant(f"prefill_{r}", r, "verify", ops=("moe_stage1", "moe_stage2"), rows=16)
       for r in ("bf16", "fp8", "scaled", "fp8lut")),
     # launch variants ("tags", the benchmark's `<route>+<tag>` rows; the tuned file names the fastest): route None
     # for any route, a route's own for its decode, scheduling and scale loads; names are unique across routes
     variant("", None, "quick full"), variant("f16", "bf16", "quick full", decode="f16"),
     variant("persistent", None, "quick full", persistent=True),
     variant("sbyte", "bf16", "full", scale_per_byte=True), variant("w4", None, "full", warps1=4, warps2=4),
     variant("k64", None, "full", block_k1=64, block_k2=64), variant("w16", None, "quick full", warps1=16),
     variant("w16p", "bf16", "full", warps1=16, persistent=True),
     # fp8lut: the per-row reference (two multiplies per promoted element instead of one), the portable decode
     # (what the inline-PTX table decode saves), pipeline depth
     variant("lut_row", "fp8lut", "quick full", lut_ref="row"),
     variant("lut_portable", "fp8lut", "full", decode="portable"),
     variant("lut_s2", "fp8lut", "full", stages1=2, stages2=2), variant("lut_s4", "fp8lut", "full", stages1=4,
                                                                         stages2=4),
     variant("lut_s4p", "fp8lut", "quick full", stages1=4, stages2=4, persistent=True)))
"""The grouped FP4 MoE of a prefill chunk (``fp4_moe_grouped``; the ``fp8lut`` route's kernels in
``fp4_moe_fp8lut``): its routes and launch variants."""

SORTER_ROWS = (16, 32, 64, 128)
"""The sorter rows (the grouped GEMM's block height) the prefill benchmark's ablation times."""


def moe_tags(route: str | None = None) -> dict[str, dict]:
    """The grouped MoE's launch variants (name → ``MoEGeometry`` fields) a ``route`` can run (None: all): a route's
    own ones only on it, and on the FP8 routes no K tile wider than the activation's 128-wide scale block."""
    return {v.name: v.fields for v in PREFILL_MOE.variants if "full" in v.runs
            and (route is None or v.route in (None, route))
            and not (route in ("fp8", "fp8lut") and v.fields.get("block_k1", 128) > 128)}


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

FAMILIES = (GEMV, MOE, ATTENTION, ATTENTION_SPLIT, INDEXER_SPLIT, MHC_SITE, PREFILL_MOE, PREFILL_GEMM, WEIGHT_GEMM,
            PREFILL_ATTENTION, INDEXER, SELECTIONS)
DECODE_FAMILIES = (GEMV, MOE, ATTENTION, ATTENTION_SPLIT, INDEXER_SPLIT)
"""The families whose variants ``TritonOps.variants`` offers for the decode kernels (the prefill ones come from
``TritonPrefillOps.prefill_variants``)."""
PREFILL_FAMILIES = (PREFILL_MOE, PREFILL_GEMM, WEIGHT_GEMM, PREFILL_ATTENTION, INDEXER, SELECTIONS)


def verify_variants(families, op: str) -> list[tuple[Family, Variant]]:
    """``(family, variant)`` of every verification variant of ``op`` among ``families``, in declaration order."""
    return [(f, v) for f in families if op in f.ops for v in f.runs("verify", op)]


__all__ = ["RUNS", "Variant", "variant", "Family", "GEMV", "MOE", "MOE_SAME_SEMANTICS", "ATTENTION",
           "LONG_CONTEXTS", "ATTENTION_SPLIT", "INDEXER_SPLIT", "MHC_SITE",
           "Fusion", "FUSIONS", "FUSION_NAMES",
           "PREFILL_MOE", "SORTER_ROWS", "moe_tags", "PREFILL_GEMM", "WEIGHT_GEMM",
           "PREFILL_ATTENTION", "INDEXER", "SELECTIONS", "FAMILIES", "DECODE_FAMILIES", "PREFILL_FAMILIES",
           "verify_variants"]
