"""A command's process (ff-train, ff-eval, ff-sample) freezes the objects its imports left, once, so the cyclic
garbage collector's full collections no longer scan them (``flow_factory.own_process``); a process that merely
imports Flow-Factory or calls a command's ``main`` is left as it was."""

import gc

import pytest

from flow_factory import evaluate, own_process, sample, train
from flow_factory.config import ConfigError


@pytest.fixture
def collector():
    """The collector's state, given back whatever a test did to it."""
    thresholds = gc.get_threshold()
    yield thresholds
    own_process._thresholds = None
    gc.unfreeze()
    gc.set_threshold(*thresholds)


@pytest.mark.parametrize("command", [train, evaluate, sample], ids=["ff-train", "ff-eval", "ff-sample"])
def test_a_command_holds_off_full_collections_until_its_imports_are_done_then_freezes_them(
        command, collector, monkeypatch):
    seen = []
    monkeypatch.setattr(command, "main", lambda: seen.append(gc.get_threshold()) or 0)
    assert command.cli() == 0
    assert seen == [(*collector[:2], 1 << 30)]  # young collections go on as before
    own_process.imports_done()
    assert gc.get_freeze_count() > 1000 and gc.get_threshold() == collector


def test_without_a_command_start_nothing_is_frozen_and_the_thresholds_stay(collector):
    own_process.imports_done()
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == collector


def test_ff_train_freezes_after_its_imports_and_before_it_builds_the_trainer(collector, monkeypatch, tmp_path):
    """Objects frozen are never freed: the Trainer's (its models, the text encoders it frees) must come after."""
    import flow_factory.trainer

    events = []
    monkeypatch.setattr(own_process, "imports_done", lambda: events.append("frozen"))

    def trainer(cfg):
        events.append("Trainer")
        raise ConfigError("model.model_name_or_path: stop here")
    monkeypatch.setattr(flow_factory.trainer, "Trainer", trainer)
    from flow_factory.config import parse_config
    from helpers_runs import tiny_run_config

    cfg = parse_config(tiny_run_config(tmp_path, "sd3-5", tmp_path / "no model"))
    assert train.train(cfg, "config.yaml") == 2
    assert events == ["frozen", "Trainer"]


def test_the_installed_commands_enter_through_cli():
    """``ff-train``, ``ff-eval`` and ``ff-sample`` as pip installs them (pyproject's scripts) start their process as
    a command's own; ``python -m`` runs the same ``cli``."""
    import tomllib
    from pathlib import Path

    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    assert {name: scripts[name] for name in ("ff-train", "ff-eval", "ff-sample")} == {
        "ff-train": "flow_factory.train:cli", "ff-eval": "flow_factory.evaluate:cli", "ff-sample": "flow_factory.sample:cli"}
    for module in (train, evaluate, sample):
        assert "sys.exit(cli())" in Path(module.__file__).read_text()
