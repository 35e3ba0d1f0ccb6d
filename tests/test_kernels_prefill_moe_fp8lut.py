"""The grouped MoE's ``fp8lut`` route (issue 34): FP4 weights decoded to E4M3 by a per-group byte table, FP8 MMAs
promoted per 128-wide K tile, gate and up in one MMA operand, persistent expert-ordered work.

In Triton's CPU interpreter (CI) on small irregular shapes — experts with no token and with one, partial N and K
tiles, NaN-poisoned buffers the kernels must not read into a stored output — stage by stage against the exact
reference within the op bounds under the accumulation the kernel uses (fp32 in the interpreter, the ``fp8_mma``
model on a GPU, derived in ``dsv4lab.tools.verify.op_bounds.dot.promoted_fp8_model``); the decode table against an
independent E4M3 oracle for every byte and offset; the exactness window and the fallbacks; the compilation for
sm_90 (an FP8 wgmma must be emitted); ``gpu`` tests at real widths and the inline-PTX decode's self-test.
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import compiled_kernel_rows
from dsv4lab.core import quant
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.engine.kernel_families import PREFILL_MOE
from dsv4lab.tools.verify.bounds import gamma
from dsv4lab.tools.verify.op_bounds import OP_BOUNDS, check_expectation, promoted_fp8_model
from dsv4lab.tools.verify.registry import make_bank, routing
from dsv4lab.tools.verify.stages import default_accumulation
from dsv4lab.tools.verify.variants import fp8_mma_matmul

pytest.importorskip("triton")
fm = pytest.importorskip("dsv4lab_kernels.fp4_moe_grouped")
fl = pytest.importorskip("dsv4lab_kernels.fp4_moe_fp8lut")

NM = Numerics()
REF = ReferenceOps(NM)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _dev() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _acc(out: torch.Tensor) -> str:
    return "fp8_mma" if out.is_cuda else default_accumulation(out.device)


def _check(name, out, op, *inputs, output=None):
    expect = OP_BOUNDS[op](NM, _acc(out), *inputs)
    if output is not None:
        expect = expect[output]
    ref = getattr(REF, op)(*inputs)
    res = check_expectation(out, ref if output is None else ref[output], expect, name)
    assert res.ok, res.line()
    return res


def _case(T, E, k, D, I, seed, device="cpu", offset=0, n_local=None):
    """Random bf16 tokens and a bank; the routing leaves expert E−1 without a token and gives expert E−2 exactly
    one (token 0's first choice)."""
    g = torch.Generator().manual_seed(seed)
    idx, w = routing(g, T, E, k, skip=2)
    idx[0, 0] = E - 2
    x = (torch.randn(T, D, generator=g) * 2).to(torch.bfloat16)
    n_local = E if n_local is None else n_local
    bank = make_bank(n_local, D, I, torch.Generator().manual_seed(seed + 100), device, offset)
    return x.to(device), idx.to(device), w.float().to(device), bank


# ------------------------------------------------------------------------------------------ the decode
def test_the_group_tables_hold_each_magnitudes_e4m3_byte_at_every_offset():
    """The two table words of offset ``d`` (0 … 11) hold E4M3(v · 2^(d−5)) of the eight E2M1 magnitudes, code 0
    stays 0, and no byte carries into its neighbour or reaches E4M3's NaN (0x7F)."""
    for d in range(12):
        lo = (fl.LUT_LO.value + 8 * d * 0x01010100) & 0xFFFFFFFF
        hi = (fl.LUT_HI.value + 8 * d * 0x01010101) & 0xFFFFFFFF
        table = [(lo >> (8 * i)) & 0xFF for i in range(4)] + [(hi >> (8 * i)) & 0xFF for i in range(4)]
        want = (E2M1 * 2.0 ** (d - 5)).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
        assert table == want and max(table) <= 0x7C, d


def test_the_decode_gives_every_byte_under_every_offset_its_e4m3_values():
    """The portable decode (the interpreter's; on a GPU the inline PTX must equal it, :func:`lut_decode_works`)
    against an E4M3 conversion of the E2M1 values: 256 bytes × 12 offsets, signs and zeros included."""
    w, d = fl.decode_probe_inputs("cpu")
    lo, hi = fl.decode(w.to(_dev()), d.to(_dev()), False)
    dd = d.repeat_interleave(16, 1).double()

    def e4m3(code):
        v = E2M1.double()[code & 7] * torch.exp2(dd - 5)
        return torch.where(code & 8 != 0, -v, v).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(lo.cpu(), e4m3(w.long() & 15)) and torch.equal(hi.cpu(), e4m3(w.long() >> 4))
    assert len(set(zip(w.flatten().tolist(), dd.flatten().tolist()))) == 256 * 12


# ------------------------------------------------------------------------------------------ the route
@pytest.mark.parametrize("T,E,k,D,I,rows,geo", [
    # partial K tiles (160 = 128 + 32) and N tiles (I 96 < the 128-column item; D 160 = 128 + 32), per-row reference
    (23, 7, 3, 160, 96, 16, dict(lut_ref="row")),
    # whole tiles: the scale bytes read four at a time, one reference per tile, a persistent grid
    (13, 6, 2, 256, 128, 32, dict(lut_ref="tile", persistent=True)),
])
def test_fp8lut_matches_the_reference_stage_by_stage(T, E, k, D, I, rows, geo):
    """Stage 1 (g, u), stage 2 and the fused routed MoE within their bounds; h's buffers NaN-poisoned (a read of a
    padding row would reach the output); an expert with no token and one with exactly one."""
    x, idx, w, bank = _case(T, E, k, D, I, seed=T, device=_dev())
    assert fl.lut_route_exact(bank)
    g = fm.MoEGeometry(rows=rows, **geo)
    kg, ku = fm.moe_stage1(x, idx, bank, route="fp8lut", geo=g)
    _check("stage1.g", kg, "moe_stage1", x, idx, bank, output=0)
    _check("stage1.u", ku, "moe_stage1", x, idx, bank, output=1)
    rg, ru = REF.moe_stage1(x, idx, bank)
    h = REF.moe_activation(rg, ru, w, 10.0)
    _check("stage2", fm.moe_stage2(h, idx, bank, route="fp8lut", geo=g), "moe_stage2", h, idx, bank)
    y = fm.routed_experts(x, idx, w, bank, 10.0, route="fp8lut", geo=g, poison=True)
    _check("routed", y, "routed_experts", x, idx, w, bank, 10.0)


def test_fp8lut_on_an_expert_parallel_slice_writes_only_its_slots():
    """Experts 3…5 of 8 live here: the other ranks' slots stay NaN in the stages and contribute nothing."""
    x, idx, w, bank = _case(17, 8, 3, 160, 96, seed=9, offset=3, n_local=3)
    g = fm.MoEGeometry(rows=16)
    kg, _ = fm.moe_stage1(x, idx, bank, route="fp8lut", geo=g)
    _check("stage1.g (EP slice)", kg, "moe_stage1", x, idx, bank, output=0)  # NaN exactly on other ranks' slots
    y = fm.routed_experts(x, idx, w, bank, 10.0, route="fp8lut", geo=g, poison=True)
    _check("routed (EP slice)", y, "routed_experts", x, idx, w, bank, 10.0)


@pytest.mark.parametrize("ref", ["row", "tile"])
def test_the_route_never_reads_past_the_bank(ref):
    """The bank's tensors are the heads of larger buffers whose tails are poison (scale byte 255 = E8M0 NaN, weight
    byte 0x77 = ±6 everywhere): a K group read past the last row's end changes that row's reference scale (``row``)
    or adds products (an unmasked weight against an unmasked activation), and the output with it. (A row past the
    N edge only feeds its own output row, which is never stored.)"""
    x, idx, w, bank = _case(11, 4, 2, 160, 96, seed=4)
    idx[0] = torch.tensor([3, 0])  # the last expert has a token: its last rows are read
    for name in ("w1", "w3", "w2", "w1_scale", "w3_scale", "w2_scale"):
        t = getattr(bank, name).view(torch.uint8)
        buf = torch.full((t.numel() + 4096,), 255 if name.endswith("scale") else 0x77, dtype=torch.uint8)
        buf[:t.numel()] = t.flatten()
        bank._buffers[name] = buf[:t.numel()].view(t.shape).view(getattr(bank, name).dtype)
    y = fm.routed_experts(x, idx, w, bank, 10.0, route="fp8lut", geo=fm.MoEGeometry(rows=16, lut_ref=ref),
                          poison=True)
    _check("routed (poisoned tails)", y, "routed_experts", x, idx, w, bank, 10.0)


# ------------------------------------------------------------------------------------------ exactness and fallback
def _new_scales(bank, make):
    """Give the bank new scale tensors ``make(old bytes)`` (new tensors: the exactness checks remember their answer
    per tensor)."""
    for name in ("w1_scale", "w3_scale", "w2_scale"):
        old = getattr(bank, name)
        bank._buffers[name] = make(old.view(torch.uint8).clone()).view(old.dtype)


def _set_scales(bank, fill, rows=None, col=0, value=None):
    def make(s):
        s.fill_(fill)
        if rows is not None:
            s[:, rows, col] = value
        return s
    _new_scales(bank, make)


def test_the_window_is_eleven_binades_per_reference_block_and_the_backend_falls_back():
    from dsv4lab.engine.triton_prefill import TritonPrefillBackend
    bank = make_bank(3, 256, 128, torch.Generator().manual_seed(2))
    _set_scales(bank, 120, rows=5, col=1, value=131)  # one group of row 5 eleven binades up: exact per row
    assert fl.lut_route_exact(bank) and fl.tile_tops((bank.w2_scale,), 128, 128)[1]
    _set_scales(bank, 120, rows=5, col=1, value=132)  # twelve: not for fp8lut, still for fp8 (14)
    assert not fl.lut_route_exact(bank) and fm.fp8_route_exact(bank)
    assert TritonPrefillBackend(NM, moe_route="fp8lut")._moe_route(bank) == "fp8"
    _set_scales(bank, 120, rows=5, col=1, value=135)  # fifteen: bf16
    assert TritonPrefillBackend(NM, moe_route="fp8lut")._moe_route(bank) == "bf16"
    for bad in (255, 6):  # E8M0's NaN; a byte whose promotion factor is no fp32 normal
        _set_scales(bank, 120 if bad == 255 else 8, rows=0, col=0, value=bad)
        assert not fl.lut_route_exact(bank), bad
    with pytest.raises(AssertionError, match="fp8lut route"):
        fm._check_route("fp8lut", bank, fm.MoEGeometry())


def test_a_fallback_from_fp8lut_runs_at_its_own_default_decode():
    """fp8lut asked with its portable decode (what a tuned ``lut_portable`` choice sets) on a bank outside the
    window: the fallback route runs at its own default decode (``portable`` is no decode of the bf16 route) and
    matches the reference."""
    from dsv4lab.engine.triton_prefill import TritonPrefillBackend
    x, idx, w, bank = _case(9, 4, 2, 256, 128, seed=14)
    for value, route in ((132, "fp8"), (135, "bf16")):
        _set_scales(bank, 120, rows=5, col=1, value=value)
        ops = TritonPrefillBackend(NM, min_tokens=1, moe_route="fp8lut", moe_decode="portable", moe_rows=16)
        assert ops._moe_plan(bank, None, 9)[0] == route
        _check(f"routed ({route} fallback)", ops.prefill_routed_experts(x, idx, w, bank, 10.0), "routed_experts",
               x, idx, w, bank, 10.0)


def test_one_reference_per_tile_where_the_scales_allow_it_else_per_row():
    """Rows 11 binades apart in one tile: exact per row, not per tile — ``auto`` takes rows (and computes what
    ``row`` does), ``tile`` is refused; the tile tops hold each tile's largest byte."""
    x, idx, w, bank = _case(9, 4, 2, 256, 128, seed=12)
    def make(s):
        s.copy_(torch.randint(118, 124, s.shape, generator=torch.Generator().manual_seed(1)).to(torch.uint8))
        s[:, 7, :] += 8  # row 7: a whole row higher, up to 13 binades above the lowest byte of its tile
        return s
    _new_scales(bank, make)
    tops, exact = fl.tile_tops((bank.w1_scale, bank.w3_scale), 64, 128)
    assert not exact and int(tops[0, 0, 0]) == int(bank.w1_scale.view(torch.uint8)[0, :64, :4].max().clamp(
        min=bank.w3_scale.view(torch.uint8)[0, :64, :4].max()))
    assert fl.lut_route_exact(bank)
    with pytest.raises(ValueError, match="ref 'tile'"):
        fm.moe_stage1(x, idx, bank, route="fp8lut", geo=fm.MoEGeometry(rows=16, lut_ref="tile"))
    auto = fm.moe_stage1(x, idx, bank, route="fp8lut", geo=fm.MoEGeometry(rows=16))
    row = fm.moe_stage1(x, idx, bank, route="fp8lut", geo=fm.MoEGeometry(rows=16, lut_ref="row"))
    assert all(torch.equal(a, b) for a, b in zip(auto, row))
    _check("stage1.g (row reference)", auto[0], "moe_stage1", x, idx, bank, output=0)


def test_a_decode_the_route_has_not_is_refused_and_asm_needs_a_gpu():
    assert not fl.lut_decode_works("cpu")
    x, idx, w, bank = _case(5, 3, 2, 160, 96, seed=1)
    for decode, msg in (("f16", "unknown fp8lut decode"), ("asm", "'asm' is not usable here")):
        with pytest.raises(ValueError, match=msg):
            fm.moe_stage1(x, idx, bank, route="fp8lut", geo=fm.MoEGeometry(rows=16, decode=decode))


# ------------------------------------------------------------------------------------------ the bound
def test_the_route_is_judged_by_the_promoted_fp8_model_and_its_arithmetic_lies_inside_it():
    """The family's model of the route is what the derivation gives for each of its K tiles; the route's exact
    operands summed as Hopper's FP8 MMA sums them (14-bit truncating partials per 128, fp32 across: simulated by
    ``fp8_mma_matmul``) land inside the ``fp8_mma`` bound of stage 1, and the same sum with one 128-wide K block
    left out does not (the bound is no tolerance: it still fails a lost block)."""
    for v in PREFILL_MOE.variants:
        if v.route in (None, "fp8lut"):
            assert promoted_fp8_model(v.fields.get("block_k1", 128), 4096) == PREFILL_MOE.accumulation_of("fp8lut")
    with pytest.raises(ValueError):
        promoted_fp8_model(256, 4096)
    assert gamma(4096, "fp8_mma") < gamma(4096, "fp32_tc") * 2 ** 11
    g = torch.Generator().manual_seed(3)
    T, E, D, I = 64, 2, 1024, 128
    bank = make_bank(E, D, I, g)
    idx = torch.zeros(T, 1, dtype=torch.long)
    x = (torch.randn(T, D, generator=g) * 3).to(torch.bfloat16)
    xq = quant.act_qdq_fp8(x).float()
    w1 = bank.dequantized("w1", 0, torch.float32)  # exact: each weight is an E4M3 value times a power of two
    expect = OP_BOUNDS["moe_stage1"](NM, "fp8_mma", x, idx, bank)[0]
    lost = torch.ones(D)
    lost[256:384] = 0
    for keep, inside in ((torch.ones(D), True), (lost, False)):
        sim = fp8_mma_matmul(xq * keep, w1, block=128, step=32, bits=14).to(torch.bfloat16).float()[:, None, :]
        res = check_expectation(sim, REF.moe_stage1(x, idx, bank)[0], expect, "simulated FP8 MMA")
        assert res.ok == inside, res.line()
    assert math.isfinite(float(expect.hi.abs().max()))


# ------------------------------------------------------------------------------------------ verify kernels
def test_verify_kernels_runs_the_fp8lut_variants():
    """``verify kernels`` iterates the family's variants: the fp8lut ones run their kernel on a registry shape
    and are judged under the route's model."""
    from dsv4lab.engine.triton_prefill import TritonPrefillBackend
    ops = TritonPrefillBackend(NM)
    names = [n for n in ops.prefill_variants("routed_experts") if "fp8lut" in n]
    assert names == ["prefill_fp8lut_rows16", "prefill_fp8lut_rows32_persistent_row_ref"]
    assert "prefill_fp8lut" in ops.prefill_variants("moe_stage1")
    x, idx, w, bank = _case(7, 5, 2, 96, 64, seed=21)
    for name in names:
        y = ops.prefill_variants("routed_experts")[name](x, idx, w, bank, 10.0)
        _check(f"verify variant {name}", y, "routed_experts", x, idx, w, bank, 10.0)
        acc = ops.prefill_variant_accumulation("routed_experts", name, x, idx, w, bank, 10.0)
        assert acc == ("fp32" if x.device.type == "cpu" else "fp8_mma")


# ------------------------------------------------------------------------------------------ the GPU compiler
@pytest.mark.slow
def test_fp8lut_compiles_to_fp8_wgmma_for_sm90():
    """``scripts/compile_prefill_moe.py --quick``: both stages of the default launch compile for sm_90 with the
    signature the JIT gives them there, their PTX multiplies on FP8 tensor cores (wgmma, E4M3 × E4M3), and the
    layout Triton chose hands the inline-PTX decode four bytes of one weight group per call (its single table per
    call needs it); the decode's self-test kernel compiles too. Skipped where Triton has no NVIDIA backend."""
    rows = compiled_kernel_rows("compile_prefill_moe.py")
    for kernel in ("_gate_up_kernel", "_down_kernel"):
        row = next(r for r in rows if r["kernel"] == kernel)
        assert any(m.startswith("wgmma.mma_async") and m.endswith("e4m3.e4m3") for m in row["mma"]), row
        assert row["asm_packs_one_group"] is True, row  # the inline PTX's one table per four bytes holds
    assert any(r["kernel"] == "_decode_probe_kernel" and r["ok"] for r in rows)


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_gpu_table_decode_self_test_passes_on_hopper():
    assert fl.lut_decode_works("cuda"), fl.lut_decode_status("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("geo", [dict(rows=64), dict(rows=128), dict(rows=64, persistent=True),
                                 dict(rows=64, lut_ref="row"), dict(rows=64, decode="portable")])
