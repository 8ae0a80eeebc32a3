"""Conditioned models (image editing, image-to-video): the condition reaches the model, the rewards and the grids,
and the invariants hold as for text-to-image.

Each adapter's ODE rollout equals its pipeline's output for the same prompts, conditions and noise (invariant
2); the on-policy ratio is exactly 1 under every SDE (invariant 1); its LoRA reloads in diffusers; a reward sees
each sample's own condition in both input forms; ``ff-train`` runs grpo and nft from a jsonl dataset that names
condition files, and its LoRA loads with the pipeline's ``load_lora_weights``.
"""

import json

import numpy as np
import pytest
import torch
from helpers_algorithms import assert_on_policy, grpo_on_perturbed_lora, perturb_lora
from helpers_runs import CONDITION_IMAGES, CONDITIONED_MODELS, tiny_run_config, write_config
from PIL import Image

from flow_factory.data import load_prompts, read_image, read_video
from flow_factory.data.media import check_video
from flow_factory.dynamics import make_dynamics
from flow_factory.dynamics.ode import ODE
from flow_factory.media import probe
from flow_factory.models import (ADAPTERS, FluxKontextAdapter, WanI2VAdapter, WanT2VAdapter, WanV2VAdapter, apply_lora,
                                 get_adapter_class, index_cond, load_adapter, save_lora)
from flow_factory.models.conditioning import as_pil
from flow_factory.rewards import RewardSet
from flow_factory.rewards.base import PointwiseRewardModel, RewardModelOutput, to_uint8_hwc
from flow_factory.trajectory import sample_trajectory
from flow_factory.sampling import SamplingServices, SamplingSettings, collect_rollouts
from flow_factory.train import main as ff_train

PROMPTS = ["make the sky red", "add a cat"]
STEPS = 3
SOURCE_SIZE = (83, 50)  # (width, height) of the condition files: not multiples of 16, so they are resized
SOURCE_FRAMES = 6  # of a condition video: more than the 5 generated, so it is cut

# a checkpoint: (fixture, adapter class, (height, width, num_frames), condition size (height, width), guidance)
CASES = {
    "flux1-kontext": ("tiny_flux_kontext_path", FluxKontextAdapter, (64, 64, None), (48, 80), 2.5),
    "wan2_i2v": ("tiny_wan_i2v_path", WanI2VAdapter, (32, 32, 5), (48, 80), 3.0),  # Wan2.1: CLIP image states
    "wan2.2-i2v-a14b": ("tiny_wan22_i2v_path", WanI2VAdapter, (32, 32, 5), (48, 80), 3.0),  # two experts
    "wan2_v2v": ("tiny_wan_v2v_path", WanV2VAdapter, (32, 32, 5), None, 3.0),  # starts from the condition video
}


def _kontext_pipeline(adapter, prompts, conditions, noise, size, condition_size, guidance, output_type):
    """FluxKontextPipeline for the same noise. Its __call__ derives the size from max_area and snaps the
    condition to Kontext's preferred resolutions unless told: max_area of the size asked, _auto_resize off
    (the condition then keeps its own size, floored to multiples of 16: 83x50 -> 80x48)."""
    pipe, (height, width, _) = adapter.pipeline, size
    pack, n = type(pipe)._pack_latents, noise.shape[0]
    out = pipe(image=[c[0] for c in conditions], prompt=list(prompts), height=height, width=width,
               max_area=height * width, _auto_resize=False, num_inference_steps=STEPS, guidance_scale=guidance,
               latents=pack(noise, n, *noise.shape[1:]), output_type=output_type).images
    if output_type == "latent":
        return type(pipe)._unpack_latents(out, height, width, pipe.vae_scale_factor)
    return out


def _wan_i2v_pipeline(adapter, prompts, conditions, noise, size, condition_size, guidance, output_type):
    """WanImageToVideoPipeline for the same noise, a sample a call (it takes one image for its whole batch), given
    each condition at condition_size: its CLIP encoder sees that, its VAE that resized to the video's size; a
    sample's second image is the pipeline's last_image (first-last-frame)."""
    height, width, frames = size
    media = adapter.prepare_conditions(conditions, None, height, width, frames, condition_size)
    images = [as_pil(sample) for sample in media.images]
    return torch.cat([adapter.pipeline(
        image=images[i][0], last_image=images[i][1] if len(images[i]) > 1 else None, prompt=prompt, height=height,
        width=width, num_frames=frames, num_inference_steps=STEPS, guidance_scale=guidance, latents=noise[i:i + 1],
        output_type=output_type).frames for i, prompt in enumerate(prompts)])


