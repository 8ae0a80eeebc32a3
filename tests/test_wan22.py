"""Wan2.2 through model_type wan2_t2v: the A14B two-expert layout (transformer for high noise,
transformer_2 for low noise, boundary_ratio, guidance_scale_2) and TI2V-5B (a timestep per
token, the 48-channel x16 VAE) reproduce WanPipeline; each step uses the expert the pipeline
uses, also when one batch straddles the boundary; and training touches only the experts
``model.target_components`` names, saved where the pipeline's own loading finds them."""

import json

import pytest
import torch
from helpers_algorithms import batch_at_step
from helpers_runs import tiny_run_config, write_config
from safetensors.torch import load_file

from flow_factory.algorithms import make_algorithm
from flow_factory.checkpoint import CheckpointError, load_for_sampling
from flow_factory.config import ConfigError, parse_config
from flow_factory.config.train import TrainConfig
from flow_factory.dynamics import make_dynamics
from flow_factory.dynamics.ode import ODE
from flow_factory.models import index_cond, load_adapter
from flow_factory.models.lora import apply_lora, lora_weight_name, save_lora
from flow_factory.models.preflight import check_before_loading, check_experts
from flow_factory.trajectory import sample_trajectory
from flow_factory.train import main
from flow_factory.trainer import Trainer
from flow_factory.trainer.policy import AdapterPolicy

PROMPTS = ["a red cube on a table", "two cats"]
NEGATIVES = ["blurry", ""]
SIZE, FRAMES = 32, 5
STEPS = 4  # shift 5: sigmas 1, 0.91, 0.72, 0.02; at boundary_ratio 0.875 each expert takes two steps
BOUNDARY_T = 0.875 * 1000  # boundary_ratio x num_train_timesteps, as the tiny A14B saves it
# layout: (fixture, guidance_scale, guidance_scale_2); the last: CFG off (guidance_scale 1), as the
# pipeline decides it for both experts from guidance_scale alone
LAYOUTS = {"a14b": ("tiny_wan22_path", 5.0, 2.0), "ti2v": ("tiny_wan22_ti2v_path", 5.0, None),
           "a14b-no-cfg": ("tiny_wan22_path", 1.0, 3.0)}


def _adapter(request, layout):
    fixture, guidance, guidance_2 = LAYOUTS[layout]
    adapter = load_adapter("wan2_t2v", request.getfixturevalue(fixture))
    adapter.guidance_scale_2 = guidance_2
    return adapter, guidance


def _pipeline(adapter, noise, guidance, output_type="latent"):
    kwargs = {"guidance_scale_2": adapter.guidance_scale_2} if adapter.guidance_scale_2 is not None else {}
    return adapter.pipeline(prompt=PROMPTS, negative_prompt=NEGATIVES, latents=noise.clone(), height=SIZE,
                            width=SIZE, num_frames=FRAMES, num_inference_steps=STEPS, guidance_scale=guidance,
                            output_type=output_type, **kwargs).frames.float()


def _record_experts(adapter):
    """Forward hooks: (component, its distinct timesteps) of every transformer call, in order."""
    calls, handles = [], []
    for name, module in adapter.transformers.items():
        def hook(module, args, kwargs, output, name=name):
            calls.append((name, tuple(sorted(set(kwargs["timestep"].flatten().tolist())))))
        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    return calls, handles


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ode_rollout_reproduces_the_pipeline_and_uses_its_experts(request, layout):
    adapter, guidance = _adapter(request, layout)
    noise = adapter.initial_noise(2, SIZE, SIZE, torch.Generator().manual_seed(0), num_frames=FRAMES)
    cond = adapter.encode(PROMPTS, NEGATIVES, guidance)
    sigmas = adapter.sigmas(STEPS, SIZE, SIZE, FRAMES)
    calls, handles = _record_experts(adapter)
    traj = sample_trajectory(adapter, ODE(), cond, noise, sigmas, guidance)
    ours, calls[:] = list(calls), []
    expected = _pipeline(adapter, noise, guidance)
    theirs = list(dict.fromkeys(calls))  # the pipeline calls once per CFG branch, the adapter once per step
    for handle in handles:
        handle.remove()

    assert traj.final.abs().max() > 0.1 and expected.shape == traj.final.shape
    torch.testing.assert_close(traj.final, expected, rtol=0, atol=1e-5)
    if layout == "ti2v":  # the Wan2.2 VAE (A14B decodes with Wan2.1's, which test_adapters.py covers)
        torch.testing.assert_close(adapter.decode(traj.final), _pipeline(adapter, noise, guidance, "pt"),
                                   rtol=0, atol=1e-4)
    # each step's expert: the pipeline's, and the one the boundary says (t >= boundary: transformer)
    assert ours == theirs and len(ours) == STEPS
    two_experts = layout.startswith("a14b")
    assert [name for name, _ in ours] == [
        "transformer" if not two_experts or t[0] >= BOUNDARY_T else "transformer_2" for _, t in ours]
    assert {name for name, _ in ours} == ({"transformer", "transformer_2"} if two_experts else {"transformer"})


