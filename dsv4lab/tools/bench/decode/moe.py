"""Decode suite, section ``moe``: the routed FP4 MoE (``fp4_moe_decode``) — every route's structures checked stage
by stage at real widths, then every route × launch geometry of :data:`dsv4lab.engine.kernel_families.MOE` timed
on 256 experts with routing drawn afresh per call, beside torch baselines."""
from __future__ import annotations

import statistics
from dataclasses import asdict

import torch
import torch.nn.functional as F

from dsv4lab.core import quant
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.engine.kernel_families import MOE
from dsv4lab.tools.bench.common import random_bank, random_routing
from dsv4lab.tools.bench.decode.harness import DecodeBench, run_mode
from dsv4lab.tools.verify.bounds import BoundCheck, check_within_bound, gamma, ulp


def moe_variants(smoke: bool, quick: bool) -> list[tuple[str, str, object]]:
    """``(route, name, MoeGeometry)`` of the run's list in :data:`~dsv4lab.engine.kernel_families.MOE` (the first
    of each route is its quick one). Names: ``n<rows>k<K step>w<warps>s<stages>``, ``:token`` token-major down
    projection, ``:plain`` the portable E2M1 decode instead of the asm one, ``:prequant`` activations quantized
    once per step, ``:elem`` the fma route's position-wise accumulators (``MoeGeometry.fma_sums``), ``:bytewise``
    the fp16 decode with the scales after the group sums (``MoeGeometry.decode``); the ``fp8lut`` route's
    ``:tile`` one scale reference per weight tile (``MoeGeometry.lut_ref``)."""
    from dsv4lab_kernels import fp4_moe_decode as moe
    return [(v.route, v.name, moe.MoeGeometry(**v.fields)) for v in MOE.runs(run_mode(smoke, quick))]


def moe_stage_checks(x, idx, w, ex, route: str, geo, limit: float, act_quant: bool = True,
                     name: str = "") -> list:
    """Every stage of a routed-MoE route within its bound, in isolation: gate/up (``g``, ``u``) against their
    exact oracles, the fused SwiGLU·weight against the reference's activation of the kernel's own ``(g, u)``
    (one bf16 ulp: a different fp64 silu formula may round one fp32 ulp apart), the down projection against the
    oracle of the kernel's own ``h``, and the combined output against the sum of the slot oracles within the
    sum of the slots' bounds (plus one fp32 ulp). Returns :class:`~dsv4lab.tools.verify.bounds.BoundCheck` results
    (the last two as equivalent records)."""
    from dsv4lab_kernels import fp4_moe_decode as moe
    name = name or route

    def stage(out, oracle, what):
        c, acc = moe.bound_args(route, oracle.terms)  # γ(c·n) in fp32, or a blocked model (fp8lut: fp8_mma)
        return check_within_bound(out, oracle.ref, oracle.magnitude.nan_to_num(0.0), terms=oracle.terms,
                                  c=c, acc_dtype=acc, out_dtype=torch.bfloat16, name=f"{name} {what}")

    def record(what, ok, ratio, numel, line):
        return BoundCheck(name=f"{name} {what}", ok=ok, numel=numel, n_violations=0 if ok else 1, nan_mismatch=0,
                          max_ratio=ratio, bitwise_equal=False, rule=line)

    out = []
    g, u = moe.moe_gate_up(x, idx, None, ex, limit, route, geo, act_quant, write_gu=True)
    og, ou = moe.reference_stage1(x, idx, ex, route, act_quant)
    out += [stage(g, og, "stage1 g"), stage(u, ou, "stage1 u")]
    h = moe.moe_gate_up(x, idx, w, ex, limit, route, geo, act_quant)
    want = ReferenceOps(Numerics()).moe_activation(g, u, w, limit)
    owned = torch.isfinite(g[..., 0])
    d = (h[owned].double() - want[owned].to(torch.bfloat16).double()).abs()
    lim = ulp(want[owned], torch.bfloat16)
    ratio = float((d / lim).max()) if d.numel() else 0.0
    out.append(record("activation", ratio <= 1, ratio, d.numel(), "≤ 1 bf16 ulp of the reference's activation"))
    o2 = moe.reference_stage2(h, idx, ex, route, act_quant)
    out.append(stage(moe.moe_down(h, idx, ex, route, geo, act_quant, per_slot=True), o2, "stage2"))
    y = moe.routed_moe_decode(x, idx, w, ex, limit, route, geo, act_quant)
    slot = gamma(*moe.bound_args(route, o2.terms)) * o2.magnitude + ulp(o2.ref, torch.bfloat16)
    ref = o2.ref.nan_to_num(0.0).sum(1)
    bound = slot.nan_to_num(0.0).sum(1) + ulp(ref, torch.float32)
    err = (y.double() - ref).abs()
    ratio = float((err / bound).max())
    ok = bool(torch.isfinite(y).all()) and ratio <= 1
    out.append(record("combined", ok, ratio, y.numel(), "Σ slot bounds + 1 ulp fp32"))
    return out



