"""`ff-train` end to end on tiny SD3, FLUX and Wan pipelines saved to a temp folder."""

import json
import os
import random
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers_runs import TINY_MODELS, ff_train_in_this_process, tiny_run_config, write_config

from flow_factory.models import get_adapter_class
from flow_factory.train import main

TESTS_DIR = Path(__file__).resolve().parent


_PORTS_HANDED_OUT: set[int] = set()
_PORTS_LOCK = threading.Lock()  # tests launch runs side by side from threads


def _free_port() -> int:
    """A port for a multi-process launch's rendezvous, never handed out twice in one test session. Taken
    below Linux's ephemeral range (32768 and up), where no other process's outgoing connection (gloo opens
    many) lands, and from a block of its own per pytest-xdist worker: ``bind(0)`` alone could give two
    launches starting side by side the same port, whose processes would then join one another's run."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    block = range(20000 + 1000 * (worker % 12), 20000 + 1000 * (worker % 12 + 1))
    start = random.randrange(len(block))  # another pytest session on this machine starts elsewhere in the block
    with _PORTS_LOCK:
        for port in (*block[start:], *block[:start]):
            if port in _PORTS_HANDED_OUT:
                continue
            _PORTS_HANDED_OUT.add(port)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:  # in use by something else: the next one
                    continue
            return port
    raise RuntimeError(f"no free port in {block.start}-{block.stop - 1}")


def _run(tmp_path, config):
    assert main([str(write_config(tmp_path, config))]) == 0


def _pipeline_output(pipe_cls, path, lora_dir, model_type):
    _, resolution, frames, guidance = TINY_MODELS[model_type]
    # the pipeline's from_pretrained (through the adapter class only for Qwen-Image-2.1's processor without torchvision)
    pipe = get_adapter_class(model_type).from_pretrained(path).pipeline
    assert type(pipe) is pipe_cls
    if lora_dir is not None and not hasattr(pipe, "load_lora_weights"):  # no LoRA loader (HunyuanVideo-1.5)
        pipe.transformer.load_lora_adapter(lora_dir, weight_name="pytorch_lora_weights.safetensors",
                                           prefix="transformer")
    elif lora_dir is not None:
        pipe.load_lora_weights(lora_dir)
    kwargs = {"num_frames": frames} if frames else {}
    # Qwen-Image's CFG is true_cfg_scale with a negative prompt; its guidance_scale is for distilled models
    kwargs.update({"true_cfg_scale": guidance, "negative_prompt": ""} if model_type == "qwen-image"
                  else {"true_cfg_scale": guidance} if model_type == "qwen-image-2.1" else {"guidance_scale": guidance})
    if model_type == "hunyuanvideo15":  # its CFG scale is its guider's
        pipe.guider = pipe.guider.new(guidance_scale=kwargs.pop("guidance_scale"))
    out = pipe(prompt="a red circle", height=resolution, width=resolution, num_inference_steps=2,
               output_type="latent", generator=torch.Generator().manual_seed(0), **kwargs)
    return (out.frames if hasattr(out, "frames") else out.images).float()


# grpo on every family; grpo-guard (the same adapter calls, another loss) where the dynamics or the
# latent layout differ: SD3, FLUX.1's packing, Wan's video, LTX-2's partly stochastic latent
GUARDED = ("sd3-5", "flux1", "wan2_t2v", "ltx2_t2av")


@pytest.mark.parametrize("model_type,trainer_type,epochs",
                         [(m, "grpo", 2) for m in TINY_MODELS] + [(m, "grpo-guard", 2) for m in GUARDED])
def test_ff_train_runs_and_writes_a_loadable_lora(request, tmp_path, model_type, trainer_type, epochs,
                                                  gpu_precision):
    """In a GPU's precision: bf16 autocast (the config's default), fp16 trajectories (the default)."""
    path = request.getfixturevalue(TINY_MODELS[model_type][0])
    extra = {"clip_range": 1e-5} if trainer_type == "grpo-guard" else {}
    config = tiny_run_config(tmp_path, model_type, path, trainer_type=trainer_type, max_epochs=epochs, **extra)
    _run(tmp_path, config)

    run_dir = tmp_path / "saves" / "run"
    events = list(run_dir.rglob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file"
    history = json.loads((run_dir / "history.json").read_text())
    assert [r["epoch"] for r in history["train"]] == list(range(epochs))
    for key in ("reward/jpeg/mean", "train/loss", "train/ratio_mean", "train/clip_frac", "train/grad_norm",
                "advantage/std", "time/sampling", "time/training", "time/other"):
        assert key in history["train"][-1], key
    assert (run_dir / "reward_curve.png").exists()
    grid = "eval_epoch_0000" + (".mp4" if get_adapter_class(model_type).is_video else ".png")  # log.video_format
    assert (run_dir / "samples" / grid).exists()

    lora_dir = run_dir / "checkpoints" / f"epoch_{epochs}"
    assert (lora_dir / "pytorch_lora_weights.safetensors").exists()
    pipe_cls = get_adapter_class(model_type).pipeline_class
    base = _pipeline_output(pipe_cls, path, None, model_type)
    tuned = _pipeline_output(pipe_cls, path, lora_dir, model_type)
    assert not torch.allclose(base, tuned, atol=1e-6), "the trained LoRA does not change the output"


@pytest.mark.parametrize("model_type", ["qwen-image", "z-image", "flux2", "flux2-klein", "hunyuanvideo15",
                                        "ltx2_t2av"])
def test_ff_train_nft_writes_a_loadable_lora(request, tmp_path, model_type, gpu_precision):
    """A decoupled algorithm end to end on the families after the first three (Qwen-Image's and Z-Image's
    prompts keep their own lengths: the epoch's conditioning concatenates across batches), in bf16 autocast;
    the LoRA loads in the pipeline and changes its output."""
    path = request.getfixturevalue(TINY_MODELS[model_type][0])
    config = tiny_run_config(tmp_path, model_type, path, trainer_type="nft", max_epochs=2, num_train_timesteps=1)
    config["scheduler"] = {"dynamics_type": "ODE", "noise_level": 0.0}
    _run(tmp_path, config)
    run_dir = tmp_path / "saves" / "run"
    history = json.loads((run_dir / "history.json").read_text())["train"]
    assert [r["epoch"] for r in history] == [0, 1] and "train/positive_loss" in history[-1]
    lora_dir = run_dir / "checkpoints" / "epoch_2"
    pipe_cls = get_adapter_class(model_type).pipeline_class
    base = _pipeline_output(pipe_cls, path, None, model_type)
    tuned = _pipeline_output(pipe_cls, path, lora_dir, model_type)
    assert not torch.allclose(base, tuned, atol=1e-6), "the trained LoRA does not change the output"


def test_a_resumed_full_fine_tune_keeps_the_starting_weights_as_its_kl_reference(tmp_path, tiny_sd3_path):
    """Invariant 5 with a KL to the reference: the reference of a full fine-tune is the pipeline's weights, copied
    before a checkpoint loads, so a resumed run pulls toward the same weights as the uninterrupted one (a copy
    taken after the resume would pull toward epoch 1's weights, and end elsewhere)."""
    from test_sharded_training import FULL_KL_STEP

    def config(folder, epochs):
        c = tiny_run_config(folder, "sd3-5", tiny_sd3_path, max_epochs=epochs, group_size=4,
                            **{**LINEAR_STEP, **FULL_KL_STEP})
        c["model"]["finetune_type"] = "full"
        c["eval"]["eval_freq"] = 0
        c["rewards"] = [{"name": "brightness", "reward_model": "helpers_rewards.MeanBrightness"}]
        return c

    _run(tmp_path / "a", config(tmp_path / "a", 2))
    _run(tmp_path / "b", config(tmp_path / "b", 1))
    resumed = config(tmp_path / "b", 2)
    resumed["model"]["resume_path"] = str(tmp_path / "b" / "saves" / "run")
    resumed["log"]["run_name"] = "run"
    _run(tmp_path / "b", resumed)

    from diffusers import SD3Transformer2DModel

    def weights(folder, epoch):
        return SD3Transformer2DModel.from_pretrained(
            folder / "saves" / "run" / "checkpoints" / f"epoch_{epoch}" / "transformer").state_dict()

    straight, again, after_one = weights(tmp_path / "a", 2), weights(tmp_path / "b", 2), weights(tmp_path / "a", 1)
    assert max(float((straight[k] - after_one[k]).abs().max()) for k in straight) > 1e-4  # epoch 2 moved them
    for key, value in straight.items():
        torch.testing.assert_close(again[key], value, atol=1e-6, rtol=0, msg=key)


@pytest.mark.parametrize("batched", [False, True], ids=["per-step-bf16", "steps-in-one-call"])
def test_resume_matches_an_uninterrupted_run(tmp_path, tiny_sd3_path, batched, monkeypatch):
    """Invariant 5, in bf16 autocast with fp16 trajectories (a GPU's precision); also in float32 with the
    window's 2 steps trained in one transformer call."""
    if not batched:
        monkeypatch.setenv("FF_CPU_MIXED_PRECISION", "1")
    extra = dict(steps_per_call="all") if batched else {}

    def config(folder, epochs):
        c = tiny_run_config(folder, "sd3-5", tiny_sd3_path, max_epochs=epochs, **extra)
        if batched:
            c["scheduler"]["num_sde_steps"] = 2
        return c

    straight = config(tmp_path / "a", 4)
    _run(tmp_path / "a", straight)

    first = config(tmp_path / "b", 2)
    _run(tmp_path / "b", first)
    resumed = config(tmp_path / "b", 4)
    resumed["model"]["resume_path"] = str(tmp_path / "b" / "saves" / "run" / "checkpoints" / "epoch_2")
    resumed["log"]["run_name"] = "resumed"
    _run(tmp_path / "b", resumed)

    from safetensors.torch import load_file
    a = load_file(tmp_path / "a" / "saves" / "run" / "checkpoints" / "epoch_4" / "pytorch_lora_weights.safetensors")
    b = load_file(tmp_path / "b" / "saves" / "resumed" / "checkpoints" / "epoch_4" / "pytorch_lora_weights.safetensors")
    assert a.keys() == b.keys() and len(a) > 0
    moved = 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)
        moved += int(a[k].abs().max() > 0)
    assert moved > 0, "training did not move the LoRA weights"


def test_config_error_stops_before_anything_loads(tmp_path, tiny_sd3_path, capsys):
    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path)
    config["train"]["learnig_rate"] = 1e-4
    assert main([str(write_config(tmp_path, config))]) == 2
    err = capsys.readouterr().err
    assert "train.learnig_rate: unknown key; did you mean train.learning_rate?" in err
    assert not (tmp_path / "saves").exists()


