"""The prompt cache (data.enable_preprocess): what it returns is what the encoders return,
it is never stale and never corrupt, and training with it is training without it."""

import logging
import os
import threading

import pytest
import torch
from helpers_runs import TINY_MODELS, tiny_run_config
from safetensors import safe_open

from flow_factory import prompt_cache
from flow_factory.config import parse_config
from flow_factory.models import load_adapter
from flow_factory.prompt_cache import PromptCache, encoder_fingerprint
from flow_factory.trainer import Trainer

PAIRS = [("a red circle", "blurry"), ("a blue square", None), ("two yellow stars", "ugly"), ("a lake", None),
         ("a cat", "dark")]


def _build(adapter, folder, guidance, batch_size=2, **kw):
    return PromptCache.build(adapter, [(p, n, guidance) for p, n in PAIRS], folder, batch_size, **kw)


@pytest.mark.parametrize("model_type", sorted(TINY_MODELS))
@pytest.mark.parametrize("guidance", [1.0, 4.5])
def test_cached_conditioning_is_what_the_encoders_give(request, tmp_path, model_type, guidance):
    adapter = load_adapter(model_type, request.getfixturevalue(TINY_MODELS[model_type][0]))
    cache = _build(adapter, tmp_path, guidance)
    for start in range(0, len(PAIRS), 2):  # the batches the cache was built in
        batch = PAIRS[start:start + 2]
        fresh = adapter.encode([p for p, _ in batch], [n or "" for _, n in batch], guidance)
        cached = cache.lookup(batch, adapter.uses_cfg(guidance), "cpu")
        assert cached.keys() == fresh.keys()
        for name in fresh:
            assert cached[name].dtype == fresh[name].dtype and torch.equal(cached[name], fresh[name]), name
    # any order and repetition, as a group repeats its prompt
    again = cache.lookup([PAIRS[3], PAIRS[0], PAIRS[3]], adapter.uses_cfg(guidance), "cpu")
    first = cache.lookup([PAIRS[3]], adapter.uses_cfg(guidance), "cpu")
    assert all(torch.equal(again[k][0], first[k][0]) and torch.equal(again[k][2], first[k][0]) for k in first)
    assert cache.lookup([("never cached", None)], adapter.uses_cfg(guidance), "cpu") is None


def test_the_fingerprint_follows_what_the_encoding_depends_on(tiny_sd3_path):
    adapter = load_adapter("sd3-5", tiny_sd3_path)
    base = encoder_fingerprint(adapter)
    assert encoder_fingerprint(load_adapter("sd3-5", tiny_sd3_path)) == base  # a fresh load: the same
    with torch.no_grad():
        weight = next(adapter.pipeline.text_encoder_3.parameters())
        weight.view(-1)[7] += 1e-3  # one value of one tensor
    assert encoder_fingerprint(adapter) != base
    adapter = load_adapter("sd3-5", tiny_sd3_path)
    adapter.pipeline.tokenizer_3.model_max_length = 8
    assert encoder_fingerprint(adapter) != base
    adapter = load_adapter("sd3-5", tiny_sd3_path)
    adapter.max_sequence_length = 7
    assert encoder_fingerprint(adapter) != base
    adapter = load_adapter("sd3-5", tiny_sd3_path)
    adapter.pipeline.tokenizer.add_tokens(["<new-word>"])
    assert encoder_fingerprint(adapter) != base


