"""What a person looks at: sample grids with prompts, rewards and conditions (animated GIFs for
videos), and reward curves.

Shared by the Trainer (eval grids, ``reward_curve.png``) and the CLIs (``ff-sample``,
``ff-eval --grid``).
"""

from .curves import curve_figure, plot_curves, trailing_mean
from .grid import VIDEO_FPS, caption, gif_bytes, sample_grid, save_grid

__all__ = ["VIDEO_FPS", "caption", "curve_figure", "gif_bytes", "plot_curves", "sample_grid", "save_grid",
           "trailing_mean"]
