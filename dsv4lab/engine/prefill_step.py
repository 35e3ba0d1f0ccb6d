"""The engine's prefill step: one chunk of one sequence at a fixed **bucket** size, no host syncs — and its graphs.

The reference forward (:meth:`Attention.forward <dsv4lab.core.model.attention.Attention.forward>`,
:meth:`Compressor.forward_row <dsv4lab.core.model.compressor.Compressor.forward_row>`) reads positions back to the
host (``.tolist()``) and sizes its tensors by them (the compressed entries a chunk completes, the keys it may see):
a CUDA graph cannot capture that, and every new prompt length is a new shape — new Triton specializations to
compile on the request path (the first 1,024-token prompt after start took 4.96 s on the H200 against ~0.2 s warm).
:class:`StaticPrefillStep` is the same chunk over the same modules, weights, caches and backend ops, written with
tensors only, at a shape that depends on the bucket alone:

* **Buckets** (:func:`bucket_ladder`): 16, 32, 48, 64, 96, 128, 192, 256, …, 3072, 4096 — powers of two and the
  points halfway in between (so at most 1.5× padding), every one a multiple of 16 (Triton's integer specialization
  is the same for all of them), from the backend's smallest prefill-kernel row count (64 for the Triton backend: a
  padded chunk always runs the prefill kernels) to the largest chunk the engine runs (the dispatch's, 4,096 by
  default; no wider than the caches). A chunk of ``L`` tokens runs at the smallest bucket ``C ≥ L``; a longer
  forward is cut into chunks of the largest bucket first.
* **Inputs**: the ``C`` token ids (padding rows get token 0) and, on the device, ``(start, length, slot)``.
  Padding rows sit at the last valid position (so every index they form is one a valid row forms too), are never
  written to any cache and never pooled by a compressor; their outputs are dropped.
* **Static upper bounds** instead of data-dependent sizes: the attention reads the window history, the chunk's own
  KV rows and *every* row of the compressed cache (``max_seq_len / ratio``; rows a query may not see are −1 in its
  index list, which the sparse attention skips); the indexer scores every key row of the slot (causal: only the
  visible ones are read); a compressor pools every block the chunk could complete (``⌈C / r⌉``) and writes
  each one only where it is complete; the rings take the last ``min(length, period)`` positions through a
  where-scatter onto distinct rows.

The ops are the backend's (the Triton prefill kernels through the dispatch, at ``C`` rows), called in the order the
eager forward calls them, on the same shapes but ``C`` for ``L``. Every op is row-independent and extra −1 columns
of an index list change no sum, so each valid row equals the eager forward's: bit for bit with the reference backend
(its reductions are batch-invariant) and with the Triton prefill kernels under the interpreter at equal kernel
choice (``tests/test_prefill_step.py``; on a GPU cuBLAS may pick another algorithm at another row count).

**With the MTP block** (``mtp=True``: speculative decoding's prefill) the same step runs the main layers, then
the MTP block over the chunk's rows as ``MTPBlock.forward_mtp`` does (row ``i`` fed the chunk's token ``i+1``, the
last valid row the given next token or the main model's greedy choice there, chosen on the device), and returns
the main and MTP logits and the final streams of both at the last valid token. The main model's part is the plain
step's, op for op, so speculation's prefill gives plain greedy's logits and caches bit for bit on every backend
(on a GPU the eager forward, at the prompt's own length, runs other GEMM shapes: the trajectories parted at the
first token). The MTP block needs the main streams of every row (it fills its own window over the chunk); they
stay inside the step, so only ``[1, vocab]`` and ``[1, hc, D]`` tensors leave it.

:class:`PrefillGraphs` captures the step per bucket with ``torch.cuda.CUDAGraph`` on first use (warm-up runs and
capture in the runner's spare slot, as :class:`~dsv4lab.engine.decode_graph.DecodeGraphs` does for decode), the MTP
form as a graph of its own per bucket (``("mtp", bucket)``, captured only when speculation prefills), one memory
pool for all of them; :class:`Prefiller` is the runner's prefill path (:data:`PREFILL_PATHS`).
"""
from __future__ import annotations

