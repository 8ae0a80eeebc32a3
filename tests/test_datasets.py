"""Several datasets in one run (``data.datasets``, Flow-Factory's weighted multi-source data): each epoch's
groups drawn from each dataset in proportion to its weight (exactly, when the weights divide the epoch;
in the long run otherwise, within a stated tolerance), every group from one dataset, each dataset's rewards
logged apart, and the same update on one process and on two."""

import json
import math
import os
import re

import pytest
import torch
from helpers_launch import ff_train_forked
from helpers_runs import ff_train_in_this_process, tiny_run_config, write_config
from safetensors.torch import load_file
from test_config import minimal
from test_train_cli import EPOCHS, LINEAR_STEP, TOLERANCE, _difference_over_movement, _free_port

from flow_factory.advantages import combine_advantages
from flow_factory.config import ConfigError, parse_config
from flow_factory.data import WeightedEpochSampler
from flow_factory.rewards import PointwiseRewardModel, RewardModelOutput
from flow_factory.rewards.reward_set import RewardSet
from flow_factory.start_checks import check_prompt_counts


def _counts(sampler, epoch):
    indices, groups = sampler.draw(epoch)
    per_group = indices.reshape(-1, sampler.group_size)
    assert (per_group == per_group[:, :1]).all()  # a group is one prompt, so one dataset
    source = torch.bucketize(per_group[:, 0].contiguous(), torch.tensor(sampler.offsets[1:]), right=True)
    return torch.bincount(source, minlength=len(sampler.sizes)).tolist()


def test_weights_that_divide_the_epoch_give_exactly_their_share_every_epoch():
    sampler = WeightedEpochSampler([5, 9], [1, 3], unique_per_epoch=8, group_size=2, seed=3)
    assert all(_counts(sampler, epoch) == [2, 6] for epoch in range(50))
    assert torch.equal(sampler.draw(7).prompt_indices, sampler.draw(7).prompt_indices)  # (seed, epoch) alone
    assert not torch.equal(sampler.draw(7).prompt_indices, sampler.draw(8).prompt_indices)


def test_weights_that_do_not_divide_the_epoch_reach_their_share_in_the_long_run():
    """Weights 1 : 2 over 4 prompts an epoch: the first dataset's expected count is 4/3, so each epoch gives
    it 1 or 2 (2 with probability 1/3, variance 2/9). Over 3000 epochs its mean count has standard deviation
    sqrt(2/9 / 3000) = 0.0086: allowed 5 of them."""
    sampler = WeightedEpochSampler([6, 6], [1, 2], unique_per_epoch=4, group_size=1, seed=0)
    counts = torch.tensor([_counts(sampler, epoch) for epoch in range(3000)], dtype=torch.float64)
    assert set(counts[:, 0].tolist()) == {1.0, 2.0} and (counts.sum(dim=1) == 4).all()
    assert abs(counts[:, 0].mean().item() - 4 / 3) < 5 * math.sqrt(2 / 9 / 3000)


def test_a_dataset_with_too_few_prompts_for_its_weight_is_named():
    with pytest.raises(ValueError, match=r"too few prompts for their weight: b \(2 prompts, up to 3 an epoch\)"):
        WeightedEpochSampler([10, 2], [1, 3], unique_per_epoch=4, group_size=2, names=["a", "b"])


def _datasets(folder, sizes=(4, 4)):
    out = []
    for name, n in zip("ab", sizes):
        (folder / name).mkdir(parents=True, exist_ok=True)
        (folder / name / "train.txt").write_text("".join(f"a {name} thing number {i}\n" for i in range(n)))
        (folder / name / "test.txt").write_text(f"a {name} test\n")
        out.append({"name": name, "dataset_dir": str(folder / name)})
    return out


