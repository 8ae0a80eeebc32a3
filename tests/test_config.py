"""flow_factory.config: YAML + overrides -> validated Config, and the messages users see."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from flow_factory.config import Config, ConfigError, load_config, parse_config
from flow_factory.config.base import Section

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def minimal(**sections) -> dict:
    """The smallest valid config: 4 prompts x group 4 = 16 samples, batches of 4."""
    data = {
        "data": {"dataset_dir": "prompts"},
        "model": {"model_name_or_path": "some/model", "model_type": "sd3-5"},
        "train": {"per_device_batch_size": 4, "group_size": 4, "unique_sample_num_per_epoch": 4},
        "rewards": [{"reward_model": "PickScore"}],
    }
    for name, values in sections.items():
        if isinstance(values, dict) and isinstance(data.get(name), dict):
            data[name] = {**data[name], **values}
        else:
            data[name] = values
    return data


def write(tmp_path: Path, content, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    return path


def problem_of(data=None, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(minimal() if data is None else data, overrides)
    return str(info.value)


# --------------------------------------------------------------------------- loading


@pytest.mark.parametrize("name, batches, micro, accumulation", [
    # 48 x 24 = 1152 samples / (8 x 8) = 18 batches; 2 trained steps; 2 optimizer steps
    ("sd3_5_grpo_lora.yaml", 18, 36, 18),
    # 48 x 16 = 768 / (8 x 2) = 48; 1 trained step; 2 optimizer steps
    ("flux1_grpo_lora.yaml", 48, 48, 24),
    # 32 x 16 = 512 / (8 x 1) = 64; 1 trained step; 2 optimizer steps
    ("wan21_t2v_grpo_lora.yaml", 64, 64, 32),
    # 48 x 16 = 768 / (8 x 1) = 96; 1 trained step; 2 optimizer steps
    ("qwen_image_grpo_lora.yaml", 96, 96, 48),
    ("z_image_turbo_grpo_lora.yaml", 96, 96, 48),
    ("wan22_t2v_a14b_grpo_lora.yaml", 64, 64, 32),
    ("flux2_grpo_lora.yaml", 96, 96, 48),
    ("flux2_klein_grpo_lora.yaml", 96, 96, 48),
    ("hunyuanvideo15_t2v_grpo_lora.yaml", 64, 64, 32),
    # 48 x 16 = 768 / (8 x 1) = 96; 3 trained steps; 2 optimizer steps
    ("ltx2_t2av_grpo_lora.yaml", 96, 288, 144),
    ("flux1_kontext_grpo_lora.yaml", 96, 96, 48),
    ("qwen_image_edit_plus_grpo_lora.yaml", 96, 96, 48),
    ("z_image_omni_grpo_lora.yaml", 96, 96, 48),
    ("qwen_image21_grpo_lora.yaml", 96, 96, 48),
])
def test_examples_load_with_the_batch_arithmetic_their_comments_state(name, batches, micro, accumulation):
    cfg = load_config(EXAMPLES / name)
    assert cfg.batches_per_epoch == batches
    assert cfg.micro_steps_per_epoch == micro
    assert cfg.gradient_accumulation == accumulation
    assert cfg.gradient_steps_per_epoch == 2
    assert cfg.train.adam_beta1 == 0.9 and cfg.train.adam_beta2 == 0.999  # read from adam_betas


def test_shapebench_example_and_every_variant_of_its_algorithm_comparison_validate():
    import importlib.util

    spec = importlib.util.spec_from_file_location("compare", EXAMPLES.parent / "bench" / "shapebench_compare.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    # 16 prompts x 8 = 128 samples / 64 = 2 batches; one trained SDE step; one optimizer step
    demo = load_config(EXAMPLES / "shapebench_grpo.yaml")
    assert (demo.batches_per_epoch, demo.micro_steps_per_epoch, demo.gradient_accumulation) == (2, 2, 2)
    for name, overrides in compare.ALGORITHMS.items():
        cfg = load_config(compare.CONFIG, overrides)
        cache = {"pab": "pyramid", "taylorseer": "taylorseer"}.get(name.partition("-")[2], "none")
        assert cfg.train.trainer_type == (name if name == "grpo-guard" else name.partition("-")[0])
        assert cfg.train.rollout_cache == cache
        # ODE rollouts from a shared start would make a group's samples identical; the demo's window shares it
        assert cfg.train.same_latent == (name in ("grpo-fast", "grpo-guard"))


def test_flow_factory_layout_loads(tmp_path):
    # the shape of Flow-Factory's own example files, with its compatibility keys
    path = write(tmp_path, textwrap.dedent("""\
        launcher: "accelerate"
        config_file: config/deepspeed/zero2.yaml
        num_processes: 8
        main_process_port: 29500
        mixed_precision: "bf16"
        data:
          dataset_dir: "dataset/t2is"
          preprocessing_batch_size: 8
          dataloader_num_workers: 16
          force_reprocess: true
          cache_dir: "~/.cache/flow_factory/datasets"
          max_dataset_size: 1000
          sampler_type: "auto"
        model:
          finetune_type: 'lora'
          lora_rank : 64
          lora_alpha : 128
          target_modules: "default"
          model_name_or_path: "black-forest-labs/FLUX.1-dev"
          model_type: "flux"
          resume_path: null
          resume_type: null
        log:
          run_name: null
          project: "Flow-Factory"
          logging_backend: "wandb"
          save_dir: "saves/"
          save_freq: 20
          save_model_only: true
        train:
          trainer_type: 'grpo'
          advantage_aggregation: 'gdpo'
          clip_range: 1.0e-4
          adv_clip_range: 5.0
          kl_type: 'v-based'
          kl_beta: 0
          ref_param_device: 'cuda'
          resolution: 512
          num_inference_steps: 10
          guidance_scale: 3.5
          per_device_batch_size: 2
          group_size: 16
          global_std: false
          unique_sample_num_per_epoch: 48
          gradient_step_per_epoch: 2
          learning_rate: 3.0e-4
          adam_weight_decay: 1.0e-4
          adam_betas: [0.9, 0.99]
          adam_epsilon: 1.0e-8
          max_grad_norm: 1.0
          ema_decay: 0.9
          ema_update_interval: 4
          ema_device: "cuda"
          enable_gradient_checkpointing: false
          seed: 42
        scheduler:
          dynamics_type: "Flow-SDE"
          noise_level: 0.7
          num_sde_steps: 1
          sde_steps: [1, 2, 3]
          seed: 42
        eval:
          resolution: 512
          per_device_batch_size: 1
          guidance_scale: 3.5
          num_inference_steps: 20
          eval_freq: 20
          seed: 42
        rewards:
          - name: "pickscore_rank"
            reward_model: "PickScore_Rank"
            weight: 1.0
            batch_size: 16
            device: "cuda"
            dtype: bfloat16
        eval_rewards:
          name: "pickscore"
          reward_model: "PickScore"
          batch_size: 16
          device: "cuda"
          dtype: bfloat16
        """))
    cfg = load_config(path)
    assert (cfg.train.ema_decay, cfg.train.ema_update_interval) == (0.9, 4)  # EMA is built (issue 3)
    assert cfg.model.model_type == "flux1"
    assert (cfg.train.adam_beta1, cfg.train.adam_beta2) == (0.9, 0.99)
    assert [r.name for r in cfg.eval_rewards] == ["pickscore"]  # one mapping -> a list of one
    assert cfg.train.kl_beta == 0.0 and isinstance(cfg.train.kl_beta, float)
    assert cfg.log.run_name.startswith("flux1_lora_grpo_")
    # 48 x 16 / (8 x 2) = 48 batches x 1 trained step / 2 optimizer steps
    assert cfg.gradient_accumulation == 24


def test_defaults_are_filled_and_resolved():
    cfg = parse_config(minimal())
    assert cfg.mixed_precision == "bf16" and cfg.seed == 42 and cfg.num_processes == 1
    assert cfg.scheduler.dynamics_type == "Flow-SDE" and cfg.scheduler.noise_level == 0.7
    assert cfg.train.learning_rate == 1e-4  # LoRA default
    assert cfg.train.seed == 42  # from the top-level seed
    ev = cfg.eval
    assert (ev.resolution, ev.num_inference_steps, ev.guidance_scale) == (512, 10, 4.5)  # train's
    assert ev.per_device_batch_size == 4 and ev.seed == 42
    assert cfg.log.logging_backend == "tensorboard" and cfg.log.save_dir == "save"
    stamp = r"\d{8}_\d{6}_[0-9a-f]{6}"  # seconds, then 6 random hex digits
    assert re.fullmatch(rf"sd3-5_lora_grpo_{stamp}", cfg.log.run_name)
    assert cfg.rewards[0].name == "PickScore" and cfg.rewards[0].weight == 1.0
    assert cfg.eval_rewards is None

    full = parse_config(minimal(model={"finetune_type": "full"}, seed=7, train={"seed": 3}))
    assert full.train.learning_rate == 1e-5
    assert full.train.seed == 3 and full.eval.seed == 3  # train.seed overrides the top-level seed


def test_every_field_is_documented():
    def walk(model):
        for name, field in model.model_fields.items():
            yield model, name, field
            inner = field.annotation
            for arg in getattr(inner, "__args__", ()) + (inner,):
                if isinstance(arg, type) and issubclass(arg, Section) and arg is not model:
                    yield from walk(arg)

    undocumented = [f"{m.__name__}.{n}" for m, n, f in walk(Config) if not (f.description or "").strip()]
    assert undocumented == []


def test_to_yaml_round_trips_with_every_default_written(tmp_path):
    cfg = load_config(EXAMPLES / "wan21_t2v_grpo_lora.yaml", ["rewards.0.threshold=0.25"])
    text = cfg.to_yaml()
    dumped = yaml.safe_load(text)
    assert set(dumped["train"]) == set(Config.model_fields["train"].annotation.model_fields) - {"adam_betas"}
    assert dumped["train"]["resolution"] == [240, 416] and dumped["log"]["run_name"] == cfg.log.run_name
    again = load_config(write(tmp_path, text))
    assert again.model_dump() == cfg.model_dump()
    assert again.rewards[0].kwargs == {"threshold": 0.25}


# --------------------------------------------------------------------------- overrides


def test_overrides_are_parsed_as_yaml(tmp_path):
    path = write(tmp_path, minimal(log={"run_name": "fixed"}, rewards={"reward_model": "CLIP"}))
    cfg = load_config(path, ["train.learning_rate=1e-5", "train.resolution=[64,96]", "seed=7",
                             "rewards.0.weight=0.5", "scheduler.sde_steps=[0, 2]", "log.run_name=null"])
    assert cfg.train.learning_rate == 1e-5 and isinstance(cfg.train.learning_rate, float)
    assert cfg.train.height_width == (64, 96)
    assert cfg.seed == 7 and cfg.train.seed == 7
    assert cfg.rewards[0].weight == 0.5
    assert cfg.scheduler.sde_steps == [0, 2] and cfg.trained_steps_per_sample == 1  # num_sde_steps: 1
    assert cfg.log.run_name.startswith("sd3-5_lora_grpo_")  # null -> generated again


def test_exponent_without_dot_is_a_float_in_files_too(tmp_path):
    text = yaml.safe_dump(minimal()) + "\nscheduler: {noise_level: 5e-1}\n"
    assert load_config(write(tmp_path, text)).scheduler.noise_level == 0.5


@pytest.mark.parametrize("override, message", [
    ("train.learning_rate", "override 'train.learning_rate': expected section.key=value"),
    ("=3", "override '=3': expected section.key=value"),
    ("train..seed=3", "expected section.key=value"),
    ("train.resolution=[64", "override 'train.resolution=[64', line 1"),
    ("train.group_size.x=4", "override 'train.group_size.x=4': train.group_size is a value, not a section"),
    ("rewards.weight=2", "rewards is a list; address an entry by its index, e.g. rewards.0"),
    ("rewards.3.weight=2", "rewards.3 is out of range; the list has 1 entries"),
])
def test_malformed_overrides(override, message):
    assert message in problem_of(overrides=[override])


# --------------------------------------------------------------------------- key errors


@pytest.mark.parametrize("override, message", [
    ("train.learnig_rate=1e-5", "train.learnig_rate: unknown key; did you mean train.learning_rate?"),
    ("scheduler.noise_levl=0.5", "scheduler.noise_levl: unknown key; did you mean scheduler.noise_level?"),
    ("model.lora_rnak=4", "model.lora_rnak: unknown key; did you mean model.lora_rank?"),
    ("eval.eval_frq=4", "eval.eval_frq: unknown key; did you mean eval.eval_freq?"),
    ("log.save_frq=4", "log.save_frq: unknown key; did you mean log.save_freq?"),
    ("data.dataset_dri=x", "data.dataset_dri: unknown key; did you mean data.dataset_dir?"),
    ("num_proceses=2", "num_proceses: unknown key; did you mean num_processes?"),
    ("trian.seed=1", "trian: unknown key; did you mean train?"),
    ("train.sde_type=CPS", "train.sde_type: unknown key; did you mean scheduler.dynamics_type? "
                           "(the setting moved there)"),
    ("train.sde_type=x", "train.sde_type: unknown key; did you mean scheduler.dynamics_type? (the setting moved "
     "there)"),
])
def test_unknown_keys_suggest_the_close_match(override, message):
    assert problem_of(overrides=[override]) == message


def test_unknown_key_without_close_match_lists_the_section():
    msg = problem_of(overrides=["log.colour=blue"])
    assert msg == ("log.colour: unknown key; valid keys of log: run_name, project, logging_backend, "
                   "save_dir, save_freq, save_model_only, verbose, video_format, overwrite")
    assert problem_of(overrides=["zzz=1"]).startswith("zzz: unknown key; valid keys at the top level: launcher,")


def test_reward_extra_keys_are_constructor_options():
    cfg = parse_config(minimal(rewards=[
        {"reward_model": "ocr", "threshold": 0.5, "kwargs": {"lang": "en"}},
        {"reward_model": "my_pkg.rewards.Aesthetic", "name": "aes", "reward_model_kwargs": {"k": 2}},
    ]))
    assert cfg.rewards[0].kwargs == {"lang": "en", "threshold": 0.5}
    assert cfg.rewards[1].kwargs == {"k": 2} and cfg.rewards[1].name == "aes"
    clash = problem_of(minimal(rewards=[{"reward_model": "ocr", "k": 1, "kwargs": {"k": 2}}]))
    assert clash == "rewards[0]: option 'k' is given twice with different values (1 and 2 in kwargs)"


# --------------------------------------------------------------------------- value errors


@pytest.mark.parametrize("override, message", [
    ("train.group_size=four", "train.group_size: expected a positive integer, got 'four'"),
    ("train.group_size=2.5", "train.group_size: expected a positive integer, got 2.5"),
    ("train.group_size=true", "train.group_size: expected a positive integer, got true"),
    ("train.trainer_type=gpro",
     "train.trainer_type: expected one of 'grpo', 'grpo-guard', 'dppo', 'nft', 'awm', 'dpo', 'dgpo', 'crd', 'sft', 'offline-dpo', 'dmd2', 'tdm', 'tdm-r1', 'diffusion-opd', got 'gpro'; did you mean 'grpo'?"),
    ("scheduler.dynamics_type=Flow-SDF",
     "scheduler.dynamics_type: expected one of 'Flow-SDE', 'Dance-SDE', 'CPS', 'ODE', 'DPM-Solver++2M', got 'Flow-SDF'; "
     "did you mean 'Flow-SDE'?"),
    ("mixed_precision=bf17", "mixed_precision: expected one of 'no', 'fp16', 'bf16', got 'bf17'; did you mean 'bf16'?"),
    ("scheduler.noise_level=-0.1", "scheduler.noise_level: expected a number >= 0, got -0.1"),
    ("train.adam_beta2=1.0", "train.adam_beta2: expected a number in [0, 1), got 1.0"),
    ("train.learning_rate=.inf", "train.learning_rate: expected a positive number or null, got inf"),
    ("train.gradient_accumulation_steps=0",
     "train.gradient_accumulation_steps: expected 'auto' or a positive integer, got 0"),
    ("train.resolution=[512, 512, 3]",
     "train.resolution: expected an integer or [height, width], got a list of 3 values [512, 512, 3]"),
    ("train.resolution=big", "train.resolution: expected an integer or [height, width], got 'big'"),
    ("scheduler.sde_steps=[1, x]", "scheduler.sde_steps: expected a list of integers or null, got [1, 'x']"),
    ("scheduler.sde_steps=[2, 2]", "scheduler.sde_steps: steps [2] are listed more than once"),
    ("model.target_modules=[]", "model.target_modules: an empty list trains nothing"),
    ("rewards.0.weight=heavy", "rewards[0].weight: expected a number or a mapping, got 'heavy'"),
    ("rewards=5", "rewards: expected a list of reward entries"),
    ("train=5", "train: expected a mapping of settings, got 5"),
])
def test_wrong_values_name_path_value_and_what_is_valid(override, message):
    assert problem_of(overrides=[override]).startswith(message)


@pytest.mark.parametrize("alias, canonical", [
    ("sd3_5", "sd3-5"), ("sd3", "sd3-5"), ("SD3-5", "sd3-5"), ("flux", "flux1"), ("flux1", "flux1"),
    ("wan", "wan2_t2v"), ("wan2.1", "wan2_t2v"), ("wan21_t2v", "wan2_t2v"), ("wan2_t2v", "wan2_t2v"),
    ("qwen-image", "qwen-image"), ("qwen_image", "qwen-image"), ("qwenimage", "qwen-image"),
    ("z-image", "z-image"), ("z_image", "z-image"), ("Z-Image-Turbo", "z-image"),
    ("flux2", "flux2"), ("FLUX.2", "flux2"), ("flux2_klein", "flux2-klein"), ("FLUX.2-klein", "flux2-klein"),
    ("flux2_klein_base", "flux2-klein"),
])
def test_model_type_aliases(alias, canonical):
    frames = {"num_frames": 5} if canonical == "wan2_t2v" else {}
    cfg = parse_config(minimal(model={"model_type": alias}, train=frames))
    assert cfg.model.model_type == canonical


def test_each_spelling_of_the_family_table_names_one_family():
    """model.model_type's spellings come from the model families' lines (config.families): none names two
    families, and the examples the config reference gives are spellings of the table."""
    from flow_factory.config.base import canonical_choice
    from flow_factory.config.families import ALIAS_EXAMPLES, MODEL_FAMILIES, model_type_aliases

    owners = {}
    for family in MODEL_FAMILIES.values():
        for spelling in (family.model_type, *family.aliases):
            owners.setdefault(spelling.lower().replace("_", "-").replace(".", "-"), set()).add(family.model_type)
    assert all(len(names) == 1 for names in owners.values())
    assert all(canonical_choice(example, model_type_aliases()) in MODEL_FAMILIES for example in ALIAS_EXAMPLES)


def test_missing_required_keys_are_named():
    assert problem_of({"model": {"model_name_or_path": "m", "model_type": "sd3"}, "rewards": {"reward_model": "a"}}) \
        == "data: dataset_dir is required: a folder of prompts (train.txt / train.jsonl, and test.* for eval); " \
           "or datasets, for several"
    data = minimal()
    del data["model"]["model_type"]
    err = pytest.raises(ConfigError, parse_config, data).value
    assert err.problems[0].startswith("model.model_type: required key is missing")
    # an online trainer needs a reward; sft and offline-dpo do not
    assert problem_of(minimal(rewards=[])).startswith("rewards: at least one reward is needed")
    assert problem_of(minimal(rewards=[{"weight": 2.0}])).startswith("rewards[0].reward_model: required key is missing")


def test_every_problem_is_reported_at_once():
    err = pytest.raises(ConfigError, parse_config, minimal(),
                        ["train.group_size=x", "log.save_frq=1", "scheduler.noise_level=-1"]).value
    assert len(err.problems) == 3
    assert str(err).startswith("3 problems:\n  ")


def test_direct_construction_raises_config_error_too():
    with pytest.raises(ConfigError, match="train.group_size: expected a positive integer, got 'four'"):
        Config(**minimal(train={"group_size": "four"}))


# --------------------------------------------------------------------------- files


def test_file_problems_name_the_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    assert str(pytest.raises(ConfigError, load_config, missing).value) == f"config file not found: {missing}"

    broken = write(tmp_path, "data:\n  dataset_dir: x\nmodel: [unclosed\n", "broken.yaml")
    msg = str(pytest.raises(ConfigError, load_config, broken).value)
    assert msg.startswith(f"{broken}, line 4, column 1: invalid YAML")

    twice = write(tmp_path, "train:\n  seed: 1\ndata: {}\ntrain:\n  seed: 2\n", "twice.yaml")
    msg = str(pytest.raises(ConfigError, load_config, twice).value)
    assert msg.startswith(f"{twice}, line 4, column 1: invalid YAML")
    assert "'train' appears twice with different values (lines 1 and 4" in msg
    # the same value twice (as some of Flow-Factory's examples write `seed`) is that value
    same = write(tmp_path, yaml.safe_dump(minimal(train={"seed": 3})) + "seed: 5\nseed: 5\n", "same.yaml")
    assert load_config(same).seed == 5

    listed = write(tmp_path, "- a\n- b\n", "list.yaml")
    assert "expected a mapping of settings at the top level, got list" in str(
        pytest.raises(ConfigError, load_config, listed).value)

    typo = write(tmp_path, minimal(train={"learnig_rate": 1e-5}), "typo.yaml")
    assert str(pytest.raises(ConfigError, load_config, typo).value) == \
        f"{typo}: train.learnig_rate: unknown key; did you mean train.learning_rate?"


# --------------------------------------------------------------------------- contradictions


@pytest.mark.parametrize("overrides, message", [
    (["scheduler.dynamics_type=ODE"],
     "train.trainer_type 'grpo' needs a stochastic dynamics to have log-probabilities to train, "
     "but scheduler.dynamics_type is 'ODE'"),
    (["train.trainer_type=grpo-guard", "scheduler.dynamics_type=Dance-SDE"],
     "train.trainer_type 'grpo-guard' re-normalises Flow-SDE's log-ratios and works only with "
     "scheduler.dynamics_type 'Flow-SDE', got 'Dance-SDE'"),
    (["scheduler.noise_level=0"], "scheduler.noise_level: 0 makes Flow-SDE deterministic"),
    (["train.group_size=1", "train.per_device_batch_size=2"],
     "train.group_size: grpo compares samples of the same prompt, so a group needs at least 2, got 1"),
    (["num_processes=3"],
     "train: unique_sample_num_per_epoch x group_size = 4 x 4 = 16 samples per epoch do not split evenly into "
     "batches of num_processes x per_device_batch_size = 3 x 4 = 12"),
    (["scheduler.sde_steps=[3, 10, 12]"],
     "scheduler.sde_steps: [10, 12] outside [0, 10) with train.num_inference_steps = 10"),
    (["scheduler.sde_steps=[1, 2]", "scheduler.num_sde_steps=3"],
     "scheduler.num_sde_steps: 3 is more than the 2 candidate steps"),
    # every step but the last is a candidate by default
    (["scheduler.num_sde_steps=10"], "scheduler.num_sde_steps: 10 is more than the 9 candidate steps"),
    # 16 / 4 = 4 batches x 9 steps = 36 micro-steps
    (["train.gradient_step_per_epoch=5", "scheduler.num_sde_steps=null"],
     "train.gradient_step_per_epoch: 5 does not divide the 36 micro-steps per epoch (4 batches per process x "
     "9 trained steps per sample); choose one of [1, 2, 3, 4, 6, 9, 12, 18, 36]"),
    (["train.gradient_accumulation_steps=6", "scheduler.num_sde_steps=2"],
     "train.gradient_accumulation_steps: 6 does not divide the 8 micro-steps per epoch"),
    (["train.outside_kl_beta=0.1", "scheduler.sde_steps=[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]",
      "scheduler.num_sde_steps=null"],
     "train.outside_kl_beta: every one of the 10 steps is trained, so no step is outside the SDE window"),
    (["train.outside_kl_beta=0.1", "scheduler.sde_steps=[0, 1]", "scheduler.num_sde_steps=5"],
     "scheduler.num_sde_steps: 5 is more than the 2 candidate steps"),
    (["train.trainer_type=nft", "train.outside_kl_beta=0.1"],
     "train.outside_kl_beta: the KL at the steps an SDE window does not train is the grpo family's; nft has no "
     "window (use kl_beta)"),
    (["model.model_type=wan", "train.num_frames=8"],
     "train.num_frames: wan2_t2v needs 4k + 1 frames (the VAE packs 4 frames into one latent), got 8; nearest: 5"),
    (["train.num_frames=5"], "train.num_frames: sd3-5 is an image model; remove num_frames"),
    (["rewards=[]"], "rewards: at least one reward is needed"),
    (["rewards=[{reward_model: a}, {reward_model: a}]"],
     "rewards: two entries are named 'a' (entries 0 and 1); give each a distinct name"),
    (["eval_rewards=[{reward_model: a, name: x}, {reward_model: b, name: x}]"],
     "eval_rewards: two entries are named 'x'"),
    (["train.adam_betas=[0.8, 0.99]", "train.adam_beta1=0.7"],
     "train: adam_betas [0.8, 0.99] contradicts adam_beta1: 0.7; keep one of the two spellings"),
])
def test_contradictions(overrides, message):
    assert problem_of(overrides=overrides).startswith(message)


# --------------------------------------------------------------------------- arithmetic


@pytest.mark.parametrize("scheduler, expected_trained", [
    ({}, 1),  # one step drawn from every step but the last (num_sde_steps: 1)
    ({"num_sde_steps": None}, 9),  # every step but the last
    ({"sde_steps": [1, 2, 3, 4], "num_sde_steps": None}, 4),  # the whole window
    ({"sde_steps": [1, 2, 3, 4], "num_sde_steps": 2}, 2),  # drawn from the window
    ({"num_sde_steps": 3}, 3),  # drawn from all steps
])
def test_trained_steps_and_accumulation(scheduler, expected_trained):
    # 2 processes x 2 per device: 8 prompts x 4 = 32 samples -> 8 batches per process
    data = minimal(num_processes=2, scheduler=scheduler,
                   train={"per_device_batch_size": 2, "unique_sample_num_per_epoch": 8, "gradient_step_per_epoch": 2})
    cfg = parse_config(data)
    assert cfg.batches_per_epoch == 8
    assert cfg.trained_steps_per_sample == expected_trained
    assert cfg.gradient_accumulation == 8 * expected_trained // 2
    explicit = parse_config(data, ["train.gradient_accumulation_steps=1"])
    assert explicit.gradient_accumulation == 1
    assert explicit.gradient_steps_per_epoch == 8 * expected_trained


def test_eval_section_falls_back_to_train_only_where_null():
    cfg = parse_config(minimal(train={"resolution": [64, 32], "guidance_scale": 1.0},
                               eval={"num_inference_steps": 4}))
    assert cfg.eval.height_width == (64, 32) and cfg.eval.guidance_scale == 1.0
    assert cfg.eval.num_inference_steps == 4 and cfg.train.num_inference_steps == 10


# --------------------------------------------------------------------------- imports


def test_config_errors_come_before_heavy_imports(tmp_path):
    bad = write(tmp_path, minimal(train={"group_size": "four"}))
    code = textwrap.dedent(f"""
        import sys
        from flow_factory.config import ConfigError, load_config
        try:
            load_config({str(bad)!r})
        except ConfigError as err:
            print("error:", err)
        heavy = sorted(m for m in ("torch", "diffusers", "transformers", "accelerate", "peft") if m in sys.modules)
        print("heavy:", heavy)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "error: " in out.stdout and "train.group_size: expected a positive integer, got 'four'" in out.stdout
    assert "heavy: []" in out.stdout


