"""The documents stay true to the code: the config reference is the schema's, every key is
described, the guides' examples run, and the links between documents resolve."""

from __future__ import annotations

import re
from pathlib import Path

from flow_factory.config import reference

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def test_config_reference_is_generated_from_the_schema():
    committed = (ROOT / reference.DEFAULT_OUT).read_text(encoding="utf-8")
    assert committed == reference.render(), (
        f"docs/config-reference.md differs from the schema; regenerate it from the repository root with: "
        f"{reference.COMMAND}")


def test_every_config_key_has_a_description():
    missing = reference.undocumented_fields()
    assert not missing, (f"config keys without a description (give each setting(default, description) in "
                         f"src/flow_factory/config/): {missing}")


def test_the_reference_lists_every_key_of_every_section():
    page = reference.render()
    keys = set(re.findall(r"^\| `([^`]+)` \|", page, flags=re.M))
    for _heading, prefix, _description, model in reference.sections():
        for name, field in model.model_fields.items():
            if reference._section_model(field) is None:
                assert f"{prefix}{name}" in keys
    assert {"train.learning_rate", "rewards[].reward_model", "seed", "scheduler.sde_steps"} <= keys


def test_a_key_without_a_description_is_named(monkeypatch):
    from flow_factory.config import RewardConfig, TrainConfig

    monkeypatch.setattr(TrainConfig.model_fields["kl_beta"], "description", "")
    monkeypatch.setattr(RewardConfig.model_fields["weight"], "description", " ")
    assert reference.undocumented_fields() == ["train.kl_beta", "rewards[].weight"]
