"""What precision each part of a run computes and stores in: decided here, once.

A GPU run under ``mixed_precision: bf16`` (or ``fp16``) does this:

| part                                   | precision                                            |
|----------------------------------------|------------------------------------------------------|
| frozen networks: transformer(s), text  | loaded in the autocast dtype (bf16 / fp16)           |
| encoders, VAE                          |                                                      |
| trained weights (LoRA or full)         | ``model.master_weight_dtype`` (float32 by default)   |
| transformer calls (rollout, training)  | under autocast: matmuls in the autocast dtype        |
| rollout trajectories                   | ``train.latent_storage_dtype`` (fp16 by default)     |
| dynamics, log-probs, ratios, losses,   | float32, outside autocast                            |
| advantages, rewards' scores            |                                                      |
| VAE decode                             | the VAE's load dtype; images float32 once decoded    |
| reward models                          | their entry's ``dtype`` (float32 unless it says)     |

A CPU run computes in float32 (``mixed_precision`` becomes ``no``): bf16 kernels are slow on
most CPUs and crash some. ``FF_CPU_MIXED_PRECISION=1`` makes a CPU run keep ``mixed_precision``
instead, so a GPU config can be checked, in a GPU's precision, on a laptop (the tests do).

Autocast's rule for ``stack`` / ``cat`` accepts float32 and the autocast dtype only (on every
device): an fp16 trajectory stacked inside a bf16 autocast region stops the run. So only the
networks' calls run under autocast (``Precision.autocast``); the rollout's bookkeeping runs
outside it (``rollout.sample_trajectory``).
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from .config.base import DTYPE_NAMES

CPU_SWITCH = "FF_CPU_MIXED_PRECISION"  # its oneDNN cap is set at the package's import (__init__.py)
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def name_deepspeed_device() -> None:
    """Tell DeepSpeed a machine without CUDA is a CPU: accelerate imports it to unwrap a model (a save)
    even in runs that do not use it, and left to detect the device it warns, on every CPU machine, that it
    "is setting the accelerator to CPU" - the same choice."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


name_deepspeed_device()


def cpu_mixed_precision() -> bool:
    """True when ``FF_CPU_MIXED_PRECISION`` asks a CPU run to keep ``mixed_precision``."""
    return os.environ.get(CPU_SWITCH, "").strip().lower() in ("1", "true", "yes", "on")


def run_mixed_precision(configured: str, cuda: bool | None = None) -> str:
    """The ``mixed_precision`` a run uses: the config's on a GPU (or on CPU under the switch), else ``no``."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return configured if cuda or cpu_mixed_precision() else "no"


def dtype_of(name: str | torch.dtype | None) -> torch.dtype:
    """``"bf16"``, ``"bfloat16"``, ``"torch.float32"`` or a torch.dtype -> torch.dtype (None: float32)."""
    if name is None:
        return torch.float32
    if isinstance(name, torch.dtype):
        return name
    key = str(name).lower().removeprefix("torch.")
    if key not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPE_NAMES)}")
    return getattr(torch, DTYPE_NAMES[key])


@dataclass(frozen=True)
class Precision:
    """The dtypes of one run (see the module's table)."""

    mixed_precision: str  # "no", "bf16" or "fp16": what accelerate runs
    device_type: str  # "cuda" or "cpu"
    master: torch.dtype = torch.float32  # the trained weights
    trajectory: torch.dtype | None = None  # None: the load dtype

    @classmethod
    def of(cls, mixed_precision: str, device: torch.device | str, master: str | None = None,
           trajectory: str | None = None) -> "Precision":
        return cls(mixed_precision, torch.device(device).type, dtype_of(master),
                   None if trajectory is None else dtype_of(trajectory))

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return AUTOCAST_DTYPES.get(self.mixed_precision)

    @property
    def load(self) -> torch.dtype:
        """The frozen networks' dtype: the autocast dtype, float32 without mixed precision."""
        return self.autocast_dtype or torch.float32

    @property
    def storage(self) -> torch.dtype:
        """The rollout trajectories' dtype."""
        return self.trajectory or self.load

    def autocast(self):
        """The context the networks' calls run under."""
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def describe(self) -> str:
        """One line for a run's first lines."""
        names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
        if self.autocast_dtype is None:
            return (f"precision: float32 on {self.device_type} (no autocast); trained weights "
                    f"{names[self.master]}, trajectories {names[self.storage]}")
        line = (f"precision: {self.mixed_precision} autocast on {self.device_type}; networks loaded in "
                f"{names[self.load]}, trained weights {names[self.master]}, trajectories {names[self.storage]}, "
                "log-probs and losses fp32")
        if self.device_type == "cpu":
            import flow_factory

            line += f" ({CPU_SWITCH}=1"
            line += ("; torch was imported before flow_factory, so the ONEDNN_MAX_CPU_ISA cap may come too "
                     "late: set ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 before Python starts if bf16 crashes)"
                     if flow_factory.ONEDNN_CAP_TOO_LATE else ")")
        return line


def cast_as_loaded(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``module`` (in place) in ``dtype``, but for the parts its ``from_pretrained`` keeps in float32 at that dtype
    (``kept_in_float32``). Not diffusers' ``to(dtype)``, which ignores them and warns about them, even when a class
    keeps none."""
    keep = kept_in_float32(module, dtype)
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.is_floating_point():  # on its own device: .data may change dtype, not device
            tensor.data = tensor.data.to(torch.float32 if any(part in keep for part in name.split(".")) else dtype)
    return module


def kept_in_float32(module: torch.nn.Module, dtype: torch.dtype) -> tuple[str, ...]:
    """The submodule names ``from_pretrained`` loads in float32 when asked for ``dtype``: diffusers keeps its class's
    ``_keep_in_fp32_modules`` (Wan's norms and time embedder) at any dtype; transformers keeps those at fp16 only,
    and its ``_keep_in_fp32_modules_strict`` at fp16 and bf16 (T5's ``wo``: at fp16)."""
    keep = tuple(getattr(module, "_keep_in_fp32_modules", None) or ())
    if not hasattr(module, "_keep_in_fp32_modules_strict"):  # a diffusers model
        return keep
    strict = tuple(module._keep_in_fp32_modules_strict or ())
    return (keep if dtype == torch.float16 else ()) + (strict if dtype in (torch.float16, torch.bfloat16) else ())


def enable_cpu_fp16(accelerator) -> None:
    """fp16 autocast and a gradient scaler on CPU, as accelerate gives a GPU run (it gives a CPU run neither).
    Only ``FF_CPU_MIXED_PRECISION`` gets here; it must run before ``accelerator.prepare`` (the prepared
    optimizer takes the scaler then)."""
    accelerator.native_amp = True  # accelerator.autocast() then enters torch.autocast("cpu", float16)
    accelerator.scaler = torch.amp.GradScaler("cpu")


def avoid_cudnn_attention() -> None:
    """Training on CUDA leaves cuDNN's fused attention out of ``scaled_dot_product_attention``'s choices.

    PyTorch picks cuDNN first for bf16 attention on Hopper GPUs. On an H200 (torch 2.11) its backward gave
    NaN gradients to FLUX.1's and FLUX.2's LoRA weights in every step, and an illegal memory access at 1024 px,
    where flash and memory-efficient attention gave finite gradients (docs/experiments/gpu.md). A model that
    asks for cuDNN by name (``model.attn_backend: _native_cudnn``) still gets it."""
    if torch.cuda.is_available():
        torch.backends.cuda.enable_cudnn_sdp(False)
