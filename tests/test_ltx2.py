"""LTX-2 (ltx2_t2av) beyond the shared tables: the noise on the video alone, the flat latent's size, and the
soundtrack for the rewards that ask for it. (Its ODE rollout equals LTX2Pipeline's, video and audio, in
test_adapters.py; the ratio is 1 under every SDE in test_on_policy.py; ff-train in test_train_cli.py.)"""

import json
from dataclasses import replace

import pytest
import torch
from helpers_algorithms import batch_at_step

from flow_factory.algorithms import make_algorithm
from flow_factory.algorithms.kl import x_based_kl
from flow_factory.config import ConfigError
from flow_factory.config.train import TrainConfig
from flow_factory.data.prompts import PromptItem
from flow_factory.dynamics import ODE, FlowSDE, PartlyStochastic
from flow_factory.models import apply_lora, load_adapter
from flow_factory.models.preflight import check_reward_inputs
from flow_factory.rewards import RewardSet
from flow_factory.rewards.base import PointwiseRewardModel, RewardInputs, RewardModelOutput
from flow_factory.trajectory import TrajectoryOptions, sample_trajectory
from flow_factory.sampling import SamplingServices, SamplingSettings, collect_rollouts
from flow_factory.trainer.policy import AdapterPolicy

SIZE, FRAMES = 32, 9


@pytest.fixture
def adapter(tiny_ltx2_path):
    return load_adapter("ltx2_t2av", tiny_ltx2_path)


def test_the_latent_is_video_then_audio_and_remembers_its_size(adapter):
    (n,) = adapter.latent_shape(SIZE, SIZE, FRAMES)
    g = adapter.geometry(torch.zeros(2, n))
    # 9 frames at 32x32 through the VAE (x8, x2): 5 x 4 x 4 tokens of 4 channels; 9 audio frames at 24 fps
    assert (g.frames, g.height, g.width, g.audio_frames) == (5, 4, 4, 9)
    assert g.video_tokens == (80, 4) and g.audio_tokens == (9, 4) and n == 80 * 4 + 9 * 4
    adapter.latent_shape(SIZE, 2 * SIZE, FRAMES)
    with pytest.raises(ValueError, match="as long as another size's"):  # the same length, transposed
        adapter.latent_shape(2 * SIZE, SIZE, FRAMES)
    with pytest.raises(ValueError, match="no size gave latents of length 7"):
        adapter.velocity(torch.zeros(1, 7), torch.tensor(0.5), {}, 1.0)
    with pytest.raises(ValueError, match="1 \\+ a multiple of 2"):
        adapter.latent_shape(SIZE, SIZE, 8)


def test_the_noise_reaches_the_video_and_the_audio_follows_the_ode(adapter):
    """Flow-Factory's LTX-2: the SDE on the video tokens, the ODE on the audio ones; an ODE is left as it is."""
    assert isinstance(adapter.sampling_dynamics(ODE()), ODE)
    dynamics = adapter.sampling_dynamics(FlowSDE(0.7))
    assert isinstance(dynamics, PartlyStochastic)
    cond = adapter.encode(["a dog barking"], None, 1.0)
    x = adapter.initial_noise(1, SIZE, SIZE, torch.Generator().manual_seed(0), num_frames=FRAMES)
    sigmas = adapter.sigmas(2, SIZE, SIZE, FRAMES)
    traj = sample_trajectory(adapter, dynamics, cond, x, sigmas, 1.0, generator=torch.Generator().manual_seed(1))
    video_numel = adapter.geometry(x).video_numel
    with torch.no_grad():
        v = adapter.velocity(traj.latents[:, 0], sigmas[0], cond, 1.0)
    ode = traj.latents[:, 0] + v * (sigmas[1] - sigmas[0])
    assert torch.equal(traj.latents[:, 1, video_numel:], ode[:, video_numel:])
    assert (traj.latents[:, 1, :video_numel] - ode[:, :video_numel]).abs().max() > 0.05
    assert dynamics.stochastic_part(x).shape == (1, video_numel)


