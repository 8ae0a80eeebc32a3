"""``trainer_type: dmd2`` and ``tdm-r1`` (and through it ``tdm``) through ``ff-train`` on tiny SD3 (issue 39
points 1-4, issue 38 point 6): two epochs of a few-step generator and its other roles, each role with its own
optimizer (the generator's Muon, the fake score's AdamW), inside the one optimisation loop; a run resumed from the
first epoch's checkpoint ends exactly where the straight run does, every role's weights and optimizer state; the
generator loads in plain diffusers; one process and two make the same update. One pair of launches per trainer
serves every assertion. And, on a toy policy, each trainer's generator loss pulls towards the teacher and away
from the fake score (its wiring of the roles)."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from flow_factory.algorithms import make_algorithm
from flow_factory.config import parse_config
from flow_factory.dynamics import ODE
from flow_factory.train import main

from helpers_runs import assert_same_state, write_config
from test_sharded_training import TOOLS_PATH, _why_no_deepspeed, needs_deepspeed
from test_roles import dmd2_config

TTUR = 2
FAKE_EMA_DECAY = 0.5
BACKENDS = {None: "ddp", "fsdp2": "fsdp", "zero2": "deepspeed"}  # config_file -> the checkpoint's sharding.backend
FAKE_WEIGHTS = {"lora": "fake_lora.pt", "full": "fake_transformer.pt"}  # the fake score's, in a checkpoint


# tdm's launch is tdm-r1's (its TransitionBatch, query draws and fake loss), less the surrogate: not launched apart
@pytest.fixture(scope="module", params=[("dmd2", "lora"), ("tdm-r1", "lora"), ("dmd2", "full")], ids="-".join)
def runs(request, tmp_path_factory, tiny_pipeline):
    """A straight run of 2 epochs (saving each), and one resumed from its first epoch's checkpoint: the model,
    the fine-tuning type and the two runs' last checkpoints."""
    (trainer, finetune), model = request.param, tiny_pipeline("sd3-5")
    tmp = tmp_path_factory.mktemp(f"{trainer}-{finetune}")
    lr = 1e-3 if finetune == "lora" else 1e-4
    # the fake score keeps an EMA (its entry's ema_decay), moved after each epoch at a constant 0.5
    config = dmd2_config(tmp, model, [{"name": "generator", "optimizer": "muon", "learning_rate": lr},
                                      {"name": "fake", "learning_rate": 2 * lr, "betas": [0.0, 0.999],
                                       "ema_decay": FAKE_EMA_DECAY}],
                         trainer_type=trainer, max_epochs=2, ttur_fake_updates=TTUR,
                         unique_sample_num_per_epoch=2, real_guidance_scale=2.0, ema_decay=0,
                         ema_decay_schedule="constant", ema_update_interval=1)
    config["model"]["finetune_type"] = finetune
    if trainer == "tdm-r1":  # rewards, and whole groups for its surrogate's preference
        config["train"]["group_size"] = 2
        config["rewards"] = [{"name": "jpeg", "reward_model": "jpeg_compressibility"}]
    config["eval"]["eval_freq"] = 0
    config["log"] |= {"logging_backend": "none", "save_freq": 1}
    assert main([str(write_config(tmp, config))]) == 0
    straight = tmp / "saves" / "run" / "checkpoints"
    config["log"]["run_name"], config["model"]["resume_path"] = "resumed", str(straight / "epoch_1")
    assert main([str(write_config(tmp, config, "resumed.yaml"))]) == 0
    return model, finetune, straight / "epoch_2", tmp / "saves" / "resumed" / "checkpoints" / "epoch_2"


def generator_weights(checkpoint) -> dict:
    """The generator's weights as the checkpoint holds them for diffusers: its LoRA file, or its transformer/."""
    lora = checkpoint / "pytorch_lora_weights.safetensors"
    return load_file(lora if lora.is_file() else checkpoint / "transformer" / "diffusion_pytorch_model.safetensors")


def test_a_resumed_run_ends_with_every_role_exactly_as_the_straight_one(runs):
    _, finetune, straight, resumed = runs
    assert_same_state(generator_weights(straight), generator_weights(resumed))
    others = ["optimizer.pt", FAKE_WEIGHTS[finetune], "fake_optimizer.pt", "fake_ema.pt"]
    if (straight / "surrogate_lora.pt").is_file():  # tdm-r1: the surrogate, its optimizer and its slow copy
        others += ["surrogate_lora.pt", "surrogate_optimizer.pt", "surrogate_slow.pt"]
    for name in others:
        assert_same_state(torch.load(straight / name, weights_only=True), torch.load(resumed / name, weights_only=True))


