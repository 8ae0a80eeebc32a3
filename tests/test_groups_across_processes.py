"""Groups whose samples sit on different processes, on 2 real CPU processes (gloo), against one
process holding everything.

* GRPO's advantages: a group cut by the processes' contiguous shares gets the advantages it gets
  in one process (the trainer normalises over the gathered batch).
* DGPO: a global micro-batch of 2 x 6 samples holds 3 groups of 4, one of them split between the
  processes (``data.process_share``); trained in lockstep with each group's preference summed over
  the processes, one epoch (two optimizer steps, with the fast old-policy EMA and the clip between
  them) ends at the weights one process with micro-batches of 12 reaches, with shared and with
  independent noise. With every group split in two (micro-batches of 2), the same against micro-batches
  of 4 (within 1e-4 of the weights' move); without the sum over processes it differs by more than 1e-2.

The model is the toy 2-D flow (bench/toy.py); the processes start once for every test (importing
the package is most of the time)."""

import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from helpers_launch import preloaded_forkserver
from toy import ToyAdapter, ToyVelocity, toy_reward

from flow_factory.advantages import combine_advantages
from flow_factory.algorithms import dgpo as dgpo_module
from flow_factory.algorithms import make_algorithm
from flow_factory.config.train import TrainConfig
from flow_factory.data import process_share
from flow_factory.dynamics import ODE
from flow_factory.guards import NonFiniteGuard
from flow_factory.sampling import Rollouts
from flow_factory.trainer.ema import WeightCopy
from flow_factory.trainer.optimize import OptimizeSettings, Stepper, optimize_epoch
from flow_factory.trainer.policy import AdapterPolicy, PolicyWeights
from flow_factory.trainer.trainer import Trainer

GROUP_SIZE, GROUPS = 4, 6
N = GROUP_SIZE * GROUPS
GROUP_IDS = torch.arange(GROUPS).repeat_interleave(GROUP_SIZE)
STEPS = 4  # denoising steps of the toy's rollouts


def epoch_rollouts():
    """One epoch's final latents and rewards, as every process would hold them after gathering."""
    x0 = torch.randn(N, 2, generator=torch.Generator().manual_seed(11)) * 1.5
    return x0, toy_reward(x0)


