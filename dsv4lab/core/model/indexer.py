"""Lightning indexer of CSA layers (spec §3.6): picks the compressed entries each query attends to.

``qi = wq_b(qr)`` per index head, rotated (last rope dims), Hadamard-transformed and FP4-simulated; keys come from
the indexer's own ratio-4 compressor. ``score[t] = Σ_h relu(qi_h·K[t])·w_h`` with ``w = weights_proj(x)·scale``;
a query at position ``p`` may pick only completed entries ``t < (p+1)//4``; it attends to the top
``min(index_topk, (p+1)//4)`` of them, listed by descending score (the order sparse attention's online softmax
sees them in).

Tie rule (a spec note): DeepSeek's code leaves the order of equal scores to ``torch.topk``, which does not
specify it — on CUDA the lowest index came first (torch 2.11, observed), torch on the CPU does not promise that.
Ties are frequent: ReLU'd scores are exactly 0 for a key no head responds to, and bf16 scores collide. dsv4lab
fixes the rule on every backend and device: equal scores go to the lower entry index (a stable descending sort;
the Triton top-k kernel sorts the same keys). Near the top-k cut a tie decides which entry is attended, so an
implementation with another tie order is correct but not bit-comparable there; the MoE router
(:mod:`dsv4lab.core.model.moe`) follows the same rule for its expert choice.
"""
from __future__ import annotations

import torch
from torch import nn

from dsv4lab.core.config import ModelArgs
from dsv4lab.core.model.compressor import Compressor
from dsv4lab.core.model.linear import Linear


class Indexer(nn.Module):
    def __init__(self, args: ModelArgs, n_local_heads: int):
        super().__init__()
        self.args = args
        self.n_local_heads = n_local_heads
        self.head_dim = args.index_head_dim
        self.wq_b = Linear(args.q_lora_rank, n_local_heads * args.index_head_dim, args.dtype)
        self.weights_proj = Linear(args.dim, n_local_heads, "bf16")
        self.compressor = Compressor(args, 4, args.index_head_dim, is_indexer=True)

    def queries(self, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                ops) -> torch.Tensor:
        """``qr [b, s, q_lora]`` → ``qi [b, s, h, d]``: rotated at ``positions [b, s]`` of the layer's tables
        ``cos, sin``, Hadamard-transformed, FP4-simulated (``ops.indexer_query``)."""
        b, s, _ = qr.shape
        qi = ops.linear(qr, self.wq_b).view(b, s, self.n_local_heads, self.head_dim)
        return ops.indexer_query(qi, cos, sin, positions)

    def head_weights(self, x: torch.Tensor, ops) -> torch.Tensor:
        """``w [b, s, h] = weights_proj(x) · index_head_dim^-0.5 · index_n_heads^-0.5`` (in act)."""
        return ops.linear(x, self.weights_proj) * self.args.index_scale


def select_topk(scores: torch.Tensor, positions: torch.Tensor, ratio: int, topk: int) -> torch.Tensor:
    """Causal top-k over compressed entries.

    ``scores [b, s, T]`` for entries ``0..T-1``; ``positions [b, s]``. Entry ``t`` is visible to a query at
    ``p`` iff ``t < (p+1)//ratio``. Returns ``[b, s, min(topk, T)]`` entry indices, −1 where fewer are visible.
    Ties go to the lower index (stable sort).
    """
    b, s, T = scores.shape
    k = min(topk, T)
    if k == 0:
        return torch.empty(b, s, 0, dtype=torch.long, device=scores.device)
    visible = torch.arange(T, device=scores.device)[None, None, :] < ((positions + 1) // ratio)[..., None]
    masked = scores.to(torch.promote_types(scores.dtype, torch.float32)).masked_fill(~visible, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :k]
    picked_visible = torch.gather(visible, -1, order)
    return torch.where(picked_visible, order, torch.full_like(order, -1))
