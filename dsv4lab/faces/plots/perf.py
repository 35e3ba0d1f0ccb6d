"""Performance figures: the roofline, step-time waterfalls, bytes per token, the hardware catalogue, the decode
and prefill kernels, and the paper's milestones beside this project's numbers.

Each function takes data (the dicts of :mod:`dsv4lab.faces.figure_data`, :mod:`dsv4lab.tools.perf`) and returns a Figure in
the package style with its caption; ``where`` fills the caption (``model``, ``measured``, ``modelled``,
``reported``, ``note``: see :func:`dsv4lab.faces.plots.style.caption`).
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from dsv4lab.tools.perf.hardware import Hardware, load_hardware
from dsv4lab.faces.plots.style import (INK, MEASURED, MODELLED, OTHER, PALETTE, REPORTED, SOURCES, bar_style, caption, fmt_value,
                    legend_below, marker_style, missing, new_figure, palette, short, source_label, use_style, wrap)

FLASH = "DeepSeek-V4-Flash"
DTYPE_ORDER = ("fp4", "fp8", "int8", "bf16", "fp32")
SOURCE_COLOR = {REPORTED: INK, MODELLED: OTHER}


DEFAULT_WHERE = {MEASURED: "this project's benchmarks (data/results/)", MODELLED: "cost model (dsv4lab.tools.perf)",
                 REPORTED: "the paper (data/paper/)"}


def _caption(fig, where: Mapping[str, Any] | None, kinds: Sequence[str] = (), **defaults) -> None:
    """The caption from ``where``, falling back to ``defaults`` and to a generic line for each kind of number in
    ``kinds`` (what the figure shows), so no figure goes without saying what its numbers are."""
    w = {k: DEFAULT_WHERE[k] for k in kinds}
    w.update(defaults)
    w.update({k: v for k, v in (where or {}).items() if v is not None})
    caption(fig, w.pop("model", FLASH), **w)


def _as_hardware(item) -> Hardware:
    return item if isinstance(item, Hardware) else load_hardware(item)


# ============================================================================================ roofline
def _draw_roof(ax, hw: Hardware, x_range: tuple[float, float], dtypes: Sequence[str]) -> float:
    """The roof of ``hw``: peak bandwidth, the measured copy bandwidth when known, and one ceiling per matrix
    rate. Returns the highest ceiling (TFLOP/s)."""
    import numpy as np
    xs = np.logspace(math.log10(x_range[0]), math.log10(x_range[1]), 200)
    ceilings: dict[float, list[str]] = {}
    for d in dtypes:
        if hw.matrix_tflops(d):
            ceilings.setdefault(float(hw.matrix_tflops(d)), []).append(d)
    if not ceilings and hw.vector_tflops("fp32"):
        ceilings[float(hw.vector_tflops("fp32"))] = ["fp32 vector"]
    top = max(ceilings) if ceilings else 1.0
    bw_peak = hw.bandwidth_gbps("peak") / 1e3  # TB/s = TFLOP/s per FLOP/byte
    ax.plot(xs, np.minimum(top, xs * bw_peak), color=INK, linewidth=1.4)
    ax.text(x_range[0] * 1.6, x_range[0] * 1.6 * bw_peak * 1.25, f"peak {bw_peak:.2f} TB/s", rotation=0,
            fontsize=6.5, color=INK, ha="left", va="bottom")
    achievable = hw.get("memory.bw_achievable_gbps")
    if achievable and abs(achievable / 1e3 - bw_peak) > 1e-6:
        bw = achievable / 1e3
        ax.plot(xs, np.minimum(top, xs * bw), color=INK, linewidth=0.9, linestyle=(0, (4, 2)))
        ax.text(x_range[0] * 1.6, x_range[0] * 1.6 * bw / 1.3, f"measured copy {bw:.2f} TB/s", fontsize=6.5,
                color="#555555", ha="left", va="top")
    for rate, names in sorted(ceilings.items()):
        ridge = rate / bw_peak
        ax.hlines(rate, ridge, x_range[1], colors=INK, linestyles=":", linewidth=0.8)
        above = rate == top  # the top ceiling is labelled above its line, the others below theirs
        ax.text(x_range[1] / 1.2, rate * (1.1 if above else 1 / 1.1), f"{'/'.join(names)} {rate:,.0f} TFLOP/s",
                fontsize=6.5, color=INK, ha="right", va="bottom" if above else "top")
    return top


def plot_roofline(panels: Sequence[Mapping[str, Any]], *, title: str | None = None,
                  where: Mapping[str, Any] | None = None, dtypes: Sequence[str] = DTYPE_ORDER):
    """Rooflines, one panel per hardware, with points placed by arithmetic intensity and attained rate.

    Each panel: ``hardware`` (name or :class:`Hardware`), ``title``, ``points`` and optional ``missing`` (notes
    on data not there yet, shown in the panel). A point: ``label, intensity`` (FLOP/byte), ``tflops``
    (attained), ``source`` (measured / modelled / reported), ``group`` (its legend entry) and ``annotate``
    (write its label, at ``offset`` points from it). Modelled points are hollow grey diamonds, reported ones black squares, measured ones
    filled circles coloured by group; the legend names each group with its kind."""
    x_range = (1e-2, 1e4)
    groups: dict[tuple[str, str], str] = {}
    for p in panels:
        for pt in p.get("points", ()):
            key = (pt["source"], pt["group"])
            if key not in groups:
                n_measured = sum(1 for s, _ in groups if s == MEASURED)
                groups[key] = SOURCE_COLOR.get(pt["source"]) or PALETTE[n_measured % len(PALETTE)]
    with use_style():
        fig = new_figure((5.0 * len(panels) + 0.8, 5.0))
        axes = fig.subplots(1, len(panels), squeeze=False, sharey=True)[0]
        lowest = math.inf
        top = 1.0
        for ax, panel in zip(axes, panels):
            hw = _as_hardware(panel["hardware"])
            top = max(top, _draw_roof(ax, hw, x_range, dtypes))
            handles: dict[tuple[str, str], Any] = {}
            for (source, group), color in groups.items():
                pts = [pt for pt in panel.get("points", ()) if (pt["source"], pt["group"]) == (source, group)]
                if not pts:
                    continue
                size = 4.0 if source == MODELLED else 6.0
                (line,) = ax.plot([pt["intensity"] for pt in pts], [pt["tflops"] for pt in pts],
                                  **marker_style(source, color, size), zorder=4 if source != MODELLED else 3)
                handles.setdefault((source, group), line)
                lowest = min(lowest, min(pt["tflops"] for pt in pts))
                for pt in pts:
                    if pt.get("annotate"):
                        ax.annotate(pt["label"], (pt["intensity"], pt["tflops"]), textcoords="offset points",
                                    xytext=pt.get("offset", (5, -2)), fontsize=6.3,
                                    ha="right" if pt.get("offset", (5, 0))[0] < 0 else "left",
                                    color=color if source == MEASURED else INK)
            for i, note in enumerate(panel.get("missing", ())):
                missing(ax, note, y=0.08 + 0.11 * i)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlim(*x_range)
            ax.set_title(panel.get("title") or hw.name, fontsize=9)
            ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
            order = sorted(handles, key=lambda k: ((REPORTED, MEASURED, MODELLED).index(k[0]), list(groups).index(k)))
            legend_below(ax, [handles[k] for k in order], [source_label(s, g) for s, g in order], ncol=1)
        axes[0].set_ylabel("attained rate (TFLOP/s)")
        axes[0].set_ylim(max(min(lowest, 1.0) / 3, 1e-5), top * 4)
        fig.suptitle(title or f"{FLASH} decode on the roofline", fontsize=10)
        _caption(fig, where, kinds=sorted({s for s, _ in groups}),
                 note="roofs: datasheet peaks; dashed: the copy bandwidth measured on the machine")
    return fig


# ============================================================================================ step waterfall
def plot_step_waterfall(rows: Sequence[Mapping[str, Any]], *, title: str | None = None, unit: str = "ms",
                        rate_unit: str = "tok/s", where: Mapping[str, Any] | None = None):
    """Step time by component, one bar per row, with the step's rate written in columns by kind of number.

    A row: ``label``; ``components_us`` (component → µs, modelled; None: the model has nothing to say for this
    row); ``tokens`` per step (default 1; a prefill gives its prompt length); ``reported_rate`` and
    ``reported_step_us`` (the paper's, drawn as a black square); ``measured_rate`` (``measured_missing``: why
    there is none); ``implied`` (the modelled value uses a cost implied by the paper's own milestone pair). The
    columns on the right print each kind beside its own kind: reported, modelled (and modelled ÷ reported
    where both exist), measured."""
    scale = {"ms": 1e-3, "us": 1.0, "s": 1e-6}[unit]
    order: list[str] = []
    for r in rows:
        for k in (r.get("components_us") or {}):
            if k not in order:
                order.append(k)
    colors = palette(len(order))
    n = len(rows)
    ys = list(range(n))[::-1]
    columns = [("reported\nby the paper", "reported"), ("modelled", "modelled")]
    if any(r.get("reported_rate") and r.get("components_us") for r in rows):
        columns.append(("modelled ÷\nreported", "ratio"))
    if any("measured_rate" in r for r in rows):
        columns.append(("measured", "measured"))
    with use_style():
        fig = new_figure((9.6, 1.0 + 0.52 * n + 1.3))
        ax, side = fig.subplots(1, 2, sharey=True, width_ratios=[3.4, 0.7 * len(columns)])
        handles, labels = [], []
        for ci, comp in enumerate(order):
            left = [sum((r.get("components_us") or {}).get(c, 0.0) for c in order[:ci]) * scale for r in rows]
            width = [(r.get("components_us") or {}).get(comp, 0.0) * scale for r in rows]
            bars = ax.barh(ys, width, left=left, height=0.62, **bar_style(MODELLED, colors[ci]))
            handles.append(bars.patches[0] if bars.patches else bars)
            labels.append(comp.replace("_", " "))
        rep = [(y, r["reported_step_us"] * scale) for y, r in zip(ys, rows) if r.get("reported_step_us")]
        if rep:
            (sq,) = ax.plot([v for _, v in rep], [y for y, _ in rep], **marker_style(REPORTED, INK, 6), zorder=5)
            handles.append(sq)
            labels.append(source_label(REPORTED, "step time"))
        ax.set_yticks(ys, [wrap(str(r["label"]), 30) for r in rows], fontsize=7)
        ax.set_ylabel("step")
        ax.set_xlabel(f"time per step ({unit}); bars: modelled, by component")
        ax.grid(axis="y", visible=False)
        ax.set_ylim(-0.6, n - 0.2)
        side.set_axis_off()
        for ci, (head, kind) in enumerate(columns):
            x = (ci + 0.5) / len(columns)
            side.text(x, n - 0.45, head, ha="center", va="bottom", fontsize=6.8, fontweight="bold",
                      transform=side.get_yaxis_transform(), color=INK)
            for y, r in zip(ys, rows):
                side.text(x, y, _cell(r, kind, rate_unit), ha="center", va="center", fontsize=6.8,
                          transform=side.get_yaxis_transform(), color=INK if kind != "modelled" else "#555555")
        legend_below(ax, handles, labels, ncol=3)
        fig.suptitle(title or "Step time by component", fontsize=10)
        note = ("†: modelled with a cost implied by the paper's own pair of milestones"
                if any(r.get("implied") for r in rows) else None)
        kinds = [MODELLED] + ([REPORTED] if rep else []) + (
            [MEASURED] if any(r.get("measured_rate") is not None for r in rows) else [])
        _caption(fig, where, kinds=kinds, note=note)
    return fig


def _rate(r: Mapping[str, Any]) -> float | None:
    comps = r.get("components_us")
    if not comps:
        return None
    total = sum(comps.values())
    return float(r.get("tokens", 1)) * 1e6 / total if total else None


def _cell(r: Mapping[str, Any], kind: str, unit: str) -> str:
    if kind == "reported":
        return f"{fmt_value(r['reported_rate'])}" if r.get("reported_rate") else "—"
    if kind == "modelled":
        v = _rate(r)
        return "not modelled" if v is None else fmt_value(v) + (" †" if r.get("implied") else "")
    if kind == "ratio":
        v = _rate(r)
        return f"×{v / r['reported_rate']:.2f}" if v and r.get("reported_rate") else ""
    if r.get("measured_rate") is not None:
        return fmt_value(r["measured_rate"])
    return r.get("measured_missing") or ""


# ============================================================================================ bytes composition
def plot_bytes_composition(bars: Mapping[str, Mapping[str, float]], *, title: str | None = None, unit: str = "GB",
                           top: int = 8, where: Mapping[str, Any] | None = None):
    """Bytes per token by component, one stacked bar per entry of ``bars`` (label → component → bytes): the
    ``top`` largest components by name, the rest summed as "other"."""
    scale = {"GB": 1e-9, "MB": 1e-6}[unit]
    totals: dict[str, float] = {}
    for comp in bars.values():
        for k, v in comp.items():
            totals[k] = totals.get(k, 0.0) + v
    ranked = sorted(totals, key=lambda k: -totals[k])
    named, rest = ranked[:top], ranked[top:]
    stacks = {}
    for label, comp in bars.items():
        row = {k: comp.get(k, 0.0) for k in named}
        if rest:
            row[f"other ({len(rest)} components)"] = sum(comp.get(k, 0.0) for k in rest)
        stacks[label] = row
    order = named + ([f"other ({len(rest)} components)"] if rest else [])
    colors = palette(len(named)) + [OTHER]
    with use_style():
        fig = new_figure((8.0, 1.9 + 0.55 * len(bars) + 0.4))
        ax = fig.add_subplot()
        names = list(stacks)
        ys = list(range(len(names)))[::-1]
        widest = max(sum(s.values()) for s in stacks.values()) * scale
        for ci, comp in enumerate(order):
            left = [sum(stacks[n].get(c, 0.0) for c in order[:ci]) * scale for n in names]
            width = [stacks[n].get(comp, 0.0) * scale for n in names]
            ax.barh(ys, width, left=left, height=0.58, label=comp.replace("_", " "),
                    **bar_style(MODELLED, colors[ci]))
            for y, l0, w in zip(ys, left, width):
                if w > 0.07 * widest:
                    ax.text(l0 + w / 2, y, f"{w:.2f}", ha="center", va="center", fontsize=6.5, color=INK,
                            bbox=dict(boxstyle="square,pad=0.1", facecolor="white", edgecolor="none", alpha=0.8))
        for y, name in zip(ys, names):
            total = sum(stacks[name].values()) * scale
            ax.text(total, y, f"  {total:.2f} {unit}", va="center", fontsize=7)
        ax.set_yticks(ys, [wrap(n, 28) for n in names], fontsize=7.5)
        ax.set_ylabel("what is counted")
        ax.set_xlabel(f"{unit} per generated token (batch 1)")
        ax.margins(x=0.12)
        ax.grid(axis="y", visible=False)
        handles, labels = ax.get_legend_handles_labels()
        legend_below(ax, handles, labels, ncol=5)
        fig.suptitle(title or "Bytes per generated token by component (modelled)", fontsize=10)
        _caption(fig, where, modelled="cost model (dsv4lab.tools.perf.costmodel), §5.1 accounting")
    return fig


# ============================================================================================ catalogue
def achievable_bandwidth(hw: Hardware) -> tuple[float | None, str | None]:
    """``(TB/s, kind)`` of a catalogue entry's achievable memory bandwidth: ``measured`` when its source is one of
    this project's measurements (the source's key or text says measured), ``reported`` when it is the paper's or a
    vendor's figure, ``(None, None)`` when nobody has measured it (``value: null``)."""
    q = hw.quantities.get("memory.bw_achievable_gbps")
    if q is None or q.value is None:
        return None, None
    own = "measure" in q.source.lower() or "measured" in q.source_text.lower()
    return float(q.value) / 1e3, (MEASURED if own and not q.source.startswith("paper") else REPORTED)


