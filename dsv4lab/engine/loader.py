"""``dsv4lab.load``: build the model, read the native checkpoint into it, allocate caches, pick a backend.

Loading reads one tensor at a time (memory-mapped), in the checkpoint's own format; nothing is dequantized at
load. Optional layout repairs (:mod:`dsv4lab.core.layouts`) are applied to each tensor as it is read, so a repaired
layout costs nothing on the hot path. Under tensor/expert parallelism each rank reads only its slices.
"""
from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Callable

import torch

from dsv4lab.core.checkpoint import Checkpoint, CheckpointError
from dsv4lab.core.config import ModelArgs
from dsv4lab.core.layouts.repair import RepairSpec
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.transformer import Transformer
from dsv4lab.core.resources import available_cpu_memory_bytes, require_memory
from dsv4lab.engine.backends import Backend, make_ops
from dsv4lab.engine.device import check_device
from dsv4lab.engine.runner import ModelRunner

# Tensors the reference holds in fp32 although the file stores bf16 (spec §2.4: norms are fp32 parameters).
_NORM_RE = re.compile(r"(^|\.)(norm|q_norm|kv_norm|attn_norm|ffn_norm|enorm|hnorm)\.weight$")
_EXPERT_RE = re.compile(r"^(?P<prefix>(layers|mtp)\.\d+\.ffn\.experts\.)(?P<which>w[123])(?P<scale>_scale)?$")

CACHE_DEQUANT_LIMIT = 2 << 30  # memoise dequantized weights for models whose native bytes are below this
VALUE_SCAN_LIMIT = 1 << 30  # load scans every stored value of checkpoints below this (``inspect`` scans any size)
PROGRESS_BYTES = 256 << 20  # load shows a progress bar for checkpoints above this, when stderr is a terminal
DEFAULT_STEP_TOKENS = 8  # tokens one static decode step may carry per sequence: 7 MTP drafts + 1 (the most a ratio-4
# compressor's 8-row state allows a speculative cycle, see dsv4lab.engine.speculative.max_draft_tokens)

log = logging.getLogger("dsv4lab.load")


