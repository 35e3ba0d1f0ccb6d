"""The error bound of every replaceable op (:class:`dsv4lab.core.model.ops.ReferenceOps`), computed from its inputs.

:data:`OP_BOUNDS` maps an op name to a function ``bound(nm, acc, *args, **kwargs) -> expectation | tuple`` — one
expectation per output of the op (for the ops that write in place, per written tensor: see
:mod:`~dsv4lab.tools.verify.op_outputs`): an :class:`~dsv4lab.tools.verify.bounds.Interval` the output must lie in, ``EXACT``
(integers, pure data movement), a :class:`TopK` / :class:`TopKInterval` (a selection compared as a set) — or one
joint expectation over all outputs (:class:`RouterChoice`: weights that belong to the experts chosen). ``nm`` is the
reference's :class:`~dsv4lab.core.model.numerics.Numerics`, ``acc`` the accumulation model of the evaluated call, as the
backend names it (:data:`~dsv4lab.tools.verify.bounds.UNIT_ROUNDOFF`); element-wise steps are fp32 whatever the
accumulation (:func:`~dsv4lab.tools.verify.bounds.elementwise_roundoff`). Each function follows the reference's rounding
points step by step (the op's docstring in ``model/ops.py``); ``docs/verification.md`` derives each family:

* **dot products** (``linear``, ``linear_f32``, ``grouped_wo_a``, ``moe_stage1``, ``moe_stage2``; ``projections``, each
  call's): exact products,
  ``γ_K(acc)·Σ|terms|`` for the K-term sum, then the reference's roundings (fp32, then bf16); the FP8 kernels'
  evaluation (exact E4M3 operands, MMA partials promoted to fp32 per K tile) is derived to be the ``fp8_mma`` model
  in :func:`~.dot.promoted_fp8_model`;
* **elementwise** (``rms_norm``, ``head_rms``, ``rope``, ``swiglu``, ``moe_activation``, ``router_scores``,
  ``hc_post``): a relative error per evaluation step, with transcendental functions allowed ``(4 + 2|x|)·u``
  (a GPU's ``exp2`` approximation is within 2 ulp; scaling the argument by log₂e adds ``|x|·u``);
* **softmax-weighted sums** (``sparse_attention``, ``compressor_pool``): score errors become relative errors of the
  probabilities, plus one bf16 rounding of each probability on either side (a kernel may round it against a
  running or per-slice maximum), plus the sums;
* **Sinkhorn / mHC** (``hc_pre``, ``hc_head``): first-order propagation of the mixing logits' error and of every
  normalisation step's rounding through the Sinkhorn iterations (adjoints by autograd), doubled for higher orders;
* **quantizer chains** (``routed_experts``, ``expert_mlp``, ``indexer_scores``): intervals through every
  rounding and through the FP8 activation quantizer, so a value near a rounding boundary may flip;
* **selections** (``indexer_topk``): compared as sets; entries that differ must tie with the last one chosen;
  from scores a kernel computes itself (``indexer_select``, ``router_topk``): any set some scores inside the score
  intervals make the top k;
* **fused ops** (``hc_pre_norm``, ``hc_post_pre_norm``, ``head_rms_rope``, ``kv_norm_rope``, ``indexer_query``,
  ``attention_norms``, ``query_heads``, ``compressor_pair``,
  ``indexer_select_decode``, ``router_topk``, ``compressor_step``, ``attention_from_caches``): the chain of their
  parts' bounds, each part taking the previous part's interval as its input (``*_interval`` helpers: RMSNorm, RoPE,
  the Hadamard transform and the FP8/FP4 block quantizers on intervals).

An op with no entry here has **no bound defined**: the stage oracle reports it as a failure, never as a pass.

One module per family: :mod:`~.intervals` (the quantizers and SiLU on intervals, shared), :mod:`~.dot`,
:mod:`~.elementwise` (with mHC), :mod:`~.attention` (softmax-weighted sums and the glue chains), :mod:`~.selection`
(selections, integers, and the checking of outputs against expectations).
"""
from __future__ import annotations

