"""Run folders, the notebook output helper, expectations, and the helpers the notebooks call
(:mod:`dsv4lab.tools.drill`, :mod:`dsv4lab.faces.measurements`)."""
from __future__ import annotations

import json
import sys
from datetime import datetime, timezone

import pytest
import torch

from dsv4lab.core import layouts
from dsv4lab.faces import measurements, runs
from dsv4lab.tools import drill as layout_drill


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny model's ops are too small to gain from threads; on a shared 2-core machine they only contend."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ============================================================================================ run folders
def test_runs_in_the_same_second_get_their_own_folders(tmp_path):
    now = datetime(2026, 11, 30, 5, 47, 0, tzinfo=timezone.utc)
    a = runs.create_run_dir(tmp_path, now=now, short_hash="abc1234")
    b = runs.create_run_dir(tmp_path, now=now, short_hash="abc1234")
    assert a.name == "20261130T054700Z_abc1234" and b.name == "20261130T054700Z_abc1234-2"
    assert {p.name for p in a.iterdir()} == {"notebooks", "results", "figures", "logs"}


def test_checkpoint_resolution(tmp_path):
    assert runs.resolve_checkpoint("").name in ("tiny-py", "tiny")
    assert runs.resolve_checkpoint("data/tiny") == (runs.REPO_ROOT / "data" / "tiny").resolve()
    with pytest.raises(runs.RunError, match="CHECKPOINT='nope'"):
        runs.resolve_checkpoint("nope")


# ============================================================================================ notebook outputs
def test_outputs_are_files_and_portable(tmp_path):
    out = runs.NotebookOutputs("99_test", tmp_path / "run", dict(SMOKE=True, checkpoint=runs.REPO_ROOT / "data/tiny"))
    out.key("ratio", float("nan"))
    out.data("where", tmp_path / "run" / "work" / "x")
    table = out.table("rows", [dict(a=1, b=[1, 2]), dict(a=2, c="x")])
    doc = json.loads(out.path.read_text())
    assert doc["parameters"] == {"SMOKE": True, "checkpoint": "data/tiny"}
    assert doc["key_results"] == {"ratio": "nan"} and doc["data"]["where"] == "RUN_DIR/work/x"
    assert (tmp_path / "run" / "results" / "99_test_rows.csv").read_text() == "a,b,c\n1,\"[1,2]\",\n2,,x\n"
    assert "| a | b | c |" in table._repr_markdown_()
    with pytest.raises(runs.RunError):
        runs.NotebookOutputs("notebooks/99_test.ipynb", tmp_path)


def test_figures_are_byte_stable_and_metadata_free(tmp_path):
    from dsv4lab.faces.plots import plot_milestones
    rows = [dict(id="a", label="first", v=14.6, v_range=[14.2, 15.0]), dict(id="b", label="second", v=74.5)]
    hashes = []
    for i in range(2):
        out = runs.NotebookOutputs("99_test", tmp_path / f"run{i}")
        out.figure(plot_milestones(rows, value="v", unit="tok/s", lines={"model": 70.0}), "milestones")
        hashes.append({p.name: runs.file_sha256(p) for p in sorted((tmp_path / f"run{i}" / "figures").iterdir())})
    assert hashes[0] == hashes[1] and set(hashes[0]) == {"99_test_milestones.png", "99_test_milestones.pdf"}
    pdf = (tmp_path / "run0" / "figures" / "99_test_milestones.pdf").read_bytes()
    assert b"CreationDate" not in pdf and b"Matplotlib" not in pdf


def test_plots_import_without_matplotlib():
    code = "import sys, dsv4lab.faces.plots, dsv4lab.faces.runs; assert 'matplotlib' not in sys.modules"
    import subprocess
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ============================================================================================ expectations
@pytest.mark.parametrize("got, exp, ok", [
    (True, {"equals": True}, True), ([0, 2], {"equals": [0, 2]}, True), (1, {"equals": 2}, False),
    (74.0, {"value": 74.5, "rel_tol": 0.01}, True), (70.0, {"value": 74.5, "rel_tol": 0.01}, False),
    (14.9, {"value": 14, "abs_tol": 1.0}, True), (520, {"min": 510, "max": 540}, True),
    (541, {"min": 510, "max": 540}, False), (None, {"max": 0}, False), ("nan", {"max": 1}, False),
])
def test_check_expectation(got, exp, ok):
    assert runs.check_expectation(got, exp)[0] is ok


def test_expectations_file_is_valid_and_names_real_notebooks():
    exp = runs.load_expectations()
    assert set(exp) <= set(runs.NOTEBOOK_ORDER) and len(exp) == len(runs.NOTEBOOK_ORDER)
    doc = dict(parameters=dict(checkpoint="data/tiny"),
               key_results=dict(flash_bytes_per_token=11217580252, mi250_tp4_bound_tok_s=600))
    rows = runs.compare_with_expectations({"05_roofline": doc}, exp, smoke=False)
    status = {r["key"]: r["status"] for r in rows}
    assert status["flash_bytes_per_token"] == "ok" and status["mi250_tp4_bound_tok_s"] == "FAIL"
    assert status["paper_account_predicted_tok_s"] == "missing"


