"""The glue of a prefill chunk (issue 18, round 2): the stand-alone RoPE kernel (the attention output's inverse
rotation; the compressor entries go through the window KV's and the indexer queries' fused kernels) and the mHC
rows kernel (the mix of many rows as a GEMM in fp64), against the reference compositions they replace.

Both evaluate the reference's formula with its rounding points, so under the interpreter (numpy's fp64) the outputs
are bit-identical to the reference and to the decode step's kernels; on a GPU (the ``gpu`` cases, Flash widths)
they are within the per-op bounds of ``kernels/dsv4lab_kernels/norm_rope_quant.py`` and ``kernels/dsv4lab_kernels/mhc.py``. Inputs are random,
shapes irregular (row counts that are not multiples of the row block, widths that are not multiples of the column
step), the memory past every input NaN-poisoned.
"""
from __future__ import annotations

import pytest
import torch

from dsv4lab.core.config import get_preset
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.core.model.rope import rope_table
from test_kernels_glue import DEV, GPU, _mhc_bounds, _mhc_inputs, _poisoned, assert_bound

pytest.importorskip("triton")
mhc = pytest.importorskip("dsv4lab_kernels.mhc")
nrq = pytest.importorskip("dsv4lab_kernels.norm_rope_quant")

TINY = get_preset("tiny")


def _ref(dtype=torch.bfloat16) -> ReferenceOps:
    return ReferenceOps(Numerics(dtype=dtype))


# ------------------------------------------------------------------------------------------ RoPE
@pytest.mark.parametrize("dtype,inverse", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, True)])
def test_rope_rows_attention_output_pattern(dtype, inverse):
    """``o [b, n, H, d]`` with ``cos [b, n, 1, r/2]``: every head of a token shares its angles (5 heads: not a
    power of two; d = 96 with 64 rotated dims)."""
    g = torch.Generator().manual_seed(int(inverse))
    cos, sin = rope_table(TINY, 1, 400)
    pos = torch.randint(0, 400, (2, 7), generator=g)
    o = _poisoned((torch.randn(2, 7, 5, 96, generator=g) * 3).to(dtype))
    c, s = cos[pos][:, :, None], sin[pos][:, :, None]
    ref = _ref(dtype).rope(o.cpu(), c, s, inverse=inverse)
    out = nrq.rope_rows(o, c.to(DEV), s.to(DEV), inverse)
    # the separately rounded fp32 rotation of torch, then one rounding to the activation dtype: 1 ulp
    assert_bound("rope (attention output)", out, ref, out_dtype=dtype)
    assert torch.equal(out.cpu()[..., :32], o.cpu()[..., :32])  # the non-rope dims are copied


def test_rope_rows_compressor_pattern_and_unsupported_broadcasts():
    g = torch.Generator().manual_seed(5)
    cos, sin = rope_table(TINY, 2, 300)
    e = _poisoned(torch.randn(11, 96, generator=g).to(torch.bfloat16))
    rpos = torch.arange(11) * 4
    ref = _ref().rope(e.cpu(), cos[rpos], sin[rpos])
    assert_bound("rope (compressed entries)", nrq.rope_rows(e, cos[rpos].to(DEV), sin[rpos].to(DEV)), ref,
                 out_dtype=torch.bfloat16)
    # angles that vary along a later dim than an earlier broadcast one, or fewer dims: the reference's job
    q = torch.randn(3, 4, 96).to(torch.bfloat16).to(DEV)
    assert nrq.rope_rows(q, cos[:4][None].expand(1, 4, -1).to(DEV), sin[:4][None].expand(1, 4, -1).to(DEV)) is None
    assert nrq.rope_rows(q, cos[:4].to(DEV), sin[:4].to(DEV)) is None


# ------------------------------------------------------------------------------------------ mHC rows kernel
@pytest.mark.parametrize("rows,D,dtype", [(77, 160, torch.bfloat16), (40, 96, torch.float32)])
def test_mhc_rows_kernel_equals_the_reference_and_the_decode_kernel(rows, D, dtype):
    g = torch.Generator().manual_seed(rows + D)
    a, X, fn, base, scale, w = _mhc_inputs(rows, D, g, dtype)
    ops = _ref(dtype)
    cpu = lambda *t: [v.cpu() for v in t]  # noqa: E731
    it, ne, he = a.hc_sinkhorn_iters, a.norm_eps, a.hc_eps
    ref = ops.hc_pre_norm(*cpu(X, fn, base, scale, w), a)
    out = mhc.hc_pre_norm_rows(X, fn, base, scale, w, it, ne, he)
    _mhc_bounds("hc_pre_norm_rows", out, ref, dtype)
    h = _poisoned(torch.randn(rows, 1, D, generator=g).to(dtype))
    post, comb = ref[1].to(DEV), ref[2].to(DEV)
    ref2 = ops.hc_post_pre_norm(*cpu(h, X, post, comb, fn, base, scale, w), a)
    out2 = mhc.hc_post_pre_norm_rows(h, X, post, comb, fn, base, scale, w, it, ne, he)
    _mhc_bounds("hc_post_pre_norm_rows", out2, ref2, dtype)
    assert_bound("hc_post_rows", mhc.hc_post_rows(h, X, post, comb), ops.hc_post(*cpu(h, X, post, comb)),
                 out_dtype=dtype)
    # the decode step's kernels compute the same fp64 sums in another order: the same bits
    dec = mhc.hc_post_pre_norm(h, X, post, comb, fn, base, scale, w, it, ne, he)
    if not GPU:
        assert all(torch.equal(u, v) for u, v in zip(out2, dec))


