"""The installed package holds the library and its CLIs, no test fixtures: every module of
flow_factory is reached, through imports read from the source, from what a user runs or
imports. Fixtures shared by the tests and benches live in bench/ (the toy flow, example
reward servers) and scripts/ (ShapeBench's data defects); flow_factory.testing, the tiny
random models, is public on purpose, for users' own offline tests."""

import re

from test_import_graph import PACKAGE, import_graph

from flow_factory.config.families import MODEL_FAMILIES

ROOT = PACKAGE.parents[1]


def entry_points(graph: dict[str, set[str]]) -> set[str]:
    """The package's surface: its __init__, flow_factory.testing, the console scripts of
    pyproject.toml, modules run as ``python -m`` (a ``__main__`` guard), and modules named
    in strings (the reward table's ``"flow_factory.rewards.pickscore:PickScore"``), and the model families' adapters."""
    scripts = (ROOT / "pyproject.toml").read_text().split("[project.scripts]")[1].split("\n[")[0]
    roots = {"flow_factory", "flow_factory.testing"} | set(re.findall(r'=\s*"([\w.]+):', scripts))
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        roots.update(re.findall(r"[\"'](flow_factory(?:\.\w+)+)[:\"']", text))
        if re.search(r"^if __name__ == [\"']__main__[\"']:", text, re.M):
            roots.add(".".join(path.relative_to(ROOT / "src").with_suffix("").parts))
    roots.update(family.adapter.partition(":")[0] for family in MODEL_FAMILIES.values())  # imported by name
    return roots & set(graph)


def reached(graph: dict[str, set[str]], roots: set[str]) -> set[str]:
    """Every module imported from ``roots``, directly or not; importing ``a.b.c`` imports ``a`` and ``a.b``."""
    seen, todo = set(), list(roots)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))] + sorted(graph[module])
    return seen


# modules built and tested ahead of what reaches them (issue 39's distillation losses were, until trainer_type dmd2
# imported them); a module listed here is named by the issue it waits for
NOT_YET_REACHED: set[str] = set()


def test_every_module_of_the_package_is_reached_from_what_a_user_runs_or_imports():
    graph = import_graph()
    unreached = sorted(set(graph) - reached(graph, entry_points(graph)) - NOT_YET_REACHED)
    assert not unreached, (f"modules nothing in the package imports (a test or bench fixture? it belongs in "
                           f"tests/ or bench/): {unreached}")


def test_the_check_sees_a_module_only_a_test_would_import():
    graph = {"flow_factory": set(), "flow_factory.train": {"flow_factory.trajectory"}, "flow_factory.trajectory": set(),
             "flow_factory.testing": set(), "flow_factory.testing.toy": {"flow_factory.trajectory"}}
    assert set(graph) - reached(graph, {"flow_factory.train", "flow_factory.testing"}) == {"flow_factory.testing.toy"}
