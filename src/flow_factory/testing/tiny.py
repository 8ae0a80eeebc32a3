"""Tiny, randomly initialised diffusers pipelines built from config, offline.

They have the real pipelines' structure (same classes, same text encoders and
tokenizers, same VAE layout and scheduler) at a few hundred kilobytes, so tests
(the project's and yours), ``make tiny-demo`` and the benchmarks exercise the real
code paths without downloading weights. Every build is seeded: the same call gives
the same weights, byte for byte, without touching the caller's global RNG.

Sizes that matter to callers: images 64x64 (latents 16x8x8; FLUX.1 Kontext's condition
images any size in multiples of 16, the pipeline called with ``max_area`` = height x width and
``_auto_resize=False`` to keep them); Wan videos of
``1 + 4k`` frames at multiples of 16 pixels (e.g. 5 frames at 32x32 -> latents
16x2x4x4). The Qwen tokenizers (Qwen-Image, Z-Image) have no merges: every byte is a
token, so a prompt with its chat template is a few hundred tokens.

Besides one pipeline per model type, ``TINY_VARIANTS`` names other checkpoints a model
type loads: Wan2.2's two-expert A14B layout (``wan2.2-a14b``: transformer and
transformer_2, boundary_ratio 0.875 as the T2V release; with shift 5 and 4 steps each
expert takes 2) and TI2V-5B (``wan2.2-ti2v-5b``: one timestep per token, the Wan2.2 VAE
with 48 latent channels, x16, so sizes in multiples of 32: 5 frames at 32x32 -> 48x2x2x2).
Wan image-to-video (``wan2_i2v``): Wan2.1's layout with a CLIP image encoder (32x32 input: 17
states an image), Wan2.1 first-last-frame-to-video's (``wan2.1-flf2v``: the same with the
transformer's ``pos_embed_seq_len`` 34, the two images' states, under a random position
embedding) and Wan2.2 I2V A14B's (``wan2.2-i2v-a14b``: two experts, boundary_ratio 0.9, no image
encoder; with shift 5 and 3 steps the first expert takes 1), latents as text-to-video's. Wan video-to-video
(``wan2_v2v``): text-to-video's Wan2.1 components in ``WanVideoToVideoPipeline``.
FLUX.2's latents are 2x2-patchified 32-channel ones (64x64 -> 128x4x4); ``flux2-klein`` is a
step-distilled Klein, ``flux2-klein-base`` the same weights as a base checkpoint
(``is_distilled`` false: classifier-free guidance). HunyuanVideo-1.5 (``hunyuanvideo15``): VAE x16 and x4
with 8 latent channels, 5 frames at 32x32 -> latents 8x2x2x2; at 25 MB (the transformer's ByT5
projection has a fixed 2048 width) and about 2000 text and image tokens a pipeline call, the slowest.
LTX-2 (``ltx2_t2av``) makes a video and its audio: its VAE is x8 in space and x2 in time, so
9 frames at 32x32 -> video latents 4x5x4x4 and, at 24 fps, 9 audio latent frames; the vocoder
turns them into about a third of a second of stereo 16 kHz audio; ``ltx2_i2av`` is the same weights in
``LTX2ImageToVideoPipeline`` (a condition image as the first frame). Qwen-Image-Edit-Plus
(``qwen-image-edit-plus``) is Qwen-Image's tiny model with a VL encoder that reads 4x4-pixel patches; its
``processor`` folder holds the image processor and tokenizer (no video processor, which needs torchvision), and
the pipeline resizes condition images to its module's ``VAE_IMAGE_SIZE`` / ``CONDITION_IMAGE_SIZE`` areas
(1024^2 and 384^2: tests shrink them to stay fast). Z-Image-Omni (``z-image-omni``) is Z-Image's tiny model with
the transformer's SigLIP branch and a SigLIP2 tower of 8x8 patches (the PIL image processor); its pipeline VAE-encodes
condition images in bfloat16 only, so a test that gives it some casts its VAE to bfloat16. Qwen-Image-2.1
(``qwen-image-2.1``): a VAE x16 of 16 latent channels that decodes RGBA, sizes in multiples of 32 (64x64 -> latents
16x4x4), Qwen3-VL with a ``processor`` folder as Qwen-Image-Edit-Plus's.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

TINY_MODEL_TYPES = ("sd3-5", "flux1", "wan2_t2v", "qwen-image", "z-image", "flux2", "flux2-klein", "hunyuanvideo15",
                    "ltx2_t2av", "ltx2_i2av", "flux1-kontext", "wan2_i2v", "wan2_v2v", "qwen-image-edit-plus",
                    "z-image-omni", "qwen-image-2.1")
# other tiny checkpoints, and the model_type that loads each
TINY_VARIANTS = {"wan2.2-a14b": "wan2_t2v", "wan2.2-ti2v-5b": "wan2_t2v", "flux2-klein-base": "flux2-klein",
                 "wan2.2-i2v-a14b": "wan2_i2v", "wan2.1-flf2v": "wan2_i2v"}

# CLIP's special tokens sit after the 2 x 256 byte symbols
_CLIP_BOS, _CLIP_EOS = 512, 513


def _byte_symbols() -> list[str]:
    """GPT-2's reversible byte -> printable unicode table, which CLIP's BPE expects."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, shifted = [], 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:  # control and blank bytes are moved above 255 so every byte has a visible symbol
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def tiny_clip_tokenizer():
    from transformers import CLIPTokenizer

    symbols = _byte_symbols()
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab.update({s + "</w>": 256 + i for i, s in enumerate(symbols)})
    vocab["<|startoftext|>"], vocab["<|endoftext|>"] = _CLIP_BOS, _CLIP_EOS
    # no merges: every character is one token, which is all a random model needs
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def tiny_t5_tokenizer():
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)]
    pieces += [(c, -2.0) for c in string.ascii_letters + string.digits + string.punctuation]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


