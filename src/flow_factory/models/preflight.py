"""Checks of the model source that need no model: run before anything loads.

``check_before_loading(cfg)`` is called by the Trainer before the pipeline loads, so a
wrong folder, a wrong ``model_type`` for it or a resolution the model cannot take is a
one-line error naming the key or file, not a traceback minutes into a load.

Only JSON is read: the folder's ``model_index.json`` (its ``_class_name`` is the pipeline
class) and ``vae/`` and ``transformer/config.json`` (the exact size factor; the config
has already checked the model family's); of diffusion-opd's local teacher LoRAs, each file's
header. A hub id is not checked: its files are not here, and nothing here may reach the network.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..config import ConfigError
from ..config.base import size_problem
from ..start_checks import HUB_ID
from .base import FlowAdapter
from .registry import ADAPTERS, get_adapter_class, model_type_for_pipeline



def check_reward_inputs(rewards, model_type: str, key: str) -> None:
    """``ConfigError`` when a reward of ``rewards`` (a RewardSet, config section ``key``) asks for audio from
    a model that makes none."""
    if "audio" in rewards.required_fields and not get_adapter_class(model_type).has_audio:
        asking = [name for name, model in rewards.models.items() if "audio" in model.required_fields]
        raise ConfigError(f"{key}: {', '.join(asking)} ask(s) for audio, which model.model_type {model_type!r} "
                          "does not make; only ltx2_t2av and ltx2_i2av do")


def check_before_loading(cfg) -> None:
    """Raise ``ConfigError`` (a ValueError) naming the key or file if the model source cannot serve ``cfg``."""
    if cfg.model.attn_backend is not None:
        check_attention_backend(cfg.model.attn_backend)
    check_teacher_loras(cfg.train.teachers)
    folder = pipeline_folder(cfg.model.model_name_or_path)
    if folder is None:
        return
    adapter = get_adapter_class(cfg.model.model_type)
    check_pipeline_class(folder, adapter)
    check_experts(adapter.experts(read_json(folder / "model_index.json")), cfg, str(folder / "model_index.json"))
    check_sizes(folder, adapter, cfg)
    check_static_shift(folder, cfg)
    if cfg.model.torch_compile == "regional":
        check_regional_compile(folder, adapter)


def check_teacher_loras(teachers) -> None:
    """diffusion-opd's teachers (``train.teachers``): each local path a diffusers LoRA file (its header read)."""
    from .lora import lora_file_problem

    problems = [f"train.teachers[{i}].path: {t.path}: {why}" for i, t in enumerate(teachers)
                if (why := lora_file_problem(t.path))]
    if problems:
        raise ConfigError("; ".join(problems))


def checkpoint_conditions(adapter: type[FlowAdapter], name_or_path: str) -> tuple[tuple[int, int], str]:
    """``adapter.checkpoint_conditions`` of the folder's ``transformer/config.json``: how many condition files
    a sample takes with this checkpoint (a hub id's config is not here: the model type's range until it loads)."""
    path = Path(name_or_path).expanduser()
    config = read_json(path / "transformer" / "config.json") if path.is_dir() else None
    return adapter.checkpoint_conditions(config)


def check_regional_compile(folder: Path, adapter: type[FlowAdapter]) -> None:
    """``model.torch_compile: regional`` needs repeated blocks declared by each denoising network's class."""
    import diffusers

    index = read_json(folder / "model_index.json")
    for name in adapter.experts(index):
        class_name = (index.get(name) or [None, None])[1]
        cls = getattr(diffusers, class_name, None) if class_name else None
        if cls is not None and not getattr(cls, "_repeated_blocks", None):
            raise ConfigError(f"model.torch_compile: regional compiles a model's repeated blocks, and {class_name} "
                              f"({folder / 'model_index.json'}: {name}) declares none; use full or auto")


def check_experts(experts: tuple[str, ...], cfg, where: str) -> None:
    """``model.target_components`` and ``guidance_scale_2`` against the denoising networks a checkpoint has
    (``FlowAdapter.experts``); run on the folder's model_index.json before loading, and on the loaded
    pipeline for a hub id (the Trainer, ff-eval)."""
    problems = []
    missing = [c for c in cfg.model.target_components if c not in experts]
    if missing:
        problems.append(f"model.target_components: {missing}: not an expert of {where}, which has "
                        f"{' and '.join(experts)}")
    scales = {"train.guidance_scale_2": cfg.train.guidance_scale_2}
    if cfg.eval.guidance_scale_2 != cfg.train.guidance_scale_2:  # else filled in from train's
        scales["eval.guidance_scale_2"] = cfg.eval.guidance_scale_2
    for path, scale in scales.items():
        if scale is not None and len(experts) == 1:
            problems.append(f"{path}: {where} has one expert ({experts[0]}), so there is no low-noise expert to "
                            "guide; remove the key")
    if problems:
        raise ConfigError(problems)


