"""Prefill suite, conclusions: what this GPU supports of the fast paths, the settings the rows pick (``choices``,
which become the tuned file's prefill entries: :func:`dsv4lab.tools.bench.tuned.prefill_entries`), the issue's
targets as measured, and the summary printed last."""
from __future__ import annotations

from dsv4lab.engine.kernel_families import WEIGHT_GEMM, moe_tags
from dsv4lab.tools.bench.prefill.harness import PrefillBench, named_configs

MHC_OPS = ("hc_pre_norm", "hc_post_pre_norm", "hc_post")
MOE_TAGS = moe_tags()


def diagnostics(b: PrefillBench) -> dict:
    """What this GPU supports of the fast paths (and why not), for whoever reads the result file next."""
    if not b.cuda:
        return dict(note="CPU interpreter: the inline-PTX decode and cuBLAS are GPU-only")
    from dsv4lab_kernels import fp4_moe_grouped as fm
    from dsv4lab_kernels import fp8_gemm as fg
    from dsv4lab_kernels import mhc
    return dict(moe_asm_decode=fm.asm_decode_status(b.device), cublas_block_fp8=fg.cublas_unavailable_reason(b.device),
                cublas_bf16_fp32_out=fg.cublas_bf16_reason(b.device), mhc_rows_kernel=mhc.rows_kernel_status(b.device))


def _rows(b: PrefillBench, kernel: str, **match) -> list[dict]:
    return [r for r in b.rows if r["kernel"] == kernel and all(r.get(k) == v for k, v in match.items())]


def choices(b: PrefillBench, headline: int) -> dict:
    """The settings the measurements pick (the prefill entries of the tuned file a GPU run writes); ``why`` says
    from what."""
    out: dict = {"why": {}}
    moe = [r for r in _rows(b, "moe_grouped_gemm", tokens=headline) if r["variant"].endswith(":total")]
    if moe:
        best = min(moe, key=lambda r: r["time_us"])
        route_tag = best["variant"].split(":")[0]
        route, _, tag = route_tag.partition("+")
        out.update(moe_route=route, moe_tag=tag, moe_decode=MOE_TAGS[tag].get("decode", "auto"),
                   moe_persistent=MOE_TAGS[tag].get("persistent", False),
                   moe_scale_per_byte=MOE_TAGS[tag].get("scale_per_byte", False))
        out["why"]["moe"] = f"fastest at {headline} tokens: {best['variant']} rows {best['sorter_rows']} " \
                            f"{best['time_us'] / 1e3:.2f} ms"
    rows_table = []
    for T in sorted({r["tokens"] for r in moe} | {r["tokens"] for r in _rows(b, "moe_grouped_gemm")}):
        cands = [r for r in _rows(b, "moe_grouped_gemm", tokens=T) if r["variant"].endswith(":total")
                 and r["variant"].split(":")[0] == out.get("moe_route", "bf16")]
        if cands:
            rows_table.append([T, min(cands, key=lambda r: r["time_us"])["sorter_rows"]])
    if rows_table:
        out["moe_rows_by_tokens"] = rows_table
    lin = {}
    for r in _rows(b, "fp8_gemm", tokens=headline):
        name, _, impl = r["variant"].partition(":")
        if impl in ("linear:cublas", "linear:triton"):
            lin.setdefault(impl.split(":")[1], 0.0)
            lin[impl.split(":")[1]] += r["time_us"]
    if len(lin) == 2:
        out["gemm_backend"] = min(lin, key=lin.get)
        out["why"]["gemm_backend"] = ", ".join(f"{k} {v / 1e3:.2f} ms" for k, v in lin.items()) + \
            f" for the FP8 projections of a layer at {headline} tokens"
    # bf16-activation GEMMs: cuBLAS (as the backend runs it) against the first Triton configuration, in total over
    # the projections both timed
    wg: dict[str, dict[str, float]] = {}
    for r in _rows(b, "weight_gemm", tokens=headline):
        name, _, impl = r["variant"].partition(":")
        if impl == "cublas" or impl == named_configs(WEIGHT_GEMM, True)[0]:
            wg.setdefault(name, {})["cublas" if impl == "cublas" else "triton"] = r["time_us"]
    both = {k: v for k, v in wg.items() if len(v) == 2}
    if both:
        tot = {impl: sum(v[impl] for v in both.values()) for impl in ("cublas", "triton")}
        out["weight_gemm_backend"] = min(tot, key=tot.get)
        out["why"]["weight_gemm_backend"] = ", ".join(f"{k} {v / 1e3:.2f} ms" for k, v in tot.items()) + \
            f" for {', '.join(sorted(both))} at {headline} tokens"
    glue_tokens = max((r["tokens"] for r in _rows(b, "glue")), default=headline)  # a smoke run's chunk is smaller
    glue = {r["variant"]: r["time_us"] for r in _rows(b, "glue", tokens=glue_tokens)}
    dec = [glue.get(f"{op}:decode_kernel") for op in MHC_OPS]
    rows_total = {}  # geometry → the three ops' time, for the geometries every op was timed at
    for r in _rows(b, "glue", tokens=glue_tokens):
        geo = r.get("geometry")
        if geo and all(f"{op}:rows_kernel:{geo}" in glue for op in MHC_OPS):
            rows_total[geo] = sum(glue[f"{op}:rows_kernel:{geo}"] for op in MHC_OPS)
    if all(v is not None for v in dec) and rows_total:
        best = min(rows_total, key=rows_total.get)
        out["mhc_rows"] = rows_total[best] < sum(dec)
        out["mhc_rows_geometry"] = best
        out["why"]["mhc_rows"] = f"mHC of a {glue_tokens}-row chunk: rows kernel " + ", ".join(
            f"{g} {v / 1e3:.2f} ms" for g, v in sorted(rows_total.items(), key=lambda kv: kv[1])) + \
            f"; decode kernels {sum(dec) / 1e3:.2f} ms"
    chunk_rows = _rows(b, "chunked_prefill")
    table = []
    for total in sorted({r["tokens"] for r in chunk_rows}):
        per_chunk: dict = {}
        for r in chunk_rows:
            if r["tokens"] == total:
                per_chunk.setdefault(r["chunk"], []).append(r["time_us"])
        n_kinds = max(len(v) for v in per_chunk.values())
        full = {c: sum(v) for c, v in per_chunk.items() if len(v) == n_kinds}  # every layer kind measured
        if full:
            table.append([total, min(full, key=full.get)])
    if table:
        out["chunk_by_prompt"] = table
        out["why"]["chunk"] = "fastest chunk (0 = one shot) per prompt length, summed over the measured layer kinds"
    return out