from dsv4lab.tools.verify.op_bounds.attention import (attention_from_caches, attention_norms, compressor_pair,
                                                      compressor_pool, compressor_step, finish_interval, hadamard_interval,
                                                      head_rms_rope, indexer_query, indexer_scores, kv_norm_rope,
                                                      query_heads, sparse_attention)
from dsv4lab.tools.verify.op_bounds.dot import (expert_down, expert_mlp, grouped_wo_a, linear, linear_f32, linear_f32_group,
                                                linear_group, moe_activation, projections, moe_combine, moe_output, moe_stage1,
                                                moe_stage1_int8, moe_stage2, promoted_fp8_model, routed_experts,
                                                routed_experts_int8)
from dsv4lab.tools.verify.op_bounds.elementwise import (hc_head, hc_post, hc_post_pre_norm, hc_pre, hc_pre_norm,
                                                        moe_post_pre_norm,
                                                        head_rms, rms_norm, rms_norm_interval, rope, rope_interval,
                                                        router_scores, swiglu)
from dsv4lab.tools.verify.op_bounds.intervals import (EXACT, act_int8_interval, act_qdq_interval, fp4_qdq_interval,
                                                      fp8_qdq_interval, swiglu_interval)
from dsv4lab.tools.verify.op_bounds.selection import (RouterChoice, TopK, TopKInterval, check_expectation,
                                                      check_outputs, check_topk, check_topk_interval,
                                                      compressed_rope_position, indexer_select,
                                                      indexer_select_decode, indexer_topk, router_topk)

OP_BOUNDS = {
    "linear": linear, "linear_f32": linear_f32, "grouped_wo_a": grouped_wo_a, "linear_group": linear_group,
    "linear_f32_group": linear_f32_group,
    "moe_stage1": moe_stage1, "moe_activation": moe_activation, "moe_stage2": moe_stage2,
    "moe_combine": moe_combine, "moe_output": moe_output, "routed_experts": routed_experts, "expert_mlp": expert_mlp,
    "swiglu": swiglu, "rms_norm": rms_norm, "head_rms": head_rms, "rope": rope, "router_scores": router_scores,
    "hc_pre": hc_pre, "hc_post": hc_post, "hc_head": hc_head,
    "compressor_pool": compressor_pool, "sparse_attention": sparse_attention,
    "attention_from_caches": attention_from_caches, "indexer_scores": indexer_scores,
    "indexer_topk": indexer_topk, "compressed_rope_position": compressed_rope_position,
    # fused ops (kernels/dsv4lab_kernels/mhc.py, norm_rope_quant.py, compressor_decode.py, router.py, indexer_decode.py)
    "hc_pre_norm": hc_pre_norm, "hc_post_pre_norm": hc_post_pre_norm, "head_rms_rope": head_rms_rope,
    "kv_norm_rope": kv_norm_rope, "indexer_query": indexer_query, "indexer_select": indexer_select,
    "indexer_select_decode": indexer_select_decode, "router_topk": router_topk, "compressor_step": compressor_step,
    "moe_post_pre_norm": moe_post_pre_norm, "attention_norms": attention_norms, "query_heads": query_heads,
    "compressor_pair": compressor_pair, "projections": projections, "expert_down": expert_down,
}
"""op name → bound function. A new op needs one entry (and, for a fused op, the chain of its parts)."""

__all__ = ["OP_BOUNDS", "EXACT", "TopK", "TopKInterval", "RouterChoice", "check_expectation", "check_outputs",
           "check_topk", "check_topk_interval", "act_qdq_interval", "fp8_qdq_interval", "fp4_qdq_interval",
           "act_int8_interval", "swiglu_interval", "rms_norm_interval", "rope_interval", "hadamard_interval",
           "finish_interval", "routed_experts_int8", "moe_stage1_int8", "promoted_fp8_model"]
