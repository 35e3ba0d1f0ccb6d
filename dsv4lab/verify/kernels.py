"""Kernel level: every registered op × every implementation a backend provides, against the reference."""
from __future__ import annotations

import torch

from ..model.ops import ReferenceOps
from .compare import compare, tolerance
from .registry import OPS, implementations


def _as_tuple(v):
    return v if isinstance(v, tuple) else (v,)


def _fmt_shape(s: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in s.items())


def run_kernel_checks(backends: list, ops_filter: list[str] | None = None, device: str = "cpu",
                      seed: int = 0) -> list[dict]:
    """Rows of ``{op, impl, shape, ok, max_abs, rel_l2, cosine, nmse, worst, ...}`` for every check."""
    rows = []
    for case in OPS:
        if ops_filter and case.name not in ops_filter:
            continue
        ref_ops = ReferenceOps(case.numerics)
        for backend in backends:
            impls = implementations(backend, case)
            for impl_name, fn in impls.items():
                for si, shape in enumerate(case.shapes):
                    gen = torch.Generator().manual_seed(seed * 1_000_003 + hash((case.name, si)) % 1_000_003)
                    inputs = case.make(shape, gen, device, case.numerics)
                    ref = _as_tuple(getattr(ref_ops, case.method)(*inputs))
                    try:
                        out = _as_tuple(fn(*inputs))
                        err = None
                    except Exception as e:  # a crashing kernel is a failed check, reported with its message
                        out, err = None, f"{type(e).__name__}: {e}"
                    for oi, r in enumerate(ref):
                        name = f"{case.name}[{impl_name}]({_fmt_shape(shape)})" + (f"#{oi}" if len(ref) > 1 else "")
                        row = dict(op=case.name, impl=impl_name, shape=_fmt_shape(shape), output=oi, kind=case.kind)
                        if err is not None:
                            row.update(ok=False, message=err)
                        else:
                            tol = tolerance(case.numerics.act, case.kind)
                            c = compare(name, out[oi], r, tol)
                            row.update(c.to_dict())
                            row["line"] = c.line()
                        rows.append(row)
    return rows
