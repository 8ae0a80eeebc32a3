"""The lock: constraints.txt, the exact versions the test suite runs with.

    python scripts/lock.py --write [FILE]   # FILE (constraints.txt) from this interpreter's packages
    python scripts/lock.py --check [FILE]   # exit 1 unless the installed versions equal FILE's
    python scripts/lock.py --refresh        # (make lock) resolve anew in a fresh venv, then --write

pyproject.toml keeps ranges, for people who use flow_factory as a library; ``make`` installs
with ``pip install -c constraints.txt -e ".[dev]"``, so every package the project and its dev
extra pull in has the locked version in .venv, whatever the interpreter's own site-packages hold
(the venv sees them, but a pinned package of another version is installed into the venv, which
comes first on sys.path).

The lock holds the dependency closure of ``flow_factory[dev]`` as installed here, walked from
the project's metadata, and not the whole ``pip freeze``: a --system-site-packages venv would list
every system package too. It leaves out torch and what only torch needs (sympy, mpmath, networkx,
jinja2, nvidia-*, triton...): a torch the user already has (a CUDA build) is kept, and it may pin
those to other versions (torch 2.5 and 2.6 require sympy==1.13.1), which a lock could not satisfy.
Packages torch shares with the rest (filelock, fsspec, typing_extensions) are locked; torch asks
only lower bounds of them.
"""

from __future__ import annotations

import argparse
import platform
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv: pip's own copy
    from pip._vendor.packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "flow_factory"
EXTRAS = ("dev",)
# not locked, and not walked into: the user's torch decides these
TORCH_OWNED = {"torch"}
# the installer's own tools
TOOLS = {"pip", "setuptools", "wheel"}
# the torch `make` installs when none is importable; --refresh resolves against it
TORCH_PIN = "torch==2.13.0"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure() -> dict[str, str]:
    """canonical name -> installed version, for every package flow_factory[dev] needs here."""
    found: dict[str, str] = {}
    seen: set[tuple[str, frozenset]] = set()
    todo = [(PROJECT, frozenset(EXTRAS))]
    while todo:
        name, extras = todo.pop()
        if (canonical(name), extras) in seen:
            continue
        seen.add((canonical(name), extras))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            sys.exit(f"lock: {name} is required but not installed; install the project first "
                     f"(pip install -e \".[dev]\")")
        if canonical(name) != canonical(PROJECT):
            found[canonical(name)] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if canonical(req.name) in TORCH_OWNED | TOOLS:
                continue
            envs = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((req.name, frozenset(req.extras)))
    return found


def torch_floor_problems(pins: dict[str, str]) -> list[str]:
    """Locked packages whose torch requirement excludes the oldest torch pyproject.toml allows:
    with such a lock, pip would replace a user's older torch (a CUDA build) with the newest."""
    project = [Requirement(r) for r in metadata.distribution(PROJECT).requires or []]
    floors = [s.version for r in project if canonical(r.name) == "torch" for s in r.specifier if s.operator == ">="]
    problems = []
    for name in pins:
        for line in metadata.distribution(name).requires or []:
            req = Requirement(line)
            if (canonical(req.name) == "torch" and (req.marker is None or req.marker.evaluate({"extra": ""}))
                    and floors and not req.specifier.contains(floors[0], prereleases=True)):
                problems.append(f"{name}=={pins[name]} requires {req}, pyproject.toml allows torch>={floors[0]}")
    return problems


def write(path: Path) -> None:
    pins = closure()
    for problem in torch_floor_problems(pins):
        print(f"lock: warning: {problem}; raise the floor there, or keep the older package", file=sys.stderr)
    header = [
        "# The exact versions the test suite runs with; `make` installs with",
        '#   pip install -c constraints.txt -e ".[dev]"',
        "# Written by scripts/lock.py (`make lock` resolves anew in a fresh venv, then run `make test`).",
        "# torch and what only torch needs are not pinned: a torch you already have is kept;",
        f"# `make` installs {TORCH_PIN} only when none is importable.",
        f"# Resolved on CPython {platform.python_version()}, {sys.platform} {platform.machine()}.",
    ]
    path.write_text("\n".join(header + [f"{n}=={v}" for n, v in sorted(pins.items())]) + "\n")
    print(f"lock: {len(pins)} packages -> {path}")


def read(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonical(name)] = version.strip()
    return pins


def check(path: Path) -> int:
    """0 when every locked package is installed at its version and nothing needed is unlocked."""
    pins, installed = read(path), closure()
    problems = []
    for name, version in sorted(pins.items()):
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            if name in installed:
                problems.append(f"{name}: not installed, locked {version}")
            continue  # a pin for another Python or platform, not needed here
        if have != version:
            problems.append(f"{name}: installed {have}, locked {version}")
    problems += [f"{name}: needed ({version}) but not in the lock; run `make lock`"
                 for name, version in sorted(installed.items()) if name not in pins]
    if problems:
        print(f"lock: the installed packages differ from {path.name}:", *problems, sep="\n  ", file=sys.stderr)
        return 1
    print(f"lock: {len(pins)} packages as in {path.name}")
    return 0


def refresh(path: Path) -> None:
    """A fresh venv (no system site-packages), the newest versions pyproject.toml allows, then --write."""
    with tempfile.TemporaryDirectory(prefix="ff-lock-") as tmp:
        venv = Path(tmp) / "venv"
        py = venv / "bin" / "python"
        run = lambda *cmd: subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT)  # noqa: E731
        run(sys.executable, "-m", "venv", venv)
        run(py, "-m", "pip", "install", "--quiet", TORCH_PIN)
        run(py, "-m", "pip", "install", "--quiet", "-e", f".[{','.join(EXTRAS)}]")
        run(py, Path(__file__).resolve(), "--write", path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="write the lock from this interpreter's packages")
    mode.add_argument("--check", action="store_true", help="exit 1 unless the installed versions equal the lock")
    mode.add_argument("--refresh", action="store_true", help="resolve anew in a fresh venv and write the lock")
    parser.add_argument("file", nargs="?", default=str(ROOT / "constraints.txt"))
    args = parser.parse_args(argv)
    path = Path(args.file).resolve()
    if args.write:
        write(path)
    elif args.check:
        return check(path)
    else:
        refresh(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