def test_x_based_kl_and_grpo_guard_read_the_video_alone(adapter):
    """The x-based KL of a step is the video's Gaussian KL (the audio's scale is 0), and GRPO-Guard's
    normalised ratio is 1 on-policy."""
    apply_lora(adapter.transformer, 4, 4, "default", adapter.default_lora_targets)
    with torch.no_grad():
        for name, p in adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
    dynamics = adapter.sampling_dynamics(FlowSDE(0.7))
    policy = AdapterPolicy(adapter, 4.0, "lora", keep_reference=False)
    cond = adapter.encode(["a dog barking", "rain on a roof"], None, 4.0)
    x = adapter.initial_noise(2, SIZE, SIZE, torch.Generator().manual_seed(0), num_frames=FRAMES)
    sigmas = adapter.sigmas(2, SIZE, SIZE, FRAMES)
    traj = sample_trajectory(adapter, dynamics, cond, x, sigmas, 4.0, generator=torch.Generator().manual_seed(1),
                             options=TrajectoryOptions(record_means=True))
    batch = batch_at_step(traj.latents, traj.log_probs, torch.tensor([1.0, -1.0]), traj.sigmas, cond, 0,
                          old_means=traj.means)
    grpo = make_algorithm("grpo", TrainConfig(kl_type="x-based", kl_beta=0.1), dynamics)
    _, metrics = grpo.loss(policy, batch)
    with torch.no_grad():
        mean, std = dynamics.mean_and_std(batch.x, policy.velocity(batch.x, batch.sigma, cond), sigmas[0], sigmas[1])
        mean_ref, _ = dynamics.mean_and_std(batch.x, policy.reference_velocity(batch.x, batch.sigma, cond),
                                            sigmas[0], sigmas[1])
    n = adapter.geometry(x).video_numel
    expected = x_based_kl(mean[:, :n], mean_ref[:, :n], std[:, :n]).mean()
    assert metrics["kl"] > 0 and torch.isfinite(metrics["kl"])
    torch.testing.assert_close(metrics["kl"], expected, rtol=1e-5, atol=0)

    guard = make_algorithm("grpo-guard", TrainConfig(clip_range=1e-5), dynamics)
    _, metrics = guard.loss(policy, batch)
    assert abs(metrics["ratio_min"].item() - 1) < 1e-6 and abs(metrics["ratio_max"].item() - 1) < 1e-6


class Loudness(PointwiseRewardModel):
    """The mean absolute sample of the soundtrack, received as one tensor."""

    required_fields = ("prompt", "audio")
    use_tensor_inputs = True

    def __call__(self, prompt, audio, audio_sample_rate):  # Flow-Factory's CLAP reward's signature
        self.seen = (audio, audio_sample_rate)
        return RewardModelOutput(audio.abs().mean(dim=(1, 2)))


class Peak(PointwiseRewardModel):
    """The loudest sample, from numpy arrays (the non-tensor form); asks for the rate by name."""

    required_fields = ("audio", "audio_sample_rate")

    def __call__(self, audio, audio_sample_rate):
        self.seen = (audio, audio_sample_rate)
        return RewardModelOutput([float(abs(a).max()) for a in audio])


class Brightness(PointwiseRewardModel):
    required_fields = ("video",)
    use_tensor_inputs = True

    def __call__(self, video):
        return RewardModelOutput(video.mean(dim=(1, 2, 3, 4)))


def _rollouts(adapter, rewards):
    items = [PromptItem("a dog barking"), PromptItem("rain on a roof")]
    settings = SamplingSettings(SIZE, SIZE, FRAMES, num_steps=2, guidance_scale=1.0, batch_size=2, seed=0)
    return collect_rollouts(adapter, ODE(), items, torch.tensor([0, 1]), [0, 1], settings, epoch=0,
                            services=SamplingServices(rewards))


