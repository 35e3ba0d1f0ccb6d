"""The ticket counters' shared workspace (``kernels/dsv4lab_kernels/tickets.py``): growth keeps every earlier buffer.

A CUDA graph holds the address of the workspace it was captured with; the workspace grows eagerly when a launch
needs more counters (the LM head's split-K GEMV, a larger batch tier). Freeing the old buffer there would let the
allocator hand it to another tensor, and every later replay of that graph would start from non-zero counters — a
tile finished before its partials were stored. (The GPU suite also checks after each test that every counter is
back at zero: ``tests/conftest.py``.)
"""
from __future__ import annotations

import torch

from dsv4lab_kernels import tickets


def test_a_grown_workspace_keeps_the_one_before_allocated_and_zero():
    dev = torch.device("cpu")
    before = tickets.counters(dev, 1)
    address, size = before.data_ptr(), before.numel()
    assert size >= tickets.MIN_COUNTERS and not before.any()
    grown = tickets.counters(dev, size + 1)
    assert grown.numel() >= size + 1 and grown.data_ptr() != address and not grown.any()
    assert tickets.counters(dev, size) is grown  # the current workspace answers every smaller request
    del before
    kept = [w for w in tickets.workspaces() if w.data_ptr() == address]
    assert len(kept) == 1 and kept[0].numel() == size and not kept[0].any()
