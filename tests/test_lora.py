"""LoRA: neutral at init, saved in diffusers' format, restored exactly, disabled for the reference."""

import pytest
import torch
from torch import nn

from flow_factory.models import (
    apply_lora, get_adapter_class, load_adapter, load_lora_state, lora_disabled, save_lora,
)
from flow_factory.models.lora import block_linear_names

FIXTURES = {"sd3-5": "tiny_sd3_path", "flux1": "tiny_flux_path", "wan2_t2v": "tiny_wan_path",
            "qwen-image": "tiny_qwen_image_path", "z-image": "tiny_z_image_path", "flux2": "tiny_flux2_path",
            "flux2-klein": "tiny_flux2_klein_path", "hunyuanvideo15": "tiny_hunyuan_video15_path",
            "ltx2_t2av": "tiny_ltx2_path", "qwen-image-2.1": "tiny_qwen_image21_path"}
SIZES = {"sd3-5": (64, 64, None), "flux1": (64, 64, None), "wan2_t2v": (32, 32, 5), "qwen-image": (64, 64, None),
         "z-image": (64, 64, None), "flux2": (64, 64, None), "flux2-klein": (64, 64, None),
         "hunyuanvideo15": (32, 32, 5), "ltx2_t2av": (32, 32, 9), "qwen-image-2.1": (64, 64, None)}


def _setup(request, model_type):
    """A fresh adapter, its conditioning and a fixed input; guidance 1 (one branch) keeps it fast."""
    path = request.getfixturevalue(FIXTURES[model_type])
    adapter = load_adapter(model_type, path)
    h, w, frames = SIZES[model_type]
    x = adapter.initial_noise(1, h, w, torch.Generator().manual_seed(0), num_frames=frames)
    cond = adapter.encode(["a lighthouse"], None, 1.0)
    return adapter, path, x, cond


def _v(adapter, x, cond):
    with torch.no_grad():
        return adapter.velocity(x, torch.tensor(0.6), cond, 1.0)


def _perturb(transformer, seed=0):
    # lora_B starts at zero; give every LoRA matrix a visible random value
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("model_type", list(FIXTURES))
def test_lora_saved_for_diffusers_reloads_exactly(request, model_type, tmp_path):
    adapter, path, x, cond = _setup(request, model_type)
    base = _v(adapter, x, cond)
    # alpha != rank: the scale alpha / rank must travel with the weights
    targets = apply_lora(adapter.transformer, rank=4, alpha=2.0, target_modules="default",
                         default_targets=adapter.default_lora_targets)
    assert targets
    torch.testing.assert_close(_v(adapter, x, cond), base, rtol=0, atol=0)  # B = 0 at init

    trainable = [n for n, p in adapter.transformer.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)

    _perturb(adapter.transformer)
    tuned = _v(adapter, x, cond)
    assert (tuned - base).abs().max() > 1e-3

    save_lora(adapter.pipeline_class, adapter.transformer, tmp_path / "lora")
    # the pipeline's from_pretrained (through the adapter class only for Qwen-Image-2.1's processor without torchvision)
    fresh = get_adapter_class(model_type).from_pretrained(path).pipeline
    if hasattr(fresh, "load_lora_weights"):
        fresh.load_lora_weights(tmp_path / "lora")  # plain diffusers, no Flow-Factory involved
    else:  # a pipeline without diffusers' LoRA loader (HunyuanVideo-1.5): the transformer's own
        fresh.transformer.load_lora_adapter(tmp_path / "lora", weight_name="pytorch_lora_weights.safetensors",
                                            prefix="transformer")
    reloaded = get_adapter_class(model_type)(fresh)
    reloaded.latent_shape(*SIZES[model_type])  # LTX-2 learns here which size its flat latents are
    torch.testing.assert_close(_v(reloaded, x, cond), tuned, rtol=0, atol=1e-6)


