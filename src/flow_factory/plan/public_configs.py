"""The architectures of the public checkpoints our examples name, for planning without their files.

A hub id's ``model_index.json`` and each component's ``config.json`` are not on a machine that has not
downloaded them, and ``ff-train --plan`` reaches no network. These are those files' numbers, written
here by hand from the model cards and released configs (the numbers that set a network's size and its
call's cost; scheduler settings, which change neither, are left to the class's defaults). Each entry
is a model_index: ``component: [library, class, config]``, and its plain keys (``boundary_ratio``).

Held by tests (tests/test_plan.py): FLUX.1-dev's transformer at 11.9 B parameters, Qwen-Image's at 20.4 B,
Wan2.1 14B's at 14.3 B (the hub's counts); FLUX.2 [dev]'s at 32 B, FLUX.2 [klein] 9B's at 9 B and 4B's at 4 B,
HunyuanVideo-1.5's at 8.3 B, LTX-2's at 19 B, Z-Image's at 6 B (the makers' rounded figures). Those five
transformers' configs were checked against diffusers' conversion scripts (``scripts/convert_flux2_to_diffusers.py``
``flux2-dev``, ``klein-9b`` and ``klein-4b``, ``convert_hunyuan_video1_5_to_diffusers.py`` ``480p_t2v``,
``convert_ltx2_to_diffusers.py``, whose connectors, VAEs and vocoder configs are the classes' defaults used
here) and, for Z-Image, its released ``transformer/config.json`` as other projects quote it. The rest (text
encoders, VAEs, the Wan2.2 and Qwen-Image-Edit variants) are the released configs as we know them, not
checked against the files: a local folder's own config.json always wins over this table. The undistilled
bases FLUX.2 [klein] Base 4B and 9B and Z-Image share their distilled siblings' networks (the makers' cards);
the klein bases' model_index has ``is_distilled`` false, so the plan counts its CFG pair. Wan's image-to-video
transformers are the released configs (Wan2.2 A14B's as diffusers' conversion script writes it; Wan2.1's at
the hub's 16.4 B, a test counting both against Wan2.1 T2V 14B's by hand), its image encoder CLIP ViT-H/14.
"""

from __future__ import annotations

# --- text encoders --------------------------------------------------------------------------
CLIP_L_TEXT = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
               "max_position_embeddings": 77, "vocab_size": 49408, "projection_dim": 768, "hidden_act": "quick_gelu"}
CLIP_G_TEXT = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 20,
               "max_position_embeddings": 77, "vocab_size": 49408, "projection_dim": 1280, "hidden_act": "gelu"}
T5_XXL = {"d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24, "vocab_size": 32128,
          "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32}
UMT5_XXL = {**T5_XXL, "vocab_size": 256384, "tie_word_embeddings": False}
BYT5_SMALL = {"d_model": 1472, "d_ff": 3584, "d_kv": 64, "num_heads": 6, "num_layers": 12, "vocab_size": 384,
              "feed_forward_proj": "gated-gelu"}
QWEN25_VL_7B_TEXT = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                     "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                     "rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6}}
QWEN25_VL_7B = {"text_config": QWEN25_VL_7B_TEXT,
                "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                                  "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                                  "temporal_patch_size": 2, "window_size": 112,
                                  "fullatt_block_indexes": [7, 15, 23, 31]}}
QWEN3_4B = {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True}
QWEN3_8B = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False}
MISTRAL_SMALL_31 = {  # Mistral-Small-3.1-24B, FLUX.2 [dev]'s text encoder
    "text_config": {"model_type": "mistral", "hidden_size": 5120, "intermediate_size": 32768, "num_hidden_layers": 40,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 131072},
    "vision_config": {"model_type": "pixtral", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                      "num_attention_heads": 16, "head_dim": 64, "image_size": 1540, "patch_size": 14}}
GEMMA3_12B = {  # LTX-2's text encoder
    "text_config": {"hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
                    "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 262208},
    "vision_config": {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
                      "image_size": 896, "patch_size": 14}}
CLIP_H_VISION = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 16,
                 "image_size": 224, "patch_size": 14, "hidden_act": "gelu"}

# --- VAEs -----------------------------------------------------------------------------------
_KL_BLOCKS = {"in_channels": 3, "out_channels": 3, "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2,
              "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
              "norm_num_groups": 32, "sample_size": 1024}
FLUX_VAE = {**_KL_BLOCKS, "latent_channels": 16, "scaling_factor": 0.3611, "shift_factor": 0.1159,
            "use_quant_conv": False, "use_post_quant_conv": False}
SD3_VAE = {**FLUX_VAE, "scaling_factor": 1.5305, "shift_factor": 0.0609}
WAN_VAE = {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
           "temperal_downsample": [False, True, True]}
