"""Qwen-Image-2.1 (model_type qwen-image-2.1) against its diffusers pipeline, beyond the shared tables
(test_adapters.py, test_on_policy.py, test_lora.py, helpers_runs.py): its prompt encoding, its sigmas with and
without a configured grid, its KV cache, why velocity calls the transformer once per text length, its sizes; and
with condition images (the pipeline's ``image``): the rollout is the pipeline's, the resize its resize, the
on-policy ratio 1, a saved LoRA the pipeline's, ff-train from rows with and without images."""

import json

import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions
from helpers_algorithms import assert_on_policy, grpo_on_perturbed_lora, perturb_lora
from helpers_runs import ff_train_in_this_process, tiny_run_config, write_config, write_mixed_condition_dataset
from PIL import Image

from flow_factory.config import ConfigError, parse_config
from flow_factory.data import load_prompts, read_image
from flow_factory.dynamics import make_dynamics
from flow_factory.dynamics.ode import ODE
from flow_factory.models import apply_lora, cat_cond, index_cond, load_adapter, save_lora
from flow_factory.trajectory import sample_trajectory

PROMPTS = ["a red cube on a table", "two cats"]  # of different token lengths


@pytest.fixture
def adapter(tiny_qwen_image21_path):
    return load_adapter("qwen-image-2.1", tiny_qwen_image21_path)


def _pipeline_latents(adapter, prompts, noise, steps=2, **kwargs):
    """The pipeline's own latents for these prompts (one batch) from this noise, in the adapter's layout."""
    pipe = adapter.pipeline
    pack, unpack = type(pipe)._pack_latents, type(pipe)._unpack_latents
    out = pipe(prompt=list(prompts), latents=pack(noise.clone(), len(noise), *noise.shape[1:]),
               num_inference_steps=steps, height=64, width=64, output_type="latent", **kwargs).images
    return unpack(out, 64, 64, pipe.vae_scale_factor).squeeze(2)


def test_prompt_encoding_is_the_pipelines_encode_prompt_padded(adapter):
    """Each prompt's embedding is what encode_prompt gives it, padded with zeros to max_sequence_length and masked;
    "" is encoded as the pipeline encodes it (as " ")."""
    cond = adapter.encode(PROMPTS, None, 4.0)
    for i, prompt in enumerate(PROMPTS):
        for key, text in (("prompt_embeds", prompt), ("negative_prompt_embeds", "")):
            expected, mask, image_slots = adapter.pipeline.encode_prompt(text)
            n = expected.shape[1]
            assert mask is None and not image_slots.any()  # one prompt: no padding, no image
            assert cond[key].shape[1] == adapter.max_sequence_length
            assert int(cond[key.replace("embeds", "embeds_mask")][i].sum()) == n
            torch.testing.assert_close(cond[key][i, :n], expected[0], rtol=0, atol=1e-6)
            assert cond[key][i, n:].abs().max() == 0


@pytest.mark.parametrize("size", [64, 128])
def test_sigmas_are_the_pipelines_with_and_without_a_configured_grid(adapter, size):
    """Unconfigured: linspace(1, 1/n, n) shifted by the token count, as the pipeline sets them; with the checkpoint's
    sample_sigmas, those for their number of steps (the pipeline's __call__ then ignores num_inference_steps)."""
    pipe = adapter.pipeline
    pipe(prompt="a cat", height=size, width=size, num_inference_steps=3, output_type="latent")
    torch.testing.assert_close(adapter.sigmas(3, size, size), pipe.scheduler.sigmas.float(), rtol=0, atol=0)
    plain = adapter.sigmas(4, size, size)
    pipe.register_to_config(sample_sigmas=[1.0, 0.7, 0.2, 0.1])
    pipe(prompt="a cat", height=size, width=size, num_inference_steps=9, output_type="latent")
    configured = adapter.sigmas(4, size, size)
    torch.testing.assert_close(configured, pipe.scheduler.sigmas.float(), rtol=0, atol=0)
    assert not torch.allclose(configured, plain)
    # another number of steps: the unconfigured grid, which the pipeline then takes as its sigmas argument
    pipe(prompt="a cat", height=size, width=size, sigmas=[1.0, 2 / 3, 1 / 3], output_type="latent")
    torch.testing.assert_close(adapter.sigmas(3, size, size), pipe.scheduler.sigmas.float(), rtol=0, atol=0)


