"""Decode kernels (issue 7) against the reference: device number formats, FP8/BF16 GEMV (two routes, split-K,
grouped ``wo_a``), the routed-MoE decode (three routes, launch geometries, an expert-parallel slice), sparse
attention decode (one and two caches, split rows), the Triton backend's dispatch and report, and the static
decode step on the tiny model, replayed stage by stage against the reference's (each call within its op's bound).

Runs in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set in conftest) on small irregular shapes with random
inputs and NaN-poisoned memory no kernel may read (bytes past every buffer, the scales of experts no token picks,
KV rows no query selects); ``gpu`` tests repeat the checks at real DeepSeek-V4-Flash widths.

Every output is judged by its op's error bound (``dsv4lab.tools.verify.op_bounds``, derived in docs/verification.md)
under the accumulation the kernel uses, stated at each call site: fp32 (round to nearest) in the interpreter, fp32
in tensor cores (truncating) on a GPU, Hopper's FP8 MMA for the FP8 ``dot`` route.
"""
from __future__ import annotations

import pytest
import torch

from dsv4lab.core import quant
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from conftest import calibrated_max_kl, in_poisoned, poisoned_x
from dsv4lab.tools.verify.compare import compare
from dsv4lab.tools.verify.model import kl_per_position
from dsv4lab.tools.verify.op_bounds import OP_BOUNDS, check_expectation, moe_stage1_int8, routed_experts_int8
from dsv4lab.tools.verify.registry import _make_attention, make_linear
from dsv4lab.tools.verify.stages import default_accumulation

triton = pytest.importorskip("triton")
tl = triton.language
gemv = pytest.importorskip("dsv4lab_kernels.fp8_gemv")
moe = pytest.importorskip("dsv4lab_kernels.fp4_moe_decode")
attn = pytest.importorskip("dsv4lab_kernels.attention_decode")
formats = pytest.importorskip("dsv4lab_kernels.formats")
from test_kernels_moe_decode import moe_case  # noqa: E402

NM = Numerics()
REF = ReferenceOps(NM)
FP8_NAN, E8M0_NAN = 0x7F, 0xFF


def _dev():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _acc(out: torch.Tensor, fp8_mma: bool = False) -> str:
    """The accumulation a kernel's result was computed with: FP8 tensor cores (a GPU's ``dot`` route), else fp32
    (round to nearest in the interpreter, possibly truncating in a GPU's tensor cores)."""
    return "fp8_mma" if fp8_mma and out.is_cuda else default_accumulation(out.device)


def _within_bound(name, out, ref, op, *inputs, output=None, acc=None, bound=None):
    """``out`` (one output of ``op``; ``output`` picks one of several) within the op's bound, computed from the
    same ``inputs`` the reference saw (on the CPU)."""
    cpu = tuple(v.cpu() if isinstance(v, torch.Tensor) else v for v in inputs)
    expect = (bound or OP_BOUNDS[op])(NM, acc or _acc(out), *cpu)
    if output is not None:
        expect = expect[output]
    res = check_expectation(out.cpu(), ref.cpu(), expect, name)
    assert res.ok, res.line()
    return res


# ------------------------------------------------------------------------------------------ device formats
@triton.jit
def _formats_probe(v_ptr, b_ptr, out_e4m3, out_bf16, out_lo, out_hi, out_lo2, out_hi2, N: tl.constexpr):
    i = tl.arange(0, N)
    v = tl.load(v_ptr + i)
    tl.store(out_e4m3 + i, formats.round_to_e4m3(tl.minimum(tl.maximum(v, -448.0), 448.0)))
    tl.store(out_bf16 + i, formats.round_to_bf16(v))
    b = tl.load(b_ptr + i).to(tl.int32)
    lo, hi = formats.e2m1_pair_to_f32_scaled(b)
    tl.store(out_lo + i, lo * 16384.0)
    tl.store(out_hi + i, hi * 16384.0)
    lo2, hi2 = formats.e2m1_pair_times2_int(b)
    tl.store(out_lo2 + i, lo2)
    tl.store(out_hi2 + i, hi2)


