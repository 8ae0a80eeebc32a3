"""The rollout replay of the distillation trainers (``train.replay_rtol`` / ``replay_atol``), as Flow-Factory's
``replay_generator_boundary`` (the PeterWangyi/Flow-Factory fork at 091df9df, ``models/trajectory_bridge``,
called by its DMD2, TDM and TDM-R1 trainers) checks it.

The generator's losses read its live velocity at a state of its own rollout, ``v = v_theta(x_k, sigma_k)``, and
take the rollout for what that generator does. The check: the ODE step recomputed from the stored ``x_k`` with
that velocity, ``x_k + v (sigma_{k+1} - sigma_k)``, lands on the state the rollout stored after it, within
``atol + rtol |x_{k+1}|``. It costs no transformer call (the loss computes ``v`` anyway). A rollout sampled with
other weights or another guidance than the loss's, or a generator changed since it sampled, fails here instead
of training on a trajectory the generator does not follow.

One difference from upstream, which compares in the promoted dtype: the rollout rounds each state to
``train.latent_storage_dtype`` and integrates on from the rounded value (``trajectory.py``), so the bound also
allows half that dtype's spacing at the stored value (fp16's is 4.9e-4 of it; float32's 6e-8). Elements whose
recomputed step is not finite are left to the non-finite guards, which skip such an update.
"""

from __future__ import annotations

import torch
from torch import Tensor


class ReplayMismatch(RuntimeError):
    """The generator's recomputed step is not the one its rollout stored (the message says where and by how much)."""


@torch.no_grad()
def check_replay(dynamics, batch, v: Tensor, tolerances: tuple[float, float], what: str) -> None:
    """Raise ``ReplayMismatch`` unless ``dynamics``' step from each row's stored state ``batch.x`` at
    ``batch.sigma`` with velocity ``v`` lands on its stored ``batch.x_next`` at ``batch.sigma_next``, the rollout's
    states rounded to ``batch.stored_in``, within ``tolerances`` (rtol, atol; see the module's docstring); ``what``
    names the loss."""
    rtol, atol = tolerances
    x, sigma, sigma_next, x_next, stored_in = batch.x, batch.sigma, batch.sigma_next, batch.x_next, batch.stored_in
    recomputed = dynamics.step(x, v.detach(), sigma, sigma_next).sample
    stored = x_next.float()
    error = (recomputed - stored).abs()
    bound = atol + (rtol + torch.finfo(stored_in).eps / 2) * stored.abs()
    excess = torch.where(torch.isfinite(recomputed), error - bound, torch.zeros_like(error))
    if bool((excess <= 0).all()):
        return
    flat = int(excess.reshape(-1).argmax())
    row = flat // stored[0].numel()
    raise ReplayMismatch(
        f"{what}: the generator's step recomputed from its rollout's state (row {row}, sigma "
        f"{float(sigma.reshape(-1)[row] if sigma.numel() > 1 else sigma):.4g} -> "
        f"{float(sigma_next.reshape(-1)[row] if sigma_next.numel() > 1 else sigma_next):.4g}) lands "
        f"{float(error.reshape(-1)[flat]):.3g} from the state the rollout stored ({float(stored.reshape(-1)[flat]):.4g}; "
        f"allowed: train.replay_atol {atol:g} + train.replay_rtol {rtol:g} x |stored|, and half a "
        f"{str(stored_in).removeprefix('torch.')} spacing). The rollout was not sampled by the weights and "
        "guidance the loss reads (the generator changed since it sampled, or it sampled with other weights or "
        "another guidance scale), or the recomputation differs numerically (bf16 kernels): then raise the "
        "tolerances")
