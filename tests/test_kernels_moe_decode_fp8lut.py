"""The routed-MoE decode's ``fp8lut`` route (``kernels/dsv4lab_kernels/fp4_moe_decode_fp8lut.py``): the decode's
structure with the grouped prefill's table decode to E4M3 and FP8 MMAs.

In Triton's CPU interpreter on small irregular shapes (partial 128-wide K tiles, 3 and 5 rows, an expert shared by
two rows), every stage against its exact oracle within the ``fp8_mma`` model's bound (the route's: exact products,
``γ_min(n,128)(2^-13) + γ_⌈n/128⌉(2^-23)`` of ``Σ|terms|``, derived in ``op_bounds.dot.promoted_fp8_model``) and,
where the interpreter sums in IEEE fp32, within fp32's; NaN-poisoned memory no kernel may read (bytes past every
buffer, the scales of unpicked experts and of other ranks' experts); a poisoned group of a picked expert poisons
exactly its row, as in the reference; a bank outside the byte table's window refused in one line, and the Triton
backend then on its default route. ``gpu`` tests repeat the stages at real widths and check the asm decode and
graph replay bit for bit.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4lab.core.model.numerics import Numerics
from dsv4lab.engine.kernel_families import MOE
from dsv4lab.tools.bench.decode import moe_stage_checks
from dsv4lab.tools.verify.bounds import check_within_bound
from dsv4lab.tools.verify.op_bounds import promoted_fp8_model

pytest.importorskip("triton")
moe = pytest.importorskip("dsv4lab_kernels.fp4_moe_decode")
lut = pytest.importorskip("dsv4lab_kernels.fp4_moe_decode_fp8lut")
from conftest import compiled_kernel_rows  # noqa: E402
from test_kernels_moe_decode import LIMIT, moe_case  # noqa: E402

G = moe.MoeGeometry
GEO = G(block_n_up=16, block_n_down=32, block_k=128, num_warps=1, num_stages=3)


def _check_stages(x, idx, w, bank, geo, name):
    for c in moe_stage_checks(x, idx, w, moe.ExpertTensors.of(bank), "fp8lut", geo, LIMIT, name=name):
        assert c.ok, c.line()


def _windowed(bank, lo=117, hi=123, seed=0):
    """New scale tensors within the byte table's window everywhere (no NaN bytes): one reference per tile holds."""
    g = torch.Generator().manual_seed(seed)
    for name in ("w1_scale", "w3_scale", "w2_scale"):
        old = getattr(bank, name)
        bank._buffers[name] = torch.randint(lo, hi, old.shape, generator=g, dtype=torch.uint8).to(
            old.device).view(old.dtype)


def _stage1_g(x, idx, ex, geo):
    return moe.moe_gate_up(x, idx, None, ex, LIMIT, "fp8lut", geo, write_gu=True)[0]


# ------------------------------------------------------------------------------------------ the stages
def test_fp8lut_stages_within_the_fp8_mma_bound_and_the_interpreters_fp32():
    """Three rows (two share an expert), D 160 and I 96 (partial K tiles: 128 + 32, and 96 < 128), one reference
    per weight row: g and u, the fused activation, the down projection of the kernel's own h and the combined
    output within the route's bound; the unpicked experts' scales are E8M0 NaN and every buffer ends in poison,
    so a read of either would reach an output. In the interpreter the MMAs sum in fp32: g is within fp32's bound
    too (a far tighter check of the same arithmetic)."""
    x, idx, w, bank = moe_case(3, seed=21)
    assert len(set(idx.flatten().tolist())) < idx.numel()  # an expert with two rows
    geo = dataclasses.replace(GEO, block_n_up=64, block_n_down=64)  # partial N tiles too: 96 = 64 + 32, 160
    _check_stages(x, idx, w, bank, geo, "fp8lut row-ref")
    if x.device.type == "cpu":
        ex = moe.ExpertTensors.of(bank)
        og, _ = moe.reference_stage1(x, idx, ex)
        c = check_within_bound(_stage1_g(x, idx, ex, geo), og.ref, og.magnitude.nan_to_num(0.0), terms=og.terms,
                               acc_dtype="fp32", out_dtype=torch.bfloat16, name="fp8lut g (interpreter fp32)")
        assert c.ok, c.line()


