"""One entry of ``rewards`` / ``eval_rewards``: the one parser of reward entries.

Keys this schema does not know are the reward class's own options, so they are
collected into ``kwargs`` rather than rejected: a keyword-form reward's ``__init__``
signature is what catches a misspelt option, and a reward in Flow-Factory's form
(``__init__(config, accelerator)``) reads them as attributes of this entry, which is
``flow_factory.hparams.RewardArguments``. ``RewardSet.from_configs`` builds from
these objects; Python callers that pass mappings have them read here too
(``parse_reward_entries``), so an entry means the same in YAML and in code.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import NonNegativeInt, PositiveFloat, PositiveInt, ValidationError, model_validator

from .base import DTYPE_NAMES, Section, canonical_choice, problem, setting, show
from .errors import ConfigError
from .explain import explain

# Flow-Factory's older spelling of the options mapping
KWARGS_KEYS = ("kwargs", "reward_model_kwargs")
# the fields the RewardSet reads itself; every other field (and kwargs) goes to the reward's constructor
SET_FIELDS = ("name", "reward_model", "weight", "applicable_datasets", "async_reward", "num_workers")


class RewardConfig(Section):
    name: str | None = setting(None, "unique name of this reward in logs and weights; null = reward_model")
    reward_model: str = setting(description="registered reward name, a dotted class path (pkg.module.Class), or a "
                                "file's path and the class (path/to/my_reward.py:MyReward)")
    weight: float | dict[str, float] = setting(
        1.0, "weight of this reward when rewards are combined; or, with data.datasets, a weight per dataset "
        "({name: weight}: a dataset left out is not scored by this reward)")
    applicable_datasets: list[str] | None = setting(
        None, "with data.datasets: the datasets whose samples this reward scores (Flow-Factory's routing); null = all")
    batch_size: PositiveInt = setting(16, "samples per reward-model call")
    device: str | None = setting(None, "device of the reward model; null = the training process's device")
    dtype: Literal["float32", "float16", "bfloat16"] = setting("float32", "dtype of the reward model")
    model_name_or_path: str | None = setting(None, "weights for the reward model; null = its default")
    kwargs: dict[str, Any] = setting(default_factory=dict,
                                     description="extra constructor options of the reward class")
    async_reward: bool = setting(False, "score this reward in a thread pool while sampling continues")
    num_workers: PositiveInt = setting(1, "threads of this reward's pool when async_reward is true")
    # options of the remote rewards and VLM judges; passed to the constructor when set
    server_url: str | None = setting(None, "remote rewards: base URL of the reward server, e.g. http://127.0.0.1:8000")
    timeout: PositiveFloat | None = setting(None, "remote rewards and VLM judges: seconds to wait for one answer")
    retry_attempts: NonNegativeInt | None = setting(None, "remote rewards and VLM judges: retries after a failed "
                                                          "request (connection error, timeout, 5xx)")
    api_base_url: str | None = setting(None, "VLM judges: OpenAI-compatible API base, e.g. http://host:8000/v1")
    vlm_model: str | None = setting(None, "VLM judges: the model name the API serves")
    api_key: str | None = setting(None, "VLM judges: bearer token of the API; null = none")
    extra_kwargs: dict[str, Any] | None = setting(None, "VLM judges: extra fields of each chat-completion "
                                                        "request (temperature, top_k, ...)")

    @model_validator(mode="before")
    @classmethod
    def _collect_kwargs(cls, data):
        if not isinstance(data, dict):
            return data
        known = set(cls.model_fields) - {"kwargs"}
        entry = {k: v for k, v in data.items() if k in known}
        options: dict[str, Any] = {}
        for key in KWARGS_KEYS:
            given = data.get(key)
            if given is None:
                continue
            if not isinstance(given, dict):
                raise problem(f"{key}: expected a mapping of constructor options, got {show(given)}")
            options.update(given)
        for key, value in data.items():
            if key in known or key in KWARGS_KEYS:
                continue
            if key in options and options[key] != value:
                raise problem(f"option {key!r} is given twice with different values "
                              f"({show(value)} and {show(options[key])} in kwargs)")
            options[key] = value
        bad = [k for k in options if not isinstance(k, str)]
        if bad:
            raise problem(f"option names must be strings, got {show(bad)}")
        entry["kwargs"] = options
        if "dtype" in entry:
            entry["dtype"] = canonical_choice(entry["dtype"], DTYPE_NAMES)
        return entry

    @model_validator(mode="after")
    def _default_name(self):
        if self.name is None:
            self.name = self.reward_model
        if self.num_workers > 1 and not self.async_reward:
            raise problem(f"num_workers: {self.num_workers} threads only apply with async_reward: true "
                          f"(reward {self.name!r}); set async_reward: true or drop num_workers")
        return self

    # --- read as Flow-Factory's RewardArguments (flow_factory.hparams) --------------------
    # A reward written to Flow-Factory's guide gets this entry as ``self.config`` and reads
    # its own keys from it: ``self.config.threshold`` for ``threshold: 0.5`` in the YAML.

    def __getattr__(self, name: str) -> Any:
        """An option of the entry (a key the schema does not type, kept in ``kwargs``) as an attribute."""
        options = self.__dict__.get("kwargs") or {}
        if not name.startswith("_") and name in options:
            return options[name]
        if name.startswith("_") or "kwargs" not in self.__dict__:  # pydantic's own lookups, or a half-built entry
            return super().__getattr__(name)
        raise AttributeError(f"reward {self.__dict__.get('name')!r}: its entry has no key {name!r}; typed keys: "
                             f"{sorted(set(type(self).model_fields) - {'kwargs'})}, its own options: {sorted(options)}")

    def __getitem__(self, key: str) -> Any:
        """``config["key"]``, as Flow-Factory's RewardArguments allows: a typed key or an option."""
        if key in type(self).model_fields and key != "kwargs":
            return getattr(self, key)
        if key in self.kwargs:
            return self.kwargs[key]
        raise KeyError(key)

    def to_dict(self) -> dict[str, Any]:
        """Every key of the entry, options beside the typed keys (Flow-Factory's ``to_dict``)."""
        return {k: v for k, v in self.model_dump().items() if k != "kwargs"} | self.kwargs

    def constructor_options(self) -> dict[str, Any]:
        """Keyword arguments of the reward class: every field but ``SET_FIELDS``, null ones left
        out (the class's default holds), then ``kwargs``. A field added to this schema reaches
        the constructor without being listed anywhere else."""
        typed = {k: getattr(self, k) for k in type(self).model_fields if k not in SET_FIELDS and k != "kwargs"}
        return {k: v for k, v in typed.items() if v is not None} | self.kwargs