def test_the_pipelines_kv_cache_gives_the_adapters_rollout(adapter):
    """The pipeline caches the text's keys and values after the first step (the default); the adapter recomputes
    them at every step: the same latents."""
    noise = adapter.initial_noise(1, 64, 64, torch.Generator().manual_seed(5))
    cached = _pipeline_latents(adapter, PROMPTS[:1], noise, steps=3)
    recomputed = _pipeline_latents(adapter, PROMPTS[:1], noise, steps=3, use_kv_cache=False)
    assert cached.abs().max() > 0.1
    torch.testing.assert_close(cached, recomputed, rtol=0, atol=1e-5)


def test_padding_moves_the_image_so_velocity_calls_once_per_text_length(adapter):
    """In the pipeline's batch the shorter prompt is padded and its image's rotary positions move: that sample is
    not what it is alone. The adapter's batch gives each sample its one-prompt result."""
    noise = adapter.initial_noise(2, 64, 64, torch.Generator().manual_seed(6))
    batched = _pipeline_latents(adapter, PROMPTS, noise, use_kv_cache=False)
    alone = torch.cat([_pipeline_latents(adapter, [p], noise[i:i + 1], use_kv_cache=False)
                       for i, p in enumerate(PROMPTS)])
    longer = 0 if len(PROMPTS[0]) > len(PROMPTS[1]) else 1
    torch.testing.assert_close(batched[longer], alone[longer], rtol=0, atol=1e-5)  # unpadded: the same
    assert (batched[1 - longer] - alone[1 - longer]).abs().max() > 1e-3  # padded: moved

    cond, sigma = adapter.encode(PROMPTS, ["", "blurry"], 4.0), torch.tensor(0.7)
    with torch.no_grad():
        together = adapter.velocity(noise, sigma, cond, 4.0)
        one_by_one = [adapter.velocity(noise[i:i + 1], sigma, index_cond(cond, [i]), 4.0) for i in range(2)]
    torch.testing.assert_close(together, torch.cat(one_by_one), rtol=0, atol=1e-6)


def test_decode_puts_the_alpha_over_white(adapter):
    """The VAE decodes four channels (RGBA); decode gives rgb * alpha + (1 - alpha), in [0, 1]."""
    latents = 2 * adapter.initial_noise(1, 64, 64, torch.Generator().manual_seed(7))
    vae = adapter.pipeline.vae
    shape = (1, vae.config.z_dim, 1, 1, 1)
    z = latents.unsqueeze(2) * torch.tensor(vae.config.latents_std).view(shape) + \
        torch.tensor(vae.config.latents_mean).view(shape)
    with torch.no_grad():
        rgba = (vae.decode(z).sample[:, :, 0] / 2 + 0.5).clamp(0, 1)
    assert rgba.shape[1] == 4 and rgba[:, 3].std() > 0
    expected = rgba[:, :3] * rgba[:, 3:] + 1 - rgba[:, 3:]
    torch.testing.assert_close(adapter.decode(latents), expected, rtol=0, atol=1e-5)


def test_spellings_and_the_size_factor_of_32_before_loading():
    """Upstream's model_type and its spellings load; sizes are multiples of 32 (x16 VAE, 2x2 latents a slot)."""
    base = {"data": {"dataset_dir": "prompts"}, "rewards": [{"reward_model": "jpeg_compressibility"}],
            "train": {"per_device_batch_size": 2, "group_size": 2, "unique_sample_num_per_epoch": 2}}
    for spelling in ("qwen-image-2.1", "qwen_image_2_1", "Qwen-Image-2.1", "qwenimage21"):
        config = parse_config({**base, "model": {"model_name_or_path": "org/name", "model_type": spelling}})
        assert config.model.model_type == "qwen-image-2.1"
    with pytest.raises(ConfigError, match=r"train.resolution: qwen-image-2.1 needs height and width in multiples "
                                          r"of 32 \(VAE x16, then 2x2 latents per text-encoder image slot\)"):
        parse_config({**base, "model": {"model_name_or_path": "org/name", "model_type": "qwen-image-2.1"},
                      "train": {**base["train"], "resolution": 48}})


# --- condition images ---------------------------------------------------------------------------------------
CONDITION_SIZE = 96  # condition_image_size [96, 96]: the pipeline's output_resolution 96 (its resize area)
GUIDANCE = 3.0


