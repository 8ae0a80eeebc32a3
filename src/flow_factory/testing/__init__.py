"""Tiny random models for offline tests: public, for your tests as much as the project's.

They have the real models' classes and layout at a few hundred kilobytes, so a test of
your own reward, config or model adapter runs ff-train's real code paths in seconds on a
CPU, with nothing downloaded::

    from flow_factory.testing import build_tiny_pipeline

    path = build_tiny_pipeline("sd3-5", tmp_path / "sd3")  # a diffusers folder for model_name_or_path

``tiny_pipeline(model_type)`` gives the pipeline in memory; ``build_tiny_clip(path)`` writes
a CLIPModel and processor, for rewards built on CLIP, ``build_tiny_clap(path)`` a ClapModel and
processor, for rewards of a soundtrack. The project's own fixtures (a toy
2-D flow, example reward servers) are in the repository's bench/ and tests/, not here.
"""

from .tiny import TINY_MODEL_TYPES, TINY_VARIANTS, build_tiny_pipeline, tiny_pipeline
from .tiny_clap import build_tiny_clap
from .tiny_clip import build_tiny_clip

__all__ = ["TINY_MODEL_TYPES", "TINY_VARIANTS", "build_tiny_clap", "build_tiny_clip", "build_tiny_pipeline",
           "tiny_pipeline"]
