"""The reference's last rounding differences from DeepSeek's code (issue 23): the sparse attention's online-softmax
rounding of P per 64-index block, the window listed oldest first, and DeepSeek's YaRN expression."""
import math

import pytest
import torch

from dsv4lab.core.random_checkpoint import RandomCheckpoint
from dsv4lab.core.config import get_preset
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.core.model.rope import rope_frequencies
from dsv4lab.tools.verify.bounds import check_within_bound
from dsv4lab.tools.verify.registry import _make_attention

NM = Numerics()  # bf16, every simulation on, attention_block 64


def _exp32(x):
    """fp32 exp, correctly rounded (the reference's convention for a transcendental)."""
    return torch.exp(x.double()).float()


def deepseek_sparse_attn(q, kv, idx, sink, scale, block=64):
    """A transcription of DeepSeek's tilelang ``sparse_attn_kernel`` for one head block per query: blocks of
    ``block`` indices in order, fp32 running max / sum / output accumulators rescaled as the max grows, the
    probabilities cast to bf16 before P·V. Scores are the exact dot product rounded to fp32 (the kernel's MMA
    order would move them by fp32 rounding, a separate effect)."""
    b, s, h, d = q.shape
    k = idx.shape[-1]
    out = torch.empty_like(q)
    for bi in range(b):
        for si in range(s):
            acc_o = torch.zeros(h, d)
            sum_exp = torch.zeros(h)
            m = torch.full((h,), float("-inf"))
            for t0 in range(0, k, block):
                ids = idx[bi, si, t0:t0 + block]
                ok = ids >= 0
                kvb = torch.where(ok[:, None], kv[bi, ids.clamp_min(0)].float(), 0.0)
                z = (q[bi, si].double() @ kvb.double().T).float() * scale
                z = torch.where(ok[None, :], z, float("-inf"))
                m_prev, m = m, torch.maximum(m, z.amax(1))
                alpha = _exp32(m_prev - m)
                p = _exp32(z - m[:, None])
                sum_exp = sum_exp * alpha + p.sum(1)
                acc_o = acc_o * alpha[:, None] + p.bfloat16().float() @ kvb
            sum_exp = sum_exp + _exp32(sink.float() - m)
            out[bi, si] = (acc_o / sum_exp[:, None]).to(q.dtype)
    return out


def _case(k, seed, masked=0.3):
    return _make_attention(dict(b=2, s=3, h=4, d=96, n_kv=k + 41, k=k, masked=masked),
                           torch.Generator().manual_seed(seed), "cpu", NM)


def _softmax_magnitude(q, kv, idx, sink, scale):
    """``Σ_t w_t·|kv_t|`` with the exact softmax weights (sink in the denominator), float64 ``[b, s, h, d]``."""
    ok = idx >= 0
    g = torch.where(ok[..., None], torch.gather(kv, 1, idx.clamp_min(0).flatten(1)[..., None].expand(
        -1, -1, kv.shape[-1])).view(*idx.shape, -1).double(), 0.0)
    z = torch.einsum("bshd,bskd->bshk", q.double(), g) * scale
    z = z.masked_fill(~ok[:, :, None], float("-inf"))
    m = z.amax(-1, keepdim=True)
    w = (z - m).exp()
    w = w / (w.sum(-1, keepdim=True) + (sink.double()[None, None, :, None] - m).exp())
    return torch.einsum("bshk,bskd->bshd", w, g.abs())


@pytest.mark.parametrize("k,seed", [(150, 0), (64, 1), (129, 2)])
def test_sparse_attention_rounds_p_like_deepseeks_kernel(k, seed):
    q, kv, idx, sink, scale = _case(k, seed)
    ref = ReferenceOps(NM).sparse_attention(q, kv, idx, sink, scale)
    ds = deepseek_sparse_attn(q, kv, idx, sink, scale)
    # Same P (bf16, against the same running maxima) on both sides: they differ only by the kernel's fp32
    # accumulation — k terms per dot product, one rescaling product and one exp per block, the division — so
    # γ(n = k + 2·blocks + 4, fp32) of Σ w·|kv| (the P·V terms; ×1.01 covers P's bf16 rounding) and of |o|,
    # plus one bf16 ulp for the final rounding.
    nb = math.ceil(k / 64)
    mag = 1.01 * _softmax_magnitude(q, kv, idx, sink, scale) + ref.double().abs()
    res = check_within_bound(ds, ref, mag, terms=k + 2 * nb + 4, acc_dtype=torch.float32,
                             out_dtype=torch.bfloat16, name="deepseek kernel vs reference")
    assert res.ok, res.line()
    # the single-max rounding (the reference before issue 23) is another rounding: it fails that bound
    # whenever more than one block is attended
    old = ReferenceOps(Numerics(attention_block=0)).sparse_attention(q, kv, idx, sink, scale)
    res_old = check_within_bound(ds, old, mag, terms=k + 2 * nb + 4, acc_dtype=torch.float32,
                                 out_dtype=torch.bfloat16)
    assert res_old.ok == (k <= 64), res_old.line()


