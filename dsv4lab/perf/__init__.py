"""Performance model: hardware catalogue, per-op cost model, roofline and the account of the paper's numbers.

* :mod:`dsv4lab.perf.hardware` — ``data/hardware/*.yaml``, every number with its source;
* :mod:`dsv4lab.perf.costmodel` — bytes and FLOPs per op of a decode step / prefill, per rank under TP/EP;
* :mod:`dsv4lab.perf.roofline` — bounds, penalty terms, step-time attribution, the paper account.

Importing this package loads nothing heavy; the names below are resolved on first use.
"""
from __future__ import annotations

_EXPORTS = {
    "load_hardware": "hardware", "list_hardware": "hardware", "catalogue": "hardware", "Hardware": "hardware",
    "HardwareError": "hardware",
    "decode_step": "costmodel", "prefill": "costmodel", "weight_bytes_per_token": "costmodel",
    "kv_read_bytes": "costmodel", "StepCost": "costmodel", "Op": "costmodel", "COMPONENTS": "costmodel",
    "roofline_report": "roofline", "paper_account": "roofline", "predict_account": "roofline",
    "compare_kernel_results": "roofline", "time_step": "roofline", "load_paper": "roofline",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
