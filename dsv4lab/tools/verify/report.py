"""Where verify commands write: one folder per run holding ``<name>.json`` and ``<name>.md``."""
from __future__ import annotations

from datetime import datetime, timezone
from functools import partial
from pathlib import Path

from dsv4lab.core.provenance import md_table as _md_table
from dsv4lab.core.provenance import short_commit, write_json

md_table = partial(_md_table, digits=4)
"""The reports' markdown tables: every row, floats to 4 significant digits."""


def default_out(kind: str) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return Path("runs") / "verify" / f"{stamp}_{kind}"


def write_report(out: str | Path | None, kind: str, data: dict, markdown: str) -> Path:
    """Write ``<kind>.json`` and ``<kind>.md`` into ``out`` (default ``runs/verify/<UTC stamp>_<kind>/``)."""
    folder = Path(out) if out else default_out(kind)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / f"{kind}.json", dict(data, commit=short_commit() or "unknown"), indent=2)
    (folder / f"{kind}.md").write_text(markdown.rstrip() + "\n")
    return folder
