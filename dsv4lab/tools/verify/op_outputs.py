"""What one call of an op outputs: its return value and, for the ops that write state in place, what they write.

Three ops of the decode step write in place, as their fused kernels store where a result belongs: ``kv_norm_rope``
(and ``attention_norms``, which contains it) writes the window KV row into the ring it is given; ``compressor_step`` (and ``compressor_pair``, two of them) advances the compressor's two rings (module
state) and writes the entries it finishes into the compressed cache (and returns nothing). Verification compares
what a call writes, so :data:`IN_PLACE` lists each such op's written state, and:

* :func:`run_op` runs a call on private copies of that state — the caller's tensors and modules are never touched,
  so the reference and an implementation can be run on the same inputs — and returns the outputs to compare
  (the return value, then each written tensor, then each written module attribute);
* :func:`snapshot` copies the module state a call is about to read and write (the stage oracle records it, so a
  replay starts from the state the reference call saw, not from whatever the module holds later);
* :func:`private_arguments` gives a call's arguments with that state replaced by private copies (of the snapshot
  when one is given).
"""
from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from dsv4lab.core.model.ops import ReferenceOps


@dataclass(frozen=True)
class InPlace:
    """The state one op writes: ``tensors`` (argument names; None arguments write nothing), ``module_state``
    (``(argument, attribute)`` pairs of a module argument's state, read and written) and whether the return value
    is an output too (``returns``)."""

    tensors: tuple[str, ...] = ()
    module_state: tuple[tuple[str, str], ...] = ()
    returns: bool = True


IN_PLACE = {
    "kv_norm_rope": InPlace(tensors=("ring",)),
    "attention_norms": InPlace(tensors=("ring",)),  # q_norm's and kv_norm_rope's returns, then the ring
    "compressor_step": InPlace(tensors=("cache",), module_state=(("comp", "kv_ring"), ("comp", "score_ring")),
                               returns=False),
    "compressor_pair": InPlace(tensors=("cache_a", "cache_b"),
                               module_state=(("comp_a", "kv_ring"), ("comp_a", "score_ring"), ("comp_b", "kv_ring"),
                                             ("comp_b", "score_ring")), returns=False),
}
"""op name → the state it writes in place (every other op only returns)."""


def _bind(op: str, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """``args, kwargs`` bound to the reference signature of ``op`` (defaults applied), without ``self``."""
    sig = inspect.signature(getattr(ReferenceOps, op))
    bound = sig.bind(None, *args, **kwargs)
    bound.apply_defaults()
    return bound


def _call_parts(bound: inspect.BoundArguments) -> tuple[tuple, dict]:
    return tuple(bound.args[1:]), dict(bound.kwargs)


def snapshot(op: str, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    """Copies of the module state ``op`` will read and write (``"comp.kv_ring"`` → tensor); empty for other ops."""
    spec = IN_PLACE.get(op)
    if spec is None or not spec.module_state:
        return {}
    a = _bind(op, args, kwargs).arguments
    return {f"{arg}.{attr}": getattr(a[arg], attr).detach().clone() for arg, attr in spec.module_state}


def private_arguments(op: str, args: tuple, kwargs: dict,
                      state: dict[str, torch.Tensor] | None = None) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with every tensor ``op`` writes cloned and every module whose state it writes replaced by
    a shallow copy holding private clones of that state (of ``state``, a :func:`snapshot`, when given)."""
    spec = IN_PLACE.get(op)
    if spec is None:
        return args, kwargs
    bound = _bind(op, args, kwargs)
    a = bound.arguments
    for name in spec.tensors:
        if a[name] is not None:
            a[name] = a[name].clone()
    copies: dict[str, object] = {}
    for arg, attr in spec.module_state:
        if arg not in copies:
            copies[arg] = copy.copy(a[arg])  # the state attributes are plain attributes: the copy's own
        src = state[f"{arg}.{attr}"] if state is not None else getattr(a[arg], attr)
        setattr(copies[arg], attr, src.to(getattr(a[arg], attr).device).clone())
    a.update(copies)
    return _call_parts(bound)


def written(op: str, args: tuple, kwargs: dict, returned) -> tuple:
    """The outputs of a finished call of ``op`` on ``args, kwargs``: the return value (if it is an output), then the
    tensors and module state it wrote (as they are now)."""
    spec = IN_PLACE.get(op)
    if spec is None:
        return returned if isinstance(returned, tuple) else (returned,)
    a = _bind(op, args, kwargs).arguments
    out = (returned if isinstance(returned, tuple) else (returned,)) if spec.returns else ()
    out += tuple(a[n] for n in spec.tensors if a[n] is not None)
    return out + tuple(getattr(a[arg], attr) for arg, attr in spec.module_state)


def run_op(fn: Callable, op: str, args: tuple, kwargs: dict | None = None,
           state: dict[str, torch.Tensor] | None = None) -> tuple:
    """Call ``fn`` (an implementation of ``op``) on private copies of the state ``op`` writes; return its outputs
    (:func:`written`)."""
    kwargs = kwargs or {}
    args, kwargs = private_arguments(op, args, kwargs, state)
    return written(op, args, kwargs, fn(*args, **kwargs))


__all__ = ["IN_PLACE", "InPlace", "run_op", "snapshot", "private_arguments", "written"]
