"""Kernel-level registry: every op a backend may implement, with random inputs over a grid of shapes.

An op is a method of :class:`dsv4lab.core.model.ops.ReferenceOps` (``linear``, ``routed_experts``, ``moe_stage1``,
``sparse_attention``, ``hc_pre`` ...). A backend *implements* an op by overriding that method; it may also expose
several variants of one op through ``variants(method) -> {name: callable}`` (e.g. the three routed-MoE decode
routes). :func:`implementations` finds them, so a new kernel registers itself by being wired into a backend —
nothing to list twice.

Inputs are fresh random values (never zeros) from a seeded generator, shapes include irregular ones, and rows a
correct kernel must never read are poisoned with NaN (masked attention slots, experts no token picked, cache rows no
query may see, cache slots a step must not write). Every op the reference forward and the engine's static decode
step call has a case — the fused ops of the decode step included (:data:`FUSED_OPS`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from dsv4lab.core import quant
from dsv4lab.core.config import get_preset
from dsv4lab.engine.decode_groups import group
from dsv4lab.engine.triton_prefill import linear_magnitude
from dsv4lab.core.model.compressor import Compressor
from dsv4lab.core.model.linear import ExpertBank, Linear
from dsv4lab.core.model.moe import Gate
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.core.model.rope import rope_table


@dataclass
class OpCase:
    """One registered op: the ops method, input maker, shape grid and the family of its error bound (a label for
    listings: the verdict always comes from :data:`dsv4lab.tools.verify.op_bounds.OP_BOUNDS` of ``method``)."""

    name: str
    method: str
    make: Callable[[dict, torch.Generator, str, Numerics], tuple]
    shapes: list[dict]
    kind: str
    description: str = ""
    numerics: Numerics = field(default_factory=Numerics)


# ------------------------------------------------------------------------------------------ input makers
def randn(gen, *shape, scale=1.0, device="cpu", dtype=torch.float32):
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def make_linear(fmt: str, out_f: int, in_f: int, gen: torch.Generator, device="cpu", act_quant=None) -> Linear:
    """A materialised :class:`Linear` with random weights whose scales span several exponents."""
    lin = Linear(in_f, out_f, fmt, act_quant)
    w = torch.randn(out_f, in_f, generator=gen) * in_f ** -0.5
    if fmt == "fp8":
        mult = torch.exp2(torch.randint(-3, 4, (-(-out_f // 128), -(-in_f // 128)), generator=gen).float())
        w = w * mult.repeat_interleave(128, 0)[:out_f].repeat_interleave(128, 1)[:, :in_f]
        q, s = quant.fp8_block_quantize(w)
    elif fmt == "fp4":
        mult = torch.exp2(torch.randint(-4, 5, (out_f, in_f // 32), generator=gen).float())
        q, s = quant.fp4_quantize(w * mult.repeat_interleave(32, 1))
    else:
        q, s = w.to(torch.bfloat16 if fmt == "bf16" else torch.float32), None
    lin._buffers["weight"] = q.to(device)
    lin._buffers["scale"] = None if s is None else s.to(device)
    return lin


def fp8_linear_case(gen: torch.Generator, n: int, k: int, device="cpu", rows: int = 301):
    """A real-width FP8 projection case of the prefill GEMM checks: ``(x [rows, k] bf16, lin, ref, Σ|terms|)`` —
    the reference's output and the fp64 magnitude its error bound scales with (301 rows: cuBLAS's row padding)."""
    lin = make_linear("fp8", n, k, gen, device)
    x = (torch.randn(rows, k, generator=gen) * 2).to(device, torch.bfloat16)
    return x, lin, ReferenceOps(Numerics()).linear(x, lin), linear_magnitude(x, lin, True)


def grouped_wo_a_case(gen: torch.Generator, device="cpu", groups: int = 8, rows_per_group: int = 1024,
                      k: int = 4096, tokens: int = 300):
    """The grouped ``wo_a`` projection at Flash width: ``(o [tokens, groups, k] bf16, lin, ref [1, tokens, groups,
    rows_per_group], Σ|terms|)`` — FP8 weights, bf16 activations (not quantized, as the reference applies it)."""
    lin = make_linear("fp8", groups * rows_per_group, k, gen, device, act_quant=False)
    o = torch.randn(1, tokens, groups, k, generator=gen).to(device, torch.bfloat16)
    ref = ReferenceOps(Numerics()).grouped_wo_a(o, lin, groups)
    mag = torch.einsum("bsgd,grd->bsgr", o.double().abs(),
                       lin.dequantized(torch.float64).view(groups, rows_per_group, k).abs())
    return o.reshape(tokens, groups, k), lin, ref, mag


def make_bank(n_experts: int, dim: int, inter: int, gen: torch.Generator, device="cpu", offset: int = 0) -> ExpertBank:
    bank = ExpertBank(n_experts, dim, inter, "fp4", offset)
    for which, (n, k) in (("w1", (inter, dim)), ("w3", (inter, dim)), ("w2", (dim, inter))):
        ws, ss = [], []
        for _ in range(n_experts):
            lin = make_linear("fp4", n, k, gen)
            ws.append(lin.weight)
            ss.append(lin.scale)
        bank._buffers[which] = torch.stack(ws).to(device)
        bank._buffers[which + "_scale"] = torch.stack(ss).to(device)
    return bank


def routing(gen, T: int, n_experts: int, k: int, device="cpu", skip: int = 2):
    """Distinct experts per token, never picking the last ``skip`` experts (so some experts get no token)."""
    keys = torch.rand(T, n_experts - skip, generator=gen)
    idx = keys.argsort(-1)[:, :k]
    w = torch.rand(T, k, generator=gen) + 0.1
    w = w / w.sum(-1, keepdim=True) * 1.5
    return idx.to(device), w.to(device)


def _x(gen, shape, nm, device, scale=1.0):
    return randn(gen, *shape, scale=scale, device=device).to(nm.act)


def _linear_case(fmt):
    def make(s, gen, device, nm):
        lin = make_linear(fmt, s["N"], s["K"], gen, device)
        return (_x(gen, (s["M"], s["K"]), nm, device, 3.0), lin)
    return make


def _group_case(fmt):
    """Projections of one input whose weights are stacked as the decode step stacks them (one launch)."""
    def make(s, gen, device, nm):
        lins = tuple(make_linear(fmt, n, s["K"], gen, device) for n in s["N"])
        assert group(lins) is not None, f"registry shape {s} cannot be grouped"
        return (_x(gen, (s["M"], s["K"]), nm, device, 3.0), lins)
    return make


def _moe_inputs(s, gen, device, nm):
    bank = make_bank(s["E"], s["D"], s["I"], gen, device)
    idx, w = routing(gen, s["T"], s["E"], s["k"], device)
    x = _x(gen, (s["T"], s["D"]), nm, device, 2.0)
    return x, idx, w, bank


def _make_routed(s, gen, device, nm):
    x, idx, w, bank = _moe_inputs(s, gen, device, nm)
    return (x, idx, w.to(nm.acc), bank, 10.0)


def _make_stage1(s, gen, device, nm):
    x, idx, _, bank = _moe_inputs(s, gen, device, nm)
    return (x, idx, bank)


def _make_activation(s, gen, device, nm):
    g = randn(gen, s["T"], s["k"], s["I"], scale=6.0, device=device, dtype=nm.acc)
    u = randn(gen, s["T"], s["k"], s["I"], scale=6.0, device=device, dtype=nm.acc)
    w = torch.rand(s["T"], s["k"], generator=gen).to(device=device, dtype=nm.acc)
    return (g, u, w, 10.0)


def _make_stage2(s, gen, device, nm):
    _, idx, _, bank = _moe_inputs(s, gen, device, nm)
    h = randn(gen, s["T"], s["k"], s["I"], scale=2.0, device=device, dtype=nm.acc)
    return (h, idx, bank)


def _make_attention(s, gen, device, nm):
    b, q_len, h, d, n_kv, k = s["b"], s["s"], s["h"], s["d"], s["n_kv"], s["k"]
    q = _x(gen, (b, q_len, h, d), nm, device)
    kv = _x(gen, (b, n_kv, d), nm, device)
    idx = torch.stack([torch.stack([torch.randperm(n_kv, generator=gen)[:k] for _ in range(q_len)])
                       for _ in range(b)]).to(device)
    masked = torch.rand(b, q_len, k, generator=gen) < s.get("masked", 0.3)
    masked[..., 0] = False  # every query sees at least one row
    idx = torch.where(masked.to(device), -1, idx)
    # poison every KV row no query may read: a kernel that reads outside its index set produces NaN
    used = torch.zeros(b, n_kv, dtype=torch.bool, device=device)
    for bi in range(b):
        sel = idx[bi][idx[bi] >= 0]
        used[bi, sel] = True
    kv = torch.where(used[..., None], kv, torch.full_like(kv, float("nan")))
    sink = randn(gen, h, device=device, dtype=nm.acc)
    return (q, kv, idx, sink, d ** -0.5)


def _make_pool(s, gen, device, nm):
    kv = randn(gen, s["nb"], s["slots"], s["c"], device=device, dtype=nm.acc)
    sc = randn(gen, s["nb"], s["slots"], s["c"], scale=2.0, device=device, dtype=nm.acc)
    if s.get("empty_half"):  # overlap mode's first entry: half the slots are empty (−inf scores)
        sc[0, : s["slots"] // 2] = float("-inf")
        kv[0, : s["slots"] // 2] = 0.0
    return (kv, sc)


def _make_indexer_scores(s, gen, device, nm):
    qi = _x(gen, (s["b"], s["s"], s["h"], s["d"]), nm, device)
    w = _x(gen, (s["b"], s["s"], s["h"]), nm, device, 0.1)
    keys = _x(gen, (s["b"], s["T"], s["d"]), nm, device)
    return (qi, w, keys)


def _make_topk(s, gen, device, nm):
    scores = _x(gen, (s["b"], s["s"], s["T"]), nm, device)
    positions = (torch.arange(s["s"]) + s["p0"]).expand(s["b"], -1).to(device)
    return (scores, positions, 4, s["k"])


def _make_hc_pre(s, gen, device, nm):
    a = get_preset("tiny").replace(dim=s["D"])
    X = _x(gen, (s["b"], s["n"], a.hc_mult, s["D"]), nm, device)
    fn = randn(gen, a.mix_hc, a.hc_dim, scale=a.hc_dim ** -0.5, device=device)
    base = randn(gen, a.mix_hc, scale=0.5, device=device)
    scale = (torch.rand(3, generator=gen) + 0.5).to(device)
    return (X, fn, base, scale, a)


def _make_hc_post(s, gen, device, nm):
    X = _x(gen, (s["b"], s["n"], 4, s["D"]), nm, device)
    out = _x(gen, (s["b"], s["n"], s["D"]), nm, device)
    post = (2 * torch.rand(s["b"], s["n"], 4, generator=gen)).to(device=device, dtype=nm.acc)
    comb = torch.rand(s["b"], s["n"], 4, 4, generator=gen).to(device=device, dtype=nm.acc)
    return (out, X, post, comb / comb.sum(-1, keepdim=True))


def _make_norm(s, gen, device, nm):
    return (_x(gen, (s["M"], s["D"]), nm, device, 5.0), (1 + 0.1 * torch.randn(s["D"], generator=gen)).to(device), 1e-6)


def _make_head_rms(s, gen, device, nm):
    return (_x(gen, (s["M"], s["h"], s["d"]), nm, device, 3.0), 1e-6)


def _make_router_scores(s, gen, device, nm):
    return (randn(gen, s["T"], s["E"], scale=3.0, device=device, dtype=nm.acc), "sqrtsoftplus")


def _make_swiglu(s, gen, device, nm):
    g = randn(gen, s["T"], s["I"], scale=6.0, device=device, dtype=nm.acc)
    u = randn(gen, s["T"], s["I"], scale=6.0, device=device, dtype=nm.acc)
    return (g, u, 10.0, True)


def _make_expert_mlp(s, gen, device, nm):
    w1 = make_linear("fp8", s["I"], s["D"], gen, device)
    w2 = make_linear("fp8", s["D"], s["I"], gen, device)
    w3 = make_linear("fp8", s["I"], s["D"], gen, device)
    return (_x(gen, (s["T"], s["D"]), nm, device, 2.0), w1, w2, w3, 10.0, None, True)


def _make_hc_head(s, gen, device, nm):
    a = get_preset("tiny").replace(dim=s["D"])
    X = _x(gen, (s["b"], s["n"], a.hc_mult, s["D"]), nm, device)
    fn = randn(gen, a.hc_mult, a.hc_dim, scale=a.hc_dim ** -0.5, device=device)
    base = randn(gen, a.hc_mult, scale=0.5, device=device)
    return (X, fn, base, (torch.rand(1, generator=gen) + 0.5).to(device), a)


def _make_combine(s, gen, device, nm):
    idx, _ = routing(gen, s["T"], s["E"], s["k"], device)
    out = randn(gen, s["T"], s["k"], s["D"], scale=2.0, device=device).to(nm.act).to(nm.acc)
    out[:, -1][idx[:, -1] % 3 == 0] = float("nan")  # slots of experts another rank holds
    return (out, idx)


def _make_moe_output(s, gen, device, nm):
    routed = randn(gen, s["T"], s["D"], scale=2.0, device=device, dtype=nm.acc)
    shared = randn(gen, s["S"], s["T"], s["D"], scale=2.0, device=device).to(nm.act)
    return (routed, shared)


def _make_rope(s, gen, device, nm):
    a = get_preset("tiny")
    cos, sin = rope_table(a, 1, 512, nm.acc, device)
    pos = torch.randint(0, 512, (s["M"],), generator=gen).to(device)
    x = _x(gen, (s["M"], s["h"], a.head_dim), nm, device)
    return (x, cos[pos][:, None], sin[pos][:, None])


def _make_wo_a(s, gen, device, nm):
    lin = make_linear("fp8", s["G"] * s["R"], s["in_g"], gen, device, act_quant=False)
    return (_x(gen, (s["b"], s["s"], s["G"], s["in_g"]), nm, device), lin, s["G"])


def _make_indexer_select(s, gen, device, nm):
    qi, w, keys = _make_indexer_scores(s, gen, device, nm)
    positions = (torch.arange(s["s"]) * s["stride"] + s["p0"]).expand(s["b"], -1).to(device)
    return (qi, w, keys, positions, 4, s["k"])


def _make_f32(s, gen, device, nm):
    lin = make_linear("bf16", s["N"], s["K"], gen, device)
    return (_x(gen, (s["M"], s["K"]), nm, device), lin)


# ------------------------------------------------------------------------------------------ fused ops
TINY = get_preset("tiny")  # head_dim 96 (64 non-rope + 32 rope), index_head_dim 64, 4 streams, window 32


def _tables(a, layer: int = 2, n: int = 1024, device="cpu", nm=None):
    return rope_table(a, layer, n, nm.acc if nm is not None else torch.float32, device)


def _positions(gen, shape, high: int, device):
    return torch.randint(0, high, shape, generator=gen).to(device)


def _make_hc_pre_norm(s, gen, device, nm):
    X, fn, base, scale, a = _make_hc_pre(s, gen, device, nm)
    return (X, fn, base, scale, (1 + 0.1 * torch.randn(s["D"], generator=gen)).to(device), a)


def _make_hc_post_pre_norm(s, gen, device, nm):
    out, X, post, comb = _make_hc_post(s, gen, device, nm)
    _, fn, base, scale, w, a = _make_hc_pre_norm(s, gen, device, nm)
    return (out, X, post, comb, fn, base, scale, w, a)


def _make_moe_post_pre_norm(s, gen, device, nm):
    """The fused MoE site: a routed MoE over ``T = b·n`` rows, ``S`` shared experts' outputs, the streams and the
    next block's mHC site of the same rows."""
    x, idx, w, bank = _moe_inputs(dict(s, T=s["b"] * s["n"]), gen, device, nm)
    shared = randn(gen, s["S"], s["b"] * s["n"], s["D"], scale=2.0, device=device).to(nm.act)
    _, X, post, comb, fn, base, scale, nw, a = _make_hc_post_pre_norm(s, gen, device, nm)
    return (x, idx, w.to(nm.acc), bank, 10.0, shared, X, post, comb, fn, base, scale, nw, a)


