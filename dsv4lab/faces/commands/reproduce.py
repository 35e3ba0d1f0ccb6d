"""``dsv4lab reproduce`` — run the notebooks headless with papermill into a new run folder.

    dsv4lab reproduce                               # every notebook, in the declared order
    dsv4lab reproduce --smoke                       # tiny CPU run (what the tests run)
    dsv4lab reproduce --only 01,05 --params my.yaml --out runs/

The notebooks are the percent-format scripts ``notebooks/NAME.py`` (jupytext's text notebooks, see
``docs/notebooks.md``); each is read into a notebook here, in memory, and the executed copy is written as
``.ipynb`` into the run folder. A folder given with ``--notebooks-dir`` may also hold ``.ipynb`` files.

Each run gets its own folder ``<out>/<UTC timestamp>_<git short hash>/`` (never reused) holding the executed
notebooks, results, figures, logs, ``manifest.json`` and ``report.md`` (see :mod:`dsv4lab.faces.runs`).

``--params FILE.yaml`` sets notebook parameters: top-level keys that name a notebook hold that notebook's
parameters, any other key is passed to every selected notebook that declares it::

    SEED: 3                  # every notebook declares SEED
    01_layout_repair:
      LAYER: 2

Parameter names and types are checked against each notebook's parameters cell before anything runs (papermill
itself would only warn); a mistake stops the run with a message naming the notebook and its parameters cell. The
file may have at most 1 MiB and 10,000 values with its YAML aliases expanded (a few lines of nested aliases would
otherwise expand into a manifest of hundreds of MB); errors quote values cut to a short excerpt.
A notebook whose cell fails is reported with the cell (its number and id, the line that raised) and the error; the
remaining notebooks still run, and the manifest, report and partial outputs are written before the command
exits with status 1. Ctrl-C (SIGINT) and ``kill`` (SIGTERM) both end the run with a manifest whose status is
``interrupted`` (exit 130 and 143). Manifests, reports and executed notebooks are written whole or not at all (a
temporary file renamed into place), and the command checks there is room for a run on the disk before it starts.

Kernels run with ``OMP_NUM_THREADS=1`` unless it is set (the tiny model's ops are too small to gain from
threads, and on a shared machine extra threads only contend), ``SOURCE_DATE_EPOCH`` (the HEAD commit time
unless set) and, without a GPU, ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from dsv4lab.faces import runs
from dsv4lab.core.errors import RunError, Terminated, UserError, clip, excerpt
from dsv4lab.core.resources import require_disk_space
from dsv4lab.tools.options import float_range
from dsv4lab.core.paths import NOTEBOOKS_DIR, display_path, read_yaml
from dsv4lab.core.provenance import source_date_epoch
from dsv4lab.faces.runs import NOTEBOOK_ORDER, REQUIRED_PARAMETERS, resolve_checkpoint

NAME = "reproduce"
HELP = "run the notebooks headless (papermill) into runs/<UTC stamp>_<commit>/ with a manifest and a report"
DESCRIPTION = __doc__

TYPE_CHECKS = {
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "list": (lambda v: isinstance(v, list), "a list"),
    "dict": (lambda v: isinstance(v, dict), "a mapping"),
}
SET_BY_REPRODUCE = ("RUN_DIR",)
PARAMS_MAX_BYTES = 1 << 20      # a parameters file is a few lines
PARAMS_MAX_VALUES = 10_000      # values in it once its YAML aliases are expanded
SHOWN_PROBLEMS = 20            # parameter problems the error lists (the manifest keeps them all)
RUN_BYTES = 256 << 20
"""Disk a run folder may take: executed notebooks, results, figures (PNG + PDF) and logs of every notebook."""
# The kernel's own log lines (ipykernel warns that loopback TCP is unencrypted, and logs the interrupt it gets at
# shutdown) would interleave with the progress bars; what a cell prints still goes to logs/<name>.log.
KERNEL_ARGUMENTS = ("--IPKernelApp.log_level=CRITICAL",)


def add_arguments(p):
    p.add_argument("--only", action="append", default=None, metavar="NAMES",
                   help="comma-separated notebooks to run (full names, or their number: 01,05); repeatable")
    p.add_argument("--smoke", action="store_true", help="SMOKE=True in every notebook: a tiny CPU run")
    p.add_argument("--params", metavar="FILE.yaml", help="notebook parameters (global and per notebook)")
    p.add_argument("--out", default="runs", help="folder the run folder is created in (default runs/)")
    p.add_argument("--notebooks-dir", default=None,
                   help="run the notebooks of this folder instead of the repository's notebooks/")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failing notebook")
    p.add_argument("--cell-timeout", type=float_range(0, lo_open=True), default=None,
                   help="seconds a single cell may run (default: no limit)")
    p.add_argument("--list", action="store_true", help="list the notebooks and their parameters, then exit")


# ============================================================================================ notebooks
# Cells read from a text notebook carry no ids; these stable ones name a failing cell the same way in every run.
CELL_ID = "cell-{:02d}"
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def discover(folder: Path) -> list[Path]:
    """The notebooks of ``folder`` (``*.py`` text notebooks and ``*.ipynb``; a text notebook wins over an
    ``.ipynb`` of the same name, which is its paired copy): the declared order first (all of it for the
    repository's folder), then any others by name."""
    found = {p.stem: p for p in folder.glob("*.ipynb")}
    found.update({p.stem: p for p in folder.glob("*.py")})
    if folder.resolve() == NOTEBOOKS_DIR.resolve():
        missing = [n for n in NOTEBOOK_ORDER if n not in found]
        if missing:
            raise UserError(f"{folder}: missing notebook(s) {missing} (notebooks/NAME.py)")
    ordered = [found[n] for n in NOTEBOOK_ORDER if n in found]
    ordered += [found[n] for n in sorted(found) if n not in NOTEBOOK_ORDER]
    if not ordered:
        raise UserError(f"{folder}: no notebooks (*.py text notebooks or *.ipynb)")
    return ordered


def read_notebook(path: Path):
    """The notebook at ``path`` as an ``nbformat`` node: a percent-format ``.py`` through jupytext (cells numbered
    ``cell-01`` ..., the Python 3 kernel), an ``.ipynb`` as it is. A file that is not a notebook is an error naming
    it, in one line."""
    import nbformat
    path = Path(path)
    try:
        if path.suffix == ".ipynb":
            return nbformat.read(str(path), as_version=4)
        import jupytext
        nb = jupytext.read(path, fmt="py:percent")
    except Exception as err:  # nbformat and jupytext raise NotJSONError, ValidationError, KeyError... for a bad file
        raise UserError(f"{path}: not a notebook nbformat can read ({type(err).__name__}: {clip(err, 120)})"
                        ) from None
    for i, cell in enumerate(nb.cells, 1):
        cell["id"] = CELL_ID.format(i)
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata.setdefault("language_info", {"name": "python"})
    nb.nbformat, nb.nbformat_minor = 4, 5
    return nb


def select(notebooks: list[Path], only: list[str] | None) -> list[Path]:
    """Filter by ``--only`` (exact names or their leading number); unknown names are an error."""
    if not only:
        return notebooks
    wanted = [w.strip() for item in only for w in item.split(",") if w.strip()]
    chosen: list[Path] = []
    for w in wanted:
        w = w.removesuffix(".ipynb").removesuffix(".py")
        hits = [p for p in notebooks if p.stem == w or p.stem.split("_", 1)[0] == w]
        if not hits:
            raise UserError(f"--only {w!r}: no such notebook; available: {', '.join(p.stem for p in notebooks)}")
        chosen += [h for h in hits if h not in chosen]
    return [p for p in notebooks if p in chosen]  # keep the declared order


def parameters_cell(path: Path) -> tuple[int | None, str | None]:
    """Index and id of the cell tagged ``parameters``."""
    nb = read_notebook(path)
    for i, cell in enumerate(nb.cells):
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            return i, cell.get("id")
    return None, None


def declared_parameters(path: Path) -> dict[str, dict]:
    """``{name: {inferred_type_name, default, help}}`` from the notebook's parameters cell."""
    import papermill
    idx, _ = parameters_cell(path)
    if idx is None:
        raise UserError(f"{path.stem}: no cell tagged 'parameters' (the first code cell must carry that tag)")
    try:
        return papermill.inspect_notebook(read_notebook(path))
    except ValueError as err:  # e.g. an .ipynb that names no kernel in its metadata
        raise UserError(f"{path}: papermill cannot read its parameters ({clip(err)})") from None


def _where(path: Path) -> str:
    idx, cid = parameters_cell(path)
    return f"{path.stem} (parameters cell: cell {idx + 1 if idx is not None else '?'}, id {cid})"


def load_params_file(path: str | None, notebook_names: list[str]) -> tuple[dict, dict[str, dict]]:
    """``(global parameters, {notebook: parameters})`` from a YAML file."""
    if not path:
        return {}, {}
    p = Path(path)
    if not p.exists():
        raise UserError(f"--params {path}: no such file")
    doc = read_yaml(p, UserError, max_values=PARAMS_MAX_VALUES, max_bytes=PARAMS_MAX_BYTES) or {}
    if not isinstance(doc, dict):
        raise UserError(f"--params {path}: expected a mapping of NAME: value (and notebook: {{NAME: value}})")
    glob, per = {}, {}
    for k, v in doc.items():
        key = str(k)
        if key in notebook_names or key.endswith(".ipynb") and key[:-6] in notebook_names:
            if not isinstance(v, dict):
                raise UserError(f"--params {path}: {key} must map parameter names to values")
            per[key.removesuffix(".ipynb")] = v
        elif isinstance(v, dict) and key[:2].isdigit():
            raise UserError(f"--params {path}: {excerpt(key)} looks like a notebook but none is named so; "
                            f"notebooks: {', '.join(notebook_names)}")
        else:
            glob[key] = v
    return glob, per


def check_parameters(notebooks: list[Path], declared: dict[str, dict], glob: dict, per: dict[str, dict],
                     selected: list[str], smoke: bool) -> tuple[dict[str, dict], list[str]]:
    """The parameters each selected notebook gets, and the list of problems (empty when all is well)."""
    problems: list[str] = []
    by_name = {p.stem: p for p in notebooks}
    for name in selected:
        missing = [r for r in REQUIRED_PARAMETERS if r not in declared[name]]
        if missing:
            problems.append(f"{_where(by_name[name])}: does not declare {missing} (every notebook must)")
    for k in glob:
        if k in SET_BY_REPRODUCE:
            problems.append(f"--params: {k} is set by dsv4lab reproduce (use --out for the run folder)")
        elif not any(k in declared[n] for n in selected):
            problems.append(f"--params: no selected notebook declares a parameter {excerpt(k)}; "
                            f"declared: {', '.join(sorted({p for n in selected for p in declared[n]}))}")
    for nb, params in per.items():
        if nb not in selected:
            continue
        for k in params:
            if k in SET_BY_REPRODUCE:
                problems.append(f"--params: {nb}.{k} is set by dsv4lab reproduce (use --out for the run folder)")
            elif k not in declared[nb]:
                problems.append(f"{_where(by_name[nb])}: unknown parameter {excerpt(k)}; it declares "
                                f"{', '.join(declared[nb])}")
    out: dict[str, dict] = {}
    for name in selected:
        params = {k: v for k, v in glob.items() if k in declared[name] and k not in SET_BY_REPRODUCE}
        params.update({k: v for k, v in per.get(name, {}).items() if k in declared[name]})
        if smoke:
            params["SMOKE"] = True
        for k, v in params.items():
            typ = declared[name][k].get("inferred_type_name", "None")
            check = TYPE_CHECKS.get(typ)
            if check and not check[0](v):
                problems.append(f"{_where(by_name[name])}: parameter {k} is declared {typ} (default "
                                f"{declared[name][k].get('default')}), got {excerpt(v)}: expected {check[1]}")
        out[name] = params
    return out, problems


# ============================================================================================ failures
def describe_failure(err: BaseException, executed: Path, source: Path) -> dict[str, Any]:
    """Where a notebook failed: the cell (1-based number and id in the source notebook, first line) and the
    error, as a dict with a one-line ``message``."""
    from papermill.exceptions import PapermillExecutionError
    info: dict[str, Any] = dict(ename=type(err).__name__, evalue=str(err).strip().splitlines()[-1:] or [""])
    info["evalue"] = info["evalue"][0] if info["evalue"] else ""
    cell_id = None
    src_line = None
    line_no = None
    if isinstance(err, PapermillExecutionError):
        info.update(ename=err.ename, evalue=err.evalue, exec_count=err.exec_count)
        line_no, src_line = _failing_line(err.traceback or [])
        if src_line is None:
            src_line = next((ln for ln in (err.source or "").splitlines() if ln.strip()), "")
        try:
            import nbformat
            nb = nbformat.read(str(executed), as_version=4)
            for cell in nb.cells:
                if cell.cell_type == "code" and any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
                    cell_id = cell.get("id")
                    break
        except Exception:  # the executed copy may be unreadable after a kernel crash; the error still stands
            pass
    number = None
    if cell_id is not None:
        src = read_notebook(source)
        number = next((i + 1 for i, c in enumerate(src.cells) if c.get("id") == cell_id), None)
    info.update(cell=number, cell_id=cell_id, line=line_no, source_line=src_line)
    where = (f"cell {number} (id {cell_id}" + (f", In [{info.get('exec_count')}]" if info.get("exec_count") else "")
             + ")" + (f", line {line_no}" if line_no else "") + f": `{src_line}`") if number else (
        "an injected or unknown cell" if isinstance(err, PapermillExecutionError) else "outside any cell")
    info["message"] = f"{source.stem} failed in {where} — {info['ename']}: {info['evalue']}"
    return info


ANSI = re.compile(r"\x1b\[[0-9;]*m")
ARROW = re.compile(r"^-*>\s*(\d+)\s(.*)$")


def _failing_line(traceback: list[str]) -> tuple[int | None, str | None]:
    """The line of the notebook cell that raised, from IPython's traceback (``Cell In[3], line 19`` then the
    code with an arrow ``---> 19 raise ...``); ``(None, None)`` when the traceback has no cell frame."""
    for entry in traceback:
        text = ANSI.sub("", entry)
        if "Cell In[" not in text:
            continue
        for ln in text.splitlines():
            m = ARROW.match(ln.strip())
            if m:
                return int(m.group(1)), m.group(2).strip()
    return None, None


# ============================================================================================ run
def _kernel_environment() -> dict[str, str]:
    env = {"SOURCE_DATE_EPOCH": source_date_epoch(), "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")}
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"
    if "TRITON_INTERPRET" not in os.environ:
        try:
            import torch
            if not torch.cuda.is_available():
                env["TRITON_INTERPRET"] = "1"
        except ImportError:
            pass
    return env