def test_print_config_shows_resolved_defaults(tmp_path, tiny_sd3_path, capsys):
    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path)
    assert main(["--print-config", str(write_config(tmp_path, config)), "train.learning_rate=5e-4"]) == 0
    out = capsys.readouterr().out
    assert "learning_rate: 0.0005" in out and "dynamics_type: Flow-SDE" in out and "kl_beta:" in out


# --- one process and two make the same update (DESIGN invariant 4) -----------------------------

U = 2.0 ** -24  # float32 unit roundoff

# AdamW with an epsilon far above sqrt(v) is momentum SGD: the denominator sqrt(v_hat) + eps rounds to
# eps exactly while sqrt(v_hat) < ulp(1e8) / 2 = 4 (gradient entries here are < 1e-2), so a step is
# (lr / eps) * m_hat, linear in the gradient. Plain Adam's m / sqrt(v) is ~sign(g) at the first step:
# it turns a rounding-level difference of a small gradient entry into a full-size difference of a
# weight. lr / eps = 10 moves the LoRA about as far as Adam at lr 1e-3; no weight decay (it scales with lr).
LINEAR_STEP = {"learning_rate": 1e9, "adam_epsilon": 1e8, "adam_weight_decay": 0.0}
EPOCHS, SAMPLES, STEPS = 2, 8, 1  # 2 epochs of 2 prompts x 4 samples, each trained at its one SDE step of 3
# The longest float32 sum behind one LoRA gradient entry runs over rows: every sample, at every
# trained step, in both halves of CFG, at every token of the text stream (77 CLIP + 256 T5; the image
# stream has 4 x 4 = 16); the linear step then adds the epochs' gradients.
TERMS = EPOCHS * SAMPLES * STEPS * 2 * (77 + 256)
# The two runs do the same arithmetic, rounded differently: each process shuffles its own
# micro-batches and the all-reduce adds two halves, so the sums are taken in other orders; and one
# process reads its weights from the memory-mapped file while a distributed run copies them to
# "cpu:0", so SIMD kernels see other alignments and round each forward and backward differently.
# A sum of n terms, in any order, is within (n - 1) u sum|t| of the exact sum, so two orders differ by
# at most 2 (n - 1) u sum|t|: 2 n u of the sum when the terms do not cancel. GRPO's terms have random
# signs (advantages are +-, SDE noise is +-), so sum|t| ~ sqrt(n) |sum t|, but then the rounding errors
# have random signs too and add up to ~sqrt(2 n) u sum|t|, again ~2 n u of the sum. The weights' change
# is a fixed multiple of that sum (linear step), so the two runs' LoRAs may differ by 2 n u = 1.3e-3 of
# how far the weights moved. Measured here: 0.6e-5 to 4.6e-5 (5 seeds, ATEN_CPU_CAPABILITY avx2 and
# default); an update that really differs, by 2 % in the wrong variant below, shows as 2e-2.
# Qwen-Image-2.1's sums have fewer terms (no CFG, one sequence of at most 54 text and 16 image tokens): for it the
# bound is looser.
TOLERANCE = 2 * TERMS * U

