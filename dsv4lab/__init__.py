"""dsv4lab — a correctness-first research workbench for DeepSeek-V4-Flash inference engineering.

``import dsv4lab`` stays light: it imports the configuration (no torch). The public entry points are
:func:`load` (a model ready to ``forward``/``generate``; importing it imports torch and the engine, so it is
resolved on first use), :class:`ModelArgs` and :func:`get_preset`. Inside the package, modules import what they
use from the module that defines it (``from .engine.loader import load``), never through this one.
"""
from __future__ import annotations

__version__ = "0.1.0"

from dsv4lab.core.config import ModelArgs, get_preset  # noqa: E402 — after __version__, which lower modules read

__all__ = ["load", "ModelArgs", "get_preset", "__version__"]


def __getattr__(name: str):
    if name == "load":
        from dsv4lab.engine.loader import load
        return load
    raise AttributeError(f"module 'dsv4lab' has no attribute {name!r}")
