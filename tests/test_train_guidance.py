"""``train.train_guidance_scale``: the decoupled algorithms train the velocity at their own CFG scale
(Diffusion-DPO on the unguided velocity while rollouts sample with CFG, as flow_grpo and Flow-Factory's
DPO example do), both experts of a two-expert model at that scale; the coupled ones refuse another
scale than the rollouts'."""

from types import SimpleNamespace

import pytest
import torch
from helpers_runs import tiny_run_config, write_config
from test_config import minimal

from flow_factory.config import ConfigError, parse_config
from flow_factory.models.sd3 import SD3Adapter
from flow_factory.train import main
from flow_factory.trainer.policy import AdapterPolicy


def test_the_config_reads_it_for_decoupled_algorithms_and_refuses_another_scale_for_coupled_ones():
    cfg = parse_config(minimal(train={"trainer_type": "dpo", "guidance_scale": 1.0, "train_guidance_scale": 3.0},
                               scheduler={"dynamics_type": "ODE"}))
    assert cfg.train.loss_guidance_scale == 3.0
    assert cfg.train.conditioning_guidance_scale == 3.0  # the loss's CFG needs the negative branch encoded
    assert parse_config(minimal(train={"guidance_scale": 4.5})).train.loss_guidance_scale == 4.5
    parse_config(minimal(train={"trainer_type": "grpo", "guidance_scale": 4.5, "train_guidance_scale": 4.5}))
    with pytest.raises(ConfigError, match=r"train.train_guidance_scale: grpo trains the rollout's own steps, which "
                                          r"ran at guidance_scale 4.5; another scale would make even the first "
                                          r"update off-policy"):
        parse_config(minimal(train={"trainer_type": "grpo", "guidance_scale": 4.5, "train_guidance_scale": 1.0}))


def test_dpo_trains_the_unguided_velocity_while_the_rollouts_use_cfg(tmp_path, tiny_sd3_path, monkeypatch):
    """Every transformer call that carries a gradient (the loss's) is at train_guidance_scale 1; the
    rollouts' calls (no gradient) at guidance_scale 3."""
    scales = {True: set(), False: set()}
    velocity = SD3Adapter.velocity

    def recording(self, latents, sigma, cond, guidance_scale):
        scales[torch.is_grad_enabled()].add(float(guidance_scale))
        return velocity(self, latents, sigma, cond, guidance_scale)

    monkeypatch.setattr(SD3Adapter, "velocity", recording)
    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path, trainer_type="dpo", guidance_scale=3.0,
                             train_guidance_scale=1.0, max_epochs=1, num_train_timesteps=1)
    config["scheduler"] = {"dynamics_type": "ODE", "noise_level": 0.0}
    config["eval"]["eval_freq"] = 0
    assert main([str(write_config(tmp_path, config))]) == 0
    assert scales[True] == {1.0}
    assert 3.0 in scales[False]


def test_both_experts_train_at_the_loss_scale():
    """A two-expert model's low-noise expert has a scale of its own (guidance_scale_2) in the rollouts; with
    train_guidance_scale the loss calls both at that scale, and the rollouts' scale is back afterwards."""
    seen = []
    adapter = SimpleNamespace(guidance_scale_2=6.0)
    adapter.velocity = lambda x, sigma, cond, scale: seen.append((scale, adapter.guidance_scale_2)) or x
    for one_scale, expected in ((True, (1.0, None)), (False, (1.0, 6.0))):
        seen.clear()
        policy = AdapterPolicy(adapter, 1.0, "lora", keep_reference=False, one_scale_for_experts=one_scale)
        policy.velocity(torch.zeros(1), torch.ones(1), {})
        assert seen == [expected] and adapter.guidance_scale_2 == 6.0
