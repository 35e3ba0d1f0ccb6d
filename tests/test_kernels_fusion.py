"""The decode step's fused paths (issue 33: fewer launches per layer) against the launches they replace, and the
greedy choice inside the step.

Each fusion computes what its launches computed, the same arithmetic in the same order, so under the interpreter
the fused result must equal the unfused one **bit for bit** (on a GPU the same tests, and the ``gpu`` ones at
Flash widths, must too: see each kernel's docstring for the one caveat, an fp64 transcendental evaluated in another
compilation unit). The unfused kernels are themselves checked against the reference compositions of
:class:`~dsv4lab.core.model.ops.ReferenceOps` (``test_kernels_glue.py``, ``test_kernels_moe_decode.py``,
``test_kernels_gemv.py``); here each fusion also runs as a backend op against its reference composition. Inputs are
random (never zeros), shapes irregular, memory past every input NaN-poisoned.
"""
from __future__ import annotations

import os

import pytest
import torch

from conftest import ROOT, poisoned_x
from dsv4lab.core.config import get_preset
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import NON_FINITE, ReferenceOps, greedy_ids

pytest.importorskip("triton")
greedy = pytest.importorskip("dsv4lab_kernels.greedy")
mhc = pytest.importorskip("dsv4lab_kernels.mhc")
moe = pytest.importorskip("dsv4lab_kernels.fp4_moe_decode")

from test_kernels_glue import DEV, _mhc_inputs, _poisoned  # noqa: E402
from test_kernels_moe_decode import LIMIT, moe_case  # noqa: E402

TINY = get_preset("tiny")


# ------------------------------------------------------------------------------------------ greedy
def test_greedy_kernel_is_torchs_argmax_with_the_finiteness_flag():
    """Ties inside and across blocks (the first index wins), a row of −inf, ±inf, NaN (torch takes the first NaN),
    an irregular vocabulary: the ids equal ``argmax`` and the reported ids :func:`greedy_ids`' exactly."""
    g = torch.Generator().manual_seed(0)
    V = 20011  # two blocks of the interpreter's 16,384 and a partial one
    x = torch.randn(10, V, generator=g)
    x[1, 5000] = x[1].max() + 1
    x[1, 19000] = x[1, 5000]  # a tie across blocks
    x[2, 7], x[2, 17000] = float("nan"), float("nan")
    x[3] = float("-inf")
    x[4, 100], x[4, 50] = float("inf"), float("inf")
    x[5, 3] = float("-inf")
    x[6] = x[6].round()  # ties everywhere
    x[7, V - 1] = 100.0  # the last element
    x[8, 9000] = float("nan")  # a NaN after the maximum
    x[9, 0] = x[9].max() + 1  # the first element
    ids, seen = greedy.greedy_ids(_poisoned(x))
    want, want_seen = greedy_ids(x)
    assert torch.equal(ids.cpu(), want) and torch.equal(seen.cpu(), want_seen), (ids, want, seen, want_seen)
    assert (seen.cpu() == NON_FINITE).sum() == 5
    assert torch.equal(greedy.greedy_ids(x[:, :97].to(torch.bfloat16))[0].cpu(), x[:, :97].to(torch.bfloat16).argmax(-1))


def test_the_engine_reads_the_same_greedy_contract():
    """``dsv4lab.engine.finite`` re-exports the reference's :func:`greedy_ids` (one definition of the contract)."""
    from dsv4lab.engine import finite
    assert finite.greedy_ids is greedy_ids and finite.NON_FINITE == NON_FINITE == greedy.NON_FINITE == -1


# ------------------------------------------------------------------------------------------ moe_site
def _moe_site_case(T: int, offset: int, n_local: int | None, S: int, seed: int):
    x, idx, w, bank = moe_case(T, E=10, k=3, D=160, I=96, seed=seed, offset=offset, n_local=n_local, device=DEV)
    g = torch.Generator().manual_seed(seed + 100)
    a, X, fn, base, scale, nw = _mhc_inputs(T, 160, g)
    pre = mhc.hc_pre_norm(X, fn, base, scale, nw, a.hc_sinkhorn_iters, a.norm_eps, a.hc_eps)
    shared = poisoned_x((torch.randn(S, T, 160, generator=g) * 0.5).to(torch.bfloat16).to(DEV))
    return x, idx, w, bank, a, X, fn, base, scale, nw, pre[1], pre[2], shared


@pytest.mark.parametrize("T,offset,n_local,S", [(1, 0, None, 1), (3, 0, None, 2), (4, 2, 6, 1)])
def test_moe_site_sums_the_moe_output_in_the_site_bit_for_bit(T, offset, n_local, S):
    """The routed slots and the shared outputs summed in the mHC site's prologue (``moe_site``) against the combine
    and output launches then the site: the same X', normed input, post and comb — also for a bank owning only some
    experts (its slots of other experts unread: ``routed_moe_slots`` leaves them unwritten) and two shared experts;
    the ticket counters are left at zero."""
    x, idx, w, bank, a, X, fn, base, scale, nw, post, comb, shared = _moe_site_case(T, offset, n_local, S, T + S)
    ex = moe.ExpertTensors.of(bank)
    geo = moe.MoeGeometry(block_n_up=32, block_n_down=64, block_k=128)
    it, ne, he = a.hc_sinkhorn_iters, a.norm_eps, a.hc_eps
    y = moe.routed_moe_decode(x, idx, w, ex, LIMIT, route="fma", geometry=geo)
    out = moe.moe_output(y, shared, torch.bfloat16)
    want = mhc.hc_post_pre_norm(out.view(T, 1, -1), X, post, comb, fn, base, scale, nw, it, ne, he)
    slots = moe.routed_moe_slots(x, idx, w, ex, LIMIT, route="fma", geometry=geo)
    parts = moe.MoeOutput(slots, idx, shared, ex.expert_offset, ex.n_experts)
    for geometry in (None, mhc.MhcSiteGeometry(splits=3, block_d=16, block_dn=64, num_warps=2)):
        got = mhc.hc_post_pre_norm(None, X, post, comb, fn, base, scale, nw, it, ne, he, geometry=geometry,
                                   moe=parts)
        for name, u, v in zip(("X'", "x", "post", "comb"), got, want):
            assert torch.equal(u, v), f"{name}: max |Δ| {(u.float() - v.float()).abs().max():.3g} ({geometry})"
    assert not mhc.site_counters(X.device, T).any()
    with pytest.raises(ValueError, match="not both"):
        mhc.hc_post_pre_norm(out, X, post, comb, fn, base, scale, nw, it, ne, he, moe=parts)
    with pytest.raises(ValueError, match="one-launch site only"):
        mhc.hc_post_pre_norm(None, X, post, comb, fn, base, scale, nw, it, ne, he, moe=parts,
                             geometry=mhc.MhcGeometry(block_m=1, block_d=32, splits=2))


