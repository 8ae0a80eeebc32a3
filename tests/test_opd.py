"""``trainer_type: diffusion-opd`` (issue 39 point 5, DiffusionOPD arXiv:2605.15055): on-policy distillation of
several LoRA teachers, each serving its own datasets. Its loss against hand-computed values, the gradient moving
the student towards its own teacher, each sample scored by the teacher of its dataset, the teachers as their
LoRA files make them; a toy 2-D flow whose student learns each dataset's teacher; config errors naming the key;
``ff-train`` for 2 epochs on tiny SD3 with two teachers over two datasets, resumed exactly, the student loading
in plain diffusers."""

import copy
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flow_factory.algorithms import make_algorithm
from flow_factory.algorithms.distillation.opd import opd_sample_loss, opd_target
from flow_factory.config import ConfigError, parse_config
from flow_factory.config.distillation import distilled_steps
from flow_factory.dynamics import ODE, make_dynamics
from flow_factory.train import main
from safetensors.torch import load_file

from helpers_runs import assert_same_state, tiny_run_config, write_config, write_dataset


def test_the_loss_against_hand_computed_values():
    student = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    teacher = torch.tensor([[0.0, 0.0], [1.0, 1.0]])  # errors [1, 2] and [2, 3]
    torch.testing.assert_close(opd_sample_loss(student, teacher), torch.tensor([2.5, 6.5]))
    # self-normalised: over the mean absolute errors 1.5 and 2.5
    torch.testing.assert_close(opd_sample_loss(student, teacher, True), torch.tensor([2.5 / 1.5, 6.5 / 2.5]))
    # under an SDE: over each step's transition variance
    torch.testing.assert_close(opd_sample_loss(student, teacher, variance=torch.tensor([[0.5], [2.0]])),
                               torch.tensor([5.0, 3.25]))
    # the target spaces: x0 = x - sigma v; xt under ODE = x + (sigma_next - sigma) v
    x, v, sigma, nxt = torch.tensor([[1.0, -1.0]]), torch.tensor([[2.0, 4.0]]), torch.tensor([0.75]), torch.tensor([0.5])
    torch.testing.assert_close(opd_target("x0", x, v, sigma, nxt, ODE()), torch.tensor([[-0.5, -4.0]]))
    torch.testing.assert_close(opd_target("xt", x, v, sigma, nxt, ODE()), torch.tensor([[0.5, -2.0]]))
    torch.testing.assert_close(opd_target("v", x, v, sigma, nxt, ODE()), v)
    # upstream's band: timestep_range 0.99 of 10 steps distils all but the last; [0.2, 0.6] of 10: 2..5
    assert distilled_steps(10, 0.99) == range(0, 9) and distilled_steps(10, [0.2, 0.6]) == range(2, 6)
    assert distilled_steps(3, 0.99) == range(0, 2) and distilled_steps(1, 0.5) == range(0, 1)


class ToyPolicy:
    """The student's velocity the one trained number ``theta``; each teacher a constant velocity, and the rows of
    each teacher's calls recorded (by their state's first element, which is the sample's index)."""

    def __init__(self, teachers: dict[str, float]):
        self.theta, self.teachers, self.calls = torch.zeros((), requires_grad=True), teachers, {}

    def velocity(self, x, sigma, cond, guidance_scale=None):
        return self.theta.expand_as(x)

    def teacher_velocity(self, teacher, x, sigma, cond, guidance_scale):
        self.calls.setdefault(teacher, []).extend(x[:, 0].long().tolist())
        self.calls.setdefault(f"{teacher} guidance", []).append(guidance_scale)
        return torch.full_like(x, self.teachers[teacher])


