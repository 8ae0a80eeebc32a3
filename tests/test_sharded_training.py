"""Sharded training on CPU: ``ff-train`` with ``config_file: fsdp2`` (and ``zero2`` for full fine-tuning
with a KL reference) over 2 gloo processes; the other DeepSpeed runs are in test_deepspeed.py.

accelerate never shards on CPU with FSDP, so there the trainer shards with torch's own ``fully_shard``
(``flow_factory/sharding.py``); everything after that (the optimizer over the shards, the
gathered checkpoint, the EMA of the shards, resuming into shards) is the code a GPU run runs.
The launches fork their processes from a preloaded server (helpers_launch.py: the same ff-train, accelerate
and backend code, without each process importing torch and diffusers again).
DeepSpeed runs its own ZeRO engine on CPU over gloo (it compiles a small C++ op on first use, so
its tests need ninja and a C++ compiler, and skip saying which is missing).
The run's checkpoint records how many trained values each process held: sharded means each held
part, and together all. A 2-machine launch is simulated over loopback too."""

import importlib.util
import json
import os
import re
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers_launch import ff_train_forked
from helpers_runs import ff_train_in_this_process, tiny_run_config, write_config
from safetensors.torch import load_file
from test_train_cli import EPOCHS, LINEAR_STEP, TOLERANCE, _difference_over_movement, _free_port


# the venv's own tools (ninja, for DeepSpeed's op) whether or not the venv is activated
TOOLS_PATH = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def _why_no_deepspeed() -> str | None:
    if importlib.util.find_spec("deepspeed") is None:
        return "DeepSpeed is not installed (pip install 'flow-factory[deepspeed]')"
    if shutil.which("ninja", path=TOOLS_PATH) is None:
        return "ninja is not installed: DeepSpeed compiles its CPU communication op with it"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}): DeepSpeed compiles its CPU communication op on first use"
    return None


needs_deepspeed = pytest.mark.skipif(_why_no_deepspeed() is not None, reason=str(_why_no_deepspeed()))


def _ff_train(folder, model_path, processes: int, **run) -> dict:
    """``ff-train`` on ``processes`` processes, as the invariant-4 test runs it (forked: helpers_launch);
    returns the run's last trainer state."""
    config, results = _launch(folder, model_path, processes, **run)
    for (_, err), code in results:  # a failed launch's output ends with its first failing process's message
        assert code == 0, f"{processes} process(es): exit {code}\n{err[-4000:]}"
    return json.loads((_checkpoint(folder, config["train"]["max_epochs"]) / "trainer_state.json").read_text())


def _launch(folder, model_path, processes: int, config_file=None, model=None, machines: int = 1,
            eval_freq: int = 0, reward_model: str = "helpers_rewards.MeanBrightness", **train) -> tuple[dict, list]:
    """The run's config and each command's ((stdout, stderr), exit code).
    ``machines`` > 1: one ``ff-train`` per machine rank, all on this machine over loopback."""
    config = tiny_run_config(folder, "sd3-5", model_path, group_size=4,
                             **{"max_epochs": EPOCHS, "ema_decay": 0.5, **LINEAR_STEP, **train})
    config["eval"]["eval_freq"] = eval_freq  # eval samples with its own seeds: the weights do not depend on it
    config["rewards"] = [{"name": "brightness", "reward_model": reward_model}]
    config["model"].update(model or {})
    if config_file:
        config["config_file"] = config_file
    (folder / "tmp").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PATH": TOOLS_PATH, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "TMPDIR": str(folder / "tmp")}
    argv = [str(write_config(folder, config)), "--num_processes", str(processes),
            "--main_process_port", str(_free_port())]
    if processes == 1 and not config_file:  # the reference run, in this process: no launch, no imports to pay
        return config, [ff_train_in_this_process(argv)]
    if machines == 1:
        return config, [ff_train_forked(argv, env)]
    # each machine encodes the prompts into its own cache (data.preprocess_parallelism: local)
    argv += ["--num_machines", str(machines), "--main_process_ip", "127.0.0.1"]
    with ThreadPoolExecutor(machines) as pool:
        runs = [pool.submit(ff_train_forked, argv + ["--machine_rank", str(rank), f"data.cache_dir={folder}/cache_{rank}"],
                            env) for rank in range(machines)]
        return config, [run.result() for run in runs]