def test_training_settings_reuse_the_cache_and_a_new_prompt_adds_to_it(tmp_path, tiny_sd3_path, monkeypatch):
    config = tiny_run_config(tmp_path / "a", "sd3-5", tiny_sd3_path, learning_rate=1e-3)
    config["data"]["cache_dir"] = str(tmp_path / "cache")
    Trainer(parse_config(config)).close()
    shards = sorted((tmp_path / "cache").rglob("*.safetensors"))
    assert shards and len({p.parent for p in shards}) == 1

    # other training settings, the same encoders: nothing is encoded again
    other = tiny_run_config(tmp_path / "b", "sd3-5", tiny_sd3_path, learning_rate=1e-5, group_size=3,
                            per_device_batch_size=3)
    other["data"]["cache_dir"] = str(tmp_path / "cache")
    calls = []
    monkeypatch.setattr(PromptCache, "_encode", lambda self, adapter, items, *a, **k: calls.append(len(items)))
    Trainer(parse_config(other)).close()
    assert calls == [0] and sorted((tmp_path / "cache").rglob("*.safetensors")) == shards
    monkeypatch.undo()

    # a prompt file with one new prompt: only it is encoded
    (tmp_path / "b" / "data" / "train.txt").write_text("a red circle\na brand new prompt\n")
    encoded = []
    original = PromptCache._encode
    monkeypatch.setattr(PromptCache, "_encode",
                        lambda self, adapter, items, *a, **k: (encoded.append(items), original(self, adapter, items,
                                                                                             *a, **k)))
    Trainer(parse_config(other)).close()
    assert [p for p, _, _ in encoded[0]] == ["a brand new prompt"]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_shard_is_rebuilt_with_a_warning(tmp_path, tiny_sd3_path, damage, caplog):
    adapter = load_adapter("sd3-5", tiny_sd3_path)
    good = _build(adapter, tmp_path, 4.5)
    reference = good.lookup(PAIRS, True, "cpu")
    shard = sorted(good.folder.glob("*.safetensors"))[0]
    original = shard.read_bytes()
    data = bytearray(original)
    if damage == "flip":
        data[-5] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        rebuilt = _build(adapter, tmp_path, 4.5)
    assert any("is damaged" in r.getMessage() for r in caplog.records)
    assert shard.read_bytes() == original  # encoded again: the same batch gives the same shard
    again = rebuilt.lookup(PAIRS, True, "cpu")
    assert all(torch.equal(again[k], reference[k]) for k in reference)


def test_force_reprocess_encodes_everything_again(tmp_path, tiny_sd3_path):
    adapter = load_adapter("sd3-5", tiny_sd3_path)
    first = {p.name for p in _build(adapter, tmp_path, 4.5).folder.glob("*.safetensors")}
    shards = list(_build(adapter, tmp_path, 4.5, batch_size=5, force=True).folder.glob("*.safetensors"))
    assert len(shards) == 1 and shards[0].name not in first  # one batch of 5 now, the old shards gone


def _shown_late(adapter, staging, cache_folder, delay_s):
    """Process 0's share of PAIRS (every second one), encoded into ``staging`` and moved into the cache
    folder ``delay_s`` seconds from now: what a process sees of a shard another machine wrote just before
    the barrier, on a shared file system whose directory cache lists it late."""
    items = [(p, n, 4.5) for p, n in PAIRS[0::2]]
    shards = sorted(PromptCache.build(adapter, items, staging, 2).folder.glob("*.safetensors"))
    timer = threading.Timer(delay_s, lambda: [os.replace(s, cache_folder / s.name) for s in shards])
    timer.start()
    return timer


@pytest.mark.parametrize("shows", [True, False])
def test_a_process_waits_a_bounded_time_for_the_shards_of_the_others(tmp_path, tiny_sd3_path, monkeypatch, shows):
    """Process 1 of 2 encodes its share, and once past the barrier reads the whole cache, waiting for process
    0's shards to show in the folder; if they never do, the error says how many entries are missing and
    where, after a bounded wait."""
    monkeypatch.setattr(prompt_cache, "VISIBLE_WITHIN_S", 30.0 if shows else 0.5)
    adapter = load_adapter("sd3-5", tiny_sd3_path)
    folder = tmp_path / "shared" / encoder_fingerprint(adapter)
    folder.mkdir(parents=True)
    timer = _shown_late(adapter, tmp_path / "staging", folder, 1.0 if shows else 3600.0)
    try:
        if not shows:
            with pytest.raises(RuntimeError, match=r"3 entries missing after encoding \(e.g. 'a red circle'\) on "
                               r"process 1 of 2, which saw 5 of 5 missing and encoded the 2 it owns, then "
                               r"waited 0.5 s .* is data.cache_dir shared by every process\?"):
                _build(adapter, tmp_path / "shared", 4.5, share=(1, 2, False))
            return
        cache = _build(adapter, tmp_path / "shared", 4.5, share=(1, 2, False))
    finally:
        timer.cancel()
    assert len(list(folder.glob("000-*.safetensors"))) == 2 and len(list(folder.glob("001-*.safetensors"))) == 1
    reference = _build(adapter, tmp_path / "one_process", 4.5)  # the same prompts, encoded by one process
    got, expected = cache.lookup(PAIRS, True, "cpu"), reference.lookup(PAIRS, True, "cpu")
    _assert_same_rows(got, expected)


