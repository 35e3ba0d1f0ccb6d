"""Kernels for steps that carry several tokens per sequence (issue 32), under the interpreter on the CPU (``gpu`` tests
at wider shapes on a GPU): each new kernel or variant against its torch reference on fresh random inputs, irregular
shapes and NaN-poisoned memory."""
from __future__ import annotations

import pytest
import torch

from conftest import in_poisoned, poisoned_x
from dsv4lab.core.config import get_preset
from dsv4lab.core.model.compressor import Compressor
from dsv4lab.tools.bench.common import random_fp8_linear
from dsv4lab.tools.bench.decode import gemv_bound, projections
from dsv4lab.tools.verify.registry import make_linear
from test_kernels_glue import DEV, TINY, _poisoned, _ref, _tables, assert_compressor_state
from test_kernels_moe_decode import LIMIT, G, check_moe, moe, moe_case

cmpd = pytest.importorskip("dsv4lab_kernels.compressor_decode")
gemv = pytest.importorskip("dsv4lab_kernels.fp8_gemv")


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


# ------------------------------------------------------------------------------------------ compressor
def _compressor_launches(ratio: int, channels: int, indexer: bool, T: int, max_len: int, seed: int) -> None:
    """Three sequences, ``T`` tokens each per launch (one has 2 real tokens, its others copies of its last; one
    starts fresh), over two launches that complete blocks mid-launch — a later token overwrites the ring row an
    earlier one pooled. The several-token launch equals ``T`` one-token launches of the same kernel bit for bit
    (rings and entries), and the reference (``T`` one-token reference steps) to its bound."""
    g = torch.Generator().manual_seed(seed)
    cos, sin = _tables(n=max_len + 8)
    comp = Compressor(TINY, ratio, channels, indexer)
    width = comp.coff * channels
    comp._buffers["ape"] = torch.randn(ratio, width, generator=g)
    comp.norm._buffers["weight"] = 1 + 0.1 * torch.randn(channels, generator=g)
    comp.allocate_state(4, torch.float32, "cpu")
    comp.kv_ring.normal_(generator=g)  # a state left by earlier tokens (never zeros)
    comp.score_ring.normal_(generator=g)
    comp.clear_state(torch.tensor([3]))  # the fresh sequence's slot
    cache = torch.full((4, max_len // ratio, channels), float("nan"), dtype=torch.bfloat16)
    # the kernel's state is a copy (on the CPU .to() would alias it: the reference below updates comp's own)
    many = [comp.kv_ring.to(DEV, copy=True), comp.score_ring.to(DEV, copy=True), cache.to(DEV, copy=True)]
    ones = [t.clone() for t in many]
    ape, norm_w = comp.ape.to(DEV), comp.norm.weight.to(DEV)
    slots = torch.tensor([3, 0, 1])
    start = torch.tensor([0, 2 * ratio - 3, max_len - 2 * T - 1])  # the middle one completes block 1 in launch 2
    lengths = torch.tensor([T, 2, T])
    ops = _ref()
    args = (cos, sin, ratio, comp.overlap, TINY.norm_eps, indexer, True)
    completed = 0  # blocks of `ratio` positions that the real tokens complete: one cache entry each
    for launch in range(2):
        t = torch.arange(T)[None, :]
        at = torch.minimum(t, (lengths - 1)[:, None])
        pos = start[:, None] + launch * lengths[:, None] + at  # a sequence advances by its real tokens
        completed += int((((pos + 1) % ratio == 0) & (t < lengths[:, None])).sum())
        kv = torch.randn(3, T, width, generator=g) * 2
        sc = torch.randn(3, T, width, generator=g)
        kv, sc = kv.gather(1, at[..., None].expand_as(kv)), sc.gather(1, at[..., None].expand_as(sc))  # copies
        ops.compressor_step(comp, kv, sc, pos, slots, cache, cos.cpu(), sin.cpu())
        cmpd.compressor_step(_poisoned(kv), _poisoned(sc), ape, pos.to(DEV), slots.to(DEV), *many[:2], many[2],
                             norm_w, *args)
        for i in range(T):
            cmpd.compressor_step(kv[:, i].contiguous().to(DEV), sc[:, i].contiguous().to(DEV), ape,
                                 pos[:, i].contiguous().to(DEV), slots.to(DEV), *ones[:2], ones[2], norm_w, *args)
    assert completed >= 1  # the geometry must complete a block, or nothing below is tested
    assert int((~torch.isnan(many[2].float().cpu())).any(-1).sum()) == completed  # entries written, and only those
    for a, b in zip(many, ones):
        assert torch.equal(a.float().nan_to_num(7.0), b.float().nan_to_num(7.0))
    assert_compressor_state(*many, comp, cache, rope_dims=2 * cos.shape[-1])


@pytest.mark.parametrize("ratio,channels,indexer,T", [(4, 96, False, 5), (4, 64, True, 3), (16, 96, False, 4)])
def test_compressor_step_of_several_tokens_per_sequence(ratio, channels, indexer, T):
    _compressor_launches(ratio, channels, indexer, T, max_len=70, seed=ratio + channels + T)


@pytest.mark.gpu
@pytest.mark.parametrize("ratio,channels,indexer,T", [(4, 544, False, 4), (4, 128, True, 8), (128, 544, False, 4)])
def test_gpu_compressor_step_of_several_tokens_per_sequence(ratio, channels, indexer, T):
    """The same on the GPU at Flash-like widths (the barrier between a program's tokens must order its threads'
    ring stores and loads on real hardware), ratio 128 included."""
    _compressor_launches(ratio, channels, indexer, T, max_len=2 * 128 + 2 * T + 3, seed=ratio + channels + T)


# ------------------------------------------------------------------------------------------ FP8 projections
@pytest.mark.parametrize("M,N,K,split,rows", [(40, 200, 192, 2, 64), (33, 72, 320, 1, 32), (64, 96, 256, 1, 64)],
                         ids=["M40-rows64", "M33-rows32", "M64-rows64"])
def test_fp8_gemv_reads_each_weight_once_for_up_to_64_rows(M, N, K, split, rows):
    """``GemvGeometry.rows_per_program`` (the ``dot_rows64`` variant): up to 64 token rows per program, so a step
    of ≤ 64 rows has one program per weight tile (the grid's row dimension is 1) — within the dot route's bound of
    the exact reference, and NaN-poisoned memory past the activations, weights and scales never read."""
    g = torch.Generator().manual_seed(M * N + rows)
    lin = make_linear("fp8", N, K, g)
    x = poisoned_x((torch.randn(M, K, generator=g) * 3).to(torch.bfloat16))
    w, s = in_poisoned(lin.weight, 0x7F), in_poisoned(lin.scale, 0xFF)
    geo = gemv.GemvGeometry(block_n=32, block_k=128, split_k=split, rows_per_program=rows)
    assert gemv.token_blocks(M, "dot", rows)[0] == min(triton_next_pow2(M), rows)  # one row block of ≤ rows
    out = gemv.fp8_gemv(x, w, s, act_quant=True, route="dot", geometry=geo)
    res = gemv_bound(out, x, lin.weight, lin.scale, "dot", True, 1, torch.bfloat16, "rows")
    assert res.ok, res.line()
    with pytest.raises(ValueError, match="rows_per_program"):
        gemv.fp8_gemv(x, w, s, route="dot", geometry=gemv.GemvGeometry(rows_per_program=48))
    assert gemv.MULTI_ROW_VARIANTS["dot_rows64"][1].rows_per_program == 64


@pytest.mark.parametrize("M,N,K,split,rows,fmt,segments", [(3, 72, 320, 2, 4, "fp8", None),
                                                             (5, 96, 256, 1, 2, "bf16", None),
                                                             (2, 256, 384, 3, 2, "fp8", (128, 128)),
                                                             (4, 48, 200, 2, 4, "bf16", (32, 16))],
                         ids=["M3-rows4-fp8-split2", "M5-rows2-bf16", "M2-rows2-fp8-segments",
                              "M4-rows4-bf16-segments"])
def test_fma_gemv_takes_several_rows_per_weight_tile_each_summed_as_alone(M, N, K, split, rows, fmt, segments):
    """``GemvGeometry.fma_rows``: one fma program multiplies each weight tile it reads with up to 4 token rows (the
    grid's row dimension shrinks by that factor), each row with an accumulator of its own — so every row equals
    the one-row program's result bit for bit (FP8 and BF16 weights, split-K with tickets, stacked segments, rows
    past M masked), within the fma route's bound of the exact reference, NaN-poisoned memory past the
    activations, weights and scales never read; fma_rows outside 1, 2, 4 refused."""
    g = torch.Generator().manual_seed(M * N + rows)
    lin = make_linear(fmt, N, K, g)
    x = poisoned_x((torch.randn(M, K, generator=g) * 3).to(torch.bfloat16))
    fp8 = fmt == "fp8"
    w = in_poisoned(lin.weight, 0x7F) if fp8 else poisoned_x(lin.weight)
    s = in_poisoned(lin.scale, 0xFF) if fp8 else None
    out_dtype = torch.bfloat16 if fp8 else torch.float32
    kw = dict(act_quant=fp8, out_dtype=out_dtype, route="fma", segments=segments)
    geo = gemv.GemvGeometry(block_n=16, block_k=128, split_k=split, fma_rows=rows)
    plan = gemv.gemv_plan(x, w, s, geometry=geo, **kw)
    tq = min(triton_next_pow2(M), rows)
    assert plan.consts["TQ"] == tq and plan.grid[2] == -(-M // tq)  # a weight tile is read by ⌈M/TQ⌉ programs
    got = gemv.fp8_gemv(x, w, s, geometry=geo, **kw)
    alone = gemv.fp8_gemv(x, w, s, geometry=gemv.GemvGeometry(block_n=16, block_k=128, split_k=split), **kw)
    got, alone = (torch.cat(t, -1) if isinstance(t, tuple) else t for t in (got, alone))
    assert torch.equal(got, alone), f"max |Δ| {(got.float() - alone.float()).abs().max():.3g}"
    res = gemv_bound(got, x, lin.weight, lin.scale if fp8 else None, "fma", fp8, 1, out_dtype, "fma_rows")
    assert res.ok, res.line()
    with pytest.raises(ValueError, match="fma_rows"):
        gemv.fp8_gemv(x, w, s, geometry=gemv.GemvGeometry(fma_rows=3), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [2, 3, 4])
def test_gpu_fma_gemv_rows_at_every_projection_width(M):
    """``fma_rows`` 2 and 4 at every Flash projection (wo_a grouped included) and the rows of verify steps: each row
    the one-row program's bits (the compiled accumulators keep the one-row layout), within the fma bound."""
    gen = torch.Generator(device="cuda").manual_seed(M)
    for name, (N, Kg, groups, aq) in projections(get_preset("flash")).items():
        lin = random_fp8_linear(N, Kg, "cuda", gen, act_quant=aq)
        x = (torch.randn(M, Kg * groups, device="cuda", generator=gen) * 2).to(torch.bfloat16)
        geo = dict(block_n=16, block_k=256, split_k=2)
        alone = gemv.fp8_gemv(x, lin.weight, lin.scale, aq, groups=groups, route="fma",
                              geometry=gemv.GemvGeometry(**geo))
        for rows in (2, 4):
            out = gemv.fp8_gemv(x, lin.weight, lin.scale, aq, groups=groups, route="fma",
                                geometry=gemv.GemvGeometry(**geo, fma_rows=rows))
            assert torch.equal(out, alone), f"{name} fma_rows={rows}"
            res = gemv_bound(out, x, lin.weight, lin.scale, "fma", aq, groups, torch.bfloat16, f"{name} r{rows}")
            assert res.ok, res.line()


@pytest.mark.gpu
@pytest.mark.parametrize("M", [24, 48, 64])
def test_gpu_fp8_gemv_rows64_at_every_projection_width(M):
    """``dot_rows64`` at every Flash projection (wo_a grouped included) and the rows of verify steps and batches:
    within the dot route's bound; the same values as 16 rows per program within that bound too."""
    gen = torch.Generator(device="cuda").manual_seed(M)
    for name, (N, Kg, groups, aq) in projections(get_preset("flash")).items():
        lin = random_fp8_linear(N, Kg, "cuda", gen, act_quant=aq)
        x = (torch.randn(M, Kg * groups, device="cuda", generator=gen) * 2).to(torch.bfloat16)
        for rows in (16, 64):
            out = gemv.fp8_gemv(x, lin.weight, lin.scale, aq, groups=groups, route="dot",
                                geometry=gemv.GemvGeometry(block_n=32, block_k=256, split_k=2, rows_per_program=rows))
            res = gemv_bound(out, x, lin.weight, lin.scale, "dot", aq, groups, torch.bfloat16, f"{name} rows{rows}")
            assert res.ok, res.line()


# ------------------------------------------------------------------------------------------ routed MoE
@pytest.mark.parametrize("route,T", [("dot", 40), ("fma", 12)])
def test_routed_moe_decode_at_many_rows_reads_each_expert_once_per_step(route, T):
    """The decode MoE is already grouped by expert: the program of the first (row, slot) pair routed to an expert
    works for every row routed to it (``_expert_of_pair``, ``_tokens_of``), so a step of many rows — verify steps
    of 4 tokens per sequence, consecutive rows sharing experts — reads each selected expert once. Every
    stage within its bound of the exact oracle; NaN-poisoned scales of unpicked experts and bytes past every
    buffer never read (the dot route's stages); on the ``fma`` route a row's output equals that row computed alone,
    bit for bit (the per-row sums do not depend on the other rows: what makes a T-token step equal T one-token
    steps; the interpreter runs that route row by row, so fewer rows)."""
    x, idx, w, bank = moe_case(T, E=12, k=3, D=160, I=96, seed=T)
    for s in range(0, T, 4):  # the four tokens of a sequence share one expert (drafts of one context often do)
        for t in range(s + 1, s + 4):
            if idx[s, 0] not in idx[t]:  # (an expert already picked, so its scales are not the poisoned ones)
                idx[t, 0] = idx[s, 0]
    geo = G(block_n_up=16, block_n_down=32, block_k=128)
    if route == "dot":  # (the fma route's stages are held to their bound at fewer rows in test_kernels_moe_decode)
        check_moe(x, idx, w, bank, route, geo)
    else:
        ex = moe.ExpertTensors.of(bank)
        y = moe.routed_moe_decode(x, idx, w, ex, LIMIT, route, geo)
        for r in (0, T - 1):
            alone = moe.routed_moe_decode(x[r:r + 1].contiguous(), idx[r:r + 1].contiguous(),
                                          w[r:r + 1].contiguous(), ex, LIMIT, route, geo)
            assert torch.equal(y[r:r + 1], alone), r
