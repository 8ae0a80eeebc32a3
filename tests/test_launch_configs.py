"""The accelerate configs shipped in ``flow_factory/launch_configs``: each parses with accelerate's
own loader, builds the plugin accelerate would build from it (without a GPU: the FSDP plugin and
the DeepSpeed config come from the environment ``accelerate launch`` sets), and ``config_file``
names them by short name, by Flow-Factory's paths, or by a file's path; anything else is refused
before the model loads."""

import os
from pathlib import Path
from unittest import mock

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env
from helpers_runs import tiny_run_config

from flow_factory.config import ConfigError, parse_config
from flow_factory.launch_configs import ALIASES, FOLDER, SHIPPED, resolve
from flow_factory.train import needs_launch, relaunch_command

KINDS = {"single_gpu": DistributedType.NO, "multi_gpu": DistributedType.MULTI_GPU, "multi_node": DistributedType.MULTI_GPU,
         "fsdp2": DistributedType.FSDP, "fsdp2_offload": DistributedType.FSDP, "zero1": DistributedType.DEEPSPEED,
         "zero2": DistributedType.DEEPSPEED, "zero2_offload": DistributedType.DEEPSPEED,
         "zero3": DistributedType.DEEPSPEED}


def _config(tmp_path, **top) -> dict:
    return {**tiny_run_config(tmp_path, "sd3-5", tmp_path / "model"), **top}


def test_every_shipped_file_is_listed_and_parses_with_accelerates_loader():
    assert sorted(p.name for p in FOLDER.glob("*.yaml")) == sorted(f for f, _ in SHIPPED.values())
    assert set(KINDS) == set(SHIPPED)
    for name, kind in KINDS.items():
        loaded = load_config_from_file(str(resolve(name)))
        assert loaded.distributed_type == kind, name
        assert loaded.mixed_precision == "bf16" and not loaded.use_cpu, name
    assert load_config_from_file(str(resolve("multi_node"))).num_machines == 2


def _launch_env(name: str) -> tuple[object, dict]:
    """The launch arguments and environment ``accelerate launch --config_file <shipped> --num_processes 2``
    gives the training processes (what the Accelerator reads its plugin from)."""
    args = launch_command_parser().parse_args(["--config_file", str(resolve(name)), "--num_processes", "2",
                                               "--mixed_precision", "bf16", "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:  # what accelerate's launch_command adds before its DeepSpeed launcher
        args.deepspeed_fields_from_accelerate_config = ",".join([*defaults.deepspeed_config, "mixed_precision"])
        return args, prepare_deepspeed_cmd_env(args)[1]
    return args, prepare_multi_gpu_env(args)


@pytest.mark.parametrize("name, offload", [("fsdp2", False), ("fsdp2_offload", True)])
def test_the_fsdp_configs_build_an_fsdp2_full_shard_plugin(name, offload):
    from torch.distributed.fsdp import CPUOffloadPolicy

    args, env = _launch_env(name)
    assert args.use_fsdp and not args.use_deepspeed
    with mock.patch.dict(os.environ, env):
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) == offload
    assert plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"  # the model's _no_split_modules


@pytest.mark.parametrize("name, stage, optimizer_device", [("zero1", 1, "none"), ("zero2", 2, "none"),
                                                            ("zero2_offload", 2, "cpu"), ("zero3", 3, "none")])
def test_the_deepspeed_configs_build_the_zero_stage_they_name(name, stage, optimizer_device):
    from flow_factory.sharding import fill_deepspeed_config

    args, env = _launch_env(name)
    assert args.use_deepspeed and not args.use_fsdp
    with mock.patch.dict(os.environ, env):
        plugin = DeepSpeedPlugin()
    assert plugin.zero_stage == stage
    assert plugin.deepspeed_config["zero_optimization"]["offload_optimizer"]["device"] == optimizer_device
    # what the trainer fills before its one prepare(model, optimizer) call: DeepSpeed refuses a
    # prepare without a dataloader unless the micro-batch size is known
    plugin.set_mixed_precision("bf16")  # as accelerate does before: its bf16 section, here one that turned
    plugin.deepspeed_config["bf16"]["check_grad_overflow"] = False  # off DeepSpeed's skip of a NaN / inf step
    fill_deepspeed_config(plugin, micro_batch_size=2, accumulation=3, max_grad_norm=0.5, num_processes=4)
    ds = plugin.deepspeed_config
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["gradient_clipping"],
            ds["train_batch_size"]) == (2, 3, 0.5, 2 * 3 * 4)
    assert ds["bf16"] == {"enabled": True, "check_grad_overflow": True}  # the non-finite guard needs it


