"""The prefill (large token count) paths of the Triton backend.

:class:`TritonPrefillOps` is a mixin: each ``prefill_<op>`` method takes the arguments of ``ReferenceOps.<op>``
and returns the same result computed by the kernels in ``kernels/`` — or ``None`` when the kernel does not apply
(too few rows, a weight format or numerics the kernel does not implement, no GPU and no interpreter). The Triton
backend calls them first for its ops and falls back otherwise:

=================== ===================================================== =========================================
op                  kernel                                                applies when
=================== ===================================================== =========================================
linear              ``fp8_gemm.fp8_linear`` (Triton or cuBLAS)            FP8 weight, activation quantization on
                    ``fp8_gemm.weight_gemm``                              BF16 weight, or FP8 without act. quant.
linear_f32          ``fp8_gemm.weight_gemm`` (fp32 out)                   BF16 weight (router, compressor, head)
grouped_wo_a        ``fp8_gemm.weight_gemm`` (grouped)                    FP8 weight
expert_mlp          ``fp8_gemm.fp8_swiglu_mlp``                           FP8 shared expert, act. quant. on
routed_experts      ``moe_sort`` + ``fp4_moe_grouped`` (fused)            FP4 bank, activation quantization on
moe_stage1/2        ``fp4_moe_grouped.moe_stage1/2``                      as above
sparse_attention    ``attention_prefill.sparse_attention``                bf16 q and kv
indexer_select      ``attention_prefill.indexer_select`` (causal scores)  any number of entries, no TP split
indexer_scores/topk ``attention_prefill.indexer_scores/topk``             as above, any number of rows
compressor_pool     ``attention_prefill.compressor_pool``                 any number of entries
=================== ===================================================== =========================================

Every kernel needs ``numerics.act == bf16`` (they round where the reference rounds to bf16), fp32 ``acc``, and at
least ``prefill_min_tokens`` rows (64; the decode kernels take up to 63) — except the indexer's scores and
top-k and the compressor's pooling, which the per-op path has no decode kernel for: they run at any row count.
A tensor-parallel partial sum (``all_reduce``) of a projection is computed in fp32 and rounded after the reduction, as the reference does.

The settings (class attributes ``prefill_*``) left at ``None`` are the dispatch's (:mod:`dsv4lab.engine.dispatch`:
the GPU's tuned file, which ``dsv4lab bench kernels --suite prefill`` writes, over the documented defaults), and so
is the chunk size per prompt length (:func:`prefill_chunk`); the variants ``verify
kernels`` checks are the prefill families' (:mod:`dsv4lab.engine.kernel_families`). :func:`accumulation_bound` states
each kernel family's error bound (reduction length and accumulation model) for the tests and the benchmark's checks;
:meth:`TritonPrefillOps.prefill_accumulation_for` names the model of the kernel a call takes (verification judges
each call by it).

:class:`TritonPrefillBackend` is the mixin over :class:`~dsv4lab.core.model.ops.ReferenceOps` as a backend of its own
(prefill kernels, reference for everything else), used by the tests and the benchmark; it counts which ops ran on
kernels (:meth:`TritonPrefillBackend.report`).
"""
from __future__ import annotations

import functools
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

from dsv4lab.core import quant
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.engine.dispatch import GPU_DEFAULTS, PREFILL_DEFAULTS, Dispatch
from dsv4lab.engine.kernel_families import PREFILL_FAMILIES, PREFILL_MOE, moe_tags, verify_variants
from dsv4lab.engine.kernel_loader import kernel_module as _kernels  # on first use: triton is imported with the kernels

log = logging.getLogger("dsv4lab.triton")

PREFILL_OPS = ("linear", "linear_f32", "grouped_wo_a", "expert_mlp", "routed_experts", "moe_stage1", "moe_stage2",
               "sparse_attention", "indexer_select", "indexer_scores", "indexer_topk", "compressor_pool",
               "hc_pre_norm", "hc_post_pre_norm", "hc_post")


def interpreting() -> bool:
    """Whether the kernels run under Triton's CPU interpreter (read without importing triton)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=8)
def _device_dispatch(device_name: str | None, interpret: bool, tuned_env: str | None) -> Dispatch:
    return Dispatch.for_device(device_name, interpret)


def device_dispatch() -> Dispatch:
    """This process's :class:`~dsv4lab.engine.dispatch.Dispatch`: the GPU's tuned file over its defaults (the
    interpreter's defaults under Triton's interpreter); read once per GPU, interpreter mode and ``DSV4LAB_TUNED``."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return _device_dispatch(name, interpreting(), os.environ.get("DSV4LAB_TUNED"))


def prefill_chunk(prompt_tokens: int, dispatch: Dispatch | None = None) -> int:
    """The prefill chunk for a prompt of ``prompt_tokens`` tokens on this device (or by ``dispatch``): the tuned
    one, else one chunk up to 4,096 tokens and chunks of 4,096 beyond
    (:meth:`~dsv4lab.engine.dispatch.Dispatch.chunk`)."""
    return (dispatch or device_dispatch()).chunk(prompt_tokens)