# Each model's run (SAMPLES samples an epoch). SD3: 2 prompts x 4 samples, so each process samples one
# prompt. Qwen-Image-2.1 calls its transformer once per text length (``velocity``): 4 prompts of 4 text
# lengths x 2 samples in micro-batches of 4, so every micro-batch holds two lengths or more, and each
# backward follows several forwards of the DDP-wrapped transformer.
SAME_UPDATE_RUNS = {"sd3-5": {"group_size": 4},
                    "qwen-image-2.1": {"group_size": 2, "unique_sample_num_per_epoch": 4, "per_device_batch_size": 4}}
PROMPTS_OF_FOUR_LENGTHS = ["a cat", "a red circle", "a cat on a mat", "two yellow stars in a dark blue sky"]


def _train_in_subprocess(folder: Path, model_path, processes: int, model_type: str = "sd3-5", **train) -> dict:
    """The real CLI in its own process (``accelerate launch`` for 2, gloo on CPU) with a deadline:
    a distributed hang fails, it does not stall CI. Returns the final LoRA."""
    return _start_training(folder, model_path, processes, model_type, **train)()


def _start_training(folder: Path, model_path, processes: int, model_type: str = "sd3-5", **train):
    """``_train_in_subprocess`` started, not awaited: call the result for the final LoRA. A one-process run
    (the reference) runs in this process, to its end, before this returns."""
    from safetensors.torch import load_file

    config = tiny_run_config(folder, model_type, model_path, max_epochs=EPOCHS,
                             **{**SAME_UPDATE_RUNS[model_type], **LINEAR_STEP, **train})
    if model_type == "qwen-image-2.1":
        Path(config["data"]["dataset_dir"], "train.txt").write_text("\n".join(PROMPTS_OF_FOUR_LENGTHS) + "\n")
    config["eval"]["eval_freq"] = 0
    config["rewards"] = [{"name": "brightness", "reward_model": "helpers_rewards.MeanBrightness"}]
    # one thread in every process of both runs: no thread-count-dependent kernel splits
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))}
    # the launch as Flow-Factory's users write it: the process count and port as flags (a free port:
    # two test runs at once must not share one)
    command = [sys.executable, "-m", "flow_factory.train", str(write_config(folder, config)),
               "--num_processes", str(processes), "--main_process_port", str(_free_port())]

    def lora() -> dict:
        return load_file(folder / "saves" / "run" / "checkpoints" / f"epoch_{EPOCHS}" /
                         "pytorch_lora_weights.safetensors")
    if processes == 1:  # the reference: the same main, in this process
        (_, stderr), code = ff_train_in_this_process(command[3:])
        assert code == 0, f"1 process: exit {code}\n{stderr[-4000:]}"
        return lora
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def finish() -> dict:
        try:
            _, stderr = process.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        assert process.returncode == 0, f"{processes} process(es): exit {process.returncode}\n{stderr[-4000:]}"
        return lora()
    return finish


