"""The decode projections (``kernels/dsv4lab_kernels/fp8_gemv.py``, issue 17): the own GEMV's routes against the exact reference
within the analytic bound, its fused activation quantization bit for bit, the cuBLAS form, and the backend
following the dispatch between them (:mod:`dsv4lab.engine.dispatch`; the tuned file itself: ``tests/test_dispatch.py``).

Bound per output (:mod:`dsv4lab.tools.verify.bounds`): ``|out − ref| ≤ γ(c·K)·Σ_k|xq_k·w_k| + 1 ulp(out dtype)``, the
reduction length ``K`` (per group for ``wo_a``), fp32 accumulation, ``c`` = 1 for the CUDA-core ``fma`` route and
4 for the tensor-core ``dot`` route (aligned, truncated accumulation; see ``ACCUMULATION``). Products are exact in
fp32 (E4M3 × E4M3 and power-of-two scales; bf16 × bf16).

Interpreter tests use irregular shapes (K=192/320: partial 128-blocks; N=72/200: partial row blocks), 1–8 rows,
split-K, and NaN-poisoned memory past every buffer; ``gpu`` tests repeat them at every real projection width.
"""
from __future__ import annotations

import json

import pytest
import torch

from conftest import in_poisoned, poisoned_x
from dsv4lab.core import quant
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.tools.verify.registry import make_linear

triton = pytest.importorskip("triton")
gemv = pytest.importorskip("dsv4lab_kernels.fp8_gemv")

REF = ReferenceOps(Numerics())
FP8_NAN, E8M0_NAN = 0x7F, 0xFF




def within_bound(out, x, weight, scale, route, act_quant=True, groups=1, out_dtype=torch.bfloat16, name=""):
    """``out`` against the exact reference of ``x @ Wᵀ`` within the route's bound (the benchmark's own check)."""
    from dsv4lab.tools.bench.decode import gemv_bound
    return gemv_bound(out, x, weight, scale, route, act_quant, groups, out_dtype, name)


CASES = [dict(M=1, N=96, K=256, split=1), dict(M=3, N=200, K=192, split=2), dict(M=5, N=72, K=320, split=3),
         dict(M=8, N=130, K=384, split=1)]


@pytest.mark.parametrize("route", gemv.ROUTES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "M{M}N{N}K{K}s{split}".format(**c))
def test_fp8_gemv_within_bound_and_never_reads_padding(route, case):
    M, N, K = case["M"], case["N"], case["K"]
    g = torch.Generator().manual_seed(M * N + len(route))
    lin = make_linear("fp8", N, K, g)
    x = poisoned_x((torch.randn(M, K, generator=g) * 3).to(torch.bfloat16))
    w = in_poisoned(lin.weight, FP8_NAN)
    s = in_poisoned(lin.scale, E8M0_NAN)
    geo = gemv.GemvGeometry(block_n=32, block_k=128, split_k=case["split"])
    out = gemv.fp8_gemv(x, w, s, act_quant=True, route=route, geometry=geo)
    res = within_bound(out, x, lin.weight, lin.scale, route)
    assert res.ok, res.line()


@pytest.mark.parametrize("route,geo", [("fma", dict(unroll=2)), ("fma", dict(unroll=3, block_n=8)),
                                       ("dot", dict(prequant=True)), ("dot", dict(prequant=True, block_n=64))],
                         ids=["fma-unroll2", "fma-unroll3", "dot-prequant", "dot-prequant-n64"])
@pytest.mark.parametrize("case", CASES[1:], ids=lambda c: "M{M}N{N}K{K}s{split}".format(**c))
def test_fp8_gemv_unrolled_and_prequantized_within_bound(route, geo, case):
    """``unroll`` (several tiles per loop step, the last ones past a split's end reading nothing) and ``prequant``
    (the rows quantized once by :func:`act_quant_fp8`, then read by every program) — same bound, padding unread."""
    M, N, K = case["M"], case["N"], case["K"]
    g = torch.Generator().manual_seed(M * N + 7)
    lin = make_linear("fp8", N, K, g)
    x = poisoned_x((torch.randn(M, K, generator=g) * 3).to(torch.bfloat16))
    w, s = in_poisoned(lin.weight, FP8_NAN), in_poisoned(lin.scale, E8M0_NAN)
    kw = dict(block_n=32, block_k=128, split_k=case["split"]) | geo
    out = gemv.fp8_gemv(x, w, s, act_quant=True, route=route, geometry=gemv.GemvGeometry(**kw))
    res = within_bound(out, x, lin.weight, lin.scale, route)
    assert res.ok, res.line()


