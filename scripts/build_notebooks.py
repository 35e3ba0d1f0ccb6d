#!/usr/bin/env python3
"""Build ``notebooks/*.ipynb`` from their sources ``notebooks/source/*.py`` (committed without outputs).

The sources are in the "percent" format (readable and diffable; jupytext opens them too)::

    # %% [markdown]
    # # A title
    # Some text.

    # %% tags=["parameters"]
    RUN_DIR: str = ""  # help

    # %%
    code()

IPython magics are commented out in the source (``# %matplotlib inline``), as jupytext writes them. Cells get
stable ids (``cell-01`` ...), so a rebuild of unchanged sources gives byte-identical notebooks.

    python scripts/build_notebooks.py            # write every notebook
    python scripts/build_notebooks.py --check    # exit 1 if a committed notebook differs from its source
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "notebooks" / "source"
OUT = ROOT / "notebooks"
HEADER = re.compile(r"^# %%(?P<rest>.*)$")
MAGIC = re.compile(r"^# %[a-z]")
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def parse_cells(text: str, where: str) -> list[dict]:
    """Split percent-format text into ``[{kind, source, tags}]``."""
    cells: list[dict] = []
    current: dict | None = None
    for lineno, line in enumerate(text.splitlines(), 1):
        m = HEADER.match(line)
        if m:
            rest = m.group("rest").strip()
            kind = "markdown" if rest.startswith("[markdown]") else "code"
            rest = rest.removeprefix("[markdown]").strip()
            tags: list[str] = []
            if rest:
                tm = re.fullmatch(r"tags=(\[.*\])", rest)
                if not tm:
                    raise SystemExit(f"{where}:{lineno}: cannot read cell header options {rest!r} "
                                     "(expected tags=[\"...\"])")
                tags = json.loads(tm.group(1))
            current = dict(kind=kind, lines=[], tags=tags)
            cells.append(current)
            continue
        if current is None:
            if line.strip():
                raise SystemExit(f"{where}:{lineno}: text before the first '# %%' cell header")
            continue
        if current["kind"] == "markdown":
            if line.strip() and not line.startswith("#"):
                raise SystemExit(f"{where}:{lineno}: markdown lines must start with '#'")
            line = line[2:] if line.startswith("# ") else line[1:]
        elif MAGIC.match(line):  # jupytext's convention: IPython magics are commented out in the source
            line = line[2:]
        current["lines"].append(line)
    out = []
    for c in cells:
        lines = c["lines"]
        while lines and not lines[-1].strip():
            lines.pop()
        while lines and not lines[0].strip():
            lines.pop(0)
        out.append(dict(kind=c["kind"], source="\n".join(lines), tags=c["tags"]))
    return out


def build(source: Path) -> str:
    """The ``.ipynb`` text for one source file."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    cells = []
    for i, c in enumerate(parse_cells(source.read_text(), str(source)), 1):
        meta = {"tags": c["tags"]} if c["tags"] else {}
        make = new_markdown_cell if c["kind"] == "markdown" else new_code_cell
        cell = make(c["source"], metadata=meta)
        cell["id"] = f"cell-{i:02d}"
        cells.append(cell)
    nb = new_notebook(cells=cells, metadata={"kernelspec": KERNELSPEC,
                                             "language_info": {"name": "python", "pygments_lexer": "ipython3"}})
    nb["nbformat"], nb["nbformat_minor"] = 4, 5
    nbformat.validate(nb)
    return nbformat.writes(nb) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true",
                   help="report notebooks that differ from their sources; write nothing")
    args = p.parse_args(argv)
    sources = sorted(SOURCES.glob("*.py"))
    if not sources:
        print(f"no sources in {SOURCES}", file=sys.stderr)
        return 1
    stale = []
    for src in sources:
        target = OUT / (src.stem + ".ipynb")
        text = build(src)
        if args.check:
            if not target.exists() or target.read_text() != text:
                stale.append(target)
        elif not target.exists() or target.read_text() != text:
            target.write_text(text)
            print(f"wrote {target.relative_to(ROOT)}")
    if stale:
        print("out of date (run python scripts/build_notebooks.py): "
              + ", ".join(str(s.relative_to(ROOT)) for s in stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
