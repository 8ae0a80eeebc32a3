"""The model families, each described once: ``MODEL_FAMILIES``.

A family's line says what the config checks before anything loads (sizes, frames, networks, condition
inputs), the spellings ``model.model_type`` accepts, and where its adapter class is; the config, the
adapter registry (``models/registry.py``, which imports only the adapter a run asks for) and the tests
all read this table. It imports no torch: the config checks a family before any model code loads.
Adding a model family is its adapter file plus one line here (docs/guides/adding-a-model.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..class_path import import_class
from .base import problem


@dataclass(frozen=True)
class ModelFamily:
    """What the torch-free config knows of a model family (``model.model_type``). Its adapter class takes
    the numbers it also needs from here (``pixel_factor = MODEL_FAMILIES[model_type].pixel_factor``) or
    declares the same ones (tests/test_import_graph.py checks that they agree)."""

    model_type: str
    adapter: str  # "module:Class" of its FlowAdapter subclass, imported when a run asks for this family
    pixel_factor: int  # height and width must be multiples of this in the released checkpoints
    why: str  # how that factor arises, for the error message
    frame_factor: int | None = None  # video only: num_frames must be 1 + a multiple of this
    # the denoising networks a checkpoint of the family may have, as the pipeline names its components
    # (model.target_components; the adapter's transformer_names); a multi-expert family lists every
    # expert, the first the default
    components: tuple[str, ...] = ("transformer",)
    # what a sample is generated from besides its prompt (the adapter's condition_inputs): ("images",) /
    # ("videos",) for a conditioned model
    conditions: tuple[str, ...] = ()
    # other spellings model.model_type accepts (compared ignoring case and _ vs - vs .)
    aliases: tuple[str, ...] = ()
    # a family whose samples hold sound beside their video (its adapter's has_audio), played at this one
    # frame rate (LTX-2: the pipeline's 24 fps)
    audio_fps: float | None = None

    @property
    def is_video(self) -> bool:
        """A video model (its adapter's ``is_video``): the one kind with a frame factor."""
        return self.frame_factor is not None


_X8_PATCHES = "VAE x8, then 2x2 transformer patches"
_X8_PACKING = "VAE x8, then 2x2 token packing"
_X8_PATCHIFY = "VAE x8, then 2x2 latent patchify"
_X32_PATCHES = "VAE x32, then 1x1 transformer patches"
_M = "flow_factory.models."
# the order the config's messages list them in
MODEL_FAMILIES = {family.model_type: family for family in (
    ModelFamily("sd3-5", _M + "sd3:SD3Adapter", 16, _X8_PATCHES, aliases=("sd3_5", "sd3", "sd35")),
    ModelFamily("flux1", _M + "flux:FluxAdapter", 16, _X8_PACKING, aliases=("flux", "flux-1")),
    # Wan2.2 A14B: transformer for high noise, transformer_2 for low noise (TI2V-5B: VAE x16, so 32)
    ModelFamily("wan2_t2v", _M + "wan:WanT2VAdapter", 16, _X8_PATCHES, frame_factor=4,
                components=("transformer", "transformer_2"),
                aliases=("wan", "wan2.1", "wan21", "wan21_t2v", "wan2.1_t2v", "wan2.2", "wan22", "wan22_t2v",
                         "wan2.2_t2v")),
    ModelFamily("qwen-image", _M + "qwen_image:QwenImageAdapter", 16, _X8_PACKING, aliases=("qwenimage", "qwen")),
    ModelFamily("z-image", _M + "z_image:ZImageAdapter", 16, _X8_PATCHES,
                aliases=("zimage", "z-image-turbo", "zimage-turbo")),
    # Z-Image-Omni: text-to-image, or from the condition images a row names (editing, references)
    ModelFamily("z-image-omni", _M + "z_image_omni:ZImageOmniAdapter", 16, _X8_PATCHES, conditions=("images",),
                # the last: upstream's adapter class path, the one name its configs can give it (its registry has none)
                aliases=("zimage-omni", "z-image-omni-base", "zimage-omni-base",
                         "flow_factory.models.z_image.z_image_omni.ZImageOmniAdapter")),
    # FLUX.2 and Klein: text-to-image, or image-to-image from the reference images a row names
    ModelFamily("flux2", _M + "flux2:Flux2Adapter", 16, _X8_PATCHIFY, conditions=("images",),
                aliases=("flux-2", "flux2-dev")),
    ModelFamily("flux2-klein", _M + "flux2:Flux2KleinAdapter", 16, _X8_PATCHIFY, conditions=("images",),
                aliases=("flux-2-klein", "klein", "flux2-klein-base")),
    ModelFamily("hunyuanvideo15", _M + "hunyuan_video15:HunyuanVideo15Adapter", 16,
                "VAE x16, then 1x1 transformer patches", frame_factor=4,
                aliases=("hunyuanvideo1.5", "hunyuan-video-1.5", "hunyuan_video15", "hunyuanvideo-1.5")),
    ModelFamily("ltx2_t2av", _M + "ltx2:LTX2Adapter", 32, _X32_PATCHES, frame_factor=8, aliases=("ltx2", "ltx-2"),
                audio_fps=24.0),
    # LTX-2 image-to-audio-video: the video's first frame from the dataset's rows
    ModelFamily("ltx2_i2av", _M + "ltx2_i2av:LTX2I2AVAdapter", 32, _X32_PATCHES, frame_factor=8,
                conditions=("images",), aliases=("ltx2-i2av", "ltx-2_i2av", "ltx-2-i2av"), audio_fps=24.0),
    ModelFamily("flux1-kontext", _M + "flux_kontext:FluxKontextAdapter", 16, _X8_PACKING, conditions=("images",),
                aliases=("flux-kontext", "flux-1-kontext", "kontext", "flux1-kontext-dev")),
    # Wan2.1 I2V (one transformer, CLIP image encoder) and Wan2.2 I2V A14B (two experts)
    ModelFamily("wan2_i2v", _M + "wan_i2v:WanI2VAdapter", 16, _X8_PATCHES, frame_factor=4,
                components=("transformer", "transformer_2"),
                conditions=("images",), aliases=("wan21_i2v", "wan2.1_i2v", "wan22_i2v", "wan2.2_i2v", "wan_i2v")),
    ModelFamily("wan2_v2v", _M + "wan_v2v:WanV2VAdapter", 16, _X8_PATCHES, frame_factor=4, conditions=("videos",),
                aliases=("wan21_v2v", "wan2.1_v2v", "wan_v2v")),
    ModelFamily("qwen-image-edit-plus", _M + "qwen_image_edit:QwenImageEditPlusAdapter", 16, _X8_PACKING,
                conditions=("images",),
                aliases=("qwen_image_edit_plus", "qwen-image-edit", "qwen-edit", "qwenimage-edit-plus")),
    # Qwen-Image-2.1: a VAE x16 whose latents the transformer reads one a token, 2x2 of them per image slot of
    # its Qwen3-VL text encoder
    ModelFamily("qwen-image-2.1", _M + "qwen_image21:QwenImage21Adapter", 32,
                "VAE x16, then 2x2 latents per text-encoder image slot", conditions=("images",),
                aliases=("qwen-image-21", "qwenimage-2.1", "qwenimage21", "qwen-image2.1")),
)}
MODEL_TYPES = tuple(MODEL_FAMILIES)


def model_type_aliases(families=None) -> dict[str, str]:
    """Every spelling of a family's model type -> the model type (its own name included), from the
    table as it is now."""
    families = MODEL_FAMILIES if families is None else families
    return {name: family.model_type for family in families.values() for name in (family.model_type, *family.aliases)}


MODEL_TYPE_ALIASES = model_type_aliases()
# spellings ModelConfig.model_type's description gives as examples
ALIAS_EXAMPLES = ("sd3_5", "flux", "wan2.1", "qwenimage", "z_image", "flux2_klein", "hunyuanvideo1.5", "ltx2",
                  "flux1_kontext")


def model_type_description() -> str:
    """``model.model_type``'s description in the config reference: the families of the table."""
    return (f"model family: {', '.join(MODEL_TYPES)} (what each generates, and from what: docs/models.md); "
            f"spellings such as {', '.join(ALIAS_EXAMPLES)} are accepted; or the dotted path of your own "
            "FlowAdapter subclass (my_package.adapters.MyAdapter)")


# what a user's adapter class (model.model_type: package.module.Class) sets, as the built-in ones do
ADAPTER_CLASS_ATTRIBUTES = ("model_type", "pipeline_class", "pixel_factor", "default_lora_targets")


def model_family(model_type: str) -> ModelFamily:
    """What the config checks about ``model.model_type``: a built-in family's line, or what a user's
    adapter class declares, named by its dotted path (imported here, and torch with it)."""
    if model_type in MODEL_FAMILIES:
        return MODEL_FAMILIES[model_type]
    try:
        cls = import_class(model_type, "adapter class path")
    except (ImportError, ValueError) as e:
        raise problem(f"{e}; the model families are {', '.join(MODEL_FAMILIES)}") from None
    # by name, not issubclass: the config does not import the models (they import the config)
    if not isinstance(cls, type) or "flow_factory.models.base.FlowAdapter" not in {
            f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__}:
        raise problem(f"{model_type!r} is {cls!r}, not a subclass of flow_factory.models.FlowAdapter")
    missing = [name for name in ADAPTER_CLASS_ATTRIBUTES if not hasattr(cls, name)]
    if missing:
        raise problem(f"{model_type!r} does not set {', '.join(missing)}; an adapter class sets "
                      f"{', '.join(ADAPTER_CLASS_ATTRIBUTES)} (docs/guides/adding-a-model.md)")
    factor = cls.pixel_factor
    if not isinstance(factor, int) or isinstance(factor, bool) or factor <= 0:
        raise problem(f"{model_type!r} has pixel_factor {factor!r}; it must be a positive integer")
    # a video adapter may declare frame_factor (num_frames = 1 + a multiple of it); 1 checks nothing
    frames = (getattr(cls, "frame_factor", None) or 1) if cls.is_video else None
    return ModelFamily(model_type, model_type, factor, f"{cls.__qualname__}.pixel_factor", frames,
                       tuple(getattr(cls, "transformer_names", ("transformer",))),
                       tuple(getattr(cls, "condition_inputs", ())))
