"""Correctness figures: the W2 permutation made visible, per-stage cosines, the kernel tier against its bounds,
teacher-forced divergence per position, and the layer tier.

Every number here is computed on this machine (``measured`` in the caption's words): ``where`` names the
checkpoint, the backend and anything else a reader needs (see :func:`dsv4lab.faces.plots.style.caption`).
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from dsv4lab.faces.plots.style import (INK, MEASURED, OTHER, PALETTE, caption, legend_below, marker_style, new_figure, short,
                    source_label, use_style)

HEATMAP_SIZE = (7.6, 3.9)
STAGES_SIZE = (7.0, 3.8)
DIVERGENCE_SIZE = (7.6, 4.0)
LAYER_MAP_SIZE = (7.6, 4.3)
STAGE_LABELS = {"stage1_w1": "stage 1 (w1 gate)", "stage1_w3": "stage 1 (w3 up)", "stage2_w2": "stage 2 (w2 down)"}


def _caption(fig, where: Mapping[str, Any] | None, default_model: str = "the checkpoint") -> None:
    w = {k: v for k, v in (where or {}).items() if v is not None}
    w.setdefault("measured", "computed on this machine (reference backend)")
    caption(fig, w.pop("model", default_model), **w)


# ============================================================================================ W2 drill (01)
def plot_channel_similarity(panels: Mapping[str, Any], *, block: int = 16, title: str | None = None,
                            where: Mapping[str, Any] | None = None):
    """Heatmaps of output-channel cosine similarity, one panel per entry of ``panels`` (label → ``[t, t]``
    matrix from :func:`dsv4lab.tools.drill.channel_similarity`: suspect channels as rows, trusted ones as
    columns). Grid lines every ``block`` channels make a block permutation readable at a glance."""
    import numpy as np
    with use_style():
        fig = new_figure(HEATMAP_SIZE)
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
            fig.colorbar(im, ax=list(axes), shrink=0.85, label="cosine on random probes")
        fig.suptitle(title or "Output-channel cosine, suspect vs trusted", fontsize=10)
        _caption(fig, where)
    return fig


def plot_stage_cosines(runs: Mapping[str, Sequence[Mapping[str, Any]]], *, highlight_layer: int | None = None,
                       title: str | None = None, where: Mapping[str, Any] | None = None):
    """Per layer, the cosine of each routed-expert stage against the trusted run, one panel per entry of
    ``runs`` (label → rows of :func:`dsv4lab.tools.drill.isolated_moe_stages`)."""
    with use_style():
        fig = new_figure(STAGES_SIZE)
        axes = fig.subplots(1, len(runs), squeeze=False, sharey=True)[0]
        for ax, (label, rows) in zip(axes, runs.items()):
            layers = [int(r["layer"]) for r in rows]
            for si, (stage, name) in enumerate(STAGE_LABELS.items()):
                ys = [float(r[f"{stage}_cosine"]) for r in rows]
                ax.bar([x + (si - 1) * 0.22 for x in layers], ys, width=0.2, color=PALETTE[si], label=name)
            if highlight_layer is not None and highlight_layer in layers:
                ax.axvspan(highlight_layer - 0.45, highlight_layer + 0.45, color="#FFE9A8", zorder=0)
            ax.axhline(1.0, color=INK, linewidth=0.6, linestyle=":")
            ax.set_xticks(layers)
            ax.set_xlabel("layer")
            ax.set_title(label, fontsize=9)
            ax.set_ylim(min(0.0, min((float(r[f"{s}_cosine"]) for r in rows for s in STAGE_LABELS), default=0)),
                        1.3)  # room above the bars for the legend
            ax.set_yticks([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
        axes[0].set_ylabel("cosine vs the trusted stage output")
        axes[-1].legend(loc="upper center", ncol=len(STAGE_LABELS), fontsize=6.8, frameon=False)
        fig.suptitle(title or "Routed-expert stages fed the trusted run's inputs", fontsize=10)
        _caption(fig, where)
    return fig


# ============================================================================================ kernel tier (02)
KERNEL_CHECK_FIELDS = ("op", "impl", "ok", "bitwise_equal", "bound_ratio")
"""The fields of a kernel-check row (:func:`dsv4lab.tools.verify.kernels.run_kernel_checks`) the kernel-tier figure
reads; ``tests/test_figures.py`` checks the verifier still writes every one."""


def check_ratio(row: Mapping[str, Any]) -> tuple[float, str]:
    """A kernel check's error as a multiple of what it is allowed (≤ 1 passes) and what it is measured against.

    A bitwise-equal check is 0. Otherwise the row's ``bound_ratio`` — the analytic bound's worst
    ``|out − ref| / bound`` over the elements (:mod:`dsv4lab.tools.verify.op_bounds`), what the verifier writes — is
    used as is (``max_ratio``, its older name, too). Rows of an older tolerance comparison (``tol``,
    :mod:`dsv4lab.tools.verify.compare`) give the worst element's error over ``atol + rtol·|ref|``, or the cosine
    shortfall over the allowed one when that is larger. A check that crashed or has no bound is ``inf``. A passing
    row that says none of this cannot be placed, and is refused rather than drawn as bitwise equal."""
    if row.get("bitwise_equal"):
        return 0.0, "bound"
    for key in ("bound_ratio", "max_ratio"):
        if row.get(key) is not None:
            return float(row[key]), "bound"
    tol = row.get("tol") or {}
    if not tol:
        if not row.get("ok"):
            return math.inf, "bound"
        raise ValueError(f"kernel check {row.get('op')}[{row.get('impl')}] passed but carries neither bitwise_equal "
                         f"nor bound_ratio (fields: {', '.join(sorted(row))}): the figure cannot place it")
    worst = row.get("worst") or {}
    ratio = 0.0
    if worst:
        limit = float(tol.get("atol", 0.0)) + float(tol.get("rtol", 0.0)) * abs(float(worst["ref"]))
        diff = abs(float(worst["out"]) - float(worst["ref"]))
        ratio = diff / limit if limit > 0 else (0.0 if diff == 0 else math.inf)
    cos, min_cos = row.get("cosine"), float(tol.get("min_cosine", 1.0))
    if cos is not None and min_cos < 1.0:
        ratio = max(ratio, max(0.0, 1.0 - float(cos)) / (1.0 - min_cos))
    if row.get("nan_mismatch"):
        ratio = math.inf
    return ratio, "tolerance"


def _family(impl: str) -> str:
    if impl == "reference":
        return "reference against itself"
    return f"{impl.split(':')[0]} variants" if ":" in impl else f"{impl} (the backend's own)"


def plot_kernel_check_errors(rows: Sequence[Mapping[str, Any]], *, floor: float = 1e-4, title: str | None = None,
                             where: Mapping[str, Any] | None = None):
    """The kernel tier: each op's worst check per implementation, as its error ÷ what it is allowed
    (:func:`check_ratio`), against the line at 1 — left of it passes, right of it fails. Bitwise-equal checks sit
    in their own column; implementations are grouped by family (colour), failures are named."""
    worst: dict[tuple[str, str], tuple[float, bool]] = {}
    bitwise: dict[tuple[str, str], bool] = {}  # every check of the pair bitwise equal: the left column
    basis = "bound"
    for r in rows:
        ratio, how = check_ratio(r)
        basis = how if how == "tolerance" else basis
        key = (str(r["op"]), str(r["impl"]))
        prev = worst.get(key, (0.0, True))
        worst[key] = (max(prev[0], ratio), prev[1] and bool(r.get("ok")))
        bitwise[key] = bitwise.get(key, True) and bool(r.get("bitwise_equal"))
    ops = list(dict.fromkeys(k[0] for k in worst))
    families = list(dict.fromkeys(_family(k[1]) for k in worst))
    family_color = {f: (OTHER if f.startswith("reference") else PALETTE[(i - 1) % len(PALETTE)])
                    for i, f in enumerate(families)}
    offsets = {f: (i - (len(families) - 1) / 2) * 0.22 for i, f in enumerate(families)}
    x_exact, x_max = floor / 4, 1e3
    with use_style():
        fig = new_figure((7.8, 2.2 + 0.2 * len(ops)))
        ax = fig.add_subplot()
        ys = {op: len(ops) - 1 - i for i, op in enumerate(ops)}
        ax.axvspan(1.0, x_max, color="#FBE3E3", zorder=0)
        ax.axvspan(x_exact / 2, x_exact * 2, color="#EEF3EA", zorder=0)
        ax.axvline(1.0, color="#B22222", linewidth=1.1, label="allowed (ratio 1: left passes, right fails)")
        for fam in families:
            pts = [(x_exact if bitwise[op, impl] else min(max(ratio, floor), x_max / 1.5), ys[op] + offsets[fam], ok,
                    impl) for (op, impl), (ratio, ok) in worst.items() if _family(impl) == fam]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=source_label(MEASURED, fam),
                    **marker_style(MEASURED, family_color[fam], 4.5), alpha=0.9)
            for x, y, ok, impl in pts:
                if not ok:
                    ax.plot([x], [y], marker="x", markersize=8, markeredgewidth=1.8, color="#B22222",
                            linestyle="none")
                    ax.annotate(short(impl, 24), (x, y), textcoords="offset points", xytext=(6, -3), fontsize=6,
                                color="#B22222")
        if any(not ok for _, ok in worst.values()):
            ax.plot([], [], marker="x", markersize=8, markeredgewidth=1.8, color="#B22222", linestyle="none",
                    label="failed check")
        ax.set_xscale("log")
        ax.set_xlim(x_exact / 2, x_max)
        ticks = [x_exact] + [10.0 ** e for e in range(int(math.log10(floor)), 4)]
        ax.set_xticks(ticks, ["bitwise\nequal"] + [f"≤{floor:g}" if t == floor else f"{t:g}" for t in ticks[1:]],
                      fontsize=7)
        ax.minorticks_off()
        ax.set_yticks(list(ys.values()), list(ys), fontsize=7)
        ax.set_ylim(-0.7, len(ops) - 0.3)
        ax.grid(axis="y", visible=False)
        ax.set_ylabel("registered op")
        ax.set_xlabel("worst error ÷ analytic bound" if basis == "bound" else
                      "worst error ÷ tolerance (atol + rtol·|ref|, or the cosine shortfall; log scale)")
        handles, labels = ax.get_legend_handles_labels()
        legend_below(ax, handles, labels, ncol=2, drop=34)
        n_bad = sum(not ok for _, ok in worst.values())
        fig.suptitle(title or f"Kernel tier: every op's worst check against what it is allowed "
                              f"({len(worst)} op × implementation pairs, {n_bad} failed)", fontsize=10)
        note = ("each check's worst element against its op's analytic error bound (dsv4lab.tools.verify.op_bounds)"
                if basis == "bound" else "some checks are older tolerance comparisons (atol + rtol·|ref|, "
                "dsv4lab.tools.verify.compare), not analytic bounds")
        w = dict(where or {})
        if note:
            w["note"] = "; ".join(x for x in (w.get("note"), note) if x)
        _caption(fig, w)
    return fig


# ============================================================================================ divergence (02)
def plot_divergence_vs_position(series: Mapping[str, Sequence[float]], boundaries: Mapping[str, int], *,
                                bound: float | None = None, floor: float = 1e-12, ylabel: str = "KL per position (nats)",
                                title: str | None = None, where: Mapping[str, Any] | None = None):
    """Teacher-forced divergence per position (label → values), with the cache boundaries (name → absolute
    position) as vertical lines. Values below ``floor`` (exact agreement) sit on the floor of the log axis."""
    with use_style():
        fig = new_figure(DIVERGENCE_SIZE)
        ax = fig.add_subplot()
        n = 0
        for i, (label, vals) in enumerate(series.items()):
            ys = [max(float(v), floor) if v == v else float("nan") for v in vals]
            n = max(n, len(ys))
            ax.semilogy(range(len(ys)), ys, color=PALETTE[i % len(PALETTE)], label=label, linewidth=1.1)
        at: dict[int, list[str]] = {}
        for name, pos in boundaries.items():
            at.setdefault(int(pos), []).append(name)
        for pos, names in sorted(at.items()):
            if pos < n:
                ax.axvline(pos, color="#999999", linewidth=0.7, linestyle="--")
                ax.text(pos, 1.0, " " + ", ".join(names), transform=ax.get_xaxis_transform(), rotation=90,
                        va="top", ha="right", fontsize=6.5, color="#555555")
        if bound is not None:
            ax.axhline(max(bound, floor), color=INK, linewidth=0.7, linestyle=":", label=f"bound {bound:g}")
        ax.set_xlabel("position (teacher-forced token index)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(floor / 3, None)
        ax.set_title(title or "Teacher-forced divergence vs position")
        ax.legend(loc="center right", fontsize=7, frameon=True)
        _caption(fig, where)
    return fig


def plot_layer_divergence(rows: Sequence[Mapping[str, Any]], *, floor: float = 1e-9, title: str | None = None,
                          where: Mapping[str, Any] | None = None):
    """Which layer and stage diverge first: a layers × stages map of the relative error against the golden
    digests (rows of :func:`dsv4lab.tools.verify.layers.first_divergence`, ``StageDiff.to_dict()``; top-k stages show
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
        fig = new_figure(LAYER_MAP_SIZE)
        ax = fig.add_subplot()
        im = ax.imshow(grid, aspect="auto", cmap="magma_r", vmin=math.log10(floor), vmax=0.5,
                       interpolation="nearest")
        ax.set_xticks(range(len(blocks)), [b.replace("layers.", "layer ") for b in blocks], fontsize=7)
        ax.set_yticks(range(len(stages)), [short(s, 40) for s in stages], fontsize=6.5)
        ax.set_xlabel("block")
        ax.set_ylabel("stage (forward order)")
        ax.grid(False)
        if first is not None:
            ax.plot(first[0], first[1], marker="o", markersize=11, markerfacecolor="none", markeredgecolor="#2A8C82",
                    markeredgewidth=2, linestyle="none")
        fig.colorbar(im, ax=ax, label="log10 relative error (1 − Jaccard for top-k)")
        ax.set_title((title or "Layer tier: per-stage error against the golden digests")
                     + ("\n(circled: the first stage that diverges; blank: stage absent in that layer)"
                        if first is not None else ""), fontsize=9)
        _caption(fig, where)
    return fig


__all__ = ["STAGE_LABELS", "KERNEL_CHECK_FIELDS", "plot_channel_similarity", "plot_stage_cosines", "check_ratio",
           "plot_kernel_check_errors", "plot_divergence_vs_position", "plot_layer_divergence"]
