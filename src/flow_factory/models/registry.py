"""Adapters by ``model.model_type``, found through the model families' table (``config.families``:
each family's line names its adapter class). A ``model_type`` that is a dotted path
(``my_package.adapters.MyAdapter``) names a user's own adapter class instead."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping

import torch

from ..class_path import import_class
from ..config.families import MODEL_FAMILIES, ModelFamily
from .base import FlowAdapter

# model_type -> "module:Class", as the table says
BUILTIN_ADAPTERS: dict[str, str] = {name: family.adapter for name, family in MODEL_FAMILIES.items()}


class AdapterTable(MutableMapping):
    """model_type -> adapter class: each family of ``families`` (read when looked up, so a line added to the
    table is found), its class imported when first looked up, so a run imports only its own adapter's module
    (and the diffusers pipeline behind it; each of the others costs seconds and memory); and classes set here
    directly, which stand in for a family's (iterating the values imports all)."""

    def __init__(self, families: Mapping[str, ModelFamily]):
        self._families = families
        self._set: dict[str, type[FlowAdapter]] = {}
        self._imported: dict[str, type[FlowAdapter]] = {}  # by "module:Class"

    def __getitem__(self, model_type: str) -> type[FlowAdapter]:
        if model_type in self._set:
            return self._set[model_type]
        path = self._families[model_type].adapter
        if path not in self._imported:
            self._imported[path] = import_class(path, "adapter class path")
        return self._imported[path]

    def __setitem__(self, model_type: str, cls: type[FlowAdapter]) -> None:
        self._set[model_type] = cls

    def __delitem__(self, model_type: str) -> None:
        if model_type not in self._set:
            raise KeyError(f"{model_type!r}: a model family of config.families.MODEL_FAMILIES is removed there")
        del self._set[model_type]

    def __contains__(self, model_type) -> bool:
        return model_type in self._set or model_type in self._families

    def __iter__(self) -> Iterator[str]:
        return iter({**dict.fromkeys(self._families), **dict.fromkeys(self._set)})

    def __len__(self) -> int:
        return len(set(self._families) | set(self._set))


ADAPTERS = AdapterTable(MODEL_FAMILIES)


def get_adapter_class(model_type: str) -> type[FlowAdapter]:
    if model_type in ADAPTERS:
        return ADAPTERS[model_type]
    if "." not in model_type and ":" not in model_type:
        raise ValueError(f"model.model_type: unknown {model_type!r}; valid: {sorted(ADAPTERS)}, or the dotted path "
                         "of a FlowAdapter subclass")
    try:
        cls = import_class(model_type, "adapter class path")
    except (ImportError, ValueError) as e:
        raise ValueError(f"model.model_type: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, FlowAdapter)):
        raise ValueError(f"model.model_type: {model_type!r} is {cls!r}, not a subclass of FlowAdapter")
    return cls


def load_adapter(model_type: str, path, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> FlowAdapter:
    """Load the diffusers pipeline at ``path`` (a local folder or hub id) behind its adapter."""
    return get_adapter_class(model_type).from_pretrained(str(path), device=device, dtype=dtype)


def model_type_for_pipeline(class_name: str) -> str | None:
    """The ``model_type`` whose adapter loads a pipeline of ``class_name`` (model_index.json's
    ``_class_name``), or None when no adapter does."""
    return next((name for name, cls in ADAPTERS.items() if cls.pipeline_class.__name__ == class_name), None)
