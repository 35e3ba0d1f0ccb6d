"""``dsv4lab bench {kernels,engine,serve,e2e}`` — measurements that write JSON results."""
from __future__ import annotations

from ._dispatch import add_subcommands

NAME = "bench"
HELP = "benchmarks: kernels (--suite decode|prefill), engine, serve (HTTP), e2e, collectives"

SUBCOMMANDS = {
    "kernels": "dsv4lab.bench.kernels",
    "engine": "dsv4lab.bench.engine",
    "serve": "dsv4lab.bench.serve",
    "e2e": "dsv4lab.bench.e2e",
    "collectives": "dsv4lab.bench.collectives",
}


def add_arguments(p):
    import importlib.util
    table = {k: v for k, v in SUBCOMMANDS.items() if importlib.util.find_spec(v) is not None}
    add_subcommands(p, table, "bench_command")


def run(args) -> int:
    return args._run(args)
