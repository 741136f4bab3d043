"""Dependency-free PNG line and bar charts (``shmkv run``'s plot and the benchmarks').

shmkv depends on numpy and nothing else, so it draws its own plots: a numpy
RGB canvas, a built-in 5x8 bitmap font and a PNG encoder made of ``zlib`` and ``struct``.

Usage::

    from shmkv.plot import bar_chart, line_chart

    line_chart("alloc_free.png", title="alloc_free: ns per block",
               x_label="blocks per call (n)", y_label="ns per block",
               x_ticks=[1, 16, 256], log_x=True,
               series={"shmkv": ([1, 16, 256], [410, 95, 60]),
                       "vLLM": ([1, 16, 256], [900, 310, 280])})

    bar_chart("speedup.png", title="vLLM / shmkv (median)", y_label="ratio",
              groups=["alloc_free", "touch_free", "lookup"],
              series={"shmkv": [3.1, 2.4, 5.0], "shmkv-py": [1.2, 0.9, 2.2]})

The y axis always includes zero, its ticks are round values (steps of 1, 2, 2.5 or 5 times
a power of ten, with k/M/G suffixes for big numbers). Series take the colours of
``PALETTE`` in order. Text outside printable ASCII (other than the signs µ and °) is drawn
as '?'. Bad input raises ``ValueError``; files are written atomically (a temporary file in
the same directory, then ``os.replace``).
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import tempfile
import zlib
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

__all__ = ["PALETTE", "bar_chart", "line_chart", "write_png"]

BACKGROUND = (255, 255, 255)
TEXT = (34, 34, 34)
AXIS = (85, 85, 85)
GRID = (228, 228, 228)
#: Series colours, in order ("Tableau 10"); an eleventh series reuses the first colour.
PALETTE = (
    (31, 119, 180),   # blue
    (255, 127, 14),   # orange
    (44, 160, 44),    # green
    (214, 39, 40),    # red
    (148, 103, 189),  # purple
    (140, 86, 75),    # brown
    (227, 119, 194),  # pink
    (127, 127, 127),  # grey
    (188, 189, 34),   # olive
    (23, 190, 207),   # cyan
)
TITLE_SCALE = 2  # the title's glyphs are 2x2 pixel blocks; all other text is 1x

# -- Font --------------------------------------------------------------------------------
# The classic 5x7 LCD font for ASCII 0x20..0x7e, with real descenders for g j p q y.
# A glyph is five columns, left to right; each column is a byte whose bit r is the pixel
# in row r (row 0 at the top, row 6 the baseline, row 7 the descenders).
_FONT_HEX = """
0000000000 00005f0000 0007000700 147f147f14 242a7f2a12 2313086462 3649552250 0005030000
001c224100 0041221c00 082a1c2a08 08083e0808 0050300000 0808080808 0060600000 2010080402
3e5149453e 00427f4000 4261514946 2141454b31 1814127f10 2745454539 3c4a494930 0171090503
3649494936 064949291e 0036360000 0056360000 0008142241 1414141414 4122140800 0201510906
324979413e 7e1111117e 7f49494936 3e41414122 7f4141221c 7f49494941 7f09090101 3e41415132
7f0808087f 00417f4100 2040413f01 7f08142241 7f40404040 7f0204027f 7f0408107f 3e4141413e
7f09090906 3e4151215e 7f09192946 4649494931 01017f0101 3f4040403f 1f2040201f 7f2018207f
6314081463 0304780403 6151494543 007f414100 0204081020 0041417f00 0402010204 4040404040
0001020400 2054545478 7f48444438 3844444420 384444487f 3854545418 087e090102 18a4a4a47c
7f08040478 00447d4000 4080847d00 007f102844 00417f4000 7c0418047c 7c08040478 3844444438
fc24242418 18242418fc 7c08040408 4854545420 043f444020 3c4040207c 1c2040201c 3c4030403c
4428102844 1ca0a0a07c 4464544c44 0008364100 00007f0000 0041360800 0804081008
fc4040207c 0205020000
"""  # the last line holds the extra glyphs of _EXTRA_CHARS: micro sign, degree sign
_EXTRA_CHARS = "\u00b5\u00b0"
GLYPH_W, GLYPH_H = 5, 8  # a character cell adds one blank column on the right


def _decode_font(hex_text: str) -> np.ndarray:
    columns = np.frombuffer(bytes.fromhex("".join(hex_text.split())), np.uint8)
    bits = np.unpackbits(columns.reshape(-1, GLYPH_W, 1), axis=2, bitorder="little")
    return bits.transpose(0, 2, 1).astype(bool)  # (glyph, row, column)


_GLYPHS = _decode_font(_FONT_HEX)


def _glyph_index(ch: str) -> int:
    if " " <= ch <= "~":
        return ord(ch) - 0x20
    if ch in _EXTRA_CHARS or ch == "\u03bc":  # Greek mu looks like the micro sign
        return 95 + _EXTRA_CHARS.index("\u00b5" if ch == "\u03bc" else ch)
    return ord("?") - 0x20


def _text_mask(text: str, scale: int = 1) -> np.ndarray:
    """The pixels of ``text`` as a boolean (rows, columns) array."""
    if not text:
        return np.zeros((GLYPH_H * scale, 0), bool)
    cells = np.zeros((len(text), GLYPH_H, GLYPH_W + 1), bool)
    cells[:, :, :GLYPH_W] = _GLYPHS[[_glyph_index(ch) for ch in text]]
    mask = cells.transpose(1, 0, 2).reshape(GLYPH_H, -1)[:, :-1]
    return mask.repeat(scale, axis=0).repeat(scale, axis=1)


def _text_width(text: str, scale: int = 1) -> int:
    return max((GLYPH_W + 1) * len(text) - 1, 0) * scale


# -- Raster primitives --------------------------------------------------------------------
def _paint(img: np.ndarray, mask: np.ndarray, x: int, y: int, color) -> None:
    """Set the pixels of ``mask``, placed with its top-left corner at (x, y), clipped."""
    height, width = img.shape[:2]
    x0, y0 = max(x, 0), max(y, 0)
    x1, y1 = min(x + mask.shape[1], width), min(y + mask.shape[0], height)
    if x0 < x1 and y0 < y1:
        img[y0:y1, x0:x1][mask[y0 - y:y1 - y, x0 - x:x1 - x]] = color


def _fill_rect(img, x0, y0, x1, y1, color) -> None:
    """Fill the pixels x0..x1, y0..y1 (inclusive, any order), clipped to the image."""
    x0, x1 = sorted((int(round(x0)), int(round(x1))))
    y0, y1 = sorted((int(round(y0)), int(round(y1))))
    _paint(img, np.ones((y1 - y0 + 1, x1 - x0 + 1), bool), x0, y0, color)


def _draw_line(img, x0, y0, x1, y1, color, thickness: int = 2) -> None:
    """A straight line ``thickness`` pixels wide: one sample per pixel step, rounded."""
    steps = int(round(max(abs(x1 - x0), abs(y1 - y0)))) + 1
    xs = np.rint(np.linspace(x0, x1, steps)).astype(int)
    ys = np.rint(np.linspace(y0, y1, steps)).astype(int)
    height, width = img.shape[:2]
    for dx in range(-(thickness // 2), thickness - thickness // 2):
        for dy in range(-(thickness // 2), thickness - thickness // 2):
            px, py = xs + dx, ys + dy
            keep = (px >= 0) & (px < width) & (py >= 0) & (py < height)
            img[py[keep], px[keep]] = color


_OFFSETS = np.arange(-3, 4)
_DISC = (_OFFSETS[:, None] ** 2 + _OFFSETS[None, :] ** 2) <= 10  # a 7x7 round marker


def _draw_text(img, text, x, y, color=TEXT, scale=1, ha="left", va="top", vertical=False):
    """Draw ``text`` aligned at (x, y); ``vertical`` turns it to read bottom to top."""
    mask = _text_mask(text, scale)
    if vertical:
        mask = np.rot90(mask)
    x -= {"left": 0, "center": mask.shape[1] // 2, "right": mask.shape[1]}[ha]
    y -= {"top": 0, "center": mask.shape[0] // 2, "bottom": mask.shape[0]}[va]
    _paint(img, mask, int(round(x)), int(round(y)), color)


# -- Numbers on axes ----------------------------------------------------------------------
def _nice_ticks(lo: float, hi: float, max_ticks: int) -> tuple[list[float], float]:
    """Round tick values covering [lo, hi] (step 1, 2, 2.5 or 5 x 10^k), and the step."""
    if hi <= lo:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / max(max_ticks - 1, 1)
    magnitude = 10.0 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw * 0.999)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [i * step for i in range(first, last + 1)], step


def _tick_labels(values: Sequence[float], step: float) -> list[str]:
    """Labels with one number of decimals per axis, and k/M/G for big numbers: 0, 0.5, 1.0."""
    divisor, suffix = _suffix(max(abs(v) for v in values))
    unit = step / divisor
    decimals = next(d for d in range(12) if abs(round(unit, d) - unit) <= unit * 1e-6)
    return ["0" if abs(v) < step * 1e-6 else f"{v / divisor:.{decimals}f}{suffix}"
            for v in values]


def _suffix(biggest: float) -> tuple[float, str]:
    """(divisor, suffix) for labels of numbers up to ``biggest``; k only from 10000 on."""
    for threshold, divisor, suffix in ((1e9, 1e9, "G"), (1e6, 1e6, "M"), (1e4, 1e3, "k")):
        if biggest >= threshold:
            return divisor, suffix
    return 1.0, ""


def _format_value(v: float) -> str:
    """A short label for one value: 3 significant digits and k/M/G (0.5, 2.45, 16k, 2.5M),
    but every digit of whole numbers that would lose some (1024, 65536)."""
    v = float(v)
    divisor, suffix = _suffix(abs(v))
    short = f"{v / divisor:.3g}"
    loses_digits = v.is_integer() and not math.isclose(float(short) * divisor, v)
    if loses_digits or (not suffix and abs(v) >= 1000):
        return f"{v:.0f}"
    return short + suffix


# -- Layout ---------------------------------------------------------------------------------
class _Box(NamedTuple):
    left: int
    top: int
    right: int
    bottom: int  # the plot area's pixels, inclusive


def _scale(lo: float, hi: float, p0: float, p1: float):
    """The linear map sending data value lo to pixel p0 and hi to p1."""
    k = (p1 - p0) / (hi - lo)
    return lambda v: p0 + (np.asarray(v, float) - lo) * k


def _new_chart(width, height, title, x_label, y_label, y_values, pad, clear_top=0):
    """A canvas with title, axis labels, y ticks and the horizontal grid.

    The tick range sits ``pad`` pixels inside the plot area, and the largest y value at
    least ``clear_top`` pixels below its top edge. Returns (img, box, y_px) where y_px
    maps y values to pixel rows.
    """
    if width < 200 or height < 150:
        raise ValueError(f"the image must be at least 200x150 pixels, got {width}x{height}")
    img = np.full((height, width, 3), BACKGROUND, np.uint8)
    top = 12 + GLYPH_H * TITLE_SCALE + 14
    bottom = height - (8 + GLYPH_H + 10 + GLYPH_H + 10)  # tick labels, x label, margin
    lo, hi = min(0.0, float(np.min(y_values))), max(0.0, float(np.max(y_values)))
    ticks, step = _nice_ticks(lo, hi, max(3, (bottom - top) // 50))
    labels = _tick_labels(ticks, step)
    left = 10 + GLYPH_H + 10 + max(_text_width(s) for s in labels) + 8
    box = _Box(left, top, width - 20, bottom)
    # Pixels per y unit: the ticks fit in the box, the largest value stays clear_top below it.
    room = bottom - pad - top
    per_unit = min((room - pad) / (ticks[-1] - ticks[0]),
                   max(room - clear_top, room / 4) / (hi - ticks[0]))
    y_px = _scale(ticks[0], ticks[0] + 1.0, bottom - pad, bottom - pad - per_unit)

    title_scale = TITLE_SCALE if _text_width(title, TITLE_SCALE) <= width - 20 else 1
    _draw_text(img, title, width // 2, 12, scale=title_scale, ha="center")
    _draw_text(img, y_label, 10, (top + bottom) // 2, ha="left", va="center", vertical=True)
    _draw_text(img, x_label, (left + box.right) // 2, height - 10, ha="center", va="bottom")
    for value, label in zip(ticks, labels, strict=True):
        y = int(round(y_px(value)))
        _fill_rect(img, left + 1, y, box.right - 1, y, GRID)
        _fill_rect(img, left - 5, y, left - 1, y, AXIS)
        _draw_text(img, label, left - 8, y, ha="right", va="center")
    return img, box, y_px


def _draw_x_ticks(img, box: _Box, positions, labels, grid: bool = True) -> None:
    """Tick marks (and vertical grid lines) at ``positions``; labels that would overlap the
    previous drawn label are left out."""
    last_right = -1e9
    for x, label in zip(positions, labels, strict=True):
        x = int(round(x))
        if grid:
            _fill_rect(img, x, box.top + 1, x, box.bottom - 1, GRID)
            _fill_rect(img, x, box.bottom + 1, x, box.bottom + 5, AXIS)
        half = _text_width(label) / 2
        if x - half >= last_right + 6:
            _draw_text(img, label, x, box.bottom + 8, ha="center")
            last_right = x + half


def _draw_frame(img, box: _Box) -> None:
    for x0, y0, x1, y1 in ((box.left, box.top, box.right, box.top),
                           (box.left, box.bottom, box.right, box.bottom),
                           (box.left, box.top, box.left, box.bottom),
                           (box.right, box.top, box.right, box.bottom)):
        _fill_rect(img, x0, y0, x1, y1, AXIS)


def _draw_legend(img, box: _Box, entries, kind: str, corners) -> None:
    """A white, framed legend box with one row per (name, colour) entry, placed in the
    first of ``corners`` ("top-right", ...) that covers the fewest already-drawn data pixels."""
    row, swatch = GLYPH_H + 6, 22
    w = 8 + swatch + 6 + max(_text_width(name) for name, _ in entries) + 8
    h = 6 + row * len(entries) + 2

    def origin(corner: str) -> tuple[int, int]:
        vertical, horizontal = corner.split("-")
        x = box.left + 10 if horizontal == "left" else box.right - 10 - w
        y = box.top + 10 if vertical == "top" else box.bottom - 10 - h
        return x, y

    def covered(corner: str) -> int:
        x, y = origin(corner)
        area = img[y:y + h, x:x + w]
        return int(np.sum(np.any(area != BACKGROUND, axis=2) & np.any(area != GRID, axis=2)))

    x, y = origin(min(corners, key=covered))  # min() keeps the first of equal candidates
    _fill_rect(img, x, y, x + w - 1, y + h - 1, (200, 200, 200))
    _fill_rect(img, x + 1, y + 1, x + w - 2, y + h - 2, BACKGROUND)
    for i, (name, color) in enumerate(entries):
        mid = y + 6 + i * row + GLYPH_H // 2 - 1
        if kind == "line":
            _draw_line(img, x + 8, mid, x + 8 + swatch, mid, color)
            _paint(img, _DISC, x + 8 + swatch // 2 - 3, mid - 3, color)
        else:
            _fill_rect(img, x + 8 + 4, mid - 4, x + 8 + swatch - 4, mid + 4, color)
        _draw_text(img, name, x + 8 + swatch + 6, mid - 3)


# -- Input checks ---------------------------------------------------------------------------
def _floats(values, what: str) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=float)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: expected a list of numbers, got {values!r}") from None
    if arr.ndim != 1:
        raise ValueError(f"{what}: expected a flat list of numbers, got {values!r}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{what}: contains NaN or infinity: {values!r}")
    return arr


def _check_series_present(series) -> None:
    if not isinstance(series, Mapping) or not series:
        raise ValueError("series is empty: give at least one legend name -> data entry")


# -- Public API -----------------------------------------------------------------------------
def line_chart(path, *, title: str, x_label: str, y_label: str,
               series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
               x_ticks: Sequence[float] | None = None, log_x: bool = False,
               width: int = 800, height: int = 480) -> None:
    """Write a line chart to ``path`` (PNG).

    ``series`` maps a legend name to ``(xs, ys)``, two equally long lists of numbers; each
    series is a 2-pixel line through its points, in the given order, with round markers.
    ``x_ticks`` puts the x ticks at exactly those values (labelled as given, e.g. 1, 2, 4,
    8); otherwise they are round values (powers of ten, or of two, on a ``log_x`` axis).
    ``log_x`` spaces x logarithmically and needs positive x values. The legend goes to
    the inside corner of the plot that hides the fewest data pixels.
    Raises ValueError on an empty series mapping, an empty series, xs and ys of different
    lengths, non-finite numbers, or non-positive x values with ``log_x``.
    """
    _check_series_present(series)
    data = []
    for name, pair in series.items():
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"series {name!r}: expected an (xs, ys) pair, got {pair!r}")
        xs, ys = _floats(pair[0], f"series {name!r} xs"), _floats(pair[1], f"series {name!r} ys")
        if len(xs) != len(ys):
            raise ValueError(f"series {name!r}: {len(xs)} x values but {len(ys)} y values")
        if len(xs) == 0:
            raise ValueError(f"series {name!r} has no points")
        if log_x and np.any(xs <= 0):
            raise ValueError(f"series {name!r}: log_x needs positive x values, got {pair[0]!r}")
        data.append((str(name), xs, ys))
    ticks = None if x_ticks is None else _floats(x_ticks, "x_ticks")
    if ticks is not None and log_x and np.any(ticks <= 0):
        raise ValueError(f"x_ticks: log_x needs positive values, got {x_ticks!r}")

    pad = 10  # pixels between the frame and the outermost points
    img, box, y_px = _new_chart(width, height, title, x_label, y_label,
                                np.concatenate([ys for _, _, ys in data]), pad)
    ticks, labels, x_px = _x_axis(np.concatenate([xs for _, xs, _ in data]), ticks, log_x,
                                  box.left + pad, box.right - pad)
    _draw_x_ticks(img, box, x_px(ticks), labels)
    for i, (_, xs, ys) in enumerate(data):
        color, px, py = PALETTE[i % len(PALETTE)], x_px(xs), y_px(ys)
        for j in range(len(px) - 1):
            _draw_line(img, px[j], py[j], px[j + 1], py[j + 1], color)
        for x, y in zip(px, py, strict=True):
            _paint(img, _DISC, int(round(x)) - 3, int(round(y)) - 3, color)
    _draw_frame(img, box)
    entries = [(name, PALETTE[i % len(PALETTE)]) for i, (name, _, _) in enumerate(data)]
    _draw_legend(img, box, entries, "line",
                 ("top-right", "top-left", "bottom-right", "bottom-left"))
    write_png(path, img)


def _x_axis(xs: np.ndarray, ticks, log_x: bool, p0: int, p1: int):
    """The x ticks, their labels, and the map from x values to pixel columns p0..p1."""
    lo, hi = float(xs.min()), float(xs.max())
    if ticks is not None and len(ticks):
        labels = [_format_value(t) for t in ticks]
    elif log_x:
        ticks = _log_ticks(lo, hi)
        labels = [_format_value(t) for t in ticks]
    else:
        ticks, step = _nice_ticks(lo, hi, max(3, (p1 - p0) // 80))
        labels = _tick_labels(ticks, step)
    ticks = np.asarray(ticks, float)
    warp = np.log10 if log_x else np.asarray
    t_lo, t_hi = float(warp(min(lo, ticks.min()))), float(warp(max(hi, ticks.max())))
    if t_hi <= t_lo:  # a single x value: put it in the middle
        t_lo, t_hi = t_lo - 1, t_hi + 1
    to_px = _scale(t_lo, t_hi, p0, p1)
    return ticks, labels, lambda v: to_px(warp(np.asarray(v, float)))


def _log_ticks(lo: float, hi: float) -> list[float]:
    """Powers of ten within [lo, hi]; powers of two if that gives fewer than two."""
    for base in (10, 2):
        powers = range(math.floor(math.log(lo, base)), math.ceil(math.log(hi, base)) + 1)
        ticks = [float(base) ** k for k in powers if lo * 0.999 <= float(base) ** k <= hi * 1.001]
        if len(ticks) >= 2:
            return ticks
    return [lo, hi] if hi > lo else [lo]


def bar_chart(path, *, title: str, y_label: str, groups: Sequence[str],
              series: Mapping[str, Sequence[float]],
              width: int = 800, height: int = 480) -> None:
    """Write a grouped bar chart to ``path`` (PNG).

    ``groups`` names the categories along the x axis; ``series`` maps a legend name to one
    value per group. Each group shows one bar per series, side by side in series order,
    labelled with its value when the label fits the bar's width. Bars start at zero
    (negative values point down). Raises ValueError on empty groups or series, a series
    whose length differs from ``len(groups)``, or non-finite values.
    """
    groups = [str(g) for g in groups]
    if not groups:
        raise ValueError("groups is empty: give at least one category name")
    _check_series_present(series)
    data = []
    for name, values in series.items():
        values = _floats(values, f"series {name!r}")
        if len(values) != len(groups):
            raise ValueError(f"series {name!r}: {len(values)} values for {len(groups)} groups "
                             f"{groups!r}; give one value per group")
        data.append((str(name), values))

    legend_h = 6 + (GLYPH_H + 6) * len(data) + 2
    all_values = np.concatenate([values for _, values in data])
    pad = 14 if all_values.min() < 0 else 0  # room for labels under negative bars
    img, box, y_px = _new_chart(width, height, title, "", y_label, all_values,
                                pad=pad, clear_top=legend_h + 24)
    group_w = (box.right - box.left) / len(groups)
    bar_w = 0.8 * group_w / len(data)
    gap = 1 if bar_w >= 6 else 0
    names = [_fit(g, int(group_w) - 4) for g in groups]
    centres = [box.left + (g + 0.5) * group_w for g in range(len(groups))]
    _draw_x_ticks(img, box, centres, names, grid=False)
    zero = float(y_px(0.0))
    for s, (_, values) in enumerate(data):
        color = PALETTE[s % len(PALETTE)]
        for g, value in enumerate(values):
            x0 = box.left + g * group_w + 0.1 * group_w + s * bar_w
            x1 = x0 + bar_w - 1 - gap
            top = float(y_px(value))
            _fill_rect(img, x0, zero, x1, top, color)
            label = _format_value(value)
            if _text_width(label) <= bar_w + 2:
                up = value >= 0
                _draw_text(img, label, (x0 + x1) / 2, top - 3 if up else top + 4,
                           ha="center", va="bottom" if up else "top")
    _fill_rect(img, box.left, zero, box.right, zero, AXIS)  # the zero line
    _draw_frame(img, box)
    entries = [(name, PALETTE[s % len(PALETTE)]) for s, (name, _) in enumerate(data)]
    _draw_legend(img, box, entries, "bar", ("top-right",))
    write_png(path, img)


def _fit(text: str, pixels: int) -> str:
    """``text``, cut short with '..' if it is wider than ``pixels``."""
    if _text_width(text) <= pixels:
        return text
    keep = max((pixels + 1) // (GLYPH_W + 1) - 2, 1)
    return text[:keep] + ".."


# -- PNG ------------------------------------------------------------------------------------
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chunk(kind: bytes, payload: bytes) -> bytes:
    crc = zlib.crc32(kind + payload) & 0xFFFFFFFF
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)


def write_png(path, pixels: np.ndarray) -> None:
    """Write a (height, width, 3) uint8 RGB array to ``path`` as a PNG, atomically.

    The file holds IHDR (8-bit RGB, no interlace), one zlib-compressed IDAT whose rows all
    use filter type 0, and IEND. It is written to a temporary file next to ``path`` and
    moved over it with ``os.replace``, so readers never see a half-written image.
    """
    pixels = np.asarray(pixels)
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"pixels must be a (height, width, 3) uint8 array, "
                         f"got {pixels.dtype} {pixels.shape}")
    height, width = pixels.shape[:2]
    rows = np.zeros((height, 1 + 3 * width), np.uint8)  # byte 0 of each row: filter 0
    rows[:, 1:] = pixels.reshape(height, 3 * width)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit depth, RGB
    png = (PNG_SIGNATURE + _chunk(b"IHDR", header)
           + _chunk(b"IDAT", zlib.compress(rows.tobytes(), 9)) + _chunk(b"IEND", b""))

    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix=".pngplot-", suffix=".tmp",
                               dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp's 0600 would make the plot private
            f.write(png)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
