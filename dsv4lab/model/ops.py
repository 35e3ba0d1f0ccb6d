"""The reference backend: every op a fast path may replace, written plainly in torch.

Model modules never compute these themselves; they call ``self.ops.<op>``. A backend (e.g. the Triton one in
:mod:`dsv4lab.engine.triton_backend`) subclasses :class:`ReferenceOps` and overrides the ops it has kernels for,
inheriting the rest — so every fast path has its reference right here, with the same signature.

Shapes: ``x`` activations are ``[..., features]`` in ``numerics.act``; outputs of linears are in ``act`` too
(the reference's Linear outputs bf16); fp32 math is done in ``numerics.acc``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import quant
from .linear import ExpertBank, Linear
from .numerics import Numerics
from .rope import apply_rope


class ReferenceOps:
    """Plain-torch implementations (the oracle every kernel is compared with)."""

    name = "reference"

    def __init__(self, numerics: Numerics):
        self.numerics = numerics

    # ---------------------------------------------------------------- projections
    def linear(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        """``x [..., in] → [..., out]``: activation quantization (if on for this projection), fp32 accumulation,
        output in ``act``."""
        nm = self.numerics
        if nm.act_quant and lin.act_quant:
            xq = quant.act_qdq_fp8(x)  # exact E4M3 values × power-of-two scales, in acc
        else:
            xq = x.to(nm.acc)
        return (xq @ lin.dequantized(nm.acc).T).to(nm.act)

    def linear_f32(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        """An fp32 projection (router gate, compressor wkv/wgate, head): ``x.float() @ W.float()ᵀ`` in ``acc``."""
        nm = self.numerics
        return x.to(nm.acc) @ lin.dequantized(nm.acc).T

    def grouped_wo_a(self, o: torch.Tensor, lin: Linear, groups: int) -> torch.Tensor:
        """``o [b,s,G,in_g] → [b,s,G,rank]`` with ``wo_a`` viewed as ``[G, rank, in_g]`` (bf16 einsum in the
        reference: no activation quantization, fp32 accumulation, bf16 output)."""
        nm = self.numerics
        w = lin.dequantized(nm.acc).view(groups, -1, o.shape[-1])
        return torch.einsum("bsgd,grd->bsgr", o.to(nm.acc), w).to(nm.act)

    # ---------------------------------------------------------------- elementwise
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm in ``acc`` with the weight in ``acc``; result in ``x.dtype``."""
        xf = x.to(self.numerics.acc)
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        return (weight.to(self.numerics.acc) * xf).to(x.dtype)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate the last ``2·cos.shape[-1]`` dims of ``x`` (interleaved pairs)."""
        r = 2 * cos.shape[-1]
        out = x.clone()
        out[..., -r:] = apply_rope(x[..., -r:], cos, sin, inverse=inverse)
        return out

    def compressed_rope_position(self, block: torch.Tensor, ratio: int) -> torch.Tensor:
        """Position whose rotation a compressed entry of ``block`` gets: the block's first token, ``j·r``."""
        return block * ratio

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float, shared: bool = False) -> torch.Tensor:
        """Clamped SwiGLU in ``acc`` (routed and shared experts alike clamp: up to ±limit, gate ≤ limit)."""
        if limit > 0:
            up = up.clamp(-limit, limit)
            gate = gate.clamp(max=limit)
        return F.silu(gate) * up

    # ---------------------------------------------------------------- experts
    def expert_mlp(self, x: torch.Tensor, w1: Linear, w2: Linear, w3: Linear, limit: float,
                   weight: torch.Tensor | None = None, shared: bool = False) -> torch.Tensor:
        """One SwiGLU expert (the shared expert, or a routed one given as Linears): output in ``act``."""
        acc = self.numerics.acc
        g = self.linear(x, w1).to(acc)
        u = self.linear(x, w3).to(acc)
        h = self.swiglu(g, u, limit, shared=shared)
        if weight is not None:
            h = weight.to(acc) * h
        return self.linear(h.to(self.numerics.act), w2)

    def routed_experts(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, bank: ExpertBank,
                       limit: float, trace=None) -> torch.Tensor:
        """Σ over each token's routed experts owned by ``bank``, accumulated in ``acc`` in expert-id order.

        ``x [T, D]`` (act), ``idx [T, k]`` global expert ids, ``weights [T, k]`` (acc). Returns ``[T, D]`` in acc.
        With ``trace`` (a callable ``(stage, tensor)``) the per-slot stage-1/activation/stage-2 values are
        recorded as ``[T, k, ·]`` tensors (NaN where the slot's expert lives on another rank).
        """
        nm = self.numerics
        T, k = idx.shape
        y = torch.zeros(T, bank.dim, dtype=nm.acc, device=x.device)
        if trace is not None:
            st_g = torch.full((T, k, bank.inter), float("nan"), dtype=nm.acc, device=x.device)
            st_u, st_h = st_g.clone(), st_g.clone()
            st_o = torch.full((T, k, bank.dim), float("nan"), dtype=nm.acc, device=x.device)
        xq = quant.act_qdq_fp8(x) if nm.act_quant else x.to(nm.acc)
        for e in torch.unique(idx).tolist():
            if not bank.owns(e):
                continue
            tok, slot = (idx == e).nonzero(as_tuple=True)
            xe = xq[tok]
            g = (xe @ bank.dequantized("w1", e, nm.acc).T).to(nm.act).to(nm.acc)
            u = (xe @ bank.dequantized("w3", e, nm.acc).T).to(nm.act).to(nm.acc)
            h = self.swiglu(g, u, limit) * weights[tok, slot, None].to(nm.acc)
            h_act = h.to(nm.act)
            hq = quant.act_qdq_fp8(h_act) if nm.act_quant else h_act.to(nm.acc)
            out = (hq @ bank.dequantized("w2", e, nm.acc).T).to(nm.act)
            y.index_add_(0, tok, out.to(nm.acc))
            if trace is not None:
                st_g[tok, slot], st_u[tok, slot], st_h[tok, slot], st_o[tok, slot] = g, u, h, out.to(nm.acc)
        if trace is not None:
            trace("stage1_w1", st_g)
            trace("stage1_w3", st_u)
            trace("activation", st_h)
            trace("stage2_w2", st_o)
        return y

    # ---------------------------------------------------------------- attention
    def sparse_attention(self, q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                         scale: float) -> torch.Tensor:
        """Attention with a sink over gathered KV rows (K = V).

        ``q [b, s, h, d]``, ``kv [b, n, d]``, ``idx [b, s, k]`` row indices into ``kv`` (−1 = masked),
        ``sink [h]`` (acc). Scores ``q·kv·scale`` in acc; ``M`` = max over selected scores; numerator
        ``Σ act(exp(z−M))·kv`` in acc; denominator ``Σ exp(z−M) + exp(sink−M)``. Returns ``[b, s, h, d]`` in act.
        """
        nm = self.numerics
        b, s, h, d = q.shape
        valid = idx >= 0
        g = torch.gather(kv, 1, idx.clamp_min(0).reshape(b, -1, 1).expand(-1, -1, d)).reshape(b, s, -1, d)
        # masked slots must contribute nothing even when the row they alias is NaN-poisoned
        g = torch.where(valid[..., None], g.to(nm.acc), 0.0)
        z = torch.einsum("bshd,bskd->bshk", q.to(nm.acc), g) * scale
        z = z.masked_fill(~valid[:, :, None, :], float("-inf"))
        m = z.amax(-1, keepdim=True)
        e = torch.exp(z - m)
        denom = e.sum(-1, keepdim=True) + torch.exp(sink.to(nm.acc)[None, None, :, None] - m)
        num = torch.einsum("bshk,bskd->bshd", e.to(nm.act).to(nm.acc), g)
        return (num / denom).to(nm.act)

    # ---------------------------------------------------------------- state hygiene
    def reset_compressor_state(self, compressor, slots: torch.Tensor | None) -> None:
        """Forget the pooling state of ``slots`` (all if None) — a new sequence must not see the previous one's."""
        compressor.clear_state(slots)


