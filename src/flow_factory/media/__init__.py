"""What a person looks at: sample grids with prompts, rewards and conditions (mp4 or animated GIF
for videos), and reward curves; video files read and written (``video``), with a soundtrack
(``audio``).

Shared by the Trainer (eval grids, ``reward_curve.png``) and the CLIs (``ff-sample``,
``ff-eval --grid``).
"""

from .audio import write_wav
from .curves import curve_figure, plot_curves, trailing_mean
from .grid import VIDEO_FORMATS, VIDEO_FPS, caption, eval_grid, gif_bytes, sample_grid, save_grid, save_video
from .video import probe, read_frames, write_mp4

__all__ = ["VIDEO_FORMATS", "VIDEO_FPS", "caption", "curve_figure", "eval_grid", "gif_bytes", "plot_curves", "probe",
           "read_frames", "sample_grid", "save_grid", "save_video", "trailing_mean", "write_mp4", "write_wav"]
