"""Checks a figure must pass before a reader sees it, made on the matplotlib objects (not on pixels).

:func:`figure_problems` returns one line per problem (empty: the figure passes):

* a title (the figure's ``suptitle`` or an axes title);
* every visible axis that shows tick labels has a label (colour bars included);
* the caption of :func:`dsv4lab.faces.plots.style.caption` (where the numbers come from, measured / modelled /
  reported);
* every legend has at most :data:`~dsv4lab.faces.plots.style.MAX_LEGEND_ENTRIES` entries, and no two of its entries
  look the same (same colour and the same marker, fill, hatch or line style).

:class:`dsv4lab.faces.runs.NotebookOutputs` runs it on every figure a notebook saves; ``tests/test_figures.py`` on
every figure function.
"""
from __future__ import annotations

from dsv4lab.faces.plots.style import CAPTION_GID, MAX_LEGEND_ENTRIES, SOURCES


def _draw(fig) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    if fig.canvas is None or not hasattr(fig.canvas, "get_renderer"):
        FigureCanvasAgg(fig)
    fig.canvas.draw()


def _has_ticklabels(axis) -> bool:
    return any(t.get_visible() and t.get_text().strip() for t in axis.get_ticklabels())


def _hex(c) -> str:
    """A colour (name, hex, RGBA or an array of RGBA rows: the first) as ``#rrggbbaa``; ``none`` if invisible."""
    import matplotlib.colors as mcolors
    import numpy as np
    if isinstance(c, str):
        return "none" if c.lower() == "none" else mcolors.to_hex(c, keep_alpha=True)
    arr = np.asarray(c, dtype=float)
    if arr.ndim == 2:
        if not len(arr):
            return "none"
        arr = arr[0]
    rgba = mcolors.to_rgba(tuple(arr))
    return mcolors.to_hex(rgba, keep_alpha=True) if rgba[3] > 0 else "none"


def style_key(handle) -> tuple:
    """What a legend entry looks like: colour(s) and marker / fill / hatch / line style."""
    from matplotlib.collections import Collection, LineCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    if isinstance(handle, Line2D):
        marker = handle.get_marker()
        if marker in (None, "None", "none", "", " "):
            return ("line", _hex(handle.get_color()), str(handle.get_linestyle()))
        return ("marker", _hex(handle.get_markeredgecolor()), str(marker), _hex(handle.get_markerfacecolor()))
    if isinstance(handle, Patch):
        return ("patch", _hex(handle.get_facecolor()), _hex(handle.get_edgecolor()), handle.get_hatch() or "")
    if isinstance(handle, LineCollection):
        return ("lines", _hex(handle.get_colors()), str(handle.get_linestyle()))
    if isinstance(handle, Collection):
        paths = handle.get_paths()
        shape = paths[0].vertices.round(3).tobytes() if paths else b""
        return ("collection", _hex(handle.get_facecolor()), _hex(handle.get_edgecolor()), hash(shape))
    return ("other", type(handle).__name__, id(handle))


def _legends(fig) -> list:
    found = list(fig.legends)
    for ax in fig.axes:
        leg = ax.get_legend()
        if leg is not None:
            found.append(leg)
    return found


def figure_problems(fig, max_legend_entries: int = MAX_LEGEND_ENTRIES) -> list[str]:
    """The rules of :mod:`dsv4lab.faces.plots.lint` this figure breaks, one line each."""
    _draw(fig)
    problems: list[str] = []
    suptitle = fig._suptitle.get_text().strip() if getattr(fig, "_suptitle", None) is not None else ""
    if not suptitle and not any(ax.get_title().strip() for ax in fig.axes):
        problems.append("no title (set fig.suptitle or an axes title)")
    for i, ax in enumerate(fig.axes):
        if not ax.get_visible() or not ax.axison:
            continue
        name = f"axes {i} ({ax.get_title()!r})" if ax.get_title() else f"axes {i}"
        if getattr(ax, "_colorbar", None) is not None:
            if not (ax.get_ylabel().strip() or ax.get_xlabel().strip()):
                problems.append(f"{name}: colour bar without a label")
            continue
        if ax.xaxis.get_visible() and _has_ticklabels(ax.xaxis) and not ax.get_xlabel().strip():
            problems.append(f"{name}: x axis has no label")
        if ax.yaxis.get_visible() and _has_ticklabels(ax.yaxis) and not ax.get_ylabel().strip():
            problems.append(f"{name}: y axis has no label")
    captions = [t for t in fig.texts if t.get_gid() == CAPTION_GID]
    if not captions:
        problems.append("no caption saying where the numbers come from (dsv4lab.faces.plots.style.caption)")
    elif not any(s.label in captions[0].get_text() for s in SOURCES.values()):
        problems.append("the caption names no kind of number (measured / modelled / reported by the paper)")
    for leg in _legends(fig):
        texts = [t.get_text() for t in leg.get_texts()]
        where = f"legend {texts[:2]}…" if len(texts) > 2 else f"legend {texts}"
        if len(texts) > max_legend_entries:
            problems.append(f"{where}: {len(texts)} entries (at most {max_legend_entries}: split into panels or "
                            "rank the top N)")
        seen: dict[tuple, str] = {}
        for handle, text in zip(leg.legend_handles, texts):
            if handle is None:
                continue
            key = style_key(handle)
            if key in seen:
                problems.append(f"{where}: {seen[key]!r} and {text!r} look the same (colour and marker)")
            seen.setdefault(key, text)
    return problems


__all__ = ["figure_problems", "style_key"]
