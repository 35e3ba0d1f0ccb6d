"""The stage-isolated layer oracle (:mod:`dsv4lab.tools.verify.stages`) and the calibrated model tier.

* the recording is a prefill, an eager decode step and a step of the engine's static decode path; the reference
  replayed against it is bit-identical at every stage, and every op of the forward and of the static step — the
  fused ones included — has a stage name, a ``verify kernels`` case and a bound that contains the reference;
* legitimate rounding variants (fp32 reductions, split-K, online-softmax attention, FP8-MMA accumulation) pass
  every stage, and the Triton backend under the interpreter comes out clean stage by stage (``slow``);
* a fault in a fused op of the static step (the ring row, the compressor's entry rotation) is named at its stage;
* each call's accumulation model is the one its kernel's table states (the measured dispatch's cuBLAS or GEMV route,
  the MoE route, FP8 or bf16 tensor cores at prefill sizes, fp32 for the glue);
* backend faults (one expert's W2 read permuted, a bf16 accumulation) and the model faults are named at their layer
  and stage by the replay; checkpoint faults, which make reference and backend agree, are named by the reference
  run's digests (tier ``checkpoint``) — the bf16 accumulation and the one-expert W2 fault both stay inside the
  calibrated KL bound, which is why the stage and checkpoint tiers are binding;
* an op with no bound is a failure; top-k ties are ties; the KL factors equal the committed calibration.

Short inputs (24 tokens: a 22-token prefill, an eager and a static decode step) keep the replays to seconds, and
the replays run on the first three layers of each checkpoint (SWA, CSA, HCA: every kind of the six, same widths;
conftest's ``layer_cut``); the tiers that read the golden layer digests run on the whole checkpoints.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import dsv4lab
from dsv4lab.core.layouts import FAULTS, inject_fault_into_checkpoint
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.tools.verify.faults import MODEL_FAULTS, faulty_backend
from dsv4lab.tools.verify import model as model_tier
from dsv4lab.tools.verify.backend_faults import BACKEND_FAULTS, inject_backend_fault
from dsv4lab.tools.verify.op_bounds import OP_BOUNDS, TopK, check_outputs, check_topk
from dsv4lab.tools.verify.registry import OPS
from dsv4lab.tools.verify.stages import bound_of, output_names, record_reference, replay, replay_call, stage_name
from dsv4lab.tools.verify.variants import VARIANTS, KernelLike

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINTS = {"tiny": ROOT / "data" / "tiny", "tiny-py": ROOT / "data" / "tiny-py"}
SHORT = 24
CLI = [sys.executable, "-m", "dsv4lab"]

# the issue's stage list, as the replay names them
ISSUE_STAGES = {"attention input (attn_norm)", "q after norm + RoPE", "kv after norm + RoPE",
                "compressor entries (norm + RoPE)", "indexer scores", "indexer top-k",
                "attention core (sparse attention)", "attention output (wo_b)", "router logits", "router scores",
                "MoE stage 1 (w1 gate, w3 up projections)", "MoE activation (clamped SwiGLU × routing weight)",
                "MoE stage 2 (w2 down projection)", "MoE combine", "shared expert (whole)", "mHC pre (attention site)",
                "mHC post (MoE site)", "head (logits)"}
BACKEND_EXPECT = {"w2_one_expert": ("layers.1", "MoE stage 2 (w2 down projection)"),
                  "bf16_accumulation": ("layers.1", "attention output (wo_b)")}
MODEL_EXPECT = {"no_shared_clamp": (None, "shared expert activation"),
                "rope_first_half": ("layers.0", "q after norm + RoPE"),
                "rope_non_interleaved": ("layers.0", "q after norm + RoPE"),
                "compressed_rope_block_end": ("layers.1", "RoPE position"),
                "stale_compressor_state": ("layers.1", "state reset")}
LAYOUT_EXPECT = {"paper_w2_blocks": ("layers.0", "stage 2"), "writer_preshuffle": ("layers.0", "stage 1 (w1"),
                 "swapped_nibbles": ("layers.1", "stage 1"), "scales_not_permuted": ("layers.0", "stage 2"),
                 "paper_w2_one_expert": ("layers.1", "stage 2"), "gate_up_interleave_w2": ("layers.0", "stage 2")}

_cache: dict = {}
REPLAYED: dict[str, Path] = {}  # name → the three-layer cut the replays record and replay on (set below)


@pytest.fixture(scope="module", autouse=True)
def _replay_on_the_cuts(layer_cut):
    REPLAYED.update({name: layer_cut(name) for name in CHECKPOINTS})


def _golden(name):
    return model_tier.load_golden(model_tier.golden_path_for(CHECKPOINTS[name]))


def _recorded(name: str, n: int = SHORT):
    """(reference runner, recorded calls) of the golden layer input's first ``n`` tokens on the three-layer cut of
    ``name``, cached per module."""
    key = (name, n)
    if key not in _cache:
        ref = dsv4lab.load(REPLAYED[name], max_batch=1)
        ids = _golden(name)["layers"]["input_ids"][:n]
        _cache[key] = (ref, record_reference(ref, ids))
    return _cache[key]


def _backend(name, ops_class=None, fault=None, model_fault=None, whole=False):
    """The reference (or ``ops_class``, a backend fault, a model fault) on the cut of ``name`` that
    :func:`_recorded` records, or with ``whole`` on the checkpoint itself."""
    backend = faulty_backend(model_fault) if model_fault is not None else "reference"
    b = dsv4lab.load(CHECKPOINTS[name] if whole else REPLAYED[name], max_batch=1, backend=backend)
    if ops_class is not None:
        b.ops = ops_class(b.ops.numerics)
    if fault is not None:
        inject_backend_fault(b, fault)
    return b


def _failures(report):
    return "\n".join(s.line() for s in report.stages if not s.ok)


# ------------------------------------------------------------------------------------------ clean runs
def test_reference_against_itself_is_bit_identical_at_every_stage():
    ref, calls = _recorded("tiny")
    report = replay(calls, _backend("tiny"), ref)
    assert report.ok and {s.verdict for s in report.stages} == {"bit-identical"}
    names = {s.stage for s in report.stages}
    assert ISSUE_STAGES <= names, ISSUE_STAGES - names
    assert {s.block for s in report.stages} == {f"layers.{i}" for i in range(3)} | {"model"}
    # a prefill, an eager decode step and a static one (the engine's decode step) were recorded
    assert {(c.forward, c.path) for c in calls} == {(0, "prefill"), (1, "eager"), (2, "static")}


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_every_op_of_the_forward_and_the_static_step_has_a_stage_name_a_registry_case_and_a_bound(name):
    """... and the bound contains the reference's own output (else the derivation is wrong)."""
    ref, calls = _recorded(name)
    nm = ref.ops.numerics
    assert [c.path for c in calls if c.depth == 0][-1] == "static" and {"eager", "static"} <= {c.path for c in calls}
    assert {"attention_from_caches", "compressor_step", "kv_norm_rope", "hc_post_pre_norm"} <= {c.op for c in calls}
    assert {"indexer_select_decode", "router_topk", "indexer_query"} <= {c.op for c in calls}
    registered = {case.method for case in OPS}
    for call in calls:
        assert call.op in OP_BOUNDS, f"{call.op} has no bound"
        assert call.op in registered, f"{call.op} has no verify kernels case"
        assert not call.stage.startswith(f"{call.op} ("), f"no stage name for {call.op} at {call.owner}"
        outs = call.out if isinstance(call.out, tuple) else (call.out,)
        for res in check_outputs(outs, outs, bound_of(call, nm, "fp32"), output_names(call)):
            assert res.ok and not res.bound_defect, res.line()


