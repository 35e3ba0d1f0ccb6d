"""Figures of the performance model: one function per figure, each taking data and returning a Figure.

matplotlib is imported inside the functions (``import dsv4lab`` stays light). Figures are built on
:class:`matplotlib.figure.Figure` directly, not through pyplot, so nothing accumulates in a global figure
manager and no display backend is needed; notebooks display the returned Figure as a cell result.
Every figure uses the package style (``dsv4lab/style/dsv4lab.mplstyle``) and a fixed size.

* :func:`plot_roofline` — classic roofline per hardware, ops placed by arithmetic intensity;
* :func:`plot_step_waterfall` — stacked step-time breakdown of the paper's milestones and our predictions;
* :func:`plot_bytes_composition` — bytes per token by component.

The notebooks' figures (``notebooks/``), one function each:

* :func:`plot_checkpoint_inventory` — a checkpoint's bytes by component and stored dtype (00);
* :func:`plot_channel_similarity` — output-channel cosine heatmaps, a permutation made visible (01);
* :func:`plot_stage_cosines` — per layer, each routed-expert stage against the trusted run (01);
* :func:`plot_kernel_check_errors` — the kernel tier: worst error per op and implementation (02);
* :func:`plot_divergence_vs_position` — teacher-forced KL per position with the cache boundaries (02);
* :func:`plot_layer_divergence` — the layer tier: layers × stages, first divergence circled (02);
* :func:`plot_kernel_timings` — measured / modelled time per kernel with the bandwidth floor (03);
* :func:`plot_prefill_throughput` — throughput against prompt length (04);
* :func:`plot_hardware_catalogue` — bandwidth and matrix rates of the catalogue (05);
* :func:`plot_milestones` — the paper's milestones with the model's values and our measurements (06);
* :func:`plot_quant_ablation` — the small model's weight-format ablation (00).
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from .paths import STYLE_FILE as STYLE
from .perf.hardware import Hardware, load_hardware
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
    tok/s the stacked time gives (``tokens`` per step, default 1: a prefill row gives its prompt length)."""
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
            rate = float(r.get("tokens", 1)) * 1e6 / total if total else 0.0
            ax.text(right * scale, yi, f"  {rate:,.1f} tok/s" if total else "", va="center", fontsize=7)
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


# ============================================================================================ notebook figures
# The figures of notebooks/ (one function per figure). Like the ones above they take data and return a Figure;
# the notebooks' widgets call the same functions as their headless cells.
HEATMAP_SIZE = (7.6, 3.5)
STAGES_SIZE = (7.0, 3.4)
INVENTORY_SIZE = (7.6, 3.4)
DIVERGENCE_SIZE = (7.6, 3.6)
LAYER_MAP_SIZE = (7.6, 3.8)
TIMINGS_SIZE = (7.6, 3.8)
THROUGHPUT_SIZE = (7.0, 3.8)
CATALOGUE_SIZE = (8.0, 3.6)
MILESTONES_SIZE = (7.6, 3.8)
KERNEL_CHECK_SIZE = (7.6, 3.4)


def _colors() -> list[str]:
    import matplotlib
    return [c["color"] for c in matplotlib.rcParams["axes.prop_cycle"]]


def _short(label: str, width: int = 34) -> str:
    return label if len(label) <= width else label[: width - 1] + "…"


def plot_channel_similarity(panels: Mapping[str, Any], *, block: int = 16, title: str | None = None):
    """Heatmaps of output-channel cosine similarity, one panel per entry of ``panels`` (label → ``[t, t]``
    matrix from :func:`dsv4lab.layouts.drill.channel_similarity`: suspect channels as rows, trusted ones as
    columns). Grid lines every ``block`` channels make a block permutation readable at a glance."""
    import numpy as np
    with use_style():
        fig = _figure(HEATMAP_SIZE)
        axes = fig.subplots(1, len(panels), squeeze=False)[0]
        im = None
        for ax, (label, m) in zip(axes, panels.items()):
            a = np.asarray(m.tolist() if hasattr(m, "tolist") else m, dtype=float)
            im = ax.imshow(a, vmin=-1.0, vmax=1.0, cmap="RdBu_r", interpolation="nearest")
            for k in range(block, a.shape[0], block):
                ax.axhline(k - 0.5, color="#888888", linewidth=0.4)
                ax.axvline(k - 0.5, color="#888888", linewidth=0.4)
            ax.set_title(label, fontsize=9)
            ax.set_xlabel("trusted output channel")
            ax.set_ylabel("suspect output channel")
            ax.grid(False)
            ticks = list(range(0, a.shape[0], block * 2 if a.shape[0] > 4 * block else block))
            ax.set_xticks(ticks)
            ax.set_yticks(ticks)
        if im is not None:
            fig.colorbar(im, ax=list(axes), shrink=0.85, label="cosine")
        if title:
            fig.suptitle(title, fontsize=10)
    return fig


