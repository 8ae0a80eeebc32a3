"""HunyuanVideo-1.5 (hunyuanvideo15): what the shared tables do not show. Quoted text reaches the ByT5
glyph encoder as in the pipeline, the sigmas are the pipeline's grid under its scheduler's shift, the
guidance is its guider's arithmetic, and a LoRA checkpoint loads without the LoRA loader the pipeline
class lacks."""

import json

import numpy as np
import pytest
import torch
from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler

from flow_factory.checkpoint import load_for_sampling
from flow_factory.config import ConfigError
from flow_factory.dynamics.ode import ODE
from flow_factory.models import apply_lora, load_adapter, save_lora
from flow_factory.models.hunyuan_video15 import HunyuanVideo15Adapter
from flow_factory.models.preflight import check_pipeline_class
from flow_factory.trajectory import sample_trajectory

SIZE = dict(height=32, width=32, num_frames=5)


@pytest.fixture
def adapter(tiny_hunyuan_video15_path):
    return load_adapter("hunyuanvideo15", tiny_hunyuan_video15_path)


def _noise(adapter, n, seed=0):
    return adapter.initial_noise(n, 32, 32, torch.Generator().manual_seed(seed), num_frames=5)


def test_quoted_text_goes_through_the_glyph_encoder_as_in_the_pipeline(adapter):
    """A prompt with quoted text has ByT5 tokens, one without has none; batched together (padding of
    different lengths in both encoders), the ODE rollout is the pipeline's."""
    prompts = ['a shop sign reading "OPEN 24h"', "two cats"]
    cond = adapter.encode(prompts, None, 1.0)
    glyph_tokens = cond["prompt_embeds_mask_2"].sum(1)
    assert glyph_tokens[0] > 0 and glyph_tokens[1] == 0
    noise = _noise(adapter, 2)
    final = sample_trajectory(adapter, ODE(), cond, noise, adapter.sigmas(2, **SIZE), 1.0).final
    pipe = adapter.pipeline
    pipe.guider = pipe.guider.new(guidance_scale=1.0)
    expected = pipe(prompt=prompts, latents=noise.clone(), num_inference_steps=2, output_type="latent", **SIZE).frames
    assert final.abs().max() > 0.1
    torch.testing.assert_close(final, expected, rtol=0, atol=1e-5)


def test_sigmas_are_the_pipelines_grid_under_its_shift(adapter):
    s = np.linspace(1.0, 0.0, 5)[:-1]
    for shift in (5.0, 9.0):  # the 480p and 720p text-to-video releases
        adapter.pipeline.scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
        expected = [shift * v / (1 + (shift - 1) * v) for v in s] + [0.0]
        torch.testing.assert_close(adapter.sigmas(4, **SIZE), torch.tensor(expected, dtype=torch.float32))


def test_guidance_is_the_checkpoints_guider(adapter):
    """velocity's CFG is what the pipeline's guider makes of the two branches, with the checkpoint's formulation
    and guidance_rescale."""
    x = _noise(adapter, 1, seed=3)
    for original, rescale in ((False, 0.0), (True, 0.0), (False, 0.7)):
        guider = ClassifierFreeGuidance(guidance_scale=4.0, use_original_formulation=original, guidance_rescale=rescale)
        adapter.pipeline.guider = guider
        cond = adapter.encode(["a red cube"], ["blurry"], 4.0)
        text = {k: v for k, v in cond.items() if not k.startswith("negative_")}
        uncond = {k: cond[f"negative_{k}"] for k in text}
        off = 0.0 if original else 1.0  # the scale at which this guider runs one branch
        with torch.no_grad():
            v = adapter.velocity(x, torch.tensor(0.7), cond, 4.0)
            v_text, v_uncond = (adapter.velocity(x, torch.tensor(0.7), c, off) for c in (text, uncond))
        torch.testing.assert_close(v, guider.forward(v_text, v_uncond).pred, rtol=0, atol=1e-5)
        assert adapter.uses_cfg(1.0) == original and not adapter.uses_cfg(off)


def test_a_disabled_guider_encodes_no_negative(adapter):
    adapter.pipeline.guider = ClassifierFreeGuidance(guidance_scale=6.0, enabled=False)
    assert not adapter.uses_cfg(6.0)
    assert not any(k.startswith("negative_") for k in adapter.encode(["a cat"], ["blurry"], 6.0))


def test_guiders_it_cannot_follow_are_refused(tiny_hunyuan_video15_path, tmp_path):
    # another guider class: named by the check before loading, from model_index.json alone
    index = json.loads((tiny_hunyuan_video15_path / "model_index.json").read_text())
    index["guider"] = ["diffusers", "AdaptiveProjectedGuidance"]
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="follows the ClassifierFreeGuidance guider; this checkpoint's guider is "
                                          "AdaptiveProjectedGuidance"):
        check_pipeline_class(tmp_path, HunyuanVideo15Adapter)
    # CFG in a window of steps: named when the pipeline is wrapped
    pipe = HunyuanVideo15Adapter.pipeline_class.from_pretrained(tiny_hunyuan_video15_path)
    pipe.guider = ClassifierFreeGuidance(guidance_scale=6.0, start=0.2)
    with pytest.raises(ValueError, match=r"from step fraction 0.2 to 1.0"):
        HunyuanVideo15Adapter(pipe)


def test_a_lora_checkpoint_loads_for_sampling_through_the_transformer(adapter, tiny_hunyuan_video15_path, tmp_path):
    """HunyuanVideo15Pipeline has no load_lora_weights: ff-sample's loader uses the transformer's
    load_lora_adapter on the file save_lora writes, and gets the trained model back."""
    assert not hasattr(adapter.pipeline, "load_lora_weights")
    apply_lora(adapter.transformer, 4, 2.0, "default", adapter.default_lora_targets)
    with torch.no_grad():
        for name, p in adapter.transformer.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    cond, x = adapter.encode(["a lighthouse"], None, 1.0), _noise(adapter, 1, seed=4)
    with torch.no_grad():
        tuned = adapter.velocity(x, torch.tensor(0.6), cond, 1.0)
    save_lora(adapter.pipeline_class, adapter.transformer, tmp_path)
    loaded = load_for_sampling("hunyuanvideo15", tiny_hunyuan_video15_path, tmp_path, device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(loaded.velocity(x, torch.tensor(0.6), cond, 1.0), tuned, rtol=0, atol=1e-6)
