"""Tensor and expert parallelism on torch.distributed, following DeepSeek's own sharding (spec §2.4).

What each rank holds:

* **Tensor parallel** (``tp`` ranks): attention heads — rows of ``wq_b``, ``attn_sink``, the indexer's
  ``wq_b`` and ``weights_proj`` — and o-groups — rows of ``wo_a`` — are split in contiguous ranges; ``wo_b`` is
  split by columns (its input is the concatenation of the groups). FP8 scales cover 128×128 blocks, so a split
  must fall on a block boundary (checked up front; the real model's 512-row heads and 1024-row groups always do).
* **Expert parallel** (``ep`` ranks): routed experts ``[ep_rank·E/ep, (ep_rank+1)·E/ep)``.
* Everything else is replicated: embedding, head, ``wq_a``, ``wkv``, norms, compressors, the indexer's
  compressor, router, shared expert, mHC. (DeepSeek's converter also splits the embedding and head by vocabulary;
  the model here holds them whole, which needs no extra collective for the logits.)

Rank layout for a world of ``W`` processes (``tp`` and ``ep`` divide ``W``, ``W ≤ tp·ep``):
``tp_rank = rank % tp`` with TP groups of consecutive ranks; ``ep_rank = rank // (W/ep)`` with EP groups of ranks
``W/ep`` apart. ``--tp N --ep N`` on N ranks is DeepSeek's scheme (both over the same ranks); ``--tp 2 --ep 2``
on 4 ranks is a 2×2 mesh.

Where the math sums over ranks (all in the reference's ``calc`` precision, before any rounding, so a split run
rounds exactly like one process and generates the same tokens): after ``wo_b`` and in the indexer's head sum
(TP group), after the routed-expert combine (EP group). Per decode step and layer that is 1 (+1 in CSA layers)
TP all-reduce and 1 EP all-reduce; :meth:`ParallelPlan.collectives_per_token` lists them, and the counters of
:class:`SiteAllReduce` count what actually ran.

Entry points: :func:`load_parallel` (under ``torchrun``; used by ``dsv4lab generate --tp/--ep``) and
:func:`run_parallel` (spawns ranks with ``torch.multiprocessing``, for tests and notebooks).
"""
from __future__ import annotations

import atexit
import datetime
import os
import pickle
import re
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv4lab.engine.collectives import DEFAULT_PEER_READ_BYTES, CountingAllReduce, make_all_reduce
from dsv4lab.core.config import ModelArgs
from dsv4lab.engine.loader import ShardPlan, load, open_checkpoint
from dsv4lab.core.errors import ParallelError

FP8_BLOCK = 128

# (pattern, dim): the tensors tensor parallelism splits, and along which dimension
_TP_SPLITS: list[tuple[re.Pattern, int]] = [
    (re.compile(r"\.attn\.wq_b\.(weight|scale)$"), 0),
    (re.compile(r"\.attn\.wo_a\.(weight|scale)$"), 0),
    (re.compile(r"\.attn\.attn_sink$"), 0),
    (re.compile(r"\.attn\.indexer\.wq_b\.(weight|scale)$"), 0),
    (re.compile(r"\.attn\.indexer\.weights_proj\.(weight|scale)$"), 0),
    (re.compile(r"\.attn\.wo_b\.(weight|scale)$"), 1),
]
_EXPERT = re.compile(r"\.ffn\.experts\.(\d+)\.")


# ============================================================================================ layout
@dataclass(frozen=True)
class Layout:
    """Which rank does what: ``world`` processes, attention split ``tp`` ways, experts ``ep`` ways."""

    world: int
    rank: int
    tp: int = 1
    ep: int = 1

    def __post_init__(self):
        if self.tp < 1 or self.ep < 1:
            raise ParallelError(f"--tp {self.tp} --ep {self.ep}: both must be >= 1")
        if self.world % self.tp or self.world % self.ep:
            raise ParallelError(f"--tp {self.tp} and --ep {self.ep} must both divide the number of ranks "
                                f"({self.world}); launch with torchrun --nproc-per-node "
                                f"{max(self.tp, self.ep)} (or {self.tp * self.ep} for a tp×ep mesh)")
        if self.world > self.tp * self.ep:
            raise ParallelError(f"{self.world} ranks for --tp {self.tp} --ep {self.ep}: some ranks would only "
                                f"repeat others' work; use at most tp·ep = {self.tp * self.ep} ranks")
        if not 0 <= self.rank < self.world:
            raise ParallelError(f"rank {self.rank} outside [0, {self.world})")

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def ep_rank(self) -> int:
        return self.rank // (self.world // self.ep)

    def tp_groups(self) -> list[list[int]]:
        """Every TP group (ranks that together hold all heads), in creation order."""
        return [list(range(s, s + self.tp)) for s in range(0, self.world, self.tp)]

    def ep_groups(self) -> list[list[int]]:
        """Every EP group (ranks that together hold all routed experts), in creation order."""
        stride = self.world // self.ep
        return [list(range(s, self.world, stride)) for s in range(stride)]