class ShardPlan:
    """Which slice of each tensor a rank reads (tensor parallel rows/columns, expert-parallel ranges).

    The single-process plan reads everything. :mod:`dsv4lab.engine.parallel` provides plans for ``--tp``/``--ep``.
    """

    tp_size = 1
    n_local_experts: int | None = None
    expert_offset = 0

    def slice_for(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """``(dim, start, stop)`` to read, or None for the whole tensor."""
        return None

    def all_reduce(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return None


def _read(ck: Checkpoint, name: str, plan: ShardPlan, repairs) -> torch.Tensor:
    info = ck.info(name)
    if repairs is not None:
        # a repair may permute rows or columns across the whole tensor: repair first, then slice
        t = repairs.apply(name, ck.get(name), ck)
        sl = plan.slice_for(name, tuple(info.shape))
        return t if sl is None else t.narrow(sl[0], sl[1], sl[2] - sl[1]).contiguous()
    sl = plan.slice_for(name, tuple(info.shape))
    return ck.get(name) if sl is None else ck.get_slice(name, *sl)


def _convert(name: str, t: torch.Tensor) -> torch.Tensor:
    if _NORM_RE.search(name):
        return t.float()
    return t


def load_weights(model: Transformer, ck: Checkpoint, plan: ShardPlan, device, repairs=None,
                 progress: bool = False) -> dict[str, int]:
    """Fill every buffer of ``model`` from ``ck``; returns bytes read per dtype code."""
    read_bytes: dict[str, int] = {}
    buffers = [(n, m, b) for m_name, m in model.named_modules() for b, _ in list(m._buffers.items())
               for n in [f"{m_name}.{b}" if m_name else b] if m._buffers[b] is not None
               and m._buffers[b].device.type == "meta"]
    it = buffers
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(buffers, desc=f"loading {ck.path.name}", unit="tensor", leave=False)
    for full, module, attr in it:
        em = _EXPERT_RE.match(full)
        if em:
            bank = module
            names = [f"{em['prefix']}{e}.{em['which']}.{'scale' if em['scale'] else 'weight'}"
                     for e in range(bank.expert_offset, bank.expert_offset + bank.n_experts)]
            parts = [_read(ck, n, plan, repairs) for n in names]
            t = torch.stack(parts)
            for n in names:
                code = ck.info(n).dtype
                read_bytes[code] = read_bytes.get(code, 0) + parts[0].numel() * parts[0].element_size()
        else:
            if full not in ck:
                raise CheckpointError(ck.path, [f"{full}: missing from the checkpoint"])
            raw = _read(ck, full, plan, repairs)
            code = ck.info(full).dtype
            read_bytes[code] = read_bytes.get(code, 0) + raw.numel() * raw.element_size()  # file bytes, not fp32
            t = _convert(full, raw)
        want = module._buffers[attr]
        if tuple(t.shape) != tuple(want.shape):
            raise CheckpointError(ck.path, [f"{full}: shape {list(t.shape)} read, model expects {list(want.shape)}"])
        if t.dtype != want.dtype:
            if t.element_size() == want.element_size() == 1:
                t = t.view(want.dtype)  # e.g. I8 bytes of packed FP4
            else:
                raise CheckpointError(ck.path, [f"{full}: dtype {t.dtype} read, model expects {want.dtype}"])
        module._buffers[attr] = t.to(device)
    return read_bytes


def open_checkpoint(checkpoint) -> Checkpoint:
    """A checkpoint folder opened lazily, or an object that already answers like one (a :class:`Checkpoint`,
    a :class:`~dsv4lab.core.random_checkpoint.RandomCheckpoint`) as it is."""
    if isinstance(checkpoint, (str, Path)):
        return Checkpoint(checkpoint)
    if all(hasattr(checkpoint, a) for a in ("tensors", "info", "get", "get_slice", "args", "path")):
        return checkpoint
    raise TypeError(f"checkpoint: expected a folder path or an opened checkpoint, got {type(checkpoint).__name__}")


def build_model(args: ModelArgs, plan: ShardPlan | None = None) -> Transformer:
    """The model on the ``meta`` device (no memory): shapes and parameter counts only."""
    plan = plan or ShardPlan()
    return Transformer(args, plan.tp_size, plan.n_local_experts, plan.expert_offset)


def check_memory(args: ModelArgs, weight_bytes: int, max_batch: int, dtype: torch.dtype, device) -> None:
    """Refuse, in one line, a load whose weights (as stored) and caches (:meth:`ModelArgs.cache_bytes`) exceed the
    memory ``device`` has available, before anything is allocated."""
    dev = torch.device(device)
    if dev.type == "cuda":
        available = torch.cuda.mem_get_info(dev)[0]
    elif dev.type == "cpu":
        available = available_cpu_memory_bytes()
    else:
        return
    act = torch.empty((), dtype=dtype).element_size()
    caches = args.cache_bytes(max_batch, act, max(4, act))
    require_memory(weight_bytes + caches, available, str(dev),
                   f"loading the weights ({weight_bytes / 2**30:.2f} GiB) and caches for {max_batch} sequence(s) of "
                   f"{args.max_seq_len:,} positions ({caches / 2**30:.2f} GiB)")


def load(checkpoint: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
         act_quant: bool = True, kv_fp8_sim: bool = True, indexer_fp4_sim: bool = True, backend: Backend = "reference",
         max_batch: int = 4, max_seq_len: int | None = None, repairs=None, plan: ShardPlan | None = None,
         validate: bool = True, progress: bool | None = None, decode_path: str = "auto",
         max_step_tokens: int = DEFAULT_STEP_TOKENS):
    """Load a native checkpoint and return a ready :class:`~dsv4lab.engine.runner.ModelRunner`.

    Args:
        checkpoint: folder with ``config.json``, the safetensors index and shards, or an opened checkpoint
            (e.g. a :class:`~dsv4lab.core.random_checkpoint.RandomCheckpoint`: a full-size model generated on the
            device, no file).
        device: torch device for weights and caches.
        dtype: compute dtype (``torch.bfloat16`` follows the reference's rounding; ``float32``/``float64`` for
            oracles).
        act_quant, kv_fp8_sim, indexer_fp4_sim: the reference's quantization simulations (see
            :class:`~dsv4lab.core.model.numerics.Numerics`).
        backend: ``"reference"``, ``"triton"`` (falls back to the reference per op where no kernel exists), or an
            ops factory (``numerics → ops``; e.g. :func:`dsv4lab.tools.verify.faults.faulty_backend` for a deliberately
            faulted reference).
        max_batch: cache slots (concurrent sequences).
        max_seq_len: positions the caches hold (default: the config's ``max_seq_len``).
        repairs: a layout repair spec (path or :class:`dsv4lab.core.layouts.RepairSpec`) applied while loading.
        plan: a tensor/expert-parallel shard plan (see :mod:`dsv4lab.engine.parallel`).
        validate: check the whole checkpoint first (names, dtypes, shapes, truncation, the tokenizer; below
            :data:`VALUE_SCAN_LIMIT` bytes also every stored value for NaN/Inf and 0xFF scales — above it a warning
            says the scan was skipped and how to run it).
        progress: show progress bars (default: when the checkpoint is above :data:`PROGRESS_BYTES` and stderr
            is a terminal).
        decode_path: how decode steps run — ``"auto"`` (CUDA-graph replay of the static step on a GPU with the
            Triton backend, the eager per-op forward otherwise), ``"graph"``, ``"static"`` or ``"eager"`` (see
            :data:`dsv4lab.engine.runner.DECODE_PATHS`).
        max_step_tokens: the most tokens one static decode step may carry per sequence (a speculative verify step
            carries ``draft_tokens + 1``); the window rings are sized for it (``window_size + max_step_tokens − 1``
            rows, see :mod:`dsv4lab.engine.decode_graph`).
    """
    check_device(device)
    if not isinstance(max_step_tokens, int) or max_step_tokens < 1:
        raise ValueError(f"max_step_tokens must be an integer ≥ 1, got {max_step_tokens!r}")
    ck = open_checkpoint(checkpoint)
    stored = sum(i.nbytes for i in ck.tensors.values())
    if progress is None:
        progress = stored >= PROGRESS_BYTES and sys.stderr.isatty()
    if validate:
        scan = stored < VALUE_SCAN_LIMIT
        ck.validate(scan_values=scan, progress=progress).raise_if_failed()
        if not scan and isinstance(ck, Checkpoint):
            log.warning("%s: %.1f GiB of weights, so loading skipped the scan for NaN/Inf values and 0xFF scales; "
                        "run `dsv4lab inspect %s` to scan every value", ck.path, stored / 2**30, ck.path)
    args = ck.args if max_seq_len is None else ck.args.replace(max_seq_len=max_seq_len)
    plan = plan or ShardPlan()
    if type(plan) is ShardPlan:  # one process holds every weight and every cache: check they fit first
        check_memory(args, stored, max_batch, dtype, device)
    repairs = RepairSpec.load(repairs) if repairs is not None else None
    model = build_model(args, plan)
    read_bytes = load_weights(model, ck, plan, device, repairs, progress)
    numerics = Numerics(dtype, act_quant, kv_fp8_sim, indexer_fp4_sim)
    ops = make_ops(backend, numerics)
    native = sum(read_bytes.values())
    for m in model.modules():
        if hasattr(m, "cache_dequant"):
            m.cache_dequant = native < CACHE_DEQUANT_LIMIT
    model.allocate(max_batch, numerics.act, numerics.acc, device, step_tokens=max_step_tokens)
    runner = ModelRunner(model, ops, checkpoint=ck.path, plan=plan, read_bytes=read_bytes, decode_path=decode_path)
    runner.reset()
    return runner