# Qwen2 tokenizer specials: ChatML turns and the vision placeholders Qwen2.5-VL's config points at
_QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                  "<|video_pad|>"]
# the ChatML template Qwen3's tokenizer ships, without the thinking block a random model does not need
_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_qwen_tokenizer(chat_template: str | None = None):
    """Byte-level Qwen2 tokenizer: 256 byte symbols, ``<|endoftext|>`` (pad) and the specials."""
    from transformers import Qwen2Tokenizer

    tokenizer = Qwen2Tokenizer(vocab={s: i for i, s in enumerate(_byte_symbols())}, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": _QWEN_SPECIALS})
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


def _clip_config():
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=_CLIP_EOS + 1, hidden_size=32, intermediate_size=37, projection_dim=32,
        num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=77,
        bos_token_id=_CLIP_BOS, eos_token_id=_CLIP_EOS, pad_token_id=_CLIP_EOS,
    )


def _t5_kwargs(vocab_size: int) -> dict:
    return dict(
        vocab_size=vocab_size, d_model=32, d_kv=8, d_ff=37, num_layers=1, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )


def _image_vae():
    """x8 spatial, 16 latent channels, with SD3/FLUX's scaling and shift factors."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=16, norm_num_groups=4,
        use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159,
    )


def _build_sd3():
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection, T5EncoderModel, T5Config

    t5_tokenizer = tiny_t5_tokenizer()
    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=16, num_layers=1, attention_head_dim=8,
        num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
        pooled_projection_dim=64, out_channels=16, pos_embed_max_size=96,
    )
    torch.manual_seed(1)
    text_encoder = CLIPTextModelWithProjection(_clip_config())
    torch.manual_seed(2)
    text_encoder_2 = CLIPTextModelWithProjection(_clip_config())
    torch.manual_seed(3)
    text_encoder_3 = T5EncoderModel(T5Config(**_t5_kwargs(len(t5_tokenizer))))
    torch.manual_seed(4)
    vae = _image_vae()
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=text_encoder, tokenizer=tiny_clip_tokenizer(),
        text_encoder_2=text_encoder_2, tokenizer_2=tiny_clip_tokenizer(),
        text_encoder_3=text_encoder_3, tokenizer_3=t5_tokenizer,
    )


def _build_flux(pipeline: str = "FluxPipeline"):
    """FLUX.1, or FLUX.1 Kontext (``FluxKontextPipeline``: the same components)."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel, T5Config

    t5_tokenizer = tiny_t5_tokenizer()
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        guidance_embeds=True, axes_dims_rope=(4, 6, 6),
    )
    torch.manual_seed(1)
    text_encoder = CLIPTextModel(_clip_config())
    torch.manual_seed(2)
    text_encoder_2 = T5EncoderModel(T5Config(**_t5_kwargs(len(t5_tokenizer))))
    torch.manual_seed(3)
    vae = _image_vae()
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_image_seq_len=256, max_image_seq_len=4096,
        base_shift=0.5, max_shift=1.15,
    )
    return getattr(diffusers, pipeline)(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tiny_clip_tokenizer(),
        text_encoder_2=text_encoder_2, tokenizer_2=t5_tokenizer, transformer=transformer,
    )


