"""Turn pydantic's validation errors into one line per problem that a user can act on:
``train.group_size: expected a positive integer, got 'four'``.

pydantic reports where it failed (a ``loc`` such as ``('rewards', 0, 'weight')`` or,
inside unions, ``('train', 'resolution', 'list[int]', 1)``); we walk the schema along
that path to the field, and describe what the field accepts from its annotation.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from .base import PROBLEM, close_match, show
from .compat import MOVED, NOT_HERE

PLURALS = {int: "integers", float: "numbers", str: "strings"}


@dataclass
class Location:
    parts: list  # path as keys and list indices
    field: FieldInfo | None  # the field the path ends on, None for an unknown key or the root
    parent: type[BaseModel]  # the model that owns the last key
    at_model: bool = False  # the path ends on a whole section or list entry, not a leaf value

    @property
    def path(self) -> str:
        return format_path(self.parts)


def format_path(parts) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def model_inside(annotation) -> tuple[type[BaseModel] | None, bool]:
    """The section / entry model an annotation holds, and whether it is a list of them."""
    args = [a for a in get_args(annotation) if a is not type(None)] if is_union(annotation) else [annotation]
    for arg in args:
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg, False
        if get_origin(arg) is list and get_args(arg) and isinstance(get_args(arg)[0], type) \
                and issubclass(get_args(arg)[0], BaseModel):
            return get_args(arg)[0], True
    return None, False


def locate(root: type[BaseModel], loc: tuple) -> Location:
    model, parts, field = root, [], None
    i = 0
    while i < len(loc):
        key = loc[i]
        if not isinstance(key, str) or key not in model.model_fields:
            if isinstance(key, str):
                parts.append(key)
            return Location(parts, None, model)
        field = model.model_fields[key]
        parts.append(key)
        i += 1
        inner, is_list = model_inside(field.annotation)
        if inner is None:
            break  # a leaf; the rest of loc is union tags and list indices inside the value
        if is_list:
            if i >= len(loc) or not isinstance(loc[i], int):
                break
            parts.append(loc[i])
            i += 1
        if i >= len(loc):
            return Location(parts, field, model, at_model=True)
        model, field = inner, None
    return Location(parts, field, model)


def is_union(tp) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def bounds(meta) -> dict[str, Any]:
    found = {}
    for m in meta:
        for name in ("gt", "ge", "lt", "le"):
            if getattr(m, name, None) is not None:
                found[name] = getattr(m, name)
    return found


def describe_number(kind: str, meta) -> str:
    b = bounds(meta)
    article = "an" if kind == "integer" else "a"
    if b == {"gt": 0}:
        return f"a positive {kind}"
    if b == {"ge": 0} and kind == "integer":
        return "a non-negative integer"
    if ("ge" in b or "gt" in b) and ("le" in b or "lt" in b):
        lo, hi = ("[", b["ge"]) if "ge" in b else ("(", b["gt"]), (b["le"], "]") if "le" in b else (b["lt"], ")")
        return f"{article} {kind} in {lo[0]}{lo[1]}, {hi[0]}{hi[1]}"
    limits = [f"{op} {b[name]}" for name, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")) if name in b]
    return f"{article} {kind}" + (f" {' and '.join(limits)}" if limits else "")


def describe(tp, meta=()) -> str:
    """What an annotation accepts, in words."""
    origin = get_origin(tp)
    if origin is Annotated:
        base, *extra = get_args(tp)
        return describe(base, (*meta, *extra))
    if is_union(tp):
        args = get_args(tp)
        words = [describe(a, meta) for a in args if a is not type(None)]
        return " or ".join(words) + (" or null" if type(None) in args else "")
    if origin is Literal:
        values = ", ".join(repr(v) for v in get_args(tp))
        return values if len(get_args(tp)) == 1 else f"one of {values}"
    if origin is list:
        (inner,) = get_args(tp) or (Any,)
        return f"a list of {PLURALS.get(inner, describe(inner))}"
    if tp is bool:
        return "true or false"
    if tp is int:
        return describe_number("integer", meta)
    if tp is float:
        return describe_number("number", meta)
    if tp is str:
        return "a string"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "a mapping of settings"
    if tp is dict or origin is dict:
        return "a mapping"
    return str(tp)


def literal_choices(tp) -> list:
    if get_origin(tp) is Literal:
        return list(get_args(tp))
    return [c for arg in get_args(tp) for c in literal_choices(arg)]


def expected(field: FieldInfo) -> str:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    return extra.get("expects") or describe(field.annotation, field.metadata)


def lookup(data, parts) -> tuple[bool, Any]:
    for p in parts:
        try:
            data = data[p]
        except (KeyError, IndexError, TypeError):
            return False, None
    return True, data


def unknown_key(where: Location) -> str:
    path, key = where.path, where.parts[-1]
    section = format_path(where.parts[:-1])
    if path in MOVED:
        return f"{path}: unknown key; did you mean {MOVED[path]}? (the setting moved there)"
    if path in NOT_HERE:
        return f"{path}: not taken here: {NOT_HERE[path]}"
    names = list(where.parent.model_fields)
    match = close_match(key, names)
    if match:
        return f"{path}: unknown key; did you mean {format_path([*where.parts[:-1], match])}?"
    scope = f"of {section}" if section else "at the top level"
    return f"{path}: unknown key; valid keys {scope}: {', '.join(names)}"


def message_for(where: Location, errors: list[dict], data) -> list[str]:
    types_ = [e["type"] for e in errors]
    path = where.path
    if "extra_forbidden" in types_:
        return [unknown_key(where)]
    if "missing" in types_:
        description = where.field.description if where.field is not None else ""
        return [f"{path}: required key is missing" + (f" ({description})" if description else "")]
    own = [e for e in errors if e["type"] in (PROBLEM, "value_error", "assertion_error")]
    if own:
        lines = []
        for e in own:
            text = e["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
            lines += text.split("\n") if not path else [f"{path}: {text}"]
        return lines
    found, value = lookup(data, where.parts)
    if not found:
        value = errors[0].get("input")
    if where.field is None or where.at_model:
        return [f"{path or 'config'}: expected a mapping of settings, got {show(value)}"]
    text = f"{path}: expected {expected(where.field)}, got {show(value)}"
    match = close_match(value, literal_choices(where.field.annotation)) if isinstance(value, str) else None
    if match:
        text += f"; did you mean {match!r}?"
    return [text]


def explain(err: ValidationError, root: type[BaseModel], data) -> list[str]:
    """One line per problem, in the order pydantic found them."""
    grouped: dict[tuple, tuple[Location, list[dict]]] = {}
    for e in err.errors():
        where = locate(root, tuple(e["loc"]))
        grouped.setdefault(tuple(where.parts), (where, []))[1].append(e)
    lines = []
    for where, errors in grouped.values():
        lines += message_for(where, errors, data)
    return lines
