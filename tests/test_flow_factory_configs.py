"""Flow-Factory's configs as its users write them: every block of its algorithm guide loads
and means what the guide says it means; omitted keys take Flow-Factory's defaults.

The blocks below are written here from the guide's keys and values (its text is the
specification: ../shared/seeds/003, the algorithm guide); each is merged into a small
valid run, as a user pastes a block into a config.
"""

import pytest
import torch

from flow_factory.algorithms.timesteps import draw_training_sigmas
from flow_factory.config import ConfigError, parse_config
from flow_factory.dynamics.window import choose_sde_steps
from flow_factory.trainer.ema import ema_decay_at
from test_config import minimal as run


@pytest.mark.parametrize("dynamics", ["Flow-SDE", "Dance-SDE", "CPS", "ODE"])
def test_dynamics_type_under_train_selects_the_sampling_dynamics(dynamics):
    # "train: dynamics_type: 'Flow-SDE' # Options are ['Flow-SDE', 'Dance-SDE', 'CPS', 'ODE']"
    trainer = "nft" if dynamics == "ODE" else "grpo"  # the guide: ODE only with NFT / AWM
    cfg = parse_config(run(train={"trainer_type": trainer, "dynamics_type": dynamics}))
    assert cfg.scheduler.dynamics_type == dynamics


def test_ode_with_grpo_is_refused_as_the_guide_warns():
    with pytest.raises(ConfigError, match="needs a stochastic dynamics"):
        parse_config(run(train={"trainer_type": "grpo", "dynamics_type": "ODE"}))


def test_the_mixgrpo_window_trains_one_random_step_of_the_candidates():
    # "train_steps: [1, 2, 3]" / "num_train_steps: 1": one of steps 1-3 is SDE each epoch, the rest ODE
    cfg = parse_config(run(train={"train_steps": [1, 2, 3], "num_train_steps": 1}))
    assert cfg.scheduler.sde_steps == [1, 2, 3] and cfg.scheduler.num_sde_steps == 1
    assert cfg.trained_steps_per_sample == 1
    drawn = {tuple(choose_sde_steps(cfg.train.num_inference_steps, cfg.sde_step_candidates,
                                    cfg.scheduler.num_sde_steps, torch.Generator().manual_seed(epoch)))
             for epoch in range(40)}
    assert drawn == {(1,), (2,), (3,)}


def test_two_spellings_of_one_setting_must_agree():
    with pytest.raises(ConfigError, match=r"train.train_steps: \[1, 2\] and scheduler.sde_steps: \[0\] are two "
                                          "spellings of one setting"):
        parse_config(run(train={"train_steps": [1, 2]}, scheduler={"sde_steps": [0]}))
    same = parse_config(run(train={"dynamics_type": "CPS"}, scheduler={"dynamics_type": "CPS"}))
    assert same.scheduler.dynamics_type == "CPS"


def test_a_lower_training_resolution_than_eval():
    cfg = parse_config(run(train={"resolution": 256}, eval={"resolution": 1024}))
    assert cfg.train.height_width == (256, 256) and cfg.eval.height_width == (1024, 1024)


@pytest.mark.parametrize("device, meant", [("same_as_model", "same"), ("cpu", "cpu")])
def test_the_kl_block(device, meant):
    cfg = parse_config(run(model={"model_name_or_path": "m", "model_type": "sd3-5", "finetune_type": "full"},
                           train={"kl_type": "v-based", "kl_beta": 0.04, "ref_param_device": device}))
    assert (cfg.train.kl_type, cfg.train.kl_beta, cfg.train.ref_param_device) == ("v-based", 0.04, meant)


def test_grpo_guard_with_flow_sde():
    cfg = parse_config(run(train={"trainer_type": "grpo-guard", "dynamics_type": "Flow-SDE"}))
    assert cfg.train.trainer_type == "grpo-guard" and cfg.scheduler.dynamics_type == "Flow-SDE"
    with pytest.raises(ConfigError, match="works only with scheduler.dynamics_type 'Flow-SDE'"):
        parse_config(run(train={"trainer_type": "grpo-guard", "dynamics_type": "CPS"}))


