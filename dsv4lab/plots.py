"""Figures of the performance model: one function per figure, each taking data and returning a Figure.

matplotlib is imported inside the functions (``import dsv4lab`` stays light). Figures are built on
:class:`matplotlib.figure.Figure` directly, not through pyplot, so nothing accumulates in a global figure
manager and no display backend is needed; notebooks display the returned Figure as a cell result.
Every figure uses the package style (``dsv4lab/style/dsv4lab.mplstyle``) and a fixed size.

* :func:`plot_roofline` — classic roofline per hardware, ops placed by arithmetic intensity;
* :func:`plot_step_waterfall` — stacked step-time breakdown of the paper's milestones and our predictions;
* :func:`plot_bytes_composition` — bytes per token by component.
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

STYLE = Path(__file__).resolve().parent / "style" / "dsv4lab.mplstyle"
ROOFLINE_SIZE = (7.0, 4.6)
WATERFALL_SIZE = (8.0, 4.2)
COMPOSITION_SIZE = (7.0, 3.6)
DTYPE_ORDER = ("fp4", "fp8", "int8", "bf16", "fp32")


@contextlib.contextmanager
def use_style():
    """The package style as a context (rcParams are restored afterwards)."""
    import matplotlib.style
    with matplotlib.style.context(str(STYLE)):
        yield


def _figure(size: tuple[float, float]):
    from matplotlib.figure import Figure
    return Figure(figsize=size, layout="constrained")


def save_figure(fig, path: str | Path, formats: Iterable[str] = ("png",)) -> list[Path]:
    """Save ``fig`` as ``path.<fmt>`` for each format with creation metadata stripped (byte-stable reruns)."""
    out = []
    base = Path(path)
    base.parent.mkdir(parents=True, exist_ok=True)
    meta = {"png": {"Software": None}, "pdf": {"Creator": None, "Producer": None, "CreationDate": None},
            "svg": {"Date": None, "Creator": None}}
    with use_style():
        for fmt in formats:
            target = base.with_suffix(f".{fmt}")
            fig.savefig(target, format=fmt, metadata=meta.get(fmt))
            out.append(target)
    return out


# ============================================================================================ roofline
def _as_hardware(items) -> list:
    from .perf.hardware import Hardware, load_hardware
    if isinstance(items, (str, Hardware)):
        items = [items]
    return [h if isinstance(h, Hardware) else load_hardware(h) for h in items]


def plot_roofline(hardware, ops: Sequence[Mapping[str, Any]] = (), *, bandwidth: str = "peak",
                  dtypes: Sequence[str] = DTYPE_ORDER, title: str | None = None, label_top: int = 8):
    """Roofline of one or more catalogue entries with ``ops`` placed by arithmetic intensity.

    ``ops`` are dicts with ``name``, ``flops_rank`` and ``bytes_rank`` (the rows of
    :func:`dsv4lab.perf.roofline.roofline_report`); a row with ``total_us`` is drawn at the FLOP rate it achieves
    in that time, otherwise on the roof of the first hardware. Ops without FLOPs cannot sit on log axes and are
    left out. The ``label_top`` most time-consuming ops are named."""
    import numpy as np
    hws = _as_hardware(hardware)
    with use_style():
        fig = _figure(ROOFLINE_SIZE)
        ax = fig.add_subplot()
        intensity = np.logspace(-2, 4, 400)
        colors = [c["color"] for c in __import__("matplotlib").rcParams["axes.prop_cycle"]]
        for i, hw in enumerate(hws):
            color = colors[i % len(colors)]
            bw = hw.bandwidth_gbps(bandwidth) * 1e9
            ceilings = [(d, hw.matrix_tflops(d)) for d in dtypes if hw.matrix_tflops(d)]
            if not ceilings and hw.vector_tflops("fp32"):
                ceilings = [("fp32", hw.vector_tflops("fp32"))]
            top = max(c for _, c in ceilings) * 1e12
            ax.loglog(intensity, np.minimum(top, intensity * bw) / 1e12, color=color,
                      label=f"{hw.name} ({bw / 1e12:.2f} TB/s {bandwidth})")
            by_rate: dict[float, list[str]] = {}
            for dtype, tflops in ceilings:
                by_rate.setdefault(tflops, []).append(dtype)
            for tflops, names in by_rate.items():
                ridge = tflops * 1e12 / bw
                ax.hlines(tflops, ridge, intensity[-1], colors=color, linestyles=":", linewidth=0.9)
                ax.text(intensity[-1], tflops, " " + "/".join(names), color=color, va="center", ha="left",
                        fontsize=7)
        if ops:
            hw0 = hws[0]
            bw0 = hw0.bandwidth_gbps(bandwidth) * 1e9
            top0 = max((hw0.matrix_tflops(d) or 0) for d in dtypes) * 1e12 or (hw0.vector_tflops("fp32") or 0) * 1e12
            pts = []
            for o in ops:
                flops, nbytes = float(o.get("flops_rank", 0)), float(o.get("bytes_rank", 0))
                if flops <= 0 or nbytes <= 0:
                    continue
                ai = flops / nbytes
                if o.get("total_us"):
                    rate = flops / (float(o["total_us"]) * 1e-6)
                else:
                    rate = min(top0, ai * bw0)
                pts.append((ai, rate / 1e12, o["name"], float(o.get("total_us") or 0)))
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=18, color="black", zorder=3,
                           label="ops (achieved)" if any(p[3] for p in pts) else "ops (on the roof)")
                labelled: dict[tuple[float, float], list[str]] = {}
                for ai, rate, name, _ in sorted(pts, key=lambda p: -p[3])[:label_top]:
                    labelled.setdefault((round(math.log10(ai), 1), round(math.log10(rate), 1)), []).append(name)
                for (lai, lrate), names in labelled.items():
                    ax.annotate(", ".join(names), (10 ** lai, 10 ** lrate), textcoords="offset points",
                                xytext=(4, 3), fontsize=6.5)
        ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
        ax.set_ylabel("TFLOP/s")
        ax.set_xlim(intensity[0], intensity[-1])
        ax.set_title(title or "Roofline")
        ax.legend(loc="upper left")
    return fig


# ============================================================================================ step waterfall
def plot_step_waterfall(rows: Sequence[Mapping[str, Any]], *, title: str | None = None, unit: str = "ms"):
    """Stacked step-time bars, one per row (paper milestones, our predictions).

    Each row is a dict with ``label`` (or ``id``) and ``components_us`` (component -> µs, stacked in the order of
    first appearance); ``reported_step_us`` marks the reported step with a diamond. Bars are annotated with the
    tok/s the stacked time gives."""
    scale = {"ms": 1e-3, "us": 1.0}[unit]
    order: list[str] = []
    for r in rows:
        for k in r["components_us"]:
            if k not in order:
                order.append(k)
    with use_style():
        import matplotlib
        colors = [c["color"] for c in matplotlib.rcParams["axes.prop_cycle"]]
        fig = _figure(WATERFALL_SIZE)
        ax = fig.add_subplot()
        labels = [str(r.get("label") or r.get("id")) for r in rows]
        y = list(range(len(rows)))[::-1]
        for ci, comp in enumerate(order):
            left = [sum(r["components_us"].get(c, 0.0) for c in order[:ci]) * scale for r in rows]
            width = [r["components_us"].get(comp, 0.0) * scale for r in rows]
            ax.barh(y, width, left=left, color=colors[ci % len(colors)], label=comp.replace("_", " "), height=0.62)
        for yi, r in zip(y, rows):
            total = sum(r["components_us"].values())
            right = max(total, r.get("reported_step_us") or 0.0)
            ax.text(right * scale, yi, f"  {1e6 / total:.1f} tok/s" if total else "", va="center", fontsize=7)
            if r.get("reported_step_us"):
                ax.plot(r["reported_step_us"] * scale, yi, marker="D", color="black", markersize=4,
                        label="reported" if yi == y[0] else None, linestyle="none")
        ax.set_yticks(y, [lab if len(lab) <= 38 else lab[:36] + "…" for lab in labels])
        ax.set_xlabel(f"time per step ({unit})")
        ax.set_title(title or "Step time by component")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
        ax.grid(axis="y", visible=False)
        ax.margins(x=0.12)
    return fig


# ============================================================================================ bytes composition
def plot_bytes_composition(components: Mapping[str, Any], *, title: str | None = None, unit: str = "GB"):
    """Bytes per token by component as stacked horizontal bars.

    ``components`` is one mapping component -> bytes (e.g. :func:`dsv4lab.perf.costmodel.weight_bytes_per_token`)
    or a mapping label -> such a mapping (several bars: whole model vs per rank, batch sizes ...)."""
    scale = {"GB": 1e-9, "MB": 1e-6}[unit]
    first = next(iter(components.values()), None)
    bars = dict(components) if isinstance(first, Mapping) else {"bytes per token": components}
    order: list[str] = []
    for comp in bars.values():
        for k, v in sorted(comp.items(), key=lambda kv: -kv[1]):
            if k not in order:
                order.append(k)
    with use_style():
        import matplotlib
        colors = [c["color"] for c in matplotlib.rcParams["axes.prop_cycle"]]
        fig = _figure(COMPOSITION_SIZE)
        ax = fig.add_subplot()
        names = list(bars)
        y = list(range(len(names)))[::-1]
        for ci, comp in enumerate(order):
            left = [sum(bars[n].get(c, 0.0) for c in order[:ci]) * scale for n in names]
            width = [bars[n].get(comp, 0.0) * scale for n in names]
            ax.barh(y, width, left=left, color=colors[ci % len(colors)], height=0.55,
                    label=comp.replace("_", " "))
            for yi, l0, w in zip(y, left, width):
                if w > 0.06 * max(sum(bars[n].values()) * scale for n in names):
                    ax.text(l0 + w / 2, yi, f"{w:.2f}", ha="center", va="center", fontsize=6.5, color="white")
        for yi, n in zip(y, names):
            ax.text(sum(bars[n].values()) * scale, yi, f"  {sum(bars[n].values()) * scale:.2f} {unit}",
                    va="center", fontsize=7)
        ax.set_yticks(y, names)
        ax.set_xlabel(f"{unit} per token")
        ax.set_title(title or "Bytes per generated token by component")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=4, fontsize=7)
        ax.grid(axis="y", visible=False)
    return fig


__all__ = ["plot_roofline", "plot_step_waterfall", "plot_bytes_composition", "save_figure", "use_style", "STYLE"]