def test_guidance_scale_2_guides_the_low_noise_expert_only(request):
    adapter, _ = _adapter(request, "a14b")
    cond = adapter.encode(PROMPTS[:1], NEGATIVES[:1], 4.0)
    text, uncond = {"prompt_embeds": cond["prompt_embeds"]}, {"prompt_embeds": cond["negative_prompt_embeds"]}
    x = adapter.initial_noise(1, SIZE, SIZE, torch.Generator().manual_seed(3), num_frames=FRAMES)
    with torch.no_grad():
        for sigma, used in ((0.95, 4.0), (0.5, 1.5)):  # high noise: guidance_scale; low: guidance_scale_2
            adapter.guidance_scale_2 = 1.5
            v = adapter.velocity(x, torch.tensor(sigma), cond, 4.0)
            v_text, v_uncond = (adapter.velocity(x, torch.tensor(sigma), c, 1.0) for c in (text, uncond))
            torch.testing.assert_close(v, v_uncond + used * (v_text - v_uncond), rtol=0, atol=1e-5)
            adapter.guidance_scale_2 = None  # = guidance_scale, as the pipeline
            changed = not torch.allclose(v, adapter.velocity(x, torch.tensor(sigma), cond, 4.0), atol=1e-6)
            assert changed == (sigma < 0.875)


def test_a_batch_straddling_the_boundary_is_split_between_the_experts(request):
    adapter, guidance = _adapter(request, "a14b")
    for transformer in adapter.transformers.values():
        apply_lora(transformer, 4, 4, "default", adapter.default_lora_targets)
    cond = adapter.encode(PROMPTS * 2, NEGATIVES * 2, guidance)
    x = adapter.initial_noise(4, SIZE, SIZE, torch.Generator().manual_seed(2), num_frames=FRAMES)
    # 0.875 itself is t = 875.0 exactly in float32: the high-noise expert's (t >= boundary)
    sigma = torch.tensor([0.95, 0.5, 0.875, float(torch.tensor(0.875).nextafter(torch.tensor(0.0)))])
    calls, handles = _record_experts(adapter)
    v = adapter.velocity(x, sigma, cond, guidance)
    for handle in handles:
        handle.remove()
    assert calls == [("transformer", (875.0, 950.0)), ("transformer_2", (500.0, 874.9999389648438))]
    with torch.no_grad():
        singles = [adapter.velocity(x[i:i + 1], sigma[i], index_cond(cond, [i]), guidance) for i in range(4)]
    torch.testing.assert_close(v.detach(), torch.cat(singles), rtol=0, atol=1e-5)
    # the gradient reaches each expert's LoRA through its own rows
    v.square().mean().backward()
    for transformer in adapter.transformers.values():
        assert any(p.grad is not None and p.grad.abs().max() > 0 for n, p in transformer.named_parameters()
                   if "lora_" in n)


@pytest.mark.parametrize("dynamics_name", ["Flow-SDE", "Dance-SDE", "CPS"])
@pytest.mark.parametrize("layout", ["a14b", "ti2v"])
def test_on_policy_ratio_is_one(request, layout, dynamics_name):
    adapter, guidance = _adapter(request, layout)
    g = torch.Generator().manual_seed(0)
    for transformer in adapter.transformers.values():  # both experts trained, each moved off its base
        apply_lora(transformer, 4, 4, "default", adapter.default_lora_targets)
        with torch.no_grad():
            for name, p in transformer.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    dynamics = make_dynamics(dynamics_name, 0.7)
    algorithm = make_algorithm("grpo", TrainConfig(kl_type="v-based"), dynamics)
    policy = AdapterPolicy(adapter, guidance, "lora", keep_reference=False, components=list(adapter.transformers))
    cond = adapter.encode(PROMPTS, None, guidance)
    noise = adapter.initial_noise(2, SIZE, SIZE, torch.Generator().manual_seed(1), num_frames=FRAMES)
    traj = sample_trajectory(adapter, dynamics, cond, noise, adapter.sigmas(STEPS, SIZE, SIZE, FRAMES), guidance,
                             generator=torch.Generator().manual_seed(2))
    for step in traj.sde_steps:  # steps of both experts on a14b
        batch = batch_at_step(traj.latents, traj.log_probs, torch.tensor([1.0, -1.0]), traj.sigmas, cond, step)
        _, metrics = algorithm.loss(policy, batch)
        assert abs(metrics["ratio_min"].item() - 1) < 1e-6 and abs(metrics["ratio_max"].item() - 1) < 1e-6, \
            (step, metrics)


