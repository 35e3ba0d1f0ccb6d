"""Prefill suite, section ``chunks``: the chunk size by measurement — one real-dims layer per compression ratio
through ``TritonOps`` with the MoE settings this run measured fastest, each prompt length prefilled in each chunk
size and in one shot, every op inside timed, beside the cost model's roofline shares."""
from __future__ import annotations

import time

import torch

from dsv4lab.core.model.block import Block
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.tools.bench.common import OP_NAMES, OpTimer, materialize_random
from dsv4lab.tools.bench.prefill.harness import PrefillBench
from dsv4lab.tools.bench.prefill.report import choices
from dsv4lab.tools.perf import costmodel


def layer_roofline(a, tokens: int, chunk: int, peaks: dict, ratio: int) -> dict:
    """Roofline time of each op of one layer's prefill (cost model), and the attention / indexer shares."""
    one = a.replace(n_layers=1, n_mtp_layers=0, n_hash_layers=0, compress_ratios=(ratio,))
    cost = costmodel.prefill(one, tokens=tokens, chunk=chunk)
    bw = peaks["copy_gbps"] * 1e9
    per_op = {}
    for op in cost.compute_ops:
        if op.name in ("embed", "head", "sample") or op.name.startswith("final."):
            continue
        if op.kind == "matmul":
            peak = peaks["fp8_tflops"] if op.weight_format in ("fp8", "fp4") else peaks["bf16_tflops"]
        elif op.kind in ("attention", "indexer"):
            peak = peaks["bf16_tflops"]
        else:
            peak = None
        t_flops = op.flops_rank / (peak * 1e12) if peak else 0.0
        per_op[op.name] = max(t_flops, op.bytes_rank / bw)
    total = sum(per_op.values())
    idx_t = per_op.get("indexer.score", 0.0) + per_op.get("indexer.topk", 0.0)
    return dict(layer_us=total * 1e6, attention_us=per_op.get("attn.core", 0.0) * 1e6, indexer_us=idx_t * 1e6,
                attention_share=per_op.get("attn.core", 0.0) / total, indexer_share=idx_t / total)