def _wan_v2v_pipeline(adapter, prompts, conditions, noise, size, condition_size, guidance, output_type):
    """WanVideoToVideoPipeline: it draws its noise itself, from the generator the noise was drawn with (seed 0),
    and noises the condition's latents to its first step; given each condition video as the adapter prepared it."""
    height, width, frames = size
    assert torch.equal(noise, torch.randn(noise.shape, generator=torch.Generator().manual_seed(0)))
    media = adapter.prepare_conditions(None, conditions, height, width, frames, condition_size)
    return adapter.pipeline(
        video=[as_pil(video[0]) for video in media.videos], prompt=list(prompts), height=height, width=width,
        num_inference_steps=STEPS, guidance_scale=guidance, strength=adapter.strength,
        generator=torch.Generator().manual_seed(0), output_type=output_type).frames


PIPELINES = {"flux1-kontext": _kontext_pipeline, "wan2_i2v": _wan_i2v_pipeline, "wan2.2-i2v-a14b": _wan_i2v_pipeline,
             "wan2_v2v": _wan_v2v_pipeline}


def _sources(n: int, seed: int = 0, frames: int | None = None) -> list[list]:
    """One random condition image (or video of ``frames`` frames) per sample, as a row's file would be read."""
    rng = np.random.default_rng(seed)

    def image():
        return Image.fromarray(rng.integers(0, 256, (SOURCE_SIZE[1], SOURCE_SIZE[0], 3), dtype=np.uint8))
    return [[image() if frames is None else [image() for _ in range(frames)]] for _ in range(n)]


def _given(adapter, n: int, seed: int = 0) -> list[list]:
    """``_sources`` of the kind the adapter takes."""
    return _sources(n, seed, SOURCE_FRAMES if "videos" in adapter.condition_inputs else None)


def _prepare(adapter, sources, height, width, frames, condition_size):
    videos = "videos" in adapter.condition_inputs
    return adapter.prepare_conditions(None if videos else sources, sources if videos else None, height, width,
                                      frames, condition_size)


def _load(request, case):
    fixture, cls, size, condition_size, guidance = CASES[case]
    adapter = load_adapter(cls.model_type, request.getfixturevalue(fixture))
    assert type(adapter) is cls and ADAPTERS[cls.model_type] is cls
    return adapter, size, condition_size, guidance


def _conditioning(adapter, prompts, sources, size, condition_size, guidance):
    """The text conditioning with the conditions' own, as the sampler merges them."""
    height, width, frames = size
    media = _prepare(adapter, sources, height, width, frames, condition_size)
    return {**adapter.encode(prompts, None, guidance), **adapter.encode_conditions(media, height, width, frames)}


@pytest.mark.parametrize("case", list(CASES))
def test_ode_rollout_reproduces_the_pipeline(request, case):
    adapter, size, condition_size, guidance = _load(request, case)
    height, width, frames = size
    sources = _given(adapter, len(PROMPTS))
    cond = _conditioning(adapter, PROMPTS, sources, size, condition_size, guidance)
    noise = adapter.initial_noise(len(PROMPTS), height, width, torch.Generator().manual_seed(0), num_frames=frames)
    sigmas = adapter.sigmas(STEPS, height, width, frames)
    traj = sample_trajectory(adapter, ODE(), cond, adapter.start_latents(noise, sigmas[0], cond), sigmas, guidance)

    expected = PIPELINES[case](adapter, PROMPTS, sources, noise.clone(), size, condition_size, guidance, "latent")
    assert traj.final.abs().max() > 0.1  # not zeros against zeros
    torch.testing.assert_close(traj.final, expected.float(), rtol=0, atol=1e-5)
    images = PIPELINES[case](adapter, PROMPTS, sources, noise.clone(), size, condition_size, guidance, "pt")
    torch.testing.assert_close(adapter.decode(traj.final), images.float(), rtol=0, atol=1e-4)

    if len(adapter.transformers) > 1:  # each expert denoises some of the steps
        assert set(adapter.experts_at(traj.sigmas[:-1])) == set(adapter.transformers)
    # the condition matters: another source image gives another result
    other = _conditioning(adapter, PROMPTS, _given(adapter, len(PROMPTS), seed=1), size, condition_size, guidance)
    start = adapter.start_latents(noise, sigmas[0], other)
    assert (sample_trajectory(adapter, ODE(), other, start, sigmas, guidance).final - traj.final).abs().max() > 1e-3


