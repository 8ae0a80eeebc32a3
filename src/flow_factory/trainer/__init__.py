"""The training loop and what it writes: checkpoints, logs, sample grids, reward curves."""

import gc as _gc

# The import below loads about 4000 modules (torch._dynamo, transformers, diffusers, peft), and while it does, the
# cyclic garbage collector would scan the growing heap in full about 4 times: 0.56 CPU s of a 5 s start. Its young
# generations still run (short-lived garbage is freed as before: pausing them all raised a run's peak RSS by 6 MB);
# only the full collections wait, for the next one the usual rule brings after the import.
_gc_thresholds = _gc.get_threshold()
_gc.set_threshold(_gc_thresholds[0], _gc_thresholds[1], 1 << 30)
try:
    from .trainer import Trainer
finally:
    _gc.set_threshold(*_gc_thresholds)

__all__ = ["Trainer"]