def _make_head_rms_rope(s, gen, device, nm):
    cos, sin = _tables(TINY, device=device, nm=nm)
    q = _x(gen, (s["b"], s["s"], s["h"], TINY.head_dim), nm, device, 3.0)
    return (q, cos, sin, _positions(gen, (s["b"], s["s"]), cos.shape[0], device), 1e-6)


def _make_kv_norm_rope(s, gen, device, nm):
    """The window KV row; with ``ring`` one token per row written into a ring whose other rows hold values and
    whose spare slot is NaN-poisoned (a write anywhere else shows)."""
    cos, sin = _tables(TINY, device=device, nm=nm)
    d, n = TINY.head_dim, 1 if s.get("ring") else s["s"]
    kv = _x(gen, (s["b"], n, d), nm, device, 4.0)
    weight = (1 + 0.1 * torch.randn(d, generator=gen)).to(device)
    pos = _positions(gen, (s["b"], n), cos.shape[0], device)
    if not s.get("ring"):
        return (kv, weight, 1e-6, cos, sin, pos)
    ring = _x(gen, (s["b"] + 1, TINY.window_size, d), nm, device)
    ring[-1] = float("nan")
    slots = torch.randperm(s["b"], generator=gen).to(device)
    return (kv, weight, 1e-6, cos, sin, pos, ring, slots)


