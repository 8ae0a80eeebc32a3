"""Helpers for tests, the demo and benchmarks: tiny offline pipelines."""

from .tiny import TINY_MODEL_TYPES, build_tiny_pipeline, tiny_pipeline

__all__ = ["TINY_MODEL_TYPES", "build_tiny_pipeline", "tiny_pipeline"]
