"""FLUX.2 and FLUX.2 [klein] image-to-image (model_type flux2 / flux2-klein with reference images): a row that
names condition images generates from them as ``Flux2Pipeline(image=[...])`` does, a row without any is
text-to-image as before.

The reference images are VAE-encoded into tokens appended to the latents' (position ids 10, 20, ... per image);
the ODE rollout equals the pipeline's own for the same prompts, references and noise (invariant 2), the on-policy
ratio is exactly 1 under every SDE (invariant 1), ``ff-train`` trains from a jsonl dataset of condition images and
its LoRA loads with the pipeline's ``load_lora_weights``.
"""

import json

import numpy as np
import pytest
import torch
from helpers_algorithms import assert_on_policy, grpo_on_perturbed_lora
from helpers_runs import ff_train_in_this_process, tiny_run_config, write_condition_image, write_config
from PIL import Image

from flow_factory.data import load_prompts, read_image
from flow_factory.dynamics import make_dynamics
from flow_factory.dynamics.ode import ODE
from flow_factory.models import get_adapter_class, load_adapter
from flow_factory.trajectory import sample_trajectory

STEPS, SIZE = 3, 64
PROMPTS = ["make the sky red", "add a cat"]
# (fixture, guidance): FLUX.2 [dev] guidance-distilled, Klein step-distilled (no guidance), Klein base (CFG)
CASES = {"flux2": ("tiny_flux2_path", 4.0), "flux2-klein": ("tiny_flux2_klein_path", 1.0),
         "flux2-klein-base": ("tiny_flux2_klein_base_path", 3.0)}
# each sample's references: two of their own sizes (the pipeline floors 100x72 to 96x64), one sample a call
REFERENCE_SIZES = [(100, 72), (64, 80)]


