"""Deliberate model faults: the reference with one known bug, to show the correctness harness catches it.

Each entry of :data:`MODEL_FAULTS` reproduces a bug class that public ports of DeepSeek-V4 shipped (spec §3.11).
:class:`FaultyReferenceOps` is :class:`~dsv4lab.core.model.ops.ReferenceOps` with that one bug; :func:`faulty_backend`
gives the ops factory the engine accepts in place of a backend name, so a faulted model is loaded with::

    dsv4lab.load(checkpoint, backend=faulty_backend("rope_first_half"))

The faults live here, with the verification tools, not in the model: the engine knows backends by name or by
factory and never imports the tools built on top of it. Stored-weight faults (permuted layouts) are the other
kind; they live in the checkpoint and are catalogued in :mod:`dsv4lab.core.layouts.catalogue`.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch.nn.functional as F

from dsv4lab.core.errors import ConfigError
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.core.model.rope import apply_rope

MODEL_FAULTS = {
    "no_shared_clamp": "shared expert SwiGLU without the swiglu_limit clamp (transformers #46018 class)",
    "rope_first_half": "RoPE applied to the first rope_head_dim dims instead of the last",
    "rope_non_interleaved": "NeoX (rotate-half) RoPE pairing instead of interleaved pairs",
    "compressed_rope_block_end": "compressed-KV RoPE at the block's last position instead of its first (j·r)",
    "stale_compressor_state": "compressor pooling state not reset between sequences",
}
"""Fault name → what the bug does."""


class FaultyReferenceOps(ReferenceOps):
    """The reference with one deliberate bug, for the fault-injection tests of the correctness harness.

    ``fault`` is one of :data:`MODEL_FAULTS`. Each reproduces a bug class public ports shipped (spec §3.11).
    """

    name = "reference+fault"

    def __init__(self, numerics: Numerics, fault: str):
        super().__init__(numerics)
        if fault not in MODEL_FAULTS:
            raise ConfigError(f"unknown model fault {fault!r}; known: {', '.join(MODEL_FAULTS)}")
        self.fault = fault
        self.name = f"reference+{fault}"

    def swiglu(self, gate, up, limit, shared=False):
        if shared and self.fault == "no_shared_clamp":
            return F.silu(gate) * up
        return super().swiglu(gate, up, limit, shared)

    def rope(self, x, cos, sin, inverse=False):
        r = 2 * cos.shape[-1]
        if self.fault == "rope_first_half":  # rotating the first rope-dims instead of the last
            out = x.clone()
            out[..., :r] = apply_rope(x[..., :r], cos, sin, inverse=inverse)
            return out
        if self.fault == "rope_non_interleaved":  # NeoX rotate-half pairing
            out = x.clone()
            out[..., -r:] = apply_rope(x[..., -r:], cos, sin, inverse=inverse, interleaved=False)
            return out
        return super().rope(x, cos, sin, inverse)

    def compressed_rope_position(self, block, ratio):
        if self.fault == "compressed_rope_block_end":  # the block's last token instead of its first
            return block * ratio + ratio - 1
        return super().compressed_rope_position(block, ratio)

    def reset_compressor_state(self, compressor, slots):
        if self.fault == "stale_compressor_state":  # the reference keeps stale buffers between sequences
            return
        super().reset_compressor_state(compressor, slots)


def faulty_backend(fault: str) -> Callable[[Numerics], FaultyReferenceOps]:
    """The ops factory of the reference with ``fault`` (one of :data:`MODEL_FAULTS`), for ``dsv4lab.load(...,
    backend=)`` or :func:`dsv4lab.engine.backends.make_ops`; an unknown name is an error naming the known ones."""
    if fault not in MODEL_FAULTS:
        raise ConfigError(f"unknown model fault {fault!r}; known: {', '.join(MODEL_FAULTS)}")
    return partial(FaultyReferenceOps, fault=fault)


__all__ = ["MODEL_FAULTS", "FaultyReferenceOps", "faulty_backend"]
