"""Flow-DPPO (``trainer_type: dppo``): the trust-region mask and loss against hand-computed values, the
step KL to the rollout against its closed forms, on-policy nothing masked and the ratio 1, and ``ff-train``
end to end on tiny SD3 (a GPU's precision), FLUX.1 and FLUX.1 Kontext (an editing family), with exact
resume under a guided reference KL."""

import json
import math

import pytest
import torch
from helpers_algorithms import batch_at_step, perturb_lora
from helpers_runs import straight_and_resumed, tiny_run_config, write_config
from safetensors.torch import load_file

from flow_factory.algorithms import DPPO, TrainBatch, make_algorithm, trust_region_loss
from flow_factory.config import ConfigError, parse_config
from flow_factory.config.train import TrainConfig
from flow_factory.dynamics import make_dynamics
from flow_factory.train import main


def test_the_mask_drops_the_samples_outside_the_region_that_push_further_out():
    """Five samples, all with KL 1 against a threshold of 0.5: the first two push further (r > 1 with
    A > 0, r < 1 with A < 0) and are dropped; the third and fourth pull back and stay; the fifth is
    on-policy (r = 1). A is clipped to [-3, 3] first."""
    log_ratio = torch.tensor([0.1, -0.1, 0.1, -0.1, 0.0], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 7.0])
    loss, metrics = trust_region_loss(log_ratio, adv, torch.ones(5), threshold=0.5, adv_clip_range=3.0)
    e = math.exp(0.1)
    kept_terms = [-(-1.0) * e, -(1.0) / e, -3.0]  # -A r of the kept samples
    assert loss.item() == pytest.approx(sum(kept_terms) / 5, rel=1e-6)
    assert metrics["masked_frac"].item() == pytest.approx(2 / 5)
    loss.backward()  # d(-A r)/d log r = -A r: none for the dropped samples
    torch.testing.assert_close(log_ratio.grad, torch.tensor([0.0, 0.0, e, -1 / e, -3.0]) / 5)

    # inside the region (KL below the threshold) every sample counts: the plain surrogate -mean(A r)
    inside, metrics = trust_region_loss(log_ratio.detach(), adv, torch.full((5,), 0.4), 0.5, 3.0)
    expected = -(adv.clamp(-3, 3) * log_ratio.detach().exp()).mean()
    assert inside.item() == pytest.approx(expected.item(), rel=1e-6) and metrics["masked_frac"].item() == 0
    with pytest.raises(ValueError, match="one value per sample"):
        trust_region_loss(log_ratio, adv.unsqueeze(1), torch.ones(5), 0.5, 3.0)


@pytest.mark.parametrize("dynamics_name", ["Flow-SDE", "Dance-SDE", "CPS"])
def test_the_step_kl_to_the_rollout_is_the_gaussian_kl_and_the_velocity_distance(dynamics_name):
    """x-based: mean((mu - mu_old)^2) / (2 s^2), s the step's scale; v-based: mean((v - v_old)^2), though
    the rollout recorded only its mean (the algorithm recovers the velocity from it)."""
    dynamics = make_dynamics(dynamics_name, 0.7)
    g = torch.Generator().manual_seed(0)
    x, v_old = torch.randn(3, 4, 2, 2, generator=g), torch.randn(3, 4, 2, 2, generator=g)
    v = v_old + 0.1 * torch.randn(3, 4, 2, 2, generator=g)
    sigma, sigma_next = torch.full((3,), 0.8), torch.full((3,), 0.6)
    old_mean = dynamics.mean_and_std(x, v_old, sigma, sigma_next)[0]
    mean, std = dynamics.mean_and_std(x, v, sigma, sigma_next)
    batch = TrainBatch(x=x, x_next=x, sigma=sigma, sigma_next=sigma_next, old_log_prob=torch.zeros(3),
                       advantages=torch.zeros(3), cond={}, step=torch.zeros(3, dtype=torch.long), old_mean=old_mean)

    x_based = DPPO(TrainConfig(trainer_type="dppo", kl_mask_type="x-based"), dynamics)
    s = torch.as_tensor(std).reshape(3, -1)[:, :1]
    expected = ((mean - old_mean) ** 2).reshape(3, -1).mean(dim=1) / (2 * s[:, 0] ** 2)
    torch.testing.assert_close(x_based.kl_to_rollout(batch, v, mean, std), expected, rtol=1e-5, atol=0)

    v_based = DPPO(TrainConfig(trainer_type="dppo", kl_mask_type="v-based"), dynamics)
    torch.testing.assert_close(v_based.kl_to_rollout(batch, v, mean, std),
                               ((v - v_old) ** 2).reshape(3, -1).mean(dim=1), rtol=1e-4, atol=0)


