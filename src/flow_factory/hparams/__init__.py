"""Flow-Factory's import path for argument classes, for rewards written to its guide.

Its reward guide writes ``from flow_factory.hparams import RewardArguments`` and types a
reward's ``__init__(self, config: RewardArguments, accelerator: Accelerator)``. Here that
class is the config's one reward entry, ``flow_factory.config.RewardConfig``: the keys of
``docs/config-reference.md`` (``batch_size``, ``device``, ``dtype``, ``model_name_or_path``,
...) are its attributes, and so is every other key the YAML entry carries
(``config.threshold`` for ``threshold: 0.5``; also ``config["threshold"]``).

Unlike Flow-Factory's, ``config.dtype`` and ``config.device`` stay as written (strings, or
None for the device): the reward's ``self.dtype`` / ``self.device`` are the torch objects.
Imports no torch, like the rest of the config.
"""

from ..config.rewards import RewardConfig as RewardArguments

__all__ = ["RewardArguments"]
