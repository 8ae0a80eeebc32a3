"""Reward curves as a PNG, drawn with PIL so plotting needs no extra dependency."""

from __future__ import annotations

from PIL import Image, ImageDraw, ImageFont

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]


def plot_curves(series: dict[str, list[tuple[int, float]]], title: str, size=(640, 400)) -> Image.Image:
    """Line plot of ``{name: [(epoch, value), ...]}`` with axes labelled by their ranges."""
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
        if len(pixels) > 1:
            draw.line(pixels, fill=colour, width=2)
        for px, py in pixels:
            draw.ellipse([px - 2, py - 2, px + 2, py + 2], fill=colour)
        draw.text((left + 8, top + 6 + 12 * i), name, fill=colour, font=font)
    return img