@pytest.mark.parametrize("case", list(CASES))
def test_conditions_are_resized_as_the_pipeline_resizes_them(request, case):
    """What the rewards and grids see: the condition at condition_size (default: the size generated), in [0, 1]."""
    adapter, (height, width, frames), condition_size, _ = _load(request, case)
    sources, size = _given(adapter, 2), condition_size or (height, width)
    media = _prepare(adapter, sources, height, width, frames, condition_size)
    if media.videos is not None:  # (k, F, 3, H, W): a video, cut to the frames generated
        assert [tuple(m.shape) for m in media.videos] == [(1, frames, 3, *size)] * 2
        shown, first = media.videos[1][0], sources[1][0][0]
    else:
        assert [tuple(m.shape) for m in media.images] == [(1, 3, *size)] * 2
        shown, first = media.images[1], sources[1][0]
    assert 0 <= shown.min() and shown.max() <= 1
    resized = first.resize(size[::-1], Image.LANCZOS)
    assert np.array_equal(to_uint8_hwc(shown[0]), np.asarray(resized))
    default = _prepare(adapter, sources, height, width, frames, None)
    assert tuple(default.per_sample()[0][0].shape[-2:]) == (height, width)


@pytest.mark.parametrize("case", list(CASES))
def test_velocity_is_per_sample(request, case):
    adapter, size, condition_size, guidance = _load(request, case)
    height, width, frames = size
    cond = _conditioning(adapter, PROMPTS, _given(adapter, 2), size, condition_size, guidance)
    x = adapter.initial_noise(2, height, width, torch.Generator().manual_seed(2), num_frames=frames)
    sigma = torch.tensor([0.9, 0.4])
    with torch.no_grad():
        batched = adapter.velocity(x, sigma, cond, guidance)
        singles = [adapter.velocity(x[i:i + 1], sigma[i], index_cond(cond, [i]), guidance) for i in range(2)]
    assert batched.shape == x.shape and batched.dtype == torch.float32
    torch.testing.assert_close(batched, torch.cat(singles), rtol=0, atol=1e-5)
    if "image_embeds" in cond:  # Wan2.1's CLIP states reach the transformer (512 text tokens, the rest image)
        blind = {**cond, "image_embeds": torch.zeros_like(cond["image_embeds"])}
        with torch.no_grad():
            assert (adapter.velocity(x, sigma, blind, guidance) - batched).abs().max() > 1e-3


def test_wan2_1_flf2v_rollout_reproduces_the_pipeline_between_a_first_and_a_last_frame(tiny_wan_flf2v_path):
    """A first-last-frame checkpoint (pos_embed_seq_len set): each sample's two images are the pipeline's image and
    last_image; the rollout equals its output (invariant 2), and the last frame and the images' order matter."""
    adapter, (height, width, frames) = load_adapter("wan2_i2v", tiny_wan_flf2v_path), (32, 32, 5)
    size, condition_size, guidance = (height, width, frames), (48, 80), 3.0
    sources = [[first[0], last[0]] for first, last in zip(_sources(2, seed=0), _sources(2, seed=1))]
    cond = _conditioning(adapter, PROMPTS, sources, size, condition_size, guidance)
    assert cond["image_embeds"].shape == (2, 2 * 17, 16)  # both images' CLIP states, per sample
    noise = adapter.initial_noise(2, height, width, torch.Generator().manual_seed(0), num_frames=frames)
    sigmas = adapter.sigmas(STEPS, height, width, frames)
    final = sample_trajectory(adapter, ODE(), cond, noise, sigmas, guidance).final
    expected = _wan_i2v_pipeline(adapter, PROMPTS, sources, noise.clone(), size, condition_size, guidance, "latent")
    assert final.abs().max() > 0.1
    torch.testing.assert_close(final, expected.float(), rtol=0, atol=1e-5)

    for changed in ([[first, _sources(1, seed=2)[0][0]] for first, _ in sources],  # another last frame
                    [[last, first] for first, last in sources]):  # the two swapped
        other = _conditioning(adapter, PROMPTS, changed, size, condition_size, guidance)
        assert (sample_trajectory(adapter, ODE(), other, noise, sigmas, guidance).final - final).abs().max() > 1e-3


