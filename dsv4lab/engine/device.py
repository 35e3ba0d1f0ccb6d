"""Whether this machine can run on a torch device, with a one-line refusal when it cannot.

torch answers a request for a device it cannot reach with an ``AssertionError`` ("Torch not compiled with CUDA
enabled") or a ``RuntimeError`` deep inside the first allocation; :func:`check_device` says instead, before
anything is loaded, which device was asked for, why it is not there and what to use.
"""
from __future__ import annotations

import torch

from dsv4lab.core.errors import RequestError


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a :class:`torch.device` when this machine has it; otherwise :class:`RequestError`."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise RequestError(f"device {str(device)!r}: not a torch device name (cpu, cuda, cuda:N, mps)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA/ROCm support" if torch.version.cuda is None and
                   torch.version.hip is None else "no GPU is visible (check CUDA_VISIBLE_DEVICES and the driver)")
            raise RequestError(f"device {str(device)!r}: {why} (torch {torch.__version__}); use device 'cpu'")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise RequestError(f"device {str(device)!r}: this machine has {count} GPU(s), cuda:0 to "
                               f"cuda:{count - 1}")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise RequestError(f"device {str(device)!r}: Apple's MPS is not available here; use device 'cpu'")
    return dev


__all__ = ["check_device"]
