"""Report figures with matplotlib: stacked panels that share the step axis.

Why matplotlib: it is what the field reads and writes its training curves with, so the
figures look like the ones people already know (labelled axes, legible text, aligned panels).
It is imported lazily, inside ``build_figure``, so ``import reshard`` and the CLI never pay for
it; figures are drawn by the Agg canvas directly (no pyplot, no display, no global backend).

The panels share one x axis in whole steps (integer ticks), every panel carries the switch
marker, and colours come from one colour-blind-safe palette (Okabe-Ito) keyed by role, so
"baseline" or "repeated" has the same colour in every figure. ``line_chart`` returns a
description of exactly what it drew, so a test can check the curves in the PNG against the
ones a JSON report claims; ``build_figure`` returns the matplotlib Figure itself (tests read
labels, titles and ticks from it).
"""
from __future__ import annotations

import math
import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Okabe & Ito (2008), "Color Universal Design": distinguishable with every common colour-vision deficiency.
OKABE_ITO = {"black": "#000000", "orange": "#E69F00", "sky_blue": "#56B4E9", "bluish_green": "#009E73",
             "yellow": "#F0E442", "blue": "#0072B2", "vermillion": "#D55E00", "reddish_purple": "#CC79A7",
             "grey": "#777777"}
# One colour per role, used by every figure: the reference run is always blue, the run under
# test always orange (never red: red reads as "wrong"), the naive control reddish purple.
COLORS = {"baseline": OKABE_ITO["blue"], "before": OKABE_ITO["blue"],
          "resumed": OKABE_ITO["orange"], "after": OKABE_ITO["orange"],
          "control": OKABE_ITO["reddish_purple"], "trend": OKABE_ITO["grey"],
          "repeated": OKABE_ITO["vermillion"], "skipped": OKABE_ITO["sky_blue"],
          "switch": OKABE_ITO["black"]}
_CYCLE = [OKABE_ITO[n] for n in ("blue", "orange", "bluish_green", "reddish_purple", "sky_blue", "vermillion")]
DPI = 100
TITLE_PX, BARE_TOP_PX, CAPTION_LINE_PX = 26, 4, 13


@dataclass
class Series:
    """One curve. ``color``: a matplotlib colour or an (r, g, b) 0-255 tuple; None picks the
    role's colour from ``COLORS`` by label (so the same role looks the same everywhere)."""
    label: str
    xs: list[float]
    ys: list[float]
    color: Any = None
    style: str = "line"  # "line" | "points" | "line+points"


@dataclass
class Annotation:
    """A note pointing at (x, y) in a panel's data coordinates."""
    x: float
    y: float
    text: str
    color: str = OKABE_ITO["black"]


@dataclass
class Panel:
    title: str
    series: list[Series]
    vlines: list[tuple[float, str]] = field(default_factory=list)
    y_label: str = ""
    y_range: tuple[float, float] | None = None  # fixed (lo, hi) instead of the data range
    notes: list[str] = field(default_factory=list)  # boxed text in the panel's corner
    annotations: list[Annotation] = field(default_factory=list)
    integer_y: bool = False  # counts (sample ids): whole-number y ticks too


def color_of(s: Series, index: int) -> Any:
    """The colour ``s`` is drawn in: its own, else its role's, else the palette in order."""
    c = s.color
    if isinstance(c, tuple) and len(c) == 3 and any(v > 1 for v in c):
        return tuple(v / 255 for v in c)
    return c or COLORS.get(s.label, _CYCLE[index % len(_CYCLE)])


def max_abs_diff(a: Series, b: Series) -> tuple[float, int] | None:
    """max |a - b| over the steps both curves have (finite values only) and the step where it
    is; None when they share no step."""
    bx = {float(x): float(y) for x, y in zip(b.xs, b.ys) if math.isfinite(y)}
    pairs = [(abs(float(y) - bx[float(x)]), int(x)) for x, y in zip(a.xs, a.ys)
             if float(x) in bx and math.isfinite(y)]
    return max(pairs) if pairs else None


