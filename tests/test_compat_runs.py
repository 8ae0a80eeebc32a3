"""Flow-Factory's run-level behaviour, here: a dataset without a test split trains with
evaluation off, and the memory settings (latent_storage_dtype, offload_samples_to_cpu)
change where and how rollouts are kept, not what the run computes."""

import logging

import torch
from helpers_runs import tiny_run_config

from flow_factory.config import parse_config
from flow_factory.trainer import Trainer


def _config(tmp_path, model_path, **train):
    config = tiny_run_config(tmp_path, "sd3-5", model_path, **train)
    config["log"]["logging_backend"] = "none"
    return config


def test_a_dataset_with_only_train_prompts_trains_with_evaluation_off(tmp_path, tiny_sd3_path, caplog):
    config = _config(tmp_path, tiny_sd3_path, max_epochs=2)
    (tmp_path / "data" / "test.txt").unlink()
    assert config["eval"]["eval_freq"] == 2
    with caplog.at_level(logging.WARNING):
        trainer = Trainer(parse_config(config))
        history = trainer.train()
    assert [r["epoch"] for r in history] == [0, 1]
    assert trainer.eval_history == []
    assert not (tmp_path / "saves" / "run" / "samples").exists()
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "no test prompts" in warning and "evaluation is off" in warning


def test_a_broken_test_file_is_still_an_error(tmp_path, tiny_sd3_path):
    from flow_factory.data import PromptFileError

    config = _config(tmp_path, tiny_sd3_path)
    (tmp_path / "data" / "test.txt").write_text("a prompt\n\nanother\n")
    try:
        Trainer(parse_config(config))
    except PromptFileError as err:
        assert "test.txt:2" in str(err)
    else:
        raise AssertionError("a blank line inside test.txt must be refused")


def _one_epoch(tmp_path, model_path, **train):
    trainer = Trainer(parse_config(_config(tmp_path, model_path, max_epochs=1, **train)))
    rollouts = trainer.sample_epoch(0)
    advantages = trainer.compute_advantages(rollouts, 0)
    trainer.optimize(rollouts, advantages, 0)
    weights = [p.detach().clone() for p in trainer.params]
    trainer.close()
    return rollouts, weights


def test_offloaded_half_precision_rollouts_train_as_kept_ones(tmp_path, tiny_sd3_path):
    """The same epoch with the rollouts offloaded to CPU and with them kept on the device gives the
    same update; fp16 storage (the default) keeps half the bytes of fp32."""
    kept, w_kept = _one_epoch(tmp_path / "a", tiny_sd3_path)
    offloaded, w_off = _one_epoch(tmp_path / "b", tiny_sd3_path, offload_samples_to_cpu=True)
    full, _ = _one_epoch(tmp_path / "c", tiny_sd3_path, latent_storage_dtype="fp32")
    assert offloaded.latents.device.type == "cpu" and offloaded.log_probs.device.type == "cpu"
    assert all(v.device.type == "cpu" for v in offloaded.cond.values())
    assert kept.latents.dtype == torch.float16 and full.latents.dtype == torch.float32
    assert kept.latents.nbytes * 2 == full.latents.nbytes
    for a, b in zip(w_kept, w_off):
        assert torch.equal(a, b)
