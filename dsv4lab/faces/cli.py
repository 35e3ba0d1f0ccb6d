"""The ``dsv4lab`` command line. Each subcommand lives in its own module under :mod:`dsv4lab.faces.commands`.

A command module defines ``NAME`` (the subcommand), ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. Modules are discovered, so adding a command means adding a file. Command modules import
nothing heavy at module level, and a command's sub-commands (``bench e2e``, ``verify model``) are imported only
when they are the one being run (:mod:`dsv4lab.faces.commands._dispatch`), so ``dsv4lab --help`` is instant.

Mistakes are reported in one line and exit status 2, with no traceback:

* a flag value argparse rejects (``--backend trition``) — ``dsv4lab generate: error: argument --backend: invalid
  choice: 'trition' (choose from reference, triton)``; the shared flags are declared once in :mod:`dsv4lab.tools.options`;
* any :class:`~dsv4lab.core.errors.DSV4LabError` a command raises (a bad path, a malformed checkpoint, a wrong config
  key);
* what the machine refuses (:func:`describe_failure`): a file that is missing, already there, not readable or
  writable (``Permission denied``), a folder where a file belongs or the reverse, a full disk (``ENOSPC``) and any
  other ``OSError``, named with its path; memory that cannot be allocated (``MemoryError``, torch's
  ``OutOfMemoryError``, the CPU allocator's refusal); arithmetic on a value out of range (``math domain error``,
  overflow, division by zero); output closed early (a broken pipe);
* anything else is a bug: it is still one line, naming the exception, and its traceback is written to a file the
  line names (``DSV4LAB_DEBUG=1`` prints the traceback instead).

Ctrl-C exits with status 130 and ``kill`` (SIGTERM, where a command turns it into
:class:`~dsv4lab.core.errors.Terminated`) with 143, each after one line.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import os
import pkgutil
import sys
import tempfile
import traceback

from dsv4lab import __version__
from dsv4lab.faces import commands
from dsv4lab.core.errors import DSV4LabError, Terminated, clip


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


def describe_failure(err: BaseException) -> tuple[str, bool]:
    """``(one line, is_a_bug)`` for an exception that ended a command (see the module doc)."""
    if isinstance(err, DSV4LabError):
        return str(err), False
    if isinstance(err, OSError):
        where = err.filename
        why = err.strerror or str(err) or type(err).__name__
        if err.errno == errno.ENOSPC:
            why += " (free some space, or write elsewhere)"
        elif isinstance(err, BrokenPipeError):
            why = "the output was closed before the command finished (broken pipe)"
            where = None
        return _one_line(f"{where}: {why}" if where is not None else why), False
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError" or (
            isinstance(err, RuntimeError) and any(s in str(err) for s in _ALLOCATION_FAILURES)):
        return _one_line(f"out of memory ({type(err).__name__}: {_first_line(err)}): use a smaller model, batch or "
                         "context, or a machine with more memory"), False
    if isinstance(err, ArithmeticError) or (isinstance(err, ValueError) and "math domain error" in str(err)):
        return _one_line(f"a value is out of the range this computation accepts ({type(err).__name__}: "
                         f"{_first_line(err)})"), False
    return _one_line(f"internal error, a bug ({type(err).__name__}: {_first_line(err)})"), True


_ALLOCATION_FAILURES = ("can't allocate memory", "Cannot allocate memory", "out of memory")
"""How torch's CPU allocator, the OS and CUDA word a failed allocation in a ``RuntimeError``."""


def _first_line(err: BaseException) -> str:
    """The first line of an exception's message, cut to 200 characters (its type's name when it has none)."""
    return clip(err, 200) or type(err).__name__


def _one_line(text: str) -> str:
    return " ".join(text.split("\n"))


def _save_traceback(err: BaseException) -> str | None:
    """Write ``err``'s traceback to a file in the temporary folder; its path, or None when even that fails."""
    try:
        fd, path = tempfile.mkstemp(prefix="dsv4lab-traceback-", suffix=".txt")
        with os.fdopen(fd, "w") as fh:
            fh.write("".join(traceback.format_exception(err)))
        return path
    except OSError:
        return None


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
        code = int(args._run(args) or 0)
        sys.stdout.flush()  # a full disk or a closed pipe under stdout is a failure of this command, reported here
        return code
    except Terminated:
        print(f"{args._prog}: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print(f"{args._prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # every failure reaches the user as one line (module doc)
        if os.environ.get("DSV4LAB_DEBUG"):
            raise
        line, bug = describe_failure(err)
        if bug:
            saved = _save_traceback(err)
            line += f"; traceback in {saved}" if saved else "; DSV4LAB_DEBUG=1 shows the traceback"
        _discard_unwritable_stdout()
        print(f"{args._prog}: error: {line}", file=sys.stderr)
        return 2


def _discard_unwritable_stdout() -> None:
    """When stdout cannot take what is buffered for it (a closed pipe, a full disk), point its descriptor at
    /dev/null, so the interpreter's last flush at exit does not add a second message to the one line."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):  # no descriptor to redirect (captured output)
            pass


if __name__ == "__main__":
    sys.exit(main())
