"""``dsv4lab verify {kernels,layers,model,record,endpoint}`` — the correctness hierarchy.

Every sub-command writes a JSON and a markdown report (``--out``, default under ``runs/``) and exits non-zero
on failure.
"""
from __future__ import annotations

from ._dispatch import add_subcommands

NAME = "verify"
HELP = "correctness hierarchy: kernels, layers, model, record (golden oracles), endpoint (any OpenAI server)"

SUBCOMMANDS = {
    "kernels": "dsv4lab.verify.cli_kernels",
    "layers": "dsv4lab.verify.cli_layers",
    "model": "dsv4lab.verify.cli_model",
    "record": "dsv4lab.verify.cli_record",
    "endpoint": "dsv4lab.serve.verify_endpoint",
}


def add_arguments(p):
    import importlib.util
    table = {}
    for k, v in SUBCOMMANDS.items():
        try:
            if importlib.util.find_spec(v) is not None:
                table[k] = v
        except ModuleNotFoundError:
            pass
    add_subcommands(p, table, "verify_command")


def run(args) -> int:
    return args._run(args)
