"""Run folders, the one helper notebooks write their results and figures through, and the manifest and report.

A *run* is one folder ``runs/<UTC timestamp>_<git short hash>/`` that is never reused or overwritten::

    manifest.json           what ran, where, with what (see :func:`write_manifest`)
    report.md               what ran, key tables, figures, comparison with data/reference/ expectations
    notebooks/<name>.ipynb  the executed notebooks (outputs up to the failing cell when one fails)
    results/<name>.json     each notebook's results (+ results/<name>_<table>.csv rows)
    figures/<name>_<tag>.png / .pdf
    logs/<name>.log         cell output as it streamed
    work/<name>/            scratch (faulted checkpoint copies ...), removed by the notebook when it finishes

Notebooks write only through :class:`NotebookOutputs` (``runs.notebook_outputs(NAME, RUN_DIR)``): results
are files, not notebook outputs, and each write rewrites the notebook's JSON, so a notebook that fails
half-way still leaves everything it produced before the failing cell. Files are byte-stable across reruns on
the same data: JSON without timestamps or run paths, figures through the package style with creation metadata
stripped (:func:`dsv4lab.faces.plots.save_figure`). Every saved figure is checked by
:func:`dsv4lab.faces.plots.figure_problems` (title, axis labels, caption, legends); problems are kept in the results.

A person running a notebook by hand (``RUN_DIR`` empty) writes into a scratch folder, ``scratch/<notebook>/``
in the checkout (git-ignored), replaced by the next interactive run of that notebook: dated run folders under
``runs/`` are for ``dsv4lab reproduce``.

Cells display :class:`Table` objects (compact HTML in JupyterLab, a short text table elsewhere), never dict
dumps: :meth:`NotebookOutputs.summary` shows the key results that way.

Nothing here imports torch, matplotlib or papermill at import time.
"""
from __future__ import annotations

import contextlib
import html
import json
import os
import shutil
import signal
import tempfile
import threading
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from dsv4lab.core.errors import RunError, Terminated
from dsv4lab.core.paths import DATA_DIR, EXPECTATIONS_FILE, IN_CHECKOUT, NOTEBOOKS_DIR, REPO_ROOT, display_path, read_yaml
from dsv4lab.faces.plots import figure_problems, save_figure
from dsv4lab.core.provenance import (dumps, environment, file_sha256, git_state, jsonable, md_table, rows_to_csv,
                         source_date_epoch, utc_stamp, write_text_if_changed)

DEFAULT_RUNS_DIR = Path("runs")
# Where a notebook run by hand (RUN_DIR empty) writes: one folder per notebook, replaced by its next such run.
SCRATCH_DIR = REPO_ROOT / "scratch" if IN_CHECKOUT else Path(tempfile.gettempdir()) / "dsv4lab-scratch"

# The declared order `dsv4lab reproduce` runs the notebooks in (each stands alone; the order is the story's).
NOTEBOOK_ORDER = (
    "00_quickstart",
    "01_layout_repair",
    "02_correctness",
    "03_decode_ablation",
    "04_prefill_ablation",
    "05_roofline",
    "06_paper_figures",
)
# Parameters every notebook declares in its first code cell (tagged ``parameters``).
REQUIRED_PARAMETERS = ("RUN_DIR", "SMOKE", "INTERACTIVE", "SEED", "CHECKPOINT")
# Checkpoints the notebooks use when CHECKPOINT is empty: the trained one when present, else the random one.
DEFAULT_CHECKPOINTS = ("data/tiny-py", "data/tiny")

RESULTS_FORMAT = "dsv4lab.notebook-results/1"
MANIFEST_FORMAT = "dsv4lab.run-manifest/1"
FIGURE_FORMATS = ("png", "pdf")
MORE_IN_CSV = "more rows in the CSV"


