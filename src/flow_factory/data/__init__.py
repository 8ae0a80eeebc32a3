"""Prompt datasets (with the condition files of conditioned models) and the per-epoch, group-aware
prompt draw."""

from .media import MediaError, MediaFile, read_image, read_video
from .prompts import (EpochDraw, EpochSampler, MissingPromptFile, PromptFileError, PromptItem, load_prompts,
                      process_share, share_slice)
from .sources import WeightedEpochSampler, epoch_sampler, load_sources

__all__ = ["EpochDraw", "EpochSampler", "MediaError", "MediaFile", "MissingPromptFile", "PromptFileError",
           "PromptItem", "WeightedEpochSampler", "epoch_sampler", "load_prompts", "load_sources", "process_share",
           "read_image", "read_video", "share_slice"]
