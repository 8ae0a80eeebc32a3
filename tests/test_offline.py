"""Offline training (``sft``, ``offline-dpo``) from Flow-Factory's schema_version 2 records: the losses by
hand, every bad row an error naming its file and line before the model loads, and ``ff-train`` end to end on
tiny SD3 (SFT lowers the flow-matching error on its images; exact resume), offline DPO, offline DPO of an
editing model (FLUX.1 Kontext) whose pairs share a condition image, SFT of Wan image-to-video; a video model (Wan2.1) trains both from
mp4 files, each row's input encoded once; every family encodes its outputs to its own latents but LTX-2,
refused naming why."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from helpers_runs import (CONDITIONED_MODELS, OWN_FILE_CONDITIONED_MODELS, TINY_MODELS, straight_and_resumed,
                          tiny_run_config, write_condition_image, write_condition_video, write_config)
from safetensors.torch import load_file

from flow_factory.algorithms import best_and_worst, flow_matching_loss
from flow_factory.data import PromptFileError
from flow_factory.data.offline import VideoOutputs, load_offline
from flow_factory.train import main

COLOURS = {"red": (200, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 200), "grey": (128, 128, 128)}


def _record(prompt, supervision, media=()):
    return {"schema_version": 2, "input": {"prompt": prompt, "media": list(media)}, "supervision": supervision,
            "metadata": {"row": prompt}}


def _image(name):
    return {"media": [{"type": "image", "path": f"images/{name}.png"}]}


def _video(name):
    return {"media": [{"type": "video", "path": f"videos/{name}.mp4", "fps": 16.0}]}


def write_offline_dataset(folder, kind, conditioned=False, size=(64, 64), frames=None):
    """train.jsonl (3 records) and test.jsonl (1) of ``kind``, their images under images/ (``frames``: their
    videos of that many frames under videos/, mp4)."""
    for i, (name, colour) in enumerate(COLOURS.items()):
        if frames:
            write_condition_video(folder / "videos" / f"{name}.mp4", size, colour, seed=i, frames=frames)
        if not frames or (conditioned and name == "grey"):
            write_condition_image(folder / "images" / f"{name}.png", size, colour, seed=i)
    inputs = [{"type": "image", "path": "images/grey.png"}] if conditioned else []
    output = _video if frames else _image
    rows = []
    for name in ("red", "green", "blue"):
        if kind == "demonstration":
            supervision = {"type": "demonstration", "target": output(name)}
        else:
            supervision = {"type": "preference", "chosen": output(name), "rejected": output("grey")}
        rows.append(_record(f"a {name} square", supervision, inputs))
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "test.jsonl").write_text(json.dumps(rows[0]) + "\n")
    return folder


def test_the_sft_loss_is_the_mean_squared_velocity_error():
    v, target = torch.tensor([[1.0, 2.0], [0.0, 0.0]]), torch.tensor([[0.0, 0.0], [1.0, 3.0]])
    assert flow_matching_loss(v, target).item() == pytest.approx(((1 + 4) / 2 + (1 + 9) / 2) / 2)


def test_a_preference_record_is_its_own_pair():
    """The offline epoch gives each record two samples, chosen +1 then rejected -1, one group: DPO's
    best-and-worst pair is (chosen, rejected) of the same record."""
    groups, advantages = torch.tensor([4, 4, 9, 9]), torch.tensor([1.0, -1.0, 1.0, -1.0])
    assert best_and_worst(groups, advantages).tolist() == [[0, 1], [2, 3]]


@pytest.mark.parametrize("change, message", [
    (lambda r: r.update(schema_version=1), r"train.jsonl:2: schema_version: Input should be 2"),
    (lambda r: r["supervision"]["target"]["media"][0].update(path="images/none.png"),
     r"train.jsonl:2: supervision.target 'images/none.png' \(.*none.png\) not found"),
    (lambda r: r.update(supervision={"type": "preference", "chosen": _image("red"), "rejected": _image("grey")}),
     r"train.jsonl:2: supervision type 'preference'; this run trains on demonstration records only"),
    (lambda r: r["supervision"]["target"]["media"][0].update(type="video", path="clip.mp4"),
     r"train.jsonl:2: supervision.target: \['video'\]: an output here is one image: this model makes images"),
    (lambda r: r.update(extra=1), r"train.jsonl:2: extra: Extra inputs are not permitted"),
])
def test_a_bad_row_is_named_by_file_and_line(tmp_path, change, message):
    folder = write_offline_dataset(tmp_path, "demonstration")
    rows = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    change(rows[1])
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(PromptFileError, match=message):
        load_offline(folder, "train", "demonstration")


def test_a_pair_of_two_sizes_is_refused(tmp_path):
    folder = write_offline_dataset(tmp_path, "preference")
    write_condition_image(folder / "images" / "grey.png", (48, 64), COLOURS["grey"])
    with pytest.raises(PromptFileError, match=r"train.jsonl:1: chosen is 64x64 and rejected 48x64: a pair's two "
                                              r"images must be one size"):
        load_offline(folder, "train", "preference")


# a video model's outputs: mp4 files one frame longer than tiny Wan's 5 (its first 5 train), at its 32x32
VIDEO_FRAMES, VIDEO_SIZE = 6, (32, 32)  # tiny LTX-2's: 10 frames


def _video_rows(tmp_path, kind):
    folder = write_offline_dataset(tmp_path, kind, size=VIDEO_SIZE, frames=VIDEO_FRAMES)
    return folder, [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]


def _media(path, type="video"):
    return {"media": [{"type": type, "path": path}]}


@pytest.mark.parametrize("change, message", [
    (lambda r: r["supervision"].update(target=_media("images/red.png", "image")),
     r"train.jsonl:2: supervision.target: \['image'\]: an output here is one video: this model makes videos"),
    (lambda r: r["supervision"].update(target=_media("images/red.png")),
     r"train.jsonl:2: supervision.target 'images/red.png' \(.*red.png\) is a single image, not a video"),
    (lambda r: r["supervision"].update(target=_media("videos/none.mp4")),
     r"train.jsonl:2: supervision.target 'videos/none.mp4' \(.*none.mp4\) not found"),
    (lambda r: r["supervision"].update(target=_media("videos/short.mp4")),
     r"train.jsonl:2: supervision.target 'videos/short.mp4' \(.*short.mp4\) has 3 frames; train.num_frames is 5"),
])
def test_a_bad_video_row_is_named_by_file_and_line(tmp_path, change, message):
    """A video model's records: an image as the output, a still named as a video, a missing file, a video shorter
    than train.num_frames."""
    folder, rows = _video_rows(tmp_path, "demonstration")
    write_condition_image(folder / "images" / "red.png", VIDEO_SIZE, COLOURS["red"])
    write_condition_video(folder / "videos" / "short.mp4", VIDEO_SIZE, COLOURS["red"], frames=3)
    change(rows[1])
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(PromptFileError, match=message):
        load_offline(folder, "train", "demonstration", video=VideoOutputs(5))


@pytest.mark.parametrize("size, frames, message", [
    ((48, 32), VIDEO_FRAMES, r"train.jsonl:1: chosen is 32x32 and rejected 48x32: a pair's two videos must be one "
                             r"size"),
    (VIDEO_SIZE, 9, r"train.jsonl:1: chosen \(red.mp4\) has 6 frames and rejected \(grey.mp4\) 9: a pair's two "
                    r"videos must have as many frames"),
])
def test_a_video_pair_of_two_sizes_or_lengths_is_refused(tmp_path, size, frames, message):
    folder, _ = _video_rows(tmp_path, "preference")
    write_condition_video(folder / "videos" / "grey.mp4", size, COLOURS["grey"], frames=frames)
    with pytest.raises(PromptFileError, match=message):
        load_offline(folder, "train", "preference", video=VideoOutputs(5))


def test_train_frame_rate_reads_a_video_on_its_clock(tmp_path):
    """Flow-Factory's train.frame_rate for offline video: frame k is the source's frame shown at k / frame_rate
    (the source's rate: the record's fps, else the file's), the epoch reads those frames; a source too short for
    the last one is refused naming it. Kept by the config for sft of a video model (no 'changes nothing' note)."""
    from types import SimpleNamespace

    from flow_factory.data.media import read_video
    from flow_factory.trainer.offline import OfflineEpochs

    folder, rows = _video_rows(tmp_path, "demonstration")
    write_condition_video(folder / "videos" / "long.mp4", VIDEO_SIZE, COLOURS["red"], frames=12)  # 16 fps
    rows[0]["supervision"]["target"]["media"][0].update(path="videos/long.mp4")
    (folder / "train.jsonl").write_text(json.dumps(rows[0]) + "\n")
    (record,) = load_offline(folder, "train", "demonstration", video=VideoOutputs(5, frame_rate=8.0))
    assert record.frames == ((0, 2, 4, 6, 8),)
    epochs = OfflineEpochs([record], SimpleNamespace(is_video=True), SimpleNamespace(width=32, height=32), 0)
    frames = read_video(record.outputs[0])
    assert len(frames) == 12 and read_video(record.outputs[0], 9) == frames[:9]  # decoding stops at a limit
    expected = [torch.from_numpy(np.asarray(frames[i].resize((32, 32), Image.Resampling.BICUBIC)).copy()) for i in
                (0, 2, 4, 6, 8)]
    torch.testing.assert_close(epochs.pixels(record.outputs[0], record.frames[0]),
                               torch.stack(expected).permute(0, 3, 1, 2).float() / 255)
    rows[0]["supervision"]["target"]["media"][0].update(fps=32.0)  # the record's rate wins over the file's
    (folder / "train.jsonl").write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(PromptFileError, match=r"train.jsonl:1: supervision.target 'videos/long.mp4' \(.*\) has 12 "
                                              r"frames at 32 fps \(0.375 s\); train.num_frames 5 at train.frame_rate "
                                              r"8 reads its frame at 0.5 s"):
        load_offline(folder, "train", "demonstration", video=VideoOutputs(5, frame_rate=8.0))


def test_the_config_keeps_frame_rate_for_offline_video(tmp_path):
    from flow_factory.config import parse_config

    config = tiny_run_config(tmp_path, "wan2_t2v", tmp_path, trainer_type="sft", frame_rate=10.0, group_size=1)
    config.pop("rewards")
    cfg = parse_config(config)
    assert cfg.train.frame_rate == 10.0 and not [n for n in cfg.notes() if "frame_rate" in n]
    config["train"]["trainer_type"], config["rewards"] = "grpo", [{"reward_model": "jpeg_compressibility"}]
    config["train"]["group_size"] = 2
    assert parse_config(config).train.frame_rate is None  # generating, Wan writes at its own rate: a note


def _offline_config(tmp_path, model_type, path, trainer_type, kind, conditioned=False, **train):
    config = tiny_run_config(tmp_path, model_type, path, trainer_type=trainer_type, per_device_batch_size=1,
                             group_size=1, **{"learning_rate": 1e-3, "max_epochs": 2, **train})
    # a video model's frames: one more in each file
    frames = {**TINY_MODELS, **CONDITIONED_MODELS, **OWN_FILE_CONDITIONED_MODELS}[model_type][2]
    frames = frames and frames + 1
    config["data"]["dataset_dir"] = str(write_offline_dataset(tmp_path / "offline", kind, conditioned,
                                                              size=VIDEO_SIZE if frames else (64, 64), frames=frames))
    config["scheduler"] = {"dynamics_type": "ODE", "noise_level": 0.0}
    config.pop("rewards")
    config["eval"]["eval_freq"] = 0
    return config


def _lora(run_dir, epoch):
    return load_file(run_dir / "checkpoints" / f"epoch_{epoch}" / "pytorch_lora_weights.safetensors")


def test_ff_train_sft_fits_its_images_and_resumes_exactly(tmp_path, tiny_sd3_path):
    """Four epochs of SFT on three demonstrations: the flow-matching error of the trained LoRA on those images
    (fixed noise and noise levels) is below the base model's; stopped after epoch 2 and resumed, the run ends
    at the uninterrupted run's LoRA."""
    straight, resumed = straight_and_resumed(
        tmp_path, lambda folder, epochs: _offline_config(folder, "sd3-5", tiny_sd3_path, "sft", "demonstration",
                                                         max_epochs=epochs),
        epochs=4, stop_after=2)
    for k, v in _lora(straight, 4).items():
        torch.testing.assert_close(_lora(resumed, 4)[k], v, atol=1e-6, rtol=0)
    history = json.loads((straight / "history.json").read_text())["train"]
    assert [r["epoch"] for r in history] == [0, 1, 2, 3] and all("train/flow_matching_loss" in r for r in history)

    from flow_factory.checkpoint import load_for_sampling

    folder = tmp_path / "a" / "offline"
    errors = []
    for checkpoint in (None, straight / "checkpoints" / "epoch_4"):
        adapter = load_for_sampling("sd3-5", tiny_sd3_path, checkpoint, device="cpu")
        images = torch.stack([torch.from_numpy(np.asarray(Image.open(folder / "images" / f"{n}.png").convert("RGB"))
                                               .copy()).permute(2, 0, 1).float() / 255 for n in ("red", "green", "blue")])
        x0 = adapter.encode_media(images)
        g = torch.Generator().manual_seed(0)
        noise, sigma = torch.randn(x0.shape, generator=g), torch.tensor([0.3, 0.5, 0.7])
        x_t = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * noise
        cond = adapter.encode([f"a {n} square" for n in ("red", "green", "blue")], None, 3.0)
        with torch.no_grad():
            errors.append(flow_matching_loss(adapter.velocity(x_t, sigma, cond, 3.0), noise - x0).item())
    assert errors[1] < errors[0], f"SFT did not lower the flow-matching error on its images: {errors}"


@pytest.mark.parametrize("model_type,fixture,trainer_type,kind,conditioned", [
    ("sd3-5", "tiny_sd3_path", "offline-dpo", "preference", False),
    ("flux1-kontext", "tiny_flux_kontext_path", "offline-dpo", "preference", True),  # pairs sharing a source image
    ("wan2_i2v", "tiny_wan_i2v_path", "sft", "demonstration", True),  # Wan2.1 I2V: videos from a first frame
    ("z-image-omni", "tiny_z_image_omni_path", "sft", "demonstration", True),  # images from a condition image
    ("z-image-omni", "tiny_z_image_omni_path", "offline-dpo", "preference", False),  # and from text alone
    ("qwen-image-2.1", "tiny_qwen_image21_path", "sft", "demonstration", True),  # edits of a source image
])
def test_ff_train_offline_runs_two_epochs(request, tmp_path, model_type, fixture, trainer_type, kind, conditioned):
    path = request.getfixturevalue(fixture)
    config = _offline_config(tmp_path, model_type, path, trainer_type, kind, conditioned)
    assert main([str(write_config(tmp_path, config))]) == 0
    run_dir = tmp_path / "saves" / "run"
    history = json.loads((run_dir / "history.json").read_text())["train"]
    expected = "train/implicit_accuracy" if trainer_type == "offline-dpo" else "train/flow_matching_loss"
    assert [r["epoch"] for r in history] == [0, 1] and all(expected in r for r in history)
    lora = _lora(run_dir, 2)
    assert max(float(v.abs().max()) for k, v in lora.items() if "lora_B" in k) > 0, "the LoRA did not move"


@pytest.mark.parametrize("trainer_type, kind", [("sft", "demonstration"), ("offline-dpo", "preference")])
def test_a_video_model_trains_offline_from_video_files(tmp_path, tiny_wan_path, trainer_type, kind):
    """Tiny Wan2.1 text-to-video, a step from records whose outputs are mp4 files: each output's first 5 frames
    encoded to the model's latents, once; each row's prompt encoded once an epoch though a pair has two outputs
    (no prompt cache here, data.enable_preprocess false); the LoRA moves."""
    from flow_factory.config import parse_config
    from flow_factory.trainer import Trainer

    config = _offline_config(tmp_path, "wan2_t2v", tiny_wan_path, trainer_type, kind, max_epochs=1)
    config["data"]["enable_preprocess"] = False
    trainer = Trainer(parse_config(config))
    encoded, encode = [], trainer.adapter.encode
    trainer.adapter.encode = lambda prompts, *args, **kwargs: encoded.extend(prompts) or encode(prompts, *args, **kwargs)
    trainer.train()
    assert sorted(encoded) == sorted(f"a {n} square" for n in ("red", "green", "blue"))
    outputs = 1 if kind == "demonstration" else 2
    assert {tuple(z.shape) for z in trainer.offline._latents.values()} == {(outputs, 16, 2, 4, 4)}
    run_dir = tmp_path / "saves" / "run"
    metric = "train/implicit_accuracy" if trainer_type == "offline-dpo" else "train/flow_matching_loss"
    assert metric in json.loads((run_dir / "history.json").read_text())["train"][0]
    assert max(float(v.abs().max()) for k, v in _lora(run_dir, 1).items() if "lora_B" in k) > 0, "no LoRA moved"
    # an output of another size is resized as WanPipeline's video processor resizes an input video
    from flow_factory.data.media import check_video, read_video

    other = check_video(write_condition_video(tmp_path / "other.mp4", (48, 40), COLOURS["blue"], frames=6))
    expected = trainer.adapter.pipeline.video_processor.preprocess_video(read_video(other)[:5], height=32, width=32)
    torch.testing.assert_close(trainer.offline.pixels(other, (0, 1, 2, 3, 4)), expected[0].transpose(0, 1) / 2 + 0.5)


@pytest.mark.parametrize("model_type, fixture", [(m, TINY_MODELS[m][0]) for m in (
    "wan2_t2v", "qwen-image", "z-image", "flux2", "flux2-klein", "hunyuanvideo15", "qwen-image-2.1")] + [
    ("wan2_t2v", "tiny_wan22_ti2v_path")])  # Wan2.2 TI2V-5B: its 48-channel x16 VAE
def test_every_family_encodes_its_outputs_to_its_latents(request, model_type, fixture):
    """encode_media gives a sample's latent shape from images or (B, F, 3, H, W) videos; FLUX.2's equals its
    pipeline's own encoding of a reference image (the mode, patchified, batch-norm normalised)."""
    from flow_factory.models import load_adapter

    _, size, frames, _ = TINY_MODELS[model_type]
    adapter = load_adapter(model_type, request.getfixturevalue(fixture))
    assert adapter.offline_refusal() is None
    media = torch.rand(2, *((frames, 3) if frames else (3,)), size, size, generator=torch.Generator().manual_seed(0))
    latents = adapter.encode_media(media)
    assert latents.shape == (2, *adapter.latent_shape(size, size, frames)) and latents.dtype == torch.float32
    if model_type.startswith("flux2"):
        torch.testing.assert_close(latents, adapter.pipeline._encode_vae_image(media * 2 - 1, None).float())
    if model_type == "qwen-image-2.1":  # opaque RGBA, as its pipeline encodes a condition image
        rgba = torch.cat([media, torch.ones_like(media[:, :1])], 1)[:, :, None] * 2 - 1
        theirs = adapter.pipeline._encode_vae_image(rgba, None)[:, :, 0]
        torch.testing.assert_close(latents, theirs.float(), rtol=0, atol=1e-5)


def _with_soundtracks(folder, seconds=0.5, rate=16000):
    """Each output of the records gains a WAV soundtrack after its video (a tone of its own pitch)."""
    from flow_factory.media.audio import write_wav

    t = np.arange(round(seconds * rate)) / rate
    for i, name in enumerate(COLOURS):
        (folder / "audios").mkdir(exist_ok=True)
        write_wav(0.3 * np.sin(2 * np.pi * (220 + 110 * i) * t)[None].repeat(2, 0), folder / "audios" / f"{name}.wav",
                  rate)
    rows = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    for row in rows:
        for side in ("target", "chosen", "rejected"):
            if side in row["supervision"]:
                media = row["supervision"][side]["media"]
                name = media[0]["path"].split("/")[-1].replace(".mp4", ".wav")
                media.append({"type": "audio", "path": f"audios/{name}", "sample_rate": rate})
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_ltx2_trains_offline_from_videos_and_their_soundtracks(tmp_path, tiny_ltx2_path):
    """Tiny LTX-2 (video with audio): each output is an mp4 and its WAV, as Flow-Factory orders them; the video is
    read at LTX-2's 24 fps from the mp4's 16, the sound resampled to the audio VAE's rate for the video's duration;
    both encoded into the one latent; the LoRA moves. A record without the soundtrack is refused naming its line."""
    from flow_factory.config import parse_config
    from flow_factory.trainer import Trainer

    kind = "demonstration"  # offline-dpo shares every step of it (tiny Wan trains both)
    config = _offline_config(tmp_path, "ltx2_t2av", tiny_ltx2_path, "sft", kind, max_epochs=1)
    folder = tmp_path / "offline"
    rows = _with_soundtracks(folder)
    trainer = Trainer(parse_config(config))
    trainer.train()
    (record,) = [r for r in trainer.offline.records if r.item.prompt == "a red square"]
    assert record.frames[0] == (0, 1, 1, 2, 3, 3, 4, 5, 5) and record.sounds[0].name == "red.wav"
    outputs = 1 if kind == "demonstration" else 2
    assert {tuple(z.shape) for z in trainer.offline._latents.values()} == {
        (outputs, *trainer.adapter.latent_shape(32, 32, 9))}
    lora = _lora(tmp_path / "saves" / "run", 1)
    assert max(float(v.abs().max()) for k, v in lora.items() if "lora_B" in k) > 0, "no LoRA moved"

    rows[1]["supervision"][next(iter(set(rows[1]["supervision"]) - {"type"}))]["media"].pop()
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(PromptFileError, match=r"train.jsonl:2: supervision.\w+: \['video'\]: an output here is a "
                                              r"video and its audio, in that order: this model makes videos with sound"):
        load_offline(folder, "train", kind, video=VideoOutputs(9, 24.0, audio=True))


def test_the_log_mel_front_end_is_transformers_spectrogram():
    """LTX-2's audio VAE input (media/audio.log_mel_spectrogram, torch) against transformers' numpy spectrogram with
    the same Slaney mel filters: a centred reflect-padded periodic-Hann STFT of 1024, magnitudes, log floored at
    1e-5."""
    from transformers.audio_utils import mel_filter_bank, spectrogram, window_function

    from flow_factory.media.audio import log_mel_spectrogram

    rate, t = 16000, np.arange(4000) / 16000
    wave = (0.5 * np.sin(2 * np.pi * 440 * t) + 0.1 * np.random.default_rng(0).standard_normal(len(t))).astype(
        np.float32)
    ours = log_mel_spectrogram(torch.from_numpy(wave)[None, None], rate, 160, 64)[0, 0]
    filters = mel_filter_bank(513, 64, 0.0, rate / 2, rate, norm="slaney", mel_scale="slaney")
    ref = spectrogram(wave, window_function(1024, "hann", periodic=True), frame_length=1024, hop_length=160,
                      power=1.0, center=True, pad_mode="reflect", mel_filters=filters, mel_floor=1e-5, log_mel="log")
    torch.testing.assert_close(ours, torch.from_numpy(ref.T).float(), atol=1e-4, rtol=1e-4)


def test_every_family_trains_offline():
    from flow_factory.config.families import MODEL_FAMILIES
    from flow_factory.models import get_adapter_class

    assert {m: get_adapter_class(m).offline_refusal() for m in MODEL_FAMILIES} == dict.fromkeys(MODEL_FAMILIES)
    # a user's own adapter without encode_media is refused, saying what it lacks (run_data's ConfigError)
    from flow_factory.models.base import FlowAdapter

    assert "has no encode_media" in type("Own", (FlowAdapter,), {"model_type": "own"}).offline_refusal()


def test_ltx2_image_to_video_trains_offline_its_first_frame_given(tmp_path, tiny_ltx2_i2av_path):
    """LTX-2 image to video with audio, offline DPO from pairs sharing a first-frame image: the record's video's
    first latent frame is the image's (the adapter puts it back into every x_t and gives it no velocity, as the
    pipeline never steps it), so that part of the loss is the same constant for the policy and the reference,
    and the LoRA moves by the rest."""
    from flow_factory.config import parse_config
    from flow_factory.trainer import Trainer

    config = _offline_config(tmp_path, "ltx2_i2av", tiny_ltx2_i2av_path, "offline-dpo", "preference",
                             conditioned=True, max_epochs=1)
    _with_soundtracks(tmp_path / "offline")
    trainer = Trainer(parse_config(config))
    trainer.train()
    assert all(r.item.images and r.sounds[1] is not None for r in trainer.offline.records)
    lora = _lora(tmp_path / "saves" / "run", 1)
    assert max(float(v.abs().max()) for k, v in lora.items() if "lora_B" in k) > 0, "no LoRA moved"


def test_an_image_where_a_video_model_needs_a_video_stops_ff_train_before_loading(tmp_path, tiny_wan_path, capsys):
    config = _offline_config(tmp_path, "wan2_t2v", tiny_wan_path, "sft", "demonstration")
    folder = tmp_path / "offline"
    write_condition_image(folder / "images" / "red.png", VIDEO_SIZE, COLOURS["red"])
    rows = (folder / "train.jsonl").read_text().replace("videos/red.mp4", "images/red.png").replace('"video"', '"image"', 1)
    (folder / "train.jsonl").write_text(rows)
    assert main([str(write_config(tmp_path, config))]) == 2
    assert "train.jsonl:1: supervision.target: ['image']: an output here is one video" in capsys.readouterr().err


def test_two_processes_train_an_uneven_dataset_in_step(tmp_path, tiny_sd3_path):
    """Three records on two processes: each epoch one record waits (as a distributed loader drops the uneven
    part), so both processes train one micro-batch and the run ends (no process waits on the other)."""
    import os

    from helpers_launch import ff_train_forked
    from test_train_cli import _free_port

    config = _offline_config(tmp_path, "sd3-5", tiny_sd3_path, "sft", "demonstration")
    argv = [str(write_config(tmp_path, config)), "--num_processes", "2", "--main_process_port", str(_free_port())]
    (_, err), code = ff_train_forked(argv, {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"},
                                     timeout=240)
    assert code == 0, err[-3000:]
    history = json.loads((tmp_path / "saves" / "run" / "history.json").read_text())["train"]
    assert [r["epoch"] for r in history] == [0, 1] and all(r["train/skipped_updates"] == 0 for r in history)


def test_an_offline_run_reads_several_datasets(tmp_path, tiny_sd3_path):
    """data.datasets names two folders of records: their records train together (no per-dataset reward to log)."""
    config = _offline_config(tmp_path, "sd3-5", tiny_sd3_path, "sft", "demonstration")
    second = write_offline_dataset(tmp_path / "second", "demonstration")
    config["data"] = {"datasets": [{"name": "a", "dataset_dir": config["data"]["dataset_dir"]},
                                   {"name": "b", "dataset_dir": str(second)}], "cache_dir": str(tmp_path / "cache")}
    assert main([str(write_config(tmp_path, config))]) == 0
    history = json.loads((tmp_path / "saves" / "run" / "history.json").read_text())["train"]
    assert [r["epoch"] for r in history] == [0, 1] and all("train/flow_matching_loss" in r for r in history)
