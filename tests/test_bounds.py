"""The analytic error bound (:mod:`dsv4lab.tools.verify.bounds`): a correct fp32 accumulation passes on irregular shapes
with heavy cancellation; an accumulation in bf16, a dropped term and a poisoned NaN fail."""
import torch

from dsv4lab.tools.verify.bounds import abs_matmul, check_within_bound, ulp


def _cancelling_gemv(rows=37, k=1823, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = torch.randn(251, k, generator=g).to(torch.bfloat16)
    # make a third of the outputs nearly cancel: the last column undoes the sum of the others
    w[::3, -1] = 0
    partial = (x.double() @ w.double().T)[:, ::3]
    x[:, -1] = 1.0
    w[::3, -1] = (-partial.mean(0)).to(torch.bfloat16)
    return x, w


def _fp32_in_blocks(x, w, block):
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    for k0 in range(0, x.shape[1], block):
        acc = acc + x[:, k0:k0 + block].float() @ w[:, k0:k0 + block].float().T
    return acc


def test_correct_fp32_accumulation_passes_with_cancellation():
    x, w = _cancelling_gemv()
    ref = (x.double() @ w.double().T).float().to(torch.bfloat16)
    mag = abs_matmul(x, w)
    for block in (1823, 512, 97, 16):
        out = _fp32_in_blocks(x, w, block).to(torch.bfloat16)
        res = check_within_bound(out, ref, mag, terms=x.shape[1], acc_dtype=torch.float32, out_dtype=torch.bfloat16)
        assert res.ok, res.line()


def test_bf16_accumulation_is_caught():
    x, w = _cancelling_gemv(seed=1)
    ref = (x.double() @ w.double().T).float().to(torch.bfloat16)
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.bfloat16)
    for k0 in range(0, x.shape[1], 64):  # partial sums rounded to bf16 every 64 terms
        acc = (acc.float() + x[:, k0:k0 + 64].float() @ w[:, k0:k0 + 64].float().T).to(torch.bfloat16)
    res = check_within_bound(acc, ref, abs_matmul(x, w), terms=x.shape[1], acc_dtype=torch.float32,
                             out_dtype=torch.bfloat16)
    assert not res.ok and res.n_violations > 0


def test_a_dropped_term_and_a_nan_are_caught():
    x, w = _cancelling_gemv(seed=2)
    ref = (x.double() @ w.double().T).float().to(torch.bfloat16)
    mag = abs_matmul(x, w)
    out = (x[:, :-1].double() @ w[:, :-1].double().T).float().to(torch.bfloat16)  # one term of 1823 missing
    assert not check_within_bound(out, ref, mag, terms=x.shape[1], acc_dtype=torch.float32,
                                  out_dtype=torch.bfloat16).ok
    good = _fp32_in_blocks(x, w, 256).to(torch.bfloat16)
    good[3, 5] = float("nan")
    res = check_within_bound(good, ref, mag, terms=x.shape[1], acc_dtype=torch.float32, out_dtype=torch.bfloat16)
    assert not res.ok and res.nan_mismatch == 1 and res.worst["index"] == [3, 5]


def test_ulp_matches_the_dtype_spacing():
    v = torch.tensor([1.0, 1.5, 3.0, 1e-40])
    assert ulp(v, torch.bfloat16).tolist()[:3] == [2 ** -7, 2 ** -7, 2 ** -6]
    assert float(ulp(v, torch.float32)[0]) == 2 ** -23


# ------------------------------------------------------------------------------------------ intervals and chains
def test_binade_edge_uses_the_ulp_of_the_larger_value():
    # exact 2 − 2⁻¹⁰ rounds to 2.0 in bf16 on one side and to 1.9921875 on the other: one ulp at 2.0, not at 1.99
    ref = torch.tensor([1.9921875], dtype=torch.bfloat16)
    out = torch.tensor([2.0], dtype=torch.bfloat16)
    assert check_within_bound(out, ref, 0.0, terms=1, acc_dtype=torch.float32, out_dtype=torch.bfloat16).ok
    far = torch.tensor([2.015625], dtype=torch.bfloat16)  # two ulps above: a real error
    assert not check_within_bound(far, ref, 0.0, terms=1, acc_dtype=torch.float32, out_dtype=torch.bfloat16).ok


def test_blocked_fp8_mma_accumulation():
    from dsv4lab.tools.verify.bounds import gamma
    g = gamma(4096, "fp8_mma")  # γ₁₂₈(2⁻¹³) inside each block + γ₃₂(2⁻²³) across the 32 blocks
    assert abs(g - (128 * 2 ** -13 / (1 - 128 * 2 ** -13) + 32 * 2 ** -23 / (1 - 32 * 2 ** -23))) < 1e-15
    assert gamma(100, "fp8_mma") == 100 * 2 ** -13 / (1 - 100 * 2 ** -13)


