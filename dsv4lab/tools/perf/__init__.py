"""Performance model: hardware catalogue, per-op cost model, roofline and the account of the paper's numbers.

* :mod:`dsv4lab.tools.perf.hardware` — ``data/hardware/*.yaml``, every number with its source;
* :mod:`dsv4lab.tools.perf.costmodel` — bytes and FLOPs per op of a decode step / prefill, per rank under TP/EP;
* :mod:`dsv4lab.tools.perf.roofline` — bounds, penalty terms, step-time attribution (the timing model);
* :mod:`dsv4lab.tools.perf.account` — the paper's numbers rebuilt from components, and predictions.

The benchmarks that measure what these modules predict live in :mod:`dsv4lab.tools.bench`.

Importing this package imports none of torch, numpy, yaml or matplotlib: ``dsv4lab roofline`` runs without them.
"""
from __future__ import annotations

from dsv4lab.tools.perf.account import load_paper, paper_account, predict_account
from dsv4lab.tools.perf.costmodel import COMPONENTS, Op, StepCost, decode_step, kv_read_bytes, prefill, weight_bytes_per_token
from dsv4lab.tools.perf.hardware import Hardware, HardwareError, catalogue, list_hardware, load_hardware
from dsv4lab.tools.perf.roofline import compare_kernel_results, roofline_report, time_step

__all__ = ["COMPONENTS", "Hardware", "HardwareError", "Op", "StepCost", "catalogue", "compare_kernel_results",
           "decode_step", "kv_read_bytes", "list_hardware", "load_hardware", "load_paper", "paper_account",
           "predict_account", "prefill", "roofline_report", "time_step", "weight_bytes_per_token"]
