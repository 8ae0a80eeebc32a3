"""A finished multi-process run ends its gloo process group without deadlocking, whatever its last collective left.

The mechanism (docs/experiments/collectives.md, torch 2.13 on gloo): a gloo worker thread that lets go of a
collective's tensors last (its last moments with a finished collective, a barrier's hold on the collectives before
it, or one still in flight) must take the GIL to do it, as they are tensors Python has seen. When DDP's reducer is
the group's last holder, freeing the reducer destroys the group holding the GIL, and the group's destructor joins
that worker: a deadlock. ``test_eval_share`` hung so now and then (the reducer of the trainer its processes built,
freed as their function returned, after they had destroyed the group).

Two processes force it: a ``Reducer`` (the one DDP builds) holds the group, and an all_gather is still in flight,
its tensors dropped by Python (process 1 joins it late). The project's order, the holder gone and then
``backends.end_process_group``, ends; the other order (the group destroyed, then the reducer freed) hangs on
process 0: the scenario does reach the deadlock, so the first half is not passing by luck."""

import gc
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers_launch import preloaded_forkserver

LATE = 1.0  # how late process 1 joins the all_gather, seconds
HANG = 4.0  # a process still running this long after both started and process 1 joined is hung


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _process(rank: int, port: int, folder: str, holder_first: bool) -> None:
    """A group held by a reducer, an all_gather in flight whose tensors Python dropped, then the group's end."""
    import torch.distributed as dist

    from flow_factory.trainer.backends import end_process_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    Path(folder, f"started{rank}").touch()
    params = list(torch.nn.Linear(4, 4).parameters())
    # what DDP's wrapper builds and holds: it holds the group from C++ and frees it without releasing the GIL
    holders = [dist.Reducer(params, [list(range(len(params)))], [1 << 20], dist.group.WORLD)]
    if rank == 1:  # joins late, and waits for the all_gather
        time.sleep(LATE)
    tensors = [torch.empty(1 << 12) for _ in range(2)], torch.full((1 << 12,), float(rank))
    dist.all_gather(*tensors, async_op=rank == 0)
    if rank == 0:  # the handle and the tensors go at once: gloo's worker holds their last references till 1 joins
        del tensors
    if holder_first:  # ff-train's order (train.train): the run's objects, then the group
        holders.clear()
        end_process_group()
    else:  # the order test_eval_share had: the group destroyed while the reducer still held it
        dist.destroy_process_group()
        holders.clear()  # the reducer freed: ~ProcessGroupGloo, holding the GIL, joins the worker that needs it
        gc.collect()
    Path(folder, f"ended{rank}").write_text(str(_gloo_workers()))


def _gloo_workers() -> int:
    """This process's gloo worker threads (one set per live process group; Linux names them)."""
    threads = Path("/proc/self/task").iterdir()
    return sum(Path(thread, "comm").read_text().strip() == "pt_gloo_runloop" for thread in threads)


def _run(folder: Path, holder_first: bool) -> dict[int, int]:
    """The processes that ended, each with the gloo worker threads it had left (the others, still running LATE +
    HANG s after both started, are killed)."""
    folder.mkdir()
    preloaded_forkserver()  # forked from the suite's server: torch and the package imported there once
    start = time.monotonic()
    context = mp.start_processes(_process, args=(_port(), str(folder), holder_first), nprocs=2, join=False,
                                 start_method="forkserver")
    started, ended = {}, {}
    while len(ended) < 2 and time.monotonic() - start < 120:
        started.update({r: time.monotonic() for r in range(2)
                        if r not in started and (folder / f"started{r}").exists()})
        ended.update({r: int(text) for r in range(2) if (text := _read(folder / f"ended{r}"))})
        if len(started) == 2 and time.monotonic() > max(started.values()) + LATE + HANG:
            break
        time.sleep(0.05)
    for process in context.processes:
        if process.is_alive():
            process.kill()
        process.join()
    return ended


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_the_group_ends_after_its_holders_though_a_gather_is_pending(tmp_path):
    ended = _run(tmp_path / "holder_first", holder_first=True)
    assert ended.keys() == {0, 1}, f"process(es) {sorted({0, 1} - ended.keys())} hung ending the group"
    # the group was destroyed there and then (its workers joined), with the all_gather still pending on process 0
    assert ended == {0: 0, 1: 0}


def test_the_group_destroyed_under_its_last_holder_deadlocks(tmp_path):
    """The control: with the group's last holder freed holding the GIL, process 0 never ends."""
    ended = _run(tmp_path / "group_first", holder_first=False)
    if 0 in ended:
        pytest.fail("no deadlock: this torch no longer needs the GIL to free a gloo collective's tensors in its "
                    "worker (or no longer destroys the group holding the GIL); the first test's scenario is moot")


def test_a_crashed_runs_trainer_is_gone_before_its_process_group_ends(monkeypatch, tmp_path):
    """ff-train's ``train``: a crash on its way to the report holds the Trainer in its traceback (its frames' ``self``);
    left so, its DDP reducer would end the group later, holding the GIL: the deadlock above, a crashed process that
    never exits. The traceback's frames are cleared first (their lines stay, for the report)."""
    import traceback
    import weakref

    import flow_factory.trainer
    from flow_factory import train
    from flow_factory.config import parse_config
    from flow_factory.trainer import backends
    from helpers_runs import tiny_run_config

    made, alive_at_the_end = [], []

    class Crashing:
        def train(self):
            raise RuntimeError("boom")

    def build(cfg):
        run = Crashing()
        made.append(weakref.ref(run))
        return run
    monkeypatch.setattr(flow_factory.trainer, "Trainer", build)
    monkeypatch.setattr(backends, "end_process_group", lambda: alive_at_the_end.append(made[0]() is not None))
    cfg = parse_config(tiny_run_config(tmp_path, "sd3-5", tmp_path / "model"))
    with pytest.raises(RuntimeError, match="boom") as crash:
        train.train(cfg, "config.yaml")
    assert alive_at_the_end == [False]
    assert 'raise RuntimeError("boom")' in "".join(traceback.format_exception(crash.value))