def test_the_torch_free_config_agrees_with_the_classes_it_names():
    """The config checks combinations without importing torch, so it keeps its own lists of
    trainer types and dynamics; they must say what the classes say."""
    from typing import get_args

    from flow_factory.algorithms import ALGORITHMS, KL_TYPES
    from flow_factory.config.schema import STOCHASTIC
    from flow_factory.config.sections import SchedulerConfig
    from flow_factory.config.algorithms import COUPLED_TRAINER_TYPES
    from flow_factory.config.train import TrainConfig
    from flow_factory.dynamics import DYNAMICS

    assert set(get_args(TrainConfig.model_fields["trainer_type"].annotation)) == set(ALGORITHMS)
    assert {name for name, cls in ALGORITHMS.items() if cls.coupled} == set(COUPLED_TRAINER_TYPES)
    assert all(cls.name == name for name, cls in ALGORITHMS.items())  # each spec names its own class
    assert set(get_args(SchedulerConfig.model_fields["dynamics_type"].annotation)) == set(DYNAMICS)
    assert {name for name, cls in DYNAMICS.items() if cls.stochastic} == set(STOCHASTIC)
    assert set(get_args(TrainConfig.model_fields["kl_type"].annotation)) == set(KL_TYPES)


def _combination_accepted_by_config(trainer_type: str, dynamics: str) -> bool:
    try:
        parse_config(minimal(train={"trainer_type": trainer_type},
                             scheduler={"dynamics_type": dynamics, "noise_level": 0.7}))
        return True
    except ConfigError:
        return False


