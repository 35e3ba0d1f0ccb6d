"""RMSNorm parameters (the math lives in :meth:`dsv4lab.core.model.ops.ReferenceOps.rms_norm`)."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Holds ``weight [dim]`` (bf16 in the file, fp32 in the reference); ``ops.rms_norm`` applies it."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.empty(dim, dtype=torch.float32, device="meta"))