def plot_hardware_catalogue(hardware, *, dtypes: Sequence[str] = ("bf16", "fp8", "int8", "fp4"),
                            title: str | None = None, where: Mapping[str, Any] | None = None):
    """The catalogue side by side: memory bandwidth (datasheet peak; achievable as measured by this project or as
    reported by the paper, each drawn as what it is, and "not measured" where the catalogue has no figure — never a
    bar at 0) and dense matrix TFLOP/s per dtype (datasheet)."""
    hws = [_as_hardware(h) for h in ([hardware] if isinstance(hardware, (str, Hardware)) else hardware)]
    with use_style():
        fig = new_figure((9.0, 4.0))
        a1, a2 = fig.subplots(1, 2)
        names = [h.name for h in hws]
        xs = list(range(len(hws)))
        peak = [(h.get("memory.bw_peak_gbps") or 0.0) / 1e3 for h in hws]
        known = [(x, p) for x, p in zip(xs, peak) if p]
        a1.bar([x - 0.2 for x, _ in known], [p for _, p in known], width=0.38, label="peak (datasheet)",
               **bar_style(REPORTED, PALETTE[0]))
        achievable = [achievable_bandwidth(h) for h in hws]
        looks = {MEASURED: ("achievable (copy kernel)", PALETTE[1]), REPORTED: ("achievable", PALETTE[3])}
        for kind, (what, color) in looks.items():
            bars = [(x, v) for x, (v, k) in zip(xs, achievable) if k == kind]
            if bars:
                a1.bar([x + 0.2 for x, _ in bars], [v for _, v in bars], width=0.38, label=source_label(kind, what),
                       **bar_style(kind, color))
        top = max(peak + [v or 0.0 for v, _ in achievable] + [1.0])
        for x, p, (v, _) in zip(xs, peak, achievable):
            if v is None:
                a1.text(x + 0.2, top * 0.02, "not\nmeasured", ha="center", va="bottom", fontsize=5.5, rotation=90,
                        color="#777777")
            if not p:
                a1.text(x - 0.2, top * 0.02, "not in\ncatalogue", ha="center", va="bottom", fontsize=5.5,
                        rotation=90, color="#777777")
        a1.set_xticks(xs, names, rotation=30, ha="right", fontsize=7)
        a1.set_xlabel("catalogue entry")
        a1.set_ylabel("memory bandwidth (TB/s)")
        a1.set_title("memory bandwidth", fontsize=9)
        a1.legend(fontsize=7)
        width = 0.8 / len(dtypes)
        for j, d in enumerate(dtypes):
            vals = [h.matrix_tflops(d) or 0.0 for h in hws]
            a2.bar([x + (j - (len(dtypes) - 1) / 2) * width for x in xs], vals, width=width * 0.92,
                   label=f"{d} (datasheet)", **bar_style(REPORTED, PALETTE[(j + 2) % len(PALETTE)]))
        a2.set_yscale("symlog", linthresh=10)
        a2.set_xticks(xs, names, rotation=30, ha="right", fontsize=7)
        a2.set_xlabel("catalogue entry")
        a2.set_ylabel("dense matrix TFLOP/s (TOP/s for int8)")
        a2.set_title("matrix engines (0: no such path)", fontsize=9)
        a2.legend(fontsize=7, ncol=2)
        fig.suptitle(title or "Hardware catalogue (data/hardware/*.yaml)", fontsize=10)
        measured = [h.name for h, (_, k) in zip(hws, achievable) if k == MEASURED]
        reported = [h.name for h, (_, k) in zip(hws, achievable) if k == REPORTED]
        _caption(fig, where, model="hardware catalogue",
                 measured=f"achievable bandwidth of {', '.join(measured)} (this project's copy kernels)"
                 if measured else None,
                 reported=f"achievable bandwidth of {', '.join(reported)} (the paper's figure)" if reported else None,
                 note="peaks: vendor datasheets; every number names its source in data/hardware/<name>.yaml")
    return fig


