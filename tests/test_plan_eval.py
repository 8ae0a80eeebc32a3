"""ff-train --plan counts the evaluation (plan/evaluation.py): its calls at each dataset's eval size against the
real eval on tiny SD3, its memory as a phase of its own, its FLOPs amortised over eval_freq epochs."""

import torch
from torch.utils.flop_counter import FlopCounterMode

from flow_factory.config import parse_config
from flow_factory.data import load_sources
from flow_factory.models import load_adapter
from flow_factory.models.conditioning import cat_cond
from flow_factory.models.lora import make_trainable
from flow_factory.plan import make_plan
from flow_factory.plan.report import as_json, as_text
from flow_factory.eval_sampling import eval_items, eval_parts, eval_sizes, sample_eval

from helpers_runs import TEST_PROMPTS, tiny_run_config


def two_sizes_config(tmp_path, tiny_sd3_path, **large) -> dict:
    """A tiny SD3 run trained at 64 x 64 whose dataset 'square' is evaluated at the eval section's 64 x 64 with
    CFG (3.0, 3 steps), and its evaluation-only copy 'large' at its own ``large`` settings."""
    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path)
    folder = config["data"].pop("dataset_dir")
    config["data"]["datasets"] = [{"name": "square", "dataset_dir": folder},
                                  {"name": "large", "dataset_dir": folder, "train": False, **large}]
    config["eval"].update(num_inference_steps=3, guidance_scale=3.0)
    return config


class Encoded:
    """A prompt cache holding every prompt's conditioning, encoded before: the eval's FLOPs are then its
    transformer calls' and decodes' alone (``sampling._conditioning`` asks ``lookup``)."""

    def __init__(self, adapter, prompts: list[str]):
        self.cond = {(p, cfg): adapter.encode([p], None, 3.0 if cfg else 1.0) for p in prompts for cfg in (0, 1)}

    def lookup(self, pairs, cfg: bool, device):
        return cat_cond([self.cond[(prompt, int(cfg))] for prompt, _ in pairs])


def test_the_evals_calls_count_what_the_real_eval_sampling_counts(tmp_path, tiny_sd3_path):
    """Each eval part's planned call (the 'large' dataset at 128 x 64 without CFG, 2 steps; 'square' at 64 x 64
    with CFG, 3 steps) counts the FLOPs FlopCounterMode counts on the real call at that size, and the whole eval
    (one process: every test prompt) what it counts on the real eval of the test prompts (LoRA's matmuls too)."""
    cfg = parse_config(two_sizes_config(tmp_path, tiny_sd3_path, eval_resolution=[128, 64],
                                        eval_num_inference_steps=2, eval_guidance_scale=1.0))
    plan = make_plan(cfg, device="cpu", num_processes=1)
    real = load_adapter("sd3-5", tiny_sd3_path)
    make_trainable(real, cfg, torch.float32)  # the eval samples the policy: the base with its LoRA adapters
    parts = {p.dataset: p for p in plan.evaluation.parts}
    assert {name: (p.call.height, p.call.width, p.steps, p.call.guidance, p.prompts) for name, p in parts.items()} \
        == {"square": (64, 64, 3, 3.0, len(TEST_PROMPTS)), "large": (128, 64, 2, 1.0, len(TEST_PROMPTS))}
    for part in parts.values():
        at = part.call
        cond = real.encode(TEST_PROMPTS[:1] * at.rows, None, at.guidance)
        latents = real.initial_noise(at.rows, at.height, at.width)
        with torch.no_grad(), FlopCounterMode(display=False) as call:
            real.velocity(latents, torch.ones(at.rows), cond, at.guidance)
        with torch.no_grad(), FlopCounterMode(display=False) as decode:
            real.decode(latents)
        assert plan.calls[at.key].flops == call.get_total_flops() > 0, at.key
        assert plan.calls[at.decode_key].flops == decode.get_total_flops() > 0, at.decode_key

    items = eval_items(load_sources(cfg.data.split_sources("test"), "test"), cfg.eval.num_samples)
    cache = Encoded(real, TEST_PROMPTS)
    with FlopCounterMode(display=False) as whole:
        sample_eval(real, items, eval_parts(cfg, items, eval_sizes(cfg, items, type(real))), lambda n: slice(0, n),
                    prompt_cache=cache)
    assert plan.eval_flops == whole.get_total_flops() > 0
    assert plan.flops["eval"] == plan.eval_flops / cfg.eval.eval_freq


