"""Attention of one DeepSeek-V4 block (spec §3.4, §3.7): q-LoRA queries, one shared K=V latent head, a
sliding window for every layer plus compressed entries (HCA: all completed blocks; CSA: the indexer's top-k),
an attention sink, the inverse rotation of the output and the grouped output projection.

Caches (per cache slot, i.e. per sequence): the window ring ``[W + S − 1, d]`` (token ``p`` in row ``p mod
(W + S − 1)``; ``S`` = the most tokens one decode step carries per sequence, 1 unless the engine asks for more — the
``S − 1`` spare rows let a step write all its tokens before any of them attends, see
:mod:`dsv4lab.engine.decode_graph`), the compressed entries ``[max_seq_len/r, d]``, and for CSA the indexer keys ``[max_seq_len/4, index_head_dim]``.
Unwritten cache rows hold NaN, so a read of a row that should not be visible poisons the output instead of
passing silently.

The index list of a query is DeepSeek's: the window positions oldest first (unfilled slots of a young sequence
last, as −1), then the compressed entries (HCA: all visible, oldest first; CSA: the indexer's picks by descending
score). Sparse attention rounds per 64-index block of that list (see ``ReferenceOps.sparse_attention``). The list
of a query depends only on its position and the sequence — never on how the sequence was chunked — so prefill,
chunked prefill and decode round alike. (DeepSeek's own prefill of a prompt shorter than the window lists fewer
window slots, moving its compressed entries to other blocks; the reference keeps the decode layout there.)

One call handles prefill, chunked prefill (``start_pos > 0`` with many tokens) and decode alike, per sequence:
every row of the batch has its own start position and length (right padding is never written to any cache
and never pooled by a compressor).
"""
from __future__ import annotations

import torch
from torch import nn