def test_the_nft_block_trains_the_first_30_percent_of_the_trajectory():
    cfg = parse_config(run(train={"trainer_type": "nft", "num_train_timesteps": 2,
                                  "time_sampling_strategy": "discrete_with_init", "time_shift": 3.0,
                                  "timestep_fraction": 0.3}, scheduler={"dynamics_type": "ODE"}))
    train = cfg.train
    assert train.timestep_range == 0.3 and train.num_train_timesteps == 2 and train.time_shift == 3.0
    assert cfg.trained_steps_per_sample == 2
    # "Train using only the first 30% of timesteps": of 10 rollout sigmas from 1, only those >= 0.7
    rollout_sigmas = torch.linspace(1, 0, 11)
    for seed in range(20):
        sigmas = draw_training_sigmas(train.time_sampling_strategy, 2, rollout_sigmas, train.timestep_range,
                                      train.time_shift, torch.Generator().manual_seed(seed))
        assert sigmas.max().item() == 1.0  # discrete_with_init: the first step is always trained
        assert sigmas.min().item() >= 0.7 - 1e-6


def test_the_off_policy_ema_block():
    cfg = parse_config(run(train={"trainer_type": "nft", "off_policy": True, "ema_decay_schedule": "piecewise_linear",
                                  "ema_decay": 0.5, "ema_update_interval": 1, "ema_device": "cuda"}))
    t = cfg.train
    assert (t.off_policy, t.ema_decay_schedule, t.ema_decay, t.ema_update_interval, t.ema_device) == \
        (True, "piecewise_linear", 0.5, 1, "cuda")


def test_the_awm_block():
    cfg = parse_config(run(train={"trainer_type": "awm", "ema_kl_beta": 0.1, "ema_decay": 0.9,
                                  "ema_decay_schedule": "power", "ema_update_interval": 1, "ema_device": "cuda",
                                  "clip_range": 1.0e-5, "adv_clip_range": 5.0, "awm_weighting": "ghuber",
                                  "ghuber_power": 0.25}))
    t = cfg.train
    assert (t.ema_kl_beta, t.clip_range, t.awm_weighting, t.ghuber_power) == (0.1, 1e-5, "ghuber", 0.25)
    assert cfg.scheduler.dynamics_type == "ODE"  # decoupled: ODE rollouts unless chosen


def test_a_key_flow_factory_has_and_we_do_not_says_why():
    with pytest.raises(ConfigError, match="model.component_load_dtypes: not taken here: the frozen networks take "
                                          "mixed_precision's dtype"):
        parse_config(run(model={"component_load_dtypes": {"vae": "float32"}}))


def test_kontext_examples_condition_keys_load_with_their_meaning():
    """examples/grpo/lora/flux1_kontext/default.yaml sets train / eval.condition_image_size; its earlier layout
    (examples/grpo/lora/flux1_kontext.yaml) sets data.condition_image_size for both splits;
    qwen_image_edit_plus/default.yaml sets train / eval.auto_resize. On a text-to-image model they change nothing
    (test_condition_keys_on_a_text_only_model_load_with_a_note)."""
    kontext = {"model_type": "flux1-kontext"}
    cfg = parse_config(run(model=kontext, train={"condition_image_size": 384, "auto_resize": True},
                           eval={"condition_image_size": 512}))
    assert (cfg.train.condition_image_size, cfg.eval.condition_image_size) == (384, 512)
    assert cfg.train.auto_resize is True and cfg.eval.auto_resize is True  # eval's null is train's
    earlier = parse_config(run(model=kontext, data={"condition_image_size": [512, 512]}))
    assert earlier.train.condition_image_size == earlier.eval.condition_image_size == [512, 512]
    own = parse_config(run(model=kontext, data={"condition_image_size": 512}, eval={"condition_image_size": 256}))
    assert (own.train.condition_image_size, own.eval.condition_image_size) == (512, 256)
    with pytest.raises(ConfigError, match=r"train.condition_image_size: flux1-kontext needs height and width in "
                                          r"multiples of 16 .*, got 500; nearest valid: 496 or 512"):
        parse_config(run(model=kontext, train={"condition_image_size": 500}))


def resolved(cfg) -> dict:
    """What a run is: the resolved config, less its generated name."""
    dumped = cfg.model_dump(mode="json")
    dumped["log"].pop("run_name")
    return dumped


@pytest.mark.parametrize("model_type, size", [
    ("qwen-image", 512),       # examples/grpo/lora/qwen_image/rational_rewards_t2i.yaml
    ("wan2_t2v", [480, 832]),  # examples/grpo/lora/wan21/t2v.yaml
])
def test_condition_keys_on_a_text_only_model_load_with_a_note(model_type, size):
    # Flow-Factory ignores them on a text-only model; here they are cleared and named by a note
    plain = run(model={"model_type": model_type}, train={"num_frames": 9} if model_type.startswith("wan") else {})
    written = run(model=plain["model"], train={**plain["train"], "condition_image_size": size, "auto_resize": True},
                  eval={"condition_image_size": size})
    cfg = parse_config(written)
    assert resolved(cfg) == resolved(parse_config(plain))  # the same run as without them
    assert cfg.train.condition_image_size is cfg.eval.condition_image_size is None
    assert [note.split(":")[0] for note in cfg.notes()[:3]] == [
        "train.condition_image_size", "train.auto_resize", "eval.condition_image_size"]
    assert f"changes nothing: {model_type} generates from text alone" in cfg.notes()[0]


