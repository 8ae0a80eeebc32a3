"""What ``ff-train`` checks once, in the process the user started, before any process launches or
any model loads: each problem is one line naming the key and what would work, all reported together.

- the process count against the devices here: a GPU a process; a config's ``num_processes: 8``
  on a machine without a GPU is refused (``--num_processes N`` on the command line runs N CPU
  processes on purpose);
- the logging backend's package, and the extra that installs it;
- the dataset against the epoch's draw (``train.unique_sample_num_per_epoch`` at most its prompts);
- the reward classes, the servers they score on (a remote reward's, a VLM judge's API: each must
  answer), and every model the run loads (the pipeline, each reward's weights), last: each must
  be a local folder, in the hub cache, or on a reachable hub. Offline (``HF_HUB_OFFLINE=1``) or
  without a network, the missing ones are named in seconds, where ``from_pretrained`` would
  retry for minutes.

The Trainer runs the cheap ones again (a Python caller builds it without ``ff-train``).
"""

from __future__ import annotations

import importlib.util
import math
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .config import ConfigError

# a hub repo id: org/name, each of letters, digits, '-', '_' and '.'
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
HUB_TIMEOUT_S = 5.0
SERVER_TIMEOUT_S = 3.0
BACKEND_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "swanlab": "swanlab"}


def start_problems(cfg, processes_on_command_line: bool = False) -> list[str]:
    """Every problem found, one line each (empty: the run can start)."""
    from .data import MissingPromptFile

    problems = [processes_problem(cfg, processes_on_command_line), backend_problem(cfg.log.logging_backend)]
    try:
        check_prompt_counts(cfg)
    except MissingPromptFile as err:
        problems.append(f"data.{'dataset_dir' if cfg.data.dataset_dir else 'datasets'}: {err}")
    except (ConfigError, ValueError) as err:  # a prompt file's own error names its file and line
        problems.append(str(err))
    sources, servers, reward_problems = reward_needs(cfg)
    problems += reward_problems
    problems.append(servers_problem(servers))
    problems.append(models_problem(sources))
    return [p for p in problems if p]


def processes_problem(cfg, on_command_line: bool) -> str | None:
    import torch

    per_machine = math.ceil(cfg.num_processes / cfg.num_machines)
    gpus = torch.cuda.device_count()
    if gpus and per_machine > gpus:
        return (f"num_processes: {cfg.num_processes} ({per_machine} a machine) needs a GPU a process, and this "
                f"machine has {gpus}; pass --num_processes {gpus * cfg.num_machines}")
    if not gpus and cfg.num_processes > 1 and not on_command_line:
        return (f"num_processes: {cfg.num_processes} runs a process a GPU, and this machine has no GPU; pass "
                f"--num_processes 1 to try the config on this CPU (--num_processes N runs N CPU processes)")
    return None


def backend_problem(backend: str) -> str | None:
    """``log.logging_backend``'s package is installed (``none`` needs nothing)."""
    if backend == "none":
        return None
    package = BACKEND_PACKAGES[backend]
    if importlib.util.find_spec(package) is not None:
        return None
    others = [name for name, pkg in BACKEND_PACKAGES.items() if importlib.util.find_spec(pkg) is not None]
    instead = " or ".join([*others, "none"])
    return (f"log.logging_backend: {backend!r} is not installed; pip install 'flow_factory[{package}]' "
            f"(or pip install {package}), or set log.logging_backend: {instead}")


def check_prompt_counts(cfg, items: list | None = None) -> None:
    """``ConfigError`` when the epoch draws more distinct prompts than the training split holds, or than a
    dataset of several holds for its weight (``items``: the prompts already loaded; else read here). An offline
    run's records are read (each row checked) and not counted."""
    from .config.algorithms import OFFLINE_TRAINER_TYPES
    from .data import epoch_sampler, load_sources

    if cfg.train.trainer_type in OFFLINE_TRAINER_TYPES:  # an epoch is a pass over the records: read them (checked)
        if items is None:
            from .data.offline import OFFLINE_KINDS, load_offline_sources, offline_video

            load_offline_sources(cfg.data.split_sources("train"), "train", OFFLINE_KINDS[cfg.train.trainer_type],
                                 offline_video(cfg))
        return
    if items is None:
        items = load_sources(cfg.data.split_sources("train"), "train")
    wanted = cfg.train.unique_sample_num_per_epoch
    if len(cfg.data.split_sources("train")) > 1:
        try:
            epoch_sampler(cfg, items, seed=0)
        except ValueError as err:
            raise ConfigError(f"train.unique_sample_num_per_epoch: {wanted} distinct prompts an epoch, shared by "
                              f"data.datasets' weights; {err}: lower it, or give those datasets less weight") from None
        return
    if wanted > len(items):
        data = cfg.data
        cap = " (data.max_dataset_size)" if data.max_dataset_size == len(items) else ""
        folder = data.split_sources("train")[0].dataset_dir
        raise ConfigError(f"train.unique_sample_num_per_epoch: {wanted} distinct prompts an epoch, and {folder} holds "
                          f"{len(items)} training prompts{cap}; set it to at most {len(items)}")