# ------------------------------------------------------------------------------------------ through the backend
def _ops(fused: bool):
    """The interpreter's dispatch with every fused path on (its default) or a tuned entry turning them off."""
    from dsv4lab.engine.dispatch import INTERPRETER_DEFAULTS, Dispatch, Tuned
    from dsv4lab.engine.kernel_families import FUSION_NAMES
    from dsv4lab.engine.triton_backend import TritonOps
    from test_dispatch import _doc
    tuned = None if fused else Tuned(_doc(**{"decode.fusion": [dict(rows=64, choice={n: False
                                                                               for n in FUSION_NAMES})]}), "t.json")
    return TritonOps(Numerics(), Dispatch(tuned, INTERPRETER_DEFAULTS))


def test_the_backends_fused_moe_site_equals_its_three_ops():
    """``TritonOps.moe_post_pre_norm`` with ``moe_site`` on (one MoE launch pair fewer) against the same op with it
    off (routed experts, MoE output, mHC site: each on its own kernel), bit for bit; the calls say which ran."""
    T, S = 3, 1
    x, idx, w, bank, a, X, fn, base, scale, nw, post, comb, shared = _moe_site_case(T, 0, None, S, 7)
    outs = {}
    for fused in (True, False):
        ops = _ops(fused)
        outs[fused] = ops.moe_post_pre_norm(x, idx, w, bank, LIMIT, shared, X, post, comb, fn, base, scale, nw, a)
        assert (ops.calls.glue.get("moe_post_pre_norm", 0), ops.calls.glue.get("moe_output", 0)) == \
            ((1, 0) if fused else (0, 1)), ops.report()
        assert not ops.calls.reference, ops.report()
    for name, u, v in zip(("X'", "x", "post", "comb"), outs[True], outs[False]):
        assert torch.equal(u, v), f"{name}: max |Δ| {(u.float() - v.float()).abs().max():.3g}"


def test_the_backends_greedy_kernel_runs_where_the_dispatch_says():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 1000, generator=g)
    logits[1, 17] = float("inf")
    want = greedy_ids(logits)
    for fused in (True, False):
        ops = _ops(fused)
        got = ops.greedy(_poisoned(logits))
        assert all(torch.equal(u.cpu(), v) for u, v in zip(got, want))
        assert ops.calls.glue.get("greedy", 0) == int(fused) and not ops.calls.reference


# ------------------------------------------------------------------------------------------ attention_norms, query_heads
nrq = pytest.importorskip("dsv4lab_kernels.norm_rope_quant")


def _attention_rows(R: int, seed: int, q_dim: int = 200):
    """The query latent and window KV rows of ``R`` tokens (an irregular latent width), ragged positions, a ring
    of ``R + 1`` slots whose spare one is NaN, slots in shuffled order — every input at the front of NaN."""
    from test_kernels_glue import _tables
    g = torch.Generator().manual_seed(seed)
    cos, sin = _tables()
    d = TINY.head_dim
    q_a = _poisoned((torch.randn(R, 1, q_dim, generator=g) * 3).to(torch.bfloat16))
    kv = _poisoned((torch.randn(R, 1, d, generator=g) * 4).to(torch.bfloat16))
    q_w = _poisoned(1 + 0.1 * torch.randn(q_dim, generator=g))
    kv_w = _poisoned(1 + 0.1 * torch.randn(d, generator=g))
    pos = torch.randint(0, cos.shape[0], (R, 1), generator=g).to(DEV)
    ring = (torch.randn(R + 1, TINY.window_size, d, generator=g)).to(torch.bfloat16).to(DEV)
    ring[-1] = float("nan")
    slots = torch.randperm(R, generator=g).to(DEV)
    return q_a, q_w, kv, kv_w, cos, sin, pos, ring, slots


@pytest.mark.parametrize("R", [1, 3])
def test_attention_norms_is_its_two_launches_bit_for_bit(R):
    """q_norm and the window KV row (norm, RoPE, FP8 sim, ring write) in one grid against ``rms_norm`` and
    ``kv_norm_rope`` launched alone: the same outputs and the same ring, the spare slot untouched (NaN), in one
    launch instead of two; rows that disagree are refused."""
    from dsv4lab.tools.bench.e2e import count_launches
    q_a, q_w, kv, kv_w, cos, sin, pos, ring, slots = _attention_rows(R, 10 + R)
    nope = TINY.head_dim - 2 * cos.shape[-1]
    ring_alone, ring_fused = ring.clone(), ring.clone()
    want_q = nrq.rms_norm(q_a, q_w, 1e-6)
    want_kv = nrq.kv_norm_rope(kv, kv_w, 1e-6, cos, sin, pos, nope, True, ring_alone, slots)
    counts, (got_q, got_kv) = count_launches(
        lambda: nrq.attention_norms(q_a, q_w, kv, kv_w, 1e-6, cos, sin, pos, nope, True, ring_fused, slots))
    assert counts["triton"] == 1, counts
    assert torch.equal(got_q, want_q) and torch.equal(got_kv, want_kv)
    assert torch.equal(ring_fused.nan_to_num(7.0), ring_alone.nan_to_num(7.0)) and ring_fused[-1].isnan().all()
    with pytest.raises(AssertionError, match="rows"):
        nrq.attention_norms(q_a[:1], q_w, kv, kv_w, 1e-6, cos, sin, pos, nope, True, None, None) if R > 1 else \
            nrq.attention_norms(torch.cat([q_a, q_a]), q_w, kv, kv_w, 1e-6, cos, sin, pos, nope, True, None, None)


