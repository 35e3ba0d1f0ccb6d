"""Prefill kernels (issue 8) against the reference: FP8 GEMM and activation quantizer, expert sorter, grouped FP4
MoE GEMM (three routes), sparse prefill attention, indexer scores / top-k, compressor pooling, and chunked
prefill through the attention of every layer kind.

Runs in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set in conftest) on small irregular shapes with random
inputs, experts that get no token and NaN-poisoned memory no kernel may read; ``gpu`` tests repeat the checks at
larger shapes.

Every output is judged by its op's error bound (``dsv4lab.tools.verify.op_bounds``, docs/verification.md) under the
accumulation the kernel uses, stated at each call site: fp32 in the interpreter, fp32 tensor cores on a GPU, and
Hopper's FP8 MMA (~14 bits inside each 128-term block) for the FP8 GEMM and the ``fp8`` MoE route on a GPU.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dsv4lab.core import quant
from dsv4lab.core.model.indexer import select_topk
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.tools.verify.op_bounds import OP_BOUNDS, check_expectation
from dsv4lab.tools.verify.registry import make_bank, make_linear, routing
from dsv4lab.tools.verify.stages import OpRecorder, default_accumulation, replay

pytest.importorskip("triton")
fg = pytest.importorskip("dsv4lab_kernels.fp8_gemm")
ms = pytest.importorskip("dsv4lab_kernels.moe_sort")
fm = pytest.importorskip("dsv4lab_kernels.fp4_moe_grouped")
ap = pytest.importorskip("dsv4lab_kernels.attention_prefill")

NM = Numerics()
REF = ReferenceOps(NM)
FP8_NAN = 0x7F


def _dev():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _acc(out: torch.Tensor, fp8_mma: bool = False) -> str:
    """FP8 tensor cores (a GPU's FP8 GEMM / ``fp8`` route) or fp32 (interpreter: round to nearest; GPU: may
    truncate)."""
    return "fp8_mma" if fp8_mma and out.is_cuda else default_accumulation(out.device)


def _check(name, out, ref, op, *inputs, output=None, acc=None):
    """``out`` within the bound of ``op`` computed from the reference's ``inputs``."""
    expect = OP_BOUNDS[op](NM, acc or _acc(out), *inputs)
    if output is not None:
        expect = expect[output]
    res = check_expectation(out, ref, expect, name)
    assert res.ok, res.line()
    return res


def _bank(E, D, I, seed, device="cpu", offset=0):
    return make_bank(E, D, I, torch.Generator().manual_seed(seed), device, offset)


