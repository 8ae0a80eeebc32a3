"""``trainer_type: dmd2`` through ``ff-train`` on tiny SD3 (issue 39 point 2, issue 38 point 6): two epochs of a
few-step generator and its online fake score, each role with its own optimizer (the generator's Muon, the fake
score's AdamW), inside the one optimisation loop; a run stopped after one epoch and resumed ends exactly where the
straight run does, both roles' weights and optimizer states; the generator's LoRA loads in plain diffusers.
One pair of launches serves every assertion."""

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers_runs import straight_and_resumed
from test_roles import dmd2_config

TTUR = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_pipeline):
    model = tiny_pipeline("sd3-5")

    def make(folder, epochs):
        config = dmd2_config(folder, model, [{"name": "generator", "optimizer": "muon", "learning_rate": 1e-3},
                                             {"name": "fake", "learning_rate": 2e-3, "betas": [0.0, 0.999]}],
                             max_epochs=epochs, ttur_fake_updates=TTUR, unique_sample_num_per_epoch=2,
                             real_guidance_scale=2.0, ema_decay=0)
        config["log"] |= {"logging_backend": "none", "save_freq": 1}
        return config

    straight, resumed = straight_and_resumed(tmp_path_factory.mktemp("dmd2"), make, epochs=2, stop_after=1)
    return model, straight / "checkpoints" / "epoch_2", resumed / "checkpoints" / "epoch_2"


def _same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    else:
        assert a == b


def test_a_resumed_run_ends_with_both_roles_exactly_as_the_straight_one(runs):
    _, straight, resumed = runs
    _same(load_file(straight / "pytorch_lora_weights.safetensors"), load_file(resumed / "pytorch_lora_weights.safetensors"))
    for name in ("fake_lora.pt", "fake_optimizer.pt", "optimizer.pt"):
        _same(torch.load(straight / name, weights_only=True), torch.load(resumed / name, weights_only=True))


def test_each_role_trains_with_its_own_optimizer_in_its_phase(runs):
    _, straight, _ = runs
    generator = torch.load(straight / "optimizer.pt", weights_only=True)
    fake = torch.load(straight / "fake_optimizer.pt", weights_only=True)
    assert generator["param_groups"][0]["lr"] == 1e-3 and "momentum_buffer" in next(iter(generator["state"].values()))
    assert fake["param_groups"][0]["betas"] == (0.0, 0.999)
    # one generator step an epoch, TTUR fake steps before each: AdamW counts its steps
    assert {float(s["step"]) for s in fake["state"].values()} == {2.0 * TTUR}
    state = json.loads((straight / "trainer_state.json").read_text())
    assert state["global_step"] == 2  # the generator's steps are the run's
    for record in state["history"]:
        assert record["train/skipped_updates"] == record["train/fake/skipped_updates"] == 0
        for key in ("train/dmd_loss", "train/fake/fake_score_loss", "train/grad_norm", "train/fake/grad_norm"):
            assert 0 < record[key] < float("inf"), key
    # the generator's and the fake score's adapters trained apart
    generator_lora = load_file(straight / "pytorch_lora_weights.safetensors")
    fake_lora = torch.load(straight / "fake_lora.pt", weights_only=True)
    assert len(generator_lora) == len(fake_lora)
    b = next(k for k in fake_lora if "lora_B" in k)
    assert fake_lora[b].abs().max() > 0 and (fake_lora[b] - generator_lora[f"transformer.{b}"]).abs().max() > 0


def test_the_generators_lora_loads_in_plain_diffusers(runs):
    from diffusers import StableDiffusion3Pipeline
    from peft.utils import get_peft_model_state_dict

    model, straight, _ = runs
    pipe = StableDiffusion3Pipeline.from_pretrained(model)
    pipe.load_lora_weights(straight)  # the user's call; the fake score's adapter is not in the file
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=pipe.transformer.active_adapters()[0])
    saved = load_file(straight / "pytorch_lora_weights.safetensors")
    _same({k: v.float() for k, v in loaded.items()}, {k.removeprefix("transformer."): v for k, v in saved.items()})
