"""The contract between a diffusers pipeline and the rest of Flow-Factory.

An adapter knows one model family: how to load it, encode prompts, shape and
draw noise, call the transformer once (with CFG or a guidance embedding), and
decode. It never runs a denoising loop (that is ``trajectory.py``) and never
computes a loss. Latents are always in the VAE's natural layout,
(B, C, H/8, W/8) for images and (B, C, F', H/8, W/8) for video; an adapter that
packs tokens (FLUX) packs inside ``velocity``.

Conditioning is a dict of batch-first tensors, so it can be sliced per sample
(``conditioning.index_cond``), cached, and moved between devices. What several adapters share
lives in small modules beside this one: ``vae.py`` (latents to pixels and back),
``schedule.py`` (resolution-shifted sigmas), ``text.py`` (prompts of their own lengths),
``conditioning.py`` (conditioning and condition media, per sample).

A conditioned model (editing, image- or video-to-video) also takes condition images or
videos (``condition_inputs``): ``prepare_conditions`` resizes a batch's files as its pipeline
does (what the rewards and the sample grids see, ``ConditionMedia``) and ``encode_conditions``
turns them into conditioning tensors (VAE latents, image-encoder states), once per sample:
``velocity`` reads them from the conditioning at every step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import contextmanager
from typing import ClassVar

import torch
from torch import Tensor

from ..config import ConfigError
from ..dynamics import Dynamics
from .conditioning import ConditionMedia, Conditioning

TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
TOKENIZERS = ("tokenizer", "tokenizer_2", "tokenizer_3")


# The image and text projections of a joint (MM-DiT) attention block, under diffusers' names:
# flow_grpo's LoRA targets for SD3, and FLUX's double-stream blocks (its single-stream blocks'
# to_q / to_k / to_v match the same names).
JOINT_ATTENTION_LORA_TARGETS = [
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
]


class ExpertCalls:
    """Which experts of a multi-expert model a ``velocity`` call runs: alone, those its rows need. A training
    backend whose experts' forward is a collective (every process runs an expert whenever one does) puts its
    own in ``FlowAdapter.expert_calls`` (``trainer/backends.py``)."""

    def to_run(self, needed: Mapping[str, bool]) -> dict[str, bool]:
        """``needed``: expert -> whether this call's rows need it."""
        return dict(needed)

    def idle_pass(self, out: Tensor, run_one_row: Callable[[], Tensor]) -> Tensor:
        """``out`` tied to an expert that ``to_run`` runs though no row needs it (``run_one_row``: that expert
        on one row of the batch). Never asked here: ``to_run`` runs what the rows need."""
        return out


