"""Flow-Factory's run-level behaviour, here: a dataset without a test split trains with
evaluation off, and the memory settings (latent_storage_dtype, offload_samples_to_cpu)
change where and how rollouts are kept, not what the run computes."""

import logging

import pytest

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


def test_save_model_only_writes_no_optimizer_state_and_such_a_checkpoint_still_resumes(tmp_path, tiny_sd3_path,
                                                                                        caplog):
    config = _config(tmp_path, tiny_sd3_path, max_epochs=1)
    config["log"]["save_model_only"] = True
    config["eval"]["eval_freq"] = 0
    Trainer(parse_config(config)).train()
    saved = tmp_path / "saves" / "run" / "checkpoints" / "epoch_1"
    assert (saved / "pytorch_lora_weights.safetensors").is_file() and not (saved / "optimizer.pt").exists()

    config["train"]["max_epochs"] = 2
    config["model"]["resume_path"] = str(saved)
    with caplog.at_level(logging.WARNING):
        history = Trainer(parse_config(config)).train()
    assert [r["epoch"] for r in history] == [0, 1]  # epoch 0 from the checkpoint, epoch 1 trained now
    assert any("holds no optimizer state" in r.getMessage() for r in caplog.records)


def test_resume_type_lora_starts_a_new_run_from_the_checkpoint_weights(tmp_path, tiny_sd3_path):
    from flow_factory.checkpoint import LORA_WEIGHT_NAME
    from safetensors.torch import load_file

    first = _config(tmp_path / "first", tiny_sd3_path, max_epochs=1)
    first["eval"]["eval_freq"] = 0
    Trainer(parse_config(first)).train()
    saved = tmp_path / "first" / "saves" / "run" / "checkpoints" / "epoch_1"

    second = _config(tmp_path / "second", tiny_sd3_path, max_epochs=1)
    second["model"].update(resume_path=str(saved), resume_type="lora")
    trainer = Trainer(parse_config(second))
    assert trainer.epoch == 0 and trainer.history == []  # a new run: nothing of the old one's progress
    lora = load_file(saved / LORA_WEIGHT_NAME)
    trained = {n: p for n, p in trainer.adapter.transformer.named_parameters() if "lora_B" in n}
    assert len(trained) == sum("lora_B" in k for k in lora) > 0
    moved = max(float(v.abs().max()) for k, v in lora.items() if "lora_B" in k)
    assert moved > 0 and max(float(p.detach().abs().max()) for p in trained.values()) == moved  # the saved weights
    trainer.close()


def test_master_weight_dtype_sets_the_trainable_weights_precision(tmp_path, tiny_sd3_path):
    config = _config(tmp_path, tiny_sd3_path, max_epochs=1)
    config["model"]["master_weight_dtype"] = "fp16"  # Flow-Factory's spelling
    trainer = Trainer(parse_config(config))
    assert trainer.cfg.model.master_weight_dtype == "float16"
    assert {p.dtype for p in trainer.params} == {torch.float16}
    frozen = {p.dtype for p in trainer.adapter.transformer.parameters() if not p.requires_grad}
    assert frozen == {torch.float32}
    trainer.close()


def test_attn_backend_is_set_on_the_transformer_and_a_wrong_one_is_named(tmp_path, tiny_flux_path, tiny_sd3_path,
                                                                         monkeypatch):
    from flow_factory.config import ConfigError

    config = tiny_run_config(tmp_path, "flux1", tiny_flux_path)
    config["log"]["logging_backend"] = "none"
    config["model"]["attn_backend"] = "_native_math"  # Flow-Factory's model.attn_backend, diffusers' names
    trainer = Trainer(parse_config(config))
    backends = {str(getattr(m.processor._attention_backend, "value", m.processor._attention_backend))
                for m in trainer.adapter.transformer.modules()
                if getattr(getattr(m, "processor", None), "_attention_backend", None) is not None}
    assert backends == {"_native_math"}
    trainer.close()

    # SD3's joint-attention processor takes no backend: diffusers would skip it without a word
    sd3 = _config(tmp_path / "sd3", tiny_sd3_path)
    sd3["model"]["attn_backend"] = "_native_math"
    with pytest.raises(ConfigError, match="model.attn_backend: sd3-5's attention processors "
                                          r"\(JointAttnProcessor2_0\) do not take"):
        Trainer(parse_config(sd3))

    monkeypatch.setattr("flow_factory.trainer.model.load_adapter", lambda *a, **k: pytest.fail("the model loaded"))
    config["model"]["attn_backend"] = "flashy"
    config["log"]["run_name"] = "other"
    with pytest.raises(ConfigError, match="model.attn_backend: 'flashy' is not one of diffusers' attention backends"):
        Trainer(parse_config(config))