def test_wan2_i2v_takes_a_last_frame_only_where_the_checkpoint_does(tmp_path, tiny_wan_i2v_path, tiny_wan_flf2v_path,
                                                                   capsys, monkeypatch):
    """Rows with two images need a first-last-frame checkpoint, and such a checkpoint needs both: refused before
    it loads, naming the row; a checkpoint known only once loaded (a hub id) refuses the batch."""
    from flow_factory.sample import main as ff_sample

    def refuse(cls, *args, **kwargs):
        pytest.fail("a pipeline started loading: the error came too late")

    monkeypatch.setattr(WanI2VAdapter, "from_pretrained", classmethod(refuse), raising=False)
    monkeypatch.setattr(WanI2VAdapter.pipeline_class, "from_pretrained", classmethod(refuse))
    images = tmp_path / "images"
    images.mkdir()
    for name in ("first.png", "last.png"):
        Image.new("RGB", (32, 32)).save(images / name)
    two, one = tmp_path / "two.jsonl", tmp_path / "one.jsonl"
    two.write_text(json.dumps({"prompt": "a", "images": ["first.png", "last.png"]}) + "\n")
    one.write_text(json.dumps({"prompt": "a", "image": "first.png"}) + "\n")
    common = ["--model-type", "wan2_i2v", "--out", str(tmp_path / "out")]
    assert ff_sample([str(tiny_wan_i2v_path), "--prompt-file", str(two), *common]) == 2
    assert (f"{two}:1: wan2_i2v takes 1 condition images per prompt ('image' / 'images'), the row names 2; this "
            "checkpoint generates from a first frame: a last frame too needs a first-last-frame checkpoint (Wan2.1 "
            "FLF2V, whose transformer sets pos_embed_seq_len)") in capsys.readouterr().err
    assert ff_sample([str(tiny_wan_flf2v_path), "--prompt-file", str(one), *common]) == 2
    assert (f"{one}:1: wan2_i2v takes 2 condition images per prompt ('image' / 'images'), the row names 1; this "
            "checkpoint generates between a first and a last frame") in capsys.readouterr().err
    monkeypatch.undo()
    adapter = load_adapter("wan2_i2v", tiny_wan_i2v_path)
    with pytest.raises(ValueError, match="wan2_i2v: a sample has 2 condition images, this checkpoint takes 1; "):
        adapter.prepare_conditions([[Image.new("RGB", (32, 32))] * 2], None, 32, 32, 5, None)


def test_wan2_i2v_names_what_it_cannot_load():
    """Wan2.2 TI2V-5B's image-to-video replaces the first latent frame (expand_timesteps): refused by name."""
    index = {"transformer": ["diffusers", "WanTransformer3DModel"], "expand_timesteps": True}
    assert "expand_timesteps, Wan2.2 TI2V-5B" in WanI2VAdapter.unsupported(index)
    assert WanI2VAdapter.unsupported({**index, "expand_timesteps": False}) is None
    assert "wan2_i2v: this checkpoint sets boundary_ratio" in WanI2VAdapter.unsupported(
        {**index, "expand_timesteps": False, "boundary_ratio": 0.9})


def test_wan2_v2v_keeps_the_last_strength_part_of_the_schedule(tmp_path, tiny_wan_v2v_path):
    """The rollout's sigmas are the tail of the full schedule (the pipeline's get_timesteps), as many as the config
    counts for the SDE window; the keys that do not apply are refused; a short condition video is an error."""
    from flow_factory.config import ConfigError, parse_config

    adapter = load_adapter("wan2_v2v", tiny_wan_v2v_path)
    full = WanT2VAdapter.sigmas(adapter, 10, 32, 32, 5)  # the whole schedule
    for strength in (0.25, 0.7, 1.0):
        adapter.strength = strength
        sigmas = adapter.sigmas(10, 32, 32, 5)
        torch.testing.assert_close(sigmas, full[10 - int(10 * strength):], rtol=0, atol=0)
        config = tiny_run_config(tmp_path, "wan2_v2v", tiny_wan_v2v_path, num_inference_steps=10, strength=strength)
        assert parse_config(config).rollout_steps == len(sigmas) - 1
    with pytest.raises(ConfigError, match="train.condition_image_size: wan2_v2v takes condition videos"):
        parse_config(tiny_run_config(tmp_path, "wan2_v2v", tiny_wan_v2v_path, condition_image_size=32))
    with pytest.raises(ConfigError, match="train.strength: wan2_i2v does not start from a condition video"):
        parse_config(tiny_run_config(tmp_path, "wan2_i2v", tiny_wan_v2v_path, strength=0.5))
    with pytest.raises(ValueError, match="a condition video has 4 frames; num_frames is 5"):
        adapter.prepare_conditions(None, _sources(1, frames=4), 32, 32, 5, None)


@pytest.mark.parametrize("dynamics_name", ["Flow-SDE", "Dance-SDE", "CPS"])
@pytest.mark.parametrize("case", list(CASES))
def test_on_policy_ratio_is_one(request, case, dynamics_name):
    adapter, size, condition_size, guidance = _load(request, case)
    height, width, frames = size
    dynamics = make_dynamics(dynamics_name, 0.7)
    algorithm, policy = grpo_on_perturbed_lora(adapter, dynamics, guidance)
    cond = _conditioning(adapter, PROMPTS, _given(adapter, 2), size, condition_size, guidance)
    noise = adapter.initial_noise(2, height, width, torch.Generator().manual_seed(1), num_frames=frames)
    sigmas = adapter.sigmas(STEPS, height, width, frames)
    traj = sample_trajectory(adapter, dynamics, cond, adapter.start_latents(noise, sigmas[0], cond), sigmas, guidance,
                             generator=torch.Generator().manual_seed(2))
    assert_on_policy(algorithm, policy, traj, cond)


