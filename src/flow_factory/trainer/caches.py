"""The run's preprocessing (``data.enable_preprocess``): every prompt encoded once (``PromptCache``), and a
conditioned model's condition files encoded once for the sizes train and eval prepare them at
(``ConditionCache``); then the text encoders may leave the device (``data.text_encoders_after_preprocess``)."""

from __future__ import annotations

from ..prompt_cache import ConditionCache, PromptCache
from ..eval_sampling import eval_guidance, eval_settings
from ..sampling import SamplingSettings


def cache_share(cfg, accelerator) -> dict:
    """Who builds the caches: the processes of each machine into its own cache_dir (local), or all of them into a
    shared one (global); each encodes its share of what is missing."""
    acc = accelerator
    local = cfg.data.preprocess_parallelism == "local"
    share = ((acc.local_process_index, acc.num_processes // cfg.num_machines, acc.is_local_main_process)
             if local else (acc.process_index, acc.num_processes, acc.is_main_process))
    return dict(force=cfg.data.force_reprocess, share=share, barrier=acc.wait_for_everyone)


def build_prompt_cache(cfg, accelerator, adapter, data) -> PromptCache | None:
    """Every train and test prompt (``data``: the run's ``RunData``) at the guidance scale it is sampled with (a test
    prompt's dataset may have its own); None where the model's text encoder reads the conditions (the condition
    cache holds its text)."""
    if not cfg.data.enable_preprocess or adapter.text_reads_conditions:
        return None
    train_scale = cfg.train.conditioning_guidance_scale
    items = ([(it.prompt, it.negative_prompt, train_scale) for it in data.train_prompts]
             + [(it.prompt, it.negative_prompt, eval_guidance(cfg, it.dataset)) for it in data.test_prompts])
    with accelerator.autocast():  # as the rollout would encode them
        cache = PromptCache.build(adapter, items, cfg.data.cache_dir, cfg.data.preprocessing_batch_size,
                                  **cache_share(cfg, accelerator))
    adapter.release_text_encoders(cfg.data.text_encoders_after_preprocess)
    return cache


def build_condition_cache(cfg, accelerator, adapter, data, train_settings: SamplingSettings) -> ConditionCache | None:
    """A conditioned model's condition files, for train's geometry (``train_settings``) and eval's (each test
    prompt's dataset's: its own eval resolution)."""
    if not cfg.data.enable_preprocess or not adapter.condition_inputs:
        return None
    train = train_settings.geometry
    test = {name: eval_settings(cfg, name, size).geometry for name, size in data.eval_sizes.items()}
    # the guidance scale each split's prompts are encoded at: what a model whose text encoder reads the conditions
    # encodes them with here
    requests = ([(it, train, cfg.train.conditioning_guidance_scale) for it in data.train_prompts]
                + [(it, test[it.dataset], eval_guidance(cfg, it.dataset)) for it in data.test_prompts])
    with accelerator.autocast():  # as the rollout would encode them
        cache = ConditionCache.build(adapter, requests, cfg.data.cache_dir, cfg.data.preprocessing_batch_size,
                                     **cache_share(cfg, accelerator))
    if adapter.text_reads_conditions:  # every prompt is encoded in it, with its conditions
        adapter.release_text_encoders(cfg.data.text_encoders_after_preprocess)
    return cache