def _make_indexer_query(s, gen, device, nm):
    cos, sin = _tables(TINY, device=device, nm=nm)
    qi = _x(gen, (s["b"], s["s"], TINY.index_n_heads, TINY.index_head_dim), nm, device, 2.0)
    return (qi, cos, sin, _positions(gen, (s["b"], s["s"]), cos.shape[0], device))


def _make_attention_norms(s, gen, device, nm):
    """The query latent's rows and the window KV rows of the same tokens (with ``ring``: one token per row, written
    into a ring whose spare slot is NaN-poisoned)."""
    kv, kv_w, eps, cos, sin, pos, *ring = _make_kv_norm_rope(s, gen, device, nm)
    q_a = _x(gen, (*kv.shape[:-1], s["q"]), nm, device, 3.0)
    q_w = (1 + 0.1 * torch.randn(s["q"], generator=gen)).to(device)
    return (q_a, q_w, kv, kv_w, eps, cos, sin, pos, *ring)


def _make_query_heads(s, gen, device, nm):
    q, cos, sin, pos, eps = _make_head_rms_rope(s, gen, device, nm)
    qi = _x(gen, (s["b"], s["s"], TINY.index_n_heads, TINY.index_head_dim), nm, device, 2.0)
    return (q, qi, cos, sin, pos, eps)


