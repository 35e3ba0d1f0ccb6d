"""Backend registry: a backend is an ops object (see :class:`dsv4lab.core.model.ops.ReferenceOps`).

:func:`make_ops` builds one from a name of :data:`dsv4lab.engine.BACKENDS` or from an *ops factory* — any callable
``numerics → ops object``. The factory is how tools above the engine run a backend the engine does not know by
name, e.g. the reference with a deliberate bug (:func:`dsv4lab.tools.verify.faults.faulty_backend`), without the engine
importing them.
"""
from __future__ import annotations

from typing import Callable, Union

from dsv4lab.core.errors import ConfigError
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.engine import BACKENDS

OpsFactory = Callable[[Numerics], ReferenceOps]
Backend = Union[str, OpsFactory]


def make_ops(backend: Backend, numerics: Numerics) -> ReferenceOps:
    """Instantiate ``backend``: ``"reference"``, ``"triton"`` or an ops factory called with ``numerics``."""
    if callable(backend):
        return backend(numerics)
    if backend == "reference":
        return ReferenceOps(numerics)
    if backend == "triton":
        from dsv4lab.engine.triton_backend import TritonOps  # imports triton: only when asked for
        return TritonOps(numerics)
    raise ConfigError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "OpsFactory", "Backend", "make_ops"]