@pytest.mark.parametrize("route", gemv.ROUTES)
@pytest.mark.parametrize("fmt,sizes,split", [("fp8", (256, 128, 384), 2), ("bf16", (96, 32, 64, 160), 1)])
def test_segments_are_the_projections_side_by_side(route, fmt, sizes, split):
    """Projections of one input stored one after the other (``segments``): one launch returns each projection as
    its own contiguous output, bit for bit what the projection alone gives with the same geometry, at 1 and 3 rows."""
    g = torch.Generator().manual_seed(len(sizes) + split)
    K = 320
    lins = [make_linear(fmt, n, K, g) for n in sizes]
    w = in_poisoned(torch.cat([lin.weight for lin in lins]), FP8_NAN if fmt == "fp8" else 0xFF)
    s = in_poisoned(torch.cat([lin.scale for lin in lins]), E8M0_NAN) if fmt == "fp8" else None
    geo = gemv.GemvGeometry(block_n=32, block_k=128, split_k=split)
    out_dtype = torch.bfloat16 if fmt == "fp8" else torch.float32
    for M in (1, 3):
        x = poisoned_x((torch.randn(M, K, generator=g) * 3).to(torch.bfloat16))
        outs = gemv.fp8_gemv(x, w, s, fmt == "fp8", out_dtype, route=route, geometry=geo, segments=sizes)
        assert len(outs) == len(sizes)
        for o, lin in zip(outs, lins):
            alone = gemv.fp8_gemv(x, lin.weight, lin.scale if fmt == "fp8" else None, fmt == "fp8", out_dtype,
                                  route=route, geometry=geo)
            assert o.is_contiguous() and o.shape == alone.shape and torch.equal(o, alone)
    with pytest.raises(ValueError, match="segments"):
        gemv.fp8_gemv(x, w, s, fmt == "fp8", out_dtype, route=route, geometry=geo, segments=(1,) * 5)


@pytest.mark.parametrize("route", gemv.ROUTES)
def test_grouped_wo_a_and_bf16_weights(route):
    g = torch.Generator().manual_seed(1)
    G, R, in_g = 3, 32, 192
    wo_a = make_linear("fp8", G * R, in_g, g, act_quant=False)
    o = torch.randn(2, 1, G, in_g, generator=g).to(torch.bfloat16)
    y = gemv.fp8_gemv(o.flatten(-2), wo_a.weight, wo_a.scale, act_quant=False, groups=G, route=route,
                      geometry=gemv.GemvGeometry(block_n=16, block_k=128, split_k=2))
    res = within_bound(y, o.flatten(-2), wo_a.weight, wo_a.scale, route, act_quant=False, groups=G)
    assert res.ok, res.line()
    head = make_linear("bf16", 130, 96, g)  # an fp32 projection of a BF16 weight (router, compressor, head)
    x = torch.randn(3, 96, generator=g).to(torch.bfloat16)
    y = gemv.fp8_gemv(x, head.weight, None, act_quant=False, out_dtype=torch.float32, route=route,
                      geometry=gemv.GemvGeometry(block_n=64, block_k=128, split_k=1))
    res = within_bound(y, x, head.weight, None, route, act_quant=False, out_dtype=torch.float32)
    assert res.ok, res.line()


def test_the_bound_catches_a_dropped_block():
    """Negative control: the kernel run without the last 64 features of K (a truncated loop) fails the check."""
    g = torch.Generator().manual_seed(2)
    lin = make_linear("fp8", 72, 320, g)
    x = (torch.randn(3, 320, generator=g) * 3).to(torch.bfloat16)
    short = x.clone()
    short[:, -64:] = 0
    out = gemv.fp8_gemv(short, lin.weight, lin.scale, route="dot", geometry=gemv.GemvGeometry(block_k=128))
    res = within_bound(out, x, lin.weight, lin.scale, "dot")
    assert not res.ok and res.n_violations > 0


