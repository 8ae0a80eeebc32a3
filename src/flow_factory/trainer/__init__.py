"""The training loop and what it writes: checkpoints, logs, sample grids, reward curves."""

import gc as _gc

# The import below loads about 4000 modules (torch._dynamo, transformers, diffusers, peft) and, while it does, the
# cyclic garbage collector would scan the growing heap about 4 times in full: 0.56 CPU s of a 5 s start. Paused,
# then one full collection (the import's cyclic garbage freed at once), it costs about a third of that.
_gc_was_enabled = _gc.isenabled()
_gc.disable()
try:
    from .trainer import Trainer
finally:
    if _gc_was_enabled:
        _gc.enable()
        _gc.collect()

__all__ = ["Trainer"]