def _wan_transformer(channels: int, in_channels: int | None = None, **image):
    """``in_channels`` 36 for image-to-video: the noisy latents, the 4-channel first-frame mask and the
    condition's latents; ``image``: Wan2.1 I2V's CLIP projection (image_dim, added_kv_proj_dim)."""
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=in_channels or channels,
        out_channels=channels, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=1,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32, **image,
    )


def _build_wan(variant: str = "wan2.1"):
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = tiny_t5_tokenizer()
    ti2v = variant == "wan2.2-ti2v-5b"
    torch.manual_seed(0)
    transformer = _wan_transformer(48 if ti2v else 16)
    torch.manual_seed(1)
    text_encoder = UMT5EncoderModel(UMT5Config(**_t5_kwargs(len(tokenizer))))
    torch.manual_seed(2)
    if ti2v:  # the Wan2.2 VAE's layout (residual, 2x2 pixel patches, 48 channels, x16) at base width 4
        channels = torch.arange(48) / 48
        vae = AutoencoderKLWan(
            base_dim=4, decoder_base_dim=8, z_dim=48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
            temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
            patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
            latents_mean=(0.2 * channels - 0.1).tolist(), latents_std=(0.5 + channels).tolist(),
        )
    else:
        vae = AutoencoderKLWan(
            base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        )
    experts = {}
    if variant == "wan2.2-a14b":
        torch.manual_seed(3)
        experts = dict(transformer_2=_wan_transformer(16), boundary_ratio=0.875)
    return WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), transformer=transformer,
        expand_timesteps=ti2v, **experts,
    )


def _build_wan_i2v(variant: str = "wan2.1"):
    """WanImageToVideoPipeline: Wan2.1 with a CLIP image encoder (its states reach the transformer's added
    key / value projections), its first-last-frame layout (``wan2.1-flf2v``: both images' states, told apart
    by a position embedding), or Wan2.2 A14B's layout (two experts, boundary_ratio 0.9, no image encoder)."""
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    parts = dict(_build_wan().components)
    torch.manual_seed(4)
    if variant in ("wan2.1", "wan2.1-flf2v"):
        flf2v = variant == "wan2.1-flf2v"
        # pos_embed_seq_len: the states of both images, 2 x (1 + (32 / 8) ** 2) of the CLIP below
        parts["transformer"] = _wan_transformer(16, 36, image_dim=16, added_kv_proj_dim=24,
                                                **({"pos_embed_seq_len": 34} if flf2v else {}))
        if flf2v:  # diffusers initialises it to zeros, under which the two images' order would not matter
            torch.nn.init.normal_(parts["transformer"].condition_embedder.image_embedder.pos_embed, std=0.5)
        parts["image_encoder"] = CLIPVisionModel(CLIPVisionConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32,
            patch_size=8, projection_dim=16))
        parts["image_processor"] = CLIPImageProcessor(size={"shortest_edge": 32},
                                                      crop_size={"height": 32, "width": 32})
        return WanImageToVideoPipeline(**parts)
    parts["transformer"], parts["transformer_2"] = _wan_transformer(16, 36), _wan_transformer(16, 36)
    return WanImageToVideoPipeline(**parts, image_encoder=None, image_processor=None, boundary_ratio=0.9)


def _build_wan_v2v():
    """WanVideoToVideoPipeline: text-to-video's Wan2.1 components (it takes no image encoder nor second expert)."""
    from diffusers import WanVideoToVideoPipeline

    parts = _build_wan().components
    return WanVideoToVideoPipeline(**{k: parts[k] for k in ("tokenizer", "text_encoder", "transformer", "vae",
                                                            "scheduler")})


