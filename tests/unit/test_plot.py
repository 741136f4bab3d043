"""shmkv/plot.py and the three plots built on it (``shmkv run``'s timeline, the contention
and serve benchmarks): valid PNG files of the expected size that show their data, read
back with matplotlib; ``import shmkv`` never imports matplotlib; without matplotlib the
chart functions raise ``PlotUnavailable`` with one line to print."""

from __future__ import annotations

import importlib.util
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shmkv import plot

mpimg = pytest.importorskip("matplotlib.image")
from matplotlib.colors import to_rgb  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
LINE_SERIES = {
    "shmkv": (NS, [410, 260, 170, 120, 95, 80, 70, 64, 60]),
    "shmkv-py": (NS, [1450, 1100, 900, 800, 760, 740, 730, 725, 720]),
    "vLLM": (NS, [900, 700, 520, 420, 310, 300, 290, 285, 280]),
}
# matplotlib's default colour cycle: series k takes C<k>
COLORS = [to_rgb(f"C{k}") for k in range(5)]


def read_png(path) -> np.ndarray:
    """Check the PNG signature and header, then read the pixels back (RGB floats)."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR" and data[-8:-4] == b"IEND"
    width, height = struct.unpack(">II", data[16:24])
    pixels = mpimg.imread(path)
    assert pixels.shape[:2] == (height, width)
    return pixels[..., :3]


def count(pixels: np.ndarray, color, tol: float = 0.02) -> int:
    """Pixels within ``tol`` of ``color`` in every channel."""
    return int(np.all(np.abs(pixels - np.array(color)) <= tol, axis=2).sum())


def not_blank(pixels: np.ndarray) -> float:
    """The fraction of pixels that are not white."""
    return float((pixels < 0.95).any(axis=2).mean())


def test_line_chart_is_a_valid_png_of_the_requested_size(tmp_path):
    path = tmp_path / "line.png"
    plot.line_chart(path, title="alloc_free latency", x_label="blocks per call",
                    y_label="ns per block", series=LINE_SERIES, x_ticks=NS, log_x=True,
                    width=640, height=400)
    assert read_png(path).shape == (400, 640, 3)
    default = tmp_path / "default.png"
    plot.line_chart(default, title="t", x_label="x", y_label="y",
                    series={"only": ([5], [-2.5e6])})
    assert read_png(default).shape == (480, 800, 3)
    assert not list(tmp_path.glob("*.tmp"))  # written atomically, nothing left over


def test_line_chart_draws_each_series_in_its_own_colour(tmp_path):
    path = tmp_path / "line.png"
    plot.line_chart(path, title="alloc_free latency", x_label="blocks per call",
                    y_label="ns per block", series=LINE_SERIES, x_ticks=NS, log_x=True)
    pixels = read_png(path)
    for color in COLORS[:len(LINE_SERIES)]:
        assert count(pixels, color) > 300, color
    assert count(pixels, COLORS[len(LINE_SERIES)]) == 0  # no fourth series
    # the lines follow the data: the vLLM line (C2) sits above the shmkv line (C0)
    rows_of = {k: np.nonzero(np.all(np.abs(pixels - COLORS[k]) <= 0.02, axis=2))[0]
               for k in (0, 2)}
    assert np.median(rows_of[2]) < np.median(rows_of[0])  # row 0 is the top


def test_empty_or_mismatched_series_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no series"):
        plot.line_chart(tmp_path / "x.png", title="t", x_label="x", y_label="y", series={})
    with pytest.raises(ValueError, match="3 x values, 2 y values"):
        plot.line_chart(tmp_path / "x.png", title="t", x_label="x", y_label="y",
                        series={"s": ([1, 2, 3], [1, 2])})
    with pytest.raises(ValueError, match="1 values for 2 groups"):
        plot.bar_chart(tmp_path / "x.png", title="t", y_label="y", groups=["a", "b"],
                       series={"s": [1.0]})
    assert not list(tmp_path.iterdir())


def test_bar_chart_bars_are_as_tall_as_their_values(tmp_path):
    path = tmp_path / "bar.png"
    plot.bar_chart(path, title="t", y_label="y", groups=["a", "b"],
                   series={"s": [1.0, 4.0]})
    blue = np.all(np.abs(read_png(path) - COLORS[0]) <= 0.02, axis=2)
    columns = blue.sum(axis=0)
    left, right = columns[: len(columns) // 2].max(), columns[len(columns) // 2:].max()
    assert left > 20 and right / left == pytest.approx(4.0, rel=0.05)


def test_grouped_bars_take_one_colour_per_series(tmp_path):
    path = tmp_path / "bar.png"
    plot.bar_chart(path, title="Throughput", y_label="Mops/s",
                   groups=["alloc_free", "touch_free", "lookup"],
                   series={"shmkv": [3.1, 2.4, 5.0], "shmkv-py": [1.2, 0.9, 2.2],
                           "vLLM": [0.8, 0.6, 3.9]})
    pixels = read_png(path)
    for color in COLORS[:3]:
        assert count(pixels, color) > 2000, color


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _timeline(rate: float) -> list[dict]:
    return [{"t_s": 0.25 * i, "prefix_hit_rate": rate * (1 - math.exp(-i / 8)),
             "pool_usage": min(1.0, i / 20), "requests_done": i} for i in range(40)]


def test_run_plot_shows_hit_rate_and_usage(tmp_path):
    from shmkv.serve import report

    f = {"pool": "shared", "schedulers": 4, "routing": "round-robin", "num_blocks": 512,
         "timeline": _timeline(0.7)}
    path = tmp_path / "run.png"
    report.plot_timeline(f, str(path))
    pixels = read_png(path)
    assert pixels.shape == (480, 800, 3) and not_blank(pixels) > 0.02
    assert count(pixels, COLORS[0]) > 500 and count(pixels, COLORS[1]) > 200  # hit rate, usage
    compare = tmp_path / "compare.png"
    report.plot_timeline([f, dict(f, pool="private", timeline=_timeline(0.3))], str(compare))
    assert count(read_png(compare), COLORS[1]) > 500  # the second run
    # an empty timeline (a run stopped before its first request) still plots
    report.plot_timeline(dict(f, timeline=[]), str(tmp_path / "empty.png"))
    assert read_png(tmp_path / "empty.png").shape == (480, 800, 3)


def test_contention_plot_has_two_panels(tmp_path):
    bench = _bench("bench_contention")
    rows = [{"processes": n, "kernel": "c", "requests_per_s": r, "wait_p50_us": p50,
             "wait_p99_us": p99}
            for n, r, p50, p99 in [(1, 21327, 0.1, 0.1), (2, 38148, 0.2, 21),
                                   (4, 31840, 0.2, 804), (8, 30298, 0.2, 2129)]]
    path = tmp_path / "contention.png"
    bench.plot(rows, path)
    pixels = read_png(path)
    assert pixels.shape == (480, 800, 3)
    blue = np.all(np.abs(pixels - COLORS[0]) <= 0.02, axis=2)
    cols = np.nonzero(blue.any(axis=0))[0]
    assert cols.min() < 400 < cols.max()  # throughput on the left, lock wait on the right
    assert count(pixels[:, 400:], COLORS[1]) > 100  # p50 in the right panel


def test_serve_plot_has_a_bar_per_row(tmp_path):
    pytest.importorskip("torch")
    bench = _bench("bench_serve")
    rows = [{"schedulers": 4, "row": f"{p}:{r}", "pool": p, "routing": r, "num_blocks": 512,
             "prefix_hit_rate": h}
            for p, r, h in [("shared", "round-robin", 0.75), ("private", "round-robin", 0.32),
                            ("private", "prefix-aware", 0.73)]]
    path = tmp_path / "serve.png"
    bench.plot(rows, str(path))
    blue = np.all(np.abs(read_png(path) - COLORS[0]) <= 0.02, axis=2)
    heights = blue.sum(axis=0)
    # three bars: three runs of blue columns, the middle one the shortest
    runs = np.split(heights, np.nonzero(heights == 0)[0])
    bars = [r.max() for r in runs if r.size and r.max() > 20]
    assert len(bars) == 3 and bars[1] < bars[0] and bars[1] < bars[2]
    assert bars[0] / bars[1] == pytest.approx(0.75 / 0.32, rel=0.05)


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_import_shmkv_does_not_import_matplotlib():
    out = _python("import sys, shmkv, shmkv.plot, shmkv.cli, shmkv.serve.report\n"
                  "assert 'matplotlib' not in sys.modules, 'matplotlib imported'\n"
                  "print('ok')")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_without_matplotlib_the_charts_raise_one_clear_line(tmp_path):
    out = _python(
        "import sys\n"
        "sys.modules['matplotlib'] = None  # import matplotlib now raises ImportError\n"
        "from shmkv import plot\n"
        "from shmkv.serve import report\n"
        "f = {'pool': 'shared', 'schedulers': 2, 'routing': 'round-robin',\n"
        "     'num_blocks': 64, 'timeline': []}\n"
        "for draw in (lambda: plot.line_chart(sys.argv[1], title='t', x_label='x',\n"
        "                                     y_label='y', series={'s': ([1], [1])}),\n"
        "             lambda: plot.bar_chart(sys.argv[1], title='t', y_label='y',\n"
        "                                    groups=['a'], series={'s': [1]}),\n"
        "             lambda: report.plot_timeline(f, sys.argv[1])):\n"
        "    try:\n"
        "        draw()\n"
        "    except plot.PlotUnavailable as e:\n"
        "        assert isinstance(e, ImportError)\n"
        "        print(e)\n"
        .replace("sys.argv[1]", repr(str(tmp_path / "x.png"))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [plot.MISSING] * 3
    assert "pip install 'shmkv[plot]'" in plot.MISSING and "\n" not in plot.MISSING
    assert not list(tmp_path.iterdir())