def test_a_roles_ema_moves_after_each_epoch_at_its_own_decay(runs):
    """The fake score's EMA after 2 epochs at decay d = 0.5 (constant): d (d w0 + (1 - d) w1) + (1 - d) w2, with
    w_k its weights after epoch k; a LoRA's B starts at 0, so its EMA is d (1 - d) w1 + (1 - d) w2. (A resume that
    restarted it from w1 would hold d w1 + (1 - d) w2: the resume test compares the files.)"""
    _, finetune, straight, _ = runs
    d = FAKE_EMA_DECAY
    state = json.loads((straight / "trainer_state.json").read_text())
    assert [r["train/fake/ema_decay"] for r in state["history"]] == [d, d]
    ema = torch.load(straight / "fake_ema.pt", weights_only=True)["weights"]
    if finetune == "full":  # a full copy starts at the base weights, not 0: its file is compared on resume
        return
    w2 = torch.load(straight / "fake_lora.pt", weights_only=True)
    w1 = torch.load(straight.parent / "epoch_1" / "fake_lora.pt", weights_only=True)
    assert len(ema) == len(w2)  # one tensor per trained weight, in the state dict's order
    for (key, now), before, average in zip(w2.items(), w1.values(), ema):
        assert average.shape == now.shape, key
        if "lora_B" in key:
            torch.testing.assert_close(average, d * (1 - d) * before.float() + (1 - d) * now.float())


def test_each_role_trains_with_its_own_optimizer_in_its_phase(runs):
    _, finetune, straight, _ = runs
    generator = torch.load(straight / "optimizer.pt", weights_only=True)
    fake = torch.load(straight / "fake_optimizer.pt", weights_only=True)
    assert generator["param_groups"][0]["lr"] == (1e-3 if finetune == "lora" else 1e-4)
    assert any("momentum_buffer" in s for s in generator["state"].values())  # Muon's
    assert fake["param_groups"][0]["betas"] == (0.0, 0.999)
    # one generator step an epoch, TTUR fake steps before each: AdamW counts its steps
    assert {float(s["step"]) for s in fake["state"].values()} == {2.0 * TTUR}
    surrogate = straight / "surrogate_optimizer.pt"
    if surrogate.is_file():  # tdm-r1: one surrogate step before each generator step, upstream's default optimizer
        surrogate = torch.load(surrogate, weights_only=True)
        assert {float(s["step"]) for s in surrogate["state"].values()} == {2.0}
        assert (surrogate["param_groups"][0]["lr"], surrogate["param_groups"][0]["betas"]) == (3e-4, (0.9, 0.999))
    state = json.loads((straight / "trainer_state.json").read_text())
    assert state["global_step"] == 2  # the generator's steps are the run's
    for record in state["history"]:
        assert record["train/skipped_updates"] == record["train/fake/skipped_updates"] == 0
        keys = ["train/fake/fake_score_loss", "train/grad_norm", "train/fake/grad_norm"]
        keys += ["train/surrogate/grad_norm"] if isinstance(surrogate, dict) else ["train/loss"]
        for key in keys:
            assert 0 < abs(record[key]) < float("inf"), key
    # the generator and the fake score trained apart
    generator, fake = generator_weights(straight), torch.load(straight / FAKE_WEIGHTS[finetune], weights_only=True)
    prefix = "transformer." if finetune == "lora" else ""
    assert len(generator) == len(fake)
    key = next(k for k in fake if "lora_B" in k or "attn.to_q.weight" in k)
    assert (fake[key] - generator[prefix + key]).abs().max() > 0


def test_the_generator_loads_in_plain_diffusers(runs):
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
    from peft.utils import get_peft_model_state_dict

    model, finetune, straight, _ = runs
    saved = generator_weights(straight)
    if finetune == "full":  # the user's call for a full fine-tune's transformer
        transformer = SD3Transformer2DModel.from_pretrained(straight / "transformer")
        assert_same_state({k: v for k, v in transformer.state_dict().items() if k in saved}, saved)
        return
    pipe = StableDiffusion3Pipeline.from_pretrained(model)
    pipe.load_lora_weights(straight)  # the user's call; the fake score's adapter is not in the file
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=pipe.transformer.active_adapters()[0])
    assert_same_state({k: v.float() for k, v in loaded.items()}, {k.removeprefix("transformer."): v for k, v in saved.items()})


def test_ff_sample_samples_a_checkpoint_with_the_generators_few_steps(runs, capsys):
    """Issue 39 point 6: ff-sample --checkpoint of a distillation run samples as its eval does, with the
    generator's own step count (2 here, not ff-sample's plain 10) and its LoRA, at the run's resolution."""
    from PIL import Image

    from flow_factory.sample import main as ff_sample

    _, finetune, straight, _ = runs
    out = straight.parent.parent / f"samples_cli_{finetune}"
    capsys.readouterr()
    assert ff_sample(["--checkpoint", str(straight), "--prompts", "a red circle", "--out", str(out)]) == 0
    assert "64x64 px, 2 steps, guidance 1" in capsys.readouterr().err
    with Image.open(out / "0000.png") as image:
        assert image.size == (64, 64)