def test_mhc_rows_kernel_with_two_streams():
    """The rows kernel's post step has a four-stream path (every preset) and a general one: the general one, with
    two streams, against the reference and the decode step's kernels."""
    g = torch.Generator().manual_seed(21)
    a = get_preset("tiny").replace(dim=96, hc_mult=2)
    X = _poisoned((torch.randn(70, 1, 2, 96, generator=g) * 2).to(torch.bfloat16))
    fn = _poisoned(torch.randn(a.mix_hc, a.hc_dim, generator=g) * a.hc_dim ** -0.5)
    base, scale = torch.randn(a.mix_hc, generator=g).to(DEV) * 0.5, (torch.rand(3, generator=g) + 0.5).to(DEV)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(DEV)
    h = _poisoned(torch.randn(70, 1, 96, generator=g).to(torch.bfloat16))
    cpu = lambda *t: [v.cpu() for v in t]  # noqa: E731
    it, ne, he = a.hc_sinkhorn_iters, a.norm_eps, a.hc_eps
    ref = _ref().hc_pre_norm(*cpu(X, fn, base, scale, w), a)
    post, comb = ref[1].to(DEV), ref[2].to(DEV)
    ref2 = _ref().hc_post_pre_norm(*cpu(h, X, post, comb, fn, base, scale, w), a)
    out2 = mhc.hc_post_pre_norm_rows(h, X, post, comb, fn, base, scale, w, it, ne, he)
    _mhc_bounds("hc_post_pre_norm_rows, two streams", out2, ref2, torch.bfloat16)
    assert_bound("hc_post_rows, two streams", mhc.hc_post_rows(h, X, post, comb),
                 _ref().hc_post(*cpu(h, X, post, comb)), out_dtype=torch.bfloat16)
    if not GPU:
        dec = mhc.hc_post_pre_norm(h, X, post, comb, fn, base, scale, w, it, ne, he)
        assert all(torch.equal(u, v) for u, v in zip(out2, dec))


def test_mhc_rows_geometries_agree():
    """Row blocks, column steps and splits over D change only the fp64 summation order: the same bits."""
    g = torch.Generator().manual_seed(9)
    a, X, fn, base, scale, w = _mhc_inputs(70, 160, g)
    outs = [mhc.hc_pre_norm_rows(X, fn, base, scale, w, a.hc_sinkhorn_iters, a.norm_eps, a.hc_eps,
                                 geometry=mhc.MhcRowsGeometry(block_m=bm, block_d=bd, splits=sp))
            for bm, bd, sp in ((16, 16, 1), (32, 32, 3), (64, 64, 2), (16, 32, 7))]
    for o in outs[1:]:
        assert all(torch.equal(u, v) for u, v in zip(o, outs[0]))


def test_prefill_dispatch_runs_mhc_on_the_rows_kernel_from_the_threshold():
    """Switched on, the rows kernel takes a chunk from the threshold; by default (nothing measured) it does not —
    the default without a measured choice is the decode step's mix/finish pair."""
    from dsv4lab.engine.triton_prefill import TritonPrefillBackend
    g = torch.Generator().manual_seed(3)
    a, X, fn, base, scale, w = _mhc_inputs(70, 96, g)
    default = TritonPrefillBackend(Numerics(), min_tokens=64)
    default.hc_pre_norm(X, fn, base, scale, w, a)
    assert default.kernel_runs["hc_pre_norm"] == 0 and default.fallbacks["hc_pre_norm"] == 1
    ops = TritonPrefillBackend(Numerics(), min_tokens=64, mhc_rows=True)
    got = ops.hc_pre_norm(X, fn, base, scale, w, a)
    assert ops.kernel_runs["hc_pre_norm"] == 1
    ref = _ref().hc_pre_norm(*[t.cpu() for t in (X, fn, base, scale, w)], a)
    _mhc_bounds("dispatched hc_pre_norm", got, ref, torch.bfloat16)
    ops.hc_pre_norm(X[:40], fn, base, scale, w, a)  # 40 rows: under the threshold
    assert ops.fallbacks["hc_pre_norm"] == 1
    ops.prefill_mhc_rows = False  # switched off (by measurement): the decode kernels / reference
    ops.hc_post(X[:, :, 0], X, got[1], got[2])
    assert ops.fallbacks["hc_post"] == 1


@pytest.mark.gpu
def test_gpu_mhc_rows_kernel_at_flash_width():
    """4,100 rows at D = 4,096 (the prefill shape): the rows kernel compiles here and agrees with the reference
    within the bounds; its probe reports it working."""
    g = torch.Generator().manual_seed(11)
    a, X, fn, base, scale, w = _mhc_inputs(4100, 4096, g)
    assert mhc.rows_kernel_works(DEV), mhc.rows_kernel_status(DEV)
    ref = _ref().hc_pre_norm(*[t.cpu() for t in (X, fn, base, scale, w)], a)
    _mhc_bounds("hc_pre_norm_rows (flash)", mhc.hc_pre_norm_rows(X, fn, base, scale, w, a.hc_sinkhorn_iters,
                                                                 a.norm_eps, a.hc_eps), ref, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_rope_rows_attention_output_at_flash_width():
    g = torch.Generator().manual_seed(12)
    flash = get_preset("flash")
    cos, sin = rope_table(flash, 2, 5000)
    pos = torch.arange(4100)[None]
    o = torch.randn(1, 4100, 64, 512, generator=g).to(torch.bfloat16)
    c, s = cos[pos][:, :, None], sin[pos][:, :, None]
    ref = _ref().rope(o, c, s, inverse=True)
    assert_bound("rope (flash attention output)", nrq.rope_rows(o.to(DEV), c.to(DEV), s.to(DEV), True), ref,
                 out_dtype=torch.bfloat16)
