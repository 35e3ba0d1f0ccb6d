"""The prefill suite's driver: the checks, then the sections most important first under a watchdog, the result
written at the end with its choices, which a GPU run also writes as tuned entries (:mod:`dsv4lab.tools.bench.tuned`)."""
from __future__ import annotations

import os

import torch

from dsv4lab.core.config import get_preset
from dsv4lab.core.errors import UserError
from dsv4lab.engine.kernel_loader import kernel_module
from dsv4lab.tools.bench.common import output_path, pick_sections, run_header, select_device, write_json
from dsv4lab.tools.bench.prefill.attention import bench_attention, check_attention_side
from dsv4lab.tools.bench.prefill.dense import bench_dense, check_dense
from dsv4lab.tools.bench.prefill.glue import bench_glue
from dsv4lab.tools.bench.prefill.harness import (CHUNKS, MOE_ROUTES, PROMPTS, QUICK_ROUTES, TOKENS, PrefillBench,
                                                 plan_variants)
from dsv4lab.tools.bench.prefill.layer import bench_chunks
from dsv4lab.tools.bench.prefill.moe import MoEBench, bench_moe_headline, bench_moe_sweep, check_moe_variants
from dsv4lab.tools.bench.prefill.report import choices, diagnostics, print_summary, targets
from dsv4lab.tools.bench.tuned import TunedWriter, prefill_entries, source_of

# The sections of a run, most important first (the watchdog cuts from the end); a full run adds the sweeps of moe,
# dense and attention. ``--sections`` narrows a run (e.g. ``glue`` alone: the mHC rows kernel's geometries).
SECTIONS = ("moe", "chunks", "dense", "glue", "attention")

HELP = ("prefill kernels: grouped FP4 MoE, FP8/BF16 GEMMs beside cuBLAS, sparse attention, indexer, chunk choice "
        "(writes JSON + tuned choices)")


def add_suite_arguments(p) -> None:
    """Options of this suite beyond the dispatcher's common ``--out --quick --smoke --budget-s --commit``."""
    p.add_argument("--moe-routes", default=None, help="prefill: grouped-MoE routes to check and time (default: all; "
                   f"--quick: {','.join(QUICK_ROUTES)})")
    p.add_argument("--ablation-route", default="bf16", help="prefill: route of the sorter-rows ablation (and of the "
                   "launch-geometry variants)")


def run_checks(b: PrefillBench, args, gen, plan: dict) -> set[str]:
    """Correctness of every planned variant at real widths (within its analytic bound); returns the names that
    passed."""
    passed: set[str] = set()
    for section in (check_moe_variants, check_dense, check_attention_side):
        b.guard(section.__name__, lambda: section(b, args, gen, passed, plan))
    return passed


