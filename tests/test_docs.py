"""The documents stay true to the code: the config reference is the schema's, every key is
described, the guides' examples run, and the links between documents resolve."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
from helpers_algorithms import rollouts_of

from flow_factory.config import reference

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def test_config_reference_is_generated_from_the_schema():
    committed = (ROOT / reference.DEFAULT_OUT).read_text(encoding="utf-8")
    assert committed == reference.render(), (
        f"docs/config-reference.md differs from the schema; regenerate it from the repository root with: "
        f"{reference.COMMAND}")


def test_every_config_key_has_a_description():
    missing = reference.undocumented_fields()
    assert not missing, (f"config keys without a description (give each setting(default, description) in "
                         f"src/flow_factory/config/): {missing}")


def test_the_reference_lists_every_key_of_every_section():
    page = reference.render()
    keys = set(re.findall(r"^\| `([^`]+)` \|", page, flags=re.M))
    for _heading, prefix, _description, model in reference.sections():
        for name, field in model.model_fields.items():
            if reference._section_model(field) is None:
                assert f"{prefix}{name}" in keys
    assert {"train.learning_rate", "rewards[].reward_model", "seed", "scheduler.sde_steps"} <= keys


def test_a_key_without_a_description_is_named(monkeypatch):
    from flow_factory.config import RewardConfig, TrainConfig

    monkeypatch.setattr(TrainConfig.model_fields["kl_beta"], "description", "")
    monkeypatch.setattr(RewardConfig.model_fields["weight"], "description", " ")
    assert reference.undocumented_fields() == ["train.kl_beta", "rewards[].weight"]


# ---------------------------------------------------------------------- guides' examples


def python_blocks(path: Path) -> list[str]:
    """The ```python code blocks of a markdown file, in order."""
    return re.findall(r"^```python\n(.*?)^```", path.read_text(encoding="utf-8"), flags=re.M | re.S)


def run_block(code: str, module_name: str, monkeypatch) -> types.ModuleType:
    """Execute a guide's code block as a module importable under ``module_name``."""
    module = types.ModuleType(module_name)
    monkeypatch.setitem(sys.modules, module_name, module)
    exec(compile(code, f"<{module_name}>", "exec"), module.__dict__)
    return module


def test_model_guide_example_reproduces_the_pipeline(monkeypatch, tiny_sd3_path):
    """The guide's adapter, registered and loaded as the guide says (its one line in the model families'
    table, which the config and the registry both read), passes the guide's own check (an ODE rollout
    equals the pipeline's latents) and agrees with the shipped SD3 adapter."""
    import dataclasses

    import torch

    from flow_factory.config.families import MODEL_FAMILIES, ModelFamily
    from flow_factory.config.sections import ModelConfig
    from flow_factory.models import ADAPTERS, FlowAdapter, SD3Adapter, index_cond, load_adapter

    adapter_code, line, check_code = python_blocks(DOCS / "guides" / "adding-a-model.md")
    guide = run_block(adapter_code, "ff_guide_model", monkeypatch)
    check = run_block(check_code, "ff_guide_model_check", monkeypatch)
    cls = guide.MinimalSD3Adapter
    (family,) = eval(line, {"ModelFamily": ModelFamily})
    assert issubclass(cls, FlowAdapter) and cls.model_type not in ADAPTERS
    assert (family.model_type, family.adapter.rpartition(":")[2], family.pixel_factor) == (
        cls.model_type, cls.__name__, cls.pixel_factor)
    # the line, its module being importable here as ff_guide_model rather than flow_factory.models.sd3_minimal
    monkeypatch.setitem(MODEL_FAMILIES, family.model_type,
                        dataclasses.replace(family, adapter=f"ff_guide_model:{cls.__name__}"))
    for spelling in (family.model_type, *family.aliases, "SD3_Minimal"):
        assert ModelConfig(model_type=spelling, model_name_or_path=str(tiny_sd3_path)).model_type == cls.model_type

    adapter = load_adapter(cls.model_type, tiny_sd3_path)
    assert type(adapter) is cls
    final = check.check_against_pipeline(adapter)
    assert final.shape == (2, *adapter.latent_shape(64, 64))

    shipped = load_adapter("sd3-5", tiny_sd3_path)
    assert isinstance(shipped, SD3Adapter)
    cond = adapter.encode(["a red circle", "two cats"], ["blurry", ""], 4.5)
    x = adapter.initial_noise(2, 64, 64, torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.9, 0.4])
    with torch.no_grad():
        v = adapter.velocity(x, sigma, cond, 4.5)
        torch.testing.assert_close(v, shipped.velocity(x, sigma, shipped.encode(["a red circle", "two cats"],
                                                                                  ["blurry", ""], 4.5), 4.5),
                                   rtol=0, atol=1e-6)
        one = adapter.velocity(x[1:], sigma[1], index_cond(cond, [1]), 4.5)
    torch.testing.assert_close(v[1:], one, rtol=0, atol=1e-5)  # per sample, as the rollout slices it
    torch.testing.assert_close(adapter.sigmas(3, 64, 64), shipped.sigmas(3, 64, 64), rtol=0, atol=0)
    images = adapter.decode(final)
    assert images.shape == (2, 3, 64, 64) and 0 <= images.min() and images.max() <= 1
    torch.testing.assert_close(images, shipped.decode(final), rtol=0, atol=0)
    assert adapter.pixel_factor_of(adapter.pipeline.vae.config, adapter.transformer.config) == cls.pixel_factor


def test_model_guide_adapter_trains_by_its_dotted_path(monkeypatch, request, tmp_path, tiny_sd3_path):
    """The guide's own-adapter section: step 1's class saved in a module outside the package and named
    by the dotted path of the guide's YAML trains with ``ff-train``, through that class, and writes a
    LoRA that the pipeline loads."""
    import importlib

    import torch
    import yaml
    from diffusers import StableDiffusion3Pipeline
    from helpers_runs import tiny_run_config, write_config

    from flow_factory.train import main

    guide = DOCS / "guides" / "adding-a-model.md"
    (block,) = re.findall(r"^```yaml\n(.*?)^```", guide.read_text(encoding="utf-8"), flags=re.M | re.S)
    model_type = yaml.safe_load(block)["model"]["model_type"]
    module_name, _, class_name = model_type.rpartition(".")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / f"{module_name}.py").write_text(python_blocks(guide)[0], encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path / "elsewhere"))
    request.addfinalizer(lambda: sys.modules.pop(module_name, None))
    cls = getattr(importlib.import_module(module_name), class_name)
    calls = []
    velocity = cls.velocity
    monkeypatch.setattr(cls, "velocity", lambda self, *a, **k: calls.append(1) or velocity(self, *a, **k))

    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path, max_epochs=2)
    config["model"]["model_type"] = model_type
    assert main([str(write_config(tmp_path, config))]) == 0
    assert calls, "the run did not sample or train through the guide's class"
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_path)
    pipe.load_lora_weights(tmp_path / "saves" / "run" / "checkpoints" / "epoch_2")
    assert any(torch.count_nonzero(p) for n, p in pipe.transformer.named_parameters() if "lora_B" in n)


def test_reward_guide_example_scores_through_a_config(monkeypatch):
    """The guide's reward, named by its class path in a reward entry with its own option, scores images."""
    import torch

    from flow_factory.rewards import PointwiseRewardModel, RewardSet

    code, needs = python_blocks(DOCS / "guides" / "adding-a-reward.md")
    guide = run_block(code, "ff_guide_reward", monkeypatch)
    judge = run_block(needs, "ff_guide_judge", monkeypatch).MyJudge  # what ff-train checks it needs
    assert judge.models_to_load({}) == ["org/my-judge", "org/my-judge-processor"]
    assert judge.models_to_load({"model_name_or_path": "/ckpt"})[0] == "/ckpt" and judge.servers_to_reach({}) == []
    assert issubclass(guide.Brightness, PointwiseRewardModel)
    images = torch.stack([torch.full((3, 8, 8), 0.4), torch.full((3, 8, 8), 0.9), torch.rand(3, 8, 8)])

    rewards = RewardSet.from_configs([{"name": "brightness", "reward_model": "ff_guide_reward.Brightness",
                                       "target": 0.4, "batch_size": 2}])
    scores = rewards(["a", "b", "c"], images=images)["brightness"]
    expected = -(images.mean(dim=(1, 2, 3)) - 0.4).abs()
    torch.testing.assert_close(scores, expected)
    assert abs(scores[0]) < 1e-6 and scores[1] < scores[0]
    with pytest.raises(TypeError, match="targt"):  # a misspelt option fails at the constructor
        RewardSet.from_configs([{"reward_model": "ff_guide_reward.Brightness", "targt": 0.4}])


def test_dynamics_guide_example_keeps_the_marginals(monkeypatch):
    """The guide's dynamics: registered it is made by name, a = 0 is the ODE step, its recomputed
    log-prob equals the recorded one with a finite gradient, and the guide's marginal check passes."""
    import torch

    from flow_factory.dynamics import DYNAMICS, ODE, Dynamics, make_dynamics

    dynamics_code, check_code = python_blocks(DOCS / "guides" / "adding-a-dynamics.md")
    guide = run_block(dynamics_code, "ff_guide_dynamics", monkeypatch)
    check = run_block(check_code, "ff_guide_dynamics_check", monkeypatch)
    cls = guide.SigmaSDE
    assert issubclass(cls, Dynamics) and cls.stochastic and cls.name not in DYNAMICS
    monkeypatch.setitem(DYNAMICS, cls.name, cls)  # what adding it to dynamics/__init__.py does
    dynamics = make_dynamics(cls.name, 0.7)

    gen = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 2, 4, 4, generator=gen), torch.randn(3, 2, 4, 4, generator=gen)
    for sigma, sigma_next in ((1.0, 0.9), (0.6, 0.5), (0.1, 0.0), (torch.tensor([1.0, 0.5, 0.1]),
                                                                 torch.tensor([0.9, 0.3, 0.0]))):
        ode = ODE().step(x, v, sigma, sigma_next).sample
        assert torch.equal(cls(0.0).step(x, v, sigma, sigma_next, generator=gen).sample, ode)
        out = dynamics.step(x, v, sigma, sigma_next, generator=gen)
        v_train = v.clone().requires_grad_(True)
        mean, std = dynamics.mean_and_std(x, v_train, sigma, sigma_next)
        log_prob = dynamics.log_prob(out.sample, mean, std)
        torch.testing.assert_close(log_prob, out.log_prob, rtol=0, atol=1e-6)
        log_prob.sum().backward()
        assert torch.isfinite(v_train.grad).all()
    check.check_marginals(dynamics)


def test_algorithm_guide_example_weights_better_samples_more(monkeypatch):
    """The guide's algorithm, registered, is made by name from a real TrainConfig, makes one
    micro-batch per training timestep, and its loss is the formula in its docstring."""
    import torch

    from flow_factory.algorithms import ALGORITHMS, DecoupledAlgorithm, make_algorithm
    from flow_factory.config import TrainConfig
    from flow_factory.config.algorithms import ALGORITHM_SPECS, AlgorithmSpec
    from flow_factory.dynamics import ODE

    code, registration = python_blocks(DOCS / "guides" / "adding-an-algorithm.md")
    cls = run_block(code, "rwr", monkeypatch).RewardWeightedRegression  # the guide's algorithms/rwr.py
    assert issubclass(cls, DecoupledAlgorithm) and cls.name not in ALGORITHMS
    spec = eval(registration.strip().rstrip(","), {"AlgorithmSpec": AlgorithmSpec})  # the guide's one line
    assert spec.name == cls.name and spec.family == "decoupled"
    monkeypatch.setitem(ALGORITHM_SPECS, spec.name, spec)  # what adding the line to ALGORITHM_SPECS does
    cfg = TrainConfig(trainer_type="nft", num_inference_steps=4, kl_beta=0.1, adv_clip_range=2.0)
    algorithm = make_algorithm(cls.name, cfg, ODE())
    assert type(algorithm) is cls
    assert algorithm.needs_reference

    gen = torch.Generator().manual_seed(0)
    rollouts = rollouts_of(torch.randn(4, 5, 2, 3, generator=gen), torch.linspace(1, 0, 5),
                           {"c": torch.randn(4, 1, 1, generator=gen)})
    advantages = torch.tensor([3.0, -1.0, 0.5, -2.5])
    units = algorithm.training_units(torch.tensor([0, 0, 1, 1]), advantages)
    batches = list(algorithm.micro_batches(rollouts, advantages, units, torch.Generator().manual_seed(1)))
    assert len(batches) == algorithm.num_timesteps == 3  # int(4 steps x timestep_range 0.9)

    weights = torch.nn.Parameter(torch.tensor(0.3))
    policy = types.SimpleNamespace(velocity=lambda x, sigma, cond: weights * x + cond["c"],
                                   reference_velocity=lambda x, sigma, cond: 0.5 * x)
    batch = batches[0]
    loss, metrics = algorithm.loss(policy, batch)
    w = torch.exp(advantages.clamp(-2, 2) / 2)
    w = w / w.mean()
    v = policy.velocity(batch.x_t, batch.sigma, batch.cond)
    error = ((v - (batch.noise - batch.x0)) ** 2).mean(dim=(1, 2))
    kl = ((v - 0.5 * batch.x_t) ** 2).mean(dim=(1, 2)).mean()
    torch.testing.assert_close(loss, (w * error).mean() + 0.1 * kl)
    assert w[0] > w[2] > w[1] > w[3] and metrics["weight_max"] == w.max()
    loss.backward()
    assert torch.isfinite(weights.grad)


# ---------------------------------------------------------------------- links


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a markdown heading: lower case, punctuation dropped, spaces to '-'."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_the_models_page_has_a_row_for_every_model_family():
    """docs/models.md's table: one row per line of the model families' table (config.families), no other."""
    from flow_factory.config.families import MODEL_FAMILIES

    table = (DOCS / "models.md").read_text(encoding="utf-8").split("\n|---|", 1)[1]  # below the header
    rows = re.findall(r"^\| `([^`]+)` \|", table, flags=re.M)
    assert sorted(rows) == sorted(MODEL_FAMILIES)


def test_links_between_documents_resolve():
    """Every relative link of the README and docs/ names a file that exists, and an anchor a heading in it."""
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked offline
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", file.read_text(encoding="utf-8"), flags=re.M)
                if anchor not in {github_anchor(h) for h in headings}:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def _expand(pattern: str) -> list[str]:
    """``trainer/{a,b}.py`` -> ``trainer/a.py``, ``trainer/b.py`` (one brace group)."""
    match = re.search(r"\{([^}]*)\}", pattern)
    if not match:
        return [pattern]
    return [pattern[:match.start()] + part + pattern[match.end():] for part in match.group(1).split(",")]


def test_the_design_parts_table_names_files_that_exist_and_every_module():
    design = (DOCS / "DESIGN.md").read_text()
    table = design[design.index("## Parts"):design.index("Outside the package")]
    rows = [line.split("|")[2] for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    named = {f for row in rows[1:] for pattern in re.findall(r"`([\w/{},.]+\.py)`", row) for f in _expand(pattern)}
    package = ROOT / "src" / "flow_factory"
    missing = sorted(f for f in named if not (package / f).is_file())
    assert not missing, f"docs/DESIGN.md's parts table names files that do not exist: {missing}"
    modules = {str(p.relative_to(package)) for p in package.rglob("*.py") if p.name != "__init__.py"}
    unnamed = sorted(modules - named)
    assert not unnamed, f"docs/DESIGN.md's parts table does not name these modules: {unnamed}"