@pytest.mark.parametrize("case", list(CASES))
def test_lora_reloads_in_diffusers_and_changes_the_output(request, case, tmp_path):
    adapter, size, condition_size, guidance = _load(request, case)
    height, width, frames = size
    cond = _conditioning(adapter, PROMPTS[:1], _given(adapter, 1), size, condition_size, guidance)
    x = adapter.initial_noise(1, height, width, torch.Generator().manual_seed(0), num_frames=frames)

    def v(a):
        with torch.no_grad():
            return a.velocity(x, torch.tensor(0.95), cond, guidance)  # Wan2.2: the expert the LoRA is on

    base = v(adapter)
    apply_lora(adapter.transformer, rank=4, alpha=2.0, target_modules="default",
               default_targets=adapter.default_lora_targets)
    perturb_lora(adapter.transformer, 0.2, which="lora_")
    tuned = v(adapter)
    assert (tuned - base).abs().max() > 1e-3
    save_lora(adapter.pipeline_class, adapter.transformer, tmp_path / "lora")
    fresh = adapter.pipeline_class.from_pretrained(request.getfixturevalue(CASES[case][0]))
    fresh.load_lora_weights(tmp_path / "lora")  # plain diffusers
    torch.testing.assert_close(v(type(adapter)(fresh)), tuned, rtol=0, atol=1e-6)


class Recorder(PointwiseRewardModel):
    """Records what it is given; scores each sample by its row's metadata."""

    required_fields = ("prompt", "image", "condition_images", "condition_videos", "metadata")
    calls: list = []

    def __call__(self, prompt, image=None, condition_images=None, condition_videos=None, metadata=None):
        assert condition_images is None or condition_videos is None  # a model takes one kind
        type(self).calls.append((list(prompt), condition_videos if condition_images is None else condition_images,
                                 metadata))
        return RewardModelOutput(rewards=[float(m["row"]) for m in metadata])


class TensorRecorder(Recorder):
    use_tensor_inputs = True
    calls: list = []


@pytest.mark.parametrize("case", list(CASES))
def test_rewards_see_each_samples_condition_in_both_forms(request, case, tmp_path):
    """Groups of 2 in batches of 3 (a group straddles two batches); each sample's reward gets its own row's
    condition, resized as the model saw it, and its metadata; only rewards that ask for them get them."""
    from helpers_runs import write_conditioned_dataset

    adapter, (height, width, frames), condition_size, guidance = _load(request, case)
    videos = "videos" in adapter.condition_inputs
    items = load_prompts(write_conditioned_dataset(tmp_path / "data", videos=videos), "train")[:3]
    items = [it for it in items for _ in range(2)]  # 3 groups of 2
    rewards = RewardSet({"pil": Recorder(batch_size=4), "tensor": TensorRecorder(batch_size=4)},
                        {"pil": 1.0, "tensor": 1.0})
    Recorder.calls.clear(), TensorRecorder.calls.clear()
    settings = SamplingSettings(height, width, frames, 2, guidance, batch_size=3, seed=0, sde_steps=[],
                                condition_size=condition_size)
    rollouts = collect_rollouts(adapter, ODE(), items, torch.arange(3).repeat_interleave(2), list(range(6)),
                                settings, epoch=0, services=SamplingServices(rewards))
    assert rollouts.rewards["pil"].tolist() == [0, 0, 1, 1, 2, 2]  # each sample's own metadata, in order

    def expected(item):  # (k, 3, H, W), or for a video (k, F, 3, H, W)
        given = [[read_video(item.videos[0]) if videos else read_image(item.images[0])]]
        return _prepare(adapter, given, height, width, frames, condition_size).per_sample()[0][0][None]

    pil = [c for call in Recorder.calls for c in call[1]]  # in calls of at most batch_size 4
    metadata = [m for call in Recorder.calls for m in call[2]]
    tensors = [c for call in TensorRecorder.calls for c in call[1]]
    assert [m["row"] for m in metadata] == [0, 0, 1, 1, 2, 2]
    size = condition_size or (height, width)
    for i, item in enumerate(items):
        assert isinstance(pil[i], list) and len(pil[i]) == 1
        frames_seen = pil[i][0] if videos else [pil[i][0]]  # a video: its frames, as PIL images
        assert all(isinstance(f, Image.Image) and f.size == size[::-1] for f in frames_seen)
        want = expected(item)[0] if videos else expected(item)
        assert len(frames_seen) == len(want)
        assert all(np.array_equal(np.asarray(f), to_uint8_hwc(w)) for f, w in zip(frames_seen, want))
        # (k, 3, H, W): one condition image; (k, F, 3, H, W): one video
        assert tensors[i].shape == ((1, frames, 3, *size) if videos else (1, 3, *size))
        torch.testing.assert_close(tensors[i], expected(item), rtol=0, atol=0)
    assert not torch.equal(tensors[0], tensors[2])  # rows of other files differ
    assert [len(c) for c in rollouts.conditions.per_sample()] == [1] * 6  # kept for the sample grids