def _build_qwen_image():
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = tiny_qwen_tokenizer()
    token = tokenizer.convert_tokens_to_ids
    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
    )
    torch.manual_seed(1)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, bos_token_id=None, eos_token_id=token("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id,
            rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e6},
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16,
                           fullatt_block_indexes=[0]),
        image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"),
    ))
    torch.manual_seed(2)
    # a latent mean and std that are not 0 and 1, so decoding without them shows
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.1 * (i - 8) for i in range(16)], latents_std=[0.5 + 0.1 * i for i in range(16)],
    )
    # Qwen-Image's own scheduler config: resolution-dependent exponential shift, stretched to end at 0.02
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_image_seq_len=256, max_image_seq_len=8192, base_shift=0.5,
        max_shift=0.9, shift_terminal=0.02, time_shift_type="exponential",
    )
    return QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)


def _build_qwen_image_edit_plus():
    """Qwen-Image's components in QwenImageEditPlusPipeline, with a vision tower that reads 4x4 patches (merged 2x2:
    one text token per 8x8 pixels) and an image processor to match (a 32x32 image: 16 tokens)."""
    from diffusers import QwenImageEditPlusPipeline
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor

    from ..models.qwen_image_edit import image_only_processor

    parts = _build_qwen_image().components
    config = parts["text_encoder"].config
    config.vision_config.patch_size = 4
    torch.manual_seed(3)
    text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    image_processor = Qwen2VLImageProcessor(patch_size=4, temporal_patch_size=2, merge_size=2,
                                            size={"shortest_edge": 8 * 8, "longest_edge": 64 * 64})
    return QwenImageEditPlusPipeline(**{k: parts[k] for k in ("scheduler", "vae", "tokenizer", "transformer")},
                                     text_encoder=text_encoder,
                                     processor=image_only_processor(image_processor, parts["tokenizer"]))


# Qwen3-VL's ChatML: a message's content is a string or a list of text parts (the pipeline counts its system
# prompt's tokens from the list form)
_CHATML_PARTS = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
                 "{{ m['content'] }}{% else %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _build_qwen_image21():
    """QwenImage21Pipeline: Qwen3-VL (one layer, width 16; a vision tower of 16x16 patches merged 2x2, one slot
    per 32x32 pixels as the VAE's 2x2 latents) behind an image-only Qwen3VLProcessor, a one-block transformer and
    an x16 VAE of 16 latent channels (the released one has 64) and four image channels (RGBA)."""
    from diffusers import (AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline,
                           QwenImage21Transformer2DModel)
    from transformers import Qwen2VLImageProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from ..models.qwen_image_edit import image_only_processor

    tokenizer = tiny_qwen_tokenizer(_CHATML_PARTS)
    token = tokenizer.convert_tokens_to_ids
    torch.manual_seed(0)
    transformer = QwenImage21Transformer2DModel(patch_size=1, in_channels=16, out_channels=16, num_layers=1,
                                                attention_head_dim=16, num_attention_heads=2, context_in_dim=16,
                                                axes_dims_rope=(4, 6, 6))
    torch.manual_seed(1)
    text_encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=8, bos_token_id=None,
                         eos_token_id=token("<|im_end|>"), pad_token_id=tokenizer.pad_token_id,
                         rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e6}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16,
                           patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[]),
        image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"),
    ))
    torch.manual_seed(2)
    vae = AutoencoderKLQwenImage21(
        base_dim=8, decoder_base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True, True],
        latents_mean=[0.1 * (i - 8) for i in range(16)], latents_std=[0.5 + 0.1 * i for i in range(16)],
    )
    image_processor = Qwen2VLImageProcessor(patch_size=16, temporal_patch_size=2, merge_size=2,
                                            size={"shortest_edge": 32 * 32, "longest_edge": 1024 * 1024})
    # Qwen-Image's scheduler config: a resolution-dependent exponential shift, stretched to end at 0.02
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_image_seq_len=256, max_image_seq_len=8192, base_shift=0.5,
        max_shift=0.9, shift_terminal=0.02, time_shift_type="exponential",
    )
    return QwenImage21Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, transformer=transformer,
                               processor=image_only_processor(image_processor, tokenizer, "Qwen3VLProcessor"))


