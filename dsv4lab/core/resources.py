"""Room on this machine, checked before work that needs it: free disk space before a large write, free memory before
a large allocation. Each check raises :class:`~dsv4lab.core.errors.ResourceError` in one line naming the path or
device, what the work needs and what is there, so a full disk or an impossible allocation is refused before
anything is half-written or the machine starts swapping.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from dsv4lab.core.errors import ResourceError

DISK_MARGIN_BYTES = 64 << 20
"""Free space a write leaves untouched on top of its own bytes (logs, metadata, what other programs need)."""


def gib(n: float) -> str:
    """``n`` bytes as GiB (or MiB below one GiB), for messages."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def free_disk_bytes(path: str | Path) -> int:
    """Free bytes on the file system that holds ``path`` (its nearest existing ancestor when it does not exist
    yet)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def require_disk_space(path: str | Path, needed: int, what: str) -> None:
    """Refuse (``ResourceError``) when the file system of ``path`` has less than ``needed`` bytes (plus
    :data:`DISK_MARGIN_BYTES`) free for ``what``."""
    free = free_disk_bytes(path)
    if needed + DISK_MARGIN_BYTES > free:
        raise ResourceError(f"{path}: {what} needs {gib(needed)} of disk (+{gib(DISK_MARGIN_BYTES)} margin), "
                            f"only {gib(free)} free there")


def available_cpu_memory_bytes() -> int | None:
    """Memory the kernel says a new allocation can get without swapping (``MemAvailable``), or None where
    ``/proc/meminfo`` is not there."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def require_memory(needed: int, available: int | None, device: str, what: str) -> None:
    """Refuse (``ResourceError``) when ``needed`` bytes exceed what ``device`` has ``available`` (no check when
    that is unknown)."""
    if available is not None and needed > available:
        raise ResourceError(f"{what} needs {gib(needed)} of {device} memory, only {gib(available)} available")


def usable_cpu_count() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


__all__ = ["DISK_MARGIN_BYTES", "gib", "free_disk_bytes", "require_disk_space", "available_cpu_memory_bytes",
           "require_memory", "usable_cpu_count"]
