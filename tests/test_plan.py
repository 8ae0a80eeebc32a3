"""ff-train --plan (flow_factory/plan): sizes from configs, FLOPs and memory of the model's own code on meta."""

import json

import pytest
import torch

from flow_factory.config import parse_config
from flow_factory.models import load_adapter
from flow_factory.models.lora import apply_lora
from flow_factory.plan import make_plan
from flow_factory.plan.conditioning import conditioning
from flow_factory.plan.measure import FrozenAwareMemTracker, Measured, measure_velocity
from flow_factory.plan.pipeline import build_pipeline
from torch.distributed._tools.mem_tracker import _MemRefType
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

PROMPTS = ["a red square beside a blue circle"]


@pytest.mark.parametrize("hub_id, model_type, public", [
    ("black-forest-labs/FLUX.1-dev", "flux1", 11.9e9),  # the hub's parameter counts
    ("Wan-AI/Wan2.1-T2V-14B-Diffusers", "wan2_t2v", 14.3e9),
    ("Qwen/Qwen-Image", "qwen-image", 20.4e9),
])
def test_public_transformers_at_their_parameter_counts(hub_id, model_type, public):
    meta = build_pipeline(model_type, hub_id, torch.bfloat16)
    params = meta.components["transformer"].params
    assert abs(params - public) / public < 0.01
    # bf16, but the parts a diffusers class keeps in float32 (Wan's norms, time embedder and rope: 0.2 % of its bytes)
    kept = type(meta.components["transformer"].module)._keep_in_fp32_modules
    assert 2 * params <= meta.components["transformer"].bytes <= 2 * params * (1.003 if kept else 1)


@pytest.mark.parametrize("hub_id, public, within", [
    ("black-forest-labs/FLUX.2-dev", 32e9, 0.01),  # the makers' figures, rounded: "32B", "9B", "8.3B", "19B", "6B"
    ("black-forest-labs/FLUX.2-klein-9B", 9e9, 0.01),
    ("hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v", 8.3e9, 0.01),
    ("Lightricks/LTX-2", 19e9, 0.01),
    ("Tongyi-MAI/Z-Image-Turbo", 6e9, 0.03),  # 6.15 B: "6B" is rounded further
    ("black-forest-labs/FLUX.2-klein-4B", 4e9, 0.04),  # 3.88 B
    ("black-forest-labs/FLUX.2-klein-base-9B", 9e9, 0.01),  # the undistilled bases: their siblings' networks
    ("Tongyi-MAI/Z-Image", 6e9, 0.03),
])
def test_public_transformers_at_their_makers_figures(hub_id, public, within):
    """The table's transformer configs (checked against diffusers' conversion scripts, plan/public_configs.py) give
    the parameter counts their makers announce."""
    from flow_factory.plan.pipeline import build_module
    from flow_factory.plan.public_configs import PUBLIC_PIPELINES

    library, class_name, config = PUBLIC_PIPELINES[hub_id]["transformer"]
    params = sum(p.numel() for p in build_module(library, class_name, config, torch.bfloat16).parameters())
    assert abs(params - public) / public < within, params


FAMILIES = [("tiny_sd3_path", "sd3-5", 64, None, 4.5), ("tiny_flux_path", "flux1", 64, None, 3.5),
            ("tiny_wan_path", "wan2_t2v", 32, 5, 5.0), ("tiny_qwen_image_path", "qwen-image", 64, None, 4.0),
            ("tiny_z_image_path", "z-image", 64, None, 0.0), ("tiny_z_image_omni_path", "z-image-omni", 64, None, 0.0),
            ("tiny_flux2_path", "flux2", 64, None, 4.0),
            ("tiny_hunyuan_video15_path", "hunyuanvideo15", 32, 5, 6.0),
            ("tiny_ltx2_path", "ltx2_t2av", 32, 9, 4.0)]


def real_text_tokens(cond: dict) -> dict[str, int]:
    """The real tokens of each positive mask of ``cond``, for the plan's conditioning."""
    return {key: int(mask.sum(1).max()) for key, mask in cond.items() if key.startswith("prompt_embeds_mask")}