def _build_z_image(omni: bool = False):
    """ZImagePipeline; ``omni``: ZImageOmniPipeline, the same parts with the transformer's SigLIP branch and a SigLIP2
    vision tower that reads 8x8 patches, at most 16 of them (a 64x64 condition image: a 4x4 grid)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = tiny_qwen_tokenizer(_CHATML)
    torch.manual_seed(0)
    transformer = ZImageTransformer2DModel(
        dim=32, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=16,
        axes_dims=[8, 4, 4], axes_lens=[1024, 64, 64], siglip_feat_dim=16 if omni else None,
    )
    with torch.no_grad():  # zeros (or uninitialised, in some diffusers versions); 1 makes padding visible
        for pad in ("x_pad_token", "cap_pad_token", "siglip_pad_token"):
            if getattr(transformer, pad, None) is not None:
                getattr(transformer, pad).fill_(1.0)
    torch.manual_seed(1)
    # the pipeline reads hidden_states[-2]: two layers
    text_encoder = Qwen3Model(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=8, pad_token_id=tokenizer.pad_token_id,
    ))
    torch.manual_seed(2)
    vae = _image_vae()  # Z-Image uses FLUX.1's VAE
    # Z-Image-Turbo's scheduler: a fixed shift of 3, no dynamic shifting
    parts = dict(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae, text_encoder=text_encoder,
                 tokenizer=tokenizer, transformer=transformer)
    if not omni:
        return ZImagePipeline(**parts)
    from diffusers import ZImageOmniPipeline
    from transformers import Siglip2VisionConfig, Siglip2VisionModel
    from transformers.models.siglip2.image_processing_pil_siglip2 import Siglip2ImageProcessorPil

    torch.manual_seed(3)
    siglip = Siglip2VisionModel(Siglip2VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, patch_size=8, num_patches=16))
    # transformers' PIL backend: the default one needs torchvision
    processor = Siglip2ImageProcessorPil(patch_size=8, max_num_patches=16)
    return ZImageOmniPipeline(**parts, siglip=siglip, siglip_processor=processor)


# FLUX.2 [dev]'s tokenizer is a PixtralProcessor, which needs torchvision; a plain tokenizer with
# Mistral's chat template (message contents as lists of text parts) encodes prompts the same way.
# Only prompt upsampling (caption_upsample_temperature) needs the processor.
_MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set text = message['content'] if message['content'] is string "
    "else message['content'] | map(attribute='text') | join('') %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}"
)


def tiny_mistral_tokenizer():
    from transformers import LlamaTokenizer

    specials = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]"]
    vocab = {s: i for i, s in enumerate(specials)}
    vocab.update({f"<0x{b:02X}>": len(specials) + b for b in range(256)})  # sentencepiece byte fallback
    for c in ["▁", *string.printable.strip()]:
        vocab.setdefault(c, len(vocab))
    return LlamaTokenizer(vocab=vocab, merges=[], add_bos_token=True, pad_token="<pad>",
                          extra_special_tokens=specials[4:], chat_template=_MISTRAL_CHAT_TEMPLATE)


def _flux2_parts(guidance_embeds: bool, text_width: int):
    """FLUX.2's transformer, VAE and scheduler; the transformer reads 3 stacked text-encoder layers."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    torch.manual_seed(0)
    transformer = Flux2Transformer2DModel(
        in_channels=128, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=3 * text_width, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=guidance_embeds,
    )
    torch.manual_seed(3)
    vae = AutoencoderKLFlux2(block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=32,
                             norm_num_groups=4, use_quant_conv=False, use_post_quant_conv=False)
    # batch-norm statistics other than (0, 1), so decoding without them would show
    vae.bn.running_mean.copy_(0.1 * torch.randn(vae.bn.running_mean.shape))
    vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape))
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, time_shift_type="exponential", shift=3.0,
        base_image_seq_len=256, max_image_seq_len=4096, base_shift=0.5, max_shift=1.15,
    )
    return transformer, vae, scheduler


def _build_flux2():
    from diffusers import Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tokenizer = tiny_mistral_tokenizer()
    transformer, vae, scheduler = _flux2_parts(guidance_embeds=True, text_width=16)
    torch.manual_seed(1)
    # 30 layers: the pipeline stacks the hidden states of layers 10, 20 and 30
    text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=30, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=8, image_size=32, patch_size=8),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
    ))
    return Flux2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                         transformer=transformer)


def _build_flux2_klein(is_distilled: bool = True):
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = tiny_qwen_tokenizer(_CHATML)  # Klein passes enable_thinking=False, which it ignores
    transformer, vae, scheduler = _flux2_parts(guidance_embeds=False, text_width=16)
    torch.manual_seed(1)
    # 27 layers: the pipeline stacks the hidden states of layers 9, 18 and 27
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=27,
        num_attention_heads=2, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id,
    ))
    return Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=transformer, is_distilled=is_distilled)