def check_attention_backend(name: str) -> None:
    """``model.attn_backend`` names one of diffusers' attention backends whose packages are installed."""
    from diffusers.models import attention_dispatch
    from diffusers.models.attention_dispatch import AttentionBackendName

    names = [b.value for b in AttentionBackendName]
    if name not in names:
        raise ConfigError(f"model.attn_backend: {name!r} is not one of diffusers' attention backends: "
                          f"{', '.join(names)}")
    # diffusers' own check of the backend's packages (flash-attn, sageattention, xformers, ...); private,
    # so only where this diffusers has it
    requirements = getattr(attention_dispatch, "_check_attention_backend_requirements", None)
    if requirements is not None:
        try:
            requirements(AttentionBackendName(name))
        except (RuntimeError, ImportError, ValueError) as e:
            raise ConfigError(f"model.attn_backend: {name!r} cannot run here: {e}") from None


def check_static_shift(folder: Path, cfg) -> None:
    """TDM's ``source_uniform`` query draw needs the schedule's static flow shift: a pipeline folder whose scheduler
    shifts by resolution is refused unless ``scheduler.flow_shift`` fixes one (hub ids: checked once loaded)."""
    if getattr(cfg.train, "tdm_query_distribution", None) != "source_uniform" or cfg.scheduler.flow_shift is not None:
        return
    path = folder / "scheduler" / "scheduler_config.json"
    if (read_json(path) or {}).get("use_dynamic_shifting", False):
        raise ConfigError(f"train.tdm_query_distribution: source_uniform draws uniformly in the unshifted schedule, "
                          f"and {path} shifts it by resolution (use_dynamic_shifting); set scheduler.flow_shift (a "
                          "static shift), or use actual_uniform or conditional_logit_normal")


def pipeline_folder(name_or_path: str) -> Path | None:
    """The local folder ``model.model_name_or_path`` names, or None for a hub id."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ConfigError(f"model.model_name_or_path: {name_or_path} is a file; expected a diffusers pipeline "
                          "folder (one holding model_index.json) or a hub id such as org/name")
    if HUB_ID.fullmatch(name_or_path) and ".." not in name_or_path:
        return None
    raise ConfigError(f"model.model_name_or_path: {name_or_path!r} does not exist, and it is not a hub id "
                      "of the form org/name")


def read_json(path: Path) -> dict | None:
    """The mapping in ``path``; None when there is no such file."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        where = f" ({e.msg} at line {e.lineno})" if isinstance(e, json.JSONDecodeError) else ""
        raise ConfigError(f"{path}: not valid JSON{where}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def check_pipeline_class(folder: Path, adapter: type[FlowAdapter]) -> None:
    """The folder holds the pipeline class ``adapter`` loads, in a variant it supports."""
    index_file = folder / "model_index.json"
    index = read_json(index_file)
    if index is None:
        # a common slip: pointing at one component (transformer/) instead of the pipeline
        parent = folder.resolve().parent
        hint = f"; did you mean {parent}?" if (parent / "model_index.json").is_file() else ""
        raise ConfigError(f"{index_file}: not found, so model.model_name_or_path is not a diffusers pipeline "
                          f"folder{hint}")
    found, wanted = index.get("_class_name"), adapter.pipeline_class.__name__
    if found != wanted:
        fits = model_type_for_pipeline(found) if isinstance(found, str) else None
        if fits:
            advice = f"use model.model_type: {fits}"
        else:
            known = ", ".join(f"{cls.pipeline_class.__name__} ({name})" for name, cls in ADAPTERS.items())
            advice = f"no adapter loads it; the adapters load {known}"
        raise ConfigError(f"{index_file}: holds a {found or 'pipeline with no _class_name'}, but model.model_type "
                          f"{adapter.model_type!r} loads a {wanted}; {advice}")
    problem = adapter.unsupported(index)
    if problem:
        raise ConfigError(f"{index_file}: {problem}")


def check_sizes(folder: Path, adapter: type[FlowAdapter], cfg) -> None:
    """train / eval resolution (and each dataset's own eval resolution) against this checkpoint's own factor, when
    its config files give it."""
    vae = read_json(folder / "vae" / "config.json") or {}
    transformer = read_json(folder / "transformer" / "config.json") or {}
    factor = adapter.pixel_factor_of(vae, transformer)
    if factor is None:
        return  # the config's check against the family's factor is all there is
    sizes = [("train.resolution", cfg.train.resolution)]
    if cfg.eval.resolution != cfg.train.resolution:  # an unset eval.resolution is train's: report it once
        sizes.append(("eval.resolution", cfg.eval.resolution))
    sizes += [(f"data.datasets[{i}].eval_resolution", source.eval_resolution)
              for i, source in enumerate(cfg.data.datasets or []) if source.eval_resolution is not None]
    problems = [size_problem(key, value, factor, f"the pipeline in {folder}",
                             "read from its vae/ and transformer/ config.json") for key, value in sizes]
    problems = [p for p in problems if p]
    if problems:
        raise ConfigError(problems)
