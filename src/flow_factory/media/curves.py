"""The reward curve: every reward series per epoch on one matplotlib figure, with labelled axes.

``curve_figure`` builds the figure (x = epoch, y = reward, a legend naming each series);
``plot_curves`` renders it as an image for the run folder's ``reward_curve.png``. The
figure is drawn by matplotlib's Agg canvas directly, without pyplot: no display, and no
global state that a user's own plotting could see.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from PIL import Image

if TYPE_CHECKING:
    from matplotlib.figure import Figure

SMOOTH_ABOVE = 30  # a series with more points is drawn faint, under its trailing mean


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and the ``window - 1`` before it (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def curve_figure(series: dict[str, list[tuple[int, float]]], title: str, size=(640, 400)) -> Figure:
    """A line per ``{name: [(epoch, value), ...]}`` series; one of more than SMOOTH_ABOVE points
    (per-epoch rewards are noisy: the trend is what a reader wants) is drawn faint under its
    trailing mean, which the legend names with its window. ``size`` in pixels."""
    # matplotlib is imported when a curve is drawn: a second and 30 MB a process that draws none
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    dpi = 100
    fig = Figure(figsize=(size[0] / dpi, size[1] / dpi), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, points in series.items():
        epochs = [epoch for epoch, _ in points]
        values = [value for _, value in points]
        if len(points) > SMOOTH_ABOVE:
            window = max(5, len(points) // 20)
            (raw,) = ax.plot(epochs, values, linewidth=1, alpha=0.3)  # no label: not in the legend
            ax.plot(epochs, trailing_mean(values, window), color=raw.get_color(), linewidth=2,
                    label=f"{name} (mean of {window} epochs)")
        else:
            ax.plot(epochs, values, marker="o", markersize=3, linewidth=1.5, label=name)
    ax.set_title(title)
    ax.set_xlabel("epoch")
    ax.set_ylabel("reward")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # epochs are whole numbers
    ax.grid(alpha=0.3)
    if series:  # below the axes, where it hides no point
        fig.legend(loc="outside lower center", ncols=2, fontsize="small")
    return fig


def plot_curves(series: dict[str, list[tuple[int, float]]], title: str, size=(640, 400)) -> Image.Image:
    """``curve_figure``, drawn: an RGB image of ``size`` pixels."""
    fig = curve_figure(series, title, size)
    fig.canvas.draw()
    return Image.frombuffer("RGBA", fig.canvas.get_width_height(), fig.canvas.buffer_rgba()).convert("RGB")
