"""DeepSpeed ZeRO on CPU: ``ff-train`` with ``config_file: zero1``, ``zero2`` or ``zero3`` over 2 gloo
processes, against one process (DESIGN invariant 4), with consolidated checkpoints that load in plain
diffusers and exact resumes from DeepSpeed's own engine state; and the non-finite guard (invariant 9):
a step whose reduced gradient is NaN skipped by the engine, counted as on every other backend.

DeepSpeed compiles a small C++ communication op on first use, so these tests need ninja and a C++
compiler, and skip saying which is missing. They live apart from test_sharded_training.py (FSDP,
multi-node) so that pytest-xdist runs the two files side by side."""

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from test_sharded_training import (TOOLS_PATH, _assert_a_plain_diffusers_lora,
                                   _assert_the_full_update_of_one_process, _checkpoint, _ff_train, _lora,
                                   _transformer, needs_deepspeed, one_process)  # noqa: F401 (one_process: a fixture)
from test_train_cli import EPOCHS, TOLERANCE, _difference_over_movement, _free_port


def _engine_files(folder, epoch=EPOCHS) -> list[str]:
    return sorted(p.name for p in (_checkpoint(folder, epoch) / "deepspeed" / "engine").iterdir())


@needs_deepspeed
def test_zero2_lora_on_two_processes_equals_one_process_and_saves_a_diffusers_lora(tmp_path, tiny_sd3_path,
                                                                                  one_process):
    """DESIGN invariant 4 under DeepSpeed ZeRO-2: its engine reduces the two processes' gradients (a sum
    of two halves, as the all-reduce of test_train_cli's derivation) and steps AdamW over its
    partitions; the tolerance is that test's. The LoRA it saves is a plain diffusers LoRA, and the run
    resumes exactly."""
    zero2 = tmp_path / "zero2"
    state = _ff_train(zero2, tiny_sd3_path, 2, config_file="zero2")
    total = sum(v.numel() for v in _lora(zero2).values())
    # ZeRO-2 splits the optimizer state and the gradients; the weights stay whole on every process
    assert state["sharding"] == {"backend": "deepspeed", "processes": 2, "trained_values_per_process": [total, total],
                                 "by_component": {"transformer": [total, total]}}
    relative, moved = _difference_over_movement(_lora(one_process), _lora(zero2))
    assert moved > 1e-4, f"training did not move the LoRA (largest B entry {moved:.2e})"
    assert relative <= TOLERANCE, f"1 process and ZeRO-2 on 2 differ by {relative:.2e} (allowed {TOLERANCE:.2e})"
    ema_one, ema_zero2 = (torch.load(_checkpoint(f, EPOCHS) / "ema.pt")["weights"] for f in (one_process, zero2))
    assert max(float((a - b).abs().max()) for a, b in zip(ema_one, ema_zero2)) <= TOLERANCE * moved
    _assert_a_plain_diffusers_lora(zero2, tiny_sd3_path)
    # each process's partition of AdamW's state, in DeepSpeed's own layout: stopped after epoch 1 and
    # resumed, the run ends at the uninterrupted run's LoRA
    assert _engine_files(zero2) == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                    "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    resumed = tmp_path / "resumed"
    _ff_train(resumed, tiny_sd3_path, 2, config_file="zero2", model={"resume_path": str(_checkpoint(zero2, 1))})
    for key, value in _lora(zero2).items():
        assert torch.allclose(_lora(resumed)[key], value, rtol=0, atol=1e-6), key