def test_attention_block_zero_is_the_single_max_formula_and_equal_within_one_block():
    q, kv, idx, sink, scale = _case(150, 3)
    nm = Numerics(attention_block=0)
    # the reference's formula before issue 23, written out
    ok = idx >= 0
    g = torch.where(ok[..., None], torch.gather(kv, 1, idx.clamp_min(0).flatten(1)[..., None].expand(
        -1, -1, 96)).view(2, 3, 150, 96).double(), 0.0)
    z = (torch.einsum("bshd,bskd->bshk", q.double(), g).float() * scale).masked_fill(~ok[:, :, None], -math.inf)
    m = z.amax(-1, keepdim=True)
    e = _exp32(z - m)
    den = e.double().sum(-1, keepdim=True).float() + _exp32(sink.float()[None, None, :, None] - m)
    num = torch.einsum("bshk,bskd->bshd", e.bfloat16().double(), g).float()
    assert torch.equal(ReferenceOps(nm).sparse_attention(q, kv, idx, sink, scale), (num / den).bfloat16())
    q, kv, idx, sink, scale = _case(64, 4)  # one block: both roundings are the same
    assert torch.equal(ReferenceOps(nm).sparse_attention(q, kv, idx, sink, scale),
                       ReferenceOps(NM).sparse_attention(q, kv, idx, sink, scale))


def test_sparse_attention_ignores_masked_slots_anywhere_and_empty_queries_get_zero():
    q, kv, idx, sink, scale = _case(150, 5, masked=0.5)
    idx[0, 0, :64] = -1  # a whole first block masked: the running max starts in the second block
    idx[1, 2, :] = -1    # nothing visible
    out = ReferenceOps(NM).sparse_attention(q, kv, idx, sink, scale)
    assert not torch.isnan(out).any()
    assert torch.equal(out[1, 2], torch.zeros_like(out[1, 2]))
    # DeepSeek's kernel computes exp(−inf − (−inf)) = NaN for a masked first block (its index lists never have
    # one: they start with the window's oldest position); the reference starts the online softmax at the first
    # visible block, i.e. as the kernel does on the list without the masked block
    q1, kv1, idx1 = q[:1, :1], kv[:1], idx[:1, :1]
    assert torch.isnan(deepseek_sparse_attn(q1, kv1, idx1, sink, scale)).all()
    ds = deepseek_sparse_attn(q1, kv1, idx1[..., 64:], sink, scale)
    mag = 1.01 * _softmax_magnitude(q1, kv1, idx1, sink, scale) + out[:1, :1].double().abs()
    res = check_within_bound(ds, out[:1, :1], mag, terms=86 + 4 + 4, acc_dtype=torch.float32,
                             out_dtype=torch.bfloat16)
    assert res.ok, res.line()


def test_window_is_listed_oldest_first_with_the_unfilled_slots_last():
    m = _small_wide_window_model()
    seen = []

    class Spy(ReferenceOps):
        def sparse_attention(self, q, kv, idx, sink, scale):
            seen.append((kv.clone(), idx.clone()))
            return super().sparse_attention(q, kv, idx, sink, scale)

    m.ops = Spy(m.ops.numerics)
    W = m.args.window_size
    m.forward(torch.arange(2, 12)[None], 0)  # positions 0..9: a young sequence
    kv, idx = seen[0]
    for t in (0, 5, 9):
        rows = idx[0, t, :W]
        assert torch.equal(rows[: t + 1], torch.arange(t + 1) + W)  # [hist (W rows); this chunk's kv]
        assert (rows[t + 1:] == -1).all()
    seen.clear()
    m.forward(torch.tensor([[20]]), 10)  # decode: the same list, read from the ring
    kv1, idx1 = seen[0]
    assert torch.equal(kv1[0, idx1[0, 0, :11]], torch.cat((kv[0, W:W + 10], kv1[0, W:W + 1])))
    assert (idx1[0, 0, 11:W] == -1).all()


def _small_wide_window_model(**kw):
    import dsv4lab
    # a window of 80: the window alone spans two 64-index blocks (as Flash's 128 does)
    args = get_preset("tiny").replace(window_size=80, max_seq_len=256)
    return dsv4lab.load(RandomCheckpoint(args, seed=3), max_batch=2, **kw)


def test_decode_equals_prefill_bit_for_bit_across_attention_blocks():
    # bf16 with every simulation on: a 64-index block boundary inside the window and inside the selection, the
    # young-sequence window order, and the ratio-4/16 boundaries — decode, chunked prefill and prefill agree
    m = _small_wide_window_model()
    ids = torch.randint(2, m.args.vocab_size, (1, 110), generator=torch.Generator().manual_seed(0))
    full = m.forward(ids, 0)
    m.reset()
    parts = [m.forward(ids[:, :37], 0)] + [m.forward(ids[:, p:p + 1], p) for p in range(37, 110)]
    assert torch.equal(torch.cat(parts, 1), full)