class FaultyReferenceOps(ReferenceOps):
    """The reference with one deliberate bug, for the fault-injection tests of the correctness harness.

    ``fault`` is one of :data:`MODEL_FAULTS`. Each reproduces a bug class public ports shipped (spec §3.11).
    """

    name = "reference+fault"

    def __init__(self, numerics: Numerics, fault: str):
        super().__init__(numerics)
        if fault not in MODEL_FAULTS:
            raise ValueError(f"unknown model fault {fault!r}; known: {', '.join(MODEL_FAULTS)}")
        self.fault = fault
        self.name = f"reference+{fault}"

    def swiglu(self, gate, up, limit, shared=False):
        if shared and self.fault == "no_shared_clamp":
            return F.silu(gate) * up
        return super().swiglu(gate, up, limit, shared)

    def rope(self, x, cos, sin, inverse=False):
        r = 2 * cos.shape[-1]
        if self.fault == "rope_first_half":  # rotating the first rope-dims instead of the last
            out = x.clone()
            out[..., :r] = apply_rope(x[..., :r], cos, sin, inverse=inverse)
            return out
        if self.fault == "rope_non_interleaved":  # NeoX rotate-half pairing
            out = x.clone()
            out[..., -r:] = apply_rope(x[..., -r:], cos, sin, inverse=inverse, interleaved=False)
            return out
        return super().rope(x, cos, sin, inverse)

    def compressed_rope_position(self, block, ratio):
        if self.fault == "compressed_rope_block_end":  # the block's last token instead of its first
            return block * ratio + ratio - 1
        return super().compressed_rope_position(block, ratio)

    def reset_compressor_state(self, compressor, slots):
        if self.fault == "stale_compressor_state":  # the reference keeps stale buffers between sequences
            return
        super().reset_compressor_state(compressor, slots)


MODEL_FAULTS = {
    "no_shared_clamp": "shared expert SwiGLU without the swiglu_limit clamp (transformers #46018 class)",
    "rope_first_half": "RoPE applied to the first rope_head_dim dims instead of the last",
    "rope_non_interleaved": "NeoX (rotate-half) RoPE pairing instead of interleaved pairs",
    "compressed_rope_block_end": "compressed-KV RoPE at the block's last position instead of its first (j·r)",
    "stale_compressor_state": "compressor pooling state not reset between sequences",
}
