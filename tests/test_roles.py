"""Roles (issue 39 point 1, issue 38 point 6): several trainable LoRA adapters on one transformer, one active at a
time and alone with gradients, the frozen teacher the base with every adapter off; each role's optimizer from the
config's ``optimizers:`` entry by role name, or upstream's default for the role; bad entries are config errors
naming what is valid."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flow_factory.config import ConfigError, parse_config
from flow_factory.config.distillation import role_optimizers
from flow_factory.models import load_adapter
from flow_factory.models.lora import lora_disabled, make_trainable
from flow_factory.trainer.optimizers import MuonWithAdamW
from flow_factory.trainer.roles import Roles, RolePolicy

from helpers_runs import tiny_run_config


def dmd2_config(tmp, model_path, optimizers=None, *, model_type="sd3-5", **train) -> dict:
    train = {"trainer_type": "dmd2", "num_inference_steps": 2, "group_size": 1, "guidance_scale": 1.0, **train}
    config = tiny_run_config(tmp, model_type, model_path, **train)
    config["scheduler"] = {"dynamics_type": "ODE"}
    del config["rewards"]
    if optimizers is not None:
        config["optimizers"] = optimizers
    return config


@pytest.fixture
def roles(tmp_path, tiny_sd3_path):
    cfg = parse_config(dmd2_config(tmp_path, tiny_sd3_path, [{"name": "generator", "optimizer": "muon",
                                                              "learning_rate": 1e-3}]))
    adapter = load_adapter("sd3-5", tiny_sd3_path)
    make_trainable(adapter, cfg, torch.float32)
    roles = Roles.of(cfg, adapter, torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # each adapter its own visible weights (lora_B starts at 0)
        for params in roles.params.values():
            for p in params:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return adapter, roles


def _velocity(adapter, grad=False):
    x = adapter.initial_noise(1, 64, 64, torch.Generator().manual_seed(1))
    cond = adapter.encode(["a red circle"], None, 1.0)
    with torch.set_grad_enabled(grad):
        return adapter.velocity(x, torch.tensor(0.6), cond, 1.0)


def test_each_role_runs_and_trains_alone_and_the_teacher_is_the_base(roles):
    adapter, roles = roles
    with lora_disabled(adapter.transformer):
        teacher = _velocity(adapter)
    generator = _velocity(adapter)  # outside a phase the generator runs
    assert all(p.requires_grad for p in roles.params["generator"])
    assert not any(p.requires_grad for p in roles.params["fake"])
    with roles.active("fake"):
        fake = _velocity(adapter, grad=True)
        fake.pow(2).mean().backward()
        assert all(p.grad is not None for p in roles.params["fake"])
        assert all(p.grad is None for p in roles.params["generator"])
        with roles.switched("generator"):  # a query of another role: no change of who has gradients
            torch.testing.assert_close(_velocity(adapter), generator, rtol=0, atol=0)
            assert not any(p.requires_grad for p in roles.params["generator"])
        with lora_disabled(adapter.transformer):
            torch.testing.assert_close(_velocity(adapter), teacher, rtol=0, atol=0)
        assert all(p.requires_grad for p in roles.params["fake"])  # restored after the teacher's call
    torch.testing.assert_close(_velocity(adapter), generator, rtol=0, atol=0)
    for a, b in ((generator, teacher), (fake, teacher), (fake, generator)):
        assert (a.detach() - b).abs().max() > 1e-3
    # the teacher is the base alone: with every adapter's weights zeroed the model gives the teacher's velocity
    with torch.no_grad():
        for params in roles.params.values():
            for p in params:
                p.zero_()
    torch.testing.assert_close(_velocity(adapter), teacher, rtol=0, atol=0)


def test_each_role_has_its_entry_or_upstreams_default(roles):
    adapter, roles = roles
    generator = roles.generator_optimizer(roles.params["generator"])
    assert isinstance(generator, MuonWithAdamW) and generator.param_groups[0]["lr"] == 1e-3
    policy = Roles.started(roles, object(), "ddp", None)
    assert isinstance(policy, RolePolicy)
    fake = roles.optimizers["fake"]  # no entry: upstream's DMD2 default for the fake score
    assert type(fake) is torch.optim.AdamW
    assert fake.param_groups[0]["lr"] == 1e-5 and fake.param_groups[0]["betas"] == (0.9, 0.999)
    assert {id(p) for p in fake.param_groups[0]["params"]} == {id(p) for p in roles.params["fake"]}


def test_tdm_r1s_per_role_defaults_are_upstreams(tmp_path, tiny_sd3_path):
    train = parse_config(dmd2_config(tmp_path, tiny_sd3_path)).train
    chosen = role_optimizers("tdm-r1", [{"name": "fake", "learning_rate": 1e-4, "max_grad_norm": 0.5}], train)
    assert (chosen["generator"].learning_rate, chosen["generator"].betas) == (7.5e-5, (0.0, 0.999))
    assert (chosen["fake"].learning_rate, chosen["fake"].betas, chosen["fake"].max_grad_norm) == (1e-4, (0.0, 0.999),
                                                                                                   0.5)
    assert (chosen["surrogate"].learning_rate, chosen["surrogate"].betas) == (3e-4, (0.9, 0.999))


@pytest.mark.parametrize("change, message", [
    ({"optimizers": [{"name": "critic"}]}, r"optimizers\[0\].name: 'critic' is not a trainable role of dmd2; "
                                           r"valid: \['generator', 'fake'\]"),
    ({"optimizers": [{"name": "fake", "lr": 1e-4}]}, r"optimizers\[0\]: unknown keys \['lr'\]; valid: name, optimizer"),
    ({"optimizers": [{"name": "fake"}, {"name": "fake"}]}, "'fake' is named twice"),
    ({"optimizers": [{"name": "fake", "optimizer": "sgd"}]}, r"optimizers\[0\].optimizer: one of \['adamw', 'muon'\]"),
    ({"optimizers": [{"name": "fake", "betas": [0.9]}]}, r"optimizers\[0\].betas"),
    ({"config_file": "fsdp2", "optimizers": [{"name": "fake", "optimizer": "muon"}]},
     "the fake role's optimizer is muon, which updates each weight matrix whole"),
    ({"config_file": "zero2", "model.finetune_type": "full"},
     "runs DEEPSPEED: without LoRA dmd2's other roles are whole copies of the transformer, outside DeepSpeed's"),
    ({"config_file": "zero3"}, "runs DEEPSPEED with ZeRO-3, which partitions every weight of the network its engine"),
    ({"train.trainer_type": "tdm-r1", "train.group_size": 2, "num_processes": 3,
      "rewards": [{"reward_model": "jpeg_compressibility"}]}, "each of the 3 processes must hold whole groups"),
    ({"mixed_precision": "fp16"}, "mixed_precision: fp16"),
    ({"train.ttur_fake_updates": 0}, "ttur_fake_updates"),
    ({"scheduler.dynamics_type": "Flow-SDE"}, "scheduler.dynamics_type: dmd2 replays deterministic ODE"),
    ({"train.use_huber": False}, "train: use_huber are tdm's; dmd2 does not use them"),
    ({"train.trainer_type": "tdm", "train.tdm_query_interval": "reverse", "train.tdm_query_max_sigma": 0},
     "tdm_query_max_sigma"),
    ({"train.trainer_type": "tdm-r1", "train.group_size": 2}, "rewards: at least one reward is needed"),
    ({"train.trainer_type": "tdm-r1", "train.group_size": 1, "rewards": [{"reward_model": "jpeg_compressibility"}]},
     "train.group_size: tdm-r1 compares samples of the same prompt"),
    ({"train.trainer_type": "tdm-r1", "train.group_size": 2, "train.per_device_batch_size": 3,
      "rewards": [{"reward_model": "jpeg_compressibility"}]}, "must be a multiple of group_size 2"),
    ({"train.trainer_type": "tdm-r1", "train.group_size": 2, "train.tdm_weight": 1.0,
      "rewards": [{"reward_model": "jpeg_compressibility"}]}, "tdm_weight"),
    ({"optimizers": [{"name": "surrogate"}]}, r"'surrogate' is not a trainable role of dmd2"),
    ({"optimizers": [{"name": "generator", "ema_decay": 0.9}]},
     r"optimizers\[0\].ema_decay: the generator's EMA is train.ema_decay"),
    ({"optimizers": [{"name": "fake", "ema_decay": 1.0}]}, r"optimizers\[0\].ema_decay: in \[0, 1\)"),
])
def test_what_the_roles_cannot_take_is_a_config_error(tmp_path, tiny_sd3_path, change, message):
    config = dmd2_config(tmp_path, tiny_sd3_path)
    for key, value in change.items():
        section, _, name = key.rpartition(".")
        (config.setdefault(section, {}) if section else config)[name] = value
    with pytest.raises(ConfigError, match=message):
        parse_config(config)


def test_several_entries_are_for_the_trainers_with_roles(tmp_path, tiny_sd3_path):
    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path)
    config["optimizers"] = [{"name": "generator"}, {"name": "fake"}]
    with pytest.raises(ConfigError, match="several, one per role by name, for dmd2"):
        parse_config(config)


def test_without_lora_each_role_is_a_full_copy_and_the_teacher_the_starting_weights(tmp_path, tiny_sd3_path):
    config = dmd2_config(tmp_path, tiny_sd3_path, [{"name": "fake", "optimizer": "muon"}])
    config["model"]["finetune_type"] = "full"
    cfg = parse_config(config)
    adapter = load_adapter("sd3-5", tiny_sd3_path)
    make_trainable(adapter, cfg, torch.float32)
    roles = Roles.of(cfg, adapter, torch.float32)
    with pytest.raises(ConfigError, match="the deepspeed backend does not train CopiedRoles"):
        roles.start("deepspeed", None)  # whole copies beside DeepSpeed's one engine (the config refuses it first)
    base = _velocity(adapter)
    with torch.no_grad():  # the generator and the fake score move apart from the start
        for p in roles.params["generator"]:
            p.add_(0.05 * torch.randn_like(p))
        for p in roles.params["fake"]:
            p.sub_(0.05 * torch.randn_like(p))
    generator = _velocity(adapter)
    policy = Roles.started(roles, SimpleNamespace(adapter=adapter, guidance_scale=1.0), "ddp", None)
    x = adapter.initial_noise(1, 64, 64, torch.Generator().manual_seed(1))
    cond = adapter.encode(["a red circle"], None, 1.0)
    torch.testing.assert_close(policy.reference_velocity(x, torch.tensor(0.6), cond), base, rtol=0, atol=0)
    with roles.active("fake"):
        fake = _velocity(adapter, grad=True)
        fake.pow(2).mean().backward()
        torch.testing.assert_close(policy.role_velocity("generator", x, torch.tensor(0.6), cond), generator,
                                   rtol=0, atol=0)
    assert all(p.grad is not None for p in roles.params["fake"])
    assert all(p.grad is None for p in roles.params["generator"])
    assert (fake.detach() - generator).abs().max() > 1e-4 and (generator - base).abs().max() > 1e-4
    torch.testing.assert_close(_velocity(adapter), generator, rtol=0, atol=0)  # the generator runs again
    assert isinstance(roles.optimizers["fake"], MuonWithAdamW)
    # its weights through a checkpoint's files, exactly
    files = roles.state_files(with_optimizers=True)
    assert set(files) == {"fake_transformer.pt", "fake_optimizer.pt"}
    for name, state in files.items():
        torch.save(state, tmp_path / name)
    with torch.no_grad():
        for p in roles.params["fake"]:
            p.zero_()
    roles.load(tmp_path)
    for k, t in roles.copies["fake"].state_dict().items():
        torch.testing.assert_close(t, files["fake_transformer.pt"][k], rtol=0, atol=0)


def test_tdm_r1_trains_whole_groups_and_its_surrogate_keeps_a_slow_copy(tmp_path, tiny_sd3_path):
    from flow_factory.algorithms import make_algorithm
    from flow_factory.dynamics import ODE

    config = dmd2_config(tmp_path, tiny_sd3_path, trainer_type="tdm-r1", group_size=2, per_device_batch_size=4)
    config["rewards"] = [{"reward_model": "jpeg_compressibility"}]
    cfg = parse_config(config)
    algorithm = make_algorithm("tdm-r1", cfg.train, ODE())
    assert [role for role, _ in algorithm.phases] == ["fake", "surrogate", "generator"]
    units = algorithm.training_units(torch.tensor([5, 3, 5, 3, 9, 9]), torch.zeros(6))
    assert units.tolist() == [[0, 2], [1, 3], [4, 5]] and algorithm.units_per_chunk(4) == 2
    adapter = load_adapter("sd3-5", tiny_sd3_path)
    make_trainable(adapter, cfg, torch.float32)
    tdm_r1 = Roles.of(cfg, adapter, torch.float32)
    assert tdm_r1.names == ("generator", "fake", "surrogate")
    tdm_r1.start("ddp", None)
    (name, (slow, decay)), = tdm_r1.step_snapshots("surrogate").items()
    assert name == "surrogate_slow" and decay(0) == 1e-3 and decay(1000) == 0.3  # upstream's ramp and cap
    assert tdm_r1.step_snapshots("fake") == {}
    assert set(tdm_r1.state_files(True)) == {"fake_lora.pt", "fake_optimizer.pt", "surrogate_lora.pt",
                                             "surrogate_optimizer.pt", "surrogate_slow.pt"}


@pytest.mark.parametrize("name, per_sample", [("dmd2", 1), ("tdm", 3)])
def test_micro_steps_count_upstreams_units(tmp_path, tiny_sd3_path, name, per_sample):
    """gradient_accumulation_steps counts what upstream counts: a sample's one drawn step (DMD2), each transition of
    its rollout (TDM, TDM-R1: Flow-Factory's TDM-R1 example gives 12 for 3 batches x 4 transitions)."""
    cfg = parse_config(dmd2_config(tmp_path, tiny_sd3_path, trainer_type=name, num_inference_steps=3,
                                   unique_sample_num_per_epoch=4, per_device_batch_size=2))
    assert cfg.trained_steps_per_sample == per_sample
    assert cfg.gradient_accumulation == 2 * per_sample  # two chunks, one optimizer step an epoch


@pytest.mark.parametrize("name", ["dmd2", "tdm", "tdm-r1", "nft"])
def test_a_runs_resolved_config_loads_back(tmp_path, tiny_sd3_path, name):
    """What ff-sample and ff-eval read of a run (its config.yaml, every default written) loads again: the
    decoupled and distillation trainers' kl_type resolves to v-based, not the coupled family's x-based default,
    which their config refuses when written."""
    import yaml

    config = dmd2_config(tmp_path, tiny_sd3_path, trainer_type=name, group_size=2)
    config["rewards"] = [{"reward_model": "jpeg_compressibility"}]
    cfg = parse_config(config)
    assert parse_config(yaml.safe_load(cfg.to_yaml())).model_dump() == cfg.model_dump()


def test_every_roles_weights_are_checked_finite_and_never_reach_a_checkpoint_otherwise(roles):
    adapter, roles = roles
    assert Roles.other_params(None) == [] and Roles.other_params(roles) == roles.params["fake"]
    roles.start("ddp", None)
    with torch.no_grad():
        roles.params["fake"][0][0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="fake role"):
        roles.state_files(with_optimizers=False)


def test_the_dmd2_example_loads_with_the_arithmetic_its_comment_states():
    from flow_factory.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "examples" / "sd3_5_dmd2_lora.yaml")
    assert (cfg.batches_per_epoch, cfg.micro_steps_per_epoch, cfg.gradient_accumulation,
            cfg.gradient_steps_per_epoch) == (1, 1, 1, 1)
    chosen = role_optimizers("dmd2", cfg.train.role_optimizers, cfg.train)
    assert [(s.role, s.learning_rate, s.max_grad_norm) for s in chosen.values()] == [("generator", 1e-5, 1.0),
                                                                                   ("fake", 1e-5, 1.0)]
    assert cfg.train.ttur_fake_updates == 5 and cfg.num_processes == 8
