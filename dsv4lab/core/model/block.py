"""One transformer block (attention + MoE, each wrapped in mHC) and the MTP block (spec §3.2, §3.9)."""
from __future__ import annotations

import torch
from torch import nn

from dsv4lab.core.config import ModelArgs
from dsv4lab.core.model.attention import Attention
from dsv4lab.core.model.linear import Linear
from dsv4lab.core.model.moe import MoE
from dsv4lab.core.model.norm import RMSNorm


def _f32(*shape) -> torch.Tensor:
    return torch.empty(*shape, dtype=torch.float32, device="meta")


class Block(nn.Module):
    """``X [b, n, hc, D]`` → ``X``: ``X = hc_post(attn(norm(hc_pre(X))))`` then the same around the MoE."""

    def __init__(self, args: ModelArgs, layer: int, tp_size: int = 1, n_local_experts: int | None = None,
                 expert_offset: int = 0):
        super().__init__()
        self.args, self.layer = args, layer
        for site in ("attn", "ffn"):
            self.register_buffer(f"hc_{site}_fn", _f32(args.mix_hc, args.hc_dim))
            self.register_buffer(f"hc_{site}_base", _f32(args.mix_hc))
            self.register_buffer(f"hc_{site}_scale", _f32(3))
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = Attention(args, layer, tp_size)
        self.ffn = MoE(args, layer, n_local_experts, expert_offset)

    def forward(self, X, start, lengths, slots, ids, ops, all_reduce=None, trace=None):
        """``all_reduce``: one callable for every cross-rank sum, or an object whose ``attention`` and ``moe``
        attributes are the callables (or None) of each site, when heads and experts are split over different
        rank groups (see :mod:`dsv4lab.engine.parallel`)."""
        a = self.args
        attn_reduce = getattr(all_reduce, "attention", all_reduce)
        moe_reduce = getattr(all_reduce, "moe", all_reduce)
        b, n = X.shape[:2]
        t_attn = (lambda k, v: trace(f"attn.{k}", v)) if trace else None
        t_ffn = (lambda k, v: trace(f"ffn.{k}", v)) if trace else None
        x, post, comb = ops.hc_pre_norm(X, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale,
                                        self.attn_norm.weight, a)
        if trace:
            trace("mhc.attn_post", post)
            trace("mhc.attn_comb", comb)
        h = self.attn(x, start, lengths, slots, ops, attn_reduce, t_attn)
        # the attention's hc_post and the MoE's hc_pre (+ its norm) as one fused op
        X, x, post, comb = ops.hc_post_pre_norm(h, X, post, comb, self.hc_ffn_fn, self.hc_ffn_base,
                                                self.hc_ffn_scale, self.ffn_norm.weight, a)
        if trace:
            trace("mhc.ffn_post", post)
            trace("mhc.ffn_comb", comb)
        f = self.ffn(x.reshape(b * n, -1), ids.reshape(-1), ops, moe_reduce, t_ffn)
        X = ops.hc_post(f.view(b, n, -1), X, post, comb)
        if trace:
            trace("out", X)
        return X


class MTPBlock(Block):
    """Multi-token prediction block (spec §3.9): at position ``p`` it mixes the main model's final streams of ``p``
    with the embedding of the *next* token ``p+1``, runs one SWA block over its own caches and its own
    ``hc_head``, and predicts token ``p+2`` through the main model's LM head (it has no embedding or head)."""

    def __init__(self, args: ModelArgs, layer: int, tp_size: int = 1, n_local_experts: int | None = None,
                 expert_offset: int = 0):
        super().__init__(args, layer, tp_size, n_local_experts, expert_offset)
        self.e_proj = Linear(args.dim, args.dim, args.dtype)
        self.h_proj = Linear(args.dim, args.dim, args.dtype)
        self.enorm = RMSNorm(args.dim, args.norm_eps)
        self.hnorm = RMSNorm(args.dim, args.norm_eps)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.register_buffer("hc_head_fn", _f32(args.hc_mult, args.hc_dim))
        self.register_buffer("hc_head_base", _f32(args.hc_mult))
        self.register_buffer("hc_head_scale", _f32(1))

    def forward_mtp(self, X_main, next_embed, start, lengths, slots, next_ids, ops, all_reduce=None,
                    trace=None, return_streams=False):
        """``X_main [b, n, hc, D]`` (the streams of positions ``start..``), ``next_embed [b, n, D]`` (act) of the
        tokens one position later → the block's normed hidden state ``[b, n, D]`` (the caller applies the LM
        head), and with ``return_streams`` also the block's output streams ``[b, n, hc, D]`` (before
        ``hc_head``: what a chained draft step feeds back in place of ``X_main``)."""
        a = self.args
        e = ops.rms_norm(next_embed, self.enorm.weight, a.norm_eps)
        xh = ops.rms_norm(X_main, self.hnorm.weight, a.norm_eps)
        Xm = ops.linear(e, self.e_proj)[:, :, None, :] + ops.linear(xh, self.h_proj)
        Xm = self.forward(Xm, start, lengths, slots, next_ids, ops, all_reduce, trace)
        y = ops.hc_head(Xm, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, a)
        y = ops.rms_norm(y, self.norm.weight, a.norm_eps)
        return (y, Xm) if return_streams else y