def opd_train_config(tmp, model, *, model_type: str = "sd3-5", **train) -> dict:
    """A diffusion-opd run of a tiny family (SD3 by default) over datasets A and B, each its teacher (paths filled in
    by the caller)."""
    config = tiny_run_config(tmp, model_type, model, **{"trainer_type": "diffusion-opd", "group_size": 1,
                                                        "guidance_scale": 1.0, **train})
    del config["rewards"], config["data"]["dataset_dir"]
    config["data"]["datasets"] = [{"name": n, "dataset_dir": str(write_dataset(tmp / n))} for n in ("A", "B")]
    config["scheduler"] = {"dynamics_type": "ODE"}
    config["train"]["teachers"] = [{"name": "ta", "path": str(tmp / "ta"), "applicable_datasets": ["A"],
                                    "guidance_scale": 2.0},
                                   {"name": "tb", "path": str(tmp / "tb"), "applicable_datasets": ["B"]}]
    return config


def toy_rollouts(datasets: list[str], steps: int = 4):
    n = len(datasets)
    states = torch.arange(float(n)).reshape(n, 1, 1).expand(n, steps + 1, 3).clone()  # x[0] = sample index
    return SimpleNamespace(sigmas=torch.linspace(1.0, 0.0, steps + 1), cond={"text": torch.arange(n)},
                           group_ids=torch.arange(n), datasets=datasets,
                           latents_at=lambda idx, step: states[idx, step])


@pytest.mark.parametrize("target", ["xt", "v", "x0"])
def test_each_sample_is_scored_by_its_datasets_teacher_and_the_student_moves_towards_it(tmp_path, tiny_sd3_path,
                                                                                        target):
    """Samples of A and B in one micro-batch: teacher ta sees A's rows alone at its guidance 2, tb B's at the
    student's 1; descending the loss moves theta towards ta's velocity on A's samples and tb's on B's. With every
    row sent to one teacher the per-teacher losses and the gradient's sign would differ."""
    cfg = parse_config(opd_train_config(tmp_path, tiny_sd3_path, loss_target=target)).train
    algorithm = make_algorithm("diffusion-opd", cfg, ODE())
    rollouts = toy_rollouts(["A", "B", "A", "B"])
    batches = list(algorithm.micro_batches(rollouts, torch.zeros(4), torch.tensor([[0], [1], [2], [3]]),
                                           torch.Generator()))
    assert len(batches) == algorithm.micro_steps_per_chunk(rollouts) == 3  # int(4 x 0.99) = 3 distilled steps
    policy = ToyPolicy({"ta": 1.0, "tb": -2.0})
    loss, metrics = algorithm.loss(policy, batches[1])
    assert sorted(policy.calls["ta"]) == [0, 2] and sorted(policy.calls["tb"]) == [1, 3]
    assert policy.calls["ta guidance"] == [2.0] and policy.calls["tb guidance"] == [1.0]
    scale = {"v": 1.0, "x0": 0.75**2, "xt": 0.25**2}[target]  # (d target / d v)^2 at sigma 0.75, dt -0.25
    torch.testing.assert_close(metrics["distill_loss_ta"], torch.tensor(1.0 * scale))
    torch.testing.assert_close(metrics["distill_loss_tb"], torch.tensor(4.0 * scale))
    torch.testing.assert_close(loss, torch.tensor(2.5 * scale))
    loss.backward()  # theta = 0, between the teachers: A's rows pull it up, B's down twice as hard
    assert policy.theta.grad > 0
    for rows, towards in (([[0], [2]], 1.0), ([[1], [3]], -2.0)):  # one dataset's samples alone
        policy.theta.grad = None
        batch = next(algorithm.micro_batches(rollouts, torch.zeros(4), torch.tensor(rows), torch.Generator()))
        algorithm.loss(policy, batch)[0].backward()
        assert torch.sign(-policy.theta.grad) == torch.sign(torch.tensor(towards))