def test_rewards_that_ask_for_the_audio_receive_it(adapter):
    loud, peak = Loudness(), Peak()
    rollouts = _rollouts(adapter, RewardSet({"loud": loud, "peak": peak}, {"loud": 1.0, "peak": 1.0}))
    waveforms, rate = adapter.decode_audio(rollouts.latents[:, -1])
    assert waveforms.shape == (2, 2, 5280) and rate == 16000  # stereo, a third of a second at 16 kHz
    audio, rates = loud.seen
    assert torch.equal(audio, waveforms) and rates == [16000, 16000]
    torch.testing.assert_close(rollouts.rewards["loud"], waveforms.abs().mean(dim=(1, 2)))
    arrays, rates = peak.seen
    assert [a.shape for a in arrays] == [(2, 5280)] * 2 and rates == [16000, 16000]
    torch.testing.assert_close(rollouts.rewards["peak"], waveforms.abs().amax(dim=(1, 2)))


def test_the_audio_is_decoded_only_when_a_reward_asks(adapter, monkeypatch):
    def refuse(_):
        raise AssertionError("decoded the audio that no reward asked for")

    monkeypatch.setattr(adapter, "decode_audio", refuse)
    rollouts = _rollouts(adapter, RewardSet({"bright": Brightness()}, {"bright": 1.0}))
    assert rollouts.rewards["bright"].shape == (2,)


def test_reward_inputs_carry_the_audio_and_its_rate():
    audio = torch.rand(3, 2, 10, generator=torch.Generator().manual_seed(0)) * 2 - 1
    inputs = RewardInputs(["a", "b", "c"], audio=audio, audio_sample_rate=16000)
    part = inputs.select([2, 0])
    assert torch.equal(part.audio, audio[[2, 0]]) and part.audio_sample_rate == 16000
    assert torch.equal(RewardInputs.concat([part, inputs.select([1])]).audio, audio[[2, 0, 1]])
    arrays = inputs.pil("audio")  # the non-tensor form, and back
    assert [a.shape for a in arrays] == [(2, 10)] * 3
    assert torch.equal(RewardInputs(["a", "b", "c"], audio=arrays, audio_sample_rate=16000).tensors("audio"), audio)
    other = RewardInputs(["d"], audio=audio[:1], audio_sample_rate=24000)
    with pytest.raises(ValueError, match="several sample rates"):
        RewardInputs.concat([inputs, other])
    with pytest.raises(ValueError, match="needs its audio_sample_rate"):
        RewardInputs(["a"], audio=audio[:1])


def test_a_reward_asking_for_audio_from_a_silent_model_fails_before_loading():
    rewards = RewardSet({"loud": Loudness(), "bright": Brightness()}, {"loud": 1.0, "bright": 1.0})
    check_reward_inputs(rewards, "ltx2_t2av", "rewards")
    with pytest.raises(ConfigError, match="rewards: loud ask\\(s\\) for audio, which model.model_type 'wan2_t2v' "
                                          "does not make"):
        check_reward_inputs(rewards, "wan2_t2v", "rewards")


def test_flow_factorys_ltx2_example_keys_load():
    """The model, train and eval keys of Flow-Factory's LTX-2 example (examples/grpo/lora/ltx2_t2av.yaml): its
    guidance keys at the values it writes (CFG alone, 24 fps, no prompt enhancement); other values refused."""
    from test_config import minimal

    from flow_factory.config import parse_config

    sampling = {"stg_scale": 0.0, "modality_scale": 1.0, "guidance_rescale": 0.0, "audio_guidance_scale": None,
                "audio_stg_scale": None, "audio_modality_scale": None, "audio_guidance_rescale": None,
                "frame_rate": 24.0, "system_prompt": None, "prompt_enhancement_seed": 10}
    model = {"model_name_or_path": "Lightricks/LTX-2", "model_type": "ltx2_t2av", "target_components": "transformer",
             "target_modules": "default"}
    train = {"resolution": [512, 768], "num_frames": 41, "num_inference_steps": 20, "guidance_scale": 4.0}
    data = minimal(model=model, train={**train, **sampling},
                   eval={"resolution": [512, 768], "num_frames": 121, "guidance_scale": 4.0, **sampling})
    cfg = parse_config(data)
    assert (cfg.model.model_type, cfg.train.num_frames, cfg.eval.num_frames) == ("ltx2_t2av", 41, 121)
    with pytest.raises(ConfigError, match="train.stg_scale: 1.0; only 0 here: LTX-2 samples with classifier-free "
                                          "guidance alone"):
        parse_config(minimal(model=model, train={**train, "stg_scale": 1.0}))
    with pytest.raises(ConfigError, match="eval.audio_guidance_scale: 7.0; only None here"):
        parse_config(minimal(model=model, train=train, eval={"audio_guidance_scale": 7.0}))
    with pytest.raises(ConfigError, match="train.num_frames: ltx2_t2av needs 8k \\+ 1 frames"):
        parse_config(minimal(model=model, train={**train, "num_frames": 40}))


