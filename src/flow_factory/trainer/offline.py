"""An epoch of an offline run (``sft``, ``offline-dpo``): a dataset's images or videos in place of rollouts.

Each epoch visits every record once, in an order drawn from ``(seed, epoch)`` (so a resumed run visits them
as the uninterrupted one), each process its contiguous share; on N processes the last ``records % N`` of an
epoch's order wait for another epoch, so that every process trains as many micro-batches. A record's output
images (a video model: the first ``num_frames`` frames of its videos) are resized to the training size and
encoded by the model's VAE (``encode_media``) once, on first use, and kept on the CPU: they never change. A
record's input (prompt, condition images or video) is encoded once per epoch (once per run with the prompt and
condition caches) and shared by its outputs: a pair's two sides see the same conditioning. What an epoch hands
the shared optimisation loop is what a rollout would: ``Rollouts`` whose final latents are the outputs' (the
decoupled algorithms train on the forward process from them), the conditioning, and the advantages: 1 for a
demonstration; +1 for the chosen and -1 for the rejected side of a preference pair, a record making a group of
two, so that DPO's best-and-worst pair is the record's own.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from PIL import Image

from ..data import process_share
from ..data.media import MediaFile, read_image, read_video
from ..data.offline import OfflineRecord
from ..models.conditioning import cat_cond, index_cond, resized_images
from ..sampling import Rollouts, SamplingSettings, encode_batch
from ..seeding import generator


class OfflineEpochs:
    def __init__(self, records: list[OfflineRecord], adapter, settings: SamplingSettings, seed: int):
        self.records, self.adapter, self.settings, self.seed = records, adapter, settings, seed
        self._latents: dict[int, torch.Tensor] = {}  # record -> (outputs, *latent), float32 on the CPU

    def __len__(self) -> int:
        return len(self.records)

    def epoch(self, epoch: int, rank: int, processes: int, autocast, prompt_cache=None,
              condition_cache=None) -> tuple[Rollouts, torch.Tensor]:
        """This process's share of epoch ``epoch``: its samples (a record's outputs consecutive, one group a
        record) and their advantages."""
        order = torch.randperm(len(self.records), generator=generator("offline", self.seed, epoch))
        # as a distributed loader dropping the last uneven part: every process trains as many micro-batches
        order = order[:len(order) - len(order) % processes]
        mine = order[process_share(len(order), rank, processes)].tolist()
        s, outputs = self.settings, len(self.records[0].outputs)
        rows = [self.records[r].item for r in mine]
        items = [item for item in rows for _ in range(outputs)]
        x0 = torch.cat([self.latents(r) for r in mine]) if mine else torch.empty(0)
        # each row's input encoded once, its outputs sharing it
        conds = [encode_batch(self.adapter, rows[i:i + s.batch_size], s, autocast, prompt_cache, condition_cache)[1]
                 for i in range(0, len(rows), s.batch_size)]
        sigmas = self.adapter.sigmas(s.num_steps, s.height, s.width, s.num_frames).float()
        final = len(sigmas) - 1
        rollouts = Rollouts(prompts=[it.prompt for it in items],
                            group_ids=torch.tensor(mine, dtype=torch.long).repeat_interleave(outputs),
                            latents=x0.unsqueeze(1), log_probs=torch.zeros(len(items), final), sigmas=sigmas,
                            sde_steps=[], media=torch.empty(0),
                            cond=index_cond(cat_cond(conds), [i for i in range(len(rows)) for _ in range(outputs)])
                            if conds else {},
                            latent_steps=[final], rewards={}, generated=self.adapter.generated(x0[:1]) if mine else None)
        signs = torch.tensor([1.0] if outputs == 1 else [1.0, -1.0])  # chosen, rejected
        return rollouts, signs.repeat(len(mine)).to(self.adapter.device)

    def latents(self, record: int) -> torch.Tensor:
        """(outputs, *latent): record ``record``'s images or videos at the training size, encoded (once)."""
        if record not in self._latents:
            s = self.settings
            r = self.records[record]
            media = torch.stack([self.pixels(f, frames) for f, frames
                                 in zip(r.outputs, r.frames or [None] * len(r.outputs))])
            # a model with sound (LTX-2) encodes each video with its soundtrack
            sound = {"sounds": list(r.sounds)} if getattr(self.adapter, "has_audio", False) else {}
            latents = self.adapter.encode_media(media, **sound)
            expected = self.adapter.latent_shape(s.height, s.width, s.num_frames)
            if tuple(latents.shape[1:]) != tuple(expected):
                raise RuntimeError(f"{type(self.adapter).__name__}.encode_media gave latents of shape "
                                   f"{tuple(latents.shape[1:])}; its samples are {tuple(expected)}")
            self._latents[record] = latents.float().cpu()
        return self._latents[record].to(self.adapter.device)

    def pixels(self, file: MediaFile, frames: tuple[int, ...] | None) -> torch.Tensor:
        """An output at the training size, in [0, 1]: an image (3, H, W), or a video model's (F, 3, H, W), the
        file's ``frames`` (data/offline.py chose them and checked that the file has them)."""
        if not self.adapter.is_video:
            return self._resized([read_image(file)])[0]
        video = read_video(file, max(frames) + 1)  # decoded no further than the last frame that trains
        return self._resized([video[i] for i in frames])

    def _resized(self, stills: list[Image.Image]) -> torch.Tensor:
        """(k, 3, H, W) in [0, 1] at the training size, resized as the pipeline resizes an input image or video (its
        image or video processor, as Flow-Factory encodes a target); Pillow's bicubic for a pipeline without one."""
        s, pipeline = self.settings, getattr(self.adapter, "pipeline", None)
        processor = getattr(pipeline, "video_processor", None) or getattr(pipeline, "image_processor", None)
        if processor is not None:
            return resized_images(processor, [[im.convert("RGB") for im in stills]], s.height, s.width).images[0]
        return torch.stack([torch.from_numpy(np.asarray(im.convert("RGB").resize(
            (s.width, s.height), Image.Resampling.BICUBIC)).copy()).permute(2, 0, 1).float() / 255 for im in stills])


def offline_optimize_settings(settings, train, records: int, num_processes: int, num_timesteps: int):
    """``settings`` (``OptimizeSettings``) with an offline epoch's accumulation: a pass over the dataset, this
    process's share of the ``records`` in micro-batches of ``num_timesteps`` drawn timesteps each, makes
    ``gradient_step_per_epoch`` optimizer steps (or ``gradient_accumulation_steps`` micro-steps each)."""
    if isinstance(train.gradient_accumulation_steps, int):
        return replace(settings, accumulation=train.gradient_accumulation_steps)
    mine = records // num_processes  # OfflineEpochs.epoch's share
    micro = -(-mine // train.per_device_batch_size) * num_timesteps
    return replace(settings, accumulation=max(1, micro // train.gradient_step_per_epoch))
