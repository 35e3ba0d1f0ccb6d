"""Decode suite, the step as a whole: the static decode step on the tiny model against the reference decode (and
graph replay against eager, section ``attention``), and one real-dims CSA layer's decode step graph-replayed with a
per-kernel breakdown (section ``layer``)."""
from __future__ import annotations

import types
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from dsv4lab.core.model.block import Block
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.engine.decode_graph import DecodeGraphs, StaticDecodeStep
from dsv4lab.engine.loader import load
from dsv4lab.tools.bench.common import kernel_families, materialize_random
from dsv4lab.tools.bench.decode.harness import EXPERT_BYTES, DecodeBench
from dsv4lab.tools.verify.model import fp32_reduction_ops, kl_per_position, kl_rule


def check_static_decode(b: DecodeBench, tiny_path: Path) -> None:
    """Teacher-forced decode of two ragged rows on the tiny model: the static step (Triton backend) vs the
    reference decode, judged as ``verify model`` judges a backend that is not bit-exact — every position's KL within
    ``KL_FLOOR_FACTOR_MAX`` × the largest KL of the reference against itself with fp32 instead of exact reductions
    on the same steps (measured here), the mean within ``KL_FLOOR_FACTOR_MEAN`` × that floor's mean; and (on a GPU)
    the graph replay vs the eager static step, bit for bit."""
    dev = b.device
    ref = load(tiny_path, device=dev, backend="reference", max_batch=2, max_seq_len=128)
    tri = load(tiny_path, device=dev, backend="triton", max_batch=2, max_seq_len=128)
    ids = torch.randint(2, 4096, (2, 24), generator=torch.Generator().manual_seed(5)).to(dev)
    lens = torch.tensor([17, 9])
    steps = 2 if b.smoke else 6
    exact_ops = ref.ops

    def prefill(m):
        m.reset()
        kernels, m.ops = m.ops, ReferenceOps(m.ops.numerics)
        m.forward(ids[:, :17], 0, slots=[0, 1], lengths=lens.tolist())
        m.ops = kernels

    def reference_steps(ops) -> list[torch.Tensor]:
        ref.ops = ops
        prefill(ref)
        out = []
        for t in range(steps):
            pos = lens + t
            out.append(ref.forward(ids[torch.arange(2), pos.to(dev)][:, None], pos, slots=[0, 1])[:, 0])
        ref.ops = exact_ops
        return out

    want = reference_steps(exact_ops)
    floor = [k for w, r in zip(want, reference_steps(fp32_reduction_ops(exact_ops.numerics)))
             for k in kl_per_position(w, r)]
    prefill(tri)
    step = StaticDecodeStep(tri)
    eager, kls, same_argmax = [], [], 0
    slots = torch.arange(2, device=dev)
    for t in range(steps):
        pos = lens + t
        got = step(ids[torch.arange(2), pos.to(dev)], pos.to(dev), slots)
        eager.append(got)
        kls += kl_per_position(want[t], got)
        same_argmax += int((got.argmax(-1) == want[t].argmax(-1)).sum())
    rule = kl_rule(floor, None)  # verify model's calibrated rule, on this run's floor
    mean = sum(kls) / len(kls)
    ok = max(kls) <= rule["max_kl"] and mean <= rule["mean_kl"]
    b.checks.append(dict(name="static_decode_vs_reference", ok=ok, max_kl=max(kls), mean_kl=mean, rule=rule,
                         same_argmax=f"{same_argmax}/{len(kls)}"))
    b.log(f"static decode step vs reference decode (tiny, {steps} steps × 2 rows): max KL {max(kls):.2e} (bound "
          f"{rule['max_kl']:.2e} = {rule['k_max']} × the fp32-reduction floor's max {rule['floor_max']:.2e}), mean "
          f"{mean:.2e} (bound {rule['mean_kl']:.2e} = {rule['k_mean']} × its mean); greedy tokens equal at "
          f"{same_argmax}/{len(kls)} — {'ok' if ok else 'FAIL'}")
    if not b.cuda:
        return
    prefill(tri)
    graphs = DecodeGraphs(tri, tiers=(2,)).capture()  # resets the caches: prefill again
    prefill(tri)
    bitwise = True
    for t in range(steps):
        pos = lens + t
        tok = ids[torch.arange(2), pos.to(dev)]
        bitwise &= bool(torch.equal(graphs.replay(tok, pos.to(dev), slots), eager[t]))
    b.checks.append(dict(name="graph_replay_equals_eager", ok=bitwise))
    b.log(f"graph replay vs eager static step: {'bitwise equal' if bitwise else 'DIFFERENT'}")




