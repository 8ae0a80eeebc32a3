"""A class named by its path in a config: ``package.module.ClassName`` or ``package.module:ClassName``, or
a file's path and the class, ``path/to/my_reward.py:ClassName`` (Flow-Factory's reward help writes
``/path/to/your/model:class_name``; ``.py`` may be left out).

How users bring their own rewards (``rewards[].reward_model``) and model adapters
(``model.model_type``). Imports nothing of its own, so the config can use it without torch.

A class path's module is looked up as a Python script's imports are, where the user put it:
first in the folder of the config file this process loaded last (``load_config`` calls
``look_beside_config``), then in the working directory, then in the installed packages. The
folder that holds the module is put at the front of ``sys.path`` (once, and only that folder,
only when a class path's module is found there), as Python does with a script's folder: so the
module's own imports of its neighbours work, and so do the processes it starts. Every
process of a run loads the config itself, so each finds the module the same way. A file's path,
relative or absolute, is read the same way: a relative one from the config's folder first, then
the working directory; its folder goes at the front of ``sys.path`` and the module is the file's
stem.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

# the folder of the config file loaded last in this process (a run has one), or None
_config_folder: Path | None = None


def look_beside_config(config_path: str | Path) -> None:
    """Let class paths name modules in the folder of ``config_path`` (first, before the working directory)."""
    global _config_folder
    _config_folder = Path(config_path).resolve().parent


def lookup_folders() -> list[Path]:
    """Where a class path's module is looked for before the installed packages, in order."""
    folders = [_config_folder] if _config_folder is not None else []
    cwd = Path.cwd().resolve()
    return folders + ([cwd] if cwd not in folders else [])


def folder_holding(module_name: str) -> Path | None:
    """The first lookup folder holding ``module_name``'s top-level module (``name.py`` or a package
    ``name/__init__.py``), or None. Only looks at files: nothing is imported."""
    top = module_name.partition(".")[0]
    for folder in lookup_folders():
        spec = importlib.machinery.PathFinder.find_spec(top, [str(folder)])
        # a folder without __init__.py is a namespace package, which any installed package of that name beats
        if spec is not None and spec.origin is not None:
            return folder
    return None


def _file_module(module: str) -> bool:
    """Whether a class path's module part is a file's path (``dir/name.py``, ``/abs/name``) rather than a
    dotted module name."""
    return "/" in module or "\\" in module or module.endswith(".py")


def _module_file(module: str) -> Path | None:
    """The file a file-form module part names, looked for as ``lookup_folders`` says, or None."""
    written = Path(module).expanduser()
    names = [written] if written.suffix == ".py" else [written.with_name(written.name + ".py"), written]
    folders = [Path()] if written.is_absolute() else lookup_folders()
    return next((folder / name for folder in folders for name in names if (folder / name).is_file()), None)


def _file_as_module(path: str, label: str, module: str) -> str:
    """A file-form module part as an importable module name (the file's stem), its folder put at the front of
    sys.path; ImportError saying where it was looked for when there is no such file."""
    found = _module_file(module)
    if found is None:
        where = "" if Path(module).expanduser().is_absolute() else f" in {', '.join(map(str, lookup_folders()))}"
        raise ImportError(f"{label} {path!r}: no file {module!r}{where}")
    folder = found.resolve().parent
    if folder not in {Path(entry or ".").resolve() for entry in sys.path}:
        sys.path.insert(0, str(folder))
    return found.stem


def missing_module(path: str, label: str) -> str | None:
    """``import_class``'s message for ``path`` when its top-level module is nowhere to be found, else None.
    Only looks at files: nothing is imported, so the config checks a reward's class path without torch."""
    module_name, _ = split_class_path(path, label)
    if _file_module(module_name):
        return None if _module_file(module_name) else f"{label} {path!r}: no file {module_name!r}"
    top = module_name.partition(".")[0]
    if top in sys.modules or folder_holding(top) is not None or importlib.util.find_spec(top) is not None:
        return None
    return _not_found(path, label, module_name)


def _not_found(path: str, label: str, module_name: str) -> str:
    """A miss, where it was looked for, and where to put the module so that it is found."""
    top = module_name.partition(".")[0]
    what = f"{top}.py" if top == module_name else f"the package {top}/"
    where = "beside the config" if _config_folder is not None else "in the working directory"
    return (f"{label} {path!r}: no module named {module_name!r}; looked in "
            f"{', '.join(map(str, lookup_folders()))} and the installed packages; put {what} {where} "
            f"or add its folder to PYTHONPATH")


def _put_on_path(module_name: str) -> None:
    """Before importing ``module_name``: its lookup folder at the front of sys.path, when it is in one."""
    if module_name.partition(".")[0] in sys.modules:
        return  # imported already (flow_factory's own, or the user's a moment ago): nothing to look up
    folder = folder_holding(module_name)
    if folder is not None and folder not in {Path(entry or ".").resolve() for entry in sys.path}:
        sys.path.insert(0, str(folder))


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
    """The object ``path`` names, its module looked up as the module docstring says; ImportError saying
    which part is missing (and, for a missing module, where it was looked for)."""
    module_name, attr = split_class_path(path, label)
    if _file_module(module_name):
        module_name = _file_as_module(path, label, module_name)
    _put_on_path(module_name)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # a missing module vs. a module that exists but needs a package that is not installed
        missing = e.name or ""
        if missing == module_name.partition(".")[0]:
            raise ImportError(_not_found(path, label, module_name)) from e
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
