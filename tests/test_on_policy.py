"""DESIGN invariant 1: on-policy, the importance ratio is exactly 1, for every adapter
and every SDE dynamics, because sampling and training call the same velocity()."""

import pytest
import torch
from helpers_algorithms import assert_on_policy, batch_at_step, perturb_lora

from flow_factory.algorithms import make_algorithm
from flow_factory.config.train import TrainConfig
from flow_factory.dynamics import make_dynamics
from flow_factory.models import load_adapter
from flow_factory.models.lora import apply_lora
from flow_factory.trajectory import TrajectoryOptions, sample_trajectory
from flow_factory.trainer.policy import AdapterPolicy

ADAPTERS = [("sd3-5", "tiny_sd3_path", 64, None, 3.0), ("flux1", "tiny_flux_path", 64, None, 3.5),
            ("wan2_t2v", "tiny_wan_path", 32, 5, 3.0), ("qwen-image", "tiny_qwen_image_path", 64, None, 4.0),
            ("z-image", "tiny_z_image_path", 64, None, 4.0), ("flux2", "tiny_flux2_path", 64, None, 4.0),
            ("flux2-klein", "tiny_flux2_klein_base_path", 64, None, 3.0),  # Klein base: CFG
            ("hunyuanvideo15", "tiny_hunyuan_video15_path", 32, 5, 4.0),
            ("ltx2_t2av", "tiny_ltx2_path", 32, 9, 4.0),  # the noise on the video, the audio on the ODE
            ("qwen-image-2.1", "tiny_qwen_image21_path", 64, None, 4.0)]
TRAIN = TrainConfig(kl_type="v-based")  # defaults: clip_range 1e-4, adv_clip_range 5, no KL


@pytest.mark.parametrize("dynamics_name", ["Flow-SDE", "Dance-SDE", "CPS"])
@pytest.mark.parametrize("model_type,path_fixture,size,frames,guidance", ADAPTERS)
def test_on_policy_ratio_is_one(request, model_type, path_fixture, size, frames, guidance, dynamics_name,
                                test_precision):
    """On a GPU (FF_TEST_DEVICE=cuda) in bf16 too: the ratio is still exactly 1, since training recomputes each
    step from the very values sampled, through the same calls in the same precision."""
    device, dtype, autocast = test_precision
    adapter = load_adapter(model_type, request.getfixturevalue(path_fixture), device, dtype)
    apply_lora(adapter.transformer, 4, 4, "default", adapter.default_lora_targets)
    perturb_lora(adapter.transformer)
    dynamics = adapter.sampling_dynamics(make_dynamics(dynamics_name, 0.7))  # as the trainer makes it
    algorithm = make_algorithm("grpo", TRAIN, dynamics)
    policy = AdapterPolicy(adapter, guidance, "lora", keep_reference=False)

    cond = adapter.encode(["a red cube", "a blue ball"], None, guidance)
    noise = adapter.initial_noise(2, size, size, torch.Generator().manual_seed(1), num_frames=frames)
    sigmas = adapter.sigmas(3, size, size, frames)
    traj = sample_trajectory(adapter, dynamics, cond, noise.to(device), sigmas, guidance,
                             generator=torch.Generator().manual_seed(2), options=TrajectoryOptions(autocast=autocast))
    assert traj.sde_steps == [0, 1, 2]
    assert_on_policy(algorithm, policy, traj, cond, autocast=autocast)


@pytest.mark.parametrize("storage", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dynamics_name", ["Flow-SDE", "CPS"])
def test_half_precision_storage_halves_the_trajectory_and_keeps_the_ratio_at_one(tiny_sd3_path, storage,
                                                                                 dynamics_name):
    """train.latent_storage_dtype: the stored trajectory takes half the bytes of float32, stays the
    float32 trajectory up to rounding, and training on it (through on_device, as the trainer does)
    finds the ratio 1 within 1e-6, as with float32 storage: the rollout integrates on the stored values."""
    from flow_factory.sampling import on_device

    adapter = load_adapter("sd3-5", tiny_sd3_path)
    apply_lora(adapter.transformer, 4, 4, "default", adapter.default_lora_targets)
    perturb_lora(adapter.transformer)
    dynamics = make_dynamics(dynamics_name, 0.7)
    algorithm = make_algorithm("grpo", TRAIN, dynamics)
    policy = AdapterPolicy(adapter, 3.0, "lora", keep_reference=False)
    cond = adapter.encode(["a red cube", "a blue ball"], None, 3.0)
    noise = adapter.initial_noise(2, 64, 64, torch.Generator().manual_seed(1))
    sigmas = adapter.sigmas(3, 64, 64, None)
    full, half = (sample_trajectory(adapter, dynamics, cond, noise, sigmas, 3.0,
                                    generator=torch.Generator().manual_seed(2),
                                    options=TrajectoryOptions(storage_dtype=dtype)) for dtype in (None, storage))

    assert full.latents.dtype == torch.float32 and half.latents.dtype == storage
    assert half.latents.untyped_storage().nbytes() * 2 == full.latents.untyped_storage().nbytes()
    rounding = 2.0 ** -8 if storage == torch.bfloat16 else 2.0 ** -11  # relative step of the format
    scale = full.latents.abs().max().item()
    assert (half.latents.float() - full.latents).abs().max().item() < 8 * rounding * scale
    for step in half.sde_steps:
        batch = on_device(batch_at_step(half.latents, half.log_probs, torch.tensor([1.0, -1.0]), half.sigmas,
                                         cond, step), "cpu")
        assert batch.x.dtype == batch.x_next.dtype == torch.float32
        _, metrics = algorithm.loss(policy, batch)
        assert abs(metrics["ratio_min"].item() - 1) < 1e-6 and abs(metrics["ratio_max"].item() - 1) < 1e-6, \
            (step, metrics)