# ============================================================================================ run folders
def create_run_dir(out: str | Path = DEFAULT_RUNS_DIR, *, now: datetime | None = None,
                   short_hash: str | None = None) -> Path:
    """Create and return a new run folder ``<out>/<UTC stamp>_<git short hash>/``.

    An existing folder is never reused: a second run in the same second gets ``..._<hash>-2`` (and so on), so
    earlier runs are never overwritten."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    short = short_hash or git_state()["short"] or "nogit"
    base = f"{utc_stamp(now)}_{short}"
    for i in range(1, 1000):
        path = out / (base if i == 1 else f"{base}-{i}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        for sub in ("notebooks", "results", "figures", "logs"):
            (path / sub).mkdir()
        return path
    raise RunError(f"{out}: could not create a new run folder named {base}-N")


def default_checkpoint(root: Path = REPO_ROOT) -> Path:
    """The first of :data:`DEFAULT_CHECKPOINTS` that exists (a folder with ``config.json``)."""
    for rel in DEFAULT_CHECKPOINTS:
        if (root / rel / "config.json").exists():
            return root / rel
    raise RunError(f"no default checkpoint: none of {', '.join(DEFAULT_CHECKPOINTS)} exists under {root} "
                   "(run `make tiny` to create data/tiny)")


def resolve_checkpoint(value: str | Path | None) -> Path:
    """A notebook's ``CHECKPOINT`` parameter as a folder: empty means :func:`default_checkpoint`; a relative
    path is taken from the current directory, then from the repository root."""
    if value is None or str(value).strip() == "":
        return default_checkpoint()
    path = Path(value).expanduser()
    for cand in (path, REPO_ROOT / path):
        if (cand / "config.json").exists():
            return cand.resolve()
    raise RunError(f"CHECKPOINT={str(value)!r}: no checkpoint folder (with config.json) there or under {REPO_ROOT}")


# ============================================================================================ notebook outputs
def _cell(v: Any) -> str:
    """One table cell as short text: floats to six significant digits, containers as cut JSON, None as —."""
    if v is None:
        return "—"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            return str(v)
        return f"{v:,.0f}" if abs(v) >= 1e5 else f"{v:.6g}"
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 1e5 else str(v)
    if isinstance(v, (list, tuple, dict)):
        text = json.dumps(jsonable(v), separators=(",", ":"))
        return text if len(text) <= 48 else text[:47] + "…"
    text = str(v).replace("\n", " ")
    return text if len(text) <= 72 else text[:71] + "…"


class Table(list):
    """Rows (dicts) that a notebook displays as a compact table: HTML in JupyterLab, fixed-width text in a log
    (``limit`` rows, then a line counting the rest, which are in the CSV). No pandas needed."""

    def __init__(self, rows: Iterable[Mapping[str, Any]] = (), columns: Sequence[str] | None = None,
                 limit: int = 12):
        super().__init__(dict(r) for r in rows)
        self.columns = list(columns) if columns else None
        self.limit = limit

    def _columns(self) -> list[str]:
        return self.columns or list(dict.fromkeys(k for r in self for k in r))

    def _more(self) -> str:
        extra = len(self) - self.limit
        return f"{extra} more row{'s' if extra != 1 else ''} (all in the CSV)" if extra > 0 else ""

    def _repr_markdown_(self) -> str:
        return md_table(self, self.columns, limit=self.limit, more=MORE_IN_CSV)

    def _repr_html_(self) -> str:
        cols = self._columns()
        if not self:
            return "<p><em>(no rows)</em></p>"
        head = "".join(f"<th style='text-align:left'>{html.escape(c)}</th>" for c in cols)
        body = []
        for r in self[: self.limit]:
            cells = []
            for c in cols:
                v = r.get(c)
                align = "right" if isinstance(v, (int, float)) and not isinstance(v, bool) else "left"
                cells.append(f"<td style='text-align:{align}'>{html.escape(_cell(v))}</td>")
            body.append("<tr>" + "".join(cells) + "</tr>")
        more = f"<p style='font-size:85%'><em>{html.escape(self._more())}</em></p>" if self._more() else ""
        return (f"<table class='dsv4lab-table' style='font-size:85%'><thead><tr>{head}</tr></thead>"
                f"<tbody>{''.join(body)}</tbody></table>{more}")

    def text(self) -> str:
        """The table as fixed-width text (what a log or a terminal shows)."""
        cols = self._columns()
        if not self:
            return "(no rows)"
        grid = [cols] + [[_cell(r.get(c)) for c in cols] for r in self[: self.limit]]
        widths = [max(len(row[i]) for row in grid) for i in range(len(cols))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in grid]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if self._more():
            lines.append(self._more())
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(self.text() if not cycle else "Table(...)")


def summary(values: Mapping[str, Any]) -> Table:
    """A mapping shown as a two-column :class:`Table` (``key``, ``value``)."""
    return Table([dict(key=k, value=v) for k, v in values.items()], ["key", "value"], limit=max(12, len(values)))


class NotebookOutputs:
    """Where one notebook writes: ``RUN_DIR/results/<notebook>.json`` (+ CSV tables) and
    ``RUN_DIR/figures/<notebook>_<tag>.png|pdf``.

    The JSON holds ``parameters`` (as the notebook reports them), ``key_results`` (scalars compared against
    ``data/reference/expectations.yaml`` by the report), ``tables`` (rows, also written as CSV), ``data``
    (anything else worth keeping) and ``figures`` (the files written). Every call rewrites the JSON.
    """

    def __init__(self, notebook: str, run_dir: str | Path, parameters: Mapping[str, Any] | None = None):
        if not notebook or "/" in notebook or notebook.endswith(".ipynb"):
            raise RunError(f"notebook name {notebook!r}: give the bare name, e.g. '01_layout_repair'")
        self.notebook = notebook
        self.run_dir = Path(run_dir)
        self.results_dir = self.run_dir / "results"
        self.figures_dir = self.run_dir / "figures"
        self.results_dir.mkdir(parents=True, exist_ok=True)
        self.figures_dir.mkdir(parents=True, exist_ok=True)
        self.doc: dict[str, Any] = dict(format=RESULTS_FORMAT, notebook=notebook,
                                        parameters=jsonable(dict(parameters or {})), key_results={}, tables={},
                                        data={}, figures=[])
        self.write()

    @property
    def path(self) -> Path:
        return self.results_dir / f"{self.notebook}.json"

    def work_dir(self, create: bool = True) -> Path:
        """A scratch folder for this notebook inside the run (``work/<notebook>/``)."""
        path = self.run_dir / "work" / self.notebook
        if create:
            path.mkdir(parents=True, exist_ok=True)
        return path

    def portable(self, value: Any) -> Any:
        """``value`` as JSON data with paths inside this run folder written ``RUN_DIR/...``: run folders differ
        from run to run, the results must not."""
        roots = sorted({str(self.run_dir.resolve()), display_path(self.run_dir)}, key=len, reverse=True)
        data = jsonable(value)

        def fix(v):
            if isinstance(v, str):
                for root in roots:
                    if v == root or v.startswith(root + "/"):
                        return "RUN_DIR" + v[len(root):]
            if isinstance(v, dict):
                return {k: fix(x) for k, x in v.items()}
            if isinstance(v, list):
                return [fix(x) for x in v]
            return v
        return fix(data)

    def write(self) -> Path:
        write_text_if_changed(self.path, dumps(self.portable(self.doc)))
        return self.path

    def json_file(self, name: str, data: Any) -> Path:
        """Write ``data`` to ``results/<notebook>_<name>.json`` (paths inside the run folder made portable)."""
        path = self.results_dir / f"{self.notebook}_{name}.json"
        write_text_if_changed(path, dumps(self.portable(data)))
        return path

    def key(self, name: str, value: Any) -> Any:
        """Record a key result (compared against the reference expectations in the report); returns ``value``."""
        self.doc["key_results"][name] = jsonable(value)
        self.write()
        return value

    def keys(self, **values: Any) -> None:
        for k, v in values.items():
            self.doc["key_results"][k] = jsonable(v)
        self.write()

    def data(self, name: str, value: Any) -> None:
        """Keep ``value`` in the results JSON under ``data`` (returns nothing, so a cell ending with it displays no
        dict dump)."""
        self.doc["data"][name] = jsonable(value)
        self.write()

    def summary(self) -> Table:
        """The key results so far, as a table (what a notebook's last cell shows)."""
        return summary(self.doc["key_results"])

    def table(self, name: str, rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> "Table":
        """Write ``rows`` to ``results/<notebook>_<name>.csv`` and into the JSON; returns them as a
        :class:`Table` (a list of dicts that a notebook displays as a table)."""
        rows = [dict(r) for r in rows]
        if columns:
            rows = [{c: r.get(c) for c in columns} for r in rows]
        self.doc["tables"][name] = jsonable(rows)
        write_text_if_changed(self.results_dir / f"{self.notebook}_{name}.csv",
                          rows_to_csv(self.portable(rows), columns))
        self.write()
        return Table(rows, columns)

    def figure(self, fig, tag: str, formats: Iterable[str] = FIGURE_FORMATS):
        """Save ``fig`` as ``figures/<notebook>_<tag>.<fmt>`` (metadata stripped, byte-stable), check it
        (:func:`dsv4lab.faces.plots.figure_problems`: kept under ``figure_problems`` when it breaks a rule) and return
        it, so a cell ending in ``out.figure(fig, "tag")`` also shows it."""
        if not tag or any(c in tag for c in "/\\ ."):
            raise RunError(f"figure tag {tag!r}: use letters, digits, '-' or '_'")
        paths = save_figure(fig, self.figures_dir / f"{self.notebook}_{tag}", formats=tuple(formats))
        for p in paths:
            rel = f"figures/{p.name}"
            if rel not in self.doc["figures"]:
                self.doc["figures"].append(rel)
        problems = figure_problems(fig)
        if problems:
            self.doc.setdefault("figure_problems", {})[tag] = problems
        else:
            self.doc.get("figure_problems", {}).pop(tag, None)
        self.write()
        return fig


def scratch_dir(notebook: str, root: Path = SCRATCH_DIR) -> Path:
    """``<root>/<notebook>/``, emptied: where a notebook run by hand writes (see :data:`SCRATCH_DIR`)."""
    path = Path(root) / notebook
    if path.exists():
        shutil.rmtree(path)
    for sub in ("results", "figures"):
        (path / sub).mkdir(parents=True)
    return path


def notebook_outputs(notebook: str, run_dir: str | Path | None = None,
                     parameters: Mapping[str, Any] | None = None) -> NotebookOutputs:
    """The writer a notebook uses. With an empty ``run_dir`` (a person running the notebook by hand) it writes
    into :func:`scratch_dir` — replaced at each such run — rather than a new dated folder under ``runs/``."""
    if run_dir is None or str(run_dir).strip() == "":
        if "/" in notebook or not notebook:
            raise RunError(f"notebook name {notebook!r}: give the bare name, e.g. '01_layout_repair'")
        run_dir = scratch_dir(notebook)
    params = {k: v for k, v in dict(parameters or {}).items() if k != "RUN_DIR"}  # run paths are not results
    return NotebookOutputs(notebook, run_dir, params)


def notebook_output_files(run_dir: str | Path, notebook: str) -> dict[str, str]:
    """``{relative path: sha256}`` of the results and figures one notebook wrote."""
    run_dir = Path(run_dir)
    files = sorted((run_dir / "results").glob(f"{notebook}.json")) + sorted(
        (run_dir / "results").glob(f"{notebook}_*")) + sorted((run_dir / "figures").glob(f"{notebook}_*"))
    return {str(p.relative_to(run_dir)): file_sha256(p) for p in files if p.is_file()
            and not p.name.endswith(".tmp-write")}


def write_manifest(run_dir: str | Path, manifest: Mapping[str, Any]) -> Path:
    """Write ``manifest.json`` whole or not at all (a temporary file renamed over the previous one: it is rewritten
    after each notebook so an interrupted run still documents what it did)."""
    path = Path(run_dir) / "manifest.json"
    write_text_if_changed(path, dumps(dict(manifest)))
    return path


def settle_notebook(partial: Path, final: Path) -> Path | None:
    """Move an executed notebook that papermill wrote to ``partial`` (it rewrites the file after every cell) into
    ``final`` if it is a whole notebook; remove it otherwise (a write cut short by a signal or a full disk). The
    run folder then holds each executed notebook whole or not at all. Returns ``final`` or None."""
    if not partial.exists():
        return None
    try:
        doc = json.loads(partial.read_text())
        whole = isinstance(doc, dict) and isinstance(doc.get("cells"), list) and "nbformat" in doc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        whole = False
    if not whole:
        partial.unlink(missing_ok=True)
        return None
    os.replace(partial, final)
    return final


@contextlib.contextmanager
def signals_end_runs():
    """For the block, SIGTERM raises :class:`~dsv4lab.core.errors.Terminated` (a ``KeyboardInterrupt``) where the
    program is, and SIGINT (Ctrl-C) ``KeyboardInterrupt``: either ends a run through the code that writes its
    manifest as "interrupted". SIGINT's handler is set too, not inherited: a process started with SIGINT ignored (a
    shell's background job ``dsv4lab reproduce &``, a test runner's worker) would otherwise run on through it. The
    previous handlers are restored afterwards (signals reach the main thread only; in any other thread this does
    nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        raise Terminated()
    previous = signal.signal(signal.SIGTERM, terminate), signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])


# ============================================================================================ expectations
def load_expectations(path: str | Path = EXPECTATIONS_FILE) -> dict[str, dict[str, dict]]:
    """``data/reference/expectations.yaml``: notebook → key → expectation (see :func:`check_expectation`)."""
    path = Path(path)
    if not path.exists():
        return {}
    doc = read_yaml(path, RunError) or {}
    nbs = doc.get("notebooks", {})
    if not isinstance(nbs, dict):
        raise RunError(f"{path}: 'notebooks' must map notebook names to expectations")
    for nb, keys in nbs.items():
        if not isinstance(keys, dict):
            raise RunError(f"{path}: notebooks.{nb} must map key names to expectations")
        for key, exp in keys.items():
            if not isinstance(exp, dict) or not ({"equals", "value", "min", "max"} & set(exp)):
                raise RunError(f"{path}: notebooks.{nb}.{key} needs one of equals / value (+ rel_tol/abs_tol) / "
                               "min / max")
    return nbs


def check_expectation(got: Any, exp: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether ``got`` meets one expectation, and the tolerance in words.

    An expectation is ``equals: V`` (exact), ``value: V`` with ``rel_tol`` and/or ``abs_tol``
    (``|got − V| ≤ abs_tol + rel_tol·|V|``), or ``min`` / ``max`` bounds (inclusive)."""
    if "equals" in exp:
        want = exp["equals"]
        return got == want, "exact"
    if got is None or isinstance(got, (str, bool, list, dict)):
        return False, "numeric expected"
    got = float(got)
    if "value" in exp:
        v = float(exp["value"])
        rel, ab = float(exp.get("rel_tol", 0.0)), float(exp.get("abs_tol", 0.0))
        ok = abs(got - v) <= ab + rel * abs(v)
        tol = " + ".join(t for t in (f"{ab:g}" if ab else "", f"{100 * rel:g}%" if rel else "") if t) or "0"
        return ok, f"± {tol}"
    lo, hi = exp.get("min"), exp.get("max")
    ok = (lo is None or got >= float(lo)) and (hi is None or got <= float(hi))
    return ok, f"[{'-∞' if lo is None else lo}, {'∞' if hi is None else hi}]"


def compare_with_expectations(results: Mapping[str, Mapping[str, Any]], expectations: Mapping[str, Mapping],
                              smoke: bool) -> list[dict[str, Any]]:
    """One row per expectation of the notebooks that produced results: ``notebook, key, expected, got,
    tolerance, status`` (``ok`` / ``FAIL`` / ``missing`` / ``skipped`` when the expectation does not apply to
    this mode or checkpoint). A key the notebook did not record, or recorded as null, is ``missing``; so is a key
    of an expectation marked ``measurement: true`` (it counts or flags measurements) recorded as false or 0: a run
    without its measurements is never ``ok``."""
    rows = []
    for nb, keys in expectations.items():
        if nb not in results:
            continue
        doc = results[nb]
        got_keys = doc.get("key_results", {})
        checkpoint = Path(str(doc.get("parameters", {}).get("checkpoint", ""))).name
        for key, exp in keys.items():
            want = exp.get("equals", exp.get("value", None))
            if want is None:
                want = f"[{exp.get('min', '-∞')}, {exp.get('max', '∞')}]"
            row = dict(notebook=nb, key=key, expected=want, got=got_keys.get(key), tolerance="",
                       why=exp.get("why", ""))
            modes = exp.get("modes")
            only = exp.get("checkpoints")
            if (modes and ("smoke" if smoke else "full") not in modes) or (only and checkpoint not in only):
                row["status"] = "skipped"
                row["tolerance"] = f"applies to {', '.join(modes or [])}{' ' if modes and only else ''}" \
                                   f"{', '.join(only or [])}".strip()
            elif got_keys.get(key) is None or (exp.get("measurement") and got_keys[key] in (False, 0)):
                row["status"] = "missing"  # never "ok" for a run that lacks what the key reports
            else:
                ok, tol = check_expectation(got_keys[key], exp)
                row.update(status="ok" if ok else "FAIL", tolerance=tol)
            rows.append(row)
    return rows


# ============================================================================================ report
def load_results(run_dir: str | Path) -> dict[str, dict]:
    """``{notebook: results JSON}`` of a run folder (unreadable files are reported as an ``error`` entry)."""
    out = {}
    for p in sorted((Path(run_dir) / "results").glob("*.json")):
        try:
            out[p.stem] = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as err:
            out[p.stem] = dict(error=f"{p}: {err}")
    return out


def write_report(run_dir: str | Path, manifest: Mapping[str, Any],
                 expectations: Mapping[str, Mapping] | None = None) -> Path:
    """Write ``report.md``: what ran, the comparison with the reference expectations, and per notebook its key
    results, tables and figures (linked relative to the run folder)."""
    run_dir = Path(run_dir)
    results = load_results(run_dir)
    exp = load_expectations() if expectations is None else expectations
    comparison = compare_with_expectations(results, exp, bool(manifest.get("smoke")))
    git = manifest.get("git", {})
    env = manifest.get("environment", {})
    torch_env = env.get("torch") or {}
    lines = [f"# dsv4lab reproduction run `{run_dir.name}`", ""]
    lines.append(f"- command: `{' '.join(manifest.get('command', []))}`")
    lines.append(f"- commit: `{git.get('commit')}`" + (" (working tree has uncommitted changes)"
                                                      if git.get("dirty") else ""))
    lines.append(f"- environment: Python {env.get('python')}, torch {torch_env.get('version')}, triton "
                 f"{env.get('triton')}, device {torch_env.get('device')}")
    ck = manifest.get("checkpoint") or {}
    if ck:
        lines.append(f"- checkpoint: `{ck.get('path')}` (weights sha256 {str(ck.get('weights', '—'))[:16]}…)")
    lines.append(f"- mode: {'SMOKE (tiny CPU run)' if manifest.get('smoke') else 'full'}; status: "
                 f"**{manifest.get('status')}**")
    lines += ["", "## What ran", ""]
    nb_rows = [dict(notebook=n["name"], status=n["status"], seconds=n.get("duration_s"),
                    figures=sum(1 for f in n.get("outputs", {}) if f.startswith("figures/") and f.endswith(".png")),
                    executed=f"[{n['name']}.ipynb](notebooks/{n['name']}.ipynb)" if n.get("executed") else "—")
               for n in manifest.get("notebooks", [])]
    lines.append(md_table(nb_rows, ["notebook", "status", "seconds", "figures", "executed"], limit=40))
    failures = [n for n in manifest.get("notebooks", []) if n.get("error")]
    for n in failures:
        lines += ["", f"**{n['name']} failed:** {n['error']['message']}"]
    lines += ["", "## Key results against `data/reference/expectations.yaml`", ""]
    if comparison:
        lines.append(md_table(comparison, ["notebook", "key", "expected", "got", "tolerance", "status", "why"],
                              limit=200))
        bad = [r for r in comparison if r["status"] in ("FAIL", "missing")]
        lines += ["", f"{sum(r['status'] == 'ok' for r in comparison)} ok, {len(bad)} failed or missing, "
                  f"{sum(r['status'] == 'skipped' for r in comparison)} not applicable to this run."]
    else:
        lines.append("_(no expectations apply to the notebooks that ran)_")
    for n in manifest.get("notebooks", []):
        doc = results.get(n["name"])
        if not doc:
            continue
        lines += ["", f"## {n['name']}", ""]
        if doc.get("error"):
            lines.append(f"results unreadable: {doc['error']}")
            continue
        keys = doc.get("key_results", {})
        if keys:
            lines.append(md_table([dict(key=k, value=v) for k, v in keys.items()], ["key", "value"], limit=40))
        for tname, rows in doc.get("tables", {}).items():
            lines += ["", f"**{tname}** ([CSV](results/{n['name']}_{tname}.csv))", "",
                      md_table(rows, limit=12, more=MORE_IN_CSV)]
        for tag, problems in doc.get("figure_problems", {}).items():
            lines += ["", f"**figure `{tag}` breaks the figure rules:** " + "; ".join(problems)]
        pngs = [f for f in doc.get("figures", []) if f.endswith(".png")]
        for f in pngs:
            pdf = f[:-4] + ".pdf"
            lines += ["", f"![{Path(f).stem}]({f}) ([PDF]({pdf}))"]
    return write_text_if_changed(run_dir / "report.md", "\n".join(lines).rstrip() + "\n")


__all__ = ["NOTEBOOKS_DIR", "DATA_DIR", "REPO_ROOT", "NOTEBOOK_ORDER", "REQUIRED_PARAMETERS", "DEFAULT_CHECKPOINTS",
           "SCRATCH_DIR", "RunError", "NotebookOutputs", "Table", "summary", "scratch_dir",
           "notebook_outputs", "create_run_dir", "default_checkpoint", "resolve_checkpoint", "display_path",
           "git_state", "utc_stamp", "environment", "file_sha256", "notebook_output_files", "write_manifest",
           "settle_notebook", "signals_end_runs",
           "load_expectations", "check_expectation", "compare_with_expectations", "write_report", "load_results",
           "md_table", "rows_to_csv", "jsonable", "dumps", "source_date_epoch"]
