"""``ff-train --plan``: memory per GPU and time per epoch of a config, from its configs alone.

``build`` puts a plan together, ``pipeline`` builds the networks on the meta device (``public_configs``: the
hub checkpoints' configs), ``conditioning`` makes one call's inputs, ``measure`` counts FLOPs and memory on
the model's own code, ``evaluation`` finds the eval's parts and sizes, ``memory`` splits it by phase and
backend, ``fit`` finds the change that fits, ``gpus`` the GPUs, ``report`` the text and JSON.
"""

from .build import Plan, make_plan

__all__ = ["Plan", "make_plan"]
