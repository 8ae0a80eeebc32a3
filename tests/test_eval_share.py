"""Evaluation on several processes scores every test prompt exactly once.

* The share rule (``data.share_slice``): contiguous shares, in process order, that hold every index once
  and differ in size by at most one, for any count and process count (fewer items than processes too);
  the training epoch's default layout (``process_share``) is the same rule.
* 3 gloo processes on a tiny SD3, started once: the Trainer's eval and ``ff-eval`` on 10 test prompts
  (shares of 4, 3, 3) and on 2 (1, 1 and an empty one) score each prompt once, on the process the rule
  names, with the per-prompt scores and the means of ``ff-eval`` on one process."""

import faulthandler
import json
import os
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import yaml
from helpers_launch import preloaded_forkserver
from helpers_runs import tiny_run_config, write_config
from test_train_cli import _free_port

from flow_factory.config import parse_config
from flow_factory.data import process_share, share_slice
from flow_factory.evaluate import main as ff_eval
from flow_factory.rewards.base import PointwiseRewardModel, RewardModelOutput
from flow_factory.trainer import Trainer
from flow_factory.trainer.backends import end_process_group

PROMPTS = ["a red circle", "a blue square", "a green triangle", "two yellow stars", "a purple cube",
           "a dog in the snow", "a cat on a mat", "a lake at dawn", "three cyan dots", "a house on a hill"]
COUNTS = (10, 2)  # 10 over 3 processes: 4, 3, 3; 2: 1, 1, 0
WORLD = 3
DEADLINE = 300  # seconds for the 3 processes
RECORD = "FF_TEST_EVAL_RECORD"  # the folder RecordedBrightness writes its calls to; unset: none
PHASE = "FF_TEST_EVAL_PHASE"  # which evaluation a call belongs to


class RecordedBrightness(PointwiseRewardModel):
    """The mean pixel value (smooth: batching changes it by rounding only), each call written down with its
    process and phase, so that the test sees which process scored which prompt, and how often."""

    required_fields = ("prompt", "image")
    use_tensor_inputs = True

    def __call__(self, prompt=None, image=None):
        scores = image.float().mean(dim=(1, 2, 3))
        if os.environ.get(RECORD):
            with open(Path(os.environ[RECORD]) / f"{os.environ['RANK']}.jsonl", "a") as f:
                f.writelines(json.dumps({"phase": os.environ[PHASE], "prompt": p, "score": s}) + "\n"
                             for p, s in zip(prompt, scores.tolist()))
        return RewardModelOutput(rewards=scores)


def test_the_shares_hold_every_index_once_and_differ_by_at_most_one():
    for processes in (1, 2, 3, 4, 5, 7, 8, 16):
        for n in range(0, 3 * processes + 2):  # fewer items than processes, as many, more, multiples
            shares = [share_slice(n, rank, processes) for rank in range(processes)]
            # contiguous, in process order: each index once
            assert [i for s in shares for i in range(n)[s]] == list(range(n)), (n, processes)
            sizes = [len(range(n)[s]) for s in shares]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True), (n, processes)
            for rank in range(processes):  # the training epoch's default layout is the same rule
                assert process_share(n, rank, processes).tolist() == list(range(n))[shares[rank]]
    assert [len(range(10)[share_slice(10, r, 3)]) for r in range(3)] == [4, 3, 3]
    assert [len(range(2)[share_slice(2, r, 3)]) for r in range(3)] == [1, 1, 0]


def test_the_lockstep_layout_still_refuses_an_epoch_that_does_not_fill_global_micro_batches():
    with pytest.raises(ValueError, match="num_processes x per_device_batch_size"):
        process_share(10, 0, 3, 2)


def _config(folder: Path, model_path) -> Path:
    config = tiny_run_config(folder, "sd3-5", model_path, unique_sample_num_per_epoch=3)
    (Path(config["data"]["dataset_dir"]) / "test.txt").write_text("\n".join(PROMPTS) + "\n")
    config["num_processes"] = WORLD
    config["log"]["logging_backend"] = "none"
    config["rewards"] = [{"name": "brightness", "reward_model": "test_eval_share.RecordedBrightness"}]
    return write_config(folder, config)