def _image(size, seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _sources(seed=0):
    """A sample of one image and one of two, of other aspect ratios."""
    return [[_image((83, 50), seed)], [_image((70, 90), seed + 1), _image((64, 64), seed + 2)]]


def _conditioning(adapter, prompts, sources, guidance=GUIDANCE, side=CONDITION_SIZE):
    media = adapter.prepare_conditions(sources, None, 64, 64, None, (side, side))
    return {**adapter.encode(prompts, None, guidance, conditions=media),
            **adapter.encode_conditions(media, 64, 64, None)}


def _pipeline_with_images(pipe, prompt, images, noise, guidance=GUIDANCE, side=CONDITION_SIZE):
    """One sample: the pipeline takes one set of images for its whole batch."""
    pack, unpack = type(pipe)._pack_latents, type(pipe)._unpack_latents
    out = pipe(prompt=prompt, image=images, negative_prompt="", true_cfg_scale=guidance, height=64, width=64,
               num_inference_steps=3, latents=pack(noise.clone(), 1, *noise.shape[1:]), output_type="latent",
               output_resolution=side, use_kv_cache=False).images
    return unpack(out, 64, 64, pipe.vae_scale_factor).squeeze(2)


def _rollout(adapter, cond, noise, guidance=GUIDANCE):
    return sample_trajectory(adapter, ODE(), cond, noise, adapter.sigmas(3, 64, 64), guidance).final


def test_condition_images_reproduce_the_pipeline(adapter):
    """Samples of one and two images of their own sizes in one call, with CFG: the ODE rollout is the pipeline's for
    each sample, and the images change it."""
    sources = _sources()
    cond = _conditioning(adapter, PROMPTS, sources)
    assert cond["image_shapes"].tolist() == [[[4, 8], [0, 0]], [[6, 6], [6, 6]]]  # 128x64, 96x96 twice: VAE x16
    noise = adapter.initial_noise(2, 64, 64, torch.Generator().manual_seed(0))
    final = _rollout(adapter, cond, noise)
    expected = torch.cat([_pipeline_with_images(adapter.pipeline, p, images, noise[i:i + 1])
                          for i, (p, images) in enumerate(zip(PROMPTS, sources))])
    assert final.abs().max() > 0.1
    torch.testing.assert_close(final, expected, rtol=0, atol=1e-5)
    text_only = _rollout(adapter, adapter.encode(PROMPTS, None, GUIDANCE), noise)
    assert (text_only - final).abs().max() > 1e-2


def test_condition_images_are_resized_as_the_pipeline_resizes_them(adapter):
    """To condition_image_size's area (default the pipeline's output_resolution^2) at the image's aspect ratio, in
    multiples of 32: the pixels the pipeline's preprocess gives its VAE, alpha 1."""
    source = _image((83, 50), 0)
    media = adapter.prepare_conditions([[source]], None, 64, 64, None, (CONDITION_SIZE, CONDITION_SIZE))
    width, height, _ = calculate_dimensions(CONDITION_SIZE ** 2, 83 / 50)
    assert media.images[0].shape == (1, 3, height, width) == (1, 3, 64, 128)
    expected = adapter.pipeline.image_processor.preprocess(source.convert("RGBA"), width=width, height=height)
    torch.testing.assert_close(media.images[0][0] * 2 - 1, expected[0, :3], rtol=0, atol=0)
    assert (expected[0, 3] == 1).all()
    assert type(adapter).condition_sizes([(83, 50)], None) == (calculate_dimensions(1024 ** 2, 83 / 50)[:2],)


def test_rows_with_and_without_images_concatenate_and_keep_their_own_velocity(adapter):
    """Samples of other image counts and sizes, and one without: their conditioning concatenates (padded) and one
    velocity call gives each what it gives alone; a row without images is text to image."""
    x = adapter.initial_noise(3, 64, 64, torch.Generator().manual_seed(2))
    sources = _sources(seed=3)
    one, two = (_conditioning(adapter, [p], [images]) for p, images in zip(PROMPTS, sources))
    none = _conditioning(adapter, PROMPTS[:1], [[]])
    both = cat_cond([one, two, none])
    sigma = torch.tensor([0.9, 0.7, 0.4])
    with torch.no_grad():
        together = adapter.velocity(x, sigma, both, GUIDANCE)
        alone = [adapter.velocity(x[i:i + 1], sigma[i], c, GUIDANCE) for i, c in enumerate((one, two, none))]
        text = adapter.velocity(x[2:], sigma[2], adapter.encode(PROMPTS[:1], None, GUIDANCE), GUIDANCE)
    torch.testing.assert_close(together, torch.cat(alone), rtol=0, atol=1e-6)
    assert torch.equal(alone[2], text)


def test_a_prompt_longer_than_max_sequence_length_with_its_image(adapter):
    """A 768^2 condition image is 576 image slots: the prompt with it is over max_sequence_length. Both CFG branches
    are padded to its length, it concatenates with a text-only row, and the rollout is still the pipeline's."""
    sources = [[_image((700, 700), 9)]]
    long = _conditioning(adapter, PROMPTS[:1], sources, side=768)
    length = long["prompt_embeds"].shape[1]
    assert int(long["prompt_image_slots"].sum()) == 576 and length > adapter.max_sequence_length
    assert long["negative_prompt_embeds"].shape[1] == length
    noise = adapter.initial_noise(2, 64, 64, torch.Generator().manual_seed(4))
    both = cat_cond([long, _conditioning(adapter, PROMPTS[1:], [[]])])
    final = _rollout(adapter, both, noise)
    expected = _pipeline_with_images(adapter.pipeline, PROMPTS[0], sources[0], noise[:1], side=768)
    torch.testing.assert_close(final[:1], expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(final[1:], _rollout(adapter, index_cond(both, [1]), noise[1:]), rtol=0, atol=1e-6)


def test_the_condition_cache_fingerprint_covers_the_vision_language_image_processor(adapter):
    """Qwen3-VL reads the resized images through its own image processor: another one is another cache."""
    from flow_factory.prompt_cache import condition_fingerprint

    before = condition_fingerprint(adapter)
    adapter.pipeline.processor.image_processor.max_pixels = 512 * 512
    assert condition_fingerprint(adapter) != before


@pytest.mark.parametrize("dynamics_name", ["Flow-SDE", "Dance-SDE", "CPS"])
def test_on_policy_ratio_is_one_with_condition_images(adapter, dynamics_name):
    dynamics = make_dynamics(dynamics_name, 0.7)
    algorithm, policy = grpo_on_perturbed_lora(adapter, dynamics, GUIDANCE)
    cond = _conditioning(adapter, PROMPTS, _sources(seed=5))
    noise = adapter.initial_noise(2, 64, 64, torch.Generator().manual_seed(1))
    traj = sample_trajectory(adapter, dynamics, cond, noise, adapter.sigmas(3, 64, 64), GUIDANCE,
                             generator=torch.Generator().manual_seed(2))
    assert_on_policy(algorithm, policy, traj, cond)


def test_lora_with_condition_images_loads_with_the_pipelines_load_lora_weights(adapter, tiny_qwen_image21_path,
                                                                               tmp_path):
    sources = _sources(seed=7)[1:]
    noise = adapter.initial_noise(1, 64, 64, torch.Generator().manual_seed(0))
    base = _pipeline_with_images(adapter.pipeline, PROMPTS[1], sources[0], noise)
    apply_lora(adapter.transformer, rank=4, alpha=2.0, target_modules="default",
               default_targets=adapter.default_lora_targets)
    perturb_lora(adapter.transformer, 0.2, which="lora_")
    tuned = _rollout(adapter, _conditioning(adapter, PROMPTS[1:], sources), noise)
    save_lora(adapter.pipeline_class, adapter.transformer, tmp_path / "lora")
    fresh = load_adapter("qwen-image-2.1", tiny_qwen_image21_path).pipeline
    fresh.load_lora_weights(tmp_path / "lora")
    reloaded = _pipeline_with_images(fresh, PROMPTS[1], sources[0], noise)
    torch.testing.assert_close(reloaded, tuned, rtol=0, atol=1e-5)
    assert (reloaded - base).abs().max() > 1e-3


def test_ff_train_runs_from_rows_with_and_without_images(tiny_qwen_image21_path, tmp_path, gpu_precision):
    """In a GPU's precision: grpo for 2 epochs from an editing dataset (condition_image_size as upstream's example
    sets it, scaled down), rows with and without images in one batch; the saved LoRA loads with the pipeline's
    load_lora_weights and changes its output with images."""
    config = tiny_run_config(tmp_path, "qwen-image-2.1", tiny_qwen_image21_path, max_epochs=2,
                             condition_image_size=[CONDITION_SIZE, CONDITION_SIZE])
    config["data"]["dataset_dir"] = str(write_mixed_condition_dataset(tmp_path / "refs"))
    (_out, err), code = ff_train_in_this_process([write_config(tmp_path, config)])
    assert code == 0, err
    run_dir = tmp_path / "saves" / "run"
    history = json.loads((run_dir / "history.json").read_text())
    assert [r["epoch"] for r in history["train"]] == [0, 1] and "reward/jpeg/mean" in history["train"][-1]
    sources = [read_image(f) for f in load_prompts(tmp_path / "refs", "test")[0].images]
    noise = torch.randn((1, 16, 4, 4), generator=torch.Generator().manual_seed(0))
    outputs = []
    for lora in (None, run_dir / "checkpoints" / "epoch_2"):
        pipe = load_adapter("qwen-image-2.1", tiny_qwen_image21_path).pipeline
        if lora is not None:
            pipe.load_lora_weights(lora)
        outputs.append(_pipeline_with_images(pipe, "blend them", sources, noise))
    assert not torch.allclose(*outputs, atol=1e-6), "the trained LoRA does not change the pipeline's output"
