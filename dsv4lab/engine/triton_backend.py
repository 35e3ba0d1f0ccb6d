"""The Triton backend: :class:`TritonOps` runs each op on a kernel where one applies and the reference otherwise.

For every op the order is: the prefill kernels (:class:`~dsv4lab.engine.triton_prefill.TritonPrefillOps`, many
token rows), then the decode kernels (few rows), then the reference. Decode kernels (``kernels/``, imported as
``dsv4lab_kernels``):

* ``linear`` (FP8 and BF16 weights), ``linear_f32`` (BF16/fp32 weights), ``grouped_wo_a`` (FP8 weight read
  directly, no BF16 copy) — :mod:`dsv4lab_kernels.fp8_gemv`, or cuBLAS where the GPU's tuned file says it is
  faster within its error bound; ``linear_group`` and
  ``linear_f32_group`` (projections of one input whose weights the decode step stacked,
  :mod:`dsv4lab.engine.decode_groups`) in one launch;
* ``routed_experts``, ``moe_stage1``, ``moe_stage2`` — packed FP4 experts, :mod:`dsv4lab_kernels.fp4_moe_decode`;
* ``sparse_attention`` — :mod:`dsv4lab_kernels.attention_decode` (plus :meth:`TritonOps.attention_from_caches`,
  the two-cache form the static decode step uses, with the inverse RoPE of the output in its epilogue).

The glue between them — row-parallel kernels for any number of rows, prefill chunks included (see
``docs/kernels_decode.md``, "The fused decode step"):

* ``hc_pre_norm``, ``hc_post_pre_norm``, ``hc_post``, ``hc_head`` — :mod:`dsv4lab_kernels.mhc` (a prefill chunk's
  mHC on its rows kernel, through the prefill dispatch);
* ``rms_norm``, ``rope``, ``head_rms_rope``, ``kv_norm_rope``, ``indexer_query`` —
  :mod:`dsv4lab_kernels.norm_rope_quant`;
* ``compressor_step`` — :mod:`dsv4lab_kernels.compressor_decode`; ``router_topk`` — :mod:`dsv4lab_kernels.router`;
  ``indexer_select`` — :mod:`dsv4lab_kernels.indexer_decode`; ``expert_mlp`` (the shared expert) — its projections
  on the GEMV above around :mod:`dsv4lab_kernels.swiglu`; ``greedy`` (the step's argmax and finiteness flag) —
  :mod:`dsv4lab_kernels.greedy`.

The decode step's fused paths — one launch where the unfused step has several, the same bits — are
:class:`~dsv4lab.engine.triton_fused.FusedPaths`, a part of this class in a module of their own.

Every other op, and every call no kernel covers (a float64 oracle dtype, tensor-parallel partial sums, a trace
request, too many rows for the decode kernels but too few for the prefill ones), runs the reference; each such
fallback is counted, logged once per (op, reason), and listed by :meth:`TritonOps.report`.

Which route and launch geometry a kernel takes is not decided here: every op asks the dispatch
(:class:`~dsv4lab.engine.dispatch.Dispatch`, ``TritonOps.config`` — the GPU's tuned table over the device's
documented defaults), and :meth:`TritonOps.variants` offers the verification variants the kernel families declare
(:mod:`~dsv4lab.engine.kernel_families`).

:meth:`TritonOps.accumulation_for` names the accumulation model of the kernel a call takes — from the kernels' own
families' tables (:mod:`~dsv4lab.engine.kernel_families`: per GEMV route and for cuBLAS, per MoE route, the prefill
families) — so verification judges each call, including a route the tuned file switched, by its own bound.

On a machine without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` is set here, before
any kernel module is imported, unless the caller chose otherwise).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from dsv4lab.core.model.linear import ExpertBank, Linear
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.engine.decode_groups import ProjectionGroup, group_of
from dsv4lab.engine.dispatch import Dispatch
from dsv4lab.engine.kernel_families import (ATTENTION, ATTENTION_SPLIT, DECODE_FAMILIES, GEMV, INDEXER_SPLIT, MOE,
                                            verify_variants)
from dsv4lab.engine.kernel_loader import kernel_module
from dsv4lab.engine.triton_fused import FusedPaths
from dsv4lab.engine.triton_prefill import TritonPrefillOps, device_dispatch, interpreting

log = logging.getLogger("dsv4lab.triton")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


gemv = kernel_module("fp8_gemv")
moe = kernel_module("fp4_moe_decode")
attn = kernel_module("attention_decode")
attn_split = kernel_module("attention_split_decode")
mhc = kernel_module("mhc")
nrq = kernel_module("norm_rope_quant")
cmp_decode = kernel_module("compressor_decode")
router = kernel_module("router")
idx_decode = kernel_module("indexer_decode")
idx_split = kernel_module("indexer_split_decode")
act_kernels = kernel_module("swiglu")

# The fused glue ops (row-parallel kernels for any row count).
GLUE_OPS = ("rms_norm", "hc_pre_norm", "hc_post_pre_norm", "hc_post", "hc_head", "head_rms_rope", "kv_norm_rope",
            "indexer_query", "indexer_select_decode", "router_topk", "compressor_step", "expert_mlp", "rope",
            "moe_output", "greedy", "moe_post_pre_norm", "attention_norms", "query_heads", "compressor_pair",
            "projections", "expert_down")
# Ops of ReferenceOps that may run on a kernel (decode, prefill or glue); the others always run the reference.
KERNEL_OPS = ("linear", "linear_f32", "linear_group", "linear_f32_group", "grouped_wo_a", "routed_experts", "moe_stage1", "moe_stage2",
              "sparse_attention", "attention_from_caches", "indexer_scores", "indexer_topk", "compressor_pool",
              "indexer_select") + GLUE_OPS
# Helpers other ops call (counting them would count one op twice) and state hygiene, not compute.
_NOT_COUNTED = ("elementwise", "compressed_rope_position", "reset_compressor_state")
REFERENCE_ONLY_OPS = tuple(n for n, v in vars(ReferenceOps).items()
                           if callable(v) and not n.startswith("_") and n not in KERNEL_OPS + _NOT_COUNTED)

# Accumulation models, as dsv4lab.tools.verify.bounds.UNIT_ROUNDOFF names them, from the tightest to the loosest; a
# kernel table's factor c (its sums err by γ(c·n) in fp32 units) maps to one of the first three.
ACCUMULATION_MODELS = ("fp32", "fp32_tc", "fp32_tc4", "fp8_mma")
_FACTOR_MODEL = {1.0: "fp32", 2.0: "fp32_tc", 4.0: "fp32_tc4"}


def accumulation_model(factor: float | str) -> str:
    """The model of a kernel table's accumulation factor ``c`` (``γ(c·n)`` with fp32's unit roundoff), or the
    model a table names itself (a blocked one: the decode MoE's ``fp8lut`` route's ``fp8_mma``)."""
    if isinstance(factor, str):
        if factor not in ACCUMULATION_MODELS:
            raise ValueError(f"no accumulation model {factor!r} (known: {', '.join(ACCUMULATION_MODELS)})")
        return factor
    if float(factor) not in _FACTOR_MODEL:
        raise ValueError(f"no accumulation model for the factor {factor} (known: {sorted(_FACTOR_MODEL)})")
    return _FACTOR_MODEL[float(factor)]


def loosest(*models: str) -> str:
    """The loosest of accumulation models (a composite op is judged under the loosest of its parts)."""
    return max(models, key=ACCUMULATION_MODELS.index)


def _cublas_scale_of(grp) -> torch.Tensor:
    """:func:`_cublas_scale` of a stacked group's scales."""
    key = grp.scale.data_ptr()
    hit = grp.members[0].__dict__.get("_cublas_group_scale")
    if hit is None or hit[0] != key:
        hit = (key, gemv.e8m0_scales_f32(grp.scale))
        grp.members[0].__dict__["_cublas_group_scale"] = hit
    return hit[1]


