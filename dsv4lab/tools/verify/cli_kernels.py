"""``dsv4lab verify kernels [--backend NAME] [--op NAME]`` — every registered op against the reference."""
from __future__ import annotations

import importlib.util
import os
import sys

from dsv4lab.engine.backends import make_ops
from dsv4lab.core.errors import UserError
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.tools.options import add_backend, add_device, resolve_device
from dsv4lab.tools.verify.kernels import run_kernel_checks
from dsv4lab.tools.verify.registry import OPS, op_names
from dsv4lab.tools.verify.report import md_table, write_report

HELP = ("run every registered op of each backend against the reference on random inputs, judged by its error "
        "bound (docs/verification.md); print the metrics")


def add_arguments(p):
    add_backend(p, repeatable=True, help="backend(s) to check (default: reference, plus triton when importable)")
    p.add_argument("--op", action="append", default=None, help="only these ops (repeatable); see --list")
    p.add_argument("--list", action="store_true", help="list the registered ops and exit")
    add_device(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="report folder (default runs/verify/<stamp>_kernels)")


def _backends(names, device):
    if names is None:
        names = ["reference"]
        if importlib.util.find_spec("triton") is not None:
            names.append("triton")
    out = []
    for n in names:
        try:
            out.append(make_ops(n, Numerics()))
        except Exception as e:  # report and continue: one missing backend must not hide the others
            print(f"backend {n}: unavailable ({type(e).__name__}: {e})", file=sys.stderr)
    return out


def run(args) -> int:
    if args.list:
        for c in OPS:
            print(f"{c.name:<24} {c.method:<18} {c.kind:<22} {len(c.shapes)} shapes  {c.description}")
        return 0
    if args.op:
        unknown = sorted(set(args.op) - set(op_names()))
        if unknown:
            raise UserError(f"unknown op(s) {unknown}; registered: {', '.join(op_names())}")
    device = resolve_device(args.device)
    if device == "cpu" and "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "1"  # Triton kernels run in the interpreter on a CPU
    backends = _backends(args.backend, device)
    rows = run_kernel_checks(backends, args.op, device, args.seed, progress=lambda line: print(line, flush=True))
    cols = ["op", "impl", "shape", "output", "ok", "bound_ratio", "max_abs", "rel_l2", "cosine", "rule", "message"]
    n_bad = sum(not r["ok"] for r in rows)
    md = [f"# verify kernels ({device})", "", f"{len(rows)} checks, {n_bad} failed.", "", md_table(rows, cols)]
    folder = write_report(args.out, "kernels", dict(device=device, backends=[b.name for b in backends], rows=rows,
                                                    failed=n_bad), "\n".join(md))
    print(f"{len(rows)} checks, {n_bad} failed; report in {folder}")
    return 1 if n_bad else 0
