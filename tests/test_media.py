"""What a person looks at: grids put each sample beside its conditions; videos are written as H.264 mp4 (or GIF)
files that decode back to what was written, and logged to TensorBoard as animations, not as one frame."""

import io
import wave

import numpy as np
import pytest
import torch
from PIL import Image, ImageSequence

from flow_factory.media import gif_bytes, probe, read_frames, sample_grid, save_grid, save_video, write_mp4, write_wav

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


def test_save_grid_writes_png_for_an_image_and_mp4_or_gif_for_a_video(tmp_path):
    image = sample_grid(torch.rand(2, 3, 16, 16), ["a", "b"], tile=TILE)
    assert save_grid(image, tmp_path / "g") == tmp_path / "g.png"
    video = sample_grid(torch.rand(2, 3, 3, 16, 16), ["a", "b"], tile=TILE)
    path = save_grid(video, tmp_path / "v")
    assert path == tmp_path / "v.mp4" and probe(path).frames == 3 and probe(path).size == video[0].size
    path = save_grid(video, tmp_path / "v", "gif")
    assert path == tmp_path / "v.gif" and Image.open(path).n_frames == 3
    with pytest.raises(ValueError, match="video format 'webm': expected one of mp4, gif"):
        save_video(video, tmp_path / "w", "webm")


def moving_gradient(frames=8, size=(64, 48)) -> list[Image.Image]:
    """Smooth colour ramps that move a few levels and pixels a frame, as a video's content does."""
    y, x = np.mgrid[0:size[1], 0:size[0]]
    return [Image.fromarray(np.stack([64 + 2 * x + 8 * t, 40 + 3 * y, 128 + 60 * np.sin((x + y + 3 * t) / 6)],
                                     -1).astype(np.uint8)) for t in range(frames)]


def rms(a, b) -> float:
    return float(np.sqrt(((np.asarray(a, dtype=float) - np.asarray(b, dtype=float)) ** 2).mean()))


def test_an_mp4_decodes_back_to_its_frames(tmp_path):
    """Frame count, fps and size as written; each frame within H.264's rounding of what was written. At CRF 18
    x264 quantises with a step of about 5 levels (QP 18; up to ~7 in B frames), an RMS error of step / sqrt(12),
    about 1.5 to 2 levels in Y, which the YCbCr -> RGB matrix amplifies up to about 2x (blue from Cb): some 3 to
    4 levels of RMS in RGB. The bound 6 leaves that a margin while a neighbouring frame (13+ away here), a frame
    order or a colour channel gone wrong fails it."""
    frames = moving_gradient()
    path = write_mp4(frames, tmp_path / "clip.mp4", fps=16)
    info = probe(path)
    assert (info.frames, info.fps, info.size) == (8, 16.0, (64, 48))
    decoded = read_frames(path)
    assert len(decoded) == 8 and all(f.mode == "RGB" and f.size == (64, 48) for f in decoded)
    errors = [rms(a, b) for a, b in zip(frames, decoded)]
    assert max(errors) < 6, errors
    assert min(rms(a, b) for a, b in zip(frames[1:], decoded)) > 2 * 6  # the tolerance tells frames apart
    assert probe(write_mp4(frames, tmp_path / "clip24.mp4", fps=24)).fps == 24


def test_an_odd_size_is_padded_to_the_even_one_yuv420p_needs(tmp_path):
    """yuv420p keeps colour per 2x2 pixels: 63x47 is written as 64x48, the last column and row repeated."""
    frames = [f.crop((0, 0, 63, 47)) for f in moving_gradient(frames=3)]
    decoded = read_frames(write_mp4(frames, tmp_path / "odd.mp4", fps=16))
    assert [f.size for f in decoded] == [(64, 48)] * 3
    assert max(rms(a, b.crop((0, 0, 63, 47))) for a, b in zip(frames, decoded)) < 6
    last = np.asarray(decoded[0], dtype=float)
    assert rms(last[:47, 63], np.asarray(frames[0], dtype=float)[:, 62]) < 6  # the repeated column


def test_writing_an_mp4_is_atomic(tmp_path, monkeypatch):
    """An encoder that fails midway leaves the file that was there, and no partial file beside it."""
    import av

    path = write_mp4(moving_gradient(frames=2), tmp_path / "clip.mp4", fps=16)
    before = path.read_bytes()
    calls = []

    def fail_on_the_third(array, format):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("encoder gone")
        return original(array, format=format)

    original = av.VideoFrame.from_ndarray
    monkeypatch.setattr(av.VideoFrame, "from_ndarray", fail_on_the_third)
    with pytest.raises(RuntimeError, match="encoder gone"):
        write_mp4(moving_gradient(frames=4), path, fps=16)
    assert len(calls) == 3 and path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["clip.mp4"]
    with pytest.raises(ValueError, match="frames of one size: frame 1 is 32x32, frame 0 64x48"):
        write_mp4([moving_gradient(1)[0], Image.new("RGB", (32, 32))], path, fps=16)


def tones(rate=16000, seconds=1.0, freqs=(440, 660), amplitude=0.5) -> np.ndarray:
    """One sine a channel, (channels, samples)."""
    t = np.arange(round(seconds * rate)) / rate
    return np.stack([amplitude * np.sin(2 * np.pi * f * t) for f in freqs]).astype(np.float32)


