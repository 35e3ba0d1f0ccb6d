"""Where a result came from, and writing it down: git state, identity, JSON and markdown tables.

Every result dsv4lab writes — a notebook's results and a run's manifest (:mod:`dsv4lab.faces.runs`), a verification
report (:mod:`dsv4lab.tools.verify.report`), a benchmark (:mod:`dsv4lab.tools.bench`), a training or ablation report
(:mod:`dsv4lab.tools.train`) — says which commit and which machine produced it through :func:`git_state` and
:func:`identity` (or the fuller :func:`environment`), and is written through :func:`write_json`: strict JSON
(``NaN``/``inf`` as strings, numpy/torch values as numbers, paths relative to the repository), deterministic key
order, a trailing newline, replaced atomically.

Nothing here imports torch, triton or numpy; versions are read from the installed distributions or from modules
already imported.
"""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import math
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from dsv4lab import __version__
from dsv4lab.core.paths import REPO_ROOT, display_path

# Package versions recorded in a run's manifest (those that are installed).
MANIFEST_PACKAGES = ("dsv4lab", "torch", "triton", "numpy", "safetensors", "tokenizers", "transformers", "matplotlib",
                     "papermill", "nbclient", "nbformat", "ipykernel", "ipywidgets", "jupyterlab", "pyyaml", "tqdm")


# ============================================================================================ git and time
def _git(*args: str, root: Path = REPO_ROOT) -> str | None:
    try:
        res = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def git_state(root: Path = REPO_ROOT) -> dict[str, Any]:
    """``{commit, short, dirty}`` of the working tree the package runs from (``None`` fields outside a checkout);
    ``DSV4LAB_COMMIT`` (and ``DSV4LAB_DIRTY=1``) name it for a copy that carries no usable history.

    ``dirty`` is true when tracked files differ from the commit or untracked, non-ignored files exist: either can
    change what a result says."""
    pinned = os.environ.get("DSV4LAB_COMMIT")  # a copy of the tree without its history (a GPU machine's)
    if pinned:
        return dict(commit=pinned, short=pinned[:7], dirty=os.environ.get("DSV4LAB_DIRTY") == "1")
    commit = _git("rev-parse", "HEAD", root=root)
    if commit is None:
        return dict(commit=None, short=None, dirty=None)
    status = _git("status", "--porcelain", root=root)
    return dict(commit=commit, short=_git("rev-parse", "--short", "HEAD", root=root),
                dirty=bool(status) if status is not None else None)


def short_commit() -> str | None:
    """``git rev-parse --short HEAD`` of the package's checkout, or None."""
    return git_state()["short"]


def source_date_epoch(root: Path = REPO_ROOT) -> str:
    """``SOURCE_DATE_EPOCH`` for reproducible files: the environment's, else the HEAD commit time, else 0."""
    return os.environ.get("SOURCE_DATE_EPOCH") or _git("log", "-1", "--format=%ct", root=root) or "0"


def utc_stamp(now: datetime | None = None) -> str:
    """``20261130T054700Z`` (UTC, second resolution: sorts chronologically as text)."""
    return (now or datetime.now(timezone.utc)).astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


# ============================================================================================ identity
def _version(name: str) -> str | None:
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__version__", None):
        return str(module.__version__)
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def identity(device: str | None = None) -> dict[str, Any]:
    """What produced a result: dsv4lab, commit, Python, platform, torch and triton versions, the time, and the
    GPU's name when ``device`` is a CUDA device (torch is asked only if it is already imported)."""
    out: dict[str, Any] = {"dsv4lab": __version__, "commit": short_commit(), "python": platform.python_version(),
                           "platform": platform.platform(), "torch": _version("torch"),
                           "triton": _version("triton"), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "device": str(device) if device else None}
    torch = sys.modules.get("torch")
    if torch is not None and device and str(device).startswith("cuda") and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return out