def _checkpoint(folder, epoch):
    return folder / "saves" / "run" / "checkpoints" / f"epoch_{epoch}"


def _lora(folder, epoch=EPOCHS) -> dict:
    return load_file(_checkpoint(folder, epoch) / "pytorch_lora_weights.safetensors")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_sd3_path):
    """The LoRA run on one process that the multi-process LoRA runs are compared with."""
    folder = tmp_path_factory.mktemp("one_process")
    _ff_train(folder, tiny_sd3_path, 1)
    return folder


def test_fsdp_on_two_processes_shards_saves_whole_and_resumes(tmp_path, tiny_sd3_path, one_process):
    """DESIGN invariant 4 under FSDP2, and a consolidated, loadable, exactly resumable checkpoint."""
    one = one_process
    fsdp = tmp_path / "fsdp"
    state = _ff_train(fsdp, tiny_sd3_path, 2, config_file="fsdp2", eval_freq=1)
    evaluated = json.loads((fsdp / "saves" / "run" / "history.json").read_text())["eval"]
    assert [e["epoch"] for e in evaluated] == list(range(EPOCHS + 1))  # eval samples through the shards too

    # really sharded: each process held part of the trained values, the two together all of them
    held = state["sharding"]
    assert held["backend"] == "fsdp" and held["processes"] == 2
    total = sum(v.numel() for v in _lora(fsdp).values())
    assert sum(held["trained_values_per_process"]) == total
    assert all(0 < n < total for n in held["trained_values_per_process"])

    # the same update as one process (the tolerance derived in test_train_cli: a reduce-scatter adds
    # the same two halves an all-reduce adds)
    relative, moved = _difference_over_movement(_lora(one), _lora(fsdp))
    assert moved > 1e-4, f"training did not move the LoRA (largest B entry {moved:.2e})"
    assert relative <= TOLERANCE, f"1 process and FSDP on 2 differ by {relative:.2e} (allowed {TOLERANCE:.2e})"
    # the EMA of the shards, gathered, is the EMA one process keeps
    ema_one, ema_fsdp = (torch.load(_checkpoint(f, EPOCHS) / "ema.pt")["weights"] for f in (one, fsdp))
    assert [w.shape for w in ema_one] == [w.shape for w in ema_fsdp]
    assert max(float((a - b).abs().max()) for a, b in zip(ema_one, ema_fsdp)) <= TOLERANCE * moved

    _assert_a_plain_diffusers_lora(fsdp, tiny_sd3_path)

    # stopped after epoch 1 and resumed on 2 processes: the same weights as the uninterrupted run
    resumed = tmp_path / "resumed"
    _ff_train(resumed, tiny_sd3_path, 2, config_file="fsdp2",
              model={"resume_path": str(_checkpoint(fsdp, 1))})
    for key, value in _lora(fsdp).items():
        assert torch.allclose(_lora(resumed)[key], value, rtol=0, atol=1e-6), key


def _assert_a_plain_diffusers_lora(folder, model_path) -> None:
    """The consolidated LoRA loads with the pipeline's own ``load_lora_weights``, every tensor as saved."""
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(model_path)
    pipe.load_lora_weights(_checkpoint(folder, EPOCHS))
    loaded = {"transformer." + re.sub(r"\.default(_\d+)?", "", n): p.detach()
              for n, p in pipe.transformer.named_parameters() if "lora_" in n}
    assert loaded.keys() == _lora(folder).keys()
    assert all(torch.equal(loaded[k], v) for k, v in _lora(folder).items())


def _transformer(folder, epoch=EPOCHS) -> dict:
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel.from_pretrained(_checkpoint(folder, epoch) / "transformer").state_dict()


def _assert_the_full_update_of_one_process(one, sharded, start: dict, name: str) -> tuple[dict, float]:
    """The sharded run's consolidated ``transformer/`` (it loads with ``from_pretrained``) made the one-process
    run's update, at the invariant-4 tolerance; returns its weights and how far the one-process run moved."""
    a, b = _transformer(one), _transformer(sharded)
    assert a.keys() == b.keys() == start.keys()
    moved = max(float((a[k] - start[k]).abs().max()) for k in a)
    difference = max(float((b[k] - a[k]).abs().max()) for k in a)
    assert moved > 1e-4, f"training did not move the weights ({moved:.2e})"
    assert difference <= TOLERANCE * moved, f"{name} differs by {difference / moved:.2e} of the movement"
    return b, moved


