"""The one plotting style: style file, palette, how each kind of number looks, the caption, saving.

Every figure of dsv4lab is drawn in the package style (``dsv4lab/faces/style/dsv4lab.mplstyle``) at a fixed size, and
says three things a reader needs before trusting it:

* **what** — its title (``fig.suptitle`` or the axes title);
* **whether each number is measured, modelled or reported by the paper** — the three never share a look
  (:data:`SOURCES`: measured filled circles and solid bars, modelled hollow diamonds and hatched bars, reported
  squares and plain bars) and the legend names them;
* **where** — the caption under the plot (:func:`caption`): the model, the hardware and commit of each measured
  set, the cost model's hardware entry, the paper's system, and the commit that drew the figure.

Data that is not there yet is said so inside the figure (:func:`missing`), never filled in.
:mod:`dsv4lab.faces.plots.lint` checks these rules on the matplotlib objects.

matplotlib is imported inside the functions: ``import dsv4lab.faces.plots`` stays light.
"""
from __future__ import annotations

import colorsys
import contextlib
import functools
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from dsv4lab.core.paths import STYLE_FILE as STYLE
from dsv4lab.core.provenance import short_commit

# Tableau 10: ten hues that stay distinct side by side (the style file's colour cycle).
PALETTE = ("#4E79A7", "#F28E2B", "#E15759", "#76B7B2", "#59A14F", "#EDC948", "#B07AA1", "#FF9DA7", "#9C755F",
           "#BAB0AC")
OTHER = "#9A9A9A"        # "the rest", summarised
INK = "#222222"          # reference lines, text
MAX_LEGEND_ENTRIES = 12  # more than this is a list, not a legend: split into panels or rank the top N
CAPTION_GID = "dsv4lab-caption"
MISSING_GID = "dsv4lab-missing"

MEASURED, MODELLED, REPORTED = "measured", "modelled", "reported"


@dataclass(frozen=True)
class SourceStyle:
    """How one kind of number is drawn, and its name in legends and captions."""

    label: str
    marker: str
    filled: bool
    hatch: str
    linestyle: str


SOURCES = {
    MEASURED: SourceStyle("measured", "o", True, "", "-"),
    MODELLED: SourceStyle("modelled", "D", False, "////", "--"),
    REPORTED: SourceStyle("reported by the paper", "s", True, "", ":"),
}


def source_label(source: str, what: str = "") -> str:
    """``"measured: what"``: legend text that names the kind of number first."""
    name = SOURCES[source].label
    return f"{name}: {what}" if what else name


def marker_style(source: str, color: str, size: float = 5.5) -> dict:
    """Keyword arguments for ``ax.plot`` drawing points of ``source`` in ``color`` (no connecting line)."""
    s = SOURCES[source]
    return dict(marker=s.marker, markersize=size, linestyle="none", color=color, markeredgecolor=color,
                markerfacecolor=color if s.filled else "none", markeredgewidth=1.2)


def bar_style(source: str, color: str) -> dict:
    """Keyword arguments for ``ax.bar``/``ax.barh``: reported plain, measured outlined in black, modelled with
    white stripes (still readable when stacked)."""
    if source == MODELLED:
        return dict(facecolor=color, edgecolor="white", hatch=SOURCES[MODELLED].hatch, linewidth=0.0)
    if source == MEASURED:
        return dict(facecolor=color, edgecolor=INK, linewidth=1.0)
    return dict(facecolor=color, edgecolor=color, linewidth=0.0)


def shades(color: str, n: int) -> list[str]:
    """``n`` shades of one hue, dark to light: the variants of one family."""
    import matplotlib.colors as mcolors
    r, g, b = mcolors.to_rgb(color)
    h, light, s = colorsys.rgb_to_hls(r, g, b)
    if n == 1:
        return [mcolors.to_hex((r, g, b))]
    lows, highs = max(0.18, light - 0.22), min(0.82, light + 0.25)
    return [mcolors.to_hex(colorsys.hls_to_rgb(h, lows + (highs - lows) * i / (n - 1), s)) for i in range(n)]


def palette(n: int) -> list[str]:
    """``n`` categorical colours; beyond the palette, colours repeat and callers must change the marker."""
    return [PALETTE[i % len(PALETTE)] for i in range(n)]


# ============================================================================================ figures
@contextlib.contextmanager
def use_style():
    """The package style as a context (rcParams are restored afterwards)."""
    import matplotlib.style
    with matplotlib.style.context(str(STYLE)):
        yield


def new_figure(size: tuple[float, float]):
    """A constrained-layout :class:`~matplotlib.figure.Figure` (no pyplot: nothing accumulates globally)."""
    from matplotlib.figure import Figure
    return Figure(figsize=size, layout="constrained")


