"""Committed GPU measurements (``data/results/<gpu>/*.json``) and what this machine can measure now.

GPU timings are taken on the GPU machine and committed as JSON (with the GPU name, versions and commit); the
notebooks plot those files on any machine. This module finds and checks them, says plainly when one is absent,
runs fresh measurements only when a GPU is present, and on a CPU runs the small check that is possible there:
the Triton kernels against the reference under the interpreter.

Files and the fields the notebooks read (each file also carries ``gpu``, ``torch``, ``triton``, ``commit``):

* ``decode_kernels.json`` — ``copy_bw_gbps`` and ``rows`` of ``kernel, variant, batch, time_us, bytes, gbps,
  pct_copy_bw`` (compared with the cost model by :func:`dsv4lab.tools.perf.roofline.compare_kernel_results`);
* ``prefill_kernels.json`` — ``rows`` of ``kernel, variant, tokens, time_us, tflops, pct_peak, peak_kind`` (MoE
  rows ``sorter_rows``, chunked rows ``chunk``);
* ``collectives.json`` — ``rows`` of ``strategy, mode, variant, message_bytes, us_median`` and a ``summary``;
* ``e2e_1gpu.json`` (one GPU, a ``--layers`` cut) and ``e2e.json`` (two GPUs) — end-to-end decode / prefill
  throughput (:func:`e2e_headline` and :func:`dsv4lab.faces.figure_data.e2e_runs` read the fields they know).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from dsv4lab.core.errors import RunError
from dsv4lab.core.paths import RESULTS_DIR, display_path, read_json
from dsv4lab.tools.verify import registry
from dsv4lab.tools.verify.kernels import run_kernel_checks
PROVENANCE_FIELDS = ("gpu", "torch", "triton", "commit")
RESULT_FILES = ("decode_kernels", "prefill_kernels", "collectives", "e2e_1gpu", "e2e")
BENCH_MODULES = {"kernels": "dsv4lab.tools.bench.kernels", "e2e": "dsv4lab.tools.bench.e2e",
                 "collectives": "dsv4lab.tools.bench.collectives", "engine": "dsv4lab.tools.bench.engine"}


def results_dir(gpu: str = "h200") -> Path:
    """``data/results/<gpu>/``; a GPU with no such folder (a misspelt ``GPU`` parameter) is an error naming the
    folders there are, so a notebook never reports a run without measurements as if it had plotted them."""
    folder = RESULTS_DIR / gpu
    if not folder.is_dir():
        known = sorted(p.name for p in RESULTS_DIR.iterdir() if p.is_dir()) if RESULTS_DIR.is_dir() else []
        raise RunError(f"GPU={gpu!r}: no measurements folder {display_path(folder)} (there are: "
                       f"{', '.join(known) or 'none'}); a GPU measured for the first time needs its folder there")
    return folder


def results_path(name: str, gpu: str = "h200") -> Path:
    return results_dir(gpu) / f"{name}.json"


def load_results_file(name: str, gpu: str = "h200", path: str | Path | None = None) -> dict[str, Any] | None:
    """A committed results file as a dict, or None when it is absent. A file that exists but is not valid JSON
    or lacks the provenance fields (``gpu, torch, triton, commit``) is an error naming it."""
    p = Path(path) if path is not None else results_path(name, gpu)
    if not p.exists():
        return None
    doc = read_json(p, RunError)
    if not isinstance(doc, dict):
        raise RunError(f"{p}: expected a JSON object at the top level")
    missing = [f for f in PROVENANCE_FIELDS if f not in doc]
    if missing:
        raise RunError(f"{p}: missing provenance field(s) {missing}; measurements must say where they were taken")
    doc.setdefault("_path", display_path(p))
    return doc


def provenance(doc: dict[str, Any]) -> str:
    """``"NVIDIA H200, torch 2.11, triton 3.6, commit abc1234"`` for a results file."""
    return (f"{doc.get('gpu')}, torch {doc.get('torch')}, triton {doc.get('triton')}, commit {doc.get('commit')}"
            + (f" ({doc['_path']})" if doc.get("_path") else ""))


def availability(gpu: str = "h200") -> list[dict[str, Any]]:
    """One row per known results file: present or not, and its provenance."""
    rows = []
    for name in RESULT_FILES:
        p = results_path(name, gpu)
        row: dict[str, Any] = dict(file=display_path(p), present=p.exists())
        if p.exists():
            try:
                doc = load_results_file(name, gpu)
                row.update(provenance=provenance(doc), rows=len(doc.get("rows", [])))
            except RunError as err:
                row.update(error=str(err))
        rows.append(row)
    return rows


def gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def e2e_headline(doc: dict[str, Any] | None) -> dict[str, float]:
    """The end-to-end numbers a figure can put beside the paper's: decode tok/s (batch 1) and prefill input
    tok/s, from the fields of ``e2e.json`` this knows (``decode_tok_s``, ``prefill_tok_s`` at the top level or
    under ``summary``); empty when absent."""
    if not doc:
        return {}
    out = {}
    for src in (doc, doc.get("summary") or {}):
        for key in ("decode_tok_s", "prefill_tok_s", "prefill_input_tok_s", "ttft_s"):
            v = src.get(key)
            if isinstance(v, (int, float)) and key not in out:
                out[key] = float(v)
    return out


# ============================================================================================ CPU smoke checks
def kernel_checks(backend: str, ops: Sequence[str] | None = None, *, seed: int = 0,
                  max_shapes: int | None = None) -> dict[str, Any]:
    """The kernel tier of :mod:`dsv4lab.tools.verify` for one backend: its implementations of ``ops`` (all registered
    ops when None) against the reference on random inputs. The Triton backend runs on the CPU through the
    Triton interpreter when no GPU is present.

    Returns ``{status, rows, message}``: ``status`` is ``"ran"`` (see each row's ``ok``), ``"unavailable"`` (the
    backend cannot be imported — e.g. triton missing, or kernels under development failing to import: the
    message says why) or ``"no-kernels"`` (the backend implements none of ``ops``). ``max_shapes`` keeps the
    first shapes of each op (quick runs)."""
    if backend == "triton":
        if importlib.util.find_spec("triton") is None:
            return dict(status="unavailable", rows=[], message="triton is not installed")
        if not gpu_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first @triton.jit decoration

    try:
        from dsv4lab.engine.backends import make_ops
        from dsv4lab.core.model.numerics import Numerics
        ops_object = make_ops(backend, Numerics())
    except Exception as err:  # an import error in kernels under development is reported, not raised
        return dict(status="unavailable", rows=[], message=f"{backend} backend: {type(err).__name__}: {err}")
    names = list(ops) if ops is not None else registry.op_names()
    unknown = sorted(set(names) - set(registry.op_names()))
    if unknown:
        raise RunError(f"unknown op(s) {unknown}; registered: {', '.join(registry.op_names())}")
    saved = {c.name: c.shapes for c in registry.OPS}
    if max_shapes is not None:  # the registry's grid is module data: trim it for this call only
        for c in registry.OPS:
            c.shapes = c.shapes[:max_shapes]
    try:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        rows = run_kernel_checks([ops_object], names, device, seed)
    finally:
        for c in registry.OPS:
            c.shapes = saved[c.name]
    if not rows:
        return dict(status="no-kernels", rows=[], message=f"the {backend} backend implements none of {names}")
    bad = sum(not r["ok"] for r in rows)
    where = "GPU" if device == "cuda" else ("CPU, Triton interpreter" if backend == "triton" else "CPU")
    return dict(status="ran", rows=rows, message=f"{len(rows)} checks, {bad} failed ({where})")


def check_rows_summary(rows: Sequence[dict]) -> list[dict[str, Any]]:
    """Kernel-check rows reduced to one line per op and implementation (worst error over shapes)."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        key = (r["op"], r["impl"])
        cur = out.setdefault(key, dict(op=r["op"], impl=r["impl"], checks=0, failed=0, worst_rel_l2=0.0,
                                       min_cosine=1.0, message=""))
        cur["checks"] += 1
        cur["failed"] += int(not r["ok"])
        if r.get("rel_l2") is not None:
            cur["worst_rel_l2"] = max(cur["worst_rel_l2"], float(r["rel_l2"]))
        if r.get("cosine") is not None:
            cur["min_cosine"] = min(cur["min_cosine"], float(r["cosine"]))
        if not r["ok"] and not cur["message"]:
            cur["message"] = str(r.get("message") or "")[:120]
    return list(out.values())


