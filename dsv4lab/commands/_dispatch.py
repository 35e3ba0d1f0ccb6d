"""Helpers for commands with sub-commands (``verify kernels``, ``bench serve`` ...).

Each sub-command is implemented in the module that owns its logic, which exposes ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``; the command module only lists them, so the parser stays
cheap (modules are imported when the sub-command runs, except for their argument definitions).
"""
from __future__ import annotations

import importlib


def add_subcommands(parser, table: dict[str, str], dest: str) -> None:
    sub = parser.add_subparsers(dest=dest, metavar="SUBCOMMAND")
    sub.required = True
    for name, modname in table.items():
        try:
            mod = importlib.import_module(modname)
        except ImportError as err:  # an optional dependency is missing: keep the rest of the CLI working
            p = sub.add_parser(name, help=f"(unavailable: {err})")
            p.set_defaults(_run=_unavailable(name, err))
            continue
        p = sub.add_parser(name, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP))
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)


def _unavailable(name, err):
    def run(args):
        from ..cli import UserError
        raise UserError(f"{name} is unavailable: {err}")
    return run
