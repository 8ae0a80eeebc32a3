"""Python's garbage collector in a process a Flow-Factory command owns (ff-train, ff-eval, ff-sample).

A run imports about 4000 modules (torch with ``torch._dynamo``, transformers, diffusers, peft): some 425 000
objects that live as long as the process. Python's cyclic collector scans every one of them at each full
collection, 0.22-0.25 CPU s each on a desktop CPU, several times before a run's first epoch and again whenever
the heap grows by a quarter. Yet after those imports it finds a few hundred unreachable objects, nothing more.

So a command, in a process of its own, holds off full collections from its start (young collections go on,
freeing short-lived garbage as usual) and, once its imports are done, freezes what they left (``gc.freeze``):
those objects are never scanned again, and later full collections scan the run's own objects alone.

Only a command's entry point calls :func:`start`. Importing Flow-Factory, or calling a command's ``main`` from a
notebook or a test runner, changes nothing: there the frozen objects would be the user's too, and those that
became cyclic garbage later would never be freed.
"""

from __future__ import annotations

import gc

_thresholds: tuple[int, int, int] | None = None  # the collector's thresholds before start(), until imports_done()


def start() -> None:
    """Hold off full collections: called first by a command that owns its process."""
    global _thresholds
    _thresholds = gc.get_threshold()
    gc.set_threshold(_thresholds[0], _thresholds[1], 1 << 30)


def imports_done() -> None:
    """Freeze the objects the imports left and give the collector its thresholds back; without start(), nothing."""
    global _thresholds
    if _thresholds is None:
        return
    gc.freeze()
    gc.set_threshold(*_thresholds)
    _thresholds = None
