"""``trainer_type: dmd2``, ``tdm-r1``, ``tdm`` and ``diffusion-opd`` through ``ff-train`` on tiny FLUX.1 and tiny
Wan2.1 text-to-video (issue 39 point 1, beyond SD3: test_distillation_run.py): FLUX.1 takes the teacher's guidance
(``real_guidance_scale``) in its guidance embedding, not by CFG; Wan's latents are 5-D video. Each trainer trains
2 epochs with LoRA roles; a run resumed from the first epoch's checkpoint ends with every role's files exactly as
the straight run's; the generator's LoRA loads with the family's own diffusers pipeline (``load_lora_weights``)
and changes its output. One process against two is not repeated per family: the loop that averages the roles'
gradients is the same for every family, and test_distillation_run.py checks it on SD3."""

from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import load_file

from flow_factory.models import get_adapter_class
from flow_factory.train import main

from helpers_runs import TINY_MODELS, assert_same_state, write_config
from test_opd import opd_train_config, save_teacher
from test_roles import dmd2_config
from test_train_cli import _pipeline_output

LORA = "pytorch_lora_weights.safetensors"
# (family, trainer): tdm's launch is tdm-r1's less its surrogate, its loss its own: on one family
CASES = [(family, trainer) for family in ("flux1", "wan2_t2v") for trainer in ("dmd2", "tdm-r1", "tdm", "diffusion-opd")]
ROLE_FILES = {"diffusion-opd": {"optimizer.pt"}}  # its teachers are frozen LoRA files, loaded again on resume


@contextmanager
def guidance_embedded():
    """The set of guidance values FLUX.1's transformer is called with inside the block (its embedding's input)."""
    from diffusers import FluxTransformer2DModel

    seen, forward = set(), FluxTransformer2DModel.forward

    def recording(self, *args, guidance=None, **kwargs):
        if guidance is not None:
            seen.update(guidance.tolist())
        return forward(self, *args, guidance=guidance, **kwargs)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FluxTransformer2DModel, "forward", recording)
        yield seen


@pytest.fixture(scope="module", params=CASES, ids="-".join)
def runs(request, tmp_path_factory, tiny_pipeline):
    """A straight run of 2 epochs (saving each), and one resumed from its first epoch's checkpoint: the model,
    its family, the two runs' last checkpoints and the guidance values FLUX.1's embedding took in the straight
    run."""
    family, trainer = request.param
    model = tiny_pipeline(family)
    tmp = tmp_path_factory.mktemp(f"{family}-{trainer}")
    # the rollouts at the family's own guidance (FLUX.1's embedding, Wan's CFG), the teacher's above it
    guidance = TINY_MODELS[family][3]
    if trainer == "diffusion-opd":  # two teachers, each serving its dataset
        save_teacher(model, tmp / "ta", 2, 1, model_type=family)
        save_teacher(model, tmp / "tb", 4, 2, model_type=family)
        config = opd_train_config(tmp, model, model_type=family, max_epochs=2, num_inference_steps=2,
                                  unique_sample_num_per_epoch=2, per_device_batch_size=2, ema_decay=0,
                                  guidance_scale=guidance)
    else:
        config = dmd2_config(tmp, model, model_type=family, trainer_type=trainer, max_epochs=2, ttur_fake_updates=1,
                             unique_sample_num_per_epoch=2, guidance_scale=guidance, real_guidance_scale=guidance + 1)
    if trainer == "tdm-r1":  # rewards, and whole groups for its surrogate's preference
        config["train"]["group_size"] = 2
        config["rewards"] = [{"name": "jpeg", "reward_model": "jpeg_compressibility"}]
    config["eval"]["eval_freq"] = 0
    config["log"] |= {"logging_backend": "none", "save_freq": 1}
    with guidance_embedded() as scales:
        assert main([str(write_config(tmp, config))]) == 0
    straight = tmp / "saves" / "run" / "checkpoints"
    config["log"]["run_name"], config["model"]["resume_path"] = "resumed", str(straight / "epoch_1")
    assert main([str(write_config(tmp, config, "resumed.yaml"))]) == 0
    return model, family, straight / "epoch_2", tmp / "saves" / "resumed" / "checkpoints" / "epoch_2", scales, trainer


def test_flux1s_teacher_is_guided_through_its_guidance_embedding(runs):
    """FLUX.1 has no negative branch: the teacher's ``real_guidance_scale`` (4.5) is its embedding's input, the
    rollouts and the generator's replay take the run's ``guidance_scale`` (3.5) and the fake score is trained
    and queried at 1 (unguided, as for CFG families); a teacher left at the rollouts' guidance would show no 4.5."""
    _, family, _, _, scales, trainer = runs
    if family != "flux1" or trainer == "diffusion-opd":
        pytest.skip("a CFG family: its guidance is a negative branch, not an embedding; or no real_guidance_scale")
    assert scales == {1.0, TINY_MODELS["flux1"][3], TINY_MODELS["flux1"][3] + 1}


def test_a_resumed_run_ends_with_every_role_exactly_as_the_straight_one(runs):
    *_, straight, resumed, _, trainer = runs
    assert [p.name for p in resumed.parent.iterdir()] == ["epoch_2"]  # it trained the second epoch alone
    lora = load_file(straight / LORA)
    assert max(float(v.abs().max()) for k, v in lora.items() if "lora_B" in k) > 0  # lora_B starts at 0: it trained
    assert_same_state(lora, load_file(resumed / LORA))
    roles = sorted(p.name for p in straight.glob("*.pt"))
    assert ROLE_FILES.get(trainer, {"optimizer.pt", "fake_lora.pt", "fake_optimizer.pt"}) <= set(roles)
    assert roles == sorted(p.name for p in resumed.glob("*.pt"))
    for name in roles:
        assert_same_state(torch.load(straight / name, weights_only=True), torch.load(resumed / name, weights_only=True))


def test_the_generator_loads_in_the_familys_diffusers_pipeline(runs):
    from peft.utils import get_peft_model_state_dict

    model, family, straight, *_ = runs
    pipe_cls = get_adapter_class(family).pipeline_class
    pipe = pipe_cls.from_pretrained(model)
    pipe.load_lora_weights(straight)  # the user's call; the other roles' adapters are not in the file
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=pipe.transformer.active_adapters()[0])
    saved = load_file(straight / LORA)
    assert_same_state({k: v.float() for k, v in loaded.items()}, {k.removeprefix("transformer."): v for k, v in saved.items()})
    base, tuned = (_pipeline_output(pipe_cls, model, lora, family) for lora in (None, straight))
    assert not torch.allclose(base, tuned, atol=1e-6), "the generator's LoRA does not change the output"
