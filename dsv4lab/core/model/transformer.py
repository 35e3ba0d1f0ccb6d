"""The whole DeepSeek-V4 model (spec §3.1): embedding → ``hc_mult`` streams → blocks → ``hc_head`` → norm → head.

Module attribute names equal the checkpoint's tensor names (``layers.3.attn.wq_b.weight`` ...), except the routed
experts, which are stacked per layer (``layers.L.ffn.experts.w1`` = all ``layers.L.ffn.experts.{e}.w1.weight``).
"""
from __future__ import annotations

import torch
from torch import nn

from dsv4lab.core.config import ModelArgs
from dsv4lab.core.model.block import Block, MTPBlock
from dsv4lab.core.model.linear import ExpertBank, Linear
from dsv4lab.core.model.norm import RMSNorm


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.register_buffer("weight", torch.empty(vocab, dim, dtype=torch.bfloat16, device="meta"))


class Transformer(nn.Module):
    """The model with its caches. ``forward`` serves prefill, chunked prefill and decode; see :meth:`forward`.

    Args:
        args: the architecture.
        tp_size: tensor-parallel ranks (attention heads, o-groups and indexer heads split across them).
        n_local_experts / expert_offset: the routed experts this rank holds (expert parallelism).
    """

    def __init__(self, args: ModelArgs, tp_size: int = 1, n_local_experts: int | None = None,
                 expert_offset: int = 0):
        super().__init__()
        self.args = args
        self.embed = Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, i, tp_size, n_local_experts, expert_offset)
                                    for i in range(args.n_layers))
        self.mtp = nn.ModuleList(MTPBlock(args, args.n_layers + j, tp_size, n_local_experts, expert_offset)
                                 for j in range(args.n_mtp_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.head = Linear(args.dim, args.vocab_size, "bf16")
        self.register_buffer("hc_head_fn", torch.empty(args.hc_mult, args.hc_dim, dtype=torch.float32, device="meta"))
        self.register_buffer("hc_head_base", torch.empty(args.hc_mult, dtype=torch.float32, device="meta"))
        self.register_buffer("hc_head_scale", torch.empty(1, dtype=torch.float32, device="meta"))
        self.max_batch = 0
        self.spare_slot: int | None = None
        self.step_tokens = 1

    # ------------------------------------------------------------------ caches
    def blocks(self):
        return list(self.layers) + list(self.mtp)

    def allocate(self, max_batch: int, act: torch.dtype, acc: torch.dtype, device, spare_slot: bool = True,
                 step_tokens: int = 1) -> None:
        """Caches for ``max_batch`` sequences, plus (``spare_slot``) one more slot, ``spare_slot = max_batch``, that
        no sequence owns: the decode graphs pad a batch up to its tier there (:mod:`dsv4lab.engine.decode_graph`).
        ``step_tokens``: the most tokens one static decode step may carry per sequence (the window rings get
        ``step_tokens − 1`` more rows)."""
        self.max_batch = max_batch
        self.spare_slot = max_batch if spare_slot else None
        self.step_tokens = step_tokens
        for blk in self.blocks():
            blk.attn.allocate(max_batch + int(spare_slot), self.args.max_seq_len, act, acc, device, step_tokens)

    def reset(self, slots: torch.Tensor | None, ops) -> None:
        for blk in self.blocks():
            blk.attn.reset(slots, ops)

    # ------------------------------------------------------------------ forward
    def hidden(self, tokens: torch.Tensor, start: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, ops,
               all_reduce=None, trace=None) -> torch.Tensor:
        """Final streams ``X [b, n, hc, D]`` (act) after all main layers."""
        nm = ops.numerics
        h = self.embed.weight[tokens].to(nm.act)
        X = h[:, :, None, :].expand(-1, -1, self.args.hc_mult, -1).contiguous()
        if trace:
            trace("embed", h)
        for i, blk in enumerate(self.layers):
            tr = (lambda k, v, i=i: trace(f"layers.{i}.{k}", v)) if trace else None
            X = blk(X, start, lengths, slots, tokens, ops, all_reduce, tr)
        return X

    def logits(self, y: torch.Tensor, ops, norm: RMSNorm | None = None) -> torch.Tensor:
        """``head(norm(y))`` in acc (the reference runs the head in fp32)."""
        yn = ops.rms_norm(y, (norm or self.norm).weight, self.args.norm_eps)
        return ops.linear_f32(yn, self.head)

    def forward(self, tokens, start, lengths, slots, ops, all_reduce=None, trace=None, return_hidden=False,
                last_only=False):
        """Logits ``[b, n, vocab]`` (acc) of every position, or with ``last_only`` ``[b, 1, vocab]`` of each row's
        last valid token (``lengths − 1``): what a prefill needs to sample the first token, without the head's
        ``n``-row GEMM."""
        X = self.hidden(tokens, start, lengths, slots, ops, all_reduce, trace)
        Xh = X
        if last_only:
            rows = torch.arange(X.shape[0], device=X.device)
            Xh = X[rows, (lengths - 1).clamp(min=0)][:, None]
        y = ops.hc_head(Xh, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.args)
        logits = self.logits(y, ops)
        if trace:
            trace("final_hidden", y)
        return (logits, X) if return_hidden else logits

    def forward_mtp(self, X, next_ids, start, lengths, slots, ops, all_reduce=None, trace=None):
        """The MTP block (``mtp.0``) at the positions of ``X``: position ``start+i`` takes the streams ``X[:, i]``
        and the token ``next_ids[:, i]`` that follows it, and predicts the token after that.

        Returns ``(logits [b, n, vocab] in acc, streams [b, n, hc, D])``; the block's caches advance like the main
        layers'. ``X`` is the main model's :meth:`hidden` output, or — for a chained draft — this block's own
        output streams of the previous position.
        """
        if not len(self.mtp):
            raise ValueError("this model has no MTP block (n_mtp_layers = 0)")
        blk = self.mtp[0]
        tr = (lambda k, v: trace(f"mtp.0.{k}", v)) if trace else None
        next_embed = self.embed.weight[next_ids].to(ops.numerics.act)
        y, Xm = blk.forward_mtp(X, next_embed, start, lengths, slots, next_ids, ops, all_reduce, tr,
                                return_streams=True)
        return ops.linear_f32(y, self.head), Xm


def expert_bank_names(args: ModelArgs, layer_prefix: str) -> dict[str, list[str]]:
    """Checkpoint names stacked into one bank buffer: ``{"w1": [... e.w1.weight ...], "w1_scale": [...]}``."""
    out: dict[str, list[str]] = {}
    for which in ("w1", "w2", "w3"):
        out[which] = [f"{layer_prefix}ffn.experts.{e}.{which}.weight" for e in range(args.n_routed_experts)]
        out[which + "_scale"] = [f"{layer_prefix}ffn.experts.{e}.{which}.scale" for e in range(args.n_routed_experts)]
    return out


__all__ = ["Transformer", "ExpertBank", "expert_bank_names"]
