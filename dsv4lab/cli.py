"""The ``dsv4lab`` command line. Each subcommand lives in its own module under :mod:`dsv4lab.commands`.

A command module defines ``NAME`` (the subcommand), ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. Modules are discovered, so adding a command means adding a file. Heavy imports (torch,
triton, fastapi, papermill) happen inside ``run``, never at parse time, so ``dsv4lab --help`` is instant.

Errors the user can fix (a bad path, a malformed checkpoint, a wrong config key) are raised as
:class:`UserError` (or the package's own ``*Error`` types) and printed as one clear message with a non-zero
exit status, without a traceback; ``DSV4LAB_DEBUG=1`` shows the traceback too.
"""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys


class UserError(Exception):
    """A problem with the user's input: printed without a traceback, exit status 2."""


def _command_modules():
    from . import commands
    mods = []
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mods.append(importlib.import_module(f"{commands.__name__}.{info.name}"))
    return mods


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    parser = argparse.ArgumentParser(
        prog="dsv4lab", description="DeepSeek-V4-Flash inference workbench: checkpoints, reference model, "
        "verification, layout repair, kernels, performance model, serving.")
    parser.add_argument("--version", action="version", version=f"dsv4lab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _command_modules():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def _known_errors() -> tuple[type[BaseException], ...]:
    from .config import ConfigError
    errs: list[type[BaseException]] = [UserError, ConfigError, FileNotFoundError, FileExistsError]
    try:
        from .checkpoint import CheckpointError
        from .quant import QuantError
        errs += [CheckpointError, QuantError]
    except ImportError:  # torch missing: still report config errors cleanly
        pass
    return tuple(errs)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    known = _known_errors()
    try:
        return int(args._run(args) or 0)
    except known as err:
        if os.environ.get("DSV4LAB_DEBUG"):
            raise
        print(f"dsv4lab {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dsv4lab {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
