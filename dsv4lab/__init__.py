"""dsv4lab — a correctness-first research workbench for DeepSeek-V4-Flash inference engineering.

``import dsv4lab`` stays light: it pulls in torch and the package's own pure-Python modules only when used.
The public entry points are re-exported lazily: :func:`load` (a model ready to ``forward``/``generate``),
:class:`ModelArgs` and :func:`get_preset`.
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["load", "ModelArgs", "get_preset", "__version__"]


def __getattr__(name: str):
    if name == "load":
        from .engine.loader import load
        return load
    if name in ("ModelArgs", "get_preset"):
        from . import config
        return getattr(config, name)
    raise AttributeError(f"module 'dsv4lab' has no attribute {name!r}")