def test_ff_sample_puts_each_samples_soundtrack_in_its_mp4_or_beside_its_gif(tmp_path, tiny_ltx2_path):
    """Sample i's mp4 carries the soundtrack its ODE latent decodes to (``decode_audio``), at its rate and length,
    within AAC's error (some 6 % of the signal's RMS here); with --video-format gif it is a WAV file beside the
    GIF, equal to 16-bit rounding, which tells the two samples apart (the tiny vocoder's soundtracks differ by
    up to 77 levels, under AAC's error). The grid stays silent."""
    import av
    import numpy as np
    import wave

    from flow_factory.sample import main as ff_sample
    from flow_factory.sampling import sample_prompts

    prompts = ["a dog barking", "rain on a roof"]
    args = [str(tiny_ltx2_path), "--model-type", "ltx2_t2av", "--prompts", *prompts, "--steps", "2",
            "--resolution", str(SIZE), "--num-frames", str(FRAMES), "--seed", "3"]
    assert ff_sample([*args, "--out", str(tmp_path / "mp4")]) == 0
    settings = SamplingSettings(SIZE, SIZE, FRAMES, num_steps=2, guidance_scale=1.0, batch_size=8, seed=3)
    rollouts = sample_prompts(load_adapter("ltx2_t2av", tiny_ltx2_path), [PromptItem(p) for p in prompts],
                              replace(settings, keep_audio=True))
    expected, rate = rollouts.audio.numpy(), rollouts.audio_sample_rate
    assert expected.shape == (2, 2, 5280) and rate == 16000

    def soundtrack(path):
        with av.open(str(path)) as container:
            stream = container.streams.audio[0]
            return np.concatenate([f.to_ndarray() for f in container.decode(stream)], 1), stream.sample_rate

    def rms(a, b):
        return float(np.sqrt(np.mean((a - b) ** 2)))

    for i in range(2):
        decoded, decoded_rate = soundtrack(tmp_path / "mp4" / f"{i:04d}.mp4")
        decoded = decoded[:, :expected.shape[2]]
        assert decoded_rate == 16000 and decoded.shape == expected[i].shape
        assert rms(decoded, expected[i]) < 0.15 * np.sqrt(np.mean(expected[i] ** 2))
    with av.open(str(tmp_path / "mp4" / "grid.mp4")) as container:
        assert not container.streams.audio

    assert ff_sample([*args, "--out", str(tmp_path / "gif"), "--video-format", "gif"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "gif" / "samples.jsonl").read_text().splitlines()]
    assert [(r["file"], r["audio"]) for r in rows] == [("0000.gif", "0000.wav"), ("0001.gif", "0001.wav")]
    with wave.open(str(tmp_path / "gif" / "0001.wav")) as f:
        assert (f.getnchannels(), f.getframerate()) == (2, 16000)
        pcm = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2").reshape(-1, 2).T
    assert np.abs(pcm / 32767 - np.clip(expected[1], -1, 1)).max() <= 0.5 / 32767 + 1e-6
    assert np.abs(pcm / 32767 - np.clip(expected[0], -1, 1)).max() > 10 / 32767
