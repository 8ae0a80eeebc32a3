"""``train.rollout_cache``: diffusers' feature caches on the rollouts of the decoupled algorithms, gone before
any training forward; refused where the loss retraces the rollout's steps (grpo, grpo-guard, dppo)."""

import pytest
import torch
from helpers_runs import tiny_run_config, write_config
from test_config import minimal

from flow_factory.algorithms import NFT
from flow_factory.config import ConfigError, parse_config
from flow_factory.dynamics import ODE
from flow_factory.models import load_adapter
from flow_factory.trajectory import sample_trajectory
from flow_factory.rollout_cache import RolloutCache, cache_hooks
from flow_factory.train import main


def _rollout(adapter, cache=None):
    cond = adapter.encode(["a red cube", "a blue ball"], None, 3.5)
    noise = adapter.initial_noise(2, 64, 64, torch.Generator().manual_seed(1))
    if cache is not None:
        cache.new_trajectory(adapter)
    return sample_trajectory(adapter, ODE(), cond, noise, adapter.sigmas(6, 64, 64), 3.5).final


def test_the_cache_samples_from_cached_blocks_and_leaves_no_hook(tiny_flux_path):
    """FirstBlockCache at threshold 0 recomputes every block: the rollout of the uncached model, to the bit. At
    a threshold no change reaches, every step after the first reuses the blocks: another rollout. Outside
    ``applied`` the transformer has no hook left and samples as before."""
    adapter = load_adapter("flux1", tiny_flux_path)  # two blocks (FirstBlockCache needs a first and a last)
    plain = _rollout(adapter)
    exact = RolloutCache("first_block", {"threshold": 0.0})
    with exact.applied(adapter):
        assert cache_hooks(adapter.transformer)
        torch.testing.assert_close(_rollout(adapter, exact), plain, rtol=0, atol=0)
    lossy = RolloutCache("first_block", {"threshold": 1e9})
    with lossy.applied(adapter):
        cached = _rollout(adapter, lossy)
        again = _rollout(adapter, lossy)  # a new trajectory starts from an empty cache: the same rollout
    assert not torch.allclose(cached, plain, atol=1e-4)
    torch.testing.assert_close(again, cached, rtol=0, atol=0)
    assert cache_hooks(adapter.transformer) == []
    torch.testing.assert_close(_rollout(adapter), plain, rtol=0, atol=0)


def test_the_config_refuses_it_where_the_loss_retraces_the_rollout():
    with pytest.raises(ConfigError, match=r"train.rollout_cache: first_block makes the rollout's steps differ from "
                                          r"what the weights compute, and grpo trains those very steps'"):
        parse_config(minimal(train={"trainer_type": "grpo", "rollout_cache": "first_block"}))
    cfg = parse_config(minimal(train={"trainer_type": "nft"}, scheduler={"dynamics_type": "ODE"},
                               acceleration={"rollout": [{"name": "diffusers_cache",
                                                          "params": {"policy": "first_block", "threshold": 0.08}}]}))
    assert (cfg.train.rollout_cache, cfg.train.rollout_cache_params) == ("first_block", {"threshold": 0.08})
    with pytest.raises(ConfigError, match=r"train.rollout_cache_params: \['treshold'\] are not options of "
                                          r"first_block \(FirstBlockCacheConfig: threshold\)"):
        RolloutCache("first_block", {"treshold": 0.1})


def test_nft_trains_without_the_hooks_its_rollouts_had(tmp_path, tiny_flux_path, monkeypatch):
    """Two epochs of nft with cached rollouts: every rollout trajectory had the hooks, no training forward
    (the loss's velocities, the policy's and the old policy's) saw one."""
    seen = {"rollout": [], "training": []}
    new_trajectory, loss = RolloutCache.new_trajectory, NFT.loss

    def recording_trajectory(self, adapter):
        seen["rollout"].append(bool(cache_hooks(adapter.transformer)))
        return new_trajectory(self, adapter)

    def recording_loss(self, policy, batch):
        seen["training"].append(bool(cache_hooks(policy.adapter.transformer)))
        return loss(self, policy, batch)

    monkeypatch.setattr(RolloutCache, "new_trajectory", recording_trajectory)
    monkeypatch.setattr(NFT, "loss", recording_loss)
    config = tiny_run_config(tmp_path, "flux1", tiny_flux_path, trainer_type="nft", max_epochs=2, num_train_timesteps=1,
                             rollout_cache="first_block", rollout_cache_params={"threshold": 0.5})
    config["scheduler"] = {"dynamics_type": "ODE", "noise_level": 0.0}
    assert main([str(write_config(tmp_path, config))]) == 0
    assert seen["rollout"] and all(seen["rollout"])
    assert seen["training"] and not any(seen["training"])


def test_a_policy_the_model_does_not_take_is_refused_before_loading(tmp_path, tiny_sd3_path, monkeypatch):
    monkeypatch.setattr("flow_factory.trainer.model.load_adapter", lambda *a, **k: pytest.fail("the model loaded"))
    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path, trainer_type="nft", rollout_cache="first_block")
    config["scheduler"] = {"dynamics_type": "ODE", "noise_level": 0.0}
    from flow_factory.trainer.trainer import Trainer

    with pytest.raises(ConfigError, match=r"train.rollout_cache: first_block does not work with sd3-5's transformer; "
                                          r"its policies: pyramid, taylorseer"):
        Trainer(parse_config(config))