def test_flow_factorys_layout_reads_as_ours_and_the_start_check_counts_each_dataset(tmp_path):
    upstream = minimal()
    upstream["data"] = {"datasets": [
        {"name": "a", "dataset_dir": str(tmp_path / "a"), "train": {"weight": 1, "max_dataset_size": 3},
         "eval": {"max_dataset_size": 1, "guidance_scale": 3.0}},
        {"name": "b", "dataset_dir": str(tmp_path / "b"), "train": {"weight": 3}, "eval": {"guidance_scale": 3.0}}]}
    cfg = parse_config(upstream)
    a, b = cfg.data.sources
    assert (a.name, a.weight, a.max_dataset_size, a.eval_max_dataset_size, b.weight) == ("a", 1, 3, 1, 3)
    assert a.eval_guidance_scale == b.eval_guidance_scale == 3.0 and a.train and a.eval
    _datasets(tmp_path, sizes=(3, 2))
    with pytest.raises(ConfigError, match=r"train.unique_sample_num_per_epoch: 4 distinct prompts an epoch, shared "
                                          r"by data.datasets' weights; too few prompts for their weight: b \(2 "
                                          r"prompts, up to 3 an epoch\)"):
        check_prompt_counts(cfg)


class PromptLength(PointwiseRewardModel):
    """The prompt's length; remembers every prompt it scored."""

    def __init__(self):
        super().__init__(batch_size=2)
        self.seen = []

    def __call__(self, prompt=None, image=None, video=None, condition_images=None, condition_videos=None):
        self.seen += list(prompt)
        return RewardModelOutput(rewards=torch.tensor([float(len(p)) for p in prompt]))


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_routed_reward_scores_its_datasets_samples_only(asynchronous):
    """Flow-Factory's routing: applicable_datasets, or a weight per dataset (a dataset left out is not scored).
    The samples a reward does not score get NaN, and it weighs 0 there."""
    only_a, weighted = PromptLength(), PromptLength()
    rewards = RewardSet({"only_a": only_a, "weighted": weighted}, {"only_a": 1.0, "weighted": {"a": 0.5, "c": 2.0}},
                        {"only_a": 1, "weighted": 1} if asynchronous else None, {"only_a": ["a"], "weighted": None})
    datasets = ["a", "a", "b", "b", "c", "c"]
    job = rewards.start(torch.tensor([0, 0, 1, 1, 2, 2]), datasets)
    prompts = ["a1", "a22", "b333", "b4444", "c55555", "c666666"]
    for start in (0, 3):
        job.add(prompts[start:start + 3])
    scores = job.finish()
    rewards.close()
    assert sorted(only_a.seen) == ["a1", "a22"] and sorted(weighted.seen) == ["a1", "a22", "c55555", "c666666"]
    nan = float("nan")
    torch.testing.assert_close(scores["only_a"], torch.tensor([2.0, 3.0, nan, nan, nan, nan]), equal_nan=True)
    torch.testing.assert_close(scores["weighted"], torch.tensor([2.0, 3.0, nan, nan, 6.0, 7.0]), equal_nan=True)
    weights = rewards.sample_weights(datasets)
    assert weights["only_a"].tolist() == [1, 1, 0, 0, 0, 0] and weights["weighted"].tolist() == [.5, .5, 0, 0, 2, 2]


def test_routed_weights_combine_per_sample_and_a_reward_that_did_not_score_counts_zero():
    """Groups {0,1} of dataset a, {2,3} of b: reward x scores a only, y both (weight 0.5 on a, 1 on b). Summed:
    a's totals x + 0.5 y, b's y alone; each group's advantage is its totals' (t - mean) / (std + eps)."""
    nan, eps = float("nan"), 1e-4
    x, y = torch.tensor([1.0, 3.0, nan, nan]), torch.tensor([2.0, 6.0, 5.0, 1.0])
    weights = {"x": torch.tensor([1.0, 1.0, 0.0, 0.0]), "y": torch.tensor([0.5, 0.5, 1.0, 1.0])}
    adv = combine_advantages({"x": x, "y": y}, weights, torch.tensor([0, 0, 1, 1]), "sum")
    # a: totals 2 and 6 (mean 4, std 2); b: 5 and 1 (mean 3, std 2)
    expected = torch.tensor([-2 / (2 + eps), 2 / (2 + eps), 2 / (2 + eps), -2 / (2 + eps)])
    torch.testing.assert_close(adv, expected)
    gdpo = combine_advantages({"x": x, "y": y}, weights, torch.tensor([0, 0, 1, 1]), "gdpo")
    assert torch.isfinite(gdpo).all()


