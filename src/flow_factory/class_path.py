"""A class named by its path in a config: ``package.module.ClassName`` or ``package.module:ClassName``.

How users bring their own rewards (``rewards[].reward_model``) and model adapters
(``model.model_type``). Imports nothing of its own, so the config can use it without torch.
"""

from __future__ import annotations

import difflib
import importlib


def split_class_path(path: str, label: str) -> tuple[str, str]:
    """``"pkg.mod:Class"`` or ``"pkg.mod.Class"`` -> ``("pkg.mod", "Class")``; ``label`` names the path
    in errors (``"reward class path"``)."""
    if ":" in path:
        module, _, attr = path.partition(":")
    else:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ValueError(f"{label} {path!r} must look like 'package.module.ClassName' "
                         f"or 'package.module:ClassName'")
    return module, attr


def import_class(path: str, label: str) -> object:
    """The object ``path`` names; ImportError saying which part is missing."""
    module_name, attr = split_class_path(path, label)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # a missing module vs. a module that exists but needs a package that is not installed
        missing = e.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise ImportError(f"{label} {path!r}: no module named {module_name!r}") from e
        raise ImportError(f"{label} {path!r}: module {module_name!r} was found but "
                          f"importing it failed: {e}") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(module) if not n.startswith("_"))
            hint = difflib.get_close_matches(part, public, n=3)
            raise ImportError(f"{label} {path!r}: module {module_name!r} has no attribute "
                              f"{attr!r}" + (f"; did you mean {hint}?" if hint else ""))
        obj = getattr(obj, part)
    return obj
