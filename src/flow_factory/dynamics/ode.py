"""The deterministic Euler step of the probability-flow ODE: ``x' = x + v dt``."""

import torch

from .base import Dynamics, as_batch_column


class ODE(Dynamics):
    name = "ODE"
    stochastic = False

    def mean_and_std(self, x, v, sigma, sigma_next):
        dt = as_batch_column(sigma_next, x) - as_batch_column(sigma, x)
        return x.float() + v.float() * dt, torch.zeros((), device=x.device)
