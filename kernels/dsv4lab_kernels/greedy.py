"""The greedy choice of a decode step in one launch: each row's argmax over the vocabulary and the finiteness flag
the engine folds into the ids it reads (reference: ``ReferenceOps.greedy`` = ``dsv4lab.engine.finite.greedy_ids``).

One program per row walks the row's ``V`` logits in blocks, keeping the largest value and the first index that
holds it (a later block replaces it only when strictly larger), the first NaN's index, and whether any value is
NaN or ±Inf. The chosen id is torch's ``argmax``: the first maximal index, and the first NaN where the row holds one
(torch orders NaN above every number); the reported id is the chosen one, or :data:`NON_FINITE` (−1) where the row is
not finite. Comparisons only: the ids are exact, whatever the block size or the GPU.

Inside the decode step's CUDA graph this replaces the four host-launched torch kernels between two replays
(``argmax``, ``isfinite``, ``all``, ``where``) by one launch in the graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .formats import interpreting
from .launch import pdl_args, pdl_prologue

NON_FINITE = -1
"""The id of a row whose logits hold a NaN or ±Inf (``dsv4lab.engine.finite.NON_FINITE``)."""
_NON_FINITE = tl.constexpr(NON_FINITE)  # what the kernel reads: the GPU compiler refuses a plain global (the
#                                         interpreter does not), which the H200 visit at 11a5fe7 hit


@triton.jit
def _greedy_kernel(logits_ptr, ids_ptr, seen_ptr, V, s_row, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * s_row
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.full((), 0, tl.int32)
    nan_i = tl.full((), 0, tl.int32) + V  # V: no NaN seen
    bad = tl.full((), 0, tl.int32)
    for v0 in range(0, V, BLOCK):
        i = v0 + tl.arange(0, BLOCK)
        m = i < V
        v = tl.load(base + i, mask=m, other=float("-inf")).to(tl.float32)
        isnan = (v != v) & m
        nan_i = tl.minimum(nan_i, tl.min(tl.where(isnan, i, V), axis=0))
        vv = tl.where(isnan, float("-inf"), v)
        bad = tl.maximum(bad, tl.max((isnan | (vv == float("inf")) | ((vv == float("-inf")) & m)).to(tl.int32),
                                     axis=0))
        bm = tl.max(vv, axis=0)
        bi = tl.min(tl.where((vv == bm) & m, i, V), axis=0)
        take = bm > best  # strictly: an equal maximum in a later block keeps the earlier index
        best_i = tl.where(take, bi, best_i)
        best = tl.where(take, bm, best)
    ids = tl.where(nan_i < V, nan_i, best_i).to(tl.int64)
    tl.store(ids_ptr + row, ids)
    tl.store(seen_ptr + row, tl.where(bad > 0, _NON_FINITE, ids))


def greedy_ids(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [b, V]`` (fp32, bf16 or fp16) → ``(ids [b], seen [b])`` int64: each row's argmax, and the same ids
    with :data:`NON_FINITE` where the row holds a NaN or ±Inf."""
    if logits.ndim != 2:
        raise ValueError(f"greedy_ids: logits must be [rows, vocab], got {list(logits.shape)}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    b, V = logits.shape
    ids = torch.empty(b, dtype=torch.long, device=logits.device)
    seen = torch.empty_like(ids)
    if b:
        block = min(triton.next_power_of_2(max(V, 1)), 16384 if interpreting() else 4096)
        _greedy_kernel[(b,)](logits, ids, seen, V, logits.stride(0), BLOCK=block, num_warps=8,
                             **pdl_args(logits.device))
    return ids, seen


__all__ = ["NON_FINITE", "greedy_ids"]