# ============================================================================================ decode kernels
def plot_decode_kernels(rows: Sequence[Mapping[str, Any]], *, title: str | None = None,
                        where: Mapping[str, Any] | None = None, missing_note: str | None = None):
    """Time per call of each decode kernel (rows of :func:`dsv4lab.faces.figure_data.decode_kernels`): the best own
    variant, the others, cuBLAS and a plain ``torch.sum`` read of the same bytes (all measured), the cost
    model's time (modelled) and the floor (the kernel's bytes at the measured copy bandwidth)."""
    n = len(rows)
    ys = list(range(n))[::-1]
    with use_style():
        fig = new_figure((8.4, 1.6 + 0.34 * n + 1.0))
        ax, side = fig.subplots(1, 2, sharey=True, width_ratios=[4.6, 0.8])
        series = [
            ("other_us", source_label(MEASURED, "other own variants"), marker_style(MEASURED, "#B9B9B9", 3.5)),
            ("best_us", source_label(MEASURED, "best own (Triton) variant"), marker_style(MEASURED, PALETTE[0], 6.5)),
            ("library_us", source_label(MEASURED, "cuBLAS (library baseline)"), marker_style(MEASURED, PALETTE[1], 5)),
            ("read_us", source_label(MEASURED, "torch.sum reading the same bytes"), marker_style(MEASURED, PALETTE[4], 5)),
            ("modelled_us", source_label(MODELLED, "cost model"), marker_style(MODELLED, PALETTE[2], 5.5)),
        ]
        for key, label, style in series:
            xs, yv = [], []
            for y, r in zip(ys, rows):
                vals = r.get(key)
                for v in (vals if isinstance(vals, list) else [vals]):
                    if v is not None:
                        xs.append(float(v))
                        yv.append(y)
            if xs:
                ax.plot(xs, yv, label=label, **style, zorder=4 if key == "best_us" else 3)
        floor = [(y, r["floor_us"]) for y, r in zip(ys, rows) if r.get("floor_us")]
        if floor:
            ax.plot([f[1] for f in floor], [f[0] for f in floor], marker="|", markersize=13, markeredgewidth=1.8,
                    color=INK, linestyle="none", label="floor: its bytes at the measured copy bandwidth")
        if missing_note:
            missing(ax, missing_note, y=0.9)
        ax.set_xscale("log")
        ax.set_yticks(ys, [r["label"] for r in rows], fontsize=7.5)
        ax.set_ylabel("kernel")
        ax.set_xlabel("time per call (µs, log scale)")
        ax.grid(axis="y", visible=False)
        ax.set_ylim(-0.7, n - 0.3)
        side.set_axis_off()
        side.text(0.5, n - 0.5, "best variant,\n% of copy BW", ha="center", va="bottom", fontsize=6.8,
                  fontweight="bold", transform=side.get_yaxis_transform())
        for y, r in zip(ys, rows):
            text = f"{r['pct_copy_bw']:.1f}%" if r.get("pct_copy_bw") is not None else "—"
            side.text(0.5, y, text, ha="center", va="center", fontsize=7, transform=side.get_yaxis_transform())
        handles, labels = ax.get_legend_handles_labels()
        legend_below(ax, handles, labels, ncol=2)
        fig.suptitle(title or "Decode kernels: time per call", fontsize=10)
        kinds = ([MEASURED] if any(r.get("best_us") for r in rows) else []) + (
            [MODELLED] if any(r.get("modelled_us") for r in rows) else [])
        _caption(fig, where, kinds=kinds)
    return fig


