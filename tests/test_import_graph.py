"""No import cycle between the package's files or between its packages, read from the
source with ``ast`` (every import counts: inside functions and under TYPE_CHECKING too,
since those are where cycles hide); the rewards never import the reward server, and the
reward server and its wire format load without torch."""

import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "flow_factory"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of flow_factory it imports}``. ``from pkg import sub`` is an edge to
    ``pkg.sub`` when that is a module, else to ``pkg``; a module's own parent packages, which
    Python imports first, are not edges (every package's __init__ would close a loop)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                for alias in node.names:
                    sub = f"{origin}.{alias.name}"
                    targets.add(sub if sub in files else origin)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]``, or None."""
    done, on_path = set(), []

    def visit(node):
        if node in on_path:
            return on_path[on_path.index(node):] + [node]
        if node in done:
            return None
        on_path.append(node)
        for target in sorted(graph.get(node, ())):
            cycle = visit(target)
            if cycle:
                return cycle
        on_path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node)
        if cycle:
            return cycle
    return None


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same edges between flow_factory's top-level parts (``flow_factory.rewards``,
    ``flow_factory.wire``, ...)."""
    top = lambda module: ".".join(module.split(".")[:2])  # noqa: E731
    out: dict[str, set[str]] = {}
    for source, targets in graph.items():
        out.setdefault(top(source), set()).update(top(t) for t in targets if top(t) != top(source))
    return out


def test_the_graph_reader_sees_relative_imports_and_a_cycle():
    graph = import_graph()
    assert "flow_factory.rewards.base" in graph["flow_factory.rewards.reward_set"]
    assert "flow_factory.wire" in graph["flow_factory.rewards.remote"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_between_files():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_between_packages():
    cycle = find_cycle(package_graph(import_graph()))
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle)


def test_rewards_never_import_the_reward_server_which_imports_them_only_to_serve_a_model():
    graph = import_graph()
    rewards = {m for m in graph if m.startswith("flow_factory.rewards")}
    server = {m for m in graph if m.startswith("flow_factory.reward_server")}
    assert not any(t in server for m in rewards for t in graph[m])
    assert {m for m in server if graph[m] & rewards} == {"flow_factory.reward_server.model_server"}
    assert not graph["flow_factory.wire"] & (rewards | server)


