"""The decode step's fused paths on the Triton backend (:data:`~dsv4lab.engine.kernel_families.FUSIONS`): one launch
where the unfused step has several, each computing what those launches compute with the same arithmetic, so the
same bits (``tests/test_kernels_fusion.py``). The dispatch turns each on per device and row count
(:meth:`~dsv4lab.engine.dispatch.Dispatch.fused`); off, or where its kernels cannot take a call, an op runs its
``ReferenceOps`` composition, whose parts take their own kernels — not a fallback.

:class:`FusedPaths` is a part of :class:`~dsv4lab.engine.triton_backend.TritonOps` (it uses the backend's dispatch,
counters and kernel choices); it is its own module so that one file holds the fused paths beside each other.
"""
from __future__ import annotations

import torch

from dsv4lab.core.model.linear import Linear
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.engine.decode_groups import group_of
from dsv4lab.engine.kernel_loader import kernel_module

# the kernel modules of the fused paths (the backend's own names for them)
gemv, moe, mhc, nrq, cmp_decode, greedy_kernels = map(kernel_module, (
    "fp8_gemv", "fp4_moe_decode", "mhc", "norm_rope_quant", "compressor_decode", "greedy"))


class FusedPaths:
    """The fused decode-step ops of :class:`~dsv4lab.engine.triton_backend.TritonOps`."""

    def _fused_glue(self, name: str, rows: int, *tensors: torch.Tensor) -> bool:
        """Whether the fused path ``name`` runs this call of its op of the same name (counted on its glue kernel):
        the dispatch turns it on at ``rows`` rows and the glue kernels take the tensors. Off, the op's reference
        composition runs its parts, each on its own kernel — not a fallback."""
        return self.config.fused(name, rows) and self._glue(name, *tensors)

    def greedy(self, logits):
        if logits.ndim != 2 or not self.config.fused("greedy", logits.shape[0]):
            return ReferenceOps.greedy(self, logits)  # torch's argmax and flag: the same ids, not a fallback
        if not self._glue("greedy", logits):
            return ReferenceOps.greedy(self, logits)
        return greedy_kernels.greedy_ids(logits)

    def moe_post_pre_norm(self, x, idx, weights, bank, limit, shared, X, post, comb, fn, base, scale, norm_weight,
                          args, all_reduce=None):
        rows = x.shape[0]
        nm = self.numerics
        route, geo = self._decode_moe_plan(bank, rows) if bank.fmt == "fp4" else self.moe_choice(rows)
        why = None if self.config.fused("moe_site", rows) else "fusion off"
        why = why or self._moe_unsupported(x, bank) or self._glue_unsupported(X)
        if why is None:
            if rows >= self.prefill_min_tokens:
                why = "prefill rows"  # the unfused ops take their prefill kernels there
            elif all_reduce is not None:
                why = "expert-parallel partial sum"
            elif geo.slot_split != 0:
                why = "token-major down projection"
            elif X.numel() // (X.shape[-1] * X.shape[-2]) > mhc.SITE_MAX_ROWS:
                why = "rows above the one-launch mHC site"
            elif nm.acc != torch.float32 or shared.dtype != nm.act:
                why = f"shared {shared.dtype}, acc {nm.acc}"
        if why is not None:  # the three ops, each on its own kernel (or its own counted fallback)
            return ReferenceOps.moe_post_pre_norm(self, x, idx, weights, bank, limit, shared, X, post, comb, fn,
                                                  base, scale, norm_weight, args, all_reduce)
        self._decode("routed_experts")
        self.calls.glue["moe_post_pre_norm"] += 1
        ex = moe.ExpertTensors.of(bank)
        slots = moe.routed_moe_slots(x, idx, weights, ex, limit, route=route, geometry=geo,
                                     act_quant=nm.act_quant, act_dtype=nm.act)
        parts = moe.MoeOutput(slots, idx, shared, ex.expert_offset, ex.n_experts)
        return mhc.hc_post_pre_norm(None, X, post, comb, fn, base, scale, norm_weight, args.hc_sinkhorn_iters,
                                    args.norm_eps, args.hc_eps, geometry=self._mhc_site(X), moe=parts)

    def attention_norms(self, q_a, q_weight, kv, kv_weight, eps, cos, sin, positions, ring=None, slots=None):
        if not self._fused_glue("attention_norms", q_a.numel() // q_a.shape[-1], q_a, kv):
            return ReferenceOps.attention_norms(self, q_a, q_weight, kv, kv_weight, eps, cos, sin, positions, ring,
                                                slots)
        return nrq.attention_norms(q_a, q_weight, kv, kv_weight, eps, cos, sin, positions,
                                   kv.shape[-1] - 2 * cos.shape[-1], self.numerics.kv_fp8_sim, ring, slots)

    def query_heads(self, q, qi, cos, sin, positions, eps):
        if not self._fused_glue("query_heads", q.numel() // (q.shape[-1] * q.shape[-2]), q, qi):
            return ReferenceOps.query_heads(self, q, qi, cos, sin, positions, eps)
        return nrq.query_heads(q, qi, cos, sin, positions, eps, self.numerics.indexer_fp4_sim)

    def compressor_pair(self, comp_a, kv_a, score_a, cache_a, comp_b, kv_b, score_b, cache_b, positions, slots, cos,
                        sin):
        rows = kv_a.numel() // kv_a.shape[-1]
        if not self._fused_glue("compressor_pair", rows, kv_a, kv_b, cache_a, cache_b):
            return ReferenceOps.compressor_pair(self, comp_a, kv_a, score_a, cache_a, comp_b, kv_b, score_b, cache_b,
                                                positions, slots, cos, sin)
        cmp_decode.compressor_pair(self._compressor_call(comp_a, kv_a, score_a, positions, slots, cache_a, cos, sin),
                                   self._compressor_call(comp_b, kv_b, score_b, positions, slots, cache_b, cos, sin))

    def _compressor_call(self, comp, kv, score, positions, slots, cache, cos, sin):
        nm = self.numerics
        return cmp_decode.CompressorCall(kv, score, comp.ape, positions, slots, comp.kv_ring, comp.score_ring, cache,
                                         comp.norm.weight, cos, sin, comp.ratio, comp.overlap, comp.args.norm_eps,
                                         comp.is_indexer,
                                         nm.indexer_fp4_sim if comp.is_indexer else nm.kv_fp8_sim)

    def projections(self, x: torch.Tensor, calls: tuple) -> tuple[torch.Tensor, ...]:
        """The fused path ``x_projections``: every call in one launch (:func:`dsv4lab_kernels.fp8_gemv.fp8_gemv_jobs`,
        up to ``JOBS`` projections: a stacked group is one, an unstacked set one per member) where each would take
        the own GEMV — the same route and geometry its op takes, so the same bits — and they share warps and
        stages; else each op on its own path (not a fallback)."""
        rows = x.numel() // max(x.shape[-1], 1)
        plans: list = [None]
        if self.config.fused("x_projections", rows):
            plans = [pl for op, w in calls for pl in self._projection_plans(x, op, w)]
        if not 2 <= len(plans) <= gemv.JOBS or any(pl is None for pl in plans) or \
                len({(pl.num_warps, pl.num_stages) for pl in plans}) != 1:
            return ReferenceOps.projections(self, x, calls)
        for op, w in calls:  # counted as the ops count themselves (an unstacked group: each member's projection)
            unstacked = isinstance(w, tuple) and group_of(w) is None
            for _ in (w if unstacked else (w,)):
                self._decode(op.removesuffix("_group") if unstacked else op)
        self.calls.glue["projections"] += 1
        out: list[torch.Tensor] = []
        for y in gemv.fp8_gemv_jobs(plans):
            out += list(y) if isinstance(y, tuple) else [y]
        return tuple(out)

    def _projection_plans(self, x: torch.Tensor, op: str, w) -> list:
        """The own GEMV's plans of ``self.<op>(x, w)`` (a projection op: ``linear``, ``linear_f32`` or a group of
        them; a stacked group is one plan, an unstacked one a plan per member) where that op would launch them
        (:meth:`_own_gemv`), else ``[None]``."""
        single = op.removesuffix("_group")
        if isinstance(w, tuple) and group_of(w) is None:
            return [pl for lin in w for pl in self._projection_plans(x, single, lin)]
        grp = group_of(w) if isinstance(w, tuple) else None
        lin = grp.members[0] if grp is not None else w
        f32 = single == "linear_f32"
        own = self._own_gemv(x, lin, f32, grp)
        if own is None:
            return [None]
        route, geo, aq = own
        weight, scale = (grp.weight, grp.scale) if grp is not None else (lin.weight, lin.scale)
        return [gemv.gemv_plan(x, weight, scale if lin.fmt == "fp8" else None, act_quant=aq,
                               out_dtype=self.numerics.acc if f32 else self.numerics.act, route=route, geometry=geo,
                               segments=grp.sizes if grp is not None else None)]

    def _own_gemv(self, x: torch.Tensor, lin: Linear, f32: bool = False, grp=None):
        """``(route, GemvGeometry, act_quant)`` where ``linear`` (``linear_f32``; ``grp``: the stacked group's launch)
        of ``x`` by ``lin`` takes the own GEMV with its activation quantized in the kernel — decode rows, a kernel
        format, the dispatch's choice neither cuBLAS nor the ``dot`` route's ``prequant`` (a quantization launch of
        its own) — else None: where a fused path may take the projection's own launch with the same bits."""
        nm = self.numerics
        rows = x.numel() // max(x.shape[-1], 1)
        if self._unsupported(rows, x, lin.weight) is not None or \
                lin.fmt not in (("bf16", "f32") if f32 else ("fp8", "bf16", "f32")):
            return None
        aq = not f32 and nm.act_quant and lin.act_quant
        if grp is not None:
            impl, route, geo = self._stacked_choice(grp, rows, aq)
        else:
            impl, route, geo = self.gemv_choice(lin.out_features, lin.in_features, rows,
                                                weight="fp8" if lin.fmt == "fp8" else "bf16", act_quant=aq)
        if impl.startswith("cublas") or (route == "dot" and geo.prequant and aq):
            return None
        return route, geo, aq

    def _down_after_swiglu(self, g, u, limit, w2: Linear) -> torch.Tensor | None:
        """The shared expert's down projection with its activation computed in the GEMV's prologue (the fused path
        ``shared_swiglu``) where the projection takes the own GEMV with its quantization in the kernel
        (:meth:`_own_gemv`); else None."""
        own = self._own_gemv(g, w2)
        if own is None:
            return None
        route, geo, aq = own
        self._decode("linear")
        return gemv.fp8_gemv(g, w2.weight, w2.scale if w2.fmt == "fp8" else None, act_quant=aq,
                             out_dtype=self.numerics.act, route=route, geometry=geo, swiglu=(u, limit))
