"""Qwen-Image-2.1 (model_type qwen-image-2.1) against its diffusers pipeline, beyond the shared tables
(test_adapters.py, test_on_policy.py, test_lora.py, helpers_runs.py): its prompt encoding, its sigmas with and
without a configured grid, its KV cache, why velocity calls the transformer once per text length, its sizes."""

import pytest
import torch

from flow_factory.config import ConfigError, parse_config
from flow_factory.models import index_cond, load_adapter

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