def test_a_launch_without_a_geometry_takes_the_routes_own_k_step():
    """``routed_moe_decode(..., route="fp8lut")`` with no geometry runs (the defaults' 256-wide K step is refused by
    the route: the GPU suite's real-width calls failed on it at 3dac085) and equals the launch given that geometry."""
    x, idx, w, bank = moe_case(2, seed=23)
    ex = moe.ExpertTensors.of(bank)
    geo = moe.default_geometry("fp8lut")
    lut.check_geometry(geo)
    with pytest.raises(ValueError, match="block_k=256"):
        lut.check_geometry(moe.MoeGeometry())
    got = moe.routed_moe_decode(x, idx, w, ex, LIMIT, route="fp8lut")
    assert torch.equal(got, moe.routed_moe_decode(x, idx, w, ex, LIMIT, route="fp8lut", geometry=geo))
    assert moe.default_geometry("fma") == moe.MoeGeometry()


def test_fp8lut_with_one_scale_reference_per_tile_on_five_rows():
    """Five rows over whole K tiles (D 128, I 64: one tile each), gate/up tiles of 8 columns (16 weight rows, the
    MMA's least), one reference per tile: within the bound; ``auto`` takes tiles here and rows where a NaN byte is in
    the bank."""
    x, idx, w, bank = moe_case(5, E=7, k=2, D=128, I=64, seed=5)
    _windowed(bank)
    geo = dataclasses.replace(GEO, block_n_up=8, block_n_down=32, lut_ref="tile")
    _check_stages(x, idx, w, bank, geo, "fp8lut tile-ref")
    ex = moe.ExpertTensors.of(bank)
    assert lut.lut.scale_reference("auto", (ex.w2_scale,), 32, 128)[0]  # tiles: the bank allows it
    _, _, _, poisoned = moe_case(5, E=7, k=2, D=128, I=64, seed=5)  # unpicked experts' scales NaN
    assert not lut.lut.scale_reference("auto", (moe.ExpertTensors.of(poisoned).w2_scale,), 32, 128)[0]


def test_an_expert_parallel_slice_and_a_poisoned_group_of_a_picked_expert():
    """Experts 4…7 of 10 live here: other ranks' slots stay NaN in g and in the slot outputs. One 32-group scale
    of a picked expert's w2 row set to E8M0's NaN: that output column is NaN for the expert's slots, as in the
    reference (and nothing else is)."""
    x, idx, w, bank = moe_case(4, seed=8, offset=4, n_local=4)
    ex = moe.ExpertTensors.of(bank)
    local = (idx >= 4) & (idx < 8)
    assert local.any() and (~local).any()
    g = _stage1_g(x, idx, ex, GEO)
    assert torch.isnan(g[~local]).all() and torch.isfinite(g[local]).all()
    e = int(idx[local][0]) - 4
    s2 = ex.w2_scale.clone()
    s2[e, 3, 1] = 255
    ex = dataclasses.replace(ex, w2_scale=s2, scales_le_2=None)
    h = (torch.randn(*idx.shape, ex.inter, generator=torch.Generator().manual_seed(1)) * 0.5).to(torch.bfloat16)
    out = moe.moe_down(h, idx, ex, "fp8lut", GEO, per_slot=True)
    oracle = moe.reference_stage2(h, idx, ex)
    c, acc = moe.bound_args("fp8lut", oracle.terms)
    res = check_within_bound(out, oracle.ref, oracle.magnitude.nan_to_num(0.0), terms=oracle.terms, c=c,
                             acc_dtype=acc, out_dtype=torch.bfloat16, name="fp8lut down, one NaN group")
    assert res.ok, res.line()  # NaN exactly where the oracle's
    assert torch.isnan(out[idx == e + 4][:, 3]).all() and int(torch.isnan(out[local]).sum()) == (idx == e + 4).sum()