class ToyPolicy:
    """Velocities that are constants: the generator's ``theta`` (trained), the teacher's ``real``, the fake
    score's ``fake``; the batch's role is the active one, as ``trainer/roles.RolePolicy`` makes it."""

    def __init__(self, real: float, fake: float):
        self.theta, self.real, self.fake = torch.zeros((), requires_grad=True), real, fake

    def velocity(self, x, sigma, cond, guidance_scale=None):
        return self.theta.expand_as(x)

    def reference_velocity(self, x, sigma, cond, guidance_scale=None):
        return torch.full_like(x, self.real)

    def role_velocity(self, role, x, sigma, cond, guidance_scale=1.0):
        return torch.full_like(x, self.fake) if role == "fake" else self.theta.detach().expand_as(x)


@pytest.mark.parametrize("name", ["dmd2", "tdm"])
@pytest.mark.parametrize("real, fake", [(0.0, 1.0), (1.0, -0.5)])
def test_the_generator_moves_towards_the_teacher_and_away_from_the_fake_score(tmp_path, tiny_sd3_path, name, real,
                                                                              fake):
    """With x0 = x_k - sigma_k theta and the scores' clean predictions x_t - sigma_t v, the correction
    x0_real - x0_fake is sigma_t (fake - real): descending the loss must raise x0 when it is positive, i.e.
    dL/dtheta has the sign of fake - real."""
    cfg = parse_config(dmd2_config(tmp_path, tiny_sd3_path, trainer_type=name, num_inference_steps=3,
                                   use_huber=False) if name == "tdm" else
                       dmd2_config(tmp_path, tiny_sd3_path, num_inference_steps=3)).train
    algorithm = make_algorithm(name, cfg, ODE())
    # (N, K + 1, *latent): the toy generator's own ODE rollouts (theta = 0: every state the first), which its
    # losses replay (algorithms/distillation/replay.py)
    states = torch.randn(4, 1, 2, 3, generator=torch.Generator().manual_seed(0)).expand(4, 4, 2, 3)
    rollouts = SimpleNamespace(sigmas=torch.tensor([1.0, 0.7, 0.3, 0.0]), cond={"text": torch.arange(4)},
                               latents_at=lambda idx, step: states[idx, step])
    units = torch.tensor([[1], [3]])
    batch, = algorithm.micro_batches(rollouts, torch.zeros(4), units, torch.Generator().manual_seed(1))
    if name == "tdm":  # every transition of each sample, a query level inside its stage
        assert len(batch.x) == 6 and batch.cond["text"].tolist() == [1, 3] * 3
        assert ((batch.sigma_next < batch.sigma_t) & (batch.sigma_t < batch.sigma)).all()
    policy = ToyPolicy(real, fake)
    loss, metrics = algorithm.loss(policy, batch)
    loss.backward()
    assert torch.sign(policy.theta.grad) == (1 if fake > real else -1)
    fake_batch, = algorithm.micro_batches(rollouts, torch.zeros(4), units, torch.Generator().manual_seed(1),
                                          role="fake")
    assert fake_batch.role == "fake"


class LinearGenerator:
    """The fake score's phase on a toy: the generator's velocity ``a x + b`` (its role switched in, no gradients),
    the active role's (the fake score's) a constant ``c`` with gradients; the fake score's inputs are kept."""

    a, b = 0.5, 0.2

    def __init__(self):
        self.c, self.inputs = torch.tensor(0.3, requires_grad=True), []

    def velocity(self, x, sigma, cond, guidance_scale=None):
        self.inputs.append(x.detach())
        return self.c.expand_as(x)

    def role_velocity(self, role, x, sigma, cond, guidance_scale=1.0):
        assert role == "generator"
        return self.a * x + self.b