# ============================================================================================ prefill kernels
def plot_prefill_throughput(rows: Sequence[Mapping[str, Any]], *, peaks: Mapping[str, tuple[float, str]] | None = None,
                            x: str = "tokens", y: str = "tflops", ylabel: str = "TFLOP/s per GPU", top: int = 4,
                            max_panels: int = 4, names: Mapping[str, str] | None = None, title: str | None = None,
                            where: Mapping[str, Any] | None = None, missing_note: str | None = None):
    """Throughput against prompt length: one panel per kernel (``names`` gives its title), its ``top`` variants
    ranked by their best rate (rows ending in ``:total`` stand for their stages; several rows at one size, e.g.
    sorter-row or chunk ablations, show their best), the rest counted in the panel title. Rows carry ``kernel, variant, x, y`` and ``source`` (default measured). ``peaks``: dtype →
    (TFLOP/s, how it is known), drawn as lines; the rate axis is logarithmic so the distance to them reads.
    ``missing_note`` says in the first panel what is not there (e.g. no measurements committed yet)."""
    panels: dict[str, dict[str, list[tuple[float, float]]]] = {}
    source_of: dict[tuple[str, str], str] = {}
    for r in rows:
        if r.get(x) is None or r.get(y) is None:
            continue
        kernel, variant = str(r.get("kernel")), str(r.get("variant") or "")
        panels.setdefault(kernel, {}).setdefault(variant, []).append((float(r[x]), float(r[y])))
        source_of[(kernel, variant)] = r.get("source", MEASURED)
    kernels = list(panels)[:max_panels]
    hidden = list(panels)[max_panels:]
    ncols = 1 if len(kernels) <= 1 else 2
    nrows = max(1, math.ceil(len(kernels) / ncols))
    values = [v for series in panels.values() for pts in series.values() for _, v in pts if v > 0]
    peak_values = [v for v, _ in (peaks or {}).values()]
    lo = min(values, default=1.0) / 2
    hi = max(values + peak_values, default=10.0) * 2
    with use_style():
        fig = new_figure((4.6 * ncols + 0.4, 3.4 * nrows + 1.0))
        axes = fig.subplots(nrows, ncols, squeeze=False)
        for i, ax in enumerate(axes.flat):
            if i >= len(kernels):
                ax.set_visible(False)
                continue
            kernel = kernels[i]
            series = panels[kernel]
            if any(v.endswith(":total") for v in series):
                series = {v: pts for v, pts in series.items() if v.endswith(":total")}
            ranked = sorted(series, key=lambda v: -max(p[1] for p in series[v]))
            shown = ranked[:top]
            for j, variant in enumerate(shown):
                best: dict[float, float] = {}  # several rows at one size (sorter rows, chunks): the best of them
                for px, py in series[variant]:
                    best[px] = max(py, best.get(px, py))
                pts = sorted(best.items())
                source = source_of[(kernel, variant)]
                style = marker_style(source, PALETTE[j % len(PALETTE)], 4.5)
                style.update(linestyle=SOURCES[source].linestyle, linewidth=1.3)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=short(variant.removesuffix(":total"), 30),
                        **style)
            for (dtype, (value, how)), color in zip(sorted((peaks or {}).items()), (INK, "#8C8C8C", "#B0B0B0")):
                ax.axhline(value, color=color, linestyle=(0, (1, 1.5)), linewidth=1.0,
                           label=f"{dtype} peak {value:,.0f} ({how})")
            counts = f"best {len(shown)} of {len(series)} variants"
            dropped = len(panels[kernel]) - len(series)
            if dropped:
                counts += f", totals of {dropped} per-stage rows"
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_ylim(lo, hi)
            ax.set_xlabel(f"{x.replace('_', ' ')} (log scale)")
            ax.set_ylabel(f"{ylabel} (log scale)")
            ax.set_title(f"{(names or {}).get(kernel, kernel.replace('_', ' '))}\n({counts}; all in the CSV)",
                         fontsize=8.5)
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=6.3, ncol=2)
            if missing_note and i == 0:
                missing(ax, missing_note, y=0.12)
        fig.suptitle(title or "Prefill kernels", fontsize=10)
        _caption(fig, where, kinds=sorted(set(source_of.values())),
                 note=f"kernels not shown: {', '.join(hidden)} (in the CSV)" if hidden else None)
    return fig


