"""``dsv4lab bench kernels --suite decode|prefill`` — dispatches to ``dsv4lab.bench.<suite>.run_suite``."""
from __future__ import annotations

import importlib

from ..errors import UserError

HELP = "kernel benchmarks on the GPU: --suite decode (batch 1…64) or prefill (512…8192 tokens); writes JSON"
SUITES = ("decode", "prefill")


def add_arguments(p) -> None:
    p.add_argument("--suite", choices=SUITES, required=True, help="which kernel family to benchmark")
    p.add_argument("--out", default=None, help="JSON path (default runs/bench/<suite>_kernels.json)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and variants")
    # suite-specific options are accepted here and ignored by suites that do not use them
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one repetition (checks the script itself)")
    p.add_argument("--budget-s", type=float, default=160.0, help="stop and write after this many seconds")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse --short HEAD)")
    for suite in SUITES:  # a suite's own options (its module must stay light to import: no torch/triton at top)
        try:
            mod = importlib.import_module(f"dsv4lab.bench.{suite}")
        except ImportError:
            continue
        if hasattr(mod, "add_suite_arguments"):
            mod.add_suite_arguments(p.add_argument_group(f"--suite {suite}"))


def run(args) -> int:
    try:
        mod = importlib.import_module(f"dsv4lab.bench.{args.suite}")
    except ImportError as err:
        raise UserError(f"bench suite {args.suite!r} is unavailable: {err}") from None
    return mod.run_suite(args)