def test_each_experts_lora_loads_with_the_pipelines_own_loading(request, tmp_path):
    adapter, guidance = _adapter(request, "a14b")
    x = adapter.initial_noise(2, SIZE, SIZE, torch.Generator().manual_seed(0), num_frames=FRAMES)
    cond = adapter.encode(PROMPTS, NEGATIVES, guidance)
    sigma = torch.tensor([0.95, 0.5])  # one sample per expert
    with torch.no_grad():
        base = adapter.velocity(x, sigma, cond, guidance)
    g = torch.Generator().manual_seed(1)
    for name, transformer in adapter.transformers.items():
        apply_lora(transformer, 4, 2.0, "default", adapter.default_lora_targets)
        with torch.no_grad():
            for n, p in transformer.named_parameters():
                if "lora_" in n:
                    p.copy_(0.2 * torch.randn(p.shape, generator=g))
        save_lora(adapter.pipeline_class, transformer, tmp_path, lora_weight_name(name))
    with torch.no_grad():
        tuned = adapter.velocity(x, sigma, cond, guidance)
    assert ((tuned - base).flatten(1).abs().amax(1) > 1e-3).all()  # each expert's LoRA changes its sample

    pipe = adapter.pipeline_class.from_pretrained(request.getfixturevalue("tiny_wan22_path"))
    pipe.load_lora_weights(tmp_path)  # plain diffusers: the transformer's file under its default name
    pipe.load_lora_weights(tmp_path, weight_name="pytorch_lora_weights_transformer_2.safetensors",
                           load_into_transformer_2=True)
    reloaded = type(adapter)(pipe)
    reloaded.guidance_scale_2 = adapter.guidance_scale_2
    with torch.no_grad():
        torch.testing.assert_close(reloaded.velocity(x, sigma, cond, guidance), tuned, rtol=0, atol=1e-6)


def test_ff_sample_takes_guidance_scale_2(request, tmp_path, capsys):
    """--guidance-scale-2 changes the video; a video is an mp4 of every frame at 16 fps (Wan's), or a GIF."""
    import numpy as np
    from PIL import Image

    from flow_factory.media import probe, read_frames
    from flow_factory.sample import main as ff_sample

    common = ["--model-type", "wan2_t2v", "--prompts", PROMPTS[0], "--resolution", str(SIZE), "--num-frames",
              str(FRAMES), "--steps", str(STEPS), "--guidance-scale", "4"]
    frames = []
    for scale in ("1", "8"):  # GIFs: their palette is a function of the pixels, where H.264 would add its noise
        out = tmp_path / scale
        assert ff_sample([str(request.getfixturevalue("tiny_wan22_path")), *common, "--guidance-scale-2", scale,
                          "--video-format", "gif", "--out", str(out)]) == 0
        assert Image.open(out / "0000.gif").n_frames == Image.open(out / "grid.gif").n_frames == FRAMES
        frames.append(np.asarray(Image.open(out / "0000.gif").convert("RGB")))
    assert not np.array_equal(*frames)
    assert ff_sample([str(request.getfixturevalue("tiny_wan22_path")), *common, "--out", str(tmp_path / "mp4")]) == 0
    for name in ("0000.mp4", "grid.mp4"):  # the default
        assert (probe(tmp_path / "mp4" / name).frames, probe(tmp_path / "mp4" / name).fps) == (FRAMES, 16)
    assert probe(tmp_path / "mp4" / "0000.mp4").size == (SIZE, SIZE)
    assert len(read_frames(tmp_path / "mp4" / "0000.mp4")) == FRAMES
    assert ff_sample([str(request.getfixturevalue("tiny_wan_path")), *common, "--guidance-scale-2", "2",
                      "--out", str(tmp_path / "x")]) == 2
    assert "--guidance-scale-2: " in capsys.readouterr().err


# --------------------------------------------------------------------------------- training

def _config(tmp_path, path, trainer_type, components, finetune_type="lora", max_epochs=2, **train):
    config = tiny_run_config(tmp_path, "wan2_t2v", path, trainer_type=trainer_type, max_epochs=max_epochs,
                             num_inference_steps=STEPS, **train)
    config["model"].update(target_components=components, finetune_type=finetune_type)
    config["log"]["logging_backend"] = "none"
    config["eval"]["eval_freq"] = 0
    if trainer_type == "grpo":
        # steps 1 (sigma 0.91: transformer) and 2 (0.72: transformer_2), both trained every epoch
        config["scheduler"].update(sde_steps=[1, 2], num_sde_steps=None)
    else:  # nft: per-sample training sigmas in (0, 1], in one batch often both experts'
        config["scheduler"] = {"dynamics_type": "ODE"}
        config["train"]["num_train_timesteps"] = 2
    return config


