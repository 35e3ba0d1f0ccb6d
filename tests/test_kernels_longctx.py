"""The long-context decode kernels (issue 33) against the reference and against today's kernels: the indexer's
selection split over the key axis (``dsv4lab_kernels.indexer_split_decode``) and the split-KV attention
(``dsv4lab_kernels.attention_split_decode``), their dispatch, and the static decode step's attention sites with
them forced.

Interpreter-sized shapes, chosen to exercise every path of the new kernels: caches whose length is not a multiple of
the split or chunk, rows of one batch at different depths (one that sees nothing yet, one that sees fewer entries
than ``k``), key slices wholly past a row's visible count, unwritten cache rows NaN-poisoned (a read of one poisons
the output), ties in the index scores (duplicated keys across slices, a slot of identical keys), several blocks of
the attention combine. The selection must be the reference's bit for bit (set and order, ties to the lower entry);
the attention must lie within its own derived bound (``op_bounds.attention.sparse_attention_split``) and within the
op's general one.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dsv4lab.core import quant
from dsv4lab.core.config import get_preset
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.core.model.rope import rope_table
from dsv4lab.engine.dispatch import GPU_DEFAULTS, INTERPRETER_DEFAULTS, SCHEMA, Dispatch, DispatchError, Tuned
from dsv4lab.engine.kernel_families import ATTENTION_SPLIT, INDEXER_SPLIT
from dsv4lab.tools.verify.op_bounds import OP_BOUNDS, check_expectation
from dsv4lab.tools.verify.op_bounds.attention import attention_from_caches_split, sparse_attention_split
from dsv4lab.tools.verify.registry import _make_attention
from dsv4lab.tools.verify.stages import default_accumulation

pytest.importorskip("triton")
ixd = pytest.importorskip("dsv4lab_kernels.indexer_decode")
ixs = pytest.importorskip("dsv4lab_kernels.indexer_split_decode")
attn = pytest.importorskip("dsv4lab_kernels.attention_decode")
asp = pytest.importorskip("dsv4lab_kernels.attention_split_decode")

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
NM = Numerics()
TINY = get_preset("tiny")


def _poisoned(t: torch.Tensor, extra: int = 64) -> torch.Tensor:
    """``t`` on the test device at the front of a buffer whose tail is NaN (a read past its end poisons)."""
    buf = torch.full((t.numel() + extra,), float("nan"), dtype=t.dtype, device=DEV)
    buf[: t.numel()] = t.reshape(-1).to(DEV)
    return buf[: t.numel()].view(t.shape)


# ============================================================================================ the indexer
def _indexer_case(B, H, D, T, p, dtype=torch.bfloat16, seed=0, flat_slot=False):
    """FP4-valued queries and keys (as the indexer's simulation makes them), random head weights, one spare cache
    slot; every key no row can see is NaN. Ties: the keys of entries 2, 5, 9, 21, 40 and 70 of row 0's slot are one
    key (they fall in different slices of 16 and 32); with ``flat_slot`` every visible key of row 1 is one key."""
    g = torch.Generator().manual_seed(seed)
    qi = quant.fp4_qdq(torch.randn(B, H, D, generator=g), 32).to(dtype)
    w = torch.randn(B, H, generator=g).to(dtype)
    keys = torch.full((B + 1, T, D), float("nan"), dtype=dtype)
    slots = torch.randperm(B + 1, generator=g)[:B]
    pos = torch.tensor(p)
    for i in range(B):
        n = min((p[i] + 1) // 4, T)
        keys[slots[i], :n] = quant.fp4_qdq(torch.randn(n, D, generator=g), 32).to(dtype)
    n0 = min((p[0] + 1) // 4, T)
    for t in (5, 9, 21, 40, 70):
        if t < n0:
            keys[slots[0], t] = keys[slots[0], 2]
    if flat_slot:
        n1 = min((p[1] + 1) // 4, T)
        keys[slots[1], :n1] = keys[slots[1], :1]
    return qi, w, keys, slots, pos


INDEXER_CASES = [
    # a row that sees nothing yet (p=2) and one with fewer keys than k (p=40) beside two deep ones; 75 keys in
    # slices of 16 (the last one partial)
    dict(B=4, H=4, D=64, T=75, topk=16, p=[299, 150, 2, 40], split=16, block_t=16, block_e=16),
    # slices shorter than k (every key a candidate), k not a power of two, a slot of identical keys
    dict(B=2, H=8, D=128, T=300, topk=40, p=[1199, 733], split=32, block_t=16, block_e=8, flat_slot=True),
    # slices longer than k (the candidates pruned to k per slice), a partial last slice, one merge block per list
    dict(B=2, H=4, D=64, T=300, topk=16, p=[1199, 300], split=128, block_t=32, block_e=16),
    # fp32 numerics (32-bit order keys)
    dict(B=2, H=4, D=64, T=75, topk=16, p=[290, 77], split=16, block_t=16, block_e=8, dtype=torch.float32),
    # a cache shorter than k: every visible key picked, in score order
    dict(B=2, H=4, D=64, T=20, topk=32, p=[79, 50], split=16, block_t=16, block_e=16),
    # many lists (25 and 11): the merge's floor under the k-th key leaves most candidates out
    dict(B=2, H=4, D=64, T=400, topk=40, p=[1599, 701], split=16, block_t=16, block_e=16),
]


def _case_id(c: dict) -> str:
    return "T{T}k{topk}s{split}".format(**c) + ("-fp32" if c.get("dtype") == torch.float32 else "") \
        + ("-flat" if c.get("flat_slot") else "")


@pytest.mark.parametrize("case", INDEXER_CASES, ids=_case_id)
def test_split_indexer_is_the_reference_selection(case):
    """Set and order of the picks equal the reference's (stable descending sort: ties to the lower entry), −1 after
    the visible count; the scores are the fused kernel's bit for bit (the same helper); two launches agree (no
    state survives a launch)."""
    dtype = case.get("dtype", torch.bfloat16)
    qi, w, keys, slots, pos = _indexer_case(case["B"], case["H"], case["D"], case["T"], case["p"], dtype,
                                            flat_slot=case.get("flat_slot", False))
    scale = TINY.index_scale
    topk = case["topk"]
    ops = ReferenceOps(Numerics(dtype=dtype))
    ref = ops.indexer_select_decode(qi, w, keys, slots, pos, topk, w_scale=scale)
    geo = ixs.IndexerSplitGeometry(split=case["split"], block_t=case["block_t"], block_e=case["block_e"])
    args = (_poisoned(qi), _poisoned(w), keys.to(DEV), slots.to(DEV), pos.to(DEV), topk)
    sel, scores = ixs.indexer_select_split(*args, w_scale=scale, geometry=geo, return_scores=True)
    again = ixs.indexer_select_split(*args, w_scale=scale, geometry=geo) if case["T"] < 400 else sel
    fused, fused_scores = ixd.indexer_select(*args, w_scale=scale, return_scores=True)
    visible = torch.arange(case["T"])[None, :] < ((pos + 1) // 4)[:, None]
    got = torch.where(visible, scores.cpu(), 0.0)
    assert torch.equal(got, torch.where(visible, fused_scores.cpu(), 0.0))
    assert not got.isnan().any()  # no NaN key was read
    assert torch.equal(sel.cpu(), again.cpu()) and torch.equal(sel.cpu(), fused.cpu())
    # exact given its scores on any device, and the reference's own selection where the scores are (interpreter)
    assert torch.equal(sel.cpu(), ops.indexer_topk(got.to(dtype)[:, None], pos[:, None], 4, topk)[:, 0])
    if not GPU:
        assert torch.equal(sel.cpu(), ref)
    if case["p"][0] >= 4 * 71:  # the duplicated keys are visible: their order is the entries'
        picked = sel[0].cpu().tolist()
        tied = [t for t in picked if t in (2, 5, 9, 21, 40, 70)]
        assert tied == sorted(tied)


def test_split_indexer_resolves_a_tie_at_the_threshold_by_entry():
    """More keys tie at the best score than k: the lowest entries win, across slices, in entry order."""
    topk = 16
    qi, w, keys, slots, pos = _indexer_case(1, 4, 64, 90, [359], seed=5)
    ops = ReferenceOps(NM)
    scores = ops.indexer_scores(qi[:, None], (w * TINY.index_scale)[:, None], keys[slots])[0, 0]
    best = int(scores.float().argmax())
    tied = sorted(set(range(3, 90, 4)) | {best})  # 23 entries, in every slice of 16
    keys[slots[0], tied] = keys[slots[0], best].clone()
    ref = ops.indexer_select_decode(qi, w, keys, slots, pos, topk, w_scale=TINY.index_scale)
    sel = ixs.indexer_select_split(qi.to(DEV), w.to(DEV), keys.to(DEV), slots.to(DEV), pos.to(DEV), topk,
                                   w_scale=TINY.index_scale,
                                   geometry=ixs.IndexerSplitGeometry(split=16, block_t=16, block_e=8))
    assert sel[0].cpu().tolist() == tied[:topk]
    assert torch.equal(sel.cpu(), ref)


def test_split_indexer_geometry_is_checked():
    with pytest.raises(ValueError, match="power of two"):
        ixs.indexer_select_split(*(_t.to(DEV) for _t in _indexer_case(1, 4, 64, 20, [79])[:5]), 16,
                                 geometry=ixs.IndexerSplitGeometry(split=48))


# ============================================================================================ the attention
def _caches(b=3, H=8, d=96, W=32, C=40, r=16, positions=(15, 100, 639), k=None, seed=0):
    """A window ring (the engine's rows: oldest first, −1 for the slots a young row has not filled) and a compressed
    cache whose rows past each row's completed entries are NaN; ``k``: CSA-like picks (a random order of the
    visible entries, −1 after them), else HCA's prefix of completed entries."""
    g = torch.Generator().manual_seed(seed)
    q = (3 * torch.randn(b, H, d, generator=g)).to(torch.bfloat16)  # a sharp softmax: the maxima move
    win = torch.randn(b + 1, W, d, generator=g).to(torch.bfloat16)
    pos = torch.tensor(positions)
    vis = ((pos + 1) // r).clamp(max=C)
    cmp = torch.full((b + 1, C, d), float("nan")).to(torch.bfloat16)
    slots = torch.randperm(b + 1, generator=g)[:b]
    for i in range(b):
        cmp[slots[i], :vis[i]] = torch.randn(int(vis[i]), d, generator=g).to(torch.bfloat16)
    wpos = (pos - (W - 1)).clamp(min=0)[:, None] + torch.arange(W)[None, :]
    win_rows = torch.where(wpos <= pos[:, None], wpos % W, -1)
    if k is None:
        cmp_rows = torch.where(torch.arange(C)[None, :] < vis[:, None], torch.arange(C)[None, :], -1)
    else:
        cmp_rows = torch.full((b, k), -1, dtype=torch.long)
        for i in range(b):
            n = min(k, int(vis[i]))
            cmp_rows[i, :n] = torch.randperm(int(vis[i]), generator=g)[:n]
    sink = torch.randn(H, generator=g)
    return q, win, win_rows, cmp, cmp_rows, slots, sink, pos


SPLIT_GEOMETRIES = [asp.SplitKvGeometry(block_h=16, block_r=16, chunk=16, combine_block=2),
                    asp.SplitKvGeometry(block_h=16, block_r=16, chunk=48, combine_block=4),
                    asp.SplitKvGeometry(block_h=16, block_r=32, chunk=32)]


def _judge(name, out, ref, expects):
    for expect in expects:
        res = check_expectation(out.cpu(), ref.cpu(), expect, name)
        assert res.ok, res.line()


@pytest.mark.parametrize("geo", SPLIT_GEOMETRIES, ids=lambda g: f"r{g.block_r}c{g.chunk}s{g.combine_block}")
@pytest.mark.parametrize("kind", ["hca", "csa"])
def test_split_attention_from_caches(geo, kind):
    """HCA (every completed entry, read as a prefix) and CSA (picks in score order, −1 after them): within the
    split kernel's own bound and the op's; NaN rows past the visible entries never read; the same bits on a
    second launch; the inverse-RoPE epilogue is the reference's rotation of the kernel's own rounded output."""
    ratio, k = (16, None) if kind == "hca" else (4, 24)
    C = 40 if kind == "hca" else 160
    q, win, win_rows, cmp, cmp_rows, slots, sink, pos = _caches(C=C, r=ratio, k=k, positions=(15, 100, 639),
                                                                seed=geo.chunk + ratio)
    scale = q.shape[-1] ** -0.5
    dev = [t.to(DEV) for t in (q, win, win_rows, slots, sink)]
    kw = dict(kv_b=cmp.to(DEV), rows_b=cmp_rows.to(DEV), batch_b=slots.to(DEV), geometry=geo, positions=pos.to(DEV),
              prefix_ratio_b=ratio)
    out = asp.sparse_attention_split(*dev[:4], dev[4], scale, **kw)
    assert torch.isfinite(out.float()).all()
    assert torch.equal(out, asp.sparse_attention_split(*dev[:4], dev[4], scale, **kw))
    ref = ReferenceOps(NM).attention_from_caches(q, win, win_rows, cmp, cmp_rows, slots, sink, scale)
    acc = default_accumulation(out.device)
    inputs = (q, win, win_rows, cmp, cmp_rows, slots, sink, scale)
    _judge(f"split-KV {kind} {geo}", out, ref,
           [attention_from_caches_split(NM, acc, *inputs, chunk=geo.chunk, block_r=geo.block_r),
            OP_BOUNDS["attention_from_caches"](NM, acc, *inputs)])
    cos, sin = _tables()
    rotated = asp.sparse_attention_split(*dev[:4], dev[4], scale, **kw, cos=cos.to(DEV), sin=sin.to(DEV))
    want = ReferenceOps(NM).rope(out.cpu(), cos[pos][:, None], sin[pos][:, None], inverse=True)
    assert torch.equal(rotated.cpu(), want) if not GPU else torch.allclose(rotated.cpu().float(), want.float(),
                                                                           rtol=2 ** -7, atol=1e-6)


def _tables():
    return rope_table(TINY, 1, 1024)


@pytest.mark.parametrize("geo", SPLIT_GEOMETRIES[:2], ids=lambda g: f"c{g.chunk}")
def test_split_attention_gathered_rows(geo):
    """The single-cache form (``sparse_attention``: rows gathered by index, −1 anywhere, every unused row NaN):
    within both bounds."""
    shape = dict(b=2, s=3, h=8, d=64, n_kv=90, k=70, masked=0.3)
    q, kv, idx, sink, scale = _make_attention(shape, torch.Generator().manual_seed(geo.chunk), "cpu", NM)
    q = q * 4
    b, s, h, d = q.shape
    out = asp.sparse_attention_split(q.reshape(b * s, h, d).to(DEV), kv.to(DEV), idx.reshape(b * s, -1).to(DEV),
                                     torch.arange(b).repeat_interleave(s).to(DEV), sink.to(DEV), scale, geometry=geo)
    out = out.view(b, s, h, d)
    ref = ReferenceOps(NM).sparse_attention(q, kv, idx, sink, scale)
    acc = default_accumulation(out.device)
    _judge(f"split-KV gathered {geo}", out, ref,
           [sparse_attention_split(NM, acc, q, kv, idx, sink, scale, geo.chunk, geo.block_r),
            OP_BOUNDS["sparse_attention"](NM, acc, q, kv, idx, sink, scale)])


def test_split_attention_combine_columns_and_a_dropped_row():
    """Column blocks of the combine give the whole rows' sums bit for bit; a kernel that loses one visible
    compressed row (read here as −1) falls outside the split bound of the true selection."""
    geo = asp.SplitKvGeometry(block_h=16, block_r=16, chunk=16, combine_block=2)
    q, win, win_rows, cmp, cmp_rows, slots, sink, pos = _caches(seed=7)
    scale = q.shape[-1] ** -0.5
    dev = [t.to(DEV) for t in (q, win, win_rows, slots, sink)]
    kw = dict(kv_b=cmp.to(DEV), batch_b=slots.to(DEV), positions=pos.to(DEV), prefix_ratio_b=16)
    whole = asp.sparse_attention_split(*dev[:4], dev[4], scale, rows_b=cmp_rows.to(DEV), geometry=geo, **kw)
    cols = asp.sparse_attention_split(*dev[:4], dev[4], scale, rows_b=cmp_rows.to(DEV),
                                      geometry=replace(geo, combine_columns=16), **kw)
    assert torch.equal(whole, cols)
    dropped = cmp_rows.clone()
    dropped[2, 17] = -1  # row 2 sees 40 entries: entry 17 is read by no program
    bad = asp.sparse_attention_split(*dev[:4], dev[4], scale, rows_b=dropped.to(DEV), geometry=geo, **kw)
    ref = ReferenceOps(NM).attention_from_caches(q, win, win_rows, cmp, cmp_rows, slots, sink, scale)
    expect = attention_from_caches_split(NM, default_accumulation(bad.device), q, win, win_rows, cmp, cmp_rows,
                                         slots, sink, scale, chunk=geo.chunk, block_r=geo.block_r)
    assert not check_expectation(bad.cpu(), ref, expect, "a dropped row").ok


def test_split_attention_geometry_is_checked():
    q, win, win_rows, cmp, cmp_rows, slots, sink, pos = _caches(b=1, positions=(40,))
    with pytest.raises(ValueError, match="multiple of block_r"):
        asp.sparse_attention_split(q, win, win_rows, slots, sink, 0.1, geometry=asp.SplitKvGeometry(chunk=40))


# ============================================================================================ GPU, Flash widths
FLASH = get_preset("flash")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", INDEXER_SPLIT.runs("full"), ids=lambda v: v.name)
def test_gpu_split_indexer_at_flash_widths_after_65536_tokens(variant):
    """Each benchmarked split-indexer geometry, compiled, at Flash's widths (64 index heads × 128, top-512) over a
    cache of 16,421 keys (not a multiple of any split): one row after a 65,536-token prompt (16,384 visible keys,
    up to 32 lists), one after 36,006 (9,001: a partial last list); every key a row cannot see NaN, one key
    duplicated across slices. The picks are the fused kernel's and the scores its bits; the picks are exact given
    the scores (the reference's stable sort of them on the CPU)."""
    dev = "cuda"
    H, D, k, T = FLASH.index_n_heads, FLASH.index_head_dim, FLASH.index_topk, 16421
    g = torch.Generator(device=dev).manual_seed(33)
    pos = torch.tensor([65535, 36005], device=dev)
    slots = torch.tensor([2, 0], device=dev)
    keys = quant.fp4_qdq(torch.randn(3, T, D, device=dev, generator=g), 32).to(torch.bfloat16)
    vis = torch.arange(T, device=dev)[None, :] < ((pos + 1) // 4)[:, None]
    keys[slots] = torch.where(vis[..., None], keys[slots], float("nan"))
    keys[1] = float("nan")  # the slot no row reads
    keys[2, [700, 5000, 9000, 16000]] = keys[2, 3].clone()
    qi = quant.fp4_qdq(torch.randn(2, H, D, device=dev, generator=g), 32).to(torch.bfloat16)
    w = torch.randn(2, H, device=dev, generator=g).to(torch.bfloat16)
    fused, fused_scores = ixd.indexer_select(qi, w, keys, slots, pos, k, w_scale=FLASH.index_scale,
                                             return_scores=True)
    sel, scores = ixs.indexer_select_split(qi, w, keys, slots, pos, k, w_scale=FLASH.index_scale,
                                           geometry=ixs.IndexerSplitGeometry(**variant.fields), return_scores=True)
    got = torch.where(vis, scores, 0.0)
    assert not got.isnan().any() and torch.equal(got, torch.where(vis, fused_scores, 0.0))
    assert torch.equal(sel, fused)
    want = ReferenceOps(NM).indexer_topk(got.cpu().to(torch.bfloat16)[:, None], pos.cpu()[:, None], 4, k)[:, 0]
    assert torch.equal(sel.cpu(), want) and (sel >= 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ATTENTION_SPLIT.runs("full"), ids=lambda v: v.name)
@pytest.mark.parametrize("kind", ["hca", "csa"])
def test_gpu_split_attention_at_flash_widths(variant, kind):
    """Each benchmarked split-KV geometry, compiled, at Flash's widths (64 heads × 512, window 128): HCA over 520
    compressed rows (a 65,535-position row sees 512, a 30,001 one 234) and CSA's 512 picks among 16,384 entries
    (a row at 20,003 sees 5,001), every row past the visible ones NaN: within the kernel's own bound and the op's,
    the same bits on a second launch, and the inverse-RoPE epilogue the rotation of the kernel's own output."""
    from dsv4lab.tools.bench.decode.long_context import _attention_case
    dev = "cuda"
    ratio, C, picks, positions = ((128, 520, None, (65535, 30001)) if kind == "hca"
                                  else (4, 16384, FLASH.index_topk, (65535, 20003)))
    geo = asp.SplitKvGeometry(**variant.fields)
    g = torch.Generator(device=dev).manual_seed(geo.chunk)
    case = _attention_case(dev, g, FLASH.n_heads, FLASH.head_dim, FLASH.window_size, C, ratio, picks, positions)
    q, win, win_rows, cmp, cmp_rows, slots, sink, pos = case
    scale = FLASH.head_dim ** -0.5
    kw = dict(kv_b=cmp, rows_b=cmp_rows, batch_b=slots, geometry=geo, positions=pos, prefix_ratio_b=ratio)
    out = asp.sparse_attention_split(q, win, win_rows, slots, sink, scale, **kw)
    assert torch.isfinite(out.float()).all()
    assert torch.equal(out, asp.sparse_attention_split(q, win, win_rows, slots, sink, scale, **kw))
    inputs = tuple(t.cpu() for t in (q, win, win_rows, cmp, cmp_rows, slots, sink)) + (scale,)
    ref = ReferenceOps(NM).attention_from_caches(*inputs)
    _judge(f"split-KV {kind} {variant.name} (Flash widths)", out, ref,
           [attention_from_caches_split(NM, "fp32_tc4", *inputs, chunk=geo.chunk, block_r=geo.block_r),
            OP_BOUNDS["attention_from_caches"](NM, "fp32_tc4", *inputs)])
    cos, sin = rope_table(FLASH, 2, 65536)
    rotated = asp.sparse_attention_split(q, win, win_rows, slots, sink, scale, **kw, cos=cos.to(dev), sin=sin.to(dev))
    want = ReferenceOps(NM).rope(out.cpu(), cos[pos.cpu()][:, None], sin[pos.cpu()][:, None], inverse=True)
    assert torch.allclose(rotated.cpu().float(), want.float(), rtol=2 ** -7, atol=1e-6)


# ============================================================================================ the dispatch
def _tuned(**ops) -> Tuned:
    return Tuned(dict(schema=SCHEMA, gpu="NVIDIA H200", sources={"t": dict(commit="abc")},
                      ops={op: [dict(e, source="t") for e in es] for op, es in ops.items()}), "t.json")


def test_dispatch_chooses_the_long_context_kernels_from_their_threshold():
    """A tuned entry (or the device's override) chooses a split kernel from ``min_entries`` on, the kernel of
    today below; a ``fused`` indexer entry and no entry at all keep the fused kernel; a field the geometry lacks
    is refused naming the entry."""
    d = Dispatch(_tuned(**{"decode.indexer": [dict(rows=1, choice=dict(kernel="split", min_entries=2048, split=512)),
                                              dict(rows=8, choice=dict(kernel="fused"))],
                           "decode.attention_split": [dict(rows=1, choice=dict(min_entries=300, chunk=64))]}),
                 GPU_DEFAULTS)
    assert d.indexer(1, 16384).fields == dict(split=512) and d.indexer(1, 2047) is None
    assert d.indexer(8, 16384) is None  # batch 8 measured the fused kernel faster
    assert d.attention_split(1, 640).fields == dict(chunk=64) and d.attention_split(1, 160) is None
    assert Dispatch(Tuned(), GPU_DEFAULTS).indexer(1, 1 << 20) is None  # nothing measured: today's kernels
    assert Dispatch(Tuned(), GPU_DEFAULTS).attention_split(1, 1 << 20) is None
    forced = Dispatch(Tuned(), replace(INTERPRETER_DEFAULTS, indexer_split=dict(split=16, block_t=16),
                                       attention_split=dict(chunk=16, block_r=16)))
    assert forced.indexer(2, 75).fields == dict(split=16, block_t=16) and forced.attention_split(2, 48) is not None
    from dsv4lab.engine.triton_backend import TritonOps
    bad = TritonOps(NM, Dispatch(_tuned(**{"decode.indexer": [dict(rows=1, choice=dict(splt=4))]}), GPU_DEFAULTS))
    with pytest.raises(DispatchError, match=r"t.json: decode.indexer\[0\] \(t\): IndexerSplitGeometry: .*splt"):
        bad.indexer_choice(1, 100)


def test_family_variants_build_and_are_offered_to_verify():
    from dsv4lab.engine.triton_backend import TritonOps
    for family, cls in ((INDEXER_SPLIT, ixs.IndexerSplitGeometry), (ATTENTION_SPLIT, asp.SplitKvGeometry)):
        for v in family.variants:
            cls(**v.fields)
    ops = TritonOps(NM)
    assert {"split16", "split32"} <= set(ops.variants("indexer_select_decode"))
    assert {"split_kv_c16", "split_kv_c32_online"} <= set(ops.variants("attention_from_caches"))
    assert {"split_kv_c16", "splits3"} <= set(ops.variants("sparse_attention"))


# ============================================================================================ through the engine
def test_static_step_attention_sites_with_the_long_context_kernels_forced(tiny_path, monkeypatch):
    """On this machine's device (the interpreter on a CPU; :func:`test_gpu_static_step_attention_sites` is the GPU
    suite's copy): see :func:`_static_step_sites`."""
    _static_step_sites(tiny_path, monkeypatch, DEV)


@pytest.mark.gpu
def test_gpu_static_step_attention_sites(tiny_path, monkeypatch):
    """The same on the GPU: compiled kernels, tensor-core sums, the step's own tensors on the device."""
    _static_step_sites(tiny_path, monkeypatch, "cuda")


def _static_step_sites(tiny_path, monkeypatch, device):
    """The static decode step's attention sites (a CSA and an HCA layer of data/tiny: projections, compressors,
    the indexer's queries and selection, the attention read from the caches, the output projections) on the Triton
    backend with today's kernels and with the split kernels forced through the dispatch's device override: the
    indexer's picks are identical (the same scores, an exact selection), the split attention lies within its own
    bound of the reference on the inputs the step gave it, and the sites' outputs agree to the attention's
    rounding. Caches filled as a 300- and a 171-token context would leave them (random FP4-valued index keys,
    random entries), every row past them NaN."""
    import dsv4lab
    from dsv4lab.engine.decode_graph import StaticDecodeStep
    from dsv4lab.engine import triton_backend

    launched = []  # which kernels the backend launched, in order
    for module, name in ((triton_backend.idx_split, "indexer_select_split"),
                         (triton_backend.idx_decode, "indexer_select"),
                         (triton_backend.attn_split, "sparse_attention_split"),
                         (triton_backend.attn, "sparse_attention_decode")):
        def spy(*args, _fn=getattr(module, name), _name=name, **kwargs):
            launched.append(_name)
            return _fn(*args, **kwargs)
        monkeypatch.setattr(module, name, spy)
    runner = dsv4lab.load(tiny_path, device=device, backend="triton", max_batch=3, max_seq_len=320)
    a = runner.args
    g = torch.Generator().manual_seed(33)
    positions = torch.tensor([298, 170], device=device)  # no block completes: the caches are only read
    slots = torch.tensor([2, 0], device=device)
    layers = [blk for blk in runner.model.layers if blk.attn.ratio in (4, 16)][:2]
    assert sorted(blk.attn.ratio for blk in layers) == [4, 16]
    for blk in layers:
        at = blk.attn
        for cache, fp4 in ((at.ikv, True), (at.ckv, False)):
            if cache is None:
                continue
            cache.fill_(float("nan"))
            ratio = 4 if fp4 else at.ratio
            for s, p in zip(slots.tolist(), positions.tolist()):
                n = (p + 1) // ratio
                v = torch.randn(n, cache.shape[-1], generator=g)
                cache[s, :n] = (quant.fp4_qdq(v, 32) if fp4 else v).to(cache)
        at.win_kv.copy_(torch.randn(at.win_kv.shape, generator=g))
    x = torch.randn(2, 1, a.dim, generator=g).to(device, torch.bfloat16)
    forced = replace(INTERPRETER_DEFAULTS, indexer_split=dict(split=16, block_t=16, block_e=8),
                     attention_split=dict(chunk=16, block_r=16, combine_block=2))
    runs = {}
    for name, dispatch in (("today", Dispatch(Tuned(), INTERPRETER_DEFAULTS)), ("split", Dispatch(Tuned(), forced))):
        ops = _Recording(NM, dispatch)
        runner.ops = ops
        step = StaticDecodeStep(runner)
        launched.clear()
        outs = [step._attention(blk.attn, x, step._rows(positions[:, None], slots)) for blk in layers]
        runs[name] = (outs, ops.selections, ops.attention)
        assert launched == (["indexer_select", "sparse_attention_decode", "sparse_attention_decode"] if name == "today"
                            else ["indexer_select_split", "sparse_attention_split", "sparse_attention_split"]), launched
    (today, sel_today, att_today), (split, sel_split, att_split) = runs["today"], runs["split"]
    assert len(sel_split) == 1 and all(torch.equal(s, t) for s, t in zip(sel_split, sel_today))
    assert len(att_split) == 2
    ref = ReferenceOps(NM)
    for (args, kwargs, out), (_, _, out_today) in zip(att_split, att_today):
        want = ref.attention_from_caches(*args, **kwargs)
        expect = attention_from_caches_split(NM, default_accumulation(out.device), *args, **kwargs, chunk=16,
                                             block_r=16)
        _judge("split-KV at the step's attention site", out, want, [expect])
        assert torch.isfinite(out.float()).all()
    for got, want in zip(split, today):
        rel = float((got.float() - want.float()).norm() / want.float().norm())
        assert rel < 2e-2, f"the site's output moved by {rel:.2e} (relative) with the split kernels"


class _Recording:
    """A :class:`TritonOps` on a given dispatch that keeps the indexer's picks and the attention calls (arguments,
    output) of a step, and checks that the long-context kernels ran where the dispatch chose them."""

    def __new__(cls, numerics, dispatch):
        from dsv4lab.engine.triton_backend import TritonOps

        class Ops(TritonOps):
            def indexer_select_decode(self, *args, **kwargs):
                out = super().indexer_select_decode(*args, **kwargs)
                self.selections.append(out.clone())
                return out

            def attention_from_caches(self, *args, **kwargs):
                out = super().attention_from_caches(*args, **kwargs)
                self.attention.append((tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args),
                                       dict(kwargs), out.clone()))
                return out

        ops = Ops(numerics, dispatch)
        ops.selections, ops.attention = [], []
        return ops


# ============================================================================================ the benchmark
def test_decode_suite_checks_and_sweeps_the_long_context_kernels(monkeypatch):
    """The ``attention`` section's context sweep on the smoke shapes (the interpreter here: its times mean
    nothing): every long-context variant checked first (the selection equal to the fused kernel's and exact given
    its scores; the split-KV attention within its own bound), then timed beside today's kernels per context."""
    from dsv4lab.tools.bench.decode import long_context as lc
    from dsv4lab.tools.bench.decode.harness import DecodeBench
    monkeypatch.setattr(lc, "SMOKE_CONTEXTS", (128,))
    b = DecodeBench(torch.device(DEV), 600.0, smoke=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    passed = lc.check_long_context(b, TINY, gen)
    assert passed == {"indexer_split:s16", "attn_split:h16r16c16:hca", "attn_split:h16r16c16:csa"}, b.errors
    assert all(c["ok"] for c in b.checks) and len(b.checks) == 3
    lc.bench_long_context(b, TINY, gen, passed, (1,))
    assert not b.errors
    got = {(r["kernel"], r["variant"], r["route"], r["entries"]) for r in b.rows}
    assert got == {("indexer_ctx128", "today", "today", 32), ("indexer_ctx128", "s16", "split", 32),
                   ("attn_hca_ctx128", "today", "today", 33), ("attn_hca_ctx128", "h16r16c16", "split", 33),
                   ("attn_csa_ctx128", "today", "today", 48), ("attn_csa_ctx128", "h16r16c16", "split", 48)}


def test_the_sweep_writes_a_long_context_choice_only_where_it_won():
    """From the sweep's rows: per batch the variant with the least summed time, chosen from the fewest entries at
    which it wins at every longer context (here from 4,096 keys: it lost at 1,024), else an entry naming today's
    kernel; the dispatch reads them back."""
    from dsv4lab.tools.bench.tuned import decode_entries, tuned_doc

    def row(kernel, variant, batch, us, entries, route="split", **geo):
        return dict(kernel=kernel, variant=variant, batch=batch, time_us=us, entries=entries, route=route,
                    geometry_fields=geo or None)
    rows = [row("indexer_ctx4096", "today", 1, 15.0, 1024, "today"), row("indexer_ctx16384", "today", 1, 60.0, 4096,
                                                                         "today"),
            row("indexer_ctx65536", "today", 1, 220.0, 16384, "today"),
            row("indexer_ctx4096", "s512", 1, 18.0, 1024, split=512), row("indexer_ctx16384", "s512", 1, 12.0, 4096,
                                                                          split=512),
            row("indexer_ctx65536", "s512", 1, 20.0, 16384, split=512),
            row("indexer_ctx65536", "s1024", 1, 25.0, 16384, split=1024),
            row("indexer_ctx65536", "today", 8, 300.0, 16384, "today"),
            row("indexer_ctx65536", "s512", 8, 320.0, 16384, split=512),
            # HCA and CSA list 640 rows each after 65,536 tokens: summed at that count
            row("attn_hca_ctx65536", "today", 1, 13.0, 640, "today"), row("attn_csa_ctx65536", "today", 1, 13.0, 640,
                                                                           "today"),
            row("attn_hca_ctx65536", "h16r32c32", 1, 9.0, 640, chunk=32), row("attn_csa_ctx65536", "h16r32c32", 1,
                                                                              10.0, 640, chunk=32),
            row("attn_hca_ctx4096", "today", 1, 8.0, 160, "today"), row("attn_hca_ctx4096", "h16r32c32", 1, 7.0, 160,
                                                                          chunk=32)]
    doc = dict(gpu="NVIDIA H200", commit="abc", rows=rows)
    ops = decode_entries(doc, {}, "abc/decode")
    assert [(e["rows"], e["choice"]) for e in ops["decode.indexer"]] == [
        (1, dict(kernel="split", min_entries=4096, split=512)), (8, dict(kernel="fused"))]
    assert [e["choice"] for e in ops["decode.attention_split"]] == [dict(kernel="split", min_entries=160, chunk=32)]
    d = Dispatch(Tuned(tuned_doc("NVIDIA H200", {"abc/decode": {}}, ops)), GPU_DEFAULTS)
    assert d.indexer(1, 16394).fields == dict(split=512) and d.indexer(1, 1100) is None and d.indexer(8, 16394) is None
    assert d.attention_split(1, 640).fields == dict(chunk=32)