def _checkpoint_record(params: dict) -> dict[str, Any]:
    try:
        path = resolve_checkpoint(params.get("CHECKPOINT", ""))
    except RunError as err:
        return dict(error=str(err))
    from dsv4lab.tools.verify.model import checkpoint_identity
    return dict(path=display_path(path), **checkpoint_identity(path))


def run(args) -> int:
    folder = Path(args.notebooks_dir) if args.notebooks_dir else NOTEBOOKS_DIR
    if not folder.is_dir():
        raise UserError(f"--notebooks-dir {folder}: no such folder")
    notebooks = discover(folder)
    chosen = select(notebooks, args.only)
    declared = {p.stem: declared_parameters(p) for p in notebooks}
    if args.list:
        for p in notebooks:
            print(p.stem)
            for name, d in declared[p.stem].items():
                print(f"    {name:<16} {d.get('inferred_type_name', ''):<6} = {d.get('default'):<10} "
                      f"{d.get('help', '')}")
        return 0

    glob, per = load_params_file(args.params, [p.stem for p in notebooks])
    params, problems = check_parameters(notebooks, declared, glob, per, [p.stem for p in chosen], args.smoke)
    require_disk_space(args.out, RUN_BYTES, "a run folder")
    with runs.signals_end_runs():  # SIGTERM ends the run like Ctrl-C: through the handler that says so
        run_dir = runs.create_run_dir(args.out)
        manifest = _new_manifest(args, folder, chosen, params, run_dir)
        try:
            return _run(args, chosen, params, problems, run_dir, manifest)
        except KeyboardInterrupt as stop:
            # the kernel's pending tasks die with the run; asyncio would log each ("Task exception was never
            # retrieved ... Kernel died") with a traceback after the one line that says the run was interrupted
            logging.getLogger("asyncio").setLevel(logging.CRITICAL)
            for n in manifest["notebooks"]:
                if n["status"] in ("pending", "running"):
                    n["status"] = "not_run" if n["status"] == "pending" else "interrupted"
            manifest.update(status="interrupted", finished_utc=runs.utc_stamp(),
                            interrupted_by="SIGTERM" if isinstance(stop, Terminated) else "SIGINT")
            runs.write_manifest(run_dir, manifest)
            runs.write_report(run_dir, manifest)
            raise