@pytest.mark.parametrize("trainer_type,components,finetune_type,extra", [
    ("grpo", ["transformer_2"], "lora", {"guidance_scale_2": 2.0, "eval": {"eval_freq": 2, "guidance_scale_2": 3.0}}),
    ("nft", ["transformer"], "lora", {}),
    ("nft", ["transformer", "transformer_2"], "full", {"kl_beta": 0.1, "learning_rate": 1e-4}),
    # Flow-Factory's Wan2.2 examples: transformer_2 is named but no module of it, so only transformer trains
    ("nft", ["transformer", "transformer_2"], "lora", {"model": {"target_modules": "transformer.default"}}),
])
def test_training_moves_only_the_experts_target_components_names(request, tmp_path, trainer_type, components,
                                                                finetune_type, extra):
    path = request.getfixturevalue("tiny_wan22_path")
    evaluation, model = extra.pop("eval", {}), extra.pop("model", {})
    config = _config(tmp_path, path, trainer_type, components, finetune_type, **extra)
    config["eval"].update(evaluation)
    config["model"].update(model)
    cfg = parse_config(config)
    components = cfg.model.trained_components
    trainer = Trainer(cfg)
    trainer.train()
    fresh = load_adapter("wan2_t2v", path)
    ckpt = tmp_path / "saves" / "run" / "checkpoints" / "epoch_2"
    assert json.loads((ckpt / "trainer_state.json").read_text())["target_components"] == components
    for name, module in trainer.adapter.transformers.items():
        base = fresh.transformers[name].state_dict()
        has_lora = any("lora_" in n for n, _ in module.named_parameters())
        state = {k.replace("base_layer.", ""): v for k, v in module.state_dict().items() if "lora_" not in k}
        identical = state.keys() == base.keys() and all(torch.equal(state[k], base[k]) for k in base)
        if name in components:
            assert has_lora == (finetune_type == "lora")
            if finetune_type == "full":  # kl_beta: a frozen copy of the starting weights of each trained expert
                reference = trainer.policy.reference[name].state_dict()
                assert all(torch.equal(reference[k], base[k]) for k in base)
            assert finetune_type == "lora" or not identical, f"{name}: full fine-tuning did not move it"
            saved = (ckpt / lora_weight_name(name)) if finetune_type == "lora" else (ckpt / name)
            assert saved.exists()
        else:  # no adapter, no gradient, bit for bit the base weights, nothing saved
            assert not has_lora and identical and all(p.grad is None for p in module.parameters())
            assert not (ckpt / lora_weight_name(name)).exists() and not (ckpt / name).exists()
    if finetune_type == "lora":
        trained = {k: v for name in components for k, v in load_file(ckpt / lora_weight_name(name)).items()}
        assert max(float(v.abs().max()) for k, v in trained.items() if "lora_B" in k) > 0, "the LoRA did not move"

    # the checkpoint applied the way a user applies it changes the pipeline's output
    def output(checkpoint):
        adapter = load_for_sampling("wan2_t2v", path, checkpoint, device="cpu")
        return adapter.pipeline("a red circle", height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=STEPS,
                                guidance_scale=3.0, output_type="latent",
                                generator=torch.Generator().manual_seed(0)).frames
    assert not torch.allclose(output(None), output(ckpt), atol=1e-6)


def test_a_ti2v_model_trains(request, tmp_path):
    path = request.getfixturevalue("tiny_wan22_ti2v_path")
    assert main([str(write_config(tmp_path, _config(tmp_path, path, "grpo", ["transformer"])))]) == 0
    lora = load_file(tmp_path / "saves" / "run" / "checkpoints" / "epoch_2" / "pytorch_lora_weights.safetensors")
    assert max(float(v.abs().max()) for k, v in lora.items() if "lora_B" in k) > 0


def test_resume_matches_an_uninterrupted_run(request, tmp_path):
    path = request.getfixturevalue("tiny_wan22_path")
    both = ["transformer", "transformer_2"]

    def run(folder, epochs, resume=None, name="run"):
        config = _config(folder, path, "grpo", both, guidance_scale_2=2.0, ema_decay=0.5, max_epochs=epochs)
        config["eval"]["eval_freq"] = 0
        config["log"]["run_name"] = name
        if resume:
            config["model"]["resume_path"] = str(resume)
        assert main([str(write_config(folder, config, f"{name}.yaml"))]) == 0
        return folder / "saves" / name / "checkpoints" / f"epoch_{epochs}"

    straight = run(tmp_path / "a", 2)
    first = run(tmp_path / "b", 1)
    resumed = run(tmp_path / "b", 2, resume=first, name="resumed")
    for file in [lora_weight_name(c) for c in both] + ["ema.pt"]:
        a, b = ((load_file(d / file) if file.endswith("safetensors") else torch.load(d / file)["weights"])
                for d in (straight, resumed))
        pairs = [(a[k], b[k]) for k in a] if isinstance(a, dict) else list(zip(a, b))
        assert pairs and len(a) == len(b)
        for x, y in pairs:
            torch.testing.assert_close(x, y, rtol=0, atol=1e-6)

    # a checkpoint of other experts does not resume this run
    config = _config(tmp_path / "c", path, "grpo", ["transformer_2"])
    config["model"]["resume_path"] = str(first)
    with pytest.raises(CheckpointError, match=r"trained \['transformer', 'transformer_2'\], but "
                                              r"model.target_components is \['transformer_2'\]"):
        Trainer(parse_config(config))


