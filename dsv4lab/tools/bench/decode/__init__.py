"""``dsv4lab bench kernels --suite decode`` — the decode kernels at DeepSeek-V4-Flash shapes, batch 1/2/4/8, on
one GPU, against cuBLAS and torch baselines measured in the same run; writes the results and (from a GPU) the
measured choices as a tuned file the Triton backend's dispatch reads (:mod:`dsv4lab.engine.dispatch`, written by
:mod:`dsv4lab.tools.bench.tuned`). The variants each section times are the kernel families' benchmark lists
(:mod:`dsv4lab.engine.kernel_families`).

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
   weights: own code paths (:class:`~.gemv.GemvVariant`: route, tile, unroll, prequant) × geometries (K split to about
   two programs per SM) and ``cublas`` side by side, weights rotating among copies totalling ≥ 256 MB.
5. (full run) **Sparse attention decode** and **one real-dims CSA layer decode step** (graph-replayed, the static
   step on the Triton backend, with a per-kernel breakdown from the profiler).

Timing: every measured call is captured in a CUDA graph with its rotated inputs (decode runs graph-replayed, so
no Python launch cost is timed), replayed after a warm-up; CUDA events; the median replay divided by the calls.
``--quick`` (about 2 minutes, a first probe; most of it compiling kernels): the MoE routes' first variants and
five GEMV variants (:func:`~.gemv.gemv_variants`), batch 1 and 8.
``--smoke`` runs the same code at tiny shapes (the CPU interpreter included, plain timing). The harness is
shared with the prefill suite: :mod:`dsv4lab.tools.bench.common`.

One module per section — :mod:`~.moe`, :mod:`~.gemv`, :mod:`~.mhc`, :mod:`~.attention`, :mod:`~.layer` (also the
static decode step's check) — around the run's bookkeeping (:mod:`~.harness`) and the driver (:mod:`~.suite`).
"""
from __future__ import annotations

from dsv4lab.tools.bench.decode.gemv import (GemvVariant, accumulation_probe, bf16_projections, gemv_bound,
                                             gemv_variants, projection_shapes, projections)
from dsv4lab.tools.bench.decode.harness import DecodeBench
from dsv4lab.tools.bench.decode.moe import moe_stage_checks, moe_variants
from dsv4lab.tools.bench.decode.suite import (HELP, QUICK_SECTIONS, SECTIONS, add_suite_arguments, chosen_sections,
                                              run_suite, targets)

__all__ = ["GemvVariant", "accumulation_probe", "bf16_projections", "gemv_bound", "gemv_variants", "projection_shapes",
           "projections", "DecodeBench", "moe_stage_checks", "moe_variants", "HELP", "QUICK_SECTIONS", "SECTIONS",
           "add_suite_arguments", "chosen_sections", "run_suite", "targets"]
