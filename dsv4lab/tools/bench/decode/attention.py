"""Decode suite, section ``attention``: the sparse attention of the decode step (``attention_decode``) — every
geometry of :data:`dsv4lab.engine.kernel_families.ATTENTION` checked against the reference, then timed from two
caches (window ring + compressed entries) beside a torch gather."""
from __future__ import annotations

from dataclasses import asdict

import torch

from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.engine.kernel_families import ATTENTION
from dsv4lab.tools.bench.decode.harness import DecodeBench
from dsv4lab.tools.verify.registry import _make_attention


def check_attention(b: DecodeBench, a) -> set[str]:
    """The attention geometries on this GPU against the reference (the tolerance of their kind)."""
    from dsv4lab_kernels import attention_decode as attn
    dev, passed = b.device, set()
    ref = ReferenceOps(Numerics())
    shape = dict(b=2, s=1, h=a.n_heads, d=a.head_dim, n_kv=700 if not b.smoke else 80,
                 k=(a.window_size + a.index_topk) if not b.smoke else 40, masked=0.2)
    q, kv, aidx, sink, scale = _make_attention(shape, torch.Generator().manual_seed(1), "cpu", Numerics())
    want = ref.sparse_attention(q, kv, aidx, sink, scale)
    q, kv, aidx, sink = q.to(dev), kv.to(dev), aidx.to(dev), sink.to(dev)
    for gname, geo in attention_geometries(b.smoke):
        name = f"attn:{gname}"
        kind = "reduction" if geo.splits == 1 and geo.two_pass else "attention"
        rows = torch.arange(2, device=dev)

        def out(geo=geo):
            return attn.sparse_attention_decode(q[:, 0], kv, aidx[:, 0], rows, sink, scale, geometry=geo)[:, None]
        if b.guard(name, lambda: b.check(name, out(), want, kind)):
            passed.add(name)
    return passed


def attention_geometries(smoke: bool):
    """``(name, AttentionGeometry)`` of :data:`~dsv4lab.engine.kernel_families.ATTENTION` (every one in a quick run
    too: the section is not part of the quick suite) — ``s`` row slices, ``1p`` one pass with a running max,
    ``2p`` two passes."""
    from dsv4lab_kernels import attention_decode as attn
    return [(v.name, attn.AttentionGeometry(**v.fields)) for v in ATTENTION.runs("smoke" if smoke else "full")]


def bench_attention(b: DecodeBench, a, gen, passed: set[str], batches) -> None:
    from dsv4lab_kernels import attention_decode as attn
    dev = b.device
    H, d, W = a.n_heads, a.head_dim, a.window_size
    C, topk = (64, 16) if b.smoke else (1024, a.index_topk)
    n_rot = 1 if b.smoke else 8
    for T in batches:
        if b.over_budget(f"attention b{T}"):
            return
        caches = [((torch.randn(T, W, d, device=dev, generator=gen)).to(torch.bfloat16),
                   (torch.randn(T, C, d, device=dev, generator=gen)).to(torch.bfloat16)) for _ in range(n_rot)]
        q = (torch.randn(T, H, d, device=dev, generator=gen)).to(torch.bfloat16)
        sink = torch.randn(H, device=dev, generator=gen)
        win_rows = torch.arange(W, device=dev).expand(T, W).contiguous()
        cmp_rows = torch.stack([torch.randperm(C, device=dev, generator=gen)[:topk] for _ in range(T)])
        slots = torch.arange(T, device=dev)
        nbytes = T * (W + topk) * d * 2 + 2 * T * H * d * 2 + T * (W + topk) * 8
        for gname, geo in attention_geometries(b.smoke):
            if f"attn:{gname}" not in passed:
                continue
            calls = [lambda c=c, geo=geo: attn.sparse_attention_decode(q, c[0], win_rows, slots, sink, d ** -0.5,
                                                                       kv_b=c[1], rows_b=cmp_rows, batch_b=slots,
                                                                       geometry=geo) for c in caches]
            t = b.guard(f"attention {gname} b{T}", lambda: b.time_graph_us(calls))
            if t is not None:
                b.add("attn_decode", gname, T, t, nbytes, route="triton", geometry_fields=asdict(geo))

        def torch_gather(c):
            kv = torch.cat((c[0], torch.gather(c[1], 1, cmp_rows[..., None].expand(-1, -1, d))), 1)  # [T, n, d]
            z = torch.einsum("thd,tnd->thn", q, kv).float() * d ** -0.5
            m = z.amax(-1, keepdim=True)
            e = torch.exp(z - m)
            den = e.sum(-1, keepdim=True) + torch.exp(sink[None, :, None] - m)
            return (torch.einsum("thn,tnd->thd", e.to(torch.bfloat16), kv).float() / den).to(torch.bfloat16)

        t = b.guard(f"attention torch b{T}", lambda: b.time_graph_us([lambda c=c: torch_gather(c) for c in caches]))
        if t is not None:
            b.add("attn_decode", "torch_gather", T, t, nbytes, route="baseline")


