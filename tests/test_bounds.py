"""The analytic error bound (:mod:`dsv4lab.verify.bounds`): a correct fp32 accumulation passes on irregular shapes
with heavy cancellation; an accumulation in bf16, a dropped term and a poisoned NaN fail."""
import torch

from dsv4lab.verify.bounds import abs_matmul, check_within_bound, ulp


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