STAGE_LABELS = {"stage1_w1": "stage 1 (w1 gate)", "stage1_w3": "stage 1 (w3 up)", "stage2_w2": "stage 2 (w2 down)"}


def plot_stage_cosines(runs: Mapping[str, Sequence[Mapping[str, Any]]], *, highlight_layer: int | None = None,
                       title: str | None = None):
    """Per layer, the cosine of each routed-expert stage against the trusted run, one panel per entry of
    ``runs`` (label → rows of :func:`dsv4lab.layouts.drill.isolated_moe_stages`)."""
    with use_style():
        colors = _colors()
        fig = _figure(STAGES_SIZE)
        axes = fig.subplots(1, len(runs), squeeze=False, sharey=True)[0]
        for ax, (label, rows) in zip(axes, runs.items()):
            layers = [int(r["layer"]) for r in rows]
            for si, (stage, name) in enumerate(STAGE_LABELS.items()):
                ys = [float(r[f"{stage}_cosine"]) for r in rows]
                offset = (si - 1) * 0.22
                ax.bar([x + offset for x in layers], ys, width=0.2, color=colors[si], label=name)
            if highlight_layer is not None and highlight_layer in layers:
                ax.axvspan(highlight_layer - 0.45, highlight_layer + 0.45, color="#FFE9A8", zorder=0)
            ax.axhline(1.0, color="black", linewidth=0.6, linestyle=":")
            ax.set_xticks(layers)
            ax.set_xlabel("layer")
            ax.set_title(label, fontsize=9)
            ax.set_ylim(min(0.0, min((float(r[f"{s}_cosine"]) for r in rows for s in STAGE_LABELS), default=0)),
                        1.08)
        axes[0].set_ylabel("cosine vs trusted stage output")
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", ncol=len(STAGE_LABELS), fontsize=7)
        fig.suptitle(title or "Routed-expert stages fed the trusted run's inputs", fontsize=10)
    return fig


def plot_checkpoint_inventory(inventory: Mapping[str, Any], *, title: str | None = None):
    """Bytes of a checkpoint by component and by stored dtype (``Inventory.to_dict()`` of
    :meth:`dsv4lab.checkpoint.Checkpoint.validate`)."""
    comps = sorted(inventory.get("by_component", {}).items(), key=lambda kv: kv[1])
    dtypes = sorted(((k, v["bytes"]) for k, v in inventory.get("by_dtype", {}).items()), key=lambda kv: kv[1])
    total = float(inventory.get("total_bytes") or sum(v for _, v in comps) or 1)
    scale, unit = (1e-9, "GB") if total > 5e9 else (1e-6, "MB")
    with use_style():
        colors = _colors()
        fig = _figure(INVENTORY_SIZE)
        a1, a2 = fig.subplots(1, 2, width_ratios=[1.6, 1.0])
        a1.barh([c for c, _ in comps], [v * scale for _, v in comps], color=colors[0])
        a1.set_xlabel(f"{unit}")
        a1.set_title("by component", fontsize=9)
        a2.barh([d for d, _ in dtypes], [v * scale for _, v in dtypes], color=colors[1])
        a2.set_xlabel(f"{unit}")
        a2.set_title("by stored dtype", fontsize=9)
        for ax in (a1, a2):
            ax.grid(axis="y", visible=False)
            ax.tick_params(axis="y", labelsize=7)
        fig.suptitle(title or f"Checkpoint bytes ({total * scale:,.1f} {unit} in {inventory.get('tensors')} tensors)",
                     fontsize=10)
    return fig


