"""One-shot peer-read all-reduce: every rank reads every peer's copy of the message and sums it itself.

For the small messages of tensor-parallel decode (one token's hidden state is 8 KiB in bf16) a library all-reduce
is dominated by its protocol, not by bytes. Here each rank owns a buffer that all peers can address (symmetric
memory or CUDA IPC, mapped into every process as a tensor), and one kernel launch does the whole collective:

1. copy the local input into the rank's own buffer;
2. announce "my data for call ``e`` is ready" to each peer (a release store of ``e`` into a flag the peer owns)
   and wait until every peer has announced ``e`` too (acquire loads of our own flags);
3. read the same elements from every peer's buffer, sum them in rank order, write the output.

Design points (why it is correct without a second barrier, and inside CUDA graphs):

* Flags hold a monotonically increasing *epoch* (int64, never wraps in practice) rather than 0/1 tokens, so one
  flag write per peer suffices and a fast peer may run ahead: a wait succeeds on ``flag >= epoch``.
* Epochs live in device memory and are advanced by the kernel itself, so a captured graph replays correctly.
* The data area is double-buffered by epoch parity. When a rank writes its buffer for call ``e`` it has already
  passed the barrier of call ``e-1``, so every peer has finished call ``e-2`` — the last reader of that half.
  This needs every program to take part in every call: the grid is fixed per communicator (``epochs.numel()``
  programs; each program loops over its chunks and owns its own flags).
* All ranks add the contributions in the same order (rank 0 first), so every rank holds bit-identical results;
  with two ranks this is also bit-identical to NCCL (``a + b`` rounded once: the fp32 sum of two bf16/fp16 values
  rounded to the input type equals the correctly rounded sum).
* bf16 results are rounded to nearest-even from their bits rather than by a cast, because Triton's CPU
  interpreter truncates fp32→bf16 casts; the GPU result is the same either way.

The same source runs on NVIDIA and AMD GPUs, and under ``TRITON_INTERPRET=1`` with several threads standing in
for ranks (the CPU tests). Memory ordering is the GPU's: a CTA barrier, then the flag write with release
semantics at system scope; acquire on the wait side, then a CTA barrier; peer data are read past the L1 cache
(``.cg``). Buffers are passed as tensors (not raw addresses) so Triton sees their alignment and vectorizes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
FLAG_BYTES = 8  # one int64 epoch per (program, peer)


@triton.jit
def _signal_and_wait(flags, pid, epoch, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Tell program ``pid`` of every peer that our data for ``epoch`` is in place, then wait for theirs.

    ``flags[r]`` is rank r's ``int64 [programs, WORLD]``; slot ``[pid, q]`` holds the last epoch rank q announced
    to program ``pid`` of rank r.
    """
    tl.debug_barrier()  # every thread's writes to our buffer precede the release below
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            tl.atomic_max(flags[peer] + pid * WORLD + RANK, epoch, sem="release", scope="sys")
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            while tl.atomic_add(flags[RANK] + pid * WORLD + peer, 0, sem="acquire", scope="sys") < epoch:
                pass
    tl.debug_barrier()  # no thread reads peer data before the acquire above


