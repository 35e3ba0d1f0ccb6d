"""The command-line options every command spells the same way, each declared once.

``--backend``, ``--dtype``, ``--device``, ``--preset`` and ``--hardware`` are added to a parser by the functions
here, so every command accepts the same values, has the same default and rejects a mistake the same way: argparse
prints one line naming the valid choices and exits 2 (see :mod:`dsv4lab.faces.cli`).

* ``--backend reference|triton`` (default ``reference``; a benchmark may default to ``triton``);
* ``--dtype bf16|fp32|fp64`` (default ``bf16``); torch's names ``bfloat16``/``float32``/``float64`` are accepted as
  aliases and stored as the short name; :func:`torch_dtype` turns either into a ``torch.dtype``;
* ``--device auto|cpu|cuda|cuda:N`` (default ``auto``: the GPU when there is one); :func:`resolve_device`;
* ``--preset`` one of :data:`dsv4lab.core.config.PRESETS`;
* ``--hardware`` a catalogue entry (``data/hardware/NAME.yaml``) or a path to a YAML file;
* ``--threads N`` torch's CPU threads for a run on the CPU (:func:`set_cpu_threads`: default 1 unless
  ``OMP_NUM_THREADS`` says otherwise, as ``dsv4lab reproduce`` runs its kernels).

Numeric flags take their range from :func:`int_range` and :func:`float_range` (``type=int_range(1)``), so an
out-of-range value is refused the same way as a wrong choice: ``argument --max-new-tokens: must be an integer
>= 1, got 0``. A device the machine does not have is refused by :func:`resolve_device` in one line.

Nothing here imports torch until a value is resolved, so building the parser stays instant.
"""
from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path

from dsv4lab.core.config import PRESETS
from dsv4lab.core.errors import UserError
from dsv4lab.core.resources import usable_cpu_count
from dsv4lab.engine import BACKENDS
from dsv4lab.tools.perf.hardware import list_hardware

