"""Projections of one input stacked for the decode step (:mod:`dsv4lab.engine.decode_groups`): the stacking changes
no value and no byte of memory, refuses what cannot be stacked exactly, notices a replaced weight, and the Triton
backend computes a stacked set in one launch with the same bits as its members one by one."""
from __future__ import annotations

import pytest
import torch

import dsv4lab
from conftest import TINY
from dsv4lab.engine.decode_groups import group, group_of, group_projections, groupable, step_groups
from dsv4lab.core.model.linear import Linear
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.tools.verify.registry import make_linear

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


def _same(got: torch.Tensor, want: torch.Tensor, lin, x) -> None:
    """Bit for bit under the interpreter; on a GPU another tile width may sum in another order: the GEMV bound."""
    if not GPU:
        assert torch.equal(got, want)
        return
    from dsv4lab.tools.bench.decode import gemv_bound
    fp8 = lin.fmt == "fp8"
    res = gemv_bound(got.reshape(-1, got.shape[-1]), x.reshape(-1, x.shape[-1]), lin.weight,
                     lin.scale if fp8 else None, "dot", fp8, out_dtype=got.dtype)
    assert res.ok, res.line()


def test_stacking_changes_no_value_and_no_memory():
    """The reference forward gives the same logits before and after every set is stacked; each member's buffers
    are views of its rows of the stack (no copy kept), and stacking twice is a no-op."""
    m = dsv4lab.load(TINY, max_batch=1, max_seq_len=64)
    _unstack(m.model)  # the runner stacked them when it was built
    ids = torch.randint(2, 4096, (1, 40), generator=torch.Generator().manual_seed(1))
    before = m.forward(ids, 0)
    m.reset()
    blk = m.model.layers[1]  # CSA: qr set, the four compressor weights, the shared expert
    old = {id(lin): lin.weight.clone() for lins in step_groups(blk) for lin in lins}
    made = group_projections(m.model)
    assert made == sum(groupable(lins) is None for b in m.model.blocks() for lins in step_groups(b)) > 0
    assert group_projections(m.model) == made  # again: the same groups
    for lins in step_groups(blk):
        g = group_of(lins)
        if g is None:
            assert "multiple of 128" in groupable(lins)  # tiny's wq_a (192 rows) + wkv (96): scales would not stack
            continue
        for lin in lins:
            assert lin.weight._base is g.weight and torch.equal(lin.weight, old[id(lin)])
    assert torch.equal(m.forward(ids, 0), before)


def _unstack(model) -> None:
    """Give every stacked member its own copy of its rows again (a model as the checkpoint loaded it)."""
    for blk in model.blocks():
        for lins in step_groups(blk):
            for lin in lins:
                lin.__dict__.pop("decode_group", None)
                for name in ("weight", "scale"):
                    if lin._buffers.get(name) is not None:
                        lin._buffers[name] = lin._buffers[name].clone()


def test_the_runner_stacks_before_any_step_so_no_step_moves_a_weight():
    """Stacking frees the members' own weights; a CUDA graph captured before it (a prefill bucket's) kept reading
    the freed memory — non-finite logits on the GPU once the decode step was built (``data/results/h100/
    diag_prefill_after_decode_f3de19f.json``: every prefill graph × static or graph decode step). So the runner stacks when it is built: every set that can be stacked
    is stacked after ``load``, and neither the static decode step nor a prefill moves a weight or a scale."""
    from dsv4lab.engine.decode_graph import StaticDecodeStep
    m = dsv4lab.load(TINY, max_batch=1, max_seq_len=64)
    sets = [lins for b in m.model.blocks() for lins in step_groups(b)]
    assert sum(group_of(lins) is not None for lins in sets) == sum(groupable(lins) is None for lins in sets) > 0

    def addresses():
        return {name: t.data_ptr() for name, t in list(m.model.named_parameters()) + list(m.model.named_buffers())}

    before = addresses()
    StaticDecodeStep(m)
    m.prefill(torch.randint(2, 4096, (20,), generator=torch.Generator().manual_seed(2)))
    moved = [name for name, ptr in addresses().items() if before.get(name) != ptr]
    assert not moved, moved[:5]


def test_what_is_not_stacked_and_a_replaced_weight():
    g = torch.Generator().manual_seed(0)
    a, b = make_linear("fp8", 256, 320, g), make_linear("fp8", 128, 320, g)
    assert groupable((a,)) and "format" in groupable((a, make_linear("bf16", 128, 320, g)))
    assert "input width" in groupable((a, make_linear("fp8", 128, 256, g)))
    assert "multiple of 128" in groupable((a, make_linear("fp8", 96, 320, g)))
    grp = group((a, b))
    assert grp is not None and group_of((a, b)) is grp and group_of((b, a)) is None
    b._buffers["weight"] = b.weight.clone()  # e.g. reloaded after stacking: the stack no longer holds it
    assert group_of((a, b)) is None


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_triton_backend_runs_a_stacked_set_in_one_launch(fmt):
    from dsv4lab.tools.bench.e2e import count_launches
    from dsv4lab.engine.triton_backend import TritonOps
    ops = TritonOps(Numerics())
    g = torch.Generator().manual_seed(3)
    lins = tuple(make_linear(fmt, n, 256, g, device=DEV) for n in (256, 128, 384))
    x = (torch.randn(2, 1, 256, generator=g) * 2).to(torch.bfloat16).to(DEV)
    op = ops.linear_group if fmt == "fp8" else ops.linear_f32_group
    alone = op(x, lins)  # not stacked: each member on its own kernel
    assert group(lins) is not None
    counts, stacked = count_launches(lambda: op(x, lins))
    assert counts["triton"] == 1, counts
    for s, a_, lin in zip(stacked, alone, lins):
        assert s.shape == a_.shape == (2, 1, lin.out_features) and s.is_contiguous()
        _same(s, a_, lin, x)
    assert ops.calls.decode[op.__name__] == 1 and not ops.calls.reference


def test_shared_expert_w1_w3_in_one_launch():
    from dsv4lab.tools.bench.e2e import count_launches
    from dsv4lab.engine.triton_backend import TritonOps
    ops = TritonOps(Numerics())
    g = torch.Generator().manual_seed(4)
    w1, w3, w2 = (make_linear("fp8", n, k, g, device=DEV) for n, k in ((256, 384), (256, 384), (384, 256)))
    x = (torch.randn(3, 384, generator=g) * 2).to(torch.bfloat16).to(DEV)
    alone = ops.expert_mlp(x, w1, w2, w3, 10.0, shared=True)
    group((w1, w3))
    counts, stacked = count_launches(lambda: ops.expert_mlp(x, w1, w2, w3, 10.0, shared=True))
    if GPU:  # the stacked w1/w3 may take another tile width than each alone: the shared expert's own bound
        from dsv4lab.core.model.ops import ReferenceOps
        from dsv4lab.tools.verify.op_bounds import check_expectation, expert_mlp
        ref = ReferenceOps(Numerics()).expert_mlp(x, w1, w2, w3, 10.0, shared=True)
        res = check_expectation(stacked, ref, expert_mlp(Numerics(), "fp32_tc", x, w1, w2, w3, 10.0, shared=True))
        assert res.ok, res.line()
    else:
        assert torch.equal(stacked, alone)
    assert counts["triton_kernels"]["_fp8_gemv_kernel"] == 2  # w1+w3, then w2


def test_linear_is_a_module_not_a_group():
    assert "decode_group" not in Linear(8, 8, "bf16").__dict__