def _difference_over_movement(reference: dict, other: dict) -> tuple[float, float]:
    """(largest |other - reference| / how far ``reference`` moved, how far it moved). LoRA's B
    matrices start at zero, so their largest entry is how far the weights moved."""
    assert reference.keys() == other.keys() and reference
    moved = max(float(v.abs().max()) for k, v in reference.items() if "lora_B" in k)
    difference = max(float((other[k].double() - v.double()).abs().max()) for k, v in reference.items())
    return difference / moved, moved


def _text_lengths(model_type: str, model_path, prompts: list[str]) -> list[int]:
    """The prompts' text lengths (unpadded tokens), as the model encodes them."""
    adapter = get_adapter_class(model_type).from_pretrained(str(model_path))
    return adapter.encode(prompts, guidance_scale=1.0)["prompt_embeds_mask"].sum(1).tolist()

@pytest.mark.parametrize("model_type", SAME_UPDATE_RUNS)
def test_two_processes_make_the_same_update_as_one(tmp_path, model_type, request):
    """DESIGN invariant 4: the same global batch on 1 and on 2 processes gives the same LoRA after 2
    epochs (the same advantages, the same averaged gradient, the same second-epoch prompts), up to
    float32 rounding (TOLERANCE, derived above), also where a micro-batch's loss comes from several
    forwards of the DDP-wrapped transformer (Qwen-Image-2.1, SAME_UPDATE_RUNS); and a run that really
    makes a different update is rejected (one process suffices for that: it checks the comparison, not
    the launch)."""
    model_path = request.getfixturevalue(TINY_MODELS[model_type][0])
    if model_type == "qwen-image-2.1":  # four text lengths: velocity calls the transformer once per length
        lengths = _text_lengths(model_type, model_path, PROMPTS_OF_FOUR_LENGTHS)
        assert len(set(lengths)) == len(PROMPTS_OF_FOUR_LENGTHS), lengths
    # the deliberately wrong variant: an update 2 % larger, which the comparison must reject
    runs = [_start_training(tmp_path / "p1", model_path, 1, model_type),
            _start_training(tmp_path / "wrong", model_path, 1, model_type,
                            learning_rate=1.02 * LINEAR_STEP["learning_rate"])]
    one, wrong = (finish() for finish in runs)
    two = _train_in_subprocess(tmp_path / "p2", model_path, 2, model_type)
    # each process encoded its share of the prompt cache (shards are named by the rank that wrote them)
    assert {p.name[:3] for p in (tmp_path / "p2" / "prompt_cache").rglob("*.safetensors")} == {"000", "001"}
    relative, moved = _difference_over_movement(one, two)
    assert moved > 1e-4, f"training did not move the LoRA (largest B entry {moved:.2e})"
    assert relative <= TOLERANCE, (f"1 and 2 processes differ by {relative:.2e} of how far the weights moved "
                                   f"(float32 rounding allows {TOLERANCE:.2e})")

    # the comparison rejects the wrong variant and measures it (the first epoch's change is 1.02x, the
    # second's nearly)
    relative_wrong, _ = _difference_over_movement(one, wrong)
    assert relative_wrong > TOLERANCE, f"a 2 % larger update passed as the same ({relative_wrong:.2e})"
    assert 0.01 < relative_wrong < 0.04, relative_wrong