@pytest.mark.parametrize("fixture, model_type, size, frames, scale", FAMILIES)
def test_one_transformer_call_planned_as_the_real_one(request, fixture, model_type, size, frames, scale):
    """The plan's conditioning has the real encode's keys and shapes, and the planned call (meta networks) counts
    the FLOPs FlopCounterMode counts on the real call."""
    path = request.getfixturevalue(fixture)
    real = load_adapter(model_type, path)
    cond = real.encode(PROMPTS, None, scale)
    latents = real.initial_noise(1, size, size, num_frames=frames)
    planned_cond = conditioning(real, 1, scale, size, size, frames, text_tokens=real_text_tokens(cond))
    assert {k: tuple(v.shape) for k, v in planned_cond.items()} == {k: tuple(v.shape) for k, v in cond.items()}
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        real.velocity(latents, torch.tensor([0.9]), cond, scale)

    meta = build_pipeline(model_type, str(path), torch.float32)
    meta.adapter.latent_shape(size, size, frames)  # LTX-2's adapter knows a latent length by the size that made it
    planned = measure_velocity(meta.adapter, torch.zeros_like(latents), 0.9,
                               conditioning(meta.adapter, 1, scale, size, size, frames,
                                            text_tokens=real_text_tokens(cond)), scale, train=False)
    assert planned.flops == counter.get_total_flops() > 0


def tracked(tracker, kind: str, part: str = "Total") -> int:
    return sum(per_device.get(part, 0) for per_device in tracker.get_tracker_snapshot(kind).values())


def measured_micro_batch(real, trained: list, optimizer, latents, cond: dict, scale: float) -> int:
    """MemTracker's peak of a real CPU training micro-batch over what the run held before it that is not state
    (the weights, the inputs, the tables the networks keep): its activations, the gradients, AdamW's state. The
    micro-batch follows an optimizer step and accumulates into the gradients, as every one after a run's first."""
    tracker = FrozenAwareMemTracker()
    tables = [t for module in real.transformers.values() for m in module.modules() for t in tree_leaves(
        [v for k, v in vars(m).items() if k not in ("_parameters", "_buffers", "_modules")]) if isinstance(t, torch.Tensor)]
    tracker.track_external(*real.transformers.values(), *tables, *cond.values(), latents)
    before = tracked(tracker, "current") - tracked(tracker, "current", _MemRefType.GRAD)  # gradients are state
    if not optimizer.state:  # the step before, untracked
        real.velocity(latents, torch.full((2,), 0.9), cond, scale).square().mean().backward()
        optimizer.step()
    tracker.track_external(*trained, optimizer)  # the gradients and AdamW's state that step left
    with tracker:
        real.velocity(latents, torch.full((2,), 0.8), cond, scale).square().mean().backward()
    return tracked(tracker, "peak") - before


@pytest.mark.parametrize("finetune", ["lora", "full"])
@pytest.mark.parametrize("fixture, model_type, size, frames, scale",
                         [f for f in FAMILIES if not hasattr(f, "marks")])
