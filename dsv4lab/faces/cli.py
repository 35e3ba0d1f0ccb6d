"""The ``dsv4lab`` command line. Each subcommand lives in its own module under :mod:`dsv4lab.faces.commands`.

A command module defines ``NAME`` (the subcommand), ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. Modules are discovered, so adding a command means adding a file. Command modules import
nothing heavy at module level, and a command's sub-commands (``bench e2e``, ``verify model``) are imported only
when they are the one being run (:mod:`dsv4lab.faces.commands._dispatch`), so ``dsv4lab --help`` is instant.

Mistakes are reported in one line and exit status 2, with no traceback:

* a flag value argparse rejects (``--backend trition``) — ``dsv4lab generate: error: argument --backend: invalid
  choice: 'trition' (choose from reference, triton)``; the shared flags are declared once in :mod:`dsv4lab.tools.options`;
* any :class:`~dsv4lab.core.errors.DSV4LabError` a command raises (a bad path, a malformed checkpoint, a wrong config
  key), and a missing or already existing file; ``DSV4LAB_DEBUG=1`` shows the traceback too.
"""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

from dsv4lab import __version__
from dsv4lab.faces import commands
from dsv4lab.core.errors import DSV4LabError

USER_ERRORS = (DSV4LabError, FileNotFoundError, FileExistsError)
"""What the command line reports as one line (exit 2) instead of a traceback."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``PROG: error: MESSAGE (see PROG --help)``, exit status 2.

    Sub-parsers created from it are of the same class, so every command and sub-command reports alike."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _command_modules():
    mods = []
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mods.append(importlib.import_module(f"{commands.__name__}.{info.name}"))
    return mods


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="dsv4lab", description="DeepSeek-V4-Flash inference workbench: checkpoints, reference model, "
        "verification, layout repair, kernels, performance model, serving.")
    parser.add_argument("--version", action="version", version=f"dsv4lab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _command_modules():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run, _prog=p.prog)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help, --version, or a flag argparse rejected (one line already printed)
        return done.code if isinstance(done.code, int) else 0
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except USER_ERRORS as err:
        if os.environ.get("DSV4LAB_DEBUG"):
            raise
        print(f"{args._prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{args._prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