import logging
import time
from typing import Sequence

import torch

from dsv4lab.core.model.attention import Attention
from dsv4lab.core.model.block import Block
from dsv4lab.core.model.compressor import Compressor
from dsv4lab.engine.dispatch import INTERPRETER_DEFAULTS, GPU_DEFAULTS

log = logging.getLogger("dsv4lab.prefill")

PREFILL_PATHS = {
    "auto": "graph on a GPU with the Triton backend, eager otherwise",
    "graph": "the static prefill step per chunk bucket, CUDA-graph replayed (GPU, sync-free backend)",
    "static": "the static prefill step run eagerly (any device: what the graphs capture, chunk by chunk)",
    "eager": "the per-op forward at the prompt's own length (CPU, tracing, verification)",
}
SMALLEST_BUCKET = 16
"""No bucket is smaller (nor any not a multiple of it): Triton specializes an integer on ``value % 16 == 0``."""


def bucket_ladder(smallest: int, largest: int) -> tuple[int, ...]:
    """Buckets from ``smallest`` to the first one ``≥ largest``: the powers of two and the points halfway between
    them (``16, 32, 48, 64, 96, 128, 192, …``), multiples of :data:`SMALLEST_BUCKET`."""
    smallest = max(SMALLEST_BUCKET, -(-smallest // SMALLEST_BUCKET) * SMALLEST_BUCKET)
    out, p = [], SMALLEST_BUCKET
    while not out or out[-1] < largest:
        for c in (p, p + p // 2):
            if c >= smallest and c % SMALLEST_BUCKET == 0 and (not out or out[-1] < largest):
                out.append(c)
        p *= 2
    return tuple(out)


def default_buckets(runner) -> tuple[int, ...]:
    """The runner's buckets: from its backend's fewest prefill-kernel rows (``prefill_min_tokens``; 16 for a
    backend without prefill kernels) to the largest chunk its dispatch runs, at most the cache length."""
    ops = runner.ops
    smallest = getattr(ops, "prefill_min_tokens", SMALLEST_BUCKET)
    dispatch = ops.kernel_dispatch() if hasattr(ops, "kernel_dispatch") else None
    defaults = dispatch.defaults if dispatch is not None else (
        INTERPRETER_DEFAULTS if runner.device.type == "cpu" else GPU_DEFAULTS)
    largest = defaults.prefill_max_chunk
    if dispatch is not None:  # a tuned chunk wider than the default
        largest = max([largest] + [int(e["choice"].get("chunk") or 0) for e in dispatch.tuned.entries("prefill.chunk")])
    return bucket_ladder(smallest, min(largest, runner.args.max_seq_len))


def resolve_prefill_path(runner, path: str) -> str:
    """``path`` checked against the runner (``auto`` resolved): a one-line ValueError for an impossible choice."""
    if path not in PREFILL_PATHS:
        raise ValueError(f"prefill_path {path!r}: expected one of {', '.join(PREFILL_PATHS)}")
    if path == "auto":
        return "graph" if runner.device.type == "cuda" and runner.ops.name == "triton" else "eager"
    if path == "graph" and runner.device.type != "cuda":
        raise ValueError(f"prefill_path 'graph' needs the model on a GPU (it is on {runner.device})")
    if path == "graph" and getattr(runner, "spare_slot", None) is None:
        raise ValueError("prefill_path 'graph' captures in a spare cache slot: load the model with dsv4lab.load")
    return path


class StaticPrefillStep:
    """``step(tokens [C], meta [3]) → logits [1, vocab]`` (fp32) at the last valid token of one chunk.

    ``meta = (start, length, slot)`` on the device: the chunk's first position, its valid tokens (1…C) and the
    sequence's cache slot. Reads and advances the slot's caches exactly as ``runner.forward(tokens[None, :length],
    start, slots=[slot], logits="last")`` does, without touching ``runner.positions``. Under tensor/expert
    parallelism it issues the runner's all-reduces where ``Block.forward`` does.

    ``step(tokens, meta [4], mtp=True)``, ``meta = (start, length, slot, next)``: the MTP block along, as
    ``runner.forward(..., mtp=True, next_tokens=[next], return_hidden=True, logits="last")`` (``next`` −1: the
    greedy choice) → ``(logits, mtp_logits, streams, mtp_streams)`` at the last valid token (``[1, vocab]`` fp32,
    ``[1, hc, D]``); the MTP block's caches advance too.

    ``poison_padding`` (tests): the padding rows' streams are NaN from the embedding on, so a padding row that
    reached a valid row or a cache would show.
    """

    def __init__(self, runner, poison_padding: bool = False):
        self.runner = runner
        self.model, self.args = runner.model, runner.args
        self.poison_padding = poison_padding
        reduce = getattr(runner, "_all_reduce", None)
        self.attn_reduce = getattr(reduce, "attention", reduce)
        self.moe_reduce = getattr(reduce, "moe", reduce)

    @property
    def ops(self):
        return self.runner.ops  # read at every call: a caller may swap the runner's backend

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, meta: torch.Tensor, mtp: bool = False):
        model, ops, a = self.model, self.ops, self.args
        C = tokens.shape[0]
        start, length, slot = meta[0:1], meta[1:2], meta[2:3]
        row = torch.arange(C, device=tokens.device)
        pos = (start + torch.minimum(row, length - 1))[None]  # [1, C]: padding rows at the last valid position
        ids = tokens[None]
        h = model.embed.weight[ids].to(ops.numerics.act)
        X = h[:, :, None, :].expand(-1, -1, a.hc_mult, -1).contiguous()
        if self.poison_padding:
            X = X.masked_fill((row >= length)[None, :, None, None], float("nan"))
        for blk in model.layers:
            X = self._block(blk, X, ids, pos, start, length, slot)
        last = X[:, length - 1]  # [1, 1, hc, D]
        y = ops.hc_head(last, model.hc_head_fn, model.hc_head_base, model.hc_head_scale, a)
        logits = model.logits(y, ops)[:, 0].float()
        if not mtp:
            return logits
        # the MTP block's input at row i is the token of row i+1; at the last valid row (and the padding rows, its
        # copies) the given next token, or the main model's greedy choice there
        given = meta[3:4]
        after = torch.where(given >= 0, given, logits.argmax(-1))
        next_ids = torch.where(row + 1 < length, tokens[(row + 1).clamp(max=C - 1)], after)[None]  # [1, C]
        mtp_logits, mtp_last = self._mtp(X, next_ids, pos, start, length, slot)
        return logits, mtp_logits, last[:, 0], mtp_last

    def _mtp(self, X, next_ids, pos, start, length, slot):
        """``MTPBlock.forward_mtp`` over the chunk's rows (its ops, in its order) with the head on the last valid
        row only: ``X [1, C, hc, D]`` (the main streams), ``next_ids [1, C]`` → ``(logits [1, vocab] fp32, the
        block's output streams [1, hc, D])`` at the last valid token."""
        model, ops, a = self.model, self.ops, self.args
        blk, eps = model.mtp[0], a.norm_eps
        e = ops.rms_norm(model.embed.weight[next_ids].to(ops.numerics.act), blk.enorm.weight, eps)
        xh = ops.rms_norm(X, blk.hnorm.weight, eps)
        Xm = ops.linear(e, blk.e_proj)[:, :, None, :] + ops.linear(xh, blk.h_proj)
        Xm = self._block(blk, Xm, next_ids, pos, start, length, slot)
        last = Xm[:, length - 1]  # [1, 1, hc, D]
        y = ops.rms_norm(ops.hc_head(last, blk.hc_head_fn, blk.hc_head_base, blk.hc_head_scale, a), blk.norm.weight,
                         eps)
        return ops.linear_f32(y, model.head)[:, 0].float(), last[:, 0]

    # ------------------------------------------------------------------ block (Block.forward's ops, in its order)
    def _block(self, blk: Block, X, ids, pos, start, length, slot):
        ops, a = self.ops, self.args
        C = X.shape[1]
        x, post, comb = ops.hc_pre_norm(X, blk.hc_attn_fn, blk.hc_attn_base, blk.hc_attn_scale,
                                        blk.attn_norm.weight, a)
        h = self._attention(blk.attn, x, pos, start, length, slot)
        X, x, post, comb = ops.hc_post_pre_norm(h, X, post, comb, blk.hc_ffn_fn, blk.hc_ffn_base, blk.hc_ffn_scale,
                                                blk.ffn_norm.weight, a)
        f = blk.ffn(x.reshape(C, -1), ids.reshape(-1), ops, self.moe_reduce)
        return ops.hc_post(f.view(1, C, -1), X, post, comb)

    # ------------------------------------------------------------------ attention (Attention.forward, one row)
    def _attention(self, attn: Attention, x, pos, start, length, slot):
        """``x [1, C, D]`` → ``[1, C, D]``; ``pos [1, C]``, ``start, length, slot [1]``."""
        ops, a = self.ops, self.args
        C = x.shape[1]
        d, W, H, eps = a.head_dim, a.window_size, attn.n_local_heads, a.norm_eps
        period = attn.win_kv.shape[1]  # the window ring's rows (≥ W)
        dev = x.device
        cos_q, sin_q = attn.cos[pos], attn.sin[pos]
        qr = ops.rms_norm(ops.linear(x, attn.wq_a), attn.q_norm.weight, eps)
        q = ops.linear(qr, attn.wq_b).view(1, C, H, d)
        q = ops.head_rms_rope(q, attn.cos, attn.sin, pos, eps)
        kv = ops.kv_norm_rope(ops.linear(x, attn.wkv), attn.kv_norm.weight, eps, attn.cos, attn.sin, pos)
        # the compressed entries these tokens complete, before attention (indexer keys first, as the eager forward)
        if attn.indexer is not None:
            self._compress(attn.indexer.compressor, x[0], start, length, slot, attn.ikv, attn.cos, attn.sin)
        if attn.compressor is not None:
            self._compress(attn.compressor, x[0], start, length, slot, attn.ckv, attn.cos, attn.sin)

        # KV rows: the window history (positions start-W … start-1), the chunk's rows, every compressed row
        hist_pos = start[:, None] - W + torch.arange(W, device=dev)[None, :]
        parts = [attn.win_kv[slot[:, None], hist_pos % period]]
        parts.append(kv.to(parts[0].dtype))
        u = torch.arange(W, device=dev)
        win_pos = (pos - (W - 1)).clamp(min=0)[:, :, None] + u[None, None, :]
        win_rows = win_pos - (start[:, None, None] - W)
        idx = [torch.where(win_pos <= pos[:, :, None], win_rows, -1)]
        if attn.ratio:
            base = W + C
            parts.append(attn.ckv[slot])
            if attn.indexer is not None:
                qi = attn.indexer.queries(qr, attn.cos, attn.sin, pos, ops)
                w = attn.indexer.head_weights(x, ops)
                sel = ops.indexer_select(qi, w, attn.ikv[slot], pos, 4, a.index_topk, all_reduce=self.attn_reduce)
                idx.append(torch.where(sel >= 0, sel + base, -1))
            else:
                ent = torch.arange(attn.ckv.shape[1], device=dev)
                visible = ((pos + 1) // attn.ratio)[..., None]
                idx.append(torch.where(ent[None, None, :] < visible, ent + base, -1))
        o = ops.sparse_attention(q, torch.cat(parts, 1), torch.cat(idx, -1), attn.attn_sink, a.softmax_scale)
        o = ops.rope(o, cos_q[:, :, None], sin_q[:, :, None], inverse=True)
        o = ops.grouped_wo_a(o.reshape(1, C, attn.n_local_groups, -1), attn.wo_a, attn.n_local_groups)
        y = ops.linear(o.flatten(2), attn.wo_b, all_reduce=self.attn_reduce)
        _write_last(attn.win_kv, slot, kv[0], start, length, period)
        return y

    # ------------------------------------------------------------------ compressor (Compressor.forward_row)
    def _compress(self, comp: Compressor, x, start, length, slot, cache, cos, sin) -> None:
        """Feed the chunk's valid tokens ``x[:length]`` (``x [C, D]``) into ``comp`` and write the entries they
        complete to ``cache`` (the slot's compressed KV or indexer keys)."""
        ops, acc = self.ops, self.ops.numerics.acc
        C, r = x.shape[0], comp.ratio
        dev = x.device
        kv_new, sc_new = comp.project(x, start + torch.arange(C, device=dev), ops)
        # positions start-2r … start+C-1: the whole ring (what any block completed here may reach back to), then
        # the chunk's rows; row of position p: p - (start - 2r)
        ring = (start - 2 * r + torch.arange(2 * r, device=dev)) % (2 * r)
        kv_all = torch.cat((comp.kv_ring[slot, ring].to(acc), kv_new), 0)
        sc_all = torch.cat((comp.score_ring[slot, ring].to(acc), sc_new), 0)
        n_rows = cache.shape[1]
        blocks = start // r + torch.arange(min(-(-C // r), n_rows), device=dev)  # every block this chunk may end
        done = (blocks + 1) * r <= start + length
        last = 2 * r + C - 1
        tok_b = blocks[:, None] * r + torch.arange(r, device=dev)[None] - (start - 2 * r)
        c = comp.channels
        if comp.overlap:  # half A of the previous block, half B of this one
            tok_a = (tok_b - r).clamp(max=last)
            tok_b = tok_b.clamp(max=last)
            kv_slots = torch.cat((kv_all[tok_a][..., :c], kv_all[tok_b][..., c:]), 1)
            sc_slots = torch.cat((sc_all[tok_a][..., :c], sc_all[tok_b][..., c:]), 1)
        else:
            tok_b = tok_b.clamp(max=last)
            kv_slots, sc_slots = kv_all[tok_b], sc_all[tok_b]
        entries = comp.finish(ops.compressor_pool(kv_slots, sc_slots), torch.where(done, blocks, 0), ops, cos, sin)
        rows = blocks % n_rows  # consecutive blocks: distinct rows; an unfinished one keeps its row's bytes
        cache[slot, rows] = torch.where(done[:, None], entries.to(cache.dtype), cache[slot, rows])
        _write_last(comp.kv_ring, slot, kv_new, start, length, 2 * r)
        _write_last(comp.score_ring, slot, sc_new, start, length, 2 * r)


def _write_last(ring: torch.Tensor, slot, rows: torch.Tensor, start, length, period: int) -> None:
    """``ring[slot, p mod period] = rows[p - start]`` for the last ``min(length, period)`` positions ``p`` of the
    chunk (what the eager forward keeps), as one scatter onto distinct rows (the others rewritten unchanged)."""
    m = min(rows.shape[0], period)
    p = start + length - m + torch.arange(m, device=rows.device)
    ring_rows = p % period
    new = rows[(p - start).clamp(min=0)].to(ring.dtype)
    ring[slot, ring_rows] = torch.where((p >= start)[:, None], new, ring[slot, ring_rows])


def _io(bucket: int, mtp: bool, pin: bool = False) -> torch.Tensor:
    """A chunk's inputs as one host tensor: ``bucket`` token ids (0), then ``start, length, slot`` (and with the
    MTP block ``next``: −1, the greedy choice) — one copy to the device."""
    io = torch.zeros(bucket + 3 + int(mtp), dtype=torch.long, pin_memory=pin)
    if mtp:
        io[-1] = -1
    return io


def _clone(out):
    return out.clone() if isinstance(out, torch.Tensor) else tuple(t.clone() for t in out)


class PrefillGraphs:
    """CUDA graphs of :class:`StaticPrefillStep`, one per bucket (``graphs[bucket]``) and, for speculation's
    prefill, one per bucket of the step with the MTP block (``graphs["mtp", bucket]``), sharing one memory pool;
    each captured on first use (:meth:`replay`) or up front (:meth:`capture`), in the runner's spare slot.
    ``capture_s`` holds the seconds each capture took (Triton compilation included where it was the first launch of
    a kernel's key)."""

    def __init__(self, runner, step: StaticPrefillStep):
        if runner.device.type != "cuda":
            raise RuntimeError("CUDA graphs need the model on a GPU")
        self.runner, self.step = runner, step
        self.graphs: dict = {}
        self.capture_s: dict = {}
        self._pool = None

    def capture(self, bucket: int, warmup: int = 2, mtp: bool = False) -> None:
        key = ("mtp", bucket) if mtp else bucket
        if key in self.graphs:
            return
        r = self.runner
        t0 = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            io = _io(bucket, mtp)
            io[bucket + 1], io[bucket + 2] = min(bucket, r.args.max_seq_len), r.spare_slot
            io = io.to(r.device)
            tokens, meta = io[:bucket], io[bucket:]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    self.step(tokens, meta, mtp)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.step(tokens, meta, mtp)
        torch.cuda.synchronize()
        r.model.reset(torch.tensor([r.spare_slot], device=r.device), r.ops)
        self.graphs[key] = (graph, io, out)
        self.capture_s[key] = time.perf_counter() - t0
        log.info("captured the prefill step%s for %d-token chunks in %.2f s", " with the MTP block" if mtp else "",
                 bucket, self.capture_s[key])

    @torch.inference_mode()  # the static inputs were made in inference mode: copying into them must be too
    def replay(self, bucket: int, io_host: torch.Tensor, mtp: bool = False):
        """Run the bucket's graph on ``io_host`` (:func:`_io`'s layout; a host tensor, pinned so that the copy in is
        asynchronous — from pageable memory torch waits for the stream): one copy in, the replay, a copy of the
        outputs (the ``[1, vocab]`` logits; with ``mtp`` the step's four outputs) — no host sync."""
        self.capture(bucket, mtp=mtp)
        graph, io, out = self.graphs[("mtp", bucket) if mtp else bucket]
        io.copy_(io_host, non_blocking=io_host.is_pinned())
        graph.replay()
        return _clone(out)


class Prefiller:
    """The runner's prefill path: every row's chunk through :class:`StaticPrefillStep` at its bucket, replayed from
    :class:`PrefillGraphs` where ``graphs``; a row longer than the largest bucket in chunks of that bucket.

    ``prefiller(tokens [b, n], start [b], lengths [b], slots [b])`` (host tensors, validated by the caller) →
    ``[b, 1, vocab]`` fp32 logits at each row's last valid token (NaN for a row of length 0). With ``mtp=True`` the
    step with the MTP block (``next_tokens [b]``: the token after each row's last, −1 or None for the greedy
    choice; a chunk before a row's last is fed the next chunk's first token) → ``(logits, mtp_logits, streams,
    mtp_streams)``, ``[b, 1, ...]`` each (NaN for a row of length 0). Where a graph cannot be captured (a backend
    op that syncs with the host) it warns once and runs the step without graphs.
    """

    def __init__(self, runner, graphs: bool, buckets: Sequence[int] | None = None):
        self.runner = runner
        self.step = StaticPrefillStep(runner)
        self.buckets = tuple(sorted(buckets or default_buckets(runner)))
        if not self.buckets or any(c % SMALLEST_BUCKET for c in self.buckets):
            raise ValueError(f"prefill buckets must be multiples of {SMALLEST_BUCKET}, got {self.buckets}")
        self.graphs = PrefillGraphs(runner, self.step) if graphs else None
        self.pinned = runner.device.type == "cuda"
        self.note = ""

    def bucket(self, n: int) -> int:
        """The smallest bucket that holds ``n`` tokens (the largest, for a longer ``n``: it is cut to it)."""
        return next((c for c in self.buckets if c >= n), self.buckets[-1])

    def warm(self, bucket: int, mtp: bool = False) -> None:
        """Compile (and on the graph path capture) the bucket's step: one chunk in the spare slot, then reset."""
        r = self.runner
        if self.graphs is not None:
            self._guarded(lambda: self.graphs.capture(bucket, mtp=mtp))
            if self.graphs is not None:
                return
        io = _io(bucket, mtp)
        io[bucket + 1], io[bucket + 2] = min(bucket, r.args.max_seq_len), r.spare_slot
        self._run(bucket, io, mtp)
        r.model.reset(torch.tensor([r.spare_slot], device=r.device), r.ops)

    def _guarded(self, fn):
        try:
            return fn()
        except RuntimeError as err:
            self.note = f"graph capture failed ({type(err).__name__}: {str(err).splitlines()[0][:160]})"
            log.warning("prefill: %s; running the static step without graphs", self.note)
            self.graphs = None
            return None

    def _run(self, bucket: int, io: torch.Tensor, mtp: bool = False):
        if self.graphs is not None:
            out = self._guarded(lambda: self.graphs.replay(bucket, io, mtp))
            if out is not None:
                return out
        io = io.to(self.runner.device, non_blocking=io.is_pinned())
        return self.step(io[:bucket], io[bucket:], mtp)

    def __call__(self, tokens: torch.Tensor, start: torch.Tensor, lengths: torch.Tensor,
                 slots: torch.Tensor, mtp: bool = False, next_tokens: torch.Tensor | None = None):
        b = tokens.shape[0]
        out = [None] * b
        widest = self.buckets[-1]
        for i in range(b):
            n, p = int(lengths[i]), int(start[i])
            for s in range(0, n, widest):
                piece = min(widest, n - s)
                bucket = self.bucket(piece)
                # a fresh pinned buffer per chunk: the copy to the device overlaps the chunk before it (torch's
                # pinned-memory cache keeps the buffer until that copy is done)
                io = _io(bucket, mtp, self.pinned)
                io[:piece] = tokens[i, s:s + piece]
                io[bucket:bucket + 3] = torch.tensor([p + s, piece, int(slots[i])])
                if mtp and s + piece < n:  # the MTP block's last row here is fed the next chunk's first token
                    io[-1] = tokens[i, s + piece]
                elif mtp and next_tokens is not None:
                    io[-1] = int(next_tokens[i])
                out[i] = self._run(bucket, io, mtp)
        if mtp:
            return _stack_rows(out, self.runner)
        return _stack_rows([None if o is None else (o,) for o in out], self.runner)[0]


def _stack_rows(rows: list, runner) -> tuple[torch.Tensor, ...]:
    """Per row, the step's outputs (a tuple of ``[1, ...]`` tensors; None for a row of length 0) stacked into
    ``[b, 1, ...]`` tensors, NaN in the rows of length 0."""
    like = next((o for o in rows if o is not None), None)
    if like is None:  # no row had a token: the shapes the step would have given
        a = runner.args
        logits = torch.empty(1, a.vocab_size, device=runner.device)
        streams = torch.empty(1, a.hc_mult, a.dim, dtype=runner.ops.numerics.act, device=runner.device)
        like = (logits, logits, streams, streams)
    return tuple(torch.stack([o[k] if o is not None else torch.full_like(t, float("nan")) for o in rows])
                 for k, t in enumerate(like))
