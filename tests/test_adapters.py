"""The adapters reproduce their diffusers pipelines (invariant 2) and keep their contract."""

import math
from contextlib import nullcontext

import numpy as np
import pytest
import torch

from flow_factory.dynamics.ode import ODE
from flow_factory.models import (Flux2Adapter, Flux2KleinAdapter, FluxAdapter, HunyuanVideo15Adapter, LTX2Adapter,
                                 QwenImage21Adapter, QwenImageAdapter, SD3Adapter, WanT2VAdapter, ZImageAdapter,
                                 cat_cond, get_adapter_class, index_cond, load_adapter)
from flow_factory.trajectory import TrajectoryOptions, sample_trajectory

PROMPTS = ["a red cube on a table", "two cats"]
NEGATIVES = ["blurry", ""]
STEPS = 3

# model_type, fixture, adapter class, pipeline kwargs for the size, guidance used
CASES = {
    "sd3-5": ("tiny_sd3_path", SD3Adapter, dict(height=64, width=64), 4.5),
    "flux1": ("tiny_flux_path", FluxAdapter, dict(height=64, width=64), 3.5),
    "wan2_t2v": ("tiny_wan_path", WanT2VAdapter, dict(height=32, width=32, num_frames=5), 5.0),
    "qwen-image": ("tiny_qwen_image_path", QwenImageAdapter, dict(height=64, width=64), 4.0),
    "z-image": ("tiny_z_image_path", ZImageAdapter, dict(height=64, width=64), 4.0),
    "flux2": ("tiny_flux2_path", Flux2Adapter, dict(height=64, width=64), 4.0),
    "flux2-klein": ("tiny_flux2_klein_path", Flux2KleinAdapter, dict(height=64, width=64), 4.0),  # distilled
    "hunyuanvideo15": ("tiny_hunyuan_video15_path", HunyuanVideo15Adapter, dict(height=32, width=32, num_frames=5),
                       4.0),
    "ltx2_t2av": ("tiny_ltx2_path", LTX2Adapter, dict(height=32, width=32, num_frames=9), 4.0),
    "qwen-image-2.1": ("tiny_qwen_image21_path", QwenImage21Adapter, dict(height=64, width=64), 4.0),
}
PACKED = {"flux1", "qwen-image"}  # their pipelines take and return latents packed into 2x2 tokens


def _load(request, model_type):
    fixture, cls, size, guidance = CASES[model_type]
    adapter = load_adapter(model_type, request.getfixturevalue(fixture))
    assert type(adapter) is cls
    return adapter, size, guidance


def _pipeline_output(adapter, noise, size, guidance, output_type):
    """The pipeline's own result for the same noise, in the adapter's latent layout."""
    pipe, model_type = adapter.pipeline, adapter.model_type
    # fresh lists: ZImagePipeline writes its chat-templated prompts back into the list it is given
    kwargs = dict(prompt=list(PROMPTS), num_inference_steps=STEPS, output_type=output_type, latents=noise, **size)
    kwargs["true_cfg_scale" if model_type == "qwen-image" else "guidance_scale"] = guidance
    if model_type in ("flux2", "flux2-klein"):
        return _flux2_pipeline_output(adapter, noise, kwargs)
    if model_type == "hunyuanvideo15":  # CFG is its guider's; its VAE decodes a batch one video at a time
        pipe.guider = pipe.guider.new(guidance_scale=kwargs.pop("guidance_scale"))
        pipe.vae.enable_slicing()
    if model_type == "ltx2_t2av":
        return _ltx2_pipeline_output(adapter, noise, kwargs)
    if model_type == "qwen-image-2.1":
        return _qwen_image21_pipeline_output(adapter, noise, kwargs)
    if model_type in PACKED:
        n, c, h, w = noise.shape
        kwargs["latents"] = type(pipe)._pack_latents(noise, n, c, h, w)
    if model_type != "flux1":  # FLUX.1's guidance is distilled: no negative prompt
        kwargs["negative_prompt"] = list(NEGATIVES)
    out = pipe(**kwargs)
    result = out.frames if adapter.is_video else out.images
    if output_type == "latent" and model_type in PACKED:  # Qwen-Image's unpacked latents have a frame axis
        result = type(pipe)._unpack_latents(result, size["height"], size["width"], pipe.vae_scale_factor)
        result = result.reshape(noise.shape)
    return result