def _build_hunyuan_video15():
    """HunyuanVideo-1.5 at its smallest: 8 latent channels (the released VAE has 32; the VAE needs its last
    block at least twice as wide), x16 and x4 like the release. The transformer's ByT5 projection keeps
    a fixed 2048 width (17 MB) whatever the config."""
    from diffusers import (AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler,
                           HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel)
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    tokenizer, glyph_tokenizer = tiny_qwen_tokenizer(_CHATML), ByT5Tokenizer()
    torch.manual_seed(0)
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=2 * 8 + 1, out_channels=8, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_refiner_layers=1, mlp_ratio=2.0, text_embed_dim=16, text_embed_2_dim=32, image_embed_dim=16,
        rope_axes_dim=(2, 2, 4), target_size=32, task_type="t2v",
    )
    torch.manual_seed(1)
    # the pipeline reads hidden_states[-3]: three layers
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=2, bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e6},
    ))
    torch.manual_seed(2)
    text_encoder_2 = T5EncoderModel(T5Config(**_t5_kwargs(len(glyph_tokenizer))))
    torch.manual_seed(3)
    vae = AutoencoderKLHunyuanVideo15(latent_channels=8, block_out_channels=(8, 8, 8, 8, 16), layers_per_block=1)
    return HunyuanVideo15Pipeline(
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), text_encoder_2=text_encoder_2,
        tokenizer_2=glyph_tokenizer, guider=ClassifierFreeGuidance(guidance_scale=6.0),  # 480p T2V: shift 5, CFG 6
    )


def tiny_gemma_tokenizer():
    """A sentencepiece-style Gemma tokenizer: specials (Gemma3's image markers among them), byte fallback,
    ``▁`` and printable ASCII."""
    from transformers import GemmaTokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_image>", "<end_of_image>",
                "<image_soft_token>"]
    vocab = {s: i for i, s in enumerate(specials)}
    vocab.update({f"<0x{b:02X}>": len(specials) + b for b in range(256)})
    for c in ["▁", *string.printable.strip()]:
        vocab.setdefault(c, len(vocab))
    return GemmaTokenizer(vocab=vocab, merges=[], extra_special_tokens=specials[5:])


def _build_ltx2(pipeline_class: str = "LTX2Pipeline"):
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    tokenizer = tiny_gemma_tokenizer()
    torch.manual_seed(0)
    # video tokens of 4 channels (the VAE's latents, 1x1 patches); audio tokens of 4 = 1 audio latent
    # channel x 4 latent mel bins, as LTX-2's 128 = 8 x 16
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4,
        audio_cross_attention_dim=8, num_layers=1, caption_channels=16, rope_double_precision=False,
        rope_type="split",
    )
    torch.manual_seed(1)
    text_encoder = _tiny_gemma3(tokenizer)
    torch.manual_seed(2)
    connectors = LTX2TextConnectors(  # LTX-2.0's: one projection of the 3 stacked layers, then a connector each
        caption_channels=16, text_proj_in_factor=3, video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_double_precision=False,
        rope_type="split",
    )
    vae, audio_vae, vocoder = _ltx2_autoencoders_and_vocoder()
    # LTX-2's scheduler (diffusers' conversion script): resolution-dependent shift, stretched to end at 0.1
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
        max_image_seq_len=4096, shift_terminal=0.1,
    )
    return getattr(diffusers, pipeline_class)(
        scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=text_encoder, tokenizer=tokenizer,
        connectors=connectors, transformer=transformer, vocoder=vocoder)


