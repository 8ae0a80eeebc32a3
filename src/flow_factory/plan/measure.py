"""The planner's measurements: the real model code run on the meta device, counted by torch's own tools.

``torch.utils.flop_counter.FlopCounterMode`` counts a call's FLOPs (matmuls, convolutions, attention; its
backward too, and with gradient checkpointing the recomputed forward), and ``PeakBytes`` the bytes its
tensors hold at their peak. Both work on meta tensors, whose shapes are real and whose storage is none, so
a 12 B transformer's call at 1024 px is measured in seconds on a laptop.

The adapter runs on the CPU with the networks on the meta device (``OnMeta`` takes their inputs there):
some adapters read values, such as the real length of a padded prompt (``trim_text``), which a meta tensor
does not hold; the CPU tensors they make are counted with the meta ones, as they would be on the GPU.

Not used, and why: ``torch.distributed._tools.MemTracker`` measures the same peak by kind, but at every
operator it walks every module it has seen to update each one's peak, and at every module call every
parameter of the module: FLUX.1-dev's training call at 1024 px (11 k operators, thousands of modules) ran
over five minutes under it. ``PeakBytes`` keeps a running sum instead, and tells gradients from
activations, which the plan splits apart by backend; tests/test_plan.py holds its figures against
``MemTracker`` (``FrozenAwareMemTracker``) on the real tiny runs. ``FakeTensorMode`` (the GPU-less mode
``MemTracker``'s docs name) refuses those values
too (``DataDependentOutputException``), and diffusers' forwards fail on fake CUDA tensors (the note in
shared/notes/gpu-path-on-cpu.md); meta tensors serve the same. ``FSDPMemTracker`` needs the model
``fully_shard``-ed over a fake process group of N ranks, once per backend and process count, and nothing of
it covers DeepSpeed, so the sharded backends are arithmetic on the one-process figures (plan/memory.py);
``RuntimeEstimator`` times operators on a real device or by roofline per operator, where the plan states one
utilisation for every FLOP (plan/work.py).
"""

from __future__ import annotations

import time
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F
from torch.distributed._tools import MemTracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from .values import KnownValues

aten = torch.ops.aten

# torch registers no FLOP formula for the CPU's fused attention (FlopCounterMode counts it as 0), where the
# CUDA kernels have one: the same formula here, so a real CPU call counts what the planned GPU call does
flop_counter.flop_registry[aten._scaled_dot_product_flash_attention_for_cpu] = \
    flop_counter.flop_registry[aten._scaled_dot_product_flash_attention]
flop_counter.flop_registry[aten._scaled_dot_product_flash_attention_for_cpu_backward] = \
    flop_counter.flop_registry[aten._scaled_dot_product_flash_attention_backward]


class FrozenAwareMemTracker(MemTracker):
    """``MemTracker`` in a module with frozen parameters: torch 2.13's registers a gradient hook on every
    parameter of a module it enters, which raises on one that needs no gradient (LoRA's base weights, a
    frozen expert). Hooks go only on the trained ones here, and only the whole call's peak is kept (not each
    module's); the rest of the tracking is torch's, the weights included (as PARAM and BUFFER): untracked, a
    weight met through a view (``aten.t`` in every ``linear``) would be counted as an activation."""

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        # a frozen parameter shows torch's loop a hook already there (an empty entry), so it installs none
        frozen = [p for p in module.parameters() if not p.requires_grad and p not in self._param_to_grad_hook_handles]
        for param in frozen:
            self._param_to_grad_hook_handles[param] = ()
        try:
            return super()._track_module_params_and_buffers(module, install_grad_hooks)
        finally:
            for param in frozen:
                self._param_to_grad_hook_handles.pop(param, None)

    def _update_peak_stats(self, peak_state) -> None:
        # torch's global peak, as torch updates it; its per-module peaks, which nothing here reads, are left out:
        # torch updates them by walking every module it has seen at every operator (most of a tiny LTX-2 step's time)
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[device] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[device] = dict(snapshot)


