"""scheduler.flow_shift: a static shift of each family's sigma schedule, checked against the closed form
sigma' = s * g / (1 + (s - 1) * g) of the unshifted grid g (a shift of 1), also where the pipeline's
own shift depends on the resolution (FLUX.1, FLUX.2).

SD3 and Wan take the scheduler's default grid, linspace(1, sigma_min, n), whose end is the shifted
sigma of the last of 1000 training timesteps: with shift s, sigma_min = s * 0.001 / (1 + (s - 1) * 0.001)."""

import pytest
import torch

from flow_factory.config import parse_config
from flow_factory.models import load_adapter
from flow_factory.trainer import Trainer
from helpers_runs import tiny_run_config

FAMILIES = [("sd3-5", "tiny_sd3_path", None), ("flux1", "tiny_flux_path", None), ("wan2_t2v", "tiny_wan_path", 5),
            ("z-image", "tiny_z_image_path", None), ("flux2", "tiny_flux2_path", None)]
DEFAULT_GRID = ("sd3-5", "wan2_t2v")


def shifted(s, g):
    return s * g / (1 + (s - 1) * g)


@pytest.mark.parametrize("model_type,fixture,frames", FAMILIES)
def test_flow_shift_is_the_closed_form_shift_of_the_unshifted_grid(request, model_type, fixture, frames):
    adapter = load_adapter(model_type, request.getfixturevalue(fixture))
    size = 32 if frames else 64
    own = adapter.sigmas(4, size, size, frames)
    adapter.set_flow_shift(1.0)
    grid = adapter.sigmas(4, size, size, frames).double()
    adapter.set_flow_shift(2.5)
    sigmas = adapter.sigmas(4, size, size, frames).double()
    if model_type in DEFAULT_GRID:
        torch.testing.assert_close(grid[:-1], torch.linspace(1, 0.001, 4, dtype=torch.float64), rtol=0, atol=1e-6)
        grid = torch.cat([torch.linspace(1, shifted(2.5, 0.001), 4, dtype=torch.float64), grid[-1:]])
    torch.testing.assert_close(sigmas, shifted(2.5, grid), rtol=0, atol=1e-6)
    assert sigmas[-1] == 0 and not torch.allclose(sigmas.float(), own)  # it replaced the model's own schedule
    if model_type in ("flux1", "flux2"):  # no longer resolution-dependent
        torch.testing.assert_close(adapter.sigmas(4, 128, 128, frames).double(), sigmas, rtol=0, atol=0)


def test_the_trainer_samples_on_the_configured_shift(tmp_path, tiny_sd3_path):
    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path)
    config["scheduler"]["flow_shift"] = 1.0
    config["log"]["logging_backend"] = "none"
    trainer = Trainer(parse_config(config))
    # SD3's scheduler grid with no shift: linspace(1, 0.001, 3) then 0
    expected = torch.tensor([1.0, 0.5005, 0.001, 0.0])
    torch.testing.assert_close(trainer.adapter.sigmas(3, 64, 64), expected)
    assert trainer.adapter.pipeline.scheduler.config.shift == 1.0  # pipeline(...) samples on it too
    trainer.run_folder.release()