@pytest.mark.parametrize("R,H", [(1, 8), (3, 5)])
def test_query_heads_is_its_two_launches_bit_for_bit(R, H):
    """The query heads' RMS + RoPE and the indexer's RoPE, Hadamard, FP4 sim in one grid (an irregular head count:
    a partial head block) against ``head_rms_rope`` and ``indexer_query`` alone: the same bits, one launch."""
    from dsv4lab.tools.bench.e2e import count_launches
    from test_kernels_glue import _tables
    g = torch.Generator().manual_seed(R * H)
    cos, sin = _tables()
    q = _poisoned((torch.randn(R, 1, H, TINY.head_dim, generator=g) * 3).to(torch.bfloat16))
    qi = _poisoned((torch.randn(R, 1, TINY.index_n_heads, TINY.index_head_dim, generator=g) * 2).to(torch.bfloat16))
    pos = torch.randint(0, cos.shape[0], (R, 1), generator=g).to(DEV)
    want = nrq.head_rms_rope(q, cos, sin, pos, 1e-6), nrq.indexer_query(qi, cos, sin, pos, True)
    counts, got = count_launches(lambda: nrq.query_heads(q, qi, cos, sin, pos, 1e-6, True))
    assert counts["triton"] == 1, counts
    for name, u, v in zip(("q", "qi"), got, want):
        assert torch.equal(u, v), f"{name}: max |Δ| {(u.float() - v.float()).abs().max():.3g}"


def test_the_backends_fused_attention_glue_equals_its_parts():
    """``TritonOps.attention_norms`` and ``query_heads`` with their fused paths on (one launch each) against the
    same ops off (each part on its own kernel) and against the reference composition: the same bits (the glue
    kernels are bit-identical to the reference at these sizes), the calls say which ran."""
    from dsv4lab.tools.bench.e2e import count_launches
    q_a, q_w, kv, kv_w, cos, sin, pos, ring, slots = _attention_rows(2, 21, q_dim=TINY.q_lora_rank)
    g = torch.Generator().manual_seed(5)
    q = _poisoned((torch.randn(2, 1, 4, TINY.head_dim, generator=g) * 3).to(torch.bfloat16))
    qi = _poisoned((torch.randn(2, 1, TINY.index_n_heads, TINY.index_head_dim, generator=g)).to(torch.bfloat16))
    results, launches = {}, {}
    for name, ops in (("fused", _ops(True)), ("parts", _ops(False)), ("reference", ReferenceOps(Numerics()))):
        r = ring.clone()
        counts, out = count_launches(lambda: (ops.attention_norms(q_a, q_w, kv, kv_w, 1e-6, cos, sin, pos, r, slots),
                                              ops.query_heads(q, qi, cos, sin, pos, 1e-6)))
        results[name], launches[name] = (*out[0], r, *out[1]), counts["triton"]
        if name != "reference":
            assert not ops.calls.reference, ops.report()
            fused = ops.calls.glue.get("attention_norms", 0), ops.calls.glue.get("query_heads", 0)
            assert fused == ((1, 1) if name == "fused" else (0, 0)), ops.report()
    assert (launches["fused"], launches["parts"]) == (2, 4), launches
    for other in ("parts", "reference"):
        for i, (u, v) in enumerate(zip(results["fused"], results[other])):
            assert torch.equal(u.cpu().nan_to_num(7.0), v.cpu().nan_to_num(7.0)), f"output {i} against {other}"


# ------------------------------------------------------------------------------------------ shared_swiglu
gemv = pytest.importorskip("dsv4lab_kernels.fp8_gemv")
swiglu_kernels = pytest.importorskip("dsv4lab_kernels.swiglu")


@pytest.mark.parametrize("route,fmt,M,K,split,limit", [
    ("fma", "fp8", 1, 200, 2, 10.0), ("fma", "fp8", 3, 384, 1, 0.0), ("dot", "fp8", 5, 320, 3, 10.0),
    ("fma", "bf16", 2, 96, 1, 10.0), ("dot", "bf16", 1, 256, 2, 0.0)])
def test_shared_swiglu_in_the_down_projections_prologue_is_bit_for_bit(route, fmt, M, K, split, limit):
    """The shared expert's activation computed in the GEMV's prologue (``swiglu=(u, limit)``) against the
    activation's own launch then the GEMV, for both routes, FP8 and BF16 weights, clamped (limit > 0) or not,
    irregular K, split-K: the same bits from one launch instead of two. Gate and up sit at the front of NaN."""
    from dsv4lab.tools.bench.e2e import count_launches
    from dsv4lab.tools.verify.registry import make_linear
    g = torch.Generator().manual_seed(M * K + split)
    lin = make_linear(fmt, 160, K, g)
    gate = poisoned_x((torch.randn(M, K, generator=g) * 4).to(torch.bfloat16))
    up = poisoned_x((torch.randn(M, K, generator=g) * 4).to(torch.bfloat16))
    if limit:  # a few values beyond the clamp
        gate[0, :5], up[-1, -3:] = 12.0, -15.0
    geo = gemv.GemvGeometry(block_n=32, block_k=128, split_k=split)
    scale, aq = (lin.scale, True) if fmt == "fp8" else (None, False)
    h = swiglu_kernels.swiglu(gate, up, limit)
    want = gemv.fp8_gemv(h, lin.weight, scale, act_quant=aq, route=route, geometry=geo)
    counts, got = count_launches(lambda: gemv.fp8_gemv(gate, lin.weight, scale, act_quant=aq, route=route,
                                                       geometry=geo, swiglu=(up, limit)))
    assert counts["triton"] == 1, counts
    assert torch.equal(got, want), f"max |Δ| {(got.float() - want.float()).abs().max():.3g}"


