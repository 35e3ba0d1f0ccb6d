"""Decode suite, section ``attention``, its long-context sweep: the indexer's selection and the attention of the
decode step after prompts of :data:`~dsv4lab.engine.kernel_families.LONG_CONTEXTS` tokens, today's kernels beside
the long-context ones (:data:`~dsv4lab.engine.kernel_families.INDEXER_SPLIT`,
:data:`~dsv4lab.engine.kernel_families.ATTENTION_SPLIT`) in one run.

Per context ``L`` (Flash: 64 index heads × 128, top-512, window 128, 64 heads × 512):

* ``indexer_ctx<L>`` — the selection over ``L/4`` index keys (FP4-valued, as the indexer's simulation leaves them):
  ``today`` (the fused ``indexer_decode``) and each split variant from its ``min_entries`` on;
* ``attn_hca_ctx<L>`` — HCA: the window and every completed entry (``L/128``), read as a prefix;
* ``attn_csa_ctx<L>`` — CSA: the window and the top-512 picks among ``L/4`` entries;

each attention row ``today`` (the geometry the dispatch gives the decode attention on this GPU: its tuned entry,
else the default) and each split-KV variant. Every variant is first checked here: a split selection must equal the
fused kernel's and be exact given its scores; a split-KV attention must lie within its own bound
(``op_bounds.attention.sparse_attention_split``). Bytes are the ones each kernel must read (keys or KV rows, the
index lists, the query) and write; caches are rotated so that a call does not find the previous one's in L2.
"""
from __future__ import annotations

from dataclasses import asdict

import torch

from dsv4lab.core import quant
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.engine.dispatch import Dispatch
from dsv4lab.engine.kernel_families import ATTENTION_SPLIT, INDEXER_SPLIT, LONG_CONTEXTS
from dsv4lab.tools.bench.decode.harness import DecodeBench
from dsv4lab.tools.verify.op_bounds import check_expectation
from dsv4lab.tools.verify.op_bounds.attention import attention_from_caches_split

SMOKE_CONTEXTS = (128, 512)
ROTATE_BYTES = 64 << 20  # at least this much cache per timed graph (the H200's L2 is 50 MB)


def contexts(smoke: bool) -> tuple[int, ...]:
    return SMOKE_CONTEXTS if smoke else LONG_CONTEXTS


def _variants(family, smoke: bool):
    return family.runs("smoke" if smoke else "full")


