"""What ``ff-train`` checks in the process the user started, before any process launches or model loads
(``start_checks.py``), and the one report of a launch whose processes fail (``launcher.py``)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_runs import tiny_run_config, write_config, write_dataset
from test_train_cli import _free_port

from flow_factory import start_checks
from flow_factory.config import ConfigError, parse_config
from flow_factory.rewards.base import PointwiseRewardModel
from flow_factory.start_checks import check_prompt_counts, model_problem, processes_problem

ROOT = Path(__file__).resolve().parents[1]
TESTS_DIR = Path(__file__).resolve().parent


def ff_train(args: list[str], env: dict | None = None, cwd: Path = ROOT, timeout: float = 60):
    """``ff-train ARGS`` as a user runs it: a fresh process; (exit status, output lines)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
           **(env or {})}
    done = subprocess.run([sys.executable, "-m", "flow_factory.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return done.returncode, (done.stdout + done.stderr).strip().splitlines()


def test_the_shipped_example_without_the_hub_ends_in_one_screen_naming_what_to_fetch(tmp_path):
    # an empty hub cache, offline: what a fresh machine without the hub has (the timeout guards "seconds, no
    # retries": from_pretrained retries a missing model for minutes)
    code, lines = ff_train(["examples/sd3_5_grpo_lora.yaml"],
                           {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")})
    assert code == 2 and len(lines) <= 20, lines
    assert lines[0] == "ff-train: examples/sd3_5_grpo_lora.yaml cannot start:"
    assert lines[-1].startswith("  models this run loads are not here (HF_HUB_OFFLINE is set): not in the hub "
                                "cache: stabilityai/stable-diffusion-3.5-medium (model.model_name_or_path), "
                                "yuvalkirstain/PickScore_v1 (rewards[0] pick_score), "
                                "laion/CLIP-ViT-H-14-laion2B-s32B-b79K (rewards[0] pick_score). Fetch each with "
                                "`hf download ID`"), lines[-1]
    assert "  num_processes: 8 runs a process a GPU, and this machine has no GPU; pass --num_processes 1" in \
        "\n".join(lines)
    if importlib.util.find_spec("wandb") is None:
        assert any(line.startswith("  log.logging_backend: 'wandb' is not installed; pip install "
                                   "'flow_factory[wandb]'") for line in lines), lines


def test_a_hub_that_cannot_be_reached_is_asked_once_without_retries(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    assert model_problem("org/absent", offline=False).startswith("not cached and the hub is unreachable")
    assert model_problem("org/absent", offline=True) == "not in the hub cache"
    assert model_problem(str(tmp_path / "nowhere"), offline=True) == "no such folder"
    assert model_problem(str(tmp_path), offline=True) is None  # a local folder
    snapshot = tmp_path / "hub" / "models--org--cached" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert model_problem("org/cached", offline=True) is None


class NeedsTwoModels(PointwiseRewardModel):
    """A reward that loads a checkpoint and a processor of its own."""

    @classmethod
    def models_to_load(cls, options):
        return [options.get("model_name_or_path") or "org/judge", "org/judge-processor"]


def test_every_reward_model_is_checked_with_the_key_that_names_it(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    config = tiny_run_config(tmp_path, "sd3-5", tmp_path)  # the model: a folder that exists
    config["rewards"].append({"name": "judge", "reward_model": "test_start_checks.NeedsTwoModels"})
    config["eval_rewards"] = [{"name": "pick", "reward_model": "PickScore", "model_name_or_path": "org/pick"}]
    problem = start_checks.models_problem(start_checks.reward_needs(parse_config(config))[0])
    assert problem == ("models this run loads are not here (HF_HUB_OFFLINE is set): not in the hub cache: "
                       "org/judge (rewards[1] judge), org/judge-processor (rewards[1] judge), org/pick "
                       "(eval_rewards[0] pick). Fetch each with `hf download ID` where the hub is reachable, "
                       "or point its key at a local folder")


def test_the_process_count_is_checked_against_the_devices_here(monkeypatch, tmp_path):
    import torch

    eight = tiny_run_config(tmp_path, "sd3-5", tmp_path, unique_sample_num_per_epoch=8)  # 16 samples: 8 x 2
    cfg = parse_config({**eight, "num_processes": 8})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert processes_problem(cfg, on_command_line=False).startswith(
        "num_processes: 8 runs a process a GPU, and this machine has no GPU; pass --num_processes 1")
    assert processes_problem(cfg, on_command_line=True) is None  # N CPU processes, asked for on purpose
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert processes_problem(cfg, on_command_line=True) == (
        "num_processes: 8 (8 a machine) needs a GPU a process, and this machine has 4; pass --num_processes 4")
    two_machines = parse_config({**eight, "num_processes": 8, "num_machines": 2, "main_process_ip": "10.0.0.1"})
    assert processes_problem(two_machines, on_command_line=False) is None


def test_more_distinct_prompts_an_epoch_than_the_dataset_holds_is_a_config_error(tmp_path):
    config = tiny_run_config(tmp_path, "sd3-5", tmp_path, unique_sample_num_per_epoch=48, group_size=2,
                             per_device_batch_size=2)
    cfg = parse_config(config)
    with pytest.raises(ConfigError, match=r"^train.unique_sample_num_per_epoch: 48 distinct prompts an epoch, and "
                                          rf"{tmp_path}/data holds 6 training prompts; set it to at most 6$"):
        check_prompt_counts(cfg)
    code, lines = ff_train([str(write_config(tmp_path, config))])
    assert code == 2 and lines[-1].startswith("  train.unique_sample_num_per_epoch: 48"), lines


def test_all_problems_are_listed_before_anything_launches(tmp_path):
    config = tiny_run_config(tmp_path, "sd3-5", tmp_path / "no-model")
    config["data"]["dataset_dir"] = str(tmp_path / "no-data")
    code, lines = ff_train([str(write_config(tmp_path, config)), "--num_processes", "2"],
                           {"HF_HUB_OFFLINE": "1"})
    assert code == 2 and lines == [
        f"ff-train: {tmp_path}/config.yaml cannot start:",
        f"  data.dataset_dir: no train prompts in {tmp_path}/no-data: looked for train.jsonl and train.txt",
        f"  models this run loads are not here (HF_HUB_OFFLINE is set): no such folder: {tmp_path}/no-model "
        "(model.model_name_or_path). Fetch each with `hf download ID` where the hub is reachable, or point its "
        "key at a local folder"]


def test_a_launch_whose_process_fails_ends_with_that_process_s_own_error_once(tmp_path, tiny_sd3_path):
    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path)
    config["rewards"] = [{"name": "judge", "reward_model": "helpers_rewards.FailsOnProcessOne"}]
    code, lines = ff_train([str(write_config(tmp_path, config)), "--num_processes", "2",
                            "--main_process_port", str(_free_port())], {"OMP_NUM_THREADS": "1"}, timeout=300)
    assert code == 1
    assert lines[-1] == "ff-train: crashed: ValueError: FailsOnProcessOne: the judge's weights are corrupt", lines
    assert sum(line.startswith("ValueError: FailsOnProcessOne") for line in lines) == 1  # one traceback
    assert any(line.startswith("ff-train: process 1 stopped") for line in lines), lines
    assert not any("Root Cause" in line or "ChildFailedError" in line for line in lines), lines


def test_a_launch_whose_processes_fail_alike_reports_it_once(tmp_path, tiny_sd3_path):
    """The launch forked (helpers_launch: the same launcher and records, without fresh interpreters); the
    test above launches for real."""
    from helpers_launch import ff_train_forked

    write_dataset(tmp_path / "data")
    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path)
    (tmp_path / "saves" / "run").mkdir(parents=True)
    (tmp_path / "saves" / "run" / "history.json").write_text("[]")  # a run is there: both processes refuse
    (out, err), code = ff_train_forked([str(write_config(tmp_path, config)), "--num_processes", "2",
                                        "--main_process_port", str(_free_port())],
                                       {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    lines = (out + err).strip().splitlines()
    assert code == 2
    assert lines[-1].startswith(f"ff-train: error: log.run_name: {tmp_path}/saves/run already holds a run"), lines
    assert sum("already holds a run" in line for line in lines) == 1, lines


def test_a_run_says_where_it_went_and_how_to_use_what_it_left(tmp_path, tiny_sd3_path, capsys):
    from flow_factory.train import main

    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path, max_epochs=1)
    config["eval"].update(eval_freq=0, resolution=32, guidance_scale=2.5)  # not ff-sample's own defaults
    path = write_config(tmp_path, config)
    run_dir = tmp_path / "saves" / "run"
    assert main([str(path)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert f"ff-train: run folder {run_dir}" in err
    checkpoint = run_dir / "checkpoints" / "epoch_1"
    assert err[-5].startswith("ff-train: done after 1 epochs; last rewards {'jpeg': ")
    assert err[-4:] == [f"  run folder:      {run_dir} (reward_curve.png, history.json, samples/)",
                        f"  last checkpoint: {checkpoint}",
                        f"  sample it:       ff-sample --checkpoint {checkpoint} --prompts \"a prompt\" "
                        f"--out {run_dir}/samples_cli",
                        f"  evaluate it:     ff-eval {path} --checkpoint {checkpoint}"]
    # the printed ff-sample command samples as the run's eval did: its resolution and guidance
    from PIL import Image

    from flow_factory.sample import main as ff_sample

    assert ff_sample(["--checkpoint", str(checkpoint), "--prompts", "a red circle", "--out",
                      str(run_dir / "samples_cli")]) == 0
    assert "32x32 px, 3 steps, guidance 2.5" in capsys.readouterr().err
    with Image.open(run_dir / "samples_cli" / "0000.png") as image:
        assert image.size == (32, 32)

    assert main([str(path), "train.max_epochs=2", f"model.resume_path={run_dir}"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert f"ff-train: resumed from {checkpoint}, epoch 1 of 2 done" in err
    assert f"  last checkpoint: {run_dir / 'checkpoints' / 'epoch_2'}" in err


def test_reward_servers_and_vlm_apis_must_answer_before_a_run_starts(tmp_path):
    """Any HTTP answer will do (a reward server answers 404 at its root); a port where nothing listens is
    named with the key of the reward that needs it."""
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    live = HTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)  # answers every GET with 501
    threading.Thread(target=live.serve_forever, daemon=True).start()
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        silent = s.getsockname()[1]
    config = tiny_run_config(tmp_path, "sd3-5", tmp_path)
    config["rewards"] += [
        {"name": "remote", "reward_model": "remote", "server_url": f"http://127.0.0.1:{live.server_port}"},
        {"name": "judge", "reward_model": "vllm_evaluate", "api_base_url": f"http://127.0.0.1:{silent}/v1",
         "vlm_model": "qwen"}]
    try:
        _, servers, problems = start_checks.reward_needs(parse_config(config))
        assert problems == [] and len(servers) == 2
        assert start_checks.servers_problem(servers) == (
            f"reward servers that do not answer: http://127.0.0.1:{silent}/v1 (rewards[2] judge: ConnectError); "
            "start them first, or fix the URL")
        assert start_checks.servers_problem(servers[:1]) is None
    finally:
        live.shutdown()