def test_shared_swiglu_prologue_refuses_what_it_cannot_compute():
    from dsv4lab.tools.verify.registry import make_linear
    g = torch.Generator().manual_seed(0)
    lin = make_linear("fp8", 128, 256, g)
    x = torch.randn(2, 256, generator=g).to(torch.bfloat16)
    with pytest.raises(ValueError, match="prequant"):
        gemv.fp8_gemv(x, lin.weight, lin.scale, route="dot", geometry=gemv.GemvGeometry(prequant=True),
                      swiglu=(x, 10.0))
    with pytest.raises(ValueError, match="one shape and dtype"):
        gemv.fp8_gemv(x, lin.weight, lin.scale, swiglu=(x.float(), 10.0))
    with pytest.raises(ValueError, match="no segments"):
        gemv.fp8_gemv(x, lin.weight, lin.scale, swiglu=(x, 10.0), segments=(64, 64))


def test_the_backends_shared_expert_runs_its_activation_in_the_down_projection():
    """``TritonOps.expert_mlp`` (the shared expert at decode rows) with ``shared_swiglu`` on: one launch fewer than
    with it off, the same bits; with a tuned ``prequant`` geometry for the down projection the activation keeps
    its own launch (that route quantizes ``x`` in a kernel of its own)."""
    from dsv4lab.engine.decode_groups import group
    from dsv4lab.tools.bench.e2e import count_launches
    from dsv4lab.tools.verify.registry import make_linear
    g = torch.Generator().manual_seed(4)
    D, inter = 256, 128
    w1, w3, w2 = make_linear("fp8", inter, D, g), make_linear("fp8", inter, D, g), make_linear("fp8", D, inter, g)
    group((w1, w3))
    x = poisoned_x((torch.randn(2, 1, D, generator=g) * 3).to(torch.bfloat16))
    outs, launches = {}, {}
    for fused in (True, False):
        ops = _ops(fused)
        counts, outs[fused] = count_launches(lambda: ops.expert_mlp(x, w1, w2, w3, LIMIT, shared=True))
        launches[fused] = counts["triton_kernels"]
        assert not ops.calls.reference, ops.report()
    assert launches[False]["_swiglu_kernel"] == 1 and "_swiglu_kernel" not in launches[True], launches
    assert sum(launches[False].values()) - sum(launches[True].values()) == 1
    assert torch.equal(outs[True], outs[False])
    from dsv4lab.engine.dispatch import INTERPRETER_DEFAULTS, Dispatch, Tuned, shape_key
    from dsv4lab.engine.triton_backend import TritonOps
    from test_dispatch import _doc
    prequant = Tuned(_doc(**{"decode.gemv": [dict(shape=shape_key(D, inter, 1, "fp8", True), rows=2, choice=dict(
        impl="triton", route="dot", block_n=32, block_k=128, prequant=True))]}), "t.json")
    ops = TritonOps(Numerics(), Dispatch(prequant, INTERPRETER_DEFAULTS))
    counts, out = count_launches(lambda: ops.expert_mlp(x, w1, w2, w3, LIMIT, shared=True))
    assert counts["triton_kernels"]["_swiglu_kernel"] == 1 and counts["triton_kernels"]["_act_quant_kernel"] == 1
    assert not ops.calls.reference, ops.report()  # (that route's precision: test_kernels_gemv.py)


# ------------------------------------------------------------------------------------------ compressor_pair
cmp_decode = pytest.importorskip("dsv4lab_kernels.compressor_decode")


def _compressor_pair_case(positions, seed: int, tokens: int = 1):
    """A CSA layer's two compressors (indexer keys, main entries) with random rings and NaN-poisoned caches
    (``registry._make_compressor_pair``); with ``tokens > 1`` each row carries that many consecutive tokens."""
    from dsv4lab.tools.verify.registry import _make_compressor_pair
    g = torch.Generator().manual_seed(seed)
    ca, kva, sca, cache_a, cb, kvb, scb, cache_b, pos, slots, cos, sin = _make_compressor_pair(
        dict(ratio=4, positions=positions), g, DEV, Numerics())
    if tokens > 1:
        pos = pos[:, None] + torch.arange(tokens, device=DEV)[None, :]
        kva, sca, kvb, scb = (torch.randn(*t.shape[:1], tokens, t.shape[-1], generator=g).to(DEV) * 2
                              for t in (kva, sca, kvb, scb))
    return ca, kva, sca, cache_a, cb, kvb, scb, cache_b, pos, slots, cos, sin


def _call(comp, kv, score, positions, slots, cache, cos, sin):
    nm = Numerics()
    return cmp_decode.CompressorCall(kv, score, comp.ape, positions, slots, comp.kv_ring, comp.score_ring, cache,
                                     comp.norm.weight, cos, sin, comp.ratio, comp.overlap, comp.args.norm_eps,
                                     comp.is_indexer, nm.indexer_fp4_sim if comp.is_indexer else nm.kv_fp8_sim)


def _state(comp, cache):
    return [t.clone().nan_to_num(7.0) for t in (cache, comp.kv_ring, comp.score_ring)]


