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

How: three small Triton kernels, parallel over the slots, deterministic (integer sums, no atomics), no host read:

1. each chunk of ``SUB`` slots counts its slots per local expert (a one-hot ``[SUB, E]`` summed over the slots);
2. per expert, an exclusive scan of those counts over the chunks (the slots of the same expert in earlier chunks)
   and the expert's total;
3. each chunk places its slots: the expert's first row (the exclusive scan of the experts' block counts, which
   every program recomputes from the totals — 256 integers) + the earlier chunks' slots + the earlier slots of
   the same expert within the chunk (a cumulative sum down the one-hot); each program also fills its share of
   ``block_expert``, and the first the per-expert ranges.

One ``torch.full`` clears the padding rows first: four launches in all. The previous form — a stable
``torch.sort`` of the slots and a dozen index ops, :func:`sort_by_expert_torch`, kept for the benchmark's
ablation — measured 140 µs of GPU kernels in 75 launches but 1.21 ms to issue per call at 4,096 tokens on an H200
(``data/results/h200/moe_sort_diag.json``): in an eager prefill chunk the host, not the GPU, was its cost.
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


def _e_pad(n_experts: int) -> int:
    return max(16, triton.next_power_of_2(n_experts))


@triton.jit
def _chunk_counts_kernel(idx_ptr, counts_ptr, n_slots, expert_offset, n_experts,
                         SUB: tl.constexpr, E_PAD: tl.constexpr):
    """``counts[c, e]``: the slots of chunk ``c`` routed to local expert ``e``."""
    c = tl.program_id(0)
    s = c * SUB + tl.arange(0, SUB)
    local = tl.load(idx_ptr + s, mask=s < n_slots, other=0).to(tl.int32) - expert_offset
    owned = (s < n_slots) & (local >= 0) & (local < n_experts)
    e = tl.arange(0, E_PAD)
    onehot = ((local[:, None] == e[None, :]) & owned[:, None]).to(tl.int32)
    tl.store(counts_ptr + c * E_PAD + e, tl.sum(onehot, axis=0))


@triton.jit
def _chunk_offsets_kernel(counts_ptr, totals_ptr, n_chunks, CT: tl.constexpr, EB: tl.constexpr,
                          E_PAD: tl.constexpr):
    """In place: ``counts[c, e]`` becomes the slots of expert ``e`` in chunks before ``c``; ``totals[e]`` the
    expert's slots. One program per ``EB`` experts, ``CT`` chunks per step."""
    e = tl.program_id(0) * EB + tl.arange(0, EB)
    carry = tl.zeros([EB], dtype=tl.int32)
    for c0 in range(0, n_chunks, CT):
        c = c0 + tl.arange(0, CT)
        ptr = counts_ptr + c[:, None] * E_PAD + e[None, :]
        ok = c[:, None] < n_chunks
        n = tl.load(ptr, mask=ok, other=0)
        tl.store(ptr, tl.cumsum(n, axis=0) - n + carry[None, :], mask=ok)
        carry += tl.sum(n, axis=0)
    tl.store(totals_ptr + e, carry)


@triton.jit
def _place_kernel(idx_ptr, before_ptr, totals_ptr, sorted_ptr, block_expert_ptr, first_block_ptr, blocks_ptr,
                  used_ptr, n_slots, expert_offset, n_experts, rows, max_blocks, n_chunks,
                  SUB: tl.constexpr, E_PAD: tl.constexpr, BB: tl.constexpr):
    """Chunk ``c``'s slots to their sorted rows; blocks ``c·BB …`` to their experts; program 0 the ranges."""
    c = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    total = tl.load(totals_ptr + e)  # zero past n_experts: no slot is owned there
    blocks = (total + rows - 1) // rows
    first = tl.cumsum(blocks, axis=0) - blocks
    if c < n_chunks:
        s = c * SUB + tl.arange(0, SUB)
        local = tl.load(idx_ptr + s, mask=s < n_slots, other=0).to(tl.int32) - expert_offset
        owned = (s < n_slots) & (local >= 0) & (local < n_experts)
        hit = (local[:, None] == e[None, :]) & owned[:, None]
        onehot = hit.to(tl.int32)
        rank = tl.cumsum(onehot, axis=0) - onehot  # earlier slots of the same expert in this chunk
        start = first * rows + tl.load(before_ptr + c * E_PAD + e)  # the expert's row of this chunk's first slot
        dest = tl.sum(tl.where(hit, rank + start[None, :], 0), axis=1)
        tl.store(sorted_ptr + dest, s.to(tl.int32), mask=owned)
    b = c * BB + tl.arange(0, BB)
    inside = (b[:, None] >= first[None, :]) & (b[:, None] < (first + blocks)[None, :])
    tl.store(block_expert_ptr + b, tl.sum(tl.where(inside, e[None, :] + 1, 0), axis=1) - 1, mask=b < max_blocks)
    if c == 0:
        tl.store(first_block_ptr + e, first, mask=e < n_experts)
        tl.store(blocks_ptr + e, blocks, mask=e < n_experts)
        tl.store(used_ptr + e * 0, tl.sum(blocks, axis=0), mask=e == 0)