def _cublas_scale(lin: Linear) -> torch.Tensor:
    """The weight's E8M0 block scales as the fp32 tensor cuBLAS takes, converted once per Linear (before any
    graph capture: the decode step runs eagerly first)."""
    key = lin.scale.data_ptr()
    hit = getattr(lin, "_cublas_scale_f32", None)
    if hit is None or hit[0] != key:
        hit = (key, gemv.e8m0_scales_f32(lin.scale))
        lin._cublas_scale_f32 = hit
    return hit[1]


@dataclass
class _Calls:
    decode: Counter = field(default_factory=Counter)
    prefill: Counter = field(default_factory=Counter)
    glue: Counter = field(default_factory=Counter)
    reference: Counter = field(default_factory=Counter)  # keyed (op, reason)


class TritonOps(FusedPaths, TritonPrefillOps, ReferenceOps):
    """Prefill kernels, then decode kernels, then the reference — counted per op and reported."""

    name = "triton"

    def __init__(self, numerics: Numerics, config: Dispatch | None = None):
        super().__init__(numerics)
        self.config = config or device_dispatch()
        self.calls = _Calls()
        self._logged: set[tuple[str, str]] = set()
        for op in REFERENCE_ONLY_OPS:  # count the inherited ops too, so the report lists every op that ran
            setattr(self, op, self._counted_reference(op, getattr(super(), op)))

    # ------------------------------------------------------------------ kernel choice: the dispatch's
    def kernel_dispatch(self) -> Dispatch:
        """The dispatch of the decode and the prefill kernels alike: :attr:`config`."""
        return self.config

    def gemv_choice(self, n: int, k: int, rows: int = 1, groups: int = 1, weight: str = "fp8",
                    act_quant: bool = True):
        """``(impl, route, GemvGeometry)`` of a decode projection (:meth:`~dsv4lab.engine.dispatch.Dispatch.gemv`)."""
        p = self.config.gemv(n, k, rows, groups, weight, act_quant)
        return p.impl, p.route, p.build(gemv.GemvGeometry)

    def moe_choice(self, rows: int | None = None):
        """``(route, MoeGeometry)`` of the routed MoE at ``rows`` rows (None: the default, as the stages take)."""
        p = self.config.moe(rows)
        return p.route, p.build(moe.MoeGeometry)

    def _decode_moe_plan(self, bank: ExpertBank, rows: int | None, route: str | None = None, geometry=None):
        """``(route, MoeGeometry)`` of a routed-MoE decode call (the prefill's grouped MoE has its own,
        ``TritonPrefillOps._moe_plan``): the caller's route/geometry over the dispatch's; where that
        is the ``fp8lut`` route and it refuses this bank or these numerics (scales outside its byte table's window,
        no FP8 activations: ``fp4_moe_decode_fp8lut.refusal``), the device's default route and geometry instead,
        logged once."""
        r, geo = self.moe_choice(rows)
        route, geo = route or r, geometry or geo
        if route == moe.lut_decode.ROUTE:
            nm = self.numerics
            why = moe.lut_decode.refusal(moe.ExpertTensors.of(bank), nm.act_quant, nm.act)
            if why is not None:
                if ("moe_route", why) not in self._logged:
                    self._logged.add(("moe_route", why))
                    log.warning("triton backend: the routed MoE takes its default route instead of fp8lut (%s)", why)
                route, geo = self.moe_choice(None)
        return route, geo

    def attention_choice(self, rows: int | None = None):
        """The decode attention's ``AttentionGeometry`` at ``rows`` query rows (``rows`` None: the default; None:
        the kernel's)."""
        p = self.config.attention(rows)
        return None if p is None else p.build(attn.AttentionGeometry)

    def attention_split_choice(self, rows: int, entries: int):
        """The split-KV attention's ``SplitKvGeometry`` for ``rows`` query rows whose selection lists ``entries``
        rows, where the dispatch chooses it (:meth:`~dsv4lab.engine.dispatch.Dispatch.attention_split`); None: the
        kernel of :meth:`attention_choice`."""
        p = self.config.attention_split(rows, entries)
        return None if p is None else p.build(attn_split.SplitKvGeometry)

    def indexer_choice(self, rows: int, keys: int):
        """The split indexer's ``IndexerSplitGeometry`` for ``rows`` rows over a cache of ``keys`` index keys,
        where the dispatch chooses it (:meth:`~dsv4lab.engine.dispatch.Dispatch.indexer`); None: the fused kernel."""
        p = self.config.indexer(rows, keys)
        return None if p is None else p.build(idx_split.IndexerSplitGeometry)

    def _mhc_site(self, X: torch.Tensor):
        """The one-launch site's geometry for the rows of ``X [..., n, D]`` when tuned (None: the kernel's choice;
        always None above ``mhc.SITE_MAX_ROWS`` rows, where the site is not one launch)."""
        rows = X.numel() // max(1, X.shape[-1] * X.shape[-2])
        p = self.config.mhc_site(rows) if rows <= mhc.SITE_MAX_ROWS else None
        return None if p is None else p.build(mhc.MhcSiteGeometry)

    # ------------------------------------------------------------------ bookkeeping
    def _counted_reference(self, op, fn):
        def run(*args, **kwargs):
            self._fallback(op, "no kernel")
            return fn(*args, **kwargs)
        run.__name__ = op
        run.__doc__ = fn.__doc__
        return run

    def _prefill(self, op: str, out):
        """Count and return a prefill kernel's result (None: that kernel did not apply)."""
        if out is not None:
            self.calls.prefill[op] += 1
        return out

    def _decode(self, op: str) -> None:
        self.calls.decode[op] += 1

    def _fallback(self, op: str, reason: str) -> None:
        self.calls.reference[(op, reason)] += 1
        if (op, reason) not in self._logged and reason != "no kernel":
            self._logged.add((op, reason))
            log.warning("triton backend: %s runs the reference (%s)", op, reason)

    def _unsupported(self, rows: int, *tensors: torch.Tensor) -> str | None:
        """Why the decode kernels cannot take this call (None if they can)."""
        if self.numerics.dtype not in (torch.bfloat16, torch.float32):
            return f"{str(self.numerics.dtype).replace('torch.', '')} numerics"
        if rows > self.config.max_rows:
            return f"{rows} rows: above the decode kernels, below the prefill kernels"
        if not interpreting() and any(t.device.type != "cuda" for t in tensors):
            return "tensor not on a GPU"
        return None

    def report(self) -> str:
        """Which ops ran on decode, prefill or glue kernels or the reference (and why), with call counts."""
        c = self.calls
        ops = sorted(set(c.decode) | set(c.prefill) | set(c.glue) | {op for op, _ in c.reference})
        lines = [f"{'op':<18}{'decode':>8}{'prefill':>9}{'glue':>7}  reference (reason)"]
        for op in ops:
            ref = ", ".join(f"{n} ({why})" for (o, why), n in sorted(c.reference.items()) if o == op)
            lines.append(f"{op:<18}{c.decode.get(op, 0):>8}{c.prefill.get(op, 0):>9}{c.glue.get(op, 0):>7}  "
                         f"{ref or '-'}")
        return "\n".join(lines)

    def summary(self) -> dict:
        c = self.calls
        return dict(decode=dict(c.decode), prefill=dict(c.prefill), glue=dict(c.glue),
                    reference={f"{op} ({why})": n for (op, why), n in c.reference.items()})

    # ------------------------------------------------------------------ projections
    def linear(self, x: torch.Tensor, lin: Linear, all_reduce=None, route: str | None = None,
               geometry=None) -> torch.Tensor:
        if route is None and geometry is None:
            out = self._prefill("linear", self.prefill_linear(x, lin, all_reduce))
            if out is not None:
                return out
        rows = x.numel() // max(x.shape[-1], 1)
        why = self._unsupported(rows, x, lin.weight)
        if why is None and all_reduce is not None:
            why = "tensor-parallel partial sum"
        if why is None and lin.fmt not in ("fp8", "bf16", "f32"):
            why = f"{lin.fmt} Linear"
        if why is not None:
            self._fallback("linear", why)
            return ReferenceOps.linear(self, x, lin, all_reduce)
        self._decode("linear")
        nm = self.numerics
        aq = nm.act_quant and lin.act_quant
        impl, r, geo = self.gemv_choice(lin.out_features, lin.in_features, rows,
                                                 weight="fp8" if lin.fmt == "fp8" else "bf16", act_quant=aq)
        if route is None and geometry is None and impl.startswith("cublas"):
            mm_out = torch.bfloat16 if impl == "cublas:bfloat16" else torch.float32
            fp8 = lin.fmt == "fp8"
            return gemv.cublas_linear(x, lin.weight, lin.scale if fp8 else None, aq, nm.act,
                                      weight_scale_f32=_cublas_scale(lin) if fp8 else None, mm_out_dtype=mm_out)
        return gemv.fp8_gemv(x, lin.weight, lin.scale if lin.fmt == "fp8" else None, act_quant=aq, out_dtype=nm.act,
                             route=route or r, geometry=geometry or geo)

    def linear_f32(self, x: torch.Tensor, lin: Linear, route: str | None = None) -> torch.Tensor:
        if route is None:
            out = self._prefill("linear_f32", self.prefill_linear_f32(x, lin))
            if out is not None:
                return out
        rows = x.numel() // max(x.shape[-1], 1)
        why = self._unsupported(rows, x, lin.weight)
        if why is None and lin.fmt not in ("bf16", "f32"):
            why = f"{lin.fmt} weight"
        if why is not None:
            self._fallback("linear_f32", why)
            return ReferenceOps.linear_f32(self, x, lin)
        self._decode("linear_f32")
        impl, r, geo = self.gemv_choice(lin.out_features, lin.in_features, rows, weight="bf16",
                                                 act_quant=False)
        if route is None and impl.startswith("cublas") and lin.weight.dtype == torch.bfloat16:
            return gemv.cublas_linear(x, lin.weight, None, False, self.numerics.acc)
        return gemv.fp8_gemv(x, lin.weight, None, act_quant=False, out_dtype=self.numerics.acc, route=route or r,
                             geometry=geo)

    def _stacked(self, op: str, x: torch.Tensor, lins: tuple[Linear, ...]) -> ProjectionGroup | None:
        """The stacked weights of ``lins`` when one decode launch can compute them; else None — then each member
        runs on its own (its op counts itself)."""
        grp = group_of(tuple(lins))
        rows = x.numel() // max(x.shape[-1], 1)
        if grp is None or self._unsupported(rows, x, lins[0].weight) is not None:
            return None
        self._decode(op)
        return grp

    def _stacked_choice(self, grp: ProjectionGroup, rows: int, act_quant: bool):
        """``(impl, route, GemvGeometry)`` of a stacked group's launch: the dispatch's choice for the stacked shape;
        cuBLAS only at one row (``[1, N]`` is the segments side by side), else the own GEMV, which writes each
        member's block."""
        lin = grp.members[0]
        fp8, N = lin.fmt == "fp8", sum(grp.sizes)
        impl, r, geo = self.gemv_choice(N, lin.in_features, rows, weight="fp8" if fp8 else "bf16",
                                        act_quant=act_quant)
        if impl.startswith("cublas") and not (rows == 1 and (not fp8 or act_quant)):
            own = self.config.own_gemv(N, lin.in_features)
            impl, r, geo = own.impl, own.route, own.build(gemv.GemvGeometry)
        return impl, r, geo

    def _stacked_gemv(self, x: torch.Tensor, grp: ProjectionGroup, out_dtype: torch.dtype, act_quant: bool):
        """One launch over a group's stacked weight: each member's output as its own contiguous tensor."""
        impl, r, geo = self._stacked_choice(grp, x.numel() // max(x.shape[-1], 1), act_quant)
        if impl.startswith("cublas"):
            mm_out = torch.bfloat16 if impl == "cublas:bfloat16" else torch.float32
            y = gemv.cublas_linear(x, grp.weight, grp.scale, act_quant, out_dtype, mm_out_dtype=mm_out,
                                   weight_scale_f32=_cublas_scale_of(grp) if grp.scale is not None else None)
            starts = [sum(grp.sizes[:i]) for i in range(len(grp.sizes) + 1)]
            return tuple(y[..., lo:hi] for lo, hi in zip(starts[:-1], starts[1:]))
        return gemv.fp8_gemv(x, grp.weight, grp.scale, act_quant=act_quant, out_dtype=out_dtype, route=r,
                             geometry=geo, segments=grp.sizes)

    def linear_group(self, x: torch.Tensor, lins: tuple[Linear, ...]) -> tuple[torch.Tensor, ...]:
        grp = self._stacked("linear_group", x, lins)
        lin = lins[0]
        if grp is None or lin.fmt not in ("fp8", "bf16", "f32"):
            return tuple(self.linear(x, l_) for l_ in lins)
        return self._stacked_gemv(x, grp, self.numerics.act, self.numerics.act_quant and lin.act_quant)

    def linear_f32_group(self, x: torch.Tensor, lins: tuple[Linear, ...]) -> tuple[torch.Tensor, ...]:
        grp = self._stacked("linear_f32_group", x, lins)
        if grp is None or lins[0].fmt not in ("bf16", "f32"):
            return tuple(self.linear_f32(x, l_) for l_ in lins)
        return self._stacked_gemv(x, grp, self.numerics.acc, False)

    def grouped_wo_a(self, o: torch.Tensor, lin: Linear, groups: int, route: str | None = None) -> torch.Tensor:
        if route is None:
            out = self._prefill("grouped_wo_a", self.prefill_grouped_wo_a(o, lin, groups))
            if out is not None:
                return out
        rows = o.numel() // max(o.shape[-1] * groups, 1)
        why = self._unsupported(rows, o, lin.weight)
        if why is None and lin.fmt != "fp8":
            why = f"{lin.fmt} wo_a"
        if why is not None:
            self._fallback("grouped_wo_a", why)
            return ReferenceOps.grouped_wo_a(self, o, lin, groups)
        self._decode("grouped_wo_a")
        # own kernel only: cuBLAS has no grouped block-scaled GEMM with a bf16 activation
        _, r, geo = self.gemv_choice(lin.out_features // groups, lin.in_features, rows, groups,
                                              act_quant=False)
        y = gemv.fp8_gemv(o.flatten(-2), lin.weight, lin.scale, act_quant=False, out_dtype=self.numerics.act,
                          groups=groups, route=route or r, geometry=geo)
        return y.view(*o.shape[:-1], lin.out_features // groups)

    # ------------------------------------------------------------------ routed experts
    def _moe_unsupported(self, x: torch.Tensor, bank: ExpertBank) -> str | None:
        why = self._unsupported(x.shape[0], x, bank.w1)
        if why is None and bank.fmt != "fp4":
            why = f"{bank.fmt} experts"
        return why

    def routed_experts(self, x, idx, weights, bank, limit, trace=None, all_reduce=None, route: str | None = None,
                       geometry=None):
        if route is None and geometry is None:
            out = self._prefill("routed_experts",
                                self.prefill_routed_experts(x, idx, weights, bank, limit, trace, all_reduce))
            if out is not None:
                return out
        why = self._moe_unsupported(x, bank)
        if why is None and all_reduce is not None:
            why = "expert-parallel partial sum"
        if why is None and trace is not None:
            why = "per-stage trace requested"
        if why is not None:
            self._fallback("routed_experts", why)
            return ReferenceOps.routed_experts(self, x, idx, weights, bank, limit, trace=trace, all_reduce=all_reduce)
        self._decode("routed_experts")
        nm = self.numerics
        route, geo = self._decode_moe_plan(bank, x.shape[0], route, geometry)
        return moe.routed_moe_decode(x, idx, weights, moe.ExpertTensors.of(bank), limit, route=route,
                                     geometry=geo, act_quant=nm.act_quant, act_dtype=nm.act).to(nm.acc)

    def moe_stage1(self, x, idx, bank, route: str | None = None):
        if route is None:
            out = self._prefill("moe_stage1", self.prefill_moe_stage1(x, idx, bank))
            if out is not None:
                return out
        why = self._moe_unsupported(x, bank)
        if why is not None:
            self._fallback("moe_stage1", why)
            return ReferenceOps.moe_stage1(self, x, idx, bank)
        self._decode("moe_stage1")
        nm = self.numerics
        route, geo = self._decode_moe_plan(bank, None, route)
        g, u = moe.moe_gate_up(x, idx, None, moe.ExpertTensors.of(bank), 0.0, route=route, geometry=geo,
                               act_quant=nm.act_quant, act_dtype=nm.act,
                               write_gu=True)
        return g.to(nm.acc), u.to(nm.acc)

    def moe_stage2(self, h, idx, bank, route: str | None = None):
        if route is None:
            out = self._prefill("moe_stage2", self.prefill_moe_stage2(h, idx, bank))
            if out is not None:
                return out
        why = self._moe_unsupported(h, bank)
        if why is not None:
            self._fallback("moe_stage2", why)
            return ReferenceOps.moe_stage2(self, h, idx, bank)
        self._decode("moe_stage2")
        nm = self.numerics
        route, geo = self._decode_moe_plan(bank, None, route)
        return moe.moe_down(h.to(nm.act), idx, moe.ExpertTensors.of(bank), route=route, geometry=geo,
                            act_quant=nm.act_quant, act_dtype=nm.act,
                            per_slot=True).to(nm.acc)

    # ------------------------------------------------------------------ attention, indexer, compressor
    def sparse_attention(self, q, kv, idx, sink, scale, geometry=None):
        if geometry is None:
            out = self._prefill("sparse_attention", self.prefill_sparse_attention(q, kv, idx, sink, scale))
            if out is not None:
                return out
        b, s, h, d = q.shape
        why = self._unsupported(b * s, q, kv)
        if why is not None:
            self._fallback("sparse_attention", why)
            return ReferenceOps.sparse_attention(self, q, kv, idx, sink, scale)
        self._decode("sparse_attention")
        batch = torch.arange(b, device=q.device).repeat_interleave(s)
        kernel = attn_split.sparse_attention_split if isinstance(geometry, attn_split.SplitKvGeometry) \
            else attn.sparse_attention_decode
        o = kernel(q.reshape(b * s, h, d), kv, idx.reshape(b * s, -1), batch, sink, scale,
                   geometry=geometry or self.attention_choice(b * s))
        return o.view(b, s, h, d)

    def attention_from_caches(self, q, win_kv, win_rows, cmp_kv, cmp_rows, slots, sink, scale, cos=None, sin=None,
                              positions=None, cmp_ratio=0, geometry=None):
        """Decode attention straight from the caches: ``q [b, H, d]``, the window ring ``win_kv [slots, W, d]``
        with ``win_rows [b, W]`` and optionally ``cmp_kv [slots, C, d]`` with ``cmp_rows [b, K]`` (−1 = masked),
        each row ``i`` reading cache slot ``slots[i]``; with ``cos, sin, positions`` the inverse RoPE of the output
        in the kernel's epilogue. Returns ``[b, H, d]``. The kernel: the split-KV one for a long selection where
        the dispatch chooses it (:meth:`attention_split_choice`), else :mod:`dsv4lab_kernels.attention_decode`;
        ``geometry`` (a variant's) fixes it."""
        why = self._unsupported(q.shape[0], q, win_kv)
        if why is not None:
            self._fallback("attention_from_caches", why)
            return ReferenceOps.attention_from_caches(self, q, win_kv, win_rows, cmp_kv, cmp_rows, slots, sink, scale,
                                                      cos, sin, positions, cmp_ratio)
        self._decode("sparse_attention")
        entries = win_rows.shape[1] + (cmp_rows.shape[1] if cmp_kv is not None else 0)
        if geometry is None:
            geometry = self.attention_split_choice(q.shape[0], entries) or self.attention_choice(q.shape[0])
            if isinstance(geometry, attn.AttentionGeometry) and geometry.splits > 1 and \
                    self.config.fused("attention_combine", q.shape[0]):
                geometry = replace(geometry, combine_in_kernel=True)  # the fused path: the combine in the kernel
        kernel = attn_split.sparse_attention_split if isinstance(geometry, attn_split.SplitKvGeometry) \
            else attn.sparse_attention_decode
        return kernel(q, win_kv, win_rows, slots, sink, scale, kv_b=cmp_kv, rows_b=cmp_rows,
                      batch_b=slots if cmp_kv is not None else None, geometry=geometry, cos=cos, sin=sin,
                      positions=positions, prefix_ratio_b=cmp_ratio if cmp_kv is not None else 0)

    def indexer_scores(self, qi, w, keys, all_reduce=None):
        out = self._prefill("indexer_scores", self.prefill_indexer_scores(qi, w, keys, all_reduce))
        if out is not None:
            return out
        self._fallback("indexer_scores", "no decode kernel")
        return ReferenceOps.indexer_scores(self, qi, w, keys, all_reduce)

    def indexer_select(self, qi, w, keys, positions, ratio, topk, all_reduce=None):
        out = self._prefill("indexer_select", self.prefill_indexer_select(qi, w, keys, positions, ratio, topk,
                                                                          all_reduce))
        if out is not None:
            return out
        return ReferenceOps.indexer_select(self, qi, w, keys, positions, ratio, topk, all_reduce)  # counts its two

    def indexer_topk(self, scores, positions, ratio, topk):
        out = self._prefill("indexer_topk", self.prefill_indexer_topk(scores, positions, ratio, topk))
        if out is not None:
            return out
        self._fallback("indexer_topk", "no decode kernel")
        return ReferenceOps.indexer_topk(self, scores, positions, ratio, topk)

    def compressor_pool(self, kv_slots, sc_slots):
        out = self._prefill("compressor_pool", self.prefill_compressor_pool(kv_slots, sc_slots))
        if out is not None:
            return out
        self._fallback("compressor_pool", "no decode kernel")
        return ReferenceOps.compressor_pool(self, kv_slots, sc_slots)

    # ------------------------------------------------------------------ fused glue (any row count)
    def _glue_unsupported(self, *tensors: torch.Tensor) -> str | None:
        """Why the glue kernels cannot take this call (None if they can): they round as the reference does for
        bf16 or fp32 activations with fp32 accumulation, on a GPU or in the interpreter."""
        if self.numerics.dtype not in (torch.bfloat16, torch.float32):
            return f"{str(self.numerics.dtype).replace('torch.', '')} numerics"
        if not interpreting() and any(t.device.type != "cuda" for t in tensors):
            return "tensor not on a GPU"
        return None

    def _glue(self, op: str, *tensors: torch.Tensor, why: str | None = None) -> bool:
        """Count the call on its glue kernel (True) or as a reference fallback (False)."""
        why = why or self._glue_unsupported(*tensors)
        if why is not None:
            self._fallback(op, why)
            return False
        self.calls.glue[op] += 1
        return True

    def moe_output(self, routed, shared):
        nm = self.numerics
        why = None if (nm.acc == torch.float32 and routed.dtype == torch.float32 and shared.dtype == nm.act) else \
            f"routed {routed.dtype}, shared {shared.dtype}, acc {nm.acc}"
        if not self._glue("moe_output", routed, shared, why=why):
            return ReferenceOps.moe_output(self, routed, shared)
        return moe.moe_output(routed, shared, nm.act)

    def rms_norm(self, x, weight, eps):
        if not self._glue("rms_norm", x):
            return ReferenceOps.rms_norm(self, x, weight, eps)
        return nrq.rms_norm(x, weight, eps)

    def rope(self, x, cos, sin, inverse=False):
        why = self._glue_unsupported(x) or (None if cos.dtype == torch.float32 else f"{cos.dtype} angles")
        out = nrq.rope_rows(x, cos, sin, inverse) if why is None else None
        if out is None and why is None:
            why = "angles broadcast other than per leading row"
        if not self._glue("rope", x, why=why):
            return ReferenceOps.rope(self, x, cos, sin, inverse)
        return out

    def hc_pre_norm(self, X, fn, base, scale, norm_weight, args):
        out = self._prefill("hc_pre_norm", self.prefill_hc_pre_norm(X, fn, base, scale, norm_weight, args))
        if out is not None:  # many rows: the mix on the rows kernel
            return out
        if not self._glue("hc_pre_norm", X):
            return ReferenceOps.hc_pre_norm(self, X, fn, base, scale, norm_weight, args)
        return mhc.hc_pre_norm(X, fn, base, scale, norm_weight, args.hc_sinkhorn_iters, args.norm_eps, args.hc_eps,
                               geometry=self._mhc_site(X))

    def hc_post_pre_norm(self, out, X, post, comb, fn, base, scale, norm_weight, args):
        res = self._prefill("hc_post_pre_norm", self.prefill_hc_post_pre_norm(out, X, post, comb, fn, base, scale,
                                                                             norm_weight, args))
        if res is not None:
            return res
        if not self._glue("hc_post_pre_norm", X):
            return ReferenceOps.hc_post_pre_norm(self, out, X, post, comb, fn, base, scale, norm_weight, args)
        return mhc.hc_post_pre_norm(out, X, post, comb, fn, base, scale, norm_weight, args.hc_sinkhorn_iters,
                                    args.norm_eps, args.hc_eps, geometry=self._mhc_site(X))

    def hc_post(self, out, X, post, comb):
        res = self._prefill("hc_post", self.prefill_hc_post(out, X, post, comb))
        if res is not None:
            return res
        if not self._glue("hc_post", X):
            return ReferenceOps.hc_post(self, out, X, post, comb)
        return mhc.hc_post(out, X, post, comb)

    def hc_head(self, X, fn, base, scale, args):
        if not self._glue("hc_head", X):
            return ReferenceOps.hc_head(self, X, fn, base, scale, args)
        return mhc.hc_head(X, fn, base, scale, args.norm_eps, args.hc_eps, geometry=self._mhc_site(X))

    def head_rms_rope(self, q, cos, sin, positions, eps):
        if not self._glue("head_rms_rope", q):
            return ReferenceOps.head_rms_rope(self, q, cos, sin, positions, eps)
        return nrq.head_rms_rope(q, cos, sin, positions, eps)

    def kv_norm_rope(self, kv, weight, eps, cos, sin, positions, ring=None, slots=None):
        if not self._glue("kv_norm_rope", kv):
            return ReferenceOps.kv_norm_rope(self, kv, weight, eps, cos, sin, positions, ring, slots)
        return nrq.kv_norm_rope(kv, weight, eps, cos, sin, positions, kv.shape[-1] - 2 * cos.shape[-1],
                                self.numerics.kv_fp8_sim, ring, slots)

    def indexer_query(self, qi, cos, sin, positions):
        if not self._glue("indexer_query", qi):
            return ReferenceOps.indexer_query(self, qi, cos, sin, positions)
        return nrq.indexer_query(qi, cos, sin, positions, self.numerics.indexer_fp4_sim)

    def indexer_select_decode(self, qi, w, keys, slots, positions, topk, all_reduce=None, w_scale=1.0,
                              geometry=None):
        """The fused kernel (:mod:`dsv4lab_kernels.indexer_decode`), or the one split over the key axis where the
        dispatch chooses it for this cache (:meth:`indexer_choice`; ``geometry``, a variant's, fixes it): the same
        selection either way."""
        why = "tensor-parallel partial sum" if all_reduce is not None else None
        if not self._glue("indexer_select_decode", qi, keys, why=why):
            return ReferenceOps.indexer_select_decode(self, qi, w, keys, slots, positions, topk, all_reduce,
                                                      w_scale)
        geometry = geometry or self.indexer_choice(qi.shape[0], keys.shape[1])
        if geometry is not None:
            return idx_split.indexer_select_split(qi, w, keys, slots, positions, topk, w_scale=w_scale,
                                                  geometry=geometry)
        return idx_decode.indexer_select(qi, w, keys, slots, positions, topk, w_scale=w_scale)

    def router_topk(self, logits, gate, ids):
        a = gate.args
        why = None if a.score_func in router.SCORE_FUNCS else f"{a.score_func} scores"
        if not self._glue("router_topk", logits, why=why):
            return ReferenceOps.router_topk(self, logits, gate, ids)
        return router.router_topk(logits, a.n_activated_experts, a.route_scale, a.score_func,
                                  bias=None if gate.hash_routed else gate.bias,
                                  tid2eid=gate.tid2eid if gate.hash_routed else None, ids=ids)

    def compressor_step(self, comp, kv, score, positions, slots, cache, cos, sin):
        if not self._glue("compressor_step", kv, cache):
            return ReferenceOps.compressor_step(self, comp, kv, score, positions, slots, cache, cos, sin)
        c = self._compressor_call(comp, kv, score, positions, slots, cache, cos, sin)
        cmp_decode.compressor_step(*(getattr(c, f.name) for f in dataclasses.fields(c)))

    def expert_mlp(self, x, w1, w2, w3, limit, weight=None, shared=False):
        out = self._prefill("expert_mlp", self.prefill_expert_mlp(x, w1, w2, w3, limit, weight, shared))
        if out is not None:  # many rows: the fused shared-expert GEMMs
            return out
        if not self._glue("expert_mlp", x):
            return ReferenceOps.expert_mlp(self, x, w1, w2, w3, limit, weight, shared)
        grp = group_of((w1, w3))
        rows = x.numel() // max(x.shape[-1], 1)
        if grp is not None and rows <= self.config.max_rows and w1.fmt == "fp8":  # w1 and w3 in one launch
            g, u = self._stacked_gemv(x, grp, self.numerics.act, self.numerics.act_quant and w1.act_quant)
        else:
            g, u = self.linear(x, w1), self.linear(x, w3)
        if weight is None:
            return self._shared_down(g, u, w2, limit)
        return self.linear(act_kernels.swiglu(g, u, limit, weight), w2)

    def expert_down(self, g, u, w2, limit):
        if not self._glue("expert_down", g, u):
            return ReferenceOps.expert_down(self, g, u, w2, limit)
        return self._shared_down(g, u, w2, limit)

    def _shared_down(self, g, u, w2, limit):
        """A shared expert's SwiGLU and down projection: in the GEMV's prologue where the fused path
        ``shared_swiglu`` runs, else the activation's own launch, then the projection."""
        if self.config.fused("shared_swiglu", g.numel() // max(g.shape[-1], 1)):
            out = self._down_after_swiglu(g, u, limit, w2)
            if out is not None:
                return out
        return self.linear(act_kernels.swiglu(g, u, limit), w2)

    # ------------------------------------------------------------------ accumulation models (for verification)
    def accumulation_for(self, op: str, *args, variant: str | None = None, **kwargs) -> str:
        """The accumulation model (a name of ``dsv4lab.tools.verify.bounds.UNIT_ROUNDOFF``) of the kernel that
        ``self.<op>(*args, **kwargs)`` — or its variant ``variant`` (:meth:`variants`) — takes: the prefill kernels'
        (:meth:`prefill_accumulation_for`), the GEMV route or cuBLAS the dispatch picks, the MoE route, the decode
        kernels' tensor-core model for attention and the indexer's dots — each as its kernel family states it
        (:mod:`~dsv4lab.engine.kernel_families`) —, fp32 for the glue kernels (CUDA cores, fp32 or wider) and for
        the reference fallbacks; the loosest of its projections for the shared expert. Under the interpreter every
        kernel sums in numpy's IEEE fp32: ``fp32``."""
        if interpreting():
            return "fp32"
        if variant is not None and variant.startswith("prefill"):
            return self.prefill_variant_accumulation(op, variant, *args)
        if kwargs.get("route") is None and kwargs.get("geometry") is None:
            pre = self.prefill_accumulation_for(op, *args, **kwargs)
            if pre is not None:
                return pre
        route = kwargs.get("route")
        if op in ("linear", "linear_f32", "grouped_wo_a"):
            return self._gemv_accumulation(op, args, route, kwargs.get("geometry"))
        if op in ("routed_experts", "moe_stage1", "moe_stage2"):
            x = args[0]
            if route is None:
                route = self.moe_choice(x.shape[0] if op == "routed_experts" else None)[0]
            return MOE.accumulation_of(route)
        if op in ("sparse_attention", "attention_from_caches", "indexer_select_decode"):
            geometry = kwargs.get("geometry")
            if isinstance(geometry, attn_split.SplitKvGeometry):
                return ATTENTION_SPLIT.accumulation_of(None)
            if isinstance(geometry, idx_split.IndexerSplitGeometry):
                return INDEXER_SPLIT.accumulation_of(None)
            return ATTENTION.accumulation_of(None)
        if op == "expert_mlp":
            x, w1, w2, w3 = args[:4]
            return loosest(*(self._gemv_accumulation("linear", (x, w), None, None) for w in (w1, w3, w2)))
        if op == "expert_down":
            g, _, w2 = args[:3]
            return self._gemv_accumulation("linear", (g, w2), None, None)
        if op in ("linear_group", "linear_f32_group"):
            return self._group_accumulation(op, *args[:2])
        if op == "projections":  # the loosest of its calls (one launch runs each with its own route)
            x, calls = args[:2]
            return loosest(*(self._group_accumulation(o, x, w) if isinstance(w, tuple) else
                             self._gemv_accumulation(o, (x, w), None, None) for o, w in calls))
        return "fp32"

    def _group_accumulation(self, op: str, x: torch.Tensor, lins: tuple) -> str:
        """The model of a stacked group's launch (:meth:`_stacked_gemv`: the dispatch's choice for the stacked shape,
        cuBLAS only at one row), or the loosest of its members' where they run one by one."""
        single = "linear_f32" if op == "linear_f32_group" else "linear"
        grp, lin = group_of(tuple(lins)), lins[0]
        rows = x.numel() // max(x.shape[-1], 1)
        if grp is None or self._unsupported(rows, x, lin.weight) is not None:
            return loosest(*(self._gemv_accumulation(single, (x, m), None, None) for m in lins))
        aq = single == "linear" and self.numerics.act_quant and lin.act_quant
        impl, r, _ = self._stacked_choice(grp, rows, aq)
        return GEMV.accumulation_of("cublas" if impl.startswith("cublas") else r)

    def _gemv_accumulation(self, op: str, args: tuple, route: str | None, geometry) -> str:
        """The model of a decode projection: its route's, or cuBLAS's where the dispatch picks it."""
        x, lin = args[0], args[1]
        groups = args[2] if op == "grouped_wo_a" else 1
        rows = x.numel() // max(x.shape[-1] * groups, 1)
        if self._unsupported(rows, x, lin.weight) is not None or lin.fmt not in ("fp8", "bf16", "f32"):
            return "fp32"  # the reference
        fp8 = lin.fmt == "fp8" and op != "linear_f32"
        aq = op == "linear" and self.numerics.act_quant and lin.act_quant
        impl, r, _ = self.gemv_choice(lin.out_features // groups, lin.in_features, rows, groups,
                                      weight="fp8" if fp8 else "bf16", act_quant=aq)
        cublas = route is None and geometry is None and impl.startswith("cublas") and op != "grouped_wo_a" \
            and (op == "linear" or lin.weight.dtype == torch.bfloat16)
        return GEMV.accumulation_of("cublas" if cublas else route or r)

    # ------------------------------------------------------------------ variants for `verify kernels`
    def variants(self, method: str) -> dict:
        """Every decode verification variant of ``method`` the kernel families declare
        (:func:`~dsv4lab.engine.kernel_families.verify_variants`: a route, launch fields over the device default —
        the GEMV's over the kernel's, its default being per shape), plus the prefill ones; each has the reference
        method's signature. The MoE's INT8 route is another quantization, not another evaluation of the
        reference's: element by element it is judged against its own exact oracle
        (``fp4_moe_decode.reference_int8_moe``, in the tests and the benchmark) and at model level by a KL bound
        (docs/kernels_decode.md), so it is not a verification variant."""
        base = {GEMV.name: gemv.GemvGeometry(), MOE.name: self.moe_choice()[1],
                ATTENTION.name: self.attention_choice(), ATTENTION_SPLIT.name: attn_split.SplitKvGeometry(),
                INDEXER_SPLIT.name: idx_split.IndexerSplitGeometry()}
        out = {}
        for family, v in verify_variants(DECODE_FAMILIES, method):
            kwargs = {"route": v.route} if v.route is not None else {}
            if v.fields:
                kwargs["geometry"] = replace(base[family.name], **v.fields)
            out[v.name] = partial(getattr(self, method), **kwargs)
        out.update(self.prefill_variants(method))
        return out
