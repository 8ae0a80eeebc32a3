"""Errors that used to come late or wrong (issue 16, point 8): each is now one line that names
the key or file and what would be valid, raised before any model loads.

Config-time errors come from ``load_config`` (``ff-train`` exits 2); what needs the pipeline
folder comes from ``models.preflight.check_before_loading``, which reads JSON only.
"""

import json
import sys
from pathlib import Path

import pytest
from helpers_runs import tiny_run_config, write_config

from flow_factory.config import ConfigError, parse_config
from flow_factory.config.families import MODEL_FAMILIES
from flow_factory.data import PromptItem, load_prompts
from flow_factory.models import ADAPTERS
from flow_factory.models.preflight import check_before_loading
from flow_factory.train import main


def config(model_type: str = "sd3-5", path: str = "org/name", **train) -> dict:
    """A valid config that touches no file: 4 prompts x group 2, batches of 4."""
    train = {"per_device_batch_size": 4, "group_size": 2, "unique_sample_num_per_epoch": 4,
             "num_frames": 5 if model_type == "wan2_t2v" else None, **train}
    return {"data": {"dataset_dir": "prompts"}, "model": {"model_name_or_path": str(path), "model_type": model_type},
            "train": train, "rewards": [{"reward_model": "jpeg_compressibility"}]}


def config_error(data: dict, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, overrides)
    return str(info.value)


