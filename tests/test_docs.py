"""The documentation says what is true: README.md and docs/*.md.

* Every fenced block marked runnable runs green from the repository root: a block whose info string is
  ``python runnable`` runs with this Python, ``bash runnable`` with bash (``set -euo pipefail``, this environment's
  ``bin/`` first on PATH, so ``dsv4lab`` is the checkout's; a block that activates ``.venv`` is skipped where
  there is none). Runnable blocks are kept cheap (``data/tiny`` or
  ``data/tiny-py``, CPU, seconds) and write nothing into the checkout (checked with ``git status``). Blocks without
  the marker are illustrations (a GPU run, a 160 GB download) and are not run.
* Every repository path the prose cites exists: ``dsv4lab/…``, ``kernels/…``, ``data/…``, ``scripts/…``,
  ``tests/…`` (``tests/x.py::test_name`` also names a test that exists), ``notebooks/…``, ``docs/…`` — outside
  fenced blocks, where listings such as a run folder's are relative to something else. ``<placeholder>`` and ``*``
  match any name, ``{a,b}`` each alternative; a path that only exists elsewhere is listed in :data:`NOT_IN_A_CHECKOUT`
  with the reason.
* Every measured number the README links to a committed result is that result: a link
  ``[154.0 tok/s](data/results/h200/FILE.json#/summary/decode_tok_s)`` carries a JSON pointer (RFC 6901), and the
  number in the link text equals the value there at the precision written (``30.1 %`` also reads a fraction 0.301);
  every cell of the README's numbers table that holds a number holds it as such a link, GPU numbers from
  ``data/results/h200/``.
* The README stays a front door: at most 1,500 words.
"""
from __future__ import annotations

import glob
import itertools
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_WORDS = 1500
RUNNABLE = "runnable"
BLOCK_TIMEOUT_S = 300
PATH_ROOTS = ("dsv4lab", "kernels", "data", "scripts", "tests", "notebooks", "docs")
# Cited on purpose although a checkout does not hold them.
NOT_IN_A_CHECKOUT = {
    "data/results/h200/e2e.json": "the two-GPU run, not measured yet: the figures and notebooks say so",
    "dsv4lab/_data": "where an installed wheel holds data/",
}
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>.*)$")
PATH = re.compile(r"(?<![\w./\-~$@])((?:%s)/[\w./*<>{},\-:]*)" % "|".join(PATH_ROOTS))
NUMBER_LINK = re.compile(r"\[(?P<text>[^\]]+)\]\((?P<file>data/results/[^)#\s]+\.json)#(?P<pointer>/[^)\s]*)\)")
NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?(?!\w)")  # not the 16 of bf16


@dataclass
class Block:
    doc: Path
    line: int
    lang: str
    info: str
    code: str

    @property
    def runnable(self) -> bool:
        return RUNNABLE in self.info.split()[1:]

    def __str__(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def split_fences(doc: Path) -> tuple[list[Block], list[tuple[int, str]]]:
    """The fenced blocks of a Markdown file, and its other lines as ``(line number, text)``."""
    blocks: list[Block] = []
    prose: list[tuple[int, str]] = []
    open_block = None
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        m = FENCE.match(line)
        if open_block is None:
            if m:
                info = m.group("info").strip()
                open_block = dict(line=number, fence=m.group("fence"), info=info, lines=[])
            else:
                prose.append((number, line))
        elif m and m.group("fence").startswith(open_block["fence"]) and not m.group("info").strip():
            info = open_block["info"]
            blocks.append(Block(doc, open_block["line"], (info.split() or [""])[0], info,
                                "\n".join(open_block["lines"]) + "\n"))
            open_block = None
        else:
            open_block["lines"].append(line)
    assert open_block is None, f"{doc}:{open_block['line']}: a fenced block is never closed"
    return blocks, prose


BLOCKS = [b for doc in DOCS for b in split_fences(doc)[0]]
RUNNABLE_BLOCKS = [b for b in BLOCKS if b.runnable]


# ============================================================================================ runnable blocks
def test_runnable_blocks_are_python_or_bash_and_some_exist():
    assert all(b.lang in ("python", "bash") for b in RUNNABLE_BLOCKS), [str(b) for b in RUNNABLE_BLOCKS]
    assert any(b.doc.name == "README.md" and b.lang == "python" for b in RUNNABLE_BLOCKS)
    assert any(b.doc.name == "README.md" and b.lang == "bash" for b in RUNNABLE_BLOCKS)


def _git_status() -> str | None:
    res = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True,
                         text=True)
    return res.stdout if res.returncode == 0 else None


@pytest.mark.parametrize("block", RUNNABLE_BLOCKS, ids=str)
def test_runnable_block_runs(block):
    if ".venv/bin/activate" in block.code and not (ROOT / ".venv" / "bin" / "activate").exists():
        pytest.skip(f"{block} activates .venv, which this checkout has not made (make install does)")
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1", PYTHONHASHSEED="0",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    argv = [sys.executable, "-c", block.code] if block.lang == "python" else ["bash", "-c",
                                                                               "set -euo pipefail\n" + block.code]
    before = _git_status()
    res = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert res.returncode == 0, f"{block} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert _git_status() == before, f"{block} changed the checkout"


# ============================================================================================ cited paths
def _candidates(path: str) -> list[str]:
    """Glob patterns for a cited path: ``<x>`` → ``*``, ``{a,b}`` → one pattern per alternative."""
    path = re.sub(r"<[^>]*>", "*", path)
    alternatives = [a.split(",") for a in re.findall(r"\{([^}]*)\}", path)]
    if not alternatives:
        return [path]
    out = []
    for combo in itertools.product(*alternatives):
        it = iter(combo)
        out.append(re.sub(r"\{[^}]*\}", lambda _: next(it), path))
    return out