def test_two_processes_encode_every_entry_once_when_one_scans_after_the_other_wrote(tmp_path, tiny_sd3_path,
                                                                                   monkeypatch):
    """Past the first barrier process 1 scans, encodes and writes before process 0 has scanned (process 0
    descheduled: seen in the suite's two-process launches on 2 cores). Process 0 then sees fewer entries
    missing than process 1 did; each still encodes just the entries it owns, so every entry is encoded
    once, by one process. (Shares cut from what each process saw left an entry to nobody.)"""
    monkeypatch.setattr(prompt_cache, "VISIBLE_WITHIN_S", 2.0)  # every shard is written before the barrier
    adapter = load_adapter("sd3-5", tiny_sd3_path)
    both, written = threading.Barrier(2, timeout=60), threading.Event()
    calls = {0: 0, 1: 0}

    def barrier(rank):
        calls[rank] += 1
        if rank == 1 and calls[1] == 2:
            written.set()  # process 1's shards are in the folder
        both.wait()
        if rank == 0 and calls[0] == 1:
            assert written.wait(60)  # process 0 scans only after process 1 has written

    caches, errors = {}, []

    def process(rank):
        try:
            caches[rank] = _build(adapter, tmp_path, 4.5, share=(rank, 2, rank == 0), barrier=lambda: barrier(rank))
        except BaseException as e:  # noqa: BLE001 (handed to the test's thread)
            errors.append(e)
            both.abort()

    threads = [threading.Thread(target=process, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]
    encoded = [key for shard in caches[0].folder.glob("*.safetensors") for key in _entry_keys(shard)]
    assert len(encoded) == len(set(encoded)) == len(PAIRS)  # each entry once
    reference = _build(adapter, tmp_path / "one_process", 4.5)
    expected = reference.lookup(PAIRS, True, "cpu")
    for rank in (0, 1):
        got = caches[rank].lookup(PAIRS, True, "cpu")
        _assert_same_rows(got, expected)


def _assert_same_rows(got: dict, expected: dict) -> None:
    """The same conditioning, up to the rounding a batch of other prompts of the same shape could bring."""
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.allclose(got[name], expected[name], rtol=0, atol=1e-6), name


def _entry_keys(shard) -> set:
    with safe_open(shard, "pt") as f:
        return {name.partition(".")[0] for name in f.keys()}


def _one_epoch_weights(tmp_path, model_path, **data):
    config = tiny_run_config(tmp_path, "sd3-5", model_path, max_epochs=1)
    config["data"].update(data)
    config["log"]["logging_backend"] = "none"
    trainer = Trainer(parse_config(config))
    trainer.train()
    return trainer, [p.detach().clone() for p in trainer.params]


def test_a_run_with_the_cache_ends_with_the_weights_of_a_run_without(tmp_path, tiny_sd3_path, monkeypatch):
    """The same encoder calls give the same run. The text encoders' float32 matmuls round by batch
    shape (a pooled embedding moves by ~4e-7 between a prompt encoded alone and in a batch of 4),
    so the cache is built one prompt at a time here, as the live run encodes them (a rollout batch
    of 2 holds one prompt twice); with other batchings both runs are equally valid and differ by
    that rounding."""
    _, without = _one_epoch_weights(tmp_path / "live", tiny_sd3_path, enable_preprocess=False)
    original = PromptCache.build

    def build_then_forbid_encoding(*args, **kwargs):  # after the cache is built, no encoder may run
        cache = original(*args, **kwargs)
        monkeypatch.setattr("flow_factory.models.sd3.SD3Adapter.encode",
                            lambda *a, **k: pytest.fail("a text encoder ran during training"))
        return cache

    monkeypatch.setattr(PromptCache, "build", build_then_forbid_encoding)
    trainer, cached = _one_epoch_weights(tmp_path / "cached", tiny_sd3_path, text_encoders_after_preprocess="free",
                                         preprocessing_batch_size=1)
    assert trainer.adapter.text_encoders() == {}  # freed: the adapter holds none
    assert trainer.eval_history  # evaluation read the cache too
    for a, b in zip(without, cached):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


def test_text_encoders_move_to_the_cpu_after_caching_by_default(tmp_path, tiny_sd3_path):
    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path)
    trainer = Trainer(parse_config(config))
    assert trainer.cfg.data.text_encoders_after_preprocess == "cpu"
    encoders = trainer.adapter.text_encoders()
    assert len(encoders) == 3
    assert {p.device.type for m in encoders.values() for p in m.parameters()} == {"cpu"}
    trainer.close()