def plot_divergence_vs_position(series: Mapping[str, Sequence[float]], boundaries: Mapping[str, int], *,
                                bound: float | None = None, floor: float = 1e-12, ylabel: str = "KL per position",
                                title: str | None = None):
    """Teacher-forced divergence per position (label → values), with the cache boundaries (name → absolute
    position) as vertical lines. Values below ``floor`` (exact agreement) sit on the floor of the log axis."""
    with use_style():
        colors = _colors()
        fig = _figure(DIVERGENCE_SIZE)
        ax = fig.add_subplot()
        n = 0
        for i, (label, vals) in enumerate(series.items()):
            ys = [max(float(v), floor) if v == v else float("nan") for v in vals]
            n = max(n, len(ys))
            ax.semilogy(range(len(ys)), ys, color=colors[i % len(colors)], label=label, linewidth=1.1)
        at: dict[int, list[str]] = {}
        for name, pos in boundaries.items():
            at.setdefault(int(pos), []).append(name)
        for pos, names in sorted(at.items()):
            if pos < n:
                ax.axvline(pos, color="#999999", linewidth=0.7, linestyle="--")
                ax.text(pos, 1.0, " " + ", ".join(names), transform=ax.get_xaxis_transform(), rotation=90,
                        va="top", ha="right", fontsize=6.5, color="#555555")
        if bound is not None:
            ax.axhline(max(bound, floor), color="black", linewidth=0.7, linestyle=":", label=f"bound {bound:g}")
        ax.set_xlabel("position (teacher-forced)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(floor / 3, None)
        ax.set_title(title or "Teacher-forced divergence vs position")
        ax.legend(loc="center right", fontsize=7, frameon=True)
    return fig


def plot_layer_divergence(rows: Sequence[Mapping[str, Any]], *, floor: float = 1e-9, title: str | None = None):
    """Which layer and stage diverge first: a layers × stages map of the relative error against the golden
    digests (rows of :func:`dsv4lab.verify.layers.first_divergence`, ``StageDiff.to_dict()``; top-k stages show
    ``1 − Jaccard``). The first failing stage is circled."""
    import numpy as np
    blocks = list(dict.fromkeys(r["block"] for r in rows if r["block"] != "model"))
    stages = list(dict.fromkeys(r["stage"] for r in rows if r["block"] != "model"))
    grid = np.full((len(stages), len(blocks)), np.nan)
    first = None
    for r in rows:
        if r["block"] == "model":
            continue
        if r.get("jaccard") is not None:
            v = 1.0 - float(r["jaccard"])
        elif r.get("rel_err") is not None:
            v = float(r["rel_err"])
        else:
            v = 1.0 if not r.get("ok", True) else 0.0
        grid[stages.index(r["stage"]), blocks.index(r["block"])] = math.log10(max(v, floor))
        if first is None and not r.get("ok", True):
            first = (blocks.index(r["block"]), stages.index(r["stage"]))
    with use_style():
        fig = _figure(LAYER_MAP_SIZE)
        ax = fig.add_subplot()
        im = ax.imshow(grid, aspect="auto", cmap="magma_r", vmin=math.log10(floor), vmax=0.5,
                       interpolation="nearest")
        ax.set_xticks(range(len(blocks)), [b.replace("layers.", "layer ") for b in blocks], fontsize=7)
        ax.set_yticks(range(len(stages)), [_short(s, 40) for s in stages], fontsize=6.5)
        ax.grid(False)
        if first is not None:
            ax.plot(first[0], first[1], marker="o", markersize=11, markerfacecolor="none", markeredgecolor="#2A8C82",
                    markeredgewidth=2, linestyle="none")
        fig.colorbar(im, ax=ax, label="log10 relative error (1 − Jaccard for top-k)")
        ax.set_title((title or "Layer tier: per-stage error against the golden digests")
                     + ("\n(circled: the first stage that diverges; blank: stage absent in that layer)"
                        if first is not None else ""), fontsize=9)
    return fig


def plot_kernel_check_errors(rows: Sequence[Mapping[str, Any]], *, floor: float = 1e-10, title: str | None = None):
    """Kernel tier: the worst relative L2 error per op and implementation (rows of
    :func:`dsv4lab.verify.kernels.run_kernel_checks`); failed checks in red, bitwise-equal ones on the floor."""
    worst: dict[tuple[str, str], tuple[float, bool]] = {}
    for r in rows:
        key = (str(r["op"]), str(r["impl"]))
        err = r.get("rel_l2")
        err = float("inf") if err is None else float(err)
        prev = worst.get(key, (0.0, True))
        worst[key] = (max(prev[0], err), prev[1] and bool(r.get("ok")))
    ops = list(dict.fromkeys(k[0] for k in worst))
    impls = list(dict.fromkeys(k[1] for k in worst))
    with use_style():
        colors = _colors()
        fig = _figure(KERNEL_CHECK_SIZE)
        ax = fig.add_subplot()
        width = 0.8 / max(len(impls), 1)
        for j, impl in enumerate(impls):
            xs, ys, failed = [], [], []
            for i, op in enumerate(ops):
                if (op, impl) not in worst:
                    continue
                err, ok = worst[(op, impl)]
                xs.append(i + (j - (len(impls) - 1) / 2) * width)
                ys.append(min(max(err, floor), 10.0))
                failed.append(not ok)
            bars = ax.bar(xs, ys, width=width * 0.9, color=colors[j % len(colors)], label=impl)
            for bar, bad in zip(bars, failed):
                if bad:  # failed checks: hatched, outlined, and marked above the bar
                    bar.set_hatch("////")
                    bar.set_edgecolor("black")
                    ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() * 1.6, "✗", ha="center",
                            va="bottom", fontsize=8, color="black")
        ax.set_yscale("log")
        ax.set_ylim(floor / 3, 60)
        ax.set_xticks(range(len(ops)), ops, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("worst relative L2 error\n(floor: bitwise equal; ✗ hatched: failed)")
        ax.set_title(title or "Kernel tier: every registered op against the reference")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    return fig


def plot_kernel_timings(rows: Sequence[Mapping[str, Any]], *, title: str | None = None):
    """Time per call of each kernel (variant): ``rows`` with ``label`` and any of ``measured_us`` (bars),
    ``predicted_us`` (diamonds: the cost model) and ``floor_us`` (ticks: its bytes at the copy bandwidth)."""
    with use_style():
        colors = _colors()
        fig = _figure(TIMINGS_SIZE)
        ax = fig.add_subplot()
        y = list(range(len(rows)))[::-1]
        labels = [_short(str(r["label"]), 40) for r in rows]
        meas = [r.get("measured_us") for r in rows]
        if any(m is not None for m in meas):
            ax.barh([yi for yi, m in zip(y, meas) if m is not None], [m for m in meas if m is not None],
                    color=colors[0], height=0.6, label="measured")
        pred = [(yi, r["predicted_us"]) for yi, r in zip(y, rows) if r.get("predicted_us") is not None]
        if pred:
            ax.plot([p[1] for p in pred], [p[0] for p in pred], "D", color=colors[1], markersize=5,
                    label="cost model", linestyle="none")
        floor = [(yi, r["floor_us"]) for yi, r in zip(y, rows) if r.get("floor_us") is not None]
        if floor:
            ax.plot([f[1] for f in floor], [f[0] for f in floor], "|", color="black", markersize=12,
                    markeredgewidth=1.6, label="bytes at copy bandwidth", linestyle="none")
        ax.set_xscale("log")
        ax.set_yticks(y, labels, fontsize=7)
        ax.set_xlabel("µs per call")
        ax.grid(axis="y", visible=False)
        ax.set_title(title or "Kernel time per call", fontsize=9)
        fig.legend(loc="outside lower center", ncol=3, fontsize=7)
    return fig


def plot_prefill_throughput(rows: Sequence[Mapping[str, Any]], *, x: str = "tokens", y: str = "tflops",
                            ylabel: str = "TFLOP/s", peak: float | None = None, title: str | None = None):
    """Throughput against problem size, one line per ``kernel / variant`` (rows with ``kernel``, ``variant``,
    ``x`` and ``y`` fields); ``peak`` draws the ceiling."""
    series: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r.get(x) is None or r.get(y) is None:
            continue
        key = f"{r.get('kernel')} / {r.get('variant')}" if r.get("variant") not in (None, "") else str(r.get("kernel"))
        series.setdefault(key, []).append((float(r[x]), float(r[y])))
    with use_style():
        colors = _colors()
        fig = _figure(THROUGHPUT_SIZE)
        ax = fig.add_subplot()
        for i, (key, pts) in enumerate(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colors[i % len(colors)],
                    label=_short(key, 40), markersize=3.5)
        if peak:
            ax.axhline(peak, color="black", linestyle=":", linewidth=0.8, label=f"peak {peak:,.0f}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(x.replace("_", " "))
        ax.set_ylabel(ylabel)
        ax.set_title(title or "Prefill kernels")
        if series:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=6.5)
    return fig


def plot_hardware_catalogue(hardware, *, dtypes: Sequence[str] = ("bf16", "fp8", "int8", "fp4"),
                            title: str | None = None):
    """The catalogue side by side: memory bandwidth (peak and achievable) and dense matrix TFLOP/s per dtype."""
    hws = _as_hardware(hardware)
    with use_style():
        colors = _colors()
        fig = _figure(CATALOGUE_SIZE)
        a1, a2 = fig.subplots(1, 2)
        names = [h.name for h in hws]
        xs = list(range(len(hws)))
        peak = [h.get("memory.bw_peak_gbps") or 0.0 for h in hws]
        ach = [h.get("memory.bw_achievable_gbps") or 0.0 for h in hws]
        a1.bar([x - 0.2 for x in xs], [p / 1e3 for p in peak], width=0.38, color=colors[0], label="peak")
        a1.bar([x + 0.2 for x in xs], [a / 1e3 for a in ach], width=0.38, color=colors[1], label="achievable")
        a1.set_xticks(xs, names, rotation=30, ha="right", fontsize=7)
        a1.set_ylabel("TB/s")
        a1.set_title("memory bandwidth", fontsize=9)
        a1.legend(fontsize=7)
        width = 0.8 / len(dtypes)
        for j, d in enumerate(dtypes):
            vals = [h.matrix_tflops(d) or 0.0 for h in hws]
            a2.bar([x + (j - (len(dtypes) - 1) / 2) * width for x in xs], vals, width=width * 0.92,
                   color=colors[(j + 2) % len(colors)], label=d)
        a2.set_yscale("symlog", linthresh=10)
        a2.set_xticks(xs, names, rotation=30, ha="right", fontsize=7)
        a2.set_ylabel("dense TFLOP/s (TOP/s for int8)")
        a2.set_title("matrix engines", fontsize=9)
        a2.legend(fontsize=7, ncol=2)
        fig.suptitle(title or "Hardware catalogue (data/hardware/*.yaml)", fontsize=10)
    return fig


def _fmt_value(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def plot_milestones(milestones: Sequence[Mapping[str, Any]], *, value: str, unit: str,
                    predicted: str | None = None, lines: Mapping[str, float] | None = None,
                    title: str | None = None):
    """A paper's milestones in order: reported values as bars (with reported ranges as error bars where a
    ``<value>_range`` is given), the cost model's prediction per milestone as diamonds (``predicted`` field;
    hollow where the row's ``independent`` is false, i.e. the model has nothing of its own to say), and
    horizontal ``lines`` (label → value) for other predictions and measurements."""
    with use_style():
        colors = _colors()
        fig = _figure(MILESTONES_SIZE)
        ax = fig.add_subplot()
        xs = list(range(len(milestones)))
        vals = [float(m[value]) for m in milestones]
        ax.bar(xs, vals, color=colors[0], width=0.62, label="reported by the paper")
        for x, m in zip(xs, milestones):
            rng = m.get(f"{value}_range")
            if rng:
                ax.errorbar([x], [float(m[value])], yerr=[[float(m[value]) - float(rng[0])],
                                                          [float(rng[1]) - float(m[value])]],
                            color="black", capsize=3, linewidth=0.9)
            ax.text(x, float(m[value]), _fmt_value(float(m[value])), ha="center", va="bottom", fontsize=6.5)
        if predicted:
            for indep, face in ((True, colors[1]), (False, "none")):
                pts = [(x, float(m[predicted])) for x, m in zip(xs, milestones)
                       if m.get(predicted) is not None and bool(m.get("independent", True)) == indep]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], "D", markersize=6, markerfacecolor=face,
                            markeredgecolor=colors[1], linestyle="none",
                            label="cost model" if indep else "cost model (change not modelled)")
        for i, (label, v) in enumerate((lines or {}).items()):
            ax.axhline(float(v), color=colors[(i + 2) % len(colors)], linestyle="--", linewidth=1.0,
                       label=f"{label}: {_fmt_value(float(v))}")
        ax.set_xticks(xs, [_short(str(m.get("label") or m.get("id")), 26) for m in milestones], rotation=28,
                      ha="right", fontsize=6.5)
        ax.set_ylabel(unit)
        ax.set_title(title or "Milestones")
        ax.legend(loc="upper left", fontsize=7, frameon=True)
    return fig


