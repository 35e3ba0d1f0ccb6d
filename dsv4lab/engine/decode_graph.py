"""The engine's decode step — ``T`` tokens per sequence (``T = 1`` plain decode, ``T = k+1`` a speculative verify
step), no host syncs, no data-dependent shapes — its CUDA graphs, and the one decoder class that runs them.

The reference forward (:mod:`dsv4lab.core.model.attention`) serves prefill, chunked prefill and decode with per-row
Python loops and ``int()`` / ``.tolist()`` reads of positions; a CUDA graph cannot capture that. This module is
the *decode* step over the same modules, weights and caches, written with tensors only and with the backend's fused
ops (:class:`~dsv4lab.core.model.ops.ReferenceOps` defines each as the composition it replaces):

* per layer: ``hc_pre_norm`` (fused with the previous layer's last ``hc_post``) → ``linear_group`` (wq_a, wkv) →
  ``rms_norm`` → ``linear_group`` (wq_b and the indexer's wq_b) → ``head_rms_rope``; ``kv_norm_rope`` writes the new
  KV rows into the window ring; the compressors' projections (``linear_f32_group``), then per compressor
  ``compressor_step`` (ring update, pooling, entry finish and write where a token completes a block — the
  candidate block is pooled only then, and written only then, so the last partial block of ``max_seq_len``, which
  has no cache row, is never touched); CSA: ``indexer_query`` and ``indexer_select_decode`` (scores and top-k over the
  visible keys only); ``attention_from_caches`` reads the window ring and the compressed cache in place and
  applies the inverse RoPE; ``grouped_wo_a``, ``wo_b``; ``hc_post_pre_norm``; the router (``linear_f32``,
  ``router_topk``), ``routed_experts``, the shared expert; ``hc_post`` (with the next layer's ``hc_pre_norm``);
* per step: the window rows ``max(0, p−W+1) … p`` oldest first (−1 after them) and HCA's visible prefix
  ``j < (p+1)//r`` are computed once and shared by every layer.

**T tokens per sequence** (:meth:`StaticDecodeStep.run`). A step of ``b`` sequences and ``T`` tokens each works on
``b·T`` rows, row ``(i, t)`` being token ``t`` of sequence ``i`` at position ``start[i] + t`` in slot ``slots[i]``:
the row-independent ops (norms, projections, the MoE, mHC, the head) run once over all rows, so each weight is read
once per step. The cache-touching ops must keep causality inside the step. Two designs were weighed:

(a) attend *before* writing the window ring, each query reading the window history from the ring and the step's
    own new KV rows as extra keys (what the eager multi-token forward does) — a third KV source in the attention
    kernel (or a gathered ``[W + T]``-row copy per sequence and layer: 128 KB per sequence and layer at Flash's
    widths, more bytes than the step's attention reads), and the ring written after the attention;
(b) give the window ring ``W + S − 1`` rows (``S`` = the most tokens a step may carry, ``load(...,
    max_step_tokens=8)``): every row's KV is written first — the rows of positions ``start … start+T−1`` overwrite
    positions at least ``W + S − 1`` older, never one the step's queries read — and **each query row is then an
    ordinary one-token decode query at its own position**, through the unchanged attention kernel.

This module takes (b): the attention, indexer and RoPE ops see one-token rows (the same kernels and the same
arithmetic as ``T`` one-token steps), the only cost is ``S − 1`` more ring rows per layer and sequence (5 % at
Flash's window of 128), and every place that indexes the ring takes its period from the ring itself
(``win_kv.shape[1]``: the reference attention, :class:`_StepRows`, ``kv_norm_rope``'s kernel, the rollback's
:class:`~dsv4lab.engine.speculative.CacheSnapshot`, ``Attention.ring_caches``). Entry caches (compressed KV, index
keys) only append and their visibility is positional (``j < (p+1)//r``), so entries completed by a later row of the
step are invisible to an earlier one. The compressor states (rings of ``2·ratio`` rows) are the exception: a later
token of the step may overwrite a ring row an earlier token pools, so ``compressor_step`` takes the ``[b, T]`` tokens
and runs each sequence's tokens in order (the Triton kernel: one program per sequence, a barrier between tokens).

A sequence with fewer tokens than the step (``lengths[i] < T``: a row that verifies fewer drafts) fills its rows
past ``lengths[i]`` with **copies of its last real row** — the same token at the same position. Rows are
independent, so a copy computes the same values as its original and every cache write it makes rewrites what the
original wrote: no mask is needed anywhere, and the padded rows' outputs are ignored. Batches below a graph tier are
padded the same way, with rows that decode token 0 at position 0 in the **spare cache slot** the loader allocates
beside the user's slots (no sequence owns it, so padding and capture never touch a live sequence's state).

The T-token step equals ``T`` one-token steps bit for bit wherever every op rounds a row the same whatever the
number of rows: the reference ops (every reduction in float64, rounded once) always, and the Triton kernels as long
as the step's ``b·T`` rows stay on the decode kernels (``DecodeConfig.max_rows``, 63; the mHC and MTP projections
see ``b·T·hc_mult`` rows) — above that the prefill kernels take the projections and the MoE, a different summation
order inside the ops' calibrated bounds (``tools/verify/op_bounds.py``).

With ``mtp=True`` the step also runs the MTP block at the same positions (row ``(i, t)`` fed token ``t+1`` of its
sequence, its last real row the main model's greedy choice there), as ``runner.forward(..., mtp=True)`` does —
the verify step of speculative decoding; :meth:`StaticDecodeStep.mtp` is the one-token MTP step of a draft chain.

With :class:`~dsv4lab.engine.triton_backend.TritonOps` every op is a kernel and the step is sync-free:
:class:`DecodeGraphs` captures it with ``torch.cuda.CUDAGraph`` (a HIP graph on ROCm) per batch tier (1, 2, 4 … 32)
and, for other step kinds (T tokens, the MTP step, a speculative cycle), per (kind, tier). Kernels are deterministic
(no atomics in any sum; split reductions summed in a fixed order), and rows are independent, so a replay equals the
eager step bit for bit. :class:`Decoder` is the runner's decode path (``ModelRunner.decoder``).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from dsv4lab.core.model.attention import Attention
from dsv4lab.core.model.block import Block
from dsv4lab.engine.decode_groups import group_projections

TIERS = (1, 2, 4, 8, 16, 32)
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


def step_tokens(model) -> int:
    """The most tokens one static step may carry per sequence: what the window rings were sized for."""
    attn = model.layers[0].attn
    return attn.win_kv.shape[1] - attn.args.window_size + 1


class _StepRows:
    """What every layer of one step reads, computed once per step: the rows' positions ``[b·T]`` and cache slots
    (per row, and per sequence for the compressors), the window ring rows of positions ``max(0, p−W+1) … p``
    oldest first, then −1 for the slots a young sequence has not filled (the reference's order: it decides which
    ``attention_block`` of the online softmax each row falls in, so a window wider than the block must list them
    alike), and, per compression ratio, the visible prefix of the compressed cache (HCA reads every completed
    entry)."""

    def __init__(self, positions: torch.Tensor, slots: torch.Tensor, window: int, period: int):
        b, T = positions.shape  # [sequences, tokens each]
        self.tokens, self.seq_slots = T, slots
        self.positions = positions.reshape(-1)
        # contiguous: the kernels read per-row index tensors as ptr + row (for b = 1 the expanded view would
        # reshape to a stride-0 view, and row t > 0 would read past the one slot; found on the H200 as an illegal
        # address in the speculative cycle's graph warm-up)
        self.slots = slots if T == 1 else slots[:, None].expand(b, T).contiguous().view(-1)
        p = self.positions
        u = torch.arange(window, device=p.device)
        window_pos = (p - (window - 1)).clamp(min=0)[:, None] + u[None, :]
        self.window = torch.where(window_pos <= p[:, None], window_pos % period, -1)
        self._compressed: dict[tuple[int, int], torch.Tensor] = {}

    def compressed(self, ratio: int, rows: int) -> torch.Tensor:
        key = (ratio, rows)
        if key not in self._compressed:
            ent = torch.arange(rows, device=self.positions.device)[None, :]
            self._compressed[key] = torch.where(ent < ((self.positions + 1) // ratio)[:, None], ent, -1)
        return self._compressed[key]


@dataclass
class StepOutput:
    """A T-token step's results: the main logits ``[b, T, vocab]`` (fp32) and final streams ``[b, T, hc, D]``;
    with the MTP block, its logits and output streams at the same positions (else None)."""

    logits: torch.Tensor
    hidden: torch.Tensor
    mtp_logits: torch.Tensor | None = None
    mtp_hidden: torch.Tensor | None = None


def step_rows(tokens: torch.Tensor, start: torch.Tensor, lengths: torch.Tensor | None):
    """``(tokens, positions)`` of a step's ``[b, T]`` rows: row ``t < lengths[i]`` is token ``t`` at ``start[i]+t``,
    the rows past a sequence's length copies of its last real row (see the module doc)."""
    T = tokens.shape[1]
    t = torch.arange(T, device=tokens.device)[None, :]
    at = t if lengths is None else torch.minimum(t, (lengths - 1)[:, None])
    return tokens.gather(1, at.expand_as(tokens)), start[:, None] + at