def test_a_dataset_evaluated_at_twice_the_training_size_makes_the_eval_the_peak(tmp_path, tiny_sd3_path):
    """Trained and evaluated at 64 x 64, the run's peak is training's; with its dataset evaluated at 128 x 128 the
    eval's phase (what stays on the device, the eval's largest call or decode) is the peak, and the report and the
    JSON name it."""
    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path)
    folder = config["data"].pop("dataset_dir")
    config["data"]["datasets"] = [{"name": "square", "dataset_dir": folder}]
    same = make_plan(parse_config(config), device="cpu")
    config["data"]["datasets"][0]["eval_resolution"] = 128
    large = make_plan(parse_config(config), device="cpu")

    assert same.peak()[0] != "eval"
    eval_phase = large.memory()["eval"]
    calls = [large.calls[key] for p in large.evaluation.parts for key in (p.call.key, p.call.decode_key)]
    kept = {part: size for part, size in large.memory()["rollout"].items()
            if part not in ("trajectories", "sampling / decoding activations")}
    assert eval_phase == {**kept, "eval call / decode activations": max(c.peak for c in calls)}  # no rollouts
    assert large.peak() == ("eval", sum(eval_phase.values())) and large.peak()[1] > same.peak()[1]
    assert {p: same.memory()[p] for p in ("prompt cache", "training")} == \
        {p: large.memory()[p] for p in ("prompt cache", "training")}
    text = as_text(large, [], large)
    assert "multi_gpu, eval (the peak), GiB per GPU:" in text
    assert "eval every 2 epochs (square: 128x128, 3 steps, guidance 3, 2 a call, 2 prompts per GPU)" in text
    assert "(the peak)" in next(line for line in text.splitlines() if line.startswith("eval every"))
    out = as_json(large, [], large)
    assert out["peak_phase"] == "eval" and out["eval"]["bytes"]["multi_gpu"] == large.peak()[1]


def test_eval_freq_0_counts_no_eval(tmp_path, tiny_sd3_path):
    """eval.eval_freq 0: no eval call measured, no eval phase, no eval FLOPs; the other phases as with an eval."""
    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path)
    evaluated = make_plan(parse_config(config), device="cpu")
    config["eval"]["eval_freq"] = 0
    plan = make_plan(parse_config(config), device="cpu")
    assert evaluated.evaluation is not None and evaluated.flops["eval"] > 0
    assert plan.evaluation is None and plan.eval_flops == 0 and "eval" not in plan.flops
    assert not any(key.startswith("eval") for key in plan.calls)
    assert "eval" not in plan.memory() and plan.memory() == {
        phase: parts for phase, parts in evaluated.memory().items() if phase != "eval"}
    assert as_json(plan, [], plan)["eval"] is None
    assert "eval: none" in as_text(plan, [], plan)


def test_a_change_that_fits_training_but_leaves_the_eval_over_is_no_fit(tmp_path, tiny_sd3_path, monkeypatch):
    """A GPU on which keeping the rollouts in CPU memory fits every phase but the eval (a dataset evaluated at 4x
    the training size): that change alone is not reported as fitting; the one reported fits the eval too."""
    from flow_factory.plan import gpus, memory
    from flow_factory.plan.report import plan_for_cli

    from helpers_runs import write_config

    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path, per_device_batch_size=4, group_size=4,
                             unique_sample_num_per_epoch=4)
    folder = config["data"].pop("dataset_dir")
    config["data"]["datasets"] = [{"name": "square", "dataset_dir": folder, "eval_resolution": 256}]
    config["eval"]["per_device_batch_size"] = 4
    path = write_config(tmp_path, config)
    offload = "train.offload_samples_to_cpu=true"
    offloaded = make_plan(parse_config({**config, "train": {**config["train"], "offload_samples_to_cpu": True}}))
    phases = {phase: sum(parts.values()) for phase, parts in offloaded.memory().items()}
    others = max(size for phase, size in phases.items() if phase != "eval")
    assert phases["eval"] > others
    monkeypatch.setattr(memory, "RESERVE", 0)
    monkeypatch.setitem(gpus.GPUS, "small", gpus.GPU("small GPU", (others + phases["eval"]) // 2,
                                                     gpus.GPUS[offloaded.gpu].bf16_flops))
    plan, changes, fitted = plan_for_cli(str(path), [], "small", None, 0.4)
    assert not plan.fits() and changes != [offload]
    assert fitted is not None and fitted.fits() and sum(fitted.memory()["eval"].values()) <= fitted.usable
    assert any(c.startswith("eval.per_device_batch_size=") for c in changes), changes


def test_the_trainer_evaluates_without_the_last_epochs_rollouts(tmp_path, tiny_sd3_path, monkeypatch):
    """What the plan's eval phase leaves out is gone in the run: when the trainer evaluates (before epochs 0 and 1,
    and the final weights), no epoch's rollouts are alive any more."""
    import gc
    import weakref

    from flow_factory.trainer import Trainer

    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path, max_epochs=2)
    config["eval"]["eval_freq"] = 1
    config["log"].update(save_freq=0, logging_backend="none")
    trainer = Trainer(parse_config(config))
    epochs, alive = [], []
    sample, evaluate = trainer.sample_epoch, trainer.evaluate

    def sampled(epoch):
        rollouts = sample(epoch)
        epochs.append(weakref.ref(rollouts))
        return rollouts

    def evaluating(epoch):
        gc.collect()
        alive.append([ref() is not None for ref in epochs])
        return evaluate(epoch)
    monkeypatch.setattr(trainer, "sample_epoch", sampled)
    monkeypatch.setattr(trainer, "evaluate", evaluating)
    trainer.train()
    assert alive == [[], [False], [False, False]]
