"""``dsv4lab bench {kernels,engine,serve,e2e,collectives}`` — measurements that write JSON results."""
from __future__ import annotations

from dsv4lab.core.provenance import refuse_replacing_committed
from dsv4lab.faces.commands._dispatch import subcommand_group

NAME = "bench"
HELP = "benchmarks: kernels (--suite decode|prefill), engine, serve (HTTP), e2e, collectives"

SUBCOMMANDS = {
    "kernels": ("dsv4lab.tools.bench.kernels", "kernel suites on the GPU: --suite decode or prefill; writes JSON"),
    "engine": ("dsv4lab.tools.bench.engine", "engine throughput without HTTP: prefill and decode tok/s, GB/s"),
    "serve": ("dsv4lab.tools.bench.serve", "an OpenAI-compatible endpoint under load: TTFT, TPOT, ITL, E2E"),
    "e2e": ("dsv4lab.tools.bench.e2e", "a generated full-width model end to end: tok/s, MBU, TTFT, oracle hash"),
    "collectives": ("dsv4lab.tools.bench.collectives", "all-reduce latency: library vs peer-read, eager and graphed"),
}


def refuse_committed_outputs(args) -> None:
    """Before any bench sub-command measures: a committed file named by ``--out`` (or ``--tuned-out``) is refused
    unless ``--force`` (serve also checks its default path, known once the model is named)."""
    for flag in ("out", "tuned_out"):
        refuse_replacing_committed(getattr(args, flag, None), getattr(args, "force", False),
                                   "--" + flag.replace("_", "-"))


add_arguments, run = subcommand_group(SUBCOMMANDS, "bench_command", before_run=refuse_committed_outputs)
