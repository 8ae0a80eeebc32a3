"""Typed, validated run configuration: YAML + ``section.key=value`` overrides -> ``Config``.

Imports only pydantic and PyYAML, so a bad config is reported before torch or
diffusers load.
"""

from .errors import ConfigError
from .loader import load_config, load_config_for_cli, parse_config
from .rewards import RewardConfig
from .schema import Config
from .sections import DataConfig, EvalConfig, LogConfig, ModelConfig, SchedulerConfig
from .train import TrainConfig

__all__ = [
    "Config", "ConfigError", "DataConfig", "EvalConfig", "LogConfig", "ModelConfig", "RewardConfig",
    "SchedulerConfig", "TrainConfig", "load_config", "load_config_for_cli", "parse_config",
]