def _make_compressor_pair(s, gen, device, nm):
    """A CSA layer's two compressors (the indexer's keys, then the main entries) fed the same token rows, each with
    its own random state and NaN-poisoned cache (:func:`_make_compressor_step`)."""
    ca, kva, sca, positions, slots, cachea, cos, sin = _make_compressor_step(dict(s, indexer=True), gen, device, nm)
    cb, kvb, scb, _, _, cacheb, _, _ = _make_compressor_step(dict(s, indexer=False), gen, device, nm)
    return (ca, kva, sca, cachea, cb, kvb, scb, cacheb, positions, slots, cos, sin)


def _make_projections(s, gen, device, nm):
    """The attention input's projections of one step: the stacked FP8 q/KV pair, a stacked BF16 group of four (the
    compressors' kv and score) with fp32 outputs, and one BF16 projection (the indexer's head weights)."""
    D = s["D"]
    qkv = tuple(make_linear("fp8", n, D, gen, device) for n in (256, 128))
    comps = tuple(make_linear("bf16", n, D, gen, device) for n in (96, 96, 64, 64))
    for lins in (qkv, comps):
        group(lins)
    x = _x(gen, (s["b"], 1, D), nm, device, 3.0)
    return (x, (("linear_group", qkv), ("linear_f32_group", comps), ("linear", make_linear("bf16", 40, D, gen, device))))