FULL = {"finetune_type": "full"}
# lr / eps = 0.1: full weights move a little. A KL this strong dominates the second epoch's update: a
# reference left out of the forward (the current weights instead) made the runs differ by ~1x the movement
FULL_KL_STEP = {"learning_rate": 1e7, "kl_beta": 1000.0, "kl_type": "v-based"}


@pytest.fixture(scope="module")
def one_process_full(tmp_path_factory, tiny_sd3_path):
    """The full fine-tuning run with a KL reference on one process that each sharded backend's is compared with."""
    folder = tmp_path_factory.mktemp("one_process_full")
    _ff_train(folder, tiny_sd3_path, 1, model=FULL, **FULL_KL_STEP)
    return folder


@pytest.mark.parametrize("config_file", ["fsdp2", pytest.param("zero2", marks=needs_deepspeed),
                                         pytest.param("zero3", marks=needs_deepspeed)])
def test_full_fine_tuning_with_a_sharded_reference_matches_one_process(tmp_path, tiny_sd3_path, config_file,
                                                                       one_process_full):
    """Full fine-tuning with the KL to the starting weights and an EMA: under FSDP the reference is a copy of
    each process's shards, under ZeRO-2 of the whole weights every process holds, under ZeRO-3 of each
    process's partitions, swapped in for the reference's forward. The second epoch's KL gradient depends
    on it, so a reference that did not reach the forward would show as a different update; the EMA of the
    shards or partitions, gathered, is the one process's."""
    from diffusers import SD3Transformer2DModel

    one, fsdp = one_process_full, tmp_path / config_file
    state = _ff_train(fsdp, tiny_sd3_path, 2, config_file=config_file, model=FULL, **FULL_KL_STEP)
    held = state["sharding"]["trained_values_per_process"]
    assert state["sharding"]["backend"] == {"fsdp2": "fsdp"}.get(config_file, "deepspeed")
    if config_file == "zero2":  # ZeRO-2 splits the optimizer state and the gradients, not the weights
        assert held[0] == held[1]
    else:  # each process held part of the weights
        assert all(0 < n < sum(held) for n in held)

    start = SD3Transformer2DModel.from_pretrained(tiny_sd3_path, subfolder="transformer").state_dict()
    b, moved = _assert_the_full_update_of_one_process(one, fsdp, start, config_file)
    ema_one, ema_sharded = (torch.load(_checkpoint(f, EPOCHS) / "ema.pt")["weights"] for f in (one, fsdp))
    assert [w.shape for w in ema_one] == [w.shape for w in ema_sharded]
    assert max(float((x - y).abs().max()) for x, y in zip(ema_one, ema_sharded)) <= TOLERANCE * moved
    if config_file == "fsdp2":  # stopped after epoch 1 and resumed into shards (ZeRO's resumes: test_deepspeed.py)
        resumed = tmp_path / "resumed"
        _ff_train(resumed, tiny_sd3_path, 2, config_file=config_file,
                  model={**FULL, "resume_path": str(_checkpoint(fsdp, 1))}, **FULL_KL_STEP)
        c = _transformer(resumed)
        assert all(torch.allclose(c[k], b[k], rtol=0, atol=1e-6) for k in b)


def test_two_machines_simulated_over_loopback_make_the_same_update_as_one_process(tmp_path, tiny_sd3_path,
                                                                                 one_process):
    """A 2-node launch with the shipped multi_node template, 2 machine ranks x 1 process on this machine:
    both ranks joined one run (the checkpoint saw 2 processes) and the update is one process's."""
    nodes = tmp_path / "nodes"
    state = _ff_train(nodes, tiny_sd3_path, 2, config_file="multi_node", machines=2)
    total = sum(v.numel() for v in _lora(nodes).values())
    assert state["sharding"] == {"backend": "ddp", "processes": 2, "trained_values_per_process": [total, total],
                                 "by_component": {"transformer": [total, total]}}
    relative, moved = _difference_over_movement(_lora(one_process), _lora(nodes))
    assert moved > 1e-4 and relative <= TOLERANCE, (relative, moved)
