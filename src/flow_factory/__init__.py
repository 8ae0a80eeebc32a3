"""Flow-Factory: reinforcement-learning fine-tuning of flow-matching image and video models."""

__version__ = "0.1.0"
