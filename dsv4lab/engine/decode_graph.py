"""The engine's decode step: one token per row, no host syncs, no data-dependent shapes — and its CUDA graphs.

The reference forward (:mod:`dsv4lab.core.model.attention`) serves prefill, chunked prefill and decode with per-row
Python loops and ``int()`` / ``.tolist()`` reads of positions; a CUDA graph cannot capture that. This module is
the *decode* step over the same modules, weights and caches, written with tensors only and with the backend's fused
ops (:class:`~dsv4lab.core.model.ops.ReferenceOps` defines each as the composition it replaces):

* per layer: ``hc_pre_norm`` (fused with the previous layer's last ``hc_post``) → ``linear_group`` (wq_a, wkv) →
  ``rms_norm`` → ``linear_group`` (wq_b and the indexer's wq_b) → ``head_rms_rope``; ``kv_norm_rope`` writes the new
  KV row into the window ring; the compressors' projections (``linear_f32_group``), then per compressor
  ``compressor_step`` (ring update, pooling, entry finish and write where the token completes a block — the
  candidate block is pooled only then, and written only then, so the last partial block of ``max_seq_len``, which
  has no cache row, is never touched); CSA: ``indexer_query`` and ``indexer_select_decode`` (scores and top-k over the
  visible keys only); ``attention_from_caches`` reads the window ring and the compressed cache in place and
  applies the inverse RoPE; ``grouped_wo_a``, ``wo_b``; ``hc_post_pre_norm``; the router (``linear_f32``,
  ``router_topk``), ``routed_experts``, the shared expert; ``hc_post`` (with the next layer's ``hc_pre_norm``);
* per step: the window rows ``max(0, p−W+1) … p`` oldest first (−1 after them) and HCA's visible prefix
  ``j < (p+1)//r`` are computed once and shared by every layer.

Projections of one input are computed by one op (``linear_group``, ``linear_f32_group``; the shared expert's w1 and
w3 inside ``expert_mlp``): the step stacks their weights once (:mod:`dsv4lab.engine.decode_groups`, views of the
same memory) so that a backend runs each set in one launch.

With :class:`~dsv4lab.engine.triton_backend.TritonOps` every op is a kernel and the step is sync-free:
:class:`DecodeGraphs` captures it per batch tier (1, 2, 4, 8, …) with ``torch.cuda.CUDAGraph`` (a HIP graph on
ROCm); a batch between tiers is padded to the next tier with rows that decode token 0 at position 0 in the
**spare cache slot** the loader allocates beside the user's slots (no sequence owns it, so padding and capture never
touch a live sequence's state, and a tier can be captured while sequences are running). Kernels are deterministic
(no atomics in any sum; split reductions summed in a fixed order), and rows are independent, so a replay equals the
eager step bit for bit. :class:`~dsv4lab.engine.runner.ModelRunner` decodes through this step on a GPU (see its
``decode_path``); the tests check it against the reference decode on the tiny model at every context class.
"""
from __future__ import annotations

import logging
import time
from typing import Sequence

import torch

from dsv4lab.core.model.attention import Attention
from dsv4lab.core.model.block import Block
from dsv4lab.core.model.moe import MoE
from dsv4lab.engine.decode_groups import group, step_groups

TIERS = (1, 2, 4, 8)
log = logging.getLogger("dsv4lab.decode")


def check_slots(slots: torch.Tensor, max_batch: int) -> None:
    """Decode rows' cache slots (a host tensor): distinct and in ``[0, max_batch)``, else a one-line error."""
    ids = slots.tolist()
    if not ids:
        raise ValueError("no rows to decode")
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= max_batch:
        raise ValueError(f"slots must be distinct and in [0, {max_batch}), got {ids}")


def tiers_for(max_batch: int, tiers: Sequence[int] = TIERS) -> tuple[int, ...]:
    """The captured batch tiers for ``max_batch`` slots: the given tiers up to the first one that holds them all."""
    out = []
    for t in sorted(tiers):
        out.append(t)
        if t >= max_batch:
            break
    return tuple(out)