WAN22_VAE = {"base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
             "temperal_downsample": [False, True, True], "is_residual": True, "in_channels": 12, "out_channels": 12,
             "patch_size": 2, "scale_factor_spatial": 16, "scale_factor_temporal": 4,
             # the decode un-normalises by these, one per latent channel (the class's defaults are Wan2.1's 16)
             "latents_mean": [-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542,
                              0.2813, 0.0891, 0.157, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109,
                              0.2665, -0.2108, -0.2158, 0.2502, -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899,
                              -0.2799, -0.123, -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.052, 0.3748,
                              0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667],
             "latents_std": [0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.499, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894,
                             1.0901, 0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146,
                             0.8986, 0.5659, 0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709,
                             0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.06, 0.3943, 0.5537,
                             0.5444, 0.4089, 0.7468, 0.7744]}

# --- denoising transformers -----------------------------------------------------------------
FLUX1_DEV = {"patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
             "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768,
             "guidance_embeds": True, "axes_dims_rope": [16, 56, 56]}
SD35_MEDIUM = {"sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 24, "attention_head_dim": 64,
               "num_attention_heads": 24, "joint_attention_dim": 4096, "caption_projection_dim": 1536,
               "pooled_projection_dim": 2048, "out_channels": 16, "pos_embed_max_size": 384,
               "dual_attention_layers": list(range(13)), "qk_norm": "rms_norm"}