def _combination_accepted_by_classes(trainer_type: str, dynamics: str) -> bool:
    from flow_factory.algorithms import make_algorithm
    from flow_factory.config.train import TrainConfig
    from flow_factory.dynamics import make_dynamics

    try:
        make_algorithm(trainer_type, TrainConfig(trainer_type=trainer_type), make_dynamics(dynamics, 0.7))
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("trainer_type", ["grpo", "grpo-guard", "dppo", "nft", "awm", "dpo", "dgpo", "crd"])
@pytest.mark.parametrize("dynamics", ["Flow-SDE", "Dance-SDE", "CPS", "ODE", "DPM-Solver++2M"])
def test_the_config_refuses_exactly_the_combinations_the_classes_refuse(trainer_type, dynamics):
    """Which algorithm trains through which dynamics is the classes' rule (GRPO needs a stochastic
    step, GRPO-Guard Flow-SDE); the torch-free config repeats it to fail before anything loads."""
    assert _combination_accepted_by_config(trainer_type, dynamics) == _combination_accepted_by_classes(
        trainer_type, dynamics)


@pytest.mark.parametrize("num_processes", [1, 2])
@pytest.mark.parametrize("trainer_type", ["grpo", "grpo-guard", "dppo", "nft", "awm", "dpo"])
def test_the_epoch_arithmetic_counts_the_micro_batches_the_algorithm_makes(trainer_type, num_processes):
    """The config computes micro-steps per epoch (and so gradient accumulation) from its own
    copy of each algorithm's rule (DPO: one best / worst pair per group); count what the
    algorithm's training_units and micro_batches really yield on one process's share."""
    import torch

    from flow_factory.algorithms import make_algorithm
    from flow_factory.dynamics import make_dynamics
    from flow_factory.dynamics.window import choose_sde_steps
    from flow_factory.sampling import Rollouts

    cfg = parse_config(minimal(num_processes=num_processes, train={
        "trainer_type": trainer_type, "num_inference_steps": 4, "unique_sample_num_per_epoch": 4,
        "group_size": 4, "per_device_batch_size": 2}))
    algorithm = make_algorithm(trainer_type, cfg.train, make_dynamics(cfg.scheduler.dynamics_type,
                                                                      cfg.scheduler.noise_level))
    n, steps = cfg.samples_per_epoch // num_processes, cfg.train.num_inference_steps
    group_ids = torch.arange(n) // cfg.train.group_size
    advantages = torch.randn(n, generator=torch.Generator().manual_seed(0))
    rollouts = Rollouts(prompts=[""] * n, group_ids=group_ids, latents=torch.zeros(n, steps + 1, 4, 2, 2),
                        log_probs=torch.zeros(n, steps), sigmas=torch.linspace(1, 0, steps + 1),
                        sde_steps=choose_sde_steps(steps, cfg.sde_step_candidates, cfg.scheduler.num_sde_steps,
                                                   torch.Generator().manual_seed(0)),
                        cond={"prompt_embeds": torch.zeros(n, 1)},
                        media=torch.empty(0), means=torch.zeros(n, steps, 4, 2, 2))
    units = algorithm.training_units(group_ids, advantages)
    batch = cfg.train.per_device_batch_size
    micro = sum(len(list(algorithm.micro_batches(rollouts, advantages, units[i:i + batch],
                                                 torch.Generator().manual_seed(i))))
                for i in range(0, len(units), batch))
    assert micro == cfg.micro_steps_per_epoch