def _missing(path: str) -> str | None:
    """Why ``path`` (as cited) does not hold in the checkout; None when it does."""
    path, _, test_name = path.partition("::")
    path = path.rstrip(".,:;").removesuffix("…").removesuffix("...")
    if path.rstrip("/") in NOT_IN_A_CHECKOUT:
        return None
    for pattern in _candidates(path):
        hits = glob.glob(str(ROOT / pattern))
        if not hits:
            return f"{pattern} does not exist"
        if test_name and not any(re.search(rf"^\s*def {re.escape(test_name)}\(", Path(h).read_text(), re.M)
                                 for h in hits if h.endswith(".py")):
            return f"{pattern} has no test {test_name}"
    return None


def cited_paths(doc: Path) -> list[tuple[int, str]]:
    _, prose = split_fences(doc)
    return [(number, m.group(1)) for number, line in prose for m in PATH.finditer(line)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_cited_path_exists(doc):
    problems = [f"{doc.name}:{n}: {p} — {why}" for n, p in cited_paths(doc) if (why := _missing(p))]
    assert problems == [], "\n".join(problems)


def test_the_path_check_catches_a_wrong_path(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("See `dsv4lab/plots.py`, `data/results/h200/<gpu>_nope.json`, `tests/test_docs.py::test_nope`,\n"
                   "and `docs/{notebooks,nowhere}.md`; fine: `dsv4lab/core/`, `data/results/h200/e2e_1gpu*.json`,\n"
                   "`tests/test_docs.py::test_every_cited_path_exists`.\n```\nnotebooks/<name>.ipynb\n```\n")
    found = [(p, _missing(p)) for _, p in cited_paths(doc)]
    assert [p for p, why in found if why] == ["dsv4lab/plots.py", "data/results/h200/<gpu>_nope.json",
                                              "tests/test_docs.py::test_nope", "docs/{notebooks,nowhere}.md"]
    assert len(found) == 7  # the fenced listing is not read


# ============================================================================================ measured numbers
def _resolve(doc: dict, pointer: str):
    value = doc
    for token in pointer.lstrip("/").split("/"):
        token = token.replace("~1", "/").replace("~0", "~")
        value = value[int(token)] if isinstance(value, list) else value[token]
    return value


def _number_matches(text: str, value) -> bool:
    if isinstance(value, str):
        return text.strip() == value
    m = NUMBER.search(text)
    if m is None or isinstance(value, bool):
        return False
    written = m.group(0).replace(",", "")
    decimals = len(written.partition(".")[2])
    want = float(written)
    options = [value] + ([100 * value] if "%" in text else [])
    return any(round(float(v), decimals) == want for v in options)


README_LINKS = [(n, m) for n, line in split_fences(ROOT / "README.md")[1] for m in NUMBER_LINK.finditer(line)]


def test_the_readme_links_its_numbers_to_results():
    assert len(README_LINKS) >= 8


@pytest.mark.parametrize("number,link", README_LINKS, ids=lambda x: str(x) if isinstance(x, int) else x["text"])
def test_a_linked_number_is_the_committed_result(number, link):
    path = ROOT / link["file"]
    assert path.exists(), f"README.md:{number}: {link['file']} does not exist"
    try:
        value = _resolve(json.loads(path.read_text()), link["pointer"])
    except (KeyError, IndexError, ValueError):
        raise AssertionError(f"README.md:{number}: {link['file']} has no {link['pointer']}") from None
    assert _number_matches(link["text"], value), \
        f"README.md:{number}: [{link['text']}] but {link['file']}#{link['pointer']} is {value!r}"


def test_number_matching_reads_the_written_precision():
    assert _number_matches("154.0 tok/s", 153.97) and not _number_matches("154.1 tok/s", 153.97)
    assert _number_matches("30.1 %", 0.301) and _number_matches("32.0 %", 32.0) and not _number_matches("30 %", 0.29)
    assert _number_matches("4,604 tokens", 4604) and _number_matches("590cf92", "590cf92")


def test_every_number_in_the_readme_table_is_a_linked_result():
    _, prose = split_fences(ROOT / "README.md")
    lines = [(n, line) for n, line in prose]
    start = next(i for i, (_, line) in enumerate(lines) if line.startswith("## Measured numbers"))
    stop = next((i for i, (_, line) in enumerate(lines) if i > start and line.startswith("## ")), len(lines))
    rows = [(n, line) for n, line in lines[start:stop] if line.startswith("|")]
    rows = [(n, line) for n, line in rows if not re.fullmatch(r"[|\-: ]+", line)][1:]  # past the header
    assert rows, "the README has a numbers table under '## Measured numbers'"
    for n, line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        linked = [m for c in cells[1:] for m in NUMBER_LINK.finditer(c)]
        assert linked, f"README.md:{n}: a row without a linked result"
        unlinked = [c for c in cells[1:] if NUMBER.search(NUMBER_LINK.sub("", c))]
        assert unlinked == [], f"README.md:{n}: numbers not linked to their result: {unlinked}"
        if "H200" in line or "GPU" in line:
            assert all(m["file"].startswith("data/results/h200/") for m in linked), f"README.md:{n}"


def test_the_readme_is_a_front_door():
    words = len((ROOT / "README.md").read_text().split())
    assert words <= README_MAX_WORDS, f"README.md has {words} words (at most {README_MAX_WORDS}): move detail to docs/"