@pytest.mark.parametrize("sigmas", [[1.0, 0.7, 0.3, 0.0], [1.0, 0.0]], ids=["3-step", "1-step"])
def test_the_fake_score_learns_the_generators_clean_prediction_at_a_drawn_step(tmp_path, tiny_sd3_path, sigmas):
    """DMD2's fake score is trained where the generator's loss is taken (upstream's ``_fake_replay_loss``): at a
    step i of the rollout drawn in [0, K), the generator's clean prediction x0_i = x_i - sigma_i (a x_i + b),
    re-noised to x_t = (1 - s) x0_i + s eps, with the flow-matching target eps - x0_i. Worked by hand from the
    toy's own Euler rollout; for K = 1 x0_0 is the rollout's final sample."""
    cfg = parse_config(dmd2_config(tmp_path, tiny_sd3_path, num_inference_steps=len(sigmas) - 1)).train
    algorithm, steps = make_algorithm("dmd2", cfg, ODE()), len(sigmas) - 1
    states = [torch.randn(16, 2, 3, generator=torch.Generator().manual_seed(0))]
    for k in range(steps):  # the toy generator's ODE rollout, which the fake phase replays
        states.append(states[k] + (sigmas[k + 1] - sigmas[k]) * (LinearGenerator.a * states[k] + LinearGenerator.b))
    states = torch.stack(states, dim=1)
    rollouts = SimpleNamespace(sigmas=torch.tensor(sigmas), cond={"text": torch.arange(16)},
                               latents_at=lambda idx, step: states[idx, step])
    units, drawn = torch.arange(16).reshape(-1, 1), set()
    for seed in range(3):  # three fake passes, each its own draws
        batch, = algorithm.micro_batches(rollouts, torch.zeros(16), units, torch.Generator().manual_seed(seed),
                                         role="fake")
        step = (batch.sigma.reshape(-1, 1) == rollouts.sigmas).float().argmax(dim=1)  # the step drawn: its sigma
        drawn |= set(step.tolist())
        x_i = states[torch.arange(16), step]
        x0 = x_i - batch.sigma.reshape(-1, 1, 1) * (LinearGenerator.a * x_i + LinearGenerator.b)
        s = batch.noise_sigma.reshape(-1, 1, 1)
        policy = LinearGenerator()
        loss, metrics = algorithm.loss(policy, batch)
        torch.testing.assert_close(policy.inputs[0], (1 - s) * x0 + s * batch.noise)
        torch.testing.assert_close(loss, (policy.c - (batch.noise - x0)).pow(2).mean())
        if steps == 1:
            torch.testing.assert_close(x0, states[:, -1])
    assert drawn == set(range(steps))  # every step of the generator's, not its last alone


LINEAR_STEP = {"learning_rate": 1e9, "eps": 1e8, "weight_decay": 0.0}  # AdamW's step linear in the gradient


def test_two_processes_make_one_processs_update(tmp_path, tiny_pipeline):
    """tdm-r1 (all three roles, rewards, groups) on 1 process (one chunk of 2 groups of 2) and on 2 (each one
    chunk of one group) under DDP, FSDP2 and DeepSpeed ZeRO-2: the same generator, fake score and surrogate after 2
    epochs (each sample's training draws are keyed by its id, not by the process; DDP averages the generator's
    gradients, the loop the other roles', FSDP2 reduce-scatters every role's, ZeRO-2's engine the generator's; the
    advantages are the gathered batch's), up to float32 rounding: measured 1.2e-5, 1.3e-5 and 2.5e-6 of how far each
    moved, every backend (dmd2 alike: 9e-6, 1e-6), bound 1e-3; with the other roles' gradients left unaveraged the
    generator's differ by 6e-3. The slow surrogate copy lags (decay 0.9) and its trust region clips half the samples
    of epoch 2: a slow copy not swapped into FSDP2's shards clips none, and the generator differs by 2.5e-2. A
    smooth reward (mean brightness): JPEG sizes jump with rounding. (ZeRO-2's run only where DeepSpeed runs.)"""
    import os

    from helpers_launch import ff_train_forked
    from helpers_runs import ff_train_in_this_process
    from test_train_cli import _free_port

    model, runs = tiny_pipeline("sd3-5"), {}
    launches = [(1, None), (2, None), (2, "fsdp2")] + ([(2, "zero2")] if _why_no_deepspeed() is None else [])
    for processes, backend in launches:
        folder = tmp_path / f"p{processes}{backend or ''}"
        config = dmd2_config(folder, model, [{"name": r, **LINEAR_STEP} for r in ("generator", "fake", "surrogate")],
                             trainer_type="tdm-r1", max_epochs=2, ttur_fake_updates=TTUR, group_size=2,
                             unique_sample_num_per_epoch=2, per_device_batch_size=4 // processes,
                             real_guidance_scale=2.0, ema_decay=0, surrogate_slow_decay_min=0.9,
                             surrogate_slow_decay_max=0.9, surrogate_clip_range=1e-6)  # the slow copy clips samples
        config["rewards"] = [{"name": "brightness", "reward_model": "helpers_rewards.MeanBrightness"}]
        config["eval"]["eval_freq"] = 0
        config["log"] |= {"logging_backend": "none"}
        if backend:
            config["config_file"] = backend
        argv = [str(write_config(folder, config)), "--num_processes", str(processes), "--main_process_port",
                str(_free_port())]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PATH": TOOLS_PATH}
        (_, err), code = ff_train_in_this_process(argv) if processes == 1 else ff_train_forked(argv, env)
        assert code == 0, err[-3000:]
        checkpoint = folder / "saves" / "run" / "checkpoints" / "epoch_2"
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        assert state["history"][-1]["train/surrogate/clip_fraction"] > 0  # the slow copy counted
        sharding = state["sharding"]
        assert (sharding["backend"], sharding["processes"]) == (BACKENDS[backend], processes)
        others = (torch.load(checkpoint / f"{role}_lora.pt", weights_only=True) for role in ("fake", "surrogate"))
        runs[processes, backend] = [generator_weights(checkpoint), *others]
    for _, backend in launches[1:]:
        for role, one, two in zip(("generator", "fake", "surrogate"), runs[1, None], runs[2, backend]):
            one = {k.removeprefix("transformer."): v for k, v in one.items()}
            two = {k.removeprefix("transformer."): v for k, v in two.items()}
            moved = max(float(v.abs().max()) for k, v in one.items() if "lora_B" in k)
            difference = max(float((two[k].double() - v.double()).abs().max()) for k, v in one.items())
            assert moved > 1e-4 and difference <= 1e-3 * moved, (backend, role, difference / moved, moved)


