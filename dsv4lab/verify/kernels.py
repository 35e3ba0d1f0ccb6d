"""Kernel level: every registered op × every implementation a backend provides, against the reference.

Each output is judged by the op's error bound (:data:`~dsv4lab.verify.op_bounds.OP_BOUNDS`, derived in
``docs/verification.md``) under the accumulation the implementation uses (:func:`variant_accumulation`); the
compare metrics (max abs, relative L2, cosine) are reported beside the verdict, for reading, not for judging.
"""
from __future__ import annotations

import fnmatch

import torch

from ..model.ops import ReferenceOps
from .compare import compare
from .op_bounds import OP_BOUNDS, check_expectation
from .registry import OPS, implementations
from .stages import accumulation_of, default_accumulation

# Implementations (``backend:variant``) that multiply on FP8 tensor cores on a GPU: Hopper keeps ~14 bits of the
# running sum inside each 128-term block (bounds.BLOCKED["fp8_mma"]). Under the CPU interpreter they run in fp32.
FP8_MMA_VARIANTS = ("*:dot", "*:prefill_fp8*")


def variant_accumulation(ops, impl: str, method: str, inputs: tuple, device: str) -> str:
    """The accumulation model an implementation is judged under (see :func:`~.stages.accumulation_of`)."""
    if torch.device(device).type == "cuda" and any(fnmatch.fnmatchcase(impl, p) for p in FP8_MMA_VARIANTS):
        return "fp8_mma"
    if ":" in impl:  # a variant with a fixed route: the backend's own dispatch rule does not describe it
        return default_accumulation(device)
    return accumulation_of(ops, method, inputs, device)


def _as_tuple(v):
    return v if isinstance(v, tuple) else (v,)


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
                    gen = torch.Generator().manual_seed(seed * 1_000_003 + hash((case.name, si)) % 1_000_003)
                    inputs = case.make(shape, gen, device, case.numerics)
                    ref = _as_tuple(getattr(ref_ops, case.method)(*inputs))
                    try:
                        out = _as_tuple(fn(*inputs))
                        err = None
                    except Exception as e:  # a crashing kernel is a failed check, reported with its message
                        out, err = None, f"{type(e).__name__}: {e}"
                    expects = None
                    if err is None and bound_fn is not None:
                        acc = variant_accumulation(backend, impl_name, case.method, inputs, device)
                        expects = _as_tuple(bound_fn(case.numerics, acc, *inputs))
                    for oi, r in enumerate(ref):
                        name = f"{case.name}[{impl_name}]({_fmt_shape(shape)})" + (f"#{oi}" if len(ref) > 1 else "")
                        row = dict(op=case.name, impl=impl_name, shape=_fmt_shape(shape), output=oi)
                        if err is not None:
                            row.update(ok=False, message=err)
                        elif expects is None:
                            row.update(ok=False, message=f"no bound defined for op {case.method}")
                        else:
                            metrics = compare(name, out[oi], r).to_dict()
                            b = check_expectation(out[oi], r, expects[oi], name)
                            row.update({k: metrics[k] for k in ("max_abs", "rel_l2", "cosine", "nmse", "numel")})
                            row.update(ok=b.ok, bitwise_equal=b.bitwise_equal, bound_ratio=b.max_ratio,
                                       n_violations=b.n_violations, nan_mismatch=b.nan_mismatch, worst=b.worst,
                                       rule=b.rule, message="" if b.ok else (b.bound_defect or "beyond its bound"),
                                       line=b.line())
                        rows.append(row)
                        if progress is not None:
                            progress(row.get("line") or f"FAIL {name}: {row.get('message')}")
    return rows
