"""``bench e2e``'s report: the issues' targets as measured, and the summary printed after a run."""
from __future__ import annotations

from dsv4lab.tools.bench.e2e_fusions import format_fusions
from dsv4lab.tools.bench.e2e_multitoken import format_multitoken


def targets(doc: dict) -> dict:
    """The issue's targets, as measured (None where this run cannot say)."""
    rows = {r["batch"]: r for r in doc["decode"]}
    mbu = rows[1]["mbu"] if 1 in rows else None
    scale = round(rows[8]["tok_s"] / rows[1]["tok_s"], 2) if 1 in rows and 8 in rows else None
    ttft = doc["ttft"]["ttft_s"] if doc.get("ttft", {}).get("prompt_tokens") == 4604 else None
    bd = doc.get("breakdown") or {}
    launches = bd.get("launches_per_layer")
    us = bd.get("measured_gpu_us") or {}
    # the small torch kernels (element-wise and reductions) the decode issue counted at 61% of the eager step
    torch_share = round(us.get("torch_elementwise", 0.0) / bd["measured_total_us"], 4) if us else None
    # issue 33 (batch-1 decode): MBU ≥ 45 %, ≤ 12 launches per layer, after 65,536 prompt tokens ≥ 90 % of the
    # short-context speed of the same run
    ctx = {r["context"]: r for r in doc.get("contexts", [])}
    flat = round(ctx[65536]["tok_s"] / rows[1]["tok_s"], 4) if 65536 in ctx and 1 in rows else None
    return dict(batch1_mbu=dict(value=mbu, target=0.45, met=None if mbu is None else mbu >= 0.45),
                **multitoken_targets(doc),
                batch8_over_batch1=dict(value=scale, target=5.0, met=None if scale is None else scale >= 5.0),
                launches_per_layer=dict(value=launches, target=12, met=None if launches is None else launches <= 12),
                context_65536_over_batch1=dict(value=flat, target=0.90, met=None if flat is None else flat >= 0.90),
                torch_kernel_share=dict(value=torch_share, target=0.20,
                                        met=None if torch_share is None else torch_share <= 0.20),
                ttft_4604=dict(value=ttft, target=0.30, met=None if ttft is None else ttft <= 0.30))


def format_summary(doc: dict) -> str:
    lines = [f"{doc['model']} ({doc['layers']} layers {doc['layer_kinds']}) seed {doc['seed']} on {doc['ranks']} × "
             f"{doc['gpu']} (tp {doc['tp']}, ep {doc['ep']}, {doc['backend']}, decode path {doc['decode_path']}), "
             f"oracle hash {doc.get('oracle_hash')}",
             f"{'batch':>6} {'tok/s':>10} {'MBU':>7}  path"]
    for r in doc["decode"]:
        mbu = "-" if r["mbu"] is None else f"{100 * r['mbu']:.1f}%"
        lines.append(f"{r['batch']:>6} {r['tok_s']:>10.2f} {mbu:>7}  {r['path']}")
    for r in doc.get("contexts", []):
        mbu = "-" if r["mbu"] is None else f"{100 * r['mbu']:.1f}%"
        lines.append(f"b=1 after {r['context']:>6} tokens: {r['tok_s']:>8.2f} tok/s, MBU {mbu}, prefill "
                     f"{r['prefill_s']:.2f} s; graph = eager step: {r['graph_equals_static']}, vs per-op forward "
                     f"rel {r['forward_rel']:.2e}, vs reference {r.get('reference_rel', float('nan')):.2e} (per-op "
                     f"forward vs reference {r.get('forward_vs_reference_rel', float('nan')):.2e})")
    if doc.get("ttft"):
        t = doc["ttft"]
        lines.append(f"TTFT {t['ttft_s']:.3f} s for {t['prompt_tokens']} tokens (chunk {t['chunk']}; "
                     + ", ".join(f"{r['chunk']}: {r['ttft_s']:.3f} s" for r in doc["prefill"]) + ")")
    if doc.get("prefill_breakdown"):
        pb = doc["prefill_breakdown"]
        top = ", ".join(f"{k} {v / 1e3:.1f}" for k, v in list(pb["measured_op_us"].items())[:6])
        lines.append(f"prefill of {pb['prompt_tokens']} tokens in chunks of {pb['chunk']}: "
                     f"{pb['measured_total_us'] / 1e3:.1f} ms measured (ops, ms: {top}; between the ops "
                     f"{pb['untimed_us'] / 1e3:.1f}), {pb['predicted_total_us'] / 1e3:.1f} ms modelled")
    if doc.get("graph_check"):
        lines.append(f"graph check: {doc['graph_check']}")
    if doc.get("breakdown"):
        bd = doc["breakdown"]
        lines.append(f"breakdown ({bd['source']}): {bd['measured_total_us']} µs, {bd['launches_per_step']} launches "
                     f"({bd['launches_per_layer']} per layer); " + ", ".join(f"{k} {v}" for k, v in
                                                                            bd["measured_gpu_us"].items()))
        if bd.get("replay_us") is not None:
            lines.append(f"step replay {bd['replay_us']} µs (PDL {'on' if bd.get('pdl') else 'off'}), without PDL "
                         f"{bd.get('replay_without_pdl_us')} µs; kernels profiled without PDL: "
                         f"{bd.get('profiled_without_pdl')}")
    lines += format_fusions(doc)
    if doc.get("abba"):
        a = doc["abba"]
        lines.append(f"ABBA ({a['order']}): " + ", ".join(f"{s} {v} tok/s" for s, v in a["tok_s"].items())
                     + f"; speedup {a['speedup']}")
    lines += format_multitoken(doc)
    lines.append("parts (s): " + ", ".join(f"{k} {v}" for k, v in doc.get("timing_s", {}).items())
                 + (f"; skipped: {', '.join(doc['skipped'])}" if doc.get("skipped") else "")
                 + (f"; failed: {', '.join(doc['failed'])}" if doc.get("failed") else ""))
    return "\n".join(lines)


def _at_least(value, target) -> dict:
    return dict(value=value, target=target, met=None if value is None else value >= target)


def multitoken_targets(doc: dict) -> dict:
    """Issue 32's targets: MBU at batch 8 and 32; each verify step within 1.2 × its bytes ratio of the one-token
    step; at injected α = 0.8 the best ``k`` at ≥ 1.25× plain greedy and ≥ 90 % of its modelled ideal."""
    rows = {r["batch"]: r for r in doc["decode"]}
    out = {f"batch{b}_mbu": _at_least(rows[b]["mbu"] if b in rows else None, 0.35) for b in (8, 32)}
    for r in doc.get("verify") or []:
        limit = round(1.2 * r["bytes_ratio"], 3)
        out[f"verify_k{r['draft_tokens']}_over_step"] = dict(value=r["verify_over_step"], target=limit,
                                                             met=r["verify_over_step"] <= limit)
    at = [r for r in doc.get("speculative") or [] if r["alpha"] == 0.8]
    best = max(at, key=lambda r: r["speedup"], default=None)
    out["speculative_alpha0.8_speedup"] = dict(_at_least(best and best["speedup"], 1.25),
                                               draft_tokens=best and best["draft_tokens"])
    out["speculative_alpha0.8_of_ideal"] = _at_least(best and best["of_ideal"], 0.9)
    return out
