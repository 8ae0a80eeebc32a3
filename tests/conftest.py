"""Shared fixtures: each tiny pipeline is built once per test session, offline.

Tests load them with ``Pipeline.from_pretrained(path)`` or
``flow_factory.models.load_adapter(model_type, path)``; every load gives fresh
modules, so a test may add LoRA or change weights without affecting others.
"""

import os

# set before diffusers / transformers are imported anywhere: no test touches the network
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# one thread (before torch is imported): the tiny models gain nothing from more, every machine then sums
# in the same order, and a test's subprocesses (ff-train runs) leave the other core to the suite
os.environ.setdefault("OMP_NUM_THREADS", "1")

# bf16 runs (FF_CPU_MIXED_PRECISION, switched on by the tests that run in a GPU's precision) need this cap on
# CPUs whose AMX bf16 kernels crash; it must be set before torch runs any kernel
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
# FF_TEST_DEVICE: the device the invariant tests run on (cpu; cuda on a GPU, as bench/gpu_check.py runs them,
# in bf16). With cpu, a GPU is hidden, so that the trainer's runs are the same on every machine.
TEST_DEVICE = os.environ.setdefault("FF_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Each test's Accelerator starts anew: accelerate keeps one state per process and refuses another
    mixed_precision afterwards (the tests run float32, bf16 and fp16 in one worker)."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture
def gpu_precision(monkeypatch):
    """Runs in this test honour ``mixed_precision`` (bf16 or fp16 autocast) on this CPU, as on a GPU."""
    monkeypatch.setenv("FF_CPU_MIXED_PRECISION", "1")


# FF_TEST_PRECISION: their mixed precision (no, bf16, fp16); by default float32 on cpu and bf16 on a GPU
TEST_PRECISION = os.environ.get("FF_TEST_PRECISION", "no" if TEST_DEVICE == "cpu" else "bf16")


@pytest.fixture
def test_precision():
    """(device, load dtype, autocast factory) of the invariant tests (FF_TEST_DEVICE, FF_TEST_PRECISION)."""
    import torch

    from flow_factory.precision import Precision

    precision = Precision.of(TEST_PRECISION, TEST_DEVICE)
    return torch.device(TEST_DEVICE), precision.load, precision.autocast


def _build(tmp_path_factory, model_type: str):
    from flow_factory.testing import build_tiny_pipeline

    return build_tiny_pipeline(model_type, tmp_path_factory.mktemp("tiny") / model_type)


@pytest.fixture(scope="session")
def tiny_sd3_path(tmp_path_factory):
    """Folder of a tiny StableDiffusion3Pipeline (model_type "sd3-5"); 64x64 images."""
    return _build(tmp_path_factory, "sd3-5")


@pytest.fixture(scope="session")
def tiny_flux_path(tmp_path_factory):
    """Folder of a tiny FluxPipeline (model_type "flux1"); 64x64 images."""
    return _build(tmp_path_factory, "flux1")


@pytest.fixture(scope="session")
def tiny_wan_path(tmp_path_factory):
    """Folder of a tiny WanPipeline (model_type "wan2_t2v"); 5 frames at 32x32."""
    return _build(tmp_path_factory, "wan2_t2v")


@pytest.fixture(scope="session")
def tiny_qwen_image_path(tmp_path_factory):
    """Folder of a tiny QwenImagePipeline (model_type "qwen-image"); 64x64 images."""
    return _build(tmp_path_factory, "qwen-image")


@pytest.fixture(scope="session")
def tiny_z_image_path(tmp_path_factory):
    """Folder of a tiny ZImagePipeline (model_type "z-image", Turbo's scheduler); 64x64 images."""
    return _build(tmp_path_factory, "z-image")


@pytest.fixture(scope="session")
def tiny_wan22_path(tmp_path_factory):
    """Folder of a tiny Wan2.2 A14B-layout WanPipeline (model_type "wan2_t2v"): transformer and
    transformer_2, boundary_ratio 0.875; 5 frames at 32x32."""
    return _build(tmp_path_factory, "wan2.2-a14b")


@pytest.fixture(scope="session")
def tiny_wan22_ti2v_path(tmp_path_factory):
    """Folder of a tiny Wan2.2 TI2V-5B-layout WanPipeline (model_type "wan2_t2v"): expand_timesteps, the
    48-channel x16 Wan2.2 VAE; 5 frames at 32x32."""
    return _build(tmp_path_factory, "wan2.2-ti2v-5b")


@pytest.fixture(scope="session")
def tiny_flux2_path(tmp_path_factory):
    """Folder of a tiny Flux2Pipeline (model_type "flux2"); 64x64 images."""
    return _build(tmp_path_factory, "flux2")


@pytest.fixture(scope="session")
def tiny_flux2_klein_path(tmp_path_factory):
    """Folder of a tiny step-distilled Flux2KleinPipeline (model_type "flux2-klein"); 64x64 images."""
    return _build(tmp_path_factory, "flux2-klein")


@pytest.fixture(scope="session")
def tiny_flux2_klein_base_path(tmp_path_factory):
    """Folder of a tiny Klein base checkpoint (model_type "flux2-klein", is_distilled false: CFG)."""
    return _build(tmp_path_factory, "flux2-klein-base")


@pytest.fixture(scope="session")
def tiny_hunyuan_video15_path(tmp_path_factory):
    """Folder of a tiny HunyuanVideo15Pipeline (model_type "hunyuanvideo15", 8 latent channels, x16 and x4);
    5 frames at 32x32."""
    return _build(tmp_path_factory, "hunyuanvideo15")


@pytest.fixture(scope="session")
def tiny_ltx2_path(tmp_path_factory):
    """Folder of a tiny LTX2Pipeline (model_type "ltx2_t2av"): video with audio; 9 frames at 32x32."""
    return _build(tmp_path_factory, "ltx2_t2av")


@pytest.fixture(scope="session")
def tiny_ltx2_i2av_path(tmp_path_factory):
    """Folder of a tiny LTX2ImageToVideoPipeline (model_type "ltx2_i2av"): tiny_ltx2_path's weights, a condition
    image as the first frame; 9 frames at 32x32."""
    return _build(tmp_path_factory, "ltx2_i2av")


@pytest.fixture(scope="session")
def tiny_flux_kontext_path(tmp_path_factory):
    """Folder of a tiny FluxKontextPipeline (model_type "flux1-kontext"); 64x64 images, condition images of any
    size in multiples of 16."""
    return _build(tmp_path_factory, "flux1-kontext")


@pytest.fixture(scope="session")
def tiny_wan_i2v_path(tmp_path_factory):
    """Folder of a tiny Wan2.1 WanImageToVideoPipeline (model_type "wan2_i2v", CLIP image encoder); 5 frames at
    32x32, one condition image per video."""
    return _build(tmp_path_factory, "wan2_i2v")


@pytest.fixture(scope="session")
def tiny_wan_flf2v_path(tmp_path_factory):
    """Folder of a tiny Wan2.1 first-last-frame-to-video WanImageToVideoPipeline (model_type "wan2_i2v", the
    transformer's pos_embed_seq_len set); 5 frames at 32x32 between two condition images."""
    return _build(tmp_path_factory, "wan2.1-flf2v")


@pytest.fixture(scope="session")
def tiny_wan22_i2v_path(tmp_path_factory):
    """Folder of a tiny Wan2.2 I2V A14B-layout WanImageToVideoPipeline (model_type "wan2_i2v"): two experts,
    boundary_ratio 0.9, no image encoder."""
    return _build(tmp_path_factory, "wan2.2-i2v-a14b")


@pytest.fixture(scope="session")
def tiny_wan_v2v_path(tmp_path_factory):
    """Folder of a tiny WanVideoToVideoPipeline (model_type "wan2_v2v"); 5 frames at 32x32 from a condition video."""
    return _build(tmp_path_factory, "wan2_v2v")


@pytest.fixture(scope="session")
def tiny_qwen_image_edit_path(tmp_path_factory):
    """Folder of a tiny QwenImageEditPlusPipeline (model_type "qwen-image-edit-plus"); 64x64 images, its processor
    folder without a video processor (loaded by the adapter's image-only fallback where torchvision is missing)."""
    return _build(tmp_path_factory, "qwen-image-edit-plus")
