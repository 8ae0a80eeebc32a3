"""A run is never lost and never corrupted: non-finite values never reach the weights,
checkpoints are atomic, an interrupt leaves a resumable checkpoint, run folders are never
silently shared, and errors that need no model come before the model loads."""

import json
import math
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from helpers_algorithms import nan_on_first_call
from helpers_launch import call_forked
from helpers_rewards import Brightness, reset
from helpers_runs import tiny_run_config, write_config
from safetensors.torch import load_file

from flow_factory.train import main
from flow_factory.trainer.run_folder import RunFolder, RunFolderError

BRIGHTNESS = [{"name": "brightness", "reward_model": "helpers_rewards.Brightness"}]
LORA = "pytorch_lora_weights.safetensors"


def _config(tmp_path, tiny_sd3_path, **train):
    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path, **train)
    config["eval"]["eval_freq"] = 0  # reward calls count training batches only
    config["rewards"] = BRIGHTNESS
    return config


def _train(tmp_path, config, name="config.yaml") -> int:
    return main([str(write_config(tmp_path, config, name))])


def _lora(run_dir: Path, epoch: int) -> dict:
    return load_file(run_dir / "checkpoints" / f"epoch_{epoch}" / LORA)


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)


def _all_finite(weights: dict) -> bool:
    return all(torch.isfinite(v).all() for v in weights.values())


@pytest.fixture
def calls_per_epoch(tmp_path_factory, tiny_sd3_path):
    """Reward calls in one epoch of the tiny config (counted, so the tests do not assume batching)."""
    folder = tmp_path_factory.mktemp("count")
    reset()
    assert _train(folder, _config(folder, tiny_sd3_path, max_epochs=1)) == 0
    return Brightness.calls


@pytest.fixture
def uninterrupted(tmp_path_factory, tiny_sd3_path):
    folder = tmp_path_factory.mktemp("straight")
    reset()
    assert _train(folder, _config(folder, tiny_sd3_path, max_epochs=3)) == 0
    return _lora(folder / "saves" / "run", 3)


# ------------------------------------------------------------------ non-finite values
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_non_finite_reward_skips_the_epoch_and_never_reaches_the_weights(tmp_path, tiny_sd3_path, value):
    reset({0: value})  # one sample of epoch 0
    assert _train(tmp_path, _config(tmp_path, tiny_sd3_path, max_epochs=3)) == 0
    run_dir = tmp_path / "saves" / "run"
    history = json.loads((run_dir / "history.json").read_text())["train"]
    assert history[0]["train/skipped_updates"] == 1 and history[0]["reward/brightness/nonfinite"] == 1
    assert "train/loss" not in history[0] and history[1]["train/skipped_updates"] == 0
    assert math.isfinite(history[0]["reward/brightness/mean"])  # the finite samples' mean
    # LoRA's B matrices start at zero: after the skipped epoch nothing moved; later epochs trained
    assert all(float(v.abs().max()) == 0 for k, v in _lora(run_dir, 1).items() if "lora_B" in k)
    for epoch in (1, 2, 3):
        assert _all_finite(_lora(run_dir, epoch))
    assert any(float(v.abs().max()) > 0 for k, v in _lora(run_dir, 3).items() if "lora_B" in k)


def test_non_finite_rewards_in_a_row_stop_the_run_naming_the_reward(tmp_path, tiny_sd3_path, capsys):
    reset({"always": "nan"})
    config = _config(tmp_path, tiny_sd3_path, max_epochs=5, max_nonfinite_in_a_row=1)
    assert _train(tmp_path, config) == 1
    err = capsys.readouterr().err
    assert "ff-train: stopped: epoch 1: reward 'brightness' is NaN or inf for 1 of 4 samples" in err
    assert "2 non-finite updates in a row (train.max_nonfinite_in_a_row is 1)" in err
    checkpoints = sorted((tmp_path / "saves" / "run" / "checkpoints").glob("epoch_*"))
    assert [p.name for p in checkpoints] == ["epoch_1"]  # epoch 2 never completed
    assert _all_finite(load_file(checkpoints[0] / LORA))


def test_a_non_finite_gradient_skips_that_step(tmp_path, tiny_sd3_path, monkeypatch):
    from flow_factory.algorithms.grpo import GRPO

    monkeypatch.setattr(GRPO, "loss", nan_on_first_call(GRPO.loss))
    reset()
    config = _config(tmp_path, tiny_sd3_path, max_epochs=2, gradient_step_per_epoch=2)
    assert _train(tmp_path, config) == 0
    history = json.loads((tmp_path / "saves" / "run" / "history.json").read_text())["train"]
    assert [r["train/skipped_updates"] for r in history] == [1, 0]
    assert math.isfinite(history[0]["train/grad_norm"])  # the mean leaves the skipped step out
    assert _all_finite(_lora(tmp_path / "saves" / "run", 2))


