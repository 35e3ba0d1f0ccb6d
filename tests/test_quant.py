"""Number formats: bit-exact codecs and properties of the quantizers (spec §2.3)."""
import math

import pytest
import torch

from dsv4lab.core import quant

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_e2m1_all_16_codes_decode_and_encode_exactly():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = quant.e2m1_decode(codes)
    assert vals.tolist() == E2M1
    # sign bit of -0 is kept
    assert torch.signbit(vals[8])
    assert quant.e2m1_encode(vals).tolist() == list(range(16))


def test_e2m1_rounding_ties_to_even_and_saturation():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -0.25, -5.0, 0.26, 5.01])
    expect = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.0, -4.0, 0.5, 6.0]
    assert quant.e2m1_decode(quant.e2m1_encode(x)).tolist() == expect


def test_e2m1_encode_rejects_nan():
    with pytest.raises(quant.QuantError):
        quant.e2m1_encode(torch.tensor([1.0, float("nan")]))


def test_e8m0_all_256_bytes():
    b = torch.arange(256, dtype=torch.uint8)
    v = quant.e8m0_decode(b, torch.float64)
    for i in range(255):
        assert v[i].item() == math.ldexp(1.0, i - 127), i
    assert math.isnan(v[255].item())
    # agrees with torch's own float8_e8m0fnu conversion
    t = b.view(torch.float8_e8m0fnu).to(torch.float32)
    assert torch.equal(torch.isnan(t), torch.isnan(v.float()))
    assert torch.equal(t[:255], v[:255].float())
    assert quant.e8m0_from_exponent(torch.arange(-127, 128)).view(torch.uint8).tolist() == list(range(255))


def test_check_scale_names_tensor_and_position():
    s = torch.full((3, 4), 127, dtype=torch.uint8)
    s[2, 1] = 255
    with pytest.raises(quant.QuantError, match=r"layers\.0\.x\.scale.*\[2, 1\]"):
        quant.check_scale(s.view(torch.float8_e8m0fnu), "layers.0.x.scale")


def test_pack_unpack_round_trip_and_nibble_order():
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    packed = quant.pack_fp4(codes)
    assert packed.shape == (7, 32)
    assert torch.equal(packed & 0xF, codes[:, 0::2])  # even element in the low nibble
    assert torch.equal(packed >> 4, codes[:, 1::2])
    assert torch.equal(quant.unpack_fp4(packed.view(torch.int8)), codes)
    # same bytes as torch's float4_e2m1fn_x2 storage
    assert torch.equal(quant.unpack_fp4(packed.view(torch.float4_e2m1fn_x2)), codes)