def run_suite(args) -> int:
    smoke = getattr(args, "smoke", False)
    quick = getattr(args, "quick", False) and not smoke
    device = select_device("prefill", smoke)
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    for name in ("fp8_gemm", "moe_sort", "fp4_moe_grouped", "attention_prefill"):
        kernel_module(name)  # registers dsv4lab_kernels from the source tree when it is not installed
    b = PrefillBench(device, getattr(args, "budget_s", 160.0), smoke)
    gen = torch.Generator(device=device).manual_seed(0)
    a = get_preset("tiny" if smoke else "flash")
    mode = "smoke" if smoke else ("quick" if quick else "full")
    if smoke:
        tokens, abl, prompts, chunks, headline, reps = (64,), 64, (64,), (32, 0), 64, 1
    elif quick:
        tokens, abl, prompts, chunks, headline, reps = (4096,), 2048, (2048, 4604), (2048, 4096, 0), 4096, 2
    else:
        tokens, abl, prompts, chunks, headline, reps = TOKENS, 2048, PROMPTS, CHUNKS, 4096, 3
    doc = run_header(b, args, smoke)
    out = output_path(args, "prefill")
    tuned = TunedWriter(args, out, doc["gpu"], b.cuda and not smoke)  # a base from another GPU: refused now
    routes_arg = getattr(args, "moe_routes", None) or ",".join(QUICK_ROUTES if quick else MOE_ROUTES)
    routes = tuple(r for r in routes_arg.split(",") if r)
    abl_route = getattr(args, "ablation_route", "bf16")
    if abl_route not in routes:
        raise UserError(f"--ablation-route {abl_route!r} is not among --moe-routes {','.join(routes)}")
    bad = [r for r in routes if r not in MOE_ROUTES]
    if bad:
        raise UserError(f"--moe-routes: unknown route(s) {', '.join(bad)}; known: {', '.join(MOE_ROUTES)}")
    plan = plan_variants(mode, routes, abl_route)
    chosen = pick_sections(getattr(args, "sections", None), SECTIONS, SECTIONS)
    b.record_ceilings()
    b.log(f"checks ({b.elapsed():.0f} s)")
    # the glue checks its own kernels and the chunk choice runs the backend as the engine does; the other sections
    # time only what these checks passed
    passed = run_checks(b, a, gen, plan) if set(chosen) - {"glue", "chunks"} else set()
    moe: dict = {}

    def moe_bench() -> MoEBench:
        if "bench" not in moe:
            moe["bench"] = MoEBench(b, a, gen, passed)
        return moe["bench"]

    def release_moe() -> None:
        moe.clear()  # the 3.2 GB bank: the layers below bring their own
        if b.cuda:
            torch.cuda.empty_cache()

    ratios = (4,) if (quick or smoke) else (4, max(a.compress_ratios))
    # most important first: the watchdog cuts from the end
    sections = [  # (section of --sections, name in the log, work)
        ("moe", "moe", lambda: bench_moe_headline(b, moe_bench(), routes, headline, plan, abl, abl_route,
                                                  quick or smoke)),
        ("moe", "release", release_moe),
        ("chunks", "chunk choice", lambda: bench_chunks(b, a, gen, prompts, chunks, ratios, reps, headline)),
        ("dense", "dense gemms", lambda: bench_dense(b, a, gen, passed, headline)),
        # smoke: 24 rows (a partial 16-row block) — the interpreter's cost is per row, and the script is what it checks
        ("glue", "glue", lambda: bench_glue(b, a, gen, 24 if smoke else headline)),
        ("attention", "attention", lambda: bench_attention(b, a, gen, passed, (headline,))),
    ]
    if not (quick or smoke):
        sections += [
            ("moe", "moe sweep", lambda: bench_moe_sweep(b, moe_bench(), routes, tokens, headline)),
            ("moe", "release", release_moe),
            ("dense", "dense sweep", lambda: [bench_dense(b, a, gen, passed, T) for T in tokens if T != headline]),
            ("attention", "attention sweep",
             lambda: bench_attention(b, a, gen, passed, [t for t in tokens if t != headline])),
        ]
    # forward-only, as the engine runs: tensors one section caches (made in inference mode by the layer timings)
    # are updated in place by the next (on the H200 the dense GEMMs failed on such an inference tensor)
    with torch.inference_mode():
        b.run_sections([(name, work) for section, name, work in sections if section in chosen])
    doc.update(mode=mode, sections=list(chosen), headline=headline, peaks=b.peaks, checks=b.checks,
               rows=b.rows, skipped=b.skipped, errors=b.errors, compile_s=b.compile_s,
               elapsed_s=round(b.elapsed(), 1), diagnostics=diagnostics(b), choices=choices(b, headline),
               targets=targets(b, headline))
    write_json(out, doc)
    source = source_of(doc, "prefill")
    wrote_tuned = tuned.write(source, prefill_entries(doc["choices"], headline, source[0]))
    print_summary(doc)
    print(f"wrote {out}" + (f" and {wrote_tuned}" if wrote_tuned else ""))
    return 0 if all(c["ok"] for c in b.checks if c["gating"]) and not b.errors else 1


