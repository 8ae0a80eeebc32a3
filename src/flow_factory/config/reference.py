"""The config reference, generated from the schema: every key with its type, default and meaning.

    python -m flow_factory.config.reference            # rewrites docs/config-reference.md
    python -m flow_factory.config.reference --check    # exit 1 if the file differs from the schema

The reference is read from the pydantic models (``Config`` and its sections), whose
fields are declared with ``setting(default, description)``: the descriptions are the
documentation, so the page cannot drift from the code. tests/test_docs.py fails when the
committed page differs from this output, or when a field has no description.
Imports no torch, like the rest of ``config/``.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from .rewards import RewardConfig
from .schema import Config

DEFAULT_OUT = Path("docs") / "config-reference.md"
COMMAND = "python -m flow_factory.config.reference"

HEADER = f"""# Config reference

Generated from the schema in `src/flow_factory/config/` by `{COMMAND}`;
do not edit by hand. `tests/test_docs.py` fails when this page and the schema disagree, and
when a key has no description.

A config is one YAML file; any key can be overridden on the command line as
`section.key=value` (`ff-train run.yaml train.learning_rate=1e-4`). Every key is checked
before anything loads: an unknown key, a wrong type or a value out of range is an error
naming the key. `ff-train --print-config run.yaml` prints the resolved config, every default
filled in. A default of `null` is resolved when the config loads, as the description says.
"""

REWARD_NOTE = """Each entry of `rewards` (and of `eval_rewards`) is a mapping. Keys that are not listed
here are collected into `kwargs` and passed to the reward class's constructor, so a
misspelt option is caught by that constructor's signature.
"""


def sections() -> Iterator[tuple[str, str, str, type[BaseModel]]]:
    """(heading, key prefix, description, model) of every table on the page, in file order."""
    top = {name: f for name, f in Config.model_fields.items() if _section_model(f) is None}
    yield "Top level", "", "Keys at the top of the file", _Subset(Config, top)
    for name, field in Config.model_fields.items():
        model = _section_model(field)
        if model is not None and model is not RewardConfig:
            yield f"`{name}`", f"{name}.", field.description or "", model
            for inner, inner_field in model.model_fields.items():  # a list of entries inside (data.datasets)
                entry = _section_model(inner_field)
                if entry is not None:
                    yield f"`{name}.{inner}` entries", f"{name}.{inner}[].", inner_field.description or "", entry
    yield ("`rewards` and `eval_rewards` entries", "rewards[].", Config.model_fields["rewards"].description or "",
           RewardConfig)


class _Subset:
    """Some fields of a model, shown as one table."""

    def __init__(self, model: type[BaseModel], fields: dict[str, FieldInfo]):
        self.model, self.model_fields = model, fields


def _section_model(field: FieldInfo) -> type[BaseModel] | None:
    """The section model a field holds (directly, or as a list / optional list of it), else None."""
    for candidate in _flatten(field.annotation):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _flatten(annotation) -> list:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, list, typing.Annotated):
        return [leaf for arg in typing.get_args(annotation) for leaf in _flatten(arg)]
    return [annotation]


# ---------------------------------------------------------------------- types


def _constraints(metadata) -> list[str]:
    out = []
    for item in metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            value = getattr(item, attr, None)
            if isinstance(item, annotated_types.BaseMetadata) and value is not None:
                out.append(f"{sign} {value:g}")
    return out


def type_name(annotation, metadata=()) -> str:
    """A type as a reader writes it: ``int > 0``, ``'lora' | 'full'``, ``list[int] | null``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0], [*args[1:], *metadata])
    if origin is typing.Literal:
        return " | ".join(_yaml_scalar(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        # a constraint given to setting() (gt=0 on ``float | None``) bounds the non-null part
        parts = [type_name(a, metadata) for a in args if a is not type(None)]
        if type(None) in args:
            parts.append("null")
        return " | ".join(parts)
    if origin is list:
        return f"list[{type_name(args[0])}]" if args else "list"
    if origin is dict:
        return "mapping"
    if annotation is typing.Any:
        return "any"
    name = {int: "int", float: "float", str: "str", bool: "bool"}.get(annotation, getattr(annotation, "__name__",
                                                                                          str(annotation)))
    bounds = _constraints(metadata)
    return f"{name} {' and '.join(bounds)}" if bounds else name


def _yaml_scalar(value) -> str:
    if isinstance(value, float):
        return repr(value)  # 1e-08, 0.0001: the loader reads both as floats
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text.removesuffix("...").strip()  # a plain scalar ends its one-line document with '...'


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return "(section)" if isinstance(value, BaseModel) else _yaml_scalar(value)
    if field.default is PydanticUndefined:
        return "required"
    return _yaml_scalar(field.default)


# ---------------------------------------------------------------------- page


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(prefix: str, model) -> list[str]:
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if _section_model(field) is not None:
            continue  # a section of its own
        key = f"{prefix}{name}"
        kind = type_name(field.annotation, field.metadata)
        rows.append(f"| `{key}` | `{_cell(kind)}` | `{_cell(default_text(field))}` | {_cell(field.description or '')} |")
    return rows


def render() -> str:
    """The whole page, as the generator writes it."""
    lines = [HEADER.rstrip(), ""]
    for heading, prefix, description, model in sections():
        lines += [f"## {heading}", ""]
        if description:
            lines += [description[0].upper() + description[1:] + ".", ""]
        if model is RewardConfig:
            lines += [REWARD_NOTE.rstrip(), ""]
        lines += _table(prefix, model)
        lines.append("")
    return "\n".join(lines)


def undocumented_fields() -> list[str]:
    """Dotted names of the schema fields whose description is empty (``rewards[].name``: a reward entry's)."""
    missing = [name for name, field in Config.model_fields.items() if not (field.description or "").strip()]
    for _heading, prefix, _description, model in sections():
        if prefix:
            missing += [f"{prefix}{name}" for name, field in model.model_fields.items()
                        if not (field.description or "").strip()]
    return missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="Write the config reference from the schema.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"where to write it (default {DEFAULT_OUT})")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the file is not current")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.is_file() else None
        if current != text:
            print(f"{args.out} is not current; run: {COMMAND}", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