# --------------------------------------------------------------------------------- config errors

def test_experts_a_checkpoint_lacks_are_named_before_loading(request, tmp_path):
    wan21 = request.getfixturevalue("tiny_wan_path")
    config = _config(tmp_path, wan21, "grpo", ["transformer_2"], guidance_scale_2=2.0)
    with pytest.raises(ConfigError) as error:
        check_before_loading(parse_config(config))
    assert error.value.problems == [
        f"model.target_components: ['transformer_2']: not an expert of {wan21 / 'model_index.json'}, which has "
        "transformer",
        f"train.guidance_scale_2: {wan21 / 'model_index.json'} has one expert (transformer), so there is no "
        "low-noise expert to guide; remove the key"]
    # the loaded pipeline says the same, for a hub id (the Trainer checks it after loading)
    adapter = load_adapter("wan2_t2v", wan21)
    with pytest.raises(ConfigError, match="not an expert of org/name, which has transformer"):
        check_experts(adapter.experts(adapter.pipeline.config), parse_config(config), "org/name")
    # TI2V-5B: its x16 VAE makes the size factor 32
    ti2v = request.getfixturevalue("tiny_wan22_ti2v_path")
    with pytest.raises(ConfigError, match=r"train.resolution: .* multiples of 32 .*got 48"):
        check_before_loading(parse_config(_config(tmp_path, ti2v, "grpo", ["transformer"], resolution=48)))


def test_a_window_of_frozen_experts_steps_is_an_error(request, tmp_path, caplog):
    path = request.getfixturevalue("tiny_wan22_path")
    config = _config(tmp_path, path, "grpo", ["transformer_2"])
    config["scheduler"]["sde_steps"] = [0, 1]  # sigmas 1 and 0.91: the high-noise expert's
    with pytest.raises(ConfigError, match=r"scheduler.sde_steps: steps \[0, 1\] are denoised by \['transformer'\], "
                                          r"which the run does not train \(it trains \['transformer_2'\]: "
                                          r"model.target_components and target_modules\); "
                                          r"no step of the window trains anything"):
        Trainer(parse_config(config))
    config["scheduler"]["sde_steps"] = [1, 2]
    config["log"]["run_name"] = "partly"
    with caplog.at_level("WARNING"):
        Trainer(parse_config(config)).close()
    assert "steps [1] are denoised by ['transformer']" in caplog.text and "those steps train nothing" in caplog.text


@pytest.mark.parametrize("model, train, message", [
    ({"model_type": "sd3-5", "target_components": ["transformer_2"]}, {},
     "model.target_components: ['transformer_2']: not a network sd3-5 trains; valid: transformer only"),
    ({"model_type": "sd3-5"}, {"guidance_scale_2": 2.0},
     "train.guidance_scale_2: the CFG scale of a two-expert model's low-noise expert (Wan2.2 A14B); sd3-5 has "
     "one transformer; remove the key"),
    ({"model_type": "wan2_t2v", "target_components": ["transformer", "vae"]}, {"num_frames": 5},
     "model.target_components: ['vae']: not a network wan2_t2v trains; valid: transformer, transformer_2 (its "
     "experts), or a list of them"),
    ({"model_type": "wan2_t2v", "target_components": ["transformer_2"], "target_modules": ["transformer.to_q"]},
     {"num_frames": 5}, "model.target_modules: ['transformer.to_q'] name modules of components that are not trained"),
])
def test_config_errors_name_the_key(model, train, message):
    from test_config import minimal

    with pytest.raises(ConfigError) as error:
        parse_config(minimal(model={"model_name_or_path": "m", **model}, train=train))
    assert str(error.value).startswith(message)