# ============================================================================================ milestones
def plot_milestones(milestones: Sequence[Mapping[str, Any]], *, value: str, unit: str,
                    predicted: str | None = None, lines: Mapping[str, Mapping[str, Any]] | None = None,
                    standing: Sequence[Mapping[str, Any]] | None = None, title: str | None = None,
                    where: Mapping[str, Any] | None = None):
    """The paper's milestones in order (reported bars, the ``<value>_range`` as error bars), the cost model's value
    per milestone (``predicted``: hollow diamonds; grey where the row's ``independent`` is false: the model has
    nothing of its own to say), and ``lines`` (label → ``{value, source, gap}`` or a bare number, modelled: a
    horizontal line in its kind's style; ``gap`` writes its ratio to the last milestone).

    With ``standing`` a second panel sets the paper's final number beside this project's (rows of
    :func:`dsv4lab.faces.figure_data.decode_standing`): each bar in its kind's style with its roofline bound (a black
    bar-wide tick) and the share of the bound it reaches (and its ``ttft_s`` when given); a row without a
    ``value`` says why in the panel."""
    with use_style():
        fig = new_figure((11.0 if standing else 7.8, 6.0))
        if standing:
            ax, right = fig.subplots(1, 2, width_ratios=[1.55, 1.0])
        else:
            ax, right = fig.add_subplot(), None
        xs = list(range(len(milestones)))
        vals = [float(m[value]) for m in milestones]
        ax.bar(xs, vals, width=0.62, label=source_label(REPORTED), **bar_style(REPORTED, PALETTE[0]))
        for x, m in zip(xs, milestones):
            rng = m.get(f"{value}_range")
            if rng:
                ax.errorbar([x], [float(m[value])], yerr=[[float(m[value]) - float(rng[0])],
                                                          [float(rng[1]) - float(m[value])]],
                            color=INK, capsize=3, linewidth=0.9)
            ax.text(x, float(m[value]) / 2, fmt_value(float(m[value])), ha="center", va="center", fontsize=6.5,
                    color="white", fontweight="bold", rotation=90 if len(milestones) > 10 else 0)
        if predicted:
            for indep, color, label in ((True, PALETTE[1], "cost model"),
                                        (False, OTHER, "no cost of its own (the later step's value)")):
                pts = [(x, float(m[predicted])) for x, m in zip(xs, milestones)
                       if m.get(predicted) is not None and bool(m.get("independent", True)) == indep]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], label=source_label(MODELLED, label),
                            **marker_style(MODELLED, color, 6.5), zorder=5)
        line_colors = {REPORTED: INK, MODELLED: PALETTE[1], MEASURED: PALETTE[2]}
        for i, (label, spec) in enumerate((lines or {}).items()):
            spec = spec if isinstance(spec, Mapping) else dict(value=spec)  # a bare number: a modelled line
            v, source = float(spec["value"]), spec.get("source", MODELLED)
            color = line_colors[source] if i < 3 else PALETTE[(i + 3) % len(PALETTE)]
            ax.axhline(v, color=color, linestyle=SOURCES[source].linestyle, linewidth=1.0,
                       label=f"{source_label(source, label)}: {fmt_value(v)}")
            if spec.get("gap") and vals:
                last = vals[-1]
                xg = xs[-1] + 0.42
                ax.annotate("", (xg, v), (xg, last), arrowprops=dict(arrowstyle="<->", color=color, linewidth=0.9))
                ax.text(xg - 0.06, math.sqrt(v * last) if v > 0 and last > 0 else (v + last) / 2,
                        f"×{v / last:.1f}" if last else "", ha="right", va="center", fontsize=7.5, color=color,
                        fontweight="bold")
        ax.set_xticks(xs, [wrap(str(m.get("label") or m.get("id")), 13, 3) for m in milestones], rotation=0,
                      fontsize=6.0)
        ax.set_xlabel("milestone (in the paper's order)")
        ax.set_ylabel(unit)
        ax.set_xlim(-0.6, len(xs) - 0.2)
        ax.set_title("the paper's milestones, 4×MI250 GCD TP4", fontsize=9)
        handles, labels = ax.get_legend_handles_labels()
        legend_below(ax, handles, labels, ncol=1, drop=52)
        if right is not None:
            _standing(right, standing, unit)
        fig.suptitle(title or "Milestones", fontsize=10)
        kinds = {REPORTED} | {spec.get("source", MODELLED) if isinstance(spec, Mapping) else MODELLED
                              for spec in (lines or {}).values()}
        kinds |= {MODELLED} if predicted or standing else set()
        kinds |= {r["source"] for r in standing or () if r.get("value") is not None}
        _caption(fig, where, kinds=sorted(kinds), reported="data/paper/ (the paper's MI250 GCD runs)")
    return fig


