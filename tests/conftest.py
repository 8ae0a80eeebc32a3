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

# The files whose tests take longest (pytest --durations; multi-process launches and whole runs), first in the
# collection: the Makefile's pytest-xdist (--dist loadfile --no-loadscope-reorder) hands files to its workers in
# this order, so no long file starts last and runs alone at the end. The other files keep their order.
LONGEST_FIRST = ("test_train_cli.py", "test_wan22.py", "test_deepspeed.py", "test_sharded_training.py",
                 "test_decoupled_train.py", "test_start_checks.py", "test_run_safety.py", "test_plan.py",
                 "test_conditioned.py", "test_reward_overlap.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


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


# The tiny pipelines: fixture name -> (the kind ``flow_factory.testing.build_tiny_pipeline`` builds, what it is).
# Each name is a session fixture giving that pipeline's folder; ``tiny_pipeline(kind)`` gives any of them.
TINY_PIPELINES = {
    "tiny_sd3_path": ("sd3-5", "StableDiffusion3Pipeline (model_type sd3-5); 64x64 images."),
    "tiny_flux_path": ("flux1", "FluxPipeline (model_type flux1); 64x64 images."),
    "tiny_wan_path": ("wan2_t2v", "WanPipeline (model_type wan2_t2v); 5 frames at 32x32."),
    "tiny_qwen_image_path": ("qwen-image", "QwenImagePipeline (model_type qwen-image); 64x64 images."),
    "tiny_z_image_path": ("z-image", "ZImagePipeline (model_type z-image, Turbo's scheduler); 64x64 images."),
    "tiny_wan22_path": ("wan2.2-a14b", "Wan2.2 A14B-layout WanPipeline (model_type wan2_t2v): transformer and "
                                       "transformer_2, boundary_ratio 0.875; 5 frames at 32x32."),
    "tiny_wan22_ti2v_path": ("wan2.2-ti2v-5b", "Wan2.2 TI2V-5B-layout WanPipeline (model_type wan2_t2v): "
                                               "expand_timesteps, the 48-channel x16 Wan2.2 VAE; 5 frames at 32x32."),
    "tiny_flux2_path": ("flux2", "Flux2Pipeline (model_type flux2); 64x64 images."),
    "tiny_flux2_klein_path": ("flux2-klein", "step-distilled Flux2KleinPipeline (model_type flux2-klein); 64x64 "
                                             "images."),
    "tiny_flux2_klein_base_path": ("flux2-klein-base", "Klein base checkpoint (model_type flux2-klein, is_distilled "
                                                       "false: CFG)."),
    "tiny_hunyuan_video15_path": ("hunyuanvideo15", "HunyuanVideo15Pipeline (model_type hunyuanvideo15, 8 latent "
                                                    "channels, x16 and x4); 5 frames at 32x32."),
    "tiny_ltx2_path": ("ltx2_t2av", "LTX2Pipeline (model_type ltx2_t2av): video with audio; 9 frames at 32x32."),
    "tiny_ltx2_i2av_path": ("ltx2_i2av", "LTX2ImageToVideoPipeline (model_type ltx2_i2av): tiny_ltx2_path's "
                                         "weights, a condition image as the first frame; 9 frames at 32x32."),
    "tiny_flux_kontext_path": ("flux1-kontext", "FluxKontextPipeline (model_type flux1-kontext); 64x64 images, "
                                                "condition images of any size in multiples of 16."),
    "tiny_wan_i2v_path": ("wan2_i2v", "Wan2.1 WanImageToVideoPipeline (model_type wan2_i2v, CLIP image encoder); "
                                      "5 frames at 32x32, one condition image per video."),
    "tiny_wan_flf2v_path": ("wan2.1-flf2v", "Wan2.1 first-last-frame-to-video WanImageToVideoPipeline (model_type "
                                            "wan2_i2v, the transformer's pos_embed_seq_len set); 5 frames at 32x32 "
                                            "between two condition images."),
    "tiny_wan22_i2v_path": ("wan2.2-i2v-a14b", "Wan2.2 I2V A14B-layout WanImageToVideoPipeline (model_type "
                                               "wan2_i2v): two experts, boundary_ratio 0.9, no image encoder."),
    "tiny_wan_v2v_path": ("wan2_v2v", "WanVideoToVideoPipeline (model_type wan2_v2v); 5 frames at 32x32 from a "
                                      "condition video."),
    "tiny_qwen_image_edit_path": ("qwen-image-edit-plus", "QwenImageEditPlusPipeline (model_type "
                                                          "qwen-image-edit-plus); 64x64 images, its processor folder "
                                                          "without a video processor (loaded by the adapter's "
                                                          "image-only fallback where torchvision is missing)."),
    "tiny_z_image_omni_path": ("z-image-omni", "ZImageOmniPipeline (model_type z-image-omni, Z-Image's tiny model with "
                                               "a SigLIP2 tower); 64x64 images, condition images optional."),
    "tiny_qwen_image21_path": ("qwen-image-2.1", "QwenImage21Pipeline (model_type qwen-image-2.1); 64x64 RGBA "
                                                 "images, its Qwen3VLProcessor folder without a video processor."),
}


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory):
    """``tiny_pipeline(kind)``: the folder of the tiny pipeline ``kind`` (a key of ``flow_factory.testing``'s
    builders, e.g. "sd3-5", "wan2.2-a14b"), built once per test session, offline."""
    from flow_factory.testing import build_tiny_pipeline

    built = {}

    def folder(kind: str):
        if kind not in built:
            built[kind] = build_tiny_pipeline(kind, tmp_path_factory.mktemp("tiny") / kind)
        return built[kind]

    return folder


def _named_tiny_pipeline(name: str, kind: str, doc: str):
    def fixture(tiny_pipeline):
        return tiny_pipeline(kind)

    fixture.__doc__ = f"Folder of a tiny {doc}"
    return pytest.fixture(scope="session", name=name)(fixture)


for _name, (_kind, _doc) in TINY_PIPELINES.items():
    globals()[_name] = _named_tiny_pipeline(_name, _kind, _doc)