def test_under_an_sde_the_step_is_weighed_by_its_transition_variance(tmp_path, tiny_sd3_path):
    """Flow-SDE and loss_target xt: each sample's squared mean gap over the step's variance std^2."""
    config = opd_train_config(tmp_path, tiny_sd3_path)
    config["scheduler"] = {"dynamics_type": "Flow-SDE", "noise_level": 0.7}
    cfg = parse_config(config)
    dynamics = make_dynamics("Flow-SDE", 0.7)
    algorithm = make_algorithm("diffusion-opd", cfg.train, dynamics)
    rollouts = toy_rollouts(["A", "B"])
    batch = list(algorithm.micro_batches(rollouts, torch.zeros(2), torch.tensor([[0], [1]]), torch.Generator()))[2]
    policy = ToyPolicy({"ta": 1.0, "tb": -2.0})
    loss, metrics = algorithm.loss(policy, batch)
    v_student = torch.zeros_like(batch.x)
    v_teacher = torch.tensor([1.0, -2.0]).reshape(2, 1).expand_as(batch.x)
    mean_s, std = dynamics.mean_and_std(batch.x, v_student, batch.sigma, batch.sigma_next)
    mean_t, _ = dynamics.mean_and_std(batch.x, v_teacher, batch.sigma, batch.sigma_next)
    expected = ((mean_s - mean_t) ** 2 / std**2).reshape(2, -1).mean(1)
    torch.testing.assert_close(metrics["distill_loss_ta"], expected[0])
    torch.testing.assert_close(metrics["distill_loss_tb"], expected[1])
    assert float(std.max()) < 1  # the division matters: a gap of 1 weighs more than 1


@pytest.mark.parametrize("change, message", [
    (lambda c: c["train"]["teachers"][1].update(applicable_datasets=["C"]),
     "train.teachers[1].applicable_datasets: 'C' is not a dataset of the run"),
    (lambda c: c["train"]["teachers"].pop(), "train.teachers: no teacher serves the datasets ['B']"),
    (lambda c: c["train"]["teachers"][1].update(applicable_datasets=["A"]), "'A' is teachers[0]'s already"),
    (lambda c: c["train"]["teachers"][1].update(name="ta"), "train.teachers[1].name: 'ta' is used twice"),
    (lambda c: c["train"].update(teachers=[]), "train.teachers: diffusion-opd distils at least one teacher"),
    (lambda c: c["train"].update(loss_target="x0") or c["scheduler"].update(dynamics_type="CPS", noise_level=0.5),
     "train.loss_target: 'x0' compares velocities, defined for ODE rollouts only"),
    (lambda c: c["scheduler"].update(dynamics_type="DPM-Solver++2M"), "scheduler.dynamics_type: diffusion-opd"),
    (lambda c: c["model"].update(finetune_type="full"), "model.finetune_type: diffusion-opd's teachers are LoRA"),
    (lambda c: c["train"].update(trainer_type="dmd2"), "train: teachers are diffusion-opd's; dmd2 does not use"),
    (lambda c: c.update(config_file="zero3"), "runs DEEPSPEED with ZeRO-3, which partitions every weight of the "
     "network its engine wraps, diffusion-opd's teachers (LoRA adapters beside the student's) included"),
])
def test_config_errors_name_the_key(tmp_path, tiny_sd3_path, change, message):
    config = opd_train_config(tmp_path, tiny_sd3_path)
    parse_config(copy.deepcopy(config))  # the config itself is fine
    for backend in ("zero2", "fsdp2"):  # and sharded (test_distillation_run.py)
        parse_config(copy.deepcopy(config) | {"config_file": backend})
    change(config)
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(config)


# ---------------------------------------------------------------------------------------------- a toy 2-D flow
TOY_MEANS = {"ta": torch.tensor([2.0, 0.0]), "tb": torch.tensor([-1.0, 1.5])}  # each dataset's teacher: N(mu, s^2 I)
TOY_STD, TOY_STEPS = 0.5, 6


def gaussian_velocity(x, sigma, mean, std):
    """The exact flow-matching velocity E[eps - x0 | x_t] of N(mean, std^2 I) data, x_t = (1 - sigma) x0 + sigma eps."""
    s = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1, 1)
    a = 1 - s
    var = a**2 * std**2 + s**2
    centred = x - a * mean
    return s / var * centred - (mean + a * std**2 / var * centred)