def test_ff_eval_reads_the_runs_cache_and_matches_its_evaluation(tmp_path, tiny_sd3_path, monkeypatch,
                                                                 gpu_precision):
    """In a GPU's precision (bf16): ff-eval samples in the run's mixed_precision, or its cache would not even
    match (the text encoders' dtype is in its fingerprint)."""
    from flow_factory.evaluate import evaluate_config

    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path, max_epochs=1)
    config["log"]["logging_backend"] = "none"
    cfg = parse_config(config)
    trainer = Trainer(cfg)
    trainer.train()
    monkeypatch.setattr("flow_factory.models.sd3.SD3Adapter.encode",
                        lambda *a, **k: pytest.fail("ff-eval encoded a prompt the run's cache holds"))
    summary = evaluate_config(cfg, tmp_path / "saves" / "run" / "checkpoints" / "epoch_1")[0]
    final = trainer.eval_history[-1]
    assert final["epoch"] == 1
    assert summary["jpeg"]["mean"] == pytest.approx(final["eval/reward/jpeg"], abs=1e-6)


# what a process of a launch prints about the tiny model it loads: the cache folders it names and the order of the
# LoRA parameters its optimizer steps
_CROSS_PROCESS = """
import sys
from flow_factory.models import load_adapter
from flow_factory.models.lora import apply_lora
from flow_factory.prompt_cache import condition_fingerprint, encoder_fingerprint
adapter = load_adapter("sd3-5", sys.argv[1])
print(encoder_fingerprint(adapter), condition_fingerprint(adapter))
apply_lora(adapter.transformer, 2, 2.0, "default", adapter.default_lora_targets)
print(*(n for n, p in adapter.transformer.named_parameters() if p.requires_grad))
"""


def test_every_process_names_the_same_cache_folders_and_parameter_order(tiny_sd3_path):
    """The processes of a launch (and a run's resume) are fresh interpreters, each with its own hash seed: what they
    must agree on may not follow set order or ``hash()`` (the condition fingerprint hashed diffusers' list of
    defaulted keys, made from a set: process 1 named a folder process 0 never made)."""
    import subprocess
    import sys

    said = [subprocess.run([sys.executable, "-c", _CROSS_PROCESS, str(tiny_sd3_path)], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout.splitlines()
            for seed in ("1", "2")]
    assert said[0][0].split()[1].startswith("conditions-") and len(said[0][1].split()) > 1, said[0]
    assert said[0] == said[1]


def test_a_set_in_a_config_is_hashed_in_one_order():
    """A set-valued config entry iterates in its interpreter's hash-seed order: the fingerprints hash it sorted, so
    two processes of a launch (each its own seed) agree."""
    import os
    import subprocess
    import sys

    code = ("from flow_factory.prompt_cache import hashed_config; "
            "print(hashed_config({'targets': {f'module_{i}' for i in range(20)}}))")
    hashed = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                             capture_output=True, text=True, check=True).stdout for seed in ("1", "2")}
    assert len(hashed) == 1 and "module_19" in hashed.pop()