def test_gpu_fp8lut_at_real_widths_stage_by_stage(geo):
    """D 4096, I 2048, 32 experts with about as many rows each as 256 experts at 4,096 tokens: every stage within
    its bound under the fp8_mma model; the asm decode and the portable one give the same bits."""
    x, idx, w, bank = _case(512, 32, 6, 4096, 2048, seed=11, device="cuda")
    g = fm.MoEGeometry(**geo)
    kg, ku = fm.moe_stage1(x, idx, bank, route="fp8lut", geo=g)
    _check("gpu stage1.g", kg, "moe_stage1", x, idx, bank, output=0)
    _check("gpu stage1.u", ku, "moe_stage1", x, idx, bank, output=1)
    if geo.get("decode") != "portable":
        pg, pu = fm.moe_stage1(x, idx, bank, route="fp8lut", geo=g.replace(decode="portable"))
        assert torch.equal(kg, pg) and torch.equal(ku, pu)
    rg, ru = REF.moe_stage1(x, idx, bank)
    h = REF.moe_activation(rg, ru, w, 10.0)
    _check("gpu stage2", fm.moe_stage2(h, idx, bank, route="fp8lut", geo=g), "moe_stage2", h, idx, bank)
    y = fm.routed_experts(x, idx, w, bank, 10.0, route="fp8lut", geo=g, poison=True)
    _check("gpu routed", y, "routed_experts", x, idx, w, bank, 10.0)
