"""The offline text corpus of the small models: Python's own standard-library sources.

Every Python installation carries them, so the corpus needs no download. Exactly which files:

* every ``*.py`` file under the running interpreter's ``stdlib`` folder (``sysconfig.get_paths()["stdlib"]``),
  recursively, **excluding** any path with a component named ``test``, ``tests``, ``idlelib``,
  ``site-packages`` or ``__pycache__``; sorted by their path relative to that folder (POSIX form);
* the held-out split is every file whose ``sha256(relative path)`` has a first byte below 13 (≈ 5%); the rest
  is the training split. The split depends on the path only, so it is stable across machines.

The files differ between Python versions; :func:`corpus_manifest` records every file's sha256 so a run can
say exactly what it read (``data/tiny-py/train_report.json`` carries the manifest digest), and
:func:`pack_corpus` writes the text into one file that can travel to a machine with another Python.
"""
from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

EXCLUDED_PARTS = {"test", "tests", "idlelib", "site-packages", "__pycache__"}
HELDOUT_FIRST_BYTE_BELOW = 13
DOC_SEPARATOR = "\n\n"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[str]:
    """Relative POSIX paths of the corpus files, sorted."""
    root = root or stdlib_root()
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if EXCLUDED_PARTS.intersection(rel.parts):
            continue
        out.append(rel.as_posix())
    return sorted(out)


def is_heldout(rel_path: str) -> bool:
    return hashlib.sha256(rel_path.encode()).digest()[0] < HELDOUT_FIRST_BYTE_BELOW


def read_corpus(root: Path | None = None) -> dict[str, list[tuple[str, str]]]:
    """``{"train": [(path, text), ...], "heldout": [...]}`` (undecodable bytes replaced)."""
    root = root or stdlib_root()
    split: dict[str, list[tuple[str, str]]] = {"train": [], "heldout": []}
    for rel in corpus_files(root):
        text = (root / rel).read_bytes().decode("utf-8", errors="replace")
        split["heldout" if is_heldout(rel) else "train"].append((rel, text))
    return split


def corpus_manifest(root: Path | None = None) -> dict:
    root = root or stdlib_root()
    files = {rel: hashlib.sha256((root / rel).read_bytes()).hexdigest() for rel in corpus_files(root)}
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    return dict(root=str(root), n_files=len(files), digest=digest,
                n_heldout=sum(is_heldout(r) for r in files), files=files)


def pack_corpus(out: str | Path, root: Path | None = None) -> Path:
    """Write the corpus (both splits, with paths) as one JSON file, to carry it to another machine."""
    split = read_corpus(root)
    out = Path(out)
    out.write_text(json.dumps({k: [[p, t] for p, t in v] for k, v in split.items()}))
    return out


def load_packed(path: str | Path) -> dict[str, list[tuple[str, str]]]:
    data = json.loads(Path(path).read_text())
    return {k: [(p, t) for p, t in v] for k, v in data.items()}