def build_layer(a, layer: int, max_batch: int, max_seq_len: int, position: int, device, gen):
    """One real-dims block with random weights and caches filled as at ``position`` (compressed entries and
    index keys written below it, NaN above), plus a runner-like object for :class:`StaticDecodeStep`."""
    from dsv4lab.engine.triton_backend import TritonOps  # imports triton
    blk = Block(a, layer)
    materialize_random(blk, device, gen)
    attn = blk.attn
    attn.allocate(max_batch, max_seq_len, torch.bfloat16, torch.float32, device)
    attn.win_kv.copy_(torch.randn(attn.win_kv.shape, device=device, generator=gen))
    n_written = (position + 1) // attn.ratio if attn.ratio else 0
    if attn.ckv is not None:
        attn.ckv[:, :n_written] = torch.randn(attn.ckv[:, :n_written].shape, device=device, generator=gen).bfloat16()
    if attn.ikv is not None:
        attn.ikv[:, :(position + 1) // 4] = torch.randn(attn.ikv[:, :(position + 1) // 4].shape, device=device,
                                                        generator=gen).bfloat16()
    ops = TritonOps(Numerics())
    model = types.SimpleNamespace(layers=[blk])
    runner = types.SimpleNamespace(model=model, ops=ops, args=a, plan=None)
    return blk, runner


def layer_bytes(blk, batch: int, idx_unique: float, position: int) -> int:
    """Bytes one decode step of ``blk`` reads: every weight once (routed experts: the ones picked), plus the
    cache rows the attention and the indexer read per row."""
    a = blk.args
    total = 0
    for name, buf in blk.named_buffers():
        if buf is None or ".experts." in f".{name}" or name.startswith("attn.") and name.split(".")[-1] in (
                "win_kv", "ckv", "ikv", "cos", "sin", "kv_ring", "score_ring"):
            continue
        if "tid2eid" in name:
            continue
        total += buf.numel() * buf.element_size()
    total += int(idx_unique * EXPERT_BYTES)
    rows = a.window_size + (min(a.index_topk, (position + 1) // 4) if blk.attn.indexer is not None
                            else (position + 1) // max(blk.attn.ratio, 1) if blk.attn.ratio else 0)
    keys = (position + 1) // 4 if blk.attn.indexer is not None else 0
    return total + batch * (rows * a.head_dim * 2 + keys * a.index_head_dim * 2)


def bench_layer(b: DecodeBench, a, gen, batches) -> None:
    dev = b.device
    layer = 4 if not b.smoke else 3  # a CSA layer with biased top-k routing
    max_seq = 4096 if not b.smoke else 64
    position = 2047 if not b.smoke else 40
    blk, runner = build_layer(a, layer, max(batches), max_seq, position, dev, gen)
    step = StaticDecodeStep(runner)
    n_rot = 1 if b.smoke else 4
    for T in batches:
        if b.over_budget(f"layer b{T}"):
            return
        Xs = [(torch.randn(T, 1, a.hc_mult, a.dim, device=dev, generator=gen)).to(torch.bfloat16)
              for _ in range(n_rot)]
        tokens = torch.randint(0, a.vocab_size, (T,), device=dev, generator=gen)
        positions = torch.full((T,), position, device=dev, dtype=torch.long)
        slots = torch.arange(T, device=dev)
        with torch.inference_mode():
            idx, _ = blk.ffn.gate(runner.ops.rms_norm(Xs[0][:, :, 0].reshape(T, -1), blk.ffn_norm.weight,
                                                      a.norm_eps), tokens, runner.ops)
            unique = len(torch.unique(idx))
            calls = [lambda X=X: step._block(blk, X, tokens, positions, slots) for X in Xs]
            t = b.time_graph_us(calls, replays=5)
        nbytes = layer_bytes(blk, T, unique, position)
        row = b.add("decode_layer", f"csa_layer{layer}:graph", T, t, nbytes, route="triton", context=position + 1)
        if b.cuda and not b.smoke:
            row["kernel_us"] = b.guard(f"layer profile b{T}", lambda: profile_breakdown(calls))
            if row["kernel_us"]:
                b.log("layer kernels (µs per step): " + ", ".join(f"{k} {v}" for k, v in row["kernel_us"].items()))
    b.log("backend report (layer):\n" + runner.ops.report())


def profile_breakdown(calls) -> dict:
    """Per-kernel GPU time (µs per call) of ``calls`` replayed from a CUDA graph, grouped into op families."""
    g = torch.cuda.CUDAGraph()
    with torch.inference_mode():
        with torch.cuda.graph(g):
            for c in calls:
                c()
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
    return kernel_families(prof, 3 * len(calls))