def reward_needs(cfg) -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[str]]:
    """``(model id or folder, the key that names it)`` for every model the run loads, ``(URL, key)`` for
    every server its rewards score on, and the problems of reward classes that cannot be found."""
    from .rewards.registry import resolve_reward_class

    sources = [(cfg.model.model_name_or_path, "model.model_name_or_path")]
    # diffusion-opd's teachers: a local one is checked before loading (models/preflight.py); a hub one is its repo
    sources += [(re.sub(r"^([^/]+/[^/]+).*", r"\1", t.path), f"train.teachers[{i}].path")
                for i, t in enumerate(cfg.train.teachers) if not Path(t.path).expanduser().exists()]
    servers, problems = [], []
    for section, entries in (("rewards", cfg.rewards), ("eval_rewards", cfg.eval_rewards or [])):
        for i, entry in enumerate(entries):
            key = f"{section}[{i}] {entry.name}"
            try:
                reward_cls = resolve_reward_class(entry.reward_model)
            except (ImportError, ValueError, TypeError) as err:
                problems.append(f"{section}[{i}].reward_model: {err}")
                continue
            options = entry.constructor_options()
            sources += [(model, key) for model in reward_cls.models_to_load(options)]
            servers += [(url, key) for url in reward_cls.servers_to_reach(options)]
    return sources, servers, problems


def each_at_once(check, values: list[str]) -> dict:
    """``{value: check(value)}`` for each distinct value, checked side by side: each may wait seconds on the
    network, and their waits need not add up."""
    unique = list(dict.fromkeys(values))
    with ThreadPoolExecutor(max(1, min(8, len(unique)))) as pool:
        return dict(zip(unique, pool.map(check, unique)))


def servers_problem(servers: list[tuple[str, str]]) -> str | None:
    """One line naming each reward server or VLM API that does not answer (any HTTP answer will do)."""
    if not servers:  # most runs: httpx stays unimported (5 MB in the process that then trains)
        return None
    import httpx

    def answers(url: str) -> str | None:
        try:
            httpx.get(url, timeout=SERVER_TIMEOUT_S)
        except httpx.HTTPError as err:
            return type(err).__name__
        return None

    silent = each_at_once(answers, [url for url, _ in servers])
    missing = [f"{url} ({key}: {silent[url]})" for url, key in servers if silent[url]]
    if not missing:
        return None
    return f"reward servers that do not answer: {', '.join(missing)}; start them first, or fix the URL"


def models_problem(sources: list[tuple[str, str]]) -> str | None:
    """One line naming each model that is neither a local folder nor cached nor on a reachable hub."""
    from huggingface_hub import constants

    found = each_at_once(lambda s: model_problem(s, constants.HF_HUB_OFFLINE), [source for source, _ in sources])
    by_reason: dict[str, list[str]] = {}
    for source, key in dict.fromkeys(sources):
        if found[source]:
            by_reason.setdefault(found[source], []).append(f"{source} ({key})")
    if not by_reason:
        return None
    listed = "; ".join(f"{why}: {', '.join(names)}" for why, names in by_reason.items())
    offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
    return (f"models this run loads are not here{offline}: {listed}. Fetch each with `hf download ID` where the "
            f"hub is reachable, or point its key at a local folder")


def model_problem(source: str, offline: bool) -> str | None:
    """Why ``source`` cannot be loaded here, or None: a local folder, a cached hub repo, or one the hub has."""
    if Path(source).expanduser().exists():
        return None
    if not HUB_ID.fullmatch(source):
        return "no such folder"
    if hub_cached(source):
        return None
    if offline:
        return "not in the hub cache"
    return hub_answer(source)


def hub_cached(repo_id: str) -> bool:
    """The hub cache holds a snapshot of ``repo_id`` (what ``from_pretrained`` reads offline)."""
    from huggingface_hub import constants

    snapshots = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    return snapshots.is_dir() and any(snapshots.iterdir())


def hub_answer(repo_id: str) -> str | None:
    """One request to the hub, no retries: None when it has ``repo_id`` and lets this user read it."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi().model_info(repo_id, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        return f"gated: accept its licence at https://huggingface.co/{repo_id} and log in (hf auth login)"
    except RepositoryNotFoundError:
        return "not on the hub (or private: log in with hf auth login)"
    except Exception as err:  # noqa: BLE001: no network, DNS, a proxy: all mean the same here
        return f"not cached and the hub is unreachable ({type(err).__name__})"
    return None
