"""The accelerate launch configs shipped with the package, and what ``config_file`` may name.

``config_file`` is a short name of a shipped file (``fsdp2``, ``zero2``), one of
Flow-Factory's paths to its own copies (``config/deepspeed/deepspeed_zero2.yaml``,
``config/accelerate_configs/fsdp2.yaml``: read as ours when no such file exists), or the
path of a file of the user's. ``ff-train`` hands the resolved file to ``accelerate launch``;
its ``num_processes``, machine flags and ``mixed_precision`` override what the file says.

Imports no torch: the config check resolves the name before anything loads.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

FOLDER = Path(__file__).parent

# short name -> (file, when to use it); the table the docs and the error message list
SHIPPED = {
    "single_gpu": ("single_gpu.yaml", "one process, no wrapper"),
    "multi_gpu": ("multi_gpu.yaml", "DDP over one machine's GPUs"),
    "fsdp2": ("fsdp2.yaml", "FSDP2 full shard: parameters, gradients, optimizer state split"),
    "fsdp2_offload": ("fsdp2_offload.yaml", "FSDP2 full shard, shards kept in CPU memory"),
    "zero1": ("zero1.yaml", "DeepSpeed ZeRO-1: optimizer state split"),
    "zero2": ("zero2.yaml", "DeepSpeed ZeRO-2: optimizer state and gradients split"),
    "zero2_offload": ("zero2_offload.yaml", "DeepSpeed ZeRO-2, optimizer state in CPU memory"),
    "zero3": ("zero3.yaml", "DeepSpeed ZeRO-3: parameters too"),
    "multi_node": ("multi_node.yaml", "DDP over several machines (a template: give --machine_rank and "
                                      "--main_process_ip)"),
}
# other names for them: ours, and the file names of Flow-Factory's configs (its folders below)
ALIASES = {"ddp": "multi_gpu", "fsdp": "fsdp2", "deepspeed_zero1": "zero1", "deepspeed_zero2": "zero2",
           "deepspeed_zero3": "zero3"}
# where Flow-Factory keeps its accelerate and DeepSpeed configs: a path there that does not exist reads as ours
UPSTREAM_FOLDERS = ("config/accelerate_configs", "config/deepspeed")


class LaunchConfigError(ValueError):
    """``config_file`` names no shipped config and no existing file."""


def valid_names() -> list[str]:
    return sorted(SHIPPED) + sorted(ALIASES)


def shipped_name(value: str) -> str | None:
    """The shipped config ``value`` stands for (a short name, an alias, or a Flow-Factory path
    that does not exist here); None for anything else."""
    if value in SHIPPED or value in ALIASES:
        return ALIASES.get(value, value)
    path = PurePosixPath(value.replace("\\", "/"))
    if path.suffix in (".yaml", ".yml") and str(path.parent).removeprefix("./").endswith(UPSTREAM_FOLDERS):
        return ALIASES.get(path.stem, path.stem if path.stem in SHIPPED else None)
    return None


def resolve(value: str) -> Path:
    """The file ``config_file: value`` launches with: an existing file of the user's first, then a shipped one.
    An FSDP config must ask for FSDP2, the version ff-train shards with."""
    given = Path(value).expanduser()
    if given.is_file():
        _check_fsdp_version(given)
        return given.resolve()
    name = shipped_name(value)
    if name is not None:
        return FOLDER / SHIPPED[name][0]
    raise LaunchConfigError(
        f"{value!r} is neither a file nor a shipped accelerate config; shipped: "
        f"{', '.join(sorted(SHIPPED))} (also {', '.join(f'{a} = {n}' for a, n in sorted(ALIASES.items()))}, "
        f"and Flow-Factory's {' / '.join(UPSTREAM_FOLDERS)}/<name>.yaml paths), or give the path of your own file")


def _check_fsdp_version(path: Path) -> None:
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) if path.suffix in (".yaml", ".yml") else None
    except yaml.YAMLError as err:
        raise LaunchConfigError(f"{path} is not valid YAML ({err})") from None
    if isinstance(data, dict) and data.get("distributed_type") == "FSDP":
        version = (data.get("fsdp_config") or {}).get("fsdp_version", 1)
        if str(version) != "2":
            raise LaunchConfigError(f"{path} asks for FSDP version {version}; ff-train shards with FSDP2 only: set "
                                    "fsdp_config.fsdp_version: 2, or use the shipped fsdp2")
