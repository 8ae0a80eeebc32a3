"""The deterministic Euler step of the probability-flow ODE: ``x' = x + v dt``."""

import torch

from .base import Dynamics, step_inputs


class ODE(Dynamics):
    name = "ODE"
    stochastic = False

    def mean_and_std(self, x, v, sigma, sigma_next):
        x, v, sigma, sigma_next = step_inputs(x, v, sigma, sigma_next)
        return x + v * (sigma_next - sigma), torch.zeros((), device=x.device)