class ToyStudent(torch.nn.Module):
    """The base (N(0, I) data's exact velocity) plus an MLP of (x, sigma, dataset) whose last layer starts at 0."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(5, 64), torch.nn.SiLU(), torch.nn.Linear(64, 2))
        torch.nn.init.zeros_(self.net[-1].weight)
        torch.nn.init.zeros_(self.net[-1].bias)

    def forward(self, x, sigma, source):
        s = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1, 1).expand(len(x), 1)
        features = torch.cat([x, s, torch.nn.functional.one_hot(source, 2).float()], dim=1)
        return gaussian_velocity(x, s, torch.zeros(2), 1.0) + self.net(features)


def euler(velocity, z):
    x, sigmas = z, torch.linspace(1.0, 0.0, TOY_STEPS + 1)
    states = [x]
    for k in range(TOY_STEPS):
        x = x + (sigmas[k + 1] - sigmas[k]) * velocity(x, sigmas[k])
        states.append(x)
    return torch.stack(states, dim=1), sigmas


def toy_opd(algorithm, seed: int, epochs: int = 150, n: int = 32) -> dict[str, float]:
    """The student trained by ``algorithm``'s micro-batches and loss on its own rollouts of datasets A and B;
    returns, per teacher, how far its dataset's samples' mean ends from the teacher's (same noise, same steps)."""
    torch.manual_seed(seed)
    student, g = ToyStudent(), torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(student.parameters(), lr=3e-3)
    source = torch.arange(2).repeat_interleave(n)

    class Policy:
        def velocity(self, x, sigma, cond, guidance_scale=None):
            return student(x, sigma, cond["source"])

        def teacher_velocity(self, teacher, x, sigma, cond, guidance_scale):
            return gaussian_velocity(x, sigma, TOY_MEANS[teacher], TOY_STD)

    for _ in range(epochs):
        with torch.no_grad():
            states, sigmas = euler(lambda x, s: student(x, s, source), torch.randn(2 * n, 2, generator=g))
        rollouts = SimpleNamespace(sigmas=sigmas, cond={"source": source}, group_ids=torch.arange(2 * n),
                                   datasets=["A"] * n + ["B"] * n, latents_at=lambda idx, k: states[idx, k])
        batches = list(algorithm.micro_batches(rollouts, torch.zeros(2 * n), torch.arange(2 * n)[:, None], g))
        loss = sum(algorithm.loss(Policy(), batch)[0] for batch in batches) / len(batches)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    z = torch.randn(2 * n, 2, generator=g)
    with torch.no_grad():
        final = euler(lambda x, s: student(x, s, source), z)[0][:, -1]
    gaps = {}
    for k, (name, mean) in enumerate(TOY_MEANS.items()):
        teacher = euler(lambda x, s: gaussian_velocity(x, s, mean, TOY_STD), z[source == k])[0][:, -1]
        gaps[name] = float((final[source == k].mean(0) - teacher.mean(0)).norm())
    return gaps


def test_a_toy_students_samples_of_each_dataset_move_to_its_teachers_distribution(tmp_path, tiny_sd3_path):
    """Two datasets, two Gaussian teachers 2.0 and 2.5 away from the base (N(0, I)); after 150 epochs of 6-step ODE
    rollouts, every step distilled, the student's samples of each dataset have the mean of its teacher's 6-step
    samples within 0.1 (same noise; measured 0.005 to 0.05), over 3 seeds; with the teachers swapped in the
    routing the student learns the other one. (Upstream's default timestep_range 0.99 leaves the last of the 6
    steps undistilled: 0.10 to 0.16 after 150 epochs, 0.04 to 0.11 after 300.)"""
    cfg = parse_config(opd_train_config(tmp_path, tiny_sd3_path, timestep_range=1.0)).train
    for seed in range(3):
        gaps = toy_opd(make_algorithm("diffusion-opd", cfg, ODE()), seed)
        assert max(gaps.values()) < 0.1, (seed, gaps)
    swapped = copy.deepcopy(cfg)
    swapped.teachers[0].applicable_datasets, swapped.teachers[1].applicable_datasets = ["B"], ["A"]
    gaps = toy_opd(make_algorithm("diffusion-opd", swapped, ODE()), 0)
    assert min(gaps.values()) > 2.0, gaps


