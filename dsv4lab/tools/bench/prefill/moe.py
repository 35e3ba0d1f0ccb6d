"""Prefill suite, section ``moe``: the grouped FP4 MoE (``fp4_moe_grouped``) — every planned route, sorter rows and
launch variant (:data:`dsv4lab.engine.kernel_families.PREFILL_MOE`) checked stage by stage within its bound at real
widths, then timed on 256 experts at the headline token count, the sorter-rows ablation, and (full run) the other
token counts."""
from __future__ import annotations

import torch

from dsv4lab.core.model.linear import ExpertBank
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.engine.kernel_families import moe_tags
from dsv4lab.engine.triton_prefill import expert_stage_magnitude
from dsv4lab.tools.bench.common import random_bank, random_routing
from dsv4lab.tools.bench.prefill.harness import ACCUMULATION_OF_ROUTE, PEAK_OF_ROUTE, PrefillBench

MOE_TAGS = moe_tags()
"""The grouped MoE's launch variants by name (the benchmark's ``<route>+<tag>`` rows), as the families declare them."""


def bank_slice(bank, n_experts: int):
    part = ExpertBank(n_experts, bank.dim, bank.inter, "fp4")
    for name in ("w1", "w3", "w2", "w1_scale", "w3_scale", "w2_scale"):
        part._buffers[name] = getattr(bank, name)[:n_experts]
    return part


def check_moe_variants(b: PrefillBench, a, gen, passed: set[str], plan: dict) -> None:
    """Real widths, fewer experts so each gets about as many rows as at 4,096 tokens with 256 experts."""
    from dsv4lab_kernels import fp4_moe_grouped as fm
    ref = ReferenceOps(Numerics())
    dev = b.device
    E = 8 if b.smoke else 32
    T = 48 if b.smoke else 512
    limit = a.swiglu_limit
    bank = bank_slice(random_bank(E, a.dim, a.moe_inter_dim, dev, gen), E)
    idx, w = random_routing(T, E, a.n_activated_experts, dev, gen)
    x = (torch.randn(T, a.dim, device=dev, generator=gen) * 2).to(torch.bfloat16)
    want_g, want_u = ref.moe_stage1(x, idx, bank)
    h_in = ref.moe_activation(want_g, want_u, w, limit)
    want_down = ref.moe_stage2(h_in, idx, bank)
    want_total = ref.routed_experts(x, idx, w, bank, limit)
    mag_g, mag_u = (expert_stage_magnitude(x, idx, bank, n, True) for n in ("w1", "w3"))
    mag_down = expert_stage_magnitude(h_in, idx, bank, "w2", True)
    b.log(f"MoE decode: asm {fm.asm_decode_status(dev) if b.cuda else 'interpreter: f16'}")

    def check(route: str, rows: int, tag: str) -> bool:
        name, geo = moe_variant_name(route, rows, tag), fm.MoEGeometry(rows=rows, **MOE_TAGS[tag])
        acc = ACCUMULATION_OF_ROUTE[route]
        g, u = fm.moe_stage1(x, idx, bank, route=route, geo=geo)
        ok = b.check_bound(f"{name}:stage1.g", g, want_g, mag_g, a.dim, acc, torch.bfloat16)
        ok = b.check_bound(f"{name}:stage1.u", u, want_u, mag_u, a.dim, acc, torch.bfloat16) and ok
        ok = b.check_bound(f"{name}:stage2", fm.moe_stage2(h_in, idx, bank, route=route, geo=geo), want_down,
                           mag_down, a.moe_inter_dim, acc, torch.bfloat16) and ok
        y = fm.routed_experts(x, idx, w, bank, limit, route=route, geo=geo, poison=True)
        h_k = ref.moe_activation(g, u, w, limit)
        composed = ref.moe_combine(ref.moe_stage2(h_k, idx, bank), idx)
        # the combine sums k bf16 slot outputs exactly: the bound is k times a slot's
        mag = torch.nan_to_num(expert_stage_magnitude(h_k, idx, bank, "w2", True)).sum(1)
        ok = b.check_bound(f"{name}:fused", y, composed, mag, a.moe_inter_dim, acc, torch.float32,
                           rounded_terms=True) and ok
        b.check(f"{name}:end_to_end", y, want_total, "quantized", gating=False)
        return ok

    for route, rows, tag in plan["moe"]:
        name = moe_variant_name(route, rows, tag)
        if tag not in moe_tags(route):  # the bf16 route's own variants run on it alone
            continue
        if b.guard(name, lambda: check(route, rows, tag)):
            passed.add(name)


def moe_variant_name(route: str, rows: int, tag: str = "") -> str:
    return f"moe:{route}:{rows}" + (f":{tag}" if tag else "")


