"""Reward names -> reward classes.

A config's ``reward_model`` is either a registered name (case-insensitive, as in
Flow-Factory: ``PickScore`` and ``pickscore`` are the same) or a class path,
``package.module.ClassName`` or ``package.module:ClassName``.

Built-in rewards register themselves with ``@register_reward("name")``. To find a
built-in without importing every reward module (and with them transformers,
open_clip, OCR engines, ...), the package's source files are scanned for that
decorator: resolving a name imports only the one module that defines it.
"""

from __future__ import annotations

import ast
import difflib
import importlib
from pathlib import Path

from .base import BaseRewardModel, GroupwiseRewardModel, PointwiseRewardModel

_PACKAGE = __name__.rsplit(".", 1)[0]  # flow_factory.rewards
_PACKAGE_DIR = Path(__file__).parent
# built-in rewards that live beside the package they belong to, found the same way
_BUILTIN_SOURCES = [(_PACKAGE_DIR, _PACKAGE),
                    (_PACKAGE_DIR.parent / "shapebench", _PACKAGE.rsplit(".", 1)[0] + ".shapebench")]

# lower-cased name -> "module:QualName"; filled by the decorator and the source scan
_REGISTRY: dict[str, str] = {}
_scanned = False


def register_reward(name: str):
    """Class decorator: make ``name`` usable as ``reward_model`` in a config."""

    def decorate(cls: type) -> type:
        path = f"{cls.__module__}:{cls.__qualname__}"
        key = name.lower()
        if _REGISTRY.get(key, path) != path:
            raise ValueError(f"reward name {name!r} is already registered to {_REGISTRY[key]}, "
                             f"cannot register {path}")
        _REGISTRY[key] = path
        return cls

    return decorate


def scan_registrations(package_dir: Path | str, package: str) -> dict[str, str]:
    """``{name: "package.module:Class"}`` for every ``@register_reward("name")`` class
    in the ``.py`` files under ``package_dir`` (sub-packages included), read as text,
    never imported."""
    found: dict[str, str] = {}
    for path in sorted(Path(package_dir).rglob("*.py")):
        module = ".".join([package, *path.relative_to(package_dir).with_suffix("").parts])
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except SyntaxError:
            continue  # a broken file fails loudly when (and only if) it is imported
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            for deco in node.decorator_list:
                if (isinstance(deco, ast.Call) and getattr(deco.func, "id", None) == "register_reward"
                        and deco.args and isinstance(deco.args[0], ast.Constant)
                        and isinstance(deco.args[0].value, str)):
                    found[deco.args[0].value.lower()] = f"{module}:{node.name}"
    return found


def registered_rewards() -> dict[str, str]:
    """Every known name and the class path it stands for."""
    global _scanned
    if not _scanned:
        for package_dir, package in _BUILTIN_SOURCES:
            for key, path in scan_registrations(package_dir, package).items():
                _REGISTRY.setdefault(key, path)
        _scanned = True
    return dict(_REGISTRY)


def _split_class_path(path: str) -> tuple[str, str]:
    if ":" in path:
        module, _, attr = path.partition(":")
    else:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ValueError(f"reward class path {path!r} must look like 'package.module.ClassName' "
                         f"or 'package.module:ClassName'")
    return module, attr


def _import_class(path: str) -> object:
    module_name, attr = _split_class_path(path)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # a missing module vs. a module that exists but needs a package that is not installed
        missing = e.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise ImportError(f"reward class path {path!r}: no module named {module_name!r}") from e
        raise ImportError(f"reward class path {path!r}: module {module_name!r} was found but "
                          f"importing it failed: {e}") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(module) if not n.startswith("_"))
            hint = difflib.get_close_matches(part, public, n=3)
            raise ImportError(f"reward class path {path!r}: module {module_name!r} has no attribute "
                              f"{attr!r}" + (f"; did you mean {hint}?" if hint else ""))
        obj = getattr(obj, part)
    return obj


def resolve_reward_class(name_or_path: str | type) -> type[BaseRewardModel]:
    """The reward class a config's ``reward_model`` names.

    Raises ValueError for an unknown name (listing the registered ones), ImportError
    for a class path whose module or attribute cannot be found, TypeError when the
    object found is not a reward model.
    """
    if isinstance(name_or_path, type):
        cls, shown = name_or_path, name_or_path.__qualname__
    else:
        shown = str(name_or_path).strip()
        registry = registered_rewards()
        if shown.lower() in registry:
            cls = _import_class(registry[shown.lower()])
        elif "." in shown or ":" in shown:
            cls = _import_class(shown)
        else:
            close = difflib.get_close_matches(shown.lower(), list(registry), n=3, cutoff=0.6)
            raise ValueError(
                f"unknown reward {shown!r}. Registered rewards: {sorted(registry)}"
                + (f"; did you mean {close[0]!r}?" if close else "")
                + ". A custom reward is given by its class path, e.g. 'my_package.rewards.MyReward'."
            )
    if not (isinstance(cls, type) and issubclass(cls, BaseRewardModel)):
        raise TypeError(f"reward {shown!r} resolves to {cls!r}, which is not a subclass of "
                        f"PointwiseRewardModel or GroupwiseRewardModel")
    if not issubclass(cls, (PointwiseRewardModel, GroupwiseRewardModel)):
        raise TypeError(f"reward {shown!r} ({cls.__qualname__}) must subclass PointwiseRewardModel "
                        f"or GroupwiseRewardModel, not BaseRewardModel directly")
    return cls