# ---------------------------------------------------------------------------------------------- ff-train, tiny SD3
def save_teacher(model, folder: Path, rank: int, seed: int, model_type: str = "sd3-5") -> Path:
    """A random LoRA of the tiny model (its own rank and alpha), saved as ff-train saves one."""
    from flow_factory.models import get_adapter_class, load_adapter
    from flow_factory.models.lora import apply_lora, save_lora

    adapter = load_adapter(model_type, model)
    apply_lora(adapter.transformer, rank, 2.0 * rank, "default", adapter.default_lora_targets)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in adapter.transformer.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return save_lora(get_adapter_class(model_type).pipeline_class, adapter.transformer, folder)


def test_each_teacher_runs_as_its_lora_file_makes_it_beside_the_student(tmp_path, tiny_sd3_path):
    """The teachers loaded beside the student's adapter: each, running, is the base plus its own LoRA (as a
    transformer with that LoRA alone computes it), frozen; the student runs outside and keeps its gradients."""
    from flow_factory.models import load_adapter
    from flow_factory.models.lora import LORA_WEIGHT_NAME, make_trainable
    from flow_factory.trainer.roles import Roles

    folders = {"ta": save_teacher(tiny_sd3_path, tmp_path / "ta", 2, 1),
               "tb": save_teacher(tiny_sd3_path, tmp_path / "tb", 4, 2)}
    cfg = parse_config(opd_train_config(tmp_path, tiny_sd3_path))
    adapter = load_adapter("sd3-5", tiny_sd3_path)
    make_trainable(adapter, cfg, torch.float32)
    roles = Roles.of(cfg, adapter, torch.float32)
    x = adapter.initial_noise(1, 64, 64, torch.Generator().manual_seed(1))
    cond = adapter.encode(["a red circle"], None, 1.0)

    def velocity(a):
        with torch.no_grad():
            return a.velocity(x, torch.tensor(0.6), cond, 1.0)

    student = velocity(adapter)
    for name, folder in folders.items():
        alone = load_adapter("sd3-5", tiny_sd3_path)  # the user's call: a transformer with that LoRA alone
        alone.transformer.load_lora_adapter(str(folder), weight_name=LORA_WEIGHT_NAME, prefix="transformer")
        with roles.teachers.running(name):
            torch.testing.assert_close(velocity(adapter), velocity(alone), rtol=0, atol=1e-6)
        assert (velocity(alone) - student).abs().max() > 1e-3
    torch.testing.assert_close(velocity(adapter), student, rtol=0, atol=0)  # the student again, untouched
    teacher_params = [p for n, p in adapter.transformer.named_parameters() if "opd_teacher" in n]
    assert teacher_params and not any(p.requires_grad for p in teacher_params)
    assert all(p.requires_grad for p in roles.params["generator"])
    # DeepSpeed's engine casts the network it wraps to bf16, teachers and all: they go back as they loaded
    loaded = {n: p.detach().clone() for n, p in adapter.transformer.named_parameters() if "opd_teacher" in n}
    adapter.transformer.to(torch.bfloat16)
    assert roles.teachers.keep_as_loaded() == len(loaded)
    for name, p in adapter.transformer.named_parameters():
        if name in loaded:
            assert p.dtype == torch.float32 and torch.equal(p, loaded[name]) and not p.requires_grad, name


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_pipeline):
    """Two epochs over datasets A and B, teachers ta (rank 2, guidance 2) and tb (rank 4), saving each epoch; and a
    run resumed from the first epoch's checkpoint."""
    model, tmp = tiny_pipeline("sd3-5"), tmp_path_factory.mktemp("opd")
    save_teacher(model, tmp / "ta", 2, 1)
    save_teacher(model, tmp / "tb", 4, 2)
    config = opd_train_config(tmp, model, max_epochs=2, num_inference_steps=3, unique_sample_num_per_epoch=2,
                              per_device_batch_size=2, learning_rate=1e-3, ema_decay=0)
    config["eval"]["eval_freq"] = 0
    config["log"] |= {"logging_backend": "none", "save_freq": 1}
    assert main([str(write_config(tmp, config))]) == 0
    straight = tmp / "saves" / "run" / "checkpoints"
    config["log"]["run_name"], config["model"]["resume_path"] = "resumed", str(straight / "epoch_1")
    assert main([str(write_config(tmp, config, "resumed.yaml"))]) == 0
    return model, straight / "epoch_2", tmp / "saves" / "resumed" / "checkpoints" / "epoch_2"