class PeakBytes(TorchDispatchMode):
    """The most bytes the tensors made under it held at once, gradients of trained weights apart: each new
    storage counted from the operator that made it until it is freed (a weak reference's callback). An
    operator's output that shares an input's storage (a view such as ``aten.t`` of a weight, an in-place
    operator) is no new memory: not counted. The weights, made before, are never in it. A storage that
    becomes a trained parameter's ``.grad`` (``gradient``) leaves the activations for ``grads``: the plan
    counts the gradients apart, split by the backend (plan/memory.py)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.grads = 0
        self._held: dict[int, list] = {}  # storage key -> [weak reference, bytes, is a gradient]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _key(t) not in inputs:
                self._hold(t.untyped_storage())
        self.peak = max(self.peak, self.live)
        return out

    def _hold(self, storage) -> None:
        key = storage._cdata
        if key in self._held:
            return
        size = storage.nbytes()
        self.live += size

        def freed(_ref, key=key):
            _, size, grad = self._held.pop(key)
            if grad:
                self.grads -= size
            else:
                self.live -= size
        self._held[key] = [weakref.ref(storage, freed), size, False]

    def gradient(self, grad: torch.Tensor) -> None:
        """``grad`` is now a trained parameter's gradient (a post-accumulate-grad hook)."""
        entry = self._held.get(_key(grad))
        if entry is not None and not entry[2]:
            entry[2] = True
            self.live -= entry[1]
            self.grads += entry[1]


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _NoModules:
    """A ``ModuleTracker`` that tracks nothing: every FLOP is the call's ("Global")."""

    parents = frozenset({"Global"})

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return None


class CallFlops(FlopCounterMode):
    """``FlopCounterMode`` without its per-module breakdown, which the plan does not read: to attribute a FLOP
    to its module, torch's ``ModuleTracker`` registers a gradient hook on every module call's inputs and
    outputs, and under gradient checkpointing those hooks change what the call holds (tiny FLUX's LoRA
    micro-batch: 5.0 MB with them, 3.5 MB without, as the real run without a counter). The total is torch's
    count, operator by operator."""

    def __init__(self):
        super().__init__(display=False)
        self.mod_tracker = _NoModules()


