"""Flow-Factory's module path of the remote rewards, which its guide's YAML names
(``reward_model: flow_factory.rewards.my_reward_remote.RemotePointwiseRewardModel``).

The same classes as ``flow_factory.rewards.remote``: one entry may name either path. They
speak this project's ``/score`` and Flow-Factory's ``/compute`` (``protocol: auto`` by default,
see ``remote.py``), so a server written for Flow-Factory serves them unchanged.
"""

from .remote import RemoteGroupwiseRewardModel, RemotePointwiseRewardModel

__all__ = ["RemoteGroupwiseRewardModel", "RemotePointwiseRewardModel"]
