"""``ff-train`` on several processes for the tests, without paying a fresh interpreter's imports per process.

A real launch (``python -m flow_factory.train ... --num_processes 2``) starts four interpreters: the
user's, ``accelerate launch``'s and one per process, and each imports torch, diffusers, transformers
and peft again (about 9 s of CPU each here, most of a tiny run). ``ff_train_forked`` runs the same
code in the same order, with processes forked from a server that imported those libraries once
(multiprocessing's forkserver, which never runs a torch op, so its children start clean):

- the user's process runs ``flow_factory.train.main(argv)`` (config, start checks, the launch
  command, the report of a failed launch) in the environment the test gives it;
- its launch command runs ``flow_factory.launcher.main`` (accelerate's own ``launch_command``, which
  sets every variable of the backend's launch, ZeRO's and FSDP's included) in that same process;
- where accelerate hands over to torchrun (``torch.distributed.run.run``), the processes are forked
  from there with the variables torchrun's agent sets, each running ``flow_factory.train.main`` on the
  arguments torchrun would pass. One failing process stops the others (SIGTERM, as torchelastic does)
  and reaches ``launcher.main`` as torchelastic's ``ChildFailedError``.

What this leaves out is torchrun's agent (its rendezvous store: process 0 hosts the store instead, as
under a plain ``env://`` start) and the fresh interpreter; ``tests/test_train_cli.py`` and
``tests/test_start_checks.py`` launch for real. The server's imports read the suite's environment as
it was when this module was imported (``SUITE_ENVIRON``): a launch whose environment changes what an
import reads (``HF_HOME``, ``HF_HUB_OFFLINE``) is a real launch.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

SUITE_ENVIRON = dict(os.environ)
# what every tiny run imports before its first step; a module missing here costs each process its import
PRELOAD = ["torch", "torch.distributed.run", "accelerate", "accelerate.commands.launch", "transformers",
           "diffusers", "peft", "flow_factory.train", "flow_factory.trainer", "flow_factory.launcher",
           "flow_factory.models.sd3", "flow_factory.models.wan", "diffusers.pipelines.stable_diffusion_3", "diffusers.pipelines.wan",
           "helpers_rewards",
           # every run draws its reward curves; DeepSpeed's engine imports its Muon module, which calls
           # torch.compile at import (torch._inductor: 3 to 7 s a process here). One not installed is skipped.
           "matplotlib.figure", "matplotlib.backends.backend_agg", "deepspeed",
           "deepspeed.runtime.zero.muon.muon_optimizer"]

_server = None


def preloaded_forkserver():
    """multiprocessing's forkserver context, its server started (once) with ``PRELOAD`` imported. The server
    is one per process (multiprocessing keeps one), so every test that forks from it shares it:
    ``mp.start_processes(..., start_method="forkserver")`` after this call forks from the same one."""
    global _server
    if _server is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        here = dict(os.environ)
        os.environ.clear()
        os.environ.update(SUITE_ENVIRON)  # the server starts, and imports, in the suite's environment
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(here)
        _server = context
    return _server


def ff_train_forked(argv: list, env: dict, timeout: float = 300) -> tuple[tuple[str, str], int]:
    """``python -m flow_factory.train ARGV`` in ``env``: ((stdout, stderr), exit status)."""
    with tempfile.TemporaryDirectory(prefix="ff-forked-") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        user = preloaded_forkserver().Process(target=_user_process, args=([str(a) for a in argv], dict(env), os.getcwd(),
                                                                 str(out), str(err)))
        user.start()
        user.join(timeout)
        if user.exitcode is None:  # the whole launch: the user's process leads a process group of its own
            _signal_group(user.pid, signal.SIGUSR1)  # every process of it prints where each of its threads is
            time.sleep(2)
            _signal_group(user.pid, signal.SIGKILL)
            user.join()
            raise TimeoutError(f"ff-train {' '.join(map(str, argv))} ran past {timeout} s; its stderr, with each "
                               f"process's threads at the timeout:\n{err.read_text()[-12000:]}")
        return (out.read_text(), err.read_text()), user.exitcode


def call_forked(target, *args, env: dict | None = None, timeout: float = 300) -> tuple[int, str]:
    """``target(*args)`` in a process of its own, forked from the preloaded server (what a fresh ``python``
    would run, without its imports), in ``env`` (default: this process's environment): its exit status
    (negative for a signal's, as ``subprocess``'s) and what it printed."""
    with tempfile.TemporaryDirectory(prefix="ff-forked-") as folder:
        output = Path(folder, "output")
        process = preloaded_forkserver().Process(target=_in_environment,
                                                 args=(dict(env or os.environ), str(output), target, args))
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise TimeoutError(f"{target.__name__}{args} ran past {timeout} s:\n{output.read_text()[-4000:]}")
        return process.exitcode, output.read_text()


def _in_environment(env, output, target, args):
    for fd in (1, 2):
        os.dup2(os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND), fd)
    os.environ.clear()
    os.environ.update(env)
    target(*args)


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:  # the group has ended (or not yet begun: the user's process forms it first thing)
        pass


def _user_process(argv, env, cwd, out, err):
    os.setpgrp()
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), fd)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # ff_train_forked's timeout asks where it hangs
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    import subprocess

    subprocess.call = _launch_here  # this process is the test's alone: ff-train's one launch comes here
    from flow_factory.train import main

    sys.exit(main(argv))


def _launch_here(command, env):
    """``python -m flow_factory.launcher ARGS`` in this process, torchrun's part forked (``_fork_processes``)."""
    assert command[1:3] == ["-m", "flow_factory.launcher"], command
    import torch.distributed.run

    from flow_factory import launcher

    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["accelerate launch", *command[3:]]
    torch.distributed.run.run = _fork_processes
    try:
        launcher.main()
    except SystemExit as stop:
        return stop.code or 0
    return 0


def _fork_processes(args):
    """torchrun ``args`` (a static rendezvous at ``master_addr:master_port``): one forked process a local
    rank, in the environment accelerate set plus torchrun's variables."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    from torch.distributed.run import parse_min_max_nnodes

    assert args.module and args.training_script == "flow_factory.train", (args.module, args.training_script)
    local, (_, machines) = int(args.nproc_per_node), parse_min_max_nnodes(args.nnodes)
    machine = int(args.node_rank)
    # one machine: --master_addr/--master_port; several: the static rendezvous endpoint "host:port"
    address, port = (args.master_addr, args.master_port) if args.master_port else args.rdzv_endpoint.rsplit(":", 1)
    processes = {}
    for local_rank in range(local):
        rank = machine * local + local_rank
        variables = {"RANK": rank, "LOCAL_RANK": local_rank, "GROUP_RANK": machine, "ROLE_RANK": rank,
                     "WORLD_SIZE": local * machines, "LOCAL_WORLD_SIZE": local, "GROUP_WORLD_SIZE": machines,
                     "ROLE_WORLD_SIZE": local * machines, "ROLE_NAME": "default",
                     "MASTER_ADDR": address or "127.0.0.1", "MASTER_PORT": port,
                     "TORCHELASTIC_RESTART_COUNT": 0, "TORCHELASTIC_MAX_RESTARTS": 0}
        process = multiprocessing.get_context("fork").Process(
            target=_launched_process, args=({k: str(v) for k, v in variables.items()}, list(args.training_script_args)))
        process.start()
        processes[process.sentinel] = (rank, local_rank, process)

    failures = {}
    while processes:
        for sentinel in multiprocessing.connection.wait(list(processes)):
            rank, local_rank, process = processes.pop(sentinel)
            process.join()
            if process.exitcode != 0:
                failures[rank] = ProcessFailure(local_rank, process.pid, process.exitcode, "")
                for _, _, other in processes.values():  # torchelastic stops the rest of a failed launch
                    _stop(other)
    if failures:
        raise ChildFailedError(name="flow_factory.train", failures=failures)


def _launched_process(variables: dict, argv: list):
    os.environ.update(variables)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from flow_factory.train import main

    sys.exit(main(argv))


def _stop(process, grace: float = 30.0):
    """SIGTERM, and SIGKILL ``grace`` seconds later if it still runs (torchelastic's order)."""
    process.terminate()
    timer = threading.Timer(grace, lambda: process.is_alive() and process.kill())
    timer.daemon = True
    timer.start()