def preflight_error(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        check_before_loading(parse_config(data))
    return str(info.value)


def ff_train_error(argv: list[str], capsys) -> str:
    """What ``ff-train`` reports: its stderr line (exit code 2), or, for a check that runs once the
    config is loaded and that ``main`` does not catch yet, the exception's message."""
    try:
        code = main(argv)
    except ConfigError as err:
        return str(err)
    assert code == 2
    return capsys.readouterr().err


@pytest.fixture
def no_pipeline_loads(monkeypatch):
    """Fails the test if any adapter starts loading a pipeline."""
    def refuse(cls, *args, **kwargs):
        pytest.fail(f"{cls.__name__}.from_pretrained was called: the error came after loading started")

    for cls in ADAPTERS.values():
        monkeypatch.setattr(cls, "from_pretrained", classmethod(refuse))


# --------------------------------------------------------------------------- empty override


@pytest.mark.parametrize("override", ["train.learning_rate=", "train.learning_rate=  "])
def test_an_empty_override_is_an_error_not_the_default(override):
    assert config_error(config(), [override]) == (
        f"override {override!r}: no value after '=' (an unset shell variable?); give a value, or write "
        "train.learning_rate=null for null")


def test_null_written_out_still_means_the_default():
    assert parse_config(config(), ["train.learning_rate=null"]).train.learning_rate == 1e-4


def test_ff_train_refuses_an_empty_override(tmp_path, capsys, no_pipeline_loads):
    path = write_config(tmp_path, tiny_run_config(tmp_path, "sd3-5", "org/name"))
    assert main([str(path), "train.learning_rate=", "--print-config"]) == 2
    assert "ff-train: config error: override 'train.learning_rate=': no value after '='" in capsys.readouterr().err


# --------------------------------------------------------------------------- prompt files


def test_a_prompt_file_that_is_not_utf8_names_the_file_and_the_line(tmp_path):
    (tmp_path / "train.txt").write_bytes("a red circle\nun café ".encode() + b"cr\xe8me br\xfbl\xe9e\n")
    with pytest.raises(ValueError) as info:
        load_prompts(tmp_path)
    assert str(info.value) == (f"{tmp_path / 'train.txt'}:2: not UTF-8 text (byte 0xe8 at column 11); "
                               "save the file as UTF-8")


def test_a_jsonl_file_that_is_not_utf8_names_the_line_too(tmp_path):
    lines = [b'{"prompt": "one"}', b'{"prompt": "two"}', b'{"prompt": "caf\xe9"}']
    (tmp_path / "test.jsonl").write_bytes(b"\r\n".join(lines))
    with pytest.raises(ValueError, match=r"test\.jsonl:3: not UTF-8 text \(byte 0xe9 at column 16\)"):
        load_prompts(tmp_path, "test")


def test_a_byte_order_mark_is_still_no_error(tmp_path):
    (tmp_path / "train.txt").write_bytes(b"\xef\xbb\xbfcaf\xc3\xa9\n")
    assert load_prompts(tmp_path) == [PromptItem("café")]


# --------------------------------------------------------------------------- resolution


@pytest.mark.parametrize("model_type, overrides, message", [
    ("sd3-5", ["train.resolution=72"],
     "train.resolution: sd3-5 needs height and width in multiples of 16 (VAE x8, then 2x2 transformer patches), "
     "got 72; nearest valid: 64 or 80"),
    ("sd3-5", ["train.resolution=8"], "got 8; nearest valid: 16"),  # 0 is no size
    ("flux1", ["train.resolution=[512, 520]"],
     "train.resolution: flux1 needs height and width in multiples of 16 (VAE x8, then 2x2 token packing), "
     "got [512, 520]; nearest valid: [512, 512] or [512, 528]"),
    ("wan2_t2v", ["eval.resolution=[480, 830]"],
     "eval.resolution: wan2_t2v needs height and width in multiples of 16 (VAE x8, then 2x2 transformer "
     "patches), got [480, 830]; nearest valid: [480, 816] or [480, 832]"),
])
def test_a_resolution_the_model_cannot_take_is_a_config_error(model_type, overrides, message):
    assert message in config_error(config(model_type), overrides)


def test_ff_train_refuses_a_bad_resolution_before_anything_loads(tmp_path, capsys, no_pipeline_loads):
    path = write_config(tmp_path, tiny_run_config(tmp_path, "sd3-5", "org/name", resolution=72))
    for argv in ([str(path)], [str(path), "--print-config"]):
        assert main(argv) == 2
        assert f"ff-train: config error: {path}: train.resolution: sd3-5 needs height and width in multiples " \
            "of 16 (VAE x8, then 2x2 transformer patches), got 72; nearest valid: 64 or 80" in capsys.readouterr().err


# the keys of the released checkpoints' vae/ and transformer/ config.json that fix the factor
RELEASED = {
    "sd3-5": ({"block_out_channels": [128, 256, 512, 512]}, {"patch_size": 2}),  # SD3 / SD3.5
    "flux1": ({"block_out_channels": [128, 256, 512, 512]}, {"patch_size": 1}),  # FLUX.1 dev / schnell
    # Wan2.1-T2V-*-Diffusers: saved before diffusers recorded scale_factor_spatial (the default 8 applies)
    "wan2_t2v": ({"temperal_downsample": [False, True, True]}, {"patch_size": [1, 2, 2]}),
    "wan2_i2v": ({"temperal_downsample": [False, True, True]}, {"patch_size": [1, 2, 2]}),  # Wan2.1 / 2.2 I2V
    "wan2_v2v": ({"temperal_downsample": [False, True, True]}, {"patch_size": [1, 2, 2]}),  # Wan2.1 T2V weights
    "qwen-image": ({"temperal_downsample": [False, True, True]}, {"patch_size": 2}),  # Qwen-Image, -2512
    "z-image": ({"block_out_channels": [128, 256, 512, 512]}, {"all_patch_size": [2]}),  # Z-Image, -Turbo
    "z-image-omni": ({"block_out_channels": [128, 256, 512, 512]}, {"all_patch_size": [2]}),  # Z-Image's VAE, patches
    "flux2": ({"block_out_channels": [128, 256, 512, 512]}, {"patch_size": 1}),  # FLUX.2 [dev]
    "flux2-klein": ({"block_out_channels": [128, 256, 512, 512]}, {"patch_size": 1}),  # FLUX.2 [klein] 4B / 9B
    "hunyuanvideo15": ({"spatial_compression_ratio": 16}, {"patch_size": 1}),  # HunyuanVideo-1.5 480p / 720p
    # LTX-2 (diffusers' conversion script, version 2.0): the VAE's ratio is in its config
    "ltx2_t2av": ({"patch_size": 4, "spatio_temporal_scaling": [True] * 4, "spatial_compression_ratio": 32},
                  {"patch_size": 1}),
    "ltx2_i2av": ({"patch_size": 4, "spatio_temporal_scaling": [True] * 4, "spatial_compression_ratio": 32},
                  {"patch_size": 1}),  # the same checkpoint, in LTX2ImageToVideoPipeline
    # Qwen-Image-2.1: diffusers' AutoencoderKLQwenImage21 and QwenImage21Transformer2DModel defaults (its configs)
    "qwen-image-2.1": ({"temperal_downsample": [False, True, True, True]}, {"patch_size": 1}),
}


@pytest.mark.parametrize("model_type", sorted(RELEASED))
def test_the_factor_is_one_number_for_config_adapter_and_checkpoint(model_type):
    adapter = ADAPTERS[model_type]
    assert adapter.pixel_factor == MODEL_FAMILIES[model_type].pixel_factor
    assert adapter.pixel_factor_of(*RELEASED[model_type]) == adapter.pixel_factor


def pipeline_folder(tmp_path: Path, class_name: str, vae: dict | None = None, transformer: dict | None = None,
                    **index) -> Path:
    """A folder with only the JSON the pre-load check reads: enough, since it must read nothing else."""
    folder = tmp_path / "pipeline"
    for name, content in (("model_index.json", {"_class_name": class_name, **index}),
                          ("vae/config.json", vae), ("transformer/config.json", transformer)):
        if content is not None:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(json.dumps(content))
    return folder


def test_the_folders_own_factor_is_checked_before_loading(tmp_path):
    # one more VAE block: x16, then 2x2 patches = 32, so 48 (a multiple of the family's 16) does not fit
    folder = pipeline_folder(tmp_path, "StableDiffusion3Pipeline", {"block_out_channels": [8] * 5},
                             {"patch_size": 2})
    assert preflight_error(config(path=folder, resolution=48)) == (
        f"train.resolution: the pipeline in {folder} needs height and width in multiples of 32 (read from its vae/ "
        "and transformer/ config.json), got 48; nearest valid: 32 or 64")
    check_before_loading(parse_config(config(path=folder, resolution=64)))
    # a dataset's own eval resolution, likewise
    several = config(path=folder, resolution=64)
    own = {"name": "b", "dataset_dir": "prompts", "train": False, "eval_resolution": [64, 48]}
    several["data"] = {"datasets": [{"name": "a", "dataset_dir": "prompts"}, own]}
    assert preflight_error(several) == (
        f"data.datasets[1].eval_resolution: the pipeline in {folder} needs height and width in multiples of 32 (read "
        "from its vae/ and transformer/ config.json), got [64, 48]; nearest valid: [64, 32] or [64, 64]")


# --------------------------------------------------------------------------- model folder


def test_flux1_on_an_sd3_folder_fails_before_loading(tmp_path, tiny_sd3_path, capsys, no_pipeline_loads):
    path = write_config(tmp_path, tiny_run_config(tmp_path, "flux1", tiny_sd3_path))
    assert ff_train_error([str(path)], capsys).strip().endswith(
        f"{tiny_sd3_path / 'model_index.json'}: holds a StableDiffusion3Pipeline, but model.model_type 'flux1' "
        "loads a FluxPipeline; use model.model_type: sd3-5")


@pytest.mark.parametrize("model_type", ["sd3-5", "wan2_t2v"])
def test_a_flux_folder_names_flux1(tmp_path, tiny_flux_path, model_type):
    wanted = ADAPTERS[model_type].pipeline_class.__name__
    assert preflight_error(config(model_type, tiny_flux_path)) == (
        f"{tiny_flux_path / 'model_index.json'}: holds a FluxPipeline, but model.model_type {model_type!r} loads "
        f"a {wanted}; use model.model_type: flux1")


def test_the_tiny_folders_pass(tmp_path, tiny_sd3_path, tiny_flux_path):
    check_before_loading(parse_config(tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path)))
    check_before_loading(parse_config(tiny_run_config(tmp_path, "flux1", tiny_flux_path)))


