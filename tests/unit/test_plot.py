"""shmkv/plot.py: the PNG files it writes are valid and show the charts' parts."""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from shmkv import plot as pngplot

NS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
LINE_SERIES = {
    "shmkv": (NS, [410, 260, 170, 120, 95, 80, 70, 64, 60]),
    "shmkv-py": (NS, [1450, 1100, 900, 800, 760, 740, 730, 725, 720]),
    "vLLM": (NS, [900, 700, 520, 420, 310, 300, 290, 285, 280]),
}
GROUPS = ["alloc_free", "touch_free", "lookup"]
BAR_SERIES = {"shmkv": [3.1, 2.4, 5.0], "shmkv-py": [1.2, 0.9, 2.2], "vLLM": [0.8, 0.6, 3.9]}


def read_png(path) -> np.ndarray:
    """Parse an 8-bit RGB PNG by hand, checking its structure, and return its pixels."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, payload = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + payload) & 0xFFFFFFFF, f"bad CRC in {kind!r}"
        chunks.append((kind, payload))
        pos += 12 + length
    assert pos == len(data)
    kinds = [kind for kind, _ in chunks]
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    width, height, depth, color_type, compression, filter_method, interlace = struct.unpack(
        ">IIBBBBB", chunks[0][1])
    assert (depth, color_type, compression, filter_method, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(payload for kind, payload in chunks if kind == b"IDAT"))
    assert len(raw) == height * (1 + 3 * width)
    rows = np.frombuffer(raw, np.uint8).reshape(height, 1 + 3 * width)
    assert not rows[:, 0].any(), "every row must use filter type 0"
    return rows[:, 1:].reshape(height, width, 3)


def count(pixels: np.ndarray, color) -> int:
    return int(np.all(pixels == np.array(color, np.uint8), axis=2).sum())


def text_pixels(pixels: np.ndarray) -> int:
    return count(pixels, pngplot.TEXT)


@pytest.fixture
def line_png(tmp_path):
    path = tmp_path / "line.png"
    pngplot.line_chart(path, title="alloc_free latency", x_label="blocks per call",
                       y_label="ns per block", series=LINE_SERIES, x_ticks=NS, log_x=True,
                       width=640, height=400)
    return path


def test_line_chart_is_a_valid_png_of_the_requested_size(line_png):
    assert read_png(line_png).shape == (400, 640, 3)


def test_line_chart_draws_each_series_in_its_palette_colour(line_png):
    pixels = read_png(line_png)
    for color in pngplot.PALETTE[:len(LINE_SERIES)]:
        assert count(pixels, color) > 300, color
    assert count(pixels, pngplot.PALETTE[len(LINE_SERIES)]) == 0  # no fourth series
    assert count(pixels, pngplot.GRID) > 1000


def test_line_chart_has_title_and_legend_text(line_png, tmp_path):
    pixels = read_png(line_png)
    title_band = pixels[:40]
    assert text_pixels(title_band) > 100
    assert all(count(title_band, color) == 0 for color in pngplot.PALETTE)
    # a longer legend name adds text pixels (the legend box holds the names)
    longer = tmp_path / "longer.png"
    renamed = {name + " with a long legend name": xy for name, xy in LINE_SERIES.items()}
    pngplot.line_chart(longer, title="alloc_free latency", x_label="blocks per call",
                       y_label="ns per block", series=renamed, x_ticks=NS, log_x=True,
                       width=640, height=400)
    assert text_pixels(read_png(longer)) > text_pixels(pixels) + 500


def test_line_chart_linear_axes_and_single_point(tmp_path):
    path = tmp_path / "single.png"
    pngplot.line_chart(path, title="one point", x_label="x", y_label="y",
                       series={"only": ([5], [-2.5e6])})
    pixels = read_png(path)
    assert pixels.shape == (480, 800, 3)
    assert count(pixels, pngplot.PALETTE[0]) > 20


def test_bar_chart_is_valid_and_draws_bars_and_text(tmp_path):
    path = tmp_path / "bar.png"
    pngplot.bar_chart(path, title="Throughput", y_label="Mops/s", groups=GROUPS,
                      series=BAR_SERIES)
    pixels = read_png(path)
    assert pixels.shape == (480, 800, 3)
    for color in pngplot.PALETTE[:3]:
        assert count(pixels, color) > 2000, color
    assert text_pixels(pixels[:40]) > 50  # the title
    assert text_pixels(pixels[-40:]) > 50  # the group names


def test_bar_chart_bars_are_as_tall_as_their_values(tmp_path):
    path = tmp_path / "bar.png"
    pngplot.bar_chart(path, title="t", y_label="y", groups=["a", "b"],
                      series={"s": [1.0, 4.0], "t": [-2.0, 0.0]})
    blue = np.all(read_png(path) == np.array(pngplot.PALETTE[0], np.uint8), axis=2)
    columns = blue.sum(axis=0)
    heights = sorted(set(columns[columns > 0]) - {9})  # 9: the legend's swatch
    assert len(heights) == 2 and abs(heights[1] / heights[0] - 4.0) < 0.1


def test_font_has_a_distinct_glyph_for_every_printable_character():
    glyphs = {}
    for code in range(0x21, 0x7F):
        mask = pngplot._text_mask(chr(code))
        assert mask.shape == (pngplot.GLYPH_H, pngplot.GLYPH_W) and mask.any(), chr(code)
        glyphs.setdefault(mask.tobytes(), []).append(chr(code))
    assert all(len(chars) == 1 for chars in glyphs.values()), glyphs.values()
    assert not pngplot._text_mask(" ").any()
    assert pngplot._text_mask("\u00e9").tobytes() == pngplot._text_mask("?").tobytes()
    assert pngplot._text_mask("ab", scale=2).shape == (16, 22)


@pytest.mark.parametrize("lo, hi, expected", [
    (0, 1, ["0", "0.2", "0.4", "0.6", "0.8", "1.0"]),
    (0, 1450, ["0", "250", "500", "750", "1000", "1250", "1500"]),
    (0, 3e6, ["0", "0.5M", "1.0M", "1.5M", "2.0M", "2.5M", "3.0M"]),
    (-4, 4, ["-4", "-2", "0", "2", "4"]),
])
def test_tick_labels_are_round(lo, hi, expected):
    ticks, step = pngplot._nice_ticks(lo, hi, 7)
    assert pngplot._tick_labels(ticks, step) == expected


def test_value_labels():
    values = [1, 8, 1024, 65536, 16000, 2.5e6, 0.5, 2.45, 12345.6]
    assert [pngplot._format_value(v) for v in values] == [
        "1", "8", "1024", "65536", "16k", "2.5M", "0.5", "2.45", "12.3k"]


def test_write_png_is_atomic_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "img.png"
    path.write_bytes(b"old")
    pixels = np.zeros((3, 2, 3), np.uint8)
    pixels[1, 0] = (1, 2, 3)
    pngplot.write_png(path, pixels)
    assert np.array_equal(read_png(path), pixels)
    assert os.listdir(tmp_path) == ["img.png"]
    with pytest.raises(ValueError, match="uint8"):
        pngplot.write_png(path, pixels.astype(float))


@pytest.mark.parametrize("series, message", [
    ({}, "series is empty"),
    ({"a": ([1, 2, 3], [1, 2])}, "'a': 3 x values but 2 y values"),
    ({"a": ([], [])}, "'a' has no points"),
    ({"a": [1, 2, 3]}, r"'a': expected an \(xs, ys\) pair"),
    ({"a": ([1, 2], [1, float("nan")])}, "NaN or infinity"),
    ({"a": ([1, "x"], [1, 2])}, "expected a list of numbers"),
    ({"a": ([0, 1], [1, 2])}, "log_x needs positive x values"),
])
def test_line_chart_rejects_bad_input(tmp_path, series, message):
    with pytest.raises(ValueError, match=message):
        pngplot.line_chart(tmp_path / "x.png", title="t", x_label="x", y_label="y",
                           series=series, log_x=True)
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("groups, series, message", [
    (["a"], {}, "series is empty"),
    ([], {"s": []}, "groups is empty"),
    (["a", "b"], {"s": [1.0]}, "'s': 1 values for 2 groups"),
    (["a"], {"s": [float("inf")]}, "NaN or infinity"),
])
def test_bar_chart_rejects_bad_input(tmp_path, groups, series, message):
    with pytest.raises(ValueError, match=message):
        pngplot.bar_chart(tmp_path / "x.png", title="t", y_label="y", groups=groups,
                          series=series)


def test_too_small_image_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="at least 200x150"):
        pngplot.line_chart(tmp_path / "x.png", title="t", x_label="x", y_label="y",
                           series={"a": ([1], [1])}, width=100, height=100)
