"""Z-Image-Omni (model_type z-image-omni): text-to-image, or from condition images, as ``ZImageOmniPipeline``.

The ODE rollout equals the pipeline's own for the same prompts, images and noise (invariant 2), with CFG, with and
without condition images; the prompt's segments are the pipeline's ``encode_prompt``'s and the sigmas its
scheduler's; the on-policy ratio is exactly 1 under every SDE (invariant 1); a saved LoRA loads with the pipeline's
``load_lora_weights`` and gives the adapter's result; ``ff-train`` grpo trains from rows with and without images.

The pipeline VAE-encodes condition images in bfloat16 only (it casts them), so the tests that give it some cast its
VAE to bfloat16, as the release's dtype is; the adapter encodes in the VAE's dtype.
"""

import json

import numpy as np
import pytest
import torch
from helpers_algorithms import assert_on_policy, grpo_on_perturbed_lora, perturb_lora
from helpers_runs import ff_train_in_this_process, tiny_run_config, write_config, write_mixed_condition_dataset
from PIL import Image

from flow_factory.data import load_prompts, read_image
from flow_factory.dynamics import make_dynamics
from flow_factory.dynamics.ode import ODE
from flow_factory.models import apply_lora, cat_cond, index_cond, load_adapter, save_lora
from flow_factory.trajectory import sample_trajectory

STEPS, SIZE, GUIDANCE = 3, 64, 2.0
PROMPTS = ["make the sky red", "add a cat"]
# two images per sample, at least the pipeline's 64 pixels a side; it keeps them (under 1024^2 pixels), floored to
# multiples of 16: 100x72 -> 96x64
SOURCE_SIZES = [(100, 72), (64, 80)]


@pytest.fixture
def adapter(tiny_z_image_omni_path):
    adapter = load_adapter("z-image-omni", tiny_z_image_omni_path)
    adapter.pipeline.vae.to(torch.bfloat16)  # the pipeline's condition encoding runs only so
    return adapter