def test_a_pipeline_no_adapter_loads_lists_those_that_do(tmp_path):
    folder = pipeline_folder(tmp_path, "StableDiffusionXLPipeline")
    assert preflight_error(config(path=folder)) == (
        f"{folder / 'model_index.json'}: holds a StableDiffusionXLPipeline, but model.model_type 'sd3-5' loads a "
        "StableDiffusion3Pipeline; no adapter loads it; the adapters load StableDiffusion3Pipeline (sd3-5), "
        "FluxPipeline (flux1), WanPipeline (wan2_t2v), QwenImagePipeline (qwen-image), ZImagePipeline (z-image), "
        "ZImageOmniPipeline (z-image-omni), Flux2Pipeline (flux2), Flux2KleinPipeline (flux2-klein), HunyuanVideo15Pipeline (hunyuanvideo15), "
        "LTX2Pipeline (ltx2_t2av), LTX2ImageToVideoPipeline (ltx2_i2av), FluxKontextPipeline (flux1-kontext), "
        "WanImageToVideoPipeline (wan2_i2v), WanVideoToVideoPipeline (wan2_v2v), QwenImageEditPlusPipeline "
        "(qwen-image-edit-plus), QwenImage21Pipeline (qwen-image-2.1)")


WAN = ["diffusers", "WanTransformer3DModel"]