def test_flux2s_condition_image_size_is_its_reference_images_area():
    # examples/grpo/lora/flux2_klein/default.yaml, flux2/i2i.yaml: FLUX.2 takes reference images from the rows, so
    # the key is kept (their area); a dataset without them makes it change nothing
    for model_type in ("flux2", "flux2-klein"):
        cfg = parse_config(run(model={"model_type": model_type}, train={"condition_image_size": [384, 384]},
                               eval={"condition_image_size": 1024}))
        assert (cfg.train.condition_image_size, cfg.eval.condition_image_size) == ([384, 384], 1024)
        assert not [n for n in cfg.notes() if "condition_image_size" in n]


def test_a_frame_rate_loads_with_a_note_except_where_it_would_change_ltx2s_run():
    # examples/sft/lora/wan22/t2v_ti2v5b.yaml: frame_rate 10 for Wan, whose videos are written at 16 fps here
    plain = run(model={"model_type": "wan2_t2v"}, train={"num_frames": 9})
    cfg = parse_config(run(model=plain["model"], train={**plain["train"], "frame_rate": 10.0}))
    assert resolved(cfg) == resolved(parse_config(plain))
    assert cfg.notes()[0] == "train.frame_rate: 10.0 changes nothing: wan2_t2v writes its videos at its own frame rate here"
    parse_config(run(model={"model_type": "ltx2_t2av"}, train={"num_frames": 9, "frame_rate": 24}))
    with pytest.raises(ConfigError, match=r"eval.frame_rate: 25.0; only 24 here: LTX-2's videos play at the "
                                          r"pipeline's default 24 fps"):
        parse_config(run(model={"model_type": "ltx2_t2av"}, train={"num_frames": 9}, eval={"frame_rate": 25}))
    # image to video with audio likewise (examples/grpo/lora/ltx2/i2av.yaml: frame_rate 24.0, no note)
    i2av = {"model_type": "ltx2_i2av"}
    assert not parse_config(run(model=i2av, train={"num_frames": 9, "frame_rate": 24.0})).notes()
    with pytest.raises(ConfigError, match=r"train.frame_rate: 30.0; only 24 here"):
        parse_config(run(model=i2av, train={"num_frames": 9, "frame_rate": 30}))


# --------------------------------------------------------------- AWM's EMA and KL block
# examples/awm/lora/{sd3_5,flux1}/default.yaml: kl_weight: 'Uniform', ema_decay_schedule: linear,
# ema_decay: 0.3, warmup_steps: 1000 (sd3_5) / 300 (flux1). Upstream's AWM arguments have no kl_weight
# (an unknown key lands in extra_kwargs, which no trainer reads); warmup_steps is the length of its EMA
# decay warm-up (ema/ema_utils.py create_decay_fn: power, linear, warmup_cosine, initial_decay 0).

AWM = {"trainer_type": "awm", "ema_kl_beta": 1, "ema_update_interval": 1}


def test_awms_kl_weight_loads_with_a_note_and_changes_nothing():
    cfg = parse_config(run(train={**AWM, "kl_weight": "Uniform"}))
    plain = parse_config(run(train=AWM))
    assert {**resolved(cfg), "train": {**resolved(cfg)["train"], "kl_weight": None}} == resolved(plain)
    assert any(note.startswith("train.kl_weight: 'Uniform' is not a key of Flow-Factory's either")
               for note in cfg.notes())


