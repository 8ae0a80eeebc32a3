"""YAML file + ``section.key=value`` overrides -> validated ``Config``.

Two PyYAML habits are corrected here because they silently change a run:
``1e-5`` (no dot) is a float, not the string "1e-5", and a key written twice in one
mapping with two different values is an error instead of the last one quietly winning
(written twice with one value, as some of Flow-Factory's examples do, it is that value). For the same reason an
override with nothing after ``=`` is an error, not null: it is what an unset shell
variable gives.
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path
from typing import Any, Iterable

import yaml

from ..class_path import look_beside_config, missing_module
from .errors import ConfigError
from .schema import Config


class ConfigYAMLLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 exponent floats and duplicate-key detection."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, tuple[int, Any]] = {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=True)
            value = self.construct_object(value_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen and seen[key][1] != value:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice with different values (lines {seen[key][0]} and "
                    f"{line}: {seen[key][1]!r} and {value!r}); keep the one you mean", key_node.start_mark)
            seen[key] = (line, value)
        return super().construct_mapping(node, deep=deep)


ConfigYAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=ConfigYAMLLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = err.problem or err.context or "invalid YAML"
        raise ConfigError(f"{source}{where}: invalid YAML: {what}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: invalid YAML: {err}") from None


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    if not path.is_file():
        raise ConfigError(f"config path is not a file: {path}")
    data = parse_yaml(path.read_text(encoding="utf-8"), str(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings at the top level, got {type(data).__name__}")
    return data


def apply_override(data: dict, override: str) -> None:
    """Set ``a.b.c=value`` in ``data`` in place; list entries are addressed by index (``rewards.0.weight``)."""
    key, sep, raw = override.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not key or not all(parts):
        raise ConfigError(f"override {override!r}: expected section.key=value, e.g. train.learning_rate=1e-5")
    if not raw.strip():
        # `train.learning_rate=$LR` with LR unset arrives as `train.learning_rate=`; reading that as null
        # would quietly fall back to the default, so null must be written out
        raise ConfigError(f"override {override!r}: no value after '=' (an unset shell variable?); "
                          f"give a value, or write {key}=null for null")
    value = parse_yaml(raw, f"override {override!r}")
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        where = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            node = node[list_index(node, part, where, override)]
        elif isinstance(node, dict):
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
        else:
            raise ConfigError(f"override {override!r}: {'.'.join(parts[:depth])} is a value, not a section")
    last = parts[-1]
    if isinstance(node, list):
        node[list_index(node, last, key, override)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError(f"override {override!r}: {'.'.join(parts[:-1])} is a value, not a section")


def list_index(items: list, part: str, where: str, override: str) -> int:
    if not part.lstrip("-").isdigit():
        raise ConfigError(f"override {override!r}: {where.rpartition('.')[0]} is a list; "
                          f"address an entry by its index, e.g. {where.rpartition('.')[0]}.0")
    index = int(part)
    if not -len(items) <= index < len(items):
        raise ConfigError(f"override {override!r}: {where} is out of range; the list has {len(items)} entries")
    return index


def entries_as_lists(data: dict) -> dict:
    """``rewards: {...}`` is a list of one entry, so ``rewards.0.weight=...`` can address it."""
    for key in ("rewards", "eval_rewards"):
        if isinstance(data.get(key), dict):
            data[key] = [data[key]] if data[key] else []
    return data


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> Config:
    """Read ``path``, apply ``section.key=value`` overrides (values parsed as YAML), validate.

    Class paths (``model.model_type``, ``rewards[].reward_model``) are looked up in the config's
    folder first, then the working directory, then the installed packages (``flow_factory.class_path``):
    from here on for this process, so the run that follows imports them from there too.
    Raises ``ConfigError`` for every problem, naming the file and the key.
    """
    if isinstance(overrides, str):
        overrides = [overrides]  # a lone string would otherwise be read character by character
    data = entries_as_lists(read_yaml(path))
    for override in overrides:
        apply_override(data, override)
    look_beside_config(path)
    return Config.from_dict(data, source=str(path))


def reward_modules_missing(cfg: Config) -> list[str]:
    """A line per reward whose class path's module is nowhere to be found (nothing is imported: the module
    runs when the run builds the reward). Not a schema check: ``parse_config`` takes entries whose module
    the caller imports later, and ff-sample loads a run's saved config without scoring anything."""
    problems = []
    for key in ("rewards", "eval_rewards"):
        for index, entry in enumerate(getattr(cfg, key) or []):
            if "." in entry.reward_model or ":" in entry.reward_model:  # a registered name has neither
                try:
                    message = missing_module(entry.reward_model, "reward class path")
                except ValueError as e:  # "my_rewards." names no class
                    message = str(e)
                if message:
                    problems.append(f"{key}[{index}].reward_model: {message}")
    return problems


def load_config_for_cli(prog: str, path: str | Path, overrides: Iterable[str] = ()) -> Config | None:
    """``load_config`` for a command that scores (ff-train, ff-eval), so a reward's module found nowhere is
    a config error too: None after printing ``prog: config error: ...`` to stderr."""
    try:
        cfg = load_config(path, overrides)
        missing = reward_modules_missing(cfg)
        if missing:
            raise ConfigError(missing, source=str(path))
    except ConfigError as err:
        print(f"{prog}: config error: {err}", file=sys.stderr)
        return None
    for note in cfg.notes():
        print(f"{prog}: note: {note}", file=sys.stderr)
    return cfg


def parse_config(data: dict, overrides: Iterable[str] = ()) -> Config:
    """Like ``load_config`` for a mapping already in memory (tests, notebooks)."""
    if isinstance(overrides, str):
        overrides = [overrides]
    data = entries_as_lists(copy.deepcopy(dict(data)))
    for override in overrides:
        apply_override(data, override)
    return Config.from_dict(data)