def moe_structure(route: str, geo) -> tuple:
    """The code path a routed-MoE variant runs: geometries with the same path differ only in the order of fp32
    sums, so one check covers them all (the fp8lut route's scale reference is a path of its own)."""
    return route, geo.slot_split > 0, geo.decode, geo.prequant, geo.fma_sums, geo.lut_ref


def check_moe(b: DecodeBench, a, gen, variants) -> set[str]:
    """Each route's structures (expert-major, token-major, portable decode, prequant) at real widths (8 experts), one
    token and eight tokens sharing experts, stage by stage within bound. Geometries of one structure
    (:func:`moe_structure`) differ only in the order of fp32 sums, which the bound does not depend on: a variant
    is timed if its structure passed."""
    from dsv4lab_kernels import fp4_moe_decode as moe
    dev = b.device
    E = 8
    bank = random_bank(E, a.dim, a.moe_inter_dim, dev, gen)
    ex = moe.ExpertTensors.of(bank)
    structures = {}
    for route, name, geo in variants:
        structures.setdefault(moe_structure(route, geo), (name, geo))
    passed_structures = set()
    for T in (1, 8):  # one token, and eight sharing the eight experts (the batches timed: no extra compiles)
        idx, w = random_routing(T, E, a.n_activated_experts, dev, gen)
        x = (torch.randn(T, a.dim, device=dev, generator=gen) * 2).to(torch.bfloat16)
        for key, (name, geo) in structures.items():
            label = f"moe:{key[0]}:{name}:T{T}"
            res = b.guard(label, lambda: moe_stage_checks(x, idx, w, ex, key[0], geo, a.swiglu_limit, name=label))
            ok = bool(res) and all(b.record_bound(r) for r in res)
            if ok and (T == 1 or key in passed_structures):
                passed_structures.add(key)
            elif not ok:
                passed_structures.discard(key)
    del bank
    return {name for route, name, geo in variants if moe_structure(route, geo) in passed_structures}