# --------------------------------------------------------------------------------- ff-train


def _pipeline_latents(model_type, path, lora_dir, source):
    """The pipeline's own output (``PIPELINES``), with the LoRA loaded by its ``load_lora_weights``."""
    _, _, size, condition_size, guidance = CASES[model_type]
    cls = get_adapter_class(model_type)
    pipe = cls.pipeline_class.from_pretrained(path)
    if lora_dir is not None:
        pipe.load_lora_weights(lora_dir)
    adapter = cls(pipe)
    noise = adapter.initial_noise(1, size[0], size[1], torch.Generator().manual_seed(0), num_frames=size[2])
    return PIPELINES[model_type](adapter, ["make it red"], [[source]], noise, size, condition_size, guidance, "latent")


@pytest.mark.parametrize("trainer_type", ["grpo", "nft"])
@pytest.mark.parametrize("model_type", list(CONDITIONED_MODELS))
def test_ff_train_runs_from_a_conditioned_dataset(request, tmp_path, model_type, trainer_type, gpu_precision):
    """In a GPU's precision (bf16 autocast, fp16 trajectories); the LoRA loads in the pipeline."""
    path = request.getfixturevalue(CONDITIONED_MODELS[model_type][0])
    videos = "videos" in get_adapter_class(model_type).condition_inputs
    sizes = dict(strength=0.7) if videos else dict(condition_image_size=[48, 80])  # a video is encoded as generated
    config = tiny_run_config(tmp_path, model_type, path, trainer_type=trainer_type, max_epochs=2, **sizes)
    config["eval"]["strength" if videos else "condition_image_size"] = 0.9 if videos else 64
    if trainer_type == "nft":
        config["train"]["num_train_timesteps"] = 1
        config["scheduler"] = {"dynamics_type": "ODE", "noise_level": 0.0}
    assert ff_train([str(write_config(tmp_path, config))]) == 0

    run_dir = tmp_path / "saves" / "run"
    history = json.loads((run_dir / "history.json").read_text())
    assert [r["epoch"] for r in history["train"]] == [0, 1] and "reward/jpeg/mean" in history["train"][-1]
    grid = next((run_dir / "samples").glob("eval_epoch_0000.*"))  # an mp4 for video models
    width = probe(grid).size[0] if grid.suffix == ".mp4" else Image.open(grid).width
    assert width == 2 * 2 * 256  # 2 test prompts, each beside its condition image
    lora_dir = run_dir / "checkpoints" / "epoch_2"
    name = next(iter(CONDITION_IMAGES))
    source = (read_video(check_video(tmp_path / "data" / "videos" / name.replace(".png", ".mp4"))) if videos
              else Image.open(tmp_path / "data" / "images" / name).convert("RGB"))
    base = _pipeline_latents(model_type, path, None, source)
    tuned = _pipeline_latents(model_type, path, lora_dir, source)
    assert not torch.allclose(base, tuned, atol=1e-6), "the trained LoRA does not change the output"


def test_ff_train_names_a_missing_condition_file_before_the_model_loads(tmp_path, tiny_flux_kontext_path, capsys,
                                                                        monkeypatch):
    def refuse(cls, *args, **kwargs):
        pytest.fail("a pipeline started loading: the error came too late")

    monkeypatch.setattr(FluxKontextAdapter, "from_pretrained", classmethod(refuse))
    config = tiny_run_config(tmp_path, "flux1-kontext", tiny_flux_kontext_path)
    (tmp_path / "data" / "images" / "green.png").unlink()
    assert ff_train([str(write_config(tmp_path, config))]) == 2
    err = capsys.readouterr().err
    train = tmp_path / "data" / "train.jsonl"
    assert f"{train}:2: image 'green.png' ({tmp_path / 'data' / 'images' / 'green.png'}) not found" in err


