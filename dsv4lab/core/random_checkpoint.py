"""A native-format checkpoint that is generated instead of read: every tensor of a preset's inventory, drawn on a
device from ``(seed, tensor name)`` when the loader asks for it.

It answers the loader's questions exactly as :class:`~dsv4lab.core.checkpoint.Checkpoint` does (``tensors``,
``info``, ``get``, ``get_slice``, ``in``), so ``dsv4lab.load(RandomCheckpoint(get_preset("flash"), seed=0,
device="cuda"))`` builds a full-dims DeepSeek-V4-Flash in its native formats (FP4 experts with E8M0 scales,
FP8 128×128-block projections) with no 160 GB file — what the end-to-end benchmark measures. The recipes are
those ``make-checkpoint`` writes (:func:`dsv4lab.core.checkpoint.random_quantized`,
:func:`~dsv4lab.core.checkpoint.random_tensor`); only the random source differs: a ``torch.Generator`` on the target
device instead of numpy, so the values depend on (seed, name, device type) — a CUDA-generated model is the same
on every CUDA GPU, and not the same as the CPU one. A slice is cut from the whole generated tensor, so every
tensor/expert-parallel split of the same seed holds the same model.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from dsv4lab.core.checkpoint import (TensorInfo, TensorSpec, TensorTable, ValidationReport, expected_tensors, random_quantized,
                         random_tensor)
from dsv4lab.core.config import ModelArgs


class TorchDraws:
    """The random draws of one tensor on ``device`` (see :class:`dsv4lab.core.checkpoint.NumpyDraws`)."""

    def __init__(self, seed: int, name: str, device: torch.device):
        self.device = device
        # a hash of both in the low bits: the CPU generator (mt19937) keeps only 32 bits of its seed
        digest = hashlib.blake2b(f"{seed}\0{name}".encode(), digest_size=8).digest()
        self.g = torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") >> 1)

    def normal(self, shape, std: float) -> torch.Tensor:
        return torch.randn(tuple(shape), generator=self.g, device=self.device, dtype=torch.float32) * std

    def pow2(self, lo: int, hi: int, shape) -> torch.Tensor:
        e = torch.randint(lo, hi, tuple(shape), generator=self.g, device=self.device)
        return torch.ldexp(torch.ones(tuple(shape), device=self.device), e.to(torch.float32))

    def uniform(self, lo: float, hi: float, shape) -> torch.Tensor:
        return torch.rand(tuple(shape), generator=self.g, device=self.device) * (hi - lo) + lo

    def distinct(self, rows: int, n: int, k: int) -> torch.Tensor:
        keys = torch.rand(rows, n, generator=self.g, device=self.device)
        return keys.argsort(dim=1)[:, :k].to(torch.int64)


class RandomCheckpoint(TensorTable):
    """The inventory of ``args`` with random values, generated on ``device`` tensor by tensor.

    Attributes:
        args: the architecture (e.g. ``get_preset("flash")``).
        seed: with the tensor name, the only input of each value.
        path: a display name (``<random flash seed 0 on cuda>``); nothing is on disk.
        tensors: name → :class:`TensorInfo` (dtype code, shape, byte size) for every tensor of the inventory.
    """

    def __init__(self, args: ModelArgs, seed: int = 0, device: str | torch.device = "cpu", name: str | None = None):
        self.args, self.seed, self.device = args, int(seed), torch.device(device)
        self.path = Path(f"<random {name or 'model'} seed {seed} on {self.device.type}>")
        self.problems: list[str] = []
        self._specs: dict[str, TensorSpec] = {s.name: s for s in expected_tensors(args)}
        self.tensors: dict[str, TensorInfo] = {s.name: TensorInfo(s.name, s.dtype, tuple(s.shape), "<generated>", 0,
                                                                  s.nbytes) for s in self._specs.values()}
        self._scales: dict[str, torch.Tensor] = {}  # a quantized weight's scale, made with it, until asked for

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise KeyError(f"{self.path}: {name} is not a tensor of this model's inventory")
        return self.tensors[name]

    def get(self, name: str) -> torch.Tensor:
        """Generate one whole tensor on the device (a weight and its scale come from one draw)."""
        spec = self._specs[self.info(name).name]
        if name in self._scales:
            return self._scales.pop(name)
        base, _, role = name.rpartition(".")
        if spec.dtype in ("F8_E4M3", "I8") and role == "weight":
            w, scale = random_quantized(spec, TorchDraws(self.seed, name, self.device))
            self._scales[base + ".scale"] = scale
            return w
        if role == "scale" and base + ".weight" in self._specs:
            w_spec = self._specs[base + ".weight"]
            return random_quantized(w_spec, TorchDraws(self.seed, w_spec.name, self.device))[1]
        return random_tensor(spec, self.args, TorchDraws(self.seed, name, self.device))

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) ``[start, stop)`` of the whole tensor: every split sees one model."""
        return self.get(name).narrow(dim, start, stop - start).contiguous()

    def validate(self, scan_values: bool = True, progress: bool = False) -> ValidationReport:
        """Nothing to check: the tensors are the inventory by construction."""
        return ValidationReport(self.path, [])

    def close(self) -> None:
        self._scales.clear()