def test_device_formats_are_exact():
    g = torch.Generator().manual_seed(0)
    N = 1024
    v = torch.randn(N, generator=g) * torch.exp2(torch.randint(-14, 9, (N,), generator=g).float())
    grid = quant.e2m1_decode(torch.arange(16)).float()
    e4m3_points = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3_points = e4m3_points[torch.isfinite(e4m3_points)]
    mids = (e4m3_points.sort().values[1:] + e4m3_points.sort().values[:-1]) / 2  # exact ties
    v[: len(mids[:300])] = mids[:300]
    v[300:310] = torch.tensor([127.1, 31.73, -31.9, 0.0, -0.0, 2.0 ** -10, 448.0, 500.0, 1e-30, -7.5])
    # NaNs with payloads the rounding bias would carry into the sign bit (CUDA's canonical NaN is 0x7FFFFFFF)
    v[310:313] = torch.tensor([0x7FFFFFFF, -1, 0x7FC00000], dtype=torch.int32).view(torch.float32)
    b = torch.arange(N, dtype=torch.int64) % 256
    outs = [torch.empty(N) for _ in range(4)] + [torch.empty(N, dtype=torch.int32) for _ in range(2)]
    _formats_probe[(1,)](v, b.to(torch.uint8), *outs, N=N)
    ok = ~v.isnan()
    assert torch.equal(outs[0][ok], v[ok].clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert torch.equal(outs[1][ok], v[ok].to(torch.bfloat16).float()) and outs[1][~ok].isnan().all()
    assert torch.equal(outs[2], grid[b & 15]) and torch.equal(outs[3], grid[b >> 4])
    times2 = torch.tensor(quant.E2M1_TIMES2_INT8, dtype=torch.int32)
    assert torch.equal(outs[4], times2[b & 15]) and torch.equal(outs[5], times2[b >> 4])


# ------------------------------------------------------------------------------------------ FP8 / BF16 GEMV
GEMV_CASES = [dict(M=1, N=96, K=256, route="fma", split=1), dict(M=3, N=200, K=192, route="dot", split=2),
              dict(M=5, N=72, K=320, route="fma", split=3)]


@pytest.mark.parametrize("case", GEMV_CASES, ids=lambda c: "M{M}N{N}K{K}_{route}_split{split}".format(**c))
def test_fp8_gemv_matches_reference_and_never_reads_padding(case):
    M, N, K = case["M"], case["N"], case["K"]
    g = torch.Generator().manual_seed(M * N)
    lin = make_linear("fp8", N, K, g)
    x = poisoned_x((torch.randn(M, K, generator=g) * 3).to(torch.bfloat16))
    w = in_poisoned(lin.weight, FP8_NAN)
    s = in_poisoned(lin.scale, E8M0_NAN)
    geo = gemv.GemvGeometry(block_n=32, block_k=128, split_k=case["split"])
    out = gemv.fp8_gemv(x, w, s, act_quant=True, route=case["route"], geometry=geo)
    _within_bound("fp8_gemv", out, REF.linear(x, lin), "linear", x, lin, acc=_acc(out, case["route"] == "dot"))


def test_grouped_wo_a_and_bf16_weights():
    g = torch.Generator().manual_seed(1)
    G, R, in_g = 3, 32, 192
    wo_a = make_linear("fp8", G * R, in_g, g, act_quant=False)
    o = (torch.randn(2, 1, G, in_g, generator=g)).to(torch.bfloat16)
    for route in gemv.ROUTES:
        y = gemv.fp8_gemv(o.flatten(-2), wo_a.weight, wo_a.scale, act_quant=False, groups=G, route=route,
                          geometry=gemv.GemvGeometry(block_n=16, block_k=128, split_k=2))
        # bf16 × bf16 products (no activation quantization): fp32 accumulation on either route
        _within_bound(f"wo_a[{route}]", y.view(2, 1, G, R), REF.grouped_wo_a(o, wo_a, G), "grouped_wo_a", o, wo_a, G)
    head = make_linear("bf16", 130, 96, g)  # an fp32 projection of a BF16 weight (router, compressor, head)
    x = torch.randn(2, 96, generator=g).to(torch.bfloat16)
    y = gemv.fp8_gemv(x, head.weight, None, act_quant=False, out_dtype=torch.float32,
                      geometry=gemv.GemvGeometry(block_n=64, block_k=128))
    _within_bound("head", y, REF.linear_f32(x, head), "linear_f32", x, head)


# ------------------------------------------------------------------------------------------ routed MoE
def _moe_case(T, **kw):
    """:func:`test_kernels_moe_decode.moe_case` with the routing as drawn (no shared expert forced)."""
    return moe_case(T, share=False, **kw)


@pytest.mark.parametrize("route,T,geo", [
    ("fma", 1, moe.MoeGeometry(block_n_up=32, block_n_down=64, block_k=128)),
    ("fma", 3, moe.MoeGeometry(block_n_up=64, block_n_down=32, block_k=256, slot_split=3)),
    ("dot_scaled", 2, moe.MoeGeometry(block_n_up=32, block_n_down=64, block_k=128, slot_split=2)),
])
def test_routed_moe_decode_matches_reference(route, T, geo):
    x, idx, w, bank = _moe_case(T, seed=T)
    y = moe.routed_moe_decode(x, idx, w, moe.ExpertTensors.of(bank), 10.0, route=route, geometry=geo)
    _within_bound(f"routed[{route}]", y, REF.routed_experts(x, idx, w, bank, 10.0), "routed_experts", x, idx, w,
                  bank, 10.0)


@pytest.mark.parametrize("prequant", [False, True])
def test_bytewise_decode_gives_the_scaled_decodes_bits(prequant):
    """``decode="bytewise"`` (unscaled fp16 codes, each 32-group's dot times its power-of-two scale after the sum)
    rounds every product and sum as the scaled decode does: the same bits, NaN-scaled experts never read (the
    portable forms here; the PTX against the asm decode on the GPU)."""
    x, idx, w, bank = _moe_case(3, seed=7)
    ex = moe.ExpertTensors.of(bank)
    geo = dict(block_n_up=32, block_n_down=32, block_k=128, prequant=prequant)
    want = moe.routed_moe_decode(x, idx, w, ex, 10.0, route="fma", geometry=moe.MoeGeometry(decode="plain", **geo))
    got = moe.routed_moe_decode(x, idx, w, ex, 10.0, route="fma", geometry=moe.MoeGeometry(decode="bytewise", **geo))
    assert torch.isfinite(want).all() and torch.equal(got, want)
    with pytest.raises(ValueError, match="'fma' route with fma_sums='group'"):
        moe.routed_moe_decode(x, idx, w, ex, 10.0, route="dot", geometry=moe.MoeGeometry(decode="bytewise"))


def test_a_kernel_reading_a_permuted_w2_or_a_wrong_scale_fails_its_bound():
    """The bounds can fail: the same kernel fed one expert's W2 in the paper's permuted tile layout, or a GEMV whose
    weight scale block is off by one binade, is far outside the bound of the correct computation."""
    from dsv4lab.tools.verify.backend_faults import permuted_w2_bank
    x, idx, w, bank = _moe_case(2, D=256, seed=4)  # W2 rows: whole 128-row tiles
    geo = moe.MoeGeometry(block_n_up=32, block_n_down=64, block_k=128)
    bad = permuted_w2_bank(bank, int(idx[0, 0]))
    y = moe.routed_moe_decode(x, idx, w, moe.ExpertTensors.of(bad), 10.0, geometry=geo)
    expect = OP_BOUNDS["routed_experts"](NM, _acc(y), x, idx, w, bank, 10.0)
    res = check_expectation(y, REF.routed_experts(x, idx, w, bank, 10.0), expect, "permuted W2")
    assert not res.ok and res.max_ratio > 10, res.line()
    g = torch.Generator().manual_seed(9)
    lin = make_linear("fp8", 96, 256, g)
    x = (torch.randn(2, 256, generator=g) * 3).to(torch.bfloat16)
    scale = lin.scale.view(torch.uint8).clone()
    scale[0, 1] += 1  # one 128×128 block read with twice its scale
    out = gemv.fp8_gemv(x, lin.weight, scale.view(torch.float8_e8m0fnu), act_quant=True,
                        geometry=gemv.GemvGeometry(block_n=32, block_k=128))
    res = check_expectation(out, REF.linear(x, lin), OP_BOUNDS["linear"](NM, _acc(out), x, lin), "scale off")
    assert not res.ok, res.line()


def test_routed_moe_stages_on_an_expert_parallel_slice():
    x, idx, w, bank = _moe_case(3, seed=5, offset=4, n_local=4)  # experts 4..7 of 10 live here
    ex = moe.ExpertTensors.of(bank)
    geo = moe.MoeGeometry(block_n_up=32, block_n_down=64, block_k=128)
    g, u = moe.moe_gate_up(x, idx, None, ex, 10.0, geometry=geo, write_gu=True)
    rg, ru = REF.moe_stage1(x, idx, bank)
    _within_bound("stage1.g", g, rg, "moe_stage1", x, idx, bank, output=0)  # NaN exactly on the other ranks' slots
    _within_bound("stage1.u", u, ru, "moe_stage1", x, idx, bank, output=1)
    h = REF.moe_activation(rg, ru, w, 10.0)
    out = moe.moe_down(h.to(torch.bfloat16), idx, ex, geometry=geo, per_slot=True)
    _within_bound("stage2", out, REF.moe_stage2(h, idx, bank), "moe_stage2", h, idx, bank)
    y = moe.routed_moe_decode(x, idx, w, ex, 10.0, geometry=geo)
    _within_bound("routed (slice)", y, REF.routed_experts(x, idx, w, bank, 10.0), "routed_experts", x, idx, w, bank,
                  10.0)


def test_int8_route_is_the_papers_arithmetic():
    x, idx, w, bank = _moe_case(2, seed=7)
    ex = moe.ExpertTensors.of(bank)
    geo = moe.MoeGeometry(block_n_up=32, block_n_down=64, block_k=128)
    g, _ = moe.moe_gate_up(x, idx, None, ex, 10.0, route="int8", geometry=geo, write_gu=True)
    want = torch.full_like(g, float("nan"))
    for t in range(idx.shape[0]):
        for s in range(idx.shape[1]):
            e = int(idx[t, s])
            want[t, s] = moe.reference_int8_route(x[t:t + 1], bank.w1[e], bank.w1_scale[e])[0].float().bfloat16()
    # the same chain of bounds with the INT8 quantizer: per projection K/32 exact group dots, three scalings each
    _within_bound("int8 stage1 vs its oracle", g, want, "moe_stage1", x, idx, bank, output=0, bound=moe_stage1_int8)
    y = moe.routed_moe_decode(x, idx, w, ex, 10.0, route="int8", geometry=geo)
    _within_bound("int8 MoE vs its oracle", y, moe.reference_int8_moe(x, idx, w, ex, 10.0), "routed_experts",
                  x, idx, w, bank, 10.0, bound=routed_experts_int8)
    # against the FP8 reference it is a different quantization (per-32 INT8 vs per-128 E4M3 activations):
    # close in aggregate, not per element (the random bank's group scales span 2^±4, which INT8's absolute
    # step per group handles worse than E4M3's relative one)
    c = compare("int8 vs fp8 reference", y, REF.routed_experts(x, idx, w, bank, 10.0))
    assert c.cosine > 0.99, c.line()


# ------------------------------------------------------------------------------------------ attention
@pytest.mark.parametrize("shape,splits,two_pass", [(dict(b=1, s=1, h=8, d=96, n_kv=80, k=48), 1, True),
                                                   (dict(b=2, s=3, h=4, d=64, n_kv=37, k=20, masked=0.5), 3, True),
                                                   (dict(b=1, s=2, h=8, d=64, n_kv=90, k=70, masked=0.3), 2, False)])
def test_sparse_attention_decode_matches_reference(shape, splits, two_pass):
    q, kv, idx, sink, scale = _make_attention(shape, torch.Generator().manual_seed(splits), "cpu", NM)
    q = q * 4  # a sharp softmax: the running max of the one-pass form moves
    b, s, h, d = q.shape
    o = attn.sparse_attention_decode(q.reshape(b * s, h, d), kv, idx.reshape(b * s, -1),
                                     torch.arange(b).repeat_interleave(s), sink, scale,
                                     geometry=attn.AttentionGeometry(block_r=16, splits=splits, two_pass=two_pass))
    ref = REF.sparse_attention(q, kv, idx, sink, scale)
    # one bound for every evaluation order: a slice's or a running max moves the bf16 rounding of each probability
    _within_bound(f"attention splits={splits} two_pass={two_pass}", o.view(b, s, h, d), ref, "sparse_attention",
                  q, kv, idx, sink, scale)


def test_attention_reads_two_caches_in_place():
    g = torch.Generator().manual_seed(3)
    slots_n, W, C, H, d = 3, 16, 10, 4, 64
    win = torch.full((slots_n, W, d), float("nan")).to(torch.bfloat16)
    cmp = torch.full((slots_n, C, d), float("nan")).to(torch.bfloat16)
    win[1, :9] = torch.randn(9, d, generator=g).to(torch.bfloat16)
    cmp[1, :4] = torch.randn(4, d, generator=g).to(torch.bfloat16)
    win[2, :] = torch.randn(W, d, generator=g).to(torch.bfloat16)
    cmp[2, :7] = torch.randn(7, d, generator=g).to(torch.bfloat16)
    slots = torch.tensor([2, 1])
    win_rows = torch.tensor([list(range(W)), list(range(9)) + [-1] * (W - 9)])
    cmp_rows = torch.tensor([[6, 0, 3, -1, 5], [2, -1, 0, 1, -1]])
    q = torch.randn(2, H, d, generator=g).to(torch.bfloat16)
    sink = torch.randn(H, generator=g)
    o = attn.sparse_attention_decode(q, win, win_rows, slots, sink, d ** -0.5, kv_b=cmp, rows_b=cmp_rows,
                                     batch_b=slots, geometry=attn.AttentionGeometry(block_r=16))
    ref = REF.attention_from_caches(q, win, win_rows, cmp, cmp_rows, slots, sink, d ** -0.5)
    _within_bound("two caches", o, ref, "attention_from_caches", q, win, win_rows, cmp, cmp_rows, slots, sink,
                  d ** -0.5)


# ------------------------------------------------------------------------------------------ backend
def test_backend_dispatch_fallbacks_and_variants():
    from dsv4lab.engine.triton_backend import TritonOps
    ops = TritonOps(NM)
    g = torch.Generator().manual_seed(4)
    lin = make_linear("fp8", 64, 128, g)
    x = torch.randn(2, 128, generator=g).to(torch.bfloat16)
    _within_bound("linear", ops.linear(x, lin), REF.linear(x, lin), "linear", x, lin)
    ops.linear(x, lin, all_reduce=lambda t: t)  # a tensor-parallel partial sum is the reference's job
    ops.head_rms(x, 1e-6)  # an op with no kernel (rms_norm has one now: the glue of the decode step)
    rep = ops.report()
    assert "tensor-parallel partial sum" in rep and "no kernel" in rep
    assert ops.calls.decode["linear"] == 1
    oracle = TritonOps(Numerics.exact())  # float64 oracle numerics: every op runs the reference
    oracle.linear(x.double(), lin)
    assert ("linear", "float64 numerics") in oracle.calls.reference
    assert {"fma", "dot_scaled", "fma_slot_split2"} <= set(ops.variants("routed_experts"))
    assert "int8" not in ops.variants("routed_experts")  # another quantization: checked against its own oracle
    assert {"fma", "dot"} <= set(ops.variants("linear"))


def _static_step_stage_by_stage(tiny_path, device):
    """Teacher-forced, two ragged rows (one completing a block of every ratio-4 compressor): the reference's static
    decode step is recorded op by op (it equals the reference's eager decode bit for bit: tests/test_decode_step.py
    pins the wiring) and every call is replayed on the Triton backend with the reference's inputs, judged by the op's
    analytic bound under the accumulation model of the kernel the call takes (``TritonOps.accumulation_for``:
    tensor-core and cuBLAS sums on a GPU, fp32 in the interpreter). Then the Triton static step itself runs, and its
    logits are held to the reference's only as a gross-error guard — under the interpreter to 1e-2 relative, on a GPU
    each row within the per-position KL bound of ``verify model``'s calibrated rule for ``data/tiny`` (rounding
    differences propagated through 6 layers are the stage replay's subject, not a tolerance's)."""
    import dsv4lab
    from dsv4lab.engine.decode_graph import Decoder
    from dsv4lab.tools.verify.stages import OpRecorder, replay

    ref = dsv4lab.load(tiny_path, backend="reference", max_batch=2, max_seq_len=64, device=device,
                       decode_path="static")
    tri = dsv4lab.load(tiny_path, backend="triton", max_batch=2, max_seq_len=64, device=device)
    ids = torch.randint(2, 4096, (2, 8), generator=torch.Generator().manual_seed(11))
    lens = [6, 3]  # the steps decode positions 6 and 3: the second completes a ratio-4 block
    kernels, tri.ops = tri.ops, ReferenceOps(tri.ops.numerics)  # prefill on the reference (state is the model's)
    for m in (ref, tri):
        m.forward(ids[:, :6], 0, slots=[0, 1], lengths=lens)
    tri.ops = kernels
    pos = torch.tensor(lens)
    tok = ids[torch.arange(2), pos]
    rec = OpRecorder(ref.ops, ref.model)
    rec.forward_index, rec.path = 1, "static"
    try:
        want = ref.forward(tok[:, None], pos, slots=[0, 1])[:, 0]
    finally:
        rec.remove()
    report = replay(rec.calls, tri, ref)
    assert report.ok, "\n".join(s.line() for s in report.stages if not s.ok)
    ops = {c.op for c in rec.calls}
    assert {"attention_from_caches", "compressor_step", "kv_norm_rope", "indexer_select_decode", "router_topk",
            "hc_post_pre_norm", "routed_experts"} <= ops
    got = Decoder(tri, graphs=False).decode(tok, [0, 1])  # the replay wrote nothing: the caches are the prefill's
    if device == "cpu":  # the interpreter sums in fp32 like the reference: agreement to ~1e-7 relative
        rel = float((got.cpu() - want.cpu()).norm() / want.cpu().norm())
        assert rel < 1e-2, f"the Triton static step's logits are {rel:.2e} (relative) from the reference decode"
    else:  # tensor-core sums: rounding amplified through 6 random layers, judged as verify model judges it
        kl = kl_per_position(want.cpu().float(), got.cpu().float())
        bound = calibrated_max_kl("tiny")
        assert max(kl) <= bound, f"the static step's rows are KL {kl} from the reference decode (bound {bound:.3g})"
    assert tri.ops.calls.decode["routed_experts"] > 0 and tri.ops.calls.glue["compressor_step"] > 0


@pytest.mark.slow
def test_static_decode_step_matches_reference_decode_on_tiny(layer_cut):
    """The static decode step on the Triton kernels in the interpreter, judged stage by stage: on the first three
    layers of ``data/tiny`` (SWA, CSA, HCA, same widths; ``layer_cut``), as the interpreter's cost is per layer."""
    _static_step_stage_by_stage(layer_cut("tiny"), "cpu")


@pytest.mark.gpu
def test_gpu_static_decode_step_stage_by_stage(tiny_path):
    """The same on the GPU: compiled kernels, tensor-core sums, the measured dispatch's routes — each call judged
    under its own kernel's accumulation model."""
    _static_step_stage_by_stage(tiny_path, "cuda")


# ------------------------------------------------------------------------------------------ GPU (real widths)
@pytest.mark.gpu
@pytest.mark.parametrize("route", moe.ROUTES)
def test_gpu_routed_moe_real_widths(route):
    T, E, k, D, I = 4, 8, 6, 4096, 2048
    x, idx, w, bank = _moe_case(T, E=E, k=k, D=D, I=I, seed=1)
    bank = bank.to("cuda")
    y = moe.routed_moe_decode(x.cuda(), idx.cuda(), w.cuda(), moe.ExpertTensors.of(bank), 10.0, route=route)
    bank = bank.to("cpu")
    if route == "int8":
        ref = moe.reference_int8_moe(x, idx, w, moe.ExpertTensors.of(bank), 10.0)
        _within_bound("routed[int8]", y, ref, "routed_experts", x, idx, w, bank, 10.0, bound=routed_experts_int8)
    else:  # dot_scaled is emulated through bf16 MMA on sm_90: fp32 tensor-core accumulation
        _within_bound(f"routed[{route}]", y, REF.routed_experts(x, idx, w, bank, 10.0), "routed_experts", x, idx, w,
                      bank, 10.0)


@pytest.mark.gpu
@pytest.mark.parametrize("prequant", [False, True])
def test_gpu_bytewise_decode_gives_the_asm_decodes_bits_at_real_widths(prequant):
    """The byte-wise PTX against the bf16 PTX, 8-row programs as the batch-1 dispatch runs them: bit for bit."""
    T, E, k, D, I = 2, 8, 6, 4096, 2048
    x, idx, w, bank = _moe_case(T, E=E, k=k, D=D, I=I, seed=3)
    ex = moe.ExpertTensors.of(bank.to("cuda"))
    x, idx, w = x.cuda(), idx.cuda(), w.cuda()
    geo = dict(block_n_up=8, block_n_down=8, block_k=256, num_warps=1, num_stages=2, prequant=prequant)
    assert ex.scales_le_2  # "auto" below is the bf16 PTX
    want = moe.routed_moe_decode(x, idx, w, ex, 10.0, route="fma", geometry=moe.MoeGeometry(decode="auto", **geo))
    got = moe.routed_moe_decode(x, idx, w, ex, 10.0, route="fma", geometry=moe.MoeGeometry(decode="bytewise", **geo))
    assert torch.isfinite(want).all() and torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("route", gemv.ROUTES)
def test_gpu_fp8_gemv_real_widths(route):
    g = torch.Generator().manual_seed(2)
    lin = make_linear("fp8", 4096, 8192, g)
    x = (torch.randn(3, 8192, generator=g)).to(torch.bfloat16)
    out = gemv.fp8_gemv(x.cuda(), lin.weight.cuda(), lin.scale.cuda(), route=route,
                        geometry=gemv.GemvGeometry(block_n=32, block_k=512, split_k=4))
    _within_bound(f"wo_b[{route}]", out, REF.linear(x, lin), "linear", x, lin, acc=_acc(out, route == "dot"))


def _check_moe_output(T, S, D, dev):
    g = torch.Generator().manual_seed(T * 10 + S)
    routed = torch.randn(T, D, generator=g) * 3
    shared = (torch.randn(S, T, D, generator=g) * 3).to(torch.bfloat16)
    routed[0, 0], routed[-1, 1] = float("nan"), -0.0
    shared[:, -1, 1] = -0.0
    routed[0, 2], shared[:, 0, 2] = 1.0 + 3 * 2.0 ** -8, 0.0  # a bf16 tie: to even is 1 + 2^-6, truncation 1 + 2^-7
    out = moe.moe_output(routed.to(dev), shared.to(dev), torch.bfloat16).cpu()
    want = REF.moe_output(routed.to(dev), shared.to(dev)).cpu()  # torch's own ops on the same device
    assert out.dtype == want.dtype == torch.bfloat16
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(out), nan)  # NaN where the reference has NaN (its payload is not specified)
    assert torch.equal(out[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert float(want[0, 2]) == 1.0 + 2.0 ** -6 and torch.isnan(out[0, 0]) and str(float(out[-1, 1])) == "-0.0"


@pytest.mark.parametrize("T,S,D", [(3, 1, 1000), (1, 2, 160)])
def test_moe_output_is_the_torch_ops_bit_for_bit(T, S, D):
    """The MoE's output in one launch (routed fp32 + shared experts' act outputs, added in fp32 in expert order,
    rounded to bf16) gives the reference's bits, -0 and a value on a bf16 rounding tie included, and NaN where it
    has NaN (torch leaves a NaN's payload unspecified: the CPU gives 0xFFFF, the kernel 0x7FC0) — an irregular
    width (1,000: the last block partial) and two shared experts (the order of the additions matters)."""
    _check_moe_output(T, S, D, _dev())


@pytest.mark.gpu
def test_gpu_moe_output_at_flash_width():
    """The same compiled, at DeepSeek-V4-Flash's width (4,096) and batch 8, against torch's CUDA ops."""
    _check_moe_output(8, 1, 4096, "cuda")