def _can_launch(t: torch.Tensor) -> bool:
    if t.is_cuda:
        return True
    return _kernels("fp8_gemm").interpreting()


# ============================================================================================ error bounds
# Unit roundoff of the accumulations the prefill kernels run on (docs/kernels_prefill.md, Numerics):
TC_FP32_U = 2.0 ** -23  # bf16/fp16 tensor-core MMA: products exact, fp32 adds aligned with truncation (< 1 ulp)
TC_FP8_U = 2.0 ** -13   # Hopper FP8 MMA: about 14 significant bits kept per add (DeepSeek-V3 report, §3.3.2)
PROMOTION_K = 128       # the FP8 kernels promote the tensor-core partial to fp32 every 128-wide K block


# The accumulation kind of each prefill kernel family (of accumulation_bound), and its model's name in
# dsv4lab.tools.verify.bounds.UNIT_ROUNDOFF (which the backends report to verification).
KIND_MODEL = {"fp32": "fp32", "tc_bf16": "fp32_tc", "tc_fp8": "fp8_mma"}
MOE_ROUTE_KIND = {route: next(k for k, m in KIND_MODEL.items() if m == model)
                  for route, model in PREFILL_MOE.accumulation.items()}  # the grouped MoE's routes (the family's)


def accumulation_bound(terms: int, kind: str) -> dict:
    """``check_within_bound`` keywords for a ``terms``-long dot product accumulated as ``kind``:

    * ``"fp32"`` — exact products summed in fp32 on CUDA cores (RN, u = 2^-24): ``γ_n``;
    * ``"tc_bf16"`` — BF16/FP16 tensor cores (exact products, fp32 accumulator with truncating alignment):
      ``γ_n`` with u = 2^-23, i.e. ``c = 2n`` in units of fp32's 2^-24;
    * ``"tc_fp8"`` — FP8 tensor cores promoted every 128 K: within a block ``γ_128`` at u = 2^-13, then the
      ``n/128`` block partials summed in fp32 (RN): ``c = 128·2^11 + ⌈n/128⌉``.

    First-order bounds (``γ ≈ n·u``), each ``Σ|terms|``-relative, so they hold under cancellation."""
    if kind == "fp32":
        c = float(terms)
    elif kind == "tc_bf16":
        c = terms * TC_FP32_U / 2.0 ** -24
    elif kind == "tc_fp8":
        c = min(terms, PROMOTION_K) * TC_FP8_U / 2.0 ** -24 + -(-terms // PROMOTION_K)
    else:
        raise ValueError(f"accumulation kind {kind!r}: expected fp32, tc_bf16 or tc_fp8")
    return dict(terms=terms, c=c, acc_dtype=torch.float32)


# ============================================================================================ the mixin
class TritonPrefillOps:
    """Mixin with the prefill kernels (see the module docstring). Needs ``self.numerics``.

    Attributes (class defaults; set on an instance to change them; ``None`` = the dispatch's: the GPU's tuned
    file, else the default of :data:`~dsv4lab.engine.dispatch.PREFILL_DEFAULTS`):
        prefill_min_tokens: fewest token rows for which a prefill kernel is used.
        prefill_moe_route: ``"bf16"`` (default), ``"fp8"`` (falls back to ``bf16`` for a bank whose scales the
            exact E4M3 upcast cannot hold) or ``"scaled"``.
        prefill_moe_rows: sorter rows (the grouped GEMM's block height); None: by token count.
        prefill_moe_decode / prefill_moe_persistent / prefill_moe_scale_per_byte: the bf16 route's weight decode,
            scheduling and scale loads (see ``fp4_moe_grouped.MoEGeometry``).
        prefill_moe_tag: a launch variant of :func:`~dsv4lab.engine.kernel_families.moe_tags` (e.g. ``"w16"``: 16
            warps for gate/up); the three settings above override its fields.
        prefill_gemm_backend: FP8 GEMM on ``"triton"``, ``"cublas"`` (``torch._scaled_mm`` with the same block
            scales, where it takes them) or ``"auto"`` (cuBLAS where available).
        prefill_weight_gemm_backend: the bf16-activation GEMMs (``linear_f32``, grouped ``wo_a``, bf16 ``linear``)
            on ``"triton"`` (:func:`fp8_gemm.weight_gemm`), ``"cublas"`` (``fp8_gemm.cublas_weight_gemm``, where
            its probe passed) or ``"auto"`` (cuBLAS where available).
        prefill_mhc_rows: mHC pre/post of a prefill chunk on the rows kernel (``mhc.hc_pre_norm_rows``: the
            mixing matrix read once per row block) instead of the decode step's mix/finish pair (default False
            where nothing was measured; the H200's choice is True: a 4,096-row chunk's three mHC ops in 4.64 ms
            on the rows kernel's fastest geometry against 9.17 ms on the pair at 28d56f5, bit-identical outputs —
            ``data/results/h200/prefill_kernels_28d56f5_quick.json``).
        prefill_mhc_rows_geometry: the rows kernel's launch geometry, a key of ``mhc.ROWS_GEOMETRIES`` (None: the
            measured fastest, else the kernel's default).
        prefill_gemm_config / prefill_weight_gemm_config / prefill_attention_config / prefill_indexer_config:
            launch geometry names (see the kernel modules).
    """

    prefill_min_tokens: int = GPU_DEFAULTS.prefill_min_tokens
    prefill_moe_route: str | None = None
    prefill_moe_rows: int | None = None
    prefill_moe_decode: str | None = None
    prefill_moe_persistent: bool | None = None
    prefill_moe_scale_per_byte: bool | None = None
    prefill_gemm_backend: str | None = None
    prefill_moe_tag: str | None = None
    prefill_mhc_rows: bool | None = None
    prefill_mhc_rows_geometry: str | None = None
    prefill_weight_gemm_backend: str | None = None
    prefill_gemm_config: str = PREFILL_DEFAULTS["gemm_config"]
    prefill_weight_gemm_config: str = PREFILL_DEFAULTS["weight_gemm_config"]
    prefill_attention_config: str = PREFILL_DEFAULTS["attention_config"]
    prefill_indexer_config: str = PREFILL_DEFAULTS["indexer_config"]

    # ------------------------------------------------------------------ applicability and settings
    def _prefill_numerics_ok(self) -> bool:
        nm = self.numerics
        return nm.act == torch.bfloat16 and nm.acc == torch.float32

    def _prefill_applies(self, t: torch.Tensor, rows: int) -> bool:
        return rows >= self.prefill_min_tokens and self._prefill_numerics_ok() and _can_launch(t)

    def _any_rows_applies(self, t: torch.Tensor) -> bool:
        """For the ops the per-op path has no decode kernel for (the indexer's scores and top-k, the compressor's
        pooling): their prefill kernel at any row count beats the reference fallback — a speculative verify step
        or a short prompt would otherwise run them on the reference."""
        return self._prefill_numerics_ok() and _can_launch(t)

    def kernel_dispatch(self) -> Dispatch:
        """Where the settings left at None come from (this process's; ``TritonOps`` answers with its config)."""
        return device_dispatch()

    def _setting(self, name: str, tokens: int | None = None, default=None):
        """The setting ``prefill_<name>``: the instance's, else the dispatch's at ``tokens`` rows, else
        ``default`` (for the fields a launch variant decides)."""
        own = getattr(self, f"prefill_{name}")
        if own is not None:
            return own
        chosen = self.kernel_dispatch().prefill(name, tokens)
        return default if chosen is None else chosen

    def _moe_geometry(self, tokens: int, rows: int | None = None):
        fm = _kernels("fp4_moe_grouped")
        if rows is None:
            rows = self._setting("moe_rows", tokens)
        tagged = moe_tags().get(self._setting("moe_tag", tokens) or "", {})
        return fm.MoEGeometry(rows=rows, **tagged).replace(
            decode=self._setting("moe_decode", tokens, tagged.get("decode", "auto")),
            persistent=bool(self._setting("moe_persistent", tokens, tagged.get("persistent", False))),
            scale_per_byte=bool(self._setting("moe_scale_per_byte", tokens, tagged.get("scale_per_byte", False))))

    def _moe_route(self, bank, route: str | None = None, tokens: int | None = None) -> str:
        fm = _kernels("fp4_moe_grouped")
        route = route or self._setting("moe_route", tokens)
        if route == "fp8" and not fm.fp8_route_exact(bank):
            return "bf16"
        return route

    def _moe_applies(self, x: torch.Tensor, tokens: int, bank) -> bool:
        return (bank.fmt == "fp4" and self.numerics.act_quant and self._prefill_applies(x, tokens)
                and bank.dim % 32 == 0 and bank.inter % 32 == 0)

    def _gemm_backend(self, tokens: int | None = None) -> str:
        backend = self._setting("gemm_backend", tokens)
        return "cublas" if backend == "auto" else backend

    @staticmethod
    def _scale_f32(lin):
        """The weight's fp32 block scales for cuBLAS, computed once per scale tensor and kept on the Linear."""
        fg = _kernels("fp8_gemm")
        hit = getattr(lin, "_prefill_scale_f32", None)
        if hit is None or hit[0] != lin.scale.data_ptr():
            hit = (lin.scale.data_ptr(), fg.weight_scale_f32(lin.scale))
            lin._prefill_scale_f32 = hit
        return hit[1]

    # ------------------------------------------------------------------ projections
    def prefill_linear(self, x: torch.Tensor, lin, all_reduce=None) -> torch.Tensor | None:
        rows = x.numel() // max(1, x.shape[-1])
        if x.dtype != torch.bfloat16 or not self._prefill_applies(x, rows):
            return None
        fg = _kernels("fp8_gemm")
        # a row-split projection (all_reduce) is summed in fp32 and rounded after the reduction, as the reference
        out_dtype = torch.float32 if all_reduce is not None else torch.bfloat16
        if lin.fmt == "fp8" and lin.act_quant and self.numerics.act_quant:
            backend = self._gemm_backend(rows)
            y = fg.fp8_linear(x, lin.weight, lin.scale, config=self.prefill_gemm_config, backend=backend,
                              out_dtype=out_dtype, w_scale_f32=self._scale_f32(lin) if backend == "cublas" and
                              x.is_cuda else None)
        elif lin.fmt == "fp8" or (lin.fmt == "bf16" and not lin.act_quant):
            y = self._weight_gemm(x.reshape(-1, x.shape[-1]), lin, out_dtype).view(*x.shape[:-1], -1)
        else:
            return None
        if all_reduce is not None:
            y = all_reduce(y).to(torch.bfloat16)
        return y

    def prefill_linear_f32(self, x: torch.Tensor, lin) -> torch.Tensor | None:
        rows = x.numel() // max(1, x.shape[-1])
        if lin.fmt != "bf16" or x.dtype != torch.bfloat16 or not self._prefill_applies(x, rows):
            return None
        return self._weight_gemm(x.reshape(-1, x.shape[-1]), lin, torch.float32).view(*x.shape[:-1], -1)

    def prefill_grouped_wo_a(self, o: torch.Tensor, lin, groups: int) -> torch.Tensor | None:
        rows = o.numel() // max(1, o.shape[-1] * groups)
        if not (lin.fmt == "fp8" and o.dtype == torch.bfloat16 and self._prefill_applies(o, rows)):
            return None
        y = self._weight_gemm(o.reshape(rows, groups, o.shape[-1]), lin, torch.bfloat16, groups)
        return y.view(*o.shape[:-1], -1)

    def _weight_gemm_backend(self, x: torch.Tensor) -> str:
        """``"cublas"`` or ``"triton"`` for a bf16-activation GEMM: the setting (``auto``: cuBLAS where its probe
        passed), never cuBLAS where it is not available."""
        backend = self._setting("weight_gemm_backend", x.shape[0])
        if backend in ("auto", "cublas"):
            return "cublas" if x.is_cuda and _kernels("fp8_gemm").cublas_bf16_available(x.device) else "triton"
        return backend

    def _weight_gemm(self, x: torch.Tensor, lin, out_dtype: torch.dtype, groups: int = 1) -> torch.Tensor:
        """``x [M, K]`` (or ``[M, G, K]``) times a bf16 or FP8 weight (bf16 activations, fp32 accumulation): the
        Triton weight-stationary GEMM or cuBLAS (:meth:`_weight_gemm_backend`)."""
        fg = _kernels("fp8_gemm")
        scale = lin.scale if lin.fmt == "fp8" else None
        if self._weight_gemm_backend(x) == "cublas":
            return fg.cublas_weight_gemm(x, lin.weight, scale, out_dtype, groups)
        return fg.weight_gemm(x, lin.weight, scale, out_dtype, groups, config=self.prefill_weight_gemm_config)

    def prefill_expert_mlp(self, x, w1, w2, w3, limit, weight=None, shared=False):
        rows = x.numel() // max(1, x.shape[-1])
        if (weight is not None or x.dtype != torch.bfloat16 or not self.numerics.act_quant
                or any(w.fmt != "fp8" or not w.act_quant for w in (w1, w2, w3))
                or not self._prefill_applies(x, rows)):
            return None
        backend = self._gemm_backend(rows)
        y = _kernels("fp8_gemm").fp8_swiglu_mlp(
            x.reshape(-1, x.shape[-1]), w1.weight, w1.scale, w3.weight, w3.scale, w2.weight, w2.scale, limit,
            config=self.prefill_gemm_config, backend=backend,
            w2_scale_f32=self._scale_f32(w2) if backend == "cublas" and x.is_cuda else None)
        return y.view(*x.shape[:-1], -1)

    # ------------------------------------------------------------------ mHC (the glue with a matrix product)
    def _mhc_rows_apply(self, X: torch.Tensor) -> bool:
        """Whether the mHC rows kernel takes ``X [..., n, D]``: enough rows, bf16 or fp32 streams (the glue kernels'
        numerics), a GPU or the interpreter, not switched off by measurement, and the kernel works here."""
        rows = X.numel() // max(1, X.shape[-1] * X.shape[-2])
        return (rows >= self.prefill_min_tokens and self.numerics.dtype in (torch.bfloat16, torch.float32)
                and _can_launch(X) and bool(self._setting("mhc_rows", rows))
                and _kernels("mhc").rows_kernel_works(X.device))

    def _mhc_rows_geometry(self, X: torch.Tensor):
        """The tuned launch geometry (``prefill.mhc_rows``), else the kernel's default."""
        rows = X.numel() // max(1, X.shape[-1] * X.shape[-2])
        return _kernels("mhc").ROWS_GEOMETRIES.get(self._setting("mhc_rows_geometry", rows) or "")

    def prefill_hc_pre_norm(self, X, fn, base, scale, norm_weight, args):
        if not self._mhc_rows_apply(X):
            return None
        return _kernels("mhc").hc_pre_norm_rows(X, fn, base, scale, norm_weight, args.hc_sinkhorn_iters,
                                                args.norm_eps, args.hc_eps, self._mhc_rows_geometry(X))

    def prefill_hc_post_pre_norm(self, out, X, post, comb, fn, base, scale, norm_weight, args):
        if not self._mhc_rows_apply(X):
            return None
        return _kernels("mhc").hc_post_pre_norm_rows(out, X, post, comb, fn, base, scale, norm_weight,
                                                     args.hc_sinkhorn_iters, args.norm_eps, args.hc_eps,
                                                     self._mhc_rows_geometry(X))

    def prefill_hc_post(self, out, X, post, comb):
        if not self._mhc_rows_apply(X):
            return None
        return _kernels("mhc").hc_post_rows(out, X, post, comb, self._mhc_rows_geometry(X))

    # ------------------------------------------------------------------ experts
    def prefill_routed_experts(self, x, idx, weights, bank, limit, trace=None, all_reduce=None, route=None,
                               rows=None):
        if not self._moe_applies(x, idx.shape[0], bank):
            return None
        fm = _kernels("fp4_moe_grouped")
        route, geo = self._moe_route(bank, route, idx.shape[0]), self._moe_geometry(idx.shape[0], rows)
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
        return _kernels("fp4_moe_grouped").moe_stage1(x, idx, bank, route=self._moe_route(bank, route, idx.shape[0]),
                                                     geo=self._moe_geometry(idx.shape[0], rows))

    def prefill_moe_stage2(self, h, idx, bank, route=None, rows=None):
        if not self._moe_applies(h, idx.shape[0], bank):
            return None
        return _kernels("fp4_moe_grouped").moe_stage2(h, idx, bank, route=self._moe_route(bank, route, idx.shape[0]),
                                                     geo=self._moe_geometry(idx.shape[0], rows))

    # ------------------------------------------------------------------ attention side
    def prefill_sparse_attention(self, q, kv, idx, sink, scale, config=None):
        b, s = q.shape[:2]
        if not (q.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16 and self._prefill_applies(q, b * s)):
            return None
        return _kernels("attention_prefill").sparse_attention(q.contiguous(), kv.contiguous(), idx, sink, scale,
                                                             config=config or self.prefill_attention_config)

    def _indexer_ok(self, qi, w, keys, all_reduce) -> bool:
        b, s = qi.shape[:2]
        # split heads (all_reduce) must be summed before rounding: the reference's job
        return all_reduce is None and qi.dtype == keys.dtype == w.dtype == torch.bfloat16 and b * s > 0 and \
            self._any_rows_applies(qi)

    def prefill_indexer_select(self, qi, w, keys, positions, ratio, topk, all_reduce=None):
        ap = _kernels("attention_prefill")
        if not self._indexer_ok(qi, w, keys, all_reduce):
            return None
        return ap.indexer_select(qi.contiguous(), w.contiguous(), keys.contiguous(), positions, ratio, topk,
                                 config=self.prefill_indexer_config)

    def prefill_indexer_scores(self, qi, w, keys, all_reduce=None):
        if not self._indexer_ok(qi, w, keys, all_reduce):
            return None
        return _kernels("attention_prefill").indexer_scores(qi.contiguous(), w.contiguous(), keys.contiguous())

    def _topk_ok(self, scores) -> bool:
        b, s = scores.shape[:2]
        return b * s > 0 and self._any_rows_applies(scores)

    def _pool_ok(self, kv_slots, sc_slots) -> bool:
        # any number of completed entries: a prefill chunk completes several, an eager decode step at most one
        return (kv_slots.dtype == sc_slots.dtype == torch.float32 and kv_slots.shape[0] >= 1
                and self._any_rows_applies(kv_slots))

    def prefill_indexer_topk(self, scores, positions, ratio, topk):
        if not self._topk_ok(scores):
            return None
        return _kernels("attention_prefill").indexer_topk(scores.contiguous(), positions, ratio, topk)

    def prefill_compressor_pool(self, kv_slots, sc_slots):
        if not self._pool_ok(kv_slots, sc_slots):
            return None
        return _kernels("attention_prefill").compressor_pool(kv_slots, sc_slots)

    # ------------------------------------------------------------------ accumulation models
    def prefill_kernel_kind(self, op: str, *args, **kwargs) -> str | None:
        """The accumulation kind (:func:`accumulation_bound`) of the prefill kernel ``prefill_<op>(*args)`` would
        run, or None where none applies — the same conditions as the ``prefill_<op>`` methods above."""
        nm = self.numerics
        if op in ("linear", "linear_f32", "expert_mlp"):
            x, lin = args[0], args[1]
            rows = x.numel() // max(1, x.shape[-1])
            if x.dtype != torch.bfloat16 or not self._prefill_applies(x, rows):
                return None
            if op == "linear_f32":
                return "tc_bf16" if lin.fmt == "bf16" else None
            if op == "expert_mlp":
                ws = args[1:4]
                ok = (kwargs.get("weight", args[5] if len(args) > 5 else None) is None and nm.act_quant
                      and all(w.fmt == "fp8" and w.act_quant for w in ws))
                return "tc_fp8" if ok else None
            if lin.fmt == "fp8" and lin.act_quant and nm.act_quant:
                return "tc_fp8"
            return "tc_bf16" if lin.fmt == "fp8" or (lin.fmt == "bf16" and not lin.act_quant) else None
        if op == "grouped_wo_a":
            o, lin, groups = args[:3]
            rows = o.numel() // max(1, o.shape[-1] * groups)
            return "tc_bf16" if lin.fmt == "fp8" and o.dtype == torch.bfloat16 and self._prefill_applies(o, rows) \
                else None
        if op in ("routed_experts", "moe_stage1", "moe_stage2"):
            x, idx, bank = args[0], args[1], args[3] if op == "routed_experts" else args[2]
            if not self._moe_applies(x, idx.shape[0], bank):
                return None
            return MOE_ROUTE_KIND[self._moe_route(bank, kwargs.get("route"), idx.shape[0])]
        if op == "sparse_attention":
            q, kv = args[:2]
            ok = q.dtype == kv.dtype == torch.bfloat16 and self._prefill_applies(q, q.shape[0] * q.shape[1])
            return "tc_bf16" if ok else None
        if op in ("indexer_select", "indexer_scores"):
            qi, w, keys = args[:3]
            at = 6 if op == "indexer_select" else 3  # the position of all_reduce in the signature
            all_reduce = kwargs.get("all_reduce", args[at] if len(args) > at else None)
            return "tc_bf16" if self._indexer_ok(qi, w, keys, all_reduce) else None
        if op == "indexer_topk":
            return "fp32" if self._topk_ok(args[0]) else None
        if op == "compressor_pool":
            return "fp32" if self._pool_ok(*args[:2]) else None
        return None

    def prefill_accumulation_for(self, op: str, *args, **kwargs) -> str | None:
        """The accumulation model (a name of ``dsv4lab.tools.verify.bounds.UNIT_ROUNDOFF``) of the prefill kernel this call
        takes — FP8 tensor cores promoted per 128-K block (``fp8_mma``), bf16 tensor cores (``fp32_tc``) or CUDA
        cores (``fp32``) — or None where no prefill kernel applies. Under the interpreter every kernel sums in numpy's
        IEEE fp32 (``fp32``)."""
        kind = self.prefill_kernel_kind(op, *args, **kwargs)
        if kind is None:
            return None
        return "fp32" if _kernels("fp8_gemm").interpreting() else KIND_MODEL[kind]

    def prefill_variant_accumulation(self, method: str, variant: str, *args) -> str:
        """The accumulation model of the prefill variant ``variant`` of ``method`` (:meth:`prefill_variants`: each
        always runs its kernel) on ``args``: its family's model for its route — the ``prefill_gemm`` variant's route
        is the weight's (the FP8 GEMM for an FP8 weight with activation quantization, else the weight GEMM)."""
        if _kernels("fp8_gemm").interpreting():
            return "fp32"
        family, v = next(((f, v) for f, v in verify_variants(PREFILL_FAMILIES, method) if v.name == variant),
                         (None, None))
        if v is None:
            raise ValueError(f"{method} has no prefill variant {variant!r}")
        route = v.route
        if method == "linear" and route is None:
            lin = args[1]
            route = "fp8" if lin.fmt == "fp8" and lin.act_quant and self.numerics.act_quant else "bf16"
        return family.accumulation_of(route)

    # ------------------------------------------------------------------ variants (checked by `verify kernels`)
    def prefill_variants(self, method: str) -> dict[str, Callable]:
        """Every prefill verification variant of ``method`` (:mod:`~dsv4lab.engine.kernel_families`) as a callable
        with the reference signature (no thresholds: a variant always runs its kernel)."""
        return {v.name: self._variant_kernel(method, v) for _, v in verify_variants(PREFILL_FAMILIES, method)}

    def _variant_kernel(self, method: str, v) -> Callable:
        """How a verification variant calls its kernel: the kernel's launcher with the variant's route and fields,
        adapted to the reference signature."""
        f = v.fields
        if method == "routed_experts":
            fm = _kernels("fp4_moe_grouped")
            geo = fm.MoEGeometry(**f)
            return (lambda x, idx, w, bank, limit, trace=None, all_reduce=None: fm.routed_experts(
                x.contiguous(), idx, w.float(), bank, limit, route=v.route, geo=geo, all_reduce=all_reduce))
        if method in ("moe_stage1", "moe_stage2"):
            fm = _kernels("fp4_moe_grouped")
            fn, geo = getattr(fm, method), fm.MoEGeometry(**f)
            return lambda a, idx, bank: fn(a, idx, bank, route=v.route, geo=geo)
        fg, ap = _kernels("fp8_gemm"), _kernels("attention_prefill")
        if method == "linear":
            def prefill_gemm(x, lin, all_reduce=None):
                if all_reduce is not None or x.dtype != torch.bfloat16 or lin.fmt not in ("fp8", "bf16"):
                    return ReferenceOps.linear(self, x, lin, all_reduce)  # the variant is the GEMMs alone
                if lin.fmt == "fp8" and lin.act_quant and self.numerics.act_quant:
                    return fg.fp8_linear(x, lin.weight, lin.scale, config=f["config"])
                y = fg.weight_gemm(x.reshape(-1, x.shape[-1]), lin.weight, lin.scale if lin.fmt == "fp8" else None,
                                   torch.bfloat16, config=f["config"])
                return y.view(*x.shape[:-1], -1)
            return prefill_gemm
        if method == "linear_f32":
            return lambda x, lin: fg.weight_gemm(x.reshape(-1, x.shape[-1]), lin.weight, None, torch.float32,
                                                 config=f["config"]).view(*x.shape[:-1], -1)
        if method == "grouped_wo_a":
            return lambda o, lin, groups: fg.weight_gemm(o.reshape(-1, groups, o.shape[-1]), lin.weight, lin.scale,
                                                         torch.bfloat16, groups, config=f["config"]).view(
                                                             *o.shape[:-1], -1)
        if method == "expert_mlp":
            return lambda x, w1, w2, w3, limit, weight=None, shared=False: fg.fp8_swiglu_mlp(
                x, w1.weight, w1.scale, w3.weight, w3.scale, w2.weight, w2.scale, limit, config=f["config"])
        if method == "sparse_attention":
            return lambda q, kv, idx, sink, scale: ap.sparse_attention(q, kv, idx, sink, scale, config=f["config"])
        if method == "indexer_select":
            return lambda qi, w, keys, positions, ratio, topk, all_reduce=None: ap.indexer_select(
                qi, w, keys, positions, ratio, topk, config=f["config"])
        return getattr(ap, method)  # indexer_scores, indexer_topk, compressor_pool: the kernel has the signature


# ============================================================================================ standalone backend
@dataclass
class _Counts:
    kernel_runs: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)


