"""Non-finite logits are an error, never a token: the cheap check on the fast path, and locating the cause.

``argmax`` of a row holding NaN returns some index, and ``softmax`` of it is NaN, so without a check a model that
overflows (an E8M0 scale too large for bf16, a negative norm epsilon, an absurd routed scaling factor) silently
emits token 0 — exit 0, HTTP 200. Every path that chooses a token checks the row it chooses from:

* **greedy on the device** (:func:`greedy_ids`): one ``isfinite`` reduction over the logits the step already
  produced, folded into the ids the host reads one step behind (a row with a non-finite logit reads
  :data:`NON_FINITE`, −1, which no token id is), so the check costs no transfer and no sync;
* **on the host** (:func:`check_rows`, what :func:`dsv4lab.engine.sampling.sample` calls): the same reduction
  over the rows being sampled.

A hit raises :class:`~dsv4lab.core.errors.NonFiniteError` naming the position. Only then is the position's cause
located (:func:`locate`): the sequence is re-run from its first token, eagerly, in its own cache slot, with the
model's trace hook on, and the first traced output that is non-finite at that position is named (the embedding, a
layer's stage, or the head). That costs one prefill of the sequence, on the failure path only.
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Sequence

import torch

from dsv4lab.core.errors import NonFiniteError

NON_FINITE = -1
"""The id a row with a non-finite logit reads on the host (see :func:`greedy_ids`)."""

_LAYER = re.compile(r"^(layers|mtp)\.(\d+)\.")


def greedy_ids(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [b, vocab]`` → ``(feed, report)``: each row's argmax (the token fed to the next step on the device)
    and the same ids with :data:`NON_FINITE` where the row holds a NaN or ±Inf (what the host reads)."""
    ids = logits.argmax(-1)
    return ids, torch.where(torch.isfinite(logits).all(-1), ids, NON_FINITE)


def check_rows(logits: torch.Tensor, positions: Sequence[int] | None = None) -> None:
    """Raise :class:`NonFiniteError` for the first row of ``logits [b, vocab]`` holding a non-finite value
    (``positions[row]``, when given, is the sequence position those logits follow)."""
    bad = ~torch.isfinite(logits).all(-1)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise non_finite(row, None if positions is None else int(positions[row]))


def non_finite(row: int, position: int | None) -> NonFiniteError:
    """The error for row ``row`` whose logits at ``position`` (None: not known here) are not finite."""
    where = f"at position {position}" if position is not None else f"in batch row {row}"
    return NonFiniteError(f"the model's logits {where} are not finite (NaN or Inf): no token can be chosen",
                          position, row)


def _at_position(t: torch.Tensor, n: int) -> torch.Tensor:
    """The last of ``n`` positions of a traced tensor of one sequence: ``[1, n, ...]``, or ``[n, ...]`` where the
    stage flattens batch and positions (the MoE)."""
    if t.dim() >= 2 and t.shape[0] == 1 and t.shape[1] == n:
        return t[0, -1]
    if t.dim() >= 1 and t.shape[0] == n:
        return t[-1]
    return t


@torch.inference_mode()
def locate(runner, slot: int, tokens: Sequence[int]) -> str:
    """Re-run ``tokens`` (positions ``0 .. len−1``) eagerly in ``slot`` with the trace hook and say where the
    logits of the last position first become non-finite. The slot is reset before and after."""
    n = len(tokens)
    first: list[str] = []

    def trace(key: str, t: torch.Tensor) -> None:
        if not first and torch.is_floating_point(t) and not bool(torch.isfinite(_at_position(t, n)).all()):
            first.append(key)

    runner.reset([slot])
    try:
        logits = runner.forward(torch.tensor([list(tokens)]), 0, slots=[slot], trace=trace, logits="last")
    finally:
        runner.reset([slot])
    if first:
        key = first[0]
        m = _LAYER.match(key)
        if m is None:
            return f"the first non-finite output is {key}"
        kind = "layer" if m.group(1) == "layers" else "MTP block"
        return f"the first non-finite output is {kind} {m.group(2)}'s ({key})"
    if not bool(torch.isfinite(logits).all()):
        return "every traced stage is finite: the head (the final norm and the vocabulary projection) is not"
    return (f"re-run eagerly with a trace, the logits there are finite: the non-finite values came from the "
            f"decode path's step ({runner.decode_path}), not the per-op forward")


def located(runner, slot: int, tokens: Sequence[int], err: NonFiniteError) -> NonFiniteError:
    """``err`` for the sequence ``tokens`` (its last token's logits are the non-finite ones), with the position and
    the stage :func:`locate` finds."""
    position = len(tokens) - 1
    try:
        where = locate(runner, slot, tokens)
    except Exception as trace_err:  # the re-run itself failing must not hide the first error
        where = f"locating it failed ({type(trace_err).__name__}: {str(trace_err).splitlines()[0][:120]})"
    return NonFiniteError(f"the model's logits at position {position} are not finite (NaN or Inf): {where}",
                          position, err.row)


def locating_non_finite(generate):
    """Decorate ``ModelRunner.generate``: a :class:`NonFiniteError` raised while generating is re-raised with the
    position and the stage :func:`locate` finds (the tokens heard so far, after the prompt, are the sequence)."""
    signature = inspect.signature(generate)

    @functools.wraps(generate)
    def wrapper(runner, *args, **kwargs):
        bound = signature.bind(runner, *args, **kwargs)
        bound.apply_defaults()
        heard: list[int] = []
        listener = bound.arguments["on_token"]

        def hear(token: int) -> None:
            heard.append(token)
            if listener is not None:
                listener(token)

        bound.arguments["on_token"] = hear
        try:
            return generate(*bound.args, **bound.kwargs)
        except NonFiniteError as err:
            tokens = [int(t) for t in bound.arguments["prompt_ids"]] + heard
            raise located(runner, int(bound.arguments["slot"]), tokens, err) from None
    return wrapper


__all__ = ["NON_FINITE", "greedy_ids", "check_rows", "non_finite", "locate", "located", "locating_non_finite"]
