"""KL penalties against the reference policy, per sample, on the scale of the log-probs.

Both are means over the non-batch dimensions, like the log-probs (DESIGN.md), so a
``kl_beta`` means the same thing whatever the latent's size.

- ``x-based``: one SDE step of the policy and of the reference are Gaussians with
  the same scale ``s`` and means ``mu`` and ``mu_ref``; their KL per dimension is
  ``mean((mu - mu_ref)^2) / (2 s^2)``. ``s`` is the step's own scale, the ``std``
  that ``Dynamics.mean_and_std`` returns (``std_dev_t * sqrt(-dt)`` for Flow-SDE).
  flow_grpo writes the same formula but, for its Flow-SDE, passes ``std_dev_t``
  without the ``sqrt(-dt)``: its KL is ours times ``-dt``, so a ``kl_beta`` carried
  over from flow_grpo is worth about ``1 / (-dt)`` times more here.
- ``v-based``: ``mean((v - v_ref)^2)``, the squared distance of the velocities
  (Flow-Factory's ``v-based``); it does not depend on the sampler at all.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..dynamics.base import mean_over_sample

KL_TYPES = ("x-based", "v-based")


def x_based_kl(mean: Tensor, mean_ref: Tensor, std: Tensor | float) -> Tensor:
    """(B,) KL between the policy's and the reference's Gaussian step, per dimension.

    ``std`` broadcasts against ``mean``: a scalar, or a (B, 1, ...) column.
    """
    std = torch.as_tensor(std, dtype=torch.float32, device=mean.device)
    return mean_over_sample((mean.float() - mean_ref.float()) ** 2 / (2 * std**2))


def v_based_kl(v: Tensor, v_ref: Tensor) -> Tensor:
    """(B,) mean squared distance between the policy's and the reference's velocity."""
    return mean_over_sample((v.float() - v_ref.float()) ** 2)