@pytest.mark.parametrize("n,k", [(33, 64), (5, 224), (128, 4096 // 16)])
def test_fp4_quantize_properties(n, k):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-6, 6, (n, k // 32), generator=g)).repeat_interleave(32, 1)
    packed, scale = quant.fp4_quantize(w)
    assert packed.dtype == torch.int8 and packed.shape == (n, k // 2)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (n, k // 32)
    deq = quant.fp4_dequant(packed, scale)
    s = quant.e8m0_decode(scale).repeat_interleave(32, 1)
    # every element within half a grid step (the widest E2M1 step is 2) of its scaled value
    assert ((deq - w).abs() <= s * 1.0 + 1e-12).all()
    # each group's max hits the top of the range or close to it (scale = 2^ceil(log2(amax/6)))
    amax = w.reshape(n, -1, 32).abs().amax(-1)
    assert ((amax / quant.e8m0_decode(scale)) > 3.0 - 1e-6).all() and ((amax / quant.e8m0_decode(scale)) <= 6.0).all()
    # requantizing the dequantized weight is exact
    p2, s2 = quant.fp4_quantize(deq)
    assert torch.equal(quant.fp4_dequant(p2, s2), deq)


@pytest.mark.parametrize("n,k", [(128, 256), (200, 300), (1, 129)])
def test_fp8_block_quant_partial_blocks(n, k):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g)
    q, s = quant.fp8_block_quantize(w)
    assert s.shape == (math.ceil(n / 128), math.ceil(k / 128))
    deq = quant.fp8_block_dequant(q, s)
    rel = (deq - w).abs() / w.abs().clamp_min(1e-3)
    assert rel.max() < 2 ** -3  # e4m3 has 3 mantissa bits
    assert torch.equal(quant.fp8_block_dequant(*quant.fp8_block_quantize(deq)), deq)
    with pytest.raises(quant.QuantError, match="needs scale"):
        quant.fp8_block_dequant(q, s[:, :1] if s.shape[1] > 1 else s[:0])


def test_act_quant_fp8_power_of_two_scales_and_error():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 3, 256, generator=g) * 10).to(torch.bfloat16)
    q, s = quant.act_quant_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (4, 3, 2)
    m, e = torch.frexp(s)
    assert (m == 0.5).all()  # exact powers of two
    blocks = x.float().reshape(4, 3, 2, 128)
    assert ((blocks.abs().amax(-1) / s) <= 448).all() and ((blocks.abs().amax(-1) / s) > 224).all()
    deq = quant.act_qdq_fp8(x)
    assert ((deq - x.float()).abs() <= x.float().abs() * 2 ** -4 + s.repeat_interleave(128, -1) * 2 ** -9).all()
    # partial last block (width not a multiple of 128)
    y = torch.randn(2, 192, generator=g)
    qy, sy = quant.act_quant_fp8(y)
    assert qy.shape == (2, 192) and sy.shape == (2, 2)
    assert torch.allclose(quant.act_qdq_fp8(y), y, rtol=2 ** -3, atol=1e-3)


def test_act_qdq_fp8_is_idempotent():
    """A consumer that quantizes its input gives the same bits on ``x`` and on ``act_qdq_fp8(x)`` (what lets a
    producer hand a quantized copy to such a consumer: docs/kernels_decode.md, the MoE input's quantization). The
    cases where the scale changes on the second pass are in: a block whose maximum rounds down to 224·s (the scale halves,
    every value doubles exactly), blocks of subnormal E4M3 values, blocks under the 1e-4 amax floor, NaN."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4 * 128, generator=g) * torch.exp2(torch.randint(-30, 20, (64, 1), generator=g).float())
    x[0, :128] = torch.linspace(-1, 1, 128) * 225 * 2.0 ** -5  # max 225·s (s = 2^-5) rounds to 224·s: the scale halves
    x[1, :128] *= 2.0 ** -12  # most values subnormal in E4M3 after the scale
    x[2, 128:256] = torch.randn(128, generator=g) * 1e-7  # under the amax floor
    x[3, 7] = float("nan")
    for xs in (x.to(torch.bfloat16).float(), x):
        once = quant.act_qdq_fp8(xs)
        twice = quant.act_qdq_fp8(once)
        assert torch.equal(once.isnan(), twice.isnan())
        assert torch.equal(once.nan_to_num(), twice.nan_to_num())
    _, s0 = quant.act_quant_fp8(x[:1])
    _, s1 = quant.act_quant_fp8(quant.act_qdq_fp8(x[:1]))
    assert s1[0, 0] == s0[0, 0] / 2 and torch.equal(s1[0, 1:], s0[0, 1:])  # the halving case is exercised


def test_kv_and_indexer_simulations():
    g = torch.Generator().manual_seed(1)
    v = torch.randn(5, 448, generator=g).to(torch.bfloat16)
    out = quant.fp8_qdq(v, 64)
    assert out.dtype == torch.bfloat16 and not torch.equal(out, v)
    assert torch.allclose(out.float(), v.float(), rtol=2 ** -3, atol=1e-2)
    f = quant.fp4_qdq(torch.randn(5, 128, generator=g), 32)
    sc = quant.pow2_scale(torch.randn(5, 128, generator=g).abs().amax(-1), 6.0)
    assert f.shape == (5, 128)
    # every value is an E2M1 grid point times its block's power-of-two scale
    blk = f.reshape(5, 4, 32)
    s = quant.pow2_scale(blk.abs().amax(-1).clamp_min(6 * 2 ** -126), 6.0)
    grid = torch.tensor(sorted(set(abs(v) for v in E2M1)))
    assert torch.isin((blk / s[..., None]).abs(), grid).all()
    assert sc.shape == (5,)


def test_int8_per32_route_and_times2_table():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 96, generator=g)
    q, s = quant.act_quant_int8(x)
    assert q.dtype == torch.int8 and s.shape == (3, 3)
    deq = q.float().reshape(3, 3, 32) * s[..., None]
    assert ((deq.flatten(-2) - x).abs() <= s.repeat_interleave(32, -1) * 0.5 + 1e-7).all()
    assert [2 * v for v in E2M1] == [float(v) for v in quant.E2M1_TIMES2_INT8]


def test_hadamard_is_orthonormal_and_matches_definition():
    h = quant.hadamard_matrix(128, torch.float64)
    assert torch.equal(h @ h.T, 128 * torch.eye(128, dtype=torch.float64))
    assert h[0].eq(1).all() and h[:, 0].eq(1).all() and h[1, 1] == -1
    x = torch.randn(4, 128, dtype=torch.float64)
    assert torch.allclose(quant.hadamard_transform(quant.hadamard_transform(x)), x)
    with pytest.raises(quant.QuantError):
        quant.hadamard_matrix(96)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")])])
def test_scales_are_correctly_rounded_quotients_on_every_device(device):
    # fp32 quotients rounded once (via fp64: 53 ≥ 2·24 + 2 bits, so no double-rounding error); a device whose
    # divide-by-scalar multiplies by the reciprocal is off by one ulp for ~5% of these
    g = torch.Generator().manual_seed(0)
    amax = (torch.rand(1 << 16, generator=g) * 8 + 1e-3).to(device)
    for d in (127.0, 448.0, 6.0):
        want = (amax.double().cpu() / d).float().to(device)  # on the CPU: a true division
        assert torch.equal(quant.div_exact(amax, d), want), d
    x = (torch.randn(64, 256, generator=g) * 3).to(device)
    q, s = quant.act_quant_int8(x, 32)
    assert torch.equal(s, (x.view(64, 8, 32).abs().amax(-1).clamp_min(1e-8).double().cpu() / 127).float().to(device))
    assert torch.equal(q, torch.round(x.view(64, 8, 32) / s[..., None]).clamp(-127, 127).to(torch.int8).view(64, 256))
