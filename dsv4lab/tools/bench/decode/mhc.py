"""Decode suite, section ``mhc``: the one-launch mHC site (``mhc.hc_post_pre_norm`` at decode sizes) — each
geometry of :data:`dsv4lab.engine.kernel_families.MHC_SITE` checked against the reference within the kernel's
stated bound and timed with the mixing matrix rotated past L2, beside the parts of its time."""
from __future__ import annotations

from dataclasses import asdict

import torch

from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.engine.kernel_families import MHC_SITE
from dsv4lab.tools.bench.decode.harness import DecodeBench
from dsv4lab.tools.verify.bounds import check_within_bound
def mhc_site_variants(smoke: bool) -> list[tuple[str, object]]:
    """``(name, MhcSiteGeometry)`` of :data:`~dsv4lab.engine.kernel_families.MHC_SITE` (``n``: programs across
    ``D`` per row, ``d``: their column step, ``f``: the finishing program's column step, ``w``: warps,
    ``:split_tail``: two programs finish a row); ``None`` for ``default``, the kernel's geometry for the batch
    (:meth:`MhcSiteGeometry.for_rows`)."""
    from dsv4lab_kernels.mhc import MhcSiteGeometry
    return [(v.name, MhcSiteGeometry(**v.fields) if v.fields else None)
            for v in MHC_SITE.runs("smoke" if smoke else "full")]


def mhc_site_checks(b: DecodeBench, name: str, outs, refs) -> bool:
    """The site kernel's stated bound (:mod:`dsv4lab_kernels.mhc`): ``post`` and ``comb`` one fp32 ulp, ``X'`` one
    ulp, the normed input ``x`` three (two chained act roundings and the rare fp32 boundary case of ``pre``)."""
    ok = True
    for n, o, r in zip(("X'", "x", "post", "comb"), outs, refs):
        od = torch.float32 if n in ("post", "comb") else torch.bfloat16
        res = check_within_bound(o, r, 0.0, terms=1, acc_dtype=torch.float32, out_dtype=od,
                                 ulps=3.0 if n == "x" else 1.0, name=f"{name}.{n}")
        ok = b.record_bound(res) and ok
    return ok


def bench_mhc(b: DecodeBench, a, gen, batches) -> None:
    """The mHC decode site at real width — ``hc_post_pre_norm``, the end of one sub-layer and the normed input of
    the next in one launch, as the decode step runs it at every site but the first and the head. Each geometry is
    checked against the reference (:func:`mhc_site_checks`) and graph-timed with the 1.6 MB mixing matrix
    rotated past L2 (the step reads it from HBM). Beside them, what the default's time is made of: the same launch
    with one Sinkhorn iteration instead of ``hc_sinkhorn_iters`` (other results: timing only), the head
    collapse (no Sinkhorn, no norm, no ``X'``), the two-launch mix/finish pair, and an empty launch."""
    from dsv4lab_kernels import mhc
    dev = b.device
    HC, D = a.hc_mult, a.dim
    it, ne, he = a.hc_sinkhorn_iters, a.norm_eps, a.hc_eps
    fn_bytes = a.mix_hc * a.hc_dim * 4
    n_rot = 1 if b.smoke else max(2, -(-64 * 2 ** 20 // fn_bytes))  # > the H200's 50 MB of L2
    fns = [torch.randn(a.mix_hc, a.hc_dim, device=dev, generator=gen) * a.hc_dim ** -0.5 for _ in range(n_rot)]
    base = torch.randn(a.mix_hc, device=dev, generator=gen) * 0.5
    scale = torch.rand(3, device=dev, generator=gen) + 0.5
    w = (1 + 0.1 * torch.randn(D, device=dev, generator=gen)).to(torch.bfloat16)
    ref_ops = ReferenceOps(Numerics())
    variants = mhc_site_variants(b.smoke)
    passed = {name for name, _ in variants}
    for T in batches:
        if b.over_budget(f"mhc b{T}"):
            return
        X = (torch.randn(T, 1, HC, D, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
        h = torch.randn(T, 1, D, device=dev, generator=gen).to(torch.bfloat16)
        _, post, comb = mhc.hc_pre_norm(X, fns[0], base, scale, w, it, ne, he)
        nbytes = fn_bytes + T * (2 * HC * D + 2 * D) * 2  # fn; X and X'; the sub-layer output and x

        def site(fn, geo, iters=it):
            return mhc.hc_post_pre_norm(h, X, post, comb, fn, base, scale, w, iters, ne, he, geometry=geo)

        if T in (batches[0], batches[-1]):  # the geometries' shared code path, at the smallest and largest batch
            refs = ref_ops.hc_post_pre_norm(h, X, post, comb, fns[0], base, scale, w, a)
            for name, geo in variants:
                ok = b.guard(f"mhc check {name} b{T}",
                             lambda: mhc_site_checks(b, f"mhc:{name}:T{T}", site(fns[0], geo), refs))
                if not ok:
                    passed.discard(name)
        for name, geo in variants:
            if name not in passed:
                continue
            t = b.guard(f"mhc {name} b{T}", lambda: b.time_graph_us([lambda f=f: site(f, geo) for f in fns]))
            if t is not None:
                b.add("mhc_site", name, T, t, nbytes, route="triton",
                      geometry_fields=asdict(geo or mhc.MhcSiteGeometry.for_rows(T, D)))
        if "default" not in passed:
            continue
        parts = {"sinkhorn_1_iteration": lambda f: site(f, None, 1),
                 "head_collapse": lambda f: mhc.hc_head(X, f[:HC], base, scale, ne, he),
                 "mix_finish_pair": lambda f: site(f, mhc.MhcGeometry.for_rows(T, D))}
        for part, fn_call in parts.items():
            t = b.guard(f"mhc {part} b{T}", lambda: b.time_graph_us([lambda f=f: fn_call(f) for f in fns]))
            if t is not None:
                b.add("mhc_site", part, T, t, nbytes, route="part")
        one = torch.zeros(1, device=dev)
        t = b.guard("empty launch", lambda: b.time_graph_us([lambda: one.add_(0)] * n_rot))
        if t is not None:
            b.add("mhc_site", "empty_launch", T, t, 0, route="floor")


