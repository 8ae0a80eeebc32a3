"""Prompt datasets (txt / jsonl, errors that point at the line) and the epoch prompt draw."""

import json
import re

import pytest
import torch

from flow_factory.data import EpochSampler, PromptFileError, PromptItem, load_prompts, read_video


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


# --- load_prompts ---------------------------------------------------------------


def test_txt_one_prompt_a_line_trailing_newlines_are_fine(tmp_path):
    write(tmp_path / "train.txt", "a cat\n  a dog on a skateboard  \nred apple\n\n")
    assert load_prompts(tmp_path) == [PromptItem("a cat"), PromptItem("a dog on a skateboard"),
                                      PromptItem("red apple")]


def test_jsonl_with_negative_prompts_and_extra_keys(tmp_path):
    """Keys other than the prompt's and the condition files' are the row's metadata (rewards may ask for it)."""
    rows = [{"prompt": "a cat", "negative_prompt": "blurry"}, {"prompt": "a dog", "tag": "animals", "n": [1, 2]},
            {"prompt": "a fox", "negative_prompt": None}]
    write(tmp_path / "test.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    items = load_prompts(tmp_path, split="test")
    assert items == [PromptItem("a cat", "blurry"), PromptItem("a dog", metadata={"tag": "animals", "n": [1, 2]}),
                     PromptItem("a fox")]
    assert items[1].source == f"{tmp_path / 'test.jsonl'}:2"


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


# --- condition files (conditioned models) ---------------------------------------------------


def image_file(path, size=(24, 16), frames=1):
    """A PNG (or, with frames > 1, an animated GIF) of ``size`` (width, height)."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    pictures = [Image.new("RGB", size, (40 * i, 100, 200)) for i in range(frames)]
    pictures[0].save(path, save_all=frames > 1, append_images=pictures[1:])
    return path


def video_file(path, size=(24, 16), frames=3, fps=8):
    """An H.264 mp4 of ``frames`` flat frames of ``size`` (width, height)."""
    from PIL import Image

    from flow_factory.media.video import write_mp4

    path.parent.mkdir(parents=True, exist_ok=True)
    return write_mp4([Image.new("RGB", size, (40 * i, 100, 200)) for i in range(frames)], path, fps)


def audio_file(path):
    """An mp4 holding one AAC audio stream and no video."""
    import av
    import numpy as np

    with av.open(str(path), "w") as container:
        stream = container.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def jsonl(path, *rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    return write(path, "".join(json.dumps(r) + "\n" for r in rows))


def test_rows_name_condition_files_under_images_and_videos(tmp_path):
    image_file(tmp_path / "images" / "a.png")
    image_file(tmp_path / "images" / "sub" / "b.png", size=(32, 8))
    image_file(tmp_path / "videos" / "clip.gif", frames=3)
    elsewhere = image_file(tmp_path / "abs.png")
    jsonl(tmp_path / "train.jsonl", {"prompt": "one", "image": "a.png"},
          {"prompt": "two", "images": ["sub/b.png", str(elsewhere)], "video": "clip.gif", "score": 0.5},
          {"prompt": "three", "images": []})
    one, two, three = load_prompts(tmp_path)
    assert [f.path for f in one.images] == [tmp_path / "images" / "a.png"] and one.images[0].size == (24, 16)
    assert [f.path for f in two.images] == [tmp_path / "images" / "sub" / "b.png", elsewhere]
    assert two.images[0].aspect_ratio == 8 / 32
    assert [(f.path.name, f.frames) for f in two.videos] == [("clip.gif", 3)]
    assert two.metadata == {"score": 0.5} and three.images == () and three.metadata == {}
    assert one.condition_key != two.condition_key


@pytest.mark.parametrize("suffix", [".mp4", ".mov", ".webm"])
def test_a_row_may_name_a_video_container_which_pyav_reads(tmp_path, suffix):
    """Flow-Factory's datasets hold mp4: any container FFmpeg decodes is a video, read frame by frame."""
    if suffix == ".webm":  # VP9 in WebM, as browsers record: a container that records no frame count
        import av
        from PIL import Image

        (tmp_path / "videos").mkdir()
        with av.open(str(tmp_path / "videos" / "clip.webm"), "w") as container:
            stream = container.add_stream("libvpx", rate=8)
            stream.width, stream.height, stream.pix_fmt = 24, 16, "yuv420p"
            for i in range(3):
                image = Image.new("RGB", (24, 16), (40 * i, 100, 200))
                container.mux(stream.encode(av.VideoFrame.from_image(image)))
            container.mux(stream.encode())
    else:
        video_file(tmp_path / "videos" / f"clip{suffix}")
    jsonl(tmp_path / "train.jsonl", {"prompt": "one", "video": f"clip{suffix}"})
    item, = load_prompts(tmp_path)
    file, = item.videos
    assert (file.size, file.frames) == ((24, 16), 3)
    frames = read_video(file)
    assert len(frames) == 3 and all(f.mode == "RGB" and f.size == (24, 16) for f in frames)
    # the frames in their order: red rises 40 levels a frame (libvpx's default bitrate blurs more than CRF 18)
    reds = [f.getpixel((12, 8))[0] for f in frames]
    assert reds[0] < reds[1] < reds[2] and abs(reds[2] - 80) < 20


def test_image_dir_and_video_dir_move_the_folders(tmp_path):
    image_file(tmp_path / "pics" / "a.png")
    jsonl(tmp_path / "data" / "train.jsonl", {"prompt": "one", "image": "a.png"})
    item, = load_prompts(tmp_path / "data", image_dir=tmp_path / "pics")
    assert item.images[0].path == tmp_path / "pics" / "a.png"


@pytest.mark.parametrize("row, make, message", [
    ({"image": "gone.png"}, None, "image 'gone.png' ({images}/gone.png) not found"),
    ({"image": "text.png"}, "text", "image 'text.png' ({images}/text.png) cannot be read as an image or animation"),
    ({"image": "clip.mp4"}, "mp4", "image 'clip.mp4' ({images}/clip.mp4) is a .mp4 video, not an image; list it "
                                   "under 'video'"),
    ({"image": "anim.gif"}, "anim", "image 'anim.gif' ({images}/anim.gif) has 3 frames: a video, not an image; "
                                    "list it under 'video'"),
    ({"image": "sub"}, "dir", "image 'sub' ({images}/sub) not a file"),
    ({"video": "still.png"}, "still", "video 'still.png' ({videos}/still.png) is a single image, not a video; list "
                                      "it under 'image'"),
    ({"video": "clip.mp4"}, "mp4", "video 'clip.mp4' ({videos}/clip.mp4) cannot be read as a video (Invalid data "
                                   "found when processing input)"),
    ({"video": "notes.txt"}, "text", "video 'notes.txt' ({videos}/notes.txt) cannot be read as a video"),
    ({"video": "sound.mp4"}, "audio", "video 'sound.mp4' ({videos}/sound.mp4) has no video stream (it holds audio "
                                      "streams)"),
    ({"video": "one.mp4"}, "one", "video 'one.mp4' ({videos}/one.mp4) has 1 frame; a video needs two or more"),
    ({"image": "a.png", "images": ["a.png"]}, None, "both 'image' and 'images'; give one of them"),
    ({"images": ["a.png", 3]}, None, "'images' must be a path or a list of paths, got ['a.png', 3]"),
])
def test_a_bad_condition_file_names_the_file_and_the_line(tmp_path, row, make, message):
    for folder in ("images", "videos"):
        target = tmp_path / folder
        if make == "text":
            target.mkdir(exist_ok=True)
            write(target / "text.png", "not a picture")
            write(target / "notes.txt", "not a video")
        elif make == "audio":
            target.mkdir(exist_ok=True)
            audio_file(target / "sound.mp4")
        elif make == "one":
            video_file(target / "one.mp4", frames=1)
        elif make == "mp4":
            target.mkdir(exist_ok=True)
            (target / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
        elif make == "anim":
            image_file(target / "anim.gif", frames=3)
        elif make == "dir":
            (target / "sub").mkdir(parents=True)
        elif make == "still":
            image_file(target / "still.png")
    path = jsonl(tmp_path / "train.jsonl", {"prompt": "fine"}, {"prompt": "bad", **row})
    with pytest.raises(PromptFileError) as info:
        load_prompts(tmp_path)
    expected = message.format(images=tmp_path / "images", videos=tmp_path / "videos")
    assert str(info.value).startswith(f"{path}:2: {expected}"), str(info.value)


def test_rows_past_max_size_are_not_opened(tmp_path):
    image_file(tmp_path / "images" / "a.png")
    jsonl(tmp_path / "train.jsonl", {"prompt": "one", "image": "a.png"}, {"prompt": "two", "image": "gone.png"})
    assert [it.prompt for it in load_prompts(tmp_path, max_size=1)] == ["one"]
    with pytest.raises(PromptFileError, match="gone.png"):
        load_prompts(tmp_path)


@pytest.mark.parametrize("row, takes, message", [
    ({}, ("images",), "flux1-kontext takes 1 condition images per prompt ('image' / 'images'), the row names 0"),
    ({"images": ["a.png", "a.png"]}, ("images",),
     "flux1-kontext takes 1 condition images per prompt ('image' / 'images'), the row names 2"),
    ({"video": "clip.gif"}, ("images",), "flux1-kontext generates from condition images, but the row names 1 "
                                         "condition videos ('video')"),
    ({"image": "a.png"}, (), "flux1-kontext generates from text alone, but the row names 1 condition images "
                             "('image'); remove them, or use a model that takes them"),
])
def test_rows_must_give_what_the_model_takes(tmp_path, row, takes, message):
    from flow_factory.data.conditions import check_conditions

    image_file(tmp_path / "images" / "a.png")
    image_file(tmp_path / "videos" / "clip.gif", frames=2)
    path = jsonl(tmp_path / "train.jsonl", {"prompt": "p", **row})
    with pytest.raises(PromptFileError, match=re.escape(f"{path}:1: {message}")):
        check_conditions(load_prompts(tmp_path), "flux1-kontext", takes, (1, 1))


def test_auto_resize_takes_the_conditions_aspect_ratio_at_the_area_of_resolution(tmp_path):
    from flow_factory.data.conditions import generated_size

    for name, size in (("wide.png", (83, 50)), ("also.png", (166, 100)), ("tall.png", (50, 83))):
        image_file(tmp_path / "images" / name, size=size)
    rows = [{"prompt": "p", "image": "wide.png"}, {"prompt": "q", "image": "also.png"}]
    path = jsonl(tmp_path / "train.jsonl", *rows)
    items = load_prompts(tmp_path)
    assert generated_size(items, (64, 64), False, 16, "train.auto_resize") == (64, 64)
    # 64 x 64 pixels at height / width = 50 / 83: 49.7 x 82.5, to multiples of 16
    assert generated_size(items, (64, 64), True, 16, "train.auto_resize") == (48, 80)
    jsonl(tmp_path / "train.jsonl", *rows, {"prompt": "r", "image": "tall.png"})
    with pytest.raises(PromptFileError, match=re.escape(
            f"{path}:3: train.auto_resize generates at the condition's aspect ratio, and the samples of a run share "
            f"one size, but tall.png is 50x83 (width x height) where wide.png ({path}:1) is 83x50; set "
            "train.auto_resize: false")):
        generated_size(load_prompts(tmp_path), (64, 64), True, 16, "train.auto_resize")


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
