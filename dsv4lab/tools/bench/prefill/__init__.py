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
   :data:`~dsv4lab.engine.kernel_families.PREFILL_MOE`) at 128 sorter rows, sorter rows 64 and 128, then the
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
kernel) are what the measurements pick; a GPU run also writes them as the prefill entries of a tuned file
(``--tuned-out``, merged over the GPU's committed one: :mod:`dsv4lab.tools.bench.tuned`), which the dispatch reads on
the GPU it was measured on (:mod:`dsv4lab.engine.dispatch`; a visit that measures and then runs ``bench e2e`` points
``DSV4LAB_TUNED`` at the fresh file); ``targets`` states the issue's targets as measured. Timing: CUDA events,
median of repetitions after a warm-up (which compiles); the 256-expert weights (3.2 GB) are far larger than L2, the
dense ones are flushed from L2 before every repetition. FLOPs are the useful ones (rows padded by the sorter and
masked attention slots are not counted). ``--smoke`` runs the same code at the tiny model's shapes (CPU interpreter
included) to check the script itself.

One module per section — :mod:`~.moe`, :mod:`~.layer` (the chunk choice), :mod:`~.dense`, :mod:`~.glue`,
:mod:`~.attention` — around the run's bookkeeping and plan (:mod:`~.harness`), the conclusions (:mod:`~.report`)
and the driver (:mod:`~.suite`).
"""
from __future__ import annotations

from dsv4lab.tools.bench.prefill.harness import PrefillBench, plan_variants
from dsv4lab.tools.bench.prefill.layer import measured_moe_settings
from dsv4lab.tools.bench.prefill.report import choices, targets
from dsv4lab.tools.bench.prefill.suite import HELP, SECTIONS, add_suite_arguments, run_suite

__all__ = ["PrefillBench", "plan_variants", "measured_moe_settings", "choices", "targets", "HELP", "SECTIONS",
           "run_suite", "add_suite_arguments"]