def test_training_micro_batch_memory_within_a_quarter_of_the_measured(request, fixture, model_type, size, frames,
                                                                     scale, finetune):
    """The plan of a CPU run (float32): one micro-batch's activations, gradients and AdamW's state against
    torch's MemTracker on the real run of the same config (LoRA or full), without and with gradient
    checkpointing."""
    path = request.getfixturevalue(fixture)
    real = load_adapter(model_type, path)
    cond = real.encode(PROMPTS * 2, None, scale)
    latents = real.initial_noise(2, size, size, num_frames=frames)
    with torch.no_grad():  # what a first call computes once and keeps (rotary tables) is there before
        real.velocity(latents, torch.full((2,), 0.9), cond, scale)

    def plan(checkpointing: bool):
        cfg = parse_config({"model": {"model_name_or_path": str(path), "model_type": model_type, "lora_rank": 4,
                                      "finetune_type": finetune},
                            "train": {"resolution": size, "num_frames": frames, "per_device_batch_size": 2,
                                      "group_size": 2, "unique_sample_num_per_epoch": 2, "guidance_scale": scale,
                                      "enable_gradient_checkpointing": checkpointing},
                            "data": {"dataset_dir": str(path)},
                            "rewards": [{"reward_model": "jpeg_compressibility"}]})
        return make_plan(cfg, device="cpu", text_tokens=real_text_tokens(cond),
                         calls={"rollout": Measured(0, 0), "decode": Measured(0, 0)})  # the training call alone

    planned = {False: plan(False)}
    trained = [real.transformers[name] for name in planned[False].trained]
    for module in trained:
        if finetune == "lora":
            apply_lora(module, 4, planned[False].config.model.lora_alpha, "default", real.default_lora_targets)
        else:
            module.requires_grad_(True)
    assert planned[False].trained == {name: sum(p.numel() for p in real.transformers[name].parameters()
                                                if p.requires_grad) for name in planned[False].trained}
    optimizer = torch.optim.AdamW([p for module in trained for p in module.parameters() if p.requires_grad])
    for checkpointing in (False, True):
        if checkpointing:
            planned[True] = plan(True)
            for module in trained:
                module.enable_gradient_checkpointing()
        measured = measured_micro_batch(real, trained, optimizer, latents, cond, scale)
        training = planned[checkpointing].memory("multi_gpu")["training"]
        figure = training["activations"] + training["gradients"] + training["optimizer state"]
        assert abs(figure - measured) / measured < 0.25, (checkpointing, figure, measured)


def deeper(folder, tmp_path, **layers):
    """The configs of the tiny pipeline ``folder`` with its transformer's stacks deeper (``layers``: config keys),
    all the planner reads (no weights)."""
    import shutil

    copy = tmp_path / folder.name
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    config = copy / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **layers}))
    return copy


@pytest.mark.parametrize("fixture, model_type, layers, groups, cases", [
    # the text branch of the last double-stream block feeds nothing (the single-stream stack of 1 stays whole): a
    # training micro-batch, with and without checkpointing
    ("tiny_flux_path", "flux1", {"num_layers": 4}, [4], [(True, False), (True, True)]),
    # the last block differs (no text output), not scaled; a sampling call (its peak does not grow with depth)
    ("tiny_sd3_path", "sd3-5", {"num_layers": 5}, [4], [(False, False)]),
])
def test_a_call_measured_on_a_few_blocks_is_the_whole_calls(request, tmp_path, fixture, model_type, layers, groups,
                                                             cases):
    """Scaled from stacks cut to 2 and 3 blocks (plan/blocks.py), a call (LoRA) counts the whole model's FLOPs and
    gradients exactly, and its peak within 1 %."""
    from flow_factory.plan.blocks import measure_scaled, repeated_groups
    from flow_factory.plan.build import make_trainable

    path = deeper(request.getfixturevalue(fixture), tmp_path, **layers)
    adapter = build_pipeline(model_type, str(path), torch.float32).adapter
    cfg = parse_config({"model": {"model_name_or_path": str(path), "model_type": model_type, "lora_rank": 4},
                        "data": {"dataset_dir": str(path)}, "rewards": [{"reward_model": "jpeg_compressibility"}]})
    make_trainable(adapter, cfg, torch.float32)
    assert [len(g.blocks) for g in repeated_groups(adapter.transformers)] == groups
    cond, latents = conditioning(adapter, 2, 4.0, 64, 64), torch.zeros(2, *adapter.latent_shape(64, 64))
    for train, checkpointing in cases:
        if checkpointing:
            adapter.transformer.enable_gradient_checkpointing()
        call = lambda: measure_velocity(adapter, latents, 0.9, cond, 4.0, train)  # noqa: E731
        scaled, whole = measure_scaled(call, adapter.transformers), call()
        assert (scaled.flops, scaled.gradients) == (whole.flops, whole.gradients) and whole.flops > 0
        assert abs(scaled.peak - whole.peak) <= 0.01 * whole.peak, (train, checkpointing, scaled.peak, whole.peak)


