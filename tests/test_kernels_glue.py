"""The fused glue kernels of the decode step (issue 17) against the reference compositions of
:class:`~dsv4lab.core.model.ops.ReferenceOps` they replace: mHC pre/post (mix, Sinkhorn, RMSNorm), RMSNorm, the query's
head-RMS + RoPE, the KV row (norm, RoPE, FP8, ring write), the indexer's queries (RoPE, Hadamard, FP4), the
compressor step (ring, pooling, entry), the router, the indexer's scores + top-k, the attention's inverse-RoPE
epilogue.

Each kernel evaluates the reference's formula with its rounding points (fp64 where the reference reduces in fp64):
under the interpreter, where its fp64 arithmetic is numpy's, the outputs must be **bit-identical**; on a GPU (the
same tests, ``gpu``-marked variants at Flash widths) they must be within the per-op bound derived in each kernel
module's docstring (:mod:`dsv4lab.tools.verify.bounds`). Inputs are random (never zeros), shapes irregular, the memory
past every input NaN-poisoned, unwritten cache rows NaN.
"""
from __future__ import annotations

from dataclasses import replace

import re

import pytest
import torch

from dsv4lab.core import quant
from dsv4lab.core.config import get_preset
from dsv4lab.core.model.compressor import Compressor
from dsv4lab.core.model.moe import Gate
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.core.model.rope import rope_table
from dsv4lab.tools.verify.bounds import check_within_bound

pytest.importorskip("triton")
mhc = pytest.importorskip("dsv4lab_kernels.mhc")
nrq = pytest.importorskip("dsv4lab_kernels.norm_rope_quant")
cmpd = pytest.importorskip("dsv4lab_kernels.compressor_decode")
router = pytest.importorskip("dsv4lab_kernels.router")
ixd = pytest.importorskip("dsv4lab_kernels.indexer_decode")
attn = pytest.importorskip("dsv4lab_kernels.attention_decode")
act = pytest.importorskip("dsv4lab_kernels.swiglu")

TINY = get_preset("tiny")
GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


def _ref(dtype=torch.bfloat16) -> ReferenceOps:
    return ReferenceOps(Numerics(dtype=dtype))


def _poisoned(t: torch.Tensor, extra: int = 64) -> torch.Tensor:
    """``t`` (moved to the test device) at the front of a buffer whose tail is NaN: a read past its end poisons."""
    buf = torch.full((t.numel() + extra,), float("nan"), dtype=t.dtype, device=DEV)
    buf[: t.numel()] = t.reshape(-1).to(DEV)
    return buf[: t.numel()].view(t.shape)


def _tables(layer: int = 1, n: int = 512):
    cos, sin = rope_table(TINY, layer, n)
    return cos.to(DEV), sin.to(DEV)


def assert_bound(name: str, out: torch.Tensor, ref: torch.Tensor, *, out_dtype, ulps: float = 1.0,
                 magnitude=0.0, terms: int = 1, acc_dtype=torch.float32):
    """Within the op's bound everywhere; bit-identical under the interpreter (the same fp64 arithmetic as torch)."""
    res = check_within_bound(out.cpu(), ref.cpu(), magnitude, terms=terms, acc_dtype=acc_dtype, out_dtype=out_dtype,
                             ulps=ulps, name=name)
    assert res.ok, res.line()
    if not GPU:
        same = torch.equal(out.cpu(), ref.cpu()) or bool(((out.cpu() == ref.cpu()) | (out.cpu().isnan()
                                                                                      & ref.cpu().isnan())).all())
        assert same, f"{name}: not bit-identical under the interpreter ({res.line()})"


