"""Where verify commands write: one folder per run holding ``<name>.json`` and ``<name>.md``."""
from __future__ import annotations

import json
import subprocess
from datetime import datetime, timezone
from pathlib import Path


def git_commit(short: bool = True) -> str:
    try:
        args = ["git", "rev-parse", "--short" if short else "HEAD", "HEAD"] if short else ["git", "rev-parse", "HEAD"]
        return subprocess.run(args, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2],
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def default_out(kind: str) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return Path("runs") / "verify" / f"{stamp}_{kind}"


def write_report(out: str | Path | None, kind: str, data: dict, markdown: str) -> Path:
    """Write ``<kind>.json`` and ``<kind>.md`` into ``out`` (default ``runs/verify/<UTC stamp>_<kind>/``)."""
    folder = Path(out) if out else default_out(kind)
    folder.mkdir(parents=True, exist_ok=True)
    data = dict(data, commit=git_commit())
    (folder / f"{kind}.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    (folder / f"{kind}.md").write_text(markdown.rstrip() + "\n")
    return folder


def md_table(rows: list[dict], cols: list[str]) -> str:
    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(cell(r.get(c, "")) for c in cols) + " |")
    return "\n".join(out)
