"""Sampling dynamics: one file per idea, all behind ``Dynamics.mean_and_std``.

The config's ``scheduler`` section chooses here: ``scheduler.dynamics_type`` names a class
of ``DYNAMICS`` and ``scheduler.noise_level`` is its ``a``; ``scheduler.sde_steps`` /
``num_sde_steps`` feed the window (``window.py``).
"""

from .base import Dynamics, StepResult
from .cps import CPS
from .dance_sde import DanceSDE
from .dpm_solver import DPMSolver2M
from .flow_sde import FlowSDE
from .ode import ODE
from .partial import PartlyStochastic

DYNAMICS = {cls.name: cls for cls in (FlowSDE, DanceSDE, CPS, ODE, DPMSolver2M)}


def make_dynamics(name: str, noise_level: float = 0.0) -> Dynamics:
    if name not in DYNAMICS:
        raise ValueError(f"scheduler.dynamics_type: unknown {name!r}; valid: {sorted(DYNAMICS)}")
    return DYNAMICS[name](noise_level)


__all__ = ["CPS", "DPMSolver2M", "DYNAMICS", "DanceSDE", "Dynamics", "FlowSDE", "ODE", "PartlyStochastic", "StepResult",
           "make_dynamics"]