@pytest.mark.parametrize("warmup", [1000, 300])
def test_awms_linear_ema_warm_up_is_flow_factorys_ramp(warmup):
    cfg = parse_config(run(train={**AWM, "ema_decay_schedule": "linear", "ema_decay": 0.3, "warmup_steps": warmup,
                                  "max_epochs": 50}))
    train = cfg.train
    assert (train.ema_decay_schedule, train.flat_steps, train.warmup_steps) == ("piecewise_linear", 0, None)
    for epoch in (0, 1, warmup // 3, warmup - 1, warmup, 5 * warmup):
        flow_factory = 0.3 * min(epoch / warmup, 1)  # its linear_warmup_decay, initial_decay 0
        got = ema_decay_at(train.ema_decay_schedule, epoch, train.ema_decay, train.max_epochs, train.flat_steps,
                           train.ramp_rate)
        assert got == pytest.approx(flow_factory, abs=1e-12)


def test_ema_warm_up_of_the_other_schedules():
    cosine = parse_config(run(train={"ema_decay_schedule": "warmup_cosine", "warmup_steps": 20}))
    assert cosine.train.flat_steps == 20 and not cosine.notes()  # its warm-up: decay 0 (initial_decay) for 20 epochs
    for schedule in ("constant", "piecewise_linear", "cosine"):  # Flow-Factory reads no warm-up there either
        cfg = parse_config(run(train={"ema_decay_schedule": schedule, "warmup_steps": 20}))
        assert f"train.warmup_steps: 20 changes nothing: ema_decay_schedule {schedule} has no warm-up" in cfg.notes()[0]
    no_ema = parse_config(run(train={"ema_decay": 0, "warmup_steps": 20}))
    assert no_ema.notes() == ["train.warmup_steps: 20 changes nothing: there is no EMA (ema_decay 0)"]
    # power: Flow-Factory's min(d, (1 + k) / (W + k)) is not the power curve here, so the run would differ
    with pytest.raises(ConfigError, match=r"train.warmup_steps: with ema_decay_schedule power \(the default\) "
                                          r"Flow-Factory's EMA decay is min\(ema_decay, \(1 \+ k\) / \(10 \+ k\)\)"):
        parse_config(run(train={"warmup_steps": 10}))
    with pytest.raises(ConfigError, match="train.warmup_steps: 0; expected a positive integer"):
        parse_config(run(train={"ema_decay_schedule": "linear", "warmup_steps": 0}))
    with pytest.raises(ConfigError, match="two spellings of one setting"):
        parse_config(run(train={"ema_decay_schedule": "linear", "warmup_steps": 10, "ramp_rate": 0.5}))


# ----------------------------------------------------------------------- defaults
# Flow-Factory's defaults for keys a config leaves out, each with where upstream sets it
# (X-GenGroup/Flow-Factory, src/flow_factory/hparams/...).

def test_omitted_keys_take_flow_factory_defaults():
    cfg = parse_config(run())
    t, s = cfg.train, cfg.scheduler
    assert cfg.mixed_precision == "bf16"  # args.py: Arguments.mixed_precision
    # training_args/_base.py: TrainingArguments.ema_decay / ema_decay_schedule / ema_update_interval
    assert (t.ema_decay, t.ema_decay_schedule, t.ema_update_interval) == (0.995, "power", 10)
    assert t.latent_storage_dtype == "float16"  # _base.py: latent_storage_dtype 'fp16'
    assert t.offload_samples_to_cpu is False  # _base.py
    assert s.num_sde_steps == 1  # scheduler_args.py: SchedulerArguments.num_sde_steps
    # scheduler_args.py sde_steps None -> every step but the last (flow_match_euler_discrete.py)
    assert cfg.sde_step_candidates == list(range(t.num_inference_steps - 1))
    assert (t.global_std, t.advantage_aggregation) == (True, "gdpo")  # training_args/grpo.py


@pytest.mark.parametrize("trainer, shift", [("nft", 3.0), ("awm", 3.0), ("dpo", 1.0)])
def test_time_shift_defaults_per_trainer(trainer, shift):
    # training_args/nft.py and awm.py: time_shift 3.0; dpo.py: 1.0
    cfg = parse_config(run(train={"trainer_type": trainer}))
    assert cfg.train.time_shift == shift
    assert (cfg.train.global_std, cfg.train.advantage_aggregation) == (True, "gdpo")  # nft.py, awm.py, dpo.py


def test_a_video_model_without_num_frames_takes_81():
    cfg = parse_config(run(model={"model_name_or_path": "m", "model_type": "wan2_t2v"},
                           train={"resolution": [480, 832]}))
    assert cfg.train.num_frames == 81 and cfg.eval.num_frames == 81  # models/wan: num_frames=81


def test_keys_accepted_for_compatibility_that_do_nothing_say_so(tmp_path, capsys):
    from flow_factory.config import load_config_for_cli
    import yaml

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run(data={"dataset_dir": "p", "cache_dir": "/tmp/c", "force_reprocess": True,
                                             "dataloader_num_workers": 16},
                                       train={"trainer_type": "nft", "time_shift": 3.0})))
    assert load_config_for_cli("ff-train", path) is not None
    err = capsys.readouterr().err
    assert "data.cache_dir" not in err  # the prompt cache is built: these keys act
    assert "ff-train: note: data.dataloader_num_workers:" in err
    assert "ff-train: note: train.time_shift: 3 shifts continuous sigmas" in err
    quiet = tmp_path / "quiet.yaml"
    quiet.write_text(yaml.safe_dump(run(train={"trainer_type": "nft", "time_sampling_strategy": "logit_normal",
                                               "time_shift": 3.0})))
    assert load_config_for_cli("ff-train", quiet) is not None
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------------------- launch