def test_a_remote_reward_answering_nan_stops_the_run_naming_the_server(tmp_path, tiny_sd3_path, capsys):
    from test_reward_server_limits import answering

    with answering(b'{"rewards": [NaN, 1.0]}') as url:
        config = _config(tmp_path, tiny_sd3_path, max_epochs=2, per_device_batch_size=2)
        config["rewards"] = [{"name": "judge", "reward_model": "remote", "server_url": url, "batch_size": 2}]
        assert _train(tmp_path, config) == 1
    err = capsys.readouterr().err
    assert f"ff-train: reward failed: {url}/score answered" in err and "rewards[0] = nan" in err
    assert not (tmp_path / "saves" / "run" / "checkpoints").exists()


def test_a_base_model_with_non_finite_weights_is_refused_before_training(tmp_path, tiny_sd3_path, capsys):
    import shutil

    from safetensors.torch import save_file

    garbled = tmp_path / "garbled"
    shutil.copytree(tiny_sd3_path, garbled)
    weights = next((garbled / "transformer").glob("*.safetensors"))
    state = load_file(weights)
    name = sorted(state)[0]
    state[name][..., 0] = float("nan")
    save_file(state, weights)
    reset()
    config = _config(tmp_path, garbled, max_epochs=1)
    assert _train(tmp_path, config) == 1
    err = capsys.readouterr().err
    assert f"{garbled}: transformer holds NaN or inf in 1 tensors (e.g. {name})" in err
    assert not (tmp_path / "saves" / "run" / "checkpoints").exists()

    from flow_factory.sample import main as ff_sample  # which would write black images

    assert ff_sample([str(garbled), "--prompts", "a cat", "--steps", "2", "--out", str(tmp_path / "out")]) == 2
    assert f"ff-sample: {garbled}: transformer holds NaN or inf" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ atomic checkpoints
def _killed_during_a_save(point: str, epoch: int, argv: list) -> None:
    """``ff-train ARGV`` in a process of its own, SIGKILLed at ``point`` of epoch ``epoch``'s save: just
    after its LoRA (weights) or its optimizer state (torch.save) is written, or before the finished
    folder is renamed into place (rename)."""
    import flow_factory.checkpoint as ckpt

    def kill_at(name, fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            paths = [str(a) for a in args if isinstance(a, (str, os.PathLike))]
            if name == point and any(f"epoch_{epoch}" in p for p in paths):
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        return wrapped

    ckpt.save_lora = kill_at("weights", ckpt.save_lora)  # (pipeline_class, transformer, out_dir, weight_name)
    ckpt.torch.save = kill_at("torch.save", ckpt.torch.save)  # (obj, path): the optimizer state
    publish = ckpt._publish

    def before_rename(tmp, out):
        if point == "rename" and out.name == f"epoch_{epoch}":
            os.kill(os.getpid(), signal.SIGKILL)
        publish(tmp, out)
    ckpt._publish = before_rename
    sys.exit(main(argv))


@pytest.mark.parametrize("point,resume", [("weights", "run folder"), ("torch.save", "checkpoint"),
                                          ("rename", "latest")])
def test_kill_during_a_save_resumes_to_the_uninterrupted_weights(tmp_path, tiny_sd3_path, uninterrupted,
                                                                 point, resume):
    config = _config(tmp_path, tiny_sd3_path, max_epochs=3)
    config["rewards"] = BRIGHTNESS
    path = write_config(tmp_path, config)
    code, output = call_forked(_killed_during_a_save, point, 2, [str(path)])
    assert code == -signal.SIGKILL, output[-2000:]
    run_dir = tmp_path / "saves" / "run"
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] and not (run_dir / "checkpoints" / "epoch_2").exists()
    partial = run_dir / "checkpoints" / ".epoch_2.partial"
    assert partial.is_dir()

    # a partial folder named directly is a clear error, not a crash inside a loader
    assert main([str(path), f"model.resume_path={partial}"]) == 2

    where = {"run folder": str(run_dir), "checkpoint": str(run_dir / "checkpoints" / "epoch_1"),
             "latest": "latest"}[resume]
    reset()
    assert main([str(path), f"model.resume_path={where}"]) == 0
    _assert_same(_lora(run_dir, 3), uninterrupted)
    assert not partial.exists()  # the resumed run's save of epoch 2 cleared it


