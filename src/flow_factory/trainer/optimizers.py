"""The optimizer ``train.optimizer`` names: AdamW, or Muon for the weight matrices with AdamW for the rest.

Muon (K. Jordan et al., 2024; torch.optim.Muon) orthogonalises each 2-D update with Newton-Schulz
iterations, so it only applies to matrices: biases, norms and other 1-D weights keep AdamW, as Muon is
used everywhere. A LoRA's weights are all matrices. ``muon_adjust_lr: match_rms_adamw`` (the default
here) scales Muon's update to AdamW's RMS (Moonshot's rule), so a ``learning_rate`` tuned for AdamW
carries over.

Both run as one ``torch.optim.Optimizer`` (``MuonWithAdamW``): accelerate, the gradient scaler, the
non-finite guard and the checkpoint see one object whose param groups and state are those of the two
inner optimizers, so a checkpoint saves and resumes both exactly.
"""

from __future__ import annotations

import torch

OPTIMIZERS = ("adamw", "muon")


MUON_DEFAULTS = {"momentum": 0.95, "nesterov": True, "ns_steps": 5, "adjust_lr_fn": "match_rms_adamw"}


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon over the 2-D parameters, AdamW over the others; one param group list and one state."""

    def __init__(self, params, lr: float, betas, eps: float, weight_decay: float, **muon_options):
        """``muon_options``: ``torch.optim.Muon``'s own (momentum, nesterov, ns_steps, adjust_lr_fn), over
        these defaults."""
        params = list(params)
        matrices, others = [p for p in params if p.ndim == 2], [p for p in params if p.ndim != 2]
        muon_options = {**MUON_DEFAULTS, **muon_options}
        self.muon = torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay,
                                     **muon_options) if matrices else None
        self.adamw = torch.optim.AdamW(others, lr=lr, betas=betas, eps=eps,
                                       weight_decay=weight_decay) if others else None
        # the inner optimizers' own group dicts: a change of lr here (a scheduler, the scaler) reaches them
        super().__init__([g for inner in self._inner() for g in inner.param_groups], {})
        self._share()

    def _inner(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.muon, self.adamw) if o is not None]

    def _share(self) -> None:
        start = 0
        for inner in self._inner():
            n = len(inner.param_groups)
            inner.param_groups = self.param_groups[start:start + n]
            inner.state = self.state
            start += n

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for inner in self._inner():
            inner.step()
        return loss

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)  # new group dicts and a new state: point the inner ones at them
        self._share()


def make_optimizer(params: list, train) -> torch.optim.Optimizer:
    """The optimizer of ``train`` (the config's ``train`` section) over ``params``."""
    return _optimizer(params, train.optimizer, train.learning_rate, (train.adam_beta1, train.adam_beta2),
                      train.adam_epsilon, train.adam_weight_decay,
                      dict(momentum=train.muon_momentum, nesterov=train.muon_nesterov, ns_steps=train.muon_ns_steps,
                           adjust_lr_fn=train.muon_adjust_lr))


def make_role_optimizer(params: list, role) -> torch.optim.Optimizer:
    """The optimizer of one trainable role (``config.distillation.RoleOptimizerSettings``) over ``params``."""
    return _optimizer(params, role.optimizer, role.learning_rate, role.betas, role.eps, role.weight_decay,
                      dict(momentum=role.muon_momentum, nesterov=role.muon_nesterov, ns_steps=role.muon_ns_steps,
                           adjust_lr_fn=role.muon_adjust_lr))


def _optimizer(params: list, kind: str, lr: float, betas, eps: float, weight_decay: float,
               muon_options: dict) -> torch.optim.Optimizer:
    if kind == "muon":
        return MuonWithAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **muon_options)
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)
