"""Programmatic dependent launch (PDL) for the decode step's kernels — on by default where the GPU has it.

A decode step is ~800 short kernels (``bench e2e``'s breakdown); between two of them the GPU drains one grid before
it launches the next. With PDL (Hopper and later) a kernel launched with ``launch_pdl`` may start while its
predecessor finishes: its first instructions (:func:`pdl_prologue`) wait until every prior grid has completed and
its memory is visible (``griddepcontrol.wait``), then let the next kernel launch in turn
(``griddepcontrol.launch_dependents``). The wait comes before any load, so every kernel still reads what the
kernels before it wrote — the saving is the launch latency between grids, not an overlap of their work; a kernel
launched without the attribute (torch, cuBLAS) serialises as before.

On for an NVIDIA GPU of compute capability 9.0 or later outside the interpreter, unless ``DSV4LAB_PDL=0``; CUDA
graph capture records the programmatic edges. Measured on an H200 (``data/results/h200/e2e_1gpu_1c4402a_pdl.json``
beside ``e2e_1gpu_1c4402a_ttft.json`` and ``e2e_1gpu_e156adc_decode.json``): the 30-layer batch-1 step 132.0 tok/s
with PDL, 124.2 and 122.8 without, the same oracle tokens; ``tests/test_kernels_launch.py`` holds the
graph-replayed step to the same bits either way. :func:`pdl_args` gives the launch keywords::

    _my_kernel[grid](..., **pdl_args(x.device))   # the kernel ends its signature with PDL: tl.constexpr = False
                                                   # and starts with pdl_prologue(PDL)
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .formats import interpreting

PDL_ENV = "DSV4LAB_PDL"


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """A PDL-launched kernel's first statement: wait for the grids before it, then release the grid after it."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device) -> bool:
    """Whether kernels on ``device`` launch with PDL: CUDA (not ROCm), sm_90+, compiled, and ``DSV4LAB_PDL`` not
    ``0``."""
    dev = torch.device(device)
    if os.environ.get(PDL_ENV, "1") == "0" or dev.type != "cuda" or interpreting():
        return False
    return _capable(dev.index if dev.index is not None else torch.cuda.current_device())


def pdl_args(device) -> dict:
    """The launch keywords of a PDL-capable kernel: ``PDL=True, launch_pdl=True`` where :func:`pdl_enabled`, else
    none (the kernel's ``PDL`` default, False, compiles the prologue away)."""
    return dict(PDL=True, launch_pdl=True) if pdl_enabled(device) else {}