def soundtrack_of(path) -> tuple[np.ndarray, int]:
    """The file's first audio stream, decoded: (channels, samples) and its sample rate."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.audio[0]
        return np.concatenate([f.to_ndarray() for f in container.decode(stream)], axis=1), stream.sample_rate


def test_a_soundtrack_goes_into_the_mp4_as_aac_and_decodes_back(tmp_path):
    """440 Hz left and 660 Hz right for a second at 16 kHz (LTX-2's rate), beside 16 frames at 16 fps. Each
    decoded channel's strongest frequency is its own tone, to the FFT's 1 Hz bin; the waveform is within AAC's
    error (0.005 RMS here, at 128 kbit/s) of what was written, sample-aligned: the same tones a sample late are
    0.06 (440 Hz) and 0.09 (660 Hz) RMS away. The picture is as without sound."""
    rate, sound = 16000, tones()
    path = write_mp4(moving_gradient(frames=16), tmp_path / "clip.mp4", fps=16, audio=sound, sample_rate=rate)
    assert probe(path).frames == 16 and len(read_frames(path)) == 16
    decoded, decoded_rate = soundtrack_of(path)
    assert decoded_rate == rate and decoded.shape[0] == 2
    n = sound.shape[1]
    assert n <= decoded.shape[1] < n + 2048  # AAC pads to whole frames of 1024 samples
    decoded = decoded[:, :n]
    for channel, freq in enumerate((440, 660)):
        assert np.argmax(np.abs(np.fft.rfft(decoded[channel]))) * rate / n == freq
    assert rms(decoded, sound) < 0.03
    assert rms(decoded[:, 1:], sound[:, :-1]) > 0.05

    mono = write_mp4(moving_gradient(frames=4), tmp_path / "mono.mp4", fps=16, audio=sound[0], sample_rate=rate)
    decoded, _ = soundtrack_of(mono)
    assert decoded.shape[0] == 1 and rms(decoded[0, :n], sound[0]) < 0.03


def test_a_soundtrack_that_cannot_be_played_is_refused_before_writing(tmp_path):
    path = tmp_path / "clip.mp4"
    frames = moving_gradient(frames=2)
    with pytest.raises(ValueError, match=r"shape \(3, 16000\): expected \(channels, samples\) with 1 or 2"):
        write_mp4(frames, path, 16, audio=tones(freqs=(1, 2, 3)), sample_rate=16000)
    loud = tones()
    loud[0, 7] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        write_mp4(frames, path, 16, audio=loud, sample_rate=16000)
    with pytest.raises(ValueError, match="sample rate None"):
        write_mp4(frames, path, 16, audio=tones())
    assert not list(tmp_path.iterdir())


def test_beside_a_gif_the_soundtrack_is_a_wav_file(tmp_path):
    """A GIF holds no sound: save_video writes the soundtrack beside it as 16-bit PCM, samples clipped to
    [-1, 1] and rounded to the nearest of 32767 levels, interleaved left, right."""
    sound = tones(seconds=0.25, amplitude=1.2)  # louder than full scale: clipped
    path = save_video(moving_gradient(frames=3), tmp_path / "clip", "gif", 16, audio=sound, sample_rate=16000)
    assert path == tmp_path / "clip.gif" and sorted(p.name for p in tmp_path.iterdir()) == ["clip.gif", "clip.wav"]
    with wave.open(str(tmp_path / "clip.wav")) as f:
        assert (f.getnchannels(), f.getsampwidth(), f.getframerate(), f.getnframes()) == (2, 2, 16000, 4000)
        pcm = np.frombuffer(f.readframes(4000), dtype="<i2").reshape(-1, 2).T
    assert np.array_equal(pcm, np.round(np.clip(sound, -1, 1) * 32767).astype(np.int16))
    assert pcm.max() == 32767 and pcm.min() == -32767
    assert write_wav(sound[1], tmp_path / "right.wav", 8000) == tmp_path / "right.wav"


def test_a_video_grid_reaches_tensorboard_as_an_animation(tmp_path):
    from accelerate import Accelerator
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from flow_factory.trainer.tracking import log_media

    accelerator = Accelerator(log_with="tensorboard", project_dir=str(tmp_path), cpu=True)
    accelerator.init_trackers("run")
    grids = sample_grid(torch.rand(1, 4, 3, 16, 16), ["v"], tile=TILE)
    # the grid written as mp4 (log.video_format's default), which TensorBoard cannot play: it gets a GIF
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


@pytest.mark.parametrize("backend", ["wandb", "swanlab"])
def test_wandb_and_swanlab_get_the_video_file_as_written(tmp_path, monkeypatch, backend):
    """Their Video reads an mp4 (or GIF) from its path: the grid's file goes to it as it is. (Neither package is
    installed here: a stand-in module records what its Video is given.)"""
    import sys
    import types

    from flow_factory.trainer.tracking import log_media

    logged = []
    module = types.ModuleType(backend)
    module.Video = lambda path: ("Video", path)
    monkeypatch.setitem(sys.modules, backend, module)
    tracker = types.SimpleNamespace(log=lambda values, step: logged.append((values, step)))
    accelerator = types.SimpleNamespace(get_tracker=lambda name, unwrap: tracker)
    grids = sample_grid(torch.rand(1, 4, 3, 16, 16), ["v"], tile=TILE)
    path = save_grid(grids, tmp_path / "grid")
    log_media(accelerator, backend, "eval/samples", grids, 3, path)
    assert logged == [({"eval/samples": ("Video", str(tmp_path / "grid.mp4"))}, 3)]