from dsv4lab.core.config import ModelArgs
from dsv4lab.core.model.compressor import Compressor
from dsv4lab.core.model.indexer import Indexer
from dsv4lab.core.model.linear import Linear
from dsv4lab.core.model.norm import RMSNorm
from dsv4lab.core.model.rope import rope_table


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, tp_size: int = 1):
        super().__init__()
        self.args, self.layer = args, layer
        self.ratio = args.compress_ratios[layer]
        if args.n_heads % tp_size or args.o_groups % tp_size or args.index_n_heads % tp_size:
            raise ValueError(f"tensor parallel size {tp_size} must divide n_heads, o_groups and index_n_heads")
        self.n_local_heads = args.n_heads // tp_size
        self.n_local_groups = args.o_groups // tp_size
        d = args.head_dim
        self.wq_a = Linear(args.dim, args.q_lora_rank, args.dtype)
        self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
        self.wq_b = Linear(args.q_lora_rank, self.n_local_heads * d, args.dtype)
        self.wkv = Linear(args.dim, d, args.dtype)
        self.kv_norm = RMSNorm(d, args.norm_eps)
        # wo_a is applied as a bf16 einsum by the reference: no activation quantization.
        self.wo_a = Linear(args.wo_a_in_per_group, self.n_local_groups * args.o_lora_rank, args.dtype, act_quant=False)
        self.wo_b = Linear(self.n_local_groups * args.o_lora_rank, args.dim, args.dtype)
        self.register_buffer("attn_sink", torch.empty(self.n_local_heads, dtype=torch.float32, device="meta"))
        self.compressor = Compressor(args, self.ratio, d, is_indexer=False) if self.ratio else None
        self.indexer = Indexer(args, args.index_n_heads // tp_size) if self.ratio == 4 else None
        self.win_kv = self.ckv = self.ikv = None
        self.cos = self.sin = None

    # ------------------------------------------------------------------ state
    def allocate(self, max_batch: int, max_seq_len: int, act: torch.dtype, acc: torch.dtype, device,
                 step_tokens: int = 1) -> None:
        """Caches for ``max_batch`` slots; the window ring holds ``window_size + step_tokens − 1`` rows, so that a
        decode step of up to ``step_tokens`` tokens per sequence can write them all before attending."""
        a = self.args
        if step_tokens < 1:
            raise ValueError(f"step_tokens must be ≥ 1, got {step_tokens}")
        self.cos, self.sin = rope_table(a, self.layer, max_seq_len, acc, device)
        nan = float("nan")
        self.win_kv = torch.full((max_batch, a.window_size + step_tokens - 1, a.head_dim), nan, dtype=act,
                                 device=device)
        if self.ratio:
            self.ckv = torch.full((max_batch, max_seq_len // self.ratio, a.head_dim), nan, dtype=act, device=device)
            self.compressor.allocate_state(max_batch, acc, device)
        if self.indexer is not None:
            self.ikv = torch.full((max_batch, max_seq_len // 4, a.index_head_dim), nan, dtype=act, device=device)
            self.indexer.compressor.allocate_state(max_batch, acc, device)

    def reset(self, slots: torch.Tensor | None, ops) -> None:
        for buf in (self.win_kv, self.ckv, self.ikv):
            if buf is not None:
                if slots is None:
                    buf.fill_(float("nan"))
                else:
                    buf[slots] = float("nan")
        if self.compressor is not None:
            ops.reset_compressor_state(self.compressor, slots)
        if self.indexer is not None:
            ops.reset_compressor_state(self.indexer.compressor, slots)

    def ring_caches(self) -> list[tuple[torch.Tensor, int]]:
        """Per-slot caches that hold position ``p`` in row ``p mod period``, as ``(tensor, period)``: the window
        ring and each compressor's kv and score state. Writing ``p`` overwrites ``p − period``."""
        out = [(self.win_kv, self.win_kv.shape[1])]
        for comp in (self.compressor, self.indexer.compressor if self.indexer is not None else None):
            if comp is not None:
                out += [(comp.kv_ring, 2 * comp.ratio), (comp.score_ring, 2 * comp.ratio)]
        return out

    def entry_caches(self) -> list[tuple[torch.Tensor, int]]:
        """Per-slot append-only caches, as ``(tensor, ratio)``: entry ``j`` is written with position
        ``(j+1)·ratio − 1`` and is NaN before (the compressed KV; the indexer keys)."""
        out = [(self.ckv, self.ratio)] if self.ratio else []
        return out + ([(self.ikv, 4)] if self.indexer is not None else [])

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, start: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, ops,
                all_reduce=None, trace=None) -> torch.Tensor:
        """``x [b, n, D]`` (normed, act) at positions ``start[i] + t``; returns ``[b, n, D]`` in act."""
        a = self.args
        b, n, _ = x.shape
        if trace is not None:
            trace("input", x)
        d, W, H = a.head_dim, a.window_size, self.n_local_heads
        period = self.win_kv.shape[1]  # the window ring's rows (≥ W)
        # (length, first position, cache slot) per row, read back once per layer for the host-side loops and sizes
        rows = list(zip(*torch.stack((lengths, start, slots)).long().tolist()))
        positions = start[:, None] + torch.arange(n, device=x.device)[None, :]
        pos_c = positions.clamp(max=self.cos.shape[0] - 1)  # padded tail may run past the table
        cos_q, sin_q = self.cos[pos_c], self.sin[pos_c]

        qr = ops.rms_norm(ops.linear(x, self.wq_a), self.q_norm.weight, a.norm_eps)
        q = ops.linear(qr, self.wq_b).view(b, n, H, d)
        q = ops.head_rms_rope(q, self.cos, self.sin, pos_c, a.norm_eps)  # per-head RMS in act (no weight), RoPE
        # kv_norm, RoPE and the KV FP8 simulation of the non-rope dims
        kv = ops.kv_norm_rope(ops.linear(x, self.wkv), self.kv_norm.weight, a.norm_eps, self.cos, self.sin, pos_c)

        # compressed entries completed by these tokens (written before attention: an entry completed by the
        # current token is visible to it)
        for i, (L, p0, slot) in enumerate(rows):
            if L == 0:
                continue
            if self.indexer is not None:
                j0, ent = self.indexer.compressor.forward_row(x[i, :L], p0, slot, ops, self.cos, self.sin)
                if ent is not None:
                    self.ikv[slot, j0:j0 + len(ent)] = ent.to(self.ikv.dtype)
            if self.compressor is not None:
                j0, ent = self.compressor.forward_row(x[i, :L], p0, slot, ops, self.cos, self.sin)
                if ent is not None:
                    self.ckv[slot, j0:j0 + len(ent)] = ent.to(self.ckv.dtype)
                    if trace is not None:
                        trace("compressed_entries", ent)

        # KV rows visible to this call: window history (positions p0-W..p0-1), this call's kv, compressed entries
        hist_pos = start[:, None] - W + torch.arange(W, device=x.device)[None, :]  # [b, W]
        hist = self.win_kv[slots[:, None], hist_pos % period]
        parts = [hist, kv.to(hist.dtype)]
        # The window of the query at position p lists positions max(0, p-W+1)..p oldest first, then −1 for the
        # slots a young sequence has not filled (DeepSeek's get_window_topk_idxs): the order decides which
        # 64-index block of the online softmax each row falls in. Row of position q in [hist; kv]: q - (start-W).
        # Always W columns, as DeepSeek's decode lists them. Its one-shot prefill of n < W tokens lists min(n, W),
        # so there the compressed entries start in another 64-index block and their probabilities round to bf16
        # against other running maxima (the same softmax, one bf16 rounding of P apart; identical when min(n, W)
        # is a multiple of 64). Kept on purpose: a prefill, a chunked prefill and decode of the same positions
        # then round alike, which the exact cached-vs-recompute tier relies on
        # (tests/test_reference_fidelity.py::test_a_prefill_shorter_than_the_window_keeps_the_decode_layout).
        u = torch.arange(W, device=x.device)
        win_pos = (positions - (W - 1)).clamp(min=0)[:, :, None] + u[None, None, :]  # [b, n, W]
        win_rows = win_pos - (start[:, None, None] - W)
        idx = [torch.where(win_pos <= positions[:, :, None], win_rows, -1)]
        if self.ratio:
            n_entries = max((p0 + L) // self.ratio for L, p0, _ in rows)
            base = W + n
            parts.append(self.ckv[slots, :n_entries])
            visible_n = (positions + 1) // self.ratio  # [b, n]
            if self.indexer is not None:
                qi = self.indexer.queries(qr, self.cos, self.sin, pos_c, ops)
                w = self.indexer.head_weights(x, ops)
                n_keys = max((p0 + L) // 4 for L, p0, _ in rows)
                sel = ops.indexer_select(qi, w, self.ikv[slots, :n_keys], positions, 4, a.index_topk,
                                         all_reduce=all_reduce)
                if trace is not None:
                    trace("indexer_selection", sel)
                idx.append(torch.where(sel >= 0, sel + base, -1))
            else:
                ent = torch.arange(n_entries, device=x.device)
                idx.append(torch.where(ent[None, None, :] < visible_n[..., None], ent + base, -1))
        kv_all = torch.cat(parts, 1)
        o = ops.sparse_attention(q, kv_all, torch.cat(idx, -1), self.attn_sink, a.softmax_scale)
        o = ops.rope(o, cos_q[:, :, None], sin_q[:, :, None], inverse=True)
        o = ops.grouped_wo_a(o.reshape(b, n, self.n_local_groups, -1), self.wo_a, self.n_local_groups)
        y = ops.linear(o.flatten(2), self.wo_b, all_reduce=all_reduce)  # wo_b is split by columns under TP

        # window ring: the last min(L, period) tokens of each row (the ring then holds the last `period` positions
        # whatever the chunking, so its bytes do not depend on how a sequence was fed)
        for i, (L, p0, slot) in enumerate(rows):
            keep = min(L, period)
            if keep:
                p = torch.arange(p0 + L - keep, p0 + L, device=x.device)
                self.win_kv[slot, p % period] = kv[i, L - keep:L].to(self.win_kv.dtype)
        if trace is not None:
            trace("attn_out", y)
        return y