@pytest.mark.parametrize("positions,tokens", [([3, 10, 126], 1), ([5, 13], 3)])
def test_compressor_pair_is_its_two_steps_bit_for_bit(positions, tokens):
    """Both compressors of a CSA layer in one grid against :func:`compressor_step` of each: the same caches (rows
    of completed blocks written, NaN poison elsewhere kept) and rings, one launch; at one token per row and at
    three (a block completed mid-step)."""
    import copy
    from dsv4lab.tools.bench.e2e import count_launches
    ca, kva, sca, cache_a, cb, kvb, scb, cache_b, pos, slots, cos, sin = _compressor_pair_case(positions, tokens,
                                                                                               tokens)
    alone = [copy.deepcopy(x) for x in (ca, cache_a, cb, cache_b)]
    a_comp, a_cache, b_comp, b_cache = alone
    for comp, kv, sc, cache in ((a_comp, kva, sca, a_cache), (b_comp, kvb, scb, b_cache)):
        cmp_decode.compressor_step(*(getattr(_call(comp, kv, sc, pos, slots, cache, cos, sin), f)
                                     for f in cmp_decode.CompressorCall.__dataclass_fields__))
    counts, _ = count_launches(lambda: cmp_decode.compressor_pair(_call(ca, kva, sca, pos, slots, cache_a, cos, sin),
                                                                  _call(cb, kvb, scb, pos, slots, cache_b, cos, sin)))
    assert counts["triton"] == 1, counts
    for name, got, want in (("indexer", _state(ca, cache_a), _state(a_comp, a_cache)),
                            ("main", _state(cb, cache_b), _state(b_comp, b_cache))):
        for part, u, v in zip(("cache", "kv ring", "score ring"), got, want):
            assert torch.equal(u, v), f"{name} {part}: max |Δ| {(u - v).abs().max():.3g}"
    assert not torch.equal(_state(ca, cache_a)[0], torch.full_like(cache_a, 7.0))  # an entry was written


def test_the_backends_compressor_pair_equals_its_two_steps():
    """``TritonOps.compressor_pair`` with its fused path on (one launch) and off (two) against the reference
    composition: the same states."""
    import copy
    from dsv4lab.tools.bench.e2e import count_launches
    case = _compressor_pair_case([3, 10, 126], 9)
    outs, launches = {}, {}
    for name, ops in (("fused", _ops(True)), ("parts", _ops(False)), ("reference", ReferenceOps(Numerics()))):
        ca, kva, sca, cache_a, cb, kvb, scb, cache_b, pos, slots, cos, sin = copy.deepcopy(case)
        counts, _ = count_launches(lambda: ops.compressor_pair(ca, kva, sca, cache_a, cb, kvb, scb, cache_b, pos,
                                                               slots, cos, sin))
        outs[name], launches[name] = _state(ca, cache_a) + _state(cb, cache_b), counts["triton"]
        if name != "reference":
            assert not ops.calls.reference, ops.report()
            assert ops.calls.glue.get("compressor_pair", 0) == int(name == "fused"), ops.report()
    assert (launches["fused"], launches["parts"]) == (1, 2), launches
    for other in ("parts", "reference"):
        for i, (u, v) in enumerate(zip(outs["fused"], outs[other])):
            assert torch.equal(u.cpu(), v.cpu()), f"state {i} against {other}"


# ------------------------------------------------------------------------------------------ x_projections
def _projection_calls(M: int, K: int, seed: int):
    """An FP8 stacked pair (split-K with tickets), a BF16 group of four with fp32 outputs (split-K too), one BF16
    projection and one more FP8 one on the dot route: the keyword arguments of each ``fp8_gemv`` call, the input
    at the front of NaN."""
    from dsv4lab.tools.verify.registry import make_linear
    g = torch.Generator().manual_seed(seed)
    x = poisoned_x((torch.randn(M, K, generator=g) * 3).to(torch.bfloat16))
    qkv = [make_linear("fp8", n, K, g) for n in (256, 128)]
    comps = [make_linear("bf16", n, K, g) for n in (96, 96, 48, 48)]
    head_w, extra = make_linear("bf16", 40, K, g), make_linear("fp8", 72, K, g)
    geo = lambda **kw: gemv.GemvGeometry(**(dict(block_n=32, block_k=128) | kw))  # noqa: E731
    return [dict(x=x, weight=torch.cat([lin.weight for lin in qkv]), scale=torch.cat([lin.scale for lin in qkv]),
                 segments=(256, 128), geometry=geo(split_k=3)),
            dict(x=x, weight=torch.cat([lin.weight for lin in comps]), scale=None, act_quant=False,
                 out_dtype=torch.float32, segments=(96, 96, 48, 48), geometry=geo(block_n=16, split_k=2)),
            dict(x=x, weight=head_w.weight, scale=None, act_quant=False, geometry=geo(block_k=256)),
            dict(x=x, weight=extra.weight, scale=extra.scale, route="dot", geometry=geo(split_k=2))]


def _flat(results):
    return [t for r in results for t in (r if isinstance(r, tuple) else (r,))]


@pytest.mark.parametrize("M,K,jobs", [(1, 320, 4), (3, 200, 3), (2, 384, 2)])
def test_gemv_jobs_are_their_own_launches_bit_for_bit(M, K, jobs):
    """Two to four projections of one input in one launch (``fp8_gemv_jobs``: FP8 and BF16 weights, stacked
    segments, fp32 and bf16 outputs, split-K with each its own tickets, both routes) against each launched alone:
    the same bits, one launch, and the ticket counters left at zero."""
    from dsv4lab.tools.bench.e2e import count_launches
    from dsv4lab_kernels.tickets import counters
    calls = _projection_calls(M, K, M * K)[:jobs]
    want = _flat(gemv.fp8_gemv(**c) for c in calls)
    counts, got = count_launches(lambda: gemv.fp8_gemv_jobs([gemv.gemv_plan(**c) for c in calls]))
    assert counts["triton"] == 1, counts
    for i, (u, v) in enumerate(zip(_flat(got), want)):
        assert u.shape == v.shape and torch.equal(u, v), f"output {i}: max |Δ| {(u.float() - v.float()).abs().max():.3g}"
    assert not counters(torch.device(DEV), 1).any()