def test_an_incomplete_or_foreign_checkpoint_is_named_before_the_model_loads(tmp_path, tiny_sd3_path,
                                                                              capsys, monkeypatch):
    monkeypatch.setattr("flow_factory.trainer.model.load_adapter", lambda *a, **k: pytest.fail("the model loaded"))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("hello")
    config = _config(tmp_path, tiny_sd3_path)
    config["model"]["resume_path"] = str(foreign)
    assert _train(tmp_path, config) == 2
    err = capsys.readouterr().err
    assert f"model.resume_path: {foreign} has no trainer_state.json: not a complete ff-train checkpoint" in err

    broken = tmp_path / "broken" / "checkpoints" / "epoch_2"
    broken.mkdir(parents=True)
    (broken / "trainer_state.json").write_text(json.dumps({"epoch": 2, "global_step": 2,
                                                            "files": {LORA: 1234, "optimizer.pt": 99}}))
    (broken / LORA).write_bytes(b"x" * 100)
    config["model"]["resume_path"] = str(broken)
    assert _train(tmp_path, config) == 2
    err = capsys.readouterr().err
    assert f"{LORA} has 100 bytes, 1234 were written; optimizer.pt is missing" in err
    config["model"]["resume_path"] = str(tmp_path / "broken")  # the run folder: no complete checkpoint
    assert _train(tmp_path, config) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err


# ------------------------------------------------------------------ interrupts
@pytest.mark.parametrize("sig", ["sigint", "sigterm"])
def test_a_signal_mid_epoch_saves_the_last_finished_epoch_and_resumes_exactly(
        tmp_path, tiny_sd3_path, calls_per_epoch, uninterrupted, capsys, sig):
    config = _config(tmp_path, tiny_sd3_path, max_epochs=3)
    config["log"]["save_freq"] = 0  # only the end would be saved
    reset({calls_per_epoch: sig})  # the first reward call of epoch 1: mid-sampling
    path = write_config(tmp_path, config)
    handler = signal.getsignal(signal.SIGINT)
    code = main([str(path)])
    signum = signal.SIGINT if sig == "sigint" else signal.SIGTERM
    assert code == 128 + signum
    err = capsys.readouterr().err
    run_dir = tmp_path / "saves" / "run"
    assert f"interrupted by {signal.Signals(signum).name}; saved {run_dir / 'checkpoints' / 'epoch_1'}" in err
    resume_line = err.strip().splitlines()[-1].split()
    assert resume_line[:2] == ["ff-train", str(path)]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["epoch_1"]
    assert signal.getsignal(signal.SIGINT) is handler  # restored

    reset()
    assert main(resume_line[1:]) == 0  # the printed command, as a user would paste it
    _assert_same(_lora(run_dir, 3), uninterrupted)


# ------------------------------------------------------------------ run folders
def test_a_reused_run_name_is_refused_unless_resuming_or_overwriting(tmp_path, tiny_sd3_path, capsys):
    reset()
    config = _config(tmp_path, tiny_sd3_path, max_epochs=1)
    assert _train(tmp_path, config) == 0
    run_dir = tmp_path / "saves" / "run"
    before = _lora(run_dir, 1)
    assert _train(tmp_path, config) == 2
    err = capsys.readouterr().err
    assert f"log.run_name: {run_dir} already holds a run" in err and "log.overwrite: true" in err
    _assert_same(_lora(run_dir, 1), before)  # untouched

    config["log"]["overwrite"] = True
    config["train"]["max_epochs"] = 2
    assert _train(tmp_path, config) == 0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["epoch_1", "epoch_2"]
    assert not (run_dir / ".replaced").exists()  # the replaced run is gone once the new one started


