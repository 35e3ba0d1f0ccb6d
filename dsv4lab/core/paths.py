"""Where dsv4lab's files are, and reading them with an error that names the file.

Run from a checkout (an editable install, ``PYTHONPATH``, the tests), every location is in the repository:
``data/``, ``notebooks/``, ``kernels/dsv4lab_kernels/``. An installed wheel has no repository; it carries the data commands read at
run time under ``dsv4lab/_data/`` — the hardware catalogue, the paper's numbers, the notebooks' expectations, the
golden oracles, the committed measurements and the small models' tokenizer (``pyproject.toml`` maps ``data/`` there)
— and :data:`DATA_DIR` points at it. What a wheel does not carry (the small checkpoints, the notebooks) is reported
by :func:`require` with the reason.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dsv4lab.core.errors import DSV4LabError

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # dsv4lab/ (this file is dsv4lab/core/paths.py)
REPO_ROOT = PACKAGE_DIR.parent
"""The folder holding the package: the repository in a checkout (site-packages for a wheel)."""
IN_CHECKOUT = (REPO_ROOT / "pyproject.toml").is_file() and (REPO_ROOT / "data").is_dir()

DATA_DIR = REPO_ROOT / "data" if IN_CHECKOUT else PACKAGE_DIR / "_data"
HARDWARE_DIR = DATA_DIR / "hardware"          # the catalogue (perf.hardware)
PAPER_DIR = DATA_DIR / "paper"                # numbers the paper reports (perf.account)
GOLDEN_DIR = DATA_DIR / "golden"              # golden oracles, one file per checkpoint (verify.model)
RESULTS_DIR = DATA_DIR / "results"            # committed measurements (measurements, the notebooks)
REFERENCE_DIR = DATA_DIR / "reference"
EXPECTATIONS_FILE = REFERENCE_DIR / "expectations.yaml"  # what each notebook's key results must be (runs)
TOKENIZERS_DIR = DATA_DIR / "tokenizers"
DEFAULT_TOKENIZER = TOKENIZERS_DIR / "pystdlib-bpe-4096.json"  # the small models' BPE (train, make-checkpoint)

NOTEBOOKS_DIR = REPO_ROOT / "notebooks"       # a checkout only
KERNELS_DIR = REPO_ROOT / "kernels" / "dsv4lab_kernels"  # the source of dsv4lab_kernels in a checkout
STYLE_FILE = PACKAGE_DIR / "faces" / "style" / "dsv4lab.mplstyle"
RUNS_DIR = Path("runs")                       # relative: results of a command go where it runs


def require(path: Path, what: str) -> Path:
    """``path`` when it exists; otherwise an error naming it and, outside a checkout, why it is absent."""
    if path.exists():
        return path
    hint = "" if IN_CHECKOUT else " (an installed wheel does not carry it: run from a clone of the repository)"
    raise DSV4LabError(f"{what} not found: {path}{hint}")


def display_path(path: str | Path) -> str:
    """A path as results should show it: relative to the repository when inside it (stable across clones and run
    folders), else as given."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def read_json(path: str | Path, error: type[Exception] = DSV4LabError) -> Any:
    """The parsed JSON of ``path``; a missing file or invalid JSON raises ``error`` naming the file."""
    return _read(Path(path), error, json.loads, json.JSONDecodeError, "JSON")


def read_yaml(path: str | Path, error: type[Exception] = DSV4LabError, *, max_values: int | None = None,
              max_bytes: int | None = None) -> Any:
    """The parsed YAML of ``path`` (``None`` for an empty file); a missing file or invalid YAML raises ``error``.

    For a file a user hands in, ``max_bytes`` bounds its size and ``max_values`` the values (scalars, lists and
    mappings) of the document *with every alias expanded*, counted on the composed node graph before anything is
    built: a few lines of nested aliases (a "billion laughs" file) otherwise expand into gigabytes the moment the
    data is copied or written out."""
    import yaml  # only when a YAML file is read: `roofline` and `--help` stay fast
    path = Path(path)
    if max_bytes is not None and path.is_file() and path.stat().st_size > max_bytes:
        raise error(f"{path}: {path.stat().st_size:,} bytes, more than the {max_bytes:,} a YAML file may have here")
    if max_values is None:
        return _read(path, error, yaml.safe_load, yaml.YAMLError, "YAML")

    def parse(text: str) -> Any:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is None:
            return None
        if _expanded_values(node, max_values) > max_values:
            raise error(f"{path}: more than {max_values:,} values once its aliases (*name) are expanded; write the "
                        "values out or use fewer aliases")
        return yaml.safe_load(text)
    return _read(path, error, parse, yaml.YAMLError, "YAML")


def _expanded_values(node: Any, limit: int) -> int:
    """How many values the YAML node graph ``node`` stands for with its aliases expanded (an alias is the same node
    object as its anchor, so a shared node counts once per reference); stops counting past ``limit``, and a node
    that contains itself counts as past it."""
    sizes: dict[int, int] = {}
    busy: set[int] = set()

    def size(n) -> int:
        key = id(n)
        if key in sizes:
            return sizes[key]
        if key in busy:  # a recursive alias: infinitely many values
            return limit + 1
        busy.add(key)
        total = 1
        # a mapping's value is a list of (key, value) node pairs, a sequence's a list of nodes, a scalar's text
        items = n.value if isinstance(n.value, list) else []
        children = [c for item in items for c in (item if isinstance(item, tuple) else (item,))]
        for child in children:
            total += size(child)
            if total > limit:
                break
        busy.discard(key)
        sizes[key] = total = min(total, limit + 1)
        return total
    return size(node)


def _read(path: Path, error: type[Exception], parse, invalid: type[Exception], language: str) -> Any:
    try:
        return parse(path.read_text())
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except OSError as err:  # a folder, no permission
        raise error(f"{path}: cannot be read ({err.strerror or err})") from None
    except UnicodeDecodeError as err:
        raise error(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except RecursionError:
        raise error(f"{path}: not valid {language} (nested too deeply)") from None
    except invalid as err:
        raise error(f"{path}: not valid {language} ({err})") from None


__all__ = ["PACKAGE_DIR", "REPO_ROOT", "IN_CHECKOUT", "DATA_DIR", "HARDWARE_DIR", "PAPER_DIR", "GOLDEN_DIR",
           "RESULTS_DIR", "REFERENCE_DIR", "EXPECTATIONS_FILE", "TOKENIZERS_DIR", "DEFAULT_TOKENIZER",
           "NOTEBOOKS_DIR", "KERNELS_DIR", "STYLE_FILE", "RUNS_DIR", "require", "display_path", "read_json",
           "read_yaml"]