def _dmd2_launch(folder, model, finetune: str, processes: int, config_file=None, resume_from=None,
                 run_name="run") -> Path:
    """dmd2 for 2 epochs (a step linear in the gradient, the fake score's EMA at 0.5), on one process here or
    forked on ``processes`` (``config_file``: their backend); its last checkpoint."""
    import os

    from helpers_launch import ff_train_forked
    from helpers_runs import ff_train_in_this_process
    from test_train_cli import _free_port

    roles = [{"name": "generator", **LINEAR_STEP}, {"name": "fake", **LINEAR_STEP, "ema_decay": FAKE_EMA_DECAY}]
    config = dmd2_config(folder, model, roles, max_epochs=2, ttur_fake_updates=TTUR, unique_sample_num_per_epoch=2,
                         per_device_batch_size=2 // processes, real_guidance_scale=2.0, ema_decay=0,
                         ema_decay_schedule="constant", ema_update_interval=1)
    config["eval"]["eval_freq"] = 0
    config["log"] |= {"logging_backend": "none", "save_freq": 1, "run_name": run_name}
    config["model"] |= {"finetune_type": finetune, "resume_path": resume_from and str(resume_from)}
    if config_file:
        config["config_file"] = config_file
    argv = [str(write_config(folder, config, f"{run_name}.yaml")), "--num_processes", str(processes),
            "--main_process_port", str(_free_port())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PATH": TOOLS_PATH}  # DeepSpeed's ninja
    (_, err), code = ff_train_in_this_process(argv) if processes == 1 else ff_train_forked(argv, env)
    assert code == 0, err[-3000:]
    return folder / "saves" / run_name / "checkpoints" / "epoch_2"


@pytest.fixture(scope="module")
def one_process_dmd2(tmp_path_factory, tiny_pipeline):
    """The last checkpoint of ``_dmd2_launch`` on one process, by fine-tuning type (each run once a module)."""
    runs = {}

    def run(finetune: str) -> Path:
        if finetune not in runs:
            runs[finetune] = _dmd2_launch(tmp_path_factory.mktemp(f"one-{finetune}"), tiny_pipeline("sd3-5"), finetune,
                                          1)
        return runs[finetune]
    return run


def _role_files(checkpoint, finetune: str, names: list[str]) -> dict:
    """The generator's weights, the fake score's and its EMA (``names``: the trained parameters' names, in the
    EMA's order), as name -> tensor, keys without the LoRA file's prefix."""
    ema = torch.load(checkpoint / "fake_ema.pt", weights_only=True)["weights"]
    return {"generator": {k.removeprefix("transformer."): v for k, v in generator_weights(checkpoint).items()},
            "fake": torch.load(checkpoint / FAKE_WEIGHTS[finetune], weights_only=True),
            "fake_ema": dict(zip(names, ema))}


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_under_fsdp2_the_roles_are_sharded_gathered_and_resumed(tmp_path, tiny_pipeline, one_process_dmd2,
                                                                  finetune):
    """dmd2's roles under FSDP2 on 2 processes, each role's optimizer over its own shards: with LoRA every role's
    adapters are shards of the one sharded transformer; without, the fake score's copy and the teacher are sharded
    too. The generator, the fake score and its EMA end as one process's run ends, to float32 rounding: measured
    (LoRA) 3e-6, 7e-7 and 7e-7 of how far each moved, (full) 1.4e-6, 1.3e-6 and 1.1e-6; bound 1e-3 as the DDP test's
    (the fake score's gradients left to this loop's all-reduce instead of FSDP2's reduce-scatter crash). A run
    resumed from the first epoch's gathered checkpoint ends as the straight one, every role's file and optimizer
    state alike, and the generator loads in diffusers."""
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
    from peft.utils import get_peft_model_state_dict

    model = tiny_pipeline("sd3-5")
    base = SD3Transformer2DModel.from_pretrained(f"{model}/transformer")
    start = {"generator": {} if finetune == "lora" else base.state_dict()}
    start["fake"] = start["fake_ema"] = start["generator"]
    one_checkpoint = one_process_dmd2(finetune)
    names = list(torch.load(one_checkpoint / FAKE_WEIGHTS[finetune], weights_only=True)) if finetune == "lora" \
        else [n for n, _ in base.named_parameters()]
    one = _role_files(one_checkpoint, finetune, names)
    straight = _dmd2_launch(tmp_path / "fsdp", model, finetune, 2, "fsdp2")
    state = json.loads((straight / "trainer_state.json").read_text())["sharding"]
    assert (state["backend"], state["processes"]) == ("fsdp", 2)
    sharded = _role_files(straight, finetune, names)
    for role in ("generator", "fake"):  # each process held a part of each role, the two together all of it
        held, total = state["by_role"][role], sum(v.numel() for v in sharded[role].values() if v.is_floating_point())
        assert sum(held) == (total if finetune == "lora" else sum(p.numel() for p in base.parameters()))
        assert all(0 < n < sum(held) for n in held), (role, held)
    for role, weights in one.items():  # a LoRA's B starts at 0; a copy at the base weights
        moved = max(float((v - start[role].get(k, 0 * v)).abs().max()) for k, v in weights.items()
                    if finetune == "full" or "lora_B" in k)
        difference = max(float((sharded[role][k].double() - v.double()).abs().max()) for k, v in weights.items())
        assert moved > 1e-4 and difference <= 1e-3 * moved, (role, difference / moved, moved)
    # the fake score's optimizer state was gathered from its shards (keyed by parameter name, as FSDP2's)
    assert all(isinstance(k, str) for k in torch.load(straight / "fake_optimizer.pt", weights_only=True)["state"])

    resumed = _dmd2_launch(tmp_path / "fsdp", model, finetune, 2, "fsdp2", straight.parent / "epoch_1", "resumed")
    assert_same_state(_role_files(straight, finetune, names), _role_files(resumed, finetune, names))
    for name in ("optimizer.pt", "fake_optimizer.pt"):
        assert_same_state(torch.load(straight / name, weights_only=True), torch.load(resumed / name, weights_only=True))

    if finetune == "full":  # the user's call for a full fine-tune's transformer
        transformer = SD3Transformer2DModel.from_pretrained(straight / "transformer")
        assert_same_state({k: v for k, v in transformer.state_dict().items() if k in sharded["generator"]}, sharded["generator"])
        return
    pipe = StableDiffusion3Pipeline.from_pretrained(model)
    pipe.load_lora_weights(straight)
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=pipe.transformer.active_adapters()[0])
    assert_same_state({k: v.float() for k, v in loaded.items()}, sharded["generator"])