# ============================================================================================ per-site reduce
class SiteAllReduce:
    """The model's cross-rank sums by site: ``attention`` over the TP group (``wo_b``, indexer scores) and
    ``moe`` over the EP group (routed-expert combine). A site is None where its group is this rank alone.

    :class:`dsv4lab.core.model.block.Block` picks the two attributes; each is counted (calls and payload bytes).
    """

    def __init__(self, attention=None, moe=None):
        self.attention = CountingAllReduce(attention) if attention is not None else None
        self.moe = CountingAllReduce(moe) if moe is not None else None

    def counts(self) -> dict[str, dict[str, int]]:
        return {site: {"calls": c.calls, "bytes": c.bytes, "strategy": c.name}
                for site, c in (("attention", self.attention), ("moe", self.moe)) if c is not None}

    def reset_counts(self) -> None:
        for c in (self.attention, self.moe):
            if c is not None:
                c.reset()


# ============================================================================================ shard plan
class ParallelPlan(ShardPlan):
    """The slices one rank reads (see the module docstring) and its cross-rank sums.

    Args:
        args: the model's architecture.
        layout: this rank's place.
        shapes: ``{tensor name: shape}`` of the checkpoint (only names are matched; nothing is read).
        reducer: the :class:`SiteAllReduce` this rank's forward uses (None: build only, e.g. to inspect slices).

    Raises:
        ParallelError: the split does not divide the heads/groups/experts, or cuts an FP8 scale block.
    """

    def __init__(self, args: ModelArgs, layout: Layout, shapes: Mapping[str, tuple[int, ...]],
                 reducer: SiteAllReduce | None = None):
        self.args, self.layout, self.reducer = args, layout, reducer
        check_split(args, layout.tp, layout.ep)
        E = args.n_routed_experts
        self.tp_size = layout.tp
        self.n_local_experts = E // layout.ep if layout.ep > 1 else None
        self.expert_offset = layout.ep_rank * (E // layout.ep)
        self._slices: dict[str, tuple[int, int, int]] = {}
        problems: list[str] = []
        for name, shape in shapes.items():
            try:
                sl = self._tp_slice(name, tuple(shape), shapes)
            except ParallelError as err:
                if str(err) not in problems:  # the same problem repeats in every layer
                    problems.append(str(err))
                continue
            if sl is not None:
                self._slices[name] = sl
        if problems:
            raise ParallelError(f"--tp {layout.tp} cannot split this checkpoint (in every layer): "
                                + "; ".join(problems))
        self.reads: dict[str, tuple[int, int, int] | None] = {}

    # ---------------------------------------------------------------- slicing
    def _tp_slice(self, name: str, shape: tuple[int, ...], shapes) -> tuple[int, int, int] | None:
        tp, r = self.layout.tp, self.layout.tp_rank
        if tp == 1:
            return None
        dim = next((d for pat, d in _TP_SPLITS if pat.search(name)), None)
        if dim is None:
            return None
        if name.endswith(".scale"):  # FP8 block scales: the weight's split, in 128-blocks
            weight = name[: -len("scale")] + "weight"
            length = shapes[weight][dim]
            start, stop = _even_range(length, tp, r, weight, dim)
            if (stop - start) % FP8_BLOCK:  # some rank boundary falls inside a scale block
                raise ParallelError(
                    f"{_kind(weight)}: {length} {'rows' if dim == 0 else 'columns'} split {tp} ways is "
                    f"{stop - start} per rank, which cuts its {FP8_BLOCK}-wide FP8 scale blocks")
            return dim, start // FP8_BLOCK, stop // FP8_BLOCK
        start, stop = _even_range(shape[dim], tp, r, name, dim)
        return dim, start, stop

    def slice_for(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        sl = self._slices.get(name)
        self.reads[name] = sl
        return sl

    def all_reduce(self):
        return self.reducer

    def owns_expert(self, name: str) -> bool | None:
        """Whether this rank holds the routed expert tensor ``name`` (None: not an expert tensor)."""
        m = _EXPERT.search(name)
        if m is None:
            return None
        e = int(m.group(1))
        return self.n_local_experts is None or self.expert_offset <= e < self.expert_offset + self.n_local_experts

    # ---------------------------------------------------------------- reports
    def load_report(self, ck) -> dict[str, Any]:
        """Bytes this rank read from the checkpoint, split into sharded and replicated (every rank reads those),
        by file dtype; ``checkpoint_bytes`` is the whole checkpoint's size for comparison."""
        sharded = replicated = 0
        by_dtype: dict[str, int] = {}
        for name, sl in self.reads.items():
            info = ck.info(name)
            n = info.nbytes if sl is None else info.nbytes // info.shape[sl[0]] * (sl[2] - sl[1])
            by_dtype[info.dtype] = by_dtype.get(info.dtype, 0) + n
            if sl is not None or (self.layout.ep > 1 and _EXPERT.search(name)):
                sharded += n
            else:
                replicated += n
        L = self.layout
        return dict(rank=L.rank, world=L.world, tp=L.tp, ep=L.ep, tp_rank=L.tp_rank, ep_rank=L.ep_rank,
                    experts=[self.expert_offset, self.expert_offset + (self.n_local_experts or
                                                                     self.args.n_routed_experts)],
                    loaded_bytes=sharded + replicated, sharded_bytes=sharded, replicated_bytes=replicated,
                    by_dtype=by_dtype, checkpoint_bytes=sum(i.nbytes for i in ck.tensors.values()))

    def collectives_per_token(self) -> dict[str, Any]:
        """All-reduces one decode step (one token per sequence) issues, per layer and in total, by site."""
        a, L = self.args, self.layout
        per_layer = []
        for i in range(a.n_layers):
            csa = a.compress_ratios[i] == 4
            attn = (1 + int(csa)) if L.tp > 1 else 0
            per_layer.append({"layer": i, "attention": attn, "moe": 1 if L.ep > 1 else 0})
        attn = sum(p["attention"] for p in per_layer)
        moe = sum(p["moe"] for p in per_layer)
        return {"per_layer": per_layer, "attention": attn, "moe": moe, "total": attn + moe}


def _kind(name: str) -> str:
    """``layers.3.attn.wo_a.weight`` → ``attn.wo_a.weight`` (the same tensor in every block)."""
    return re.sub(r"^(layers|mtp)\.\d+\.", "", name)


def _even_range(length: int, parts: int, index: int, name: str, dim: int) -> tuple[int, int]:
    if length % parts:
        raise ParallelError(f"{_kind(name)}: {length} {'rows' if dim == 0 else 'columns'} do not split into "
                            f"{parts} equal parts")
    n = length // parts
    return index * n, (index + 1) * n


def check_split(args: ModelArgs, tp: int, ep: int) -> None:
    """Raise :class:`ParallelError` if ``tp`` does not divide the heads/groups or ``ep`` the experts."""
    bad = [f"{field}={getattr(args, field)}" for field in ("n_heads", "o_groups", "index_n_heads")
           if getattr(args, field) % tp]
    if bad:
        raise ParallelError(f"--tp {tp} must divide {', '.join(bad)}")
    if args.n_routed_experts % ep:
        raise ParallelError(f"--ep {ep} must divide n_routed_experts={args.n_routed_experts}")


# ============================================================================================ process groups
def init_distributed(device: str | torch.device | None = None, timeout_s: float = 600.0) -> tuple[int, int,
                                                                                                   torch.device]:
    """Join the process group the launcher describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR/PORT``, as set by
    ``torchrun``): NCCL/RCCL on GPUs, gloo on CPUs. Returns ``(rank, world_size, device)``."""
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ParallelError("--tp/--ep need one process per rank: launch with "
                                "`torchrun --nproc-per-node N -m dsv4lab ...` (or dsv4lab.engine.parallel.run_parallel)")
        want_cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
        if want_cuda:
            local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
            if local >= torch.cuda.device_count():
                raise ParallelError(f"local rank {local} but only {torch.cuda.device_count()} GPUs are visible")
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if want_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
        atexit.register(_shutdown)
    backend = dist.get_backend()
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), dev


def _shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _my_group(groups: list[list[int]], rank: int, world: int):
    """Create every group (all ranks must, in the same order) and return this rank's; None for groups of one."""
    if len(groups[0]) == 1:
        return None
    mine = None
    for ranks in groups:
        g = dist.group.WORLD if len(ranks) == world else dist.new_group(ranks)
        if rank in ranks:
            mine = g
    return mine


def make_site_reducer(layout: Layout, device: torch.device, collective: str = "library",
                      max_peer_read_bytes: int = DEFAULT_PEER_READ_BYTES) -> SiteAllReduce:
    """Create the TP and EP groups and this rank's all-reduce for each site (collective: every rank calls it)."""
    tp_group = _my_group(layout.tp_groups(), layout.rank, layout.world)
    ep_group = _my_group(layout.ep_groups(), layout.rank, layout.world)
    attn = make_all_reduce(collective, tp_group, device, max_peer_read_bytes) if tp_group is not None else None
    if ep_group is None:
        moe = None
    elif layout.tp_groups() == layout.ep_groups():
        moe = attn  # the same ranks: one buffer and one group serve both sites
    else:
        moe = make_all_reduce(collective, ep_group, device, max_peer_read_bytes)
    return SiteAllReduce(attn, moe)


# ============================================================================================ loading
def load_parallel(checkpoint: str | Path, tp: int = 1, ep: int = 1, dtype: torch.dtype = torch.bfloat16,
                  backend: str = "reference", collective: str = "auto", device: str | torch.device | None = None,
                  max_batch: int = 1, verbose: bool = True, **load_kw):
    """Load this rank's shard of ``checkpoint`` and return ``(runner, rank)``.

    Call on every rank (``torchrun --nproc-per-node N``); the process group is created if needed. ``collective``
    is the all-reduce strategy (:data:`dsv4lab.engine.collectives.STRATEGIES`). With ``verbose`` each rank prints what it
    loaded to stderr, and rank 0 the all-reduces per decode token. Other keywords go to :func:`dsv4lab.load`.
    The runner's ``plan`` (a :class:`ParallelPlan`) has ``load_report``, ``collectives_per_token`` and the
    counting ``reducer``.
    """
    ck = open_checkpoint(checkpoint)
    check_split(ck.args, tp, ep)  # before any process group exists: a bad request fails fast on every rank
    rank, world, dev = init_distributed(device)
    layout = Layout(world, rank, tp, ep)
    shapes = {name: tuple(info.shape) for name, info in ck.tensors.items()}
    plan = ParallelPlan(ck.args, layout, shapes)  # validates the slices before any group or buffer exists
    plan.reducer = reducer = make_site_reducer(layout, dev, collective)
    runner = load(ck, device=dev, dtype=dtype, backend=backend, max_batch=max_batch, plan=plan, **load_kw)
    if verbose:
        rep = plan.load_report(ck)
        print(f"[rank {rank}/{world}] tp {layout.tp_rank}/{tp} ep {layout.ep_rank}/{ep} experts "
              f"{rep['experts'][0]}..{rep['experts'][1] - 1}: loaded {rep['loaded_bytes']:,} B "
              f"({rep['sharded_bytes']:,} sharded + {rep['replicated_bytes']:,} replicated) of "
              f"{rep['checkpoint_bytes']:,}", file=sys.stderr, flush=True)
        if rank == 0:
            c = plan.collectives_per_token()
            strategies = {site: v["strategy"] for site, v in reducer.counts().items()}
            print(f"[rank 0] all-reduces per decode token: {c['total']} ({c['attention']} attention over "
                  f"{tp} ranks, {c['moe']} MoE over {ep} ranks, {ck.args.n_layers} layers); strategy "
                  f"{strategies or 'none'}", file=sys.stderr, flush=True)
    return runner, rank


# ============================================================================================ spawning
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, fn: Callable, world: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # ranks share the host's cores
    result = fn(rank, world, *args)
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    _shutdown()


def run_parallel(fn: Callable, world: int, *args) -> list:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes (torch.multiprocessing, spawn) with the
    torchrun environment set, and return the ranks' return values in rank order. ``fn`` must be importable
    (a module-level function); a rank's exception is re-raised here with its traceback."""
    with tempfile.TemporaryDirectory(prefix="dsv4lab-ranks-") as out_dir:
        mp.start_processes(_spawned, args=(fn, world, _free_port(), out_dir, args), nprocs=world, join=True,
                           start_method="spawn")
        return [pickle.loads(Path(out_dir, f"rank{r}.pkl").read_bytes()) for r in range(world)]