@contextmanager
def fused_attention_on_meta():
    """``scaled_dot_product_attention`` on meta tensors as a GPU runs it: the fused kernels, which keep no
    attention matrix for the backward (flash without a mask, memory-efficient with one). On meta, torch would
    pick the math path, whose saved (L x S) weights are not what a GPU holds. The function is swapped, not
    intercepted by a TorchFunctionMode: gradient checkpointing's recomputation runs on autograd's thread,
    which a mode does not reach, and must save what the forward saved."""
    original = torch.nn.functional.scaled_dot_product_attention

    def attention(query, *args, **kwargs):
        return (fused_attention if query.device.type == "meta" else original)(query, *args, **kwargs)
    torch.nn.functional.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    q, k, v = query, key, value
    if enable_gqa and k.shape[-3] != q.shape[-3]:  # the kernels take grouped heads; on meta a copy is free
        k, v = (x.repeat_interleave(q.shape[-3] // x.shape[-3], dim=-3) for x in (k, v))
    if attn_mask is None:
        return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    if attn_mask.dtype == torch.bool:  # as torch's convert_boolean_attn_mask makes the kernel's bias: filled in place
        attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill_(attn_mask.logical_not(), -torch.inf)
    bias = attn_mask.to(q.dtype).expand(*q.shape[:-1], k.shape[-2])
    return aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, dropout_p, is_causal, scale=scale)[0]


# autocast's lower-precision operators that hold most of a call's memory: their inputs are cast to the autocast
# dtype, and what they save for the backward is that cast
AUTOCAST_LOW = ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d")


@contextmanager
def autocast_on_meta(dtype: torch.dtype | None):
    """What ``torch.autocast`` does to a GPU call's memory, on meta tensors, for which torch has no autocast
    (``torch.autocast("meta")`` is refused: autocast is a dispatch key of the CUDA, CPU, ... tensors only).
    ``torch.nn.functional``'s linear and convolutions cast their meta inputs to ``dtype``: a LoRA layer's
    float32 weights otherwise make it keep a float32 copy of its input for the backward, where autocast keeps
    one in bf16 (FLUX.1-dev at 1024 px without checkpointing: 30.7 GiB of activations planned without this,
    25.8 with it; the H200's run held about 25, docs/experiments/gpu.md). Functions are swapped, not intercepted
    by a ``TorchFunctionMode``: checkpointing's recomputation runs on autograd's thread, which a mode does not
    reach, and must cast as the forward did (or torch's checkpoint refuses the recomputed dtypes).

    Not emulated, and why: autocast's float32 list (CUDA runs layer_norm, group_norm, softmax, log_softmax,
    pow, exp, ... in float32; diffusers' RMSNorm already casts to float32 itself). Emulated as the linears are
    (their meta inputs cast to float32: ``F.layer_norm``, ``F.group_norm``, ``F.softmax``, ``F.log_softmax``), it
    changed FLUX.1-dev's training micro-batch at 1024 px (LoRA rank 64, one sample) from 2.30 to 2.33 GiB of
    activations with checkpointing (+1 %) and from 25.8 to 27.8 without (+8 %; sampling 0.46 to 0.49), where
    the H200's run held about 2.5 and 25.0 (docs/experiments/gpu.md): the one measurement there is moves the
    figure without checkpointing from +3 % of it to +11 %, so the emulation is left out until a GPU
    measurement says otherwise (docs/experiments/plan.md, 2026-11-29). Nor ``matmul`` / ``bmm`` called
    directly (most attention is ``scaled_dot_product_attention``, whose inputs are the linears' outputs)."""
    if dtype is None:
        yield
        return
    saved = {name: getattr(F, name) for name in AUTOCAST_LOW}

    def cast_inputs(fn):
        def call(*args, **kwargs):
            if not any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in args):
                return fn(*args, **kwargs)
            cast = lambda a: a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a  # noqa: E731
            return fn(*map(cast, args), **{k: cast(v) for k, v in kwargs.items()})
        return call
    for name, fn in saved.items():
        setattr(F, name, cast_inputs(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(F, name, fn)


class OnMeta(nn.Module):
    """A network on the meta device, called by an adapter that runs on the CPU: its tensor inputs go there."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        move = lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x  # noqa: E731
        return self.module(*tree_map(move, args), **tree_map(move, kwargs))


@dataclass
class Measured:
    flops: int  # FlopCounterMode's count, forward (and backward)
    peak: int  # bytes the tensors the call made held at their peak, its gradients apart: activations, temporaries, inputs
    seconds: float = 0.0
    gradients: dict[str, int] = field(default_factory=dict)  # per network, trained parameters the call gave a gradient


@contextmanager
def adapter_on_cpu(adapter):
    """The adapter's own code on the CPU, its networks (``denoiser_for``) on the meta device."""
    saved = adapter.device, dict(adapter.callers)
    adapter.device = torch.device("cpu")
    adapter.callers = {name: OnMeta(module) for name, module in adapter.transformers.items()}
    try:
        yield adapter
    finally:
        adapter.device, adapter.callers = saved


def values_if_read(measure) -> "Measured":
    """``measure(values)`` with ``values`` a null context; where the code reads a value that meta tensors lack
    (``item()``, a boolean index: a ``RuntimeError``), once more with ``KnownValues`` (plan/values.py), which
    keeps the values of the small tensors computed from the inputs (HunyuanVideo-1.5's masks). Not always
    with it: it costs a quarter of a tiny call's time (every operator's inputs looked at), and most networks
    read nothing. An error that is not about values comes back from the second call."""
    try:
        return measure(nullcontext())
    except RuntimeError:
        return measure(KnownValues())


def measure_velocity(adapter, latents: torch.Tensor, sigma: float, cond: dict, guidance_scale: float,
                     train: bool, autocast: torch.dtype | None = None) -> Measured:
    """One ``adapter.velocity`` call: with ``train``, forward and backward of a loss on it, as a training
    micro-batch (the algorithms' losses are elementwise on the velocity: nothing a GPU notices). Its peak
    leaves out the trained parameters' gradients; it counts the parameters that got one (not every trained
    one does: the text branch of a double-stream model's last block feeds no output), which alone get
    gradients and optimizer state in a run."""
    trained = [p for module in adapter.transformers.values() for p in module.parameters() if p.requires_grad]

    def measure(values) -> Measured:
        start, tracker = time.perf_counter(), PeakBytes()
        hooks = [p.register_post_accumulate_grad_hook(lambda p: tracker.gradient(p.grad)) for p in trained] \
            if train else []
        try:
            with adapter_on_cpu(adapter), torch.set_grad_enabled(train), fused_attention_on_meta(), \
                    autocast_on_meta(autocast), CallFlops() as counter, tracker, values:
                sigmas = torch.full((len(latents),), float(sigma))
                v = adapter.velocity(latents, sigmas, cond, guidance_scale)
                if train:
                    v.float().square().mean().backward()
                del v
            gradients = {name: sum(p.numel() for p in module.parameters() if p.requires_grad and p.grad is not None)
                         for name, module in adapter.transformers.items()}
        finally:
            for hook in hooks:
                hook.remove()
            for p in trained:
                p.grad = None
        return Measured(counter.get_total_flops(), tracker.peak, time.perf_counter() - start, gradients)
    return values_if_read(measure)


def measure_call(fn, *args, autocast: torch.dtype | None = None) -> Measured:
    """A no-grad call of ``fn`` (a decode, a reward model's forward) on meta tensors."""
    def measure(values) -> Measured:
        start, tracker = time.perf_counter(), PeakBytes()
        with torch.no_grad(), fused_attention_on_meta(), autocast_on_meta(autocast), CallFlops() as counter, \
                tracker, values:
            fn(*args)
        return Measured(counter.get_total_flops(), tracker.peak, time.perf_counter() - start)
    return values_if_read(measure)