def test_zero3_refuses_several_experts_before_loading_and_zero2_and_fsdp2_take_them(request, tmp_path):
    """ZeRO-3 gathers one network's partitions in the order it traced, and the experts are called apart: a
    ZeRO-3 launch stops on the folder's experts, before the pipeline loads, as Flow-Factory's Wan2.2 examples
    say. ZeRO-1/2 take the experts bundled into one engine, FSDP2 each expert sharded (the runs:
    test_two_processes_make_the_same_update_as_one)."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from flow_factory.trainer.backends import check_experts_before_loading

    def launch(kind, zero_stage=None):
        plugin = None if zero_stage is None else SimpleNamespace(zero_stage=zero_stage)
        return SimpleNamespace(distributed_type=kind, state=SimpleNamespace(deepspeed_plugin=plugin))

    config = _config(tmp_path, request.getfixturevalue("tiny_wan22_path"), "grpo", ["transformer", "transformer_2"])
    config["config_file"] = "zero3"
    cfg = parse_config(config)
    with pytest.raises(ConfigError, match=r"^config_file: zero3 runs DeepSpeed ZeRO-3, which partitions one network "
                                          r"and gathers it in the order it traced; wan2_t2v has 2 experts, called "
                                          r"apart: use zero2 \(the experts in one engine\), fsdp2 \(each expert "
                                          r"sharded\) or multi_gpu \(DDP\)"):
        check_experts_before_loading(cfg, launch(DistributedType.DEEPSPEED, 3))
    for stage in (1, 2):
        check_experts_before_loading(cfg, launch(DistributedType.DEEPSPEED, stage))
    check_experts_before_loading(cfg, launch(DistributedType.FSDP))
    # Wan2.1 (one expert) trains under ZeRO-3
    wan21 = parse_config({**_config(tmp_path, request.getfixturevalue("tiny_wan_path"), "nft", ["transformer"]),
                          "config_file": "zero3"})
    check_experts_before_loading(wan21, launch(DistributedType.DEEPSPEED, 3))


def test_flow_factorys_wan22_example_keys_load():
    """The model, train and eval keys of Flow-Factory's Wan2.2 examples (examples/*/wan22_t2v.yaml)."""
    from test_config import minimal

    data = minimal(model={"model_name_or_path": "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "model_type": "wan2_t2v",
                          "target_components": ["transformer", "transformer_2"], "target_modules": "default"},
                   train={"trainer_type": "nft", "guidance_scale": 4.0, "guidance_scale_2": 3.0, "num_frames": 1,
                          "resolution": [384, 720], "num_inference_steps": 12, "timestep_range": [0.4, 0.9]})
    data.update(scheduler={"dynamics_type": "ODE"}, eval={"guidance_scale": 4.0, "num_frames": 21})
    cfg = parse_config(data)
    assert cfg.model.target_components == ["transformer", "transformer_2"] and cfg.model.target_modules == "default"
    assert (cfg.train.guidance_scale_2, cfg.eval.guidance_scale_2) == (3.0, 3.0)  # eval's null: the training one
    one = parse_config(minimal(model={"model_name_or_path": "m", "model_type": "wan2_t2v",
                                      "target_components": "transformer"}, train={"num_frames": 5}))
    assert one.model.target_components == ["transformer"]


def test_per_component_target_modules(request):
    """Flow-Factory's 'transformer_2.<module>': LoRA on that module of that expert only."""
    from flow_factory.config.sections import component_targets

    cfg = parse_config(__import__("test_config").minimal(
        model={"model_name_or_path": "m", "model_type": "wan2_t2v", "target_components": ["transformer_2", "transformer"],
               "target_modules": ["transformer.attn1.to_q", "transformer_2.default", "ffn.net.2"]},
        train={"num_frames": 5}))
    model = cfg.model
    assert model.target_components == ["transformer", "transformer_2"]  # the pipeline's order
    adapter = load_adapter("wan2_t2v", request.getfixturevalue("tiny_wan22_path"))
    wrapped = {}
    for name in model.target_components:
        targets = component_targets(model.target_modules, name, model.target_components)
        apply_lora(adapter.transformers[name], 4, 4, targets, adapter.default_lora_targets)
        wrapped[name] = {n.split("blocks.0.")[-1] for n, m in adapter.transformers[name].named_modules()
                         if hasattr(m, "lora_A") and n.startswith("blocks.")}
    assert wrapped["transformer"] == {"attn1.to_q", "ffn.net.2"}
    assert {"attn1.to_k", "attn2.to_out.0", "ffn.net.2"} <= wrapped["transformer_2"]
    assert "attn1.to_k" not in wrapped["transformer"]


# --------------------------------------------------------------------------------- two processes