def test_activation_quantization_is_the_references_bit_for_bit():
    """The device quantizer (the GEMV prologue and the cuBLAS form share it) against ``quant.act_qdq_fp8``:
    ties, values at the E4M3 grid's edges, tiny and huge blocks, a partial last block, zero rows of padding."""
    g = torch.Generator().manual_seed(0)
    M, K = 5, 320
    x = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-20, 12, (M, 1), generator=g).float())
    x[0, :8] = torch.tensor([448.0, -448.0, 0.0, -0.0, 1e-30, 240.0, 232.0, 239.9])
    x[1, :128] = 0.0  # an all-zero block: amax floored at 1e-4
    x = x.to(torch.bfloat16)
    q, s = gemv.act_quant_fp8(x, rows=8)
    assert q.shape == (8, K) and s.shape == (8, 3) and s.stride() == (1, 8)  # outer-dim-major, as cuBLAS wants
    got = q.float() * s.repeat_interleave(128, 1)[:, :K]
    assert torch.equal(got[:M], quant.act_qdq_fp8(x))
    assert torch.equal(q[M:].float(), torch.zeros(8 - M, K)) and torch.equal(s[M:], torch.ones(8 - M, 3))


def test_split_k_is_deterministic_and_split_independent_in_bound():
    g = torch.Generator().manual_seed(3)
    lin = make_linear("fp8", 64, 640, g)
    x = (torch.randn(2, 640, generator=g)).to(torch.bfloat16)
    outs = [gemv.fp8_gemv(x, lin.weight, lin.scale, route="fma",
                          geometry=gemv.GemvGeometry(block_n=32, block_k=128, split_k=s)) for s in (1, 2, 5, 5)]
    assert torch.equal(outs[2], outs[3])  # same split: the same bits, always (whichever program finishes)
    assert not gemv.counters(x.device, 1).any(), "a split launch left a ticket counter non-zero"
    for o in outs:
        res = within_bound(o, x, lin.weight, lin.scale, "fma")
        assert res.ok, res.line()


def test_bad_arguments_are_clear_errors():
    g = torch.Generator().manual_seed(4)
    lin = make_linear("fp8", 64, 256, g)
    x = torch.randn(1, 256, generator=g).to(torch.bfloat16)
    with pytest.raises(ValueError, match="unknown route"):
        gemv.fp8_gemv(x, lin.weight, lin.scale, route="mfma")
    with pytest.raises(ValueError, match="multiple of 128"):
        gemv.fp8_gemv(x, lin.weight, lin.scale, geometry=gemv.GemvGeometry(block_k=192))
    with pytest.raises(ValueError, match="features"):
        gemv.fp8_gemv(x[:, :128], lin.weight, lin.scale)
    with pytest.raises(ValueError, match="128×128"):
        gemv.fp8_gemv(x, lin.weight, lin.scale[:, :1])


# ------------------------------------------------------------------------------------------ the dispatch
def _tuned(**ops):
    from dsv4lab.engine.dispatch import SCHEMA, Tuned
    return Tuned(dict(schema=SCHEMA, gpu="NVIDIA H200", sources={"t": dict(commit="abc")}, ops=ops), "test.json")


def test_backend_follows_the_dispatch():
    """A tuned entry selects the route and geometry the backend launches (the result stays within bound);
    without one the documented default (the dot route, K split to ~2 programs per SM) runs."""
    from dsv4lab.engine.dispatch import GPU_DEFAULTS, Dispatch, shape_key
    from dsv4lab.engine.triton_backend import TritonOps
    tuned = _tuned(**{"decode.gemv": [dict(shape=shape_key(96, 256, 1, "fp8", True), rows=1, source="t", choice=dict(
        impl="triton", route="fma", block_n=16, block_k=128, split_k=2))],
        "decode.moe": [dict(rows=4, source="t", choice=dict(route="fma", block_n_up=32, block_k=256))]})
    ops = TritonOps(Numerics(), Dispatch(tuned, GPU_DEFAULTS))
    impl, route, geo = ops.gemv_choice(96, 256, 1)
    assert (impl, route, geo.split_k, geo.block_n) == ("triton", "fma", 2, 16)
    impl, route, geo = TritonOps(Numerics(), Dispatch(None, GPU_DEFAULTS)).gemv_choice(96, 256, 1)
    assert (impl, route) == ("triton", "dot") and geo.split_k >= 1
    assert ops.moe_choice(3)[0] == "fma" and ops.moe_choice(3)[1].block_n_up == 32
    g = torch.Generator().manual_seed(5)
    lin = make_linear("fp8", 96, 256, g)
    x = torch.randn(1, 256, generator=g).to(torch.bfloat16)
    res = within_bound(ops.linear(x, lin), x, lin.weight, lin.scale, "fma")
    assert res.ok, res.line()


