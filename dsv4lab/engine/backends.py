"""Backend registry: a backend is an ops object (see :class:`dsv4lab.model.ops.ReferenceOps`)."""
from __future__ import annotations

from ..model.numerics import Numerics
from ..model.ops import FaultyReferenceOps, ReferenceOps

BACKENDS = ("reference", "triton")


def make_ops(backend: str, numerics: Numerics, fault: str | None = None):
    """Instantiate ``backend``; ``fault`` (reference only) injects one of ``MODEL_FAULTS``."""
    if fault is not None:
        if backend != "reference":
            raise ValueError("model faults are injected into the reference backend only")
        return FaultyReferenceOps(numerics, fault)
    if backend == "reference":
        return ReferenceOps(numerics)
    if backend == "triton":
        from .triton_backend import TritonOps  # imports triton: only when asked for
        return TritonOps(numerics)
    raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