def _image(size, seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _sources(n, sizes=SOURCE_SIZES, seed=0):
    return [[_image(size, seed + 10 * i + k) for k, size in enumerate(sizes)] for i in range(n)]


def _conditioning(adapter, prompts, sources, guidance=GUIDANCE, condition_size=None):
    media = adapter.prepare_conditions(sources, None, SIZE, SIZE, None, condition_size)
    return {**adapter.encode(prompts, None, guidance, conditions=media),
            **adapter.encode_conditions(media, SIZE, SIZE, None)}


def _rollout(adapter, cond, noise, guidance=GUIDANCE):
    return sample_trajectory(adapter, ODE(), cond, noise, adapter.sigmas(STEPS, SIZE, SIZE), guidance).final


def _pipeline(pipe, prompts, images, noise, guidance=GUIDANCE):
    return pipe(image=images, prompt=list(prompts), height=SIZE, width=SIZE, num_inference_steps=STEPS,
                guidance_scale=guidance, latents=noise.clone(), output_type="latent").images


def test_text_to_image_reproduces_the_pipeline(adapter):
    """Two prompts in one call, with CFG: the rollout, the prompt encoding and the sigmas are the pipeline's."""
    noise = adapter.initial_noise(2, SIZE, SIZE, torch.Generator().manual_seed(0))
    cond = adapter.encode(PROMPTS, None, GUIDANCE)
    final = _rollout(adapter, cond, noise)
    expected = _pipeline(adapter.pipeline, PROMPTS, None, noise)
    assert final.abs().max() > 0.1
    torch.testing.assert_close(final, expected.float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(adapter.sigmas(STEPS, SIZE, SIZE).cpu(), adapter.pipeline.scheduler.sigmas.float(),
                               rtol=0, atol=0)
    positive, negative = adapter.pipeline.encode_prompt(list(PROMPTS), device="cpu", num_condition_images=0)
    for key, rows in (("prompt_embeds", positive), ("negative_prompt_embeds", negative)):
        for mine, theirs in zip(adapter._caption_segments(cond, key), rows):
            assert len(mine) == len(theirs) == 1 and torch.equal(mine[0], theirs[0])


def test_condition_images_reproduce_the_pipeline(adapter):
    """Two samples of two images each (of two sizes), in one call; the pipeline takes one set of images for its
    batch, so it runs a sample a call. Its prompt segments (k + 2 of them) are the pipeline's."""
    sources = _sources(2)
    cond = _conditioning(adapter, PROMPTS, sources)
    assert cond["condition_latents_sizes"][0].tolist() == [[8, 12], [10, 8]]  # 96x64 and 64x80, VAE x8
    noise = adapter.initial_noise(2, SIZE, SIZE, torch.Generator().manual_seed(0))
    final = _rollout(adapter, cond, noise)
    expected = torch.cat([_pipeline(adapter.pipeline, [p], images, noise[i:i + 1])
                          for i, (p, images) in enumerate(zip(PROMPTS, sources))])
    torch.testing.assert_close(final, expected.float(), rtol=0, atol=1e-5)
    theirs, _ = adapter.pipeline.encode_prompt(PROMPTS[:1], device="cpu", do_classifier_free_guidance=False,
                                               num_condition_images=2)
    mine = adapter._caption_segments(cond, "prompt_embeds")[0]
    assert len(mine) == 4 and all(torch.equal(a, b) for a, b in zip(mine, theirs[0]))
    # the images change the result: without them it is the text-to-image rollout
    text_only = _rollout(adapter, adapter.encode(PROMPTS, None, GUIDANCE), noise)
    assert (text_only - final).abs().max() > 1e-2


def test_condition_images_are_resized_as_the_pipeline_resizes_them(adapter):
    """Under 1024^2 pixels an image keeps its size, floored to multiples of 16 (a centre crop); with
    condition_image_size (Flow-Factory's) one over that area is brought down to it, keeping its aspect ratio."""
    sources = [[_image((100, 72), 0), _image((300, 200), 1)]]
    media = adapter.prepare_conditions(sources, None, SIZE, SIZE, None, None)
    assert [tuple(im.shape[-2:]) for im in media.images[0]] == [(64, 96), (192, 288)]
    assert [im.size for im in media.originals[0]] == [(100, 72), (300, 200)]  # what SigLIP reads: before the crop
    media = adapter.prepare_conditions(sources, None, SIZE, SIZE, None, (64, 64))
    # 100x72 at an area of 64^2: 75x54 -> 64x48; 300x200: 78x52 -> 64x48
    assert [im.size for im in media.originals[0]] == [(75, 54), (78, 52)]
    assert [tuple(im.shape[-2:]) for im in media.images[0]] == [(48, 64), (48, 64)]
    expected = adapter.pipeline.image_processor.preprocess(media.originals[0][0], height=48, width=64,
                                                           resize_mode="crop")
    torch.testing.assert_close(media.images[0][0] * 2 - 1, expected[0], rtol=0, atol=0)


def test_samples_concatenate_and_a_call_takes_images_for_all_or_none(adapter):
    """Samples of other image counts and sizes: their conditioning concatenates (padded), each sample's velocity is
    its own; a call mixing rows with and without images is refused by name, and the check before loading says so."""
    x = adapter.initial_noise(3, SIZE, SIZE, torch.Generator().manual_seed(2))
    one = _conditioning(adapter, PROMPTS[:1], [[_image((100, 72), 0)]])
    two = _conditioning(adapter, PROMPTS[1:], _sources(1, seed=3))
    none = _conditioning(adapter, PROMPTS[:1], [[]])
    both = cat_cond([one, two])
    sigma = torch.tensor(0.7)
    with torch.no_grad():
        for i, alone in enumerate((one, two)):
            torch.testing.assert_close(adapter.velocity(x[i:i + 1], sigma, index_cond(both, [i]), GUIDANCE),
                                       adapter.velocity(x[i:i + 1], sigma, alone, GUIDANCE), rtol=0, atol=1e-6)
        # a row without images is text-to-image
        assert torch.equal(adapter.velocity(x[2:], sigma, none, GUIDANCE),
                           adapter.velocity(x[2:], sigma, adapter.encode(PROMPTS[:1], None, GUIDANCE), GUIDANCE))
        with pytest.raises(ValueError, match="all have condition images or all have none.*per_device_batch_size: 1"):
            adapter.velocity(x, sigma, cat_cond([one, two, none]), GUIDANCE)
    shape = type(adapter).call_shape
    assert shape([(100, 72)], None) == shape([(64, 64), (80, 80)], None) != shape([], None)


@pytest.mark.parametrize("dynamics_name", ["Flow-SDE", "Dance-SDE", "CPS"])
def test_on_policy_ratio_is_one(adapter, dynamics_name):
    dynamics = make_dynamics(dynamics_name, 0.7)
    algorithm, policy = grpo_on_perturbed_lora(adapter, dynamics, GUIDANCE)
    cond = _conditioning(adapter, PROMPTS, _sources(2, seed=5))
    noise = adapter.initial_noise(2, SIZE, SIZE, torch.Generator().manual_seed(1))
    traj = sample_trajectory(adapter, dynamics, cond, noise, adapter.sigmas(STEPS, SIZE, SIZE), GUIDANCE,
                             generator=torch.Generator().manual_seed(2))
    assert_on_policy(algorithm, policy, traj, cond)


def test_lora_loads_with_the_pipelines_load_lora_weights(adapter, tiny_z_image_omni_path, tmp_path):
    """The default targets (the SigLIP refiner's blocks among them) saved, loaded into a fresh pipeline by plain
    diffusers: its output is the adapter's, and not the untrained one."""
    sources = _sources(1, seed=7)
    noise = adapter.initial_noise(1, SIZE, SIZE, torch.Generator().manual_seed(0))
    base = _pipeline(adapter.pipeline, PROMPTS[:1], sources[0], noise)
    apply_lora(adapter.transformer, rank=4, alpha=2.0, target_modules="default",
               default_targets=adapter.default_lora_targets)
    assert any("siglip_refiner" in name and "lora_A" in name for name, _ in adapter.transformer.named_parameters())
    perturb_lora(adapter.transformer, 0.2, which="lora_")
    tuned = _rollout(adapter, _conditioning(adapter, PROMPTS[:1], sources), noise)
    save_lora(adapter.pipeline_class, adapter.transformer, tmp_path / "lora")
    fresh = adapter.pipeline_class.from_pretrained(tiny_z_image_omni_path)
    fresh.vae.to(torch.bfloat16)
    fresh.load_lora_weights(tmp_path / "lora")
    reloaded = _pipeline(fresh, PROMPTS[:1], sources[0], noise)
    torch.testing.assert_close(reloaded.float(), tuned, rtol=0, atol=1e-5)
    assert (reloaded - base).abs().max() > 1e-3


def test_ff_train_runs_from_rows_with_and_without_images(tiny_z_image_omni_path, tmp_path, gpu_precision):
    """In a GPU's precision (bf16 autocast, fp16 trajectories): grpo for 2 epochs (CFG), a sample a call (rows with
    and without images), the conditions encoded once into the condition cache; the saved LoRA loads with the
    pipeline's load_lora_weights and changes its output."""
    config = tiny_run_config(tmp_path, "z-image-omni", tiny_z_image_omni_path, max_epochs=2, per_device_batch_size=1)
    config["data"]["dataset_dir"] = str(write_mixed_condition_dataset(tmp_path / "refs"))
    config["eval"].update(per_device_batch_size=1)
    (_out, err), code = ff_train_in_this_process([write_config(tmp_path, config)])
    assert code == 0, err
    run_dir = tmp_path / "saves" / "run"
    history = json.loads((run_dir / "history.json").read_text())
    assert [r["epoch"] for r in history["train"]] == [0, 1] and "reward/jpeg/mean" in history["train"][-1]
    assert list((tmp_path / "prompt_cache").glob("conditions-*"))
    sources = [read_image(f) for f in load_prompts(tmp_path / "refs", "test")[0].images]
    outputs = []
    for lora in (None, run_dir / "checkpoints" / "epoch_2"):
        pipe = load_adapter("z-image-omni", tiny_z_image_omni_path).pipeline
        pipe.vae.to(torch.bfloat16)
        if lora is not None:
            pipe.load_lora_weights(lora)
        noise = torch.randn((1, 16, 8, 8), generator=torch.Generator().manual_seed(0))
        outputs.append(_pipeline(pipe, ["blend them"], sources, noise))
    assert not torch.allclose(*outputs, atol=1e-6), "the trained LoRA does not change the pipeline's output"


def test_upstreams_adapter_class_path_names_the_family(tmp_path, tiny_z_image_omni_path):
    """Flow-Factory's registry has no name for its Z-Image-Omni adapter: its configs name the class by its path."""
    from flow_factory.config import load_config

    config = tiny_run_config(tmp_path, "z-image-omni", tiny_z_image_omni_path)
    config["model"]["model_type"] = "flow_factory.models.z_image.z_image_omni.ZImageOmniAdapter"
    assert load_config(write_config(tmp_path, config)).model.model_type == "z-image-omni"