@triton.jit
def _round_to_bf16(x):
    """fp32 → bf16, round to nearest even (NaN stays NaN)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _contribution(x_ptr, buffers, half, offs, mask, peer: tl.constexpr, RANK: tl.constexpr, ACC: tl.constexpr):
    if peer == RANK:
        v = tl.load(x_ptr + offs, mask=mask, other=0.0)
    else:  # .cg: straight from the owner's memory, never a stale line of this SM's L1
        v = tl.load(buffers[peer] + half + offs, mask=mask, other=0.0, cache_modifier=".cg")
    return v.to(ACC)


@triton.jit
def one_shot_all_reduce_kernel(x_ptr, out_ptr, buffers, flags, epoch_ptr, n_elements, half_stride,
                               RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                               ACC: tl.constexpr, ROUND_BF16: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    epoch = tl.load(epoch_ptr + pid) + 1
    half = (epoch % 2) * half_stride  # elements: which half of the double buffer this call uses
    for start in range(pid * BLOCK, n_elements, step):
        offs = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)
        mask = offs < n_elements
        tl.store(buffers[RANK] + half + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)

    _signal_and_wait(flags, pid, epoch, RANK, WORLD)

    for start in range(pid * BLOCK, n_elements, step):
        offs = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)
        mask = offs < n_elements
        # start from rank 0's value (not from 0.0) so that -0 + -0 stays -0, as in the library
        acc = _contribution(x_ptr, buffers, half, offs, mask, 0, RANK, ACC)
        for peer in tl.static_range(1, WORLD):
            acc += _contribution(x_ptr, buffers, half, offs, mask, peer, RANK, ACC)
        if ROUND_BF16:
            y = _round_to_bf16(acc)
        else:
            y = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs, y, mask=mask)
    tl.store(epoch_ptr + pid, epoch)


def buffer_bytes(capacity_bytes: int, num_programs: int, world: int) -> tuple[int, int]:
    """``(flag_bytes, total_bytes)`` of one rank's buffer: flags, then two data halves of ``capacity_bytes``."""
    flag_bytes = -(-num_programs * world * FLAG_BYTES // 256) * 256  # keep the data area 256-byte aligned
    return flag_bytes, flag_bytes + 2 * capacity_bytes


def one_shot_all_reduce(x: torch.Tensor, out: torch.Tensor, buffers: tuple[torch.Tensor, ...],
                        flags: tuple[torch.Tensor, ...], epochs: torch.Tensor, rank: int, block: int = 1024,
                        num_warps: int = 4) -> torch.Tensor:
    """Launch the one-shot all-reduce (sum) of ``x`` into ``out`` on this rank.

    Args:
        x, out: contiguous, same shape and dtype (bf16, fp16, fp32 or fp64), at most half a buffer.
        buffers: every rank's data area as seen from this process (peer memory mapped here), in rank order,
            viewed as ``x.dtype``: two halves of equal size, 16-byte aligned.
        flags: every rank's flags, int64 ``[programs · world]``, zeroed on every rank before the first call.
        epochs: int64 ``[programs]`` of this rank (zeroed with the flags); its length is the grid, which must
            be the same for every call of every rank.
        rank: this rank's index in ``[0, world)``.
        block, num_warps: launch geometry (elements per program per loop step, a power of two; warps).
    """
    world = len(buffers)
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"one_shot_all_reduce: dtype {x.dtype} not supported ({SUPPORTED_DTYPES})")
    assert out.dtype == x.dtype and out.shape == x.shape, "out must match x in shape and dtype"
    assert x.is_contiguous() and out.is_contiguous(), "x and out must be contiguous"
    assert len(flags) == world and 0 <= rank < world, "one buffer and one flag array per rank"
    assert all(b.dtype == x.dtype and b.numel() == buffers[0].numel() for b in buffers), \
        "buffers must be views of x.dtype, all the same size"
    half_stride = buffers[0].numel() // 2
    assert x.numel() <= half_stride, f"message of {x.numel()} elements exceeds half a buffer ({half_stride})"
    assert half_stride * x.element_size() % 16 == 0, "the two halves must stay 16-byte aligned"
    assert all(f.dtype == torch.int64 and f.numel() >= epochs.numel() * world for f in flags)
    assert epochs.dtype == torch.int64
    assert block & (block - 1) == 0, "block must be a power of two"
    acc = tl.float64 if x.dtype == torch.float64 else tl.float32
    one_shot_all_reduce_kernel[(epochs.numel(),)](
        x, out, tuple(buffers), tuple(flags), epochs, x.numel(), half_stride,
        RANK=rank, WORLD=world, BLOCK=block, ACC=acc, ROUND_BF16=x.dtype == torch.bfloat16, num_warps=num_warps)
    return out


def reference_all_reduce(parts: list[torch.Tensor]) -> torch.Tensor:
    """What every rank must hold: the rank-ordered sum in fp32 (fp64 for fp64), rounded once to the input type."""
    acc = torch.float64 if parts[0].dtype == torch.float64 else torch.float32
    total = parts[0].to(acc)
    for p in parts[1:]:
        total = total + p.to(acc)
    return total.to(parts[0].dtype)