# ============================================================================================ work order
@triton.jit
def expert_work_item(w, n_tiles, block_expert_ptr, first_block_ptr, expert_blocks_ptr):
    """Work item ``w`` (< ``used_blocks`` × ``n_tiles``) of a grouped GEMM over the sorted blocks → (block, N tile,
    local expert). Items are numbered expert by expert (an expert's blocks are contiguous, so ``w // n_tiles`` is
    one of its blocks), then tile by tile, then block by block: programs running together share each weight tile
    (and the expert's rows) through L2."""
    e = tl.load(block_expert_ptr + w // n_tiles)
    first = tl.load(first_block_ptr + e)
    nb = tl.load(expert_blocks_ptr + e)
    local = w - first * n_tiles
    return first + local % nb, local // nb, e


def sort_by_expert(idx: torch.Tensor, n_experts: int, rows: int, expert_offset: int = 0) -> SortedRouting:
    """Group the slots of ``idx [T, k]`` (global expert ids) by the local experts ``[offset, offset+E)``.

    Args:
        rows: sorter rows (block height of the grouped GEMM), a power of two >= 16.
    """
    assert idx.ndim == 2, f"sort_by_expert: idx must be [T, k], got {list(idx.shape)}"
    assert rows >= 16 and rows & (rows - 1) == 0, f"sort_by_expert: rows={rows} must be a power of two >= 16"
    T, k = idx.shape
    n_slots = T * k
    dev = idx.device
    max_blocks = triton.cdiv(n_slots, rows) + min(n_experts, n_slots)
    if n_slots == 0:
        return _with_block_ranges(SortedRouting(torch.full((0,), -1, dtype=torch.int32, device=dev),
                                                torch.full((0,), -1, dtype=torch.int32, device=dev),
                                                torch.zeros(n_experts, dtype=torch.int32, device=dev), rows, k))
    e_pad = _e_pad(n_experts)
    sub = max(16, min(64, 4096 // e_pad))  # the [SUB, E] one-hot: 32 registers a thread at 256 experts
    block_b = 64
    n_chunks = triton.cdiv(n_slots, sub)
    flat = idx.reshape(-1).contiguous()
    i32 = dict(dtype=torch.int32, device=dev)
    before = torch.empty((n_chunks, e_pad), **i32)
    totals = torch.empty(e_pad, **i32)
    sorted_slots = torch.full((max_blocks * rows,), -1, **i32)
    block_expert = torch.empty(max_blocks, **i32)
    first_block, blocks, used = torch.empty(n_experts, **i32), torch.empty(n_experts, **i32), torch.empty(1, **i32)
    _chunk_counts_kernel[(n_chunks,)](flat, before, n_slots, expert_offset, n_experts, SUB=sub, E_PAD=e_pad)
    _chunk_offsets_kernel[(e_pad // 8,)](before, totals, n_chunks, CT=128, EB=8, E_PAD=e_pad)
    _place_kernel[(max(n_chunks, triton.cdiv(max_blocks, block_b)),)](
        flat, before, totals, sorted_slots, block_expert, first_block, blocks, used, n_slots, expert_offset,
        n_experts, rows, max_blocks, n_chunks, SUB=sub, E_PAD=e_pad, BB=block_b)
    return SortedRouting(sorted_slots, block_expert, totals[:n_experts], rows, k, expert_first_block=first_block,
                         expert_blocks=blocks, used_blocks=used)


def sort_by_expert_torch(idx: torch.Tensor, n_experts: int, rows: int, expert_offset: int = 0) -> SortedRouting:
    """The previous device sorter (a stable ``torch.sort`` and index ops; see the module docstring): the same
    outputs as :func:`sort_by_expert`, kept for the benchmark's ablation."""
    T, k = idx.shape
    n_slots = T * k
    dev = idx.device
    max_blocks = triton.cdiv(n_slots, rows) + min(n_experts, n_slots)
    if n_slots == 0:
        return sort_by_expert(idx, n_experts, rows, expert_offset)
    local = idx.reshape(-1).to(torch.int64) - expert_offset
    key = torch.where((local >= 0) & (local < n_experts), local, n_experts)  # other ranks' experts: key E, last
    order = torch.sort(key, stable=True).indices  # slot ids grouped by expert, in slot order within each
    counts = torch.zeros(n_experts + 1, dtype=torch.int64, device=dev).index_add_(0, key, torch.ones_like(key))
    blocks = (counts + rows - 1) // rows
    blocks[n_experts] = 0
    first_block = torch.cumsum(blocks, 0) - blocks
    first_index = torch.cumsum(counts, 0) - counts
    sorted_key = key[order]
    i = torch.arange(n_slots, device=dev)
    dest = first_block[sorted_key] * rows + (i - first_index[sorted_key])
    # other ranks' slots go to a scratch tail (one entry each: no duplicate index), cut off below
    dest = torch.where(sorted_key < n_experts, dest, max_blocks * rows + i)
    sorted_slots = torch.full((max_blocks * rows + n_slots,), -1, dtype=torch.int32, device=dev)
    sorted_slots.scatter_(0, dest, order.to(torch.int32))
    ends = torch.cumsum(blocks[:n_experts], 0)
    b = torch.arange(max_blocks, device=dev)
    block_expert = torch.where(b < ends[-1], torch.searchsorted(ends, b, right=True), -1).to(torch.int32)
    return _with_block_ranges(SortedRouting(sorted_slots[:max_blocks * rows], block_expert,
                                            counts[:n_experts].to(torch.int32), rows, k))


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
