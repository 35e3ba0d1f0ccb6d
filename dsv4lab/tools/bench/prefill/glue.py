"""Prefill suite, section ``glue``: the mHC of a prefill chunk on the decode step's kernels and on the rows kernel
(each of ``mhc.ROWS_GEOMETRIES``, checked against the decode kernels first), and the attention output's RoPE."""
from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.tools.bench.common import top_kernels
from dsv4lab.tools.bench.prefill.harness import PrefillBench


def bench_glue(b: PrefillBench, a, gen, T: int) -> None:
    """The glue of a ``T``-token prefill chunk: mHC on the decode step's kernels and on the rows kernel (checked
    against each other first — both evaluate the reference's sums in fp64, so at most one output ulp apart where a
    value lies on a rounding boundary; a failed check keeps the rows kernel untimed), and the RoPE of the attention
    output on its kernel beside the reference's torch ops."""
    from dsv4lab_kernels import mhc
    from dsv4lab_kernels import norm_rope_quant as nrq
    dev = b.device
    X = (torch.randn(T, a.hc_mult, a.dim, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
    fn = torch.randn(a.mix_hc, a.hc_dim, device=dev, generator=gen) * a.hc_dim ** -0.5
    base = torch.randn(a.mix_hc, device=dev, generator=gen) * 0.5
    scale = torch.rand(3, device=dev, generator=gen) + 0.5
    w = 1 + 0.1 * torch.randn(a.dim, device=dev, generator=gen)
    h = torch.randn(T, a.dim, device=dev, generator=gen).to(torch.bfloat16)
    it, ne, he = a.hc_sinkhorn_iters, a.norm_eps, a.hc_eps
    _, post, comb = mhc.hc_pre_norm(X, fn, base, scale, w, it, ne, he)
    kernels = {
        "hc_pre_norm": (lambda: mhc.hc_pre_norm(X, fn, base, scale, w, it, ne, he),
                        lambda g: mhc.hc_pre_norm_rows(X, fn, base, scale, w, it, ne, he, g)),
        "hc_post_pre_norm": (lambda: mhc.hc_post_pre_norm(h, X, post, comb, fn, base, scale, w, it, ne, he),
                             lambda g: mhc.hc_post_pre_norm_rows(h, X, post, comb, fn, base, scale, w, it, ne, he,
                                                                 g)),
        "hc_post": (lambda: (mhc.hc_post(h, X, post, comb),), lambda g: (mhc.hc_post_rows(h, X, post, comb, g),)),
    }
    rows_ok = mhc.rows_kernel_works(dev)
    if not rows_ok:
        b.log(f"mHC rows kernel not used: {mhc.rows_kernel_status(dev)}")
    geometries = list(mhc.ROWS_GEOMETRIES.values())[:1 if b.smoke else None]

    def kernels_of(fn) -> list[dict]:
        """What one call's time is made of, on a GPU: its kernels (the mix, the finish, a widening copy…)."""
        if not b.cuda:
            return []
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fn()
            b.sync()
        top = top_kernels(prof, 3, n=6)
        b.log("  kernels per call: " + ", ".join(f"{k['name'][:48]} {k['us']:.0f} µs" for k in top))
        return top
    for op, (decode_fn, rows_fn) in kernels.items():
        t = b.time_events_us(decode_fn, name=f"{op}:decode")
        b.add("glue", f"{op}:decode_kernel", t, 0.0, "copy", tokens=T, kernels=kernels_of(decode_fn))
        want = decode_fn() if rows_ok else ()  # what every geometry is checked against (one call, not one each)
        for geo in geometries if rows_ok else ():
            def check(geo=geo) -> bool:
                ok = True
                for i, (o, r) in enumerate(zip(rows_fn(geo), want)):
                    od = torch.float32 if o.dtype == torch.float32 else torch.bfloat16
                    ok = b.check_ulps(f"mhc_rows:{op}:{geo.name}.{i}", o, r, od, 3.0 if (
                        op != "hc_post" and o.ndim == 2 and od != torch.float32) else 1.0) and ok
                return ok
            if b.guard(f"mhc rows {op} {geo.name}", check):
                t = b.time_events_us(lambda geo=geo: rows_fn(geo), name=f"{op}:rows {geo.name}")
                b.add("glue", f"{op}:rows_kernel:{geo.name}", t, 0.0, "copy", tokens=T, geometry=geo.name,
                      kernels=kernels_of(lambda geo=geo: rows_fn(geo)))
    # the attention output's inverse RoPE: [T, heads, head_dim], angles per token
    o = torch.randn(T, a.n_heads, a.head_dim, device=dev, generator=gen).to(torch.bfloat16)
    ang = torch.rand(T, 1, a.rope_head_dim // 2, device=dev, generator=gen) * 6.28
    c, sn = ang.cos(), ang.sin()
    ref = ReferenceOps(Numerics(exact_reductions=False))
    if b.guard("rope", lambda: b.check_ulps("rope", nrq.rope_rows(o, c, sn, True), ref.rope(o, c, sn, True),
                                            torch.bfloat16, 1.0)):
        t = b.time_events_us(lambda: nrq.rope_rows(o, c, sn, True), name="rope")
        b.add("glue", "rope:kernel", t, 0.0, "copy", tokens=T, gbps=round(2 * o.numel() * 2 / (t * 1e-6) / 1e9, 1))
    t = b.time_events_us(lambda: ref.rope(o, c, sn, True))
    b.add("glue", "rope:torch", t, 0.0, "copy", tokens=T)