def _process(rank: int, port: int, folder: str) -> None:
    """The Trainer's eval, then ff-eval, on the first 10 and 2 test prompts, in one of 3 processes."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                      **{RECORD: str(Path(folder) / "records")})
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(DEADLINE - 30, exit=True)  # a hang shows where each process waits
    config = Path(folder) / "config.yaml"
    trainer = Trainer(parse_config(yaml.safe_load(config.read_text())))
    result = {"world": trainer.accelerator.num_processes, "means": {}}
    try:
        for n in COUNTS:
            os.environ[PHASE] = f"trainer {n}"
            trainer.cfg.eval.num_samples = n
            result["means"][n] = trainer.evaluate(n)
    finally:
        trainer.close()
    for n in COUNTS:
        os.environ[PHASE] = f"ff-eval {n}"
        assert ff_eval([str(config), f"eval.num_samples={n}", "--out", str(Path(folder) / f"ff-eval{n}.json")]) == 0
    torch.save(result, Path(folder) / f"rank{rank}.pt")
    torch.distributed.barrier()
    # the trainer (its DDP reducer holds the group) goes before the group, as in ff-train: left as the group's last
    # holder, it would free the group holding the GIL, a rare deadlock (docs/experiments/collectives.md)
    del trainer
    end_process_group()


def test_three_processes_score_every_test_prompt_once_as_one_process_does(tmp_path, tiny_sd3_path):
    """10 test prompts on 3 processes (4, 3, 3) and 2 (1, 1, 0): the Trainer's eval and ff-eval score each
    prompt once, on the process the share rule names, as ff-eval on one process scores it, and their means
    are one process's."""
    config = _config(tmp_path, tiny_sd3_path)
    (tmp_path / "records").mkdir()
    # forked from the suite's server that imported torch, diffusers and the package once: three processes
    # each importing them on a 2-core machine take a minute; the server has run nothing that fork would break
    preloaded_forkserver()
    context = mp.start_processes(_process, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=False,
                                 start_method="forkserver")
    deadline = time.monotonic() + DEADLINE  # a process that skips a collective hangs the others: fail, not stall
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for p in context.processes:
                p.kill()
            pytest.fail(f"the {WORLD} processes did not finish in {DEADLINE} s")
    # the reference: ff-eval on one process (this one, which records nothing), on every prompt
    assert ff_eval([str(config), "--out", str(tmp_path / "one.json")]) == 0
    reference = json.loads((tmp_path / "one.json").read_text())["samples"]
    assert [s["prompt"] for s in reference] == PROMPTS
    one = {s["prompt"]: s["brightness"] for s in reference}

    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    assert [r["world"] for r in results] == [WORLD] * WORLD
    calls = [[json.loads(line) for line in (tmp_path / "records" / f"{r}.jsonl").read_text().splitlines()]
             for r in range(WORLD)]
    for n in COUNTS:
        expected_mean = sum(one[p] for p in PROMPTS[:n]) / n
        for tool in ("trainer", "ff-eval"):
            phase = f"{tool} {n}"
            scored = [[c["prompt"] for c in rank if c["phase"] == phase] for rank in calls]
            # each prompt once, by the process whose share holds it (2 prompts: the third scores none)
            assert scored == [PROMPTS[:n][share_slice(n, r, WORLD)] for r in range(WORLD)], phase
            assert Counter(p for rank in scored for p in rank) == Counter(PROMPTS[:n]), phase
            for c in (c for rank in calls for c in rank if c["phase"] == phase):
                assert c["score"] == pytest.approx(one[c["prompt"]], abs=1e-5), (phase, c["prompt"])
        for r in results:  # every process logs the mean over all n prompts
            assert r["means"][n]["eval/reward/brightness"] == pytest.approx(expected_mean, abs=1e-5), n
        written = json.loads((tmp_path / f"ff-eval{n}.json").read_text())
        assert [s["prompt"] for s in written["samples"]] == PROMPTS[:n]
        assert [s["brightness"] for s in written["samples"]] == pytest.approx([one[p] for p in PROMPTS[:n]],
                                                                              abs=1e-5)
        assert written["rewards"]["brightness"]["n"] == n
        assert written["rewards"]["brightness"]["mean"] == pytest.approx(expected_mean, abs=1e-5)
