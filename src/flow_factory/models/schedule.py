"""The sigmas of the pipelines whose schedule shifts with the resolution (FLUX.1, Qwen-Image, Z-Image, LTX-2)."""

from __future__ import annotations

from torch import Tensor


def shifted_sigmas(pipeline, num_steps: int, image_seq_len: int, grid, device) -> Tensor:
    """The sigmas of the pipelines with a resolution-dependent shift (FLUX.1, Qwen-Image, Z-Image):
    their default ``grid`` (None: the scheduler's own) through a fresh copy of their scheduler, with
    ``mu`` interpolated from the number of image tokens as they do; the scheduler applies it when its
    config has ``use_dynamic_shifting``."""
    # diffusers' own mu (FLUX.1's copy; Qwen-Image's and Z-Image's are the same), imported here: a
    # pipeline module is seconds to import, and most runs never call this
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    scheduler = type(pipeline.scheduler).from_config(pipeline.scheduler.config)
    config = scheduler.config
    mu = calculate_shift(
        image_seq_len,
        config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5), config.get("max_shift", 1.15),
    )
    scheduler.set_timesteps(num_steps, device="cpu", sigmas=grid, mu=mu)
    return scheduler.sigmas.float().to(device)
