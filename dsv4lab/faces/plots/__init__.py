"""Figures: one function per figure, each taking data and returning a matplotlib Figure in the package style.

Figures are built on :class:`matplotlib.figure.Figure` directly, not through pyplot, so nothing accumulates in a
global figure manager and no display backend is needed; notebooks display the returned Figure as a cell result.
matplotlib is imported inside the functions (``import dsv4lab.faces.plots`` stays light).

* :mod:`~dsv4lab.faces.plots.style` — the style, palette and the look of measured / modelled / reported numbers; the
  caption every figure carries (model, hardware, commit); the "not measured yet" note; saving;
* :mod:`~dsv4lab.faces.plots.lint` — the rules a figure must pass, checked on the matplotlib objects;
* :mod:`~dsv4lab.faces.plots.perf` — roofline, step waterfall, bytes per token, hardware catalogue, decode and prefill
  kernels, the paper's milestones beside this project's numbers (03–06);
* :mod:`~dsv4lab.faces.plots.correctness` — W2 heatmap and stage cosines (01), kernel tier against its bounds,
  divergence per position, layer tier (02);
* :mod:`~dsv4lab.faces.plots.checkpoint` — a checkpoint's bytes and the number-format ablation (00).
"""
from __future__ import annotations

from dsv4lab.faces.plots.checkpoint import plot_checkpoint_inventory, plot_quant_ablation
from dsv4lab.faces.plots.correctness import (KERNEL_CHECK_FIELDS, check_ratio, plot_channel_similarity,
                                             plot_divergence_vs_position, plot_kernel_check_errors,
                                             plot_layer_divergence, plot_stage_cosines)
from dsv4lab.faces.plots.lint import figure_problems
from dsv4lab.faces.plots.perf import (plot_bytes_composition, plot_decode_kernels, plot_hardware_catalogue, plot_milestones,
                   plot_prefill_throughput, plot_roofline, plot_step_waterfall)
from dsv4lab.faces.plots.style import STYLE, headline, save_figure, use_style

FIGURES = ("plot_checkpoint_inventory", "plot_quant_ablation", "plot_channel_similarity", "plot_stage_cosines",
           "plot_kernel_check_errors", "plot_divergence_vs_position", "plot_layer_divergence", "plot_roofline",
           "plot_step_waterfall", "plot_bytes_composition", "plot_hardware_catalogue", "plot_decode_kernels",
           "plot_prefill_throughput", "plot_milestones")
"""Every figure function (``tests/test_figures.py`` renders each and lints it)."""

__all__ = list(FIGURES) + ["FIGURES", "STYLE", "KERNEL_CHECK_FIELDS", "check_ratio", "figure_problems", "headline",
           "save_figure", "use_style"]
