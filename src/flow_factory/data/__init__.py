"""Prompt datasets and the per-epoch, group-aware prompt draw."""

from .prompts import (EpochDraw, EpochSampler, MissingPromptFile, PromptFileError, PromptItem, load_prompts,
                      process_share)

__all__ = ["EpochDraw", "EpochSampler", "MissingPromptFile", "PromptFileError", "PromptItem", "load_prompts",
           "process_share"]