def as_entry_list(value: Any) -> Any:
    """One mapping is shorthand for a list of one entry; null or {} for none."""
    if isinstance(value, dict):
        return [value] if value else []
    if isinstance(value, tuple):
        return list(value)
    return value


def parse_reward_entries(value: Any) -> list[RewardConfig]:
    """Reward entries given in code (RewardConfig objects, mappings, or one of them alone)
    -> RewardConfig objects, checked as the YAML's ``rewards`` is: every problem a line of
    one ConfigError (``rewards[1].weight: ...``), repeated names refused."""
    items = as_entry_list(value)
    data = {"rewards": items if isinstance(items, list) else [items]}
    try:
        entries = _RewardList.model_validate(data).rewards
    except ValidationError as err:
        raise ConfigError(explain(err, _RewardList, data)) from None
    repeated = duplicate_names(entries)
    if repeated:
        raise ConfigError(f"rewards: {repeated}")
    return entries


class _RewardList(Section):
    """Wraps a list of entries so that pydantic's error locations read ``rewards[i].key``."""

    rewards: list[RewardConfig] = setting(description="reward entries")


def duplicate_names(entries: list[RewardConfig]) -> str | None:
    """A problem message when two entries share a name, else None."""
    first_seen: dict[str, int] = {}
    for index, entry in enumerate(entries):
        if entry.name in first_seen:
            return (f"two entries are named {entry.name!r} (entries {first_seen[entry.name]} and {index}); "
                    f"give each a distinct name")
        first_seen[entry.name] = index
    return None
