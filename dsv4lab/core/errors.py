"""The errors a user can cause, under one base class.

Every problem a user can fix — a bad flag value, a malformed file, a checkpoint that does not match its config,
a layout the scales cannot follow — is raised as a :class:`DSV4LabError` whose message names the file, tensor or
field and says what was expected. The command line catches the base class, prints the message as one line
(``dsv4lab <command>: error: ...``) and exits with status 2, without a traceback (``DSV4LAB_DEBUG=1`` shows it).
Anything else that escapes is a bug and keeps its traceback.

The subclasses say which part of the package found the problem; the ones that used to be ``ValueError``\\s still
are, so ``except ValueError`` around a call keeps working. Modules re-export the class they raise
(``dsv4lab.core.config.ConfigError`` is ``dsv4lab.core.errors.ConfigError``).
"""
from __future__ import annotations

from pathlib import Path


class DSV4LabError(Exception):
    """A problem the user can fix; the message names the file, tensor or field and what was expected."""


class UserError(DSV4LabError):
    """A command-line input is wrong (a flag value, a missing file named on the command line)."""


class ConfigError(DSV4LabError, ValueError):
    """A configuration value is missing or inconsistent; the message names the field."""


class ParallelError(ConfigError):
    """A tensor/expert-parallel layout this model or this launch cannot run; the message says why."""


class QuantError(DSV4LabError, ValueError):
    """A quantized tensor is malformed (wrong dtype, shape or NaN scale); the message names it."""


class CheckpointError(DSV4LabError):
    """A checkpoint cannot be used; ``problems`` lists every finding (tensor or file, expected, found)."""

    def __init__(self, path: str | Path, problems: list[str]):
        self.path = str(path)
        self.problems = list(problems)
        if len(self.problems) == 1:  # one line, naming the checkpoint once
            only = self.problems[0]
            super().__init__(only if only.startswith(self.path) else f"{path}: {only}")
            return
        shown = "\n  ".join(self.problems[:50])
        more = f"\n  ... and {len(self.problems) - 50} more" if len(self.problems) > 50 else ""
        super().__init__(f"{path}: {len(self.problems)} problem(s):\n  {shown}{more}")


class LayoutError(DSV4LabError, ValueError):
    """A layout cannot be applied (shape, dtype, or a permutation the block scales cannot follow), or a repair
    spec is malformed; the message names the tensor or field."""


class ConversionError(DSV4LabError, ValueError):
    """The model cannot be expressed as a transformers ``DeepseekV4Config``; the message names the field."""


class HardwareError(DSV4LabError, ValueError):
    """A catalogue file is missing, malformed, or lacks a number a model needs; the message names file and key."""


class PerfError(DSV4LabError, ValueError):
    """A performance-model input is missing or malformed; the message names the file and field."""


class RunError(DSV4LabError, ValueError):
    """A problem with a run folder, a results file or an expectations file (names the file and field)."""


class ResourceError(DSV4LabError):
    """This machine lacks what a command needs (free disk space, memory); the message names the path or device,
    what is needed and what is there."""


class RequestError(DSV4LabError, ValueError):
    """A generation request is out of range (token count, sampling setting, prompt ids, device); the message names
    the argument and the range it must be in."""


class NonFiniteError(DSV4LabError, ArithmeticError):
    """The model produced a non-finite value (NaN or ±Inf) where a token must be chosen; the message names the
    position and, where it was located, the first layer whose output is non-finite. Carries ``position`` (None
    until known) and ``row`` (the batch row it was found in)."""

    def __init__(self, message: str, position: int | None = None, row: int = 0):
        super().__init__(message)
        self.position, self.row = position, row


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is (see :func:`dsv4lab.faces.runs.signals_end_runs`) so that a
    ``kill`` ends a command as Ctrl-C does: every ``except KeyboardInterrupt`` that records an interrupted state
    runs, and the command line exits with 143 (128 + SIGTERM) instead of 130."""


def excerpt(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: an error quoting a user's value stays one short line however large
    the value (a 10 MB string, a list of a million ids)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def clip(text: str, limit: int = 160) -> str:
    """The first line of ``text`` cut to ``limit`` characters (for quoting a library's error message in ours)."""
    lines = str(text).strip().splitlines()
    first = lines[0] if lines else ""
    return first if len(first) <= limit else first[: limit - 1] + "…"


__all__ = ["excerpt", "clip", "Terminated", "DSV4LabError", "UserError", "ConfigError", "ParallelError", "QuantError",
           "CheckpointError", "LayoutError", "ConversionError", "HardwareError", "PerfError", "RunError",
           "ResourceError", "RequestError", "NonFiniteError"]