def _flux2_pipeline_output(adapter, noise, kwargs):
    """FLUX.2 takes the noise in the adapter's layout; its latent output differs between the two pipelines
    (packed, or denormalised and unpatchified), so the last step's latents are read from a callback."""
    pipe, last = adapter.pipeline, {}
    if adapter.uses_cfg(kwargs["guidance_scale"]):  # Klein's own negative is ""; it takes negative embeddings
        kwargs["negative_prompt_embeds"] = pipe.encode_prompt(NEGATIVES)[0]
    out = pipe(callback_on_step_end=lambda _p, _i, _t, step: last.update(step) or {}, **kwargs)
    if kwargs["output_type"] != "latent":
        return out.images
    return type(pipe)._unpack_latents_with_ids(last["latents"], type(pipe)._prepare_latent_ids(noise))


def _qwen_image21_pipeline_output(adapter, noise, kwargs):
    """Qwen-Image-2.1 one prompt at a time: a batch of prompts of different lengths pads them, which moves the
    image's rotary positions, so the pipeline's batch is not its prompts alone (the adapter's velocity is). Without
    the KV cache (the same within 1e-6; test_qwen_image21.py); images RGBA, put over white as the adapter does."""
    pipe, out, guidance = adapter.pipeline, [], kwargs.pop("guidance_scale")
    pack, unpack = type(pipe)._pack_latents, type(pipe)._unpack_latents
    for i, prompt in enumerate(kwargs.pop("prompt")):
        one = pipe(**{**kwargs, "latents": pack(noise[i:i + 1], 1, *noise.shape[1:])}, prompt=prompt,
                   negative_prompt=NEGATIVES[i], true_cfg_scale=guidance, use_kv_cache=False).images
        out.append(one if kwargs["output_type"] != "latent" else
                   unpack(one, kwargs["height"], kwargs["width"], pipe.vae_scale_factor).squeeze(2))
    out = torch.cat(out)
    if kwargs["output_type"] == "latent":
        return out
    return out[:, :3] * out[:, 3:] + 1 - out[:, 3:]


def _ltx2_pipeline_output(adapter, noise, kwargs):
    """LTX-2 with the adapter's guidance (CFG alone, one scale for video and audio) on the adapter's noise
    (video and audio tokens); latents in the adapter's layout, or (videos, audio waveforms)."""
    pipe = adapter.pipeline
    video, audio = adapter.split(noise)
    stats = pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std
    # the pipeline normalises the audio latents it is given (not the packed video ones)
    out = pipe(**{**kwargs, "latents": video, "audio_latents": pipe._denormalize_audio_latents(audio, *stats)},
               negative_prompt=list(NEGATIVES), stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0,
               audio_guidance_scale=None, audio_stg_scale=None, audio_modality_scale=None, audio_guidance_rescale=None)
    if kwargs["output_type"] != "latent":
        return out.frames, out.audio
    vae = pipe.vae
    video = pipe._pack_latents(pipe._normalize_latents(out.frames, vae.latents_mean, vae.latents_std,
                                                       vae.config.scaling_factor))
    audio = pipe._normalize_audio_latents(pipe._pack_audio_latents(out.audio), *stats)
    return torch.cat([video.flatten(1), audio.flatten(1)], 1)


@pytest.mark.parametrize("model_type", list(CASES))
def test_ode_rollout_reproduces_the_pipeline(request, model_type, test_precision):
    """In float32 to 1e-5; on a GPU (FF_TEST_DEVICE=cuda) or with FF_TEST_PRECISION=bf16, the pipeline loaded in
    bf16 against the adapter under bf16 autocast, to bf16's rounding: the pipeline rounds its latents to bf16
    after every step and the adapter keeps them in float32, so they part by a few bf16 ulps per step."""
    device, dtype, autocast = test_precision
    fixture, _, size, guidance = CASES[model_type]
    adapter = load_adapter(model_type, request.getfixturevalue(fixture), device, dtype)
    _check_ode_rollout(adapter, size, guidance, autocast, exact=dtype == torch.float32)


