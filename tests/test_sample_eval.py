"""ff-sample and ff-eval on a tiny pipeline: the files, grid, table and JSON hold what they claim."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from flow_factory.evaluate import main as ff_eval
from flow_factory.sample import main as ff_sample
from flow_factory.shapebench import verdict_on_image

import shapebench_families  # scripts/

PROMPTS = ["a photo of a red circle", "a photo of two squares", "a photo of a circle left of a triangle"]


def _config(tmp_path, model_path) -> str:
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.txt").write_text("a photo of a square\n")
    (data / "test.txt").write_text("\n".join(PROMPTS) + "\n")
    cfg = {
        "data": {"dataset_dir": str(data)},
        "model": {"model_name_or_path": str(model_path), "model_type": "sd3-5"},
        "scheduler": {"dynamics_type": "Flow-SDE"},
        "train": {"resolution": 64, "num_inference_steps": 4, "per_device_batch_size": 2, "group_size": 2,
                  "unique_sample_num_per_epoch": 1},
        "eval": {"resolution": 64, "num_inference_steps": 4, "per_device_batch_size": 2, "seed": 5,
                 "guidance_scale": 1.0},
        "log": {"save_dir": str(tmp_path / "runs"), "run_name": "r", "logging_backend": None},
        "rewards": [{"name": "jpeg", "reward_model": "jpeg_compressibility"}],
        "eval_rewards": [{"name": "strict", "reward_model": "shapebench_strict"},
                         {"name": "jpeg", "reward_model": "jpeg_compressibility"}],
    }
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_ff_sample_writes_images_grid_and_index(tmp_path, tiny_sd3_path, capsys):
    out = tmp_path / "s"
    assert ff_sample([str(tiny_sd3_path), "--prompts", *PROMPTS, "--out", str(out), "--steps", "4",
                      "--seed", "5", "--batch-size", "2"]) == 0
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == PROMPTS and [r["file"] for r in rows] == ["0000.png", "0001.png", "0002.png"]
    images = [np.asarray(Image.open(out / r["file"])) for r in rows]
    assert all(im.shape == (64, 64, 3) for im in images)
    assert not np.array_equal(images[0], images[1])  # each sample its own noise
    grid = Image.open(out / "grid.png")
    assert grid.width == 3 * 256 and grid.height > 256  # 3 tiles of 256 px, captions below
    # the same seed gives the same images, whatever the batch size (to float rounding: one uint8 level)
    again = tmp_path / "s2"
    ff_sample([str(tiny_sd3_path), "--prompts", *PROMPTS, "--out", str(again), "--steps", "4", "--seed", "5"])
    diff = np.abs(np.asarray(Image.open(again / "0002.png")).astype(int) - images[2].astype(int))
    assert diff.max() <= 1


def test_ff_sample_samples_in_the_precision_it_is_given(tmp_path, tiny_sd3_path, capsys, gpu_precision):
    """--mixed-precision as ff-train's mixed_precision (on this CPU under FF_CPU_MIXED_PRECISION): bf16 autocast
    draws other pixels than float32 from the same seed."""
    def sample(precision):
        out = tmp_path / precision
        assert ff_sample([str(tiny_sd3_path), "--prompts", PROMPTS[0], "--out", str(out), "--steps", "3",
                          "--mixed-precision", precision]) == 0
        return np.asarray(Image.open(out / "0000.png")).astype(int)

    bf16, fp32 = sample("bf16"), sample("no")
    err = capsys.readouterr().err
    assert "ff-sample: precision: bf16 autocast on cpu" in err and "ff-sample: precision: float32 on cpu" in err
    assert not np.array_equal(bf16, fp32)


def test_ff_sample_reads_a_prompt_file_and_names_a_bad_one(tmp_path, tiny_sd3_path, capsys):
    (tmp_path / "p.txt").write_text("a photo of a circle\n\na photo of a square\n")
    assert ff_sample([str(tiny_sd3_path), "--prompt-file", str(tmp_path / "p.txt"), "--out", str(tmp_path / "o")]) == 2
    assert "p.txt:2" in capsys.readouterr().err
    assert ff_sample([str(tiny_sd3_path), "--prompt-file", str(tmp_path / "none.txt"), "--out", "x"]) == 2


def random_lora_checkpoint(model_path, out) -> Path:
    """A LoRA checkpoint of the tiny SD3 in ``out`` whose B matrices are random: it changes the samples."""
    from flow_factory.models import load_adapter
    from flow_factory.models.lora import apply_lora, save_lora

    adapter = load_adapter("sd3-5", model_path)
    apply_lora(adapter.transformer, 4, 4, "all", adapter.default_lora_targets)
    with torch.no_grad():
        for name, p in adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    return save_lora(type(adapter.pipeline), adapter.transformer, out)


def test_ff_sample_applies_a_lora_checkpoint(tmp_path, tiny_sd3_path, capsys):
    ckpt = random_lora_checkpoint(tiny_sd3_path, tmp_path / "ckpt")
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    common = ["--prompts", PROMPTS[0], "--steps", "4"]
    assert ff_sample([str(tiny_sd3_path), *common, "--out", str(base)]) == 0
    assert ff_sample([str(tiny_sd3_path), *common, "--checkpoint", str(ckpt), "--out", str(tuned)]) == 0
    assert not np.array_equal(np.asarray(Image.open(base / "0000.png")), np.asarray(Image.open(tuned / "0000.png")))
    assert ff_sample([str(tiny_sd3_path), *common, "--checkpoint", str(tmp_path), "--out", str(tuned)]) == 2
    err = capsys.readouterr().err
    assert f"ff-sample: checkpoint {tmp_path}: expected pytorch_lora_weights.safetensors" in err
    assert f"ff-sample's defaults (no config.yaml in --checkpoint {ckpt} or its run folder)" in err  # no run's


def test_ff_eval_prints_a_table_and_writes_json_that_match_the_images(tmp_path, tiny_sd3_path, capsys):
    config = _config(tmp_path, tiny_sd3_path)
    out = tmp_path / "eval.json"
    assert ff_eval([config, "--out", str(out), "--grid", str(tmp_path / "g.png")]) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [s["prompt"] for s in result["samples"]] == PROMPTS
    for name in ("strict", "jpeg"):
        per_sample = [s[name] for s in result["samples"]]
        assert result["rewards"][name]["mean"] == pytest.approx(np.mean(per_sample), abs=1e-6)
        assert result["rewards"][name]["n"] == 3
        assert f"{name} " in table and f"{result['rewards'][name]['mean']:.4f}" in table
    assert Image.open(tmp_path / "g.png").width == 3 * 256
    assert "family" not in table  # ff-eval knows no benchmark: ShapeBench's table is a script's
    # scripts/shapebench_families.py reads the JSON; one prompt per family here, so each
    # family's mean is that sample's score
    assert shapebench_families.main([str(out)]) == 0
    family_table = capsys.readouterr().out
    families = shapebench_families.by_family(result["samples"])
    assert list(families) == ["counting", "colors", "position"]  # FAMILIES order
    for sample, family in zip(result["samples"], ("colors", "counting", "position")):
        assert families[family] == {"strict": sample["strict"], "jpeg": sample["jpeg"], "n": 1}
        assert f"{family} " in family_table and f"{sample['strict']:.4f}" in family_table
    # ff-eval seeds sample i as ff-sample does with the same seed: the strict scores are those of its images
    ff_sample([str(tiny_sd3_path), "--prompts", *PROMPTS, "--out", str(tmp_path / "s"), "--steps", "4", "--seed", "5",
               "--batch-size", "2"])
    strict = [verdict_on_image(p, np.asarray(Image.open(tmp_path / "s" / f"{i:04d}.png"))).strict
              for i, p in enumerate(PROMPTS)]
    assert strict == [s["strict"] for s in result["samples"]]


def test_ff_eval_writes_a_video_grid_as_its_suffix_or_log_video_format_says(tmp_path, tiny_wan_path):
    """A video model's --grid: a GIF for a .gif path, else the config's log.video_format (mp4 by default)."""
    from helpers_runs import tiny_run_config, write_config

    from flow_factory.media import probe

    config = tiny_run_config(tmp_path, "wan2_t2v", tiny_wan_path)
    config["eval"].update(num_samples=1, num_inference_steps=2)
    config["log"]["logging_backend"] = "none"
    path = str(write_config(tmp_path, config))
    assert ff_eval([path, "--out", str(tmp_path / "e.json"), "--grid", str(tmp_path / "g.gif")]) == 0
    assert Image.open(tmp_path / "g.gif").n_frames == 5
    assert ff_eval([path, "--out", str(tmp_path / "e.json"), "--grid", str(tmp_path / "g.png")]) == 0
    assert probe(tmp_path / "g.mp4").frames == 5 and probe(tmp_path / "g.mp4").fps == 16


def test_shapebench_families_averages_each_family_and_names_a_prompt_of_another_benchmark(tmp_path, capsys):
    samples = [{"prompt": "a photo of a circle", "strict": 1.0, "partial": 1.0},
               {"prompt": "a photo of two squares", "strict": 1.0, "partial": 0.5},
               {"prompt": "a photo of a square", "strict": 0.0, "partial": 0.25}]
    assert shapebench_families.by_family(samples) == {
        "single_object": {"strict": 0.5, "partial": 0.625, "n": 2},
        "counting": {"strict": 1.0, "partial": 0.5, "n": 1},
    }
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"samples": samples + [{"prompt": "a cat on a sofa", "strict": 0.0, "partial": 0.0}]}))
    assert shapebench_families.main([str(path)]) == 2
    assert "not a ShapeBench prompt: 'a cat on a sofa'" in capsys.readouterr().err


def test_ff_eval_reports_a_config_error(tmp_path, tiny_sd3_path, capsys):
    config = _config(tmp_path, tiny_sd3_path)
    assert ff_eval([config, "eval.num_inference_step=3"]) == 2
    assert "eval.num_inference_step" in capsys.readouterr().err


# ------------------------------------------------------------------ sampling as the run did
# the run's eval settings, each other than ff-sample's own default (64 px, 10 steps, guidance 1, seed 0)
RUN_EVAL = {"resolution": 32, "num_inference_steps": 3, "guidance_scale": 2.5, "seed": 5}


@pytest.fixture(scope="module")
def run_checkpoint(tmp_path_factory, tiny_sd3_path):
    """(config, checkpoint) of a run as ff-train leaves it: RUN/config.yaml, the resolved config, and a LoRA
    checkpoint in RUN/checkpoints/epoch_1 (random LoRA weights: training would add only time)."""
    from flow_factory.checkpoint import RUN_CONFIG, checkpoint_dir
    from flow_factory.config import load_config
    tmp = tmp_path_factory.mktemp("run")
    config = _config(tmp, tiny_sd3_path)
    data = yaml.safe_load(open(config))
    data["eval"].update(RUN_EVAL)
    (tmp / "eval.yaml").write_text(yaml.safe_dump(data))
    cfg = load_config(config)
    run_dir = tmp / "runs" / cfg.log.run_name
    ckpt = random_lora_checkpoint(tiny_sd3_path, checkpoint_dir(run_dir, 1))
    (run_dir / RUN_CONFIG).write_text(cfg.to_yaml())
    return config, str(ckpt)


def _sample(tmp_path, name: str, *args) -> np.ndarray:
    """ff-sample of PROMPTS[0] into tmp_path/name with ``args``; its image."""
    assert ff_sample([*args, "--prompts", PROMPTS[0], "--out", str(tmp_path / name)]) == 0
    return np.asarray(Image.open(tmp_path / name / "0000.png"))


def test_ff_sample_samples_a_runs_checkpoint_as_its_eval(tmp_path, run_checkpoint, tiny_sd3_path, capsys):
    """With a run's checkpoint, the size, steps, guidance and seed are the run's eval's, and the model its own."""
    _, ckpt = run_checkpoint
    as_run = _sample(tmp_path, "run", str(tiny_sd3_path), "--checkpoint", ckpt)
    assert as_run.shape == (32, 32, 3)  # eval.resolution, not ff-sample's 64
    assert f"32x32 px, 3 steps, guidance 2.5, seed 5: run r's eval settings ({Path(ckpt).parents[1]}" in \
        capsys.readouterr().err
    explicit = _sample(tmp_path, "explicit", str(tiny_sd3_path), "--checkpoint", ckpt, "--resolution", "32",
                       "--steps", "3", "--guidance-scale", "2.5", "--seed", "5")
    np.testing.assert_array_equal(as_run, explicit)
    # the run's model.model_name_or_path when MODEL is left out
    np.testing.assert_array_equal(as_run, _sample(tmp_path, "no_model", "--checkpoint", ckpt))