@needs_deepspeed
def test_under_zero2_the_lora_roles_train_beside_the_engine(tmp_path, tiny_pipeline, one_process_dmd2):
    """dmd2's LoRA roles under DeepSpeed ZeRO-2 on 2 processes: the engine holds the generator's optimizer (its
    partitioned state), the fake score's adapter trains beside it with its own AdamW, its gradients averaged by the
    loop. Every role ends as one process's run ends (measured 3e-6, 7e-7 and 7e-7 of the generator's, the fake
    score's and its EMA's move, bound 1e-3 as the DDP test), the run resumes from the first epoch's checkpoint (the
    engine's state and the fake score's files, its optimizer's included) to the straight run's roles (1e-6, as the
    ZeRO-2 test), and the generator loads in diffusers. (In bf16 the engine casts the fake score's adapter with the
    rest: ``Roles._beside_engine`` puts it back in float32, checked by hand, docs/scaling.md.)"""
    from diffusers import StableDiffusion3Pipeline
    from peft.utils import get_peft_model_state_dict

    model = tiny_pipeline("sd3-5")
    one_checkpoint = one_process_dmd2("lora")
    names = list(torch.load(one_checkpoint / "fake_lora.pt", weights_only=True))
    one = _role_files(one_checkpoint, "lora", names)
    straight = _dmd2_launch(tmp_path / "zero2", model, "lora", 2, "zero2")
    state = json.loads((straight / "trainer_state.json").read_text())["sharding"]
    assert (state["backend"], state["processes"]) == ("deepspeed", 2)
    beside = _role_files(straight, "lora", names)
    for role, weights in one.items():
        moved = max(float(v.abs().max()) for k, v in weights.items() if "lora_B" in k)
        difference = max(float((beside[role][k].double() - v.double()).abs().max()) for k, v in weights.items())
        assert moved > 1e-4 and difference <= 1e-3 * moved, (role, difference / moved, moved)

    resumed = _dmd2_launch(tmp_path / "zero2", model, "lora", 2, "zero2", straight.parent / "epoch_1", "resumed")
    again = _role_files(resumed, "lora", names)
    for role, weights in beside.items():
        for key, value in weights.items():
            torch.testing.assert_close(again[role][key], value, rtol=0, atol=1e-6)

    pipe = StableDiffusion3Pipeline.from_pretrained(model)
    pipe.load_lora_weights(straight)
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=pipe.transformer.active_adapters()[0])
    assert_same_state({k: v.float() for k, v in loaded.items()}, beside["generator"])


