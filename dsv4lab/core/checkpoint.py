"""Native DeepSeek-V4 checkpoints: the expected tensor table, lazy reading, validation and writing.

* :func:`expected_tensors` — every tensor a checkpoint of a given :class:`ModelArgs` holds (spec §2.2), with
  safetensors dtype codes and shapes; no tensor is allocated. For ``flash`` it gives the real index's 69,187
  tensors and 159,609,485,896 bytes.
* :class:`Checkpoint` — opens ``model.safetensors.index.json`` + shards (or one ``model.safetensors``), parses
  the shard headers itself (so truncated or corrupt files are reported, not crashed on) and reads tensors one at
  a time, memory-mapped; :meth:`Checkpoint.validate` lists every problem with tensor, file, expected and found.
  The shard headers are parsed by :mod:`dsv4lab.core.safetensors_format`, the stored values checked by
  :mod:`dsv4lab.core.checkpoint_values`.
* :func:`write_checkpoint` / :func:`make_random_checkpoint` — write the native format deterministically
  (sorted index, fixed shard split, per-tensor seeds), into a temporary folder that is renamed into place only
  when complete, so a failure leaves nothing half-written.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dsv4lab.core import quant
from dsv4lab.core.checkpoint_values import scan_values
from dsv4lab.core.config import ConfigError, ModelArgs, ceil_div
from dsv4lab.core.errors import CheckpointError
from dsv4lab.core.provenance import file_sha256
from dsv4lab.core.resources import require_disk_space
from dsv4lab.core.safetensors_format import DTYPE_SIZE, ShardHeader, TensorInfo, read_safetensors_header
from dsv4lab.core.tokenizer import load_tokenizer

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

TORCH_DTYPE = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
               "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8,
               "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}
DTYPE_CODE = {v: k for k, v in TORCH_DTYPE.items()}


# ============================================================================================ expected table
@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the native format. ``component`` groups tensors for byte accounting (spec §5.1)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    component: str
    block: int | None  # block index (layer, or n_layers + i for mtp.i); None for globals

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZE[self.dtype]

    @property
    def is_scale(self) -> bool:
        return self.name.endswith(".scale")

    @property
    def logical_params(self) -> int:
        """Parameters this tensor stores (packed FP4 bytes hold two; scales count as their own numel)."""
        return self.numel * (2 if self.dtype == "I8" and ".experts." in self.name else 1)


def block_prefix(args: ModelArgs, block: int) -> str:
    return f"layers.{block}." if block < args.n_layers else f"mtp.{block - args.n_layers}."


def _linear(name: str, out_f: int, in_f: int, fmt: str, component: str, block: int | None) -> list[TensorSpec]:
    if fmt == "fp8":
        return [TensorSpec(name + ".weight", "F8_E4M3", (out_f, in_f), component, block),
                TensorSpec(name + ".scale", "F8_E8M0", (ceil_div(out_f, 128), ceil_div(in_f, 128)), component, block)]
    if fmt == "fp4":
        return [TensorSpec(name + ".weight", "I8", (out_f, in_f // 2), component, block),
                TensorSpec(name + ".scale", "F8_E8M0", (out_f, in_f // 32), component, block)]
    return [TensorSpec(name + ".weight", "BF16", (out_f, in_f), component, block)]


def block_tensors(args: ModelArgs, block: int) -> list[TensorSpec]:
    """The tensors of one transformer block (main layer or MTP block), in the file's order."""
    p = block_prefix(args, block)
    d, b = args.dim, block
    dense = args.dtype
    t: list[TensorSpec] = []
    for site in ("attn", "ffn"):
        t += [TensorSpec(f"{p}hc_{site}_fn", "F32", (args.mix_hc, args.hc_dim), "mhc", b),
              TensorSpec(f"{p}hc_{site}_base", "F32", (args.mix_hc,), "mhc", b),
              TensorSpec(f"{p}hc_{site}_scale", "F32", (3,), "mhc", b)]
    t += [TensorSpec(f"{p}attn_norm.weight", "BF16", (d,), "norms", b),
          TensorSpec(f"{p}ffn_norm.weight", "BF16", (d,), "norms", b),
          TensorSpec(f"{p}attn.attn_sink", "F32", (args.n_heads,), "norms", b)]
    t += _linear(f"{p}attn.wq_a", args.q_lora_rank, d, dense, "attention", b)
    t += [TensorSpec(f"{p}attn.q_norm.weight", "BF16", (args.q_lora_rank,), "norms", b)]
    t += _linear(f"{p}attn.wq_b", args.n_heads * args.head_dim, args.q_lora_rank, dense, "attention", b)
    t += _linear(f"{p}attn.wkv", args.head_dim, d, dense, "attention", b)
    t += [TensorSpec(f"{p}attn.kv_norm.weight", "BF16", (args.head_dim,), "norms", b)]
    t += _linear(f"{p}attn.wo_a", args.o_groups * args.o_lora_rank, args.wo_a_in_per_group, dense, "attention", b)
    t += _linear(f"{p}attn.wo_b", d, args.o_groups * args.o_lora_rank, dense, "attention", b)
    ratio = args.compress_ratios[block]
    if ratio > 0:
        coff = 2 if ratio == 4 else 1
        c = args.head_dim
        t += [TensorSpec(f"{p}attn.compressor.ape", "F32", (ratio, coff * c), "compressor", b),
              TensorSpec(f"{p}attn.compressor.wkv.weight", "BF16", (coff * c, d), "compressor", b),
              TensorSpec(f"{p}attn.compressor.wgate.weight", "BF16", (coff * c, d), "compressor", b),
              TensorSpec(f"{p}attn.compressor.norm.weight", "BF16", (c,), "compressor", b)]
    if ratio == 4:
        ic = args.index_head_dim
        t += _linear(f"{p}attn.indexer.wq_b", args.index_n_heads * ic, args.q_lora_rank, dense, "indexer", b)
        t += [TensorSpec(f"{p}attn.indexer.weights_proj.weight", "BF16", (args.index_n_heads, d), "indexer", b),
              TensorSpec(f"{p}attn.indexer.compressor.ape", "F32", (4, 2 * ic), "indexer_compressor", b),
              TensorSpec(f"{p}attn.indexer.compressor.wkv.weight", "BF16", (2 * ic, d), "indexer_compressor", b),
              TensorSpec(f"{p}attn.indexer.compressor.wgate.weight", "BF16", (2 * ic, d), "indexer_compressor", b),
              TensorSpec(f"{p}attn.indexer.compressor.norm.weight", "BF16", (ic,), "indexer_compressor", b)]
    t += [TensorSpec(f"{p}ffn.gate.weight", "BF16", (args.n_routed_experts, d), "router", b)]
    if args.is_hash_layer(block):
        t += [TensorSpec(f"{p}ffn.gate.tid2eid", "I64", (args.vocab_size, args.n_activated_experts), "router", b)]
    else:
        t += [TensorSpec(f"{p}ffn.gate.bias", "F32", (args.n_routed_experts,), "router", b)]
    inter = args.moe_inter_dim
    for s in range(args.n_shared_experts):
        # the real model has one shared expert named plainly "shared_experts"; more get an index
        sp = f"{p}ffn.shared_experts." if args.n_shared_experts == 1 else f"{p}ffn.shared_experts.{s}."
        t += _linear(sp + "w1", inter, d, dense, "shared_expert", b)
        t += _linear(sp + "w2", d, inter, dense, "shared_expert", b)
        t += _linear(sp + "w3", inter, d, dense, "shared_expert", b)
    for e in range(args.n_routed_experts):
        ep = f"{p}ffn.experts.{e}."
        t += _linear(ep + "w1", inter, d, args.expert_dtype, "routed_experts", b)
        t += _linear(ep + "w2", d, inter, args.expert_dtype, "routed_experts", b)
        t += _linear(ep + "w3", inter, d, args.expert_dtype, "routed_experts", b)
    if block >= args.n_layers:
        t += _linear(f"{p}e_proj", d, d, dense, "mtp", b)
        t += _linear(f"{p}h_proj", d, d, dense, "mtp", b)
        t += [TensorSpec(f"{p}enorm.weight", "BF16", (d,), "mtp", b),
              TensorSpec(f"{p}hnorm.weight", "BF16", (d,), "mtp", b),
              TensorSpec(f"{p}norm.weight", "BF16", (d,), "mtp", b),
              TensorSpec(f"{p}hc_head_fn", "F32", (args.hc_mult, args.hc_dim), "mtp", b),
              TensorSpec(f"{p}hc_head_base", "F32", (args.hc_mult,), "mtp", b),
              TensorSpec(f"{p}hc_head_scale", "F32", (1,), "mtp", b)]
    return t


