"""Grouped FP4 MoE (issue 18): the sorter's per-expert block ranges, the expert-grouped work order (one program
per item or a persistent grid), the bf16 route's decodes, and — on a GPU — every route at real widths, stage by
stage within the analytic bound of its accumulation, and the inline-PTX decode's self-test.
"""
from __future__ import annotations

import pytest
import torch

from dsv4lab.engine.triton_prefill import accumulation_bound, expert_stage_magnitude
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.tools.verify.bounds import check_within_bound
from dsv4lab.tools.verify.registry import make_bank, routing

pytest.importorskip("triton")
ms = pytest.importorskip("dsv4lab_kernels.moe_sort")
fm = pytest.importorskip("dsv4lab_kernels.fp4_moe_grouped")

REF = ReferenceOps(Numerics())


def _case(T=23, E=8, k=3, D=160, I=96, seed=3, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    bank = make_bank(E, D, I, torch.Generator().manual_seed(seed + 100), device)
    idx, w = routing(g, T, E, k, device, skip=2)
    x = (torch.randn(T, D, generator=g) * 2).to(device, torch.bfloat16)
    return x, idx, w.float(), bank


def test_sorter_block_ranges_match_the_blocks():
    g = torch.Generator().manual_seed(1)
    idx, _ = routing(g, 41, 10, 3, skip=3)
    for rows in (16, 32):
        r = ms.sort_by_expert(idx, 10, rows)
        want = ms.sort_by_expert_reference(idx, 10, rows)
        for name in ("expert_first_block", "expert_blocks", "used_blocks"):
            assert torch.equal(getattr(r, name), getattr(want, name)), name
        be = r.block_expert
        assert int(r.used_blocks) == int((be >= 0).sum())
        for e in range(10):  # each expert's blocks are the contiguous run the work order relies on
            first, n = int(r.expert_first_block[e]), int(r.expert_blocks[e])
            assert torch.equal(be[first:first + n], torch.full((n,), e, dtype=be.dtype))


def test_sorter_kernels_span_many_chunks_and_match_the_torch_sorter():
    """9,300 slots: more chunks than the offset kernel's step (128), so its carry across steps is exercised; an
    expert-parallel slice leaves other ranks' slots out. The kernels, the previous torch sorter and the reference
    agree on every output."""
    g = torch.Generator().manual_seed(11)
    idx, _ = routing(g, 3100, 12, 3, skip=2)
    for offset, n_local, rows in ((0, 12, 64), (3, 5, 16)):
        got = ms.sort_by_expert(idx, n_local, rows, offset)
        want = ms.sort_by_expert_reference(idx, n_local, rows, offset)
        old = ms.sort_by_expert_torch(idx, n_local, rows, offset)
        for name in ("sorted_slots", "block_expert", "counts", "expert_first_block", "expert_blocks", "used_blocks"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
            assert torch.equal(getattr(old, name), getattr(want, name)), name


def test_sorter_edge_cases_own_nothing_or_get_nothing():
    idx = torch.tensor([[0, 1], [1, 2]])
    r = ms.sort_by_expert(idx, 4, 16, expert_offset=8)  # every slot is another rank's
    assert int(r.used_blocks) == 0 and bool((r.block_expert == -1).all()) and bool((r.sorted_slots == -1).all())
    empty = ms.sort_by_expert(torch.zeros(0, 6, dtype=torch.long), 4, 16)
    assert empty.max_blocks == 0 and int(empty.used_blocks) == 0


@pytest.mark.parametrize("persistent", [False, True])
def test_work_order_covers_every_block_and_tile_once(persistent):
    # 19 slots of expert 5 span two 16-row blocks; expert 7 has none; gate/up and down have 1 and 2 N tiles
    x, idx, w, bank = _case(T=19, D=256, I=128, seed=5)
    others = torch.tensor([0, 1, 2, 3, 4, 6])
    g = torch.Generator().manual_seed(8)
    idx = torch.stack([torch.cat((torch.tensor([5]), others[torch.randperm(6, generator=g)[:2]]))
                       for _ in range(19)])
    geo = fm.MoEGeometry(rows=16, persistent=persistent, block_n1=128, block_n2=128)
    y = fm.routed_experts(x, idx, w, bank, 10.0, route="bf16", geo=geo, poison=True)
    assert torch.equal(y, REF.routed_experts(x, idx, w, bank, 10.0))  # every slot, every column, once


def test_portable_decode_is_exact_and_asm_is_refused_off_the_gpu():
    x, idx, w, bank = _case(seed=7)
    rg, ru = REF.moe_stage1(x, idx, bank)
    for per_byte in (False, True):  # scales broadcast per 32 weights, or loaded per byte
        g, u = fm.moe_stage1(x, idx, bank, route="bf16", geo=fm.MoEGeometry(rows=16, decode="f16",
                                                                            scale_per_byte=per_byte))
        assert torch.equal(g, rg) and torch.equal(u, ru)
    assert fm.asm_decode_exact(bank) and not fm.asm_decode_works("cpu")
    with pytest.raises(ValueError, match="'asm' is not usable"):
        fm.moe_stage1(x, idx, bank, route="bf16", geo=fm.MoEGeometry(rows=16, decode="asm"))
    s = bank.w2_scale.view(torch.uint8).clone()
    s[0, 0, 0] = 129  # a scale of 4: 2^(s−1) overflows bf16's exponent in the asm multiply
    bank._buffers["w2_scale"] = s.view(torch.float8_e8m0fnu)
    assert not fm.asm_decode_exact(bank)


# ------------------------------------------------------------------------------------------ GPU
def _within(name, out, ref, mag, terms, accumulation, out_dtype, rounded_terms=False):
    kw = accumulation_bound(terms, accumulation)
    if rounded_terms:  # an exact sum of bf16-rounded slot outputs: each may straddle a bf16 rounding
        kw["c"] += 2.0 ** -7 / 2.0 ** -24
    res = check_within_bound(out, ref, mag, out_dtype=out_dtype, name=name, **kw)
    assert res.ok, res.line()


@pytest.mark.gpu
def test_gpu_sorter_at_flash_size_equals_the_reference():
    """4,100 tokens, top-6 of 256 experts (the whole bank and an expert-parallel slice): the kernel sorter and the
    previous torch sorter give the reference sorter's outputs exactly."""
    g = torch.Generator().manual_seed(5)
    idx, _ = routing(g, 4100, 256, 6, skip=5)
    for offset, n_local, rows in ((0, 256, 128), (64, 32, 64)):
        want = ms.sort_by_expert_reference(idx, n_local, rows, offset)
        for sorter in (ms.sort_by_expert, ms.sort_by_expert_torch):
            got = sorter(idx.cuda(), n_local, rows, offset)
            for name in ("sorted_slots", "block_expert", "counts", "expert_first_block", "expert_blocks",
                         "used_blocks"):
                assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), (sorter.__name__, name)


@pytest.mark.gpu
def test_gpu_asm_decode_self_test_passes_on_hopper():
    assert fm.asm_decode_works("cuda"), fm.asm_decode_status("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("route,geo", [
    ("bf16", fm.MoEGeometry(rows=64)), ("bf16", fm.MoEGeometry(rows=128)),
    ("bf16", fm.MoEGeometry(rows=64, decode="f16")), ("bf16", fm.MoEGeometry(rows=32, persistent=True)),
    ("bf16", fm.MoEGeometry(rows=64, scale_per_byte=True)),
    ("fp8", fm.MoEGeometry(rows=64)), ("scaled", fm.MoEGeometry(rows=64)), ("fp8lut", fm.MoEGeometry(rows=64)),
    ("fp8lut", fm.MoEGeometry(rows=128, persistent=True))])
