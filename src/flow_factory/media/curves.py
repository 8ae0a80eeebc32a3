"""The reward curve: every reward series per epoch on one matplotlib figure, with labelled axes.

``curve_figure`` builds the figure (x = epoch, y = reward, a legend naming each series);
``plot_curves`` renders it as an image for the run folder's ``reward_curve.png``. The
figure is drawn by matplotlib's Agg canvas directly, without pyplot: no display, and no
global state that a user's own plotting could see.

``plot_curves`` draws in a process of its own (``CurveDrawer``), started at the first curve
and kept for the next: matplotlib's import and first drawing add about 33 MB to the process
that holds them, and in a trainer that is the run's peak RSS (its save comes after the
epochs' busiest moment). This file is that process's program too (``serve``).
"""

from __future__ import annotations

import atexit
import json
import subprocess
import sys
import threading
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


def render(series: dict[str, list[tuple[int, float]]], title: str, size=(640, 400)) -> Image.Image:
    """``curve_figure``, drawn in this process: an RGB image of ``size`` pixels."""
    fig = curve_figure(series, title, size)
    fig.canvas.draw()
    return Image.frombuffer("RGBA", fig.canvas.get_width_height(), fig.canvas.buffer_rgba()).convert("RGB")


def plot_curves(series: dict[str, list[tuple[int, float]]], title: str, size=(640, 400)) -> Image.Image:
    """``render``, in the drawing process: matplotlib is never imported by this one."""
    return DRAWER.draw(series, title, size)


class CurveDrawer:
    """A child process that runs ``serve``: a request is a line of JSON (series, title, size), the reply a header
    line (``rgb WIDTH HEIGHT LENGTH``, or ``error LENGTH`` with the child's traceback) and that many bytes. It
    starts at the first request, again if it has ended, in a session of its own (a Ctrl-C or a job's SIGTERM to
    the trainer's process group is the trainer's to handle, with a checkpoint that draws the curve), and ends when
    its stdin closes: at this process's exit, whichever way it ends."""

    def __init__(self):
        self.process: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def draw(self, series: dict[str, list[tuple[int, float]]], title: str, size) -> Image.Image:
        request = json.dumps({"series": series, "title": title, "size": list(size)}).encode() + b"\n"
        with self.lock:
            if self.process is None or self.process.poll() is not None:
                self.process = self._start()
            try:
                self.process.stdin.write(request)
                self.process.stdin.flush()
                kind, *fields = self.process.stdout.readline().decode().split()
                body = self.process.stdout.read(int(fields[-1]))
            except (BrokenPipeError, ValueError) as err:  # ValueError: no header, the child has ended
                raise RuntimeError(f"the reward curve's drawing process ended (exit status "
                                   f"{self.process.wait()})") from err
        if kind == "error":
            raise RuntimeError(f"drawing the reward curve failed in its process:\n{body.decode()}")
        width, height, _ = map(int, fields)
        return Image.frombytes("RGB", (width, height), body)

    def _start(self) -> subprocess.Popen:
        # this file run by path (its package's __init__ would import torch), seeing the modules this process sees
        code = "import runpy, sys; sys.path[:] = sys.argv[2:]; runpy.run_path(sys.argv[1], run_name='__main__')"
        process = subprocess.Popen([sys.executable, "-c", code, __file__, *sys.path], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, start_new_session=True)
        atexit.register(self._close, process)
        return process

    @staticmethod
    def _close(process: subprocess.Popen) -> None:
        if process.poll() is None:
            process.stdin.close()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


DRAWER = CurveDrawer()


def serve() -> None:
    """The drawing process's loop: ``render`` each request until stdin closes."""
    import traceback

    replies = sys.stdout.buffer
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            image = render({k: [tuple(p) for p in v] for k, v in request["series"].items()}, request["title"],
                           tuple(request["size"]))
            body = image.tobytes()
            header = f"rgb {image.width} {image.height} {len(body)}"
        except Exception:  # noqa: BLE001 - the trainer raises it, with this traceback
            body = traceback.format_exc().encode()
            header = f"error {len(body)}"
        try:
            replies.write(header.encode() + b"\n" + body)
            replies.flush()
        except BrokenPipeError:  # the trainer has ended mid-request: end quietly, its own error is the one to read
            return


if __name__ == "__main__":
    serve()
