"""The notebooks: committed without outputs and in step with their sources; each runs green in SMOKE mode through
``dsv4lab reproduce`` and meets the reference expectations; parameter mistakes and failing cells are reported
with the notebook and cell, after the manifest and partial outputs are written."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4lab import runs

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"

# Expectations that depend on kernels still under development elsewhere: reported in the run's report.md, not
# asserted here (the kernel tests own them).
NOT_ASSERTED = {("03_decode_ablation", "interpreter_failed_checks"),
                ("04_prefill_ablation", "interpreter_failed_checks")}


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def _reproduce(*argv: str) -> int:
    from dsv4lab.cli import main
    return main(["reproduce", *argv])


def _only_run(out: Path) -> Path:
    folders = [p for p in out.iterdir() if p.is_dir()]
    assert len(folders) == 1, folders
    return folders[0]


# ============================================================================================ static checks
def test_every_declared_notebook_is_committed():
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == sorted(runs.NOTEBOOK_ORDER)


@pytest.mark.parametrize("name", runs.NOTEBOOK_ORDER)
def test_committed_notebook_has_no_outputs(name):
    nb = _read(NOTEBOOKS / f"{name}.ipynb")
    for i, cell in enumerate(nb["cells"], 1):
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [], f"{name} cell {i} has outputs: clear them (python scripts/build_notebooks.py)"
            assert cell["execution_count"] is None, f"{name} cell {i} has an execution count"
    assert "widgets" not in nb["metadata"], f"{name} carries saved widget state"


@pytest.mark.parametrize("name", runs.NOTEBOOK_ORDER)
def test_first_code_cell_is_the_annotated_parameters_cell(name):
    import papermill
    nb = _read(NOTEBOOKS / f"{name}.ipynb")
    first = next(c for c in nb["cells"] if c["cell_type"] == "code")
    assert "parameters" in first["metadata"].get("tags", []), f"{name}: first code cell is not tagged 'parameters'"
    declared = papermill.inspect_notebook(str(NOTEBOOKS / f"{name}.ipynb"))
    for p in runs.REQUIRED_PARAMETERS:
        assert p in declared, f"{name} does not declare {p}"
        assert declared[p]["help"], f"{name}: parameter {p} has no help comment"
    assert declared["SMOKE"]["inferred_type_name"] == "bool" and declared["CHECKPOINT"]["default"] == '""'


def test_notebooks_are_built_from_their_sources():
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_notebooks.py"), "--check"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


# ============================================================================================ parameters
def test_unknown_parameter_is_refused_naming_the_notebook_and_its_cell(tmp_path, capsys):
    params = tmp_path / "p.yaml"
    params.write_text("SEED: 3\n01_layout_repair:\n  LAYR: 2\n")
    assert _reproduce("--only", "01", "--params", str(params), "--out", str(tmp_path / "runs")) == 2
    err = capsys.readouterr().err
    assert "01_layout_repair (parameters cell: cell 2, id cell-02): unknown parameter 'LAYR'" in err
    assert "LAYER" in err  # the declared names are listed
    run = _only_run(tmp_path / "runs")
    manifest = _read(run / "manifest.json")
    assert manifest["status"] == "invalid_parameters" and manifest["notebooks"][0]["status"] == "not_run"
    assert (run / "report.md").exists()


def test_parameter_of_the_wrong_type_and_global_names_nobody_declares(tmp_path, capsys):
    params = tmp_path / "p.yaml"
    params.write_text("SEED: three\nNOT_A_PARAMETER: 1\n")
    assert _reproduce("--only", "05", "--params", str(params), "--out", str(tmp_path / "runs")) == 2
    err = capsys.readouterr().err
    assert "parameter SEED is declared int (default 0), got 'three': expected an integer" in err
    assert "no selected notebook declares a parameter 'NOT_A_PARAMETER'" in err


def test_only_refuses_unknown_notebooks(tmp_path, capsys):
    assert _reproduce("--only", "09", "--out", str(tmp_path)) == 2
    assert "--only '09': no such notebook" in capsys.readouterr().err
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # nothing was started


# ============================================================================================ failures
FAILING_SOURCE = '''
# %% tags=["parameters"]
RUN_DIR: str = ""  # run folder
SMOKE: bool = False  # smoke
INTERACTIVE: bool = False  # widgets
SEED: int = 0  # seed
CHECKPOINT: str = ""  # checkpoint

# %%
from dsv4lab import runs
from dsv4lab.plots import plot_milestones
out = runs.notebook_outputs("NAME", RUN_DIR, dict(SEED=SEED))
out.key("before_the_failure", 1)
out.figure(plot_milestones([dict(id="a", label="a", v=1.0)], value="v", unit="u"), "partial")

# %%
stage = "the second line of this cell raises"
raise ValueError("deliberate failure for the test")

# %%
out.key("after_the_failure", 2)
'''


@pytest.mark.notebooks
def test_failing_cell_is_named_and_the_run_keeps_manifest_and_partial_outputs(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from build_notebooks import build
    finally:
        sys.path.pop(0)
    nbdir = tmp_path / "nbs"
    nbdir.mkdir()
    for name in ("a_fails", "b_passes"):
        src = tmp_path / f"{name}.py"
        text = FAILING_SOURCE.replace("NAME", name)
        if name == "b_passes":
            text = text.replace('raise ValueError("deliberate failure for the test")', "del stage")
        src.write_text(text)
        (nbdir / f"{name}.ipynb").write_text(build(src))
    rc = _reproduce("--notebooks-dir", str(nbdir), "--out", str(tmp_path / "runs"))
    assert rc == 1
    err = capsys.readouterr().err
    assert re.search(r"a_fails failed in cell 3 \(id cell-03, In \[\d+\]\), line 2: ", err), err
    assert '`raise ValueError("deliberate failure for the test")` — ValueError: deliberate failure for the test' in err
    run = _only_run(tmp_path / "runs")
    manifest = _read(run / "manifest.json")
    assert manifest["status"] == "failed"
    a, b = manifest["notebooks"]
    assert a["status"] == "failed" and a["error"]["cell"] == 3 and a["error"]["ename"] == "ValueError"
    assert a["error"]["line"] == 2
    assert b["status"] == "ok"  # the run goes on after a failure
    assert "figures/a_fails_partial.png" in a["outputs"] and "results/a_fails.json" in a["outputs"]
    partial = _read(run / "results" / "a_fails.json")
    assert partial["key_results"] == {"before_the_failure": 1}
    assert (run / "notebooks" / "a_fails.ipynb").exists() and (run / "logs" / "a_fails.log").exists()
    assert "a_fails failed in cell 3" in (run / "report.md").read_text()


# ============================================================================================ SMOKE runs
@pytest.mark.notebooks
@pytest.mark.parametrize("name", runs.NOTEBOOK_ORDER)
def test_notebook_runs_green_in_smoke_mode(name, tmp_path):
    assert _reproduce("--only", name, "--smoke", "--out", str(tmp_path)) == 0
    run = _only_run(tmp_path)
    manifest = _read(run / "manifest.json")
    entry = manifest["notebooks"][0]
    assert manifest["status"] == "ok" and entry["status"] == "ok" and entry["parameters"]["SMOKE"] is True
    assert manifest["git"]["commit"] and manifest["environment"]["torch"]["version"]
    assert manifest["checkpoint"]["weights"] and entry["source_sha256"]
    results = _read(run / "results" / f"{name}.json")
    assert results["key_results"], f"{name} recorded no key results"
    pngs = [f for f in entry["outputs"] if f.startswith("figures/") and f.endswith(".png")]
    assert pngs, f"{name} saved no figure"
    for png in pngs:  # every figure in both formats, listed with its hash
        assert png[:-4] + ".pdf" in entry["outputs"]
    rows = runs.compare_with_expectations({name: results}, runs.load_expectations(), smoke=True)
    bad = [r for r in rows if r["status"] in ("FAIL", "missing") and (name, r["key"]) not in NOT_ASSERTED]
    assert not bad, bad
    assert (run / "report.md").exists() and not (run / "work" / name).exists()