def test_interval_rounding_allows_a_flip_only_where_the_interval_straddles():
    from dsv4lab.tools.verify.bounds import Interval, check_interval
    mid = torch.tensor([1.0 + 2 ** -8, 1.0 + 2 ** -9], dtype=torch.float64)  # a bf16 tie point, and a quarter ulp
    iv = Interval.around(mid, torch.full_like(mid, 2 ** -20)).round(torch.bfloat16)
    assert iv.lo[0] < iv.hi[0] and iv.lo[1] == iv.hi[1] == 1.0
    ref = mid.to(torch.bfloat16)
    up = torch.tensor([1.0078125, 1.0078125], dtype=torch.bfloat16)  # the upper neighbour of 1.0 in both places
    res = check_interval(up, ref, iv)
    assert not res.ok and res.n_violations == 1 and res.worst["index"] == [1]


def test_fp8_activation_quantizer_interval_flips_at_a_boundary_only():
    from dsv4lab.core import quant
    from dsv4lab.tools.verify.bounds import Interval
    from dsv4lab.tools.verify.op_bounds import act_qdq_interval
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    x[0, 7] = 2.125  # exactly between two E4M3 values at scale 2⁻⁶ (step 0.25 at 2..4 after scaling)
    x = x.to(torch.bfloat16).to(torch.float64)
    q = quant.act_qdq_fp8(x.to(torch.bfloat16)).to(torch.float64)
    point = act_qdq_interval(Interval.point(x))
    assert torch.equal(point.lo, q) and torch.equal(point.hi, q)  # a point maps to the reference's value exactly
    wide = act_qdq_interval(Interval.around(x, 1e-6 * x.abs()))
    flips = (wide.hi > wide.lo).sum()
    assert 0 < flips < 40 and wide.contains(q).all()


def _composite_case(seed=0):
    from dsv4lab.core.model.numerics import Numerics
    from dsv4lab.core.model.ops import ReferenceOps
    from dsv4lab.tools.verify.registry import make_bank, routing
    g = torch.Generator().manual_seed(seed)
    bank = make_bank(8, 256, 128, g)
    idx, w = routing(g, 5, 8, 3)
    x = (torch.randn(5, 256, generator=g) * 2).to(torch.bfloat16)
    nm = Numerics()
    return nm, ReferenceOps(nm), x, idx, w.float(), bank


def test_routed_experts_bound_passes_other_fp32_orders_and_fails_a_permuted_w2():
    """Correct evaluations in another fp32 order (where a last-bit difference in g may flip a bf16 and an FP8
    rounding of h downstream: the GPU failure mode of the old output-relative tests) stay inside the chain bound; a
    W2 read through the paper's permutation for one expert is far outside."""
    from dsv4lab.tools.verify.backend_faults import permuted_w2_bank
    from dsv4lab.tools.verify.bounds import check_interval
    from dsv4lab.tools.verify.op_bounds import routed_experts
    from dsv4lab.tools.verify.variants import Fp32Reductions, SplitKFp32
    nm, ref_ops, x, idx, w, bank = _composite_case()
    ref = ref_ops.routed_experts(x, idx, w, bank, 10.0)
    bound = routed_experts(nm, "fp32", x, idx, w, bank, 10.0)
    assert check_interval(ref, ref, bound).ok
    for variant in (Fp32Reductions(nm), SplitKFp32(nm)):
        res = check_interval(variant.routed_experts(x, idx, w, bank, 10.0), ref, bound)
        assert res.ok, res.line()
    faulted = ref_ops.routed_experts(x, idx, w, permuted_w2_bank(bank, int(idx[0, 0])), 10.0)
    res = check_interval(faulted, ref, bound)
    assert not res.ok and res.max_ratio > 100, res.line()


def test_sparse_attention_bound_passes_online_softmax_and_fails_a_wrong_row():
    from dsv4lab.tools.verify.bounds import check_interval
    from dsv4lab.tools.verify.op_bounds import sparse_attention
    from dsv4lab.tools.verify.registry import _make_attention
    from dsv4lab.tools.verify.variants import KernelLike
    from dsv4lab.core.model.numerics import Numerics
    from dsv4lab.core.model.ops import ReferenceOps
    nm = Numerics()
    q, kv, idx, sink, scale = _make_attention(dict(b=2, s=3, h=4, d=64, n_kv=50, k=40, masked=0.3),
                                              torch.Generator().manual_seed(1), "cpu", nm)
    q = q * 4  # sharp: the running max moves
    ref = ReferenceOps(nm).sparse_attention(q, kv, idx, sink, scale)
    bound = sparse_attention(nm, "fp32", q, kv, idx, sink, scale)
    online = KernelLike(nm).sparse_attention(q, kv, idx, sink, scale)
    assert not torch.equal(online, ref) and check_interval(online, ref, bound).ok
    shifted = idx.clone()
    shifted[0, 0, 1] = (shifted[0, 0, 1] + 1) % 50 if shifted[0, 0, 1] >= 0 else 3  # one gathered row off by one
    kv2 = torch.nan_to_num(kv, nan=0.0)
    wrong = ReferenceOps(nm).sparse_attention(q, kv2, shifted, sink, scale)
    assert not check_interval(wrong, ref, bound).ok