def overlap_note(a: Series, b: Series, quantity: str, *, frac: float = 0.01) -> str | None:
    """A note when curve ``a`` lies on ``b`` (every shared point within ``frac`` of the y span of
    both): on the figure one hides the other, so the reader is told, with the largest gap."""
    d = max_abs_diff(a, b)
    ys = [float(y) for y in list(a.ys) + list(b.ys) if math.isfinite(y)]
    if d is None or not ys:
        return None
    span = (max(ys) - min(ys)) or abs(ys[0]) or 1.0
    if d[0] > frac * span:
        return None
    return f"{a.label} overlaps {b.label}: max |\u0394{quantity}| = {d[0]:.2e} (step {d[1]})"


def figure_size_px(n_panels: int, *, width: int = 900, height_per_panel: int = 260, title: str = "",
                   caption_lines: int = 0) -> tuple[int, int]:
    """The PNG's pixel size: a title band, the panels, then a caption line by line."""
    top = TITLE_PX if title else BARE_TOP_PX
    return width, top + height_per_panel * n_panels + (CAPTION_LINE_PX * caption_lines + 8 if caption_lines else 0)


def wrap_caption(caption: list[str], width: int) -> list[str]:
    """The caption as the lines drawn (monospace 8 pt: about 6.7 px a character at 100 dpi)."""
    per_line = max(20, int((width - 16) / 7.0))
    rows: list[str] = []
    for text in caption:
        rows += textwrap.wrap(text, per_line, break_long_words=True, break_on_hyphens=False) or [""]
    return rows


def build_figure(panels: list[Panel], *, width: int = 900, height_per_panel: int = 260, title: str = "",
                 caption: list[str] | None = None, x_label: str = "step"):
    """The matplotlib Figure for ``panels`` (stacked, x shared, whole-step ticks, aligned y
    labels, vertical markers, notes, annotations, a legend per panel, ``title`` as suptitle
    and ``caption`` in monospace below). Raises a ReshardError naming the install line when
    matplotlib is missing."""
    try:
        from matplotlib.figure import Figure  # drawn by FigureCanvasAgg in save_figure: no pyplot, no display
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:  # a plain dependency: only a broken install gets here
        from reshard.errors import ReshardError
        raise ReshardError(f"the figures need matplotlib, which is not importable ({exc})",
                           hint="install it with `pip install 'matplotlib>=3.8'` (it is a dependency of reshard)") from exc

    rows = wrap_caption(caption or [], width)
    w_px, h_px = figure_size_px(len(panels), width=width, height_per_panel=height_per_panel, title=title,
                                caption_lines=len(rows))
    fig = Figure(figsize=(w_px / DPI, h_px / DPI), dpi=DPI)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    top_px = TITLE_PX if title else BARE_TOP_PX
    bottom_px = h_px - top_px - height_per_panel * len(panels)
    fig.subplots_adjust(left=0.09, right=0.80, top=1 - (top_px + 18) / h_px,
                        bottom=(bottom_px + 40) / h_px, hspace=0.42)
    if title:
        fig.suptitle(title, fontsize=11, fontweight="bold", y=1 - 4 / h_px, va="top")
    for ax, panel in zip(axes, panels):
        _draw_panel(ax, panel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if panel.integer_y:
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1].set_xlabel(x_label)
    for ax in axes[:-1]:
        ax.tick_params(labelbottom=True)  # every panel readable on its own
    fig.align_ylabels(list(axes))
    if rows:
        fig.text(8 / w_px, (bottom_px - 4) / h_px, "\n".join(rows), family="monospace", fontsize=8,
                 va="top", ha="left", linespacing=1.05)
    return fig