def _new_manifest(args, folder: Path, chosen: list[Path], params: dict[str, dict], run_dir: Path) -> dict[str, Any]:
    manifest: dict[str, Any] = dict(
        format=runs.MANIFEST_FORMAT, command=["dsv4lab", "reproduce", *sys.argv[2:]] if sys.argv[1:2] == ["reproduce"]
        else ["dsv4lab", "reproduce", *_argv(args)],
        run_dir=runs.display_path(run_dir), started_utc=runs.utc_stamp(),
        smoke=bool(args.smoke) or bool(params) and all(p.get("SMOKE") is True for p in params.values()),
        notebooks_dir=runs.display_path(folder), params_file=args.params, git=runs.git_state(),
        environment=runs.environment(), kernel_environment=_kernel_environment(), status="running",
        checkpoint=None, notebooks=[])
    for p in chosen:
        manifest["notebooks"].append(dict(name=p.stem, source=runs.display_path(p), source_sha256=runs.file_sha256(p),
                                          parameters=dict(params.get(p.stem, {}), RUN_DIR=runs.display_path(run_dir)),
                                          status="pending", duration_s=None, outputs={}))
    return manifest


def _run(args, chosen: list[Path], params: dict[str, dict], problems: list[str], run_dir: Path,
         manifest: dict[str, Any]) -> int:
    started = time.time()
    if problems:
        manifest.update(status="invalid_parameters", problems=problems, finished_utc=runs.utc_stamp())
        for n in manifest["notebooks"]:
            n["status"] = "not_run"
        runs.write_manifest(run_dir, manifest)
        runs.write_report(run_dir, manifest)
        shown = problems[:SHOWN_PROBLEMS] + ([f"... and {len(problems) - SHOWN_PROBLEMS} more (all in the manifest)"]
                                             if len(problems) > SHOWN_PROBLEMS else [])
        raise UserError("invalid parameters, nothing was run:\n  " + "\n  ".join(shown)
                        + f"\n(manifest written to {run_dir / 'manifest.json'})")

    records: dict[str, dict] = {}
    for entry in manifest["notebooks"]:
        value = str(params[entry["name"]].get("CHECKPOINT", ""))
        if value not in records:
            records[value] = _checkpoint_record(params[entry["name"]])
        entry["checkpoint"] = records[value].get("path")
    manifest["checkpoint"] = next(iter(records.values()), None)
    if len(records) > 1:
        manifest["checkpoints"] = list(records.values())
    runs.write_manifest(run_dir, manifest)
    failures = _execute_all(chosen, params, run_dir, manifest, args)
    manifest.update(status="failed" if failures else "ok", finished_utc=runs.utc_stamp(),
                    duration_s=round(time.time() - started, 1))
    runs.write_manifest(run_dir, manifest)
    report = runs.write_report(run_dir, manifest)
    n_figs = len(list((run_dir / "figures").glob("*.png")))
    print(f"run folder {run_dir}: {len(chosen) - len(failures)}/{len(chosen)} notebooks ok, {n_figs} figures, "
          f"{manifest['duration_s']:.0f} s; report {report}")
    for f in failures:
        print(f"FAILED {f}", file=sys.stderr)
    return 1 if failures else 0


