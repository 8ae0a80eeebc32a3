"""Prompt datasets (txt / jsonl, errors that point at the line) and the epoch prompt draw."""

import json
import re

import pytest
import torch

from flow_factory.data import EpochSampler, PromptItem, load_prompts


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


# --- load_prompts ---------------------------------------------------------------


def test_txt_one_prompt_a_line_trailing_newlines_are_fine(tmp_path):
    write(tmp_path / "train.txt", "a cat\n  a dog on a skateboard  \nred apple\n\n")
    assert load_prompts(tmp_path) == [PromptItem("a cat"), PromptItem("a dog on a skateboard"),
                                      PromptItem("red apple")]


def test_jsonl_with_negative_prompts_and_extra_keys(tmp_path):
    rows = [{"prompt": "a cat", "negative_prompt": "blurry"}, {"prompt": "a dog", "tag": "animals"},
            {"prompt": "a fox", "negative_prompt": None}]
    write(tmp_path / "test.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    assert load_prompts(tmp_path, split="test") == [PromptItem("a cat", "blurry"), PromptItem("a dog"),
                                                    PromptItem("a fox")]


def test_jsonl_wins_over_txt_and_max_size_keeps_the_first(tmp_path):
    write(tmp_path / "train.txt", "from txt\n")
    write(tmp_path / "train.jsonl", '{"prompt": "one"}\n{"prompt": "two"}\n{"prompt": "three"}\n')
    assert [p.prompt for p in load_prompts(tmp_path, max_size=2)] == ["one", "two"]


def test_missing_file_names_both_candidates(tmp_path):
    write(tmp_path / "test.txt", "only a test split\n")
    with pytest.raises(FileNotFoundError, match=r"train\.jsonl and train\.txt"):
        load_prompts(tmp_path, split="train")


@pytest.mark.parametrize(
    "name, text, line, message",
    [
        ("train.txt", "a cat\n\na dog\n", 2, "empty prompt"),
        ("train.txt", "a cat\n   \na dog\n", 2, "empty prompt"),
        ("train.jsonl", '{"prompt": "a"}\n{"prompt": "b",}\n', 2, "not valid JSON"),
        ("train.jsonl", '{"prompt": "a"}\n{"prompt": "b"}\n{"caption": "c"}\n', 3, "missing 'prompt' key"),
        ("train.jsonl", '{"prompt": "  "}\n', 1, "empty prompt"),
        ("train.jsonl", '["a cat"]\n', 1, "expected a JSON object"),
        ("train.jsonl", '{"prompt": "a", "negative_prompt": 3}\n', 1, "'negative_prompt' must be a string"),
    ],
)
def test_errors_name_file_and_line(tmp_path, name, text, line, message):
    path = write(tmp_path / name, text)
    with pytest.raises(ValueError, match=re.escape(f"{path}:{line}: {message}")):
        load_prompts(tmp_path)


def test_an_empty_file_is_an_error(tmp_path):
    path = write(tmp_path / "train.txt", "\n\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}: no prompts")):
        load_prompts(tmp_path)


# --- EpochSampler -----------------------------------------------------------------


def test_draw_is_distinct_prompts_in_contiguous_groups():
    sampler = EpochSampler(num_prompts=10, unique_per_epoch=4, group_size=3, seed=7)
    indices, group_ids = sampler.draw(epoch=5)
    assert len(indices) == len(sampler) == 12
    assert group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    groups = indices.view(4, 3)
    assert (groups == groups[:, :1]).all()  # one prompt per group
    assert len(set(groups[:, 0].tolist())) == 4  # four different prompts
    assert all(0 <= i < 10 for i in indices.tolist())


def test_draw_depends_only_on_seed_and_epoch():
    a = EpochSampler(50, 8, 2, seed=3)
    b = EpochSampler(50, 8, 2, seed=3)  # a resumed run builds a fresh sampler
    assert torch.equal(a.draw(4).prompt_indices, b.draw(4).prompt_indices)
    assert torch.equal(a.draw(4).prompt_indices, a.draw(4).prompt_indices)
    epochs = {tuple(a.draw(e).prompt_indices.tolist()) for e in range(5)}
    assert len(epochs) == 5  # epochs differ
    # (seed, epoch) are mixed, not added: (3, 1) and (4, 0) are different draws
    assert not torch.equal(a.draw(1).prompt_indices, EpochSampler(50, 8, 2, seed=4).draw(0).prompt_indices)


def test_every_prompt_gets_drawn_over_many_epochs():
    sampler = EpochSampler(20, 5, 1, seed=0)
    seen = set()
    for epoch in range(60):
        seen.update(sampler.draw(epoch).prompt_indices.tolist())
    assert seen == set(range(20))


def test_whole_dataset_per_epoch_is_a_permutation():
    indices, _ = EpochSampler(6, 6, 2, seed=1).draw(0)
    assert sorted(indices[::2].tolist()) == list(range(6))


def test_sampler_errors():
    with pytest.raises(ValueError, match=r"between 1 and the number of prompts \(3\)"):
        EpochSampler(3, 4, 2)
    with pytest.raises(ValueError, match="group_size"):
        EpochSampler(3, 2, 0)


def test_process_share_lays_samples_out_whole_or_by_global_micro_batch():
    from flow_factory.data import process_share

    # default: a contiguous share each
    assert process_share(12, 1, 2).tolist() == [6, 7, 8, 9, 10, 11]
    # by global micro-batch of 2 x 3: each process's m-th micro-batch is its part of the m-th global one
    assert process_share(12, 0, 2, 3).tolist() == [0, 1, 2, 6, 7, 8]
    assert process_share(12, 1, 2, 3).tolist() == [3, 4, 5, 9, 10, 11]
    assert process_share(12, 0, 1, 3).tolist() == list(range(12))
    with pytest.raises(ValueError, match="global micro-batches of 2 x 4"):
        process_share(12, 0, 2, 4)
