"""All-reduce strategies for tensor and expert parallelism: the library collective and a peer-read one.

A strategy is a callable ``t -> sum of t over the group's ranks`` (the result may alias ``t``). The model calls
it at the places its math sums over ranks (after ``wo_b``, the indexer's head sum, the routed-expert combine).

* ``library`` — ``torch.distributed.all_reduce`` (gloo on CPUs, NCCL/RCCL on GPUs).
* ``peer_read`` — one kernel launch per all-reduce: every rank copies its message into a buffer its peers can
  address (torch symmetric memory, no NVLink multicast), signals, and sums everyone's copy itself
  (:mod:`dsv4lab_kernels.allreduce`). Capturable in CUDA graphs. GPUs only.
* ``auto`` — ``peer_read`` inside CUDA graphs where it is available (the decode path), ``library`` for eager
  calls, where the library launch is cheaper (see :class:`SizeSwitchAllReduce`), and on CPUs.

Under ``peer_read`` and ``auto`` messages larger than ``max_peer_read_bytes`` (prefill) take the library path;
``peer_read`` raises an error where the peer-read path is unavailable.

Every rank must make the same choice for the same call; the choice depends on the message size and on whether
a CUDA graph is being captured, which are the same on every rank.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

STRATEGIES = ("library", "peer_read", "auto")
DEFAULT_PEER_READ_BYTES = 256 << 10  # messages up to this size may take the peer-read path

AllReduce = Callable[[torch.Tensor], torch.Tensor]


class LibraryAllReduce:
    """``torch.distributed.all_reduce`` (sum) over ``group`` (None: the default group), in place."""

    name = "library"

    def __init__(self, group=None):
        self.group = group

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        dist.all_reduce(t, group=self.group)
        return t


class PeerReadAllReduce:
    """One-shot peer-read all-reduce over ``group`` on CUDA/ROCm devices, through torch symmetric memory.

    Args:
        group: process group (None: the default group); every rank of it must construct this together.
        device: this rank's GPU.
        capacity_bytes: largest message; the symmetric buffer holds two halves of it plus the flags.
        num_programs: programs per launch (fixed for the life of the object: the protocol needs every program
            in every call).
        block, num_warps: elements per program per loop step, and warps per program. The defaults were the
            fastest of the geometries measured on 2×H200 for 4–256 KiB (``dsv4lab bench collectives``).
    """

    name = "peer_read"

    def __init__(self, group=None, device: torch.device | str | None = None,
                 capacity_bytes: int = DEFAULT_PEER_READ_BYTES, num_programs: int = 16, block: int = 2048,
                 num_warps: int = 8):
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if self.device.type != "cuda":
            raise ValueError(f"the peer-read all-reduce needs GPUs; device {self.device} is not one "
                             "(use the library strategy on CPUs)")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # peer reads only, never NVLink multicast
        from dsv4lab_kernels import allreduce as kernel

        self._kernel = kernel
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.capacity_bytes = -(-capacity_bytes // 256) * 256
        self.num_programs, self.block, self.num_warps = num_programs, block, num_warps
        flag_bytes, total = kernel.buffer_bytes(self.capacity_bytes, num_programs, self.world)
        self.buffer = symm_mem.empty(total, dtype=torch.uint8, device=self.device)
        group_name = self.group.group_name
        enable_symmetric_memory(group_name)
        handle = symm_mem.rendezvous(self.buffer, group_name)
        # every rank's buffer mapped into this process; the tensor may start inside a pooled allocation, at the
        # same offset on every rank
        offset = self.buffer.data_ptr() - int(handle.buffer_ptrs[self.rank])
        peers = [handle.get_buffer(r, (total,), torch.uint8, offset) for r in range(self.world)]
        if peers[self.rank].data_ptr() != self.buffer.data_ptr():
            raise RuntimeError("symmetric memory: this rank's mapped buffer is not the allocated one")
        self._handle = handle  # keeps the peers' mappings alive
        self._flags = tuple(b[:flag_bytes].view(torch.int64) for b in peers)
        self._data = tuple(b[flag_bytes:] for b in peers)
        self._views: dict[torch.dtype, tuple[torch.Tensor, ...]] = {}
        self.epochs = torch.zeros(num_programs, dtype=torch.int64, device=self.device)
        self.buffer.zero_()
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)  # nobody signals a peer before the peer has zeroed its flags

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        x = t.contiguous()
        out = torch.empty_like(x)
        views = self._views.get(x.dtype)
        if views is None:
            views = self._views[x.dtype] = tuple(b.view(x.dtype) for b in self._data)
        self._kernel.one_shot_all_reduce(x.view(-1), out.view(-1), views, self._flags, self.epochs, self.rank,
                                         self.block, self.num_warps)
        return out

    def fits(self, t: torch.Tensor) -> bool:
        return t.dtype in self._kernel.SUPPORTED_DTYPES and t.numel() * t.element_size() <= self.capacity_bytes


class SizeSwitchAllReduce:
    """``small`` for messages it fits (``small.fits(t)``), ``large`` otherwise.

    With ``graphs_only`` the small path is taken only while a CUDA graph is being captured: launched eagerly from
    Python, a Triton kernel costs more host time than NCCL's launch (8 KiB on 2×H200: 53 µs vs 44 µs per call),
    while inside a graph it is 3.5× faster (3.9 µs vs 13.6 µs; ``data/results/h200/collectives.json``). Every
    rank captures the same graphs at the same time, so every rank makes the same choice.
    """

    def __init__(self, small: PeerReadAllReduce, large: AllReduce, graphs_only: bool = False):
        self.small, self.large, self.graphs_only = small, large, graphs_only
        self.name = "auto" if graphs_only else "peer_read"

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.small.fits(t) and (not self.graphs_only or (t.is_cuda and torch.cuda.is_current_stream_capturing())):
            return self.small(t)
        return self.large(t)


class CountingAllReduce:
    """Wraps a strategy and counts its calls and payload bytes (per rank)."""

    def __init__(self, inner: AllReduce):
        self.inner = inner
        self.calls = 0
        self.bytes = 0

    @property
    def name(self) -> str:
        return getattr(self.inner, "name", type(self.inner).__name__)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.bytes += t.numel() * t.element_size()
        return self.inner(t)

    def reset(self) -> None:
        self.calls = self.bytes = 0


def enable_symmetric_memory(group_name: str) -> None:
    """Older torch releases need symmetric memory enabled per group before a rendezvous; newer ones deprecate
    the call (a no-op with a FutureWarning), so it is made quietly."""
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            try:
                symm_mem.enable_symm_mem_for_group(group_name)
            except Exception:  # already enabled for this group
                pass


def peer_read_available(device: torch.device | str) -> bool:
    """Whether this process can run the peer-read strategy on ``device`` (a GPU with symmetric memory)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False
    return all(importlib.util.find_spec(m) is not None for m in ("torch.distributed._symmetric_memory", "triton"))


def make_all_reduce(strategy: str, group=None, device: torch.device | str = "cpu",
                    max_peer_read_bytes: int = DEFAULT_PEER_READ_BYTES) -> AllReduce:
    """The all-reduce callable of ``strategy`` (see :data:`STRATEGIES`) for ``group`` on ``device``.

    Every rank of ``group`` must call this together (the peer-read setup is collective).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown all-reduce strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    library = LibraryAllReduce(group)
    if strategy == "library":
        return library
    if not peer_read_available(device):
        if strategy == "peer_read":
            raise ValueError(f"the peer-read all-reduce needs GPUs with torch symmetric memory and triton; "
                             f"device {device} has none (use --collective library or auto)")
        return library
    try:
        peer = PeerReadAllReduce(group, device, capacity_bytes=max_peer_read_bytes)
    except Exception as err:
        if strategy == "peer_read":
            raise
        print(f"dsv4lab: peer-read all-reduce unavailable ({err}); using the library all-reduce", file=sys.stderr)
        return library
    # messages past the buffer's capacity take the library path; "auto" also leaves eager calls to it
    return SizeSwitchAllReduce(peer, library, graphs_only=strategy == "auto")
