"""``dsv4lab bench kernels --suite decode|prefill`` — dispatches to ``dsv4lab.tools.bench.<suite>.run_suite``."""
from __future__ import annotations

from dsv4lab.tools.bench import decode, prefill
from dsv4lab.tools.bench.tuned import add_tuned_arguments

HELP = "kernel benchmarks on the GPU: --suite decode (batch 1…64) or prefill (512…8192 tokens); writes JSON"
SUITES = {"decode": decode, "prefill": prefill}


def add_arguments(p) -> None:
    p.add_argument("--suite", choices=tuple(SUITES), required=True, help="which kernel family to benchmark")
    p.add_argument("--out", default=None, help="JSON path (default runs/bench/<suite>_kernels.json)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and variants")
    # suite-specific options are accepted here and ignored by suites that do not use them
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one repetition (checks the script itself)")
    p.add_argument("--budget-s", type=float, default=160.0, help="stop and write after this many seconds")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse --short HEAD)")
    p.add_argument("--sections", default=None,
                   help="comma-separated subset of the suite's sections (default: all; --quick: the quick ones) — "
                        f"decode: {','.join(decode.SECTIONS)} (quick: {','.join(decode.QUICK_SECTIONS)}); prefill: "
                        f"{','.join(prefill.SECTIONS)}; the tuned file keeps what a run does not measure")
    add_tuned_arguments(p.add_argument_group("the tuned file (dsv4lab.engine.dispatch), written from a GPU"))
    for name, suite in SUITES.items():  # a suite's own options; suites import triton only when they run
        if hasattr(suite, "add_suite_arguments"):
            suite.add_suite_arguments(p.add_argument_group(f"--suite {name}"))


def run(args) -> int:
    return SUITES[args.suite].run_suite(args)