DTYPES = ("bf16", "fp32", "fp64")
DTYPE_ALIASES = {"bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}
TORCH_DTYPE_NAMES = {"bf16": "bfloat16", "fp32": "float32", "fp64": "float64"}
DEVICE_FORM = re.compile(r"^(auto|cpu|cuda(:\d+)?|mps)$")


def dtype_name(text: str) -> str:
    """The short spelling of a compute dtype (``bfloat16`` → ``bf16``); unknown names pass through to argparse's
    choice check, which names the valid ones."""
    return DTYPE_ALIASES.get(text, text)


def torch_dtype(name: str):
    """``torch.bfloat16`` for ``"bf16"`` or ``"bfloat16"`` (and the fp32/fp64 pair)."""
    import torch  # light at parse time: torch only when a value is used
    short = dtype_name(name)
    if short not in TORCH_DTYPE_NAMES:
        raise ValueError(f"dtype {name!r}: expected one of {', '.join(DTYPES)}")
    return getattr(torch, TORCH_DTYPE_NAMES[short])


def device_name(text: str) -> str:
    if not DEVICE_FORM.match(text):
        raise argparse.ArgumentTypeError(f"invalid device {text!r} (choose from auto, cpu, cuda, cuda:N, mps)")
    return text


def resolve_device(name: str | None) -> str:
    """``auto`` (or None) → ``cuda`` when a GPU is visible, else ``cpu``; any other name as given once this
    machine is known to have it (otherwise :class:`~dsv4lab.core.errors.RequestError` says why, in one line)."""
    if name in (None, "auto"):
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    from dsv4lab.engine.device import check_device  # imports torch: only when a device is resolved
    check_device(name)
    return name


def _interval(lo, hi, lo_open: bool = False, hi_open: bool = False) -> str:
    """``>= 1``, ``in (0, 1]``: the range an option's value must be in, as its error message says it."""
    def num(v) -> str:
        return f"{v:g}" if isinstance(v, float) else str(v)
    if hi is None:
        return f"{'>' if lo_open else '>='} {num(lo)}"
    if lo is None:
        return f"{'<' if hi_open else '<='} {num(hi)}"
    return f"in {'(' if lo_open else '['}{num(lo)}, {num(hi)}{')' if hi_open else ']'}"


def int_range(lo: int | None = None, hi: int | None = None):
    """An argparse ``type`` for an integer in ``[lo, hi]`` (an end left None is open): ``type=int_range(1)``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be an integer {_interval(lo, hi)}, got {value}")
        return value
    return parse


def float_range(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False,
                finite: bool = True):
    """An argparse ``type`` for a number in ``[lo, hi]`` (``lo_open``/``hi_open`` exclude an end; None leaves it
    unbounded; NaN is never accepted, infinity only with ``finite=False``): ``float_range(0, 1, lo_open=True)``
    for a top-p."""
    what = "a finite number" if finite else "a number"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        below = lo is not None and (value <= lo if lo_open else value < lo)
        above = hi is not None and (value >= hi if hi_open else value > hi)
        if math.isnan(value) or (finite and math.isinf(value)) or below or above:
            raise argparse.ArgumentTypeError(f"must be {what} {_interval(lo, hi, lo_open, hi_open)}, got {text}")
        return value
    return parse


def hardware_name(text: str) -> str:
    """A catalogue entry or a path to a YAML file."""
    if Path(text).suffix in (".yaml", ".yml") or text in list_hardware():
        return text
    raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(list_hardware())}, "
                                     "or a path to a .yaml file)")


def add_backend(p, default: str = "reference", *, repeatable: bool = False, help: str = "") -> None:
    """``--backend reference|triton``; ``repeatable`` collects several (``--backend a --backend b``)."""
    text = help or "engine backend: reference (the oracle) or triton (kernels where they exist)"
    if repeatable:
        p.add_argument("--backend", action="append", choices=BACKENDS, default=None,
                       help=f"{text}; repeatable (default: every available backend)")
    else:
        p.add_argument("--backend", choices=BACKENDS, default=default, help=f"{text} (default {default})")


def add_dtype(p, default: str = "bf16") -> None:
    """``--dtype bf16|fp32|fp64`` (torch's long names accepted)."""
    p.add_argument("--dtype", type=dtype_name, choices=DTYPES, default=default,
                   help=f"compute dtype (default {default}; bfloat16/float32/float64 also accepted)")


def add_device(p, default: str = "auto") -> None:
    """``--device auto|cpu|cuda|cuda:N`` (default ``auto``: the GPU when one is visible, else the CPU)."""
    p.add_argument("--device", type=device_name, default=default, metavar="{auto,cpu,cuda,cuda:N}",
                   help=f"torch device (default {default}; auto: cuda when a GPU is visible, else cpu)")


def add_preset(p, default: str | None = None, *, positional: bool = False, group=None, help: str = "") -> None:
    """``--preset NAME`` (or a positional ``preset``) with the names of :data:`dsv4lab.core.config.PRESETS`."""
    target = group if group is not None else p
    text = help or "model preset"
    names = sorted(PRESETS)
    if positional:
        target.add_argument("preset", nargs="?", choices=names, default=default, help=text)
    else:
        target.add_argument("--preset", choices=names, default=default,
                            help=text + (f" (default {default})" if default else ""))


def add_hardware(p, default: str | None = None, help: str = "") -> None:
    """``--hardware NAME|FILE.yaml``: a catalogue entry or a YAML path."""
    p.add_argument("--hardware", type=hardware_name, default=default, metavar="NAME|FILE.yaml",
                   help=(help or "catalogue entry") + f" ({', '.join(list_hardware())}) or a YAML path")


THREADS_HELP = ("CPU threads for torch's ops in a run on the CPU (default: $OMP_NUM_THREADS when set, else 1, as "
                "`dsv4lab reproduce` runs its kernels: the per-op work of models that run on a CPU is too small to "
                "gain from threads, and on a shared machine extra threads only wait on each other; 0: every core "
                "this process may use)")


def add_threads(p) -> None:
    """``--threads N``: torch's intra-op threads when the command runs on the CPU (:func:`set_cpu_threads`)."""
    p.add_argument("--threads", type=int_range(0, 4096), default=None, metavar="N", help=THREADS_HELP)


def set_cpu_threads(threads: int | None, device: str) -> int | None:
    """Give torch ``threads`` intra-op threads for a run on the CPU (None: ``$OMP_NUM_THREADS`` when set — torch
    already read it — else 1; 0: every core this process may use) and return the count; on another device, leave
    torch as it is and return None.

    One thread is the default because the per-op work of the checkpoints a CPU runs is small: 32 greedy tokens of
    ``data/tiny-py`` took 3.4 s with 1 thread and 36.7 s with 2 on this project's shared 2-core machine at a load
    average of 7.7 (threads that spin while another process holds the core)."""
    import torch  # light at parse time: torch only when a run starts
    if not str(device).startswith("cpu"):
        return None
    if threads is None:
        if os.environ.get("OMP_NUM_THREADS"):
            return torch.get_num_threads()
        threads = 1
    count = threads or usable_cpu_count()
    torch.set_num_threads(count)
    return count


SHARED_OPTIONS = ("backend", "dtype", "device", "preset", "hardware", "threads")
"""The destinations the functions above own; ``tests/test_cli.py`` checks no command declares them by hand."""

__all__ = ["DTYPES", "add_backend", "add_dtype", "add_device", "add_preset", "add_hardware", "add_threads",
           "set_cpu_threads", "torch_dtype",
           "resolve_device", "dtype_name", "device_name", "hardware_name", "int_range", "float_range",
           "SHARED_OPTIONS"]


def positive_ints(text: str, flag: str) -> list[int]:
    """A comma-separated list of integers ≥ 1 (``--batches 1,2,4``), or a one-line error naming ``flag``."""
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise UserError(f"{flag} {text!r}: values must be >= 1")
    return values
