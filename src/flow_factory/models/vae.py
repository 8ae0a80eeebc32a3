"""Latents to pixels and back, as the pipelines' VAEs do it: shared by the adapters whose VAEs scale and shift
(SD3, FLUX, HunyuanVideo-1.5) or normalise per channel (Wan, Qwen-Image)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor


@torch.no_grad()
def packed_2x2_pixel_factor(vae: Mapping, transformer: Mapping) -> int | None:
    """``pixel_factor_of`` for an AutoencoderKL whose 2x2 latents make one token (FLUX.1 and Z-Image): the
    VAE halves the size at each block after the first, and the tokens halve it again."""
    if "block_out_channels" not in vae:
        return None
    return 2 ** (len(vae["block_out_channels"]) - 1) * 2


def decode_image(vae, latents: Tensor, device) -> Tensor:
    """(B, 3, H, W) in [0, 1] from latents of a VAE with ``scaling_factor`` and ``shift_factor`` (SD3's and
    FLUX's), as their pipelines decode; (B, 3, F, H, W) from a video VAE's, whose shift may be absent
    (HunyuanVideo-1.5's)."""
    z = latents.to(device, vae.dtype) / vae.config.scaling_factor + (vae.config.get("shift_factor") or 0.0)
    image = vae.decode(z, return_dict=False)[0]
    return (image.float() / 2 + 0.5).clamp(0, 1)


@torch.no_grad()
def encode_image(vae, images: Tensor, device) -> Tensor:
    """``decode_image``'s inverse: the latents of (B, 3, H, W) images in [0, 1] (or (B, 3, F, H, W) videos for a
    video VAE), the VAE's mode (as the image-to-image pipelines encode), float32."""
    z = vae.encode((images * 2 - 1).to(device, vae.dtype)).latent_dist.mode()
    return (z.float() - (vae.config.get("shift_factor") or 0.0)) * vae.config.scaling_factor


@torch.no_grad()
def decode_normalized(vae, latents: Tensor, device) -> Tensor:
    """(B, 3, F, H, W) in [0, 1] from (B, C, F, h, w) latents of a VAE with per-channel ``latents_mean``
    and ``latents_std`` (Wan's, Qwen-Image's), as their pipelines decode."""
    z = latents.to(device, vae.dtype)
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(z.device, z.dtype)
    # the pipelines divide by 1/std rather than multiply by std; the same rounding here
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(z.device, z.dtype)
    video = vae.decode(z / inv_std + mean, return_dict=False)[0]
    return (video.float() / 2 + 0.5).clamp(0, 1)


@torch.no_grad()
def encode_normalized(vae, videos: Tensor, device) -> Tensor:
    """``decode_normalized``'s inverse: the (B, C, F', h, w) latents of (B, 3, F, H, W) videos in [0, 1], each
    encoded alone (the VAE is causal in time), its mode normalised per channel, as the Wan pipelines encode
    their input image or video; float32."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    latents = torch.cat([vae.encode((v[None] * 2 - 1).to(device, vae.dtype)).latent_dist.mode() for v in videos])
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents)
    return ((latents - mean) * inv_std).float()
