"""What a person looks at: grids put each sample beside its conditions; videos are animations, written as GIF
files and logged to TensorBoard as videos, not as one frame."""

import io

import numpy as np
import torch
from PIL import Image, ImageSequence

from flow_factory.media import gif_bytes, sample_grid, save_grid

TILE = 64


def solid(colour, shape=(3, 32, 32)) -> torch.Tensor:
    return torch.tensor(colour, dtype=torch.float32).view(3, 1, 1).expand(*shape).clone()


def frames_of(data: bytes) -> list[np.ndarray]:
    return [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(Image.open(io.BytesIO(data)))]


def test_each_sample_sits_right_of_its_conditions():
    """A cell per sample: its condition images in the first tiles, the sample in the last; a sample with
    fewer conditions leaves the first tiles blank."""
    samples = torch.stack([solid((0, 0, 1)), solid((0, 1, 0))])
    conditions = [[solid((1, 0, 0)), solid((1, 1, 0))], [solid((1, 0, 1))]]
    grid = np.asarray(sample_grid(samples, ["a", "b"], tile=TILE, conditions=conditions))
    assert grid.shape[1] == 3 * TILE  # one cell a row: 3 tiles wide
    centre = TILE // 2
    cell_h = grid.shape[0] // 2
    assert grid[centre, centre].tolist() == [255, 0, 0]  # first condition
    assert grid[centre, TILE + centre].tolist() == [255, 255, 0]  # second
    assert grid[centre, 2 * TILE + centre].tolist() == [0, 0, 255]  # the sample
    assert grid[cell_h + centre, centre].tolist() == [255, 255, 255]  # no second condition: blank
    assert grid[cell_h + centre, TILE + centre].tolist() == [255, 0, 255]
    assert grid[cell_h + centre, 2 * TILE + centre].tolist() == [0, 255, 0]


def test_a_condition_keeps_its_aspect_ratio():
    grid = np.asarray(sample_grid(solid((0, 0, 1))[None], ["a"], tile=TILE,
                                  conditions=[[solid((1, 0, 0), (3, 16, 32))]]))
    # 32 x 16 fits the 64 px tile as 64 x 32, centred: white above and below
    assert grid[5, TILE // 2].tolist() == [255, 255, 255] and grid[TILE // 2, TILE // 2].tolist() == [255, 0, 0]


def test_a_video_grid_is_one_grid_per_frame_and_a_gif():
    """Frame t of each video beside its condition image; a shorter condition video holds its last frame."""
    video = torch.stack([solid((t / 4, 0, 0)) for t in range(5)])[None]  # (1, 5, 3, 32, 32): red fades in
    short = torch.stack([solid((0, 1, 0)), solid((0, 0, 1))])  # a 2-frame condition video: green, then blue
    grids = sample_grid(video, ["v"], tile=TILE, conditions=[[short]])
    assert isinstance(grids, list) and len(grids) == 5
    reds = [np.asarray(g)[TILE // 2, TILE + TILE // 2, 0] for g in grids]
    assert reds == [0, 64, 128, 191, 255]
    conds = [np.asarray(g)[TILE // 2, TILE // 2].tolist() for g in grids]
    assert conds == [[0, 255, 0]] + [[0, 0, 255]] * 4

    frames = frames_of(gif_bytes(grids))
    assert len(frames) == 5
    assert [f[TILE // 2, TILE + TILE // 2, 0] for f in frames] == reds  # flat colours survive the palette


def test_save_grid_writes_png_for_an_image_and_gif_for_a_video(tmp_path):
    image = sample_grid(torch.rand(2, 3, 16, 16), ["a", "b"], tile=TILE)
    assert save_grid(image, tmp_path / "g") == tmp_path / "g.png"
    video = sample_grid(torch.rand(2, 3, 3, 16, 16), ["a", "b"], tile=TILE)
    path = save_grid(video, tmp_path / "v")
    assert path == tmp_path / "v.gif" and Image.open(path).n_frames == 3


def test_a_video_grid_reaches_tensorboard_as_an_animation(tmp_path):
    from accelerate import Accelerator
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from flow_factory.trainer.tracking import log_media

    accelerator = Accelerator(log_with="tensorboard", project_dir=str(tmp_path), cpu=True)
    accelerator.init_trackers("run")
    grids = sample_grid(torch.rand(1, 4, 3, 16, 16), ["v"], tile=TILE)
    log_media(accelerator, "tensorboard", "eval/samples", grids, 3, save_grid(grids, tmp_path / "grid"))
    image = sample_grid(torch.rand(1, 3, 16, 16), ["i"], tile=TILE)
    log_media(accelerator, "tensorboard", "eval/still", image, 3, save_grid(image, tmp_path / "still"))
    accelerator.end_training()

    events = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents.*")).parent))
    events.Reload()
    video, = events.Images("eval/samples")
    assert video.step == 3 and video.encoded_image_string[:6] == b"GIF89a"
    assert len(frames_of(video.encoded_image_string)) == 4
    still, = events.Images("eval/still")
    assert Image.open(io.BytesIO(still.encoded_image_string)).format == "PNG"