def _tiny_gemma3(tokenizer):
    """LTX-2's text encoder, tiny: Gemma3 with two layers, one sliding and one full (the pipeline stacks
    every layer's hidden states). Seeded by the caller."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    token = tokenizer.convert_tokens_to_ids
    return Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8,
                         sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                         max_position_embeddings=1024, pad_token_id=0, eos_token_id=1, bos_token_id=2),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8),
        mm_tokens_per_image=4, boi_token_index=token("<start_of_image>"), eoi_token_index=token("<end_of_image>"),
        image_token_index=token("<image_soft_token>"),
    ))


def _ltx2_autoencoders_and_vocoder():
    """LTX-2's video VAE, audio VAE and vocoder, tiny, each seeded (3, 4, 5) as the pipeline's build always was."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
    from diffusers.pipelines.ltx2 import LTX2Vocoder

    torch.manual_seed(3)
    # 4x4 pixel patches, then one block halving space and time: x8, x2
    vae = AutoencoderKLLTX2Video(
        latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,), layers_per_block=(1, 1),
        decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False), downsample_type=("spatiotemporal",), upsample_residual=(False,),
        upsample_factor=(1,), patch_size=4, decoder_causal=False,
    )
    torch.manual_seed(4)
    # ch_mult (1, 2, 4): its encoder halves time and mel bins twice, the x4 the pipeline assumes (its
    # mel_compression_ratio), so that a soundtrack encodes to the latent the pipeline samples (offline training)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1, 2, 4), num_res_blocks=1, in_channels=2, resolution=32,
        latent_channels=1, mel_bins=16, sample_rate=16000, mel_hop_length=160,
    )
    # latent statistics other than (0, 1), so decoding without them would show
    for module in (vae, audio_vae):
        n = module.latents_mean.numel()
        module.latents_mean.copy_(0.1 * torch.arange(n) - 0.1)
        module.latents_std.copy_(0.5 + 0.25 * torch.arange(n))
    torch.manual_seed(5)
    # upsampling 10 x 4 x 4 = the mel hop length: one waveform sample per audio sample
    vocoder = LTX2Vocoder(
        in_channels=2 * 16, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[20, 8, 8],
        upsample_factors=[10, 4, 4], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
        output_sampling_rate=16000,
    )
    return vae, audio_vae, vocoder


_BUILDERS = {"sd3-5": _build_sd3, "flux1": _build_flux, "wan2_t2v": _build_wan, "qwen-image": _build_qwen_image,
             "z-image": _build_z_image, "flux2": _build_flux2, "flux2-klein": _build_flux2_klein,
             "hunyuanvideo15": _build_hunyuan_video15,
             "ltx2_t2av": _build_ltx2,
             "ltx2_i2av": lambda: _build_ltx2("LTX2ImageToVideoPipeline"),
             "flux2-klein-base": lambda: _build_flux2_klein(is_distilled=False),
             "wan2.2-a14b": lambda: _build_wan("wan2.2-a14b"), "wan2.2-ti2v-5b": lambda: _build_wan("wan2.2-ti2v-5b"),
             "flux1-kontext": lambda: _build_flux("FluxKontextPipeline"),
             "wan2_i2v": _build_wan_i2v, "wan2_v2v": _build_wan_v2v, "wan2.2-i2v-a14b": lambda: _build_wan_i2v("wan2.2"),
             "wan2.1-flf2v": lambda: _build_wan_i2v("wan2.1-flf2v"),
             "qwen-image-edit-plus": _build_qwen_image_edit_plus,
             "z-image-omni": lambda: _build_z_image(omni=True),
             "qwen-image-2.1": _build_qwen_image21}


def tiny_pipeline(model_type: str):
    """The tiny pipeline for ``model_type`` (or a name of ``TINY_VARIANTS``), in memory, float32."""
    if model_type not in _BUILDERS:
        raise ValueError(f"no tiny pipeline for model_type {model_type!r}; available: {sorted(_BUILDERS)}")
    # fork so that seeding the weights does not reset the caller's random stream
    with torch.random.fork_rng(devices=[]):
        return _BUILDERS[model_type]()


def build_tiny_pipeline(model_type: str, path) -> Path:
    """Build the tiny ``model_type`` pipeline (or a ``TINY_VARIANTS`` one) and save it to ``path`` (a diffusers
    folder)."""
    from ..precision import name_deepspeed_device

    name_deepspeed_device()  # save_pretrained imports DeepSpeed when it is installed
    path = Path(path)
    pipe = tiny_pipeline(model_type)
    processor = getattr(pipe, "processor", None)
    if processor is None:
        pipe.save_pretrained(path)
        return path
    # Qwen-Image-Edit-Plus, Qwen-Image-2.1: its processor folder as the released checkpoints have it (image
    # processor and tokenizer files; no video processor, which transformers cannot save or load without
    # torchvision), named Qwen2VLProcessor (Qwen3VLProcessor) in model_index.json as theirs is
    pipe.processor = None
    pipe.save_pretrained(path)
    processor.image_processor.save_pretrained(path / "processor")
    processor.tokenizer.save_pretrained(path / "processor")
    index = json.loads((path / "model_index.json").read_text())
    index["processor"] = ["transformers", type(processor).__base__.__name__]  # the real class, not image-only
    (path / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    return path