def test_the_bound_fails_a_wrong_scale():
    """Negative control: the kernel's w2 with one group's scale doubled (byte + 1) in a picked expert fails the
    stage-2 check against the true bank's oracle."""
    x, idx, w, bank = moe_case(2, seed=4, share=False)
    ex = moe.ExpertTensors.of(bank)
    h = (torch.randn(*idx.shape, ex.inter, generator=torch.Generator().manual_seed(2)) * 0.5).to(torch.bfloat16)
    s2 = ex.w2_scale.clone()
    s2[int(idx[0, 0]), :, 0] += 1
    wrong = moe.moe_down(h, idx, dataclasses.replace(ex, w2_scale=s2), "fp8lut", GEO, per_slot=True)
    oracle = moe.reference_stage2(h, idx, ex)
    c, acc = moe.bound_args("fp8lut", oracle.terms)
    res = check_within_bound(wrong, oracle.ref, oracle.magnitude.nan_to_num(0.0), terms=oracle.terms, c=c,
                             acc_dtype=acc, out_dtype=torch.bfloat16, name="wrong scale")
    assert not res.ok and res.n_violations > 0


# ------------------------------------------------------------------------------------------ refusals, fallback
def test_a_bank_outside_the_window_is_refused_in_one_line_and_the_backend_falls_back():
    """One group of a picked expert's w1 row twelve binades above the rest of its K tile: the launcher refuses in
    one line; the Triton backend, asked for fp8lut by its tuned table, runs its default route instead (the same
    bits as that route launched directly), and fp8lut again once the bank is back in the window. Bad geometries
    and numerics without FP8 activations are refused too."""
    from dsv4lab.engine.dispatch import INTERPRETER_DEFAULTS, SCHEMA, Dispatch, Tuned
    from dsv4lab.engine.triton_backend import TritonOps
    x, idx, w, bank = moe_case(2, E=4, k=2, D=128, I=64, seed=3, share=False)
    _windowed(bank, 118, 120)
    ex = moe.ExpertTensors.of(bank)
    doc = dict(schema=SCHEMA, gpu="test", sources={"t": {}}, ops={"decode.moe": [
        dict(rows=1, source="t", choice=dict(route="fp8lut", block_n_up=16, block_n_down=32, block_k=128))]})
    ops = TritonOps(Numerics(), Dispatch(Tuned(doc), INTERPRETER_DEFAULTS))
    want = moe.routed_moe_decode(x, idx, w, ex, LIMIT, "fp8lut", G(block_n_up=16, block_n_down=32, block_k=128))
    assert torch.equal(ops.routed_experts(x, idx, w, bank, LIMIT), want)

    s1 = bank.w1_scale.view(torch.uint8).clone()
    s1[int(idx[0, 0]), 5, 1] = 130  # 12 binades above 118
    bank._buffers["w1_scale"] = s1.view(bank.w1_scale.dtype)
    ex = moe.ExpertTensors.of(bank)
    with pytest.raises(ValueError, match="fp8lut routed-MoE route: some expert weight row") as err:
        moe.routed_moe_decode(x, idx, w, ex, LIMIT, "fp8lut", GEO)
    assert "\n" not in str(err.value)
    default = moe.routed_moe_decode(x, idx, w, ex, LIMIT, INTERPRETER_DEFAULTS.moe_route,
                                    G(**INTERPRETER_DEFAULTS.moe_geometry))
    assert torch.equal(ops.routed_experts(x, idx, w, bank, LIMIT), default)

    for geo, msg in ((G(block_k=256), "block_k=128"), (dataclasses.replace(GEO, block_n_down=8), "≥ 16 weight rows"),
                     (dataclasses.replace(GEO, slot_split=1), "expert-major"),
                     (dataclasses.replace(GEO, decode="bytewise"), "table decode")):
        with pytest.raises(ValueError, match=msg):
            moe.routed_moe_decode(x, idx, w, ex, LIMIT, "fp8lut", geo)
    assert "act_quant on" in lut.refusal(ex, False, torch.bfloat16)


