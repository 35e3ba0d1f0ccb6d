"""Sampling, the checks a generation request must pass, why a generation stopped, and the trajectory hash."""
from __future__ import annotations

import hashlib
import math
from typing import Sequence

import numpy as np
import torch

from dsv4lab.core.errors import RequestError
from dsv4lab.engine import MAX_TEMPERATURE, SEED_RANGE
from dsv4lab.engine.finite import check_rows

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


MIN_TEMPERATURE = 1e-5
"""Below this temperature (and above 0) sampling is greedy. The logits are divided by the temperature in float64,
so no finite logit overflows for any accepted value; the threshold is what a user can tell apart: at 1e-5 a
logit gap of 1e-3 already weighs the runner-up by e^-100, so nothing but an exact tie could be drawn otherwise."""


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None, top_k: int = 0, check: bool = True) -> torch.Tensor:
    """``logits [b, V]`` → token ids ``[b]``: greedy (ties → lowest id) at a temperature below
    :data:`MIN_TEMPERATURE`, else a draw from the tokens kept by ``top_k`` (0 or −1: all) and then ``top_p`` (the
    fewest most likely tokens whose probability reaches it; the most likely token is always kept), computed in log
    space in float64 so that no accepted setting yields NaN. Non-finite logits raise
    :class:`~dsv4lab.core.errors.NonFiniteError` (never a token); ``check=False`` is for a caller that checked the
    model's logits before processing them (a −inf ban is intended there)."""
    if check:
        check_rows(logits)
    if temperature < MIN_TEMPERATURE:
        return logits.argmax(-1)
    logp = torch.log_softmax(logits.double() / temperature, -1)
    if 0 < top_k < logp.shape[-1]:
        kth = logp.topk(top_k, dim=-1).values[..., -1:]
        logp = torch.log_softmax(logp.masked_fill(logp < kth, -math.inf), -1)
    if top_p < 1.0:
        sorted_lp, order = logp.sort(-1, descending=True)
        # log of the probability mass before each token (−inf before the first): kept while it is below top_p
        before = torch.logcumsumexp(sorted_lp, -1).roll(1, -1)
        before[..., 0] = -math.inf
        drop = torch.zeros_like(sorted_lp, dtype=torch.bool).scatter(-1, order, before >= math.log(top_p))
        logp = torch.log_softmax(logp.masked_fill(drop, -math.inf), -1)
    probs = logp.exp()
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def bias_logits(logits: torch.Tensor, logit_bias: dict[int, float] | None = None,
                banned: Sequence[int] = ()) -> torch.Tensor:
    """``logits [..., V]`` with ``logit_bias`` added (token id → bias, OpenAI's ``logit_bias``) and the ``banned``
    ids set to −inf (vLLM's ``min_tokens``: stop tokens are banned until that many tokens are generated). Returns
    the same tensor when there is nothing to apply, else a float copy."""
    if not logit_bias and not banned:
        return logits
    out = logits.float().clone()
    if logit_bias:
        ids = torch.tensor(list(logit_bias), dtype=torch.long, device=out.device)
        out[..., ids] += torch.tensor(list(logit_bias.values()), dtype=out.dtype, device=out.device)
    if banned:
        out[..., torch.tensor(list(banned), dtype=torch.long, device=out.device)] = -math.inf
    return out
