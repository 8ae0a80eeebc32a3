"""The training loop and what it writes: checkpoints, logs, sample grids, reward curves."""

from .trainer import Trainer

__all__ = ["Trainer"]