__all__ = ["plot_roofline", "plot_step_waterfall", "plot_bytes_composition", "save_figure", "use_style", "STYLE",
           "plot_channel_similarity", "plot_stage_cosines", "plot_checkpoint_inventory", "plot_divergence_vs_position",
           "plot_layer_divergence", "plot_kernel_check_errors", "plot_kernel_timings", "plot_prefill_throughput",
           "plot_hardware_catalogue", "plot_milestones", "plot_quant_ablation"]


# ============================================================================================ quantization ablation
QUANT_ABLATION_SIZE = (8.0, 3.6)


def plot_quant_ablation(points: Sequence[Mapping[str, Any]], *, title: str | None = None):
    """The weight-format ablation of the trained small model (``data/results/quant_ablation.json``).

    Left: routed experts — teacher-forced KL against the bf16 model per FP4 group size, E8M0 (power-of-two) vs
    E4M3 group scales, with bytes per parameter on a twin axis. Right: dense projections, FP8 with 128×128 blocks vs
    per-channel scales. The real checkpoint's choice is drawn as a star.
    """
    with use_style():
        fig = _figure(QUANT_ABLATION_SIZE)
        ax_e, ax_d = fig.subplots(1, 2, gridspec_kw=dict(width_ratios=(3, 2)))
        experts = [p for p in points if p.get("sweep") == "experts"]
        for scale, marker in (("e8m0", "o"), ("e4m3", "s")):
            rows = sorted((p for p in experts if p["experts"]["scale"] == scale), key=lambda p: p["experts"]["group"])
            if not rows:
                continue
            ax_e.plot([p["experts"]["group"] for p in rows], [p["kl_vs_bf16"] for p in rows], marker=marker,
                      label=f"{scale.upper()} group scales")
        chosen = [p for p in experts if p.get("is_checkpoint_choice")]
        for p in chosen:
            ax_e.plot([p["experts"]["group"]], [p["kl_vs_bf16"]], marker="*", markersize=14, color="black",
                      linestyle="none", label="checkpoint's choice (E2M1, g32, E8M0)")
        ax_e.set_xscale("log", base=2)
        groups = sorted({p["experts"]["group"] for p in experts})
        ax_e.set_xticks(groups, [str(g) for g in groups])
        ax_e.set_xlabel("FP4 (E2M1) group size")
        ax_e.set_ylabel("KL vs bf16 model (nats/token)")
        ax_e.set_title("routed experts")
        ax_e.legend(fontsize="small")
        dense = [p for p in points if p.get("sweep") == "dense"]
        labels = [p["name"].replace("dense E4M3 ", "").replace(" E8M0", "\nE8M0").replace(" F32", "\nF32")
                  for p in dense]
        colors = ["black" if p.get("is_checkpoint_choice") else "tab:blue" for p in dense]
        ax_d.bar(range(len(dense)), [p["kl_vs_bf16"] for p in dense], color=colors)
        ax_d.set_xticks(range(len(dense)), labels, fontsize="small")
        ax_d.set_ylabel("KL vs bf16 model (nats/token)")
        ax_d.set_title("dense projections (FP8 E4M3)")
        if title:
            fig.suptitle(title)
    return fig