def _files(run_dir: Path) -> dict[str, bytes]:
    """A run's files and their bytes (not the lock, nor run.json: who holds the folder now)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name not in (".lock", "run.json")}


# the steps of start-up after the run folder is claimed: a function a step calls, where a run fails or dies
STARTUP_STEPS = {"rewards": "flow_factory.trainer.trainer.RewardSet.from_configs",
                 "pipeline": "flow_factory.trainer.model.load_adapter",
                 "trained weights": "flow_factory.trainer.trainer.make_trainable",
                 "the old run's removal": "flow_factory.trainer.run_folder.RunFolder.started"}


def _killed_at(step: str, config_path: Path) -> int:
    """``ff-train`` in a forked copy of this process that dies at ``step`` as a kill -9 would leave it: no
    ``except``, no ``finally`` runs. Its exit status."""
    pid = os.fork()
    if pid == 0:
        try:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(STARTUP_STEPS[step], lambda *args, **kwargs: os._exit(137))
                main([str(config_path)])
        finally:
            os._exit(3)  # the step was never reached
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_overwrite_destroys_no_run_until_the_new_one_has_started(tmp_path, tiny_sd3_path, monkeypatch):
    reset()
    config = _config(tmp_path, tiny_sd3_path, max_epochs=1)
    assert _train(tmp_path, config) == 0
    run_dir = tmp_path / "saves" / "run"
    old = _files(run_dir)
    assert "checkpoints/epoch_1/" + LORA in old and "history.json" in old
    config["log"]["overwrite"] = True
    path = write_config(tmp_path, config)
    for step in STARTUP_STEPS:
        with monkeypatch.context() as patch:  # the new run fails: the old one is back at once
            patch.setattr(STARTUP_STEPS[step], lambda *args, **kwargs: (_ for _ in ()).throw(OSError(step)))
            with pytest.raises(OSError, match=step):
                main([str(path)])
        assert _files(run_dir) == old, step
        assert _killed_at(step, path) == 137  # killed: the old run waits in .replaced/ for the next claim
        assert _files(run_dir) != old and set(_files(run_dir / ".replaced")) == set(old), step
        with pytest.raises(RunFolderError, match="already holds a run"):
            RunFolder(run_dir).claim()  # the next claim puts it back, and refuses to reuse it unasked
        assert _files(run_dir) == old, step


def test_resuming_an_older_checkpoint_of_the_same_run_is_refused(tmp_path, tiny_sd3_path, capsys):
    reset()
    config = _config(tmp_path, tiny_sd3_path, max_epochs=2)
    assert _train(tmp_path, config) == 0
    run_dir = tmp_path / "saves" / "run"
    config["model"]["resume_path"] = str(run_dir / "checkpoints" / "epoch_1")
    config["train"]["max_epochs"] = 3
    assert _train(tmp_path, config) == 2
    assert "is older than epoch_2 of the same run, which the resumed run would overwrite" in capsys.readouterr().err


def test_a_live_run_folder_is_locked(tmp_path, tiny_sd3_path, capsys):
    holder = RunFolder(tmp_path / "saves" / "run")
    holder.claim()
    try:
        assert _train(tmp_path, _config(tmp_path, tiny_sd3_path, max_epochs=1)) == 2
        assert "is in use by a live run (pid" in capsys.readouterr().err
    finally:
        holder.release()


def test_default_run_names_never_collide(tmp_path, tiny_sd3_path):
    from flow_factory.config import parse_config

    config = _config(tmp_path, tiny_sd3_path)
    del config["log"]["run_name"]
    # all in the same second or two: 20 draws of 6 hex digits collide with probability 190 / 16.7e6 ~ 1e-5
    # (4 digits, 3e-3, did collide once here); a collision would be refused by the run folder's lock
    names = {parse_config(config).log.run_name for _ in range(20)}
    assert len(names) == 20


def test_an_unwritable_save_dir_fails_before_the_model_loads(tmp_path, tiny_sd3_path, capsys, monkeypatch):
    monkeypatch.setattr("flow_factory.trainer.model.load_adapter", lambda *a, **k: pytest.fail("the model loaded"))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    config = _config(tmp_path, tiny_sd3_path)
    config["log"]["save_dir"] = str(blocker / "saves")
    assert _train(tmp_path, config) == 2
    assert f"log.save_dir: cannot create the run folder {blocker / 'saves' / 'run'}" in capsys.readouterr().err


# ------------------------------------------------------------------ late errors about resuming
def test_resume_errors_name_the_key_before_the_model_loads(tmp_path, tiny_sd3_path, capsys, monkeypatch):
    reset()
    config = _config(tmp_path, tiny_sd3_path, max_epochs=1)
    assert _train(tmp_path, config) == 0
    checkpoint = tmp_path / "saves" / "run" / "checkpoints" / "epoch_1"
    config["log"]["run_name"] = "next"
    config["model"]["resume_path"] = str(checkpoint)

    with monkeypatch.context() as m:
        m.setattr("flow_factory.trainer.model.load_adapter", lambda *a, **k: pytest.fail("the model loaded"))
        assert _train(tmp_path, config) == 2  # max_epochs 1: nothing left to train
        assert (f"model.resume_path: {checkpoint} has 1 epochs done and train.max_epochs is 1: nothing to train; "
                "set train.max_epochs above 1") in capsys.readouterr().err

    config["train"]["max_epochs"] = 2
    config["model"]["finetune_type"] = "full"
    assert _train(tmp_path, config) == 2
    assert (f"model.resume_path: {checkpoint} holds a lora checkpoint, but model.finetune_type is 'full'; "
            "set model.finetune_type: lora") in capsys.readouterr().err
