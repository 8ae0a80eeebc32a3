"""Qwen-Image-Edit-Plus (model_type qwen-image-edit-plus): several condition images per sample, read by the text
encoder (Qwen2.5-VL) and appended to the latents as tokens.

The pipeline resizes every condition image to about 1024^2 pixels for the VAE and 384^2 for the VL encoder (module
constants); the tests shrink both (64^2 and 32^2) in the pipeline's module, which the adapter reads too, so a call
takes milliseconds. The processor is the adapter's image-only fallback (no torchvision here): the real
``Qwen2VLProcessor`` is not exercised, its image processor's PIL backend and the tokenizer are.
"""

import json

import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit_plus
from helpers_algorithms import assert_on_policy, grpo_on_perturbed_lora, perturb_lora
from helpers_runs import tiny_run_config, write_config
from PIL import Image

from flow_factory.data import load_prompts
from flow_factory.dynamics import make_dynamics
from flow_factory.dynamics.ode import ODE
from flow_factory.models import QwenImageEditPlusAdapter, apply_lora, load_adapter, save_lora
from flow_factory.rewards.base import PointwiseRewardModel, RewardModelOutput
from flow_factory.models.qwen_image_edit import load_pipeline
from flow_factory.trajectory import sample_trajectory
from flow_factory.sampling import SamplingServices, SamplingSettings, collect_rollouts

STEPS, GUIDANCE, SIZE = 3, 2.5, 64
PROMPTS = ["make the sky red", "add a cat"]


@pytest.fixture(autouse=True)
def small_condition_sizes(monkeypatch):
    monkeypatch.setattr(edit_plus, "VAE_IMAGE_SIZE", 64 * 64)
    monkeypatch.setattr(edit_plus, "CONDITION_IMAGE_SIZE", 32 * 32)


@pytest.fixture
def adapter(tiny_qwen_image_edit_path):
    return load_adapter("qwen-image-edit-plus", tiny_qwen_image_edit_path)


