"""The trainer's own behaviour: noise sharing, the SDE window, full fine-tuning with a
frozen reference, and tracker errors."""

import pytest
import torch
from helpers_runs import tiny_run_config

from flow_factory.config import parse_config
from flow_factory.dynamics.window import choose_sde_steps
from flow_factory.trainer import Trainer
from flow_factory.seeding import generator
from flow_factory.trainer.tracking import check_backend


def _trainer(tmp_path, model_path, **train):
    config = tiny_run_config(tmp_path, "sd3-5", model_path, **train)
    config["log"]["logging_backend"] = "none"
    return Trainer(parse_config(config))


@pytest.mark.parametrize("same_latent", [True, False])
def test_same_latent_shares_initial_noise_within_a_group(tmp_path, tiny_sd3_path, same_latent):
    trainer = _trainer(tmp_path, tiny_sd3_path, same_latent=same_latent, group_size=3,
                       per_device_batch_size=3, unique_sample_num_per_epoch=2)
    rollouts = trainer.sample_epoch(0)
    noise, groups = rollouts.latents[:, 0], rollouts.group_ids
    for g in groups.unique():
        members = noise[groups == g]
        assert torch.equal(members[0], members[1]) == same_latent
    assert not torch.equal(noise[groups == 0][0], noise[groups == 1][0])


def test_only_the_sde_window_is_stochastic_and_trained(tmp_path, tiny_sd3_path):
    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path, num_inference_steps=4)
    config["scheduler"].update(sde_steps=[0, 1, 2], num_sde_steps=1)
    config["log"]["logging_backend"] = "none"
    trainer = Trainer(parse_config(config))
    windows = []
    for epoch in range(4):
        rollouts = trainer.sample_epoch(epoch)
        expected = choose_sde_steps(4, [0, 1, 2], 1, generator("window", 3, epoch))
        assert rollouts.sde_steps == expected
        windows.append(tuple(expected))
        # ODE steps record no log-prob; the stochastic one does
        stochastic = (rollouts.log_probs != 0).any(dim=0).nonzero().flatten().tolist()
        assert stochastic == expected
    assert len(set(windows)) > 1, "the window should be redrawn each epoch"

    calls = []
    original = trainer.algorithm.loss
    trainer.algorithm.loss = lambda policy, batch: calls.append(int(batch.step[0])) or original(policy, batch)
    rollouts = trainer.sample_epoch(0)
    trainer.optimize(rollouts, trainer.compute_advantages(rollouts, 0), 0)
    batches = len(rollouts.prompts) // trainer.cfg.train.per_device_batch_size
    assert calls == rollouts.sde_steps * batches


def test_full_finetune_keeps_a_frozen_reference_and_saves_the_transformer(tmp_path, tiny_sd3_path):
    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path, max_epochs=2, kl_beta=0.1, kl_type="x-based",
                             learning_rate=1e-3)
    config["model"]["finetune_type"] = "full"
    config["log"]["logging_backend"] = "none"
    trainer = Trainer(parse_config(config))
    start = {k: v.clone() for k, v in trainer.adapter.transformer.state_dict().items()}
    history = trainer.train()

    assert history[0]["train/kl"] == pytest.approx(0.0, abs=1e-10)  # first step: policy == reference
    assert history[1]["train/kl"] > 0  # after an update the policy has moved away
    assert list(trainer.policy.reference) == ["transformer"]  # a frozen copy per trained component
    reference = trainer.policy.reference["transformer"].state_dict()
    assert all(torch.equal(reference[k], start[k]) for k in start)

    from diffusers import SD3Transformer2DModel

    saved = SD3Transformer2DModel.from_pretrained(tmp_path / "saves" / "run" / "checkpoints" / "epoch_2" / "transformer")
    trained = trainer.adapter.transformer.state_dict()
    assert all(torch.equal(saved.state_dict()[k], trained[k]) for k in trained)
    assert any(not torch.equal(trained[k], start[k]) for k in start)


def test_a_missing_tracker_is_a_clear_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "swanlab") else real(name, *a))
    with pytest.raises(ValueError, match=r"^log.logging_backend: 'wandb' is not installed; pip install "
                                         r"'flow_factory\[wandb\]' \(or pip install wandb\), or set "
                                         r"log.logging_backend: tensorboard or none$"):
        check_backend("wandb")
    assert check_backend("none") is None


def test_the_reward_curve_is_a_figure_with_labelled_axes_and_a_long_series_under_its_trailing_mean():
    from flow_factory.media import curve_figure, plot_curves, trailing_mean

    assert trailing_mean([1.0, 2.0, 3.0, 4.0, 5.0], 3) == [1.0, 1.5, 2.0, 3.0, 4.0]
    train = [(e, float(e % 2)) for e in range(100)]  # a reward alternating 0 / 1 every epoch
    evals = [(e, 0.3 + e / 300) for e in range(0, 100, 10)]
    fig = curve_figure({"reward/r/mean": train, "eval/reward/r": evals}, "reward per epoch")
    fig.canvas.draw()  # tick labels are made when the figure is drawn
    (ax,) = fig.axes
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == ("reward per epoch", "epoch", "reward")

    def labels(axis, lo, hi):  # the numbers written at the ticks inside the axes
        return [float(label.get_text().replace("\N{MINUS SIGN}", "-"))
                for tick, label in zip(axis.get_majorticklocs(), axis.get_majorticklabels()) if lo <= tick <= hi]

    epochs, rewards = labels(ax.xaxis, *ax.get_xlim()), labels(ax.yaxis, *ax.get_ylim())
    assert len(epochs) >= 3 and all(e == int(e) for e in epochs) and epochs[0] <= 0 and epochs[-1] >= 90
    assert len(rewards) >= 3 and rewards[0] <= 0 and rewards[-1] >= 1

    # 100 noisy points: drawn faint, under their mean over 5 epochs (which stays at 0.4-0.6);
    # the 10 eval points: a line with markers; the legend names the two series
    raw, mean, ev = ax.get_lines()
    assert list(raw.get_xdata()) == list(range(100)) and list(raw.get_ydata()) == [v for _, v in train]
    assert list(mean.get_ydata()) == trailing_mean([v for _, v in train], 5)
    assert all(0.4 <= y <= 0.6 for y in mean.get_ydata()[4:])
    assert raw.get_color() == mean.get_color() and raw.get_alpha() < 1
    assert mean.get_linewidth() > raw.get_linewidth()
    assert list(zip(ev.get_xdata(), ev.get_ydata())) == evals and ev.get_marker() == "o"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["reward/r/mean (mean of 5 epochs)", "eval/reward/r"]
    assert plot_curves({"reward/r/mean": train}, "t").size == (640, 400)