class _StepRows:
    """Cache rows every layer of one step reads, computed once per step from the positions: the window ring rows
    of positions ``max(0, p−W+1) … p`` oldest first, then −1 for the slots a young sequence has not filled (the
    reference's order: it decides which ``attention_block`` of the online softmax each row falls in, so a window
    wider than the block must list them alike), and, per compression ratio, the visible prefix of the compressed
    cache (HCA reads every completed entry)."""

    def __init__(self, positions: torch.Tensor, window: int):
        self.positions = positions
        u = torch.arange(window, device=positions.device)
        window_pos = (positions - (window - 1)).clamp(min=0)[:, None] + u[None, :]
        self.window = torch.where(window_pos <= positions[:, None], window_pos % window, -1)
        self._compressed: dict[tuple[int, int], torch.Tensor] = {}

    def compressed(self, ratio: int, rows: int) -> torch.Tensor:
        key = (ratio, rows)
        if key not in self._compressed:
            ent = torch.arange(rows, device=self.positions.device)[None, :]
            self._compressed[key] = torch.where(ent < ((self.positions + 1) // ratio)[:, None], ent, -1)
        return self._compressed[key]


class StaticDecodeStep:
    """``step(tokens [b], positions [b], slots [b]) → logits [b, vocab]`` (fp32) for a loaded model.

    It reads and advances the model's caches exactly as ``runner.forward(tokens[:, None], positions, slots)``
    does, but does not touch ``runner.positions`` (the runner keeps that bookkeeping). Under tensor/expert
    parallelism it issues the runner's all-reduces where ``Block.forward`` does (wo_b and the indexer scores over
    the TP group, the routed-expert sum over the EP group); every rank runs the step.
    """

    def __init__(self, runner):
        self.runner = runner
        self.model, self.args = runner.model, runner.args
        for blk in self.model.layers:  # projections of one input side by side (same values, same memory)
            for lins in step_groups(blk):
                group(lins)
        # under tensor/expert parallelism: the same cross-rank sums, at the same sites, as Block.forward
        reduce = getattr(runner, "_all_reduce", None)
        self.attn_reduce = getattr(reduce, "attention", reduce)
        self.moe_reduce = getattr(reduce, "moe", reduce)

    @property
    def ops(self):
        return self.runner.ops  # read at every step: a caller may swap the runner's backend

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        model, ops, a = self.model, self.ops, self.args
        nm = ops.numerics
        h = model.embed.weight[tokens].to(nm.act)  # [b, D]
        X = h[:, None, None, :].expand(-1, 1, a.hc_mult, -1).contiguous()  # [b, 1, hc, D]
        rows = _StepRows(positions, a.window_size)
        layers = list(model.layers)
        first = layers[0]
        x, post, comb = ops.hc_pre_norm(X, first.hc_attn_fn, first.hc_attn_base, first.hc_attn_scale,
                                        first.attn_norm.weight, a)
        for i, blk in enumerate(layers):
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            X, x, post, comb = self._layer(blk, X, x, post, comb, tokens, positions, slots, rows, nxt)
        y = ops.hc_head(X, model.hc_head_fn, model.hc_head_base, model.hc_head_scale, a)
        return model.logits(y, ops)[:, 0].float()

    # ------------------------------------------------------------------ block
    def _block(self, blk: Block, X, tokens, positions, slots, rows: _StepRows | None = None):
        """One block on its own: ``X [b, 1, hc, D]`` → ``X``."""
        a = self.args
        rows = rows or _StepRows(positions, a.window_size)
        x, post, comb = self.ops.hc_pre_norm(X, blk.hc_attn_fn, blk.hc_attn_base, blk.hc_attn_scale,
                                             blk.attn_norm.weight, a)
        return self._layer(blk, X, x, post, comb, tokens, positions, slots, rows, None)[0]

    def _layer(self, blk: Block, X, x, post, comb, tokens, positions, slots, rows: _StepRows, nxt: Block | None):
        """A block from its mixed, normed input ``x`` (and ``post, comb`` of its attention site): attention,
        ``hc_post_pre_norm`` into the MoE, the MoE, then the MoE's ``hc_post`` — fused with the next block's
        ``hc_pre_norm`` when there is one (``Block.forward`` composes the same ops block by block). Returns
        ``(X, x, post, comb)`` for the next block (the last three None after the last)."""
        ops, a = self.ops, self.args
        b = X.shape[0]
        h = self._attention(blk.attn, x, positions, slots, rows)
        X, x, post, comb = ops.hc_post_pre_norm(h, X, post, comb, blk.hc_ffn_fn, blk.hc_ffn_base, blk.hc_ffn_scale,
                                                blk.ffn_norm.weight, a)
        f = self._moe(blk.ffn, x.reshape(b, -1), tokens).view(b, 1, -1)
        if nxt is None:
            return ops.hc_post(f, X, post, comb), None, None, None
        return ops.hc_post_pre_norm(f, X, post, comb, nxt.hc_attn_fn, nxt.hc_attn_base, nxt.hc_attn_scale,
                                    nxt.attn_norm.weight, a)

    def _moe(self, ffn: MoE, x, tokens):
        ops = self.ops
        idx, weights = ffn.gate(x, tokens, ops)
        y = ops.routed_experts(x, idx, weights, ffn.experts, self.args.swiglu_limit, all_reduce=self.moe_reduce)
        return ops.moe_output(y, ffn.shared_outputs(x, ops))  # routed + shared, rounded to act: one launch on a GPU

    # ------------------------------------------------------------------ attention
    def _attention(self, attn: Attention, x, positions, slots, rows: _StepRows):
        """``x [b, 1, D]`` → ``[b, 1, D]``, the reference's :meth:`Attention.forward` for one token per row."""
        ops, a = self.ops, self.args
        b = x.shape[0]
        d, H, eps = a.head_dim, attn.n_local_heads, a.norm_eps
        pos = positions[:, None]  # [b, 1]: the query positions, as the reference's [b, n]

        q_a, kv = ops.linear_group(x, (attn.wq_a, attn.wkv))
        qr = ops.rms_norm(q_a, attn.q_norm.weight, eps)
        idx = attn.indexer
        if idx is not None:
            q, qi = ops.linear_group(qr, (attn.wq_b, idx.wq_b))
        else:
            q = ops.linear(qr, attn.wq_b)
        q = ops.head_rms_rope(q.view(b, 1, H, d), attn.cos, attn.sin, pos, eps)
        # the new KV row goes into the window ring before the query reads it
        ops.kv_norm_rope(kv, attn.kv_norm.weight, eps, attn.cos, attn.sin, pos, ring=attn.win_kv, slots=slots)
        # each compressor's kv and score projections, all of them from one op; then its step (indexer keys first)
        comps = [(c, cache) for c, cache in ((idx.compressor if idx is not None else None, attn.ikv),
                                            (attn.compressor, attn.ckv)) if c is not None]
        if comps:
            proj = ops.linear_f32_group(x[:, 0], tuple(lin for c, _ in comps for lin in (c.wkv, c.wgate)))
            for i, (c, cache) in enumerate(comps):
                ops.compressor_step(c, proj[2 * i], proj[2 * i + 1], positions, slots, cache, attn.cos, attn.sin)

        cmp_rows = None
        if idx is not None:  # Indexer.queries and head_weights on the projections above
            qi = ops.indexer_query(qi.view(b, 1, idx.n_local_heads, idx.head_dim), attn.cos, attn.sin, pos)[:, 0]
            w = ops.linear(x[:, 0], idx.weights_proj)  # its scale is applied in the op
            cmp_rows = ops.indexer_select_decode(qi, w, attn.ikv, slots, positions, a.index_topk,
                                          all_reduce=self.attn_reduce, w_scale=a.index_scale)
        elif attn.ratio:
            cmp_rows = rows.compressed(attn.ratio, attn.ckv.shape[1])
        # the valid compressed rows are a prefix of cmp_rows (CSA's sorted picks, HCA's completed entries)
        o = ops.attention_from_caches(q[:, 0], attn.win_kv, rows.window, attn.ckv if attn.ratio else None, cmp_rows,
                                      slots, attn.attn_sink, a.softmax_scale, attn.cos, attn.sin, positions,
                                      cmp_ratio=attn.ratio)
        o = ops.grouped_wo_a(o.reshape(b, 1, attn.n_local_groups, -1), attn.wo_a, attn.n_local_groups)
        return ops.linear(o.flatten(2), attn.wo_b, all_reduce=self.attn_reduce)  # wo_b: column-split under TP


class DecodeGraphs:
    """CUDA graphs of :class:`StaticDecodeStep`, one per batch tier, sharing one memory pool.

    Each tier is captured on first use (:meth:`replay`) or up front (:meth:`capture`): the warm-up runs and the
    capture decode in the runner's spare cache slot only, so no sequence's state is touched. ``capture_s`` holds
    the seconds each capture took (Triton compilation on the first one included).
    """

    def __init__(self, runner, tiers: Sequence[int] = TIERS, step: StaticDecodeStep | None = None):
        if runner.device.type != "cuda":
            raise RuntimeError("CUDA graphs need the model on a GPU")
        if getattr(runner, "spare_slot", None) is None:
            raise RuntimeError("decode graphs pad batches in a spare cache slot: load the model with dsv4lab.load")
        self.runner = runner
        self.step = step or StaticDecodeStep(runner)
        self.tiers = tiers_for(runner.max_batch, tiers)
        self.graphs: dict[int, tuple] = {}
        self.capture_s: dict[int, float] = {}
        self._pool = None

    def tier(self, b: int) -> int | None:
        """The smallest captured-or-capturable tier holding ``b`` rows (None above the largest)."""
        return next((t for t in self.tiers if t >= b), None)

    def capture(self, tiers: Sequence[int] | None = None, warmup: int = 2) -> "DecodeGraphs":
        for b in tiers or self.tiers:
            if b not in self.graphs:
                self._capture(b, warmup)
        return self

    def _capture(self, b: int, warmup: int) -> None:
        r = self.runner
        t0 = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            io = torch.zeros(3, b, dtype=torch.long, device=r.device)  # tokens, positions, slots
            io[2] = r.spare_slot
            tokens, positions, slots = io[0], io[1], io[2]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    self.step(tokens, positions, slots)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self.step(tokens, positions, slots)
        torch.cuda.synchronize()
        r.model.reset(torch.tensor([r.spare_slot], device=r.device), r.ops)
        self.graphs[b] = (graph, io, logits)
        self.capture_s[b] = time.perf_counter() - t0
        log.info("captured the decode step for batch %d in %.2f s", b, self.capture_s[b])

    def _graph_for(self, b: int) -> tuple[int, tuple]:
        """The smallest tier ``≥ b`` and its ``(graph, io, logits)``, captured now if it is not yet."""
        tier = self.tier(b)
        if tier is None:
            raise ValueError(f"no graph tier holds batch {b}; tiers: {self.tiers}")
        if tier not in self.graphs:
            self._capture(tier, 2)
        return tier, self.graphs[tier]

    @torch.inference_mode()  # the static inputs were made in inference mode: copying into them must be too
    def replay(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Decode ``b = len(tokens)`` rows with the graph of the smallest tier ``≥ b`` (captured now if it is not
        yet), the rows past ``b`` padded into the spare slot; returns a copy of the ``[b, vocab]`` logits."""
        b = tokens.shape[0]
        tier, (graph, io, logits) = self._graph_for(b)
        rows = torch.zeros(3, tier, dtype=torch.long)
        rows[2] = self.runner.spare_slot
        rows[0, :b], rows[1, :b], rows[2, :b] = tokens.cpu(), positions.cpu(), slots.cpu()
        io.copy_(rows)  # one host-to-device copy of the step's inputs
        graph.replay()
        return logits[:b].clone()

    @torch.inference_mode()
    def stepper(self, slots: torch.Tensor):
        """``advance(tokens, positions) → logits`` for the ``b = len(slots)`` rows of ``slots`` (device tensors):
        each call copies the rows into the tier's static inputs on the device and replays, with no host
        transfer — what :meth:`ModelRunner.decode_greedy` runs one step ahead of the host. The logits returned
        are the graph's own output rows (valid until the next replay of the tier: consume them in stream
        order)."""
        b = slots.shape[0]
        graph, io, logits = self._graph_for(b)[1]
        io[:, b:] = 0  # padding rows: token 0 at position 0 of the spare slot, as replay pads them
        io[2, b:] = self.runner.spare_slot
        io[2, :b].copy_(slots)

        @torch.inference_mode()  # the static inputs were made in inference mode
        def advance(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            io[0, :b].copy_(tokens)
            io[1, :b].copy_(positions)
            graph.replay()
            return logits[:b]
        return advance


class FastDecoder:
    """The engine's decode path: :class:`StaticDecodeStep`, replayed from :class:`DecodeGraphs` where ``graphs``.

    ``decoder(tokens, positions, slots)`` (1-D, any device) → ``[b, vocab]`` fp32 logits; the caller validates
    the rows and keeps ``runner.positions``. Batches above the largest tier run the step eagerly.
    """

    def __init__(self, runner, graphs: bool, tiers: Sequence[int] = TIERS):
        self.runner = runner
        self.step = StaticDecodeStep(runner)
        self.graphs = DecodeGraphs(runner, tiers, self.step) if graphs else None

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        if self.graphs is not None and self.graphs.tier(tokens.shape[0]) is not None:
            return self.graphs.replay(tokens, positions, slots)
        dev = self.runner.device
        return self.step(tokens.to(dev), positions.to(dev), slots.to(dev))

    def stepper(self, slots: torch.Tensor):
        """``advance(tokens, positions) → [b, vocab]`` logits on the device for the rows of ``slots`` (a device
        tensor), no host transfer: the graph tier's (:meth:`DecodeGraphs.stepper`), else the eager step."""
        if self.graphs is not None and self.graphs.tier(slots.shape[0]) is not None:
            return self.graphs.stepper(slots)
        return lambda tokens, positions: self.step(tokens, positions, slots)


class GraphDecoder:
    """Decode steps through the engine's decode path outside ``runner.forward``: ``decoder(tokens, slots)``
    continues each slot's sequence by one token, checks and advances ``runner.positions`` like
    :meth:`ModelRunner.forward`, and returns ``[b, vocab]`` fp32 logits. ``graphs``: replay CUDA graphs (default:
    on a GPU), else the eager static step."""

    def __init__(self, runner, graphs: bool | None = None, tiers: Sequence[int] = TIERS):
        self.runner = runner
        use = runner.device.type == "cuda" if graphs is None else graphs
        self.decoder = FastDecoder(runner, use, tiers)
        self.step = self.decoder.step
        self.graphs = self.decoder.graphs
        if self.graphs is not None:
            self.graphs.capture()

    def __call__(self, tokens: Sequence[int] | torch.Tensor, slots: Sequence[int] | torch.Tensor) -> torch.Tensor:
        r = self.runner
        slots_cpu = torch.as_tensor(slots, dtype=torch.long).cpu()
        tokens_t = torch.as_tensor(tokens, dtype=torch.long)
        if tokens_t.ndim != 1 or slots_cpu.shape != tokens_t.shape:
            raise ValueError(f"tokens and slots must be 1-D and equally long, got {list(tokens_t.shape)} and "
                             f"{list(slots_cpu.shape)}")
        check_slots(slots_cpu, r.max_batch)
        positions_cpu = r.positions[slots_cpu]
        if int(positions_cpu.max()) >= r.args.max_seq_len:
            raise ValueError(f"sequence would exceed max_seq_len={r.args.max_seq_len}")
        logits = self.decoder(tokens_t, positions_cpu, slots_cpu)
        r.positions[slots_cpu] += 1
        return logits
