"""Metadata and writing for the serving benchmarks' JSON results (what ran, where, on which commit)."""
from __future__ import annotations

import json
import platform
import subprocess
import time
from pathlib import Path


def git_commit(short: bool = True) -> str | None:
    """``git rev-parse --short HEAD`` of the working tree the package runs from (None outside git)."""
    root = Path(__file__).resolve().parents[2]
    cmd = ["git", "rev-parse", "--short", "HEAD"] if short else ["git", "rev-parse", "HEAD"]
    try:
        return subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def result_meta(device: str | None = None) -> dict:
    """Versions, host, device name and commit, recorded with every benchmark result."""
    import dsv4lab
    meta = {"dsv4lab": dsv4lab.__version__, "commit": git_commit(), "python": platform.python_version(),
            "platform": platform.platform(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        import torch
        meta["torch"] = torch.__version__
        if device and str(device).startswith("cuda") and torch.cuda.is_available():
            meta["gpu"] = torch.cuda.get_device_name(torch.device(device))
        meta["device"] = str(device) if device else None
    except ImportError:
        pass
    return meta


def write_result(doc: dict, out: str | Path | None, kind: str) -> Path:
    """Write ``doc`` to ``out`` (default ``runs/<kind>/<time>.json``); strict JSON (infinities as strings)."""
    path = Path(out) if out else Path("runs") / kind / f"{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(doc), indent=1, allow_nan=False) + "\n")
    return path


def _finite(x):
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
