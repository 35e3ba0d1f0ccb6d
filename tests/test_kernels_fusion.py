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

import pytest
import torch

from conftest import poisoned_x
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