@pytest.mark.parametrize("preset,ramp_form_differs", [("flash", 0), ("tiny", 1)])
def test_yarn_uses_deepseeks_expression(preset, ramp_form_differs):
    args = get_preset(preset)
    layer = args.compress_ratios.index(4)  # a CSA layer: compress_rope_theta with YaRN
    dim, theta = args.rope_head_dim, args.compress_rope_theta
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    def corr(rot):
        return dim * math.log(args.original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(theta))
    low, high = max(math.floor(corr(args.beta_fast)), 0), min(math.ceil(corr(args.beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    smooth = 1 - ramp
    deepseek = freqs / args.rope_factor * (1 - smooth) + freqs * smooth
    assert torch.equal(rope_frequencies(args, layer), deepseek)
    # the algebraically equal ramp form (the reference's before issue 23) is another rounding: on data/tiny's
    # geometry it moves one frequency by an fp32 ulp (on Flash's it happens to round the same)
    ramp_form = freqs / args.rope_factor * ramp + freqs * (1 - ramp)
    assert int((ramp_form != deepseek).sum()) == ramp_form_differs
    assert torch.equal(rope_frequencies(args, 0), 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2) / dim)))


@pytest.mark.parametrize("n,W,differs", [(100, 128, True), (40, 128, True), (64, 128, False), (200, 128, False)])
def test_a_prefill_shorter_than_the_window_keeps_the_decode_layout(n, W, differs):
    """DeepSeek's one-shot prefill of ``n`` tokens lists ``min(n, W)`` window columns before the compressed
    entries; the reference lists ``W`` (the decode layout, unfilled slots −1), so a prefill, a chunked prefill and
    decode of the same positions round alike. For ``n < W`` the compressed entries then sit in other 64-index
    blocks and their probabilities are rounded to bf16 against other running maxima: the same softmax, each side
    within one bf16 rounding of every probability of the exact one, and bit-identical when ``min(n, W)`` is a
    multiple of 64 (an all-masked block between the window and the entries changes nothing)."""
    gen = torch.Generator().manual_seed(n)
    h, d, n_comp = 4, 96, 30
    visible = min(n, W)  # the last query of the prompt sees every window position it has
    q = torch.randn(1, 1, h, d, generator=gen).bfloat16()
    kv = torch.randn(1, visible + n_comp, d, generator=gen).bfloat16()
    sink = torch.randn(h, generator=gen)
    window, comp = torch.arange(visible), visible + torch.randperm(n_comp, generator=gen)
    deepseek_prefill = torch.cat((window, comp))[None, None]
    decode_layout = torch.cat((window, torch.full((W - visible,), -1), comp))[None, None]
    ops = ReferenceOps(NM)
    ours = ops.sparse_attention(q, kv, decode_layout, sink, d ** -0.5)
    theirs = ops.sparse_attention(q, kv, deepseek_prefill, sink, d ** -0.5)
    assert (not torch.equal(ours, theirs)) == differs
    # each side's P·V differs from the exact one by at most one bf16 rounding of each probability (u_bf16·Σ w·|kv|;
    # ×1.01 covers the fp32 sums), so the two differ by twice that, plus the output's rounding (the ulp allowance)
    mag = 2 * 1.01 * _softmax_magnitude(q, kv, deepseek_prefill, sink, d ** -0.5)
    res = check_within_bound(theirs, ours, mag, terms=1, acc_dtype=torch.bfloat16, out_dtype=torch.bfloat16,
                             name="DeepSeek's prefill layout vs the decode layout")
    assert res.ok, res.line()


@pytest.mark.parametrize("preset", ["tiny", "flash"])
def test_rope_table_is_within_one_ulp_of_deepseeks_polar(preset):
    """DeepSeek builds the table as ``torch.polar(1, p·f)``; the reference takes ``cos``/``sin`` of the same fp32
    angles. Both round the same angle: they differ by at most one fp32 ulp, in a few percent of the entries on
    this CPU (which ones depends on the math library, so no golden depends on the choice beyond that ulp)."""
    from dsv4lab.core.model.rope import rope_table
    args = get_preset(preset)
    n = 4096
    for layer in (0, args.compress_ratios.index(4)):  # no YaRN, and YaRN
        cos, sin = rope_table(args, layer, n)
        angles = torch.outer(torch.arange(n, dtype=torch.float32), rope_frequencies(args, layer))
        cis = torch.polar(torch.ones_like(angles), angles)
        for ours, theirs in ((cos, cis.real.contiguous()), (sin, cis.imag.contiguous())):
            ulps = (ours.view(torch.int32).long() - theirs.view(torch.int32).long()).abs()
            assert int(ulps.max()) <= 1
            assert float((ulps > 0).float().mean()) < 0.1