def test_a_config_over_its_gpu_gets_the_change_that_fits_with_its_figures(tiny_sd3_path, monkeypatch):
    """A GPU a little smaller than the tiny demo's plan needs (the 2 GiB reserve set aside): the verdict names the
    cheapest change that fits, and its figures are those of the config planned with that change."""
    from flow_factory.config import load_config
    from flow_factory.plan import gpus, memory
    from flow_factory.plan.report import as_json, as_text, plan_for_cli

    example, overrides = "examples/demo_tiny_sd3.yaml", [f"model.model_name_or_path={tiny_sd3_path}"]
    change = "train.offload_samples_to_cpu=true"  # the rollouts of the epoch are the most of what it holds
    changed = make_plan(load_config(example, overrides + [change]))
    as_is = make_plan(load_config(example, overrides))
    monkeypatch.setattr(memory, "RESERVE", 0)
    monkeypatch.setitem(gpus.GPUS, "small", gpus.GPU("small GPU", (changed.peak()[1] + as_is.peak()[1]) // 2,
                                                     gpus.GPUS[changed.gpu].bf16_flops))

    plan, changes, fitted = plan_for_cli(example, overrides, "small", None, 0.4)
    assert not plan.fits() and changes == [change] and fitted.fits()
    assert fitted.peak() == changed.peak() and fitted.memory("fsdp2") == changed.memory("fsdp2")
    out = as_json(plan, changes, fitted)
    assert not out["fits"] and out["change"] == [change]
    assert out["planned_with_change"]["peak"] == {"phase": changed.peak()[0], "bytes": changed.peak()[1]}
    assert out["planned_with_change"]["seconds_per_epoch"] == changed.seconds_per_epoch
    gib = f"{changed.peak()[1] / 2 ** 30:.1f} GiB at {changed.peak()[0]}"
    assert f"verdict: does not fit ({as_is.peak()[1] / 2 ** 30:.1f} GiB at {as_is.peak()[0]}" in as_text(
        plan, changes, fitted)
    assert f"the cheapest change that fits: {change} -> {gib}" in as_text(plan, changes, fitted)


def test_networks_too_large_to_load_get_no_change(tiny_sd3_path, monkeypatch):
    """Every network is loaded whole on each GPU before anything is split: a GPU smaller than that gets no change
    (none of the list alters it), and the verdict says why, without planning any change."""
    from flow_factory.config import load_config
    from flow_factory.plan import gpus, memory
    from flow_factory.plan.report import as_text, plan_for_cli

    example, overrides = "examples/demo_tiny_sd3.yaml", [f"model.model_name_or_path={tiny_sd3_path}"]
    loading = sum(make_plan(load_config(example, overrides)).memory()["prompt cache"].values())
    monkeypatch.setattr(memory, "RESERVE", 0)
    monkeypatch.setitem(gpus.GPUS, "tiny", gpus.GPU("tiny GPU", loading - 1, 1e12))
    plan, changes, fitted = plan_for_cli(example, overrides, "tiny", None, 0.4)
    assert (changes, fitted) == ([], None) and not plan.fits("fsdp2_offload")
    assert "every network is loaded whole on each GPU" in as_text(plan, changes, fitted)


