"""LTX-2 image to video with audio (model_type ltx2_i2av): a row's condition image is the video's first frame, as
``LTX2ImageToVideoPipeline(image=...)`` makes it.

The first latent frame is the image's (re-compressed at the pipeline's CRF, resized to the video's size,
VAE-encoded) and never stepped: the ODE rollout equals the pipeline's video and audio latents for the same
generator's noise (invariant 2), the on-policy ratio is exactly 1 under every SDE, whose noise reaches the
generated frames alone (invariant 1), ``ff-train`` trains from a jsonl dataset of condition images and its LoRA
loads with the pipeline's ``load_lora_weights``, and a row without its image is named before the model loads.
"""

import json

import numpy as np
import pytest
import torch
from helpers_algorithms import assert_on_policy, grpo_on_perturbed_lora
from helpers_runs import CONDITION_IMAGES, ff_train_in_this_process, tiny_run_config, write_config
from PIL import Image

from flow_factory.algorithms import make_algorithm
from flow_factory.config.train import TrainConfig
from flow_factory.dynamics import make_dynamics
from flow_factory.dynamics.ode import ODE
from flow_factory.models import load_adapter
from flow_factory.sampling import Rollouts
from flow_factory.trajectory import sample_trajectory
from flow_factory.trainer.policy import AdapterPolicy

SIZE, FRAMES, STEPS, GUIDANCE = 32, 9, 3, 4.0
PROMPTS = ["a dog barking on a beach", "rain on a tin roof"]


def _image(seed, size=(83, 50)):
    """A random RGB image of (width, height) ``size``: not the video's, so it is cropped for H.264 and resized."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture
def adapter(tiny_ltx2_i2av_path):
    return load_adapter("ltx2_i2av", tiny_ltx2_i2av_path)


def _conditioning(adapter, prompts, images, guidance):
    media = adapter.prepare_conditions([[im] for im in images], None, SIZE, SIZE, FRAMES, None)
    return {**adapter.encode(prompts, None, guidance), **adapter.encode_conditions(media, SIZE, SIZE, FRAMES)}


def _pipeline_noise(adapter, seed):
    """What the pipeline draws from ``Generator().manual_seed(seed)`` for one video: the video's latents
    (1, C, F, H, W), then the audio's (1, C, L, M), in the adapter's flat layout."""
    pipe, (n,) = adapter.pipeline, adapter.latent_shape(SIZE, SIZE, FRAMES)
    g = adapter.geometry(torch.zeros(1, n))
    generator = torch.Generator().manual_seed(seed)
    video = torch.randn((1, adapter.transformer.config.in_channels, g.frames, g.height, g.width), generator=generator)
    mel_bins = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
    audio = torch.randn((1, pipe.audio_vae.config.latent_channels, g.audio_frames, mel_bins), generator=generator)
    return torch.cat([pipe._pack_latents(video).flatten(1), pipe._pack_audio_latents(audio).flatten(1)], 1)


def _pipeline_latents(pipe, prompt, image, seed):
    """The pipeline's own rollout for one prompt and image (it takes one image for its batch), its noise from the
    seed, with the adapter's guidance (CFG alone, one scale for video and audio); latents in the adapter's layout."""
    out = pipe(image=image, prompt=prompt, height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=STEPS,
               guidance_scale=GUIDANCE, generator=torch.Generator().manual_seed(seed), output_type="latent",
               stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0, audio_guidance_scale=None,
               audio_stg_scale=None, audio_modality_scale=None, audio_guidance_rescale=None)
    vae, stats = pipe.vae, (pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std)
    video = pipe._pack_latents(pipe._normalize_latents(out.frames, vae.latents_mean, vae.latents_std,
                                                       vae.config.scaling_factor))
    audio = pipe._normalize_audio_latents(pipe._pack_audio_latents(out.audio), *stats)
    return torch.cat([video.flatten(1), audio.flatten(1)], 1)


def test_ode_rollout_reproduces_the_pipeline_with_a_condition_image(adapter):
    """Two samples, each its own image and seed, in one rollout; the pipeline one call a sample (one image a batch),
    at its default image_crf. Video and audio latents to 1e-5, as LTX-2's text-to-audio-video check."""
    assert adapter.image_crf == 33  # LTX-2's Gemma 3 text encoder: the pipeline's default
    images = [_image(0), _image(1)]
    cond = _conditioning(adapter, PROMPTS, images, GUIDANCE)
    noise = torch.cat([_pipeline_noise(adapter, seed) for seed in (10, 11)])
    start = adapter.start_latents(noise, None, cond)
    sigmas = adapter.sigmas(STEPS, SIZE, SIZE, FRAMES)
    traj = sample_trajectory(adapter, ODE(), cond, start, sigmas, GUIDANCE)
    expected = torch.cat([_pipeline_latents(adapter.pipeline, prompt, image, seed)
                          for prompt, image, seed in zip(PROMPTS, images, (10, 11))])
    assert traj.final.abs().max() > 0.1
    torch.testing.assert_close(traj.final, expected.float(), rtol=0, atol=1e-5)

    # the first frame is the image's at every step, the rest was noise; the image changes what is generated
    given = adapter.given(adapter.geometry(noise))
    assert 0 < given.sum() < adapter.geometry(noise).video_numel
    assert all(torch.equal(traj.latents[:, k, given], start[:, given]) for k in range(STEPS + 1))
    assert torch.equal(start[:, ~given], noise[:, ~given])
    other = _conditioning(adapter, PROMPTS, [_image(2), _image(3)], GUIDANCE)
    moved = sample_trajectory(adapter, ODE(), other, adapter.start_latents(noise, None, other), sigmas, GUIDANCE)
    assert (moved.final - traj.final)[:, ~given].abs().max() > 1e-3


