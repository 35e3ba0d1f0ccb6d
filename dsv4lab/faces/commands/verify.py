"""``dsv4lab verify {kernels,layers,model,record,endpoint}`` — the correctness hierarchy.

Every sub-command writes a JSON and a markdown report (``--out``, default under ``runs/``) and exits non-zero
on failure.
"""
from __future__ import annotations

from dsv4lab.faces.commands._dispatch import subcommand_group

NAME = "verify"
HELP = "correctness hierarchy: kernels, layers, model, record (golden oracles), endpoint (any OpenAI server)"

SUBCOMMANDS = {
    "kernels": ("dsv4lab.tools.verify.cli_kernels", "every registered op of each backend against the reference"),
    "layers": ("dsv4lab.tools.verify.cli_layers", "per layer and stage against the reference; names the first divergence"),
    "model": ("dsv4lab.tools.verify.cli_model", "fixed-id oracles, trajectory hash, teacher-forced logits vs the golden"),
    "record": ("dsv4lab.tools.verify.cli_record", "record a checkpoint's golden oracles"),
    "endpoint": ("dsv4lab.tools.serve.verify_endpoint", "check an OpenAI-compatible server against a golden file"),
}

add_arguments, run = subcommand_group(SUBCOMMANDS, "verify_command")
