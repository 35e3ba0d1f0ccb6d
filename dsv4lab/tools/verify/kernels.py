"""Kernel level: every registered op × every implementation a backend provides, against the reference.

Each output is judged by the op's error bound (:data:`~dsv4lab.tools.verify.op_bounds.OP_BOUNDS`, derived in
``docs/verification.md``) under the accumulation the implementation uses, as its backend states it
(:func:`variant_accumulation`); the compare metrics (max abs, relative L2, cosine) are reported beside the verdict,
for reading, not for judging. Ops that write state in place (:data:`~dsv4lab.tools.verify.op_outputs.IN_PLACE`) run on
private copies of it, and what they write is compared.
"""
from __future__ import annotations

import zlib

import torch

from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.tools.verify.compare import compare
from dsv4lab.tools.verify.op_bounds import OP_BOUNDS, check_outputs
from dsv4lab.tools.verify.op_outputs import run_op
from dsv4lab.tools.verify.registry import OPS, implementations
from dsv4lab.tools.verify.stages import accumulation_of


def variant_accumulation(ops, impl: str, method: str, inputs: tuple, device: str, fn=None) -> str:
    """The accumulation model an implementation is judged under: the backend's answer for this call
    (:func:`~.stages.accumulation_of`) — for a variant (``backend:variant``) with the variant's name and the
    arguments it fixes (its route or geometry), so a fixed route is judged by its own model."""
    kwargs = {}
    if ":" in impl:
        kwargs = dict(getattr(fn, "keywords", None) or {}, variant=impl.split(":", 1)[1])
    return accumulation_of(ops, method, inputs, device, kwargs)


def _fmt_shape(s: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in s.items())


def run_kernel_checks(backends: list, ops_filter: list[str] | None = None, device: str = "cpu",
                      seed: int = 0, progress=None) -> list[dict]:
    """Rows of ``{op, impl, shape, ok, bound_ratio, rule, worst, max_abs, rel_l2, cosine, ...}`` per output;
    ``progress`` (a callable taking a line) hears each row as it is judged."""
    rows = []
    for case in OPS:
        if ops_filter and case.name not in ops_filter:
            continue
        ref_ops = ReferenceOps(case.numerics)
        bound_fn = OP_BOUNDS.get(case.method)
        for backend in backends:
            impls = implementations(backend, case)
            for impl_name, fn in impls.items():
                for si, shape in enumerate(case.shapes):
                    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{case.name}/{si}".encode()))
                    inputs = case.make(shape, gen, device, case.numerics)
                    ref = run_op(getattr(ref_ops, case.method), case.method, inputs)
                    try:
                        out = run_op(fn, case.method, inputs)
                        err = None
                    except Exception as e:  # a crashing kernel is a failed check, reported with its message
                        out, err = None, f"{type(e).__name__}: {e}"
                    names = [f"{case.name}[{impl_name}]({_fmt_shape(shape)})" + (f"#{oi}" if len(ref) > 1 else "")
                             for oi in range(len(ref))]
                    checks = None
                    if err is None and bound_fn is not None:
                        acc = variant_accumulation(backend, impl_name, case.method, inputs, device, fn)
                        checks = check_outputs(out, ref, bound_fn(case.numerics, acc, *inputs), names)
                    for oi, r in enumerate(ref):
                        row = dict(op=case.name, impl=impl_name, shape=_fmt_shape(shape), output=oi)
                        if err is not None:
                            row.update(ok=False, message=err)
                        elif checks is None:
                            row.update(ok=False, message=f"no bound defined for op {case.method}")
                        else:
                            metrics = compare(names[oi], out[oi], r).to_dict()
                            b = checks[oi]
                            row.update({k: metrics[k] for k in ("max_abs", "rel_l2", "cosine", "nmse", "numel")})
                            row.update(ok=b.ok, bitwise_equal=b.bitwise_equal, bound_ratio=b.max_ratio,
                                       n_violations=b.n_violations, nan_mismatch=b.nan_mismatch, worst=b.worst,
                                       rule=b.rule, message="" if b.ok else (b.bound_defect or "beyond its bound"),
                                       line=b.line())
                        rows.append(row)
                        if progress is not None:
                            progress(row.get("line") or f"FAIL {names[oi]}: {row.get('message')}")
    return rows
