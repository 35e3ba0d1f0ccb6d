"""A static decode step — one token per row, no host syncs, no data-dependent shapes — and its CUDA graphs.

The reference forward (:mod:`dsv4lab.model.attention`) serves prefill, chunked prefill and decode with per-row
Python loops and ``int()`` / ``.tolist()`` reads of positions; a CUDA graph cannot capture that. This module is
a second implementation of the *decode* step over the same modules, weights and caches, written with tensors
only:

* window: the new KV row is written into the ring first, then the query reads the ring rows of positions
  ``p-W+1 .. p`` (−1 where negative) — the same rows the reference gathers from ``[history; kv]``;
* compressors: the candidate block ``j = p // r`` is always pooled and its entry written only where the block
  completes (``(p+1) % r == 0``), through ``torch.where``;
* HCA reads every entry of the compressed cache masked by ``j < (p+1)//r``; CSA's indexer scores the whole
  index-key cache (unwritten rows are NaN and masked out) and keeps ``min(index_topk, cache rows)`` picks, the
  invisible ones as −1 — the same visible selection as the reference's;
* attention reads the window ring and the compressed cache in place (:meth:`TritonOps.attention_from_caches`).

Every op goes through the backend (``runner.ops``), so with :class:`~dsv4lab.engine.triton_backend.TritonOps`
the step is sync-free and :class:`DecodeGraphs` captures it per batch tier (1, 2, 4, 8) with
``torch.cuda.CUDAGraph`` (a HIP graph on ROCm). Kernels are deterministic (no atomics; split reductions summed in
a fixed order), so a replay equals the eager step bit for bit. ``tests/test_kernels_decode.py`` checks the
step against the reference decode on the tiny model.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .. import quant
from ..model.attention import Attention
from ..model.block import Block
from ..model.compressor import Compressor
from ..model.moe import MoE

TIERS = (1, 2, 4, 8)


class StaticDecodeStep:
    """``step(tokens [b], positions [b], slots [b]) → logits [b, vocab]`` (fp32) for a loaded model.

    It reads and advances the model's caches exactly as ``runner.forward(tokens[:, None], positions, slots)``
    does, but does not touch ``runner.positions`` (see :class:`GraphDecoder` for the bookkeeping). Under
    tensor/expert parallelism it issues the runner's all-reduces where ``Block.forward`` does (wo_b and the
    indexer scores over the TP group, the routed-expert sum over the EP group); every rank runs the step.
    """

    def __init__(self, runner):
        self.model, self.ops, self.args = runner.model, runner.ops, runner.args
        # under tensor/expert parallelism: the same cross-rank sums, at the same sites, as Block.forward
        reduce = getattr(runner, "_all_reduce", None)
        self.attn_reduce = getattr(reduce, "attention", reduce)
        self.moe_reduce = getattr(reduce, "moe", reduce)

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        model, ops, a = self.model, self.ops, self.args
        nm = ops.numerics
        h = model.embed.weight[tokens].to(nm.act)  # [b, D]
        X = h[:, None, None, :].expand(-1, 1, a.hc_mult, -1).contiguous()  # [b, 1, hc, D]
        for blk in model.layers:
            X = self._block(blk, X, tokens, positions, slots)
        y = ops.hc_head(X, model.hc_head_fn, model.hc_head_base, model.hc_head_scale, a)
        return model.logits(y, ops)[:, 0].float()

    # ------------------------------------------------------------------ block
    def _block(self, blk: Block, X, tokens, positions, slots):
        ops, a = self.ops, self.args
        b = X.shape[0]
        u, post, comb = ops.hc_pre(X, blk.hc_attn_fn, blk.hc_attn_base, blk.hc_attn_scale, a)
        h = self._attention(blk.attn, ops.rms_norm(u, blk.attn_norm.weight, a.norm_eps), positions, slots)
        X = ops.hc_post(h, X, post, comb)
        u, post, comb = ops.hc_pre(X, blk.hc_ffn_fn, blk.hc_ffn_base, blk.hc_ffn_scale, a)
        f = self._moe(blk.ffn, ops.rms_norm(u, blk.ffn_norm.weight, a.norm_eps).reshape(b, -1), tokens)
        return ops.hc_post(f.view(b, 1, -1), X, post, comb)

    def _moe(self, ffn: MoE, x, tokens):
        ops, nm = self.ops, self.ops.numerics
        idx, weights = ffn.gate(x, tokens, ops)
        y = ops.routed_experts(x, idx, weights, ffn.experts, self.args.swiglu_limit, all_reduce=self.moe_reduce)
        shared = ffn.shared_experts if isinstance(ffn.shared_experts, torch.nn.ModuleList) else [ffn.shared_experts]
        z = torch.zeros_like(y)
        for se in shared:
            z = z + ops.expert_mlp(x, se.w1, se.w2, se.w3, self.args.swiglu_limit, shared=True).to(nm.acc)
        return (y + z).to(nm.act)

    # ------------------------------------------------------------------ attention
    def _attention(self, attn: Attention, x, positions, slots):
        """``x [b, 1, D]`` → ``[b, 1, D]``, the reference's :meth:`Attention.forward` for one token per row."""
        ops, a = self.ops, self.args
        nm = ops.numerics
        b = x.shape[0]
        d, W, H = a.head_dim, a.window_size, attn.n_local_heads
        cos_q, sin_q = attn.cos[positions][:, None], attn.sin[positions][:, None]  # [b, 1, r/2]

        qr = ops.rms_norm(ops.linear(x, attn.wq_a), attn.q_norm.weight, a.norm_eps)
        q = ops.linear(qr, attn.wq_b).view(b, 1, H, d)
        q = ops.head_rms(q, a.norm_eps)
        q = ops.rope(q, cos_q[:, :, None], sin_q[:, :, None])
        kv = ops.rms_norm(ops.linear(x, attn.wkv), attn.kv_norm.weight, a.norm_eps)
        kv = ops.rope(kv, cos_q, sin_q)
        if nm.kv_fp8_sim:
            kv = torch.cat((quant.fp8_qdq(kv[..., :a.nope_head_dim], 64), kv[..., a.nope_head_dim:]), -1)

        if attn.indexer is not None:
            self._compress(attn.indexer.compressor, x[:, 0], positions, slots, attn.ikv, attn.cos, attn.sin)
        if attn.compressor is not None:
            self._compress(attn.compressor, x[:, 0], positions, slots, attn.ckv, attn.cos, attn.sin)

        attn.win_kv[slots, positions % W] = kv[:, 0].to(attn.win_kv.dtype)
        window_pos = positions[:, None] - (W - 1) + torch.arange(W, device=x.device)[None, :]
        win_rows = torch.where(window_pos >= 0, window_pos % W, -1)

        cmp_rows = None
        if attn.ratio and attn.indexer is not None:
            qi = attn.indexer.queries(qr, cos_q, sin_q, ops)
            w = attn.indexer.head_weights(x, ops)
            scores = ops.indexer_scores(qi, w, attn.ikv[slots], all_reduce=self.attn_reduce)
            cmp_rows = ops.indexer_topk(scores, positions[:, None], 4, a.index_topk)[:, 0]
        elif attn.ratio:
            ent = torch.arange(attn.ckv.shape[1], device=x.device)
            cmp_rows = torch.where(ent[None, :] < ((positions + 1) // attn.ratio)[:, None], ent[None, :], -1)
        o = ops.attention_from_caches(q[:, 0], attn.win_kv, win_rows, attn.ckv if attn.ratio else None, cmp_rows,
                                      slots, attn.attn_sink, a.softmax_scale)[:, None]
        o = ops.rope(o, cos_q[:, :, None], sin_q[:, :, None], inverse=True)
        o = ops.grouped_wo_a(o.reshape(b, 1, attn.n_local_groups, -1), attn.wo_a, attn.n_local_groups)
        return ops.linear(o.flatten(2), attn.wo_b, all_reduce=self.attn_reduce)  # wo_b: column-split under TP

    def _compress(self, comp: Compressor, x, positions, slots, cache, cos, sin) -> None:
        """Feed one token per row into ``comp`` and write the entry of every block it completes."""
        ops = self.ops
        r, c = comp.ratio, comp.channels
        kv_new, sc_new = comp.project(x, positions, ops)
        comp.kv_ring[slots, positions % (2 * r)] = kv_new.to(comp.kv_ring.dtype)
        comp.score_ring[slots, positions % (2 * r)] = sc_new.to(comp.score_ring.dtype)
        block = positions // r
        offs = torch.arange(r, device=x.device)[None, :]
        ring_b = (block[:, None] * r + offs) % (2 * r)  # the candidate block's positions in the ring
        kv_ring, sc_ring = comp.kv_ring[slots], comp.score_ring[slots]
        gather = lambda t, rows: torch.gather(t, 1, rows[..., None].expand(-1, -1, t.shape[-1]))  # noqa: E731
        if comp.overlap:  # half A of the previous block (empty for block 0: reset ring rows), half B of this one
            ring_a = (block[:, None] * r - r + offs) % (2 * r)
            kv_slots = torch.cat((gather(kv_ring, ring_a)[..., :c], gather(kv_ring, ring_b)[..., c:]), 1)
            sc_slots = torch.cat((gather(sc_ring, ring_a)[..., :c], gather(sc_ring, ring_b)[..., c:]), 1)
        else:
            kv_slots, sc_slots = gather(kv_ring, ring_b), gather(sc_ring, ring_b)
        entry = comp.finish(ops.compressor_pool(kv_slots, sc_slots), block, ops, cos, sin)
        done = ((positions + 1) % r == 0)[:, None]
        cache[slots, block] = torch.where(done, entry.to(cache.dtype), cache[slots, block])


class DecodeGraphs:
    """CUDA graphs of :class:`StaticDecodeStep`, one per batch tier, sharing one memory pool.

    Capturing runs the step eagerly a few times (warm-up) on the model's caches, so :meth:`capture` resets every
    cache slot afterwards: capture before serving sequences.
    """

    def __init__(self, runner, tiers: Sequence[int] = TIERS):
        self.runner = runner
        self.step = StaticDecodeStep(runner)
        self.tiers = tuple(t for t in tiers if t <= runner.max_batch)
        self.graphs: dict[int, tuple] = {}

    def capture(self, warmup: int = 2) -> "DecodeGraphs":
        dev = self.runner.device
        if dev.type != "cuda":
            raise RuntimeError("CUDA graphs need the model on a GPU")
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for b in self.tiers:
                tokens = torch.zeros(b, dtype=torch.long, device=dev)
                positions = torch.zeros(b, dtype=torch.long, device=dev)
                slots = torch.arange(b, device=dev)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(warmup):
                        self.step(tokens, positions, slots)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self.step(tokens, positions, slots)
                self.graphs[b] = (graph, tokens, positions, slots, logits)
        torch.cuda.synchronize()
        self.runner.reset()
        return self

    @torch.inference_mode()  # the static inputs were made in inference mode: copying into them must be too
    def replay(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Run the captured step for ``b = len(tokens)`` (a captured tier); returns a copy of the logits."""
        b = tokens.shape[0]
        if b not in self.graphs:
            raise ValueError(f"no graph captured for batch {b}; tiers: {sorted(self.graphs)}")
        graph, t, p, s, logits = self.graphs[b]
        t.copy_(tokens)
        p.copy_(positions)
        s.copy_(slots)
        graph.replay()
        return logits.clone()


class GraphDecoder:
    """Decode steps for a loaded model: graph replay where a tier is captured, the eager static step otherwise.

    ``decoder(tokens, slots)`` continues each slot's sequence by one token, checks and advances
    ``runner.positions`` like :meth:`ModelRunner.forward`, and returns ``[b, vocab]`` fp32 logits.
    """

    def __init__(self, runner, graphs: bool | None = None, tiers: Sequence[int] = TIERS):
        self.runner = runner
        self.step = StaticDecodeStep(runner)
        use = runner.device.type == "cuda" if graphs is None else graphs
        self.graphs = DecodeGraphs(runner, tiers).capture() if use else None

    def __call__(self, tokens: Sequence[int] | torch.Tensor, slots: Sequence[int] | torch.Tensor) -> torch.Tensor:
        r = self.runner
        slots_cpu = torch.as_tensor(slots, dtype=torch.long).cpu()
        tokens_t = torch.as_tensor(tokens, dtype=torch.long)
        if tokens_t.ndim != 1 or slots_cpu.shape != tokens_t.shape:
            raise ValueError(f"tokens and slots must be 1-D and equally long, got {list(tokens_t.shape)} and "
                             f"{list(slots_cpu.shape)}")
        if len(set(slots_cpu.tolist())) != len(slots_cpu) or int(slots_cpu.min()) < 0 \
                or int(slots_cpu.max()) >= r.max_batch:
            raise ValueError(f"slots must be distinct and in [0, {r.max_batch}), got {slots_cpu.tolist()}")
        positions_cpu = r.positions[slots_cpu]
        if int(positions_cpu.max()) >= r.args.max_seq_len:
            raise ValueError(f"sequence would exceed max_seq_len={r.args.max_seq_len}")
        dev = r.device
        args = (tokens_t.to(dev), positions_cpu.to(dev), slots_cpu.to(dev))
        if self.graphs is not None and len(tokens_t) in self.graphs.graphs:
            logits = self.graphs.replay(*args)
        else:
            logits = self.step(*args)
        r.positions[slots_cpu] += 1
        return logits
