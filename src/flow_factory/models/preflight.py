"""Checks of the model source that need no model: run before anything loads.

``check_before_loading(cfg)`` is called by the Trainer before the pipeline loads, so a
wrong folder, a wrong ``model_type`` for it or a resolution the model cannot take is a
one-line error naming the key or file, not a traceback minutes into a load.
"""

from __future__ import annotations


def check_before_loading(cfg) -> None:
    """Raise ``ValueError`` naming the key or file when the model source cannot serve ``cfg``."""
