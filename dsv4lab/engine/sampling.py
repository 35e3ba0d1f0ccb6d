"""Sampling and the project's trajectory hash."""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np
import torch


def trajectory_hash(ids: Sequence[int]) -> str:
    """First 16 hex digits of sha256 over the ids as little-endian int32 — the project's trajectory hash."""
    return hashlib.sha256(np.asarray(list(ids), dtype="<i4").tobytes()).hexdigest()[:16]


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """``logits [b, V]`` → token ids ``[b]``: greedy at temperature 0 (ties → lowest id), else nucleus sampling."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = (logits.float() / temperature).softmax(-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the most likely token
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)