def test_gpu_grouped_moe_stage_by_stage_within_bounds(route, geo):
    """Real widths (D 4096, I 2048), 32 experts with about as many rows each as 256 experts at 4,096 tokens."""
    dev = "cuda"
    x, idx, w, bank = _case(T=512, E=32, k=6, D=4096, I=2048, seed=11, device=dev)
    acc = {"bf16": "tc_bf16", "fp8": "tc_fp8", "scaled": "tc_bf16", "fp8lut": "tc_fp8"}[route]
    rg, ru = REF.moe_stage1(x, idx, bank)
    g, u = fm.moe_stage1(x, idx, bank, route=route, geo=geo)
    _within("stage1.g", g, rg, expert_stage_magnitude(x, idx, bank, "w1", True), 4096, acc, torch.bfloat16)
    _within("stage1.u", u, ru, expert_stage_magnitude(x, idx, bank, "w3", True), 4096, acc, torch.bfloat16)
    h = REF.moe_activation(rg, ru, w, 10.0)
    _within("stage2", fm.moe_stage2(h, idx, bank, route=route, geo=geo), REF.moe_stage2(h, idx, bank),
            expert_stage_magnitude(h, idx, bank, "w2", True), 2048, acc, torch.bfloat16)
    y = fm.routed_experts(x, idx, w, bank, 10.0, route=route, geo=geo, poison=True)
    hk = REF.moe_activation(g, u, w, 10.0)  # the fused epilogue against the reference fed the kernel's g and u
    mag = torch.nan_to_num(expert_stage_magnitude(hk, idx, bank, "w2", True)).sum(1)
    _within("fused", y, REF.moe_combine(REF.moe_stage2(hk, idx, bank), idx), mag, 2048, acc, torch.float32,
            rounded_terms=True)


def test_the_exactness_checks_never_answer_for_a_bank_they_did_not_see():
    """``fp8_route_exact`` / ``asm_decode_exact`` remember their answer per bank. A new scale tensor at the address
    and shape of one already checked (memory freed and reused; here a view of the same memory) is checked again:
    a remembered "exact" once sent a later test's bank down a route its scales do not allow (outputs ~1e11)."""
    bank = make_bank(4, 256, 128, torch.Generator().manual_seed(3))
    for name in ("w1_scale", "w3_scale", "w2_scale"):
        fm._u8(getattr(bank, name)).fill_(127)
    assert fm.fp8_route_exact(bank) and fm.asm_decode_exact(bank)
    for name in ("w1_scale", "w3_scale", "w2_scale"):  # same address and shape, other tensors, other values
        t = getattr(bank, name).view(getattr(bank, name).shape)
        fm._u8(t)[0, 0, 0] = 127 + fm.FP8_ROUTE_MAX_SPREAD + 1 if name == "w1_scale" else 127
        fm._u8(t)[0, 0, 1] = 255 if name == "w3_scale" else 127
        bank._buffers[name] = t
    assert not fm.fp8_route_exact(bank) and not fm.asm_decode_exact(bank)