def _check_ode_rollout(adapter, size, guidance, autocast=nullcontext, exact=True):
    h, w, frames = size["height"], size["width"], size.get("num_frames")
    noise = adapter.initial_noise(len(PROMPTS), h, w, torch.Generator().manual_seed(0), num_frames=frames)
    noise = noise.to(adapter.device)
    with autocast():  # the text encoders too, as the trainer encodes its prompt cache
        cond = adapter.encode(PROMPTS, NEGATIVES, guidance)
    sigmas = adapter.sigmas(STEPS, h, w, frames)
    traj = sample_trajectory(adapter, ODE(), cond, noise, sigmas, guidance, options=TrajectoryOptions(autocast=autocast))

    expected = _pipeline_output(adapter, noise.clone().to(adapter.dtype), size, guidance, "latent")
    # the pipeline's scheduler keeps the sigmas of its last call
    torch.testing.assert_close(sigmas, adapter.pipeline.scheduler.sigmas.float().to(sigmas.device), rtol=0, atol=0)
    assert expected.shape == traj.final.shape
    assert traj.final.abs().max() > 0.1  # a meaningful comparison, not zeros against zeros
    if not exact:  # bf16: ~2^-8 relative per step, over STEPS steps
        scale = expected.float().abs().max().item()
        torch.testing.assert_close(traj.final, expected.float(), rtol=0, atol=0.02 * STEPS * scale)
        assert (traj.final - expected.float()).abs().mean() < 0.01 * scale
        return
    torch.testing.assert_close(traj.final, expected.float(), rtol=0, atol=1e-5)

    images = adapter.decode(traj.final)
    expected_images = _pipeline_output(adapter, noise.clone(), size, guidance, "pt")
    if adapter.has_audio:  # LTX-2: and the soundtrack
        expected_images, expected_audio = expected_images
        waveforms, _ = adapter.decode_audio(traj.final)
        assert waveforms.abs().max() > 0.01
        torch.testing.assert_close(waveforms, expected_audio.float(), rtol=0, atol=1e-4)
    torch.testing.assert_close(images, expected_images.float(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("model_type", list(CASES))
def test_decode_shape_and_range(request, model_type):
    adapter, size, _ = _load(request, model_type)
    h, w, frames = size["height"], size["width"], size.get("num_frames")
    latents = 3 * adapter.initial_noise(2, h, w, torch.Generator().manual_seed(1), num_frames=frames)
    out = adapter.decode(latents)
    expected = (2, frames, 3, h, w) if adapter.is_video else (2, 3, h, w)
    assert out.shape == expected and out.dtype == torch.float32
    assert out.min() >= 0 and out.max() <= 1
    assert out.std() > 0  # not a constant image


@pytest.mark.parametrize("model_type", list(CASES))
def test_velocity_is_per_sample(request, model_type):
    """A (B,) sigma and a batch give what each sample gives alone (cond slices by index)."""
    adapter, size, guidance = _load(request, model_type)
    h, w, frames = size["height"], size["width"], size.get("num_frames")
    cond = adapter.encode(PROMPTS, None, guidance)
    assert all(v.shape[0] == len(PROMPTS) for v in cond.values())
    x = adapter.initial_noise(2, h, w, torch.Generator().manual_seed(2), num_frames=frames)
    sigma = torch.tensor([0.9, 0.4])
    with torch.no_grad():
        batched = adapter.velocity(x, sigma, cond, guidance)
        singles = [adapter.velocity(x[i : i + 1], sigma[i], index_cond(cond, [i]), guidance) for i in range(2)]
    assert batched.shape == x.shape and batched.dtype == torch.float32
    torch.testing.assert_close(batched, torch.cat(singles), rtol=0, atol=1e-5)
    assert not torch.allclose(singles[0], adapter.velocity(x[:1], sigma[1], index_cond(cond, [0]), guidance))


def test_cfg_mixes_the_two_branches_with_the_guidance_weight(request):
    """v = v_uncond + g (v_text - v_uncond), the uncond branch encoded from the negative prompt."""
    adapter, size, _ = _load(request, "sd3-5")
    cond = adapter.encode(PROMPTS[:1], ["ugly"], 4.0)
    x = adapter.initial_noise(1, 64, 64, torch.Generator().manual_seed(3))
    text = {"prompt_embeds": cond["prompt_embeds"], "pooled_prompt_embeds": cond["pooled_prompt_embeds"]}
    uncond = {"prompt_embeds": cond["negative_prompt_embeds"],
              "pooled_prompt_embeds": cond["negative_pooled_prompt_embeds"]}
    with torch.no_grad():
        v_text = adapter.velocity(x, torch.tensor(0.7), text, 1.0)
        v_uncond = adapter.velocity(x, torch.tensor(0.7), uncond, 1.0)
        v = adapter.velocity(x, torch.tensor(0.7), cond, 4.0)
    torch.testing.assert_close(v, v_uncond + 4.0 * (v_text - v_uncond), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="negative branch"):
        adapter.velocity(x, torch.tensor(0.7), text, 4.0)


def test_flux_sigmas_follow_the_resolution_dependent_shift(tiny_flux_path):
    adapter = load_adapter("flux1", tiny_flux_path)
    n = 4
    for size in (64, 128):
        seq_len = (size // 16) ** 2
        mu = 0.5 + (seq_len - 256) * (1.15 - 0.5) / (4096 - 256)  # FLUX's linear interpolation of the shift
        grid = np.linspace(1.0, 1.0 / n, n)
        expected = [math.exp(mu) / (math.exp(mu) + (1 / s - 1)) for s in grid] + [0.0]
        torch.testing.assert_close(adapter.sigmas(n, size, size), torch.tensor(expected, dtype=torch.float32))
    assert (adapter.sigmas(n, 128, 128)[1:-1] > adapter.sigmas(n, 64, 64)[1:-1]).all()


def test_flux2_klein_base_runs_cfg_as_its_pipeline(tiny_flux2_klein_base_path):
    """A Klein base checkpoint (is_distilled false) guides with the negative prompt, as its pipeline."""
    adapter = load_adapter("flux2-klein", tiny_flux2_klein_base_path)
    assert adapter.uses_cfg(4.0) and not adapter.uses_cfg(1.0)
    _check_ode_rollout(adapter, dict(height=64, width=64), 4.0)
    cond = adapter.encode(PROMPTS[:1], ["ugly"], 4.0)
    x = adapter.initial_noise(1, 64, 64, torch.Generator().manual_seed(3))
    text, uncond = {"prompt_embeds": cond["prompt_embeds"]}, {"prompt_embeds": cond["negative_prompt_embeds"]}
    with torch.no_grad():
        v_text, v_uncond = (adapter.velocity(x, torch.tensor(0.7), c, 1.0) for c in (text, uncond))
        v = adapter.velocity(x, torch.tensor(0.7), cond, 4.0)
    torch.testing.assert_close(v, v_uncond + 4.0 * (v_text - v_uncond), rtol=0, atol=1e-5)
    assert (v - v_text).abs().max() > 1e-3


def test_flux2_guidance_is_an_embedding_and_distilled_klein_has_none(tiny_flux2_path, tiny_flux2_klein_path):
    flux2, klein = load_adapter("flux2", tiny_flux2_path), load_adapter("flux2-klein", tiny_flux2_klein_path)
    assert flux2.latent_shape(64, 128) == klein.latent_shape(64, 128) == (128, 4, 8)  # 32 channels, 2x2 patches
    for adapter in (flux2, klein):
        assert not adapter.uses_cfg(4.0)
        cond = adapter.encode(PROMPTS[:1], ["ugly"], 4.0)
        assert list(cond) == ["prompt_embeds"]
        x = adapter.initial_noise(1, 64, 64, torch.Generator().manual_seed(4))
        with torch.no_grad():
            changed = (adapter.velocity(x, torch.tensor(0.5), cond, 4.0)
                       - adapter.velocity(x, torch.tensor(0.5), cond, 1.0)).abs().max()
        assert (changed > 1e-4) == (adapter is flux2), (adapter.model_type, changed)
    with pytest.raises(ValueError, match="multiples of 16"):
        klein.latent_shape(64, 40)


def test_flux2_fingerprints_the_tokenizer_inside_its_processor(tiny_flux2_path):
    """FLUX.2 [dev]'s tokenizer slot holds a PixtralProcessor (not buildable here: it needs torchvision);
    the prompt cache fingerprints the tokenizer the processor wraps."""
    from flow_factory.prompt_cache import encoder_fingerprint

    class Processor:  # what the cache reads of a transformers processor: its tokenizer
        def __init__(self, tokenizer):
            self.tokenizer = tokenizer

    adapter = load_adapter("flux2", tiny_flux2_path)
    plain = encoder_fingerprint(adapter)
    adapter.pipeline.tokenizer = Processor(adapter.pipeline.tokenizer)
    assert encoder_fingerprint(adapter) == plain


def test_sd3_sigmas_are_the_shifted_grid(tiny_sd3_path):
    adapter = load_adapter("sd3-5", tiny_sd3_path)
    sigmas = adapter.sigmas(4, 64, 64).double()
    # shift 3: sigma = 3 s / (1 + 2 s); invert to recover the unshifted grid, which must be linear
    s = sigmas[:-1] / (3 - 2 * sigmas[:-1])
    assert sigmas[0] == 1 and sigmas[-1] == 0
    torch.testing.assert_close(s.diff(), torch.full((3,), float(s.diff()[0]), dtype=torch.float64))


def test_latent_shapes_and_size_errors(request):
    sd3, _, _ = _load(request, "sd3-5")
    flux, _, _ = _load(request, "flux1")
    wan, _, _ = _load(request, "wan2_t2v")
    qwen, _, _ = _load(request, "qwen-image")
    z_image, _, _ = _load(request, "z-image")
    assert sd3.latent_shape(64, 128) == (16, 8, 16)
    assert flux.latent_shape(64, 128) == (16, 8, 16)
    assert qwen.latent_shape(64, 128) == z_image.latent_shape(64, 128) == (16, 8, 16)
    for adapter in (qwen, z_image):
        with pytest.raises(ValueError, match="multiples of 16"):
            adapter.latent_shape(64, 40)
    assert wan.latent_shape(32, 48, num_frames=9) == (16, 3, 4, 6)
    with pytest.raises(ValueError, match="multiples of 16"):
        sd3.latent_shape(72, 64)
    with pytest.raises(ValueError, match="multiples of 16"):
        flux.latent_shape(64, 40)
    with pytest.raises(ValueError, match="num_frames"):
        wan.latent_shape(32, 32)
    with pytest.raises(ValueError, match="num_frames"):
        wan.latent_shape(32, 32, num_frames=6)


def test_qwen_image_cfg_rescales_the_mix_to_the_conditional_norm(tiny_qwen_image_path):
    """Qwen-Image's true CFG: the mixed prediction keeps, at every token, the norm of the conditional one."""
    adapter = load_adapter("qwen-image", tiny_qwen_image_path)
    cond = adapter.encode(PROMPTS[:1], ["ugly"], 4.0)
    x = adapter.initial_noise(1, 64, 64, torch.Generator().manual_seed(3))
    text = {k: cond[k] for k in ("prompt_embeds", "prompt_embeds_mask")}
    uncond = {k: cond[f"negative_{k}"] for k in text}
    with torch.no_grad():
        v_text, v_uncond, v = (adapter.velocity(x, torch.tensor(0.7), c, g) for c, g in
                               ((text, 1.0), (uncond, 1.0), (cond, 4.0)))

    def tokens(latents):  # (B, C, H, W) -> (B, tokens, 4 C), the pipeline's packing
        return type(adapter.pipeline)._pack_latents(latents, 1, 16, 8, 8)

    mixed = tokens(v_uncond + 4.0 * (v_text - v_uncond))
    expected = mixed * tokens(v_text).norm(dim=-1, keepdim=True) / mixed.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(tokens(v), expected, rtol=0, atol=1e-5)
    assert (tokens(v) - mixed).abs().max() > 100 * 1e-5  # the rescale is not a no-op here
    with pytest.raises(ValueError, match="negative branch"):
        adapter.velocity(x, torch.tensor(0.7), text, 4.0)


def test_z_image_guidance_is_the_pipelines_and_zero_is_one_branch(tiny_z_image_path):
    """Z-Image: v = -(v_c + g (v_c - v_u)) of the transformer's outputs; g = 0 (Turbo) encodes no negative."""
    adapter = load_adapter("z-image", tiny_z_image_path)
    assert not adapter.uses_cfg(0.0) and adapter.uses_cfg(0.5)
    assert set(adapter.encode(PROMPTS, None, 0.0)) == {"prompt_embeds", "prompt_embeds_mask"}
    cond = adapter.encode(PROMPTS[:1], ["ugly"], 2.0)
    x = adapter.initial_noise(1, 64, 64, torch.Generator().manual_seed(3))
    text = {k: cond[k] for k in ("prompt_embeds", "prompt_embeds_mask")}
    uncond = {k: cond[f"negative_{k}"] for k in text}
    with torch.no_grad():
        v_text, v_uncond, v = (adapter.velocity(x, torch.tensor(0.7), c, g) for c, g in
                               ((text, 0.0), (uncond, 0.0), (cond, 2.0)))
    torch.testing.assert_close(v, v_text + 2.0 * (v_text - v_uncond), rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type", ["qwen-image", "z-image"])
def test_prompts_of_any_length_stack_across_batches(request, model_type):
    """Prompts keep their own lengths: conditioning encoded in separate batches, whose longest
    prompts differ, concatenates (as rollouts and the prompt cache do) and gives each sample the
    velocity it has alone."""
    adapter, size, guidance = _load(request, model_type)
    short, long = ["a cat"], ["a very long prompt about a red cube on a wooden table at dawn"]
    parts = [adapter.encode(p, ["blurry"], guidance) for p in (short, long)]
    lengths = [int(part["prompt_embeds_mask"].sum()) for part in parts]
    assert lengths[0] < lengths[1] and parts[0]["prompt_embeds"].shape == parts[1]["prompt_embeds"].shape
    both = cat_cond(parts)
    x = adapter.initial_noise(2, 64, 64, torch.Generator().manual_seed(4))
    sigma = torch.tensor([0.8, 0.3])
    with torch.no_grad():
        batched = adapter.velocity(x, sigma, both, guidance)
        alone = [adapter.velocity(x[i:i + 1], sigma[i], parts[i], guidance) for i in range(2)]
    torch.testing.assert_close(batched, torch.cat(alone), rtol=0, atol=1e-5)


def test_qwen_image_sigmas_are_the_pipelines_at_every_resolution(tiny_qwen_image_path):
    """Qwen-Image's shift grows with the number of image tokens (use_dynamic_shifting, exponential,
    stretched to end at shift_terminal): the adapter's grid is the pipeline's at 64 and at 128 pixels."""
    adapter = load_adapter("qwen-image", tiny_qwen_image_path)
    pipe = adapter.pipeline
    grids = {}
    for size in (64, 128):
        pipe(prompt=["a cat"], height=size, width=size, num_inference_steps=4, true_cfg_scale=1.0,
             output_type="latent")
        grids[size] = adapter.sigmas(4, size, size)
        torch.testing.assert_close(grids[size], pipe.scheduler.sigmas.float(), rtol=0, atol=0)
        assert grids[size][-2] == pytest.approx(0.02)  # shift_terminal
    assert (grids[128][1:-2] > grids[64][1:-2]).all()


def test_registry():
    assert get_adapter_class("flux1") is FluxAdapter
    assert get_adapter_class("wan2_t2v").is_video and not get_adapter_class("sd3-5").is_video
    assert get_adapter_class("qwen-image") is QwenImageAdapter and get_adapter_class("z-image") is ZImageAdapter
    assert get_adapter_class("flow_factory.models.flux.FluxAdapter") is FluxAdapter  # a class by its path
    with pytest.raises(ValueError, match=r"unknown 'sd3'.*'flux1'.*'sd3-5'.*or the dotted path"):
        get_adapter_class("sd3")
    with pytest.raises(ValueError, match=r"model.model_type: 'collections.OrderedDict' is .* not a subclass"):
        get_adapter_class("collections.OrderedDict")
    with pytest.raises(ValueError, match=r"model.model_type: adapter class path 'no_such.Adapter': no module"):
        get_adapter_class("no_such.Adapter")


@pytest.mark.parametrize("model_type", list(CASES))
def test_tiny_builds_are_seeded_and_leave_the_global_rng_alone(request, model_type, tmp_path):
    from flow_factory.testing import build_tiny_pipeline

    cls = get_adapter_class(model_type)  # its from_pretrained: the pipeline's (Qwen-Image-2.1's processor as it can)
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    path = build_tiny_pipeline(model_type, tmp_path / "again")
    assert torch.equal(torch.rand(3), before)  # the build forked the RNG instead of reseeding it
    again = cls.from_pretrained(path).pipeline
    first = cls.from_pretrained(request.getfixturevalue(CASES[model_type][0])).pipeline
    for name in ("transformer", "vae", "text_encoder"):
        a, b = getattr(first, name).state_dict(), getattr(again, name).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tokenizers = [next(iter(cls(pipe).tokenizers().values())) for pipe in (first, again)]
    assert tokenizers[0]("a cat").input_ids == tokenizers[1]("a cat").input_ids