class LayerBench:
    """One real-dims layer (random weights) through ``TritonOps``, prefilled in chunks, op times by CUDA event.

    Every op call the layer makes is timed (an op called inside another — a composite's parts — counts in its
    caller's time), so ``untimed_us`` = the layer's time − the ops' is the torch glue between the ops (index
    arithmetic, concatenations, cache writes) and any time the GPU waited for the host; ``host_us`` is how long
    the host took to issue the layer (near the layer's time: the host is the limit)."""

    def __init__(self, b: PrefillBench, args, gen, ratio: int, max_tokens: int, settings: dict | None = None):
        self.b, self.torch = b, torch
        self.a = args.replace(max_seq_len=-(-max(max_tokens, args.max_seq_len) // 128) * 128)
        a, dev = self.a, b.device
        self.layer = next(i for i in range(a.n_layers) if a.compress_ratios[i] == ratio and not a.is_hash_layer(i))
        self.ratio = ratio
        self.blk = Block(a, self.layer)
        materialize_random(self.blk, dev, gen)
        nm = Numerics(exact_reductions=False)  # production semantics; torch's fp32 reductions for the glue ops
        from dsv4lab.engine.triton_backend import TritonOps  # imports triton
        self.ops = TritonOps(nm)
        for key, value in (settings or {}).items():  # prefill settings measured earlier in this run
            setattr(self.ops, f"prefill_{key}", value)
        self.blk.attn.allocate(1, a.max_seq_len, nm.act, nm.acc, dev)
        self.X = (torch.randn(1, max_tokens, a.hc_mult, a.dim, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
        self.ids = torch.zeros(1, max_tokens, dtype=torch.long, device=dev)
        self.host_us = 0.0
        self.timer = OpTimer(self.ops, OP_NAMES, cuda=b.cuda).install()  # every op, for the layer's lifetime

    def prefill(self, total: int, chunk: int) -> None:
        torch, dev = self.torch, self.b.device
        self.blk.attn.reset(None, self.ops)
        for p in range(0, total, chunk):
            c = min(chunk, total - p)
            self.blk(self.X[:, p:p + c], torch.tensor([p], device=dev), torch.tensor([c], device=dev),
                     torch.tensor([0], device=dev), self.ids[:, p:p + c], self.ops)

    def time(self, total: int, chunk: int) -> tuple[float, dict, float]:
        """One prefill of ``total`` tokens: its time in µs, the time of each op inside it, and the host's time to
        issue it (µs)."""
        torch, b = self.torch, self.b
        self.timer.clear()
        if not b.cuda:
            t = time.perf_counter()
            self.prefill(total, chunk)
            return (time.perf_counter() - t) * 1e6, {}, (time.perf_counter() - t) * 1e6
        b.l2_flush_buffer().zero_()
        b.sync()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        t_host = time.perf_counter()
        self.prefill(total, chunk)
        self.host_us = (time.perf_counter() - t_host) * 1e6
        e.record()
        b.sync()
        return s.elapsed_time(e) * 1e3, self.timer.totals_us(), self.host_us


def measured_moe_settings(b: PrefillBench, headline: int) -> dict:
    """The grouped-MoE settings the rows measured so far pick (route, launch variant, sorter rows), as
    ``TritonPrefillOps`` settings: the layers of this run use them before the choices are written."""
    c = choices(b, headline)
    if "moe_route" not in c:
        return {}
    rows = dict(c.get("moe_rows_by_tokens", [])).get(headline)
    # the variant's decode/scheduling/scale fields too: unset, they would come from the committed choices
    return dict(moe_route=c["moe_route"], moe_tag=c["moe_tag"], moe_decode=c["moe_decode"],
                moe_persistent=c["moe_persistent"], moe_scale_per_byte=c["moe_scale_per_byte"],
                **({"moe_rows": rows} if rows else {}))


def bench_chunks(b: PrefillBench, args, gen, prompts, chunks, ratios, reps: int, headline: int) -> None:
    """Each prompt length in each chunk size (0: one shot) through one layer per compression ratio."""
    settings = measured_moe_settings(b, headline)
    if settings:
        b.log(f"layers with the MoE settings measured above: {settings}")
    for ratio in ratios:
        if b.over_budget(f"chunked layer ratio {ratio}"):
            return
        lb = LayerBench(b, args, gen, ratio, max(prompts), settings)
        kind = {4: "csa", 0: "swa"}.get(ratio, "hca")
        for total in prompts:
            for chunk in chunks:
                c = total if chunk == 0 else chunk
                if (chunk and chunk >= total) or b.over_budget(f"layer {kind} {total} chunk {chunk}"):
                    continue
                if b.guard(f"layer warm-up {kind} {total}/{c}", lambda: lb.time(total, c)) is None:
                    continue
                runs = [b.guard(f"layer {kind} {total}/{c}", lambda: lb.time(total, c)) for _ in range(reps)]
                runs = sorted((r for r in runs if r is not None), key=lambda r: r[0])
                if not runs:
                    continue
                t, per_op, host = runs[len(runs) // 2]
                row = b.add("chunked_prefill", f"{kind}_layer{lb.layer}", t, 0.0, "bf16", tokens=total, chunk=chunk,
                            tok_per_s=round(total / (t * 1e-6)), host_us=round(host, 1),
                            untimed_us=round(t - sum(per_op.values()), 1),
                            op_us={k: round(v, 1) for k, v in sorted(per_op.items(), key=lambda kv: -kv[1])})
                if b.peaks.get("copy_gbps"):
                    roof = layer_roofline(args, total, c, b.peaks, ratio)
                    att = per_op.get("sparse_attention", 0.0)
                    idx_t = per_op.get("indexer_select", 0.0)
                    row.update(roofline_layer_us=round(roof["layer_us"], 1),
                               attention_share=round(att / t, 4),
                               attention_roofline_share=round(roof["attention_share"], 4),
                               indexer_share=round(idx_t / t, 4),
                               indexer_roofline_share=round(roof["indexer_share"], 4))
                b.log(f"{kind} layer, {total} tokens in chunks of {c}: {t / 1e3:.2f} ms (host {host / 1e3:.2f} ms); "
                      f"between the ops {row['untimed_us']:.0f} µs; ops (µs): "
                      + ", ".join(f"{k} {v:.0f}" for k, v in row["op_us"].items()))
        b.log("backend report:\n" + lb.ops.report())
        del lb
        if b.cuda:
            torch.cuda.empty_cache()


