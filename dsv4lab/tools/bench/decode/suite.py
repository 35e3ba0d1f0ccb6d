"""The decode suite's driver: the sections in order under a watchdog, the result written after each, the tuned
entries written from a GPU run (:mod:`dsv4lab.tools.bench.tuned`), the issue's targets and a short table last."""
from __future__ import annotations

import torch

from dsv4lab.core.config import get_preset
from dsv4lab.core.paths import DATA_DIR
from dsv4lab.tools.bench.common import output_path, pick_sections, run_header, select_device, write_json
from dsv4lab.tools.bench.decode.attention import bench_attention, check_attention
from dsv4lab.tools.bench.decode.gemv import (bench_gemv, check_gemv, gemv_variants, probe_scaled_mm,
                                             projection_shapes)
from dsv4lab.tools.bench.decode.harness import BATCHES, QUICK_BATCHES, QUICK_BUDGET_S, DecodeBench
from dsv4lab.tools.bench.decode.layer import bench_layer, check_static_decode
from dsv4lab.tools.bench.decode.long_context import bench_long_context, check_long_context
from dsv4lab.tools.bench.decode.mhc import bench_mhc
from dsv4lab.tools.bench.decode.moe import bench_moe, check_moe, moe_variants
from dsv4lab.tools.bench.tuned import TunedWriter, decode_entries, source_of
from dsv4lab.tools.options import positive_ints

HELP = "decode kernels: routed FP4 MoE, FP8/BF16 GEMV vs cuBLAS, attention, one layer (writes JSON + tuned choices)"

SECTIONS = ("moe", "gemv", "mhc", "attention", "layer")
QUICK_SECTIONS = ("moe", "gemv", "mhc")


def chosen_sections(spec: str | None, quick: bool) -> tuple[str, ...]:
    """The sections a run times, in :data:`SECTIONS` order: ``spec`` (comma-separated names), else the mode's."""
    return pick_sections(spec, SECTIONS, QUICK_SECTIONS if quick else SECTIONS)


def add_suite_arguments(p) -> None:
    """Options of this suite beyond the dispatcher's common ones."""
    p.add_argument("--batches", default=None,
                   help=f"decode: token rows timed (comma-separated; default {','.join(map(str, BATCHES))}, --quick "
                        f"{','.join(map(str, QUICK_BATCHES))}; e.g. 16,32 for the larger tiers of a batched step — "
                        "the dispatch takes each call's entry at the fewest rows ≥ its own)")


def run_suite(args) -> int:
    smoke = getattr(args, "smoke", False)
    quick = getattr(args, "quick", False)
    chosen = chosen_sections(getattr(args, "sections", None), quick)  # a misspelt name is refused before any work
    asked = getattr(args, "batches", None)
    asked = tuple(positive_ints(asked, "--batches")) if asked else None  # so is a bad row count
    device = select_device("decode", smoke)
    from dsv4lab.engine import triton_backend  # noqa: F401 — registers dsv4lab_kernels, sets the interpreter on a CPU
    budget = getattr(args, "budget_s", 160.0)
    b = DecodeBench(device, min(budget, QUICK_BUDGET_S) if quick else budget, smoke)
    b.quick = quick or smoke
    gen = torch.Generator(device=device).manual_seed(0)
    a = get_preset("tiny" if smoke else "flash")
    tiny = DATA_DIR / "tiny"
    batches = (1,) if smoke else (asked or (QUICK_BATCHES if quick else BATCHES))
    mv = moe_variants(smoke, quick)
    gv = gemv_variants(smoke, quick)
    doc = run_header(b, args, smoke) | dict(quick=quick)
    out = output_path(args, "decode")
    doc["sections"] = list(chosen)
    if asked:
        doc["batches"] = list(asked)  # (the tuned entries' source names them: two narrowed runs stay apart)
    # read (and a base from another GPU refused) before the run
    tuned = TunedWriter(args, out, doc["gpu"], b.cuda and not smoke and bool({"moe", "gemv", "mhc", "attention"}
                                                                              & set(chosen)))
    wrote_tuned = None

    def write() -> None:  # after every section: a run stopped from outside still leaves its measurements
        nonlocal wrote_tuned
        doc.update(copy_bw_gbps=b.copy_bw, peaks=b.peaks, cublas_scaled_mm=b.cublas, checks=b.checks, rows=b.rows,
                   skipped=b.skipped, errors=b.errors, elapsed_s=round(b.elapsed(), 1))
        doc["targets"] = targets(doc)
        write_json(out, doc)
        source = source_of(doc, "decode")
        wrote_tuned = tuned.write(source, decode_entries(doc, projection_shapes(a), source[0]))

    def after_section() -> None:
        if b.cuda:
            torch.cuda.empty_cache()
        write()

    b.guard("ceilings", b.record_ceilings)
    b.guard("scaled_mm probe", lambda: probe_scaled_mm(b))
    b.log(f"checks ({b.elapsed():.0f} s)")
    passed_moe, gemv_ok = set(), {}
    if "moe" in chosen:
        passed_moe = b.guard("moe checks", lambda: check_moe(b, a, gen, mv)) or set()
    if "gemv" in chosen:
        gemv_ok = b.guard("gemv checks", lambda: check_gemv(b, a, gen, gv)) or {}
    write()

    def attention():
        passed = check_attention(b, a)
        passed |= b.guard("long-context checks", lambda: check_long_context(b, a, gen)) or set()
        b.guard("static decode step (tiny)", lambda: check_static_decode(b, tiny))
        bench_attention(b, a, gen, passed, batches)
        # the context sweep: batch 1 and the largest batch (the long-context kernels' two ends)
        ends = sorted({batches[0], batches[-1]})
        b.guard("long-context sweep", lambda: bench_long_context(b, a, gen, passed, ends))
    sections = {"moe": lambda: bench_moe(b, a, gen, passed_moe, batches, mv),
                "gemv": lambda: bench_gemv(b, a, gen, gemv_ok, batches, gv),
                "mhc": lambda: bench_mhc(b, a, gen, batches),
                "attention": attention,
                "layer": lambda: bench_layer(b, a, gen, batches)}
    b.run_sections([(name, sections[name]) for name in SECTIONS if name in chosen], after=after_section)
    write()
    print_table(doc)
    print(f"wrote {out}" + (f" and {wrote_tuned}" if wrote_tuned else ""))
    return 0 if all(c["ok"] for c in b.checks) and not b.errors else 1