WAN_14B = {"patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
           "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
           "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024}
WAN_14B_I2V = {**WAN_14B, "in_channels": 36}  # the noise, the first frame's latents and its mask, stacked
WAN21_14B_I2V = {**WAN_14B_I2V, "image_dim": 1280, "added_kv_proj_dim": 5120}  # Wan2.1's: CLIP states too
WAN_1_3B = {**WAN_14B, "num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30}
WAN22_5B = {**WAN_14B, "num_attention_heads": 24, "ffn_dim": 14336, "num_layers": 30, "in_channels": 48,
            "out_channels": 48}
QWEN_IMAGE = {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
              "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False,
              "axes_dims_rope": [16, 56, 56]}
Z_IMAGE = {"all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16, "dim": 3840, "n_layers": 30,
           "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30, "norm_eps": 1e-5, "qk_norm": True,
           "cap_feat_dim": 2560, "rope_theta": 256.0, "t_scale": 1000.0, "axes_dims": [32, 48, 48],
           "axes_lens": [1536, 512, 512]}
FLUX2_DEV = {"in_channels": 128, "num_layers": 8, "num_single_layers": 48, "attention_head_dim": 128,
             "num_attention_heads": 48, "joint_attention_dim": 15360, "mlp_ratio": 3.0,
             "axes_dims_rope": [32, 32, 32, 32], "guidance_embeds": True}
FLUX2_KLEIN_9B = {**FLUX2_DEV, "num_single_layers": 24, "num_attention_heads": 32, "joint_attention_dim": 12288,
                  "guidance_embeds": False}
FLUX2_KLEIN_4B = {**FLUX2_KLEIN_9B, "num_layers": 5, "num_single_layers": 20, "num_attention_heads": 24,
                  "joint_attention_dim": 7680}  # three of Qwen3-4B's layers' states, 3 x 2560
HUNYUAN15_T2V = {"in_channels": 65, "out_channels": 32, "num_attention_heads": 16, "attention_head_dim": 128,
                 "num_layers": 54, "num_refiner_layers": 2, "mlp_ratio": 4.0, "patch_size": 1, "patch_size_t": 1,
                 "qk_norm": "rms_norm", "text_embed_dim": 3584, "text_embed_2_dim": 1472, "image_embed_dim": 1152,
                 "rope_axes_dim": [16, 56, 56], "target_size": 640, "task_type": "t2v"}
LTX2 = {"in_channels": 128, "out_channels": 128, "num_attention_heads": 32, "attention_head_dim": 128,
        "cross_attention_dim": 4096, "audio_in_channels": 128, "audio_out_channels": 128,
        "audio_num_attention_heads": 32, "audio_attention_head_dim": 64, "audio_cross_attention_dim": 2048,
        "num_layers": 48, "caption_channels": 3840}

# diffusers' convert_ltx2_to_diffusers.py: the video VAE's compression ratios are not its class's defaults (those
# derive 16 frames per latent frame from the block types; LTX-2 packs 8), the rest are written out as the script does
LTX2_VIDEO_VAE = {"latent_channels": 128, "block_out_channels": [256, 512, 1024, 2048],
                  "decoder_block_out_channels": [256, 512, 1024], "layers_per_block": [4, 6, 6, 2, 2],
                  "decoder_layers_per_block": [5, 5, 5, 5], "patch_size": 4, "patch_size_t": 1,
                  "encoder_causal": True, "decoder_causal": False, "spatial_compression_ratio": 32,
                  "temporal_compression_ratio": 8}
LTX2_AUDIO_VAE = {"base_channels": 128, "output_channels": 2, "ch_mult": [1, 2, 4], "num_res_blocks": 2,
                  "in_channels": 2, "latent_channels": 8, "norm_type": "pixel", "causality_axis": "height",
                  "mid_block_add_attention": False, "sample_rate": 16000, "mel_hop_length": 160, "is_causal": True,
                  "mel_bins": 64, "double_z": True}
LTX2_CONNECTORS = {"caption_channels": 3840, "text_proj_in_factor": 49, "video_connector_num_attention_heads": 30,
                   "video_connector_attention_head_dim": 128, "video_connector_num_layers": 2,
                   "video_connector_num_learnable_registers": 128, "audio_connector_num_attention_heads": 30,
                   "audio_connector_attention_head_dim": 128, "audio_connector_num_layers": 2,
                   "audio_connector_num_learnable_registers": 128}

_FLOW = ["diffusers", "FlowMatchEulerDiscreteScheduler", {}]


def _flux1(pipeline: str) -> dict:
    return {"_class_name": pipeline, "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler",
                                                   {"use_dynamic_shifting": True, "shift": 3.0}],
            "text_encoder": ["transformers", "CLIPTextModel", CLIP_L_TEXT],
            "text_encoder_2": ["transformers", "T5EncoderModel", T5_XXL],
            "transformer": ["diffusers", "FluxTransformer2DModel", FLUX1_DEV],
            "vae": ["diffusers", "AutoencoderKL", FLUX_VAE]}


def _wan(transformer: dict, vae: dict = WAN_VAE, experts: int = 1, **extra) -> dict:
    index = {"_class_name": "WanPipeline", "scheduler": ["diffusers", "UniPCMultistepScheduler", {"flow_shift": 5.0}],
             "text_encoder": ["transformers", "UMT5EncoderModel", UMT5_XXL],
             "transformer": ["diffusers", "WanTransformer3DModel", transformer],
             "vae": ["diffusers", "AutoencoderKLWan", vae], "boundary_ratio": None, **extra}
    if experts == 2:
        index.update(transformer_2=["diffusers", "WanTransformer3DModel", transformer], boundary_ratio=0.875)
    return index


def _wan_i2v(transformer: dict, experts: int = 1) -> dict:
    """WanImageToVideoPipeline: Wan2.1's with the CLIP ViT-H/14 image encoder, Wan2.2 A14B's two experts without
    (its boundary 0.9)."""
    index = {**_wan(transformer, experts=experts), "_class_name": "WanImageToVideoPipeline"}
    if experts == 1:
        index["image_encoder"] = ["transformers", "CLIPVisionModel", {**CLIP_H_VISION, "projection_dim": 1024}]
    else:
        index["boundary_ratio"] = 0.9
    return index


def _qwen_image(pipeline: str) -> dict:
    return {"_class_name": pipeline, "scheduler": _FLOW,
            "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration", QWEN25_VL_7B],
            "transformer": ["diffusers", "QwenImageTransformer2DModel", QWEN_IMAGE],
            "vae": ["diffusers", "AutoencoderKLQwenImage", WAN_VAE]}


def _z_image() -> dict:
    return {"_class_name": "ZImagePipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler", {"shift": 3.0}],
            "text_encoder": ["transformers", "Qwen3Model", QWEN3_4B],
            "transformer": ["diffusers", "ZImageTransformer2DModel", Z_IMAGE],
            "vae": ["diffusers", "AutoencoderKL", FLUX_VAE]}


def _flux2_klein(transformer: dict, text_encoder: dict, is_distilled: bool) -> dict:
    return {"_class_name": "Flux2KleinPipeline", "scheduler": _FLOW, "is_distilled": is_distilled,
            "text_encoder": ["transformers", "Qwen3ForCausalLM", text_encoder],
            "transformer": ["diffusers", "Flux2Transformer2DModel", transformer],
            "vae": ["diffusers", "AutoencoderKLFlux2", {}]}


