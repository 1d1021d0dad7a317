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
# One line style per role, like one colour per role. The naive control is dash-dotted with
# small filled squares and drawn above the other two: where it runs close to them (at the
# switch) its squares still show inside the resumed run's hollow circles, which in turn sit
# on the baseline's line (z-order: baseline < resumed < control).
ROLE_STYLE: dict[str, dict[str, Any]] = {
    "baseline": {"zorder": 2.0}, "before": {"zorder": 2.0},
    "resumed": {"zorder": 2.3}, "after": {"zorder": 2.3},
    "control": {"linestyle": "-.", "linewidth": 1.3, "marker": "s", "markersize": 2.6, "zorder": 2.6},
}
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


def max_rel_diff(a: Series, b: Series) -> tuple[float, int] | None:
    """max |a - b| / |b| over the steps both curves have (finite values only; b = 0 with a != 0
    counts as inf, as the rehearsal's judge counts it) and the step where it is; None when they
    share no step."""
    def rel(y: float, ref: float) -> float:
        return 0.0 if y == ref else abs(y - ref) / abs(ref) if ref else math.inf

    bx = {float(x): float(y) for x, y in zip(b.xs, b.ys) if math.isfinite(y)}
    pairs = [(rel(float(y), bx[float(x)]), int(x)) for x, y in zip(a.xs, a.ys)
             if float(x) in bx and math.isfinite(y)]
    return max(pairs) if pairs else None


def overlaps(a: Series, b: Series, *, frac: float = 0.01) -> bool:
    """Whether curve ``a`` lies on ``b`` as drawn: they share a step and every shared point is
    within ``frac`` of the y span of both, so on the figure one hides the other."""
    d = max_abs_diff(a, b)
    ys = [float(y) for y in list(a.ys) + list(b.ys) if math.isfinite(y)]
    if d is None or not ys:
        return False
    span = (max(ys) - min(ys)) or abs(ys[0]) or 1.0
    return d[0] <= frac * span


def overlap_note(a: Series, b: Series, quantity: str, *, frac: float = 0.01) -> str | None:
    """A note when curve ``a`` lies on ``b`` (see ``overlaps``): the reader is told, with the
    largest absolute gap. (The rehearsal figure words its own note in its verdict's metric.)"""
    if not overlaps(a, b, frac=frac):
        return None
    d = max_abs_diff(a, b)
    assert d is not None  # overlaps() needs a shared step
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
    for ax, panel in zip(axes, panels):
        _place_annotations(fig, ax, panel)
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
            continue
        if s.style == "line+points":
            kw: dict[str, Any] = {"linestyle": "--", "linewidth": 1.2, "marker": "o", "markersize": 3.5,
                                  "markerfacecolor": "none"}
        else:
            kw = {"linewidth": 1.6, "marker": "." if len(xs) == 1 else None}
        ax.plot(xs, ys, color=c, label=s.label, **{**kw, **ROLE_STYLE.get(s.label, {})})
    for x, label in panel.vlines:
        ax.axvline(float(x), color=COLORS["switch"], linestyle=":", linewidth=1.2, label=label)
    if panel.y_range:
        ax.set_ylim(*panel.y_range)
    if panel.series or panel.vlines:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7.5, frameon=False, borderaxespad=0)
    if panel.notes:
        ax.text(0.99, 0.96, "\n".join(panel.notes), transform=ax.transAxes, ha="right", va="top", fontsize=7.5,
                bbox={"boxstyle": "round,pad=0.3", "facecolor": "white", "edgecolor": "#bbbbbb", "alpha": 0.9})


def _box_of(text, renderer):
    """The pixel extent a reader sees of ``text``: its drawn box (the white patch) when it has one."""
    if hasattr(text, "update_positions"):  # an Annotation: its text's transform is set at draw time
        text.update_positions(renderer)
    patch = text.get_bbox_patch()
    if patch is None:
        return text.get_window_extent(renderer)
    text.update_bbox_position_size(renderer)
    return patch.get_window_extent(renderer)