class MoEBench:
    """The 256-expert bank at real shapes and the timing of one (route, sorter rows, tokens, tag) case."""

    def __init__(self, b: PrefillBench, args, gen, passed: set[str]):
        self.b, self.a, self.gen, self.passed = b, args, gen, passed
        self.bank = random_bank(args.n_routed_experts, args.dim, args.moe_inter_dim, b.device, gen)
        self.inputs: dict[int, tuple] = {}

    def _inputs(self, T: int):
        if T not in self.inputs:
            idx, w = random_routing(T, self.a.n_routed_experts, self.a.n_activated_experts, self.b.device, self.gen)
            x = torch.randn(T, self.a.dim, device=self.b.device, generator=self.gen).to(torch.bfloat16)
            self.inputs[T] = (idx, w, x)
        return self.inputs[T]

    def run(self, route: str, rows: int, T: int, stages: bool, tag: str = "") -> float | None:
        from dsv4lab_kernels import fp4_moe_grouped as fm
        from dsv4lab_kernels.moe_sort import sort_by_expert, sort_by_expert_torch
        b, a, bank = self.b, self.a, self.bank
        name = moe_variant_name(route, rows, tag)
        if name not in self.passed:
            b.skipped.append(f"{name} @{T} (not checked or failed its check)")
            return None
        E, k, D, I = a.n_routed_experts, a.n_activated_experts, a.dim, a.moe_inter_dim
        geo = fm.MoEGeometry(rows=rows, **MOE_TAGS[tag])
        route_tag = route + (f"+{tag}" if tag else "")
        idx, w, x = self._inputs(T)
        f_up, f_down = 2.0 * T * k * 2 * I * D, 2.0 * T * k * D * I
        kind, limit = PEAK_OF_ROUTE[route], a.swiglu_limit
        t = b.time_events_us(lambda: fm.routed_experts(x, idx, w, bank, limit, route=route, geo=geo), name=name)
        routing = sort_by_expert(idx, E, rows)
        padded = int(((routing.counts + rows - 1) // rows * rows).sum())
        b.add("moe_grouped_gemm", f"{route_tag}:total", t, f_up + f_down, kind, tokens=T, sorter_rows=rows,
              row_efficiency=round(T * k / padded, 3))
        if stages:
            xv, xs = fm._activation_operands(x, route)
            w_flat = w.reshape(-1).contiguous()
            h = fm.gate_up(xv, xs, bank, routing, route, geo, w_flat, limit)
            t_up = b.time_events_us(lambda: fm.gate_up(xv, xs, bank, routing, route, geo, w_flat, limit))
            b.add("moe_grouped_gemm", f"{route_tag}:gate_up", t_up, f_up, kind, tokens=T, sorter_rows=rows)
            t_dn = b.time_events_us(lambda: fm.down(h[0], h[1], bank, routing, route, geo, T * k))
            b.add("moe_grouped_gemm", f"{route_tag}:down", t_dn, f_down, kind, tokens=T, sorter_rows=rows)
            t_sort = b.time_events_us(lambda: sort_by_expert(idx, E, rows))
            b.add("moe_sort", "sort", t_sort, tokens=T, sorter_rows=rows, peak_kind="copy")
            t_sort = b.time_events_us(lambda: sort_by_expert_torch(idx, E, rows))  # the previous sorter
            b.add("moe_sort", "sort_torch", t_sort, tokens=T, sorter_rows=rows, peak_kind="copy")
        return t


def bench_moe_headline(b: PrefillBench, moe: MoEBench, routes, headline: int, plan: dict, ablation_tokens,
                       ablation_route, quick: bool) -> None:
    """Every route at the headline token count, the bf16 route's variants and 128 rows, then the sorter-rows
    ablation at the paper's M = 2048 and at the headline count."""
    cases = [(r, 64, "") for r in routes] + [("bf16", 128, "")] * ("bf16" in routes)
    cases += [(ablation_route, plan["tag_rows"], t) for t in plan["tags"]]
    rows_list = plan["rows"]
    for route, rows, tag in cases:
        if not b.over_budget(f"moe {moe_variant_name(route, rows, tag)} @{headline}"):
            b.guard(f"moe {route} {rows} {tag}", lambda: moe.run(route, rows, headline, True, tag))
    for T in (headline,) if quick else (ablation_tokens, headline):
        for rows in rows_list:
            if T == headline and rows in (64, 128):
                continue  # timed above
            if not b.over_budget(f"sorter ablation {ablation_route} rows {rows} @{T}"):
                b.guard(f"moe ablation {rows} @{T}", lambda: moe.run(ablation_route, rows, T, True))


def bench_moe_sweep(b: PrefillBench, moe: MoEBench, routes, tokens, headline: int) -> None:
    for T in tokens:
        for route in routes:
            if T == headline or b.over_budget(f"moe {route} @{T}"):
                continue
            b.guard(f"moe {route} @{T}", lambda: moe.run(route, 64, T, False))