PUBLIC_PIPELINES: dict[str, dict] = {
    "black-forest-labs/FLUX.1-dev": _flux1("FluxPipeline"),
    "black-forest-labs/FLUX.1-Kontext-dev": _flux1("FluxKontextPipeline"),
    "stabilityai/stable-diffusion-3.5-medium": {
        "_class_name": "StableDiffusion3Pipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler",
                                                                 {"shift": 3.0}],
        "text_encoder": ["transformers", "CLIPTextModelWithProjection", CLIP_L_TEXT],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection", CLIP_G_TEXT],
        "text_encoder_3": ["transformers", "T5EncoderModel", T5_XXL],
        "transformer": ["diffusers", "SD3Transformer2DModel", SD35_MEDIUM],
        "vae": ["diffusers", "AutoencoderKL", SD3_VAE]},
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": _wan(WAN_14B),
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": _wan(WAN_1_3B),
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": _wan(WAN_14B, experts=2),
    "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers": _wan_i2v(WAN21_14B_I2V),
    "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers": _wan_i2v(WAN21_14B_I2V),
    "Wan-AI/Wan2.2-I2V-A14B-Diffusers": _wan_i2v(WAN_14B_I2V, experts=2),
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers": _wan(WAN22_5B, WAN22_VAE, expand_timesteps=True),
    "Qwen/Qwen-Image": _qwen_image("QwenImagePipeline"),
    "Qwen/Qwen-Image-2512": _qwen_image("QwenImagePipeline"),
    "Qwen/Qwen-Image-Edit-2509": _qwen_image("QwenImageEditPlusPipeline"),
    "Qwen/Qwen-Image-Edit-2511": _qwen_image("QwenImageEditPlusPipeline"),
    "Tongyi-MAI/Z-Image-Turbo": _z_image(),
    "Tongyi-MAI/Z-Image": _z_image(),  # the undistilled base: the Turbo's 6.15 B S3-DiT, encoder and VAE
    "black-forest-labs/FLUX.2-dev": {
        "_class_name": "Flux2Pipeline", "scheduler": _FLOW,
        "text_encoder": ["transformers", "Mistral3ForConditionalGeneration", MISTRAL_SMALL_31],
        "transformer": ["diffusers", "Flux2Transformer2DModel", FLUX2_DEV],
        "vae": ["diffusers", "AutoencoderKLFlux2", {}]},
    "black-forest-labs/FLUX.2-klein-9B": _flux2_klein(FLUX2_KLEIN_9B, QWEN3_8B, is_distilled=True),
    # the bases: the same networks not step- or guidance-distilled, so sampling runs the CFG pair
    "black-forest-labs/FLUX.2-klein-base-9B": _flux2_klein(FLUX2_KLEIN_9B, QWEN3_8B, is_distilled=False),
    "black-forest-labs/FLUX.2-klein-4B": _flux2_klein(FLUX2_KLEIN_4B, QWEN3_4B, is_distilled=True),
    "black-forest-labs/FLUX.2-klein-base-4B": _flux2_klein(FLUX2_KLEIN_4B, QWEN3_4B, is_distilled=False),
    "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v": {
        "_class_name": "HunyuanVideo15Pipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler",
                                                               {"shift": 5.0}],
        "guider": ["diffusers", "ClassifierFreeGuidance", {"guidance_scale": 6.0}],
        "text_encoder": ["transformers", "Qwen2_5_VLTextModel", QWEN25_VL_7B_TEXT],
        "text_encoder_2": ["transformers", "T5EncoderModel", BYT5_SMALL],
        "transformer": ["diffusers", "HunyuanVideo15Transformer3DModel", HUNYUAN15_T2V],
        "vae": ["diffusers", "AutoencoderKLHunyuanVideo15", {}]},
    "Lightricks/LTX-2": {
        "_class_name": "LTX2Pipeline", "scheduler": _FLOW,
        "text_encoder": ["transformers", "Gemma3ForConditionalGeneration", GEMMA3_12B],
        "connectors": ["ltx2", "LTX2TextConnectors", LTX2_CONNECTORS],
        "transformer": ["diffusers", "LTX2VideoTransformer3DModel", LTX2],
        "vae": ["diffusers", "AutoencoderKLLTX2Video", LTX2_VIDEO_VAE],
        "audio_vae": ["diffusers", "AutoencoderKLLTX2Audio", LTX2_AUDIO_VAE],
        "vocoder": ["ltx2", "LTX2Vocoder", {}]},
}

# the reward models our built-in rewards load by default: CLIPModel configs
PUBLIC_MODELS: dict[str, list] = {
    "openai/clip-vit-large-patch14": ["transformers", "CLIPModel", {
        "text_config": CLIP_L_TEXT, "projection_dim": 768,
        "vision_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                          "num_attention_heads": 16, "image_size": 224, "patch_size": 14, "hidden_act": "quick_gelu"}}],
    "yuvalkirstain/PickScore_v1": ["transformers", "CLIPModel", {  # CLIP ViT-H/14
        "text_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                        "num_attention_heads": 16, "vocab_size": 49408, "hidden_act": "gelu"},
        "vision_config": CLIP_H_VISION, "projection_dim": 1024}],
}