# ============================================================================================ fresh measurements
def fresh_benchmark(kind: str, extra_args: Sequence[str], out: str | Path, timeout_s: float = 1800) -> dict[str, Any]:
    """Run ``dsv4lab bench <kind> <extra_args> --out <out>`` when a GPU is present and the benchmark exists.

    Returns ``{status, path?, message}``: ``"measured"`` (``path`` is the JSON written), ``"skipped"`` (no GPU, or
    the benchmark is not in this checkout) or ``"failed"`` (its exit status and last output lines)."""
    if not gpu_available():
        return dict(status="skipped", message="no GPU on this machine: plotting committed results only")
    mod = BENCH_MODULES.get(kind)
    if mod is None or importlib.util.find_spec(mod) is None:
        return dict(status="skipped", message=f"`dsv4lab bench {kind}` is not available in this checkout")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "dsv4lab", "bench", kind, *extra_args, "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-8:])
    if res.returncode != 0 or not out.exists():
        return dict(status="failed", message=f"{' '.join(cmd[2:])} exited {res.returncode}: {tail}")
    return dict(status="measured", path=str(out), message=tail)


__all__ = ["RESULTS_DIR", "RESULT_FILES", "results_dir", "results_path", "load_results_file", "provenance",
           "availability", "gpu_available", "e2e_headline", "kernel_checks", "check_rows_summary", "fresh_benchmark"]