def test_auto_resize_generates_at_the_conditions_aspect_ratio(tmp_path, tiny_flux_kontext_path):
    """train.auto_resize: the conditions are 83x50, so 64x64 pixels become 48 x 80 (height x width); eval keeps
    its resolution (auto_resize false) and its condition size."""
    from flow_factory.config import parse_config
    from flow_factory.trainer import Trainer

    config = tiny_run_config(tmp_path, "flux1-kontext", tiny_flux_kontext_path, auto_resize=True)
    config["eval"].update(auto_resize=False, condition_image_size=32)
    config["log"]["logging_backend"] = "none"  # no trackers: train() starts them, this test does not call it
    trainer = Trainer(parse_config(config))
    try:
        assert (trainer.data.train_size, trainer.data.eval_sizes) == ((48, 80), {"default": (64, 64)})
        rollouts = trainer.sample_epoch(0)
        assert rollouts.media.shape[-2:] == (48, 80) and rollouts.latents.shape[-2:] == (6, 10)
        assert rollouts.conditions.images[0].shape == (1, 3, 48, 80)  # null condition size: the size generated
        trainer.evaluate(0)
        assert Image.open(tmp_path / "saves" / "run" / "samples" / "eval_epoch_0000.png").width == 2 * 2 * 256
    finally:
        trainer.close()


def test_ff_sample_takes_the_conditions_from_a_jsonl_file(tmp_path, tiny_flux_kontext_path, capsys):
    from helpers_runs import write_conditioned_dataset

    from flow_factory.sample import main as ff_sample

    data = write_conditioned_dataset(tmp_path / "data")
    common = ["--model-type", "flux1-kontext", "--resolution", "64", "--steps", "2", "--guidance-scale", "2.5"]
    assert ff_sample([str(tiny_flux_kontext_path), *common, "--prompt-file", str(data / "test.jsonl"),
                      "--out", str(tmp_path / "s")]) == 0
    assert Image.open(tmp_path / "s" / "0001.png").size == (64, 64)
    assert Image.open(tmp_path / "s" / "grid.png").width == 2 * 2 * 256  # each sample beside its source image
    assert ff_sample([str(tiny_flux_kontext_path), *common, "--prompts", "make it red", "--out",
                      str(tmp_path / "x")]) == 2
    assert ("ff-sample: prompt 'make it red': flux1-kontext takes 1 condition images per prompt ('image' / 'images'), "
            "the row names 0") in capsys.readouterr().err


def test_ff_sample_strength_regenerates_that_part_of_the_steps_as_the_pipeline(tmp_path, tiny_wan_v2v_path, capsys,
                                                                              monkeypatch):
    """ff-sample --strength 0.6 with 5 steps: the pipeline's output for strength 0.6 (3 steps from the source
    noised to the first of them), from the noise it draws with ff-sample's per-sample generator; the default
    0.8 would run 4. The flag is refused outside (0, 1], where it keeps no step, and for other models."""
    from helpers_runs import write_conditioned_dataset

    from flow_factory import sampling
    from flow_factory.sample import main as ff_sample
    from flow_factory.seeding import generator

    data = write_conditioned_dataset(tmp_path / "data", videos=True)
    prompts = tmp_path / "data" / "one.jsonl"
    prompts.write_text((data / "test.jsonl").read_text().splitlines()[0] + "\n")
    sampled = []
    original = sampling.sample_prompts
    monkeypatch.setattr(sampling, "sample_prompts", lambda *a, **k: sampled.append(original(*a, **k)) or sampled[-1])
    common = ["--model-type", "wan2_v2v", "--prompt-file", str(prompts), "--resolution", "32", "--num-frames", "5",
              "--steps", "5", "--guidance-scale", "3"]
    assert ff_sample([str(tiny_wan_v2v_path), *common, "--strength", "0.6", "--out", str(tmp_path / "s")]) == 0
    assert probe(tmp_path / "s" / "0000.mp4").frames == 5
    rollouts, = sampled
    assert len(rollouts.sigmas) == 3 + 1

    adapter = load_adapter("wan2_v2v", tiny_wan_v2v_path)
    item, = load_prompts(data, "test")[:1]
    media = adapter.prepare_conditions(None, [[read_video(item.videos[0])]], 32, 32, 5, None)
    expected = adapter.pipeline(
        video=as_pil(media.videos[0][0]), prompt=item.prompt, height=32, width=32, num_inference_steps=5,
        guidance_scale=3.0, strength=0.6, generator=generator("noise", 0, -1, 0), output_type="pt").frames
    torch.testing.assert_close(rollouts.media, expected.float(), rtol=0, atol=1e-4)

    for flags, message in (
            (["--strength", "0"], "--strength 0: must be in (0, 1], the part of the steps that regenerate the "
                                  "condition video"),
            (["--strength", "1.5"], "--strength 1.5: must be in (0, 1]"),
            (["--strength", "0.1"], "--strength 0.1 with --steps 5 keeps no step (int(5 x 0.1) = 0); raise either")):
        assert ff_sample([str(tiny_wan_v2v_path), *common, *flags, "--out", str(tmp_path / "x")]) == 2
        assert f"ff-sample: {message}" in capsys.readouterr().err
    assert ff_sample([str(tiny_wan_v2v_path), "--model-type", "wan2_t2v", "--prompts", "a", "--strength", "0.5",
                      "--out", str(tmp_path / "x")]) == 2
    assert ("ff-sample: --strength: wan2_t2v does not start from a condition video; the flag is for video-to-video "
            "(wan2_v2v)") in capsys.readouterr().err
    assert len(sampled) == 1  # every refusal came before sampling