def test_the_reward_server_and_its_wire_format_load_without_torch():
    code = ("import sys, flow_factory.wire, flow_factory.reward_server.app, flow_factory.reward_server.cli; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('flow_factory.rewards')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# what every family's adapter shares (models/): the modules that are not one family's adapter
SHARED_MODEL_MODULES = ('base', 'conditioning', 'vae', 'schedule', 'text', 'lora', 'registry', 'preflight')


# what a run whose config asks for none of them never uses, so never imports before its first epoch: the other
# training backends, the trackers, plotting (never: the reward curve is drawn in a process of its own), the reward
# server, the planner, and httpx (only remote rewards and VLM judges need it)
OPTIONAL_MODULES = ("deepspeed", "matplotlib", "tensorboard", "torch.utils.tensorboard", "wandb", "swanlab",
                    "fastapi", "starlette", "uvicorn", "httpx", "flow_factory.reward_server", "flow_factory.plan",
                    "flow_factory.shapebench")


@functools.lru_cache(maxsize=None)
def launch_path() -> dict:
    """``sys.modules`` of a process that has done what ``ff-train`` does before a one-process tiny SD3 run's first
    epoch, short of building the Trainer: the CLI module, the start checks that need no files (no remote
    reward, logging backend none), the Trainer class and SD3's adapter, and whether its cyclic garbage collector
    thresholds before and after the trainer's import (which holds off its full collections). One interpreter for the
    tests below."""
    code = ("import sys, json; import flow_factory.train; from flow_factory import start_checks; "
            "assert start_checks.servers_problem([]) is None and start_checks.backend_problem('none') is None; "
            "import gc; before = gc.get_threshold(); "
            "from flow_factory.trainer import Trainer; from flow_factory.models import ADAPTERS; ADAPTERS['sd3-5']; "
            "print(json.dumps({'modules': sorted(sys.modules), 'gc': [before, gc.get_threshold(), gc.isenabled(), gc.get_freeze_count()]}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_a_run_imports_only_its_own_models_adapter_and_no_plotting():
    """The trainer and SD3's adapter load neither another family's adapter (each pulls its diffusers pipeline)
    nor matplotlib (the reward curve is drawn in a process of its own)."""
    assert [m for m in launch_path()["modules"] if m.startswith(("flow_factory.models.", "matplotlib"))
            and m.split(".")[-1] not in SHARED_MODEL_MODULES] == ["flow_factory.models.sd3"]


def test_the_reward_curve_is_drawn_in_a_process_of_its_own_and_matplotlib_never_loads_here(tmp_path):
    """A lean run (issue 35): matplotlib's import and first figure add about 33 MB to the process that holds them,
    and a trainer's save, where the curve is drawn, comes after its epochs' busiest moment: it was the run's peak.
    ``plot_curves`` draws in a child process, the same pixels as drawn here; a child that has ended is started
    again, a failure there is raised here with its traceback, and it ends quietly with the process it draws for."""
    from flow_factory.media.curves import plot_curves, render

    series = {"reward/r/mean": [(e, (e % 3) / 2) for e in range(40)], "eval/reward/r": [(0, 0.2), (20, 0.6)]}
    code = ("import json, sys; from PIL import Image; from flow_factory.media.curves import DRAWER, plot_curves; "
            f"series = json.loads({json.dumps(json.dumps(series))}); first = plot_curves(series, 'reward per epoch'); "
            "DRAWER.process.kill(); DRAWER.process.wait(); again = plot_curves(series, 'reward per epoch'); "
            f"first.save({str(tmp_path / 'first.png')!r}); again.save({str(tmp_path / 'again.png')!r}); "
            "print(json.dumps('matplotlib' in sys.modules), flush=True); "
            # this process ends before the reply: the child ends too, without a word on the terminal
            "DRAWER.process.stdin.write(json.dumps({'series': series, 'title': 't', 'size': [640, 400]}).encode() "
            "+ b'\\n'); DRAWER.process.stdin.flush(); import os; os._exit(0)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(run.stdout.strip().splitlines()[-1]) is False
    assert "Error" not in run.stderr, run.stderr  # the child holds the stderr pipe: its output would be here
    here = render({k: [tuple(p) for p in v] for k, v in series.items()}, "reward per epoch").tobytes()
    from PIL import Image

    assert all(Image.open(tmp_path / name).tobytes() == here for name in ("first.png", "again.png"))
    with pytest.raises(RuntimeError, match=r"(?s)failed in its process.*figure size must be positive"):
        plot_curves(series, "t", size=(-640, 400))


def test_a_run_imports_no_backend_tracker_server_or_planner_it_does_not_use():
    """A lean start (issue 35): DeepSpeed, TensorBoard, matplotlib, the reward server's FastAPI, the planner and
    httpx each cost a process memory and import time; a run that uses none of them loads none of them."""
    loaded = [m for m in launch_path()["modules"] if m.startswith(OPTIONAL_MODULES)
              and (m in OPTIONAL_MODULES or m.startswith(tuple(f"{o}." for o in OPTIONAL_MODULES)))]
    assert loaded == []


def test_the_trainers_import_gives_the_garbage_collector_back():
    """``flow_factory.trainer`` holds off the cyclic GC's full collections while its ~4000 modules load (a lean
    start): the collector is on, with the thresholds it had, and nothing is frozen (only a command's own process
    freezes its imports: ``own_process``)."""
    before, after, enabled, frozen = launch_path()["gc"]
    assert after == before and enabled and frozen == 0


def test_every_adapter_is_reached_through_the_family_table_and_agrees_with_its_line():
    """A model family is its adapter file plus one line of config.families.MODEL_FAMILIES: every class of
    models/ that sets a model_type is some line's adapter, and each line's class loads and says what the line
    says (the config reads the line before anything loads; the adapter's code reads its class attributes)."""
    from flow_factory.config.families import MODEL_FAMILIES
    from flow_factory.models import ADAPTERS

    defined = set()
    for path in (PACKAGE / "models").glob("*.py"):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(item, ast.Assign) and any(getattr(t, "id", None) == "model_type" for t in item.targets)
                    for item in node.body):
                defined.add(f"flow_factory.models.{path.stem}:{node.name}")
    assert defined == {family.adapter for family in MODEL_FAMILIES.values()}
    for model_type, family in MODEL_FAMILIES.items():
        cls = ADAPTERS[model_type]
        assert (cls.model_type, cls.pixel_factor, cls.is_video, tuple(cls.transformer_names),
                tuple(cls.condition_inputs), getattr(cls, "frame_factor", family.frame_factor),
                cls.frame_rate if cls.has_audio else None) == (
            model_type, family.pixel_factor, family.is_video, family.components, family.conditions,
            family.frame_factor, family.audio_fps), model_type


def imported_names(path: Path) -> set[str]:
    """Every module name ``path`` imports, absolute or relative as written (``..sharding`` stays ``sharding``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
            names.update(f"{node.module or ''}.{alias.name}".lstrip(".") for alias in node.names)
    return names


def test_model_adapters_import_nothing_distributed():
    """An adapter says how to call its model; who runs which expert on which process is the training backend's
    (``trainer/backends.py``), which the adapter sees only as ``expert_calls`` and ``callers``."""
    distributed = ("torch.distributed", "accelerate", "deepspeed", "sharding", "flow_factory.sharding", "trainer",
                   "flow_factory.trainer")
    offenders = {f"{path.relative_to(SRC)}: {name}" for path in (PACKAGE / "models").glob("*.py")
                 for name in imported_names(path) if name.startswith(distributed)}
    assert not offenders, sorted(offenders)
    assert "accelerate" in {n.split(".")[0] for n in imported_names(PACKAGE / "trainer" / "backends.py")}


def test_nothing_below_the_trainer_imports_it():
    """The trainer builds on everything else; only ``ff-train``'s entry point imports it."""
    graph = import_graph()
    importers = {m for m, targets in graph.items() if not m.startswith("flow_factory.trainer")
                 and any(t.startswith("flow_factory.trainer") for t in targets)}
    assert importers == {"flow_factory.train"}
