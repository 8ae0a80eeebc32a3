"""Lossy feature caching of the rollouts (``train.rollout_cache``), through diffusers' own cache hooks.

A cache reuses a transformer's block outputs from one denoising step in the next when they barely change
(diffusers' FirstBlockCache, FasterCache, Pyramid Attention Broadcast, TaylorSeer, MagCache): rollouts get
cheaper, and slightly different from what the weights would compute. So only the decoupled algorithms may
use it (the config refuses it for grpo / grpo-guard / dppo, whose loss recomputes the rollout's own steps),
and only while sampling: ``RolloutCache.applied`` adds the hooks for the rollouts and removes them before
the training forward sees the transformer (and before evaluation: eval samples uncached, as ff-eval does).

Two things the diffusers pipelines do around their denoising loop, done here: each transformer call of a
step runs in a cache context of its own (``call0``, ``call1``, ...: a model that calls the transformer
twice a step for CFG keeps the conditional and unconditional branches' caches apart), and every
trajectory starts from an empty cache (``new_trajectory``). The timestep-aware policies read the step's
timestep (1000 sigma, as the pipelines' schedulers give it) from the call being made.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch

from .config import ConfigError

POLICIES = ("first_block", "faster", "pyramid", "taylorseer", "magcache")


def _policy(policy: str) -> tuple:
    """(diffusers' config class, its apply function, the names of the hooks it adds) of ``policy``."""
    from diffusers import hooks
    from diffusers.hooks import faster_cache, first_block_cache, mag_cache, pyramid_attention_broadcast
    from diffusers.hooks import taylorseer_cache

    return {
        "first_block": (hooks.FirstBlockCacheConfig, hooks.apply_first_block_cache,
                        (first_block_cache._FBC_LEADER_BLOCK_HOOK, first_block_cache._FBC_BLOCK_HOOK)),
        "faster": (hooks.FasterCacheConfig, hooks.apply_faster_cache,
                   (faster_cache._FASTER_CACHE_DENOISER_HOOK, faster_cache._FASTER_CACHE_BLOCK_HOOK)),
        "pyramid": (hooks.PyramidAttentionBroadcastConfig, hooks.apply_pyramid_attention_broadcast,
                    (pyramid_attention_broadcast._PYRAMID_ATTENTION_BROADCAST_HOOK,)),
        "taylorseer": (hooks.TaylorSeerCacheConfig, hooks.apply_taylorseer_cache,
                       (taylorseer_cache._TAYLORSEER_CACHE_HOOK,)),
        "magcache": (hooks.MagCacheConfig, hooks.apply_mag_cache,
                     (mag_cache._MAG_CACHE_LEADER_BLOCK_HOOK, mag_cache._MAG_CACHE_BLOCK_HOOK)),
    }[policy]


class RolloutCache:
    def __init__(self, policy: str, params: dict):
        """``policy`` (one of ``POLICIES``) and its diffusers config's keyword arguments (ConfigError naming
        ``train.rollout_cache_params`` for one the config does not take)."""
        self.policy, self.params = policy, dict(params)
        self.sigma, self.timestep = 1.0, torch.tensor(1000.0)  # the step being sampled (timestep-aware policies)
        cls, self._apply, self._hook_names = _policy(policy)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(self.params) - fields)
        if unknown:
            raise ConfigError(f"train.rollout_cache_params: {unknown} are not options of {policy} "
                              f"({cls.__name__}: {', '.join(sorted(fields - {'current_timestep_callback'}))})")
        extra = {"current_timestep_callback": lambda: self.timestep} if "current_timestep_callback" in fields else {}
        try:
            self.config = cls(**self.params, **extra)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"train.rollout_cache_params: {err}") from None
        self._calls = 0

    @classmethod
    def of(cls, train, adapter_cls) -> "RolloutCache | None":
        """The cache the ``train`` section asks for, or None; checked against the policies ``adapter_cls``'s
        transformer takes (before the model loads)."""
        if train.rollout_cache == "none":
            return None
        if train.rollout_cache not in adapter_cls.cache_policies:
            raise ConfigError(f"train.rollout_cache: {train.rollout_cache} does not work with "
                              f"{adapter_cls.model_type}'s transformer; its policies: "
                              f"{', '.join(adapter_cls.cache_policies)}")
        return cls(train.rollout_cache, train.rollout_cache_params)

    @contextmanager
    def applied(self, adapter):
        """The hooks on ``adapter``'s transformers while the block runs; none left after it, whatever happens.
        (The apply functions work on any transformer whose blocks diffusers knows, with or without its
        ``CacheMixin``: SD3's has none.)"""
        from diffusers.hooks.hooks import _set_cache_context

        networks = list(adapter.transformers.values())
        handles, velocity, own = [], adapter.velocity, "velocity" in vars(adapter)
        try:
            for net in networks:
                try:
                    self._apply(net, self.config)
                except IndexError:  # FirstBlockCache / MagCache take a first and a last block apart
                    raise ConfigError(f"train.rollout_cache: {self.policy} needs a transformer of two blocks or "
                                      f"more; {type(net).__name__} here has fewer") from None
                handles.append(net.register_forward_pre_hook(self._enter_call))

            def stepped(latents, sigma, cond, guidance_scale):
                self._calls, self.sigma = 0, float(torch.as_tensor(sigma).float().reshape(-1)[0])
                self.timestep = torch.tensor(1000 * self.sigma)
                return velocity(latents, sigma, cond, guidance_scale)

            adapter.velocity = stepped
            yield self
        finally:
            if own:
                adapter.velocity = velocity
            else:  # the class's method again, not a copy of it on the instance
                vars(adapter).pop("velocity", None)
            for handle in handles:
                handle.remove()
            for net in networks:
                _set_cache_context(net, None)
                registry = self._registry(net)
                for name in self._hook_names:
                    registry.remove_hook(name, recurse=True)
                registry.invalidate_child_registries_cache()

    def new_trajectory(self, adapter) -> None:
        """An empty cache for the next trajectory (the last one's states must not leak into it)."""
        for net in adapter.transformers.values():
            self._registry(net).reset_stateful_hooks(recurse=True)

    def _enter_call(self, module, args):
        from diffusers.hooks.hooks import CacheContext, _set_cache_context

        _set_cache_context(module, CacheContext(f"call{self._calls}", timestep=self.timestep, sigma=self.sigma))
        self._calls += 1

    @staticmethod
    def _registry(net):
        from diffusers.hooks import HookRegistry

        return HookRegistry.check_if_exists_or_initialize(net)


def cache_hooks(module: torch.nn.Module) -> list[str]:
    """The names of the cache hooks on ``module`` and its submodules (none outside ``RolloutCache.applied``)."""
    ours = {name for policy in POLICIES for name in _policy(policy)[2]}
    names = []
    for sub in module.modules():
        registry = getattr(sub, "_diffusers_hook", None)
        if registry is not None:
            names += [name for name in registry.hooks if name in ours]
    return names