def wan_folder(tmp_path: Path, **index) -> Path:
    """A WanPipeline folder holding only its model_index.json (whose entries name the components)."""
    folder = tmp_path / "pipeline"
    folder.mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "transformer": WAN, **index}))
    return folder


def test_wan22_folders_are_read_before_loading(tmp_path):
    """Wan2.2 A14B (two experts and their boundary) and TI2V-5B load; a folder whose experts contradict
    its boundary is refused, and target_components may name only the experts the folder uses."""
    a14b = wan_folder(tmp_path / "a14b", transformer_2=WAN, boundary_ratio=0.875)
    data = config("wan2_t2v", a14b, guidance_scale_2=3.0)
    data["model"]["target_components"] = ["transformer_2"]
    check_before_loading(parse_config(data))
    check_before_loading(parse_config(config("wan2_t2v", wan_folder(tmp_path / "ti2v", expand_timesteps=True))))
    no_expert = wan_folder(tmp_path / "broken", transformer_2=[None, None], boundary_ratio=0.9)
    assert preflight_error(config("wan2_t2v", no_expert)) == (
        f"{no_expert / 'model_index.json'}: wan2_t2v: this checkpoint sets boundary_ratio but has no transformer_2 "
        "(the low-noise expert)")
    # a second expert without a boundary is never called by the pipeline: not an expert to train
    unused = wan_folder(tmp_path / "unused", transformer_2=WAN)
    data = config("wan2_t2v", unused, guidance_scale_2=3.0)
    data["model"]["target_components"] = ["transformer", "transformer_2"]
    assert preflight_error(data).splitlines()[1:] == [
        f"  model.target_components: ['transformer_2']: not an expert of {unused / 'model_index.json'}, which has "
        "transformer",
        f"  train.guidance_scale_2: {unused / 'model_index.json'} has one expert (transformer), so there is no "
        "low-noise expert to guide; remove the key"]


def test_a_folder_without_model_index_is_not_a_pipeline_folder(tmp_path):
    folder = pipeline_folder(tmp_path, "StableDiffusion3Pipeline", transformer={"patch_size": 2})
    assert preflight_error(config(path=tmp_path)) == (
        f"{tmp_path / 'model_index.json'}: not found, so model.model_name_or_path is not a diffusers pipeline folder")
    # pointing at one component of a pipeline is a common slip: the message names the pipeline
    assert preflight_error(config(path=folder / "transformer")) == (
        f"{folder / 'transformer' / 'model_index.json'}: not found, so model.model_name_or_path is not a diffusers "
        f"pipeline folder; did you mean {folder.resolve()}?")


