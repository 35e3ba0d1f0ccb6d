"""KV compressor (spec §3.5): pools every ``ratio`` tokens into one compressed entry.

Ratio 4 (CSA layers, and inside the lightning indexer) uses the *overlap* mode: entry ``j`` pools the A-half
channels of block ``j−1`` and the B-half channels of block ``j`` (8 slots, softmax per channel). Larger ratios
(HCA) pool the ``ratio`` tokens of block ``j`` alone. ``ape`` is added to the scores only. Entry ``j`` exists once
its block is complete (``(j+1)·r ≤ p+1``); it is RMS-normed, rotated at position ``j·r`` (the block's first
token) and then quantize-simulated (FP8 for the main KV; Hadamard + FP4 for the indexer keys).

Per-sequence state: a ring of the last ``2r`` positions' projected kv and scores (fp32), indexed by
``position mod 2r``. A reset fills it with kv 0 / score −inf, which is exactly what entry 0's missing
"previous block" must look like — so prefill, chunked prefill and decode are one code path, and a state that is
*not* reset between sequences corrupts entry 0 the way the reference's stale buffers do.
"""
from __future__ import annotations

import torch
from torch import nn

from dsv4lab.core.config import ModelArgs
from dsv4lab.core.model.linear import Linear
from dsv4lab.core.model.norm import RMSNorm


class Compressor(nn.Module):
    """One compressor (main: ``head_dim`` channels; indexer: ``index_head_dim`` channels)."""

    def __init__(self, args: ModelArgs, ratio: int, channels: int, is_indexer: bool):
        super().__init__()
        self.args, self.ratio, self.channels, self.is_indexer = args, ratio, channels, is_indexer
        self.overlap = ratio == 4
        self.coff = 2 if self.overlap else 1
        width = self.coff * channels
        self.register_buffer("ape", torch.empty(ratio, width, dtype=torch.float32, device="meta"))
        self.wkv = Linear(args.dim, width, "bf16")
        self.wgate = Linear(args.dim, width, "bf16")
        self.norm = RMSNorm(channels, args.norm_eps)
        self.kv_ring: torch.Tensor | None = None
        self.score_ring: torch.Tensor | None = None

    def allocate_state(self, max_batch: int, dtype: torch.dtype, device) -> None:
        width = self.coff * self.channels
        self.kv_ring = torch.zeros(max_batch, 2 * self.ratio, width, dtype=dtype, device=device)
        self.score_ring = torch.full((max_batch, 2 * self.ratio, width), float("-inf"), dtype=dtype, device=device)

    def clear_state(self, slots: torch.Tensor | None = None) -> None:
        if self.kv_ring is None:
            return
        if slots is None:
            self.kv_ring.zero_()
            self.score_ring.fill_(float("-inf"))
        else:
            self.kv_ring[slots] = 0
            self.score_ring[slots] = float("-inf")

    def project(self, x: torch.Tensor, positions: torch.Tensor, ops) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(kv, score)`` of tokens ``x [n, D]`` at ``positions [n]`` (ape already added to the scores)."""
        kv = ops.linear_f32(x, self.wkv)
        sc = ops.linear_f32(x, self.wgate) + self.ape.to(kv.dtype)[positions % self.ratio]
        return kv, sc

    def forward_row(self, x: torch.Tensor, p0: int, slot: int, ops, cos: torch.Tensor, sin: torch.Tensor):
        """Feed the tokens ``x [n, D]`` at positions ``p0..p0+n-1`` of the sequence in ``slot``.

        Returns ``(first_block, entries [m, channels])`` — the entries completed by these tokens (``m`` may be
        0) in the compute dtype — and advances the slot's ring.
        """
        nm = ops.numerics
        r, n = self.ratio, x.shape[0]
        p1 = p0 + n
        pos = torch.arange(p0, p1, device=x.device)
        kv_new, sc_new = self.project(x, pos, ops)
        j_lo, j_hi = p0 // r, p1 // r - 1
        entries = None
        if j_hi >= j_lo:
            # all positions from the earliest slot any completed block needs, ring first then the new tokens
            base = j_lo * r - (r if self.overlap else 0)
            hist = torch.arange(base, p0, device=x.device)
            ring_idx = hist % (2 * r)
            kv_all = torch.cat((self.kv_ring[slot, ring_idx].to(nm.acc), kv_new), 0)
            sc_all = torch.cat((self.score_ring[slot, ring_idx].to(nm.acc), sc_new), 0)
            blocks = torch.arange(j_lo, j_hi + 1, device=x.device)
            tok_b = blocks[:, None] * r + torch.arange(r, device=x.device)[None] - base  # [nb, r]
            c = self.channels
            if self.overlap:
                tok_a = tok_b - r
                kv_slots = torch.cat((kv_all[tok_a][..., :c], kv_all[tok_b][..., c:]), 1)  # [nb, 2r, c]
                sc_slots = torch.cat((sc_all[tok_a][..., :c], sc_all[tok_b][..., c:]), 1)
            else:
                kv_slots, sc_slots = kv_all[tok_b], sc_all[tok_b]
            pooled = ops.compressor_pool(kv_slots, sc_slots)  # [nb, c] fp32
            entries = self.finish(pooled, blocks, ops, cos, sin)
        keep = min(n, 2 * r)  # only the last 2r positions can ever be needed again
        ring_pos = pos[n - keep:] % (2 * r)
        self.kv_ring[slot, ring_pos] = kv_new[n - keep:].to(self.kv_ring.dtype)
        self.score_ring[slot, ring_pos] = sc_new[n - keep:].to(self.score_ring.dtype)
        return j_lo, entries

    def finish(self, pooled: torch.Tensor, blocks: torch.Tensor, ops, cos: torch.Tensor, sin: torch.Tensor):
        """Norm, RoPE at the block's first position, and the KV/indexer quantization simulation: ``pooled [nb, c]``
        (acc) → entries ``[nb, c]`` in act.

        The same compositions as the window KV row (``ops.kv_norm_rope``: RMSNorm, RoPE, the FP8 simulation of the
        non-rope dims) and, for the indexer keys, the indexer queries (``ops.rms_norm`` then ``ops.indexer_query``:
        RoPE, Hadamard, the FP4 simulation) — so a fast backend runs them on its fused kernels."""
        nm = ops.numerics
        rpos = ops.compressed_rope_position(blocks, self.ratio)
        e = pooled.to(nm.act)
        if self.is_indexer:
            e = ops.rms_norm(e, self.norm.weight, self.args.norm_eps)
            return ops.indexer_query(e[:, None], cos, sin, rpos)[:, 0]
        return ops.kv_norm_rope(e, self.norm.weight, self.args.norm_eps, cos, sin, rpos)