# ------------------------------------------------------------------------------------------ interval steps
def test_tensor_core_model_per_term_and_elementwise_roundoff():
    from dsv4lab.tools.verify.bounds import ELEMENTWISE_U, elementwise_roundoff, gamma
    assert gamma(1000, "fp32_tc4") == 1000 * 2 ** -22 / (1 - 1000 * 2 ** -22)  # c = 4 of the decode kernels' tables
    assert gamma(1000, "fp32") < gamma(1000, "fp32_tc") < gamma(1000, "fp32_tc4") < gamma(1000, "fp8_mma")
    # element-wise steps run in fp32 whatever the dots accumulate in; an evaluation in a dtype is that dtype's
    assert {elementwise_roundoff(m) for m in ("fp32", "fp32_tc", "fp32_tc4", "fp8_mma")} == {ELEMENTWISE_U}
    assert elementwise_roundoff("fp64") == 2 ** -53 and elementwise_roundoff(torch.bfloat16) == 2 ** -8


def _box(shape, seed, rel=2 ** -8):
    """A random interval of bf16-sized width around bf16 values, and bf16 points drawn inside it (ends included)."""
    from dsv4lab.tools.verify.bounds import Interval
    g = torch.Generator().manual_seed(seed)
    c = (torch.randn(*shape, generator=g) * 3).to(torch.bfloat16).double()
    r = c.abs() * rel * torch.rand(*shape, generator=g, dtype=torch.float64)
    iv = Interval(c - r, c + r)
    pts = [iv.lo, iv.hi] + [iv.lo + (iv.hi - iv.lo) * torch.rand(*shape, generator=g, dtype=torch.float64)
                            for _ in range(6)]
    inside = [p.to(torch.bfloat16) for p in pts]
    return iv, [torch.where(iv.contains(p.double()), p, c.to(torch.bfloat16)) for p in inside]


def test_interval_steps_contain_the_reference_at_every_point_of_their_input():
    """Soundness of the fused-op chain steps: for bf16 points anywhere in an input interval, the reference's own
    RMSNorm, RoPE (both directions), Hadamard transform and FP8/FP4 block simulations land inside the step's output
    interval (fp32 evaluation allowed for, so the reference's fp64-exact value is well inside)."""
    from dsv4lab.core import quant
    from dsv4lab.core.model.numerics import Numerics
    from dsv4lab.core.model.ops import ReferenceOps
    from dsv4lab.core.model.rope import rope_table
    from dsv4lab.core.config import get_preset
    from dsv4lab.tools.verify.bounds import Interval
    from dsv4lab.tools.verify.op_bounds import (fp4_qdq_interval, fp8_qdq_interval, hadamard_interval, rms_norm_interval,
                                          rope_interval)
    nm = Numerics()
    ref = ReferenceOps(nm)
    g = torch.Generator().manual_seed(3)
    w = 1 + 0.1 * torch.randn(96, generator=g)
    cos, sin = rope_table(get_preset("tiny"), 2, 64)
    pos = torch.randint(0, 64, (5,), generator=g)
    steps = [
        ("rms_norm", (5, 96), lambda iv: rms_norm_interval(nm, "fp32", iv, w, 1e-6, torch.bfloat16),
         lambda x: ref.rms_norm(x, w, 1e-6)),
        ("rope", (5, 96), lambda iv: rope_interval("fp32", iv, cos[pos], sin[pos], out_dtype=torch.bfloat16),
         lambda x: ref.rope(x, cos[pos], sin[pos])),
        ("inverse rope", (5, 96), lambda iv: rope_interval("fp32", iv, cos[pos], sin[pos], True, torch.bfloat16),
         lambda x: ref.rope(x, cos[pos], sin[pos], inverse=True)),
        ("hadamard", (5, 64), lambda iv: hadamard_interval("fp32", iv, torch.bfloat16), quant.hadamard_transform),
        ("fp8 sim", (5, 128), lambda iv: fp8_qdq_interval(iv, 64).round(torch.bfloat16),
         lambda x: quant.fp8_qdq(x, 64)),
        ("fp4 sim", (5, 64), lambda iv: fp4_qdq_interval(iv, 32).round(torch.bfloat16),
         lambda x: quant.fp4_qdq(x, 32)),
    ]
    for i, (name, shape, step, reference) in enumerate(steps):
        iv, points = _box(shape, i)
        out = step(iv)
        assert (out.lo <= out.hi).all(), name
        for p in points:
            y = reference(p).double()
            assert out.contains(y).all(), f"{name}: {int((~out.contains(y)).sum())} reference values outside"
        # and not vacuous: from a point (no input width) the step allows at most about one bf16 rounding
        at_point = step(Interval.point(iv.mid.to(torch.bfloat16).double()))
        width = ((at_point.hi - at_point.lo) / at_point.mag.clamp_min(1e-30))
        assert float(width.median()) <= 2 ** -8 and float(width.max()) <= 2 ** -6, (name, float(width.max()))