def _launch(argv, environ):
    import yaml as _yaml

    from flow_factory.config import parse_config as _parse
    from flow_factory.train import launch_overrides, parse_args, relaunch_command

    args = parse_args(argv)
    cfg = _parse(_yaml.safe_load(open(args.config)), launch_overrides(args, environ) + args.overrides)
    return cfg, relaunch_command(cfg, argv)


def test_launch_flags_override_the_environment_which_overrides_the_config(tmp_path):
    import yaml

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**run(), "num_processes": 1, "main_process_port": 29500}))
    cfg, cmd = _launch([str(path), "--num_processes", "4", "--main_process_port", "1234"], {})
    assert (cfg.num_processes, cfg.main_process_port, cfg.num_machines) == (4, 1234, 1)
    assert cmd[cmd.index("--num_processes") + 1] == "4" and cmd[cmd.index("--main_process_port") + 1] == "1234"

    # a 2-node job as a scheduler describes it: 2 machines x 2 GPUs, this is machine 1
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "6000", "NODE_RANK": "1", "NUM_NODES": "2",
           "GPUS_PER_NODE": "2"}
    cfg, cmd = _launch([str(path)], env)
    assert (cfg.num_processes, cfg.num_machines, cfg.machine_rank, cfg.main_process_ip, cfg.main_process_port) == \
        (4, 2, 1, "10.0.0.1", 6000)
    flags = dict(zip(cmd[3:-3:2], cmd[4:-3:2]))
    assert {k: flags[k] for k in ("--num_processes", "--num_machines", "--machine_rank", "--main_process_ip",
                                  "--main_process_port")} == {
        "--num_processes": "4", "--num_machines": "2", "--machine_rank": "1", "--main_process_ip": "10.0.0.1",
        "--main_process_port": "6000"}
    cfg, _ = _launch([str(path), "--machine_rank", "0"], env)  # a flag beats the environment
    assert cfg.machine_rank == 0

    # one machine: a scheduler's MASTER_ADDR alone changes nothing (Flow-Factory reads the
    # environment only for a multi-machine job)
    cfg, _ = _launch([str(path)], {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "6000"})
    assert (cfg.num_machines, cfg.main_process_ip, cfg.main_process_port) == (1, None, 29500)


def test_several_machines_need_machine_zeros_address(tmp_path):
    import yaml

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run()))
    with pytest.raises(ConfigError, match="main_process_ip: required with num_machines > 1"):
        _launch([str(path), "--num_machines", "2", "--num_processes", "2"], {})
    with pytest.raises(ConfigError, match="machine_rank: 2 with num_machines = 2"):
        _launch([str(path), "--num_machines", "2", "--num_processes", "2", "--machine_rank", "2",
                 "--main_process_ip", "h"], {})


@pytest.mark.parametrize("written, meant", [("transformer.default", "default"),
                                            (["transformer.attn.to_q", "attn.to_k"], ["attn.to_q", "attn.to_k"])])
def test_target_modules_prefixed_with_the_component(written, meant):
    cfg = parse_config(run(model={"model_name_or_path": "m", "model_type": "sd3-5", "target_modules": written,
                                  "target_components": ["transformer"]}))
    assert cfg.model.target_modules == meant and cfg.model.target_components == ["transformer"]