def quant_step(ref: torch.Tensor, block: int, fmt: str) -> torch.Tensor:
    """The largest grid step of a quantization round trip at each element of ``ref`` (float64): where a value one
    ulp away from the reference's falls on the other side of a grid midpoint, the round trip moves by one step.
    E4M3 (per ``block``, scale ``s ≤ 2·amax/448``): a step is at most ``2^-3·|v|``, and ``2^-9·s`` among the
    subnormals; E2M1 (scale ``s ≤ 2·amax/6``): at most ``|v|/2``, and ``s/2`` below 1."""
    r = ref.double().nan_to_num()
    blocks = r.reshape(*r.shape[:-1], -1, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    if fmt == "e4m3":
        step = 2 ** -3 * blocks.abs() + 2 ** -9 * 2 * amax / 448
    else:
        step = 0.5 * blocks.abs() + 0.5 * 2 * amax / 6
    return step.reshape(r.shape)


def _norm_w(n: int, g) -> torch.Tensor:
    return (1 + 0.1 * torch.randn(n, generator=g)).to(DEV)


# ------------------------------------------------------------------------------------------ norms and rotations
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm(dtype):
    g = torch.Generator().manual_seed(0)
    x = _poisoned((torch.randn(7, 192, generator=g) * 3).to(dtype))
    w = _norm_w(192, g)
    ref = _ref(dtype).rms_norm(x.cpu(), w.cpu(), 1e-6)
    # one rounding of an fp32 value computed as the reference computes it: 1 ulp of the output dtype
    assert_bound("rms_norm", nrq.rms_norm(x, w, 1e-6), ref, out_dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_head_rms_rope(dtype):
    g = torch.Generator().manual_seed(1)
    cos, sin = _tables()
    q = _poisoned(torch.randn(3, 2, 5, 96, generator=g).to(dtype))  # [b, s, H, d], 5 heads (a partial block)
    pos = torch.randint(0, 512, (3, 2), generator=g).to(DEV)
    ref = _ref(dtype).head_rms_rope(q.cpu(), cos.cpu(), sin.cpu(), pos.cpu(), 1e-6)
    # IEEE operations only (exact squares, an exact fp64 sum, sqrt, division, the separately rounded rotation):
    # identical up to the last rounding, 1 ulp of the output
    assert_bound("head_rms_rope", nrq.head_rms_rope(q, cos, sin, pos, 1e-6), ref, out_dtype=dtype)


@pytest.mark.parametrize("D,nope,fp8", [(96, 64, True), (192, 128, True), (192, 128, False)])
def test_kv_norm_rope_and_ring_write(D, nope, fp8):
    g = torch.Generator().manual_seed(D + fp8)
    cos, sin = rope_table(TINY.replace(head_dim=D, rope_head_dim=D - nope), 1, 300)
    cos, sin = cos.to(DEV), sin.to(DEV)
    kv = _poisoned((torch.randn(3, 1, D, generator=g) * 2).to(torch.bfloat16))
    w = _norm_w(D, g)
    pos = torch.tensor([[5], [299], [40]], device=DEV)
    slots = torch.tensor([2, 0, 3], device=DEV)
    ring = torch.full((5, 32, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    ring_ref = ring.cpu().clone()
    ops = ReferenceOps(Numerics(kv_fp8_sim=fp8))
    ref = ops.kv_norm_rope(kv.cpu(), w.cpu(), 1e-6, cos.cpu(), sin.cpu(), pos.cpu(), ring_ref, slots.cpu())
    out = nrq.kv_norm_rope(kv, w, 1e-6, cos, sin, pos, nope, fp8, ring, slots)
    # one bf16 ulp of the normed value, or one E4M3 step of its 64-block where that ulp crosses a midpoint
    mag = torch.zeros_like(ref, dtype=torch.float64)
    if fp8:
        mag[..., :nope] = quant_step(ref[..., :nope], 64, "e4m3")
    # (terms=2^23 with fp32's unit roundoff makes γ = 1: the magnitude is the allowance itself)
    assert_bound("kv_norm_rope", out, ref, out_dtype=torch.bfloat16, magnitude=mag, terms=1 << 23)
    assert_bound("window ring", ring, ring_ref, out_dtype=torch.bfloat16)
    assert torch.isnan(ring[1].float()).all() and torch.isnan(ring[4].float()).all()  # untouched slots


def test_index_tensors_given_as_strided_views_are_read_row_by_row():
    """The kernels read per-row positions and slots as ``ptr + row``: a view with stride 0 (one sequence's slot
    expanded over its T rows) must be made dense by the launcher, not read past its one element — on the H200 that
    read was an illegal address in the speculative cycle's graph warm-up."""
    D, nope = 96, 64
    g = torch.Generator().manual_seed(7)
    cos, sin = rope_table(TINY.replace(head_dim=D, rope_head_dim=D - nope), 1, 300)
    cos, sin = cos.to(DEV), sin.to(DEV)
    kv = (torch.randn(3, 1, D, generator=g) * 2).to(torch.bfloat16).to(DEV)
    w = _norm_w(D, g)
    pos = torch.tensor([[7], [8], [9]], device=DEV)
    one_slot = torch.tensor([4], device=DEV)[:, None].expand(1, 3).reshape(-1)  # [3], stride 0
    assert one_slot.stride() == (0,)
    rings = [torch.full((5, 32, D), float("nan"), dtype=torch.bfloat16, device=DEV) for _ in range(2)]
    a = nrq.kv_norm_rope(kv, w, 1e-6, cos, sin, pos, nope, True, rings[0], one_slot)
    b = nrq.kv_norm_rope(kv, w, 1e-6, cos, sin, pos, nope, True, rings[1], one_slot.contiguous())
    assert torch.equal(a, b) and torch.equal(rings[0].float().nan_to_num(7.0), rings[1].float().nan_to_num(7.0))
    assert not torch.isnan(rings[0][4, 7:10].float()).any() and torch.isnan(rings[0][:4].float()).all()


def test_a_step_of_several_tokens_of_one_sequence_has_dense_row_slots():
    from dsv4lab.engine.decode_graph import _StepRows
    rows = _StepRows(torch.tensor([[5, 6, 7]]), torch.tensor([2]), window=4, period=8)
    assert rows.slots.is_contiguous() and rows.slots.tolist() == [2, 2, 2] and rows.positions.is_contiguous()


@pytest.mark.parametrize("H,D", [(3, 64), (5, 128)])
def test_indexer_query(H, D):
    g = torch.Generator().manual_seed(H)
    cos, sin = _tables()
    qi = _poisoned(torch.randn(4, H, D, generator=g).to(torch.bfloat16))
    pos = torch.randint(0, 512, (4,), generator=g).to(DEV)
    ref = _ref().indexer_query(qi.cpu(), cos.cpu(), sin.cpu(), pos.cpu())
    out = nrq.indexer_query(qi, cos, sin, pos, True)
    # exact butterflies and one fp64 scaling, then the FP4 round trip: one E2M1 step (scale·0.5) where a rounded
    # value straddles a grid midpoint
    assert_bound("indexer_query", out, ref, out_dtype=torch.bfloat16, magnitude=quant_step(ref, 32, "e2m1"),
                 terms=1 << 23)


@pytest.mark.parametrize("dtype,weighted", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)])
def test_shared_expert_swiglu(dtype, weighted):
    g = torch.Generator().manual_seed(int(weighted))
    gate = (torch.randn(5, 200, generator=g) * 6).to(dtype)  # beyond the clamp at ±10 on a few
    up = (torch.randn(5, 200, generator=g) * 6).to(dtype)
    w = (torch.rand(5, 1, generator=g) + 0.1) if weighted else None
    ops = _ref(dtype)
    h = ops.swiglu(gate.float(), up.float(), 10.0, shared=True)
    ref = ((w * h) if weighted else h).to(dtype)
    out = act.swiglu(_poisoned(gate), _poisoned(up), 10.0, None if w is None else w.to(DEV))
    assert_bound("swiglu", out, ref, out_dtype=dtype)


# ------------------------------------------------------------------------------------------ mHC
def _mhc_inputs(rows: int, D: int, g, dtype=torch.bfloat16):
    a = TINY.replace(dim=D)
    X = _poisoned((torch.randn(rows, 1, a.hc_mult, D, generator=g) * 2).to(dtype))
    fn = _poisoned(torch.randn(a.mix_hc, a.hc_dim, generator=g) * a.hc_dim ** -0.5)
    base = (torch.randn(a.mix_hc, generator=g) * 0.5).to(DEV)
    scale = (torch.rand(3, generator=g) + 0.5).to(DEV)
    return a, X, fn, base, scale, _norm_w(D, g)


def _mhc_bounds(name, outs, refs, dtype):
    """post and comb: 1 fp32 ulp (fp64 sigmoids/Sinkhorn rounded once to fp32); the normed input x: two chained
    act roundings (u, then the norm of u) — 1 ulp, plus 2 ulps where u's own rounding straddled (the rare fp32
    boundary case, propagated through ``w·rsqrt(ms)``); X' 1 ulp."""
    for n, o, r in zip(("x", "post", "comb") if len(outs) == 3 else ("X'", "x", "post", "comb"), outs, refs):
        od = torch.float32 if n in ("post", "comb") else dtype
        assert_bound(f"{name}.{n}", o, r, out_dtype=od, ulps=3.0 if n == "x" else 1.0)


@pytest.mark.parametrize("rows,D,dtype", [(1, 256, torch.bfloat16), (3, 160, torch.bfloat16),
                                          (2, 96, torch.float32)])
def test_hc_pre_norm_post_and_head(rows, D, dtype):
    g = torch.Generator().manual_seed(rows * D)
    a, X, fn, base, scale, w = _mhc_inputs(rows, D, g, dtype)
    ops = _ref(dtype)
    cpu = lambda *t: [v.cpu() for v in t]  # noqa: E731
    ref = ops.hc_pre_norm(*cpu(X, fn, base, scale, w), a)
    out = mhc.hc_pre_norm(X, fn, base, scale, w, a.hc_sinkhorn_iters, a.norm_eps, a.hc_eps)
    _mhc_bounds("hc_pre_norm", out, ref, dtype)
    h = _poisoned((torch.randn(rows, 1, D, generator=g)).to(dtype))
    post, comb = ref[1].to(DEV), ref[2].to(DEV)
    ref2 = ops.hc_post_pre_norm(*cpu(h, X, post, comb, fn, base, scale, w), a)
    out2 = mhc.hc_post_pre_norm(h, X, post, comb, fn, base, scale, w, a.hc_sinkhorn_iters, a.norm_eps, a.hc_eps)
    _mhc_bounds("hc_post_pre_norm", out2, ref2, dtype)
    assert_bound("hc_post", mhc.hc_post(h, X, post, comb), ops.hc_post(*cpu(h, X, post, comb)), out_dtype=dtype)
    fh = _poisoned(torch.randn(a.hc_mult, a.hc_dim, generator=g) * a.hc_dim ** -0.5)
    ref_h = ops.hc_head(X.cpu(), fh.cpu(), base[:4].cpu(), scale[:1].cpu(), a)
    assert_bound("hc_head", mhc.hc_head(X, fh, base[:4], scale[:1], a.norm_eps, a.hc_eps), ref_h, out_dtype=dtype,
                 ulps=2.0)  # one fp32 ulp of pre may straddle the bf16 rounding of y: 1 + 1 ulps


def test_mhc_split_geometries_agree():
    """The mix's split over D and the row blocks change only the fp64 summation order: the same bits."""
    g = torch.Generator().manual_seed(7)
    a, X, fn, base, scale, w = _mhc_inputs(5, 160, g)
    outs = [mhc.hc_pre_norm(X, fn, base, scale, w, a.hc_sinkhorn_iters, a.norm_eps, a.hc_eps,
                            geometry=mhc.MhcGeometry(block_m=bm, block_d=bd, splits=sp))
            for bm, bd, sp in ((1, 32, 1), (2, 16, 3), (8, 64, 2))]
    for o in outs[1:]:
        assert all(torch.equal(u, v) for u, v in zip(o, outs[0]))


@pytest.mark.parametrize("rows", [1, 5])
def test_mhc_one_launch_site_equals_the_two_launch_pair(rows):
    """The decode form (one launch per site: every program mixes its columns, the last one to take a ticket
    finishes the row) against the prefill form (mix, then finish) over irregular D and uneven column splits: only
    the fp64 summation order of the partials differs, so the bits are the same — for pre, post+pre and the head; the
    ticket counters are left at zero, so a second launch (a graph replay) gives the same bits again."""
    g = torch.Generator().manual_seed(rows)
    a, X, fn, base, scale, w = _mhc_inputs(rows, 160, g)
    h = _poisoned(torch.randn(rows, 1, 160, generator=g).to(torch.bfloat16))
    it, ne, he = a.hc_sinkhorn_iters, a.norm_eps, a.hc_eps
    pair = mhc.MhcGeometry(block_m=2, block_d=32, splits=2)
    fh = _poisoned(torch.randn(a.hc_mult, a.hc_dim, generator=g) * a.hc_dim ** -0.5)
    want_pre = mhc.hc_pre_norm(X, fn, base, scale, w, it, ne, he, geometry=pair)
    want_post = mhc.hc_post_pre_norm(h, X, want_pre[1], want_pre[2], fn, base, scale, w, it, ne, he, geometry=pair)
    want_head = mhc.hc_head(X, fh, base[:4], scale[:1], ne, he, geometry=pair)
    for geo in (mhc.MhcSiteGeometry(splits=1, block_d=64, block_dn=256, num_warps=4),
                mhc.MhcSiteGeometry(splits=3, block_d=16, block_dn=64, num_warps=2),
                mhc.MhcSiteGeometry(splits=7, block_d=16, block_dn=32, num_warps=8),
                mhc.MhcSiteGeometry(splits=3, block_d=16, block_dn=64, split_tail=True)):  # one finisher here
        for _ in range(2):
            got = mhc.hc_pre_norm(X, fn, base, scale, w, it, ne, he, geometry=geo)
            assert all(torch.equal(u, v) for u, v in zip(got, want_pre)), geo
            got = mhc.hc_post_pre_norm(h, X, want_pre[1], want_pre[2], fn, base, scale, w, it, ne, he, geometry=geo)
            assert all(torch.equal(u, v) for u, v in zip(got, want_post)), geo
            assert torch.equal(mhc.hc_head(X, fh, base[:4], scale[:1], ne, he, geometry=geo), want_head), geo
        assert not mhc.site_counters(X.device, rows).any(), "a launch left a ticket counter non-zero"


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_gpu_mhc_site_split_tail_gives_the_same_bits(rows):
    """Two programs finishing a row — the Sinkhorn in the one before the last, which waits for the last ticket —
    against one finisher at Flash width: the same bits at every launch, the ticket counters back at zero after each
    (the interpreter cannot run it: its programs run one after another)."""
    g = torch.Generator().manual_seed(rows)
    a, X, fn, base, scale, w = _mhc_inputs(rows, 4096, g)
    h = _poisoned(torch.randn(rows, 1, 4096, generator=g).to(torch.bfloat16))
    it, ne, he = a.hc_sinkhorn_iters, a.norm_eps, a.hc_eps
    one = mhc.MhcSiteGeometry(splits=128, block_d=32)
    two = replace(one, split_tail=True)
    want_pre = mhc.hc_pre_norm(X, fn, base, scale, w, it, ne, he, geometry=one)
    want_post = mhc.hc_post_pre_norm(h, X, want_pre[1], want_pre[2], fn, base, scale, w, it, ne, he, geometry=one)
    for _ in range(3):
        got = mhc.hc_pre_norm(X, fn, base, scale, w, it, ne, he, geometry=two)
        assert all(torch.equal(u, v) for u, v in zip(got, want_pre))
        got = mhc.hc_post_pre_norm(h, X, want_pre[1], want_pre[2], fn, base, scale, w, it, ne, he, geometry=two)
        assert all(torch.equal(u, v) for u, v in zip(got, want_post))
        assert not mhc.site_counters(X.device, rows).any(), "a launch left a ticket counter non-zero"


# ------------------------------------------------------------------------------------------ compressor
@pytest.mark.parametrize("ratio,channels,indexer", [(4, 96, False), (4, 64, True), (16, 96, False)])
def test_compressor_step_over_block_boundaries(ratio, channels, indexer):
    """Consecutive decode steps of three rows (one starting a fresh sequence) across two block boundaries."""
    g = torch.Generator().manual_seed(ratio + channels)
    cos, sin = _tables()
    comp = Compressor(TINY, ratio, channels, indexer)
    comp._buffers["ape"] = torch.randn(ratio, comp.coff * channels, generator=g)
    comp.norm._buffers["weight"] = 1 + 0.1 * torch.randn(channels, generator=g)
    comp.allocate_state(4, torch.float32, "cpu")
    rows = 70 // ratio  # max_seq_len 70: the last partial block has no row
    cache = torch.full((4, rows, channels), float("nan"), dtype=torch.bfloat16)
    kv_ring, score_ring, cache_dev = comp.kv_ring.to(DEV), comp.score_ring.to(DEV), cache.to(DEV)
    ape, norm_w = comp.ape.to(DEV), comp.norm.weight.to(DEV)
    slots = torch.tensor([3, 0, 1])
    start = torch.tensor([0, 5, 70 - 2 * ratio - 2])
    ops = _ref()
    for step in range(2 * ratio + 2):
        pos = start + step
        kv = torch.randn(3, comp.coff * channels, generator=g) * 2
        sc = torch.randn(3, comp.coff * channels, generator=g)
        ops.compressor_step(comp, kv, sc, pos, slots, cache, cos.cpu(), sin.cpu())
        cmpd.compressor_step(_poisoned(kv), _poisoned(sc), ape, pos.to(DEV), slots.to(DEV), kv_ring, score_ring,
                             cache_dev, norm_w, cos, sin, ratio, comp.overlap, TINY.norm_eps, indexer, True)
    assert (~torch.isnan(cache.float())).any(-1).sum() >= 4  # entries were written
    assert_compressor_state(kv_ring, score_ring, cache_dev, comp, cache, rope_dims=2 * cos.shape[-1])


def compressor_entry_magnitude(ref_entries, rope_dims: int, indexer: bool) -> torch.Tensor:
    """The ``magnitude`` term of compressor cache entries (norm, rotation, then the quantization simulation): one
    step of each entry's quantization block — the indexer's e2m1 blocks of 32, else the e4m3 blocks of 64 of the
    non-rotated part — on top of the 1 ulp of the bf16 rounding."""
    if indexer:
        return quant_step(ref_entries, 32, "e2m1")
    mag = torch.zeros_like(ref_entries, dtype=torch.float64)
    nope = ref_entries.shape[-1] - rope_dims
    mag[..., :nope] = quant_step(ref_entries[..., :nope], 64, "e4m3")
    return mag


def assert_compressor_state(kv_ring, score_ring, entries, comp: Compressor, ref_entries, rope_dims: int) -> None:
    """The kernel's compressor state against the reference's (``comp``'s rings, ``ref_entries``): the rings bit for
    bit, the cache entries within :func:`compressor_entry_magnitude`'s bound."""
    mag = compressor_entry_magnitude(ref_entries, rope_dims, comp.is_indexer)
    assert_bound("compressor entries", entries, ref_entries, out_dtype=torch.bfloat16, magnitude=mag, terms=1 << 23)
    assert_bound("kv ring", kv_ring, comp.kv_ring, out_dtype=torch.float32, ulps=0)
    assert_bound("score ring", score_ring, comp.score_ring, out_dtype=torch.float32, ulps=0)


def test_compressor_step_ratio_128_pools_once_per_block():
    """HCA's 128-slot pooling, from a filled ring: the completing token writes the entry, the others only the ring."""
    g = torch.Generator().manual_seed(128)
    cos, sin = _tables(2, 700)
    comp = Compressor(TINY, 128, 96, False)
    comp._buffers["ape"] = torch.randn(128, 96, generator=g)
    comp.norm._buffers["weight"] = 1 + 0.1 * torch.randn(96, generator=g)
    comp.allocate_state(2, torch.float32, "cpu")
    comp.kv_ring.normal_(generator=g)
    comp.score_ring.normal_(generator=g)
    cache = torch.full((2, 5, 96), float("nan"), dtype=torch.bfloat16)
    dev_kv, dev_sc, cache_dev = comp.kv_ring.to(DEV), comp.score_ring.to(DEV), cache.to(DEV)
    for pos in ([127, 300], [200, 511]):
        kv, sc = torch.randn(2, 96, generator=g), torch.randn(2, 96, generator=g)
        p, s = torch.tensor(pos), torch.tensor([1, 0])
        _ref().compressor_step(comp, kv, sc, p, s, cache, cos.cpu(), sin.cpu())
        cmpd.compressor_step(kv.to(DEV), sc.to(DEV), comp.ape.to(DEV), p.to(DEV), s.to(DEV), dev_kv, dev_sc,
                             cache_dev, comp.norm.weight.to(DEV), cos, sin, 128, False, TINY.norm_eps, False, True)
    written = (~torch.isnan(cache.float())).any(-1)
    assert written.tolist() == [[False, False, False, True, False], [True, False, False, False, False]]
    mag = torch.zeros_like(cache, dtype=torch.float64)
    mag[..., :64] = quant_step(cache[..., :64], 64, "e4m3")
    assert_bound("HCA entries", cache_dev, cache, out_dtype=torch.bfloat16, magnitude=mag, terms=1 << 23)
    assert_bound("HCA ring", dev_kv, comp.kv_ring, out_dtype=torch.float32, ulps=0)


# ------------------------------------------------------------------------------------------ router
def _gate(E: int, k: int, hashed: bool, g) -> Gate:
    a = TINY.replace(n_routed_experts=E, n_activated_experts=k)
    gate = Gate(a, hashed)
    if hashed:
        gate._buffers["tid2eid"] = torch.randint(0, E, (a.vocab_size, k), generator=g)
    else:
        gate._buffers["bias"] = torch.randn(E, generator=g) * 0.1
    return gate


@pytest.mark.parametrize("E,k,hashed", [(16, 4, False), (256, 6, False), (72, 5, False), (16, 4, True)])
def test_router_topk(E, k, hashed):
    g = torch.Generator().manual_seed(E + k)
    gate = _gate(E, k, hashed, g)
    logits = torch.randn(9, E, generator=g) * 3
    logits[0, :4] = 30.0  # past softplus's threshold
    logits[1, :3] = -40.0  # log1p of a tiny exp
    logits[2, 5:9] = 1.25  # exact ties: the lower expert id wins
    ids = torch.randint(-3, TINY.vocab_size + 3, (9,), generator=g)  # out-of-range ids are clamped
    ref_idx, ref_w = _ref().router_topk(logits, gate, ids)
    idx, w = router.router_topk(_poisoned(logits), k, gate.args.route_scale, gate.args.score_func,
                                bias=None if hashed else gate.bias.to(DEV),
                                tid2eid=gate.tid2eid.to(DEV) if hashed else None, ids=ids.to(DEV))
    assert torch.equal(idx.cpu(), ref_idx)  # the scores are the reference's: the same picks, ties included
    assert_bound("router weights", w, ref_w, out_dtype=torch.float32, ulps=3.0)


# ------------------------------------------------------------------------------------------ indexer
@pytest.mark.parametrize("case", [dict(B=3, H=4, D=64, T=75, topk=16, p=[290, 10, 63]),
                                  dict(B=2, H=8, D=128, T=300, topk=40, p=[1199, 300]),
                                  dict(B=2, H=4, D=64, T=20, topk=16, p=[2, 79]),
                                  dict(B=1, H=4, D=64, T=75, topk=16, p=[290], dtype=torch.float32),
                                  # the selection streaming its scores (more than it holds at once) …
                                  dict(B=2, H=8, D=128, T=300, topk=40, p=[1199, 300], block_t=64, block_sel=64),
                                  # … and a row with fewer picks than the small sort's width beside a full one
                                  dict(B=2, H=4, D=64, T=300, topk=100, p=[30, 1199])],
                         ids=lambda c: "B{B}H{H}D{D}T{T}k{topk}".format(**c) + c.get("dtype", torch.bfloat16).__str__()
                         + ("-stream" if "block_sel" in c else ""))
def test_indexer_select_scores_and_topk(case):
    """Scores of the visible keys only (the rest are NaN and never read), the top-k with ties (duplicated keys) to
    the lower entry, −1 past the visible count, and a second launch (the arrival counters were reset); the
    selection in registers and streamed, the picks sorted in the small network and the full one."""
    dtype = case.get("dtype", torch.bfloat16)
    g = torch.Generator().manual_seed(case["T"])
    B, H, D, T = case["B"], case["H"], case["D"], case["T"]
    qi = quant.fp4_qdq(torch.randn(B, H, D, generator=g), 32).to(dtype)
    w = torch.randn(B, H, generator=g).to(dtype)
    keys = torch.full((4, T, D), float("nan"), dtype=dtype)
    slots, pos = torch.tensor([3, 0, 1][:B]), torch.tensor(case["p"])
    for i in range(B):
        n = min((case["p"][i] + 1) // 4, T)
        keys[slots[i], :n] = quant.fp4_qdq(torch.randn(n, D, generator=g), 32).to(dtype)
    keys[slots[0], 5] = keys[slots[0], 9] = keys[slots[0], 2]  # tied scores
    ops = _ref(dtype)
    scale = TINY.index_scale  # the head weights' scale, applied (and rounded to act) inside the op
    ref = ops.indexer_select_decode(qi, w, keys, slots, pos, case["topk"], w_scale=scale)
    ref_scores = ops.indexer_scores(qi[:, None], (w * scale)[:, None], keys[slots])[:, 0].float()
    args = (_poisoned(qi), _poisoned(w), keys.to(DEV), slots.to(DEV), pos.to(DEV), case["topk"])
    for _ in range(2):
        sel, scores = ixd.indexer_select(*args, w_scale=scale, return_scores=True, block_t=case.get("block_t"),
                                         block_sel=case.get("block_sel"))
        visible = torch.arange(T)[None, :] < ((pos + 1) // 4)[:, None]
        got = torch.where(visible, scores.cpu(), float("nan"))
        want = torch.where(visible, ref_scores, float("nan"))
        assert_bound("indexer scores", got, want, out_dtype=dtype)
        # the selection is exact given the scores
        assert torch.equal(sel.cpu(), ops.indexer_topk(got.to(dtype)[:, None], pos[:, None], 4, case["topk"])[:, 0])
        if not GPU:
            assert torch.equal(sel.cpu(), ref)


# ------------------------------------------------------------------------------------------ attention epilogue
@pytest.mark.parametrize("splits,columns", [(1, 0), (3, 0), (3, 32), (5, 16)])
def test_attention_epilogue_is_the_reference_inverse_rope(splits, columns):
    """The inverse RoPE in the attention kernel's epilogue (the single-slice store and the split combine, whole rows
    or column blocks — 32 and 16 columns put the rotated dims across several blocks) equals the reference's
    ``rope(..., inverse=True)`` of the kernel's own rounded output, bit for bit (the attention itself is checked
    against the reference in tests/test_kernels_decode.py)."""
    g = torch.Generator().manual_seed(splits)
    b, H, d, W, C = 3, 8, 96, 32, 20
    cos, sin = _tables()
    q = torch.randn(b, H, d, generator=g).to(torch.bfloat16)
    win = torch.randn(4, W, d, generator=g).to(torch.bfloat16)
    cmp = torch.full((4, C, d), float("nan")).to(torch.bfloat16)
    cmp[:, :12] = torch.randn(4, 12, d, generator=g).to(torch.bfloat16)
    slots = torch.tensor([2, 0, 3])
    pos = torch.tensor([5, 40, 300])
    u = pos[:, None] - W + 1 + torch.arange(W)
    win_rows = torch.where(u >= 0, u % W, -1)
    cmp_rows = torch.where(torch.arange(C)[None, :] < torch.tensor([[1], [12], [7]]), torch.arange(C)[None, :], -1)
    sink = torch.randn(H, generator=g)
    geo = attn.AttentionGeometry(block_h=8, block_r=16, splits=splits, two_pass=splits == 1, combine_columns=columns)
    args = (q.to(DEV), win.to(DEV), win_rows.to(DEV), slots.to(DEV), sink.to(DEV), d ** -0.5)
    kw = dict(kv_b=cmp.to(DEV), rows_b=cmp_rows.to(DEV), batch_b=slots.to(DEV), geometry=geo)
    plain = attn.sparse_attention_decode(*args, **kw)
    if columns:  # column blocks of the combine: the same sums per column as whole rows
        whole = attn.sparse_attention_decode(*args, **kw | dict(geometry=replace(geo, combine_columns=0)))
        assert torch.equal(plain, whole)
    rotated = attn.sparse_attention_decode(*args, **kw, cos=cos, sin=sin, positions=pos.to(DEV))
    want = _ref().rope(plain.cpu(), cos.cpu()[pos][:, None], sin.cpu()[pos][:, None], inverse=True)
    assert_bound("attention epilogue", rotated, want, out_dtype=torch.bfloat16)
    assert torch.isfinite(rotated.float()).all()  # the NaN rows past each visible prefix were never read


@pytest.mark.parametrize("splits", [1, 3])
def test_attention_skips_the_invisible_compressed_rows(splits):
    """With ``prefix_ratio_b`` the kernel visits only each row's first ``(p+1)//r`` compressed entries (the rest are
    −1: CSA's picks come sorted, HCA's completed entries are a prefix); NaN past them stays unread. One slice: the
    same rows in the same order, so the same bits; split slices move only the rounding of P (the attention bound)."""
    from dsv4lab.tools.verify.compare import compare, tolerance
    g = torch.Generator().manual_seed(10 + splits)
    b, H, d, W, C, r = 3, 8, 96, 32, 40, 16
    q = torch.randn(b, H, d, generator=g).to(torch.bfloat16)
    win = torch.randn(4, W, d, generator=g).to(torch.bfloat16)
    pos = torch.tensor([15, 100, 639])
    vis = (pos + 1) // r
    cmp = torch.full((4, C, d), float("nan")).to(torch.bfloat16)
    slots = torch.tensor([2, 0, 3])
    for i in range(b):
        cmp[slots[i], :vis[i]] = torch.randn(int(vis[i]), d, generator=g).to(torch.bfloat16)
    u = pos[:, None] - W + 1 + torch.arange(W)
    win_rows = torch.where(u >= 0, u % W, -1)
    cmp_rows = torch.where(torch.arange(C)[None, :] < vis[:, None], torch.arange(C)[None, :], -1)
    sink = torch.randn(H, generator=g)
    geo = attn.AttentionGeometry(block_h=8, block_r=16, splits=splits, two_pass=splits == 1)
    args = (q.to(DEV), win.to(DEV), win_rows.to(DEV), slots.to(DEV), sink.to(DEV), d ** -0.5)
    kw = dict(kv_b=cmp.to(DEV), rows_b=cmp_rows.to(DEV), batch_b=slots.to(DEV), geometry=geo,
              positions=pos.to(DEV))
    full = attn.sparse_attention_decode(*args, **kw)
    skip = attn.sparse_attention_decode(*args, **kw, prefix_ratio_b=r)
    assert torch.isfinite(skip.float()).all()
    if splits == 1:
        assert torch.equal(skip, full)
    ref = _ref().attention_from_caches(q, win, win_rows, cmp, cmp_rows, slots, sink, d ** -0.5)
    c = compare("attention, invisible rows skipped", skip.cpu(), ref, tolerance(torch.bfloat16, "attention"))
    assert c.ok, c.line()


# ------------------------------------------------------------------------------------------ Flash widths
FLASH = get_preset("flash")


def _flash_case(name: str, g):
    """(kernel output, reference output, bound keywords) of one glue op at DeepSeek-V4-Flash widths, 2 rows."""
    a, b, bf = FLASH, 2, torch.bfloat16
    cos, sin = rope_table(a, 2, 4096)
    pos = torch.tensor([4095, 517])
    ops = _ref()
    if name == "hc_pre_norm":
        X = (torch.randn(b, 1, a.hc_mult, a.dim, generator=g) * 2).to(bf)
        fn = torch.randn(a.mix_hc, a.hc_dim, generator=g) * a.hc_dim ** -0.5
        base, scale, w = torch.randn(a.mix_hc, generator=g) * 0.5, torch.rand(3, generator=g) + 0.5, \
            1 + 0.1 * torch.randn(a.dim, generator=g)
        out = mhc.hc_pre_norm(*[t.to(DEV) for t in (X, fn, base, scale, w)], a.hc_sinkhorn_iters, a.norm_eps,
                              a.hc_eps)
        return out[0], ops.hc_pre_norm(X, fn, base, scale, w, a)[0], dict(ulps=3.0)
    if name == "head_rms_rope":
        q = torch.randn(b, 1, a.n_heads, a.head_dim, generator=g).to(bf)
        return (nrq.head_rms_rope(q.to(DEV), cos.to(DEV), sin.to(DEV), pos[:, None].to(DEV), a.norm_eps),
                ops.head_rms_rope(q, cos, sin, pos[:, None], a.norm_eps), {})
    if name == "kv_norm_rope":
        kv, w = torch.randn(b, 1, a.head_dim, generator=g).to(bf), 1 + 0.1 * torch.randn(a.head_dim, generator=g)
        ref = ops.kv_norm_rope(kv, w, a.norm_eps, cos, sin, pos[:, None])
        mag = torch.zeros_like(ref, dtype=torch.float64)
        mag[..., :a.nope_head_dim] = quant_step(ref[..., :a.nope_head_dim], 64, "e4m3")
        return (nrq.kv_norm_rope(kv.to(DEV), w.to(DEV), a.norm_eps, cos.to(DEV), sin.to(DEV), pos[:, None].to(DEV),
                                 a.nope_head_dim, True), ref, dict(magnitude=mag, terms=1 << 23))
    if name == "indexer_query":
        qi = torch.randn(b, 1, a.index_n_heads, a.index_head_dim, generator=g).to(bf)
        ref = ops.indexer_query(qi, cos, sin, pos[:, None])
        return (nrq.indexer_query(qi.to(DEV), cos.to(DEV), sin.to(DEV), pos[:, None].to(DEV), True), ref,
                dict(magnitude=quant_step(ref, 32, "e2m1"), terms=1 << 23))
    if name == "router_topk":
        gate = Gate(a, False)
        gate._buffers["bias"] = torch.randn(a.n_routed_experts, generator=g) * 0.1
        logits = torch.randn(b, a.n_routed_experts, generator=g) * 3
        idx, w = router.router_topk(logits.to(DEV), 6, a.route_scale, a.score_func, bias=gate.bias.to(DEV))
        ref_idx, ref_w = ops.router_topk(logits, gate, pos)
        assert torch.equal(idx.cpu(), ref_idx)
        return w, ref_w, dict(out_dtype=torch.float32, ulps=3.0)
    if name.startswith("compressor"):
        ratio, indexer = (4, False) if name == "compressor_csa" else (4, True) if name == "compressor_indexer" \
            else (128, False)
        ch = a.index_head_dim if indexer else a.head_dim
        comp = Compressor(a, ratio, ch, indexer)
        width = comp.coff * ch
        comp._buffers["ape"] = torch.randn(ratio, width, generator=g)
        comp.norm._buffers["weight"] = 1 + 0.1 * torch.randn(ch, generator=g)
        comp.allocate_state(3, torch.float32, "cpu")
        comp.kv_ring.normal_(generator=g)
        comp.score_ring.normal_(generator=g)
        cache = torch.full((3, 4096 // ratio, ch), float("nan"), dtype=bf)
        rings = (comp.kv_ring.to(DEV), comp.score_ring.to(DEV))
        cache_dev = cache.to(DEV)
        p = torch.tensor([4095, 511]) if ratio == 128 else torch.tensor([4095, 518])
        kv, sc = torch.randn(b, width, generator=g), torch.randn(b, width, generator=g)
        slots = torch.tensor([2, 0])
        ops.compressor_step(comp, kv, sc, p, slots, cache, cos, sin)
        cmpd.compressor_step(kv.to(DEV), sc.to(DEV), comp.ape.to(DEV), p.to(DEV), slots.to(DEV), *rings, cache_dev,
                             comp.norm.weight.to(DEV), cos.to(DEV), sin.to(DEV), ratio, ratio == 4, a.norm_eps,
                             indexer, True)
        assert (~torch.isnan(cache.float())).any(-1).sum() >= 1
        return cache_dev, cache, dict(magnitude=compressor_entry_magnitude(cache, a.rope_head_dim, indexer),
                                      terms=1 << 23)
    if name == "indexer_select":
        T, H, D = 4096 // 4, a.index_n_heads, a.index_head_dim
        qi = quant.fp4_qdq(torch.randn(b, H, D, generator=g), 32).to(bf)
        w = torch.randn(b, H, generator=g).to(bf)
        keys = quant.fp4_qdq(torch.randn(3, T, D, generator=g), 32).to(bf)
        slots = torch.tensor([2, 0])
        sel, scores = ixd.indexer_select(qi.to(DEV), w.to(DEV), keys.to(DEV), slots.to(DEV), pos.to(DEV),
                                         a.index_topk, w_scale=a.index_scale, return_scores=True)
        # the selection is exact given the scores; the scores are checked against the reference's
        assert torch.equal(sel.cpu(), ops.indexer_topk(scores.cpu().to(bf)[:, None], pos[:, None], 4,
                                                        a.index_topk)[:, 0])
        if not GPU:
            assert torch.equal(sel.cpu(), ops.indexer_select_decode(qi, w, keys, slots, pos, a.index_topk,
                                                              w_scale=a.index_scale))
        ref = ops.indexer_scores(qi[:, None], (w * a.index_scale)[:, None], keys[slots])[:, 0].float()
        visible = torch.arange(T)[None, :] < ((pos + 1) // 4)[:, None]
        return (torch.where(visible, scores.cpu(), float("nan")), torch.where(visible, ref, float("nan")),
                dict(out_dtype=bf))
    raise KeyError(name)


@pytest.mark.parametrize("name", ["hc_pre_norm", "head_rms_rope", "kv_norm_rope", "indexer_query", "router_topk",
                                  "compressor_csa", "compressor_indexer", "compressor_hca", "indexer_select"])
def test_glue_at_flash_widths(name):
    """Each glue kernel at DeepSeek-V4-Flash widths (D 4096, 64 heads × 512, index 64 × 128, 256 experts, ratio
    128's 128-slot pooling, top-512 of 1,024 keys), positions deep in a 4,096-token context."""
    out, ref, kw = _flash_case(name, torch.Generator().manual_seed(17))
    kw.setdefault("out_dtype", torch.bfloat16)
    assert_bound(name, out, ref, **kw)


# ------------------------------------------------------------------------------------------ GPU compilers
@pytest.mark.slow
@pytest.mark.parametrize("target", ["cuda:90", "hip:gfx90a"])
def test_glue_kernels_compile_for_gpu_targets(target):
    """Every glue kernel, at Flash widths, through Triton's GPU compiler for the H200 and for the paper's MI250
    (``scripts/compile_glue_kernels.py``): what the interpreter accepts the GPU compilers must accept too. Without
    the register report, a second ptxas run per kernel that nothing here reads (11 of the 14 s of a warm run)."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(root / "scripts" / "compile_glue_kernels.py"), "--target", target,
                          "--no-registers"],
                         capture_output=True, text=True, env=env, cwd=root, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert out.stdout.count("ok ") >= 20


def test_the_sass_counter_names_every_parameter_of_each_kernel():
    """``scripts/kernel_sass.py --signatures``: each configuration the instruction counter compiles names every
    parameter of its kernel, in order (kernels that gained parameters had left its GEMV, mHC-site and attention
    configurations failing to compile, unnoticed outside CI)."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(root / "scripts" / "kernel_sass.py"), "--signatures"],
                         capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    named, total = re.match(r"(\d+) of (\d+) configurations", out.stdout.splitlines()[-1]).groups()
    assert named == total and int(total) >= 50, out.stdout[-2000:]


def test_device_probe_runs_once_per_device_and_records_why_not():
    """The once-per-process capability probes (cuBLAS block FP8, the mHC rows kernel, the inline-PTX decode): one
    run per device, a failure or an exception kept as the reason the fallback is taken."""
    from dsv4lab_kernels.rowops import DeviceProbe
    runs = []
    refusing = DeviceProbe(lambda dev: runs.append(dev) or "the product differs", ok_word="available")
    assert refusing.status("cpu") == "not probed"
    assert not refusing.works("cpu") and not refusing.works("cpu") and len(runs) == 1
    assert refusing.status("cpu") == "the product differs"
    crashing = DeviceProbe(lambda dev: 1 / 0)
    assert not crashing.works("cpu") and crashing.status("cpu").startswith("ZeroDivisionError")
    assert DeviceProbe(lambda dev: True, ok_word="available").works("cpu")


def _cli_in_process(args: list[str]) -> tuple[int, str, str]:
    """``dsv4lab ARGS`` through ``cli.main`` in this process (an exception escaping ``cli.main`` fails the test as a
    traceback would): exit status, stdout and stderr. For the refusals, and for the suites' smoke runs: in this
    process their kernels run in the interpreter as patched by conftest (the same values, less of the
    interpreter's overhead) and no second Python starts (~2 s); the JSON written is what is checked."""
    import contextlib
    import io

    from dsv4lab.faces import cli
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(args)
    return rc, out.getvalue(), err.getvalue()


def test_decode_suite_checks_and_times_the_mhc_site_and_its_parts(tmp_path):
    """``bench kernels --suite decode --sections mhc`` (the smoke shapes, on the interpreter here): the site kernel
    checked against the reference within its stated bound, then timed beside the parts of its time (one Sinkhorn
    iteration, the head collapse, the two-launch pair, an empty launch); no other section runs and (without a
    GPU) no tuned file is written. A misspelt section is refused naming it (in this process: a refusal needs
    no process of its own)."""
    import json

    out = tmp_path / "decode.json"
    rc, printed, logged = _cli_in_process(["bench", "kernels", "--suite", "decode", "--smoke", "--sections", "mhc",
                                           "--out", str(out)])
    assert rc == 0, printed + logged
    doc = json.loads(out.read_text())
    assert doc["sections"] == ["mhc"] and {row["kernel"] for row in doc["rows"]} == {"mhc_site"}
    assert {row["variant"] for row in doc["rows"]} == {"default", "sinkhorn_1_iteration", "head_collapse",
                                                       "mix_finish_pair", "empty_launch"}
    assert len(doc["checks"]) == 4 and all(c["ok"] for c in doc["checks"])
    assert not list(tmp_path.glob("tuned_*.json"))
    rc, _, err = _cli_in_process(["bench", "kernels", "--suite", "decode", "--smoke", "--sections", "mhc,glue",
                                  "--out", str(out)])
    assert rc == 2 and "Traceback" not in err, err
    assert "--sections 'mhc,glue': unknown glue; known: moe, gemv, mhc, attention, layer" in err


@pytest.mark.slow
def test_prefill_suite_glue_section_alone(tmp_path):
    """``bench kernels --suite prefill --sections glue`` (smoke shapes, the interpreter here, ~4 s): only the glue
    rows, the mHC rows kernel checked against the decode kernels and timed per named geometry, the choice naming
    the geometry; no MoE/GEMM/attention checks run. A misspelt section is refused naming the known ones (in this
    process)."""
    import json

    out = tmp_path / "prefill.json"
    cmd = ["bench", "kernels", "--suite", "prefill", "--smoke", "--out", str(out)]
    rc, printed, logged = _cli_in_process(cmd + ["--sections", "glue"])
    assert rc == 0, printed + logged
    doc = json.loads(out.read_text())
    assert doc["sections"] == ["glue"] and {row["kernel"] for row in doc["rows"]} == {"glue"}
    assert all(c["name"].startswith(("mhc_rows:", "rope")) for c in doc["checks"]) and doc["checks"]
    geo = doc["choices"]["mhc_rows_geometry"]
    assert {f"{op}:rows_kernel:{geo}" for op in ("hc_pre_norm", "hc_post_pre_norm", "hc_post")} <= {
        row["variant"] for row in doc["rows"]}
    rc, _, err = _cli_in_process(cmd + ["--sections", "glue,mhc"])
    assert rc == 2 and "Traceback" not in err, err
    assert "--sections 'glue,mhc': unknown mhc; known: moe, chunks, dense, glue, attention" in err