def test_a_model_index_that_is_not_json_names_the_file(tmp_path):
    (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline",,}')
    assert preflight_error(config(path=tmp_path)) == (
        f"{tmp_path / 'model_index.json'}: not valid JSON (Expecting property name enclosed in double quotes "
        "at line 1)")


@pytest.mark.parametrize("path", ["/no/such/folder", "./checkpoints/sd3", "sd3-5-local", "~/models/../sd3"])
def test_a_path_that_does_not_exist_and_is_no_hub_id_is_named(path):
    assert preflight_error(config(path=path)) == (
        f"model.model_name_or_path: {path!r} does not exist, and it is not a hub id of the form org/name")


def test_a_file_is_not_a_pipeline_folder(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert preflight_error(config(path=tmp_path / "model.safetensors")).startswith(
        f"model.model_name_or_path: {tmp_path / 'model.safetensors'} is a file; expected a diffusers pipeline folder")


@pytest.mark.parametrize("hub_id", ["stabilityai/stable-diffusion-3.5-medium", "black-forest-labs/FLUX.1-dev"])
def test_a_hub_id_is_left_to_the_loader(hub_id):
    check_before_loading(parse_config(config(path=hub_id)))  # nothing to read offline, so nothing to say


# --------------------------------------------------------------------------- a user's adapter class


USER_ADAPTERS = """
from flow_factory.models.sd3 import SD3Adapter


class CoarseSD3(SD3Adapter):
    model_type = "coarse-sd3"
    pixel_factor = 32  # stricter than SD3's 16: the config must read it from here


class VideoSD3(SD3Adapter):
    model_type = "video-sd3"
    is_video = True
    frame_factor = 8


class Unfinished(SD3Adapter.__mro__[1]):  # FlowAdapter without the class attributes
    pass


NOT_A_CLASS = 3
"""


@pytest.fixture
def user_adapters(tmp_path, monkeypatch):
    """A module of adapter classes outside the package, importable as ``user_adapters_check``."""
    (tmp_path / "user_adapters_check.py").write_text(USER_ADAPTERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_adapters_check"
    sys.modules.pop("user_adapters_check", None)


def test_a_users_adapter_class_gives_the_family_its_numbers(user_adapters):
    coarse = config(f"{user_adapters}.CoarseSD3", resolution=64)
    assert parse_config(coarse).model.model_type == f"{user_adapters}.CoarseSD3"
    assert config_error(coarse, ["train.resolution=48"]) == (
        f"train.resolution: {user_adapters}.CoarseSD3 needs height and width in multiples of 32 "
        "(CoarseSD3.pixel_factor), got 48; nearest valid: 32 or 64")
    video = config(f"{user_adapters}.VideoSD3", resolution=64, num_frames=9)
    assert parse_config(video).model.is_video
    assert "train.num_frames: user_adapters_check.VideoSD3 needs 8k + 1 frames" in config_error(
        video, ["train.num_frames=5"])


@pytest.mark.parametrize("path, message", [
    ("user_adapters_check.Missing", "model.model_type: adapter class path 'user_adapters_check.Missing': module "
                                    "'user_adapters_check' has no attribute 'Missing'"),
    ("no_such_package.Adapter", "model.model_type: adapter class path 'no_such_package.Adapter': no module named "
                                "'no_such_package'; looked in "),
    ("user_adapters_check.NOT_A_CLASS", "model.model_type: 'user_adapters_check.NOT_A_CLASS' is 3, not a subclass of "
                                        "flow_factory.models.FlowAdapter"),
    ("user_adapters_check.Unfinished", "model.model_type: 'user_adapters_check.Unfinished' does not set model_type, "
                                       "pipeline_class, pixel_factor, default_lora_targets"),
    ("sd4", "model.model_type: unknown model family 'sd4'; expected one of sd3-5, flux1"),
])
def test_a_model_type_that_names_no_adapter_is_a_config_error(user_adapters, path, message):
    assert config_error(config(path)).startswith(message)