def _make_expert_down(s, gen, device, nm):
    """A shared expert's gate and up outputs (act; some beyond the clamp) and its FP8 down projection."""
    g = _x(gen, (s["T"], 1, s["I"]), nm, device, 4.0)
    u = _x(gen, (s["T"], 1, s["I"]), nm, device, 4.0)
    g.view(-1)[:3] = 12.0
    return (g, u, make_linear("fp8", s["D"], s["I"], gen, device), 10.0)


def _make_indexer_select_decode(s, gen, device, nm):
    """One query per row over its slot's index-key cache; the keys no row can see yet are NaN-poisoned."""
    b, T = len(s["positions"]), s["T"]
    qi = _x(gen, (b, TINY.index_n_heads, TINY.index_head_dim), nm, device)
    w = _x(gen, (b, TINY.index_n_heads), nm, device)
    keys = _x(gen, (b + 1, T, TINY.index_head_dim), nm, device)
    slots = torch.randperm(b + 1, generator=gen)[:b].to(device)
    positions = torch.tensor(s["positions"], device=device)
    visible = torch.arange(T, device=device)[None, :] < ((positions + 1) // 4)[:, None]
    poisoned = torch.ones(b + 1, T, dtype=torch.bool, device=device)
    poisoned[slots] = ~visible
    keys[poisoned] = float("nan")
    return (qi, w, keys, slots, positions, s["k"], None, TINY.index_scale)


def _make_router_topk(s, gen, device, nm):
    a = TINY.replace(n_routed_experts=s["E"], n_activated_experts=s["k"])
    gate = Gate(a, s["hash"])
    if s["hash"]:
        gate._buffers["tid2eid"] = torch.rand(a.vocab_size, a.n_routed_experts, generator=gen).argsort(-1)[
            :, :s["k"]].to(device)
    else:
        gate._buffers["bias"] = (0.1 * torch.randn(s["E"], generator=gen)).to(device)
    logits = randn(gen, s["T"], s["E"], scale=2.0, device=device, dtype=nm.acc)
    return (logits, gate, torch.randint(0, a.vocab_size, (s["T"],), generator=gen).to(device))


def _make_compressor_step(s, gen, device, nm):
    """One token per row into a compressor with random ring state; the rows of ``positions`` complete a block
    where ``(p+1) % ratio == 0``. The cache's unwritten rows are NaN-poisoned, and so is a spare slot."""
    r, indexer = s["ratio"], s.get("indexer", False)
    channels = TINY.index_head_dim if indexer else TINY.head_dim
    comp = Compressor(TINY, r, channels, is_indexer=indexer)
    width = comp.coff * channels
    comp._buffers["ape"] = randn(gen, r, width, scale=0.5, device=device)
    comp.norm._buffers["weight"] = (1 + 0.1 * torch.randn(channels, generator=gen)).to(device)
    b = len(s["positions"])
    comp.allocate_state(b + 1, nm.acc, device)
    comp.kv_ring.copy_(randn(gen, *comp.kv_ring.shape, device=device))
    comp.score_ring.copy_(randn(gen, *comp.score_ring.shape, scale=2.0, device=device))
    cos, sin = _tables(TINY, device=device, nm=nm)
    cache = torch.full((b + 1, cos.shape[0] // r, channels), float("nan"), dtype=nm.act, device=device)
    positions = torch.tensor(s["positions"], device=device)
    slots = torch.randperm(b + 1, generator=gen)[:b].to(device)
    kv = randn(gen, b, width, device=device, dtype=nm.acc)
    score = randn(gen, b, width, scale=2.0, device=device, dtype=nm.acc)
    return (comp, kv, score, positions, slots, cache, cos, sin)


def _make_attention_from_caches(s, gen, device, nm):
    """Decode attention over a window ring and (``ratio``) a compressed cache read in place: the window rows of
    positions ``p−W+1 … p`` (−1 before the start), the compressed rows a prefix (HCA: every completed entry; CSA:
    ``k`` picks among them, −1 after); every cache row no query reads is NaN-poisoned; with the tables, the
    inverse RoPE of the output."""
    a = TINY
    W, d, H = a.window_size, a.head_dim, s["h"]
    positions = torch.tensor(s["positions"], device=device)
    b = len(s["positions"])
    q = _x(gen, (b, H, d), nm, device)
    slots = torch.randperm(b + 1, generator=gen)[:b].to(device)
    win_kv = _x(gen, (b + 1, W, d), nm, device)
    wpos = positions[:, None] - (W - 1) + torch.arange(W, device=device)[None, :]
    win_rows = torch.where(wpos >= 0, wpos % W, -1)
    used = torch.zeros(b + 1, W, dtype=torch.bool, device=device)
    for i in range(b):
        used[slots[i], win_rows[i][win_rows[i] >= 0]] = True
    win_kv[~used] = float("nan")
    cmp_kv = cmp_rows = None
    ratio = s.get("ratio", 0)
    if ratio:
        C = s["C"]
        cmp_kv = _x(gen, (b + 1, C, d), nm, device)
        n_vis = ((positions + 1) // ratio).clamp(max=C)
        k = s.get("k") or C
        cmp_rows = torch.full((b, k), -1, dtype=torch.long, device=device)
        seen = torch.zeros(b + 1, C, dtype=torch.bool, device=device)
        for i in range(b):
            pick = torch.randperm(int(n_vis[i]), generator=gen)[:k].to(device) if s.get("k") else \
                torch.arange(int(n_vis[i]), device=device)[:k]
            cmp_rows[i, :len(pick)] = pick
            seen[slots[i], pick] = True
        cmp_kv[~seen] = float("nan")
    sink = randn(gen, H, device=device, dtype=nm.acc)
    cos, sin = _tables(a, device=device, nm=nm)
    return (q, win_kv, win_rows, cmp_kv, cmp_rows, slots, sink, d ** -0.5, cos, sin, positions, ratio)


def _make_rope_position(s, gen, device, nm):
    return (torch.randint(0, 256, (s["n"],), generator=gen).to(device), s["ratio"])


MOE_SHAPES = [dict(T=1, E=16, k=4, D=256, I=128), dict(T=3, E=12, k=3, D=96, I=64),
              dict(T=37, E=16, k=4, D=160, I=96)]

OPS: list[OpCase] = [
    OpCase("linear_fp8", "linear", _linear_case("fp8"),
           [dict(M=1, N=96, K=256), dict(M=3, N=200, K=192), dict(M=17, N=256, K=384), dict(M=1, N=1000, K=640)],
           "dot", "FP8 E4M3 weight, 128×128 E8M0 block scales, per-token FP8 activations"),
    OpCase("linear_fp4", "linear", _linear_case("fp4"),
           [dict(M=1, N=128, K=256), dict(M=5, N=72, K=96), dict(M=33, N=256, K=128)],
           "dot", "FP4 E2M1 weight, 1×32 E8M0 scales, per-token FP8 activations"),
    OpCase("linear_bf16", "linear", _linear_case("bf16"), [dict(M=2, N=8, K=256), dict(M=9, N=64, K=96)],
           "dot", "BF16 weight (indexer weights_proj)"),
    OpCase("linear_f32", "linear_f32", _make_f32, [dict(M=1, N=16, K=256), dict(M=7, N=129, K=96)],
           "dot", "fp32 projection of a BF16 weight (router, compressor, head)"),
    OpCase("linear_group", "linear_group", _group_case("fp8"),
           [dict(M=1, N=(256, 128), K=256), dict(M=3, N=(128, 384, 128), K=384)],
           "dot", "FP8 projections of one input, weights stacked (wq_a+wkv, wq_b+indexer wq_b, shared w1+w3)"),
    OpCase("linear_f32_group", "linear_f32_group", _group_case("bf16"),
           [dict(M=1, N=(16, 16, 32, 32), K=256), dict(M=2, N=(72, 72), K=96)],
           "dot", "fp32 projections of one input by stacked BF16 weights (the compressors' wkv/wgate)"),
    OpCase("grouped_wo_a", "grouped_wo_a", _make_wo_a, [dict(b=1, s=1, G=4, R=64, in_g=192),
                                                       dict(b=2, s=5, G=2, R=32, in_g=96)],
           "dot", "grouped output projection (bf16 einsum over groups)"),
    OpCase("moe_stage1", "moe_stage1", _make_stage1, MOE_SHAPES, "dot", "routed experts w1/w3 (FP4)"),
    OpCase("moe_activation", "moe_activation", _make_activation, [dict(T=3, k=4, I=128), dict(T=1, k=6, I=96)],
           "elementwise", "clamped SwiGLU × routing weight"),
    OpCase("moe_stage2", "moe_stage2", _make_stage2, MOE_SHAPES, "quantizer chain", "routed experts w2 (FP4)"),
    OpCase("routed_experts", "routed_experts", _make_routed, MOE_SHAPES, "quantizer chain",
           "whole routed MoE: stage 1, activation, stage 2, combine"),
    OpCase("sparse_attention", "sparse_attention", _make_attention,
           [dict(b=1, s=1, h=8, d=96, n_kv=80, k=48), dict(b=2, s=5, h=4, d=64, n_kv=37, k=20, masked=0.5),
            dict(b=1, s=3, h=2, d=512, n_kv=200, k=160)], "softmax-weighted", "gathered KV with attention sink"),
    OpCase("compressor_pool", "compressor_pool", _make_pool,
           [dict(nb=3, slots=8, c=96, empty_half=True), dict(nb=2, slots=16, c=64)], "softmax-weighted",
           "softmax pooling of compressor slots"),
    OpCase("indexer_scores", "indexer_scores", _make_indexer_scores,
           [dict(b=1, s=1, h=4, d=64, T=75), dict(b=2, s=6, h=8, d=128, T=33)], "quantizer chain",
           "ReLU-weighted index scores"),
    OpCase("indexer_topk", "indexer_topk", _make_topk,
           [dict(b=1, s=4, T=75, k=16, p0=290), dict(b=2, s=9, T=10, k=16, p0=0)], "top-k set",
           "causal top-k of compressed entries (ties → lower index)"),
    OpCase("hc_pre", "hc_pre", _make_hc_pre, [dict(b=1, n=1, D=256), dict(b=2, n=3, D=96)], "Sinkhorn (first order)",
           "mHC pre-mix and Sinkhorn"),
    OpCase("hc_post", "hc_post", _make_hc_post, [dict(b=1, n=1, D=256), dict(b=2, n=3, D=96)], "dot",
           "mHC post-mix"),
    OpCase("rms_norm", "rms_norm", _make_norm, [dict(M=1, D=256), dict(M=7, D=96)], "elementwise", "RMSNorm"),
    OpCase("rope", "rope", _make_rope, [dict(M=3, h=8), dict(M=1, h=1)], "elementwise", "interleaved RoPE"),
    OpCase("head_rms", "head_rms", _make_head_rms, [dict(M=3, h=8, d=96), dict(M=1, h=2, d=64)], "quantizer chain",
           "per-head RMS of q in bf16 steps"),
    OpCase("router_scores", "router_scores", _make_router_scores, [dict(T=5, E=16), dict(T=1, E=256)],
           "elementwise", "sqrt(softplus) router scores"),
    OpCase("swiglu", "swiglu", _make_swiglu, [dict(T=3, I=128), dict(T=1, I=96)], "elementwise",
           "clamped SwiGLU (shared expert)"),
    OpCase("expert_mlp", "expert_mlp", _make_expert_mlp,
           [dict(T=1, D=256, I=128), dict(T=5, D=160, I=96), dict(T=70, D=256, I=200)],
           "quantizer chain", "the shared expert: w1/w3, SwiGLU, w2 (FP8)"),
    OpCase("hc_head", "hc_head", _make_hc_head, [dict(b=1, n=1, D=256), dict(b=2, n=3, D=96)], "dot",
           "mHC head (collapse the streams)"),
    OpCase("moe_combine", "moe_combine", _make_combine, [dict(T=3, E=12, k=4, D=160), dict(T=1, E=16, k=6, D=96)],
           "dot", "sum of the routed slots (NaN slots skipped)"),
    OpCase("moe_output", "moe_output", _make_moe_output, [dict(T=3, S=1, D=160), dict(T=1, S=2, D=1000)],
           "elementwise", "routed + shared experts, added in acc, rounded to act"),
]

# Prefill-sized cases (issue 8): several sorter blocks per expert, many queries per call.
OPS += [
    OpCase("routed_experts_prefill", "routed_experts", _make_routed, [dict(T=70, E=16, k=4, D=256, I=128)],
           "quantizer chain", "whole routed MoE at a prefill token count (experts with more rows than one sorter block)"),
    OpCase("sparse_attention_prefill", "sparse_attention", _make_attention,
           [dict(b=1, s=40, h=8, d=96, n_kv=120, k=48, masked=0.3)], "softmax-weighted",
           "gathered KV with attention sink, many queries per call"),
    # issue 18: the indexer's selection as one op (the shared expert's prefill size is among expert_mlp's shapes)
    OpCase("indexer_select", "indexer_select", _make_indexer_select,
           [dict(b=1, s=9, h=4, d=64, T=30, k=16, p0=2, stride=13), dict(b=2, s=40, h=4, d=64, T=75, k=16, p0=150,
                                                                         stride=4)],
           "exact", "the indexer's causal top-k selection (scores, then top-k)"),
]


# the fused ops of the decode step (issue 17) and the remaining ops of the forward
FUSED_OPS = [
    OpCase("hc_pre_norm", "hc_pre_norm", _make_hc_pre_norm, [dict(b=1, n=1, D=256), dict(b=2, n=3, D=96)],
           "fused chain", "mHC pre + the sub-layer's RMSNorm"),
    OpCase("hc_post_pre_norm", "hc_post_pre_norm", _make_hc_post_pre_norm,
           [dict(b=1, n=1, D=256), dict(b=2, n=3, D=96)], "fused chain", "mHC post, then the next pre + RMSNorm"),
    OpCase("moe_post_pre_norm", "moe_post_pre_norm", _make_moe_post_pre_norm,
           [dict(b=1, n=1, D=256, E=16, k=4, I=128, S=1), dict(b=3, n=1, D=96, E=12, k=3, I=64, S=2)], "fused chain",
           "routed experts, MoE output (routed + shared), then the next mHC site"),
    OpCase("head_rms_rope", "head_rms_rope", _make_head_rms_rope, [dict(b=1, s=1, h=8), dict(b=2, s=3, h=3)],
           "fused chain", "per-head RMS of q, then RoPE at its positions"),
    OpCase("kv_norm_rope", "kv_norm_rope", _make_kv_norm_rope, [dict(b=2, s=5), dict(b=3, ring=True)],
           "fused chain", "window KV: RMSNorm, RoPE, FP8 sim (and its write into the ring)"),
    OpCase("indexer_query", "indexer_query", _make_indexer_query, [dict(b=1, s=1), dict(b=2, s=3)],
           "fused chain", "indexer q: RoPE, Hadamard, FP4 sim"),
    OpCase("attention_norms", "attention_norms", _make_attention_norms,
           [dict(b=2, s=5, q=192), dict(b=3, ring=True, q=96)], "fused chain",
           "q norm and the window KV row's norm, RoPE, FP8 sim (and ring write) in one launch"),
    OpCase("query_heads", "query_heads", _make_query_heads, [dict(b=1, s=1, h=8), dict(b=2, s=3, h=3)],
           "fused chain", "query heads' RMS + RoPE and the indexer's RoPE, Hadamard, FP4 sim in one launch"),
    OpCase("indexer_select_decode", "indexer_select_decode", _make_indexer_select_decode,
           [dict(positions=[150, 299], T=75, k=16), dict(positions=[2, 9, 40], T=30, k=16)],
           "top-k set (score intervals)", "indexer scores + top-k from the key cache, one query per row"),
    OpCase("router_topk", "router_topk", _make_router_topk,
           [dict(T=5, E=16, k=4, hash=False), dict(T=3, E=256, k=6, hash=False), dict(T=4, E=16, k=4, hash=True)],
           "top-k set (score intervals)", "router scores, choice (bias or hash table) and weights"),
    OpCase("compressor_step", "compressor_step", _make_compressor_step,
           [dict(ratio=4, positions=[3, 10, 127]), dict(ratio=4, indexer=True, positions=[7, 8, 299]),
            dict(ratio=16, positions=[15, 47, 100])],
           "fused chain", "compressor decode step: ring write, pooling, entry finish and cache write"),
    OpCase("compressor_pair", "compressor_pair", _make_compressor_pair,
           [dict(ratio=4, positions=[3, 10, 127]), dict(ratio=4, positions=[7, 8])], "fused chain",
           "a CSA layer's two compressor steps (indexer keys, main entries) in one launch"),
    OpCase("expert_down", "expert_down", _make_expert_down, [dict(T=1, D=256, I=128), dict(T=3, D=160, I=200)],
           "quantizer chain", "a shared expert after its up projections: SwiGLU, w2 (FP8)"),
    OpCase("projections", "projections", _make_projections, [dict(b=1, D=256), dict(b=3, D=320)], "dot",
           "the attention input's projections of one step (FP8 pair, BF16 group, BF16) in one launch"),
    OpCase("attention_from_caches", "attention_from_caches", _make_attention_from_caches,
           [dict(h=8, positions=[5, 40]), dict(h=8, positions=[63, 200], ratio=16, C=16),
            dict(h=3, positions=[120, 299, 20], ratio=4, C=75, k=16)],
           "softmax-weighted", "decode attention read in place from the window ring and the compressed cache, "
           "inverse RoPE"),
    OpCase("rope_inverse", "rope", lambda s, g, dv, nm: _make_rope(s, g, dv, nm) + (True,), [dict(M=3, h=8)],
           "elementwise", "the inverse rotation of the attention output"),
    OpCase("compressed_rope_position", "compressed_rope_position", _make_rope_position,
           [dict(n=7, ratio=4), dict(n=3, ratio=128)], "exact", "position of a compressed entry's rotation"),
]
OPS += FUSED_OPS


def op_names() -> list[str]:
    return [o.name for o in OPS]


def implementations(ops, case: OpCase) -> dict[str, Callable]:
    """The implementations of ``case`` that a backend provides: its override of the method and any variants.

    The reference backend counts as an implementation of everything (it is compared with itself, a sanity check
    that must be bitwise).
    """
    out: dict[str, Callable] = {}
    method = getattr(type(ops), case.method, None)
    if type(ops) is ReferenceOps or (method is not None and method is not getattr(ReferenceOps, case.method)):
        out[ops.name] = getattr(ops, case.method)
    variants = getattr(ops, "variants", None)
    if variants is not None:
        for vname, fn in (variants(case.method) or {}).items():
            out[f"{ops.name}:{vname}"] = fn
    return out
