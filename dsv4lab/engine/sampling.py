"""Sampling, the checks a generation request must pass, why a generation stopped, and the trajectory hash."""
from __future__ import annotations

import hashlib
import math
from typing import Sequence

import numpy as np
import torch

from dsv4lab.core.errors import RequestError
from dsv4lab.engine import MAX_TEMPERATURE, SEED_RANGE

FINISH_REASONS = {
    "eos": "end of sequence (the model wrote EOS)",
    "length": "max new tokens reached",
    "context": "context full (prompt + output reached the cache length max_seq_len)",
}
"""Why a generation stops: the keys :func:`finish_reason` returns, with the sentence a command prints."""


def check_generation(prompt_len: int, max_new_tokens, max_seq_len: int, temperature=0.0, top_p=1.0,
                     seed=None) -> None:
    """Raise :class:`~dsv4lab.core.errors.RequestError` naming the first argument of a generation request that is
    out of range: a prompt of at least one token that leaves room in the cache, ``max_new_tokens`` >= 1,
    ``temperature`` in [0, :data:`MAX_TEMPERATURE`], ``top_p`` in (0, 1], ``seed`` in :data:`SEED_RANGE`."""
    if prompt_len < 1:
        raise RequestError("prompt_ids is empty: generation needs at least one prompt token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise RequestError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if prompt_len >= max_seq_len:
        raise RequestError(f"the prompt has {prompt_len} tokens but the cache holds max_seq_len={max_seq_len} "
                           f"positions: at most {max_seq_len - 1} prompt tokens leave room to generate")
    if not _finite_in(temperature, 0.0, MAX_TEMPERATURE):
        raise RequestError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy), "
                           f"got {temperature!r}")
    if not _finite_in(top_p, 0.0, 1.0) or top_p == 0:
        raise RequestError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise RequestError(f"seed must be an integer in [-2**63, 2**64 - 1], got {seed!r}")


def _finite_in(value, lo: float, hi: float) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and lo <= value <= hi)


def finish_reason(output_ids: Sequence[int], prompt_len: int, max_new_tokens: int, max_seq_len: int,
                  eos_id: int | None, stop_at_eos: bool = True) -> str:
    """Why a generation of ``output_ids`` stopped — a key of :data:`FINISH_REASONS`: ``eos`` (the last token is
    EOS), ``length`` (``max_new_tokens`` were generated) or ``context`` (the cache is full before that)."""
    if stop_at_eos and output_ids and output_ids[-1] == eos_id:
        return "eos"
    if len(output_ids) >= max_new_tokens:
        return "length"
    if prompt_len + len(output_ids) >= max_seq_len:
        return "context"
    raise ValueError(f"{len(output_ids)} of {max_new_tokens} tokens, no EOS and room in the cache: the generation "
                     "did not stop by itself")


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
