"""What a model needs of a split's rows, checked before the model loads: the condition files it
takes (and no others), and the size it generates at when ``auto_resize`` follows them."""

from __future__ import annotations

import math
from fractions import Fraction

from .prompts import MEDIA_KEYS, PromptFileError, PromptItem


def check_conditions(items: list[PromptItem], model_type: str, takes: tuple[str, ...],
                     per_sample: tuple[int, int], note: str = "") -> None:
    """PromptFileError naming the row unless every row gives the condition files ``model_type`` takes
    (``takes``: "images" / "videos"; ``per_sample``: how many, fewest and most) and no other kind; ``note``
    ends the message about a count (why this checkpoint takes that many)."""
    for item in items:
        where = item.source or f"prompt {item.prompt!r}"
        for kind in ("images", "videos"):
            count = len(getattr(item, kind))
            if kind not in takes and count:
                what = f"condition {takes[0]}" if takes else "text alone"
                raise PromptFileError(f"{where}: {model_type} generates from {what}, but the row names {count} "
                                      f"condition {kind} ('{MEDIA_KEYS[kind][0]}'); remove them, or use a model that "
                                      "takes them")
        for kind in takes:
            count, (low, high) = len(getattr(item, kind)), per_sample
            if not low <= count <= high:
                wanted = str(low) if low == high else f"{low} to {high}"
                keys = "' / '".join(MEDIA_KEYS[kind])
                raise PromptFileError(f"{where}: {model_type} takes {wanted} condition {kind} per prompt "
                                      f"('{keys}'), the row names {count}{note}")

def check_batchable(items: list[PromptItem], call_shape, batch_size: int, key: str) -> None:
    """PromptFileError naming the first row that differs unless every row's ``call_shape(item)`` (what the samples
    of one transformer call must share, for a model whose conditions keep their own sizes) agrees, or
    ``batch_size`` is 1 (``key``: the config key to name); or naming the row whose shape ``call_shape`` refuses."""
    shaped = []
    for item in items:
        try:
            shaped.append((item, call_shape(item)))
        except ValueError as e:
            raise PromptFileError(f"{item.source}: {e}") from None
    if batch_size == 1:
        return
    for item, shape in shaped:
        if shape != shaped[0][1]:
            raise PromptFileError(
                f"{item.source}: {key} is {batch_size}, and the samples of one transformer call must have condition "
                f"images that come out the same sizes, but this row's give {shape} where {shaped[0][0].source}'s give "
                f"{shaped[0][1]}; set {key} to 1, or give every row condition images of the same sizes")


def generated_size(items: list[PromptItem], resolution: tuple[int, int], auto_resize: bool, factor: int,
                   key: str) -> tuple[int, int]:
    """The (height, width) a split is generated at: ``resolution``, or with ``auto_resize`` the aspect ratio
    of its condition images (each row's last one, as Flow-Factory's) at the area of ``resolution``, in
    multiples of ``factor``. One run's samples stack in one tensor, so the split's conditions must share one
    aspect ratio then (PromptFileError naming the first row that differs; ``key``: the config key to name)."""
    if not auto_resize:
        return resolution
    shaped = [(item, (item.images or item.videos)[-1]) for item in items if item.images or item.videos]
    if not shaped:
        return resolution
    first_item, first = shaped[0]
    ratio = Fraction(first.size[1], first.size[0])
    for item, file in shaped:
        if Fraction(file.size[1], file.size[0]) != ratio:
            raise PromptFileError(
                f"{item.source}: {key} generates at the condition's aspect ratio, and the samples of a run share "
                f"one size, but {file.path.name} is {file.size[0]}x{file.size[1]} (width x height) where "
                f"{first.path.name} ({first_item.source}) is {first.size[0]}x{first.size[1]}; set {key}: false "
                "(generate at resolution), or give conditions of one aspect ratio")
    area = resolution[0] * resolution[1]
    height = max(factor, round(math.sqrt(area * ratio) / factor) * factor)
    width = max(factor, round(math.sqrt(area / ratio) / factor) * factor)
    return height, width