@pytest.mark.parametrize("trainer", ["dmd2", "tdm", "tdm-r1"])
def test_each_trainer_trains_in_a_gpus_precision(tmp_path, tiny_pipeline, trainer, gpu_precision):
    """bf16 autocast and fp16 rollouts, as on a GPU: an epoch of each trainer replays its generator's steps from
    the fp16 states within upstream's default tolerances (the replay stops the run otherwise) and saves a trained,
    finite generator LoRA."""
    config = dmd2_config(tmp_path, tiny_pipeline("sd3-5"), None, trainer_type=trainer, max_epochs=1,
                         unique_sample_num_per_epoch=2)
    if trainer == "tdm-r1":
        config["train"]["group_size"] = 2
        config["rewards"] = [{"name": "jpeg", "reward_model": "jpeg_compressibility"}]
    config["mixed_precision"] = "bf16"
    config["eval"]["eval_freq"] = 0
    config["log"] |= {"logging_backend": "none"}
    assert main([str(write_config(tmp_path, config))]) == 0
    checkpoint = tmp_path / "saves" / "run" / "checkpoints" / "epoch_1"
    lora = generator_weights(checkpoint)
    assert all(torch.isfinite(t).all() for t in lora.values())
    assert max(t.abs().max() for k, t in lora.items() if "lora_B" in k) > 0  # lora_B starts at 0: it trained


@pytest.mark.parametrize("backend", [pytest.param("zero2", marks=needs_deepspeed), "fsdp2"])
def test_diffusion_opd_sharded_makes_one_processs_update(tmp_path, tiny_pipeline, backend):
    """diffusion-opd (datasets A and B, each its LoRA teacher) on 2 processes, each one sample, against one process
    with both in its micro-batch. Under DeepSpeed ZeRO-2 the engine holds the student's optimizer, the teachers
    frozen adapters inside the network it wraps, outside that optimizer; under FSDP2 the teachers are shards of the
    transformer, gathered with it for each query. The student ends as one process's to float32 rounding (AdamW's
    step linear in the gradient; measured 6.1e-7 of its move under zero2, bound 1e-3 as the roles' tests), its LoRA
    file the student's adapter alone; a teacher trained, left cast or queried from its shard alone would move it
    elsewhere. (The bf16 cast the engine makes, undone for the teachers: test_opd.py.)"""
    import os

    from helpers_launch import ff_train_forked
    from helpers_runs import ff_train_in_this_process
    from test_opd import opd_train_config, save_teacher
    from test_train_cli import _free_port

    model, students = tiny_pipeline("sd3-5"), {}
    save_teacher(model, tmp_path / "ta", 2, 1)
    save_teacher(model, tmp_path / "tb", 4, 2)
    for processes, backend in ((1, None), (2, backend)):
        config = opd_train_config(tmp_path, model, max_epochs=1, num_inference_steps=3, unique_sample_num_per_epoch=2,
                                  per_device_batch_size=2 // processes, ema_decay=0, learning_rate=1e9,
                                  adam_epsilon=1e8, adam_weight_decay=0.0)
        config["eval"]["eval_freq"] = 0
        config["log"] |= {"logging_backend": "none", "run_name": f"p{processes}"}
        if backend:
            config["config_file"] = backend
        argv = [str(write_config(tmp_path, config, f"p{processes}.yaml")), "--num_processes", str(processes),
                "--main_process_port", str(_free_port())]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PATH": TOOLS_PATH}
        (_, err), code = ff_train_in_this_process(argv) if processes == 1 else ff_train_forked(argv, env)
        assert code == 0, err[-3000:]
        checkpoint = tmp_path / "saves" / f"p{processes}" / "checkpoints" / "epoch_1"
        sharding = json.loads((checkpoint / "trainer_state.json").read_text())["sharding"]
        assert (sharding["backend"], sharding["processes"]) == (BACKENDS[backend], processes)
        students[processes] = load_file(checkpoint / "pytorch_lora_weights.safetensors")
    assert students[1].keys() == students[2].keys() and not any("opd_teacher" in k for k in students[2])
    moved = max(float(v.abs().max()) for k, v in students[1].items() if "lora_B" in k)
    difference = max(float((students[2][k].double() - v.double()).abs().max()) for k, v in students[1].items())
    assert moved > 1e-4 and difference <= 1e-3 * moved, (difference / moved, moved)