def test_plan_cli_json(tiny_sd3_path, capsys):
    from flow_factory.train import main

    code = main(["--plan", "examples/demo_tiny_sd3.yaml", f"model.model_name_or_path={tiny_sd3_path}", "--json",
                 "--gpu", "l40s"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["fits"]
    assert out["components"]["transformer"]["params"] > 0
    assert set(out["memory"]) >= {"multi_gpu", "fsdp2", "fsdp2_offload", "zero2", "zero3"}
    assert out["seconds_per_epoch"] > 0 and out["flops_per_epoch_per_gpu"]["training"] > 0


def test_a_reward_this_version_lacks_is_a_note_not_the_end_of_the_plan():
    """Flow-Factory's LTX-2 example loads but names its ``imagebind`` reward: the plan counts the rest and says so."""
    from flow_factory.plan.build import reward_models

    cfg = parse_config({"model": {"model_name_or_path": "m", "model_type": "sd3-5"}, "data": {"dataset_dir": "d"},
                        "rewards": [{"reward_model": "imagebind"}, {"reward_model": "jpeg_compressibility"}]})
    notes = []
    assert reward_models(cfg, notes) == (0, []) and len(notes) == 1
    assert notes[0].startswith("rewards[0].reward_model: 'imagebind' is Flow-Factory's built-in reward imagebind")
    assert "a run stops there" in notes[0]


def test_an_offline_trainer_is_planned_without_rollouts(tiny_sd3_path, tmp_path):
    """sft samples and decodes nothing in an epoch (it trains on the dataset's media): the plan measures and
    counts neither, holds no epoch of rollouts, and says what its epoch stands for."""
    import yaml
    from flow_factory.config import load_config

    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump({
        "num_processes": 1, "mixed_precision": "no",
        "data": {"datasets": [{"name": "demos", "dataset_dir": "dataset/sft", "train": {"weight": 1}}]},
        "model": {"model_name_or_path": str(tiny_sd3_path), "model_type": "sd3-5", "finetune_type": "lora",
                  "lora_rank": 4, "lora_alpha": 4, "target_modules": "all"},
        "train": {"trainer_type": "sft", "resolution": 64, "per_device_batch_size": 2, "guidance_scale": 1.0},
        "eval": {"eval_freq": 0}}))
    plan = make_plan(load_config(path), device="cpu")
    assert plan.flops["rollout"] == plan.flops["decode"] == 0 and plan.flops["training"] > 0
    assert plan.calls["rollout"].peak == plan.calls["decode"].peak == 0
    assert plan.sizes.trajectories == plan.sizes.trajectory_batch  # one micro-batch of latents, no epoch of rollouts
    assert any("no rollout and no decode" in note for note in plan.notes)


def test_public_wan_vaes_carry_a_latent_mean_and_std_per_channel():
    """The decode un-normalises each latent channel by the VAE's latents_mean / latents_std; AutoencoderKLWan's
    defaults hold 16 (Wan2.1's), so a VAE of another z_dim (Wan2.2 TI2V-5B's 48) must carry its own."""
    from flow_factory.plan.public_configs import PUBLIC_PIPELINES

    for hub_id, index in PUBLIC_PIPELINES.items():
        library, class_name, config = index.get("vae", [None, None, {}])
        if class_name == "AutoencoderKLWan" and config.get("z_dim", 16) != 16:
            assert len(config["latents_mean"]) == len(config["latents_std"]) == config["z_dim"], hub_id


def test_ltx2_image_to_video_call_planned_as_the_real_one(tiny_ltx2_i2av_path):
    """LTX-2 image to video with audio: the plan's conditioning has the real encode's and encode_conditions' keys
    and shapes (the first frame's latents beside the text), and the planned call counts the real call's FLOPs."""
    from flow_factory.models.conditioning import ConditionMedia

    size, frames, scale = 32, 9, 4.0
    real = load_adapter("ltx2_i2av", tiny_ltx2_i2av_path)
    cond = real.encode(PROMPTS, None, scale)
    cond.update(real.encode_conditions(ConditionMedia(images=[torch.rand(1, 3, size, size)]), size, size, frames))
    planned_cond = conditioning(real, 1, scale, size, size, frames, text_tokens=real_text_tokens(cond))
    assert {k: tuple(v.shape) for k, v in planned_cond.items()} == {k: tuple(v.shape) for k, v in cond.items()}
    latents = real.initial_noise(1, size, size, num_frames=frames)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        real.velocity(latents, torch.tensor([0.9]), cond, scale)
    meta = build_pipeline("ltx2_i2av", str(tiny_ltx2_i2av_path), torch.float32)
    meta.adapter.latent_shape(size, size, frames)
    planned = measure_velocity(meta.adapter, torch.zeros_like(latents), 0.9,
                               conditioning(meta.adapter, 1, scale, size, size, frames,
                                            text_tokens=real_text_tokens(cond)), scale, train=False)
    assert planned.flops == counter.get_total_flops() > 0


def test_public_wan_image_to_video_transformers_are_text_to_videos_plus_their_image_inputs():
    """Wan I2V's transformers against Wan2.1 T2V 14B's, counted by hand: the patch embedding's 20 more input
    channels (the first frame's latents and mask) for both; Wan2.1's also a CLIP-state embedder (LayerNorm,
    1280 -> 1280 -> 5120, LayerNorm) and each block's added key / value projections with their RMSNorm
    (16.39 B in all, the hub's 16.4 B)."""
    from flow_factory.plan.pipeline import build_module
    from flow_factory.plan.public_configs import PUBLIC_PIPELINES

    def params(hub_id: str) -> int:
        library, class_name, config = PUBLIC_PIPELINES[hub_id]["transformer"]
        return sum(p.numel() for p in build_module(library, class_name, config, torch.bfloat16).parameters())

    t2v, patch = params("Wan-AI/Wan2.1-T2V-14B-Diffusers"), 20 * 2 * 2 * 5120
    embedder = 2 * 1280 + (1280 * 1280 + 1280) + (1280 * 5120 + 5120) + 2 * 5120
    added = 40 * (2 * (5120 * 5120 + 5120) + 5120)
    assert params("Wan-AI/Wan2.2-I2V-A14B-Diffusers") == t2v + patch
    assert params("Wan-AI/Wan2.1-I2V-14B-480P-Diffusers") == t2v + patch + embedder + added
    assert PUBLIC_PIPELINES["Wan-AI/Wan2.2-I2V-A14B-Diffusers"]["boundary_ratio"] == 0.9


def test_an_eval_reward_that_is_a_training_rewards_model_is_counted_once(tmp_path, tiny_sd3_path):
    """The trainer shares a training reward's model with an eval reward that names it with the same options, its
    batch size aside (``RewardSet.from_configs``' ``built``): the plan counts its bytes once; in another dtype, it is
    a second model."""
    from helpers_runs import tiny_run_config

    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path)
    config["rewards"] = [{"name": "ps", "reward_model": "pickscore"}]
    calls = {"rollout": Measured(0, 0), "decode": Measured(0, 0), "training": Measured(0, 0)}

    def reward_bytes(eval_rewards):
        cfg = parse_config({**config, "eval_rewards": eval_rewards, "eval": {"eval_freq": 0}})
        return make_plan(cfg, device="cpu", num_processes=1, calls=dict(calls)).sizes.rewards
    alone = reward_bytes(None)
    assert alone > 1e9  # PickScore's CLIP ViT-H/14 in float32
    assert reward_bytes([{"name": "ps_eval", "reward_model": "pickscore", "weight": 2.0, "batch_size": 32}]) == alone
    assert reward_bytes([{"name": "ps_eval", "reward_model": "pickscore", "dtype": "bf16"}]) == alone * 3 // 2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_the_planned_components_have_the_dtypes_from_pretrained_loads(tiny_pipeline, dtype):
    """Wan's transformer keeps its norms, time embedder and rope in float32 at any dtype (diffusers), UMT5 its ``wo``
    at fp16 only (transformers): the planner's meta components, built from the configs, hold each weight in the
    dtype the real ``from_pretrained`` loads it in, so their bytes are the loaded ones."""
    import diffusers
    import transformers
    from flow_factory.plan.pipeline import build_module

    folder = tiny_pipeline("wan2_t2v")
    for library, class_name, part in (("diffusers", "WanTransformer3DModel", "transformer"),
                                      ("transformers", "UMT5EncoderModel", "text_encoder")):
        module = {"diffusers": diffusers, "transformers": transformers}[library]
        loaded = getattr(module, class_name).from_pretrained(folder / part, torch_dtype=dtype)
        config = json.loads((folder / part / "config.json").read_text())
        planned = build_module(library, class_name, config, dtype)
        want = {n: t.dtype for n, t in loaded.state_dict().items()}
        assert {n: t.dtype for n, t in planned.state_dict().items()} == want
        assert torch.float32 in want.values() or (library, dtype) == ("transformers", torch.bfloat16)