@pytest.mark.parametrize("name", CHECKPOINTS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_legitimate_rounding_variants_pass_every_stage(name, variant):
    ref, calls = _recorded(name)
    report = replay(calls, _backend(name, VARIANTS[variant]), ref)
    assert report.ok, _failures(report)
    assert any(s.verdict == "within bound" for s in report.stages)  # not bit-identical: the bounds were used


# ------------------------------------------------------------------------------------------ faults
@pytest.mark.parametrize("name", CHECKPOINTS)
@pytest.mark.parametrize("fault", sorted(BACKEND_FAULTS))
def test_backend_faults_are_named_at_their_layer_and_stage(name, fault):
    ref, calls = _recorded(name)
    report = replay(calls, _backend(name, KernelLike, fault=fault), ref)
    assert not report.ok
    block, stage = BACKEND_EXPECT[fault]
    assert (report.first.block, report.first.stage) == (block, stage), report.first.line()
    worst = report.first.worst()[1].worst
    assert worst["out"] != worst["ref"] and worst["index"]  # the worst element, both values, its position


class RingRowLate(KernelLike):
    """The decode step's window KV row written one ring row late (a fused kernel's store offset)."""

    def kv_norm_rope(self, kv, weight, eps, cos, sin, positions, ring=None, slots=None):
        out = super().kv_norm_rope(kv, weight, eps, cos, sin, positions)
        if ring is not None:
            ring[slots, (positions.reshape(-1) + 1) % ring.shape[1]] = out.reshape(slots.shape[0], -1).to(ring.dtype)
        return out


class EntryAtBlockEnd(KernelLike):
    """The compressor's decode step rotating a finished entry at its block's last position (the prefill path's
    helper stays right)."""

    def compressor_step(self, comp, *args):
        late = copy.copy(self)
        late.compressed_rope_position = lambda block, ratio: block * ratio + ratio - 1
        return ReferenceOps.compressor_step(late, comp, *args)


@pytest.mark.parametrize("ops_class,op,stage,containing", [
    (RingRowLate, "kv_norm_rope", "kv norm + RoPE + FP8 sim, ring write (fused)", "attention_norms"),
    (EntryAtBlockEnd, "compressor_step", "decode step: ring, pooling, entry write (fused)", "compressor_pair")])
def test_a_fault_in_a_fused_op_of_the_static_step_is_named_at_its_stage(ops_class, op, stage, containing):
    """The faulty op's stage fails first; the only other stage blamed is the one-launch op the static step calls
    that contains it (this backend composes it of the faulty part), nothing else."""
    ref, calls = _recorded("tiny")
    report = replay(calls, _backend("tiny", ops_class), ref)
    assert not report.ok and stage in report.first.stage, report.first.line()
    assert {s.op for s in report.stages if not s.ok} == {op, containing}, _failures(report)


@pytest.mark.parametrize("fault", sorted(MODEL_FAULTS))
def test_model_faults_are_named_by_the_replay(fault):
    ref, calls = _recorded("tiny", 96)  # the shared clamp acts only on larger pre-activations: the full input
    report = replay(calls, _backend("tiny", model_fault=fault), ref)
    assert not report.ok
    block, stage = MODEL_EXPECT[fault]
    assert stage in report.first.stage and (block is None or report.first.block == block), report.first.line()


@pytest.mark.parametrize("fault", sorted(LAYOUT_EXPECT))
def test_checkpoint_faults_fail_a_fast_backend_at_the_checkpoint_tier(fault, tmp_path):
    # a faulted checkpoint makes reference and backend agree: the stages pass, the reference's digests do not
    assert set(LAYOUT_EXPECT) == set(FAULTS)
    bad = tmp_path / "bad"
    inject_fault_into_checkpoint(CHECKPOINTS["tiny"], fault, bad)
    ref = dsv4lab.load(bad, max_batch=1)
    res = model_tier.verify_model(_backend_at(bad), _golden("tiny"), bad, ref, tiers=("checkpoint", "stages"),
                                  stage_tokens=SHORT)
    assert not res["ok"] and res["tiers"]["stages"]["ok"] and not res["tiers"]["checkpoint"]["ok"]
    block, stage = LAYOUT_EXPECT[fault]
    first = res["first_divergence"]
    assert first["where"] == "checkpoint" and first["block"] == block and stage in first["stage"], first


def _backend_at(path):
    b = dsv4lab.load(path, max_batch=1)
    b.ops = KernelLike(b.ops.numerics)
    return b


def test_verify_model_passes_a_legitimate_backend_and_only_the_stages_catch_a_bf16_accumulation():
    golden = _golden("tiny-py")
    ref = dsv4lab.load(CHECKPOINTS["tiny-py"], max_batch=1)
    tiers = ("vs_reference", "checkpoint", "stages")
    good = model_tier.verify_model(_backend("tiny-py", KernelLike, whole=True), golden, CHECKPOINTS["tiny-py"], ref,
                                   tiers=tiers, stage_tokens=SHORT)
    assert good["ok"], {k: v.get("summary", v.get("ok")) for k, v in good["tiers"].items()}
    assert good["tiers"]["vs_reference"]["max_position"] is not None
    assert good["kl_rule"]["k_mean"] == model_tier.KL_FLOOR_FACTOR_MEAN
    bad = model_tier.verify_model(_backend("tiny-py", KernelLike, fault="bf16_accumulation", whole=True), golden,
                                  CHECKPOINTS["tiny-py"], ref, tiers=tiers, stage_tokens=SHORT)
    assert not bad["ok"] and bad["tiers"]["vs_reference"]["ok"]  # invisible to the KL tier ...
    assert bad["first_divergence"] == dict(where="stages", block="layers.1", stage="attention output (wo_b)")


def test_the_reference_with_a_backend_fault_keeps_exact_tiers_and_is_caught_by_the_stages():
    # its oracles pass (the bf16 accumulation moves no greedy choice) and its own caches agree with themselves
    golden = _golden("tiny-py")
    ref = dsv4lab.load(CHECKPOINTS["tiny-py"], max_batch=1)
    res = model_tier.verify_model(_backend("tiny-py", fault="bf16_accumulation", whole=True), golden,
                                  CHECKPOINTS["tiny-py"], ref, tiers=("oracles", "checkpoint", "stages"),
                                  layer_check="never", stage_tokens=SHORT)
    assert res["exact_semantics"] and res["tiers"]["oracles"]["ok"] and not res["ok"]
    assert res["first_divergence"] == dict(where="stages", block="layers.1", stage="attention output (wo_b)")


# ------------------------------------------------------------------------------------------ rules
def test_an_op_without_a_bound_is_a_failure_not_a_pass(monkeypatch):
    ref, calls = _recorded("tiny")
    call = next(c for c in calls if c.op == "rope")
    monkeypatch.delitem(OP_BOUNDS, "rope")
    faulty = _backend("tiny", model_fault="rope_first_half")
    names = {id(m): n for n, m in ref.model.named_modules()}
    res = replay_call(call, faulty.ops, ref.ops.numerics, names, {}, torch.device("cpu"))
    assert res.verdict == "no bound defined" and not res.ok


def test_topk_ties_are_reported_as_ties_not_mismatches():
    scores = torch.tensor([[[3.0, 1.0, 2.0, 2.0, 0.5]]])
    positions = torch.tensor([[19]])
    t = TopK(scores, positions, 4)
    ref = torch.tensor([[[0, 2, 3]]])
    ok = check_topk(torch.tensor([[[0, 2, 3]]]), ref, t)
    assert ok.ok and ok.bitwise_equal
    scores2 = torch.tensor([[[3.0, 1.0, 2.0, 2.0, 2.0]]])
    tied = check_topk(torch.tensor([[[0, 2, 4]]]), ref, TopK(scores2, positions, 4))
    assert tied.ok and "1 row(s) differ only among tied scores" in tied.rule
    wrong = check_topk(torch.tensor([[[0, 1, 2]]]), ref, t)
    assert not wrong.ok and wrong.worst["only_out"] == [1] and wrong.worst["only_ref"] == [3]


def test_stage_names_follow_the_module_and_the_op():
    assert stage_name("linear", "layers.3.attn.wq_a") == ("layers.3", "q projection (wq_a)")
    assert stage_name("rope", "layers.0.attn.kv_norm") == ("layers.0", "kv after norm + RoPE")
    assert stage_name("linear_f32", "head") == ("model", "head (logits)")
    assert stage_name("fused_thing", "layers.2.attn.wq_b") == ("layers.2", "fused_thing (attn.wq_b)")


def test_kl_factors_equal_the_committed_calibration():
    cal = json.loads((ROOT / "data" / "results" / "host" / "kl_calibration.json").read_text())
    assert (model_tier.KL_FLOOR_FACTOR_MEAN, model_tier.KL_FLOOR_FACTOR_MAX) == (cal["k_mean"], cal["k_max"])
    largest = max(v["mean_over_floor"] for r in cal["rows"] for v in r["variants"].values())
    assert cal["k_mean"] >= 2 * largest and {r["checkpoint"] for r in cal["rows"]} == {"tiny", "tiny-py"}
    # the faults the KL tier alone separates, and those it cannot (caught by the stage and checkpoint tiers)
    faults = {(f["checkpoint"], f["fault"]): f["mean_over_floor"] for f in cal["faults"]}
    assert all(faults[(c, "paper_w2_blocks")] > cal["k_mean"] for c in ("tiny", "tiny-py"))
    assert all(faults[(c, "bf16_accumulation")] < cal["k_mean"] for c in ("tiny", "tiny-py"))


# ------------------------------------------------------------------------------------------ accumulation models
def test_every_kernel_tables_accumulation_has_a_model_ordered_by_looseness():
    from dsv4lab.engine import triton_backend as tb
    from dsv4lab.engine.triton_prefill import KIND_MODEL
    from dsv4lab.tools.verify.bounds import UNIT_ROUNDOFF, gamma
    assert set(tb.ACCUMULATION_MODELS) <= set(UNIT_ROUNDOFF) and set(KIND_MODEL.values()) <= set(UNIT_ROUNDOFF)
    widths = [gamma(4096, m) for m in tb.ACCUMULATION_MODELS]
    assert widths == sorted(widths) and len(set(widths)) == len(widths)
    for table in (tb.gemv.ACCUMULATION, tb.moe.ACCUMULATION):
        for route, (_, factor) in table.items():
            assert tb.accumulation_model(factor) in tb.ACCUMULATION_MODELS, route
    with pytest.raises(ValueError, match="no accumulation model"):
        tb.accumulation_model(3.0)


def test_the_triton_backend_names_the_accumulation_of_the_kernel_each_call_takes(monkeypatch):
    """On a GPU (simulated: the dispatch's device checks bypassed) each call is judged by the model of its own
    kernel: a projection the measured dispatch sends to cuBLAS by cuBLAS's, one it keeps on the GEMV by its route's,
    a prefill-sized FP8 projection by FP8 tensor cores', the MoE by its route's, the glue by fp32; a variant by its
    fixed route. Under the interpreter every call is fp32."""
    from dsv4lab.engine import triton_backend as tb
    from dsv4lab.engine import triton_prefill as tp
    from dsv4lab.engine.dispatch import GPU_DEFAULTS, SCHEMA, Dispatch, Tuned, shape_key
    from dsv4lab.core.model.numerics import Numerics
    from dsv4lab.tools.verify.kernels import variant_accumulation
    from dsv4lab.tools.verify.registry import make_bank, make_linear, routing

    g = torch.Generator().manual_seed(0)
    lin, lin2 = make_linear("fp8", 96, 256, g), make_linear("fp8", 128, 256, g)
    bank = make_bank(8, 128, 64, g)
    x1, x100 = torch.randn(1, 256).bfloat16(), torch.randn(100, 256).bfloat16()
    idx, w = routing(g, 1, 8, 2)
    doc = dict(schema=SCHEMA, gpu="test", sources={"t": {}}, ops={"decode.gemv": [
        dict(shape=shape_key(96, 256, 1, "fp8", True), rows=1, source="t", choice=dict(impl="cublas")),
        dict(shape=shape_key(128, 256, 1, "fp8", True), rows=1, source="t", choice=dict(impl="triton", route="fma"))],
        "decode.moe": [dict(rows=1, source="t", choice=dict(route="fma"))]})
    defaults = dataclasses.replace(GPU_DEFAULTS, moe_route="dot", gemv_route="dot")
    ops = tb.TritonOps(Numerics(), Dispatch(Tuned(doc), defaults))
    assert ops.accumulation_for("linear", x1, lin) == "fp32"  # the interpreter: numpy's fp32
    # every kernel module the calls below may load is loaded first: a module imported while `interpreting` is
    # patched binds the patch for good (`from .fp8_gemm import interpreting`) and runs the later tests compiled
    for name in ("fp8_gemm", "fp4_moe_grouped", "attention_prefill", "moe_sort", "mhc", "rowops", "fp8_gemv",
                 "fp4_moe_decode"):
        tp._kernels(name)
    monkeypatch.setattr(tb, "interpreting", lambda: False)
    monkeypatch.setattr(tp, "_can_launch", lambda t: True)
    monkeypatch.setattr(tp._kernels("fp8_gemm"), "interpreting", lambda: False)
    monkeypatch.setattr(tb.TritonOps, "_unsupported", lambda self, rows, *t: None if rows <= 63 else "rows")
    assert ops.accumulation_for("linear", x1, lin) == "fp32_tc4"  # cuBLAS, as the dispatch measured
    assert ops.accumulation_for("linear", x1, lin2) == "fp32"  # the GEMV's fma route
    assert ops.accumulation_for("linear", x1, lin2, route="dot") == "fp32_tc4"
    assert ops.accumulation_for("linear", x100, lin) == "fp8_mma"  # the prefill FP8 GEMM
    assert ops.accumulation_for("routed_experts", x1[:, :128], idx, w, bank, 10.0) == "fp32"  # measured: fma
    assert ops.accumulation_for("moe_stage1", x1[:, :128], idx, bank) == "fp32_tc4"  # the configured dot route
    x100m = torch.randn(100, 128).bfloat16()
    idx100, w100 = routing(g, 100, 8, 2)
    assert ops.accumulation_for("routed_experts", x100m, idx100, w100, bank, 10.0) == "fp32_tc"  # prefill bf16
    assert ops.accumulation_for("expert_mlp", x1, lin2, lin2, lin2, 10.0) == "fp32"
    assert ops.accumulation_for("expert_mlp", x1, lin, lin2, lin, 10.0) == "fp32_tc4"  # the loosest part
    assert ops.accumulation_for("hc_pre_norm", None) == "fp32" and ops.accumulation_for("rms_norm", x1) == "fp32"
    assert ops.accumulation_for("attention_from_caches", x1) == "fp32_tc4"
    variants = ops.variants("linear")
    assert variant_accumulation(ops, "triton:fma", "linear", (x1, lin), "cuda", variants["fma"]) == "fp32"
    assert variant_accumulation(ops, "triton:dot", "linear", (x1, lin), "cuda", variants["dot"]) == "fp32_tc4"
    assert variant_accumulation(ops, "triton:prefill_gemm", "linear", (x1, lin), "cuda",
                                variants["prefill_gemm"]) == "fp8_mma"


# ------------------------------------------------------------------------------------------ CLI
def test_cli_verify_layers_names_a_backend_fault_and_writes_json(tmp_path):
    r = subprocess.run(CLI + ["verify", "layers", "--checkpoint", str(CHECKPOINTS["tiny"]), "--backend-fault",
                              "w2_one_expert", "--stage-tokens", str(SHORT), "--out", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "first defect: layers.1 — MoE stage 2 (w2 down projection)" in r.stdout
    rep = json.loads((tmp_path / "layers.json").read_text())
    # the faulted backend is the reference's: its own run leaves the golden digests at the same layer and stage
    assert rep["first"]["block"] == "layers.1" and "stage 2" in rep["first"]["stage"]
    assert rep["stages"]["first"]["stage"] == "MoE stage 2 (w2 down projection)" and not rep["ok"]


def test_docs_cover_the_backend_faults_and_link_the_verification_page():
    guide = (ROOT / "docs" / "troubleshooting.md").read_text()
    for name in BACKEND_FAULTS:
        assert f"| `{name}` |" in guide, f"docs/troubleshooting.md has no row for backend fault {name}"
    assert "verification.md" in guide and "verification.md" in (ROOT / "README.md").read_text()


# ------------------------------------------------------------------------------------------ Triton (interpreter)
@pytest.mark.slow
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_triton_backend_is_clean_stage_by_stage_under_the_interpreter(name):
    """A 6-token prefill (prefill kernels from 4 rows), an eager decode step (decode kernels) and a step of the
    engine's static decode path (its fused glue kernels): every op of the Triton backend within its bound on the
    reference's inputs (~30 s of CPU per checkpoint in the interpreter, on the three-layer cut)."""
    ref, calls = _recorded(name, 8)  # the static step at position 7 completes a block of every ratio-4 compressor
    tri = dsv4lab.load(REPLAYED[name], max_batch=1, backend="triton")
    tri.ops.prefill_min_tokens = 4
    report = replay(calls, tri, ref)
    assert report.ok, _failures(report)
    c = tri.ops.calls
    for op in ("linear", "routed_experts", "moe_stage1", "moe_stage2", "sparse_attention"):
        assert c.decode[op] > 0 and c.prefill[op] > 0, (op, tri.ops.report())
    for op in ("hc_pre_norm", "hc_post_pre_norm", "head_rms_rope", "kv_norm_rope", "indexer_query",
               "indexer_select_decode", "router_topk", "compressor_step", "expert_mlp"):
        assert c.glue[op] > 0, (op, tri.ops.report())
    written = [c for c in calls if c.op == "compressor_step" and not torch.equal(c.out[0].isnan(), c.args[5].isnan())]
    assert written, "no compressor step of the recording wrote an entry"


def test_replay_accepts_any_object_with_ops_model_and_device():
    ref, calls = _recorded("tiny")
    b = _backend("tiny", KernelLike)
    report = replay(calls[:40], SimpleNamespace(ops=b.ops, model=b.model, device=b.device), ref)
    assert report.ok