def _unshift(sigma, s: float):
    """The unshifted u of sigma = s u / (1 + (s - 1) u)."""
    return sigma / (s - (s - 1) * sigma)


@pytest.mark.parametrize("fixture", ["tiny_sd3_path", "tiny_wan_path"])
def test_a_static_flow_shift_unshifts_the_models_schedule_to_an_even_grid(request, fixture):
    """The shift the model reports is its schedule's: unshifted, its sigmas are evenly spaced (the scheduler's
    linear grid), which no other shift makes them."""
    from flow_factory.models import load_adapter

    model_type = {"tiny_sd3_path": "sd3-5", "tiny_wan_path": "wan2_t2v"}[fixture]
    adapter = load_adapter(model_type, request.getfixturevalue(fixture))
    s = adapter.static_flow_shift()
    size, frames = (32, 5) if adapter.is_video else (64, None)
    sigmas = adapter.sigmas(8, size, size, frames)[:-1].double().cpu()  # the last, 0, is appended after the grid
    steps = _unshift(sigmas, s).diff()
    assert s > 1 and torch.allclose(steps, steps.mean().expand_as(steps), atol=1e-6)
    other = _unshift(sigmas, s + 1).diff()
    assert not torch.allclose(other, other.mean().expand_as(other), atol=1e-3)


def test_source_uniform_draws_uniformly_in_the_unshifted_stage(tmp_path, tiny_sd3_path):
    """TDM-R1's official query (upstream's tdm_r1 OCR example): each level's unshifted coordinate is uniform in
    its stage's unshifted interval (mean position 1/2), where actual_uniform's is not."""
    from flow_factory.models import load_adapter

    adapter = load_adapter("sd3-5", tiny_sd3_path)
    s = adapter.static_flow_shift()
    sigmas = adapter.sigmas(3, 64, 64)
    states = torch.zeros(400, 4, 1, 1)
    rollouts = SimpleNamespace(sigmas=sigmas, cond={"text": torch.arange(400)},
                               latents_at=lambda idx, step: states[idx, step])

    def positions(distribution):
        cfg = parse_config(dmd2_config(tmp_path, tiny_sd3_path, trainer_type="tdm", num_inference_steps=3,
                                       tdm_query_distribution=distribution)).train
        algorithm = make_algorithm("tdm", cfg, ODE())
        algorithm.bind_model(adapter)
        batch, = algorithm.micro_batches(rollouts, torch.zeros(400), torch.arange(400)[:, None],
                                         torch.Generator().manual_seed(0))
        lo, hi, at = (_unshift(x.double(), s) for x in (batch.sigma_next, batch.sigma, batch.sigma_t))
        return (at - lo) / (hi - lo)

    uniform = positions("source_uniform")
    assert ((uniform > 0) & (uniform < 1)).all() and abs(uniform.mean().item() - 0.5) < 0.03
    assert abs(positions("actual_uniform").mean().item() - 0.5) > 0.05


def test_source_uniform_on_a_resolution_dependent_shift_says_how_to_fix_it(tmp_path, tiny_sd3_path, tiny_flux_path):
    from flow_factory.config import ConfigError
    from flow_factory.models.preflight import check_static_shift

    cfg = parse_config(dmd2_config(tmp_path, tiny_sd3_path, trainer_type="tdm",
                                   tdm_query_distribution="source_uniform"))
    algorithm = make_algorithm("tdm", cfg.train, ODE())
    with pytest.raises(ConfigError, match="flux1's scheduler shifts it by resolution .*set scheduler.flow_shift"):
        algorithm.bind_model(SimpleNamespace(model_type="flux1", static_flow_shift=lambda: None))
    check_static_shift(Path(tiny_sd3_path), cfg)  # a static shift: nothing to say
    with pytest.raises(ConfigError, match="scheduler_config.json shifts it by resolution"):
        check_static_shift(Path(tiny_flux_path), cfg)  # before the model loads
    cfg.scheduler.flow_shift = 3.0
    check_static_shift(Path(tiny_flux_path), cfg)