def test_lora_disabled_gives_the_base_model_and_restores_state(request):
    adapter, _, x, cond = _setup(request, "sd3-5")
    base = _v(adapter, x, cond)
    apply_lora(adapter.transformer, 4, 4, "default", adapter.default_lora_targets)
    _perturb(adapter.transformer)
    tuned = _v(adapter, x, cond)
    lora_params = [p for n, p in adapter.transformer.named_parameters() if "lora_" in n]
    lora_params[0].requires_grad_(False)  # a frozen LoRA tensor must stay frozen after the context

    with lora_disabled(adapter.transformer):
        torch.testing.assert_close(_v(adapter, x, cond), base, rtol=0, atol=0)
        with lora_disabled(adapter.transformer):  # nesting keeps it disabled
            pass
        torch.testing.assert_close(_v(adapter, x, cond), base, rtol=0, atol=0)
    torch.testing.assert_close(_v(adapter, x, cond), tuned, rtol=0, atol=0)
    assert not lora_params[0].requires_grad and all(p.requires_grad for p in lora_params[1:])

    # the reference path builds no graph to the LoRA weights; the policy path does
    with lora_disabled(adapter.transformer):
        assert not adapter.velocity(x, torch.tensor(0.6), cond, 1.0).requires_grad
    adapter.velocity(x, torch.tensor(0.6), cond, 1.0).sum().backward()
    assert lora_params[1].grad is not None and lora_params[0].grad is None

    plain, _, _, _ = _setup(request, "sd3-5")
    with pytest.raises(ValueError, match="no LoRA adapter"):
        with lora_disabled(plain.transformer):
            pass


def test_load_lora_state_restores_for_resume(request, tmp_path):
    adapter, path, x, cond = _setup(request, "sd3-5")
    apply_lora(adapter.transformer, 4, 8, ["attn.to_q", "attn.to_v"])
    _perturb(adapter.transformer, seed=1)
    tuned = _v(adapter, x, cond)
    save_lora(adapter.pipeline_class, adapter.transformer, tmp_path)

    resumed, _, _, _ = _setup(request, "sd3-5")
    apply_lora(resumed.transformer, 4, 8, ["attn.to_q", "attn.to_v"])
    load_lora_state(resumed.transformer, tmp_path)
    torch.testing.assert_close(_v(resumed, x, cond), tuned, rtol=0, atol=0)

    other_alpha, _, _, _ = _setup(request, "sd3-5")
    apply_lora(other_alpha.transformer, 4, 16, ["attn.to_q", "attn.to_v"])
    with pytest.raises(ValueError, match="alpha 8.0.*alpha 16"):
        load_lora_state(other_alpha.transformer, tmp_path)

    other_targets, _, _, _ = _setup(request, "sd3-5")
    apply_lora(other_targets.transformer, 4, 8, ["attn.to_q"])
    with pytest.raises(ValueError, match="does not fit"):
        load_lora_state(other_targets.transformer, tmp_path)

    with pytest.raises(FileNotFoundError):
        load_lora_state(resumed.transformer, tmp_path / "missing")


def test_target_all_covers_every_linear_in_the_blocks_only(request):
    adapter, _, _, _ = _setup(request, "flux1")
    t = adapter.transformer
    apply_lora(t, 2, 2, "all")
    adapted = {n for n, m in t.named_modules() if hasattr(m, "lora_A")}
    for name, module in t.named_modules():
        if isinstance(module, nn.Linear) and "lora_" not in name and not name.endswith("base_layer"):
            in_blocks = name.startswith(("transformer_blocks.", "single_transformer_blocks."))
            assert (name in adapted) == in_blocks, name
    # both kinds of FLUX block and the modulation layers are included
    assert {"single_transformer_blocks.0.proj_mlp", "transformer_blocks.0.norm1.linear"} <= adapted
    assert "proj_out" not in adapted and "context_embedder" not in adapted


def test_target_module_errors(request):
    adapter, _, _, _ = _setup(request, "sd3-5")
    t = adapter.transformer
    with pytest.raises(ValueError, match=r"\['attn.to_qq', 'mlp'\].*'attn.to_q'"):
        apply_lora(t, 4, 4, ["attn.to_q", "attn.to_qq", "mlp"])
    with pytest.raises(ValueError, match="selects nothing"):
        apply_lora(t, 4, 4, [])
    assert not any("lora_" in n for n, _ in t.named_parameters())  # a failed call changes nothing
    with pytest.raises(ValueError, match="no ModuleList named"):
        block_linear_names(nn.Sequential(nn.Linear(2, 2)))
