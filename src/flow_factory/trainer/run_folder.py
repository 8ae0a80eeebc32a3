"""The folder of one run (``log.save_dir/log.run_name``), claimed before any model loads.

Claiming it checks what would otherwise fail after hours of training, and keeps two runs
from mixing their files:
- the folder can be created and written (a probe file, ``run.json``, says who runs in it);
- a folder that already holds a run (anything but ``run.json`` and ``.lock``) is never
  reused silently: only a resume from one of its own checkpoints continues in it, and
  ``log.overwrite: true`` replaces it, but only once the new run has started: until then
  the old run waits in ``.replaced/`` and comes back if the new one fails (or, killed, at the
  next claim of the folder), so a run that never started destroys nothing;
- a resume from an older checkpoint of the same folder, with later ones beside it, is
  refused: its next saves would overwrite them (resume into a new ``log.run_name``);
- ``.lock`` is held with ``flock`` while the run lives, so a second process that tries the
  same folder is told which process has it. The kernel drops the lock when the process
  dies, so a killed run never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from ..checkpoint import checkpoint_epoch, list_checkpoints, write_atomic

LOCK_FILE = ".lock"
INFO_FILE = "run.json"
REPLACED = ".replaced"  # the run log.overwrite replaces, kept until the new run has started


class RunFolderError(RuntimeError):
    """The run folder cannot be used; the message says why and what to do instead."""


class RunFolder:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = None

    def claim(self, resume_from: Path | None = None, resumed_epoch: int = 0, overwrite: bool = False) -> None:
        """Create (or take over) the folder and lock it; ``RunFolderError`` when it cannot be used.

        ``resume_from``: the checkpoint folder the run resumes from (``resumed_epoch`` epochs done)."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunFolderError(f"log.save_dir: cannot create the run folder {self.path} ({e.strerror})") from None
        self._take_lock()
        self._restore_replaced()  # a run that set it aside died before it started
        # a run that wrote nothing but its run.json (stopped before its first log or save) is not kept
        held = [p.name for p in self.path.iterdir() if p.name not in (LOCK_FILE, INFO_FILE)]
        if held:
            self._check_reuse(held, resume_from, resumed_epoch, overwrite)
        try:
            write_atomic(self.path / INFO_FILE, json.dumps({
                "pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "command": sys.argv}, indent=1))
        except OSError as e:
            self.release()
            raise RunFolderError(f"log.save_dir: cannot write in {self.path} ({e.strerror})") from None

    def started(self) -> None:
        """The new run has started: the run ``log.overwrite`` replaced is deleted."""
        if self._lock is not None:
            shutil.rmtree(self.path / REPLACED, ignore_errors=True)

    def release(self) -> None:
        """Unlock the folder; a run set aside for a run that did not start (``started``) comes back first."""
        if self._lock is not None:
            self._restore_replaced()
            self._lock.close()  # closing the file drops the flock
            self._lock = None

    def _take_lock(self) -> None:
        try:
            handle = open(self.path / LOCK_FILE, "a+")
        except OSError as e:
            raise RunFolderError(f"log.save_dir: cannot write in {self.path} ({e.strerror})") from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise RunFolderError(f"log.run_name: {self.path} is in use by a live run ({self._owner()}); "
                                 "choose another log.run_name or wait for it to end") from None
        self._lock = handle

    def _restore_replaced(self) -> None:
        """Put back the run set aside in ``.replaced/``, over anything of the same name the run that never
        started wrote; an entry at a time, so that a restore cut short is finished by the next."""
        aside = self.path / REPLACED
        if not aside.is_dir():
            return
        for entry in aside.iterdir():
            target = self.path / entry.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
            entry.rename(target)
        aside.rmdir()

    def _owner(self) -> str:
        try:
            info = json.loads((self.path / INFO_FILE).read_text())
            return f"pid {info['pid']} on {info['host']}, started {info['started']}"
        except (OSError, ValueError, KeyError):
            return "owner unknown"

    def _check_reuse(self, held: list[str], resume_from: Path | None, resumed_epoch: int, overwrite: bool) -> None:
        inside = resume_from is not None and self.path.resolve() in Path(resume_from).resolve().parents
        if inside:
            later = [p.name for p in list_checkpoints(self.path) if checkpoint_epoch(p) > resumed_epoch]
            if later:
                self.release()
                raise RunFolderError(
                    f"model.resume_path: {resume_from} is older than {', '.join(later)} of the same run, which "
                    f"the resumed run would overwrite; resume into a new log.run_name to branch from it, or "
                    f"resume from the latest (model.resume_path: {self.path})")
            return
        if overwrite:  # set aside: renames within the folder, atomic each
            (self.path / REPLACED).mkdir()
            for name in held:
                (self.path / name).rename(self.path / REPLACED / name)
            return
        self.release()
        raise RunFolderError(
            f"log.run_name: {self.path} already holds a run ({', '.join(sorted(held)[:4])}); resume it with "
            f"model.resume_path={self.path}, choose another log.run_name, or set log.overwrite: true to replace it")


def from_main(accelerator, fn):
    """``fn()`` on the main process, its result (or its RunFolderError) on every process."""
    from accelerate.utils import broadcast_object_list

    result = error = None
    if accelerator.is_main_process:
        try:
            result = fn()
        except RunFolderError as e:
            error = str(e)
    if accelerator.num_processes > 1:
        result, error = broadcast_object_list([result, error])
    if error is not None:
        raise RunFolderError(error)
    return result
