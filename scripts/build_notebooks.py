#!/usr/bin/env python3
"""Build ``notebooks/*.ipynb`` from their sources ``notebooks/source/*.py`` (committed without outputs).

The format and the builder are :mod:`dsv4lab.faces.notebook_format` (which JupyterLab's save hook shares, so a notebook
saved there stays output-free and in step with its source). Cells get stable ids (``cell-01`` ...), so a rebuild of
unchanged sources gives byte-identical notebooks.

    python scripts/build_notebooks.py            # write every notebook
    python scripts/build_notebooks.py --check    # exit 1 if a committed notebook differs from its source
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's package, also without an install

from dsv4lab.faces.notebook_format import NotebookFormatError, build  # noqa: E402

SOURCES = ROOT / "notebooks" / "source"
OUT = ROOT / "notebooks"


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
        try:
            text = build(src)
        except NotebookFormatError as err:
            print(err, file=sys.stderr)
            return 1
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