def test_accumulation_probe_separates_fp32_from_a_narrow_accumulator():
    """The probe the benchmark runs on cuBLAS: an fp32 sum passes the bound, a 13-bit-mantissa accumulator (what
    Hopper's FP8 tensor cores keep) fails it, and the kernels pass it."""
    from dsv4lab.tools.bench.decode import accumulation_probe
    x, w, s = accumulation_probe(64, 1024, 1, "cpu")
    exact = gemv.reference_fp8_gemv(x, w, s, True, torch.float64)
    assert torch.allclose(exact, torch.full_like(exact, 8 * 127 * 2.0 ** -9))
    assert within_bound(exact.float().bfloat16(), x, w, s, "fma").ok
    wd = quant.fp8_block_dequant(w, s, torch.float64)

    def narrow(v):  # round to 13 significant bits toward zero, as a reduced-precision accumulator
        m, e = torch.frexp(v)
        return torch.ldexp(torch.trunc(m * 2 ** 13) / 2 ** 13, e)
    acc = torch.zeros(64, dtype=torch.float64)
    for k in range(1024):
        acc = narrow(acc + wd[:, k])
    res = within_bound(acc[None].float().bfloat16(), x, w, s, "dot")
    assert not res.ok
    for route in gemv.ROUTES:
        res = within_bound(gemv.fp8_gemv(x, w, s, route=route), x, w, s, route)
        assert res.ok, res.line()


# ------------------------------------------------------------------------------------------ GPU, real widths
def _projections():
    from dsv4lab.core.config import get_preset
    from dsv4lab.tools.bench.decode import projections
    return projections(get_preset("flash"))


@pytest.mark.gpu
@pytest.mark.parametrize("route", gemv.ROUTES)
@pytest.mark.parametrize("M", [1, 4, 8])
def test_gpu_every_projection_within_bound(route, M):
    from dsv4lab.tools.bench.common import random_fp8_linear
    gen = torch.Generator(device="cuda").manual_seed(M)
    for name, (N, Kg, G, aq) in _projections().items():
        lin = random_fp8_linear(N, Kg, "cuda", gen, act_quant=aq)
        x = (torch.randn(M, Kg * G, device="cuda", generator=gen) * 2).to(torch.bfloat16)
        out = gemv.fp8_gemv(x, lin.weight, lin.scale, aq, groups=G, route=route,
                            geometry=gemv.GemvGeometry(block_n=32, block_k=256, split_k=4))
        res = within_bound(out, x, lin.weight, lin.scale, route, aq, G, name=f"{name}[{route}] M={M}")
        assert res.ok, res.line()


@pytest.mark.gpu
def test_gpu_dispatch_choices_hold_their_bound():
    """Every cuBLAS choice in this GPU's tuned file is within the bound of the own kernel it replaces (the
    tensor-core bound γ(4K)), on fresh inputs — the file was written by a run that checked it."""
    from dsv4lab.engine.dispatch import parse_shape_key, tuned_path
    from dsv4lab.tools.bench.common import random_fp8_linear
    path = tuned_path(torch.cuda.get_device_name())
    if not path.exists():
        pytest.skip(f"no tuned file {path.name} for this GPU")
    doc = json.loads(path.read_text())
    gen = torch.Generator(device="cuda").manual_seed(9)
    for e in doc["ops"].get("decode.gemv", []):
        if e["choice"]["impl"] != "cublas":
            continue
        n, k, _, weight, aq = parse_shape_key(e["shape"])
        lin = random_fp8_linear(n, k, "cuda", gen, act_quant=aq)
        if weight == "bf16":
            lin._buffers["weight"] = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
            lin._buffers["scale"] = None
        x = (torch.randn(e["rows"], k, device="cuda", generator=gen) * 2).to(torch.bfloat16)
        out_dtype = torch.float32 if weight == "bf16" else torch.bfloat16
        mm_out = torch.bfloat16 if e["choice"].get("cublas_out") == "bfloat16" else torch.float32
        out = gemv.cublas_linear(x, lin.weight, lin.scale, aq, out_dtype, mm_out_dtype=mm_out)
        res = within_bound(out, x, lin.weight, lin.scale, "dot", aq, out_dtype=out_dtype, name=f"cublas {e['shape']}")
        assert res.ok, res.line()


@pytest.mark.gpu
def test_gpu_graph_replay_equals_eager():
    g = torch.Generator().manual_seed(6)
    lin = make_linear("fp8", 4096, 8192, g)
    w, s = lin.weight.cuda(), lin.scale.cuda()
    x = torch.randn(3, 8192, generator=g).to(torch.bfloat16).cuda()
    geo = gemv.GemvGeometry(block_n=32, block_k=256, split_k=8)
    eager = gemv.fp8_gemv(x, w, s, route="dot", geometry=geo)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv.fp8_gemv(x, w, s, route="dot", geometry=geo)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