def test_config_file_takes_a_short_name_an_upstream_path_or_a_file(tmp_path):
    for value, name in [("fsdp2", "fsdp2"), ("zero2", "zero2"), ("ddp", "multi_gpu"),
                        ("config/deepspeed/deepspeed_zero2.yaml", "zero2"),
                        ("config/deepspeed/deepspeed_zero3.yaml", "zero3"),
                        ("./config/accelerate_configs/fsdp2.yaml", "fsdp2"),
                        ("config/accelerate_configs/multi_gpu.yaml", "multi_gpu"),
                        ("config/deepspeed/zero2.yaml", "zero2")]:
        assert resolve(value) == FOLDER / SHIPPED[name][0], value
        assert parse_config(_config(tmp_path, config_file=value)).config_file == value
    own = tmp_path / "config" / "deepspeed" / "deepspeed_zero2.yaml"  # the user's own file wins over ours
    own.parent.mkdir(parents=True)
    own.write_text(yaml.safe_dump({"distributed_type": "DEEPSPEED"}))
    assert resolve(str(own)) == own
    assert set(ALIASES.values()) <= set(SHIPPED)


@pytest.mark.parametrize("value", ["zero4", "config/deepspeed/deepspeed_zero4.yaml", "mine/fsdp2.yaml"])
def test_an_unknown_config_file_is_a_config_error_listing_the_shipped_ones(tmp_path, value):
    with pytest.raises(ConfigError, match=r"config_file: .* neither a file nor a shipped accelerate config; "
                                          r"shipped: fsdp2, fsdp2_offload, multi_gpu, multi_node, single_gpu, zero1"):
        parse_config(_config(tmp_path, config_file=value))


def test_the_launch_command_carries_the_resolved_file(tmp_path):
    cfg = parse_config(_config(tmp_path, config_file="config/deepspeed/deepspeed_zero2.yaml", num_processes=1))
    cmd = relaunch_command(cfg, ["run.yaml"])
    assert Path(cmd[cmd.index("--config_file") + 1]) == FOLDER / "zero2.yaml"
    assert cmd[cmd.index("--mixed_precision") + 1] == "bf16" and "--multi_gpu" not in cmd
    # one process with a launch config still goes through accelerate (FSDP / ZeRO on one GPU), once
    assert needs_launch(cfg, {}) and not needs_launch(cfg, {"FLOW_FACTORY_LAUNCHED": "1"})
    plain = parse_config(_config(tmp_path))
    assert not needs_launch(plain, {})
    assert "--multi_gpu" in relaunch_command(plain.model_copy(update={"num_processes": 2}), ["run.yaml"])


def test_a_shipped_multi_node_template_still_needs_machine_zeros_address(tmp_path):
    with pytest.raises(ConfigError, match="main_process_ip: required with num_machines > 1"):
        parse_config(_config(tmp_path, config_file="multi_node", num_machines=2, num_processes=2))
    own = tmp_path / "cluster.yaml"
    own.write_text(yaml.safe_dump({"distributed_type": "MULTI_GPU", "main_process_ip": "10.0.0.1"}))
    parse_config(_config(tmp_path, config_file=str(own), num_machines=2, num_processes=2))


def test_an_fsdp1_file_is_refused_before_anything_loads(tmp_path):
    own = tmp_path / "fsdp1.yaml"
    own.write_text(yaml.safe_dump({"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": 1}}))
    with pytest.raises(ConfigError, match="asks for FSDP version 1; ff-train shards with FSDP2 only"):
        parse_config(_config(tmp_path, config_file=str(own)))