def train_dgpo_epoch(rank: int, world: int, batch_size: int, shared_noise: bool, accelerator, epochs: int = 1):
    """The toy's weights after ``epochs`` (one, or none) DGPO epochs on this process's share of the epoch."""
    torch.manual_seed(0)
    adapter = ToyAdapter(ToyVelocity(16))
    params = list(adapter.transformer.parameters())
    cfg = TrainConfig(trainer_type="dgpo", group_size=GROUP_SIZE, per_device_batch_size=batch_size, dpo_beta=20.0,
                      num_train_timesteps=2, time_sampling_strategy="uniform", time_shift=1.0, timestep_range=1.0,
                      num_inference_steps=STEPS, clip_range=0.05, kl_beta=0.1, use_shared_noise=shared_noise,
                      ema_ref_ramp_rate=0.2)
    algo = make_algorithm("dgpo", cfg, ODE())
    snapshots = {name: WeightCopy(params) for name in algo.step_snapshots}
    policy = AdapterPolicy(adapter, 1.0, "full", keep_reference=algo.needs_reference,
                           weights=PolicyWeights(snapshots=snapshots))
    with torch.no_grad():  # away from the reference, so that every group's preference is far from 0
        for p in params:
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    x0, rewards = epoch_rollouts()
    advantages = combine_advantages({"r": rewards}, {"r": 1.0}, GROUP_IDS, "sum", False)
    mine = process_share(N, rank, world, batch_size)
    cond = adapter.encode([""] * len(mine), None, 1.0)
    rollouts = Rollouts([""] * len(mine), GROUP_IDS[mine], x0[mine].unsqueeze(1), torch.zeros(len(mine), STEPS),
                        adapter.sigmas(STEPS), [], cond, media=x0[mine], latent_steps=[STEPS])
    if not epochs:
        return torch.cat([p.detach().flatten() for p in params])
    optimizer = torch.optim.SGD(params, lr=0.05)
    micro_steps = len(mine) // batch_size * 2
    optimize_epoch(algo, policy, rollouts, advantages[mine],
                   OptimizeSettings(batch_size=batch_size, accumulation=micro_steps // 2, max_grad_norm=100.0, seed=5),
                   Stepper(accelerator, optimizer, params, NonFiniteGuard(0),
                           step_snapshots={k: (snapshots[k], d) for k, d in algo.step_snapshots.items()}),
                   epoch=0, steps_before=1)  # the fast EMA's decay is 0.2 from the first step: it lags the weights
    return torch.cat([p.detach().flatten() for p in params])


def grpo_advantages(accelerator):
    """This process's advantages as the trainer computes them: over the gathered batch, then its share."""
    from types import SimpleNamespace

    _, rewards = epoch_rollouts()
    # 7 groups of 4 over 2 contiguous shares of 14: group 3's members 12, 13 | 14, 15 are cut
    mine = process_share(N + 4, accelerator.process_index, accelerator.num_processes)
    group_ids = torch.arange(GROUPS + 1).repeat_interleave(GROUP_SIZE)
    rewards = torch.cat([rewards, rewards[:4] * 0.5])
    from flow_factory.rewards.reward_set import RewardSet

    trainer = SimpleNamespace(accelerator=accelerator, rewards=RewardSet({"r": object()}, {"r": 1.0}),
                              cfg=SimpleNamespace(train=TrainConfig(advantage_aggregation="sum", global_std=False)),
                              guard=NonFiniteGuard(0), data=SimpleNamespace(source_names=[], offline_records=None))
    trainer._local_share = lambda n: Trainer._local_share(trainer, n)
    trainer._gathered_datasets = lambda: Trainer._gathered_datasets(trainer)
    rollouts = SimpleNamespace(rewards={"r": rewards[mine]}, group_ids=group_ids[mine], pending_rewards=None)
    return Trainer.compute_advantages(trainer, rollouts, 0), combine_advantages(
        {"r": rewards}, {"r": 1.0}, group_ids, "sum", False)[mine]


def _process(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    result = {"world": accelerator.num_processes, "advantages": grpo_advantages(accelerator),
              "dgpo": {shared: train_dgpo_epoch(rank, 2, 6, shared, accelerator) for shared in (True, False)}}
    # every group split in two (micro-batches of 2), with and without the sum over processes
    result["halves"] = train_dgpo_epoch(rank, 2, 2, True, accelerator)
    dgpo_module.sum_over_processes = lambda t: t.detach()  # the deliberately wrong variant
    result["halves_without_sum"] = train_dgpo_epoch(rank, 2, 2, True, accelerator)
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> list[dict]:
    """What each of 2 processes (one start: importing the package takes most of the time) ended with."""
    folder = tmp_path_factory.mktemp("two_processes")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    preloaded_forkserver()  # forked from the suite's server: torch and the package imported there once
    context = mp.start_processes(_process, args=(port, str(folder)), nprocs=2, join=False,
                                 start_method="forkserver")
    deadline = time.monotonic() + 300  # a distributed hang fails, it does not stall CI
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for p in context.processes:
                p.kill()
            pytest.fail("the two processes did not finish in 300 s")
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def one_process():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    start = train_dgpo_epoch(0, 1, 12, True, accelerator, epochs=0)
    trained = {shared: train_dgpo_epoch(0, 1, 12, shared, accelerator) for shared in (True, False)}
    return start, trained, train_dgpo_epoch(0, 1, 4, True, accelerator)


def test_grpo_advantages_of_a_cut_group_are_the_one_process_ones(two_processes):
    assert [r["world"] for r in two_processes] == [2, 2]
    for rank in two_processes:
        torch.testing.assert_close(*rank["advantages"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("shared_noise", [True, False])
def test_two_processes_train_a_split_group_as_one_process_does(two_processes, one_process, shared_noise):
    start, trained, _ = one_process
    one = trained[shared_noise]
    moved = (one - start).abs().max().item()
    assert moved > 1e-3, "one epoch did not move the weights"
    ranks = [r["dgpo"][shared_noise] for r in two_processes]
    torch.testing.assert_close(ranks[0], ranks[1], rtol=0, atol=0)  # the averaged gradient: one update
    difference = (ranks[0] - one).abs().max().item()
    assert difference <= 1e-4 * moved, f"{difference:.2e} of a {moved:.2e} move"


def test_without_the_sum_over_processes_a_split_group_trains_otherwise(two_processes, one_process):
    """Every group split in two: with the sum the processes make one process's update, without it they
    weigh each half by its own preference and do not."""
    start, _, one = one_process
    moved = (one - start).abs().max().item()
    right, wrong = (two_processes[0][k] for k in ("halves", "halves_without_sum"))
    assert (right - one).abs().max().item() <= 1e-4 * moved
    assert (wrong - one).abs().max().item() > 1e-2 * moved
