"""The prefill (large token count) paths of the Triton backend.

:class:`TritonPrefillOps` is a mixin: each ``prefill_<op>`` method takes the arguments of
``ReferenceOps.<op>`` and returns the same result computed by the kernels in ``kernels/`` — or ``None`` when the
kernel does not apply (too few tokens, another weight format, numerics the kernel does not implement, no GPU and
no interpreter). The Triton backend calls them first for its ops and falls back otherwise:

=================== ============================================== =================================================
op                  kernel                                         applies when
=================== ============================================== =================================================
linear              ``fp8_gemm.fp8_linear``                        FP8 weight, activation quantization on, M ≥ min
grouped_wo_a        ``fp8_gemm.grouped_bf16_fp8_gemm``             FP8 weight, M ≥ min
routed_experts      ``moe_sort`` + ``fp4_moe_grouped`` (fused)     FP4 bank, activation quantization on, T ≥ min
moe_stage1/2        ``fp4_moe_grouped.moe_stage1/2``               as above
sparse_attention    ``attention_prefill.sparse_attention``         b·s ≥ min
indexer_scores      ``attention_prefill.indexer_scores``           b·s ≥ min
indexer_topk        ``attention_prefill.indexer_topk``             b·s ≥ min, T ≤ TOPK_MAX_ENTRIES
compressor_pool     ``attention_prefill.compressor_pool``          entries ≥ min / 4
=================== ============================================== =================================================

All kernels need ``numerics.act == bf16`` (they round where the reference rounds to bf16) and fp32 ``acc``.
:class:`TritonPrefillBackend` is the mixin over :class:`~dsv4lab.model.ops.ReferenceOps` as a backend of its own
(prefill kernels, reference for everything else), used by the tests and by ``dsv4lab bench kernels --suite
prefill``; it counts which ops ran on kernels (:meth:`TritonPrefillBackend.report`).
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

import torch

from ..model.ops import ReferenceOps
from .kernel_loader import kernel_module as _kernels  # on first use: triton is imported with the kernels

PREFILL_OPS = ("linear", "grouped_wo_a", "routed_experts", "moe_stage1", "moe_stage2", "sparse_attention",
               "indexer_scores", "indexer_topk", "compressor_pool")


def _can_launch(t: torch.Tensor) -> bool:
    if t.is_cuda:
        return True
    return _kernels("fp8_gemm").interpreting()


class TritonPrefillOps:
    """Mixin with the prefill kernels (see the module docstring). Needs ``self.numerics``.

    Attributes (class defaults; set on an instance to change them):
        prefill_min_tokens: fewest tokens (rows of the op) for which a prefill kernel is used.
        prefill_moe_route: ``"bf16"`` (default: fp32 accumulation on every GPU), ``"fp8"`` (Hopper's FP8 MMA
            accumulates with reduced precision, see docs/kernels_prefill.md; falls back to ``bf16`` for a bank whose
            scales the exact E4M3 upcast cannot hold) or ``"scaled"``.
        prefill_moe_rows: sorter rows (the grouped GEMM's block height).
        prefill_gemm_config / prefill_attention_config: launch geometry names (see the kernel modules).
    """

    prefill_min_tokens: int = 64
    prefill_moe_route: str = "bf16"
    prefill_moe_rows: int = 64
    prefill_gemm_config: str = "m128n128"
    prefill_attention_config: str = "h64n32x"

    # ------------------------------------------------------------------ applicability
    def _prefill_numerics_ok(self) -> bool:
        nm = self.numerics
        return nm.act == torch.bfloat16 and nm.acc == torch.float32

    def _prefill_applies(self, t: torch.Tensor, rows: int) -> bool:
        return rows >= self.prefill_min_tokens and self._prefill_numerics_ok() and _can_launch(t)

    def _moe_geometry(self, rows: int | None = None):
        return _kernels("fp4_moe_grouped").MoEGeometry(rows=rows or self.prefill_moe_rows)

    def _moe_route(self, bank, route: str | None = None) -> str:
        fm = _kernels("fp4_moe_grouped")
        route = route or self.prefill_moe_route
        if route == "fp8" and not fm.fp8_route_exact(bank):
            return "bf16"
        return route

    def _moe_applies(self, x: torch.Tensor, tokens: int, bank) -> bool:
        return (bank.fmt == "fp4" and self.numerics.act_quant and self._prefill_applies(x, tokens)
                and bank.dim % 32 == 0 and bank.inter % 32 == 0)

    # ------------------------------------------------------------------ projections
    def prefill_linear(self, x: torch.Tensor, lin, all_reduce=None) -> torch.Tensor | None:
        rows = x.numel() // max(1, x.shape[-1])
        # a row-split projection (all_reduce) must be summed before rounding: the reference's job
        if all_reduce is not None or not (lin.fmt == "fp8" and lin.act_quant and self.numerics.act_quant
                                          and self._prefill_applies(x, rows)):
            return None
        return _kernels("fp8_gemm").fp8_linear(x.to(torch.bfloat16), lin.weight, lin.scale,
                                              config=self.prefill_gemm_config)

    def prefill_grouped_wo_a(self, o: torch.Tensor, lin, groups: int) -> torch.Tensor | None:
        rows = o.numel() // max(1, o.shape[-1] * groups)
        if not (lin.fmt == "fp8" and o.dtype == torch.bfloat16 and self._prefill_applies(o, rows)):
            return None
        y = _kernels("fp8_gemm").grouped_bf16_fp8_gemm(o.reshape(rows, groups, o.shape[-1]), lin.weight, lin.scale,
                                                       groups, config=self.prefill_gemm_config)
        return y.view(*o.shape[:-1], -1)

    # ------------------------------------------------------------------ experts
    def prefill_routed_experts(self, x, idx, weights, bank, limit, trace=None, all_reduce=None, route=None,
                               rows=None):
        if not self._moe_applies(x, idx.shape[0], bank):
            return None
        fm = _kernels("fp4_moe_grouped")
        route, geo = self._moe_route(bank, route), self._moe_geometry(rows)
        if trace is None:
            return fm.routed_experts(x.contiguous(), idx, weights.float(), bank, limit, route=route, geo=geo,
                                     all_reduce=all_reduce)
        # traced (layer-level verification): the same kernels stage by stage, so each stage can be compared
        g, u = fm.moe_stage1(x, idx, bank, route=route, geo=geo)
        h = self.moe_activation(g, u, weights, limit)
        out = fm.moe_stage2(h, idx, bank, route=route, geo=geo)
        trace("stage1_w1", g)
        trace("stage1_w3", u)
        trace("activation", h)
        trace("stage2_w2", out)
        return self.moe_combine(out, idx, all_reduce)

    def prefill_moe_stage1(self, x, idx, bank, route=None, rows=None):
        if not self._moe_applies(x, idx.shape[0], bank):
            return None
        return _kernels("fp4_moe_grouped").moe_stage1(x, idx, bank, route=self._moe_route(bank, route),
                                                     geo=self._moe_geometry(rows))

    def prefill_moe_stage2(self, h, idx, bank, route=None, rows=None):
        if not self._moe_applies(h, idx.shape[0], bank):
            return None
        return _kernels("fp4_moe_grouped").moe_stage2(h, idx, bank, route=self._moe_route(bank, route),
                                                     geo=self._moe_geometry(rows))

    # ------------------------------------------------------------------ attention side
    def prefill_sparse_attention(self, q, kv, idx, sink, scale, config=None):
        b, s = q.shape[:2]
        if not (q.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16 and self._prefill_applies(q, b * s)):
            return None
        return _kernels("attention_prefill").sparse_attention(q.contiguous(), kv.contiguous(), idx, sink, scale,
                                                             config=config or self.prefill_attention_config)

    def prefill_indexer_scores(self, qi, w, keys, all_reduce=None):
        b, s = qi.shape[:2]
        # split heads (all_reduce) must be summed before rounding: the reference's job
        if all_reduce is not None or not (qi.dtype == keys.dtype == w.dtype == torch.bfloat16
                                          and self._prefill_applies(qi, b * s)):
            return None
        return _kernels("attention_prefill").indexer_scores(qi.contiguous(), w.contiguous(), keys.contiguous())

    def prefill_indexer_topk(self, scores, positions, ratio, topk):
        ap = _kernels("attention_prefill")
        b, s, T = scores.shape
        if T > ap.TOPK_MAX_ENTRIES or not self._prefill_applies(scores, b * s):
            return None
        return ap.indexer_topk(scores.contiguous(), positions, ratio, topk)

    def prefill_compressor_pool(self, kv_slots, sc_slots):
        nb = kv_slots.shape[0]
        if not (kv_slots.dtype == sc_slots.dtype == torch.float32
                and self._prefill_applies(kv_slots, nb * 4)):
            return None
        return _kernels("attention_prefill").compressor_pool(kv_slots, sc_slots)

    # ------------------------------------------------------------------ variants (checked by `verify kernels`)
    def prefill_variants(self, method: str) -> dict[str, Callable]:
        """Every prefill route/geometry of ``method`` as a callable with the reference signature (no thresholds:
        a variant always runs its kernel)."""
        out: dict[str, Callable] = {}
        if method == "routed_experts":
            fm = _kernels("fp4_moe_grouped")
            for route, rows in (("bf16", 16), ("bf16", 64), ("fp8", 32), ("scaled", 16)):
                out[f"prefill_{route}_rows{rows}"] = (
                    lambda x, idx, w, bank, limit, trace=None, all_reduce=None, route=route, rows=rows:
                    fm.routed_experts(x.contiguous(), idx, w.float(), bank, limit, route=route,
                                      geo=fm.MoEGeometry(rows=rows), all_reduce=all_reduce))
        elif method in ("moe_stage1", "moe_stage2"):
            fm = _kernels("fp4_moe_grouped")
            fn = getattr(fm, method)
            for route in fm.ROUTES:
                out[f"prefill_{route}"] = (lambda a, idx, bank, route=route, fn=fn:
                                           fn(a, idx, bank, route=route, geo=fm.MoEGeometry(rows=16)))
        elif method == "linear":
            fg = _kernels("fp8_gemm")

            def fp8_linear(x, lin, all_reduce=None):
                if lin.fmt != "fp8" or all_reduce is not None:  # the variant is the FP8 GEMM alone
                    return ReferenceOps.linear(self, x, lin, all_reduce)
                return fg.fp8_linear(x.to(torch.bfloat16), lin.weight, lin.scale, config="small")
            out["prefill_fp8_gemm"] = fp8_linear
        elif method == "grouped_wo_a":
            fg = _kernels("fp8_gemm")
            out["prefill_bf16_fp8_gemm"] = (lambda o, lin, groups: fg.grouped_bf16_fp8_gemm(
                o.reshape(-1, groups, o.shape[-1]), lin.weight, lin.scale, groups, config="small").view(
                    *o.shape[:-1], -1))
        elif method == "sparse_attention":
            ap = _kernels("attention_prefill")
            for cfg in ("h16n16", "h16n16x", "h64n32d2"):
                out[f"prefill_{cfg}"] = (lambda q, kv, idx, sink, scale, cfg=cfg:
                                         ap.sparse_attention(q, kv, idx, sink, scale, config=cfg))
        elif method in ("indexer_scores", "indexer_topk", "compressor_pool"):
            out["prefill"] = getattr(_kernels("attention_prefill"), method)
        return out


class TritonPrefillBackend(TritonPrefillOps, ReferenceOps):
    """Prefill kernels where they apply, the reference elsewhere; counts kernel runs and fallbacks per op."""

    name = "triton-prefill"

    def __init__(self, numerics, min_tokens: int | None = None, **settings):
        super().__init__(numerics)
        if min_tokens is not None:
            self.prefill_min_tokens = min_tokens
        for key, value in settings.items():
            if not hasattr(TritonPrefillOps, f"prefill_{key}"):
                raise ValueError(f"unknown prefill setting {key!r}")
            setattr(self, f"prefill_{key}", value)
        self.kernel_runs: Counter = Counter()
        self.fallbacks: Counter = Counter()

    def _dispatch(self, op: str, result, fallback):
        if result is not None:
            self.kernel_runs[op] += 1
            return result
        self.fallbacks[op] += 1
        return fallback()

    def report(self) -> str:
        """One line per op: how often it ran on a kernel and how often it fell back to the reference."""
        lines = [f"{self.name}: prefill kernels from {self.prefill_min_tokens} tokens"]
        for op in PREFILL_OPS:
            lines.append(f"  {op:18s} kernel {self.kernel_runs[op]:5d}  reference {self.fallbacks[op]:5d}")
        return "\n".join(lines)

    def variants(self, method: str) -> dict[str, Callable]:
        return self.prefill_variants(method)

    def linear(self, x, lin, all_reduce=None):
        return self._dispatch("linear", self.prefill_linear(x, lin, all_reduce),
                              lambda: super(TritonPrefillBackend, self).linear(x, lin, all_reduce))

    def grouped_wo_a(self, o, lin, groups):
        return self._dispatch("grouped_wo_a", self.prefill_grouped_wo_a(o, lin, groups),
                              lambda: super(TritonPrefillBackend, self).grouped_wo_a(o, lin, groups))

    def routed_experts(self, x, idx, weights, bank, limit, trace=None, all_reduce=None):
        return self._dispatch("routed_experts",
                              self.prefill_routed_experts(x, idx, weights, bank, limit, trace, all_reduce),
                              lambda: super(TritonPrefillBackend, self).routed_experts(x, idx, weights, bank, limit,
                                                                                       trace, all_reduce))

    def moe_stage1(self, x, idx, bank):
        return self._dispatch("moe_stage1", self.prefill_moe_stage1(x, idx, bank),
                              lambda: super(TritonPrefillBackend, self).moe_stage1(x, idx, bank))

    def moe_stage2(self, h, idx, bank):
        return self._dispatch("moe_stage2", self.prefill_moe_stage2(h, idx, bank),
                              lambda: super(TritonPrefillBackend, self).moe_stage2(h, idx, bank))

    def sparse_attention(self, q, kv, idx, sink, scale):
        return self._dispatch("sparse_attention", self.prefill_sparse_attention(q, kv, idx, sink, scale),
                              lambda: super(TritonPrefillBackend, self).sparse_attention(q, kv, idx, sink, scale))

    def indexer_scores(self, qi, w, keys, all_reduce=None):
        return self._dispatch("indexer_scores", self.prefill_indexer_scores(qi, w, keys, all_reduce),
                              lambda: super(TritonPrefillBackend, self).indexer_scores(qi, w, keys, all_reduce))

    def indexer_topk(self, scores, positions, ratio, topk):
        return self._dispatch("indexer_topk", self.prefill_indexer_topk(scores, positions, ratio, topk),
                              lambda: super(TritonPrefillBackend, self).indexer_topk(scores, positions, ratio, topk))

    def compressor_pool(self, kv_slots, sc_slots):
        return self._dispatch("compressor_pool", self.prefill_compressor_pool(kv_slots, sc_slots),
                              lambda: super(TritonPrefillBackend, self).compressor_pool(kv_slots, sc_slots))