def test_ff_sample_flags_override_the_runs_settings(tmp_path, run_checkpoint, capsys):
    _, ckpt = run_checkpoint
    as_run = _sample(tmp_path, "run", "--checkpoint", ckpt)
    unguided = _sample(tmp_path, "g1", "--checkpoint", ckpt, "--guidance-scale", "1")
    assert unguided.shape == (32, 32, 3) and not np.array_equal(as_run, unguided)
    assert _sample(tmp_path, "big", "--checkpoint", ckpt, "--resolution", "64").shape == (64, 64, 3)
    # no checkpoint of a run, no model: nothing names the pipeline
    assert ff_sample(["--prompts", "a", "--out", str(tmp_path / "x")]) == 2
    assert "ff-sample: MODEL: name a diffusers pipeline folder" in capsys.readouterr().err


def test_ff_sample_help_shows_each_default(capsys):
    with pytest.raises(SystemExit):
        ff_sample(["--help"])
    # each option's help: the text from its line "  --flag ..." to the next option's
    options = {chunk.split()[0]: " ".join(chunk.split()) for chunk in re.split(r"\n  (?=-)", capsys.readouterr().out)}
    for flag, plain in (("--resolution", 64), ("--steps", 10), ("--guidance-scale", 1.0), ("--seed", 0),
                        ("--model-type", "sd3-5"), ("--mixed-precision", "bf16"), ("--batch-size", 8)):
        assert f"default: the run's eval setting with --checkpoint, else {plain}" in options[flag], flag
    assert "(default: mp4)" in options["--video-format"]


