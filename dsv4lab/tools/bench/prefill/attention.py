"""Prefill suite, section ``attention``: the sparse attention (CSA: window + top-k; HCA: window + every visible
entry) per configuration, the indexer's causal selection and full score matrix, its top-k and the compressor's
pooling — checked against the reference first, then timed on one chunk from position 0."""
from __future__ import annotations

import torch

from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.engine.kernel_families import INDEXER, PREFILL_ATTENTION
from dsv4lab.tools.bench.prefill.harness import PrefillBench, named_configs
from dsv4lab.tools.verify.registry import _make_attention


def check_attention_side(b: PrefillBench, a, gen, passed: set[str], plan: dict) -> None:
    """Sparse attention (the attention tolerance policy), indexer scores, selection and pooling."""
    from dsv4lab_kernels import attention_prefill as ap
    ref = ReferenceOps(Numerics())
    dev = b.device
    shape = dict(b=1, s=8 if b.smoke else 48, h=a.n_heads, d=a.head_dim, n_kv=300 if b.smoke else 1200,
                 k=(a.window_size + a.index_topk), masked=0.3)
    q, kv, aidx, sink, scale = _make_attention(shape, torch.Generator().manual_seed(1), "cpu", Numerics())
    q, kv, aidx, sink = q.to(dev), kv.to(dev), aidx.to(dev), sink.to(dev)
    want = ref.sparse_attention(q, kv, aidx, sink, scale)
    for cfg in plan["attention"]:
        name = f"attn:{cfg}"
        if b.guard(name, lambda: b.check(name, ap.sparse_attention(q, kv, aidx, sink, scale, config=cfg), want,
                                         "attention")):
            passed.add(name)
    S, Tk = (16, 40) if b.smoke else (64, 1024)
    qi = torch.randn(1, S, a.index_n_heads, a.index_head_dim, device=dev, generator=gen).to(torch.bfloat16)
    wi = (torch.randn(1, S, a.index_n_heads, device=dev, generator=gen) * 0.1).to(torch.bfloat16)
    keys = torch.randn(1, Tk, a.index_head_dim, device=dev, generator=gen).to(torch.bfloat16)
    scores = ref.indexer_scores(qi, wi, keys)
    if b.guard("indexer_scores", lambda: b.check("indexer_scores", ap.indexer_scores(qi, wi, keys), scores,
                                                 "attention")):
        passed.add("indexer_scores")
    pos = (torch.arange(S, device=dev) * (4 * Tk // S) + 3)[None]
    if b.guard("indexer_topk", lambda: b.check("indexer_topk", ap.indexer_topk(scores, pos, 4, a.index_topk),
                                               ref.indexer_topk(scores, pos, 4, a.index_topk), "exact")):
        passed.add("indexer_topk")
    want_sel = ref.indexer_topk(scores, pos, 4, a.index_topk)
    for cfg in plan["indexer"]:
        name = f"indexer_select:{cfg}"
        # scores of bf16 MMAs may differ from the exact reference in a last bit, so near-ties may pick another
        # entry: the selection is judged by the reference scores of what it picked (sorted), not by the indices
        if b.guard(name, lambda: b.check(name, _picked_scores(scores, ap.indexer_select(
                qi, wi, keys, pos, 4, a.index_topk, config=cfg)), _picked_scores(scores, want_sel), "attention")):
            passed.add(name)
    kvs = torch.randn(64, 8, a.head_dim, device=dev, generator=gen)
    scs = torch.randn(64, 8, a.head_dim, device=dev, generator=gen)
    if b.guard("compressor_pool", lambda: b.check("compressor_pool", ap.compressor_pool(kvs, scs),
                                                  ref.compressor_pool(kvs, scs), "reduction")):
        passed.add("compressor_pool")


def _picked_scores(scores, sel):
    """The scores of the selected entries, sorted descending (−inf where nothing was selected)."""
    got = torch.gather(scores.float(), -1, sel.clamp_min(0))
    return torch.where(sel >= 0, got, float("-inf")).sort(-1, descending=True).values


def prefill_attention_inputs(a, T: int, ratio: int, device, gen):
    """q, kv_all, idx, sink for one chunk of ``T`` tokens from position 0 laid out as the model does: window
    history (empty), the chunk's own rows, then the compressed entries; CSA picks ``index_topk`` of the
    visible entries at random, HCA attends to every visible one."""
    W, H, d = a.window_size, a.n_heads, a.head_dim
    n_ent = T // ratio
    q = torch.randn(1, T, H, d, device=device, generator=gen).to(torch.bfloat16)
    kv = torch.randn(1, W + T + n_ent, d, device=device, generator=gen).to(torch.bfloat16)
    p = torch.arange(T, device=device)
    u = torch.arange(W, device=device)
    win = torch.where((p[:, None] - (W - 1) + u[None]) >= 0, p[:, None] + 1 + u[None], -1)
    visible = (p + 1) // ratio
    if ratio == 4:
        k = min(a.index_topk, n_ent)
        keys = torch.rand(T, max(n_ent, 1), device=device, generator=gen)
        keys = keys.masked_fill(torch.arange(max(n_ent, 1), device=device)[None] >= visible[:, None], -1.0)
        sel = keys.topk(k, dim=-1)
        ent = torch.where(sel.values >= 0, sel.indices + W + T, -1)
    else:
        e = torch.arange(n_ent, device=device)
        ent = torch.where(e[None] < visible[:, None], e[None] + W + T, -1)
    idx = torch.cat((win, ent), -1)[None].to(torch.int32)
    sink = torch.randn(H, device=device, generator=gen)
    return q, kv, idx, sink


def bench_attention(b: PrefillBench, args, gen, passed: set[str], tokens) -> None:
    from dsv4lab_kernels import attention_prefill as ap
    a, dev = args, b.device
    configs = [c for c in named_configs(PREFILL_ATTENTION, True) if f"attn:{c}" in passed]
    for T in tokens:
        if b.over_budget(f"attention @{T}"):
            return
        for ratio, kind in ((4, "csa"), (max(a.compress_ratios), "hca")):
            q, kv, idx, sink = prefill_attention_inputs(a, T, ratio, dev, gen)
            valid = float((idx >= 0).sum())
            flops = 4.0 * a.n_heads * a.head_dim * valid
            for cfg in configs:
                t = b.guard(f"attn {cfg}", lambda: b.time_events_us(
                    lambda: ap.sparse_attention(q, kv, idx, sink, a.softmax_scale, config=cfg), name=f"attn:{cfg}"))
                if t:
                    b.add("attn_prefill", f"{kind}:{cfg}", t, flops, "bf16", tokens=T, attended_rows=int(valid))
        # the indexer of a CSA layer: the causal selection (visible keys only), and the full score matrix
        n_keys = T // 4
        qi = torch.randn(1, T, a.index_n_heads, a.index_head_dim, device=dev, generator=gen).to(torch.bfloat16)
        wi = (torch.randn(1, T, a.index_n_heads, device=dev, generator=gen) * 0.1).to(torch.bfloat16)
        keys = torch.randn(1, n_keys, a.index_head_dim, device=dev, generator=gen).to(torch.bfloat16)
        pos = torch.arange(T, device=dev)[None]
        visible_pairs = float(((torch.arange(T, device=dev) + 1) // 4).sum())
        useful = 2.0 * a.index_n_heads * a.index_head_dim * visible_pairs
        for cfg in named_configs(INDEXER, True):
            if f"indexer_select:{cfg}" not in passed:
                continue
            t = b.guard("indexer_select", lambda: b.time_events_us(
                lambda: ap.indexer_select(qi, wi, keys, pos, 4, a.index_topk, config=cfg), name=f"select:{cfg}"))
            if t:
                b.add("indexer", f"select:{cfg}", t, useful, "bf16", tokens=T, entries=n_keys)
        if "indexer_scores" in passed:
            t = b.guard("indexer_scores", lambda: b.time_events_us(lambda: ap.indexer_scores(qi, wi, keys),
                                                                   name="indexer_scores"))
            if t:
                b.add("indexer", "scores:all_keys", t, 2.0 * T * a.index_n_heads * n_keys * a.index_head_dim,
                      "bf16", tokens=T)
        if "indexer_topk" in passed:
            scores = ap.indexer_scores(qi, wi, keys)
            t = b.guard("indexer_topk", lambda: b.time_events_us(lambda: ap.indexer_topk(scores, pos, 4, a.index_topk),
                                                                 name=f"topk:{n_keys}"))
            if t:
                b.add("indexer", "topk", t, 0.0, "copy", tokens=T, entries=n_keys,
                      gbps=round(scores.numel() * 2 / (t * 1e-6) / 1e9, 1))
        if "compressor_pool" in passed:
            nb = T // 4
            kvs = torch.randn(nb, 8, a.head_dim, device=dev, generator=gen)
            scs = torch.randn(nb, 8, a.head_dim, device=dev, generator=gen)
            t = b.guard("pool", lambda: b.time_events_us(lambda: ap.compressor_pool(kvs, scs), name="pool"))
            if t:
                b.add("compressor_pool", "csa_main", t, 0.0, "copy", tokens=T,
                      gbps=round(2 * kvs.numel() * 4 / (t * 1e-6) / 1e9, 1))