def test_routing_names_datasets_of_the_run():
    config = minimal(rewards=[{"reward_model": "PickScore", "weight": {"a": 1.0}}])
    with pytest.raises(ConfigError, match=r"rewards\[0\].weight: routes a reward to datasets, but the run reads one"):
        parse_config(config)
    config["data"] = {"datasets": [{"name": "a", "dataset_dir": "x"}, {"name": "b", "dataset_dir": "y"}]}
    config["rewards"][0]["applicable_datasets"] = ["a", "z"]
    with pytest.raises(ConfigError, match=r"rewards\[0\].applicable_datasets: \['z'\] are not datasets of the run; "
                                          r"data.datasets names \['a', 'b'\]"):
        parse_config(config)


def _run_config(tmp_path, tiny_sd3_path):
    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path, group_size=4, max_epochs=EPOCHS, **LINEAR_STEP)
    config["data"] = {"datasets": _datasets(tmp_path / "data"), "cache_dir": str(tmp_path / "cache")}
    # brightness weighs 1 on a, 0.5 on b; jpeg scores a's samples only
    config["rewards"] = [{"name": "brightness", "reward_model": "helpers_rewards.MeanBrightness",
                          "weight": {"a": 1.0, "b": 0.5}},
                         {"name": "jpeg", "reward_model": "jpeg_compressibility", "applicable_datasets": ["a"]}]
    config["eval"]["eval_freq"] = 1
    return config


def test_each_dataset_is_logged_apart_and_two_processes_make_one_processs_update(tmp_path, tiny_sd3_path):
    """Two datasets of weight 1 and two prompts an epoch: one group of each every epoch, its rewards under
    source/<name>/ in the history, each dataset's test prompt scored under eval/source/<name>/; one reward
    weighted per dataset, one scoring a's samples only."""
    one, two = tmp_path / "one", tmp_path / "two"
    for folder, processes in ((one, 1), (two, 2)):
        argv = [str(write_config(folder, _run_config(folder, tiny_sd3_path))), "--num_processes", str(processes),
                "--main_process_port", str(_free_port())]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        (out, err), code = ff_train_in_this_process(argv) if processes == 1 else ff_train_forked(argv, env)
        assert code == 0, err[-3000:]
    history = json.loads((one / "saves" / "run" / "history.json").read_text())
    for record in history["train"]:
        assert record["source/a/groups"] == record["source/b/groups"] == 1
        assert {"source/a/reward/brightness/mean", "source/b/reward/brightness/mean", "source/a/reward/jpeg/mean",
                "reward/jpeg/mean"} <= set(record)
        assert "source/b/reward/jpeg/mean" not in record and "reward/jpeg/nonfinite" not in record
    assert {"eval/source/a/reward/brightness", "eval/source/b/reward/brightness"} <= set(history["eval"][-1])
    assert all(math.isfinite(v) for v in history["eval"][-1].values())

    # ff-eval of the final weights: the routed jpeg reward summarised over a's test prompt alone, as the run's eval
    from flow_factory.evaluate import main as ff_eval

    out = tmp_path / "eval.json"
    config_path = str(one / "config.yaml")
    assert ff_eval([config_path, "--checkpoint", str(one / "saves" / "run" / "checkpoints" / f"epoch_{EPOCHS}"),
                    "--out", str(out)]) == 0
    evaluated = json.loads(out.read_text())
    assert evaluated["rewards"]["jpeg"]["n"] == 1 and math.isfinite(evaluated["rewards"]["jpeg"]["mean"])
    assert [("jpeg" in s) for s in evaluated["samples"]] == [True, False]  # a's test prompt, then b's

    def lora(folder):
        return load_file(folder / "saves" / "run" / "checkpoints" / f"epoch_{EPOCHS}" /
                         "pytorch_lora_weights.safetensors")
    relative, moved = _difference_over_movement(lora(one), lora(two))
    assert moved > 1e-4 and relative <= TOLERANCE, (relative, moved)


def _eval_only_config(tmp_path, **c_settings):
    """Datasets a and b train (weights 1 and 3), c is evaluation-only: its own test prompts, eval steps and
    guidance."""
    datasets = _datasets(tmp_path, sizes=(4, 6))
    datasets[1]["weight"] = 3
    (tmp_path / "c").mkdir(exist_ok=True)
    (tmp_path / "c" / "test.txt").write_text("a c test one\na c test two\n")
    (tmp_path / "c" / "train.txt").write_text("".join(f"a c thing number {i}\n" for i in range(8)))  # never drawn
    datasets.append({"name": "c", "dataset_dir": str(tmp_path / "c"), "train": False, **c_settings})
    config = minimal(eval={"num_inference_steps": 5, "guidance_scale": 4.5},
                     train={"per_device_batch_size": 2, "group_size": 2, "unique_sample_num_per_epoch": 4})
    config["data"] = {"datasets": datasets, "cache_dir": str(tmp_path / "cache")}
    return config


