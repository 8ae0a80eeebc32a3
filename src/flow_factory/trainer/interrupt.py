"""SIGINT / SIGTERM end a run with a checkpoint of its last finished epoch.

A signal only raises a flag. The loop reads it at the points where the weights are
those of a finished epoch (after eval, after sampling, after training), saves, and
raises ``TrainingInterrupted``; ``ff-train`` prints how to resume and exits with
128 + the signal number, as a shell reports a process killed by that signal. Reading
the flag there, rather than raising from the handler, keeps every process of a
distributed run at the same point: they agree on stopping through one all-reduce, so
no process is left waiting in a collective the others never join. A second signal
raises ``KeyboardInterrupt`` at once, for a user who does not want to wait for the
phase to end (the checkpoints already written stay complete).
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager

import torch

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(Exception):
    def __init__(self, signum: int, checkpoint):
        self.signum, self.checkpoint = signum, checkpoint
        super().__init__(f"interrupted by {signal.Signals(signum).name}; saved {checkpoint}")


class StopFlag:
    def __init__(self):
        self.signum: int | None = None

    @contextmanager
    def installed(self):
        """Handle SIGINT / SIGTERM inside the block (main thread only: Python delivers signals there)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        print(f"\nff-train: {signal.Signals(signum).name} received; saving the last finished epoch when this "
              "phase ends (send it again to stop at once without that save)", file=sys.stderr, flush=True)

    def raised(self, accelerator) -> bool:
        """Whether any process got a signal (every process gets the same answer)."""
        local = self.signum is not None
        if accelerator.num_processes == 1:
            return local
        flags = torch.tensor([self.signum or 0], device=accelerator.device)
        signum = int(accelerator.reduce(flags, reduction="sum").item())
        if signum and self.signum is None:
            self.signum = signal.SIGTERM  # another process was told to stop: stop as if terminated
        return bool(signum)
