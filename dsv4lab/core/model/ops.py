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

from dsv4lab.core import quant
from dsv4lab.core.model.indexer import select_topk
from dsv4lab.core.model.linear import ExpertBank, Linear
from dsv4lab.core.model.mhc import hc_head, hc_post, hc_pre
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.rope import apply_rope

NON_FINITE = -1
"""The id a row with a non-finite logit reports (:func:`greedy_ids`; :mod:`dsv4lab.engine.finite`)."""


def greedy_ids(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [b, vocab]`` → ``(feed, report)``: each row's argmax (the token fed to the next step on the device)
    and the same ids with :data:`NON_FINITE` where the row holds a NaN or ±Inf (what the host reads)."""
    ids = logits.argmax(-1)
    return ids, torch.where(torch.isfinite(logits).all(-1), ids, NON_FINITE)


class ReferenceOps:
    """Plain-torch implementations (the oracle every kernel is compared with)."""

    name = "reference"

    def __init__(self, numerics: Numerics):
        self.numerics = numerics

    # ---------------------------------------------------------------- projections
    def linear(self, x: torch.Tensor, lin: Linear, all_reduce=None) -> torch.Tensor:
        """``x [..., in] → [..., out]``: activation quantization (if on for this projection), fp32 accumulation,
        output in ``act``. ``all_reduce`` (tensor parallelism: a row-split projection) sums the ranks' partial
        products before the result is rounded, so a split projection rounds exactly like the whole one."""
        nm = self.numerics
        if nm.act_quant and lin.act_quant:
            xq = quant.act_qdq_fp8(x)  # exact E4M3 values × power-of-two scales
        else:
            xq = x
        y = xq.to(nm.calc) @ lin.dequantized(nm.calc).T
        if all_reduce is not None:
            y = all_reduce(y)
        return y.to(nm.acc).to(nm.act)

    def _matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x @ wᵀ`` evaluated in ``calc`` and rounded to ``acc`` (see :class:`Numerics`)."""
        nm = self.numerics
        return (x.to(nm.calc) @ w.to(nm.calc).T).to(nm.acc)

    def linear_f32(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        """An fp32 projection (router gate, compressor wkv/wgate, head): ``x.float() @ W.float()ᵀ`` in ``acc``."""
        return self._matmul(x, lin.dequantized(self.numerics.calc))

    def linear_group(self, x: torch.Tensor, lins: tuple[Linear, ...]) -> tuple[torch.Tensor, ...]:
        """Several projections of one input, :meth:`linear` each — one op, so that a fast backend may compute them
        in one launch (their weights stored side by side: :mod:`dsv4lab.engine.decode_groups`)."""
        return tuple(self.linear(x, lin) for lin in lins)

    def linear_f32_group(self, x: torch.Tensor, lins: tuple[Linear, ...]) -> tuple[torch.Tensor, ...]:
        """:meth:`linear_f32` of one input by several weights (the compressors' ``wkv``/``wgate``), as one op."""
        return tuple(self.linear_f32(x, lin) for lin in lins)

    def projections(self, x: torch.Tensor, calls: tuple) -> tuple[torch.Tensor, ...]:
        """Several projections of one input, as one op: ``calls`` names each as ``(op, weights)`` — ``("linear",
        lin)``, ``("linear_f32", lin)``, ``("linear_group", lins)``, ``("linear_f32_group", lins)`` — and the result
        is every output of every call, flattened in order (a group's members one after the other). A fast backend
        runs them in one launch (the decode step's fused path ``x_projections``: the attention input's FP8 q/KV
        projections, its compressors' BF16 projections and the indexer's head weights)."""
        out: list[torch.Tensor] = []
        for op, w in calls:
            y = getattr(self, op)(x, w)
            out += list(y) if isinstance(y, tuple) else [y]
        return tuple(out)

    def grouped_wo_a(self, o: torch.Tensor, lin: Linear, groups: int) -> torch.Tensor:
        """``o [b,s,G,in_g] → [b,s,G,rank]`` with ``wo_a`` viewed as ``[G, rank, in_g]`` (bf16 einsum in the
        reference: no activation quantization, fp32 accumulation, bf16 output)."""
        nm = self.numerics
        w = lin.dequantized(nm.calc).view(groups, -1, o.shape[-1])
        return torch.einsum("bsgd,grd->bsgr", o.to(nm.calc), w).to(nm.acc).to(nm.act)

    # ---------------------------------------------------------------- elementwise
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm in ``acc`` with the weight in ``acc``; result in ``x.dtype``."""
        nm = self.numerics
        xf = x.to(nm.acc)
        ms = xf.to(nm.calc).square().mean(-1, keepdim=True).to(nm.acc)
        xf = xf * self.elementwise(torch.rsqrt, ms + eps)
        return (weight.to(nm.acc) * xf).to(x.dtype)

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
        return self.elementwise(F.silu, gate) * up

    def elementwise(self, fn, x: torch.Tensor) -> torch.Tensor:
        """A transcendental function evaluated in ``calc`` and rounded to ``x.dtype`` (correctly rounded, so the
        result does not depend on which vectorised libm variant the CPU runs)."""
        return fn(x.to(self.numerics.calc)).to(x.dtype)

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

    def expert_down(self, g: torch.Tensor, u: torch.Tensor, w2: Linear, limit: float) -> torch.Tensor:
        """A shared expert after its gate and up projections ``g, u`` (act, as :meth:`linear` returns them): the
        clamped SwiGLU in acc, rounded to act, and the down projection — :meth:`expert_mlp`'s second half (the decode
        step computes ``g, u`` with the router logits in one op, :meth:`projections`)."""
        acc = self.numerics.acc
        return self.linear(self.swiglu(g.to(acc), u.to(acc), limit, shared=True).to(self.numerics.act), w2)

    def moe_stage1(self, x: torch.Tensor, idx: torch.Tensor, bank: ExpertBank) -> tuple[torch.Tensor, torch.Tensor]:
        """Gate/up projections of each token's routed experts: ``x [T, D]``, ``idx [T, k]`` →
        ``(g, u) [T, k, I]`` in acc (each rounded to act first, as the reference's Linear outputs bf16).
        Slots whose expert is not in ``bank`` (another expert-parallel rank) are NaN."""
        nm = self.numerics
        T, k = idx.shape
        g = torch.full((T, k, bank.inter), float("nan"), dtype=nm.acc, device=x.device)
        u = g.clone()
        xq = quant.act_qdq_fp8(x) if nm.act_quant else x
        for e in torch.unique(idx).tolist():
            if not bank.owns(e):
                continue
            tok, slot = (idx == e).nonzero(as_tuple=True)
            g[tok, slot] = self._matmul(xq[tok], bank.dequantized("w1", e, nm.calc)).to(nm.act).to(nm.acc)
            u[tok, slot] = self._matmul(xq[tok], bank.dequantized("w3", e, nm.calc)).to(nm.act).to(nm.acc)
        return g, u

    def moe_activation(self, g: torch.Tensor, u: torch.Tensor, weights: torch.Tensor, limit: float) -> torch.Tensor:
        """Clamped SwiGLU times the routing weight: ``[T, k, I]`` in acc."""
        return self.swiglu(g, u, limit) * weights[..., None].to(g.dtype)

    def moe_stage2(self, h: torch.Tensor, idx: torch.Tensor, bank: ExpertBank) -> torch.Tensor:
        """Down projection of each slot: ``h [T, k, I]`` (acc) → ``[T, k, D]`` in acc (act-rounded outputs;
        the input is rounded to act and activation-quantized as the reference's ``w2(bf16(h))``)."""
        nm = self.numerics
        T, k, _ = h.shape
        out = torch.full((T, k, bank.dim), float("nan"), dtype=nm.acc, device=h.device)
        h_act = h.to(nm.act)
        hq = quant.act_qdq_fp8(h_act) if nm.act_quant else h_act
        for e in torch.unique(idx).tolist():
            if not bank.owns(e):
                continue
            tok, slot = (idx == e).nonzero(as_tuple=True)
            out[tok, slot] = self._matmul(hq[tok, slot], bank.dequantized("w2", e, nm.calc)).to(nm.act).to(nm.acc)
        return out

    def moe_combine(self, out: torch.Tensor, idx: torch.Tensor, all_reduce=None) -> torch.Tensor:
        """Σ over slots, skipping NaN slots (experts on other ranks): ``[T, k, D]`` → ``[T, D]`` in acc.

        The slot outputs are act-rounded, so their sum in ``calc`` is exact and independent of order — the
        reference's expert-order fp32 loop, an expert-parallel split and any kernel's order all agree; ``all_reduce``
        sums the ranks' partial sums before rounding."""
        y = torch.nan_to_num(out.to(self.numerics.calc), nan=0.0).sum(1)
        if all_reduce is not None:
            y = all_reduce(y)
        return y.to(self.numerics.acc)

    def moe_output(self, routed: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """The MoE's output: the routed sum ``[T, D]`` (acc) plus each shared expert's output (``shared [S, T, D]``,
        act), added in acc in expert order, rounded to act."""
        y = routed
        for s in shared:
            y = y + s.to(self.numerics.acc)
        return y.to(self.numerics.act)

    def routed_experts(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, bank: ExpertBank,
                       limit: float, trace=None, all_reduce=None) -> torch.Tensor:
        """Σ over each token's routed experts owned by ``bank``: stage 1 → activation → stage 2 → combine.

        ``x [T, D]`` (act), ``idx [T, k]`` global expert ids, ``weights [T, k]`` (acc). Returns ``[T, D]`` in acc.
        ``trace`` (a callable ``(stage, tensor)``) receives the per-slot stage outputs.
        """
        g, u = self.moe_stage1(x, idx, bank)
        h = self.moe_activation(g, u, weights, limit)
        out = self.moe_stage2(h, idx, bank)
        if trace is not None:
            trace("stage1_w1", g)
            trace("stage1_w3", u)
            trace("activation", h)
            trace("stage2_w2", out)
        return self.moe_combine(out, idx, all_reduce)

    # ---------------------------------------------------------------- mHC
    def hc_pre(self, X, fn, base, scale, args):
        return hc_pre(X, fn, base, scale, args, self.numerics.acc, self.numerics.calc)

    def head_rms(self, q: torch.Tensor, eps: float) -> torch.Tensor:
        """Per-head RMS normalisation without weight, in act tensors as the reference does it
        (``q * rsqrt(mean(q²) + eps)`` with bf16 squares, the mean accumulated wider and rounded to act)."""
        act = q.dtype
        ms = q.square().to(self.numerics.calc).mean(-1, keepdim=True).to(self.numerics.acc).to(act)
        return q * self.elementwise(torch.rsqrt, ms + eps)

    def router_scores(self, logits: torch.Tensor, score_func: str) -> torch.Tensor:
        """Router scores from fp32 logits (``sqrt(softplus)`` for DeepSeek-V4), evaluated in calc."""
        calc, acc = self.numerics.calc, self.numerics.acc
        lc = logits.to(calc)
        if score_func == "sqrtsoftplus":
            s = F.softplus(lc).sqrt()
        elif score_func == "sigmoid":
            s = lc.sigmoid()
        else:
            s = lc.softmax(-1)
        return s.to(acc)

    def hc_post(self, out, X, post, comb):
        return hc_post(out, X, post, comb, self.numerics.calc)

    def hc_head(self, X, fn, base, scale, args):
        return hc_head(X, fn, base, scale, args, self.numerics.acc, self.numerics.calc)

    # ---------------------------------------------------------------- compressor and indexer
    def compressor_pool(self, kv_slots: torch.Tensor, sc_slots: torch.Tensor) -> torch.Tensor:
        """Per channel softmax over the slots of each entry: ``[nb, slots, c]`` × 2 → ``[nb, c]`` (acc)."""
        calc, acc = self.numerics.calc, self.numerics.acc
        w = sc_slots.to(calc).softmax(1).to(acc)  # the softmax's exp and sum in calc
        return (w.to(calc) * kv_slots.to(calc)).sum(1).to(acc)

    def indexer_scores(self, qi: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, all_reduce=None) -> torch.Tensor:
        """``Σ_h relu(qi_h·K_t)·w_h``: ``qi [b,s,h,d]``, ``w [b,s,h]``, ``keys [b,T,d]`` → ``[b,s,T]`` in act (each
        dot product accumulated in fp32 and rounded to bf16, then the bf16 head sum, as the reference;
        ``all_reduce`` adds the other ranks' heads before rounding)."""
        act, calc = self.numerics.act, self.numerics.calc
        dots = torch.einsum("bshd,btd->bsht", qi.to(calc), keys.to(calc)).to(self.numerics.acc).to(act)
        y = (dots.relu() * w[..., None]).to(calc).sum(2)
        if all_reduce is not None:
            y = all_reduce(y)
        return y.to(self.numerics.acc).to(act)

    def indexer_topk(self, scores: torch.Tensor, positions: torch.Tensor, ratio: int, topk: int) -> torch.Tensor:
        return select_topk(scores, positions, ratio, topk)

    def indexer_select(self, qi: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                       ratio: int, topk: int, all_reduce=None) -> torch.Tensor:
        """The indexer's selection, :meth:`indexer_scores` then :meth:`indexer_topk`: ``[b, s, min(topk, T)]``
        entry indices (−1 = none). One op, so a fast path may score only the keys a query can see and never
        materialise the scores."""
        return self.indexer_topk(self.indexer_scores(qi, w, keys, all_reduce=all_reduce), positions, ratio, topk)

    # ---------------------------------------------------------------- attention
    def sparse_attention(self, q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                         scale: float) -> torch.Tensor:
        """Attention with a sink over gathered KV rows (K = V), rounded as DeepSeek's ``sparse_attn`` kernel.

        ``q [b, s, h, d]``, ``kv [b, n, d]``, ``idx [b, s, k]`` row indices into ``kv`` (−1 = masked),
        ``sink [h]`` (acc). Returns ``[b, s, h, d]`` in act.

        Scores ``z = q·kv·scale`` in acc. The kernel is an online softmax over blocks of ``B =
        numerics.attention_block`` (64) indices in the order of ``idx``: block ``t`` takes its probabilities
        ``e = exp(z − m_t)`` (acc) against the running max ``m_t`` of blocks ``0..t`` and rounds them to act for
        P·V, and rescales what it accumulated by ``exp(m_{t−1} − m_t)`` whenever the max grows. Here each block's
        total rescaling is one factor ``c_t = exp(m_t − M)`` (acc, ``M`` the final max) and the sums are exact:
        numerator ``Σ_t c_t·Σ act(e)·kv``, denominator ``Σ_t c_t·Σ e + exp(sink − M)``, each rounded to acc, then
        ``num / den`` in act. So the order of ``idx`` matters (the caller lists the window oldest first, then the
        compressed entries, as DeepSeek does); masked slots anywhere contribute nothing, even when the row they
        alias is NaN-poisoned; a query with no visible row gets 0.
        """
        nm = self.numerics
        b, s, h, d = q.shape
        k = idx.shape[-1]
        valid = idx >= 0
        g = torch.gather(kv, 1, idx.clamp_min(0).reshape(b, -1, 1).expand(-1, -1, d)).reshape(b, s, -1, d)
        g = torch.where(valid[..., None], g.to(nm.calc), 0.0)
        z = (torch.einsum("bshd,bskd->bshk", q.to(nm.calc), g).to(nm.acc) * scale)
        z = z.masked_fill(~valid[:, :, None, :], float("-inf"))
        blk = nm.attention_block or max(k, 1)
        nb = max(1, -(-k // blk))
        pad = nb * blk - k
        zb = F.pad(z, (0, pad), value=float("-inf")).unflatten(-1, (nb, blk))  # [b, s, h, nb, B]
        m_run = zb.amax(-1).cummax(-1).values  # running max after each block, −inf before the first visible row
        seen = torch.isfinite(m_run)
        m_run = torch.where(seen, m_run, 0.0)
        e = self.elementwise(torch.exp, zb - m_run[..., None])
        m_final = m_run[..., -1:]
        c = torch.where(seen, self.elementwise(torch.exp, m_run - m_final), 0.0).to(nm.calc)[..., None]
        denom = (c * e.to(nm.calc)).sum((-2, -1)).to(nm.acc)[..., None] + self.elementwise(
            torch.exp, sink.to(nm.acc)[None, None, :, None] - m_final)
        gb = F.pad(g, (0, 0, 0, pad)).unflatten(2, (nb, blk))  # [b, s, nb, B, d]
        num = torch.einsum("bshtk,bstkd->bshd", c * e.to(nm.act).to(nm.calc), gb).to(nm.acc)
        return (num / denom).to(nm.act)

    def attention_from_caches(self, q: torch.Tensor, win_kv: torch.Tensor, win_rows: torch.Tensor,
                              cmp_kv: torch.Tensor | None, cmp_rows: torch.Tensor | None, slots: torch.Tensor,
                              sink: torch.Tensor, scale: float, cos: torch.Tensor | None = None,
                              sin: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                              cmp_ratio: int = 0) -> torch.Tensor:
        """Decode attention over rows of two caches: ``q [b, h, d]``; the window ring ``win_kv [slots, W, d]`` with
        ``win_rows [b, W]`` and optionally the compressed cache ``cmp_kv [slots, C, d]`` with ``cmp_rows [b, K]``
        (−1 = masked), row ``i`` reading cache slot ``slots[i]``. The selected rows of both caches, side by side,
        through :meth:`sparse_attention` (a fast backend reads them in place instead). With the layer's tables
        ``cos, sin`` and ``positions [b]`` the output then gets the inverse rotation (:meth:`rope`, ``inverse``).
        ``cmp_ratio > 0`` tells a fast backend that only the first ``(p+1) // cmp_ratio`` entries of a row's
        ``cmp_rows`` can be valid (the rest are −1), so it may skip them. Returns ``[b, h, d]``."""
        kv, rows = win_kv[slots], win_rows
        if cmp_kv is not None:
            kv = torch.cat((kv, cmp_kv[slots].to(kv.dtype)), 1)
            rows = torch.cat((win_rows, torch.where(cmp_rows >= 0, cmp_rows + win_kv.shape[1], -1)), 1)
        o = self.sparse_attention(q[:, None], kv, rows[:, None], sink, scale)[:, 0]
        if cos is not None:
            o = self.rope(o, cos[positions][:, None], sin[positions][:, None], inverse=True)
        return o

    # ---------------------------------------------------------------- fused ops: compositions of the ops above
    # A fast backend runs each on one or two kernels (kernels/dsv4lab_kernels/mhc.py, norm_rope_quant.py, compressor_decode.py,
    # router.py, indexer_decode.py); here each is literally the composition of the ops it fuses, so the reference
    # forward stays one readable path and verification sees a fused op as one stage.
    def hc_pre_norm(self, X, fn, base, scale, norm_weight, args):
        """:meth:`hc_pre` then the sub-layer's RMSNorm: ``X [b,s,n,D]`` → ``(x [b,s,D] act, post, comb)``."""
        u, post, comb = self.hc_pre(X, fn, base, scale, args)
        return self.rms_norm(u, norm_weight, args.norm_eps), post, comb

    def hc_post_pre_norm(self, out, X, post, comb, fn, base, scale, norm_weight, args):
        """:meth:`hc_post` of one sub-layer, then :meth:`hc_pre_norm` of the next: ``(X', x, post', comb')``."""
        X = self.hc_post(out, X, post, comb)
        return (X, *self.hc_pre_norm(X, fn, base, scale, norm_weight, args))

    def moe_post_pre_norm(self, x, idx, weights, bank: ExpertBank, limit: float, shared, X, post, comb, fn, base,
                          scale, norm_weight, args, all_reduce=None):
        """The end of a MoE sub-layer and the mHC site after it, as one op: :meth:`routed_experts` of ``x [T, D]``
        (its combine included), :meth:`moe_output` with the shared experts' outputs ``shared [S, T, D]``, then
        :meth:`hc_post_pre_norm` of the next sub-layer on the streams ``X [..., n, D]`` (``T`` = their rows) →
        ``(X', x', post', comb')``. A fast backend sums the routed slots and the shared outputs in the site's
        prologue (one launch for the combine, the output and the site)."""
        y = self.routed_experts(x, idx, weights, bank, limit, all_reduce=all_reduce)
        out = self.moe_output(y, shared).view(*X.shape[:-2], X.shape[-1])
        return self.hc_post_pre_norm(out, X, post, comb, fn, base, scale, norm_weight, args)

    def head_rms_rope(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                      eps: float) -> torch.Tensor:
        """Query heads ``q [..., H, d]``: :meth:`head_rms`, then :meth:`rope` at ``positions`` (shape
        ``q.shape[:-2]``) of the layer's tables ``cos, sin [P, r/2]``."""
        q = self.head_rms(q, eps)
        return self.rope(q, cos[positions][..., None, :], sin[positions][..., None, :])

    def kv_norm_rope(self, kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                     positions: torch.Tensor, ring: torch.Tensor | None = None,
                     slots: torch.Tensor | None = None) -> torch.Tensor:
        """The window KV row ``kv [..., d]``: RMSNorm, RoPE of the last ``r`` dims at ``positions``, the KV FP8
        simulation of the others. With ``ring [slots, W, d]`` (one token per row) the row is also written to
        ``ring[slots[i], positions[i] mod W]``."""
        kv = self.rope(self.rms_norm(kv, weight, eps), cos[positions], sin[positions])
        if self.numerics.kv_fp8_sim:
            nope = kv.shape[-1] - 2 * cos.shape[-1]
            kv = torch.cat((quant.fp8_qdq(kv[..., :nope], 64), kv[..., nope:]), -1)
        if ring is not None:
            ring[slots, positions.reshape(-1) % ring.shape[1]] = kv.reshape(slots.shape[0], -1).to(ring.dtype)
        return kv

    def indexer_query(self, qi: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      positions: torch.Tensor) -> torch.Tensor:
        """The indexer's query heads ``qi [..., h, d]``: RoPE at ``positions``, Hadamard, FP4 simulation."""
        qi = self.rope(qi, cos[positions][..., None, :], sin[positions][..., None, :])
        qi = quant.hadamard_transform(qi)
        return quant.fp4_qdq(qi, 32) if self.numerics.indexer_fp4_sim else qi

    def attention_norms(self, q_a: torch.Tensor, q_weight: torch.Tensor, kv: torch.Tensor, kv_weight: torch.Tensor,
                        eps: float, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                        ring: torch.Tensor | None = None,
                        slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's two norms after its first projections, as one op: :meth:`rms_norm` of the query latent
        ``q_a`` (``q_norm``) and :meth:`kv_norm_rope` of the window KV row ``kv`` (its ring write included) →
        ``(qr, kv')``. A fast backend runs both in one launch (the decode step's fused path ``attention_norms``)."""
        return self.rms_norm(q_a, q_weight, eps), self.kv_norm_rope(kv, kv_weight, eps, cos, sin, positions, ring,
                                                                     slots)

    def query_heads(self, q: torch.Tensor, qi: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    positions: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The query heads and the indexer's query heads of the same rows, as one op: :meth:`head_rms_rope` of ``q``
        and :meth:`indexer_query` of ``qi`` → ``(q', qi')``. A fast backend runs both in one launch (the decode
        step's fused path ``query_heads``)."""
        return self.head_rms_rope(q, cos, sin, positions, eps), self.indexer_query(qi, cos, sin, positions)

    def compressor_pair(self, comp_a, kv_a: torch.Tensor, score_a: torch.Tensor, cache_a: torch.Tensor, comp_b,
                        kv_b: torch.Tensor, score_b: torch.Tensor, cache_b: torch.Tensor, positions: torch.Tensor,
                        slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Two compressors of one layer fed the same token rows (a CSA layer's indexer keys ``comp_a`` and main
        entries ``comp_b``), as one op: :meth:`compressor_step` of each, in that order (their states are disjoint).
        A fast backend runs both in one launch (the decode step's fused path ``compressor_pair``)."""
        self.compressor_step(comp_a, kv_a, score_a, positions, slots, cache_a, cos, sin)
        self.compressor_step(comp_b, kv_b, score_b, positions, slots, cache_b, cos, sin)

    def indexer_select_decode(self, qi: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor,
                              positions: torch.Tensor, topk: int, all_reduce=None,
                              w_scale: float = 1.0) -> torch.Tensor:
        """Decode: each row's top-``topk`` visible entries of its index-key cache. ``qi [b, h, d]``, the head
        weights ``w [b, h] · w_scale`` (an act product, as ``Indexer.head_weights``), ``keys [slots, T, d]`` read at
        ``slots [b]``, ``positions [b]`` → ``[b, min(topk, T)]`` (−1 = none): :meth:`indexer_scores`, then
        :meth:`indexer_topk` (the decode form of :meth:`indexer_select`: keys read in place from the cache)."""
        w = w * w_scale if w_scale != 1.0 else w
        scores = self.indexer_scores(qi[:, None], w[:, None], keys[slots], all_reduce=all_reduce)
        return self.indexer_topk(scores, positions[:, None], 4, topk)[:, 0]

    def router_topk(self, logits: torch.Tensor, gate, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router after its projection: fp32 ``logits [T, E]`` → ``(idx [T, k], weights [T, k] acc)`` —
        :meth:`router_scores`; the hash table (``gate.tid2eid[ids]``) or the stable top-k of ``scores + bias``
        (ties to the lower expert id); the picked scores renormalised to sum 1, times ``route_scale``."""
        a = gate.args
        scores = self.router_scores(logits, a.score_func)
        if gate.hash_routed:
            idx = gate.tid2eid[ids.clamp(0, a.vocab_size - 1)]
        else:
            biased = scores + gate.bias.to(scores.dtype)
            idx = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, : a.n_activated_experts]
        weights = scores.gather(1, idx)
        if a.score_func != "softmax":
            total = weights.to(torch.float64).sum(-1, keepdim=True).to(weights.dtype)  # exact-order independent
            weights = weights / total
        return idx, weights * a.route_scale

    def compressor_step(self, comp, kv: torch.Tensor, score: torch.Tensor, positions: torch.Tensor,
                        slots: torch.Tensor, cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Decode: feed one token per row into the compressor ``comp`` and write the entry of every block the token
        completes. ``kv, score [b, width]`` are its fp32 projections (``ape`` not yet added); the token at
        ``positions[i]`` goes into the ring of ``slots[i]``; the candidate block ``p // r`` is pooled
        (:meth:`compressor_pool`), finished (norm, RoPE, quantization simulation) and written to
        ``cache[slots[i], p // r]`` where ``(p + 1) % r == 0``.

        Several tokens per row (a static decode step of ``T`` tokens per sequence): ``kv, score [b, T, width]`` at
        ``positions [b, T]``, each row's tokens in order — ``T`` successive one-token steps, token ``t`` of every
        row in the ``t``-th (a row may repeat its last token at its last position: the repeat rewrites the same
        values)."""
        if kv.ndim == 3:
            for t in range(kv.shape[1]):
                self.compressor_step(comp, kv[:, t], score[:, t], positions[:, t], slots, cache, cos, sin)
            return
        r, c = comp.ratio, comp.channels
        score = score + comp.ape.to(score.dtype)[positions % r]
        ring_row = positions % (2 * r)
        comp.kv_ring[slots, ring_row] = kv.to(comp.kv_ring.dtype)
        comp.score_ring[slots, ring_row] = score.to(comp.score_ring.dtype)
        block = positions // r
        offs = torch.arange(r, device=kv.device)[None, :]
        ring_b = (block[:, None] * r + offs) % (2 * r)  # the candidate block's positions in the ring
        kv_ring, sc_ring = comp.kv_ring[slots], comp.score_ring[slots]
        gather = lambda t, rows: torch.gather(t, 1, rows[..., None].expand(-1, -1, t.shape[-1]))  # noqa: E731
        if comp.overlap:  # half A of the previous block (empty for block 0: reset ring rows), half B of this one
            ring_a = (block[:, None] * r - r + offs) % (2 * r)
            kv_slots = torch.cat((gather(kv_ring, ring_a)[..., :c], gather(kv_ring, ring_b)[..., c:]), 1)
            sc_slots = torch.cat((gather(sc_ring, ring_a)[..., :c], gather(sc_ring, ring_b)[..., c:]), 1)
        else:
            kv_slots, sc_slots = gather(kv_ring, ring_b), gather(sc_ring, ring_b)
        entry = comp.finish(self.compressor_pool(kv_slots, sc_slots), block, self, cos, sin)
        # an unfinished block's entry is never written; its row may not even exist (the last partial block of
        # max_seq_len has no cache row), so the read-modify-write goes through a clamped row
        done = ((positions + 1) % r == 0)[:, None]
        row = block.clamp(max=cache.shape[1] - 1)
        cache[slots, row] = torch.where(done, entry.to(cache.dtype), cache[slots, row])

    def greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step's greedy choice, inside the step (a captured graph holds it): :func:`greedy_ids`."""
        return greedy_ids(logits)

    # ---------------------------------------------------------------- state hygiene
    def reset_compressor_state(self, compressor, slots: torch.Tensor | None) -> None:
        """Forget the pooling state of ``slots`` (all if None) — a new sequence must not see the previous one's."""
        compressor.clear_state(slots)