@needs_deepspeed
def test_zero3_full_fine_tuning_partitions_saves_whole_and_resumes_exactly(tmp_path, tiny_sd3_path):
    """ZeRO-3 partitions the transformer's weights too: each process held part of them, the update equals
    one process's, the gathered checkpoint loads with ``from_pretrained``, and a run stopped after epoch 1
    and resumed (the weights from the checkpoint, AdamW's moments from DeepSpeed's engine state, the EMA
    of the partitions from ema.pt) ends where the uninterrupted run ended."""
    from diffusers import SD3Transformer2DModel

    full = {"finetune_type": "full"}
    step = {"learning_rate": 1e7}  # lr / eps = 0.1: full weights move a little; the EMA of the partitions too
    one, zero3 = tmp_path / "p1", tmp_path / "zero3"
    state = _ff_train(zero3, tiny_sd3_path, 2, config_file="zero3", model=full, eval_freq=1, **step)
    _ff_train(one, tiny_sd3_path, 1, model=full, **step)  # in this process (_launch)
    evaluated = json.loads((zero3 / "saves" / "run" / "history.json").read_text())["eval"]
    assert [e["epoch"] for e in evaluated] == list(range(EPOCHS + 1))  # eval samples through the partitions too

    initial = SD3Transformer2DModel.from_pretrained(tiny_sd3_path, subfolder="transformer")
    start, total = initial.state_dict(), sum(p.numel() for p in initial.parameters())
    held = state["sharding"]["trained_values_per_process"]
    assert state["sharding"]["backend"] == "deepspeed" and len(held) == 2
    # each partition is padded to the same size: together they hold every value and at most one pad per tensor
    assert all(0 < n < total for n in held) and total <= sum(held) < total + 2 * len(start), (held, total)

    b, _ = _assert_the_full_update_of_one_process(one, zero3, start, "ZeRO-3")

    resumed = tmp_path / "resumed"
    _ff_train(resumed, tiny_sd3_path, 2, config_file="zero3", model={**full, "resume_path": str(_checkpoint(zero3, 1))},
              **step)
    after_one = _transformer(zero3, 1)
    assert max(float((b[k] - after_one[k]).abs().max()) for k in b) > 1e-4  # epoch 2 moved the weights
    c = _transformer(resumed)
    for key, value in b.items():
        assert torch.allclose(c[key], value, rtol=0, atol=1e-6), key
    # the EMA of the partitions, gathered into ema.pt and handed back to each process's partition on resume
    ema_zero3, ema_resumed = (torch.load(_checkpoint(f, EPOCHS) / "ema.pt")["weights"] for f in (zero3, resumed))
    assert max(float((x - y).abs().max()) for x, y in zip(ema_zero3, ema_resumed)) <= 1e-6


@needs_deepspeed
def test_zero1_trains_an_epoch_as_one_process_does(tmp_path, tiny_sd3_path, one_process):
    """ZeRO-1 (only AdamW's state split): one epoch, compared with the one-process run's first epoch at the
    invariant-4 tolerance. ``zero2_offload`` is not run here: accelerate swaps AdamW for DeepSpeed's CPU
    Adam there, whose C++ build takes minutes on a fresh machine; its config is checked in
    test_launch_configs.py."""
    state = _ff_train(tmp_path / "zero1", tiny_sd3_path, 2, config_file="zero1", max_epochs=1)
    assert state["sharding"]["backend"] == "deepspeed" and state["sharding"]["processes"] == 2
    relative, moved = _difference_over_movement(_lora(one_process, 1), _lora(tmp_path / "zero1", 1))
    assert moved > 1e-4, f"training did not move the LoRA (largest B entry {moved:.2e})"
    assert relative <= TOLERANCE, f"1 process and zero1 on 2 differ by {relative:.2e} (allowed {TOLERANCE:.2e})"