def bench_moe(b: DecodeBench, a, gen, passed: set[str], batches, variants) -> None:
    from dsv4lab_kernels import fp4_moe_decode as moe
    dev = b.device
    E, k, D, I = (16, 4, 256, 128) if b.smoke else (a.n_routed_experts, a.n_activated_experts, a.dim,
                                                    a.moe_inter_dim)
    bank = random_bank(E, D, I, dev, gen)
    ex = moe.ExpertTensors.of(bank)
    per_expert = 3 * (I * D // 2 + I * D // 32)
    n_rot = 1 if b.smoke else 16
    best: dict[str, str] = {}
    for T in batches:
        if b.over_budget(f"moe batch {T}"):
            return
        routings = [random_routing(T, E, k, dev, gen) for _ in range(n_rot)]
        xs = [(torch.randn(T, D, device=dev, generator=gen) * 2).to(torch.bfloat16) for _ in range(n_rot)]
        nbytes = statistics.mean(len(torch.unique(i)) for i, _ in routings) * per_expert
        for route, name, geo in variants:
            if name not in passed:
                continue
            if T != batches[0] and best.get(route) != name and not (route == "dot" and T == batches[-1]):
                continue  # past batch 1: each route's best geometry, and every dot geometry at the largest batch
            calls = [lambda r=r, geo=geo, route=route: moe.routed_moe_decode(
                xs[r], routings[r][0], routings[r][1], ex, a.swiglu_limit, route, geo) for r in range(n_rot)]
            t = b.guard(f"moe {route} {name} b{T}", lambda: b.time_graph_us(calls))
            if t is not None:
                b.add("moe_decode", f"{route}:{name}", T, t, nbytes, route=route, geometry=name,
                      geometry_fields=asdict(geo))
        if T == batches[0]:
            for route in moe.ROUTES:
                mine = [r for r in b.rows if r["kernel"] == "moe_decode" and r.get("route") == route
                        and r["batch"] == T]
                if mine:
                    best[route] = min(mine, key=lambda r: r["time_us"])["geometry"]
        host_routes = [r[0].tolist() for r in routings]
        b.guard(f"moe baselines b{T}", lambda: moe_baselines(b, bank, xs, host_routes, routings, T, nbytes,
                                                             a.swiglu_limit, quant, full=not b.quick))
    del bank


def moe_baselines(b, bank, xs, host_routes, routings, T, nbytes, limit, quant, full: bool = True) -> None:
    # a plain torch read of the same bytes, rotated through 4 copies (the "as fast as reading them")
    flat = [torch.empty(int(nbytes) // 4, dtype=torch.float32, device=b.device).uniform_() for _ in range(4)]
    t = b.time_graph_us([lambda f=f: f.sum() for f in flat], replays=7)
    b.add("moe_decode", "torch_sum_read", T, t, nbytes, route="baseline")
    del flat
    if not full:
        return

    def swiglu(g, u):
        return F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)

    def dequant_matmul(r):
        y = torch.zeros(T, bank.dim, device=b.device, dtype=torch.float32)
        for t_, experts in enumerate(host_routes[r]):
            for s, e in enumerate(experts):
                w1 = quant.fp4_dequant(bank.w1[e], bank.w1_scale[e], torch.bfloat16)
                w3 = quant.fp4_dequant(bank.w3[e], bank.w3_scale[e], torch.bfloat16)
                w2 = quant.fp4_dequant(bank.w2[e], bank.w2_scale[e], torch.bfloat16)
                h = swiglu(xs[r][t_:t_ + 1] @ w1.T, xs[r][t_:t_ + 1] @ w3.T) * routings[r][1][t_, s]
                y[t_] += (h.to(torch.bfloat16) @ w2.T)[0].float()
        return y

    n = len(host_routes)
    t = b.time_graph_us([lambda r=r: dequant_matmul(r) for r in range(min(n, 4))], replays=3)
    b.add("moe_decode", "torch_dequant_matmul", T, t, nbytes, route="baseline")
    # BF16-resident: a BF16 copy of the first experts (the routings are remapped onto them, same count)
    n_res = min(bank.n_experts, 64)
    res = {w: torch.stack([quant.fp4_dequant(getattr(bank, w)[e], getattr(bank, w + "_scale")[e], torch.bfloat16)
                           for e in range(n_res)]) for w in ("w1", "w3", "w2")}

    def bf16_resident(r):
        y = torch.zeros(T, bank.dim, device=b.device, dtype=torch.float32)
        for t_, experts in enumerate(host_routes[r]):
            for s, e in enumerate(experts):
                e = e % n_res
                h = swiglu(xs[r][t_:t_ + 1] @ res["w1"][e].T, xs[r][t_:t_ + 1] @ res["w3"][e].T) * routings[r][1][t_, s]
                y[t_] += (h.to(torch.bfloat16) @ res["w2"][e].T)[0].float()
        return y

    t = b.time_graph_us([lambda r=r: bf16_resident(r) for r in range(n)], replays=5)
    unique = nbytes / (3 * (bank.inter * bank.dim // 2 + bank.inter * bank.dim // 32))
    b.add("moe_decode", "bf16_resident", T, t, unique * 3 * bank.inter * bank.dim * 2, route="baseline")
    del res


