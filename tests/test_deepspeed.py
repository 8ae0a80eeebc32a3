"""DeepSpeed ZeRO on CPU: ``ff-train`` with ``config_file: zero1``, ``zero2`` or ``zero3`` over 2 gloo
processes, against one process (DESIGN invariant 4), with consolidated checkpoints that load in plain
diffusers and exact resumes from DeepSpeed's own engine state.

DeepSpeed compiles a small C++ communication op on first use, so these tests need ninja and a C++
compiler, and skip saying which is missing. They live apart from test_sharded_training.py (FSDP,
multi-node) so that pytest-xdist runs the two files side by side."""

import json
from concurrent.futures import ThreadPoolExecutor

import torch
from test_sharded_training import (_assert_a_plain_diffusers_lora, _assert_the_full_update_of_one_process,
                                   _checkpoint, _ff_train, _lora, _transformer, needs_deepspeed,
                                   one_process)  # noqa: F401 (one_process: a fixture)
from test_train_cli import EPOCHS, TOLERANCE, _difference_over_movement


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
    with ThreadPoolExecutor(2) as pool:  # side by side: the one-process run takes the core the other leaves
        reference = pool.submit(_ff_train, one, tiny_sd3_path, 1, model=full, **step)
        state = _ff_train(zero3, tiny_sd3_path, 2, config_file="zero3", model=full, eval_freq=1, **step)
        reference.result()
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