# --------------------------------------------------------------------------------- the condition cache


def test_the_condition_cache_holds_what_encode_conditions_gives(tmp_path, tiny_flux_kontext_path):
    """data.enable_preprocess: each row's condition encoded once per geometry; a changed file is a new
    entry; the folder follows the condition encoders' weights."""
    import os

    from helpers_runs import write_conditioned_dataset

    from flow_factory.prompt_cache import ConditionCache, condition_fingerprint, condition_media

    adapter = load_adapter("flux1-kontext", tiny_flux_kontext_path)
    items = load_prompts(write_conditioned_dataset(tmp_path / "data"), "train")[:3]
    geometries = [(64, 64, None, (48, 80)), (64, 64, None, None)]
    cache = ConditionCache.build(adapter, [(it, g) for g in geometries for it in items], tmp_path / "cache", 2)
    assert cache.folder.name == condition_fingerprint(adapter) and cache.folder.name.startswith("conditions-")
    for geometry in geometries:
        for batch in (items[:2], items[2:]):  # the batches it was built in: float32 convolutions round by batch
            fresh = adapter.encode_conditions(condition_media(adapter, batch, geometry), *geometry[:3])
            cached = cache.lookup(batch, geometry, "cpu")
            assert cached.keys() == fresh.keys()
            assert all(torch.equal(cached[k], fresh[k]) for k in fresh)
    assert cache.lookup([items[2], items[0], items[2]], geometries[0], "cpu")["image_latents"].shape[0] == 3
    assert cache.lookup(items, (32, 32, None, None), "cpu") is None  # a geometry never encoded

    path = items[1].images[0].path  # the same name, other pixels: another entry
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10 ** 9))
    assert cache.lookup(items, geometries[0], "cpu") is None
    with torch.no_grad():
        next(adapter.pipeline.vae.parameters()).view(-1)[3] += 1e-3
    assert condition_fingerprint(adapter) != cache.folder.name


def test_the_condition_cache_folder_is_the_same_in_every_process(tiny_flux_kontext_path):
    """diffusers lists the config keys left at their defaults (``_use_default_values``) from a set, in an order
    each interpreter's hash seed decides: the fingerprint, which names the folder every process of a launch writes
    to, must not read it (a 2-process run crashed writing into a folder process 0 never made)."""
    from diffusers.configuration_utils import FrozenDict

    from flow_factory.prompt_cache import condition_fingerprint

    adapter = load_adapter("flux1-kontext", tiny_flux_kontext_path)
    before = condition_fingerprint(adapter)
    reordered = 0
    for part in adapter.condition_encoders().values():  # as another process would list them
        defaulted = list(getattr(part, "config", {}).get("_use_default_values", []))
        if len(defaulted) > 1:
            part._internal_dict = FrozenDict({**part.config, "_use_default_values": defaulted[::-1]})
            reordered += 1
    assert reordered, "no condition encoder lists defaulted keys: the test checks nothing"
    assert condition_fingerprint(adapter) == before


def test_a_run_with_the_condition_cache_ends_with_the_weights_of_a_run_without(tmp_path, tiny_flux_kontext_path,
                                                                               monkeypatch):
    """The same encoder calls give the same run: the cache encodes one row at a time, as the rollouts do
    (a batch of 2 holds one group); after it is built no condition is encoded, in training or eval."""
    from flow_factory.config import parse_config
    from flow_factory.prompt_cache import ConditionCache
    from flow_factory.trainer import Trainer

    def run(folder, **data):
        config = tiny_run_config(folder, "flux1-kontext", tiny_flux_kontext_path, max_epochs=1)
        config["data"].update(data)
        config["log"]["logging_backend"] = "none"
        trainer = Trainer(parse_config(config))
        trainer.train()
        return trainer, [p.detach().clone() for p in trainer.params]

    _, without = run(tmp_path / "live", enable_preprocess=False)
    original = ConditionCache.build

    def build_then_forbid_encoding(*args, **kwargs):
        cache = original(*args, **kwargs)
        monkeypatch.setattr(FluxKontextAdapter, "encode_conditions",
                            lambda *a, **k: pytest.fail("a condition was encoded after the cache was built"))
        return cache

    monkeypatch.setattr(ConditionCache, "build", build_then_forbid_encoding)
    trainer, cached = run(tmp_path / "cached", preprocessing_batch_size=1)
    assert trainer.condition_cache is not None and trainer.eval_history  # evaluation read it too
    for a, b in zip(without, cached):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
