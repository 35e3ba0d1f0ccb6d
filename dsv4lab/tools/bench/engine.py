"""``dsv4lab bench engine`` — the engine without HTTP, with SGLang ``bench_one_batch`` definitions.

For each batch size B and input length L_in: reset, prefill a batch of random prompts in one forward, then
decode ``output_len - 1`` steps greedily, timing every step with the device synchronized:

* prefill latency t_prefill, **prefill tok/s = B · L_in / t_prefill**;
* decode step latencies, **decode tok/s = B / median(t_step)**;
* total latency, overall tok/s = B · (L_in + L_out) / total;
* **achieved GB/s** of decode = weight bytes one decode step must read / median(t_step). The bytes are
  analytic, in the checkpoint's own formats (FP4 experts, FP8 linears, BF16 embeddings): every main-layer
  tensor once, the B embedding rows, and of each MoE layer's routed experts the expected number of distinct
  experts the batch touches under uniform routing, E·(1 − (1 − k/E)^B). KV-cache traffic is not counted,
  so this is a lower bound on the bytes moved.

One warm-up case runs first (not reported). The JSON keeps every step latency.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from dsv4lab.core.checkpoint import expected_tensors
from dsv4lab.core.errors import UserError
from dsv4lab.tools.options import add_backend, add_device, add_dtype, int_range, positive_ints, resolve_device
from dsv4lab.core.provenance import identity, result_path, write_json
from dsv4lab.tools.serve.server import ServerOptions, load_model

HELP = "engine benchmark without HTTP (SGLang bench_one_batch: prefill tok/s, decode tok/s, GB/s)"


def add_arguments(p):
    p.add_argument("--checkpoint", required=True)
    add_backend(p)
    add_device(p)
    add_dtype(p)
    p.add_argument("--batch-size", default="1,4", help="comma-separated batch sizes")
    p.add_argument("--input-len", default="32", help="comma-separated prompt lengths")
    p.add_argument("--output-len", type=int_range(2), default=8, help="generated tokens per sequence (>= 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON result path (default runs/bench_engine/<time>.json)")
    p.add_argument("--force", action="store_true", help="replace an existing committed file (under data/ or the "
                   "tuned tables) named by --out")




def decode_weight_bytes(args, batch_size: int) -> int:
    """Analytic weight bytes one decode step of ``batch_size`` sequences reads (see the module docstring)."""
    total = 0
    experts_per_layer: dict[int, int] = {}
    for spec in expected_tensors(args):
        if spec.block is not None and spec.block >= args.n_layers:
            continue  # MTP blocks: not used by generation
        if spec.component == "embedding":
            total += spec.nbytes * min(batch_size, args.vocab_size) // args.vocab_size
        elif spec.component == "routed_experts":
            experts_per_layer[spec.block] = experts_per_layer.get(spec.block, 0) + spec.nbytes
        else:
            total += spec.nbytes
    e, k = args.n_routed_experts, args.n_activated_experts
    touched = e * (1 - (1 - k / e) ** batch_size)
    for layer_bytes in experts_per_layer.values():
        total += int(layer_bytes / e * touched)
    return total


def _sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def bench_case(model, batch_size: int, input_len: int, output_len: int, seed: int, device) -> dict:
    """One SGLang-style case: prefill B×L_in, then L_out − 1 greedy decode steps."""
    vocab = int(model.args.vocab_size)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(6, vocab, (batch_size, input_len), generator=g).to(device)
    slots = torch.arange(batch_size, device=device)
    model.reset()
    with torch.no_grad():
        _sync(device)
        t0 = time.perf_counter()
        logits = model.forward(tokens, 0, slots=slots)
        nxt = logits[:, -1].argmax(-1)
        _sync(device)
        t_prefill = time.perf_counter() - t0
        steps = []
        for i in range(output_len - 1):
            _sync(device)
            t = time.perf_counter()
            logits = model.forward(nxt[:, None], input_len + i, slots=slots)
            nxt = logits[:, -1].argmax(-1)
            _sync(device)
            steps.append(time.perf_counter() - t)
    model.reset()
    median = statistics.median(steps)
    total = t_prefill + sum(steps)
    weight_bytes = decode_weight_bytes(model.args, batch_size)
    return {"batch_size": batch_size, "input_len": input_len, "output_len": output_len,
            "prefill_latency_s": t_prefill, "prefill_throughput_tok_s": batch_size * input_len / t_prefill,
            "decode_median_latency_s": median, "decode_throughput_tok_s": batch_size / median,
            "decode_step_latencies_s": steps, "total_latency_s": total,
            "overall_throughput_tok_s": batch_size * (input_len + output_len) / total,
            "decode_weight_bytes_per_step": weight_bytes, "decode_achieved_gb_s": weight_bytes / median / 1e9}


def format_table(results: list[dict]) -> str:
    head = (f"{'B':>4} {'L_in':>6} {'L_out':>6} {'prefill ms':>11} {'prefill tok/s':>14} {'step ms (med)':>14} "
            f"{'decode tok/s':>13} {'GB/s':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r['batch_size']:>4} {r['input_len']:>6} {r['output_len']:>6} "
                     f"{r['prefill_latency_s'] * 1e3:>11.2f} {r['prefill_throughput_tok_s']:>14.1f} "
                     f"{r['decode_median_latency_s'] * 1e3:>14.2f} {r['decode_throughput_tok_s']:>13.1f} "
                     f"{r['decode_achieved_gb_s']:>8.3f}")
    return "\n".join(lines)


def run(args) -> int:
    batches = positive_ints(args.batch_size, "--batch-size")
    lengths = positive_ints(args.input_len, "--input-len")
    if args.output_len < 2:
        raise UserError("--output-len must be >= 2 (one prefill token and at least one decode step)")
    device = resolve_device(args.device)
    model = load_model(ServerOptions(checkpoint=args.checkpoint, backend=args.backend, device=device,
                                     dtype=args.dtype, max_concurrency=max(batches),
                                     max_model_len=max(lengths) + args.output_len))
    slots = int(getattr(model, "max_batch", max(batches)))
    if max(batches) > slots:
        raise UserError(f"--batch-size {max(batches)} exceeds the engine's {slots} cache slots")
    if max(lengths) + args.output_len > model.args.max_seq_len:
        raise UserError(f"--input-len {max(lengths)} + --output-len {args.output_len} exceeds the cache length "
                        f"{model.args.max_seq_len}")
    print(f"warm-up (B={batches[0]}, L_in={lengths[0]}) ...", file=sys.stderr)
    bench_case(model, batches[0], lengths[0], 2, args.seed, device)
    results = []
    for b in batches:
        for n in lengths:
            print(f"B={b} L_in={n} L_out={args.output_len} ...", file=sys.stderr)
            results.append(bench_case(model, b, n, args.output_len, args.seed, device))
    print(format_table(results))
    doc = {"benchmark": "engine",
           "definitions": "SGLang bench_one_batch: prefill tok/s = B*L_in/t_prefill; decode tok/s = "
                          "B/median(t_step); GB/s = analytic decode weight bytes / median(t_step)",
           "meta": {**identity(device), "checkpoint": str(args.checkpoint), "backend": args.backend,
                    "dtype": args.dtype, "seed": args.seed},
           "results": results}
    print(f"wrote {write_json(result_path(args.out, 'bench_engine'), doc)}")
    return 0