@needs_deepspeed
def test_zero2_skips_a_step_whose_reduced_gradient_is_nan_and_the_guard_counts_it(tmp_path, tiny_sd3_path,
                                                                                   monkeypatch):
    """The non-finite guard under DeepSpeed (DESIGN invariant 9), as on every other backend: process 1's NaN
    loss makes the reduced gradient of epoch 1's only optimizer step NaN on both processes. DeepSpeed's
    engine skips that step (its overflow check of the reduced gradients), the guard counts it on process 0
    too, whose own losses were finite, and the run goes on: epoch 1 ends at the starting weights (LoRA B
    still zero: the weights of a run without that step) with AdamW's moments untouched, and epoch 2 trains
    to finite weights. In bf16, as on a GPU: the precision whose ZeRO-1/2 skip hangs on DeepSpeed's
    ``bf16.check_grad_overflow``."""
    monkeypatch.setenv("FF_CPU_MIXED_PRECISION", "1")  # a GPU's bf16: DeepSpeed's bf16 engine, as on GPUs
    run = tmp_path / "zero2"
    state = _ff_train(run, tiny_sd3_path, 2, config_file="zero2", reward_model="helpers_rewards.BrightnessAndANaNLoss")
    assert state["sharding"]["backend"] == "deepspeed" and state["sharding"]["processes"] == 2
    history = json.loads((run / "saves" / "run" / "history.json").read_text())["train"]
    assert [r["train/skipped_updates"] for r in history] == [1, 0] and state["global_step"] == 1
    assert "train/grad_norm" not in history[0] and math.isfinite(history[1]["train/grad_norm"])
    skipped, trained = _lora(run, 1), _lora(run)
    assert all(float(v.abs().max()) == 0 for k, v in skipped.items() if "lora_B" in k)
    assert all(bool(torch.isfinite(v).all()) for v in [*skipped.values(), *trained.values()])
    assert max(float(v.abs().max()) for k, v in trained.items() if "lora_B" in k) > 1e-4  # epoch 2 trained
    # each process's partition of AdamW's state after epoch 1: no step taken, no moments
    engine = sorted((_checkpoint(run, 1) / "deepspeed" / "engine").glob("*zero_pp_rank_*_optim_states.pt"))
    assert [p.name for p in engine] == [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
    for partition in engine:
        adamw = torch.load(partition, weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]
        assert adamw["state"] == {}, adamw["state"]


# One process over gloo: DeepSpeed's engine around a tiny network, its config as ff-train fills it (from a file
# that turned bf16's overflow check off), stepped once with a NaN gradient and once with a finite one.
_ENGINE_STEPS = """
import json
from types import SimpleNamespace
import deepspeed, torch
from flow_factory.sharding import fill_deepspeed_config

deepspeed.init_distributed("gloo")
seen = []
for stage in (0, 1, 2, 3):
    for bf16 in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        plugin = SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
                                                   "bf16": {"enabled": bf16, "check_grad_overflow": False}})
        fill_deepspeed_config(plugin, micro_batch_size=1, accumulation=1, max_grad_norm=1.0, num_processes=1)
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1),
                                          config=plugin.deepspeed_config)
        params = list(engine.module.parameters())

        def weights():
            with deepspeed.zero.GatheredParameters(params) if stage == 3 else torch.no_grad():
                return [p.detach().float().clone() for p in params]

        x, start, applied, after = torch.ones(1, 4, dtype=params[0].dtype), weights(), [], []
        for factor in (float("nan"), 1.0):
            engine.backward(engine(x).sum() * factor)
            engine.step()
            applied.append(engine.was_step_applied())
            after.append(weights())
        kept, end = after
        seen.append({"stage": stage, "bf16": bf16, "applied": applied,
                     "nan_step_kept_weights": all(torch.equal(a, b) for a, b in zip(start, kept)),
                     "end_finite": all(bool(torch.isfinite(w).all()) for w in end),
                     "end_moved": any(not torch.equal(a, b) for a, b in zip(start, end))})
print("SEEN", json.dumps(seen))
"""


@needs_deepspeed
def test_deepspeed_itself_skips_a_step_whose_gradient_is_nan_in_every_config_ff_train_runs(tmp_path):
    """The mechanism the guard counts on under DeepSpeed (``engine.was_step_applied()``, trainer/optimize.py):
    every ZeRO stage, in float32 and in bf16 (its overflow check turned back on by ``fill_deepspeed_config``),
    and bf16 without ZeRO skip the NaN step, the weights as they were, and then train on. DeepSpeed without
    ZeRO in float32 steps the NaN into the weights: ff-train refuses that launch before anything loads."""
    env = {**os.environ, "PATH": TOOLS_PATH, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "TMPDIR": str(tmp_path), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
           "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    result = subprocess.run([sys.executable, "-c", _ENGINE_STEPS], env=env, timeout=300, capture_output=True,
                            text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    seen = json.loads(result.stdout.split("SEEN ", 1)[1])
    skipped = {"applied": [False, True], "nan_step_kept_weights": True, "end_finite": True, "end_moved": True}
    for config in seen:
        stage, bf16 = config.pop("stage"), config.pop("bf16")
        if stage == 0 and not bf16:
            assert config["applied"][0] and not config["end_finite"], config
        else:
            assert config == skipped, (stage, bf16)


def test_deepspeed_without_zero_in_float32_is_refused(tmp_path):
    from accelerate.utils import DistributedType

    from flow_factory.config import ConfigError
    from flow_factory.trainer.backends import check_deepspeed_skips_nonfinite

    def launch(stage, precision):
        return SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, mixed_precision=precision,
                               state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=stage)))

    cfg = SimpleNamespace(config_file="mine.yaml")
    with pytest.raises(ConfigError, match=r"^config_file: mine.yaml runs DeepSpeed without ZeRO \(zero_stage 0\) in "
                                          r"float32, where its engine steps NaN or inf gradients into the weights: "
                                          r"use multi_gpu"):
        check_deepspeed_skips_nonfinite(cfg, launch(0, "no"))
    for stage, precision in [(0, "bf16"), (0, "fp16"), (1, "no"), (2, "no"), (3, "no")]:
        check_deepspeed_skips_nonfinite(cfg, launch(stage, precision))
