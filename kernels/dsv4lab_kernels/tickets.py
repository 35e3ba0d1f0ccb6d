"""Ticket counters: a grid's reduction finished by its last program, in one launch, deterministically.

A kernel that splits one output over several programs (split-K of a projection, the column slices of an mHC site)
has each program store its partial result, then take a ticket from a counter of the output tile
(:func:`take_ticket`: a barrier, so that every store of the program is made, then one atomic add that releases
them). The program that draws the last ticket reads every partial back (``cache_modifier=".cg"``: from L2, where
the other programs' stores are) and sums them **in the order of the partials, not of arrival** — so the result does
not depend on which program came last, and a CUDA-graph replay equals the eager launch bit for bit — then resets
the counter to zero for the next launch. No second launch, no atomics in any sum.

The counters live in one zeroed ``int32`` workspace per device (:func:`counters`), shared by every kernel that
uses them: launches on one stream never overlap and each leaves its counters at zero. (Kernels on two streams at
once would need a workspace each.) The workspace is made on the first eager call — the decode step always runs
eagerly before its graph is captured — and grows (eagerly) when a launch needs more counters than it has. A grown
workspace never frees the one before: a CUDA graph captured earlier holds that buffer's address and keeps using it
at every replay, and freed memory handed to another tensor would give those replays non-zero counters (a tile
finished before its partials were stored: garbage or NaN in a prefill or decode step captured before the growth).
The old buffers stay allocated, zeroed by their own last launches (:data:`_RETIRED`: a few KB each).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_WORKSPACE: dict = {}
_RETIRED: list = []  # every workspace a growth replaced: graphs captured before it still launch on them
MIN_COUNTERS = 1 << 12


@triton.jit
def take_ticket(cnt_ptr):
    """Make this program's stores visible and draw its ticket (0, 1, …) from the counter at ``cnt_ptr``."""
    tl.debug_barrier()  # every thread's stores are made before the one thread that adds releases them
    return tl.atomic_add(cnt_ptr, 1, sem="acq_rel")


def counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` zeroed ticket counters on ``device`` (the shared workspace; grown outside graph capture)."""
    key = (device.type, device.index)
    cnt = _WORKSPACE.get(key)
    if cnt is None or cnt.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            have = 0 if cnt is None else cnt.numel()
            raise RuntimeError(f"ticket counters: {n} needed while a CUDA graph is captured, {have} made; run the "
                               "step eagerly once before capturing it")
        if cnt is not None:
            _RETIRED.append(cnt)
        cnt = torch.zeros(max(n, MIN_COUNTERS, 2 * (0 if cnt is None else cnt.numel())), dtype=torch.int32,
                          device=device)
        _WORKSPACE[key] = cnt
    return cnt


def workspaces() -> list[torch.Tensor]:
    """Every ticket workspace made in this process, the current ones and those growth replaced (a check that each
    launch left its counters at zero reads them all)."""
    return list(_WORKSPACE.values()) + list(_RETIRED)


__all__ = ["take_ticket", "counters", "workspaces", "MIN_COUNTERS"]
