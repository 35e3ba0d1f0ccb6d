"""The prefill suite's run: rows with TFLOP/s and % of the measured peak of the dtype the tensor cores compute in,
bound checks recorded, and what a run of each mode checks and times (:func:`plan_variants`, from the kernel
families' lists: :mod:`dsv4lab.engine.kernel_families`)."""
from __future__ import annotations

import torch

from dsv4lab.engine.kernel_families import (INDEXER, PREFILL_ATTENTION, PREFILL_GEMM, PREFILL_MOE, SORTER_ROWS,
                                            WEIGHT_GEMM, moe_tags)
from dsv4lab.engine.triton_prefill import accumulation_bound
from dsv4lab.tools.bench.common import BenchRun, measure_ceilings
from dsv4lab.tools.verify.bounds import check_within_bound

MOE_ROUTES = ("bf16", "fp8", "scaled")
TOKENS = (512, 1024, 2048, 4096, 8192)
PROMPTS = (1024, 2048, 4096, 4604, 8192)
CHUNKS = (512, 1024, 2048, 4096, 0)  # 0: the whole prompt in one chunk
PEAK_OF_ROUTE = {"bf16": "bf16", "fp8": "fp8", "scaled": "bf16"}  # sm_90 has no MX cores: dot_scaled runs in bf16
ACCUMULATION_OF_ROUTE = {"bf16": "tc_bf16", "fp8": "tc_fp8", "scaled": "tc_bf16"}
TAG_ROWS = 128  # sorter rows of the launch variants: the fastest at 4,096 tokens (probe 1: 9.72 ms vs 10.76 at 64)
QUICK_ROUTES = ("bf16", "fp8")  # dot_scaled measured 2.2× slower than bf16 (probe 1): full runs only


def named_configs(family, full: bool) -> tuple[str, ...]:
    """The named kernel configurations a run times of ``family`` (a full run's list, else the quick one)."""
    return tuple(v.fields["config"] for v in family.runs("full" if full else "quick"))


def plan_variants(mode: str, routes, ablation_route: str) -> dict:
    """What a run of ``mode`` (smoke / quick / full) checks and times: the quick probe keeps the headline
    variants (every route, the bf16 route's decodes and scheduling, 64 and 128 rows, the default geometries)."""
    full = mode == "full"
    rows = {"quick": (64, 128), "smoke": (16, 64)}.get(mode, SORTER_ROWS)
    quick_tags = {v.name for v in PREFILL_MOE.runs("quick") if v.name and not v.ops}
    tags = [t for t in moe_tags(ablation_route) if t and (full or (mode == "quick" and t in quick_tags))]
    tag_rows = 64 if mode == "smoke" else TAG_ROWS
    moe = sorted({(r, 64, "") for r in routes} | {(ablation_route, n, "") for n in rows}
                 | ({("bf16", 128, "")} if "bf16" in routes else set())
                 | {(ablation_route, tag_rows, t) for t in tags})
    return dict(moe=moe, rows=rows, tags=tags, tag_rows=tag_rows, gemm=named_configs(PREFILL_GEMM, full),
                weight=named_configs(WEIGHT_GEMM, full), attention=named_configs(PREFILL_ATTENTION, full),
                indexer=named_configs(INDEXER, full))


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


