"""A dependency-free PNG line chart (numpy + zlib + struct): stacked panels sharing a look.

Enough for a report figure: axes, a few "nice" ticks with numeric labels, a legend, vertical
marker lines (e.g. the step of a topology switch), series drawn as lines or points. Text
uses a built-in 5x7 bitmap font (digits, letters -- lowercase drawn as capitals -- and
`` .-_:=+/()%?<>``). ``line_chart`` returns a description of exactly what it drew, so a test
can check that the curves in the PNG are the ones a JSON report claims.
"""
from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# 5x7 glyphs: 7 rows of 5 bits (MSB = leftmost pixel), 2 hex digits per row
_FONT_SRC = {
    "0": "0E11131519110E", "1": "040C040404040E", "2": "0E11010204081F", "3": "1F02040201110E",
    "4": "02060A121F0202", "5": "1F101E0101110E", "6": "0608101E11110E", "7": "1F010204080808",
    "8": "0E11110E11110E", "9": "0E11110F01020C", "A": "0E11111F111111", "B": "1E11111E11111E",
    "C": "0E11101010110E", "D": "1C12111111121C", "E": "1F10101E10101F", "F": "1F10101E101010",
    "G": "0E11101711110F", "H": "1111111F111111", "I": "0E04040404040E", "J": "0702020202120C",
    "K": "11121418141211", "L": "1010101010101F", "M": "111B1515111111", "N": "11111915131111",
    "O": "0E11111111110E", "P": "1E11111E101010", "Q": "0E11111115120D", "R": "1E11111E141211",
    "S": "0F10100E01011E", "T": "1F040404040404", "U": "1111111111110E", "V": "11111111110A04",
    "W": "1111111515150A", "X": "11110A040A1111", "Y": "1111110A040404", "Z": "1F01020408101F",
    " ": "00000000000000", ".": "00000000000C0C", "-": "0000001F000000", "_": "0000000000001F",
    ":": "000C0C000C0C00", "=": "00001F001F0000", "+": "0004041F040400", "/": "00010204081000",
    "(": "02040808080402", ")": "08040202020408", "%": "18190204081303", "?": "0E110102040004",
    ">": "08040201020408", "<": "02040810080402",
}
_FONT = {ch: np.array([[(int(s[2 * r:2 * r + 2], 16) >> (4 - c)) & 1 for c in range(5)]
                       for r in range(7)], dtype=bool) for ch, s in _FONT_SRC.items()}
PALETTE = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (255, 127, 14), (148, 103, 189), (140, 86, 75)]
BLACK, GRID, MARK = (0, 0, 0), (225, 225, 225), (200, 0, 120)


@dataclass
class Series:
    label: str
    xs: list[float]
    ys: list[float]
    color: tuple[int, int, int] | None = None
    style: str = "line"  # "line" | "points"


@dataclass
class Panel:
    title: str
    series: list[Series]
    vlines: list[tuple[float, str]] = field(default_factory=list)
    y_label: str = ""
    y_range: tuple[float, float] | None = None  # fixed (lo, hi) instead of the data range


def text_width(s: str, scale: int = 1) -> int:
    return 6 * scale * len(s)


def draw_text(img: np.ndarray, x: int, y: int, s: str, color=BLACK, scale: int = 1) -> None:
    """Draw ``s`` with its top-left corner at (x, y); clipped to the image."""
    for i, ch in enumerate(s):
        glyph = _FONT.get(ch.upper(), _FONT["?"])
        if scale > 1:
            glyph = np.kron(glyph, np.ones((scale, scale), dtype=bool))
        gx = x + 6 * scale * i
        ys, xs = np.nonzero(glyph)
        ys, xs = ys + y, xs + gx
        ok = (ys >= 0) & (ys < img.shape[0]) & (xs >= 0) & (xs < img.shape[1])
        img[ys[ok], xs[ok]] = color


def _plot_pixels(img, xs, ys, color) -> None:
    xs, ys = np.asarray(xs), np.asarray(ys)
    ok = (ys >= 0) & (ys < img.shape[0]) & (xs >= 0) & (xs < img.shape[1])
    img[ys[ok], xs[ok]] = color


