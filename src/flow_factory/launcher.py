"""``accelerate launch`` for ff-train, with one report of a failed launch.

A launched process leaves the message it stops with (an error, an interrupt's resume command)
in a folder the launch shares (``FF_ERROR_DIR``) instead of printing it, so that N processes
failing alike do not print it N times. Once the launch ends, ``ff-train`` prints the first
failing process's message as the last lines of the output. ``python -m flow_factory.launcher
ARGS`` is ``accelerate launch ARGS`` without torchelastic's failure summary, which names exit
codes where the process's own message says what went wrong; it records a process that died
without a message (a signal: out of memory, a kill) in the same folder.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ERROR_DIR = "FF_ERROR_DIR"


def report(message: str, code: int) -> int:
    """``message`` to stderr, or, in a launched process, to the launch's folder for ff-train to print once;
    returns ``code``, the process's exit status."""
    folder = os.environ.get(ERROR_DIR)
    if not folder:
        print(message, file=sys.stderr, flush=True)
        return code
    from .checkpoint import write_atomic  # here, not at the top: the launching process never reports

    rank = int(os.environ.get("RANK", "0"))
    record = {"rank": rank, "time": time.time(), "code": code, "message": message}
    write_atomic(Path(folder) / f"rank{rank}.json", json.dumps(record))  # whole or absent when ff-train reads it
    return code


def report_crash(error: BaseException) -> int:
    """An unexpected exception of a launched process: its traceback, recorded once (exit status 1)."""
    text = "".join(traceback.format_exception(error)).rstrip()
    return report(f"{text}\nff-train: crashed: {type(error).__name__}: {error}", 1)


def launched() -> bool:
    return ERROR_DIR in os.environ


def run(command: list[str], env: dict) -> int:
    """Run the launch ``command``; when it fails, print the first failing process's message last."""
    with tempfile.TemporaryDirectory(prefix="ff-train-launch-") as folder:
        code = subprocess.call(command, env={**env, ERROR_DIR: folder})
        if code == 0:
            return 0
        records = [json.loads(p.read_text()) for p in Path(folder).glob("*.json")]
    # a process's own message before the launcher's note of a death; then the earliest
    records.sort(key=lambda r: (r.get("from_launcher", False), r["time"]))
    if not records:
        print(f"ff-train: the launch failed (exit status {code}) before any process started", file=sys.stderr)
        return code
    first = records[0]
    others = sorted({r["rank"] for r in records} - {first["rank"]})
    also = f" (process{'es' if len(others) > 1 else ''} {', '.join(map(str, others))} stopped too)" if others else ""
    print(f"ff-train: process {first['rank']} stopped{also}:", file=sys.stderr)
    print(first["message"], file=sys.stderr, flush=True)
    return first["code"] or code


def main() -> None:
    """``accelerate launch`` with sys.argv; a failed process is recorded, not summarised."""
    from accelerate.commands.launch import main as accelerate_launch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # "failed (exitcode: 2) ..."
    sys.argv[0] = "accelerate launch"
    try:
        accelerate_launch()
    except ChildFailedError as failed:
        folder = Path(os.environ.get(ERROR_DIR, "."))
        for rank, failure in failed.failures.items():
            if (folder / f"rank{rank}.json").exists():
                continue
            how = (f"was killed by {failure.signal_name()}" if failure.exitcode < 0
                   else f"exited with status {failure.exitcode}")
            record = {"rank": rank, "time": failure.timestamp, "code": 1, "from_launcher": True,
                      "message": f"ff-train: process {rank} {how} without a message (out of memory, or killed)"}
            (folder / f"launcher-rank{rank}.json").write_text(json.dumps(record))
        sys.exit(1)


if __name__ == "__main__":
    main()
