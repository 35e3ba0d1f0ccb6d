"""Expert sorting for the grouped MoE GEMM: token slots grouped by expert into padded blocks of ``rows`` rows.

A *slot* is one (token, top-k position) pair, numbered ``t·k + j``. The sorter lays the slots of every owned
expert out contiguously, in slot order, each expert's run padded up to a multiple of ``rows`` (the "sorter rows"
of the paper: 32 → 64 was one of its prefill steps), so a GEMM program takes one block of ``rows`` slots that all
use the same expert and reuses each unpacked weight tile across all of them.

Outputs (all on the device, no host synchronisation):

* ``sorted_slots [max_blocks·rows]`` int32 — the slot id at each sorted row, ``-1`` on padding rows;
* ``block_expert [max_blocks]`` int32 — the local expert of each block, ``-1`` for blocks past the end;
* ``counts [E]`` int32 — slots per local expert;
* ``expert_first_block [E]``, ``expert_blocks [E]`` int32 — each expert's first block and its number of blocks
  (its blocks are contiguous), and ``used_blocks [1]`` int32 — the blocks in use (``Σ expert_blocks``; they are
  blocks ``0 … used_blocks − 1``). The grouped GEMM orders its work by them (see ``fp4_moe_grouped.py``).

``max_blocks = ceil(T·k / rows) + min(E, T·k)`` bounds ``Σ_e ceil(count_e / rows)``, so the grid is known
without reading the counts back. Slots routed to experts this rank does not own (expert parallelism) are left out.

Two passes, one program per expert each: count, then (after a prefix sum of the padded counts) scatter, where a
running ``cumsum`` over the slot-ordered match mask gives each slot its rank — deterministic, no atomics.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass
class SortedRouting:
    """The sorter's result (see the module docstring)."""

    sorted_slots: torch.Tensor
    block_expert: torch.Tensor
    counts: torch.Tensor
    rows: int
    top_k: int
    expert_first_block: torch.Tensor | None = None
    expert_blocks: torch.Tensor | None = None
    used_blocks: torch.Tensor | None = None

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]


@triton.jit
def _count_kernel(idx_ptr, counts_ptr, n_slots, expert_offset, BLOCK: tl.constexpr):
    e = tl.program_id(0)
    total = tl.zeros((BLOCK,), dtype=tl.int32)
    for s0 in range(0, n_slots, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        ids = tl.load(idx_ptr + s, mask=s < n_slots, other=-1)
        total += (ids == e + expert_offset).to(tl.int32)
    tl.store(counts_ptr + e, tl.sum(total, axis=0))


@triton.jit
def _scatter_kernel(idx_ptr, padded_start_ptr, counts_ptr, sorted_ptr, block_expert_ptr, n_slots, expert_offset,
                    ROWS: tl.constexpr, BLOCK: tl.constexpr):
    e = tl.program_id(0)
    start = tl.load(padded_start_ptr + e)
    base = start
    for s0 in range(0, n_slots, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        ids = tl.load(idx_ptr + s, mask=s < n_slots, other=-1)
        hit = (ids == e + expert_offset).to(tl.int32)
        rank = tl.cumsum(hit, axis=0) - hit
        tl.store(sorted_ptr + base + rank, s.to(tl.int32), mask=hit != 0)
        base += tl.sum(hit, axis=0)
    n_blocks = (tl.load(counts_ptr + e) + ROWS - 1) // ROWS
    for b in range(0, n_blocks):
        tl.store(block_expert_ptr + start // ROWS + b, e)


def sort_by_expert(idx: torch.Tensor, n_experts: int, rows: int, expert_offset: int = 0,
                   block: int = 1024) -> SortedRouting:
    """Group the slots of ``idx [T, k]`` (global expert ids) by the local experts ``[offset, offset+E)``.

    Args:
        rows: sorter rows (block height of the grouped GEMM), a power of two >= 16.
        block: slots each program scans per step (launch geometry).
    """
    assert idx.ndim == 2, f"sort_by_expert: idx must be [T, k], got {list(idx.shape)}"
    assert rows >= 16 and rows & (rows - 1) == 0, f"sort_by_expert: rows={rows} must be a power of two >= 16"
    T, k = idx.shape
    n_slots = T * k
    dev = idx.device
    flat = idx.reshape(-1).to(torch.int32).contiguous()
    max_blocks = triton.cdiv(n_slots, rows) + min(n_experts, n_slots)
    sorted_slots = torch.full((max_blocks * rows,), -1, dtype=torch.int32, device=dev)
    block_expert = torch.full((max_blocks,), -1, dtype=torch.int32, device=dev)
    counts = torch.zeros(n_experts, dtype=torch.int32, device=dev)
    if n_slots == 0:
        return _with_block_ranges(SortedRouting(sorted_slots, block_expert, counts, rows, k))
    _count_kernel[(n_experts,)](flat, counts, n_slots, expert_offset, BLOCK=block)
    padded = (counts + rows - 1) // rows * rows
    padded_start = (torch.cumsum(padded, 0) - padded).to(torch.int32)
    _scatter_kernel[(n_experts,)](flat, padded_start, counts, sorted_slots, block_expert, n_slots, expert_offset,
                                  ROWS=rows, BLOCK=block)
    return _with_block_ranges(SortedRouting(sorted_slots, block_expert, counts, rows, k))


def _with_block_ranges(r: SortedRouting) -> SortedRouting:
    """Fill the per-expert block ranges and the used-block count from ``counts`` (device ops, no host sync)."""
    blocks = ((r.counts + r.rows - 1) // r.rows).to(torch.int32)
    r.expert_blocks = blocks
    r.expert_first_block = (torch.cumsum(blocks, 0) - blocks).to(torch.int32)
    r.used_blocks = blocks.sum().reshape(1).to(torch.int32)
    return r


def sort_by_expert_reference(idx: torch.Tensor, n_experts: int, rows: int, expert_offset: int = 0) -> SortedRouting:
    """Plain-torch oracle of :func:`sort_by_expert` (a stable sort of the slots by expert)."""
    T, k = idx.shape
    n_slots = T * k
    flat = idx.reshape(-1).long()
    local = flat - expert_offset
    owned = (local >= 0) & (local < n_experts)
    max_blocks = -(-n_slots // rows) + min(n_experts, n_slots)
    sorted_slots = torch.full((max_blocks * rows,), -1, dtype=torch.int32)
    block_expert = torch.full((max_blocks,), -1, dtype=torch.int32)
    counts = torch.bincount(local[owned].cpu(), minlength=n_experts).to(torch.int32)
    pos = 0
    for e in range(n_experts):
        slots = torch.nonzero(local.cpu() == e).flatten()
        sorted_slots[pos:pos + len(slots)] = slots.to(torch.int32)
        nb = -(-len(slots) // rows)
        block_expert[pos // rows: pos // rows + nb] = e
        pos += nb * rows
    return _with_block_ranges(SortedRouting(sorted_slots, block_expert, counts, rows, k))
