"""PNG line and bar charts drawn with matplotlib (``shmkv run``'s plot and the benchmarks').

matplotlib is an optional extra (``pip install 'shmkv[plot]'``; the ``torch`` and ``dev``
extras pull it in too). It is imported when a chart is drawn, never by ``import shmkv``;
without it every function here raises :class:`PlotUnavailable`, whose message is one line
that the commands print instead of the plot's path. The charts use matplotlib's
object-oriented API on the Agg canvas (no pyplot, no global backend switch).

Usage::

    from shmkv.plot import bar_chart, line_chart

    line_chart("alloc_free.png", title="alloc_free: ns per block",
               x_label="blocks per call", y_label="ns per block",
               x_ticks=[1, 16, 256], log_x=True,
               series={"shmkv": ([1, 16, 256], [410, 95, 60]),
                       "vLLM": ([1, 16, 256], [900, 310, 280])})

    bar_chart("speedup.png", title="vLLM / shmkv (median)", y_label="ratio",
              groups=["alloc_free", "touch_free", "lookup"],
              series={"shmkv": [3.1, 2.4, 5.0], "shmkv-py": [1.2, 0.9, 2.2]})

For a figure of several panels: ``fig, axes = figure(2)``, then :func:`draw_lines` /
:func:`draw_bars` on each axes, then :func:`save`. The y axis starts at zero unless told
otherwise; files are written atomically (a temporary file in the same directory, then
``os.replace``), 800 x 480 pixels by default.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import textwrap
from collections.abc import Mapping, Sequence

__all__ = ["MISSING", "PlotUnavailable", "bar_chart", "draw_bars", "draw_lines", "figure",
           "line_chart", "save"]

#: The line the commands print when matplotlib is not installed.
MISSING = "matplotlib is not installed, no plot written (pip install 'shmkv[plot]')"
WIDTH, HEIGHT, DPI = 800, 480, 100  # pixels; 100 pixels an inch


class PlotUnavailable(ImportError):
    """matplotlib cannot be imported; the message is :data:`MISSING`."""


def figure(ncols: int = 1, *, title: str | None = None, width: int = WIDTH,
           height: int = HEIGHT):
    """A new figure of ``ncols`` panels side by side, ``width`` x ``height`` pixels:
    ``(fig, [axes, ...])``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise PlotUnavailable(MISSING) from e
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(1, ncols, squeeze=False)[0])
    if title:
        fig.suptitle("\n".join(textwrap.wrap(title, width=width // 9)), fontsize="large")
    return fig, axes


def draw_lines(ax, series: Mapping[str, tuple[Sequence[float], Sequence[float]]], *,
               x_label: str, y_label: str, title: str | None = None,
               x_ticks: Sequence[float] | None = None, log_x: bool = False,
               log_y: bool = False, y_lim: tuple[float, float] | None = None) -> None:
    """One line per series (``name: (xs, ys)``), markers when the points are few; a log y
    axis (``log_y``) does not start at zero."""
    if not series:
        raise ValueError("no series to plot")
    for name, (xs, ys) in series.items():
        if len(xs) != len(ys):
            raise ValueError(f"series {name!r}: {len(xs)} x values, {len(ys)} y values")
        ax.plot(xs, ys, label=name, linewidth=2, marker="o" if len(xs) <= 20 else None)
    if log_x:
        ax.set_xscale("log", base=2)
    if x_ticks is not None:
        from matplotlib.ticker import NullLocator

        ax.set_xticks(list(x_ticks), labels=[f"{t:g}" for t in x_ticks])
        ax.xaxis.set_minor_locator(NullLocator())
    if log_y:
        ax.set_yscale("log")
    _finish(ax, x_label, y_label, title, y_lim, log_y=log_y)


def draw_bars(ax, groups: Sequence[str], series: Mapping[str, Sequence[float]], *,
              y_label: str, x_label: str | None = None, title: str | None = None,
              value_format: str = "{:.1f}", y_lim: tuple[float, float] | None = None) -> None:
    """Grouped bars: one group per ``groups`` entry, one bar per series in each, its
    value written on top."""
    if not series:
        raise ValueError("no series to plot")
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series.items()):
        if len(values) != len(groups):
            raise ValueError(f"series {name!r}: {len(values)} values for {len(groups)} groups")
        xs = [g - 0.4 + width * (k + 0.5) for g in range(len(groups))]
        bars = ax.bar(xs, values, width * 0.9, label=name)
        ax.bar_label(bars, labels=[value_format.format(v) for v in values], padding=2,
                     fontsize="small")
    ax.set_xticks(range(len(groups)), labels=list(groups))
    _finish(ax, x_label, y_label, title, y_lim, legend=len(series) > 1)
    ax.grid(axis="x", visible=False)


def _finish(ax, x_label, y_label, title, y_lim, legend: bool = True,
            log_y: bool = False) -> None:
    if x_label:
        ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    if title:
        ax.set_title(title)
    if y_lim is not None:
        ax.set_ylim(*y_lim)
    elif not log_y:
        ax.margins(y=0.12)
        ax.set_ylim(bottom=0)
    ax.grid(True, color="0.88", linewidth=0.8)
    ax.set_axisbelow(True)
    if legend:
        ax.legend(loc="best", fontsize="small", framealpha=0.9)


def _file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file (0666 less the umask, 0644 under the
    usual umask 022): a plot is as readable as the JSON beside it, not mkstemp's 0600."""
    try:
        with open("/proc/self/status") as status:  # the umask, without changing it
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o644


def save(fig, path) -> None:
    """Write ``fig`` as a PNG at ``path``, atomically, mode 0666 less the umask (as a
    JSON file written beside it)."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", suffix=".png.tmp")
    try:
        os.fchmod(fd, _file_mode())
        with os.fdopen(fd, "wb") as out:
            fig.savefig(out, format="png", dpi=DPI)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def line_chart(path, *, title: str, x_label: str, y_label: str,
               series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
               x_ticks: Sequence[float] | None = None, log_x: bool = False,
               y_lim: tuple[float, float] | None = None, width: int = WIDTH,
               height: int = HEIGHT) -> None:
    """One panel of lines, written to ``path``."""
    fig, (ax,) = figure(title=title, width=width, height=height)
    draw_lines(ax, series, x_label=x_label, y_label=y_label, x_ticks=x_ticks, log_x=log_x,
               y_lim=y_lim)
    save(fig, path)


def bar_chart(path, *, title: str, y_label: str, groups: Sequence[str],
              series: Mapping[str, Sequence[float]], x_label: str | None = None,
              value_format: str = "{:.1f}", width: int = WIDTH, height: int = HEIGHT) -> None:
    """One panel of grouped bars, written to ``path``."""
    fig, (ax,) = figure(title=title, width=width, height=height)
    draw_bars(ax, groups, series, y_label=y_label, x_label=x_label, value_format=value_format)
    save(fig, path)