def package_versions(names: Iterable[str] = MANIFEST_PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            out[n] = None
    return out


def environment() -> dict[str, Any]:
    """Python, platform, torch (and its device), triton and package versions: what a run's manifest records."""
    env: dict[str, Any] = dict(python=platform.python_version(), implementation=platform.python_implementation(),
                               platform=platform.platform(), machine=platform.machine(), cpu_count=os.cpu_count(),
                               executable=sys.executable)
    try:
        import torch  # the manifest names the device the notebooks ran on
        cuda = torch.cuda.is_available()
        env["torch"] = dict(version=torch.__version__, cuda=torch.version.cuda, hip=getattr(torch.version, "hip", None),
                            threads=torch.get_num_threads(), cuda_available=cuda,
                            device=torch.cuda.get_device_name(0) if cuda else "cpu",
                            device_count=torch.cuda.device_count() if cuda else 0)
    except ImportError:
        env["torch"] = None
    env["packages"] = package_versions()
    env["triton"] = env["packages"].get("triton")
    env["variables"] = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "TRITON_INTERPRET", "SOURCE_DATE_EPOCH",
                                                       "CUDA_VISIBLE_DEVICES") if os.environ.get(k) is not None}
    return env


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ============================================================================================ writing
def jsonable(value: Any) -> Any:
    """``value`` as plain JSON data: numpy/torch scalars and arrays to numbers and lists, paths to strings,
    dataclasses and objects with ``to_dict``/``to_json`` to dicts, non-finite floats to ``"nan"``/``"inf"``."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, Path):
        return display_path(value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=str) if isinstance(value, (set, frozenset)) else value
        return [jsonable(v) for v in items]
    for attr in ("to_json", "to_dict"):
        if hasattr(value, attr) and callable(getattr(value, attr)):
            return jsonable(getattr(value, attr)())
    if hasattr(value, "tolist"):  # numpy / torch arrays and scalars
        return jsonable(value.tolist())
    if hasattr(value, "item"):
        return jsonable(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable(dataclasses.asdict(value))
    return str(value)


def dumps(data: Any, indent: int = 1) -> str:
    """Deterministic JSON text (key order as given, trailing newline) of :func:`jsonable` data."""
    return json.dumps(jsonable(data), indent=indent, ensure_ascii=False, allow_nan=False) + "\n"


def write_text_if_changed(path: Path, text: str) -> Path:
    """Write ``text`` atomically (a temporary file renamed over ``path``), and only when it differs."""
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp-write")
        try:  # a full disk or a signal mid-write leaves the old file whole and no temporary behind
            tmp.write_text(text)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def write_json(path: str | Path, data: Any, indent: int = 1) -> Path:
    """Write ``data`` to ``path`` as :func:`dumps` text (folders created, replaced atomically); returns the path."""
    return write_text_if_changed(Path(path), dumps(data, indent))


def result_path(out: str | Path | None, kind: str) -> Path:
    """``out``, or ``runs/<kind>/<local time>.json``: where a command writes a result it was not told where to."""
    return Path(out) if out else Path("runs") / kind / f"{time.strftime('%Y%m%d-%H%M%S')}.json"


def _md_cell(v: Any, digits: int) -> str:
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    if isinstance(v, (list, dict)):
        text = json.dumps(v, separators=(",", ":"))
        return text if len(text) <= 60 else text[:57] + "…"
    return str(v).replace("|", "\\|").replace("\n", " ")


def md_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None, *, limit: int | None = None,
             digits: int = 6, more: str = "more rows") -> str:
    """A markdown table of ``rows`` (columns: ``columns`` or every key in order of first appearance; floats to
    ``digits`` significant digits); with ``limit``, the first ``limit`` rows and a line counting the rest."""
    if not rows:
        return "_(no rows)_"
    cols = list(columns) if columns else list(dict.fromkeys(k for r in rows for k in r))
    shown = rows if limit is None else rows[:limit]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in shown:
        out.append("| " + " | ".join(_md_cell(r.get(c, ""), digits) for c in cols) + " |")
    if len(rows) > len(shown):
        out.append(f"\n_{len(rows) - len(shown)} {more}._")
    return "\n".join(out)


def rows_to_csv(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """CSV text of ``rows`` (columns: ``columns`` or every key in order of first appearance; lists and dicts
    as compact JSON)."""
    cols = list(columns) if columns else list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(cols)
    for r in rows:
        cells = []
        for c in cols:
            v = jsonable(r.get(c))
            cells.append(json.dumps(v, separators=(",", ":")) if isinstance(v, (list, dict)) else ("" if v is None
                                                                                                  else v))
        w.writerow(cells)
    return buf.getvalue()


__all__ = ["git_state", "short_commit", "source_date_epoch", "utc_stamp", "identity", "environment",
           "package_versions", "file_sha256", "jsonable", "dumps", "write_json", "write_text_if_changed",
           "result_path", "md_table", "rows_to_csv", "MANIFEST_PACKAGES"]