def test_ff_eval_takes_overrides_after_the_flags(tmp_path, run_checkpoint, capsys):
    """``ff-eval CONFIG --checkpoint DIR key=value``, as its usage line and ff-train have it."""
    config, ckpt = run_checkpoint
    out = tmp_path / "e.json"
    assert ff_eval([config, "--checkpoint", ckpt, "eval.num_samples=1", "--out", str(out), "eval.seed=6"]) == 0
    assert [s["prompt"] for s in json.loads(out.read_text())["samples"]] == PROMPTS[:1]


def test_ff_sample_takes_every_spelling_the_config_takes_for_the_model_type():
    """``--model-type qwenimage`` names the family as ``model.model_type: qwenimage`` does (case, ``_``, ``.``
    and the table's other spellings); a dotted path of a user's adapter stays as given."""
    from flow_factory.sample import fill_settings, parse_args

    for spelling, model_type in (("SD3_5", "sd3-5"), ("qwenimage", "qwen-image"), ("wan2.1", "wan2_t2v"),
                                 ("my_package.adapters.MyAdapter", "my_package.adapters.MyAdapter")):
        args = parse_args(["a-model", "--model-type", spelling, "--prompts", "a", "--out", "out"])
        fill_settings(args)
        assert args.model_type == model_type, spelling
