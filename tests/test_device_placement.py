"""Device placement, checked without a GPU (issue 34, point 3).

How. The test trains tiny models in a child process whose accelerator is a pretend device,
``fakegpu``: PyTorch's PrivateUse1 slot registered as a Python backend
(``torch.utils.backend_registration._setup_privateuseone_for_python_backend``: a device guard and
hooks, so autograd accepts tensors on it). A tensor on it (``OnDevice``) is a wrapper subclass
holding a real CPU tensor; every op runs on those CPU values, so sampling, decoding, rewards, losses
and AdamW compute what they compute on the CPU, and any op where a CPU tensor with dimensions meets a
``fakegpu`` tensor raises, and is recorded, as CUDA raises ("Expected all tensors to be on the same
device"). ``.to("fakegpu")``, ``module.to``, the factories with ``device=`` and the tensors a C++
composite creates there (a PrivateUse1 fallback kernel) make such tensors; ``.to("cpu")`` / ``.cpu()``
give plain CPU tensors back. ``accelerate.Accelerator.device`` is that device, so the trainer puts the
pipeline, the reward models and whatever it keeps "on the device" there. A child process, because
the registration is process-wide and cannot be undone (``torch.accelerator`` then reports the pretend
device, which diffusers reads).

Why not the alternatives: ``FakeTensorMode`` has no values (rollouts, rewards and advantages need
them) and diffusers makes real CUDA constants under it; a wrapper reporting ``cuda`` aborts the process
in autograd (a CPU build has no CUDA device guard); the meta device is shape-only and is what
accelerate and diffusers load empty models on.

Moves covered, by three runs (tiny SD3: GRPO with full fine-tuning and the KL, and DGPO; tiny FLUX.1
Kontext: GRPO), each checked where it lands (``check``: the list the child prints) and by the mismatch
check along the way:
- the pipeline onto the device at load (transformer, VAE), and the CLIP reward model;
- ``data.text_encoders_after_preprocess: cpu``: the text encoders on the CPU once every prompt is cached;
- prompt-cache rows, and a conditioned model's condition-cache rows (FLUX.1 Kontext), onto the device;
  the adapters also move latents and conditioning to the device at every call, so a CPU row would not
  raise: where the rollouts keep them is asserted instead (on the device without offload);
- noise drawn on the CPU generators (initial, SDE and the decoupled training noise), then moved;
- ``train.offload_samples_to_cpu``: trajectory, log-probs and conditioning on the CPU after the
  rollout; every micro-batch on the device when the loss gets it; without offload, on the device;
- decoded media on the CPU, the reward models' inputs onto their device (CLIP, also in an async
  reward's thread pool), the scores onto the device for the advantages;
- ``train.ref_param_device: cpu``: the frozen reference (full fine-tuning, ``kl_beta``) on the CPU
  between calls and on the device for each reference call;
- ``train.ema_device: cpu``: the EMA on the CPU, moved after each epoch; ``train.ema_ref_device: cpu``:
  DGPO's fast old-policy EMA on the CPU, moved after every optimizer step, swapped into the live weights
  for the rollouts (``switch_ema_ref: 0``) and for the loss;
- the live weights on the device after every swap back; checkpoints written from device tensors.

Not covered: ``fsdp2_offload`` and DeepSpeed's offload (torch's ``fully_shard`` and DeepSpeed move
those tensors; they need a process group and streams on the device, which the pretend device lacks;
``tests/test_launch_configs.py`` checks that ``fsdp2_offload`` gives a ``CPUOffloadPolicy``);
several processes; NFT / AWM's old-policy copy and CRD's snapshots (the same ``WeightCopy`` swap as
DGPO's, not run here for time); resuming (a checkpoint's tensors are copied into place, and copies
between devices are allowed, as on CUDA, so a load never trips the check); a CPU 0-dim tensor beside a device tensor
(allowed, as on CUDA); anything that branches on ``device.type == "cuda"`` (autocast, bf16, pinned
memory, streams): the pretend device is not ``cuda``, and these runs are fp32. Other models are not in
this test for its time.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

NAME = "fakegpu"
# what the child checks (``check`` in run_child), each at least once
MOVES = [
    "pipeline loaded onto the device (transformer, VAE)",
    "reward model on the device",
    "text encoders on the cpu after the prompt cache",
    "EMA on ema_device cpu",
    "DGPO's fast EMA on ema_ref_device cpu",
    "frozen reference on ref_param_device cpu between calls",
    "offload_samples_to_cpu: trajectory and conditioning on the cpu",
    "without offload: trajectory and conditioning stay on the device",
    "prompt-cache rows on the device",
    "condition-cache rows on the device",
    "decoded media on the cpu",
    "reward scores on the device",
    "every micro-batch on the device when the loss gets it",
    "live weights on the device (after every swap)",
    "grpo-full: no op mixed cpu and device tensors",
    "dgpo: no op mixed cpu and device tensors",
    "kontext: no op mixed cpu and device tensors",
]


# ------------------------------------------------------------------ the pretend device (child process only)
def install_pretend_device():
    """Register ``fakegpu``; returns (its torch.device, the list every mismatch is recorded in)."""
    import copy
    import threading

    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._device import _device_constructors
    from torch.utils._pytree import tree_leaves, tree_map
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(NAME)
    device = torch.device(NAME, 0)
    aten = torch.ops.aten
    # ops that legitimately take tensors of two devices, as on CUDA: copies, and CPU index tensors
    across = {aten.copy_.default, aten._to_copy.default, aten.index.Tensor, aten.index_put_.default,
              aten.index_put.default, aten._index_put_impl_.default}
    mismatches: list[str] = []

    def on_device(d) -> bool:
        return isinstance(d, (str, torch.device)) and torch.device(d).type == NAME

    def mismatch(message: str):
        mismatches.append(message)
        raise RuntimeError(f"pretend device: {message}")

    class OnDevice(torch.Tensor):
        @staticmethod
        def __new__(cls, elem):
            r = torch.Tensor._make_wrapper_subclass(cls, elem.size(), strides=elem.stride(),
                                                    storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                    layout=elem.layout, device=device)
            r.elem = elem
            return r

        def __repr__(self):
            return f"OnDevice({self.elem!r})"

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func == torch.Tensor.tolist:
                return args[0].elem.tolist()
            if func in (torch.Tensor.storage, torch.Tensor.untyped_storage):  # serialisers key tensors by it
                return func(args[0].elem)
            if func == torch.Tensor.__reduce_ex__:  # torch.save: saved as its CPU values
                return args[0].elem.__reduce_ex__(*args[1:])
            if func == torch.Tensor.data.__set__:
                target, new = args
                if not isinstance(target, OnDevice):  # a plain tensor cannot become a wrapper
                    raise NotImplementedError(f"pretend device: a cpu tensor's .data set to a {NAME} tensor")
                if not isinstance(new, OnDevice):  # the live weights of a swap or a cast: on the device
                    mismatch(f"a {NAME} parameter's .data set to a cpu tensor")
                with torch._C.DisableTorchFunctionSubclass():
                    torch.Tensor.data.__set__(target, new)
                target.elem = new.elem
                return None
            if func == torch.Tensor.__deepcopy__:
                source, memo = args
                out = OnDevice(copy.deepcopy(source.elem, memo))
                memo[id(source)] = out
                out.requires_grad_(source.requires_grad)
                out.__dict__.update({k: copy.deepcopy(v, memo) for k, v in source.__dict__.items() if k != "elem"})
                return out
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            return run(func, args, kwargs or {})

    def run(func, args, kwargs):
        loose, generators = [], []

        def unwrap(value):
            if isinstance(value, OnDevice):
                return value.elem
            if isinstance(value, torch.Tensor) and value.dim() > 0 and func not in across:
                loose.append(value)
            if isinstance(value, torch.Generator):
                generators.append(value)
            if isinstance(value, torch.device) and value.type == NAME:
                return torch.device("cpu")
            return value
        a, k = tree_map(unwrap, (args, kwargs))
        if loose:
            mismatch(f"{func}: a cpu tensor of shape {tuple(loose[0].shape)} meets a {NAME} tensor")
        if any(g.device.type != NAME for g in generators):
            mismatch(f"{func}: a cpu generator draws a {NAME} tensor")
        out = func(*a, **k)
        if func is aten.copy_.default and not isinstance(args[0], OnDevice):
            return args[0]  # a copy into a CPU tensor
        if func is aten._to_copy.default and "device" in kwargs and not on_device(kwargs["device"]):
            return out  # to the CPU
        for given in tree_leaves((args, kwargs)):  # an out= or resized tensor: the wrapper cannot follow
            if isinstance(given, OnDevice) and given.shape != given.elem.shape:
                raise NotImplementedError(f"pretend device: {func} resized its out= tensor")
        return tree_map(lambda t: OnDevice(t) if type(t) is torch.Tensor else t, out)

    class Factories(TorchFunctionMode):
        """``torch.zeros(..., device="fakegpu")`` and the like: made on the CPU, then put on the device."""
        constructors = _device_constructors()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in self.constructors and on_device(kwargs.get("device")):
                generator = kwargs.get("generator")
                if generator is not None and generator.device.type != NAME:
                    mismatch(f"{func.__name__}: a cpu generator draws a {NAME} tensor")
                grad = kwargs.pop("requires_grad", False)
                made = func(*args, **{**kwargs, "device": "cpu"})
                return OnDevice(made).requires_grad_(grad)
            return func(*args, **kwargs)

    library = torch.library.Library("_", "IMPL")
    library.fallback(lambda op, *args, **kwargs: run(op, args, kwargs), "PrivateUse1")
    Factories().__enter__()  # for the rest of the process: the main thread's, and every thread's (a mode is
    thread_run = threading.Thread.run  # per thread: the async rewards score in a pool)

    def run_with_factories(thread):
        with Factories():
            thread_run(thread)
    threading.Thread.run = run_with_factories
    install_pretend_device.keep = (library, OnDevice)
    return device, mismatches


# ------------------------------------------------------------------ the runs (child process)
def where(*values) -> set[str]:
    """The device types of every tensor in ``values`` (tensors, dataclasses, dicts, lists, modules)."""
    import dataclasses

    import torch

    found: set[str] = set()
    for value in values:
        if isinstance(value, torch.Tensor):
            found.add(value.device.type)
        elif isinstance(value, torch.nn.Module):
            found |= where(*value.parameters(), *value.buffers())
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            found |= where(*(getattr(value, f.name) for f in dataclasses.fields(value)))
        elif isinstance(value, dict):
            found |= where(*value.values())
        elif isinstance(value, (list, tuple)):
            found |= where(*value)
    return found


def run_child(tmp: Path) -> list[str]:
    """Train the runs the module docstring lists on the pretend device; returns the moves checked."""
    import torch

    device, mismatches = install_pretend_device()
    try:  # the check itself: a CPU tensor meeting a device tensor raises
        torch.ones(2, 2, device=device) + torch.ones(2, 2)
    except RuntimeError:
        mismatches.clear()
    else:
        raise AssertionError("a cpu tensor met a fakegpu tensor unnoticed")

    import accelerate

    accelerate.Accelerator.device = property(lambda self: device)  # the trainer's accelerator is fakegpu

    from helpers_runs import tiny_run_config

    from flow_factory.config import parse_config
    from flow_factory.testing import build_tiny_pipeline
    from flow_factory.testing.tiny_clip import build_tiny_clip
    from flow_factory.trainer import Trainer

    sd3 = build_tiny_pipeline("sd3-5", tmp / "sd3-pipeline")
    clip = build_tiny_clip(tmp / "clip")
    moves: list[str] = []

    def check(ok: bool, move: str, detail="") -> None:
        assert ok, f"{move}: {detail}"
        if move not in moves:
            moves.append(move)

    def copies(trainer) -> None:
        """Where the weight copies and the text encoders are, at any time of the run."""
        train = trainer.cfg.train
        live = [p for module in trainer.adapter.transformers.values() for p in module.parameters()]
        check(where(live) == {NAME}, "live weights on the device (after every swap)", where(live))
        if trainer.ema is not None and train.ema_device == "cpu":
            check(where(trainer.ema.weights) == {"cpu"}, "EMA on ema_device cpu", where(trainer.ema.weights))
        for name in trainer.step_snapshot_decays:
            check(where(trainer.snapshots[name].weights) == {"cpu"}, "DGPO's fast EMA on ema_ref_device cpu",
                  where(trainer.snapshots[name].weights))
        if isinstance(trainer.policy.reference, dict) and train.ref_param_device == "cpu":
            check(where(trainer.policy.reference) == {"cpu"}, "frozen reference on ref_param_device cpu "
                  "between calls", where(trainer.policy.reference))
        if trainer.cfg.data.text_encoders_after_preprocess == "cpu":
            check(where(trainer.adapter.text_encoders()) == {"cpu"}, "text encoders on the cpu after the "
                  "prompt cache", where(trainer.adapter.text_encoders()))

    def train(name: str, model_type: str, path, *, model: dict | None = None, eval_freq: int = 0,
              clip_async: bool = False, **train) -> None:
        config = tiny_run_config(tmp / name, model_type, path, max_epochs=1, **train)
        config["model"].update(model or {})
        config["eval"]["eval_freq"] = eval_freq
        config["log"]["save_freq"] = 1
        config["rewards"].append({"name": "clip", "reward_model": "clip", "model_name_or_path": str(clip),
                                  "async_reward": clip_async})
        trainer = Trainer(parse_config(config))
        offload = trainer.cfg.train.offload_samples_to_cpu
        check(where(*trainer.adapter.transformers.values(), trainer.adapter.pipeline.vae) == {NAME},
              "pipeline loaded onto the device (transformer, VAE)")
        check(where(trainer.rewards.models["clip"].model) == {NAME}, "reward model on the device")
        copies(trainer)
        counts = {"rollouts": 0, "losses": 0}
        sample_epoch, loss = trainer.sample_epoch, trainer.algorithm.loss

        def checked_sample_epoch(epoch):
            rollouts = sample_epoch(epoch)
            stored = where(rollouts.latents, rollouts.log_probs, rollouts.means, rollouts.cond)
            if offload:
                check(stored == {"cpu"}, "offload_samples_to_cpu: trajectory and conditioning on the cpu", stored)
            else:
                check(stored == {NAME}, "without offload: trajectory and conditioning stay on the device", stored)
                if trainer.prompt_cache is not None:
                    check(where(rollouts.cond) == {NAME}, "prompt-cache rows on the device")
                if trainer.condition_cache is not None:
                    check(where(rollouts.cond) == {NAME}, "condition-cache rows on the device")
            check(where(rollouts.media) == {"cpu"}, "decoded media on the cpu", where(rollouts.media))
            check(where(rollouts.rewards) == {NAME}, "reward scores on the device", where(rollouts.rewards))
            counts["rollouts"] += 1
            return rollouts

        def checked_loss(policy, batch):
            check(where(batch) == {NAME}, "every micro-batch on the device when the loss gets it", where(batch))
            copies(trainer)
            counts["losses"] += 1
            return loss(policy, batch)

        trainer.sample_epoch, trainer.algorithm.loss = checked_sample_epoch, checked_loss
        trainer.train()
        copies(trainer)
        assert counts["rollouts"] and counts["losses"], counts
        assert not mismatches, f"{name}: {mismatches}"  # also the ones some code caught and went on from
        check(True, f"{name}: no op mixed cpu and device tensors")

    # GRPO, full fine-tuning: the frozen reference on the CPU, the EMA on the CPU, offloaded rollouts, eval
    train("grpo-full", "sd3-5", sd3, model={"finetune_type": "full"}, kl_beta=0.1, ref_param_device="cpu",
          ema_decay=0.5, ema_device="cpu", ema_update_interval=1, offload_samples_to_cpu=True, eval_freq=1)
    # DGPO: its fast EMA on the CPU, moved every optimizer step and swapped in for the rollouts and the loss;
    # rollouts kept on the device (the training noise, drawn on the CPU, meets them); CLIP in a thread pool
    train("dgpo", "sd3-5", sd3, trainer_type="dgpo", num_train_timesteps=1, kl_beta=0.1, clip_kl=True,
          ema_decay=0.5, ema_device="cpu", ema_ref_device="cpu", use_ema_ref=True, switch_ema_ref=0,
          ema_ref_ramp_rate=0.2, guidance_scale=1.0, kl_cfg=3.0, clip_async=True)
    # FLUX.1 Kontext: its condition cache's rows onto the device (kept there with the rollouts)
    kontext = build_tiny_pipeline("flux1-kontext", tmp / "kontext-pipeline")
    train("kontext", "flux1-kontext", kontext)
    return moves


def test_every_move_between_devices_lands_where_it_should(tmp_path):
    """The runs of the module docstring on the pretend device ``fakegpu``, in a child process."""
    child = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-2000:] + child.stderr[-6000:]
    moves = child.stdout.split("moves checked:\n", 1)[1].splitlines()
    assert sorted(moves) == sorted(MOVES), moves


if __name__ == "__main__":
    checked = run_child(Path(sys.argv[1]))
    print("moves checked:\n" + "\n".join(checked))