def targets(doc: dict) -> dict:
    """The issue's targets, measured: routed MoE at batch 1 ≥ 60% of the copy bandwidth and batch 8 ≤ 3× batch 1
    (best variant of the reference's semantics each); every projection's dispatched choice at least as fast as
    the faster of cuBLAS and the own kernel in this run (true by construction of the dispatch: the row says by how
    much each lost)."""
    out: dict = {}
    moe = [r for r in doc["rows"] if r["kernel"] == "moe_decode" and r.get("route") in ("dot", "fma", "dot_scaled")]
    best = {}
    for r in moe:
        if r["batch"] not in best or r["time_us"] < best[r["batch"]]["time_us"]:
            best[r["batch"]] = r
    if 1 in best:
        b1 = best[1]
        out["moe_decode_b1"] = dict(variant=b1["variant"], time_us=b1["time_us"], pct_copy_bw=b1["pct_copy_bw"],
                                    target_pct=60, met=bool(b1["pct_copy_bw"] and b1["pct_copy_bw"] >= 60))
        if 8 in best:
            ratio = best[8]["time_us"] / b1["time_us"]
            out["moe_decode_b8_over_b1"] = dict(variant=best[8]["variant"], time_us=best[8]["time_us"],
                                                ratio=round(ratio, 2), bytes_ratio=round(best[8]["bytes"] / b1["bytes"], 2),
                                                target=3.0, met=ratio <= 3.0)
    int8 = [r for r in doc["rows"] if r["kernel"] == "moe_decode" and r.get("route") == "int8" and r["batch"] == 1]
    checks = [c for c in doc["checks"] if str(c.get("name", "")).startswith("moe:int8")]
    if checks:
        out["int8_own_arithmetic_check"] = dict(checks=len(checks), passed=sum(bool(c["ok"]) for c in checks),
                                                met=all(c["ok"] for c in checks),
                                                time_us_b1=min((r["time_us"] for r in int8), default=None))
    for kernel in sorted({r["kernel"] for r in doc["rows"] if "_gemv_" in r["kernel"]}):
        for T in sorted({r["batch"] for r in doc["rows"] if r["kernel"] == kernel}):
            rows = [r for r in doc["rows"] if r["kernel"] == kernel and r["batch"] == T]
            own = [r for r in rows if r.get("impl") == "triton"]
            cub = [r for r in rows if r.get("impl") == "cublas"]
            if not own:
                continue
            o = min(own, key=lambda r: r["time_us"])
            c = min(cub, key=lambda r: r["time_us"]) if cub else None
            chosen = o if c is None or o["time_us"] <= c["time_us"] else c
            out[f"{kernel}_b{T}"] = dict(dispatched=chosen["variant"], time_us=chosen["time_us"],
                                         own_us=o["time_us"], cublas_us=c["time_us"] if c else None,
                                         pct_copy_bw=chosen["pct_copy_bw"], met=True)
    return out


def print_table(doc: dict) -> None:
    print(f"\ndecode kernels on {doc['gpu']} (torch {doc['torch']}, triton {doc['triton']}, commit {doc['commit']}"
          f"{', quick' if doc.get('quick') else ''})")
    print(f"copy bandwidth {doc['copy_bw_gbps']} GB/s; {doc.get('peaks')}; checks "
          f"{sum(bool(c['ok']) for c in doc['checks'])}/{len(doc['checks'])} ok; {len(doc['errors'])} errors; "
          f"{doc['elapsed_s']} s; _scaled_mm block scales: {doc.get('cublas_scaled_mm')}")
    failed = [c.get("name") for c in doc["checks"] if not c["ok"]]
    if failed:
        print(f"FAILED checks ({len(failed)}): {', '.join(map(str, failed[:12]))}{' …' if len(failed) > 12 else ''}")
    best: dict = {}
    for r in doc["rows"]:
        key = (r["kernel"], r["batch"], r.get("route"))
        if key not in best or r["time_us"] < best[key]["time_us"]:
            best[key] = r
    print(f"{'kernel':<26}{'best variant of its route':<36}{'batch':>6}{'time_us':>10}{'GB/s':>9}{'%copy':>7}")
    for r in sorted(best.values(), key=lambda r: (r["kernel"], r["batch"], r["time_us"])):
        print(f"{r['kernel']:<26}{r['variant'][:35]:<36}{r['batch']:>6}{r['time_us']:>10.2f}"
              f"{r['gbps'] or 0:>9.1f}{r['pct_copy_bw'] or 0:>7.1f}")
    for k, v in doc.get("targets", {}).items():
        print(f"target {k}: {v}")