def global_tensors(args: ModelArgs) -> list[TensorSpec]:
    return [TensorSpec("embed.weight", "BF16", (args.vocab_size, args.dim), "embedding", None),
            TensorSpec("head.weight", "BF16", (args.vocab_size, args.dim), "lm_head", None),
            TensorSpec("norm.weight", "BF16", (args.dim,), "final", None),
            TensorSpec("hc_head_fn", "F32", (args.hc_mult, args.hc_dim), "final", None),
            TensorSpec("hc_head_base", "F32", (args.hc_mult,), "final", None),
            TensorSpec("hc_head_scale", "F32", (1,), "final", None)]


def expected_tensors(args: ModelArgs) -> list[TensorSpec]:
    """Every tensor of a native checkpoint for ``args``: globals, then blocks 0..n_layers-1, then MTP blocks."""
    out = global_tensors(args)
    for block in range(args.n_blocks):
        out += block_tensors(args, block)
    return out


@dataclass
class Inventory:
    """Counts and bytes of a tensor table (expected or found)."""

    tensors: int = 0
    total_bytes: int = 0
    by_dtype: dict[str, list[int]] = field(default_factory=dict)  # dtype -> [count, bytes]
    by_component: dict[str, int] = field(default_factory=dict)    # component -> bytes
    logical_params: int = 0
    params_main: int = 0      # weights (scales excluded) of main layers + globals
    params_with_mtp: int = 0  # weights (scales excluded) of everything

    @classmethod
    def of(cls, specs: Iterable[TensorSpec], args: ModelArgs | None = None) -> "Inventory":
        inv = cls()
        for s in specs:
            inv.tensors += 1
            inv.total_bytes += s.nbytes
            c = inv.by_dtype.setdefault(s.dtype, [0, 0])
            c[0] += 1
            c[1] += s.nbytes
            inv.by_component[s.component] = inv.by_component.get(s.component, 0) + s.nbytes
            inv.logical_params += s.logical_params
            if not s.is_scale:
                inv.params_with_mtp += s.logical_params
                if s.block is None or args is None or s.block < args.n_layers:
                    inv.params_main += s.logical_params
        return inv

    def to_dict(self) -> dict:
        return dict(tensors=self.tensors, total_bytes=self.total_bytes,
                    by_dtype={k: dict(count=v[0], bytes=v[1]) for k, v in sorted(self.by_dtype.items())},
                    by_component=dict(sorted(self.by_component.items())), logical_params=self.logical_params,
                    params_main=self.params_main, params_with_mtp=self.params_with_mtp)

    def format(self) -> str:
        lines = [f"tensors      {self.tensors:,}", f"bytes        {self.total_bytes:,}  ({self.total_bytes / 1e9:.3f} GB)",
                 f"parameters   {self.params_main / 1e9:.2f} B main + embed/head, "
                 f"{self.params_with_mtp / 1e9:.2f} B with MTP (scales excluded)", "by dtype:"]
        for k, (n, b) in sorted(self.by_dtype.items()):
            lines.append(f"  {k:<8} {n:>8,} tensors {b:>18,} bytes")
        lines.append("by component:")
        for k, b in sorted(self.by_component.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {k:<20} {b:>18,} bytes")
        return "\n".join(lines)


def inventory(args: ModelArgs) -> Inventory:
    """The expected inventory of ``args`` (allocates no tensor)."""
    return Inventory.of(expected_tensors(args), args)


# ============================================================================================ reading
def _read_index(folder: Path, index: Path) -> tuple[dict[str, str], int]:
    """``(weight_map, total_size)`` of ``model.safetensors.index.json`` (total_size -1 when absent), every shard
    name checked to be a plain file name inside the checkpoint folder."""
    try:
        idx = json.loads(index.read_text())
        weight_map = idx["weight_map"]
        total = (idx.get("metadata") or {}).get("total_size", -1)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(folder, [f"{INDEX_NAME}: unreadable index ({type(err).__name__}: {err})"]) from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(folder, [f"{INDEX_NAME}: weight_map is a JSON {type(weight_map).__name__}, expected an "
                                       "object mapping tensor names to shard files"])
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or Path(shard).name != shard or shard in (".", ".."):
            raise CheckpointError(folder, [f"{INDEX_NAME}: weight_map gives {name} the shard {shard!r}, expected a "
                                           "file name inside the checkpoint folder"])
    if isinstance(total, bool) or not isinstance(total, int):
        raise CheckpointError(folder, [f"{INDEX_NAME}: metadata.total_size is {total!r}, expected an integer"])
    return dict(weight_map), total


class TensorTable:
    """What any checkpoint answers from its ``tensors`` table (name → :class:`TensorInfo`)."""

    tensors: dict[str, TensorInfo]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return sorted(self.tensors)


class Checkpoint(TensorTable):
    """A native checkpoint folder, opened lazily: only headers are read until a tensor is asked for.

    Attributes:
        path: the folder.
        args: its :class:`ModelArgs` (from ``config.json``).
        tensors: name → :class:`TensorInfo` for every tensor found in the shard headers.
        weight_map: name → shard file as the index declares it.
        problems: structural problems found while opening (missing shards, truncation, ...).
    """

    def __init__(self, path: str | Path, args: ModelArgs | None = None):
        self.path = Path(path)
        if not self.path.exists():
            raise CheckpointError(path, [f"{path}: no such file or directory"])
        if not self.path.is_dir():
            raise CheckpointError(path, [f"{path}: not a checkpoint directory (expected a folder with config.json "
                                         f"and {INDEX_NAME} or {SINGLE_NAME})"])
        try:
            self.args = args or ModelArgs.from_json(self.path / "config.json")
        except ConfigError as err:
            raise CheckpointError(path, [str(err)]) from None
        self.problems: list[str] = []
        self.metadata: dict[str, dict] = {}
        self.bad_shards: dict[str, str] = {}  # shard file → why none of its tensors can be read
        index = self.path / INDEX_NAME
        if index.exists():
            self.weight_map, self.index_total_size = _read_index(self.path, index)
            files = sorted(set(self.weight_map.values()))
        elif (self.path / SINGLE_NAME).exists():
            files, self.weight_map, self.index_total_size = [SINGLE_NAME], {}, -1
        else:
            raise CheckpointError(path, [f"{path}: neither {INDEX_NAME} nor {SINGLE_NAME} found"])
        self.files = files
        self.tensors: dict[str, TensorInfo] = {}
        for f in files:
            fp = self.path / f
            shard = read_safetensors_header(fp) if fp.is_file() else ShardHeader(
                problem="shard listed in the index is missing (or not a file)")
            self.metadata[f] = shard.metadata
            if shard.problem is not None:
                self.bad_shards[f] = shard.problem
                takes = sum(1 for v in self.weight_map.values() if v == f)
                self.problems.append(f"{f}: {shard.problem}; " + (
                    f"the {takes} tensor(s) the index maps to it are unavailable" if self.weight_map
                    else "it is the only shard: no tensor is available"))
                continue
            for name, info in shard.tensors.items():
                if name in self.tensors:
                    self.problems.append(f"{name}: present in both {self.tensors[name].file} and {f}")
                self.tensors[name] = info
        if not self.weight_map:
            self.weight_map = {n: i.file for n, i in self.tensors.items()}
        self._handles: dict[str, object] = {}

    def shard_of(self, name: str) -> str | None:
        """The shard file a tensor is in, or where the index says it should be."""
        if name in self.tensors:
            return self.tensors[name].file
        return self.weight_map.get(name) or (SINGLE_NAME if self.files == [SINGLE_NAME] else None)

    # ------------------------------------------------------------------ access
    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            where = f" (the index maps it to {self.weight_map[name]})" if name in self.weight_map else ""
            raise CheckpointError(self.path, [f"{name}: tensor not found in any shard{where}"])
        return self.tensors[name]

    def _handle(self, file: str):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(self.path / file), framework="pt", device="cpu")
            except (OSError, SafetensorError) as err:  # changed on disk since its header was read
                raise CheckpointError(self.path, [f"{file}: cannot be opened ({err})"]) from None
        return self._handles[file]

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor (memory-mapped; only its bytes are touched)."""
        return self._handle(self.info(name).file).get_tensor(name)

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Read rows (dim 0) or columns (dim 1) ``[start, stop)`` of a tensor without reading the rest."""
        sl = self._handle(self.info(name).file).get_slice(name)
        idx = [slice(None)] * len(self.info(name).shape)
        idx[dim] = slice(start, stop)
        return sl[tuple(idx)]

    def raw_bytes(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 memmap (no torch conversion; used for fast scans)."""
        info = self.info(name)
        return np.memmap(self.path / info.file, dtype=np.uint8, mode="r", offset=info.begin, shape=(info.nbytes,))

    def close(self) -> None:
        self._handles.clear()

    # ------------------------------------------------------------------ validation
    def validate(self, scan_values: bool = True, progress: bool = False) -> "ValidationReport":
        """Check every expected tensor's presence, dtype and shape, the index, the tokenizer, and (optionally) every
        stored value (:meth:`scan_values`). Returns a report; nothing is raised. A shard that cannot be read is
        one problem, counting the tensors it takes with it, not one line per tensor."""
        rep = ValidationReport(path=str(self.path))
        rep.problems += self.problems
        expected = expected_tensors(self.args)
        exp_names = {s.name for s in expected}
        for s in expected:
            info = self.tensors.get(s.name)
            if info is None:
                if self.shard_of(s.name) in self.bad_shards:
                    continue  # counted in its shard's problem
                in_index = s.name in self.weight_map
                rep.problems.append(
                    f"{s.name}: missing (expected {s.dtype}{list(s.shape)}"
                    + (f"; the index maps it to {self.weight_map[s.name]} but that shard lacks it)" if in_index
                       else "; not in the index)"))
                continue
            if s.name not in self.weight_map and self.weight_map:
                rep.problems.append(f"{s.name}: in {info.file} but not listed in {INDEX_NAME}")
            elif self.weight_map.get(s.name, info.file) != info.file:
                rep.problems.append(f"{s.name}: index says {self.weight_map[s.name]}, found in {info.file}")
            if info.dtype != s.dtype:
                rep.problems.append(f"{s.name}: dtype {info.dtype} in {info.file}, expected {s.dtype}")
            if tuple(info.shape) != s.shape:
                rep.problems.append(f"{s.name}: shape {list(info.shape)} in {info.file}, expected {list(s.shape)}")
        for name in sorted(set(self.tensors) - exp_names):
            rep.warnings.append(f"{name}: unexpected tensor in {self.tensors[name].file} (ignored)")
        for name in sorted(set(self.weight_map) - set(self.tensors)):
            if name not in exp_names and self.weight_map[name] not in self.bad_shards:
                rep.problems.append(f"{name}: listed in {INDEX_NAME} ({self.weight_map[name]}) but in no shard")
        found_bytes = sum(i.nbytes for i in self.tensors.values())
        if self.index_total_size >= 0 and self.index_total_size != found_bytes and not self.bad_shards:
            rep.warnings.append(f"{INDEX_NAME}: metadata.total_size {self.index_total_size:,} != "
                                f"{found_bytes:,} bytes found in the shards")
        rep.problems += self.tokenizer_problems()
        if scan_values:
            rep.problems += self.scan_values(progress=progress)
        component = {s.name: s.component for s in expected}
        rep.inventory = Inventory.of(
            [TensorSpec(i.name, i.dtype, i.shape, component.get(i.name, "unexpected"), None)
             for i in self.tensors.values()])
        return rep

    def tokenizer_problems(self) -> list[str]:
        """What makes the checkpoint's ``tokenizer.json`` unusable with its model (none when it ships none)."""
        try:
            tok = load_tokenizer(self.path)
        except CheckpointError as err:
            return err.problems
        if tok is None:
            return []
        return tok.problems(self.args.vocab_size, self.args.bos_token_id, self.args.eos_token_id)

    def scan_values(self, progress: bool = False) -> list[str]:
        """Every tensor holding a value it must not (:mod:`dsv4lab.core.checkpoint_values`: NaN or Inf in a floating
        tensor, a NaN or overflowing E8M0 scale, a NaN FP8 byte, an expert id out of range in a hash-routing
        table), each with its count and first index. The shards are read once, in chunks, straight from the file;
        ``progress`` shows a bar over the bytes. A shard whose header is broken is skipped (reported already)."""
        return scan_values(self.path, self.tensors.values(), self.args, progress)


@dataclass
class ValidationReport:
    path: str
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    inventory: Inventory | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_failed(self) -> None:
        if self.problems:
            raise CheckpointError(self.path, self.problems)

    def by_class(self, problems: list[str] | None = None) -> dict[str, list[str]]:
        """``problems`` (default: the report's) grouped by :data:`PROBLEM_CLASSES`, in the order found."""
        out: dict[str, list[str]] = {}
        for pr in self.problems if problems is None else problems:
            body = pr.split(": ", 1)[-1]
            kind = next((k for k, words in PROBLEM_CLASSES if any(w in body or w in pr for w in words)), "other")
            out.setdefault(kind, []).append(pr)
        return out


PROBLEM_CLASSES = (  # (class, words that mark it), first match wins
    ("shard", ("truncated", "header", "bytes after the last tensor", "shard listed in the index", "cannot read",
               "overlaps the previous tensor", "leaves a gap")),
    ("missing", ("missing",)), ("dtype", ("dtype",)), ("shape", ("shape",)),
    ("index", (INDEX_NAME, "present in both")), ("tokenizer", ("tokenizer.json",)),
    ("values", ("non-finite", "scale byte", "FP8 byte", "expert id")),
)
"""How ``dsv4lab inspect`` groups a long list of problems: counts per class and the first few of each."""


def _progress(items, enabled: bool, desc: str):
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency, but progress must never be the reason a scan fails
        return items
    return tqdm(items, desc=desc, unit="tensor", leave=False)


# ============================================================================================ writing
def _shard_plan(specs: list[TensorSpec], n_shards: int) -> list[list[TensorSpec]]:
    """Split the ordered table into ``n_shards`` contiguous runs of about equal bytes."""
    total = sum(s.nbytes for s in specs)
    target = total / n_shards
    shards: list[list[TensorSpec]] = [[]]
    acc = 0
    for s in specs:
        if acc >= target * len(shards) and len(shards) < n_shards:
            shards.append([])
        shards[-1].append(s)
        acc += s.nbytes
    return [sh for sh in shards if sh]


def default_shard_count(total_bytes: int) -> int:
    return max(2, ceil_div(total_bytes, 4 << 30))


def write_checkpoint(out_dir: str | Path, args: ModelArgs, make_tensor: Callable[[TensorSpec], torch.Tensor],
                     *, n_shards: int | None = None, extra_files: Mapping[str, str | Path] | None = None,
                     overwrite: bool = False, progress: bool = False, specs: list[TensorSpec] | None = None,
                     shards: list[list[TensorSpec]] | None = None) -> Path:
    """Write a native checkpoint: ``config.json``, ``model-0000i-of-0000n.safetensors`` and the index.

    ``make_tensor(spec)`` supplies each tensor (checked against the spec's dtype and shape). The disk must have room
    for every byte first; files are written into a temporary sibling folder and renamed into place at the end; on
    any error nothing is left behind.
    ``extra_files`` maps a file name in the checkpoint to a source path to copy (e.g. ``tokenizer.json``).
    ``shards`` fixes which tensors go to which shard file (to keep another checkpoint's sharding when copying
    it); without it the table is split into ``n_shards`` runs of about equal bytes.
    """
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out}: already exists (pass overwrite=True / --overwrite to replace it)")
    if shards is not None:
        plan = [list(sh) for sh in shards if sh]
    else:
        specs = specs if specs is not None else expected_tensors(args)
        n_shards = n_shards or default_shard_count(sum(s.nbytes for s in specs))
        plan = _shard_plan(specs, n_shards)
    require_disk_space(out.parent, sum(s.nbytes for shard in plan for s in shard), f"writing {out.name}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o777 & ~umask)
        (tmp / "config.json").write_text(json.dumps(args.to_hf_config(), indent=2) + "\n")
        weight_map: dict[str, str] = {}
        total = 0
        bar = _progress(range(len(plan)), progress, f"writing {out.name}")
        for i in bar:
            fname = f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
            tensors: dict[str, torch.Tensor] = {}
            for s in plan[i]:
                t = make_tensor(s).contiguous()
                if DTYPE_CODE.get(t.dtype) != s.dtype or tuple(t.shape) != s.shape:
                    raise CheckpointError(out, [f"{s.name}: produced {DTYPE_CODE.get(t.dtype, t.dtype)}"
                                                f"{list(t.shape)}, expected {s.dtype}{list(s.shape)}"])
                tensors[s.name] = t
                weight_map[s.name] = fname
                total += s.nbytes
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            del tensors
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, tmp / name)
        for f in tmp.iterdir():
            os.chmod(f, 0o666 & ~umask)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ------------------------------------------------------------------------------------ random weights