def _image(size, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _sources(n, sizes=REFERENCE_SIZES, seed=0):
    return [[_image(size, seed + 10 * i + k) for k, size in enumerate(sizes)] for i in range(n)]


@pytest.fixture(params=list(CASES))
def case(request):
    fixture, guidance = CASES[request.param]
    model_type = "flux2" if request.param == "flux2" else "flux2-klein"
    return load_adapter(model_type, request.getfixturevalue(fixture)), guidance


def _conditioning(adapter, prompts, sources, guidance, condition_size=None):
    media = adapter.prepare_conditions(sources, None, SIZE, SIZE, None, condition_size)
    return {**adapter.encode(prompts, None, guidance), **adapter.encode_conditions(media, SIZE, SIZE, None)}


def _pipeline_latents(pipe, prompt, references, noise, guidance):
    """The pipeline's own rollout for one prompt and its references, in the adapter's layout (the last step's
    latents, read from a callback: the two pipelines' latent outputs differ)."""
    last = {}
    kwargs = dict(image=references, prompt=prompt, height=SIZE, width=SIZE, num_inference_steps=STEPS,
                  guidance_scale=guidance, latents=noise, output_type="latent",
                  callback_on_step_end=lambda _p, _i, _t, step: last.update(step) or {})
    if type(pipe).__name__ == "Flux2KleinPipeline" and guidance > 1 and not pipe.config.is_distilled:
        kwargs["negative_prompt_embeds"] = pipe.encode_prompt([""])[0]
    pipe(**kwargs)
    return type(pipe)._unpack_latents_with_ids(last["latents"], type(pipe)._prepare_latent_ids(noise))


def test_ode_rollout_reproduces_the_pipeline_with_reference_images(case):
    """Two samples of two references each (of two sizes), in one call; the pipeline takes one set of references
    for its batch, so it runs a sample a call."""
    adapter, guidance = case
    sources = _sources(len(PROMPTS))
    cond = _conditioning(adapter, PROMPTS, sources, guidance)
    assert cond["image_latents"].shape[:2] == (2, 6 * 4 + 4 * 5)  # 96x64 and 64x80, at 16 pixels a token
    noise = adapter.initial_noise(len(PROMPTS), SIZE, SIZE, torch.Generator().manual_seed(0))
    sigmas = adapter.sigmas(STEPS, SIZE, SIZE)
    final = sample_trajectory(adapter, ODE(), cond, noise, sigmas, guidance).final
    expected = torch.cat([_pipeline_latents(adapter.pipeline, prompt, refs, noise[i:i + 1].clone(), guidance)
                          for i, (prompt, refs) in enumerate(zip(PROMPTS, sources))])
    assert final.abs().max() > 0.1
    torch.testing.assert_close(final, expected.float(), rtol=0, atol=1e-5)
    # the references change the output: the same rollout without them is the text-to-image one
    text_only = sample_trajectory(adapter, ODE(), adapter.encode(PROMPTS, None, guidance), noise, sigmas,
                                  guidance).final
    assert (text_only - final).abs().max() > 1e-3


def test_a_row_without_references_is_text_to_image(tiny_flux2_path):
    """encode_conditions of a row that names no image gives no token: the velocity is the text-only one."""
    adapter = load_adapter("flux2", tiny_flux2_path)
    media = adapter.prepare_conditions([[]], None, SIZE, SIZE, None, None)
    assert media.images[0].shape == (0, 3, SIZE, SIZE)
    text = adapter.encode(PROMPTS[:1], None, 4.0)
    cond = {**text, **adapter.encode_conditions(media, SIZE, SIZE, None)}
    x = adapter.initial_noise(1, SIZE, SIZE, torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(adapter.velocity(x, torch.tensor(0.7), cond, 4.0),
                           adapter.velocity(x, torch.tensor(0.7), text, 4.0))


def test_references_are_resized_as_the_pipeline_resizes_them(tiny_flux2_path):
    """Down to the area (the pipeline's 1024^2, or condition_image_size's), floored to multiples of 16; an image
    that comes out under one token is named before anything loads (call_shape)."""
    adapter = load_adapter("flux2", tiny_flux2_path)
    sizes = [(100, 72), (300, 200)]
    media = adapter.prepare_conditions([[_image(s, k) for k, s in enumerate(sizes)]], None, SIZE, SIZE, None, (64, 64))
    # 300x200 at an area of 64^2: 78x52, floored to 64x48; 100x72: 75x54 -> 64x48
    assert [tuple(im.shape[-2:]) for im in media.images[0]] == [(48, 64), (48, 64)]
    assert type(adapter).call_shape(sizes, None) == ((96, 64), (288, 192))
    # the pipeline refuses a side under 64 pixels; Flow-Factory takes it, and so does this
    assert type(adapter).call_shape([(50, 83)], None) == ((48, 80),)
    with pytest.raises(ValueError, match="a reference image resized to an area of 4096 pixels is 357x11, a side "
                                         "under 16 pixels; give a larger image, or raise condition_image_size"):
        type(adapter).call_shape([(2000, 64)], (64, 64))


def test_samples_of_other_reference_sizes_need_a_call_each(tiny_flux2_path):
    adapter = load_adapter("flux2", tiny_flux2_path)
    refs = [[_image((100, 72), 0)], [_image((64, 64), 1)]]
    media = adapter.prepare_conditions(refs, None, SIZE, SIZE, None, None)
    cond = {**adapter.encode(PROMPTS, None, 4.0), **adapter.encode_conditions(media, SIZE, SIZE, None)}
    x = adapter.initial_noise(2, SIZE, SIZE, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="reference images of the same sizes; got \\[24, 16\\] tokens"):
        adapter.velocity(x, torch.tensor(0.7), cond, 4.0)
    with torch.no_grad():  # one row a call: each sample's own references (the padding cut off)
        for i in range(2):
            one = {k: v[i:i + 1] for k, v in cond.items()}
            alone = _conditioning(adapter, PROMPTS[i:i + 1], [refs[i]], 4.0)
            torch.testing.assert_close(adapter.velocity(x[i:i + 1], torch.tensor(0.7), one, 4.0),
                                       adapter.velocity(x[i:i + 1], torch.tensor(0.7), alone, 4.0), rtol=0, atol=0)


@pytest.mark.parametrize("dynamics_name", ["Flow-SDE", "Dance-SDE", "CPS"])
def test_on_policy_ratio_is_one(case, dynamics_name):
    adapter, guidance = case
    dynamics = make_dynamics(dynamics_name, 0.7)
    algorithm, policy = grpo_on_perturbed_lora(adapter, dynamics, guidance)
    cond = _conditioning(adapter, PROMPTS, _sources(2, seed=5), guidance)
    noise = adapter.initial_noise(2, SIZE, SIZE, torch.Generator().manual_seed(1))
    traj = sample_trajectory(adapter, dynamics, cond, noise, adapter.sigmas(STEPS, SIZE, SIZE), guidance,
                             generator=torch.Generator().manual_seed(2))
    assert_on_policy(algorithm, policy, traj, cond)


# --------------------------------------------------------------------------------- ff-train


def _reference_dataset(folder):
    """Rows of one or two reference images (two rows without any: text-to-image in the same run), each of the
    image sizes the pipeline takes; a row of other sizes than the others, so one sample a call."""
    images = {"a.png": ((100, 72), (200, 30, 30)), "b.png": ((64, 80), (30, 200, 30)),
              "c.png": ((96, 64), (30, 30, 200))}
    for i, (name, (size, colour)) in enumerate(images.items()):
        write_condition_image(folder / "images" / name, size, colour, seed=i)
    rows = {"train": [{"prompt": "make it red", "image": "a.png"}, {"prompt": "blend them", "images": ["b.png", "c.png"]},
                      {"prompt": "a lake at dawn"}],
            "test": [{"prompt": "make it blue", "image": "c.png"}, {"prompt": "blend them", "images": ["a.png", "b.png"]}]}
    for split, lines in rows.items():
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return folder


@pytest.mark.parametrize("model_type,trainer_type", [("flux2", "grpo"), ("flux2-klein", "grpo"), ("flux2", "nft")])
def test_ff_train_runs_from_a_dataset_of_reference_images(request, tmp_path, model_type, trainer_type, gpu_precision):
    """In a GPU's precision (bf16 autocast, fp16 trajectories): grpo (and nft) for 2 epochs, a sample a call (per_device_batch_size 1, as Flow-Factory's i2i example), rows with and
    without references in one run, the references encoded once into the condition cache; the saved LoRA loads with
    the pipeline's load_lora_weights and changes its image-to-image output."""
    fixture, guidance = CASES[model_type]
    path = request.getfixturevalue(fixture)
    config = tiny_run_config(tmp_path, model_type, path, trainer_type=trainer_type, max_epochs=2,
                             per_device_batch_size=1, condition_image_size=[96, 96])
    if trainer_type == "nft":
        config["train"]["num_train_timesteps"] = 1
        config["scheduler"] = {"dynamics_type": "ODE", "noise_level": 0.0}
    config["data"]["dataset_dir"] = str(_reference_dataset(tmp_path / "refs"))
    config["eval"].update(per_device_batch_size=1)
    (_out, err), code = ff_train_in_this_process([write_config(tmp_path, config)])
    assert code == 0, err

    run_dir = tmp_path / "saves" / "run"
    history = json.loads((run_dir / "history.json").read_text())
    assert [r["epoch"] for r in history["train"]] == [0, 1] and "reward/jpeg/mean" in history["train"][-1]
    assert list((tmp_path / "prompt_cache").glob("conditions-*"))
    sources = [read_image(f) for f in load_prompts(tmp_path / "refs", "test")[1].images]
    pipeline_class = get_adapter_class(model_type).pipeline_class
    latents = []
    for lora in (None, run_dir / "checkpoints" / "epoch_2"):
        pipe = pipeline_class.from_pretrained(path)
        if lora is not None:
            pipe.load_lora_weights(lora)
        noise = torch.randn((1, 128, 4, 4), generator=torch.Generator().manual_seed(0))
        latents.append(_pipeline_latents(pipe, "blend them", sources, noise, guidance))
    assert not torch.allclose(*latents, atol=1e-6), "the trained LoRA does not change the pipeline's output"


def test_a_missing_reference_image_is_named_before_the_model_loads(tmp_path, tiny_flux2_path, monkeypatch):
    from flow_factory.models.flux2 import Flux2Adapter

    def refuse(cls, *args, **kwargs):
        pytest.fail("a pipeline started loading: the error came too late")

    monkeypatch.setattr(Flux2Adapter, "from_pretrained", classmethod(refuse))
    config = tiny_run_config(tmp_path, "flux2", tiny_flux2_path, per_device_batch_size=1)
    config["data"]["dataset_dir"] = str(_reference_dataset(tmp_path / "refs"))
    (tmp_path / "refs" / "images" / "b.png").unlink()
    (_out, err), code = ff_train_in_this_process([write_config(tmp_path, config)])
    assert code == 2
    train = tmp_path / "refs" / "train.jsonl"
    assert f"{train}:2: images 'b.png' ({tmp_path / 'refs' / 'images' / 'b.png'}) not found" in err


def test_a_text_only_run_is_the_run_of_a_text_only_model(tmp_path, tiny_flux2_path, monkeypatch):
    """A dataset without reference images: the same rewards and weights as the adapter without the reference-image
    path (condition_inputs empty, as FLUX.2 was text-to-image only), to the bit."""
    from flow_factory.config import parse_config
    from flow_factory.models.flux2 import Flux2FamilyAdapter
    from flow_factory.trainer import Trainer

    def run(folder):
        config = tiny_run_config(folder, "flux2", tiny_flux2_path, max_epochs=1)
        config["log"]["logging_backend"] = "none"
        trainer = Trainer(parse_config(config))
        try:
            trainer.train()
            return trainer.history, [p.detach().clone() for p in trainer.params]
        finally:
            trainer.close()

    history, weights = run(tmp_path / "references")
    monkeypatch.setattr(Flux2FamilyAdapter, "condition_inputs", ())
    text_history, text_weights = run(tmp_path / "text")
    assert [r["reward/jpeg/mean"] for r in history] == [r["reward/jpeg/mean"] for r in text_history]
    assert all(torch.equal(a, b) for a, b in zip(weights, text_weights))