class TritonPrefillBackend(TritonPrefillOps, ReferenceOps):
    """Prefill kernels where they apply, the reference elsewhere; counts kernel runs and fallbacks per op."""

    name = "triton-prefill"

    def __init__(self, numerics, min_tokens: int | None = None, **settings):
        super().__init__(numerics)
        if min_tokens is not None:
            self.prefill_min_tokens = min_tokens
        for key, value in settings.items():
            if not hasattr(TritonPrefillOps, f"prefill_{key}"):
                raise ValueError(f"unknown prefill setting {key!r}; known: " + ", ".join(
                    n[len("prefill_"):] for n in vars(TritonPrefillOps) if n.startswith("prefill_")
                    and not callable(getattr(TritonPrefillOps, n))))
            setattr(self, f"prefill_{key}", value)
        counts = _Counts()
        self.kernel_runs, self.fallbacks = counts.kernel_runs, counts.fallbacks

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

    def accumulation_for(self, op: str, *args, variant: str | None = None, **kwargs) -> str:
        """The accumulation model of this call (a prefill kernel's, or the reference's fp32 where none applies)."""
        if variant is not None:
            return self.prefill_variant_accumulation(op, variant, *args)
        return self.prefill_accumulation_for(op, *args, **kwargs) or "fp32"

    def linear(self, x, lin, all_reduce=None):
        return self._dispatch("linear", self.prefill_linear(x, lin, all_reduce),
                              lambda: ReferenceOps.linear(self, x, lin, all_reduce))

    def linear_f32(self, x, lin):
        return self._dispatch("linear_f32", self.prefill_linear_f32(x, lin),
                              lambda: ReferenceOps.linear_f32(self, x, lin))

    def grouped_wo_a(self, o, lin, groups):
        return self._dispatch("grouped_wo_a", self.prefill_grouped_wo_a(o, lin, groups),
                              lambda: ReferenceOps.grouped_wo_a(self, o, lin, groups))

    def expert_mlp(self, x, w1, w2, w3, limit, weight=None, shared=False):
        return self._dispatch("expert_mlp", self.prefill_expert_mlp(x, w1, w2, w3, limit, weight, shared),
                              lambda: ReferenceOps.expert_mlp(self, x, w1, w2, w3, limit, weight, shared))

    def routed_experts(self, x, idx, weights, bank, limit, trace=None, all_reduce=None):
        return self._dispatch("routed_experts",
                              self.prefill_routed_experts(x, idx, weights, bank, limit, trace, all_reduce),
                              lambda: ReferenceOps.routed_experts(self, x, idx, weights, bank, limit, trace,
                                                                  all_reduce))

    def moe_stage1(self, x, idx, bank):
        return self._dispatch("moe_stage1", self.prefill_moe_stage1(x, idx, bank),
                              lambda: ReferenceOps.moe_stage1(self, x, idx, bank))

    def moe_stage2(self, h, idx, bank):
        return self._dispatch("moe_stage2", self.prefill_moe_stage2(h, idx, bank),
                              lambda: ReferenceOps.moe_stage2(self, h, idx, bank))

    def sparse_attention(self, q, kv, idx, sink, scale):
        return self._dispatch("sparse_attention", self.prefill_sparse_attention(q, kv, idx, sink, scale),
                              lambda: ReferenceOps.sparse_attention(self, q, kv, idx, sink, scale))

    def indexer_select(self, qi, w, keys, positions, ratio, topk, all_reduce=None):
        return self._dispatch("indexer_select",
                              self.prefill_indexer_select(qi, w, keys, positions, ratio, topk, all_reduce),
                              lambda: ReferenceOps.indexer_select(self, qi, w, keys, positions, ratio, topk,
                                                                  all_reduce))

    def indexer_scores(self, qi, w, keys, all_reduce=None):
        return self._dispatch("indexer_scores", self.prefill_indexer_scores(qi, w, keys, all_reduce),
                              lambda: ReferenceOps.indexer_scores(self, qi, w, keys, all_reduce))

    def indexer_topk(self, scores, positions, ratio, topk):
        return self._dispatch("indexer_topk", self.prefill_indexer_topk(scores, positions, ratio, topk),
                              lambda: ReferenceOps.indexer_topk(self, scores, positions, ratio, topk))

    def compressor_pool(self, kv_slots, sc_slots):
        return self._dispatch("compressor_pool", self.prefill_compressor_pool(kv_slots, sc_slots),
                              lambda: ReferenceOps.compressor_pool(self, kv_slots, sc_slots))

    def hc_pre_norm(self, X, fn, base, scale, norm_weight, args):
        return self._dispatch("hc_pre_norm", self.prefill_hc_pre_norm(X, fn, base, scale, norm_weight, args),
                              lambda: ReferenceOps.hc_pre_norm(self, X, fn, base, scale, norm_weight, args))

    def hc_post_pre_norm(self, out, X, post, comb, fn, base, scale, norm_weight, args):
        return self._dispatch("hc_post_pre_norm",
                              self.prefill_hc_post_pre_norm(out, X, post, comb, fn, base, scale, norm_weight, args),
                              lambda: ReferenceOps.hc_post_pre_norm(self, out, X, post, comb, fn, base, scale,
                                                                    norm_weight, args))

    def hc_post(self, out, X, post, comb):
        return self._dispatch("hc_post", self.prefill_hc_post(out, X, post, comb),
                              lambda: ReferenceOps.hc_post(self, out, X, post, comb))