def targets(b: PrefillBench, headline: int) -> dict:
    """The issue's targets, measured: grouped MoE %-of-peak at 4,096 tokens; FP8 GEMM vs cuBLAS; attention and
    indexer shares of a layer against their roofline shares."""
    moe = [r for r in _rows(b, "moe_grouped_gemm", tokens=headline) if r["variant"].endswith(":total")]
    best = max((r for r in moe if r["pct_peak"] is not None), key=lambda r: r["pct_peak"], default=None)
    fastest = min(moe, key=lambda r: r["time_us"], default=None)
    out = dict(moe_best_pct=None if best is None else dict(
        tokens=headline, variant=best["variant"], sorter_rows=best["sorter_rows"], pct_peak=best["pct_peak"],
        peak_kind=best["peak_kind"], tflops=best["tflops"], time_ms=round(best["time_us"] / 1e3, 3),
        met=best["pct_peak"] >= 50), moe_fastest=None if fastest is None else dict(
        tokens=headline, variant=fastest["variant"], sorter_rows=fastest["sorter_rows"],
        time_ms=round(fastest["time_us"] / 1e3, 3), pct_peak=fastest["pct_peak"], peak_kind=fastest["peak_kind"]))
    gemm = []
    for r in _rows(b, "fp8_gemm", tokens=headline):
        name, _, impl = r["variant"].partition(":")
        if impl == "cublas":
            tri = [t["time_us"] for t in _rows(b, "fp8_gemm", tokens=headline)
                   if t["variant"].startswith(f"{name}:triton:")]
            if tri:
                gemm.append(dict(projection=name, cublas_us=r["time_us"], triton_best_us=min(tri),
                                 triton_over_cublas=round(min(tri) / r["time_us"], 3), met=min(tri) <= r["time_us"]))
    out["fp8_gemm_vs_cublas"] = gemm
    out["layer_shares"] = [dict(layer=r["variant"], tokens=r["tokens"], chunk=r["chunk"],
                                attention=r["attention_share"], attention_roofline=r["attention_roofline_share"],
                                indexer=r["indexer_share"], indexer_roofline=r["indexer_roofline_share"],
                                met=r["attention_share"] <= r["attention_roofline_share"]
                                and r["indexer_share"] <= r["indexer_roofline_share"])
                           for r in _rows(b, "chunked_prefill") if "attention_share" in r]
    return out


