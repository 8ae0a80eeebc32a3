"""The reward server: serve any reward over HTTP (``ff-reward-server``).

Imports neither torch nor the training stack: a ``RewardServer`` subclass that does not
need them runs in an environment with only ``pip install 'flow_factory[server]'``'s
dependencies (FastAPI, uvicorn, pydantic, Pillow). The JSON it speaks is
``flow_factory.wire``, which the remote rewards import too; ``flow_factory.rewards`` is
imported only by ``model_server``, when the served reward is a reward model.
"""

from .base import RewardServer

__all__ = ["RewardServer"]