@pytest.mark.parametrize("model, message", [
    ({"target_components": ["transformer", "transformer_2"]}, "not a network sd3-5 trains; valid: transformer only"),
    ({"target_modules": ["text_encoder.q_proj"]}, "name modules of components that are not trained"),
    ({"master_weight_dtype": "fp8"}, "model.master_weight_dtype: expected one of"),
])
def test_model_keys_this_version_cannot_honour_are_refused(model, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(run(model={"model_name_or_path": "m", "model_type": "sd3-5", **model}))


# ----------------------------------------------------------------------- its layouts

def test_the_newest_layout_one_dataset_and_one_optimizer():
    data = run()
    del data["data"]
    data.update(
        data={"datasets": [{"name": "default", "dataset_dir": "dataset/pickscore",
                            "train": {"weight": 1, "max_dataset_size": 1024},
                            "eval": {"max_dataset_size": 64, "num_inference_steps": 40}}]},
        optimizers=[{"name": "default", "learning_rate": 3.0e-4, "weight_decay": 1.0e-4, "betas": [0.9, 0.99],
                     "eps": 1.0e-8, "max_grad_norm": 0.5}])
    data["train"].update(reward_optimization_overlap=False, reward_optimization_overlap_mode="ready")
    cfg = parse_config(data)
    assert (cfg.data.dataset_dir, cfg.data.max_dataset_size) == ("dataset/pickscore", 1024)
    assert (cfg.eval.num_samples, cfg.eval.num_inference_steps) == (64, 40)
    t = cfg.train
    assert (t.learning_rate, t.adam_weight_decay, t.betas, t.adam_epsilon, t.max_grad_norm) == \
        (3e-4, 1e-4, (0.9, 0.99), 1e-8, 0.5)


def test_a_reward_routed_to_the_one_dataset_by_name_applies_to_every_sample():
    """Flow-Factory's TDM example names its one dataset in eval_rewards' applicable_datasets; a routing to another
    dataset still fails, naming it."""
    data = run()
    del data["data"]
    data["data"] = {"datasets": [{"name": "pick", "dataset_dir": "dataset/pickscore", "train": {"weight": 1}}]}
    data["eval_rewards"] = [{"name": "clip", "reward_model": "CLIP", "applicable_datasets": ["pick"]},
                            {"name": "pick", "reward_model": "PickScore", "weight": {"pick": 0.5}}]
    cfg = parse_config(data)
    assert [(e.applicable_datasets, e.weight) for e in cfg.eval_rewards] == [(None, 1.0), (None, 0.5)]
    data["data"] = {"datasets": [{"name": "pick", "dataset_dir": "dataset/pickscore", "train": {"weight": 1}}]}
    data["eval_rewards"] = [{"name": "clip", "reward_model": "CLIP", "applicable_datasets": ["other"]}]
    with pytest.raises(ConfigError, match=r"eval_rewards\[0\].applicable_datasets: routes a reward to datasets"):
        parse_config(data)


@pytest.mark.parametrize("change, message", [
    ({"optimizers": [{"learning_rate": 1e-4}, {"learning_rate": 1e-5}]}, "one optimizer trains the transformer"),
    ({"optimizers": [{"learning_rate": 1e-4, "momentum": 0.9}]}, r"optimizers\[0\]: unknown keys \['momentum'\]"),
    ({"optimizers": [{"learning_rate": 1e-4}], "train": {"learning_rate": 1e-5}},
     r"optimizers\[0\].learning_rate: 0.0001 and train.learning_rate: 1e-05 are two spellings"),
    ({"model": {"frozen_parameters_dtype": {"default": None, "vae": "fp32"}}}, "the frozen networks take"),
    ({"train": {"trainer_type": "dpo", "logit_std": 2.0}}, r"train.logit_std: 2.0; only 1 here"),
])
def test_what_of_the_newest_layout_cannot_be_honoured_is_refused(change, message):
    data = run()
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
            if key == "data":
                data["data"].pop("dataset_dir")
        else:
            data[key] = value
    with pytest.raises(ConfigError, match=message):
        parse_config(data)


def test_earlier_layouts_spellings():
    data = run()
    data.update(run_name="r", project="p", logging_backend="none", reward={"reward_model": "CLIP"})
    del data["rewards"]
    data["train"].update(noise_level=0.5, save_freq=3, eval_freq=4)
    data["model"].update(resume_training_state=True, trainable_parameters_dtype="bf16",
                         frozen_parameters_dtype={"default": None, "transformers": "bf16", "vae": "bf16"})
    cfg = parse_config(data)
    assert (cfg.log.run_name, cfg.log.project, cfg.log.logging_backend) == ("r", "p", "none")
    assert cfg.rewards[0].reward_model == "CLIP" and cfg.scheduler.noise_level == 0.5
    assert (cfg.log.save_freq, cfg.eval.eval_freq) == (3, 4)
    assert cfg.model.resume_type == "state" and cfg.model.master_weight_dtype == "bfloat16"


def test_dpo_takes_flow_factory_dpo_timestep_defaults():
    cfg = parse_config(run(train={"trainer_type": "dpo", "weighting_scheme": "uniform"}))
    t = cfg.train  # training_args/dpo.py: weighting_scheme, timestep_range 0.99, num_train_timesteps 1
    assert (t.time_sampling_strategy, t.timestep_range, t.num_train_timesteps, t.time_shift) == \
        ("uniform", 0.99, 1, 1.0)
    assert parse_config(run(train={"trainer_type": "dpo"})).train.time_sampling_strategy == "logit_normal"
    nft = parse_config(run(train={"trainer_type": "nft", "num_train_timesteps": 0})).train
    assert (nft.time_sampling_strategy, nft.timestep_range, nft.num_train_timesteps) == ("discrete", 0.9, None)


@pytest.mark.parametrize("shuffle", [True, False])
def test_shuffle_samples_false_trains_in_rollout_order(shuffle):
    from dataclasses import dataclass

    from accelerate import Accelerator

    from flow_factory.guards import NonFiniteGuard
    from flow_factory.trainer.optimize import OptimizeSettings, Stepper, optimize_epoch

    @dataclass
    class Batch:
        x: torch.Tensor
        parts: int = 1

    seen = []
    weight = torch.nn.Parameter(torch.ones(1))

    class Recorder:  # an algorithm that records which samples each micro-batch holds
        lockstep = False  # each process shuffles its own samples (Algorithm's default)

        def training_units(self, group_ids, advantages):
            return torch.arange(len(advantages)).unsqueeze(1)

        def units_per_chunk(self, batch_size):
            return batch_size

        def micro_batches(self, rollouts, advantages, units, generator):
            seen.extend(units[:, 0].tolist())
            yield Batch(torch.zeros(1))

        def loss(self, policy, batch):
            return (weight ** 2).sum(), {}

    rollouts = type("Rollouts", (), {"group_ids": torch.arange(8) // 2})
    optimize_epoch(Recorder(), None, rollouts, torch.zeros(8), OptimizeSettings(batch_size=2, shuffle=shuffle),
                   Stepper(Accelerator(cpu=True), torch.optim.SGD([weight], lr=0.1), [weight], NonFiniteGuard(3),
                           syncing_module=torch.nn.Linear(1, 1)), epoch=0)
    assert sorted(seen) == list(range(8)) and (seen == list(range(8))) == (not shuffle)


# ----------------------------------------------------------------------- the reward guide's blocks

REWARD_GUIDE_BLOCKS = {  # written from the keys and values of the reward guide's YAML blocks
    "builtin": {"rewards": [{"name": "aesthetic", "reward_model": "PickScore", "dtype": "bfloat16", "device": "cuda",
                             "batch_size": 16}]},
    "shorthand": {"rewards": {"name": "aesthetic", "reward_model": "PickScore", "batch_size": 16}},
    "custom": {"rewards": [{"name": "custom", "reward_model": "flow_factory.rewards.MyPointwiseReward",
                            "batch_size": 16}]},
    "remote": {"rewards": [{"name": "remote_reward", "reward_model": "flow_factory.rewards.remote.RemotePointwiseRewardModel",
                            "server_url": "http://localhost:8000", "batch_size": 16, "timeout": 60.0,
                            "retry_attempts": 3}]},
    "remote_group": {"rewards": [{"name": "remote_ranking",
                                  "reward_model": "flow_factory.rewards.remote.RemoteGroupwiseRewardModel",
                                  "server_url": "http://localhost:8000", "timeout": 60.0, "retry_attempts": 3}]},
    "async": {"rewards": [{"name": "api", "reward_model": "flow_factory.rewards.my_reward_remote.RemotePointwiseRewardModel",
                           "server_url": "http://localhost:8000", "async_reward": True, "num_workers": 4},
                          {"name": "local", "reward_model": "PickScore"}]},
    "multi_gdpo": {"train": {"trainer_type": "grpo", "advantage_aggregation": "gdpo"},
                   "rewards": [{"name": "aesthetic", "reward_model": "PickScore", "weight": 1.0, "batch_size": 16},
                               {"name": "text_align", "reward_model": "CLIP", "weight": 0.5, "batch_size": 32}]},
    "dedup": {"rewards": [{"name": "aesthetic_1", "reward_model": "PickScore", "batch_size": 16},
                          {"name": "aesthetic_2", "reward_model": "PickScore", "batch_size": 16}]},
    "eval_rewards": {"rewards": [{"name": "fast_score", "reward_model": "PickScore", "batch_size": 32}],
                     "eval_rewards": [{"name": "hps", "reward_model": "my_rewards.HPSv2RewardModel", "batch_size": 8}]},
}


@pytest.mark.parametrize("block", sorted(REWARD_GUIDE_BLOCKS))
def test_every_reward_guide_block_loads_as_it_reads(block):
    sections = dict(REWARD_GUIDE_BLOCKS[block])
    data = run(train=sections.pop("train", {}))
    data.update(sections)
    cfg = parse_config(data)
    entries = sections["rewards"] if isinstance(sections["rewards"], list) else [sections["rewards"]]
    assert [r.name for r in cfg.rewards] == [e["name"] for e in entries]
    for entry, reward in zip(entries, cfg.rewards):
        assert reward.reward_model == entry["reward_model"]
        assert reward.batch_size == entry.get("batch_size", reward.batch_size)
        assert reward.weight == entry.get("weight", 1.0)
        assert reward.async_reward is entry.get("async_reward", False)
    if block == "multi_gdpo":
        assert cfg.train.advantage_aggregation == "gdpo"
    if block == "eval_rewards":
        assert [r.name for r in cfg.eval_rewards] == ["hps"]


# The train / scheduler blocks of Flow-Factory's DGPO and CRD examples (X-GenGroup/Flow-Factory,
# examples/dgpo/lora/sd3_5/nocfg.yaml and examples/crd/lora/sd3_5/default.yaml), with their geometry.
DGPO_NOCFG = {"trainer_type": "dgpo", "advantage_aggregation": "sum", "dpo_beta": 10, "use_shared_noise": True,
              "clip_dsm": True, "clip_kl": False, "switch_ema_ref": 200, "kl_cfg": 1.0, "use_ema_ref": False,
              "off_policy": False, "ema_decay": 0.9, "ema_decay_schedule": "constant", "ema_update_interval": 8,
              "ema_device": "cuda", "ema_ref_max_decay": 0.3, "ema_ref_ramp_rate": 0.001, "ema_ref_device": "cuda",
              "num_train_timesteps": 4, "time_sampling_strategy": "discrete", "time_shift": 3.0,
              "timestep_range": 0.6, "kl_type": "v-based", "kl_beta": 0.001, "ref_param_device": "cuda",
              "clip_range": 5.0e-2, "adv_clip_range": 5.0, "resolution": 512, "num_inference_steps": 10,
              "guidance_scale": 1.0, "per_device_batch_size": 12, "group_size": 24, "global_std": True,
              "unique_sample_num_per_epoch": 24, "gradient_step_per_epoch": 1, "num_inner_epochs": 1}
CRD_DEFAULT = {"trainer_type": "crd", "advantage_aggregation": "sum", "crd_beta": 1.0, "crd_loss_type": "mse",
               "use_old_for_loss": True, "adaptive_logp": True, "weight_temp": -1.0,
               "old_model_decay": "0-0.25-0.005-0.999", "sampling_model_decay": "75-0.0-0.0075-0.999",
               "num_train_timesteps": 20, "time_sampling_strategy": "discrete", "time_shift": 3.0,
               "timestep_range": 0.99, "kl_type": "v-based", "kl_beta": 0.1, "kl_cfg": 4.5,
               "reward_adaptive_kl": True, "ref_param_device": "cuda", "adv_clip_range": 5.0, "resolution": 512,
               "num_inference_steps": 10, "guidance_scale": 1.0, "per_device_batch_size": 8, "group_size": 24,
               "global_std": True, "unique_sample_num_per_epoch": 48, "gradient_step_per_epoch": 2,
               "gradient_accumulation_steps": "auto"}


def test_the_dgpo_and_crd_examples_load_with_their_meaning():
    dgpo = parse_config({**run(train=DGPO_NOCFG, scheduler={"dynamics_type": "ODE"}), "num_processes": 4})
    # 4 processes x 12 samples: every global micro-batch holds 2 groups of 24, each spread over 2 processes
    assert (dgpo.batches_per_epoch, dgpo.micro_steps_per_epoch, dgpo.gradient_accumulation) == (12, 48, 48)
    assert dgpo.train.ema_ref_device == "cuda" and dgpo.train.conditioning_guidance_scale == 1.0
    crd = parse_config({**run(train=CRD_DEFAULT, scheduler={"dynamics_type": "ODE"}), "num_processes": 8})
    # rollouts without CFG, the KL's teacher with CFG at 4.5: the prompts carry their negative branch
    assert (crd.train.guidance_scale, crd.train.kl_cfg, crd.train.conditioning_guidance_scale) == (1.0, 4.5, 4.5)
    assert crd.gradient_steps_per_epoch == 2