def test_each_gemv_job_reduces_in_the_register_layout_of_its_own_launch():
    """Compiled for sm_90 on this machine (no GPU): the CSA layer's three attention-input projections in one jobs
    launch sum their K tiles in the layouts they have alone, and the rows of an fma program of 2 or 4 rows in the
    one-row program's (``scripts/check_gemv_jobs_layouts.py``). Inlined, they did not — the BF16 tile took the FP8
    tile's 16-byte layout, another summation order: up to 1.9e-6 apart on the H100
    (``data/results/h100/diag_prefill_after_decode_f3de19f.json``) where the interpreter, one program at a time,
    saw the same bits."""
    import json
    import subprocess
    import sys
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_gemv_jobs_layouts.py"), "--rows", "1"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    report = json.loads(out.stdout) if out.stdout.startswith("{") else None
    assert report is not None, out.stderr[-2000:]
    case = report["cases"][0]
    assert len(case["alone"]) == 2, case  # the FP8 and the BF16 tiles want different layouts: the check can fail
    assert report["ok"] and out.returncode == 0, case
    # and GemvGeometry.fma_rows: each row of a several-row fma program sums K in the one-row program's layout
    assert len(report["fma_rows"]) == 3 and all(f["same"] for f in report["fma_rows"]), report["fma_rows"]


def test_gemv_jobs_refuse_what_one_launch_cannot_hold():
    calls = _projection_calls(1, 256, 0)
    plans = [gemv.gemv_plan(**c) for c in calls]
    with pytest.raises(ValueError, match="2 to 4"):
        gemv.fp8_gemv_jobs(plans[:1])
    with pytest.raises(ValueError, match="2 to 4"):
        gemv.fp8_gemv_jobs(plans + plans[:1])
    with pytest.raises(ValueError, match="num_warps"):
        gemv.fp8_gemv_jobs([plans[0], gemv.gemv_plan(**(calls[2] | dict(geometry=gemv.GemvGeometry(num_warps=8))))])
    with pytest.raises(ValueError, match="prequant"):
        gemv.fp8_gemv_jobs([plans[0], gemv.gemv_plan(**(calls[3] | dict(geometry=gemv.GemvGeometry(prequant=True))))])


def test_the_backends_attention_input_projections_in_one_launch():
    """``TritonOps.projections`` (the fused path ``x_projections``) with a stacked FP8 pair, a stacked BF16 group
    and a single projection: one launch, the same bits as the three ops launched one by one and as the unfused
    backend; an unstacked pair counts as two jobs; a tuned cuBLAS choice for one of them (or a prequant geometry)
    leaves every call on its own path."""
    from dsv4lab.engine.dispatch import INTERPRETER_DEFAULTS, Dispatch, Tuned, shape_key
    from dsv4lab.engine.triton_backend import TritonOps
    from dsv4lab.tools.bench.e2e import count_launches
    from dsv4lab.tools.verify.registry import _make_projections
    from test_dispatch import _doc
    x, calls = _make_projections(dict(b=2, D=256), torch.Generator().manual_seed(3), DEV, Numerics())
    outs, launches = {}, {}
    for name, ops in (("fused", _ops(True)), ("parts", _ops(False)), ("reference", ReferenceOps(Numerics()))):
        counts, outs[name] = count_launches(lambda: ops.projections(x, calls))
        launches[name] = counts["triton"]
        if name == "fused":
            assert ops.calls.glue["projections"] == 1 and ops.calls.decode["linear_group"] == 1, ops.report()
    assert (launches["fused"], launches["parts"]) == (1, 3), launches
    assert len(outs["fused"]) == 7 and all(torch.equal(u, v) for u, v in zip(outs["fused"], outs["parts"]))
    from dsv4lab.tools.verify.op_bounds import OP_BOUNDS, check_outputs
    checks = check_outputs(outs["fused"], outs["reference"], OP_BOUNDS["projections"](Numerics(), "fp32", x, calls),
                           [f"projections[{i}]" for i in range(7)])
    assert all(c.ok for c in checks), [c.line() for c in checks if not c.ok]  # against the reference: its bound
    unstacked = ((calls[0][0], tuple(make_copy(m) for m in calls[0][1])),) + calls[1:]
    counts, got = count_launches(lambda: _ops(True).projections(x, unstacked))
    assert counts["triton"] == 1 and all(torch.equal(u, v) for u, v in zip(got, outs["parts"]))
    head = calls[2][1]
    for key, choice in ((shape_key(head.out_features, 256, 1, "bf16", False), dict(impl="cublas")),
                        (shape_key(384, 256, 1, "fp8", True), dict(impl="triton", route="dot", prequant=True))):
        tuned = Tuned(_doc(**{"decode.gemv": [dict(shape=key, rows=2, choice=choice)]}), "t.json")
        if choice["impl"] == "cublas" and not torch.cuda.is_available():
            continue  # cuBLAS needs a GPU; the prequant case is the same refusal
        ops = TritonOps(Numerics(), Dispatch(tuned, INTERPRETER_DEFAULTS))
        counts, _ = count_launches(lambda: ops.projections(x, calls))
        assert "projections" not in ops.calls.glue and counts["triton"] >= 3, (choice, counts)


def make_copy(lin):
    """A copy of ``lin`` with its own weight storage (outside any stacked group)."""
    import copy
    c = copy.copy(lin)
    c._buffers = {k: (v.clone() if v is not None else None) for k, v in lin._buffers.items()}
    c.__dict__.pop("decode_group", None)
    return c


def test_the_backends_expert_down_is_expert_mlps_second_half():
    """``expert_down`` of the shared expert's gate and up outputs equals ``expert_mlp`` of its input on the
    backend (fused path on: one launch, the SwiGLU in the GEMV's prologue; off: two) and the reference's
    ``expert_down`` equals its ``expert_mlp`` bit for bit (the decode step's split of the shared expert changes
    nothing)."""
    from dsv4lab.engine.decode_groups import group
    from dsv4lab.tools.bench.e2e import count_launches
    from dsv4lab.tools.verify.registry import make_linear
    g = torch.Generator().manual_seed(8)
    D, inter = 256, 128
    w1, w3, w2 = make_linear("fp8", inter, D, g), make_linear("fp8", inter, D, g), make_linear("fp8", D, inter, g)
    group((w1, w3))
    x = poisoned_x((torch.randn(3, D, generator=g) * 3).to(torch.bfloat16))
    ref = ReferenceOps(Numerics())
    gate, up = ref.linear_group(x, (w1, w3))
    assert torch.equal(ref.expert_down(gate, up, w2, LIMIT), ref.expert_mlp(x, w1, w2, w3, LIMIT, shared=True))
    for fused, launches in ((True, 1), (False, 2)):
        ops = _ops(fused)
        counts, got = count_launches(lambda: ops.expert_down(gate, up, w2, LIMIT))
        assert counts["triton"] == launches and not ops.calls.reference, (counts, ops.report())
        assert torch.equal(got, ops.expert_mlp(x, w1, w2, w3, LIMIT, shared=True))


# ------------------------------------------------------------------------------------------ GPU, Flash widths
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
def test_gpu_fused_paths_are_their_parts_at_flash_widths(rows):
    """Compiled (the claim the interpreter cannot check: each fused launch's code generation), at DeepSeek-V4-Flash
    widths and the tuned H200 GEMV geometries: every fused path equals its parts launched alone bit for bit —
    ``attention_norms``, ``query_heads``, ``compressor_pair``, ``shared_swiglu``, the GEMV jobs of a CSA
    layer's attention input (``x_projections``) and the split attention's in-kernel combine (``attention_combine``)."""
    from dsv4lab.core.config import get_preset
    a = get_preset("flash")
    g = torch.Generator().manual_seed(rows)
    bf = torch.bfloat16
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(DEV)  # noqa: E731
    d, R = a.head_dim, a.rope_head_dim
    cos, sin = rnd(4096, R // 2), rnd(4096, R // 2)
    pos = torch.randint(0, 4096, (rows, 1), generator=g).to(DEV)
    slots = torch.randperm(rows, generator=g).to(DEV)
    # attention_norms
    q_a, kv = rnd(rows, 1, a.q_lora_rank, scale=3).to(bf), rnd(rows, 1, d, scale=3).to(bf)
    q_w, kv_w = 1 + 0.1 * rnd(a.q_lora_rank), 1 + 0.1 * rnd(d)
    ring_a, ring_b = (torch.zeros(rows + 1, a.window_size, d, dtype=bf, device=DEV) for _ in range(2))
    want = nrq.rms_norm(q_a, q_w, 1e-6), nrq.kv_norm_rope(kv, kv_w, 1e-6, cos, sin, pos, d - R, True, ring_a, slots)
    got = nrq.attention_norms(q_a, q_w, kv, kv_w, 1e-6, cos, sin, pos, d - R, True, ring_b, slots)
    assert all(torch.equal(u, v) for u, v in zip(got, want)) and torch.equal(ring_a, ring_b), "attention_norms"
    # query_heads
    q = rnd(rows, 1, a.n_heads, d, scale=3).to(bf)
    qi = rnd(rows, 1, a.index_n_heads, a.index_head_dim, scale=2).to(bf)
    want = nrq.head_rms_rope(q, cos, sin, pos, 1e-6), nrq.indexer_query(qi, cos, sin, pos, True)
    got = nrq.query_heads(q, qi, cos, sin, pos, 1e-6, True)
    assert all(torch.equal(u, v) for u, v in zip(got, want)), "query_heads"
    # compressor_pair: a CSA layer's two compressors, positions completing a block
    p1 = (torch.arange(rows, device=DEV) * 4 + 3)
    calls = []
    for ch, idx in ((a.index_head_dim, True), (d, False)):
        w = 2 * ch
        state = [rnd(rows + 1, 8, w), rnd(rows + 1, 8, w, scale=2)]
        calls.append(dict(kv=rnd(rows, w), score=rnd(rows, w, scale=2), ape=rnd(4, w, scale=0.5), positions=p1,
                          slots=slots, kv_ring=state[0], score_ring=state[1],
                          cache=torch.zeros(rows + 1, 1024, ch, dtype=bf, device=DEV), norm_weight=1 + 0.1 * rnd(ch),
                          cos=cos, sin=sin, ratio=4, overlap=True, eps=1e-6, indexer=idx, quantize=True))
    alone = [{k: (v.clone() if k in ("kv_ring", "score_ring", "cache") else v) for k, v in c.items()} for c in calls]
    for c in alone:
        cmp_decode.compressor_step(**c)
    cmp_decode.compressor_pair(*(cmp_decode.CompressorCall(**c) for c in calls))
    for c, w in zip(calls, alone):
        for k in ("kv_ring", "score_ring", "cache"):
            assert torch.equal(c[k], w[k]), f"compressor_pair {k}"
    # shared_swiglu and the GEMV jobs at the tuned H200 geometries of rows 1
    from dsv4lab.tools.verify.registry import make_linear
    geo = gemv.GemvGeometry
    gate, up = rnd(rows, a.moe_inter_dim, scale=3).to(bf), rnd(rows, a.moe_inter_dim, scale=3).to(bf)
    w2 = make_linear("fp8", a.dim, a.moe_inter_dim, g, DEV)
    g2 = geo(block_n=64, block_k=256, split_k=5, num_warps=8)
    want = gemv.fp8_gemv(swiglu_kernels.swiglu(gate, up, 10.0), w2.weight, w2.scale, geometry=g2)
    assert torch.equal(gemv.fp8_gemv(gate, w2.weight, w2.scale, geometry=g2, swiglu=(up, 10.0)), want), \
        "shared_swiglu"
    x = rnd(rows, a.dim, scale=3).to(bf)
    qkv = make_linear("fp8", a.q_lora_rank + d, a.dim, g, DEV)
    comps = make_linear("bf16", 2 * 2 * d + 2 * 2 * a.index_head_dim, a.dim, g, DEV)
    head_w = make_linear("bf16", a.index_n_heads, a.dim, g, DEV)
    jobs = [dict(x=x, weight=qkv.weight, scale=qkv.scale, segments=(a.q_lora_rank, d),
                 geometry=geo(block_n=32, block_k=256, split_k=6)),
            dict(x=x, weight=comps.weight, scale=None, act_quant=False, out_dtype=torch.float32,
                 segments=(2 * d, 2 * d, 2 * a.index_head_dim, 2 * a.index_head_dim),
                 geometry=geo(block_n=32, block_k=256, split_k=4)),
            dict(x=x, weight=head_w.weight, scale=None, act_quant=False, geometry=geo(block_n=32, split_k=16))]
    want = _flat(gemv.fp8_gemv(**c) for c in jobs)
    got = _flat(gemv.fp8_gemv_jobs([gemv.gemv_plan(**c) for c in jobs]))
    assert all(torch.equal(u, v) for u, v in zip(got, want)), "x_projections"
    # attention_combine: the H200's default split attention (16 slices) over the window and 512 CSA picks
    from dsv4lab_kernels import attention_decode as attn_decode_k
    W, C = a.window_size, 1024
    q = rnd(rows, a.n_heads, d, scale=0.2).to(bf)
    win_kv, cmp_kv = rnd(rows + 1, W, d).to(bf), rnd(rows + 1, C, d).to(bf)
    win_rows = torch.arange(W, device=DEV)[None, :].expand(rows, W).contiguous()
    cmp_rows = torch.stack([torch.randperm(C, generator=g)[:a.index_topk] for _ in range(rows)]).to(DEV)
    sink, p2 = rnd(a.n_heads), torch.full((rows,), 4095, device=DEV)
    outs = [attn_decode_k.sparse_attention_decode(
        q, win_kv, win_rows, slots, sink, d ** -0.5, kv_b=cmp_kv, rows_b=cmp_rows, batch_b=slots,
        geometry=attn_decode_k.AttentionGeometry(16, 32, 16, 8, False, combine_in_kernel=fused), cos=cos, sin=sin,
        positions=p2) for fused in (False, True)]
    assert torch.equal(*outs), "attention_combine"


# ------------------------------------------------------------------------------------------ attention_combine
attn_decode = pytest.importorskip("dsv4lab_kernels.attention_decode")


@pytest.mark.parametrize("case,splits", [(dict(h=8, positions=[5, 40]), 3),
                                         (dict(h=3, positions=[120, 299, 20], ratio=4, C=75, k=16), 5),
                                         (dict(h=8, positions=[63, 200], ratio=16, C=16), 16)])
def test_attention_combine_in_the_kernel_is_the_combine_launch_bit_for_bit(case, splits):
    """The split attention's combine made by the last slice program of each query row and head block (a ticket:
    ``combine_in_kernel``, the fused path ``attention_combine``) against the combine's own launch: the same bits
    (window only, CSA picks, HCA entries; slices past a short selection empty; unread cache rows NaN-poisoned), one
    launch instead of two, the ticket counters left at zero."""
    from dsv4lab.tools.bench.e2e import count_launches
    from dsv4lab.tools.verify.registry import _make_attention_from_caches
    from dsv4lab_kernels.tickets import counters
    args = _make_attention_from_caches(case, torch.Generator().manual_seed(splits), DEV, Numerics())
    q, win_kv, win_rows, cmp_kv, cmp_rows, slots, sink, scale, cos, sin, positions, ratio = args
    outs = {}
    for fused in (False, True):
        geo = attn_decode.AttentionGeometry(block_h=16, block_r=16, splits=splits, two_pass=False,
                                            combine_in_kernel=fused)
        counts, outs[fused] = count_launches(lambda: attn_decode.sparse_attention_decode(
            q, win_kv, win_rows, slots, sink, scale, kv_b=cmp_kv, rows_b=cmp_rows,
            batch_b=slots if cmp_kv is not None else None, geometry=geo, cos=cos, sin=sin, positions=positions,
            prefix_ratio_b=ratio if cmp_kv is not None else 0))
        assert counts["triton"] == (1 if fused else 2), counts
    assert torch.equal(outs[True], outs[False]), f"max |Δ| {(outs[True] - outs[False]).abs().max():.3g}"
    assert not counters(torch.device(DEV), 16).any()


def test_the_backends_attention_combines_in_the_kernel_where_the_dispatch_says():
    """``TritonOps.attention_from_caches`` with a split geometry from the dispatch: ``attention_combine`` on → one
    launch, off → two, the same bits; a geometry the caller fixes (a verification variant) is taken as it is."""
    from dsv4lab.engine.dispatch import INTERPRETER_DEFAULTS, Dispatch, Tuned
    from dsv4lab.engine.kernel_families import FUSION_NAMES
    from dsv4lab.engine.triton_backend import TritonOps
    from dsv4lab.tools.bench.e2e import count_launches
    from dsv4lab.tools.verify.registry import _make_attention_from_caches
    from test_dispatch import _doc
    args = _make_attention_from_caches(dict(h=8, positions=[63, 200], ratio=16, C=16), torch.Generator().manual_seed(1),
                                       DEV, Numerics())
    split = [dict(rows=64, choice=dict(block_h=16, block_r=16, splits=4, two_pass=False))]
    outs = {}
    for fused in (True, False):
        tuned = Tuned(_doc(**{"decode.attention": split, "decode.fusion": [dict(rows=64, choice={
            n: fused for n in FUSION_NAMES})]}), "t.json")
        ops = TritonOps(Numerics(), Dispatch(tuned, INTERPRETER_DEFAULTS))
        counts, outs[fused] = count_launches(lambda: ops.attention_from_caches(*args[:11], cmp_ratio=args[11]))
        assert counts["triton"] == (1 if fused else 2), counts
        fixed = attn_decode.AttentionGeometry(block_h=16, block_r=16, splits=4, two_pass=False)
        counts, _ = count_launches(lambda: ops.attention_from_caches(*args[:11], cmp_ratio=args[11], geometry=fixed))
        assert counts["triton"] == 2, counts
    assert torch.equal(outs[True], outs[False])