@pytest.mark.parametrize("kl_mask_type", ["x-based", "v-based"])
@pytest.mark.parametrize("dynamics_name", ["Flow-SDE", "Dance-SDE", "CPS"])
def test_on_policy_the_ratio_is_one_and_nothing_is_masked(tiny_sd3_path, dynamics_name, kl_mask_type):
    """DESIGN invariant 1 under DPPO: the step the rollout took, recomputed, has ratio 1 and KL 0 to it, so
    even a threshold of 0 drops nothing."""
    from flow_factory.models import load_adapter
    from flow_factory.models.lora import apply_lora
    from flow_factory.trajectory import TrajectoryOptions, sample_trajectory
    from flow_factory.trainer.policy import AdapterPolicy

    adapter = load_adapter("sd3-5", tiny_sd3_path)
    apply_lora(adapter.transformer, 4, 4, "default", adapter.default_lora_targets)
    perturb_lora(adapter.transformer)
    dynamics = adapter.sampling_dynamics(make_dynamics(dynamics_name, 0.7))
    algorithm = make_algorithm("dppo", TrainConfig(trainer_type="dppo", kl_mask_type=kl_mask_type,
                                                   kl_mask_threshold=0.0), dynamics)
    assert algorithm.records_step_means
    policy = AdapterPolicy(adapter, 3.0, "lora", keep_reference=False)
    cond = adapter.encode(["a red cube", "a blue ball"], None, 3.0)
    noise = adapter.initial_noise(2, 64, 64, torch.Generator().manual_seed(1))
    traj = sample_trajectory(adapter, dynamics, cond, noise, adapter.sigmas(3, 64, 64), 3.0,
                             generator=torch.Generator().manual_seed(2), options=TrajectoryOptions(record_means=True))
    for step in traj.sde_steps:
        batch = batch_at_step(traj.latents, traj.log_probs, torch.tensor([1.0, -1.0]), traj.sigmas, cond, step,
                              old_means=traj.means)
        _, metrics = algorithm.loss(policy, batch)
        assert abs(metrics["ratio_min"].item() - 1) < 1e-6 and abs(metrics["ratio_max"].item() - 1) < 1e-6
        assert metrics["kl_to_rollout"].item() < 1e-10 and metrics["masked_frac"].item() == 0, (step, metrics)


def test_the_config_reads_dppos_keys_and_refuses_them_elsewhere(tmp_path):
    from test_config import minimal

    cfg = parse_config(minimal(train={"trainer_type": "dppo", "kl_mask_type": "v-based", "kl_mask_threshold": 1e-5,
                                      "kl_beta": 0.01, "kl_guidance_scale": 4.5, "guidance_scale": 1.0}))
    assert (cfg.train.kl_mask_type, cfg.train.kl_mask_threshold) == ("v-based", 1e-5)
    # the reference's CFG needs the prompts' negative branch although the rollouts run without CFG
    assert cfg.train.conditioning_guidance_scale == 4.5
    with pytest.raises(ConfigError, match=r"train: kl_mask_threshold are dppo's; grpo does not use them"):
        parse_config(minimal(train={"trainer_type": "grpo", "kl_mask_threshold": 1e-5}))
    with pytest.raises(ConfigError, match=r"train.trainer_type 'dppo' needs a stochastic dynamics"):
        parse_config(minimal(train={"trainer_type": "dppo"}, scheduler={"dynamics_type": "ODE"}))