@functools.lru_cache(maxsize=1)
def _drawing_commit() -> str:
    return short_commit() or "no git"


def caption(fig, model: str, *, measured: str | None = None, modelled: str | None = None,
            reported: str | None = None, note: str | None = None) -> None:
    """The line under a figure that says where its numbers come from.

    ``model`` names the model (and checkpoint or cut); ``measured`` / ``modelled`` / ``reported`` say where each
    kind of number in the figure comes from (hardware, commit, file); ``note`` adds what a reader must know.
    The commit that drew the figure closes the line. It is the figure's ``supxlabel``, so constrained layout
    keeps room for it under everything else (legends included)."""
    parts = [model]
    for source, where in ((MEASURED, measured), (MODELLED, modelled), (REPORTED, reported)):
        if where:
            parts.append(f"{SOURCES[source].label}: {where}")
    if note:
        parts.append(note)
    parts.append(f"drawn by dsv4lab {_drawing_commit()}")
    lines = textwrap.wrap(" · ".join(parts), width=int(fig.get_figwidth() * 19.5))
    fig.supxlabel("\n".join(lines), x=0.006, ha="left", va="bottom", multialignment="left", fontsize=6.3,
                  color="#555555", gid=CAPTION_GID, linespacing=1.25)


def missing(ax, text: str, *, y: float = 0.5) -> None:
    """Say inside the axes that a data set is not there (yet): a visible note, never a made-up number."""
    ax.text(0.5, y, text, transform=ax.transAxes, ha="center", va="center", fontsize=7, color="#6B4E00",
            wrap=True, gid=MISSING_GID, zorder=5,
            bbox=dict(boxstyle="round,pad=0.4", facecolor="#FFF4D6", edgecolor="#C49A2F", linewidth=0.8))


def save_figure(fig, path: str | Path, formats: Iterable[str] = ("png",)) -> list[Path]:
    """Save ``fig`` as ``path.<fmt>`` for each format with creation metadata stripped (byte-stable reruns), each
    file whole or not at all (written beside its place, then renamed onto it)."""
    out = []
    base = Path(path)
    base.parent.mkdir(parents=True, exist_ok=True)
    meta = {"png": {"Software": None}, "pdf": {"Creator": None, "Producer": None, "CreationDate": None},
            "svg": {"Date": None, "Creator": None}}
    with use_style():
        for fmt in formats:
            target = base.with_suffix(f".{fmt}")
            partial = target.with_name(f".{target.name}.partial")
            try:
                fig.savefig(partial, format=fmt, metadata=meta.get(fmt))
                partial.replace(target)
            finally:
                partial.unlink(missing_ok=True)
            out.append(target)
    return out


# ============================================================================================ labels
def short(label: str, width: int = 34) -> str:
    """``label`` cut to ``width`` characters with an ellipsis."""
    return label if len(label) <= width else label[: width - 1] + "…"


def wrap(label: str, width: int = 26, lines: int = 2) -> str:
    """``label`` on at most ``lines`` lines of ``width`` characters (the last one cut with an ellipsis)."""
    parts = textwrap.wrap(label, width=width) or [""]
    if len(parts) > lines:
        parts = parts[: lines - 1] + [short(" ".join(parts[lines - 1:]), width)]
    return "\n".join(parts)


def headline(label: str) -> str:
    """The short name of a long milestone label: the text before its first ``:`` / `` (`` / ``,``."""
    cut = len(label)
    for sep in (":", " (", ","):
        i = label.find(sep)
        if 0 < i < cut:
            cut = i
    return label[:cut].strip()


def fmt_value(v: float) -> str:
    """``1,336`` for large numbers, four significant digits otherwise."""
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "—"


def legend_below(ax, handles: Sequence, labels: Sequence[str], ncol: int = 3, drop: float = 30.0) -> None:
    """A legend under ``ax``'s x label (``drop`` points below the axes). An axes legend, not a figure one:
    constrained layout makes room for it, and the caption stays under everything."""
    from matplotlib.transforms import offset_copy
    ax.legend(handles, labels, loc="upper center", ncol=ncol, fontsize=7, frameon=False, borderaxespad=0.0,
              bbox_to_anchor=(0.5, 0.0), bbox_transform=offset_copy(ax.transAxes, fig=ax.figure, y=-drop,
                                                                   units="points"))


__all__ = ["PALETTE", "OTHER", "INK", "MAX_LEGEND_ENTRIES", "CAPTION_GID", "MISSING_GID", "MEASURED", "MODELLED",
           "REPORTED", "SOURCES", "SourceStyle", "STYLE", "source_label", "marker_style", "bar_style", "shades",
           "palette", "use_style", "new_figure", "caption", "missing", "save_figure", "short", "wrap", "headline",
           "fmt_value", "pct", "legend_below"]