def test_ff_train_distils_both_teachers_and_a_resumed_run_ends_exactly_as_the_straight_one(runs):
    _, straight, resumed = runs
    for name in ("pytorch_lora_weights.safetensors", "optimizer.pt"):
        a = load_file(straight / name) if name.endswith("safetensors") else torch.load(straight / name, weights_only=True)
        b = load_file(resumed / name) if name.endswith("safetensors") else torch.load(resumed / name, weights_only=True)
        assert_same_state(a, b)
    state = json.loads((straight / "trainer_state.json").read_text())
    assert state["global_step"] == 2  # one optimizer step an epoch, over both of its distilled steps
    for record in state["history"]:  # one sample of each dataset an epoch (weights 1:1), each by its teacher
        assert record["train/skipped_updates"] == 0
        for key in ("train/distill_loss_ta", "train/distill_loss_tb", "train/grad_norm"):
            assert 0 < record[key] < float("inf"), key
    saved = load_file(straight / "pytorch_lora_weights.safetensors")
    assert not any("opd_teacher" in k for k in saved)  # the student's LoRA alone
    assert max(float(v.abs().max()) for k, v in saved.items() if "lora_B" in k) > 0  # it trained


def test_the_student_loads_in_plain_diffusers(runs):
    from diffusers import StableDiffusion3Pipeline
    from peft.utils import get_peft_model_state_dict

    model, straight, _ = runs
    pipe = StableDiffusion3Pipeline.from_pretrained(model)
    pipe.load_lora_weights(straight)  # the user's call
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=pipe.transformer.active_adapters()[0])
    saved = load_file(straight / "pytorch_lora_weights.safetensors")
    assert_same_state({k: v.float() for k, v in loaded.items()}, {k.removeprefix("transformer."): v for k, v in saved.items()})
    assert pipe.transformer.peft_config[pipe.transformer.active_adapters()[0]].r == 4  # the student's rank