@pytest.mark.parametrize("model_type,fixture", [("sd3-5", "tiny_sd3_path"), ("flux1", "tiny_flux_path"),
                                                ("flux1-kontext", "tiny_flux_kontext_path")])
def test_ff_train_dppo_trains_and_writes_a_loadable_lora(request, tmp_path, model_type, fixture, monkeypatch):
    """Two epochs, two optimizer steps each (the second sees a moved policy, so the mask has something to
    judge); SD3 in a GPU's precision (bf16 autocast, fp16 trajectories), its LoRA loaded by diffusers."""
    if model_type == "sd3-5":
        monkeypatch.setenv("FF_CPU_MIXED_PRECISION", "1")
    path = request.getfixturevalue(fixture)
    config = tiny_run_config(tmp_path, model_type, path, trainer_type="dppo", max_epochs=2, group_size=4,
                             gradient_step_per_epoch=2, kl_mask_threshold=0.0)
    assert main([str(write_config(tmp_path, config))]) == 0
    run_dir = tmp_path / "saves" / "run"
    history = json.loads((run_dir / "history.json").read_text())["train"]
    assert [r["epoch"] for r in history] == [0, 1]
    for key in ("train/masked_frac", "train/kl_to_rollout", "train/ratio_mean", "train/loss", "train/grad_norm"):
        assert key in history[-1], key
    lora = load_file(run_dir / "checkpoints" / "epoch_2" / "pytorch_lora_weights.safetensors")
    assert max(float(v.abs().max()) for k, v in lora.items() if "lora_B" in k) > 0, "the LoRA did not move"
    if model_type == "sd3-5":
        from diffusers import StableDiffusion3Pipeline

        StableDiffusion3Pipeline.from_pretrained(path).load_lora_weights(run_dir / "checkpoints" / "epoch_2")


def test_dppo_resumes_exactly_with_a_guided_reference(tmp_path, tiny_sd3_path):
    """v-based mask at threshold 0 (every outward sample of a moved policy dropped), a v-based KL to the
    reference called with CFG at 3 while the rollouts run without CFG: stopped after epoch 1 and resumed,
    the run ends at the uninterrupted run's LoRA and EMA."""
    extra = dict(trainer_type="dppo", kl_mask_type="v-based", kl_mask_threshold=0.0, kl_beta=0.1,
                 kl_type="v-based", kl_guidance_scale=3.0, guidance_scale=1.0, gradient_step_per_epoch=2,
                 group_size=4, ema_decay=0.5)

    straight, resumed = straight_and_resumed(
        tmp_path, lambda folder, epochs: tiny_run_config(folder, "sd3-5", tiny_sd3_path, max_epochs=epochs, **extra),
        epochs=3, stop_after=1)
    history = json.loads((straight / "history.json").read_text())["train"]
    assert any(r["train/masked_frac"] > 0 for r in history), "the mask never dropped a sample"
    assert all("train/kl" in r for r in history)
    end = [d / "checkpoints" / "epoch_3" for d in (straight, resumed)]
    a, b = (load_file(d / "pytorch_lora_weights.safetensors") for d in end)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)
    ema_a, ema_b = (torch.load(d / "ema.pt", weights_only=True)["weights"] for d in end)
    for x, y in zip(ema_a, ema_b):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0)


def test_at_a_deterministic_step_any_move_leaves_the_region():
    """CPS's last step has std 0: the means agreeing is KL 0, any difference infinite; the infinite KL masks
    the outward sample and stays out of the logged mean."""
    from flow_factory.algorithms import step_kl

    old = torch.zeros(3, 4)
    new = torch.tensor([[0.0] * 4, [0.1, 0, 0, 0], [0.0] * 4])
    kl = step_kl(new, old, torch.tensor([[0.0], [0.0], [0.5]]))
    assert kl[0] == 0 and kl[1] == float("inf") and kl[2] == 0
    loss, metrics = trust_region_loss(torch.tensor([0.0, 0.1, 0.1]), torch.ones(3), kl, 1e-6, 5.0)
    assert metrics["masked_frac"].item() == pytest.approx(1 / 3) and metrics["kl_to_rollout"].item() == 0
    assert torch.isfinite(loss)