class StaticDecodeStep:
    """``step(tokens [b], positions [b], slots [b]) → logits [b, vocab]`` (fp32) for a loaded model, and the
    T-token form :meth:`run`.

    It reads and advances the model's caches exactly as ``runner.forward(tokens[:, None], positions, slots)``
    does, but does not touch ``runner.positions`` (the runner keeps that bookkeeping). Under tensor/expert
    parallelism it issues the runner's all-reduces where ``Block.forward`` does (wo_b and the indexer scores over
    the TP group, the routed-expert sum over the EP group); every rank runs the step.
    """

    def __init__(self, runner):
        self.runner = runner
        self.model, self.args = runner.model, runner.args
        group_projections(self.model)  # made by the runner already (a no-op then); a bench's bare model here
        self.max_tokens = step_tokens(self.model)
        # under tensor/expert parallelism: the same cross-rank sums, at the same sites, as Block.forward
        reduce = getattr(runner, "_all_reduce", None)
        self.attn_reduce = getattr(reduce, "attention", reduce)
        self.moe_reduce = getattr(reduce, "moe", reduce)

    @property
    def ops(self):
        return self.runner.ops  # read at every step: a caller may swap the runner's backend

    def _rows(self, positions: torch.Tensor, slots: torch.Tensor) -> _StepRows:
        return _StepRows(positions, slots, self.args.window_size, self.model.layers[0].attn.win_kv.shape[1])

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        rows = self._rows(positions[:, None], slots)
        return self._head(self._hidden(tokens, rows))

    @torch.inference_mode()
    def greedy(self, tokens: torch.Tensor, positions: torch.Tensor,
               slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The one-token step with its greedy choice inside it: ``(ids [b], seen [b], logits [b, vocab])`` — each
        row's argmax, the same ids with ``NON_FINITE`` (−1) where the row's logits are not finite
        (:func:`dsv4lab.engine.finite.greedy_ids`, the backend's ``greedy`` op: in the captured graph, one kernel
        where the dispatch turns the fused path ``greedy`` on), and the logits for callers that choose on the host."""
        logits = self(tokens, positions, slots)
        ids, seen = self.ops.greedy(logits)
        return ids, seen, logits

    @torch.inference_mode()
    def run(self, tokens: torch.Tensor, start: torch.Tensor, slots: torch.Tensor,
            lengths: torch.Tensor | None = None, mtp: bool = False) -> StepOutput:
        """``tokens [b, T]`` at positions ``start[i] + t`` of ``slots [b]``; ``lengths [b]`` (default ``T``) real
        tokens per sequence, the rest copies of its last (see the module doc). ``mtp``: the MTP block at the same
        positions (row ``t`` fed token ``t+1``, the last real row the main model's greedy choice). Returns a
        :class:`StepOutput` (``[b, T, ...]``; rows past a length repeat the last real row's results)."""
        b, T = tokens.shape
        if T > self.max_tokens:
            raise ValueError(f"a step of {T} tokens per sequence: the caches were sized for at most "
                             f"{self.max_tokens} (load(..., max_step_tokens=...))")
        tok, pos = step_rows(tokens, start, lengths)
        rows = self._rows(pos, slots)
        X = self._hidden(tok.reshape(-1), rows)
        logits = self._head(X)
        out = StepOutput(logits.view(b, T, -1), X.view(b, T, *X.shape[2:]))
        if mtp:
            # each real row is fed the token after it; the last real row (and its copies) the greedy choice there
            greedy = logits.argmax(-1).view(b, T)
            t = torch.arange(T, device=tokens.device)[None, :]
            lens = torch.full_like(start, T) if lengths is None else lengths
            nxt = torch.where(t + 1 < lens[:, None], tokens.gather(1, (t + 1).clamp(max=T - 1).expand(b, T)),
                              greedy)
            mtp_logits, Xm = self._mtp(X, nxt.reshape(-1), rows)
            out.mtp_logits, out.mtp_hidden = mtp_logits.view(b, T, -1), Xm.view(b, T, *Xm.shape[2:])
        return out

    @torch.inference_mode()
    def mtp(self, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
            slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP block alone, one token per row (a chained draft): the streams ``hidden [b, hc, D]`` at
        ``positions [b]`` with the tokens that follow them → ``(logits [b, vocab] fp32, streams [b, hc, D])``, as
        ``runner.forward_mtp`` (its caches advance; ``runner.mtp_positions`` is the caller's)."""
        logits, Xm = self._mtp(hidden[:, None], next_tokens, self._rows(positions[:, None], slots))
        return logits, Xm[:, 0]

    # ------------------------------------------------------------------ the model
    def _hidden(self, tokens: torch.Tensor, rows: _StepRows) -> torch.Tensor:
        """Final streams ``[R, 1, hc, D]`` of the rows' tokens after every main layer."""
        model, ops, a = self.model, self.ops, self.args
        h = model.embed.weight[tokens].to(ops.numerics.act)  # [R, D]
        X = h[:, None, None, :].expand(-1, 1, a.hc_mult, -1).contiguous()  # [R, 1, hc, D]
        layers = list(model.layers)
        first = layers[0]
        x, post, comb = ops.hc_pre_norm(X, first.hc_attn_fn, first.hc_attn_base, first.hc_attn_scale,
                                        first.attn_norm.weight, a)
        for i, blk in enumerate(layers):
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            X, x, post, comb = self._layer(blk, X, x, post, comb, tokens, rows, nxt)
        return X

    def _head(self, X: torch.Tensor) -> torch.Tensor:
        model = self.model
        y = self.ops.hc_head(X, model.hc_head_fn, model.hc_head_base, model.hc_head_scale, self.args)
        return model.logits(y, self.ops)[:, 0].float()

    def _mtp(self, X: torch.Tensor, next_tokens: torch.Tensor, rows: _StepRows):
        """``MTPBlock.forward_mtp`` on the static path: ``X [R, 1, hc, D]`` → ``(logits [R, vocab], streams)``."""
        model, ops, a = self.model, self.ops, self.args
        if not len(model.mtp):
            raise ValueError("this model has no MTP block (n_mtp_layers = 0)")
        blk = model.mtp[0]
        eps = a.norm_eps
        e = ops.rms_norm(model.embed.weight[next_tokens].to(ops.numerics.act)[:, None], blk.enorm.weight, eps)
        xh = ops.rms_norm(X, blk.hnorm.weight, eps)
        Xm = ops.linear(e, blk.e_proj)[:, :, None, :] + ops.linear(xh, blk.h_proj)
        x, post, comb = ops.hc_pre_norm(Xm, blk.hc_attn_fn, blk.hc_attn_base, blk.hc_attn_scale,
                                        blk.attn_norm.weight, a)
        Xm = self._layer(blk, Xm, x, post, comb, next_tokens, rows, None)[0]
        y = ops.hc_head(Xm, blk.hc_head_fn, blk.hc_head_base, blk.hc_head_scale, a)
        y = ops.rms_norm(y, blk.norm.weight, eps)
        return ops.linear_f32(y, model.head)[:, 0].float(), Xm

    # ------------------------------------------------------------------ block
    def _block(self, blk: Block, X, tokens, positions, slots, rows: _StepRows | None = None):
        """One block on its own, one token per row: ``X [b, 1, hc, D]`` → ``X``."""
        rows = rows or self._rows(positions[:, None], slots)
        x, post, comb = self.ops.hc_pre_norm(X, blk.hc_attn_fn, blk.hc_attn_base, blk.hc_attn_scale,
                                             blk.attn_norm.weight, self.args)
        return self._layer(blk, X, x, post, comb, tokens, rows, None)[0]

    def _layer(self, blk: Block, X, x, post, comb, tokens, rows: _StepRows, nxt: Block | None):
        """A block from its mixed, normed input ``x`` (and ``post, comb`` of its attention site): attention,
        ``hc_post_pre_norm`` into the MoE, the MoE, then the MoE's ``hc_post`` — fused with the next block's
        ``hc_pre_norm`` when there is one (``Block.forward`` composes the same ops block by block). Returns
        ``(X, x, post, comb)`` for the next block (the last three None after the last)."""
        ops, a = self.ops, self.args
        R = X.shape[0]
        h = self._attention(blk.attn, x, rows)
        X, x, post, comb = ops.hc_post_pre_norm(h, X, post, comb, blk.hc_ffn_fn, blk.hc_ffn_base, blk.hc_ffn_scale,
                                                blk.ffn_norm.weight, a)
        ffn, x = blk.ffn, x.reshape(R, -1)
        idx, weights, shared = self._moe_inputs(ffn, x, tokens)
        if nxt is None:
            y = ops.routed_experts(x, idx, weights, ffn.experts, a.swiglu_limit, all_reduce=self.moe_reduce)
            return ops.hc_post(ops.moe_output(y, shared).view(R, 1, -1), X, post, comb), None, None, None
        # routed experts, routed + shared rounded to act, the next block's mHC site: the sums in the site's prologue
        return ops.moe_post_pre_norm(x, idx, weights, ffn.experts, a.swiglu_limit, shared, X, post, comb,
                                     nxt.hc_attn_fn, nxt.hc_attn_base, nxt.hc_attn_scale, nxt.attn_norm.weight, a,
                                     all_reduce=self.moe_reduce)

    def _moe_inputs(self, ffn, x, tokens):
        """``MoE.gate`` and ``MoE.shared_outputs`` of the MoE input ``x [R, D]``: the router logits and every shared
        expert's gate and up projections from one op (``projections``), then the router's choice and each shared
        expert's SwiGLU and down projection (``expert_down``) → ``(idx, weights, shared [S, R, D])``."""
        ops = self.ops
        experts = ffn.shared_experts if isinstance(ffn.shared_experts, torch.nn.ModuleList) else [ffn.shared_experts]
        calls = (("linear_f32", ffn.gate),) + tuple(("linear_group", (se.w1, se.w3)) for se in experts)
        logits, *gate_up = ops.projections(x, calls)
        idx, weights = ops.router_topk(logits, ffn.gate, tokens)
        outs = [ops.expert_down(gate_up[2 * i], gate_up[2 * i + 1], se.w2, self.args.swiglu_limit)
                for i, se in enumerate(experts)]
        return idx, weights, outs[0][None] if len(outs) == 1 else torch.stack(outs)

    # ------------------------------------------------------------------ attention
    def _attention(self, attn: Attention, x, rows: _StepRows):
        """``x [R, 1, D]`` → ``[R, 1, D]``, the reference's :meth:`Attention.forward` for one token per row."""
        ops, a = self.ops, self.args
        R = x.shape[0]
        d, H, eps = a.head_dim, attn.n_local_heads, a.norm_eps
        positions, slots = rows.positions, rows.slots
        pos = positions[:, None]  # [R, 1]: the query positions, as the reference's [b, n]

        idx = attn.indexer
        # every projection of x: q/KV (FP8), each compressor's kv and score (BF16 → fp32), the indexer's head weights
        comps = [(c, cache) for c, cache in ((idx.compressor if idx is not None else None, attn.ikv),
                                            (attn.compressor, attn.ckv)) if c is not None]
        calls = [("linear_group", (attn.wq_a, attn.wkv))]
        if comps:
            calls.append(("linear_f32_group", tuple(lin for c, _ in comps for lin in (c.wkv, c.wgate))))
        if idx is not None:
            calls.append(("linear", idx.weights_proj))  # its scale is applied in indexer_select_decode
        q_a, kv, *rest = ops.projections(x, tuple(calls))
        # q_norm, and the window KV row into the ring before any query reads it (the ring has room: module doc)
        qr, _ = ops.attention_norms(q_a, attn.q_norm.weight, kv, attn.kv_norm.weight, eps, attn.cos, attn.sin, pos,
                                    ring=attn.win_kv, slots=slots)
        if idx is not None:
            q, qi = ops.linear_group(qr, (attn.wq_b, idx.wq_b))
            # the query heads and the indexer's (Indexer.queries): one op
            q, qi = ops.query_heads(q.view(R, 1, H, d), qi.view(R, 1, idx.n_local_heads, idx.head_dim), attn.cos,
                                    attn.sin, pos, eps)
            qi = qi[:, 0]
        else:
            q = ops.head_rms_rope(ops.linear(qr, attn.wq_b).view(R, 1, H, d), attn.cos, attn.sin, pos, eps)
        # each compressor's step on its kv and score projections (indexer keys first)
        if comps:
            proj = [t[:, 0] for t in rest[:2 * len(comps)]]
            T = rows.tokens
            if T == 1:
                where = (positions, slots, attn.cos, attn.sin)
            else:  # each sequence's tokens in order (a later token may overwrite a ring row an earlier pools)
                proj = [t.view(-1, T, t.shape[-1]) for t in proj]
                where = (positions.view(-1, T), rows.seq_slots, attn.cos, attn.sin)
            steps = [(c, proj[2 * i], proj[2 * i + 1], cache) for i, (c, cache) in enumerate(comps)]
            if len(steps) == 2:  # the indexer's keys and the main entries: one op
                ops.compressor_pair(*steps[0], *steps[1], *where)
            else:
                c, kv_c, sc_c, cache = steps[0]
                ops.compressor_step(c, kv_c, sc_c, where[0], where[1], cache, *where[2:])

        cmp_rows = None
        if idx is not None:  # Indexer.head_weights: the projection above
            w = rest[-1][:, 0]
            cmp_rows = ops.indexer_select_decode(qi, w, attn.ikv, slots, positions, a.index_topk,
                                                 all_reduce=self.attn_reduce, w_scale=a.index_scale)
        elif attn.ratio:
            cmp_rows = rows.compressed(attn.ratio, attn.ckv.shape[1])
        # the valid compressed rows are a prefix of cmp_rows (CSA's sorted picks, HCA's completed entries)
        o = ops.attention_from_caches(q[:, 0], attn.win_kv, rows.window, attn.ckv if attn.ratio else None, cmp_rows,
                                      slots, attn.attn_sink, a.softmax_scale, attn.cos, attn.sin, positions,
                                      cmp_ratio=attn.ratio)
        o = ops.grouped_wo_a(o.reshape(R, 1, attn.n_local_groups, -1), attn.wo_a, attn.n_local_groups)
        return ops.linear(o.flatten(2), attn.wo_b, all_reduce=self.attn_reduce)  # wo_b: column-split under TP


def _tree(out, fn):
    """``fn`` applied to every tensor of a static call's output (a tensor, a tuple, a dataclass of them)."""
    if out is None:
        return None
    if isinstance(out, torch.Tensor):
        return fn(out)
    if dataclasses.is_dataclass(out):
        return type(out)(**{f.name: _tree(getattr(out, f.name), fn) for f in dataclasses.fields(out)})
    return tuple(_tree(o, fn) for o in out)


class DecodeGraphs:
    """CUDA graphs of the static step, sharing one memory pool: the one-token step per batch tier (``graphs[b]``,
    :meth:`replay`, :meth:`stepper`) and any other static call per (kind, tier) (:meth:`call`: the T-token step,
    the MTP step, a speculative cycle).

    Each graph is captured on first use or up front (:meth:`capture`): the warm-up runs and the capture work in the
    runner's spare cache slot only, so no sequence's state is touched. ``capture_s`` holds the seconds each capture
    took (Triton compilation on the first one included).
    """

    def __init__(self, runner, tiers: Sequence[int] = TIERS, step: StaticDecodeStep | None = None):
        if runner.device.type != "cuda":
            raise RuntimeError("CUDA graphs need the model on a GPU")
        if getattr(runner, "spare_slot", None) is None:
            raise RuntimeError("decode graphs pad batches in a spare cache slot: load the model with dsv4lab.load")
        self.runner = runner
        self.step = step or StaticDecodeStep(runner)
        self.tiers = tiers_for(runner.max_batch, tiers)
        self.graphs: dict = {}  # tier → (graph, io, (ids, seen, logits)) of the one-token step (its greedy form);
        #                         (kind, tier) → (graph, io, out)
        self.capture_s: dict = {}
        self.uncaptured: dict = {}  # (kind, tier) → why its capture failed (it runs eagerly)
        self._pool = None

    def tier(self, b: int) -> int | None:
        """The smallest captured-or-capturable tier holding ``b`` rows (None above the largest)."""
        return next((t for t in self.tiers if t >= b), None)

    def capture(self, tiers: Sequence[int] | None = None, warmup: int = 2) -> "DecodeGraphs":
        """The one-token step's graphs of ``tiers`` (default: all)."""
        for b in tiers or self.tiers:
            if b not in self.graphs:
                self._capture(b, warmup)
        return self

    def _captured(self, key, io: Sequence[torch.Tensor], fn: Callable, warmup: int):
        """Warm ``fn(*io)`` up on a side stream, capture it, reset the spare slot; ``(graph, io, out)``."""
        r = self.runner
        t0 = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    fn(*io)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = fn(*io)
        torch.cuda.synchronize()
        r.model.reset(torch.tensor([r.spare_slot], device=r.device), r.ops)
        self.capture_s[key] = time.perf_counter() - t0
        log.info("captured %s in %.2f s", key, self.capture_s[key])
        return graph, io, out

    def _capture(self, b: int, warmup: int) -> None:
        r = self.runner
        with torch.inference_mode():
            io = torch.zeros(3, b, dtype=torch.long, device=r.device)  # tokens, positions, slots
            io[2] = r.spare_slot
        graph, _, out = self._captured(b, (io,), lambda t: self.step.greedy(t[0], t[1], t[2]), warmup)
        self.graphs[b] = (graph, io, out)

    def _graph_for(self, b: int) -> tuple[int, tuple]:
        """The smallest tier ``≥ b`` and its ``(graph, io, (ids, seen, logits))``, captured now if it is not yet."""
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
        tier, (graph, io, (_, _, logits)) = self._graph_for(b)
        rows = torch.zeros(3, tier, dtype=torch.long)
        rows[2] = self.runner.spare_slot
        rows[0, :b], rows[1, :b], rows[2, :b] = tokens.cpu(), positions.cpu(), slots.cpu()
        io.copy_(rows)  # one host-to-device copy of the step's inputs
        graph.replay()
        return logits[:b].clone()

    @torch.inference_mode()
    def stepper(self, slots: torch.Tensor, greedy: bool = False):
        """``advance(tokens, positions) → logits`` for the ``b = len(slots)`` rows of ``slots`` (device tensors):
        each call copies the rows into the tier's static inputs on the device and replays, with no host
        transfer — what :meth:`ModelRunner.decode_greedy` runs one step ahead of the host. The logits returned
        are the graph's own output rows (valid until the next replay of the tier: consume them in stream
        order). ``greedy``: ``advance`` returns ``(ids, seen, logits)``, the choice made inside the graph
        (:meth:`StaticDecodeStep.greedy`: no launch between two replays)."""
        b = slots.shape[0]
        graph, io, (ids, seen, logits) = self._graph_for(b)[1]
        io[:, b:] = 0  # padding rows: token 0 at position 0 of the spare slot, as replay pads them
        io[2, b:] = self.runner.spare_slot
        io[2, :b].copy_(slots)

        @torch.inference_mode()  # the static inputs were made in inference mode
        def advance(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            io[0, :b].copy_(tokens)
            io[1, :b].copy_(positions)
            graph.replay()
            return (ids[:b], seen[:b], logits[:b]) if greedy else logits[:b]
        return advance

    @torch.inference_mode()
    def call(self, kind: str, fn: Callable, inputs: Sequence[torch.Tensor], pads: Sequence[float | int]):
        """``fn(*inputs)`` (each input ``[b, ...]``) replayed from the graph of ``(kind, tier)``, captured on first
        use: the inputs are copied into static buffers of ``tier`` rows whose rows past ``b`` hold ``pads[i]``
        (the spare slot for the slots, a position-0 row for the rest — ``fn`` must keep such rows in the spare
        slot). Returns ``fn``'s outputs cut to ``b`` rows: views of the graph's buffers, valid until its next
        replay."""
        b = inputs[0].shape[0]
        tier = self.tier(b)
        if tier is None:
            raise ValueError(f"no graph tier holds batch {b}; tiers: {self.tiers}")
        key = (kind, tier)
        if key in self.uncaptured:
            return fn(*inputs)
        if key not in self.graphs:
            with torch.inference_mode():
                io = tuple(torch.full((tier,) + tuple(x.shape[1:]), p, dtype=x.dtype, device=self.runner.device)
                           for x, p in zip(inputs, pads))
            try:
                self.graphs[key] = self._captured(key, io, fn, 2)
            except RuntimeError as err:
                # an op that syncs with the host cannot be captured (e.g. a step whose b·T rows reach the prefill
                # kernels, or the reference's expert loop): this kind and tier run eagerly from now on
                self.uncaptured[key] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
                log.warning("decode graphs: %s b%d not captured (%s); it runs eagerly", kind, tier,
                            self.uncaptured[key])
                return fn(*inputs)
        graph, io, out = self.graphs[key]
        for buf, x in zip(io, inputs):
            buf[:b].copy_(x)
        graph.replay()
        return _tree(out, lambda t: t[:b])


class Decoder:
    """The engine's static decode path — :class:`StaticDecodeStep`, replayed from :class:`DecodeGraphs` where
    ``graphs`` (default: on a GPU) — and the only decoder class (``ModelRunner.decoder``). Every method takes
    device or host tensors; batches above the largest tier run the step eagerly.

    * ``decoder(tokens [b], positions [b], slots [b]) → [b, vocab]`` fp32 logits: one token per row for rows the
      caller validated; ``runner.positions`` is the caller's.
    * :meth:`stepper` — ``advance(tokens, positions) → logits`` for fixed slots, fed on the device (the one-step-
      behind loops: ``ModelRunner.decode_greedy``, the server's batch loop); ``greedy=True`` adds the ids chosen
      inside the step (``(ids, seen, logits)``).
    * :meth:`decode` — one token per row, validated, advancing ``runner.positions`` like ``ModelRunner.forward``.
    * :meth:`run` — ``T`` tokens per sequence (:meth:`StaticDecodeStep.run`), with the MTP block on request;
      :meth:`mtp` — the MTP block's one-token step; :meth:`call` — any other static function of the step
      (a speculative cycle), graph-replayed per (kind, tier).
    """

    def __init__(self, runner, graphs: bool | None = None, tiers: Sequence[int] = TIERS):
        self.runner = runner
        self.step = StaticDecodeStep(runner)
        use = runner.device.type == "cuda" if graphs is None else graphs
        self.graphs = DecodeGraphs(runner, tiers, self.step) if use else None

    def capture(self, tiers: Sequence[int] | None = None) -> "Decoder":
        """Capture the one-token step's graphs of ``tiers`` (default all) now instead of on first use."""
        if self.graphs is not None:
            self.graphs.capture(tiers)
        return self

    def _graphed(self, b: int) -> bool:
        return self.graphs is not None and self.graphs.tier(b) is not None

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        if self._graphed(tokens.shape[0]):
            return self.graphs.replay(tokens, positions, slots)
        dev = self.runner.device
        return self.step(tokens.to(dev), positions.to(dev), slots.to(dev))

    def stepper(self, slots: torch.Tensor, greedy: bool = False):
        """``advance(tokens, positions) → [b, vocab]`` logits on the device for the rows of ``slots`` (a device
        tensor), no host transfer: the graph tier's (:meth:`DecodeGraphs.stepper`), else the eager step.
        ``greedy``: ``advance`` returns ``(ids, seen, logits)`` (:meth:`StaticDecodeStep.greedy`), the choice made
        inside the step."""
        if self._graphed(slots.shape[0]):
            return self.graphs.stepper(slots, greedy)
        if greedy:
            return lambda tokens, positions: self.step.greedy(tokens, positions, slots)
        return lambda tokens, positions: self.step(tokens, positions, slots)

    def decode(self, tokens: Sequence[int] | torch.Tensor, slots: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Continue each slot's sequence by one token: checks the rows, advances ``runner.positions`` like
        :meth:`ModelRunner.forward` and returns ``[b, vocab]`` fp32 logits."""
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
        logits = self(tokens_t, positions_cpu, slots_cpu)
        r.positions[slots_cpu] += 1
        return logits

    def call(self, kind: str, fn: Callable, inputs: Sequence[torch.Tensor], pads: Sequence[float | int]):
        """``fn(*inputs)`` on the device: replayed from the graph of ``(kind, tier)`` (see
        :meth:`DecodeGraphs.call`) where graphs are on and a tier holds the batch, else run eagerly."""
        dev = self.runner.device
        inputs = [x.to(dev) for x in inputs]
        if self._graphed(inputs[0].shape[0]):
            return self.graphs.call(kind, fn, inputs, pads)
        return fn(*inputs)

    def run(self, tokens: torch.Tensor, start: torch.Tensor, slots: torch.Tensor,
            lengths: torch.Tensor | None = None, mtp: bool = False) -> StepOutput:
        """:meth:`StaticDecodeStep.run` (``T`` tokens per sequence), graph-replayed per (tier, T) where graphs
        are on; ``runner.positions`` is the caller's."""
        b, T = tokens.shape
        lengths = torch.full((b,), T, dtype=torch.long) if lengths is None else lengths
        spare = self.runner.spare_slot if self.runner.spare_slot is not None else 0
        step = self.step
        return self.call(f"tokens T{T}{' mtp' if mtp else ''}",
                         lambda t, s, sl, n: step.run(t, s, sl, n, mtp=mtp),
                         [tokens, start, slots, lengths], [0, 0, spare, 1])

    def mtp(self, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
            slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`StaticDecodeStep.mtp`, graph-replayed per tier where graphs are on."""
        spare = self.runner.spare_slot if self.runner.spare_slot is not None else 0
        return self.call("mtp", self.step.mtp, [hidden, next_tokens, positions, slots], [0, 0, 0, spare])
