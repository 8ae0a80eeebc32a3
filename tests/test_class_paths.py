"""Class paths resolve as a Python script's imports do: a reward module beside the config, or in the
working directory, is found without PYTHONPATH; a miss is one config error that says where it looked."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from helpers_runs import tiny_run_config, write_config

from flow_factory import class_path
from flow_factory.class_path import import_class
from flow_factory.train import main

REWARD_GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "adding-a-reward.md"


@pytest.fixture
def clean_lookup(monkeypatch):
    """sys.path, the imported modules and the remembered config folder as they were before the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(class_path, "_config_folder", None, raising=False)
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith(("my_rewards", "cwd_rewards")):
            del sys.modules[name]


def guide_reward_module() -> str:
    """The reward guide's Brightness, the module the guide tells users to put beside their config."""
    code = re.findall(r"^```python\n(.*?)^```", REWARD_GUIDE.read_text(encoding="utf-8"), flags=re.M | re.S)[0]
    return code


def test_a_reward_beside_the_config_trains_without_pythonpath(clean_lookup, tmp_path, tiny_sd3_path):
    configs = tmp_path / "configs"  # neither the working directory nor on sys.path
    configs.mkdir()
    (configs / "my_rewards.py").write_text(guide_reward_module(), encoding="utf-8")
    assert "my_rewards" not in sys.modules and str(configs) not in sys.path

    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path, max_epochs=1)
    config["eval"]["eval_freq"] = 0
    config["log"]["save_freq"] = 0
    config["rewards"] = [{"name": "brightness", "reward_model": "my_rewards.Brightness", "target": 0.4}]
    assert main([str(write_config(configs, config))]) == 0
    assert Path(sys.modules["my_rewards"].__file__).parent == configs


def test_a_missing_reward_module_is_one_config_error_saying_where_it_looked(clean_lookup, tmp_path, capsys):
    configs = tmp_path / "configs"
    configs.mkdir()
    config = tiny_run_config(tmp_path, "sd3-5", tmp_path / "no_model")
    config["eval_rewards"] = [{"reward_model": "my_rewardz.Brightness"}]  # misspelt
    path = write_config(configs, config)
    assert main([str(path)]) == 2
    error = capsys.readouterr().err
    assert error == (f"ff-train: config error: {path}: eval_rewards[0].reward_model: reward class path "
                     f"'my_rewardz.Brightness': no module named 'my_rewardz'; looked in {configs.resolve()}, "
                     f"{Path.cwd().resolve()} and the installed packages; put my_rewardz.py beside the config or "
                     f"add its folder to PYTHONPATH\n")


def test_a_class_path_is_found_in_the_working_directory(clean_lookup, tmp_path, monkeypatch):
    """What ff-reward-server and ff-sample (no config file) get: the working directory, then the packages."""
    (tmp_path / "cwd_rewards.py").write_text("class Found:\n    pass\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert import_class("cwd_rewards.Found", "--reward").__name__ == "Found"
    assert str(tmp_path.resolve()) in sys.path  # so its neighbours import, as a script's do
    with pytest.raises(ImportError, match=re.escape(
            f"--reward 'cwd_rewardz.Found': no module named 'cwd_rewardz'; looked in {tmp_path.resolve()} and the "
            f"installed packages; put cwd_rewardz.py in the working directory or add its folder to PYTHONPATH")):
        import_class("cwd_rewardz.Found", "--reward")


def test_a_files_path_and_class_name_a_reward_as_flow_factorys_help_writes_it(clean_lookup, tmp_path):
    """``path/to/file.py:Class``, relative to the config's folder (then the working directory) or absolute, with or
    without ``.py`` (Flow-Factory's reward_model help: ``/path/to/your/model:class_name``)."""
    configs = tmp_path / "configs"
    (configs / "rewards").mkdir(parents=True)
    (configs / "rewards" / "my_rewards_file.py").write_text(guide_reward_module(), encoding="utf-8")
    class_path.look_beside_config(configs / "run.yaml")
    relative = import_class("rewards/my_rewards_file.py:Brightness", "reward class path")
    assert relative.__name__ == "Brightness"
    assert Path(sys.modules["my_rewards_file"].__file__) == configs / "rewards" / "my_rewards_file.py"
    absolute = import_class(f"{configs / 'rewards' / 'my_rewards_file'}:Brightness", "reward class path")
    assert absolute is relative
    assert class_path.missing_module("rewards/my_rewards_file.py:Brightness", "reward class path") is None


def test_a_missing_file_says_where_it_was_looked_for(clean_lookup, tmp_path):
    class_path.look_beside_config(tmp_path / "run.yaml")
    with pytest.raises(ImportError, match=re.escape(f"reward class path 'rewards/my_rewards_nope.py:Brightness': "
                                                    f"no file 'rewards/my_rewards_nope.py' in {tmp_path}")):
        import_class("rewards/my_rewards_nope.py:Brightness", "reward class path")
    assert class_path.missing_module("rewards/my_rewards_nope.py:X", "reward class path") == (
        "reward class path 'rewards/my_rewards_nope.py:X': no file 'rewards/my_rewards_nope.py'")