class NumpyDraws:
    """The random draws of one tensor on the CPU (numpy): its value depends on (seed, name) only, not on write
    order. What ``make-checkpoint`` writes from, so ``data/tiny`` regenerates byte for byte."""

    def __init__(self, seed: int, name: str):
        self.rng = np.random.default_rng([seed, zlib.crc32(name.encode())])

    def normal(self, shape, std: float) -> torch.Tensor:
        return torch.from_numpy(self.rng.standard_normal(size=shape, dtype=np.float32) * np.float32(std))

    def pow2(self, lo: int, hi: int, shape) -> torch.Tensor:
        """``2**U{lo..hi-1}`` (fp32)."""
        return torch.from_numpy((2.0 ** self.rng.integers(lo, hi, size=shape)).astype(np.float32))

    def uniform(self, lo: float, hi: float, shape) -> torch.Tensor:
        return torch.from_numpy(self.rng.uniform(lo, hi, size=shape).astype(np.float32))

    def distinct(self, rows: int, n: int, k: int) -> torch.Tensor:
        """Per row, ``k`` distinct values of ``range(n)`` (int64)."""
        keys = self.rng.random(size=(rows, n))
        return torch.from_numpy(np.argsort(keys, axis=1)[:, :k].astype(np.int64))


def random_quantized(spec: TensorSpec, draws) -> tuple[torch.Tensor, torch.Tensor]:
    """A random FP8 (``F8_E4M3``) or FP4 (``I8``) weight and its E8M0 scale, quantized together.

    FP8 weights get a per-128×128-block magnitude of 2**U{-3..3}, FP4 experts a per-32-group magnitude of
    2**U{-4..4}, so the scales exercise a wide exponent range, as real checkpoints do. ``draws``:
    :class:`NumpyDraws` or any object with the same methods (e.g. on a GPU).
    """
    if spec.dtype == "F8_E4M3":
        out_f, in_f = spec.shape
        w = draws.normal((out_f, in_f), in_f ** -0.5)
        mult = draws.pow2(-3, 4, (ceil_div(out_f, 128), ceil_div(in_f, 128))).to(w.device)
        w = w * mult.repeat_interleave(128, 0)[:out_f].repeat_interleave(128, 1)[:, :in_f]
        return quant.fp8_block_quantize(w)
    out_f, in_f = spec.shape[0], spec.shape[1] * 2
    w = draws.normal((out_f, in_f), in_f ** -0.5)
    mult = draws.pow2(-4, 5, (out_f, in_f // 32)).to(w.device)
    return quant.fp4_quantize(w * mult.repeat_interleave(32, 1))


def random_tensor(spec: TensorSpec, args: ModelArgs, draws) -> torch.Tensor:
    """A realistic random value for one unquantized tensor (never zeros)."""
    name, shape = spec.name, spec.shape
    if spec.dtype == "I64":  # tid2eid: k distinct experts per token id
        return draws.distinct(shape[0], args.n_routed_experts, shape[1])
    if name.endswith("norm.weight"):
        return (1.0 + draws.normal(shape, 0.1)).to(torch.bfloat16)
    if name == "embed.weight":
        return draws.normal(shape, 1.0).to(torch.bfloat16)
    if name.endswith("attn_sink"):
        return draws.normal(shape, 1.0)
    if "hc_" in name and name.endswith("_fn"):
        return draws.normal(shape, shape[1] ** -0.5)
    if "hc_" in name and name.endswith("_base"):
        return draws.normal(shape, 0.5)
    if "hc_" in name and name.endswith("_scale"):
        return draws.uniform(0.5, 1.5, shape)
    if name.endswith("ape"):
        return draws.normal(shape, 0.5)
    if name.endswith("gate.bias"):
        return draws.normal(shape, 0.1)
    if spec.dtype == "BF16" and len(shape) == 2:  # head, compressor wkv/wgate, weights_proj, gate.weight
        return draws.normal(shape, shape[1] ** -0.5).to(torch.bfloat16)
    return draws.normal(shape, 1.0).to(TORCH_DTYPE[spec.dtype])


class _RandomSource:
    """Hands out random tensors by spec; a quantized weight's scale is produced with it and kept until asked."""

    def __init__(self, args: ModelArgs, seed: int):
        self.args, self.seed = args, seed
        self._pending: dict[str, torch.Tensor] = {}

    def __call__(self, spec: TensorSpec) -> torch.Tensor:
        if spec.name in self._pending:
            return self._pending.pop(spec.name)
        if spec.name.endswith(".weight") and spec.dtype in ("F8_E4M3", "I8"):
            w, scale = random_quantized(spec, NumpyDraws(self.seed, spec.name))
            self._pending[spec.name[: -len(".weight")] + ".scale"] = scale
            return w
        return random_tensor(spec, self.args, NumpyDraws(self.seed, spec.name))


def make_random_checkpoint(args: ModelArgs, seed: int, out: str | Path, *, n_shards: int | None = None,
                           tokenizer: str | Path | None = None, overwrite: bool = False,
                           progress: bool = False) -> Path:
    """Write a random checkpoint of ``args`` (byte-for-byte reproducible from ``seed``)."""
    extra = {"tokenizer.json": tokenizer} if tokenizer else None
    return write_checkpoint(out, args, _RandomSource(args, seed), n_shards=n_shards, extra_files=extra,
                            overwrite=overwrite, progress=progress)


def write_state_dict(out: str | Path, args: ModelArgs, state: Mapping[str, torch.Tensor], **kw) -> Path:
    """Write native tensors held in memory (e.g. a quantized trained model) as a checkpoint."""
    missing = [s.name for s in expected_tensors(args) if s.name not in state]
    if missing:
        raise CheckpointError(out, [f"{n}: missing from the state dict" for n in missing])
    return write_checkpoint(out, args, lambda s: state[s.name], **kw)


def file_hashes(folder: str | Path) -> dict[str, str]:
    """sha256 of every file in a folder (for reproducibility checks)."""
    return {p.name: file_sha256(p) for p in sorted(Path(folder).iterdir()) if p.is_file()}