# ------------------------------------------------------------------------------------------ declarations
def test_the_route_is_declared_with_its_derived_model():
    """The family declares fp8lut under ``fp8_mma``, which the derivation gives for its 128-wide tiles; the kernel's
    table names the same model; its variants build geometries the route takes; a tuned file may name it (an
    unknown route is refused in one line) and the defaults never do."""
    from dsv4lab.engine.dispatch import GPU_DEFAULTS, SCHEMA, DispatchError, Tuned
    assert MOE.accumulation_of("fp8lut") == promoted_fp8_model(lut.BLOCK_K, 4096) == moe.ACCUMULATION["fp8lut"][1]
    assert moe.bound_args("fp8lut", 300) == (300, "fp8_mma") and moe.bound_args("fma", 300) == (300.0, torch.float32)
    variants = [v for v in MOE.variants if v.route == "fp8lut"]
    assert {"verify", "quick", "full", "smoke"} <= set().union(*(v.runs for v in variants))
    for v in variants:
        lut.check_geometry(G(**v.fields))
    assert GPU_DEFAULTS.moe_route != "fp8lut"
    doc = dict(schema=SCHEMA, gpu="test", sources={"t": {}}, ops={"decode.moe": [
        dict(rows=1, source="t", choice=dict(route="fp8lut", block_k=128))]})
    assert Tuned(doc).lookup("decode.moe", 1)["choice"]["route"] == "fp8lut"
    doc["ops"]["decode.moe"][0]["choice"]["route"] = "fp8lux"
    with pytest.raises(DispatchError, match="unknown routed-MoE route 'fp8lux'"):
        Tuned(doc)


# ------------------------------------------------------------------------------------------ the GPU compiler
@pytest.mark.slow
def test_the_route_compiles_to_fp8_wgmma_for_sm90_and_the_table_decode_gets_one_group_per_call():
    """``scripts/compile_decode_moe.py --quick``: today's tuned batch-1 route and the first quick fp8lut geometry at
    Flash widths compile for sm_90 with the JIT's GPU signature; the fp8lut kernels multiply on FP8 tensor cores
    (wgmma, E4M3 × E4M3) and Triton's layout hands the inline-PTX table decode four bytes of one weight group per
    call (its single table per call needs it); every weight-streaming kernel's K loop is counted per weight byte.
    Skipped where Triton has no NVIDIA backend."""
    rows = compiled_kernel_rows("compile_decode_moe.py")
    for kernel in ("_moe_up_lut_kernel", "_moe_down_lut_kernel"):
        row = next(r for r in rows if r["kernel"] == kernel)
        assert any(m.startswith("wgmma.mma_async") and m.endswith("e4m3.e4m3") for m in row["mma"]), row
        assert row["asm_packs_one_group"] is True and row["per_weight_byte"] > 0, row
    assert all(r["per_weight_byte"] > 0 for r in rows if r["kernel"] in ("_moe_up_kernel", "_moe_down_expert_kernel"))


# ------------------------------------------------------------------------------------------ GPU, real widths
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("geo", [GEO, dataclasses.replace(GEO, block_n_up=32, block_n_down=32, num_warps=2),
                                 dataclasses.replace(GEO, block_n_up=64, block_n_down=64, num_warps=4)],
                         ids=["n16w1", "n32w2", "n64w4"])
def test_gpu_fp8lut_real_widths_within_bound(T, geo):
    x, idx, w, bank = moe_case(T, E=8, k=6, D=4096, I=2048, seed=1, device="cuda")
    _check_stages(x, idx, w, bank, geo, f"gpu fp8lut T{T}")


@pytest.mark.gpu
def test_gpu_table_decode_asm_and_portable_give_the_same_bits():
    x, idx, w, bank = moe_case(4, E=8, k=6, D=4096, I=2048, seed=2, device="cuda")
    ex = moe.ExpertTensors.of(bank)
    assert lut.lut.lut_decode_works("cuda"), lut.lut.lut_decode_status("cuda")
    got = moe.routed_moe_decode(x, idx, w, ex, LIMIT, "fp8lut", dataclasses.replace(GEO, decode="asm"))
    assert torch.equal(got, moe.routed_moe_decode(x, idx, w, ex, LIMIT, "fp8lut",
                                                  dataclasses.replace(GEO, decode="plain")))


@pytest.mark.gpu
def test_gpu_fp8lut_graph_replay_equals_eager():
    x, idx, w, bank = moe_case(8, E=16, k=6, D=4096, I=2048, seed=3, device="cuda")
    ex = moe.ExpertTensors.of(bank)
    eager = moe.routed_moe_decode(x, idx, w, ex, LIMIT, "fp8lut", GEO)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.routed_moe_decode(x, idx, w, ex, LIMIT, "fp8lut", GEO)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