def _argv(args) -> list[str]:
    out = []
    for o in args.only or []:
        out += ["--only", o]
    if args.smoke:
        out.append("--smoke")
    if args.params:
        out += ["--params", args.params]
    if args.out != "runs":
        out += ["--out", args.out]
    return out


def _execute_all(chosen: list[Path], params: dict[str, dict], run_dir: Path, manifest: dict, args) -> list[str]:
    import nbformat
    import papermill
    from tqdm.auto import tqdm


    env_before = {k: os.environ.get(k) for k in _kernel_environment()}
    os.environ.update(_kernel_environment())
    failures: list[str] = []
    bar = tqdm(chosen, desc="reproduce", unit="notebook", file=sys.stderr, dynamic_ncols=True)
    try:
        for path, entry in zip(bar, manifest["notebooks"]):
            bar.set_postfix_str(path.stem)
            executed = run_dir / "notebooks" / f"{path.stem}.ipynb"
            partial = executed.with_name(f".{path.stem}.partial.ipynb")  # papermill rewrites it after every cell
            log = run_dir / "logs" / f"{path.stem}.log"
            entry.update(status="running", executed=runs.display_path(executed), log=runs.display_path(log))
            runs.write_manifest(run_dir, manifest)
            parameters = dict(params[path.stem], RUN_DIR=str(run_dir.resolve()))
            t0 = time.time()
            try:
                # The notebook is built into the run folder first and executed there in place (papermill records
                # its input's path in the executed copy, and an in-memory input would be recorded as a whole copy),
                # as a hidden partial file that becomes notebooks/NAME.ipynb only when it is whole.
                executed.parent.mkdir(parents=True, exist_ok=True)
                nbformat.write(read_notebook(path), str(partial))
                with open(log, "w") as log_file:
                    try:
                        papermill.execute_notebook(
                            str(partial), str(partial), parameters=parameters, cwd=str(path.parent),
                            progress_bar=dict(desc=f"  {path.stem}", leave=False, file=sys.stderr),
                            stdout_file=log_file, stderr_file=log_file, kernel_name="python3",
                            extra_arguments=list(KERNEL_ARGUMENTS),
                            **({"execution_timeout": args.cell_timeout} if args.cell_timeout else {}))
                    finally:  # the executed notebook whole, or none
                        if runs.settle_notebook(partial, executed) is None:
                            entry["executed"] = None
                entry["status"] = "ok"
            except KeyboardInterrupt as stop:
                how = "terminated (SIGTERM)" if isinstance(stop, Terminated) else "interrupted"
                entry.update(status="interrupted", error=dict(message=f"{path.stem}: {how}"))
                failures.append(entry["error"]["message"])
                raise
            except Exception as err:  # any failure of one notebook is recorded; the others still run
                entry["status"] = "failed"
                entry["error"] = describe_failure(err, executed, path)
                failures.append(entry["error"]["message"])
                tqdm.write(f"FAILED {entry['error']['message']}", file=sys.stderr)
            finally:
                entry["duration_s"] = round(time.time() - t0, 1)
                entry["outputs"] = runs.notebook_output_files(run_dir, path.stem)
                runs.write_manifest(run_dir, manifest)
            if failures and args.fail_fast:
                for rest in manifest["notebooks"]:
                    if rest["status"] == "pending":
                        rest["status"] = "not_run"
                break
    finally:
        bar.close()
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return failures