def _standing(ax, rows: Sequence[Mapping[str, Any]], unit: str) -> None:
    colors = {REPORTED: PALETTE[0], MEASURED: PALETTE[4], MODELLED: PALETTE[1]}
    xs = list(range(len(rows)))
    values = [float(r["value"]) for r in rows if r.get("value")] + [float(r["bound"]) for r in rows if r.get("bound")]
    lo, hi = (min(values), max(values)) if values else (1.0, 10.0)
    ax.set_yscale("log")
    ax.set_ylim(lo / 3, hi * 3)
    labelled: set[str] = set()
    for x, r in zip(xs, rows):
        source = r["source"]
        if r.get("value") is None:
            ax.text(x, math.sqrt(lo * hi), r.get("missing") or "not measured yet", ha="center", va="center",
                    rotation=90, fontsize=6.5, color="#6B4E00", gid="dsv4lab-missing",
                    bbox=dict(boxstyle="round,pad=0.3", facecolor="#FFF4D6", edgecolor="#C49A2F", linewidth=0.8))
            continue
        v = float(r["value"])
        ax.bar([x], [v], width=0.6, label=source_label(source) if source not in labelled else None,
               **bar_style(source, colors[source]))
        labelled.add(source)
        ttft = f"\nTTFT {float(r['ttft_s']):.2f} s" if r.get("ttft_s") else ""
        ax.text(x, v, fmt_value(v) + ttft, ha="center", va="bottom", fontsize=6.5)
        if r.get("bound"):
            b = float(r["bound"])
            ax.plot([x - 0.33, x + 0.33], [b, b], color=INK, linewidth=2.0,
                    label="modelled: roofline bound of the same setting" if "bound" not in labelled else None)
            labelled.add("bound")
            ax.text(x, b * 1.12, f"{100 * v / b:.1f}% of bound", ha="center", va="bottom", fontsize=6.3, color=INK)
    ax.set_xticks(xs, [wrap(str(r["label"]), 12, 4) for r in rows], fontsize=6.0)
    ax.set_xlabel("system")
    ax.set_ylabel(f"{unit} (log scale)")
    ax.set_title("where this project stands", fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    legend_below(ax, handles, labels, ncol=1, drop=58)


__all__ = ["plot_roofline", "plot_step_waterfall", "plot_bytes_composition", "plot_hardware_catalogue",
           "plot_decode_kernels", "plot_prefill_throughput", "plot_milestones"]