def test_upstreams_example_layout_reads_as_ours(tmp_path):
    """Flow-Factory's examples/opd layout (X-GenGroup/Flow-Factory 5f6cda1): its one ``optimizers`` entry (name
    default) is the train keys, ``teacher_param_device: cuda`` is accepted, the teachers' hub paths are kept for
    the start checks; its evaluation-only datasets (``train: null``) read as ours (``train: false``) with their own
    eval guidance, no teacher routed to them; a teacher device of cpu is refused."""
    from flow_factory.config import load_config

    datasets = [{"name": n, "dataset_dir": str(write_dataset(tmp_path / n)), "train": {"weight": 1},
                 "eval": {"num_inference_steps": 40, "guidance_scale": 4.5}} for n in ("pickscore", "ocr")]
    raw = {"config_file": "multi_gpu", "num_processes": 1, "mixed_precision": "bf16",
           "data": {"datasets": datasets},
           "model": {"finetune_type": "lora", "lora_rank": 32, "lora_alpha": 64, "model_type": "sd3-5",
                     "model_name_or_path": "stabilityai/stable-diffusion-3.5-medium"},
           "train": {"trainer_type": "diffusion-opd", "teacher_param_device": "cuda", "resolution": 512,
                     "num_inference_steps": 10, "guidance_scale": 4.5, "timestep_range": 0.99,
                     "loss_target": "xt", "self_normalize": False, "per_device_batch_size": 3, "group_size": 1,
                     "unique_sample_num_per_epoch": 6, "gradient_step_per_epoch": 1,
                     "teachers": [{"name": "aes-teacher", "path": "quanhaol/DiffusionOPD/AesTeacher/lora",
                                   "applicable_datasets": ["pickscore"], "guidance_scale": 4.5},
                                  {"name": "ocr-teacher", "path": "quanhaol/DiffusionOPD/OCRTeacher/lora",
                                   "applicable_datasets": ["ocr"], "guidance_scale": 1.0}]},
           "scheduler": {"dynamics_type": "ODE", "noise_level": 0.0},
           "optimizers": [{"name": "default", "learning_rate": 3.0e-4, "weight_decay": 1.0e-4,
                           "betas": [0.9, 0.999], "eps": 1.0e-8, "max_grad_norm": 1.0}]}
    raw["data"]["datasets"].append({"name": "ocr_no-cfg", "dataset_dir": datasets[1]["dataset_dir"], "train": None,
                                    "eval": {"num_inference_steps": 40, "guidance_scale": 1.0}})
    raw["eval_rewards"] = [{"name": "jpeg", "reward_model": "jpeg_compressibility"}]  # scores every eval dataset
    cfg = load_config(write_config(tmp_path, raw))
    assert cfg.train.learning_rate == 3e-4 and cfg.gradient_accumulation == 2 * 9  # 2 batches x 9 distilled steps
    no_cfg = cfg.data.sources[2]
    assert (no_cfg.train, no_cfg.eval_guidance_scale, [s.name for s in cfg.data.split_sources("train")]) == (
        False, 1.0, ["pickscore", "ocr"])
    assert [t.name for t in cfg.train.teachers] == ["aes-teacher", "ocr-teacher"]
    assert cfg.train.conditioning_guidance_scale == 4.5
    one = copy.deepcopy(raw)  # one dataset (read as data.dataset_dir), its one teacher routed to it by name
    one["data"]["datasets"], one["train"]["teachers"] = datasets[:1], raw["train"]["teachers"][:1]
    one["train"]["unique_sample_num_per_epoch"] = 3
    assert load_config(write_config(tmp_path, one, "one.yaml")).train.teachers[0].applicable_datasets == []
    for change, message in (
            (lambda r: r["train"].update(teacher_param_device="cpu"), "train.teacher_param_device: 'cpu'; only cuda"),
            (lambda r: r["train"]["teachers"][1]["applicable_datasets"].append("ocr_no-cfg"),
             "train.teachers[1].applicable_datasets: 'ocr_no-cfg' is evaluation-only (train: false)")):
        bad = copy.deepcopy(raw)
        change(bad)
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(write_config(tmp_path, bad, "bad.yaml"))