# Where an annotation's text may go, as the top-left corner of its box in axes fractions.
ANNOTATION_SPOTS = [(0.03 + 0.0625 * i, 0.95 - 0.075 * j) for j in range(11) for i in range(11)]


def _place_annotations(fig, ax, panel: Panel) -> None:
    """Draw ``panel``'s annotations, each text where it covers no curve, marker, switch line or
    note: a note laid over the curves would hide the very thing it points at. Of the spots in
    ``ANNOTATION_SPOTS`` whose box stays inside the axes and off the note, the one covering the
    fewest curve points wins, then the one whose arrow cuts the fewest, then the nearest (the
    shortest arrow). Needs the axes' final limits, so ``build_figure`` calls it once every
    panel is drawn."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if not panel.annotations:
        return
    renderer = (fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)).get_renderer()
    ax.get_xlim(), ax.get_ylim()  # autoscale now: the data transform below must map to the final limits
    pts = []
    for ln in ax.get_lines():  # every drawn curve, sampled densely along its segments, in pixels
        xy = ln.get_transform().transform(np.asarray(ln.get_xydata(), dtype=float))
        xy = xy[np.isfinite(xy).all(axis=1)]
        if len(xy) == 1:
            pts.append(xy)
        for p0, p1 in zip(xy[:-1], xy[1:]):
            pts.append(p0 + np.linspace(0.0, 1.0, 24)[:, None] * (p1 - p0))
    curve = np.concatenate(pts) if pts else np.zeros((0, 2))
    taken = [_box_of(t, renderer).padded(4) for t in ax.texts]  # the notes box
    frame = ax.get_window_extent(renderer)
    for a in panel.annotations:
        ann = ax.annotate(a.text, xy=(a.x, a.y), xytext=(0.42, 0.42), textcoords="axes fraction", fontsize=7.5,
                          color=a.color, ha="left", va="top", zorder=5,
                          bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85},
                          arrowprops={"arrowstyle": "->", "color": a.color, "linewidth": 0.8, "shrinkB": 3})
        target = ax.transData.transform((a.x, a.y))
        best: tuple | None = None
        for spot in ANNOTATION_SPOTS:
            ann.xyann = spot
            ext = _box_of(ann, renderer).padded(2)
            inside = frame.x0 <= ext.x0 and ext.x1 <= frame.x1 and frame.y0 <= ext.y0 and ext.y1 <= frame.y1
            covered = int(((curve[:, 0] >= ext.x0) & (curve[:, 0] <= ext.x1)
                           & (curve[:, 1] >= ext.y0) & (curve[:, 1] <= ext.y1)).sum())
            clash = any(ext.overlaps(t) for t in taken)
            # the arrow, from the box's nearest corner to the point, should not cut through the
            # curves either (the last 8 px are where it meets the curve it points at)
            start = np.array([min(max(target[0], ext.x0), ext.x1), min(max(target[1], ext.y0), ext.y1)])
            seg = target - start
            length = float(np.hypot(*seg))
            if length > 8 and len(curve):
                t = np.clip(((curve - start) @ seg) / length**2, 0.0, 1.0 - 8 / length)
                crossed = int((np.hypot(*(curve - (start + t[:, None] * seg)).T) < 2.0).sum())
            else:
                crossed = 0
            key = (not inside, clash, covered, crossed, length)
            if best is None or key < best[0]:
                best = (key, spot, ext)
        assert best is not None
        ann.xyann = best[1]
        taken.append(best[2])


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


__all__ = ["Panel", "Series", "Annotation", "COLORS", "OKABE_ITO", "ROLE_STYLE", "build_figure", "save_figure",
           "line_chart", "describe", "overlaps", "overlap_note", "max_abs_diff", "max_rel_diff", "read_png",
           "figure_size_px"]