def _rotations(nbytes: int, smoke: bool) -> int:
    return 1 if smoke else max(2, min(16, -(-ROTATE_BYTES // max(nbytes, 1))))


def _fp4_keys(n_slots: int, n: int, d: int, dev, gen) -> torch.Tensor:
    return quant.fp4_qdq(torch.randn(n_slots, n, d, device=dev, generator=gen), 32).to(torch.bfloat16)


# ============================================================================================ checks
def check_long_context(b: DecodeBench, a, gen) -> set[str]:
    """The long-context variants on this device: a split selection equal to the fused kernel's and exact given its
    scores (two rows at different depths over an irregular cache, keys duplicated across slices); a split-KV
    attention within its own bound of the reference (HCA's prefix and CSA's picks, NaN past the visible rows)."""
    from dsv4lab_kernels import attention_split_decode as asp
    from dsv4lab_kernels import indexer_decode as ixd
    from dsv4lab_kernels import indexer_split_decode as ixs
    dev, passed = b.device, set()
    H, D, k = a.index_n_heads, a.index_head_dim, a.index_topk
    T = 75 if b.smoke else 4099
    positions = torch.tensor([4 * T - 1, 2 * T + 3], device=dev)
    keys = _fp4_keys(3, T, D, dev, gen)
    keys[0, (2 * T + 4) // 4:] = float("nan")  # slot 0 is row 1's: only its first (2T+4)/4 keys are visible
    keys[2, [5, 9, T // 2, T - 1]] = keys[2, 3].clone()
    slots = torch.tensor([2, 0], device=dev)
    qi = _fp4_keys(1, 2, H * D, dev, gen).view(2, H, D)
    w = torch.randn(2, H, device=dev, generator=gen).to(torch.bfloat16)
    want, scores = ixd.indexer_select(qi, w, keys, slots, positions, k, w_scale=a.index_scale, return_scores=True)
    ref = ReferenceOps(Numerics())
    for v in _variants(INDEXER_SPLIT, b.smoke):
        name = f"indexer_split:{v.name}"

        def check(v=v, name=name):
            sel, own = ixs.indexer_select_split(qi, w, keys, slots, positions, k, w_scale=a.index_scale,
                                                geometry=ixs.IndexerSplitGeometry(**v.fields), return_scores=True)
            vis = torch.arange(T, device=dev)[None, :] < ((positions + 1) // 4)[:, None]
            own = torch.where(vis, own, 0.0)
            exact = torch.equal(sel.cpu(), ref.indexer_topk(own.cpu().to(torch.bfloat16)[:, None],
                                                            positions.cpu()[:, None], 4, k)[:, 0])
            same = torch.equal(sel, want) and torch.equal(own, torch.where(vis, scores, 0.0))
            return b.record_bound(dict(name=name, ok=exact and same,
                                       line=f"{name}: exact given its scores {exact}, the fused kernel's picks and "
                                            f"scores {same}"))
        if b.guard(name, check):
            passed.add(name)
    W, d, Hq = a.window_size, a.head_dim, a.n_heads
    for kind, ratio, C, picks in (("hca", 128, 20 if b.smoke else 600, None), ("csa", 4, 80 if b.smoke else 2400,
                                                                             a.index_topk)):
        case = _attention_case(dev, gen, Hq, d, W, C, ratio, picks, positions=(ratio * C - 1, ratio * C // 3 + 5))
        q, win, win_rows, cmp, cmp_rows, slots_a, sink, pos = case
        want = ref.attention_from_caches(*(t.cpu() for t in (q, win, win_rows, cmp, cmp_rows, slots_a, sink)),
                                         d ** -0.5)
        for v in _variants(ATTENTION_SPLIT, b.smoke):
            name = f"attn_split:{v.name}:{kind}"
            geo = asp.SplitKvGeometry(**v.fields)

            def check(geo=geo, name=name):
                out = asp.sparse_attention_split(q, win, win_rows, slots_a, sink, d ** -0.5, kv_b=cmp, rows_b=cmp_rows,
                                                 batch_b=slots_a, geometry=geo, positions=pos, prefix_ratio_b=ratio)
                acc = "fp32_tc4" if b.cuda else "fp32"
                expect = attention_from_caches_split(
                    Numerics(), acc, *(t.cpu() for t in (q, win, win_rows, cmp, cmp_rows, slots_a, sink)),
                    d ** -0.5, chunk=geo.chunk, block_r=geo.block_r)
                return b.record_bound(check_expectation(out.cpu(), want, expect, name))
            if b.guard(name, check):
                passed.add(name)
    return passed


def _attention_case(dev, gen, H, d, W, C, ratio, picks, positions, batch_slots=None):
    """One query per row over a full window ring and a compressed cache whose rows past each row's completed
    entries are NaN: HCA's prefix (``picks`` None) or ``picks`` random visible entries (CSA), −1 after them."""
    pos = torch.tensor(positions, device=dev)
    R = len(positions)
    q = torch.randn(R, H, d, device=dev, generator=gen).to(torch.bfloat16)
    win = torch.randn(R, W, d, device=dev, generator=gen).to(torch.bfloat16)
    cmp = torch.randn(R, C, d, device=dev, generator=gen).to(torch.bfloat16)
    vis = ((pos + 1) // ratio).clamp(max=C)
    ent = torch.arange(C, device=dev)[None, :]
    cmp = torch.where((ent < vis[:, None])[..., None], cmp, torch.full_like(cmp, float("nan")))
    wpos = (pos - (W - 1)).clamp(min=0)[:, None] + torch.arange(W, device=dev)[None, :]
    win_rows = torch.where(wpos <= pos[:, None], wpos % W, -1)
    if picks is None:
        cmp_rows = torch.where(ent < vis[:, None], ent, -1)
    else:
        cmp_rows = torch.full((R, picks), -1, dtype=torch.long, device=dev)
        for i in range(R):
            n = min(picks, int(vis[i]))
            cmp_rows[i, :n] = torch.randperm(int(vis[i]), device=dev, generator=gen)[:n]
    slots = torch.arange(R, device=dev)
    sink = torch.randn(H, device=dev, generator=gen)
    return q, win, win_rows, cmp, cmp_rows, slots, sink, pos


# ============================================================================================ timing
def bench_long_context(b: DecodeBench, a, gen, passed: set[str], batches) -> None:
    """The sweep: per context and batch, today's kernel and every checked long-context variant that applies."""
    from dsv4lab_kernels import attention_decode as attn
    from dsv4lab_kernels import attention_split_decode as asp
    from dsv4lab_kernels import indexer_decode as ixd
    from dsv4lab_kernels import indexer_split_decode as ixs
    dev = b.device
    today = Dispatch.for_device(torch.cuda.get_device_name() if b.cuda else None, not b.cuda)
    H, D, k = a.index_n_heads, a.index_head_dim, a.index_topk
    W, d, Hq = a.window_size, a.head_dim, a.n_heads
    for L in contexts(b.smoke):
        for T in batches:
            if b.over_budget(f"long context {L} b{T}"):
                return
            # -------------------------------------------------------------- the indexer over L/4 keys
            n = L // 4
            nbytes = T * (n * D * 2 + n * 4 + H * D * 2 + H * 2 + k * 8)
            rot = _rotations(T * n * D * 2, b.smoke)
            caches = [_fp4_keys(T, n, D, dev, gen) for _ in range(rot)]
            qi = _fp4_keys(1, T, H * D, dev, gen).view(T, H, D)
            w = torch.randn(T, H, device=dev, generator=gen).to(torch.bfloat16)
            slots = torch.arange(T, device=dev)
            pos = torch.full((T,), L - 1, device=dev)
            extra = dict(context=L, entries=n)
            t = b.guard(f"indexer today ctx{L} b{T}", lambda: b.time_graph_us(
                [lambda c=c: ixd.indexer_select(qi, w, c, slots, pos, k, w_scale=a.index_scale) for c in caches]))
            if t is not None:
                b.add(f"indexer_ctx{L}", "today", T, t, nbytes, route="today", **extra)
            for v in _variants(INDEXER_SPLIT, b.smoke):
                if f"indexer_split:{v.name}" not in passed or not v.applies(T, True, n):
                    continue
                geo = ixs.IndexerSplitGeometry(**v.fields)
                t = b.guard(f"indexer {v.name} ctx{L} b{T}", lambda geo=geo: b.time_graph_us(
                    [lambda c=c: ixs.indexer_select_split(qi, w, c, slots, pos, k, w_scale=a.index_scale,
                                                          geometry=geo) for c in caches]))
                if t is not None:
                    b.add(f"indexer_ctx{L}", v.name, T, t, nbytes, route="split", geometry_fields=asdict(geo),
                          **extra)
            del caches
            # -------------------------------------------------------------- the attention, HCA and CSA
            for kind, ratio, picks in (("hca", 128, None), ("csa", 4, k)):
                C = L // ratio
                rows_read = W + (picks if picks is not None else C)
                nbytes = T * (rows_read * (d * 2 + 8) + 2 * Hq * d * 2)
                rot = _rotations(T * (W + C) * d * 2, b.smoke)
                cases = [_attention_case(dev, gen, Hq, d, W, C, ratio, picks, positions=(L - 1,) * T)
                         for _ in range(rot)]
                entries = W + (picks if picks is not None else C)
                extra = dict(context=L, entries=entries)
                geo_today = today.attention(T)
                geo_today = attn.AttentionGeometry(**geo_today.fields) if geo_today is not None else None

                def calls(kernel, geo):
                    return [lambda c=c: kernel(c[0], c[1], c[2], c[5], c[6], d ** -0.5, kv_b=c[3], rows_b=c[4],
                                               batch_b=c[5], geometry=geo, positions=c[7], prefix_ratio_b=ratio)
                            for c in cases]
                t = b.guard(f"attention {kind} today ctx{L} b{T}",
                            lambda: b.time_graph_us(calls(attn.sparse_attention_decode, geo_today)))
                if t is not None:
                    b.add(f"attn_{kind}_ctx{L}", "today", T, t, nbytes, route="today",
                          geometry_fields=asdict(geo_today) if geo_today else None, **extra)
                for v in _variants(ATTENTION_SPLIT, b.smoke):
                    if f"attn_split:{v.name}:{kind}" not in passed or not v.applies(T, True, entries):
                        continue
                    geo = asp.SplitKvGeometry(**v.fields)
                    t = b.guard(f"attention {kind} {v.name} ctx{L} b{T}",
                                lambda geo=geo: b.time_graph_us(calls(asp.sparse_attention_split, geo)))
                    if t is not None:
                        b.add(f"attn_{kind}_ctx{L}", v.name, T, t, nbytes, route="split",
                              geometry_fields=asdict(geo), **extra)
                del cases


__all__ = ["contexts", "check_long_context", "bench_long_context"]