def test_the_plan_holds_one_distilled_steps_graph_at_a_time(tmp_path, tiny_sd3_path):
    """``ff-train --plan``'s record of an optimizer step: per distilled step, the student's call with gradients and
    one call per teacher of the chunk's datasets at its guidance; each step's backward ends its graph, so the pass
    holds one step's at a time (summing both steps' made the SD3.5 example's plan 122.6 GiB of activations where
    one step holds 13.7)."""
    from flow_factory.plan.measure import Measured
    from flow_factory.plan.roles import RolePhases, recorded_phases

    cfg = parse_config(opd_train_config(tmp_path, tiny_sd3_path))  # 3 steps: 2 distilled; a chunk of A and B
    (role, passes, calls), = recorded_phases(cfg)
    assert (role, passes) == ("generator", 1)
    assert [(c.batch, c.grad, c.rows, c.guidance) for c in calls] == [
        (0, True, 2, 1.0), (0, False, 1, 2.0), (0, False, 1, 1.0), (1, True, 2, 1.0), (1, False, 1, 2.0),
        (1, False, 1, 1.0)]
    phases = RolePhases([(role, passes, [(c, Measured(1, 10 if c.grad else 3)) for c in calls])])
    assert phases.peak("generator") == 13


def test_ff_eval_of_a_run_without_rewards_says_so(tmp_path, tiny_sd3_path, capsys):
    """A distillation run may name no reward: ff-eval of its config ends in one line saying what to add (it
    crashed formatting an empty table)."""
    from flow_factory.evaluate import main as ff_eval

    config = opd_train_config(tmp_path, tiny_sd3_path)
    assert ff_eval([str(write_config(tmp_path, config))]) == 2
    assert "names no eval_rewards (nor rewards): nothing to score the samples with" in capsys.readouterr().err


def test_a_teachers_lora_is_checked_before_anything_loads(tmp_path, tiny_sd3_path):
    """A local teacher path without its LoRA file is a config error naming the key before the model loads
    (``check_before_loading``, the Trainer's first step); a hub one is a model the start checks look for (its
    repo, cached or on a reachable hub), named by its key."""
    from flow_factory.models.preflight import check_before_loading
    from flow_factory.start_checks import reward_needs

    save_teacher(tiny_sd3_path, tmp_path / "ta", 2, 1)
    (tmp_path / "tb").mkdir()  # a folder without pytorch_lora_weights.safetensors
    config = opd_train_config(tmp_path, tiny_sd3_path)
    with pytest.raises(ConfigError, match=re.escape(f"train.teachers[1].path: {tmp_path / 'tb'}: no "
                                                    "pytorch_lora_weights.safetensors in the folder")):
        check_before_loading(parse_config(config))
    config["train"]["teachers"][1]["path"] = str(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match=re.escape("train.teachers[1].path: ") + ".*no such file or folder"):
        check_before_loading(parse_config(config))
    config["train"]["teachers"][1]["path"] = "quanhaol/DiffusionOPD/OCRTeacher/lora"
    cfg = parse_config(config)
    check_before_loading(cfg)  # a hub id: not this check's
    assert ("quanhaol/DiffusionOPD", "train.teachers[1].path") in reward_needs(cfg)[0]


def test_the_accumulation_counts_the_rollouts_own_steps(tmp_path):
    """Video-to-video rolls out the last ``strength`` part of ``num_inference_steps`` (5 of 10 at 0.5): the config's
    micro-steps per sample are the algorithm's over those 5 (diffusion-opd distils int(5 x 0.99) = 4, tdm all 5),
    not over 10, so the optimizer steps where ``gradient_step_per_epoch`` says."""
    for trainer, expected in (("diffusion-opd", 4), ("tdm", 5)):
        config = tiny_run_config(tmp_path / trainer, "wan2_v2v", tmp_path / "no-model", trainer_type=trainer,
                                 num_inference_steps=10, strength=0.5, group_size=1)
        del config["rewards"]
        config["scheduler"] = {"dynamics_type": "ODE"}
        config["train"]["teachers"] = [{"path": str(tmp_path / "t")}] if trainer == "diffusion-opd" else []
        cfg = parse_config(config)
        algorithm = make_algorithm(trainer, cfg.train, ODE())
        rollouts = SimpleNamespace(sigmas=torch.linspace(1.0, 0.0, cfg.rollout_steps + 1))
        assert cfg.rollout_steps == 5
        assert cfg.trained_steps_per_sample == algorithm.micro_steps_per_chunk(rollouts) == expected
