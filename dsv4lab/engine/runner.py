"""The model object users hold: ``prefill``, ``forward`` over cache slots, ``reset``, ``generate``.

Decoding (one token per row, no trace) goes through the engine's decode path (:attr:`ModelRunner.decode_path`):
on a GPU with the Triton backend, the captured static step (:mod:`dsv4lab.engine.decode_graph`, graph replay per
batch tier, batches padded to the tier); elsewhere the eager per-op forward (the reference's structure, and the
path a trace needs). ``forward`` (the server's prefills, the notebooks) and the engine's one step-late loop
(:class:`~dsv4lab.engine.batch_loop.BatchLoop`: each step's ids read on the host one step behind the GPU — the
server's scheduler, and ``decode_greedy`` for greedy ``generate`` and the benchmarks) take it;
speculative decoding's cycles run on the same step with ``k+1`` tokens per sequence (:attr:`ModelRunner.decoder`,
:mod:`dsv4lab.engine.speculative_step`). Prompts go through :meth:`ModelRunner.prefill`, the one prefill loop.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from dsv4lab.core.model.transformer import Transformer
from dsv4lab.core.tokenizer import load_tokenizer
from dsv4lab.engine.batch_loop import BatchLoop
from dsv4lab.engine.decode_graph import Decoder, check_slots
from dsv4lab.engine.decode_groups import group_projections
from dsv4lab.engine.finite import NON_FINITE, check_rows, locating_non_finite, non_finite
from dsv4lab.engine.prefill_step import Prefiller, resolve_prefill_path
from dsv4lab.engine.sampling import check_generation, sample, trajectory_hash
from dsv4lab.engine.speculative import check_speculative, generate_speculative
from dsv4lab.engine.warmup import WarmupReport, warm_up

log = logging.getLogger("dsv4lab.runner")

DECODE_PATHS = {
    "auto": "graph on a GPU with the Triton backend, eager otherwise",
    "graph": "the static decode step, CUDA-graph replayed per batch tier (GPU, sync-free backend)",
    "static": "the static decode step run eagerly (any device: what the graphs capture, step by step)",
    "eager": "the per-op forward, as prefill (CPU, tracing)",
}


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
        args: the :class:`~dsv4lab.core.config.ModelArgs`.
        ops: the backend (``ops.name``, ``ops.numerics``).
        tokenizer: the checkpoint's tokenizer, or None.
        max_batch: cache slots; each concurrent sequence owns one.
        positions: per slot, the number of tokens its caches hold.
        mtp_positions: per slot, the number of positions the MTP block's caches hold (see ``forward(mtp=True)``).
    """

    def __init__(self, model: Transformer, ops, checkpoint: Path | None = None, plan=None, read_bytes=None,
                 decode_path: str = "auto", prefill_path: str = "auto"):
        self.model, self.ops, self.plan = model, ops, plan
        self.args = model.args
        self.checkpoint = checkpoint
        self.read_bytes = read_bytes or {}
        self.tokenizer = load_tokenizer(checkpoint) if checkpoint is not None else None
        self.max_batch = model.max_batch
        self.spare_slot = getattr(model, "spare_slot", None)
        self.device = model.embed.weight.device
        # the decode step's stacked projections, made before any graph can be captured: stacking moves those
        # weights, and a graph captured earlier (a prefill bucket's) would go on reading the freed ones
        group_projections(model)
        self.positions = torch.zeros(self.max_batch, dtype=torch.long)
        self.mtp_positions = torch.zeros(self.max_batch, dtype=torch.long)
        self.last_speculative_stats = None  # SpeculativeStats of the last generate(speculative=...)
        self._all_reduce = plan.all_reduce() if plan is not None else None
        self._decoders: dict[str, Decoder] = {}  # per path, kept when the path is switched and back
        self.decode_note = ""
        self.decode_path = decode_path
        self._prefillers: dict[str, Prefiller] = {}
        self.prefill_path = prefill_path
        self.warmup_report: WarmupReport | None = None  # the last warm-up's (load(warmup=True) or warmup())

    @property
    def backend(self) -> str:
        return self.ops.name

    # ------------------------------------------------------------------ decode path
    @property
    def decode_path(self) -> str:
        """How one-token-per-row steps run: ``graph``, ``static`` or ``eager`` (see :data:`DECODE_PATHS`)."""
        return self._decode_path

    @decode_path.setter
    def decode_path(self, path: str) -> None:
        if path not in DECODE_PATHS:
            raise ValueError(f"decode_path {path!r}: expected one of {', '.join(DECODE_PATHS)}")
        if path == "auto":
            path = "graph" if self.device.type == "cuda" and self.ops.name == "triton" else "eager"
        if path == "graph" and self.device.type != "cuda":
            raise ValueError(f"decode_path 'graph' needs the model on a GPU (it is on {self.device})")
        if path == "graph" and self.spare_slot is None:
            raise ValueError("decode_path 'graph' pads batches in a spare cache slot: load the model with "
                             "dsv4lab.load")
        self._decode_path = path

    @property
    def decoder(self) -> Decoder | None:
        """The static-step decoder of the current path (built on first use; None on the eager path). Assignable,
        e.g. to alternate decoders captured under different all-reduce strategies."""
        if self._decode_path == "eager":
            return None
        if self._decode_path not in self._decoders:
            self._decoders[self._decode_path] = Decoder(self, graphs=self._decode_path == "graph")
        return self._decoders[self._decode_path]

    @decoder.setter
    def decoder(self, decoder: Decoder) -> None:
        self._decoders[self._decode_path] = decoder

    def drop_decoders(self) -> None:
        """Forget the decoders and their graphs (they hold the collectives they were captured with: call this
        after changing ``_all_reduce``)."""
        self._decoders.clear()

    def decode_info(self) -> dict:
        """The decode path and, for graphs, the tiers captured so far and what each capture cost (seconds)."""
        info = dict(path=self.decode_path)
        dec = self._decoders.get(self._decode_path)
        graphs = dec.graphs if dec is not None else None
        if graphs is not None:
            # one-token step graphs by tier; other kinds as "kind b<tier>" (e.g. "tokens T3 mtp b4")
            info.update(tiers=list(graphs.tiers), captured={k if isinstance(k, int) else f"{k[0]} b{k[1]}": round(s, 3)
                                                            for k, s in graphs.capture_s.items()})
            if graphs.uncaptured:
                info["uncaptured"] = {f"{k} b{t}": why for (k, t), why in graphs.uncaptured.items()}
        if self.decode_note:
            info["note"] = self.decode_note
        return info

    def _fast_decode(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One step of the static decode path for rows already validated: ``[b, vocab]`` fp32 logits."""
        return self.through_decoder(lambda d: d(tokens, positions, slots), tokens.shape[0])

    def through_decoder(self, use: Callable[[Decoder], object], b: int):
        """``use(self.decoder)`` for a step of ``b`` rows; where capturing the graph of ``b`` rows fails, the decode
        path becomes ``static`` (noted in :meth:`decode_info`) and ``use`` gets the static step's decoder."""
        decoder = self.decoder
        try:
            return use(decoder)
        except RuntimeError as err:
            graphs = decoder.graphs
            if graphs is None or graphs.tier(b) in graphs.graphs:
                raise
            # a backend op that syncs with the host cannot be captured (e.g. the reference's routed-expert loop
            # under expert parallelism): decode through the same step, eagerly
            self.decode_note = f"graph capture failed ({type(err).__name__}: {str(err).splitlines()[0][:160]})"
            log.warning("decode: %s; decoding through the static step without graphs", self.decode_note)
            self.decode_path = "static"
            return use(self.decoder)

    # ------------------------------------------------------------------ prefill path and warm-up
    @property
    def prefill_path(self) -> str:
        """How a plain multi-token forward (``logits="last"``) runs: ``graph``, ``static`` or ``eager`` (see
        :data:`~dsv4lab.engine.prefill_step.PREFILL_PATHS`)."""
        return self._prefill_path

    @prefill_path.setter
    def prefill_path(self, path: str) -> None:
        self._prefill_path = resolve_prefill_path(self, path)

    @property
    def prefiller(self) -> Prefiller | None:
        """The static prefill step of the current path (built on first use; None on the eager path)."""
        if self._prefill_path == "eager":
            return None
        if self._prefill_path not in self._prefillers:
            self._prefillers[self._prefill_path] = Prefiller(self, graphs=self._prefill_path == "graph")
        return self._prefillers[self._prefill_path]

    def warmup(self, progress: bool | None = None, draft_tokens: int = 0) -> WarmupReport:
        """Compile (and capture) every prefill bucket and decode tier now, so no prompt compiles later
        (:func:`dsv4lab.engine.warmup.warm_up`); ``draft_tokens ≥ 1``: speculative decoding's steps too, for up to
        that many drafts per cycle (``generate(..., speculative="mtp", draft_tokens=k)``, ``serve --speculative
        mtp``)."""
        self.warmup_report = warm_up(self, progress, draft_tokens=draft_tokens)
        return self.warmup_report

    # ------------------------------------------------------------------ state
    def reset(self, slots: Sequence[int] | torch.Tensor | None = None) -> None:
        """Drop the per-sequence state of ``slots`` (all slots if None). A new sequence must start reset."""
        s = None if slots is None else torch.as_tensor(slots, dtype=torch.long, device=self.device)
        self.model.reset(s, self.ops)
        if s is None:
            self.positions.zero_()
            self.mtp_positions.zero_()
        else:
            self.positions[s.cpu()] = 0
            self.mtp_positions[s.cpu()] = 0

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, tokens, start_pos=0, slots=None, lengths=None, trace=None, mtp: bool = False,
                next_tokens=None, return_hidden: bool = False, logits: str = "all"):
        """Run ``tokens [b, n]`` and return fp32 logits for **every** position ``[b, n, vocab]``.

        ``logits="last"`` returns ``[b, 1, vocab]``: each row's logits at its last valid token only (NaN for a row
        of length 0) — all a prefill needs to pick the first token, and the head then runs on one row per sequence
        instead of ``n`` (``generate``, the server's prefill and ``bench e2e``'s TTFT use it; verification keeps
        the all-positions form). The MTP logits and the streams below are then at that token only too.
        A multi-token ``logits="last"`` forward, with the MTP block or without, runs the prefill path's static
        step (:attr:`prefiller`, per chunk bucket; graph-replayed on a GPU) and a one-token one the decode path's:
        speculation's prefill computes plain greedy's main logits and caches bit for bit.

        ``start_pos``: int or ``[b]`` — absolute position of ``tokens[:, 0]`` per row (0 for a prefill, the
        slot's current length for a continuation/decode). ``slots``: ``[b]`` cache slots (default ``0..b-1``).
        ``lengths``: ``[b]`` valid tokens per row (right padding); padded positions get NaN logits and never
        touch the caches. Each used slot's caches advance by its length.

        ``mtp=True`` also runs the MTP block at the same positions and returns ``(logits, mtp_logits)``: position
        ``i`` of a row is fed ``tokens[:, i+1]`` — at the row's last valid token ``next_tokens[row]``, or where
        that is None or −1 the main model's greedy choice there (what greedy speculative decoding feeds) — so
        ``mtp_logits[:, i]`` predicts the token two after ``tokens[:, i]``. The MTP block has its own caches, which
        advance with the main ones: run every forward of a sequence with ``mtp=True`` (or reset the slot).
        ``return_hidden`` appends the main model's final streams ``[b, n, hc, D]`` (and with ``mtp`` the MTP
        block's output streams) — the inputs of :meth:`forward_mtp`.
        """
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, n], got shape {list(tokens.shape)}")
        b, n = tokens.shape
        # validated on host copies (one transfer each), then moved to the device
        cpu = torch.device("cpu")
        tokens_cpu = tokens.cpu()
        slots_t = torch.arange(b) if slots is None else _as_rows(slots, b, "slots", cpu)
        start = _as_rows(start_pos, b, "start_pos", cpu)
        lengths_t = torch.full((b,), n, dtype=torch.long) if lengths is None else _as_rows(lengths, b, "lengths", cpu)
        if int(slots_t.max()) >= self.max_batch or int(slots_t.min()) < 0:
            raise ValueError(f"slots must be in [0, {self.max_batch}), got {slots_t.tolist()}")
        if len(set(slots_t.tolist())) != b:
            raise ValueError("each row needs its own cache slot")
        if int((start + lengths_t).max()) > self.args.max_seq_len:
            raise ValueError(f"sequence would exceed max_seq_len={self.args.max_seq_len}")
        if int(lengths_t.max()) > n or int(lengths_t.min()) < 0:
            raise ValueError("lengths must be within [0, n]")
        if int(tokens_cpu.min()) < 0 or int(tokens_cpu.max()) >= self.args.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.args.vocab_size})")
        pos_cpu = self.positions[slots_t]
        if not torch.equal(pos_cpu, start):
            raise ValueError(f"start_pos {start.tolist()} does not continue the slots' sequences "
                             f"(their lengths are {pos_cpu.tolist()}); reset a slot to start a new sequence")
        given = None
        if mtp:
            self._check_mtp(slots_t, start)
            if next_tokens is not None:
                given = self._token_rows(next_tokens, b, "next_tokens", greedy_marker=True, device=cpu)
        # the engine's static steps, plain greedy's and speculation's alike (the streams only with the MTP block)
        static = trace is None and (mtp or not return_hidden)
        if static and n == 1 and bool((lengths_t == 1).all()) and self.decode_path != "eager":
            if mtp:
                out = self._mtp_decode(tokens_cpu[:, 0], start, slots_t, given)
            else:
                out = (self._fast_decode(tokens_cpu[:, 0], start, slots_t)[:, None],)
        elif static and n > 1 and logits == "last" and self.prefiller is not None:
            # static chunks per bucket (no host sync)
            out = self.prefiller(tokens_cpu, start, lengths_t, slots_t, mtp=mtp, next_tokens=given)
            out = out if mtp else (out,)
        else:
            out = self._eager_forward(tokens, start, slots_t, lengths_t, trace, mtp, given, logits == "last")
        self.positions[slots_t] += lengths_t
        if mtp:
            self.mtp_positions[slots_t] += lengths_t
            return out if return_hidden else out[:2]
        return out if return_hidden else out[0]

    def _eager_forward(self, tokens, start, slots_t, lengths_t, trace, mtp: bool, given, last_only: bool):
        """:meth:`forward` on the per-op path at the tokens' own length, for rows validated by it (host ``start``,
        ``slots_t``, ``lengths_t``, ``given``): ``(logits, X)``, with ``mtp`` ``(logits, mtp_logits, X, Xm)`` —
        each at every position, or with ``last_only`` at each row's last valid token."""
        b, n = tokens.shape
        ragged = int(lengths_t.min()) < n  # (host copies: no device read-back to decide the padding mask)
        dev = self.device
        slots_t, start, lengths_t = slots_t.to(dev), start.to(dev), lengths_t.to(dev)
        tokens = tokens.to(dev)
        out, X = self.model(tokens, start, lengths_t, slots_t, self.ops, self._all_reduce, trace,
                            return_hidden=True, last_only=last_only)
        if last_only:
            pad = (lengths_t == 0)[:, None]  # a row with no token has no last position
        else:
            pad = torch.arange(n, device=self.device)[None, :] >= lengths_t[:, None]
        if ragged:
            out = out.masked_fill(pad[..., None], float("nan"))
        last = (lengths_t - 1).clamp(min=0)
        rows = torch.arange(b, device=self.device)

        def at_last(t):  # [b, n, ...] → [b, 1, ...] at each row's last valid token (NaN for a row with none)
            if not last_only:
                return t
            t = t[rows, last][:, None]
            return t.masked_fill(pad.view(b, 1, *[1] * (t.ndim - 2)), float("nan"))

        if not mtp:
            return out.float(), at_last(X)
        # the MTP block's input at position i is the token of position i+1: the next tokens of the row
        greedy = (out.float()[:, 0] if last_only else out.float()[rows, last]).argmax(-1)
        nxt = greedy if given is None else torch.where(given.to(dev) >= 0, given.to(dev), greedy)
        next_ids = torch.cat((tokens[:, 1:], tokens[:, -1:]), 1)
        next_ids[rows, last] = nxt
        mtp_logits, Xm = self.model.forward_mtp(X, next_ids, start, lengths_t, slots_t, self.ops, self._all_reduce)
        if ragged:
            mtp_pad = torch.arange(n, device=self.device)[None, :] >= lengths_t[:, None]
            mtp_logits = mtp_logits.masked_fill(mtp_pad[..., None], float("nan"))
        return out.float(), at_last(mtp_logits.float()), at_last(X), at_last(Xm)

    def _mtp_decode(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, given):
        """One token per row with the MTP block on the static decode path (plain decoding's step, then the MTP
        step on its streams, fed ``given`` or the greedy choice): ``(logits, mtp_logits, X, Xm)``, ``[b, 1, ...]``
        copies of the graphs' outputs."""
        dec = self.decoder
        step = dec.run(tokens[:, None], positions, slots)
        logits, X = step.logits.clone(), step.hidden.clone()
        greedy = logits[:, 0].argmax(-1)
        nxt = greedy if given is None else torch.where(given.to(self.device) >= 0, given.to(self.device), greedy)
        mtp_logits, Xm = dec.mtp(X[:, 0], nxt, positions, slots)
        return logits, mtp_logits.clone()[:, None], X, Xm.clone()[:, None]

    @torch.inference_mode()
    def prefill(self, ids, chunk: int | None = None, slots=None, lengths=None, logits: str = "last",
                mtp: bool = False, next_tokens=None):
        """Start sequences: reset ``slots`` and run their prompts from position 0, ``chunk`` tokens per forward
        (default: the longest prompt in one forward) — the one prefill loop of the engine (generation,
        speculation, the server, the benchmarks and the verifier call it).

        ``ids``: one prompt ``[n]`` or right-padded prompts ``[b, n]`` with ``lengths [b]`` valid tokens each
        (default ``n``; every length ≥ 1); ``slots``: ``[b]`` cache slots (default ``0..b-1``). A chunk runs only
        the rows whose prompt reaches into it. Returns fp32 logits: ``logits="last"`` — ``[b, vocab]`` at each
        row's last prompt token (the head runs on that row only); ``"all"`` — ``[b, n, vocab]``, NaN past a row's
        length.

        ``mtp=True`` runs the MTP block along (:meth:`forward` with ``mtp``; each chunk's last position is fed the
        next chunk's first token) and returns ``(logits, mtp_logits, mtp_streams)``: the MTP logits in the form
        ``logits`` asks for and the MTP block's output streams ``[b, hc, D]`` at each row's last token (a chained
        draft's input). Its last position is fed ``next_tokens[row]``, or where that is None or −1 the main
        model's greedy choice there.
        """
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        tokens = torch.as_tensor(ids, dtype=torch.long).cpu()  # host copy: the chunks and rows are planned there
        if tokens.ndim == 1:
            tokens = tokens[None]
        if tokens.ndim != 2 or tokens.shape[1] == 0:
            raise ValueError(f"ids must be [n] or [batch, n] with n ≥ 1, got shape {list(tokens.shape)}")
        b, n = tokens.shape
        cpu = torch.device("cpu")
        slots_t = torch.arange(b) if slots is None else _as_rows(slots, b, "slots", cpu)
        lens = torch.full((b,), n, dtype=torch.long) if lengths is None else _as_rows(lengths, b, "lengths", cpu)
        if int(lens.min()) < 1 or int(lens.max()) > n:
            raise ValueError(f"lengths must be within [1, {n}], got {lens.tolist()}")
        chunk = n if chunk is None else int(chunk)
        if chunk < 1:
            raise ValueError(f"chunk must be ≥ 1, got {chunk}")
        given = None if next_tokens is None else _as_rows(next_tokens, b, "next_tokens", cpu)
        self.reset(slots_t)
        dev, last = self.device, lens - 1
        out = mtp_out = streams = None
        for s in range(0, int(lens.max()), chunk):
            rows = (lens > s).nonzero().flatten()  # the rows whose prompt reaches into this chunk
            piece_len = (lens[rows] - s).clamp(max=chunk)
            width = int(piece_len.max())
            piece = tokens[rows, s:s + width]
            ragged = bool((piece_len < width).any())
            kw = dict(slots=slots_t[rows], lengths=piece_len if ragged else None, logits=logits)
            if not mtp:
                got = (self.forward(piece.to(dev), s, **kw),)
            else:  # each row's last position here is fed the token after it: the next chunk's, or the given one
                ends = lens[rows] <= s + chunk
                follow = tokens[rows, (s + chunk) if s + chunk < n else n - 1]
                tail = given[rows] if given is not None else torch.full_like(follow, -1)
                got = self.forward(piece.to(dev), s, mtp=True, next_tokens=torch.where(ends, tail, follow),
                                   return_hidden=True, **kw)
            if out is None:  # allocated from the first chunk's outputs (their dtype, vocab and stream shapes)
                shape = (b,) if logits == "last" else (b, n)
                out = torch.full(shape + got[0].shape[2:], float("nan"), device=dev)
                if mtp:
                    mtp_out = torch.full(shape + got[1].shape[2:], float("nan"), device=dev)
                    streams = torch.full((b,) + got[3].shape[2:], float("nan"), dtype=got[3].dtype, device=dev)
            r, ends_here = rows.to(dev), (last[rows] < s + chunk).to(dev)
            if logits == "last":  # the forward's outputs are at each row's last token of the chunk
                out[r[ends_here]] = got[0][ends_here, 0]
                if mtp:
                    mtp_out[r[ends_here]] = got[1][ends_here, 0]
                    streams[r[ends_here]] = got[3][ends_here, 0]
            else:
                out[r, s:s + width] = got[0]
                if mtp:
                    mtp_out[r, s:s + width] = got[1]
                    at = (last[rows] - s).clamp(0, width - 1).to(dev)  # each row's last position in this chunk
                    streams[r[ends_here]] = got[3][torch.arange(len(rows), device=dev), at][ends_here]
        return out if not mtp else (out, mtp_out, streams)

    @torch.inference_mode()
    def forward_mtp(self, hidden: torch.Tensor, next_tokens, start_pos, slots=None, lengths=None):
        """Run the MTP block alone: the streams ``hidden [b, n, hc, D]`` of positions ``start_pos..`` — the main
        model's (``forward(..., return_hidden=True)``) or, for a chained draft, the MTP block's own output
        streams of the position before — with the tokens that follow them, ``next_tokens [b, n]``.

        Returns ``(mtp_logits [b, n, vocab] fp32, streams [b, n, hc, D])`` and advances the MTP caches only (a
        drafting MTP block runs ahead of the main caches; :mod:`dsv4lab.engine.speculative` rolls it back).
        """
        next_ids = torch.as_tensor(next_tokens, dtype=torch.long, device=self.device)
        if next_ids.ndim != 2 or hidden.ndim != 4 or tuple(hidden.shape[:2]) != tuple(next_ids.shape):
            raise ValueError(f"forward_mtp: hidden must be [b, n, hc, dim] and next_tokens [b, n] of the same b, n; "
                             f"got {list(hidden.shape)} and {list(next_ids.shape)}")
        b, n = next_ids.shape
        slots_t = torch.arange(b, device=self.device) if slots is None else _as_rows(slots, b, "slots", self.device)
        start = _as_rows(start_pos, b, "start_pos", self.device)
        lengths_t = torch.full((b,), n, dtype=torch.long, device=self.device) if lengths is None \
            else _as_rows(lengths, b, "lengths", self.device)
        if int((start + lengths_t).max()) > self.args.max_seq_len:
            raise ValueError(f"sequence would exceed max_seq_len={self.args.max_seq_len}")
        self._token_rows(next_ids.flatten(), b * n, "next_tokens")
        self._check_mtp(slots_t, start)
        logits, Xm = self.model.forward_mtp(hidden, next_ids, start, lengths_t, slots_t, self.ops, self._all_reduce)
        self.mtp_positions[slots_t.cpu()] += lengths_t.cpu()
        return logits.float(), Xm

    def _check_mtp(self, slots: torch.Tensor, start: torch.Tensor) -> None:
        if not len(self.model.mtp):
            raise ValueError(f"{self.checkpoint or 'this model'} has no MTP block (n_mtp_layers = 0)")
        held = self.mtp_positions[slots.cpu()]
        if not torch.equal(held, start.cpu()):
            raise ValueError(f"start_pos {start.tolist()} does not continue the MTP caches of slots "
                             f"{slots.tolist()} (they hold {held.tolist()} positions): run every forward of a sequence "
                             "with mtp=True, or reset the slot")

    @torch.inference_mode()
    def decode_greedy(self, tokens, steps: int, slots=None, stop_token: int | None = None,
                      on_tokens: Callable[[list[int]], None] | None = None) -> list[list[int]]:
        """Greedy decoding of ``steps`` tokens per row through the decode path, the host one step behind the GPU.

        ``tokens [b]``: each row's next input, fed at its slot's current position (``slots``: default
        ``0..b-1``); step ``i`` feeds the token step ``i−1`` chose, on the device. Each step's choices are copied to
        the host while the next step runs, so the host's work (reading, streaming, the stop check) never leaves
        the GPU idle; ``on_tokens(ids)`` hears each step's ``b`` ids. Stops after ``steps`` steps, or once every
        row has chosen ``stop_token`` (every row steps until then: the batch, and so each step's kernels, stay the
        same); each row's list ends at its first ``stop_token``. Returns the chosen ids per row; the slots advance
        by the tokens fed whose choices were read (``tokens`` and every chosen id but the last step's).

        The loop is the engine's one step-late loop, :class:`~dsv4lab.engine.batch_loop.BatchLoop` (the server's),
        with its rows fixed: on every decode path (the eager one steps through :meth:`forward`). Stopping early
        leaves one step run past the stop (launched before the stop was read): it wrote the stopped token's cache
        rows at the slot's next position, which the next token fed there overwrites (every cache this step writes
        is a ring of at least the window's period, or an entry rebuilt from such rows, and no later position reads
        what that write replaced) — the loop's overshoot rule, :meth:`BatchLoop.finish
        <dsv4lab.engine.batch_loop.BatchLoop.finish>`; ``tests/test_decode_greedy.py`` checks that continuing after
        such a stop equals continuing without it, bit for bit.
        A row whose logits are not finite raises :class:`~dsv4lab.core.errors.NonFiniteError` naming its position
        (checked on the device with the ids, :func:`dsv4lab.engine.finite.greedy_ids`), never a token; the slots
        then stand where the loop fed them.
        """
        cpu = torch.device("cpu")
        tok = torch.as_tensor(tokens, dtype=torch.long, device=cpu)
        if tok.ndim != 1:
            raise ValueError(f"tokens must be [batch], got shape {list(tok.shape)}")
        b = tok.shape[0]
        slots_t = torch.arange(b) if slots is None else _as_rows(slots, b, "slots", cpu)
        check_slots(slots_t, self.max_batch)
        if int(tok.min()) < 0 or int(tok.max()) >= self.args.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.args.vocab_size})")
        if steps < 1:
            raise ValueError(f"steps must be ≥ 1, got {steps}")
        start = self.positions[slots_t].clone()
        if int(start.max()) + steps > self.args.max_seq_len:
            raise ValueError(f"{steps} steps from position {int(start.max())} would exceed "
                             f"max_seq_len={self.args.max_seq_len}")
        loop = BatchLoop(self)
        for slot, token, position in zip(slots_t.tolist(), tok.tolist(), start.tolist()):
            loop.join(slot, token, position, steps)
        out: list[list[int]] = [[] for _ in range(b)]
        stopped = [False] * b
        read = 0  # steps whose ids the host has read
        while loop.busy:
            ids = [token for _, token in loop.step().ids]  # the rows in batch order (none leaves before the end)
            if not ids:  # the first step: launched, nothing to read yet
                continue
            if NON_FINITE in ids:  # a row's logits were not finite: an error, never a token
                r = ids.index(NON_FINITE)
                raise non_finite(r, int(start[r]) + read)
            for r, t in enumerate(ids):
                if not stopped[r]:
                    out[r].append(t)
                    stopped[r] = t == stop_token
            read += 1
            if on_tokens is not None:
                on_tokens(ids)
            if stop_token is not None and all(stopped):
                break
        for slot in slots_t.tolist():
            loop.finish(slot)
        return out

    def _token_rows(self, ids, b: int, name: str, greedy_marker: bool = False, device=None) -> torch.Tensor:
        t = _as_rows(ids, b, name, device or self.device)
        lo = -1 if greedy_marker else 0
        if int(t.min()) < lo or int(t.max()) >= self.args.vocab_size:
            raise ValueError(f"{name}: token ids must be in [{lo}, {self.args.vocab_size})"
                             + (" (−1: the greedy choice)" if greedy_marker else ""))
        return t


    __call__ = forward

    # ------------------------------------------------------------------ generation
    @torch.inference_mode()
    @locating_non_finite  # non-finite logits raise NonFiniteError naming the position and the first such layer
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, stop_at_eos: bool = True, slot: int = 0,
                 prefill_chunk: int | None = None, speculative: str | None = None, draft_tokens: int = 1,
                 on_token: Callable[[int], None] | None = None) -> list[int]:
        """Prefill ``prompt_ids`` (optionally in chunks) into ``slot`` and decode up to ``max_new_tokens``.

        ``on_token(id)`` hears each token as it is chosen (to stream it); why the generation stopped is
        :func:`~dsv4lab.engine.sampling.finish_reason` of the result. An out-of-range argument raises
        :class:`~dsv4lab.core.errors.RequestError` (:func:`~dsv4lab.engine.sampling.check_generation`).
        ``speculative="mtp"``: greedy self-speculative decoding, the MTP block drafting ``draft_tokens`` tokens per
        main-model forward (:mod:`dsv4lab.engine.speculative`); the ids equal plain greedy decoding's (``on_token``
        hears the tokens of each accepted run)."""
        ids = list(map(int, prompt_ids))
        check_generation(len(ids), max_new_tokens, self.args.max_seq_len, temperature, top_p, seed)
        if speculative is not None:
            check_speculative(speculative, temperature)
            out, self.last_speculative_stats = generate_speculative(
                self, [ids], max_new_tokens, draft_tokens, stop_at_eos=stop_at_eos, slots=[slot],
                prefill_chunk=prefill_chunk)
            if on_token is not None:
                for t in out[0]:
                    on_token(t)
            return out[0]
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        logits = self.prefill(ids, prefill_chunk, slots=[slot])  # [1, vocab]: the prompt's last token
        out: list[int] = []
        if temperature <= 0:  # greedy: the device feeds itself, the host reads one step behind
            limit = min(max_new_tokens, self.args.max_seq_len - len(ids))  # tokens it may choose
            check_rows(logits)
            out.append(int(logits[0].argmax()))
            if on_token is not None:
                on_token(out[0])
            if limit > 1 and not (stop_at_eos and out[0] == self.args.eos_token_id):
                out += self.decode_greedy([out[0]], limit - 1, slots=[slot],
                                          stop_token=self.args.eos_token_id if stop_at_eos else None,
                                          on_tokens=None if on_token is None else lambda t: on_token(t[0]))[0]
            return out
        for _ in range(max_new_tokens):
            nxt = int(sample(logits, temperature, top_p, gen)[0])
            out.append(nxt)
            if on_token is not None:
                on_token(nxt)
            if stop_at_eos and nxt == self.args.eos_token_id:
                break
            if len(ids) + len(out) >= self.args.max_seq_len:
                break
            logits = self.forward(torch.tensor([[nxt]]), start_pos=len(ids) + len(out) - 1, slots=[slot])[:, -1]
        return out

    def generate_with_stats(self, prompt_ids, max_new_tokens, **kw) -> dict:
        """:meth:`generate` plus timing: prefill seconds, decode tok/s, the trajectory hash."""
        t0 = time.perf_counter()
        out = self.generate(prompt_ids, max_new_tokens, **kw)
        dt = time.perf_counter() - t0
        return dict(output_ids=out, hash=trajectory_hash(out), seconds=dt)