# ============================================================================================ the W2 drill
@pytest.fixture(scope="module")
def faulted(tmp_path_factory):
    out = tmp_path_factory.mktemp("drill") / "faulted"
    hit = layouts.inject_fault_into_checkpoint(runs.REPO_ROOT / "data" / "tiny", layout_drill.PAPER_FAULT, out)
    return out, hit


def test_channel_similarity_shows_the_block_permutation(faulted):
    tiny = runs.REPO_ROOT / "data" / "tiny"
    out, _ = faulted
    linear = layout_drill.expert_linears(tiny)[(1, 3)]
    same = layout_drill.channel_similarity(tiny, tiny, linear, tile=1, seed=5)
    assert torch.allclose(same.diagonal(), torch.ones(128)) and same.shape == (128, 128)
    perm = layouts.FAULTS[layout_drill.PAPER_FAULT].layout.index(256)[128:] - 128  # tile 1 of the stored rows
    sim = layout_drill.channel_similarity(tiny, out, linear, tile=1, seed=5)
    assert torch.equal(sim.argmax(dim=1), perm) and float(sim.max(dim=1).values.min()) > 0.9999
    with pytest.raises(ValueError, match="tile 2 out of range"):
        layout_drill.channel_similarity(tiny, out, linear, tile=2)


def test_injected_layout_recovered_is_strict(faulted):
    tiny = runs.REPO_ROOT / "data" / "tiny"
    out, hit = faulted
    only = ["layers.0.ffn.experts.*"]
    fp = layouts.fingerprint_checkpoint(out, reference=tiny, only=only)
    verdict = layout_drill.injected_layout_recovered(fp, out, hit, only=only)
    assert verdict["exact"] and verdict["checked"] == 48 and verdict["injected"] == 16
    # claiming an extra faulted linear, or a different fault, must fail the verdict
    assert not layout_drill.injected_layout_recovered(fp, out, hit + ["layers.0.ffn.experts.0.w1"], only=only)["exact"]
    assert not layout_drill.injected_layout_recovered(fp, out, hit, "gate_up_interleave_w2", only=only)["exact"]


def test_isolated_stages_separate_stage_1_from_stage_2(faulted):
    import dsv4lab
    out, _ = faulted
    tiny = runs.REPO_ROOT / "data" / "tiny"
    trusted, suspect = dsv4lab.load(tiny, max_batch=1), dsv4lab.load(out, max_batch=1)
    rows = layout_drill.isolated_moe_stages(trusted, suspect, [3, 17, 99, 250, 4000, 12, 7, 8])
    assert [r["layer"] for r in rows] == list(range(trusted.args.n_layers))
    assert all(r["stage1_w1_cosine"] > 1 - 1e-12 and r["stage1_w3_rel_err"] == 0 for r in rows)
    assert all(r["stage2_w2_cosine"] < 0.6 for r in rows)
    same = layout_drill.isolated_moe_stages(trusted, trusted, [3, 17, 99])
    assert all(r["stage2_w2_rel_err"] == 0 for r in same)


# ============================================================================================ measurements
def test_results_files_are_validated(tmp_path):
    # a GPU with no results folder is a misspelling until its folder exists: an error naming the folders there are
    with pytest.raises(runs.RunError, match=r"GPU='no-such-gpu': no measurements folder .* \(there are: .*h200"):
        measurements.load_results_file("decode_kernels", gpu="no-such-gpu")
    assert measurements.load_results_file("no_such_file", gpu="h200") is None  # a known GPU, nothing measured yet
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    with pytest.raises(runs.RunError, match="not valid JSON"):
        measurements.load_results_file("x", path=bad)
    bad.write_text(json.dumps(dict(gpu="H200", rows=[])))
    with pytest.raises(runs.RunError, match=r"missing provenance field\(s\) \['torch', 'triton', 'commit'\]"):
        measurements.load_results_file("x", path=bad)
    assert measurements.e2e_headline(dict(summary=dict(decode_tok_s=120.5))) == {"decode_tok_s": 120.5}


def test_kernel_checks_restore_the_registry_and_reject_unknown_ops():
    from dsv4lab.tools.verify import registry
    before = {c.name: list(c.shapes) for c in registry.OPS}
    res = measurements.kernel_checks("reference", ["rms_norm", "rope"], max_shapes=1)
    assert res["status"] == "ran" and len(res["rows"]) == 2 and all(r["ok"] for r in res["rows"])
    assert {c.name: list(c.shapes) for c in registry.OPS} == before
    with pytest.raises(runs.RunError, match="unknown op"):
        measurements.kernel_checks("reference", ["no_such_op"])
