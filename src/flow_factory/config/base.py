"""What every config section shares: strict types, no unknown keys, documented fields.

Strict mode on purpose: a YAML ``true`` must not become the integer 1 and ``4.7``
must not become 4. Numbers written as integers are still accepted for float
fields (``kl_beta: 0``).
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

# error type of the problems this package raises itself: their message is final
PROBLEM = "flow_factory_config"


class Section(BaseModel):
    # inf / nan would pass every range check and then poison the run
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


def setting(default: Any = ..., description: str = "", *, expects: str | None = None, **constraints) -> Any:
    """A documented field. ``expects`` overrides the generated "expected ..." phrase in errors."""
    extra = {"expects": expects} if expects else None
    return Field(default, description=description, json_schema_extra=extra, **constraints)


def problem(message: str) -> PydanticCustomError:
    """An error whose message pydantic passes through untouched."""
    return PydanticCustomError(PROBLEM, "{message}", {"message": message})


def close_match(word: str, choices, cutoff: float = 0.6) -> str | None:
    found = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=cutoff)
    return found[0] if found else None


def show(value: Any) -> str:
    """A value as the user wrote it in YAML, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


# Every spelling of a float dtype a config or a reward option may use, to torch's name for it:
# the one table (rewards' parse_dtype and the trainer's mixed precision read it too).
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float": "float32",
               "float16": "float16", "fp16": "float16", "half": "float16",
               "bfloat16": "bfloat16", "bf16": "bfloat16", "float64": "float64", "fp64": "float64"}


def canonical_choice(value: Any, aliases: dict[str, str]) -> Any:
    """Map a spelling to its canonical form, ignoring case and ``_`` vs ``-`` vs ``.``;
    anything unknown is returned unchanged so the Literal check reports it."""
    if not isinstance(value, str):
        return value
    key = value.strip().lower().replace("_", "-").replace(".", "-")
    for alias, target in aliases.items():
        if key == alias.lower().replace("_", "-").replace(".", "-"):
            return target
    return value


def as_list(value: Any) -> Any:
    """Tuples from Python callers behave like YAML lists."""
    return list(value) if isinstance(value, tuple) else value


def resolution_pair(value: int | list[int] | None) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, int):
        return (value, value)
    return (value[0], value[-1])


def check_resolution(value: Any) -> Any:
    """``resolution`` is ``512``, ``[512]`` or ``[height, width]``, all positive."""
    value = as_list(value)
    if isinstance(value, list):
        if not 1 <= len(value) <= 2:
            raise problem(f"expected an integer or [height, width], got a list of {len(value)} values {show(value)}")
        sizes = value
    else:
        sizes = [value]
    for size in sizes:
        if isinstance(size, int) and not isinstance(size, bool) and size <= 0:
            raise problem(f"sizes must be positive, got {show(value)}")
    return value


def size_problem(key: str, value: int | list[int], factor: int, who: str, why: str) -> str | None:
    """The error line when a resolution ``value`` is not a multiple of ``factor``, else None:
    ``train.resolution: sd3-5 needs height and width in multiples of 16 (VAE x8, ...), got 72;
    nearest valid: 64 or 80``. Shared by the config check and the pre-load check of a pipeline folder."""
    sizes = value if isinstance(value, list) else [value]
    if all(size % factor == 0 for size in sizes):
        return None
    below = [size // factor * factor for size in sizes]
    above = [-(-size // factor) * factor for size in sizes]
    options = [below, above] if all(below) else [above]  # 0 is no size: round up only
    nearest = " or ".join(show(o if isinstance(value, list) else o[0]) for o in options)
    return (f"{key}: {who} needs height and width in multiples of {factor} ({why}), got {show(value)}; "
            f"nearest valid: {nearest}")
