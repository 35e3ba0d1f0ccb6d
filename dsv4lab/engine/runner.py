"""The model object users hold: ``forward`` over cache slots, ``reset``, ``generate``."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..model.transformer import Transformer
from ..tokenizer import load_tokenizer
from .sampling import check_generation, sample, trajectory_hash


def _as_rows(v, b: int, name: str, device) -> torch.Tensor:
    if v is None:
        raise ValueError(f"{name} is required")
    if isinstance(v, int):
        return torch.full((b,), v, dtype=torch.long, device=device)
    t = torch.as_tensor(v, dtype=torch.long, device=device)
    if t.ndim == 0:
        return t.expand(b).clone()
    if t.shape != (b,):
        raise ValueError(f"{name} must be an int or have shape [{b}], got {list(t.shape)}")
    return t


class ModelRunner:
    """A loaded model with per-sequence caches.

    Attributes:
        args: the :class:`~dsv4lab.config.ModelArgs`.
        ops: the backend (``ops.name``, ``ops.numerics``).
        tokenizer: the checkpoint's tokenizer, or None.
        max_batch: cache slots; each concurrent sequence owns one.
        positions: per slot, the number of tokens its caches hold.
    """

    def __init__(self, model: Transformer, ops, checkpoint: Path | None = None, plan=None, read_bytes=None):
        self.model, self.ops, self.plan = model, ops, plan
        self.args = model.args
        self.checkpoint = checkpoint
        self.read_bytes = read_bytes or {}
        self.tokenizer = load_tokenizer(checkpoint) if checkpoint is not None else None
        self.max_batch = model.max_batch
        self.device = model.embed.weight.device
        self.positions = torch.zeros(self.max_batch, dtype=torch.long)
        self._all_reduce = plan.all_reduce() if plan is not None else None

    @property
    def backend(self) -> str:
        return self.ops.name

    # ------------------------------------------------------------------ state
    def reset(self, slots: Sequence[int] | torch.Tensor | None = None) -> None:
        """Drop the per-sequence state of ``slots`` (all slots if None). A new sequence must start reset."""
        s = None if slots is None else torch.as_tensor(slots, dtype=torch.long, device=self.device)
        self.model.reset(s, self.ops)
        if s is None:
            self.positions.zero_()
        else:
            self.positions[s.cpu()] = 0

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, tokens, start_pos=0, slots=None, lengths=None, trace=None) -> torch.Tensor:
        """Run ``tokens [b, n]`` and return fp32 logits for **every** position ``[b, n, vocab]``.

        ``start_pos``: int or ``[b]`` — absolute position of ``tokens[:, 0]`` per row (0 for a prefill, the
        slot's current length for a continuation/decode). ``slots``: ``[b]`` cache slots (default ``0..b-1``).
        ``lengths``: ``[b]`` valid tokens per row (right padding); padded positions get NaN logits and never
        touch the caches. Each used slot's caches advance by its length.
        """
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, n], got shape {list(tokens.shape)}")
        b, n = tokens.shape
        slots_t = torch.arange(b, device=self.device) if slots is None else _as_rows(slots, b, "slots", self.device)
        start = _as_rows(start_pos, b, "start_pos", self.device)
        lengths_t = torch.full((b,), n, dtype=torch.long, device=self.device) if lengths is None \
            else _as_rows(lengths, b, "lengths", self.device)
        if int(slots_t.max()) >= self.max_batch or int(slots_t.min()) < 0:
            raise ValueError(f"slots must be in [0, {self.max_batch}), got {slots_t.tolist()}")
        if len(set(slots_t.tolist())) != b:
            raise ValueError("each row needs its own cache slot")
        if int((start + lengths_t).max()) > self.args.max_seq_len:
            raise ValueError(f"sequence would exceed max_seq_len={self.args.max_seq_len}")
        if int(lengths_t.max()) > n or int(lengths_t.min()) < 0:
            raise ValueError("lengths must be within [0, n]")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.args.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.args.vocab_size})")
        pos_cpu = self.positions[slots_t.cpu()]
        if not torch.equal(pos_cpu, start.cpu()):
            raise ValueError(f"start_pos {start.tolist()} does not continue the slots' sequences "
                             f"(their lengths are {pos_cpu.tolist()}); reset a slot to start a new sequence")
        logits = self.model(tokens, start, lengths_t, slots_t, self.ops, self._all_reduce, trace)
        pad = torch.arange(n, device=self.device)[None, :] >= lengths_t[:, None]
        if pad.any():
            logits = logits.masked_fill(pad[..., None], float("nan"))
        self.positions[slots_t.cpu()] += lengths_t.cpu()
        return logits.float()

    __call__ = forward

    # ------------------------------------------------------------------ generation
    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, stop_at_eos: bool = True, slot: int = 0,
                 prefill_chunk: int | None = None, on_token: Callable[[int], None] | None = None) -> list[int]:
        """Prefill ``prompt_ids`` (optionally in chunks) into ``slot`` and decode up to ``max_new_tokens``.

        ``on_token(id)`` hears each token as it is chosen (to stream it); why the generation stopped is
        :func:`~dsv4lab.engine.sampling.finish_reason` of the result. An out-of-range argument raises
        :class:`~dsv4lab.errors.RequestError` (:func:`~dsv4lab.engine.sampling.check_generation`)."""
        ids = list(map(int, prompt_ids))
        check_generation(len(ids), max_new_tokens, self.args.max_seq_len, temperature, top_p, seed)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        self.reset([slot])
        chunk = prefill_chunk or len(ids)
        for s in range(0, len(ids), chunk):
            piece = torch.tensor([ids[s:s + chunk]])
            logits = self.forward(piece, start_pos=s, slots=[slot])
        out: list[int] = []
        for _ in range(max_new_tokens):
            nxt = int(sample(logits[:, -1], temperature, top_p, gen)[0])
            out.append(nxt)
            if on_token is not None:
                on_token(nxt)
            if stop_at_eos and nxt == self.args.eos_token_id:
                break
            if len(ids) + len(out) >= self.args.max_seq_len:
                break
            logits = self.forward(torch.tensor([[nxt]]), start_pos=len(ids) + len(out) - 1, slots=[slot])
        return out

    def generate_with_stats(self, prompt_ids, max_new_tokens, **kw) -> dict:
        """:meth:`generate` plus timing: prefill seconds, decode tok/s, the trajectory hash."""
        t0 = time.perf_counter()
        out = self.generate(prompt_ids, max_new_tokens, **kw)
        dt = time.perf_counter() - t0
        return dict(output_ids=out, hash=trajectory_hash(out), seconds=dt)