def print_summary(doc: dict) -> None:
    """A summary a reader without the code can act on: ceilings, failed checks, headline rows, choices, targets."""
    p = doc["peaks"]
    checks = [c for c in doc["checks"] if c["gating"]]
    print(f"\nprefill kernels ({doc['mode']} run) on {doc['gpu']} (torch {doc['torch']}, triton {doc['triton']}, "
          f"commit {doc['commit']}), {doc['elapsed_s']} s")
    print(f"ceilings measured now: copy {p.get('copy_gbps')} GB/s, bf16 {p.get('bf16_tflops')} TFLOP/s, fp8 "
          f"{p.get('fp8_tflops')} TFLOP/s (8192³, per-tensor scales)")
    print(f"fast paths here: {doc.get('diagnostics')}")
    print(f"checks: {sum(c['ok'] for c in checks)}/{len(checks)} within their bounds; errors {len(doc['errors'])}; "
          f"skipped {len(doc['skipped'])}")
    for c in checks:
        if not c["ok"]:
            print("  FAILED " + c["line"])
    for e in doc["errors"]:
        print("  ERROR " + e[:300])
    print(f"\n{'kernel':<17}{'variant':<34}{'tokens':>7}{'rows':>5}{'chunk':>6}{'time_us':>11}{'TFLOP/s':>9}"
          f"{'% peak':>12}")
    head = max((r["tokens"] or 0) for r in doc["rows"]) if doc["rows"] else 0
    head = 4096 if any(r["tokens"] == 4096 for r in doc["rows"]) else head
    for r in doc["rows"]:
        if r["tokens"] != head and r["kernel"] not in ("chunked_prefill",) and not (
                r["kernel"] == "moe_grouped_gemm" and r["variant"].endswith(":total")):
            continue
        tflops = f"{r['tflops']:.1f}" if r["tflops"] is not None else ""
        pct = f"{r['pct_peak']:.1f} {r['peak_kind']}" if r["pct_peak"] is not None else ""
        print(f"{r['kernel']:<17}{r['variant'][:33]:<34}{r['tokens'] or '':>7}{r['sorter_rows'] or '':>5}"
              f"{'' if r['chunk'] is None else r['chunk']:>6} {r['time_us']:>10.1f}{tflops:>9}{pct:>12}")
    c = doc.get("choices", {})
    print("\nchoices (the prefill entries of the tuned file a GPU run writes; dsv4lab.engine.dispatch reads them):")
    for k, v in c.items():
        if k != "why":
            print(f"  {k} = {v}")
    for k, v in c.get("why", {}).items():
        print(f"  ({k}: {v})")
    t = doc.get("targets", {})
    m = t.get("moe_best_pct")
    if m:
        print(f"\ntarget grouped MoE @{m['tokens']} ≥ 50% of the peak of its dtype: {m['pct_peak']}% "
              f"{m['peak_kind']} ({m['variant']}, rows {m['sorter_rows']}, {m['time_ms']} ms) → "
              f"{'met' if m['met'] else 'MISSED'}")
    f = t.get("moe_fastest")
    if f:
        print(f"fastest grouped MoE @{f['tokens']}: {f['variant']} rows {f['sorter_rows']}, {f['time_ms']} ms")
    for g in t.get("fp8_gemm_vs_cublas", []):
        print(f"target FP8 GEMM {g['projection']}: Triton best {g['triton_best_us']:.1f} µs vs cuBLAS "
              f"{g['cublas_us']:.1f} µs → {'met' if g['met'] else 'slower: the backend dispatches to cuBLAS'}")
    for s in t.get("layer_shares", []):
        print(f"target shares, {s['layer']} {s['tokens']} tokens chunk {s['chunk']}: attention {s['attention']:.3f} "
              f"(roofline {s['attention_roofline']:.3f}), indexer {s['indexer']:.3f} (roofline "
              f"{s['indexer_roofline']:.3f}) → {'met' if s['met'] else 'MISSED'}")
