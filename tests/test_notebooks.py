"""The notebooks: percent-format text notebooks (``notebooks/NAME.py``, read and written by jupytext), which hold
no outputs, and JupyterLab saves them back unchanged after a run; each runs green in SMOKE mode through
``dsv4lab reproduce``, meets the reference expectations and saves only figures that pass the figure rules; parameter
mistakes and failing cells are reported with the notebook and cell, after the manifest and partial outputs are
written; a notebook run by hand writes into ``scratch/``, not ``runs/``; cells display compact tables."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from dsv4lab.faces import runs
from dsv4lab.faces.commands.reproduce import read_notebook

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"

# Expectations that depend on kernels still under development elsewhere: reported in the run's report.md, not
# asserted here (the kernel tests own them).
NOT_ASSERTED = {("03_decode_ablation", "interpreter_failed_checks"),
                ("04_prefill_ablation", "interpreter_failed_checks")}


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def _reproduce(*argv: str) -> int:
    from dsv4lab.faces.cli import main
    return main(["reproduce", *argv])


def _reproduce_with_params(tmp_path: Path, only: str, params_yaml: str) -> int:
    """``reproduce --only ONLY --params p.yaml --out tmp_path/runs`` with ``params_yaml`` as the parameter file."""
    params = tmp_path / "p.yaml"
    params.write_text(params_yaml)
    return _reproduce("--only", only, "--params", str(params), "--out", str(tmp_path / "runs"))


def _only_run(out: Path) -> Path:
    folders = [p for p in out.iterdir() if p.is_dir()]
    assert len(folders) == 1, folders
    return folders[0]


# ============================================================================================ static checks
def test_every_declared_notebook_is_committed_as_a_text_notebook():
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.py")) == sorted(runs.NOTEBOOK_ORDER)
    tracked = subprocess.run(["git", "ls-files", "notebooks"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode == 0:  # a checkout: no notebook is committed in a form that can hold outputs
        assert [f for f in tracked.stdout.split() if f.endswith(".ipynb")] == []


@pytest.mark.parametrize("name", runs.NOTEBOOK_ORDER)
def test_text_notebook_is_what_jupytext_writes_back(name):
    """Reading and writing the file gives it back byte for byte, with no header: what JupyterLab saves is what is
    committed (only cell tags are kept, by ``notebooks/jupytext.toml``)."""
    import jupytext
    text = (NOTEBOOKS / f"{name}.py").read_text()
    assert text.startswith("# %%"), f"{name}: a text notebook starts with its first cell (no metadata header)"
    assert jupytext.writes(jupytext.reads(text, fmt="py:percent"), fmt="py:percent") == text


def test_the_jupytext_setting_keeps_only_cell_tags():
    import tomllib
    config = tomllib.loads((NOTEBOOKS / "jupytext.toml").read_text())
    assert config == {"formats": "py:percent", "notebook_metadata_filter": "-all",
                      "cell_metadata_filter": "tags,-all"}
    lab = _read(NOTEBOOKS / "jupyter_config" / "labconfig" / "default_setting_overrides.json")
    assert lab["@jupyterlab/docmanager-extension:plugin"]["defaultViewers"]["python"] == "Jupytext Notebook"


@pytest.mark.parametrize("name", runs.NOTEBOOK_ORDER)
def test_first_code_cell_is_the_annotated_parameters_cell(name):
    import papermill
    nb = read_notebook(NOTEBOOKS / f"{name}.py")
    first = next(c for c in nb["cells"] if c["cell_type"] == "code")
    assert "parameters" in first["metadata"].get("tags", []), f"{name}: first code cell is not tagged 'parameters'"
    declared = papermill.inspect_notebook(nb)
    for p in runs.REQUIRED_PARAMETERS:
        assert p in declared, f"{name} does not declare {p}"
        assert declared[p]["help"], f"{name}: parameter {p} has no help comment"
    assert declared["SMOKE"]["inferred_type_name"] == "bool" and declared["CHECKPOINT"]["default"] == '""'


def test_a_text_notebook_without_a_parameters_cell_is_refused_naming_it(tmp_path, capsys):
    (tmp_path / "plain.py").write_text("# %%\nprint('no parameters cell')\n")
    assert _reproduce("--notebooks-dir", str(tmp_path), "--out", str(tmp_path / "runs")) == 2
    assert "plain: no cell tagged 'parameters'" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


# ============================================================================================ saving from JupyterLab
def _saved_after_a_run(tmp_path, keep_notebook_metadata: bool) -> tuple[Path, str]:
    """Save 05_roofline through jupytext's contents manager (what JupyterLab's server runs) as JupyterLab sends it
    after a run: outputs, execution counts, editor metadata. Returns the saved file and the committed text."""
    from jupytext import TextFileContentsManager
    folder = tmp_path / "notebooks"
    folder.mkdir()
    committed = (NOTEBOOKS / "05_roofline.py").read_text()
    (folder / "05_roofline.py").write_text(committed)
    (folder / "jupytext.toml").write_text((NOTEBOOKS / "jupytext.toml").read_text())
    manager = TextFileContentsManager(root_dir=str(folder))
    nb = manager.get("05_roofline.py", content=True, type="notebook")["content"]
    if not keep_notebook_metadata:  # a notebook that never had its filters recorded: only the setting keeps them
        nb["metadata"].pop("jupytext", None)
    nb["metadata"]["language_info"] = {"name": "python", "version": "3.11.7",
                                       "codemirror_mode": {"name": "ipython", "version": 3}}
    nb["metadata"]["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    for i, cell in enumerate(nb["cells"]):
        cell["metadata"].update(scrolled=True, execution={"iopub.status.idle": "2026-12-01T00:00:00Z"})
        if cell["cell_type"] == "code":
            cell["execution_count"] = i
            cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "ran\n"}]
    manager.save(dict(type="notebook", format="json", content=nb), "05_roofline.py")
    return folder / "05_roofline.py", committed


@pytest.mark.parametrize("keep_notebook_metadata", [True, False])
def test_a_save_after_a_run_in_jupyterlab_writes_the_committed_text(tmp_path, keep_notebook_metadata):
    saved, committed = _saved_after_a_run(tmp_path, keep_notebook_metadata)
    assert saved.read_text() == committed
    assert sorted(p.name for p in saved.parent.iterdir()) == ["05_roofline.py", "jupytext.toml"]  # no paired copy


def test_a_cell_edited_in_jupyterlab_reaches_the_text_notebook(tmp_path):
    from jupytext import TextFileContentsManager
    saved, committed = _saved_after_a_run(tmp_path, True)
    manager = TextFileContentsManager(root_dir=str(saved.parent))
    nb = manager.get(saved.name, content=True, type="notebook")["content"]
    nb["cells"][-1]["source"] = "out.summary()  # edited in JupyterLab"
    manager.save(dict(type="notebook", format="json", content=nb), saved.name)
    text = saved.read_text()
    assert text.rstrip().endswith("out.summary()  # edited in JupyterLab") and text != committed
    assert '# %% tags=["parameters"]' in text


# ============================================================================================ runs by hand, displays
def test_a_notebook_run_by_hand_writes_into_its_scratch_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(runs, "SCRATCH_DIR", tmp_path / "scratch")
    monkeypatch.setattr(runs.scratch_dir, "__defaults__", (tmp_path / "scratch",))
    out = runs.notebook_outputs("05_roofline", "")
    assert out.run_dir == tmp_path / "scratch" / "05_roofline"
    out.key("first", 1)
    (out.figures_dir / "stale.png").write_bytes(b"x")
    again = runs.notebook_outputs("05_roofline", "")
    assert again.run_dir == out.run_dir and not (out.figures_dir / "stale.png").exists()  # replaced, not piled up
    assert not (runs.REPO_ROOT / "runs" / "05_roofline").exists()
    assert "/scratch/" in (runs.REPO_ROOT / ".gitignore").read_text()


def test_tables_display_compactly_and_key_results_are_not_a_dict_dump(tmp_path):
    rows = [dict(op=f"op{i}", ratio=1 / 3, ids=list(range(40)), ok=True, note=None) for i in range(30)]
    table = runs.Table(rows)
    html = table._repr_html_()
    assert html.count("<tr>") == 1 + table.limit and "18 more rows (all in the CSV)" in html
    text = table.text()
    assert len(text.splitlines()) == 2 + table.limit + 1 and "0.333333" in text and "…" in text and "—" in text
    out = runs.NotebookOutputs("99_test", tmp_path)
    out.keys(a=1, b="x")
    assert out.data("d", {"k": list(range(100))}) is None  # a cell ending with it shows nothing
    assert out.summary().text().splitlines()[2:] == ["a    1", "b    x"]


# ============================================================================================ parameters
def test_unknown_parameter_is_refused_naming_the_notebook_and_its_cell(tmp_path, capsys):
    assert _reproduce_with_params(tmp_path, "01", "SEED: 3\n01_layout_repair:\n  LAYR: 2\n") == 2
    err = capsys.readouterr().err
    assert "01_layout_repair (parameters cell: cell 2, id cell-02): unknown parameter 'LAYR'" in err
    assert "LAYER" in err  # the declared names are listed
    run = _only_run(tmp_path / "runs")
    manifest = _read(run / "manifest.json")
    assert manifest["status"] == "invalid_parameters" and manifest["notebooks"][0]["status"] == "not_run"
    assert (run / "report.md").exists()


def test_parameter_of_the_wrong_type_and_global_names_nobody_declares(tmp_path, capsys):
    assert _reproduce_with_params(tmp_path, "05", "SEED: three\nNOT_A_PARAMETER: 1\n") == 2
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
from dsv4lab.faces import runs
from dsv4lab.faces.plots import plot_milestones
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
    nbdir = tmp_path / "nbs"
    nbdir.mkdir()
    for name in ("a_fails", "b_passes"):
        text = FAILING_SOURCE.replace("NAME", name)
        if name == "b_passes":
            text = text.replace('raise ValueError("deliberate failure for the test")', "del stage")
        (nbdir / f"{name}.py").write_text(text.lstrip())
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
    assert results.get("figure_problems", {}) == {}, results["figure_problems"]