def _image(size, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _conditioning(adapter, prompts, sources, guidance=GUIDANCE):
    media = adapter.prepare_conditions(sources, None, SIZE, SIZE, None, None)
    return media, {**adapter.encode(prompts, None, guidance, conditions=media),
                   **adapter.encode_conditions(media, SIZE, SIZE, None)}


@pytest.mark.parametrize("sizes", [[(83, 50)], [(83, 50), (50, 50)]], ids=["one image", "two images, two sizes"])
def test_ode_rollout_reproduces_the_pipeline(adapter, sizes):
    """Invariant 2, one sample a call as the pipeline takes: its latents for the same noise, prompt, images."""
    sources = [[_image(s, seed=i) for i, s in enumerate(sizes)]]
    media, cond = _conditioning(adapter, PROMPTS[:1], sources)
    assert [tuple(i.shape) for i in media.per_sample()[0]] == [(3, 64, 96), (3, 64, 64)][:len(sizes)]
    noise = adapter.initial_noise(1, SIZE, SIZE, torch.Generator().manual_seed(0))
    sigmas = adapter.sigmas(STEPS, SIZE, SIZE)
    final = sample_trajectory(adapter, ODE(), cond, noise, sigmas, GUIDANCE).final

    pipe = adapter.pipeline
    packed = type(pipe)._pack_latents(noise, 1, *noise.shape[1:])
    out = pipe(image=sources[0], prompt=PROMPTS[0], negative_prompt="", true_cfg_scale=GUIDANCE, height=SIZE,
               width=SIZE, num_inference_steps=STEPS, latents=packed, output_type="latent").images
    expected = type(pipe)._unpack_latents(out, SIZE, SIZE, pipe.vae_scale_factor)[:, :, 0]
    assert final.abs().max() > 0.1
    torch.testing.assert_close(final, expected.float(), rtol=0, atol=1e-5)
    # the images reach the text encoder (its embedding changes with them) and the tokens (the result changes;
    # in this tiny model about 300 text tokens dilute the 16 to 40 image tokens' attention: a small change, over 30x
    # the tolerance above)
    _, moved = _conditioning(adapter, PROMPTS[:1], [[Image.new("RGB", s, "white") for s in sizes]])
    assert (moved["prompt_embeds"] - cond["prompt_embeds"]).abs().max() > 1e-2
    mixed = {**cond, "image_latents": moved["image_latents"]}
    assert (sample_trajectory(adapter, ODE(), mixed, noise, sigmas, GUIDANCE).final - final).abs().max() > 3e-4


def test_ragged_samples_concatenate_and_a_batch_must_share_shapes(adapter):
    """Samples whose conditions differ in number and size: their conditioning concatenates (padded), each
    sample's velocity is its own, and a call mixing their shapes is refused by name."""
    from flow_factory.models import cat_cond, index_cond

    _, one = _conditioning(adapter, PROMPTS[:1], [[_image((83, 50), 0)]])
    _, two = _conditioning(adapter, PROMPTS[1:], [[_image((83, 50), 1), _image((50, 50), 2)]])
    both = cat_cond([one, two])
    x = adapter.initial_noise(2, SIZE, SIZE, torch.Generator().manual_seed(2))
    with torch.no_grad():
        for i, alone in enumerate((one, two)):
            torch.testing.assert_close(adapter.velocity(x[i:i + 1], torch.tensor(0.7), index_cond(both, [i]), GUIDANCE),
                                       adapter.velocity(x[i:i + 1], torch.tensor(0.7), alone, GUIDANCE), rtol=0, atol=0)
        with pytest.raises(ValueError, match="per_device_batch_size: 1"):
            adapter.velocity(x, torch.tensor(0.7), both, GUIDANCE)


def _ragged_dataset(folder):
    """train.jsonl and test.jsonl: a row with one condition image (83x50), a row with two (83x50, 50x50)."""
    (folder / "images").mkdir(parents=True)
    for name, size in (("wide.png", (83, 50)), ("square.png", (50, 50))):
        _image(size, seed=len(name)).save(folder / "images" / name)
    rows = [{"prompt": "make it red", "image": "wide.png"},
            {"prompt": "blend them", "images": ["wide.png", "square.png"]}]
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


class Recorder(PointwiseRewardModel):
    """Records the condition images it is given."""

    required_fields = ("prompt", "image", "condition_images")
    calls: list = []

    def __call__(self, prompt, image=None, condition_images=None):
        type(self).calls.extend(condition_images)
        return RewardModelOutput(rewards=[0.0] * len(prompt))


class TensorRecorder(Recorder):
    use_tensor_inputs = True
    calls: list = []


def test_rows_of_other_image_counts_and_sizes_sample_store_and_score(adapter, tmp_path):
    """Rows with one and with two condition images of two sizes, a transformer call each: the rollouts store both
    (padded), the stored conditioning gives each sample's own velocity, and the rewards see each row's images as
    the model saw them, PIL or tensors (a list when their sizes differ)."""
    from flow_factory.models import index_cond
    from flow_factory.rewards import RewardSet

    items = load_prompts(_ragged_dataset(tmp_path / "data"), "train")
    Recorder.calls.clear(), TensorRecorder.calls.clear()
    rewards = RewardSet({"pil": Recorder(batch_size=4), "tensor": TensorRecorder(batch_size=4)},
                        {"pil": 1, "tensor": 1})
    settings = SamplingSettings(SIZE, SIZE, None, 2, GUIDANCE, batch_size=1, seed=0, sde_steps=[])
    rollouts = collect_rollouts(adapter, ODE(), items, torch.arange(2), [0, 1], settings, epoch=0, services=SamplingServices(rewards))

    assert rollouts.cond["image_shapes"].tolist() == [[[4, 6], [0, 0]], [[4, 6], [4, 4]]]  # token grids, padded
    assert [[im.size for im in sample] for sample in Recorder.calls] == [[(96, 64)], [(96, 64), (64, 64)]]
    assert TensorRecorder.calls[0].shape == (1, 3, 64, 96)
    assert [tuple(t.shape) for t in TensorRecorder.calls[1]] == [(3, 64, 96), (3, 64, 64)]
    x = adapter.initial_noise(1, SIZE, SIZE, torch.Generator().manual_seed(3))
    for i, item in enumerate(items):
        _, alone = _conditioning(adapter, [item.prompt], [[Image.open(f.path).convert("RGB") for f in item.images]])
        with torch.no_grad():
            torch.testing.assert_close(adapter.velocity(x, torch.tensor(0.6), index_cond(rollouts.cond, [i]), GUIDANCE),
                                       adapter.velocity(x, torch.tensor(0.6), alone, GUIDANCE), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dynamics_name", ["Flow-SDE", "Dance-SDE", "CPS"])
def test_on_policy_ratio_is_one(adapter, dynamics_name):
    dynamics = make_dynamics(dynamics_name, 0.7)
    algorithm, policy = grpo_on_perturbed_lora(adapter, dynamics, GUIDANCE)
    _, cond = _conditioning(adapter, PROMPTS, [[_image((83, 50), 0)], [_image((83, 50), 1)]])
    noise = adapter.initial_noise(2, SIZE, SIZE, torch.Generator().manual_seed(1))
    traj = sample_trajectory(adapter, dynamics, cond, noise, adapter.sigmas(STEPS, SIZE, SIZE), GUIDANCE,
                             generator=torch.Generator().manual_seed(2))
    assert_on_policy(algorithm, policy, traj, cond)


def test_lora_reloads_in_diffusers_and_changes_the_output(adapter, tiny_qwen_image_edit_path, tmp_path):
    _, cond = _conditioning(adapter, PROMPTS[:1], [[_image((83, 50), 0)]])
    x = adapter.initial_noise(1, SIZE, SIZE, torch.Generator().manual_seed(0))

    def v(a):
        with torch.no_grad():
            return a.velocity(x, torch.tensor(0.8), cond, GUIDANCE)

    base = v(adapter)
    apply_lora(adapter.transformer, 4, 2.0, "default", adapter.default_lora_targets)
    perturb_lora(adapter.transformer, 0.2, which="lora_")
    tuned = v(adapter)
    assert (tuned - base).abs().max() > 1e-3
    save_lora(adapter.pipeline_class, adapter.transformer, tmp_path / "lora")
    fresh = load_pipeline(tiny_qwen_image_edit_path)
    fresh.load_lora_weights(tmp_path / "lora")  # plain diffusers
    torch.testing.assert_close(v(QwenImageEditPlusAdapter(fresh)), tuned, rtol=0, atol=1e-6)


def test_a_prompt_is_encoded_with_its_own_rows_images(adapter, tmp_path):
    """The text encoding depends on the images: two rows with one prompt and other images get other embeddings,
    in the sampler and in the condition cache, which keys an entry by files and prompt and equals a fresh encoding."""
    from helpers_runs import write_conditioned_dataset

    from flow_factory.prompt_cache import ConditionCache, condition_media, encode_condition_rows

    items = load_prompts(write_conditioned_dataset(tmp_path / "data"), "train")[:2]
    same_prompt = [items[0], type(items[0])(items[0].prompt, images=items[1].images)]
    geometry = (SIZE, SIZE, None, None)
    cache = ConditionCache.build(adapter, [(it, geometry, GUIDANCE) for it in same_prompt], tmp_path / "cache", 2)
    cached = cache.lookup(same_prompt, geometry, "cpu", GUIDANCE)
    fresh = encode_condition_rows(adapter, condition_media(adapter, same_prompt, geometry), same_prompt, geometry,
                                  GUIDANCE)
    assert cached.keys() == fresh.keys() and "negative_prompt_embeds" in fresh
    assert all(torch.equal(cached[k], fresh[k]) for k in fresh)
    assert (fresh["prompt_embeds"][0] - fresh["prompt_embeds"][1]).abs().max() > 1e-4
    assert cache.lookup(same_prompt, geometry, "cpu", 1.0) is None  # without CFG: other entries

    settings = SamplingSettings(SIZE, SIZE, None, 2, GUIDANCE, batch_size=1, seed=0, sde_steps=[])
    rollouts = collect_rollouts(adapter, ODE(), same_prompt, torch.arange(2), [0, 1], settings, epoch=0,
                                services=SamplingServices(condition_cache=cache))
    assert all(torch.equal(rollouts.cond[k], cached[k]) for k in cached)


@pytest.mark.parametrize("trainer_type", ["grpo", "nft"])
def test_ff_train_runs_from_a_conditioned_dataset(tmp_path, tiny_qwen_image_edit_path, trainer_type):
    """Rows of one and two condition images of their own sizes, a sample a call (per_device_batch_size 1, as
    Flow-Factory's examples), train and eval at other condition sizes; the saved LoRA changes the pipeline's output
    for the two-image row."""
    from flow_factory.data import read_image
    from flow_factory.train import main as ff_train

    config = tiny_run_config(tmp_path, "qwen-image-edit-plus", tiny_qwen_image_edit_path, trainer_type=trainer_type,
                             max_epochs=2, condition_image_size=48, auto_resize=False, per_device_batch_size=1)
    config["data"]["dataset_dir"] = str(_ragged_dataset(tmp_path / "ragged"))
    config["eval"].update(condition_image_size=64, auto_resize=False, per_device_batch_size=1)
    if trainer_type == "nft":
        config["train"]["num_train_timesteps"] = 1
        config["scheduler"] = {"dynamics_type": "ODE", "noise_level": 0.0}
    assert ff_train([str(write_config(tmp_path, config))]) == 0

    run_dir = tmp_path / "saves" / "run"
    history = json.loads((run_dir / "history.json").read_text())
    assert [r["epoch"] for r in history["train"]] == [0, 1] and "reward/jpeg/mean" in history["train"][-1]
    sources = [read_image(f) for f in load_prompts(tmp_path / "ragged", "test")[1].images]
    latents = []
    for lora in (None, run_dir / "checkpoints" / "epoch_2"):
        pipe = load_pipeline(tiny_qwen_image_edit_path)
        if lora is not None:
            pipe.load_lora_weights(lora)
        noise = torch.randn((1, 16, 8, 8), generator=torch.Generator().manual_seed(0))
        latents.append(pipe(image=sources, prompt="blend them", negative_prompt="", true_cfg_scale=GUIDANCE,
                            height=SIZE, width=SIZE, num_inference_steps=STEPS, output_type="latent",
                            latents=type(pipe)._pack_latents(noise, 1, 16, 8, 8)).images)
    assert not torch.allclose(*latents, atol=1e-6), "the trained LoRA does not change the pipeline's output"


def test_rows_that_cannot_share_a_call_are_named_before_the_model_loads(tmp_path, tiny_qwen_image_edit_path,
                                                                        capsys, monkeypatch):
    from flow_factory.train import main as ff_train

    def refuse(cls, *args, **kwargs):
        pytest.fail("a pipeline started loading: the error came too late")

    monkeypatch.setattr(QwenImageEditPlusAdapter, "from_pretrained", classmethod(refuse))
    config = tiny_run_config(tmp_path, "qwen-image-edit-plus", tiny_qwen_image_edit_path, auto_resize=False,
                             condition_image_size=64)
    config["data"]["dataset_dir"] = str(_ragged_dataset(tmp_path / "ragged"))
    assert ff_train([str(write_config(tmp_path, config))]) == 2
    train = tmp_path / "ragged" / "train.jsonl"
    assert (f"{train}:2: train.per_device_batch_size is 2, and the samples of one transformer call must have "
            f"condition images that come out the same sizes, but this row's give ((96, 64), (64, 64)) where "
            f"{train}:1's give ((96, 64),); set train.per_device_batch_size to 1") in capsys.readouterr().err
    from flow_factory.sample import main as ff_sample

    assert ff_sample([str(tiny_qwen_image_edit_path), "--model-type", "qwen-image-edit-plus", "--prompt-file",
                      str(train), "--out", str(tmp_path / "s"), "--batch-size", "2"]) == 2
    assert "--batch-size is 2, and the samples of one transformer call" in capsys.readouterr().err
    Image.new("RGB", (400, 4)).save(tmp_path / "ragged" / "images" / "wide.png")  # 4096 px at ratio 100: 640x0
    config["train"]["per_device_batch_size"] = 1
    assert ff_train([str(write_config(tmp_path, config))]) == 2
    assert (f"{train}:1: qwen-image-edit-plus: a 400x4 condition image resized to an area of 4096 pixels is 640x0"
            in capsys.readouterr().err)