def _draw_panel(ax, panel: Panel) -> None:
    ax.set_title(panel.title, loc="left", fontsize=9)
    ax.set_ylabel(panel.y_label or panel.title, fontsize=8)
    ax.grid(True, color="#dddddd", linewidth=0.6)
    ax.tick_params(labelsize=8)
    for i, s in enumerate(panel.series):
        xs = [float(x) for x in s.xs]
        ys = [float(y) if math.isfinite(y) else float("nan") for y in s.ys]
        c = color_of(s, i)
        if s.style == "points":
            ax.plot(xs, ys, linestyle="none", marker="o", markersize=3.5, color=c, label=s.label)
        elif s.style == "line+points":
            ax.plot(xs, ys, linestyle="--", linewidth=1.2, marker="o", markersize=3.5, markerfacecolor="none",
                    color=c, label=s.label)
        else:
            ax.plot(xs, ys, linewidth=1.6, color=c, label=s.label, marker="." if len(xs) == 1 else None)
    for x, label in panel.vlines:
        ax.axvline(float(x), color=COLORS["switch"], linestyle=":", linewidth=1.2, label=label)
    if panel.y_range:
        ax.set_ylim(*panel.y_range)
    if panel.series or panel.vlines:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7.5, frameon=False, borderaxespad=0)
    if panel.notes:
        ax.text(0.99, 0.96, "\n".join(panel.notes), transform=ax.transAxes, ha="right", va="top", fontsize=7.5,
                bbox={"boxstyle": "round,pad=0.3", "facecolor": "white", "edgecolor": "#bbbbbb", "alpha": 0.9})
    for a in panel.annotations:
        ax.annotate(a.text, xy=(a.x, a.y), xytext=(0.42, 0.42), textcoords="axes fraction", fontsize=7.5,
                    color=a.color, ha="left", va="top", bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85},
                    arrowprops={"arrowstyle": "->", "color": a.color, "linewidth": 0.8})


def save_figure(fig, path: str | Path) -> tuple[int, int]:
    """Write ``fig`` as an 8-bit RGB PNG at exactly its pixel size, atomically (a temporary file
    beside ``path``, then a rename: a reader never sees half a PNG). Returns (width, height)."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    path = Path(path)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    rgb = np.asarray(canvas.buffer_rgba())[:, :, :3]
    tmp = path.with_name(f".{path.name}.tmp")
    Image.fromarray(np.ascontiguousarray(rgb), "RGB").save(tmp, format="PNG", optimize=True)
    os.replace(tmp, path)
    return int(rgb.shape[1]), int(rgb.shape[0])


def describe(panels: list[Panel], size: tuple[int, int], *, title: str = "", caption: list[str] | None = None) -> dict:
    """What the figure draws: ``{"width", "height", "title", "panels": [{"title", "series":
    [{"label", "xs", "ys"}], "vlines", "notes", "annotations"}], "caption"}`` (non-finite y
    values are not drawn and are described as None)."""
    out: dict[str, Any] = {"width": size[0], "height": size[1], "title": title, "panels": [
        {"title": p.title,
         "series": [{"label": s.label, "xs": [float(x) for x in s.xs],
                     "ys": [float(y) if math.isfinite(y) else None for y in s.ys]} for s in p.series],
         "vlines": [[float(x), lbl] for x, lbl in p.vlines],
         "notes": list(p.notes), "annotations": [a.text for a in p.annotations]} for p in panels]}
    if caption:
        out["caption"] = list(caption)
    return out


def line_chart(path: str | Path, panels: list[Panel], *, width: int = 900, height_per_panel: int = 260,
               title: str = "", caption: list[str] | None = None) -> dict:
    """Draw ``panels`` (see ``build_figure``), save the PNG at ``path`` atomically, and return
    ``describe`` of what was drawn."""
    rows = wrap_caption(caption or [], width)  # wrapping is idempotent: build_figure draws these rows
    fig = build_figure(panels, width=width, height_per_panel=height_per_panel, title=title, caption=rows)
    size = save_figure(fig, path)
    return describe(panels, size, title=title, caption=rows)


def read_png(path: str | Path):
    """Decode a PNG into an (h, w, 3) uint8 array (for tests that look at pixels)."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB")).copy()


__all__ = ["Panel", "Series", "Annotation", "COLORS", "OKABE_ITO", "build_figure", "save_figure", "line_chart",
           "describe", "overlap_note", "max_abs_diff", "read_png", "figure_size_px"]
