"""diffusion-opd's teachers: LoRAs of the base model, each loaded from its file (``train.teachers[i].path``) as a
peft adapter of the one transformer beside the student's (``models/lora.ADAPTER_NAME``), frozen. Each keeps the
rank, alpha and targets its file's metadata gives (diffusers' ``load_lora_adapter``), so a teacher need not share
the student's. ``running(name)`` makes one the adapter the transformer runs, for a query without gradients; outside
it the student runs, as every other part of the trainer expects. Nothing of theirs is checkpointed (the student's
LoRA file is its adapter's alone): a resumed run loads them from their paths again. Under DeepSpeed ZeRO-1/2 they
sit inside the network the engine wraps, outside its optimizer, whole on every process (``keep_as_loaded``); under
FSDP2 they are loaded before the backend shards the transformer, so they are sharded with it and gathered with it
for each query, frozen (outside every optimizer, which takes the trained weights alone)."""

from __future__ import annotations

import warnings

from ..config import ConfigError
from ..models.lora import ADAPTER_NAME, adapter_running, fetch_lora, run_adapter


class LoraTeachers:
    def __init__(self, transformer, teachers):
        """``teachers``: the config's ``train.teachers`` entries (named), loaded in order."""
        self.transformer, self.adapters = transformer, {}
        for i, teacher in enumerate(teachers):
            adapter = f"opd_teacher_{i}"  # not the user's name: peft's must not clash with the roles' adapters
            path = fetch_lora(teacher.path)
            try:
                with warnings.catch_warnings():  # peft warns that a second adapter is added: that is the point
                    warnings.filterwarnings("ignore", message=".*multiple adapters.*")
                    transformer.load_lora_adapter(str(path.parent), weight_name=path.name, prefix="transformer",
                                                  adapter_name=adapter)
            except (ValueError, RuntimeError, KeyError) as err:
                raise ConfigError(f"train.teachers[{i}].path: {teacher.path} does not load as a LoRA of this "
                                  f"{type(transformer).__name__}: {err}") from None
            self.adapters[teacher.name] = adapter
        self.loaded = {}  # parameter -> its tensor as loaded (``keep_as_loaded``)
        for name, p in transformer.named_parameters():  # loading made them trainable
            if any(f".{adapter}." in name for adapter in self.adapters.values()):
                p.requires_grad_(False)
                self.loaded[p] = p.data
        run_adapter(transformer, ADAPTER_NAME)  # loading made the last one run

    def keep_as_loaded(self) -> int:
        """Put back each teacher weight a backend cast (DeepSpeed's engine casts the whole network it wraps to the
        run's precision), in the dtype and values it loaded with, on the device it is on now; returns how many.
        A weight loaded in that precision is left as it is. Once only: the references held since loading go."""
        cast = [p for p, held in self.loaded.items() if p.dtype != held.dtype]
        for p in cast:
            p.data = self.loaded[p].to(p.device)
        self.loaded = {}
        return len(cast)

    def running(self, teacher: str):
        """The teacher named ``teacher`` runs inside (its adapter alone), the adapter that ran before after."""
        return adapter_running(self.transformer, self.adapters[teacher])