def test_two_processes_make_the_same_update_as_one(request, tmp_path):
    """DESIGN invariant 4 for a two-expert model, under DDP, FSDP2 and DeepSpeed ZeRO-2. DDP leaves the
    experts unwrapped (a micro-step may not call an expert on every process) and trainer/optimize.py
    averages their gradients; FSDP2 shards each expert as its own root, ZeRO-2 takes both in one engine
    (sharding.BundledExperts), and both run a trained expert on every process whenever one needs it (FSDP2's
    forward all-gathers and its backward reduce-scatters, ZeRO-2's backward reduces gradients in buckets
    every process fills alike: models/wan.py).

    GRPO (both experts trained at a step of each): 1 and 2 DDP processes end with the same LoRAs up to
    float32 rounding. NFT draws a training sigma per sample, so a micro-batch often holds both experts'
    rows on one process and one expert's on the other: FSDP2 and ZeRO-2 there make DDP's update and EMA
    (NFT's draws are seeded per process, so its 2-process runs compare with each other, not with one
    process); so does ZeRO-2 training the high-noise expert alone, where a micro-step on the frozen expert
    has no gradient on any process. The FSDP2 checkpoint holds each expert's LoRA whole, each process
    having held part of it; it loads with WanPipeline's own load_lora_weights; stopped after epoch 1 and
    resumed, the run ends at the uninterrupted run's LoRAs. Flow-Factory's ``target_modules: transformer.default``
    with both experts named trains the high-noise expert alone and shards the frozen one too under FSDP2: every
    parameter of it a DTensor, each process holding a part, its values as loaded after training, and the update
    DDP's with that expert whole."""
    import os
    import re
    from concurrent.futures import ThreadPoolExecutor

    from diffusers import WanPipeline
    from helpers_launch import ff_train_forked
    from helpers_runs import ff_train_in_this_process
    from test_train_cli import LINEAR_STEP, U, _difference_over_movement, _free_port

    path = request.getfixturevalue("tiny_wan22_path")
    both = ["transformer", "transformer_2"]
    epochs, samples, steps = 2, 8, 2
    # the longest float32 sum behind a LoRA gradient entry (test_train_cli's derivation): every sample at
    # every trained step, both CFG halves, every token of the text (512) and video (2 x 4 x 4 / 4) streams
    tolerance = 2 * (epochs * samples * steps * 2 * (512 + 8)) * U

    def checkpoint(folder, epoch=epochs):
        return folder / "saves" / "run" / "checkpoints" / f"epoch_{epoch}"

    def lora(folder, epoch=epochs):
        return {f"{c}/{k}": v for c in both if (checkpoint(folder, epoch) / lora_weight_name(c)).exists()
                for k, v in load_file(checkpoint(folder, epoch) / lora_weight_name(c)).items()}

    def train(folder, trainer_type, processes, config_file=None, resume=None, components=both, target_modules=None):
        config = _config(folder, path, trainer_type, components, max_epochs=epochs, group_size=4, ema_decay=0.5,
                         **LINEAR_STEP)
        if target_modules:
            config["model"]["target_modules"] = target_modules
        config["rewards"] = [{"name": "brightness", "reward_model": "helpers_rewards.MeanVideoBrightness"}]
        if config_file:
            config["config_file"] = config_file
        if resume:
            config["model"]["resume_path"] = str(resume)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        argv = [str(write_config(folder, config)), "--num_processes", str(processes),
                "--main_process_port", str(_free_port())]
        if processes == 1:  # the reference, in this process (from its main thread: the run sets signal handlers)
            (_, stderr), code = ff_train_in_this_process(argv)
        else:  # forked from the suite's preloaded server (helpers_launch): the launch without its imports
            (_, stderr), code = ff_train_forked(argv, env, timeout=400)
        assert code == 0, f"{folder.name}: exit {code}\n{stderr[-4000:]}"
        return json.loads((checkpoint(folder) / "trainer_state.json").read_text())["sharding"]

    def assert_same_update(reference, other, components=both):
        for expert in components:
            part = lambda weights: {k: v for k, v in weights.items() if k.startswith(f"{expert}/")}  # noqa: E731
            relative, moved = _difference_over_movement(part(lora(reference)), part(lora(other)))
            assert moved > 1e-4, f"{other.name}, {expert}: training did not move its LoRA"
            assert relative <= tolerance, (f"{reference.name} and {other.name}, {expert}: differ by {relative:.2e} "
                                           "of the movement")
        return moved

    runs = {"p1": ("grpo", 1, None), "ddp": ("grpo", 2, None), "nft_ddp": ("nft", 2, None),
            "nft_fsdp": ("nft", 2, "fsdp2"), "nft_zero2": ("nft", 2, "zero2"),
            # the high-noise expert trained alone: micro-steps on the frozen one have no gradient anywhere
            "nft_ddp_one": ("nft", 2, None, None, ["transformer"]),
            "nft_zero2_one": ("nft", 2, "zero2", None, ["transformer"]),
            # Flow-Factory's trick: transformer_2 named, none of its modules: it trains nothing, sharded frozen
            "nft_fsdp_frozen": ("nft", 2, "fsdp2", None, both, "transformer.default")}
    with ThreadPoolExecutor(2) as pool:  # two launches side by side, the one-process reference here meanwhile
        started = {name: pool.submit(train, tmp_path / name, *run) for name, run in runs.items() if run[1] > 1}
        held = {name: train(tmp_path / name, *run) for name, run in runs.items() if run[1] == 1}
        held.update({name: run.result() for name, run in started.items()})
        fsdp, zero2 = tmp_path / "nft_fsdp", tmp_path / "nft_zero2"
        resumed = pool.submit(train, tmp_path / "resumed", "nft", 2, "fsdp2", checkpoint(fsdp, 1))
        assert_same_update(tmp_path / "p1", tmp_path / "ddp")
        # DeepSpeed steps inside the backward: a step's last micro-step without a gradient must still step
        assert_same_update(tmp_path / "nft_ddp_one", tmp_path / "nft_zero2_one", ["transformer"])
        # a frozen expert sharded beside the trained one: the update of a run holding it whole on each process
        # (its rollouts of epoch 2 went through the sharded expert, so its output shaped that epoch's update)
        assert_same_update(tmp_path / "nft_ddp_one", tmp_path / "nft_fsdp_frozen", ["transformer"])
        assert not (checkpoint(tmp_path / "nft_fsdp_frozen") / lora_weight_name("transformer_2")).exists()
        for sharded in (fsdp, zero2):
            moved = assert_same_update(tmp_path / "nft_ddp", sharded)
            # the EMA of both experts' shards, gathered, is the EMA of DDP's whole weights
            ema_ddp, ema = (torch.load(checkpoint(f) / "ema.pt")["weights"] for f in (tmp_path / "nft_ddp", sharded))
            assert [w.shape for w in ema_ddp] == [w.shape for w in ema]
            assert max(float((a - b).abs().max()) for a, b in zip(ema_ddp, ema)) <= tolerance * moved
            # the case the lockstep is for happened: a process ran an expert its own batch did not need
            history = json.loads((sharded / "saves" / "run" / "history.json").read_text())["train"]
            assert sum(epoch["sharding/idle_expert_passes"] for epoch in history) > 0

        # FSDP2 really sharded each expert: each process held part of its LoRA, the two together all of it;
        # ZeRO-2 keeps whole weights (it partitions the optimizer's state and the gradients)
        assert [held[n]["backend"] for n in ("nft_ddp", "nft_fsdp", "nft_zero2")] == ["ddp", "fsdp", "deepspeed"]
        for expert in both:
            total = sum(v.numel() for k, v in lora(fsdp).items() if k.startswith(f"{expert}/"))
            assert held["nft_ddp"]["by_component"][expert] == held["nft_zero2"]["by_component"][expert] == [total] * 2
            shares = held["nft_fsdp"]["by_component"][expert]
            assert sum(shares) == total and all(0 < n < total for n in shares), (expert, shares)
        assert (checkpoint(zero2) / "deepspeed").is_dir()

        # the frozen expert was sharded (each process held a part of it, every parameter a DTensor) and, after two
        # epochs, its values summed over the shards still sum to the loaded ones'
        pipe = WanPipeline.from_pretrained(path)
        frozen = held["nft_fsdp_frozen"]["frozen_sharded"]["transformer_2"]
        total = sum(p.numel() for p in pipe.transformer_2.parameters())
        assert frozen["all_dtensors"] and sum(frozen["values_per_process"]) == total
        assert all(0 < n < total for n in frozen["values_per_process"]), frozen
        loaded_sum = sum(float(p.detach().double().sum()) for p in pipe.transformer_2.parameters())
        assert frozen["sum"] == pytest.approx(loaded_sum, rel=1e-12, abs=1e-9)
        assert "frozen_sharded" not in held["nft_fsdp"] and "frozen_sharded" not in held["nft_ddp_one"]
        # WanPipeline's own loading takes both experts' LoRAs, every tensor as saved
        pipe.load_lora_weights(checkpoint(fsdp), weight_name=lora_weight_name("transformer"), adapter_name="high")
        pipe.load_lora_weights(checkpoint(fsdp), weight_name=lora_weight_name("transformer_2"), adapter_name="low",
                               load_into_transformer_2=True)
        loaded = {f"{c}/transformer." + re.sub(r"\.(high|low)\.", ".", n): p.detach() for c in both
                  for n, p in getattr(pipe, c).named_parameters() if "lora_" in n}
        assert loaded.keys() == lora(fsdp).keys()
        assert all(torch.equal(loaded[k], v) for k, v in lora(fsdp).items())

        resumed.result()
        for key, value in lora(fsdp).items():
            assert torch.allclose(lora(tmp_path / "resumed")[key], value, rtol=0, atol=1e-6), key