def test_an_evaluation_only_dataset_is_never_drawn_for_training_and_its_test_split_is_evaluated(tmp_path):
    """200 epochs' draws hold a's and b's prompts alone, 1 : 3 every epoch; c's test prompts are evaluated (and
    named apart in the eval metrics), and the training metrics name a and b only."""
    from flow_factory.models import get_adapter_class
    from flow_factory.trainer.run_data import load_run_data

    cfg = parse_config(_eval_only_config(tmp_path))
    data = load_run_data(cfg, get_adapter_class("sd3-5"), num_processes=1, seed=0)
    for epoch in range(200):
        drawn = [data.train_prompts[i].dataset for i in data.sampler.draw(epoch).prompt_indices[::2].tolist()]
        assert sorted(drawn) == ["a", "b", "b", "b"], (epoch, drawn)
    assert [it.dataset for it in data.test_prompts] == ["a", "b", "c", "c"]
    assert data.source_names == ["a", "b"] and data.eval_source_names == ["a", "b", "c"]
    config = _eval_only_config(tmp_path)
    config["data"]["datasets"][1]["eval"] = False  # b trains and is left out of the evaluation
    data = load_run_data(parse_config(config), get_adapter_class("sd3-5"), num_processes=1, seed=0)
    assert [it.dataset for it in data.test_prompts] == ["a", "c", "c"] and data.eval_source_names == ["a", "c"]
    assert data.source_names == ["a", "b"]