# ------------------------------------------------------------------------------------------ FP8 GEMM family
def test_activation_quantizer_is_the_reference_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    M, K = 9, 192  # a partial second 128-block
    x = (torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-12, 12, (M, 1), generator=g).float()))
    x[0, :64] = 31.0 * 2.0 ** -5  # exactly between two E4M3 values after scaling: ties to even
    x[1, 5] = 0.0
    x[2, :] = -x[2, :].abs()
    x = x.to(torch.bfloat16)
    out = fg.quantize_activations(x, q=True, deq_split=True, q_split=True, scales32=True)
    q, s = quant.act_quant_fp8(x)
    assert torch.equal(out["q"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(out["scale"], s)
    deq = (q.float() * s.repeat_interleave(128, -1)[:, :K]).to(torch.bfloat16)
    assert torch.equal(out["deq_split"], torch.cat((deq[:, 0::2], deq[:, 1::2]), 1))
    assert torch.equal(out["q_split"].view(torch.uint8), torch.cat((q[:, 0::2], q[:, 1::2]), 1).view(torch.uint8))
    exps = quant.e8m0_exponent(quant.e8m0_from_exponent(torch.log2(s).round().int()))
    assert torch.equal(out["scale32"].int() - 127, exps.repeat_interleave(4, -1)[:, : K // 32])


@pytest.mark.parametrize("M,N,K", [(37, 200, 192), (5, 96, 256)])
def test_fp8_gemm_matches_reference_and_never_reads_padding(M, N, K):
    g = torch.Generator().manual_seed(M)
    lin = make_linear("fp8", N, K, g)
    # weight and activations live inside NaN-filled buffers: a read past N or K poisons the output
    wbuf = torch.full((N + 7, K + 64), FP8_NAN, dtype=torch.uint8).view(torch.float8_e4m3fn)
    wbuf[:N, :K] = lin.weight
    xbuf = torch.full((M, K + 32), float("nan"), dtype=torch.bfloat16)
    xbuf[:, :K] = (torch.randn(M, K, generator=g) * 3).to(torch.bfloat16)
    w, x = wbuf[:N, :K], xbuf[:, :K]
    out = fg.fp8_linear(x, w, lin.scale, config="small")
    lin._buffers["weight"] = w.contiguous()
    xc = x.contiguous()
    _check("fp8_gemm", out, REF.linear(xc, lin), "linear", xc, lin, acc=_acc(out, fp8_mma=True))


# ------------------------------------------------------------------------------------------ sorter
@pytest.mark.parametrize("rows", [16, 32, 64, 128])
def test_sorter_groups_slots_by_expert(rows):
    g = torch.Generator().manual_seed(rows)
    T, E, k = 29, 12, 3
    idx, _ = routing(g, T, E, k, skip=3)  # the last 3 experts get no token
    for offset, n_local in ((0, E), (4, 6)):  # whole bank, and an expert-parallel slice
        got = ms.sort_by_expert(idx, n_local, rows, offset)
        want = ms.sort_by_expert_reference(idx, n_local, rows, offset)
        assert torch.equal(got.sorted_slots, want.sorted_slots)
        assert torch.equal(got.block_expert, want.block_expert)
        assert torch.equal(got.counts, want.counts)
        assert int((got.sorted_slots >= 0).sum()) == int(got.counts.sum())


# ------------------------------------------------------------------------------------------ grouped MoE
def _moe_case(T=13, E=8, k=3, D=160, I=96, seed=3, offset=0, n_local=None):
    g = torch.Generator().manual_seed(seed)
    bank = _bank(n_local or E, D, I, seed + 100, offset=offset)
    idx, w = routing(g, T, E, k, skip=2)
    x = (torch.randn(T, D, generator=g) * 2).to(torch.bfloat16)
    return x, idx, w.float(), bank


@pytest.mark.parametrize("route", ["bf16", "fp8", "scaled"])
def test_grouped_moe_routes_match_reference(route):
    x, idx, w, bank = _moe_case()
    assert fm.fp8_route_exact(bank)
    y = fm.routed_experts(x, idx, w, bank, 10.0, route=route, geo=fm.MoEGeometry(rows=16), poison=True)
    _check(f"routed_experts[{route}]", y, REF.routed_experts(x, idx, w, bank, 10.0), "routed_experts", x, idx, w,
           bank, 10.0, acc=_acc(y, route == "fp8"))


def test_grouped_moe_stages_and_expert_parallel_slice():
    x, idx, w, bank = _moe_case(T=19, seed=5, offset=4, n_local=4)  # experts 4..7 of 8 live here
    # expert 5 takes a slot of every token (19 slots > 16 rows: two blocks), expert 7 none
    others = torch.tensor([0, 1, 2, 3, 4, 6])
    g = torch.Generator().manual_seed(8)
    idx = torch.stack([torch.cat((torch.tensor([5]), others[torch.randperm(6, generator=g)[:2]]))
                       for _ in range(idx.shape[0])])
    geo = fm.MoEGeometry(rows=16)
    g, u = fm.moe_stage1(x, idx, bank, route="bf16", geo=geo)
    rg, ru = REF.moe_stage1(x, idx, bank)
    _check("stage1.g", g, rg, "moe_stage1", x, idx, bank, output=0)  # NaN exactly on the other rank's slots
    _check("stage1.u", u, ru, "moe_stage1", x, idx, bank, output=1)
    h = torch.randn(*rg.shape, generator=torch.Generator().manual_seed(9)) * 2
    _check("stage2", fm.moe_stage2(h, idx, bank, route="bf16", geo=geo), REF.moe_stage2(h, idx, bank), "moe_stage2",
           h, idx, bank)
    _check("routed (EP slice)", fm.routed_experts(x, idx, w, bank, 10.0, route="bf16", geo=geo, poison=True),
           REF.routed_experts(x, idx, w, bank, 10.0), "routed_experts", x, idx, w, bank, 10.0)


def test_grouped_moe_rows_do_not_depend_on_the_batch():
    # a token's result is the same whatever else is in the call: chunking a prefill cannot change it
    x, idx, w, bank = _moe_case(T=14, seed=7)
    geo = fm.MoEGeometry(rows=16)
    full = fm.routed_experts(x, idx, w, bank, 10.0, route="scaled", geo=geo)
    part = fm.routed_experts(x[5:9].contiguous(), idx[5:9], w[5:9], bank, 10.0, route="scaled", geo=geo)
    assert torch.equal(full[5:9], part)


def test_fp8_route_refuses_scales_it_cannot_upcast_exactly():
    _, _, _, bank = _moe_case()
    s = bank.w1_scale.view(torch.uint8).clone()
    s[0, 0, 0], s[0, 0, 1] = 100, 120  # 20 binades inside one 128-wide K tile
    bank._buffers["w1_scale"] = s.view(torch.float8_e8m0fnu)
    assert not fm.fp8_route_exact(bank)
    with pytest.raises(AssertionError, match="binades"):
        fm._check_route("fp8", bank, fm.MoEGeometry())
    from dsv4lab.engine.triton_prefill import TritonPrefillBackend
    assert TritonPrefillBackend(NM, moe_route="fp8")._moe_route(bank) == "bf16"


# ------------------------------------------------------------------------------------------ attention side
def _attention_case(b, s, h, d, n_kv, k, masked, seed):
    from dsv4lab.tools.verify.registry import _make_attention
    return _make_attention(dict(b=b, s=s, h=h, d=d, n_kv=n_kv, k=k, masked=masked),
                           torch.Generator().manual_seed(seed), "cpu", NM)


@pytest.mark.parametrize("config", ["h16n16", "h16n16x", "h64n32d2"])
def test_sparse_attention_matches_reference(config):
    q, kv, idx, sink, scale = _attention_case(2, 7, 5, 96, 61, 37, 0.4, 1)
    idx[0, 0, :20] = -1  # a first block with nothing visible (the window at the start of a sequence)
    out = ap.sparse_attention(q, kv, idx, sink, scale, config=config)
    ref = REF.sparse_attention(q, kv, idx, sink, scale)
    _check(f"sparse_attention[{config}]", out, ref, "sparse_attention", q, kv, idx, sink, scale)


def test_indexer_scores_match_reference():
    g = torch.Generator().manual_seed(2)
    b, s, h, d, T = 2, 5, 6, 64, 45
    qi = torch.randn(b, s, h, d, generator=g).to(torch.bfloat16)
    w = (torch.randn(b, s, h, generator=g) * 0.1).to(torch.bfloat16)
    keys = torch.randn(b, T, d, generator=g).to(torch.bfloat16)
    _check("indexer_scores", ap.indexer_scores(qi, w, keys, block_t=32), REF.indexer_scores(qi, w, keys),
           "indexer_scores", qi, w, keys)


def test_indexer_topk_is_exact_with_ties_and_signed_zeros():
    g = torch.Generator().manual_seed(4)
    b, s, T, ratio, topk = 2, 11, 40, 4, 16
    scores = torch.randint(-3, 4, (b, s, T), generator=g).float() * 0.5  # many exact ties
    scores[0, :, ::3] = -0.0  # −0 and +0 must tie
    scores = scores.to(torch.bfloat16)
    positions = (torch.arange(s) * 13 + 2).expand(b, -1).contiguous()  # from nothing visible to all of T
    got = ap.indexer_topk(scores, positions, ratio, topk, rows_per_program=4)
    assert torch.equal(got, select_topk(scores, positions, ratio, topk))


def test_compressor_pool_matches_reference():
    g = torch.Generator().manual_seed(6)
    kv = torch.randn(5, 8, 96, generator=g)
    sc = torch.randn(5, 8, 96, generator=g) * 2
    sc[0, :4], kv[0, :4] = float("-inf"), 0.0  # overlap mode's first entry: no previous block
    _check("compressor_pool", ap.compressor_pool(kv, sc, block_c=64), REF.compressor_pool(kv, sc), "compressor_pool",
           kv, sc)


# ------------------------------------------------------------------------------------------ chunked prefill
def _run_attention(model, layer, x, chunks, ops):
    """Run one layer's attention over ``x [1, n, D]`` in the given chunk lengths; the concatenated outputs."""
    model.reset()
    attn = model.model.layers[layer].attn
    outs, p = [], 0
    for c in chunks:
        start, lengths, slots = (torch.tensor([v]) for v in (p, c, 0))
        outs.append(attn(x[:, p:p + c], start, lengths, slots, ops))
        p += c
    return torch.cat(outs, 1)


@pytest.mark.parametrize("layer,kind,chunks", [(0, "swa", [40, 32]), (1, "csa", [24, 24, 24]),
                                               (2, "hca", [40, 32])])
def test_chunked_prefill_attention_every_layer_kind(layer, kind, chunks):
    """72 tokens cross the window (32), both ratios (4, 16) and the index top-k (16 entries = 64 tokens); chunks
    (the 512…4096 sweep at tiny scale: several chunks per window, chunks cutting compressor blocks) agree with
    the one-shot prefill bit for bit; and every op of the one-shot attention, replayed on the kernels with the
    reference's inputs, is within its bound (the stage-isolated oracle, on one layer)."""
    from conftest import load_tiny
    from dsv4lab.engine.triton_prefill import TritonPrefillBackend

    class AttentionKernels(TritonPrefillBackend):
        linear = ReferenceOps.linear  # row-wise (checked above); keeps this test inside the CI budget

    m = load_tiny(max_batch=1)
    assert m.args.layer_kind(layer) == kind
    ops = AttentionKernels(m.ops.numerics, min_tokens=1, attention_config="h16n64x")
    x = (torch.randn(1, 72, m.args.dim, generator=torch.Generator().manual_seed(layer)) * 0.5).to(torch.bfloat16)
    one = _run_attention(m, layer, x, [72], ops)
    assert ops.kernel_runs["sparse_attention"] == 1 and ops.fallbacks["sparse_attention"] == 0
    if kind == "csa":
        assert ops.kernel_runs["indexer_select"] == 1 and ops.kernel_runs["compressor_pool"] >= 2
    assert torch.equal(_run_attention(m, layer, x, chunks, ops), one), f"chunks {chunks}"
    rec = OpRecorder(m.ops, m.model)
    try:
        _run_attention(m, layer, x, [72], m.ops)
    finally:
        rec.remove()
    report = replay(rec.calls, SimpleNamespace(model=m.model, ops=ops, device=torch.device("cpu")), m)
    assert report.ok, "\n".join(s.line() for s in report.stages if not s.ok)
    assert {"attention core (sparse attention)", "kv after norm + RoPE"} <= {s.stage for s in report.stages}


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("route", ["bf16", "scaled", "fp8"])
def test_gpu_grouped_moe_at_larger_shapes(route):
    """Stage by stage against the reference, and the fused kernel as a whole: a last-bit difference in g or u may
    flip a bf16 and then an FP8 rounding of h, which the routed-experts bound follows through (it allows a flip
    exactly where the interval of h straddles a rounding boundary). Hopper's FP8 MMA keeps ~14 bits inside each
    128-term block: the fp8 route is judged under that accumulation."""
    dev = "cuda"
    g = torch.Generator().manual_seed(11)
    T, E, k, D, I = 700, 32, 6, 1024, 512
    bank = _bank(E, D, I, 12, dev)
    idx, w = routing(g, T, E, k, dev, skip=3)
    w = w.float()
    x = (torch.randn(T, D, generator=g) * 2).to(dev, torch.bfloat16)
    rg, ru = REF.moe_stage1(x, idx, bank)
    h = REF.moe_activation(rg, ru, w, 10.0)
    r2, total = REF.moe_stage2(h, idx, bank), REF.routed_experts(x, idx, w, bank, 10.0)
    acc = "fp8_mma" if route == "fp8" else default_accumulation(dev)
    for rows in (16, 64, 128):
        geo = fm.MoEGeometry(rows=rows)
        kg, ku = fm.moe_stage1(x, idx, bank, route=route, geo=geo)
        _check(f"gpu stage1.g[{route},{rows}]", kg, rg, "moe_stage1", x, idx, bank, output=0, acc=acc)
        _check(f"gpu stage1.u[{route},{rows}]", ku, ru, "moe_stage1", x, idx, bank, output=1, acc=acc)
        _check(f"gpu stage2[{route},{rows}]", fm.moe_stage2(h, idx, bank, route=route, geo=geo), r2, "moe_stage2",
               h, idx, bank, acc=acc)
        y = fm.routed_experts(x, idx, w, bank, 10.0, route=route, geo=geo, poison=True)
        _check(f"gpu fused[{route},{rows}]", y, total, "routed_experts", x, idx, w, bank, 10.0, acc=acc)


@pytest.mark.gpu
def test_gpu_fp8_gemm_and_attention_at_real_widths():
    dev = "cuda"
    g = torch.Generator().manual_seed(13)
    lin = make_linear("fp8", 1536, 4096, g, dev)
    x = (torch.randn(300, 4096, generator=g) * 2).to(dev, torch.bfloat16)
    ref = REF.linear(x, lin)
    for cfg in fg.FP8_GEMM_CONFIGS:
        _check(f"gpu fp8 gemm {cfg}", fg.fp8_linear(x, lin.weight, lin.scale, config=cfg), ref, "linear", x, lin,
               acc="fp8_mma")
    q, kv, idx, sink, scale = _attention_case(1, 33, 64, 512, 900, 640, 0.3, 5)
    q, kv, idx, sink = q.to(dev), kv.to(dev), idx.to(dev), sink.to(dev)
    ref = REF.sparse_attention(q, kv, idx, sink, scale)
    for cfg in ap.ATTENTION_CONFIGS:
        _check(f"gpu attention {cfg}", ap.sparse_attention(q, kv, idx, sink, scale, config=cfg), ref,
               "sparse_attention", q, kv, idx, sink, scale)


@pytest.mark.gpu
def test_gpu_tiny_model_chunked_prefill_through_prefill_kernels():
    """The tiny model prefilled through the prefill kernels, one-shot and in chunks: every op stage by stage on the
    reference's inputs is within its bound, and the teacher-forced KL of the one-shot and chunked logits against
    the reference stays within the calibrated multiples of this checkpoint's rounding floor measured here
    (``verify.model.kl_rule``; the one-shot-vs-chunked comparison is held to the same rule)."""
    import dsv4lab
    from conftest import TINY
    from dsv4lab.engine.triton_prefill import TritonPrefillBackend
    from dsv4lab.tools.verify.model import judge_kl, kl_per_position, kl_rule, rounding_noise_floor
    from dsv4lab.tools.verify.stages import verify_stages
    m = dsv4lab.load(TINY, device="cuda", max_batch=1)
    ref = dsv4lab.load(TINY, device="cuda", max_batch=1)
    ids = torch.randint(2, m.args.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    ref_logits = ref.forward(ids, 0)[0]
    rule = kl_rule(rounding_noise_floor(ref, ids[0].tolist(), ref_logits), None)
    m.ops = TritonPrefillBackend(m.ops.numerics, min_tokens=16)
    report = verify_stages(m, ref, ids[0, :97].tolist(), decode_steps=1)
    assert report.ok, "\n".join(s.line() for s in report.stages if not s.ok)
    for chunk in (300, 128, 64):
        out = m.prefill(ids, chunk, logits="all")[0]
        if chunk == 300:
            one = out
            continue
        verdict = judge_kl(kl_per_position(one, out), m.args, rule)
        assert verdict["ok"], f"chunk {chunk} vs one-shot: {verdict['mean_kl']:.3g} mean, {verdict['max_kl']:.3g} max"
    assert m.ops.kernel_runs["routed_experts"] > 0 and m.ops.kernel_runs["sparse_attention"] > 0, m.ops.report()
    verdict = judge_kl(kl_per_position(ref_logits, one), m.args, rule)
    assert verdict["ok"], (f"vs reference: mean KL {verdict['mean_kl']:.3g} (bound {rule['mean_kl']:.3g}), max "
                           f"{verdict['max_kl']:.3g} (bound {rule['max_kl']:.3g})")
