"""Reward curves as a PNG, drawn with PIL so plotting needs no extra dependency."""

from __future__ import annotations

from PIL import Image, ImageDraw, ImageFont

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]
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


def _faint(colour: str, keep: float = 0.3) -> tuple[int, int, int]:
    rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    return tuple(round(255 - (255 - c) * keep) for c in rgb)


def plot_curves(series: dict[str, list[tuple[int, float]]], title: str, size=(640, 400)) -> Image.Image:
    """Line plot of ``{name: [(epoch, value), ...]}`` with axes labelled by their ranges; a series
    of more than SMOOTH_ABOVE points is drawn faint under its trailing mean."""
    w, h = size
    left, right, top, bottom = 60, 20, 30, 40
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    points = [p for pts in series.values() for p in pts]
    draw.text((left, 8), title, fill="black", font=font)
    if not points:
        return img
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1e-6)

    def to_px(x, y):
        return (left + (x - x0) / (x1 - x0) * (w - left - right),
                h - bottom - (y - y0) / (y1 - y0) * (h - top - bottom))

    draw.rectangle([left, top, w - right, h - bottom], outline="black")
    draw.text((4, top), f"{y1:.3g}", fill="black", font=font)
    draw.text((4, h - bottom - 10), f"{y0:.3g}", fill="black", font=font)
    draw.text((left, h - bottom + 4), f"epoch {x0}", fill="black", font=font)
    draw.text((w - right - 60, h - bottom + 4), f"epoch {x1}", fill="black", font=font)
    for i, (name, pts) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        pixels = [to_px(x, y) for x, y in pts]
        if len(pts) > SMOOTH_ABOVE:  # per-epoch rewards are noisy: the trend is what a reader wants
            window = max(5, len(pts) // 20)
            draw.line(pixels, fill=_faint(colour), width=1)
            smooth = trailing_mean([y for _, y in pts], window)
            draw.line([to_px(x, y) for (x, _), y in zip(pts, smooth)], fill=colour, width=3)
            name = f"{name} (mean of {window} epochs)"
        else:
            if len(pixels) > 1:
                draw.line(pixels, fill=colour, width=2)
            for px, py in pixels:
                draw.ellipse([px - 2, py - 2, px + 2, py + 2], fill=colour)
        draw.text((left + 8, top + 6 + 12 * i), name, fill=colour, font=font)
    return img