def test_each_dataset_is_evaluated_with_its_own_steps_and_guidance(tmp_path, monkeypatch):
    """c's test prompts are sampled at its eval_num_inference_steps and eval_guidance_scale, a's and b's at the
    eval section's; each sample keeps its index in the test prompts as its noise seed, so the scores come back in
    the test prompts' order; the prompt cache encodes c's prompts at c's guidance."""
    from flow_factory import eval_sampling, sampling
    from flow_factory.data import load_sources

    cfg = parse_config(_eval_only_config(tmp_path, eval_num_inference_steps=2, eval_guidance_scale=1.0))
    items = load_sources(cfg.data.split_sources("test"), "test")
    calls = []

    def sample_prompts(adapter, part, settings, sample_ids, **services):
        calls.append(([it.dataset for it in part], settings.num_steps, settings.guidance_scale, sample_ids))
        empty = torch.empty(0)
        return sampling.Rollouts(prompts=[it.prompt for it in part], group_ids=empty, latents=empty,
                                 log_probs=empty, sigmas=empty, sde_steps=[], cond={}, media=empty,
                                 rewards={"r": torch.tensor([float(i) for i in sample_ids])})
    monkeypatch.setattr(eval_sampling, "sample_prompts", sample_prompts)
    scores, _ = eval_sampling.sample_eval(None, items, eval_sampling.eval_parts(cfg, items), lambda n: slice(0, n))
    assert calls == [(["a", "b"], 5, 4.5, [0, 1]), (["c", "c"], 2, 1.0, [2, 3])]
    assert scores["r"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert [eval_sampling.eval_guidance(cfg, it.dataset) for it in items] == [4.5, 4.5, 1.0, 1.0]


def test_eval_num_samples_is_split_evenly_over_the_evaluated_datasets(tmp_path):
    """a, b and c hold 2, 2 and 4 test prompts (a's, b's, c's first ones): 3 evaluates one of each, 7 takes
    what a and b lack from c; one dataset's cap takes its first prompts, as before."""
    from flow_factory.data import load_sources
    from flow_factory.eval_sampling import eval_items

    config = _eval_only_config(tmp_path)
    (tmp_path / "c" / "test.txt").write_text("".join(f"c test {i}\n" for i in range(4)))
    config["data"]["datasets"][0]["eval_max_dataset_size"] = 2
    config["data"]["datasets"][1]["eval_max_dataset_size"] = 2
    (tmp_path / "a" / "test.txt").write_text("a one\na two\na three\n")
    (tmp_path / "b" / "test.txt").write_text("b one\nb two\n")
    cfg = parse_config(config)
    items = load_sources(cfg.data.split_sources("test"), "test")
    assert [it.prompt for it in eval_items(items, 3)] == ["a one", "b one", "c test 0"]
    assert [it.prompt for it in eval_items(items, 7)] == ["a one", "a two", "b one", "b two", "c test 0",
                                                          "c test 1", "c test 2"]
    assert eval_items(items, None) == items and len(eval_items(items, 100)) == 8
    assert [it.prompt for it in eval_items(items[4:], 2)] == ["c test 0", "c test 1"]


def test_the_eval_grid_shows_each_datasets_samples_labelled(tmp_path, monkeypatch):
    """a and b share the eval section's settings (one part), c has its own (a second part): the grid's 16 split
    over the three, each its first test prompts, each led by its dataset's name; with 2 the grid still shows one
    of each dataset (before, the grid showed the first part's samples alone)."""
    from flow_factory import eval_sampling, sampling
    from flow_factory.data import load_sources

    config = _eval_only_config(tmp_path, eval_guidance_scale=1.0)
    (tmp_path / "a" / "test.txt").write_text("".join(f"a test {i}\n" for i in range(20)))
    cfg = parse_config(config)
    items = load_sources(cfg.data.split_sources("test"), "test")

    def sample_prompts(adapter, part, settings, sample_ids, **services):
        return sampling.Rollouts(prompts=[it.prompt for it in part], group_ids=torch.tensor(sample_ids),
                                 latents=torch.empty(0), log_probs=torch.empty(0), sigmas=torch.empty(0),
                                 sde_steps=[], cond={}, media=torch.tensor(sample_ids).float().reshape(-1, 1, 1, 1),
                                 rewards={"r": torch.tensor([float(i) for i in sample_ids])})
    monkeypatch.setattr(eval_sampling, "sample_prompts", sample_prompts)
    parts = eval_sampling.eval_parts(cfg, items)
    _, rollouts = eval_sampling.sample_eval(None, items, parts, lambda n: slice(0, n))
    assert len(rollouts) == 2 and len(rollouts[0].prompts) == 21  # a's 20 and b's 1; c's 2
    shown = eval_sampling.grid_samples(rollouts, [it.dataset for it in items])
    prompts = [prompt for prompt, *_ in shown]
    assert prompts == [f"[a] a test {i}" for i in range(13)] + ["[b] a b test", "[c] a c test one",
                                                                 "[c] a c test two"], prompts
    assert [float(media) for _, media, *_ in shown] == [float(it) for it in [*range(13), 20, 21, 22]]
    assert [rewards for *_, rewards, _ in shown][-1] == {"r": 22.0}
    two = eval_sampling.grid_samples(rollouts, [it.dataset for it in items], shown=2)
    assert [prompt.split("]")[0] for prompt, *_ in two] == ["[a", "[b", "[c"]


@pytest.mark.parametrize("change, message", [
    (lambda c: [d.update(train=False) or d.pop("weight", None) for d in c["data"]["datasets"]],
     "data: datasets: every dataset has train: false, so there is none to train from"),
    (lambda c: c["data"]["datasets"][2].update(weight=2),
     "data.datasets[2]: weight: 'c' is evaluation-only (train: false), never drawn for training"),
    (lambda c: c["data"]["datasets"][2].update(eval=False),
     "data.datasets[2]: train: false and eval: false: the run never reads 'c'"),
    (lambda c: c["data"]["datasets"][0].update(eval=False, eval_guidance_scale=1.0),
     "data.datasets[0]: eval_guidance_scale: 'a' is not evaluated (eval: false)"),
    (lambda c: c["eval"].update(eval_freq=0),
     "data.datasets[2].train: false makes 'c' evaluation-only, and eval.eval_freq is 0"),
    (lambda c: c["rewards"][0].update(applicable_datasets=["c"]),
     "rewards[0].applicable_datasets: ['c'] are evaluation-only datasets (train: false), which training never "
     "draws; route it to training datasets, or list it under eval_rewards"),
    (lambda c: c.update(eval_rewards=[{"reward_model": "PickScore", "weight": {"c": 1.0}}]) or
     c["rewards"][0].update(applicable_datasets=["a", "c"]),
     "rewards[0].applicable_datasets: ['c'] are evaluation-only datasets (train: false), which training never "
     "draws and eval_rewards score"),
    (lambda c: c["data"]["datasets"][1].update(eval=False) or
     c.update(eval_rewards=[{"reward_model": "PickScore", "applicable_datasets": ["b", "c"]}]),
     "eval_rewards[0].applicable_datasets: ['b'] are not evaluated (eval: false)"),
    (lambda c: c["eval"].update(num_samples=2),
     "eval.num_samples: 2 test prompts, split evenly over the 3 evaluated datasets ['a', 'b', 'c'], would leave "
     "['c'] out of the evaluation; make it at least 3"),
    (lambda c: c["data"]["datasets"][2].update(eval_resolution=[32, 72]),
     "data.datasets[2].eval_resolution: sd3-5 needs height and width in multiples of 16 (VAE x8, then 2x2 "
     "transformer patches), got [32, 72]; nearest valid: [32, 64] or [32, 80]"),
    (lambda c: c["data"]["datasets"][2].update(eval_resolution=[64, 64, 64]),
     "data.datasets[2].eval_resolution: expected an integer or [height, width], got a list of 3 values"),
    (lambda c: c["data"]["datasets"][2].update(eval_resolution=[0, 64]),
     "data.datasets[2].eval_resolution: sizes must be positive, got [0, 64]"),
    (lambda c: c["data"]["datasets"][0].update(eval=False, eval_resolution=64),
     "data.datasets[0]: eval_resolution: 'a' is not evaluated (eval: false); remove it"),
])
def test_what_an_evaluation_only_dataset_cannot_mean_is_refused_naming_the_key(tmp_path, change, message):
    config = _eval_only_config(tmp_path)
    change(config)
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(config)


def test_an_evaluation_only_dataset_without_a_test_split_is_refused_before_the_model_loads(tmp_path):
    from flow_factory.models import get_adapter_class
    from flow_factory.trainer.run_data import load_run_data

    cfg = parse_config(_eval_only_config(tmp_path))
    (tmp_path / "c" / "test.txt").unlink()
    with pytest.raises(ConfigError, match=re.escape("data.datasets[2].train: false makes 'c' evaluation-only, and "
                                                    f"{tmp_path / 'c'} holds no test split (test.jsonl / test.txt)")):
        load_run_data(cfg, get_adapter_class("sd3-5"), num_processes=1, seed=0)


def test_flow_factorys_eval_only_datasets_read_as_ours(tmp_path):
    """Upstream's layout (X-GenGroup/Flow-Factory 5f6cda1a, examples/opd): ``train: null`` is an evaluation-only
    dataset, an absent or null ``eval`` (or ``enabled: false``) one not evaluated, and each dataset's
    ``eval.num_inference_steps`` / ``eval.guidance_scale`` its own."""
    upstream = minimal()
    upstream["data"] = {"datasets": [
        {"name": "a", "dataset_dir": "a", "train": {"weight": 1}, "eval": {"num_inference_steps": 40,
                                                                           "guidance_scale": 4.5}},
        {"name": "b", "dataset_dir": "b", "train": {"weight": 2, "enabled": True}},
        {"name": "a_no-cfg", "dataset_dir": "a", "train": None, "eval": {"guidance_scale": 1.0}},
        {"name": "d", "dataset_dir": "d", "train": {"enabled": False}, "eval": {"enabled": True}}]}
    a, b, no_cfg, d = parse_config(upstream).data.sources
    assert (a.train, a.eval, a.eval_num_inference_steps, a.eval_guidance_scale) == (True, True, 40, 4.5)
    assert (b.weight, b.train, b.eval) == (2, True, False)
    assert (no_cfg.train, no_cfg.eval, no_cfg.eval_guidance_scale, d.train, d.eval) == (False, True, 1.0, False, True)
    one = minimal(eval={"eval_freq": 20})
    one["data"] = {"datasets": [{"name": "a", "dataset_dir": "a", "train": {"weight": 1}}]}
    assert parse_config(one).eval.eval_freq == 0  # upstream evaluates no dataset without an eval block
    one["data"]["datasets"][0]["eval"] = {}
    assert parse_config(one).eval.eval_freq == 20
    one["data"] = {"datasets": [{"name": "a", "dataset_dir": "a", "train": None, "eval": {}}]}
    with pytest.raises(ConfigError, match=re.escape("data.datasets[0].train: the run's one dataset is "
                                                    "evaluation-only")):
        parse_config(one)


def test_flow_factorys_per_dataset_eval_resolution_is_each_datasets_own():
    """Upstream's ``data.datasets[].eval.resolution`` (hparams/dataset_args.py, ``DatasetEvalSpec.resolution``: an
    int or [height, width], null inheriting the eval section's; ``get_merged_eval_kwargs`` samples the dataset at
    it): each dataset's ``eval_resolution`` here, the eval section's left as it is (before: refused unless the
    datasets agreed)."""
    from flow_factory.eval_sampling import eval_resolution

    upstream = minimal(eval={"resolution": 256})
    upstream["data"] = {"datasets": [
        {"name": "a", "dataset_dir": "a", "train": {"weight": 1}, "eval": {"resolution": [32, 64]}},
        {"name": "b", "dataset_dir": "b", "train": {"weight": 1}, "eval": {}},
        {"name": "c", "dataset_dir": "c", "train": None, "eval": {"resolution": 48, "guidance_scale": 1.0}}]}
    cfg = parse_config(upstream)
    assert [s.eval_resolution for s in cfg.data.sources] == [[32, 64], None, 48] and cfg.eval.resolution == 256
    assert [eval_resolution(cfg, name) for name in ("a", "b", "c")] == [(32, 64), (256, 256), (48, 48)]
    upstream["data"]["datasets"][1]["eval"]["resolution"] = [40, 64]
    with pytest.raises(ConfigError, match=re.escape("data.datasets[1].eval_resolution: sd3-5 needs height and width "
                                                    "in multiples of 16")):
        parse_config(upstream)


def test_each_test_prompt_is_prepared_at_its_datasets_eval_size(tmp_path, monkeypatch):
    """c has its own eval_resolution [32, 64], a and b the eval section's (train's 512): the run's sizes are each
    dataset's, its eval parts sample at them, and the condition cache holds each test prompt's conditions at its
    dataset's geometry (a condition image is resized to the size generated)."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from flow_factory.data import load_sources
    from flow_factory.eval_sampling import eval_parts
    from flow_factory.models import get_adapter_class
    from flow_factory.sampling import SamplingSettings
    from flow_factory.trainer import caches
    from flow_factory.trainer.run_data import load_run_data

    cfg = parse_config(_eval_only_config(tmp_path, eval_resolution=[32, 64]))
    data = load_run_data(cfg, get_adapter_class("sd3-5"), num_processes=1, seed=0)
    assert data.eval_sizes == {"a": (512, 512), "b": (512, 512), "c": (32, 64)}
    items = load_sources(cfg.data.split_sources("test"), "test")
    parts = eval_parts(cfg, items, data.eval_sizes)
    assert [([it.dataset for it in items[part]], (s.height, s.width)) for part, s in parts] == [
        (["a", "b"], (512, 512)), (["c", "c"], (32, 64))]
    requests = []
    monkeypatch.setattr(caches.ConditionCache, "build",
                        classmethod(lambda cls, adapter, wanted, *args, **kwargs: requests.extend(wanted)))
    adapter = SimpleNamespace(condition_inputs=("images",), text_reads_conditions=False)
    acc = SimpleNamespace(autocast=nullcontext, local_process_index=0, num_processes=1, is_local_main_process=True,
                          wait_for_everyone=lambda: None)
    train = SamplingSettings(64, 64, None, 2, 1.0, 2, 0)
    caches.build_condition_cache(cfg, acc, adapter, data, train)
    tested = requests[len(data.train_prompts):]
    assert [(it.dataset, geometry[:2]) for it, geometry, _ in tested] == [
        ("a", (512, 512)), ("b", (512, 512)), ("c", (32, 64)), ("c", (32, 64))]


def _two_resolutions_config(tmp_path, tiny_sd3_path) -> dict:
    """A tiny SD3 run whose dataset 'square' is evaluated at the eval section's 64 x 64 and its evaluation-only copy
    'wide' at its own eval_resolution [32, 64]: one test prompt of each."""
    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path)
    folder = config["data"].pop("dataset_dir")
    config["data"]["datasets"] = [{"name": "square", "dataset_dir": folder},
                                  {"name": "wide", "dataset_dir": folder, "train": False, "eval_resolution": [32, 64]}]
    config["eval"].update(num_samples=2, num_inference_steps=2)
    config["log"]["logging_backend"] = "none"
    return config


def test_each_dataset_is_sampled_at_its_own_eval_resolution(tmp_path, tiny_sd3_path):
    """The eval ff-eval and the Trainer share (``evaluate_config``: ``eval_sizes`` -> ``eval_parts`` ->
    ``sample_eval``): each part's images have its dataset's size, and each is scored."""
    from flow_factory.evaluate import evaluate_config

    summary, parts, datasets = evaluate_config(parse_config(_two_resolutions_config(tmp_path, tiny_sd3_path)))
    assert datasets == ["square", "wide"]
    assert [tuple(rollouts.media.shape) for rollouts in parts] == [(1, 3, 64, 64), (1, 3, 32, 64)]
    assert summary["jpeg"]["n"] == 2 and math.isfinite(summary["jpeg"]["mean"])


def test_ff_eval_grid_shows_samples_of_two_sizes_each_fit_to_its_cell(tmp_path, tiny_sd3_path):
    """ff-eval --grid with datasets evaluated at 64 x 64 and 32 x 64: one row of two 256-px cells, each sample
    scaled to fit its cell with its aspect ratio kept and centred, the rest of the cell white (before, the samples
    were stacked into one tensor, which different sizes cannot be)."""
    import numpy as np
    from PIL import Image

    from flow_factory.evaluate import main as ff_eval

    path = write_config(tmp_path, _two_resolutions_config(tmp_path, tiny_sd3_path))
    out, grid_path = tmp_path / "eval.json", tmp_path / "grid.png"
    assert ff_eval([str(path), "--out", str(out), "--grid", str(grid_path)]) == 0
    assert [s["prompt"] for s in json.loads(out.read_text())["samples"]] == ["a purple cube", "a purple cube"]
    grid, tile = np.asarray(Image.open(grid_path).convert("RGB")), 256
    assert grid.shape[1] == 2 * tile
    for cell, (height, width) in enumerate([(64, 64), (32, 64)]):
        shown = round(height * tile / max(height, width))  # the sample's height once fit to the cell
        top = (tile - shown) // 2
        white = (grid[:tile, cell * tile:(cell + 1) * tile] == 255).all(axis=(1, 2))  # each row of the cell's tile
        assert white[:top].all() and white[top + shown:].all() and not white[top:top + shown].any(), (cell, top)


def test_a_run_evaluates_its_evaluation_only_dataset_under_its_own_name(tmp_path, tiny_sd3_path, monkeypatch):
    """ff-train with a training dataset and an evaluation-only copy of it at another eval guidance (upstream's
    ``*_no-cfg`` datasets): each epoch's groups are a's, the eval scores both under eval/source/<name>/, its
    eval.num_samples 2 one test prompt of each (before, a's two alone), and its grid shows both, labelled."""
    from flow_factory.trainer import trainer

    grids = []
    monkeypatch.setattr(trainer, "save_eval_grid", lambda samples, *args, save=trainer.save_eval_grid:
                        grids.append([prompt for prompt, *_ in samples]) or save(samples, *args))
    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path, max_epochs=1)
    folder = config["data"].pop("dataset_dir")
    config["data"]["datasets"] = [{"name": "a", "dataset_dir": folder},
                                  {"name": "a_no-cfg", "dataset_dir": folder, "train": False,
                                   "eval_guidance_scale": 1.0, "eval_num_inference_steps": 2}]
    config["eval"].update(eval_freq=1, num_samples=2)
    (out, err), code = ff_train_in_this_process([str(write_config(tmp_path, config))])
    assert code == 0, err[-3000:]
    history = json.loads((tmp_path / "saves" / "run" / "history.json").read_text())
    assert all(r["source/a/groups"] == 2 and not any("a_no-cfg" in k for k in r) for r in history["train"])
    evaluated = history["eval"][-1]
    assert {"eval/source/a/reward/jpeg", "eval/source/a_no-cfg/reward/jpeg"} <= set(evaluated)
    assert all(math.isfinite(v) for v in evaluated.values())
    assert grids and all(shown == ["[a] a purple cube", "[a_no-cfg] a purple cube"] for shown in grids), grids
    assert len(list((tmp_path / "saves" / "run" / "samples").glob("eval_epoch_*.png"))) == len(grids)
