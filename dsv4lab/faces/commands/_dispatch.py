"""Commands with sub-commands (``verify kernels``, ``bench serve`` ...), each imported only when it runs.

Each sub-command is implemented in the module that owns its logic, which exposes ``add_arguments(parser)``,
``run(args) -> int`` and optionally ``DESCRIPTION`` (or ``HELP``) for its ``--help``. The command module lists them
with one help line each; a sub-command's module is imported when that sub-command is parsed (or its ``--help``
shown), so ``dsv4lab --help`` and ``dsv4lab bench --help`` import none of them. A module that cannot be imported
(an optional dependency missing) leaves the rest of the CLI working and says why when it is asked for.
"""
from __future__ import annotations

import argparse
import importlib

from dsv4lab.faces.cli import ArgumentParser
from dsv4lab.core.errors import UserError


class LazySubcommandParser(ArgumentParser):
    """The parser of one sub-command, filled from ``module`` (its arguments, description, ``run``) on first use."""

    def __init__(self, *args, module: str, before_run=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.module = module
        self.before_run = before_run
        self.unavailable: ImportError | None = None
        self._filled = False

    def fill(self) -> None:
        if self._filled:
            return
        self._filled = True
        try:
            mod = importlib.import_module(self.module)
        except ImportError as err:  # an optional dependency is missing: say so when this sub-command is asked for
            self.unavailable = err
            return
        self.description = getattr(mod, "DESCRIPTION", None) or getattr(mod, "HELP", None) or self.description
        mod.add_arguments(self)
        self.set_defaults(_run=_preceded(self.before_run, mod.run) if self.before_run else mod.run, _prog=self.prog)

    def parse_known_args(self, args=None, namespace=None):
        self.fill()
        if self.unavailable is not None:  # whatever the flags, the answer is why the sub-command cannot run
            namespace = namespace if namespace is not None else argparse.Namespace()
            namespace._run, namespace._prog = _unavailable(self.unavailable), self.prog
            return namespace, []
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self.fill()
        return super().format_help()


def subcommand_group(table: dict[str, tuple[str, str]], dest: str, before_run=None):
    """``(add_arguments, run)`` of a command made of the sub-commands of ``table`` (name → (module, one-line
    help)); the chosen sub-command's name lands in ``args.<dest>``. ``before_run(args)``, when given, runs before
    every sub-command (checks common to the group, e.g. bench's committed outputs)."""
    def add_arguments(parser) -> None:
        sub = parser.add_subparsers(dest=dest, metavar="SUBCOMMAND", parser_class=LazySubcommandParser)
        sub.required = True
        for name, (module, help_line) in table.items():
            sub.add_parser(name, help=help_line, description=help_line, module=module, before_run=before_run)

    def run(args) -> int:
        return args._run(args)
    return add_arguments, run


def _preceded(check, run):
    def checked_run(args) -> int:
        check(args)
        return run(args)
    return checked_run


def _unavailable(err: ImportError):
    def run(args):
        raise UserError(f"unavailable in this installation ({err})")
    return run