@pytest.mark.parametrize("dynamics_name", ["Flow-SDE", "Dance-SDE", "CPS"])
def test_on_policy_ratio_is_one_and_the_noise_misses_the_first_frame(adapter, dynamics_name):
    dynamics = adapter.sampling_dynamics(make_dynamics(dynamics_name, 0.7))
    algorithm, policy = grpo_on_perturbed_lora(adapter, dynamics, GUIDANCE)
    cond = _conditioning(adapter, PROMPTS, [_image(4), _image(5)], GUIDANCE)
    noise = adapter.initial_noise(2, SIZE, SIZE, torch.Generator().manual_seed(1), num_frames=FRAMES)
    start = adapter.start_latents(noise, None, cond)
    traj = sample_trajectory(adapter, dynamics, cond, start, adapter.sigmas(STEPS, SIZE, SIZE, FRAMES), GUIDANCE,
                             generator=torch.Generator().manual_seed(2))
    assert_on_policy(algorithm, policy, traj, cond)
    g = adapter.geometry(noise)
    given = adapter.given(g)
    assert torch.equal(traj.latents[:, -1, given], start[:, given])
    # the SDE's noise reaches the generated frames alone: neither the given frame nor the audio
    assert dynamics.stochastic_part(noise).shape == (2, g.video_numel - int(given.sum()))


def test_the_transformer_always_sees_the_image_in_the_first_frame(adapter):
    """The decoupled algorithms noise a rollout's whole final latent: the velocity of that state is the velocity of
    the state with the image in its first frame, 0 on that frame."""
    cond = _conditioning(adapter, PROMPTS, [_image(6), _image(7)], GUIDANCE)
    noise = adapter.initial_noise(2, SIZE, SIZE, torch.Generator().manual_seed(3), num_frames=FRAMES)
    start = adapter.start_latents(noise, None, cond)
    given = adapter.given(adapter.geometry(noise))
    assert (start - noise)[:, given].abs().max() > 0.1
    with torch.no_grad():
        v = adapter.velocity(noise, torch.tensor(0.6), cond, GUIDANCE)
        assert torch.equal(v, adapter.velocity(start, torch.tensor(0.6), cond, GUIDANCE))
    assert torch.equal(v[:, given], torch.zeros_like(v[:, given])) and v[:, ~given].abs().max() > 0.1


