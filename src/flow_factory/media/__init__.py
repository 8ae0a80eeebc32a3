"""What a person looks at: sample grids with prompts and rewards, and reward curves.

Shared by the Trainer (eval grids, ``reward_curve.png``) and the CLIs (``ff-sample``,
``ff-eval --grid``).
"""

from .curves import curve_figure, plot_curves, trailing_mean
from .grid import caption, sample_grid

__all__ = ["caption", "curve_figure", "plot_curves", "sample_grid", "trailing_mean"]