# ============================================================================================ Σ|terms| of the ops
def linear_magnitude(x: torch.Tensor, lin, act_quant: bool) -> torch.Tensor:
    """``Σ_k |x_k · W_nk|`` per output of a projection (float64), with ``x`` quantized as the reference does."""
    xq = quant.act_qdq_fp8(x) if act_quant else x
    return xq.double().abs() @ lin.dequantized(torch.float64).abs().T


def expert_stage_magnitude(x: torch.Tensor, idx: torch.Tensor, bank, which: str, act_quant: bool) -> torch.Tensor:
    """``Σ|terms|`` of one routed-expert projection per slot: ``x [T, K]`` (stage 1) or ``[T, k, K]`` (stage 2's
    per-slot input), ``which`` ∈ {w1, w3, w2} → ``[T, k, N]`` float64 (NaN for slots of other ranks)."""
    T, k = idx.shape
    per_slot = x.ndim == 3
    xq = quant.act_qdq_fp8(x.to(torch.bfloat16)) if act_quant else x
    n = bank.inter if which != "w2" else bank.dim
    out = torch.full((T, k, n), float("nan"), dtype=torch.float64, device=x.device)
    for e in torch.unique(idx).tolist():
        if not bank.owns(e):
            continue
        tok, slot = (idx == e).nonzero(as_tuple=True)
        rows = xq[tok, slot] if per_slot else xq[tok]
        out[tok, slot] = rows.double().abs() @ bank.dequantized(which, e, torch.float64).abs().T
    return out