class FlowAdapter:
    """Base class; subclasses register under ``model_type`` in models/registry.py."""

    model_type: ClassVar[str]
    pipeline_class: ClassVar[type]
    # module names LoRA targets when ``target_modules: default``
    default_lora_targets: ClassVar[list[str]]
    # True: video model, decode returns (B, F, 3, H, W)
    is_video: ClassVar[bool] = False
    # True: the model makes sound too; decode_audio gives it (a reward asks with the "audio" field)
    has_audio: ClassVar[bool] = False
    # height and width must be multiples of this in the released checkpoints; the config checks it
    # before anything loads, so the number lives in config.families.MODEL_FAMILIES (no torch there)
    pixel_factor: ClassVar[int]
    # text tokens per prompt where the adapter fixes the length; part of the prompt cache's fingerprint
    max_sequence_length: ClassVar[int | None] = None
    # the pipeline components that turn prompts into the transformer's text conditioning (frozen; the prompt
    # cache fingerprints them and stands in for them)
    text_encoder_names: ClassVar[tuple[str, ...]] = TEXT_ENCODERS
    # the pipeline components that denoise: one transformer, or each expert of a multi-expert model
    # (Wan2.2 A14B: transformer, transformer_2); model.target_components picks which of them train
    transformer_names: ClassVar[tuple[str, ...]] = ("transformer",)
    # keyword arguments of the pipeline's load_lora_weights that load a LoRA into that component
    # (diffusers loads every file as "transformer" unless told otherwise)
    lora_load_kwargs: ClassVar[dict[str, dict]] = {}
    # a two-expert model's CFG scale for its low-noise expert (train / eval.guidance_scale_2, set by the
    # caller); None = the guidance_scale ``velocity`` is given, as the pipelines do
    guidance_scale_2: float | None = None
    # what a sample is generated from besides its prompt: () text only, ("images",) condition images (editing,
    # image-to-video), ("videos",) condition videos (video-to-video); the dataset's rows name the files
    condition_inputs: ClassVar[tuple[str, ...]] = ()
    # how many condition images (or videos) one sample takes: (fewest, most), over the model type's checkpoints
    # (one checkpoint may take fewer: checkpoint_conditions)
    conditions_per_sample: ClassVar[tuple[int, int]] = (1, 1)
    # train / eval.auto_resize when the config leaves it null: generate at the condition's aspect ratio
    auto_resize: ClassVar[bool] = False
    # the text encoder reads the condition images too (Qwen-Image-Edit-Plus): ``encode`` takes them
    # (``conditions=``), so the prompt cache cannot answer for it; the condition cache holds its text encoding
    text_reads_conditions: ClassVar[bool] = False

    def __init__(self, pipeline, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.pipeline = pipeline
        self.device = torch.device(device)
        self.dtype = dtype
        pipeline.to(self.device)
        for module in [getattr(pipeline, "vae", None), *self.text_encoders().values(), *self.transformers.values()]:
            if module is not None:
                module.requires_grad_(False)
        # set by the training backend (trainer/backends.py): the module a component is called through while it
        # trains (its DDP wrapper, DeepSpeed's engine), and which experts a call runs
        self.callers: dict[str, torch.nn.Module] = {}
        self.expert_calls = ExpertCalls()

    @classmethod
    def from_pretrained(cls, path: str, device="cpu", dtype: torch.dtype = torch.float32) -> "FlowAdapter":
        pipe = cls.pipeline_class.from_pretrained(path, dtype=dtype)
        return cls(pipe, device, dtype)

    @property
    def transformer(self) -> torch.nn.Module:
        return self.pipeline.transformer

    @transformer.setter
    def transformer(self, module: torch.nn.Module) -> None:
        self.pipeline.transformer = module

    @property
    def transformers(self) -> dict[str, torch.nn.Module]:
        """The loaded denoising networks, by component name (``transformer_names``)."""
        found = {name: getattr(self.pipeline, name, None) for name in self.transformer_names}
        return {name: module for name, module in found.items() if module is not None}

    @property
    def denoiser(self) -> torch.nn.Module:
        """What ``velocity`` calls: the transformer, or its distributed wrapper while training."""
        return self.denoiser_for("transformer")

    def denoiser_for(self, name: str) -> torch.nn.Module:
        """``denoiser`` of one expert of a multi-expert model."""
        return self.callers[name] if name in self.callers else getattr(self.pipeline, name)

    @contextmanager
    def swapped_transformers(self, modules: Mapping[str, torch.nn.Module]):
        """Run ``velocity`` with other networks (frozen reference copies) in these components for a while."""
        saved = {name: getattr(self.pipeline, name) for name in modules}, dict(self.callers)
        for name, module in modules.items():
            setattr(self.pipeline, name, module)
            self.callers.pop(name, None)
        try:
            yield
        finally:
            for name, module in saved[0].items():
                setattr(self.pipeline, name, module)
            self.callers = saved[1]

    # --- the text side, which the prompt cache (prompt_cache.py) stands in for ----------
    def text_encoders(self) -> dict[str, torch.nn.Module]:
        """The pipeline's text encoders that are loaded, by component name."""
        found = {name: getattr(self.pipeline, name, None) for name in self.text_encoder_names}
        return {name: module for name, module in found.items() if module is not None}

    def tokenizers(self) -> dict:
        found = {name: getattr(self.pipeline, name, None) for name in TOKENIZERS}
        return {name: tokenizer for name, tokenizer in found.items() if tokenizer is not None}

    def uses_cfg(self, guidance_scale: float) -> bool:
        """Whether ``encode`` at this guidance scale also encodes the negative prompts (true CFG)."""
        return guidance_scale > 1

    def release_text_encoders(self, where: str) -> None:
        """Once every prompt is cached: move the text encoders to the CPU (``cpu``) or drop them
        (``free``); ``encode`` then fails for ``free`` (the cache answers instead)."""
        for name, module in self.text_encoders().items():
            if where == "free":
                setattr(self.pipeline, name, None)
            else:
                module.to("cpu")

    def set_attention_backend(self, name: str) -> None:
        """diffusers' ``set_attention_backend`` on the transformer (``model.attn_backend``; the name is
        checked before loading, in preflight.py). diffusers skips, without a word, attention
        processors that take no backend: a model none of whose processors took it is an error."""
        for transformer in self.transformers.values():
            transformer.set_attention_backend(name)
        processors = [m.processor for t in self.transformers.values() for m in t.modules()
                      if getattr(m, "processor", None) is not None]
        if not any(getattr(p, "_attention_backend", None) for p in processors):
            kinds = ", ".join(sorted({type(p).__name__ for p in processors}))
            raise ConfigError(f"model.attn_backend: {self.model_type}'s attention processors ({kinds}) do not "
                              "take diffusers' attention backends; remove the key")

    def set_flow_shift(self, shift: float) -> None:
        """``scheduler.flow_shift``: every sigma schedule from now on uses the static shift
        sigma' = shift * sigma / (1 + (shift - 1) * sigma), in place of the scheduler's own shift and of
        a resolution-dependent one (FLUX.1, Qwen-Image, FLUX.2: ``use_dynamic_shifting`` turned off).
        The pipeline's scheduler is replaced, so ``pipeline(...)`` samples on the same schedule."""
        scheduler = self.pipeline.scheduler
        override = {"shift": shift, "flow_shift": shift, "use_dynamic_shifting": False}  # Wan's UniPC: flow_shift
        self.pipeline.scheduler = type(scheduler).from_config(
            scheduler.config, **{k: v for k, v in override.items() if k in scheduler.config})

    def static_flow_shift(self) -> float | None:
        """The s of this model's sigma schedule, sigma = s u / (1 + (s - 1) u) of the unshifted u, when it does not
        depend on the size: the scheduler's static ``shift`` (Wan's UniPC: ``flow_shift``; ``scheduler.flow_shift``
        sets both); None for a resolution-dependent one (``use_dynamic_shifting``: FLUX.1, Qwen-Image, FLUX.2)."""
        config = self.pipeline.scheduler.config
        if config.get("use_dynamic_shifting", False):
            return None
        return float(config.get("flow_shift") or config.get("shift") or 1.0)

    def compile_transformers(self, strategy: str = "auto", **options) -> dict[str, str]:
        """``torch.compile`` every denoising network in place (``model.torch_compile``; ``options`` go to
        ``torch.compile``): its repeated blocks (``regional``; ``auto`` where the model declares them) or
        the whole network (``full``). In place (``Module.compile``), not a wrapper: the state dict, LoRA
        saving and the DDP wrapper see the same modules and keys as without it. Returns what each got."""
        chosen = {}
        for name, transformer in self.transformers.items():
            blocks = getattr(transformer, "_repeated_blocks", None)
            if strategy == "regional" and not blocks:
                raise ConfigError(f"model.torch_compile: regional compiles a model's repeated blocks, and "
                                  f"{type(transformer).__name__} declares none; use full or auto")
            chosen[name] = "regional" if strategy == "regional" or (strategy == "auto" and blocks) else "full"
            if chosen[name] == "regional":
                transformer.compile_repeated_blocks(**options)
            else:
                transformer.compile(**options)
        return chosen

    @property
    def loaded_pixel_factor(self) -> int:
        """``pixel_factor_of`` for the loaded checkpoint."""
        return self.pixel_factor_of(self.pipeline.vae.config, self.transformer.config)

    def check_size(self, height: int, width: int) -> None:
        """ValueError unless height and width are multiples of the loaded checkpoint's factor."""
        f = self.loaded_pixel_factor
        if height % f or width % f:
            raise ValueError(f"{self.model_type}: height and width must be multiples of {f}, got {height}x{width}")

    # --- what each model defines -------------------------------------------------
    @staticmethod
    def pixel_factor_of(vae: Mapping, transformer: Mapping) -> int | None:
        """The factor height and width must be multiples of, for one checkpoint: from its VAE's and
        transformer's configs (their config.json read as dicts, or the loaded modules' ``.config``),
        so the pre-load check and ``latent_shape`` compute it the same way. None when a key is missing."""
        raise NotImplementedError  # abstract

    @staticmethod
    def experts(model_index: Mapping) -> tuple[str, ...]:
        """The components of ``transformer_names`` that denoise in a checkpoint whose ``model_index.json``
        (or loaded ``pipeline.config``) is ``model_index``: what ``model.target_components`` may name."""
        return ("transformer",)

    @staticmethod
    def unsupported(model_index: Mapping) -> str | None:
        """Why this adapter cannot serve a pipeline of its class whose ``model_index.json`` (or loaded
        ``pipeline.config``) is ``model_index``; None when it can."""
        return None

    def experts_at(self, sigmas: Tensor) -> list[str]:
        """The component ``velocity`` calls at each of ``sigmas``: a multi-expert model picks by noise level."""
        return ["transformer"] * len(sigmas)

    def encode(self, prompts: list[str], negative_prompts: list[str] | None, guidance_scale: float) -> Conditioning:
        """Text conditioning for ``prompts``; includes the negative branch when CFG is used."""
        raise NotImplementedError  # abstract

    # image models whose pipelines pack 2x2 latents into one token (FLUX.1, Qwen-Image): 4
    latents_per_token = 1

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        """Shape of one sample's latents (no batch dim). By default an image model's VAE latents: the
        transformer's input channels (per packed latent) at the VAE's scale; video models override it."""
        self.check_size(height, width)
        s = self.pipeline.vae_scale_factor
        return (self.transformer.config.in_channels // self.latents_per_token, height // s, width // s)

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> Tensor:
        """(num_steps + 1,) float32 from 1-ish down to 0, as the pipeline's scheduler sets them."""
        raise NotImplementedError  # abstract

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """One transformer call (CFG inside); returns float32 v with ``latents``' shape."""
        raise NotImplementedError  # abstract

    def decode(self, latents: Tensor) -> Tensor:
        """Images (B, 3, H, W) or videos (B, F, 3, H, W), float32 in [0, 1]."""
        raise NotImplementedError  # abstract

    # the train.rollout_cache policies that work on this model's transformer (rollout_cache.py)
    cache_policies: tuple[str, ...] = ("first_block", "faster", "pyramid", "taylorseer", "magcache")

    def encode_media(self, media: Tensor) -> Tensor:
        """``decode``'s inverse: the latents (the sampler's final state) of (B, 3, H, W) images or, for a video
        model, (B, F, 3, H, W) videos in [0, 1], the VAE's mode as the pipelines encode an input image or video:
        what offline training (sft, offline-dpo) trains toward. A model without it cannot train offline."""
        raise NotImplementedError(f"{self.model_type} {self.offline_refusal()}")

    # why a model that has encode_media still cannot train offline (LTX-2: its sound); None: it can
    offline_problem: ClassVar[str | None] = None

    @classmethod
    def offline_refusal(cls) -> str | None:
        """Why this model cannot train from a dataset's images or videos (sft, offline-dpo), or None."""
        if cls.offline_problem:
            return cls.offline_problem
        if cls.encode_media is FlowAdapter.encode_media:
            return "does not encode images or videos into its latents (its adapter has no encode_media)"
        return None

    def decode_audio(self, latents: Tensor) -> tuple[Tensor, int]:
        """Waveforms (B, channels, T), float32 in [-1, 1], and their sample rate: a model with ``has_audio``."""
        raise NotImplementedError(f"{self.model_type} makes no audio")

    def generated(self, latents: Tensor) -> Tensor | None:
        """Bool (*latent) over one sample of ``latents`` (B, *latent): the elements the model generates, where the
        rest is a condition it is given and keeps (ltx2_i2av's first frame); None: every element."""
        return None

    def sampling_dynamics(self, dynamics: Dynamics) -> Dynamics:
        """The dynamics this model samples and trains with: the configured one, unless part of the latent
        must stay on the ODE (LTX-2's audio: ``dynamics.partial.PartlyStochastic``)."""
        return dynamics

    # --- conditioned models only (condition_inputs) -----------------------------------
    @classmethod
    def checkpoint_conditions(cls, transformer_config: Mapping | None) -> tuple[tuple[int, int], str]:
        """(fewest, most) condition files a sample takes with the checkpoint whose transformer has this config
        (None: not known yet, a hub id before loading), and the reason, when narrower than the model type's
        ``conditions_per_sample``, that an error about a row's count adds (starting with "; ")."""
        return cls.conditions_per_sample, ""

    def prepare_conditions(self, images: list[list] | None, videos: list[list[list]] | None, height: int, width: int,
                           num_frames: int | None, condition_size: tuple[int, int] | None) -> ConditionMedia:
        """Each sample's condition images (lists of RGB PIL images) or videos (lists of frame lists), resized
        as the pipeline resizes them: to ``condition_size`` (height, width) or, when None, to the model's
        own choice; float32 tensors in [0, 1]. Deterministic and cheap (no network)."""
        raise NotImplementedError(f"{self.model_type} takes no condition images or videos")

    def condition_encoders(self) -> dict:
        """The pipeline's networks and processors that ``prepare_conditions`` / ``encode_conditions`` use, by
        name: what the condition cache's fingerprint covers (prompt_cache.py)."""
        names = ("vae", "image_encoder", "image_processor", "video_processor", "feature_extractor")
        return {n: getattr(self.pipeline, n) for n in names if getattr(self.pipeline, n, None) is not None}

    @classmethod
    def call_shape(cls, sizes: list[tuple[int, int]], condition_size: tuple[int, int] | None) -> tuple | None:
        """For a model whose condition images keep their own sizes: what the samples of one transformer call must
        share, from a row's condition images' (width, height) (Qwen-Image-Edit-Plus: their sizes as resized);
        checked per split before the model loads unless a call takes one sample."""
        return None

    def encode_conditions(self, media: ConditionMedia, height: int, width: int,
                          num_frames: int | None) -> Conditioning:
        """Batch-first conditioning tensors of ``prepare_conditions``' media (VAE latents, image-encoder
        states) for samples of that size, merged into the text conditioning; computed once per sample."""
        raise NotImplementedError(f"{self.model_type} takes no condition images or videos")

    def start_latents(self, noise: Tensor, sigma: Tensor, cond: Conditioning) -> Tensor:
        """The state a rollout starts from at ``sigma`` (its first sigma): the noise, or for a model that starts
        from its condition (video-to-video) the condition's latents noised to that level."""
        return noise

    # --- shared -----------------------------------------------------------------
    def cfg_inputs(self, cond: Conditioning, guidance_scale: float, x: Tensor, t: Tensor,
                   keys: tuple[str, ...]) -> tuple[bool, Tensor, Tensor, list[Tensor]]:
        """Classifier-free guidance (where ``uses_cfg``) batches [uncond, cond] into one call, the pipelines' order.

        Returns (cfg, x, t, the ``keys`` of ``cond`` with their ``negative_`` twins prepended).
        """
        cfg = self.uses_cfg(guidance_scale)
        if not cfg:
            return cfg, x, t, [cond[k] for k in keys]
        if any(f"negative_{k}" not in cond for k in keys):
            raise ValueError(f"guidance_scale {guidance_scale} needs the negative branch: encode() with the same "
                             "guidance_scale")
        doubled = [torch.cat([cond[f"negative_{k}"], cond[k]]) for k in keys]
        return cfg, torch.cat([x, x]), torch.cat([t, t]), doubled

    @staticmethod
    def combine_cfg(out: Tensor, guidance_scale: float) -> Tensor:
        uncond, text = out.chunk(2)
        return uncond + guidance_scale * (text - uncond)

    def initial_noise(self, n: int, height: int, width: int, generator: torch.Generator | None = None,
                      num_frames: int | None = None) -> Tensor:
        shape = (n, *self.latent_shape(height, width, num_frames))
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(self.device)