def draw_segment(img, x0, y0, x1, y1, color) -> None:
    n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    t = np.linspace(0.0, 1.0, n + 1)
    _plot_pixels(img, np.rint(x0 + (x1 - x0) * t).astype(int), np.rint(y0 + (y1 - y0) * t).astype(int), color)


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values (1, 2, 5 x 10^k steps) inside [lo, hi]."""
    raw = (hi - lo) / max(n - 1, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + i * step, 12) for i in range(int((hi - first) / step + 1e-9) + 1)]


def fmt_tick(v: float) -> str:
    return "0" if v == 0 else f"{v:.4g}"


def _range(values: list[float]) -> tuple[float, float]:
    v = [x for x in values if math.isfinite(x)]
    if not v:
        return 0.0, 1.0
    lo, hi = min(v), max(v)
    if hi == lo:
        pad = abs(lo) * 0.05 or 1.0
        return lo - pad, hi + pad
    pad = (hi - lo) * 0.05
    return lo - pad, hi + pad


def line_chart(path: str | Path, panels: list[Panel], *, width: int = 900, height_per_panel: int = 260,
               title: str = "") -> dict:
    """Write ``panels`` stacked vertically to a PNG at ``path``; return what was drawn:
    ``{"width", "height", "panels": [{"title", "series": [{"label", "xs", "ys"}], "vlines"}]}``
    (non-finite y values are not drawn and are described as None)."""
    top = 26 if title else 4
    height = top + height_per_panel * len(panels)
    img = np.full((height, width, 3), 255, dtype=np.uint8)
    if title:
        draw_text(img, (width - text_width(title, 2)) // 2, 6, title, scale=2)
    described = []
    for p_i, panel in enumerate(panels):
        oy = top + p_i * height_per_panel
        labels = [s.label for s in panel.series]
        legend_w = max([text_width(lbl) for lbl in labels] + [0]) + 28
        left, right = 64, width - max(legend_w, 40) - 8
        y_top, y_bot = oy + 22, oy + height_per_panel - 24
        draw_text(img, left, oy + 8, panel.title + (f"  ({panel.y_label})" if panel.y_label else ""))
        all_x = [x for s in panel.series for x in s.xs] + [v for v, _ in panel.vlines]
        xlo, xhi = _range([float(x) for x in all_x])
        ylo, yhi = panel.y_range or _range([float(y) for s in panel.series for y in s.ys])
        to_px = lambda x: left + (x - xlo) / (xhi - xlo) * (right - left)  # noqa: E731
        to_py = lambda y: y_bot - (y - ylo) / (yhi - ylo) * (y_bot - y_top)  # noqa: E731
        for v in nice_ticks(ylo, yhi, 6):  # y grid, ticks, labels
            py = int(round(to_py(v)))
            img[py, left + 1:right + 1] = GRID
            img[py, left - 4:left] = BLACK
            lbl = fmt_tick(v)
            draw_text(img, left - 6 - text_width(lbl), py - 3, lbl)
        for v in nice_ticks(xlo, xhi, 7):  # x ticks, labels
            px = int(round(to_px(v)))
            img[y_bot + 1:y_bot + 5, px] = BLACK
            lbl = fmt_tick(v)
            draw_text(img, px - text_width(lbl) // 2, y_bot + 8, lbl)
        img[y_top:y_bot + 1, left] = BLACK  # axes
        img[y_bot, left:right + 1] = BLACK
        for x, lbl in panel.vlines:  # dashed marker lines
            px = int(round(to_px(float(x))))
            rows = np.arange(y_top, y_bot)
            img[rows[(rows - y_top) % 6 < 4], px] = MARK
            draw_text(img, min(px + 3, right - text_width(lbl)), y_top + 2, lbl, MARK)
        out_series = []
        for s_i, s in enumerate(panel.series):
            color = s.color or PALETTE[s_i % len(PALETTE)]
            pts = [(to_px(float(x)), to_py(float(y))) if math.isfinite(y) else None for x, y in zip(s.xs, s.ys)]
            if s.style == "points":
                for pt in pts:
                    if pt is not None:
                        cx, cy = int(round(pt[0])), int(round(pt[1]))
                        for dy in (-1, 0, 1):
                            _plot_pixels(img, np.arange(cx - 1, cx + 2), np.full(3, cy + dy), color)
            else:
                for a, b in zip(pts, pts[1:]):
                    if a is not None and b is not None:
                        draw_segment(img, a[0], a[1], b[0], b[1], color)
                if len(pts) == 1 and pts[0] is not None:
                    _plot_pixels(img, [int(round(pts[0][0]))], [int(round(pts[0][1]))], color)
            ly = y_top + 4 + 12 * s_i  # legend entry: swatch + label
            img[ly + 2:ly + 5, right + 12:right + 24] = color
            draw_text(img, right + 28, ly, s.label)
            out_series.append({"label": s.label, "xs": [float(x) for x in s.xs],
                               "ys": [float(y) if math.isfinite(y) else None for y in s.ys]})
        described.append({"title": panel.title, "series": out_series,
                          "vlines": [[float(x), lbl] for x, lbl in panel.vlines]})
    write_png(path, img)
    return {"width": width, "height": height, "panels": described}


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def write_png(path: str | Path, img: np.ndarray) -> None:
    """8-bit RGB, no interlace, filter 0 on every row."""
    h, w, _ = img.shape
    raw = np.concatenate([np.zeros((h, 1), dtype=np.uint8), img.astype(np.uint8).reshape(h, w * 3)], axis=1)
    data = (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", zlib.compress(raw.tobytes(), 9)) + _chunk(b"IEND", b""))
    Path(path).write_bytes(data)


def read_png(path: str | Path) -> np.ndarray:
    """Decode a PNG written by ``write_png`` (8-bit RGB, filter 0) into an (h, w, 3) array."""
    data = Path(path).read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path}: not a PNG")
    pos, idat, w, h = 8, b"", 0, 0
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    rows = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(h, 1 + 3 * w)
    if rows[:, 0].any():
        raise ValueError(f"{path}: only filter type 0 is supported")
    return rows[:, 1:].reshape(h, w, 3).copy()


__all__ = ["Panel", "Series", "line_chart", "write_png", "read_png", "draw_text", "nice_ticks"]