def test_the_decoupled_losses_average_over_the_generated_elements_only(adapter):
    """The given first frame is the condition, not a prediction: its velocity is 0 against a target ``eps - x0``, an
    error no weight changes. The rollouts name the generated elements (the other frames and the audio) and the
    flow-matching loss is their mean alone, not diluted by the frame's share of the latent."""
    cond = _conditioning(adapter, PROMPTS, [_image(8), _image(9)], GUIDANCE)
    noise = adapter.initial_noise(2, SIZE, SIZE, torch.Generator().manual_seed(4), num_frames=FRAMES)
    x0 = adapter.start_latents(noise, None, cond)
    generated = adapter.generated(x0)
    assert torch.equal(generated, ~adapter.given(adapter.geometry(x0)))
    sigmas = adapter.sigmas(STEPS, SIZE, SIZE, FRAMES)
    rollouts = Rollouts(prompts=PROMPTS, group_ids=torch.arange(2), latents=x0.unsqueeze(1),
                        log_probs=torch.zeros(2, STEPS), sigmas=sigmas, sde_steps=[], cond=cond, media=torch.empty(0),
                        latent_steps=[STEPS], generated=generated)
    algorithm = make_algorithm("sft", TrainConfig(trainer_type="sft", num_train_timesteps=1), ODE())
    batch = next(algorithm.micro_batches(rollouts, torch.zeros(2), torch.arange(2)[:, None],
                                         torch.Generator().manual_seed(5)))
    policy = AdapterPolicy(adapter, 1.0, "lora", keep_reference=False)
    with torch.no_grad():
        loss, _ = algorithm.loss(policy, batch)
        error = (policy.velocity(batch.x_t, batch.sigma, batch.cond) - batch.target).float() ** 2
    torch.testing.assert_close(loss, error[:, generated].mean(), rtol=1e-6, atol=0)
    assert error[:, ~generated].min() > 0 and (loss - error.mean()).abs() > 0.01 * loss


# --------------------------------------------------------------------------------- ff-train


@pytest.mark.parametrize("trainer_type", ["grpo", "nft"])
def test_ff_train_runs_from_a_dataset_of_condition_images(tmp_path, tiny_ltx2_i2av_path, trainer_type,
                                                          gpu_precision):
    """In a GPU's precision (bf16 autocast, fp16 trajectories): grpo (and nft) for 2 epochs from a jsonl of
    condition images (83x50, so re-compressed, cropped and resized); the saved LoRA loads with the pipeline's
    load_lora_weights and changes its image-to-video output."""
    from diffusers import LTX2ImageToVideoPipeline

    config = tiny_run_config(tmp_path, "ltx2_i2av", tiny_ltx2_i2av_path, trainer_type=trainer_type, max_epochs=2)
    if trainer_type == "nft":
        config["train"]["num_train_timesteps"] = 1
        config["scheduler"] = {"dynamics_type": "ODE", "noise_level": 0.0}
    (_out, err), code = ff_train_in_this_process([write_config(tmp_path, config)])
    assert code == 0, err
    run_dir = tmp_path / "saves" / "run"
    history = json.loads((run_dir / "history.json").read_text())
    assert [r["epoch"] for r in history["train"]] == [0, 1] and "reward/jpeg/mean" in history["train"][-1]
    assert list((tmp_path / "prompt_cache").glob("conditions-*"))

    image = Image.open(tmp_path / "data" / "images" / next(iter(CONDITION_IMAGES))).convert("RGB")
    latents = []
    for lora in (None, run_dir / "checkpoints" / "epoch_2"):
        pipe = LTX2ImageToVideoPipeline.from_pretrained(tiny_ltx2_i2av_path)
        if lora is not None:
            pipe.load_lora_weights(lora)
        latents.append(_pipeline_latents(pipe, "make it a red circle", image, 0))
    assert not torch.allclose(*latents, atol=1e-6), "the trained LoRA does not change the pipeline's output"


@pytest.mark.parametrize("fault", ["no image", "missing file"])
def test_a_row_without_its_image_is_named_before_the_model_loads(tmp_path, tiny_ltx2_i2av_path, monkeypatch, fault):
    from flow_factory.models.ltx2_i2av import LTX2I2AVAdapter

    def refuse(cls, *args, **kwargs):
        pytest.fail("a pipeline started loading: the error came too late")

    monkeypatch.setattr(LTX2I2AVAdapter, "from_pretrained", classmethod(refuse))
    config = tiny_run_config(tmp_path, "ltx2_i2av", tiny_ltx2_i2av_path)
    train = tmp_path / "data" / "train.jsonl"
    if fault == "no image":
        rows = [json.loads(line) for line in train.read_text().splitlines()]
        del rows[1]["image"]
        train.write_text("".join(json.dumps(r) + "\n" for r in rows))
        expected = f"{train}:2: ltx2_i2av takes 1 condition images per prompt ('image' / 'images'), the row names 0"
    else:
        (tmp_path / "data" / "images" / "green.png").unlink()
        expected = f"{train}:2: image 'green.png' ({tmp_path / 'data' / 'images' / 'green.png'}) not found"
    (_out, err), code = ff_train_in_this_process([write_config(tmp_path, config)])
    assert code == 2
    assert expected in err
