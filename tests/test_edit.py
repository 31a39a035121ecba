"""Image editing: edit prompt files (an input image per prompt, checked at load)."""

import json

import pytest
from PIL import Image

from digenrl.config import PromptConfig
from digenrl.data.prompts import PromptError, load_prompt_set, load_splits


def _png(path, color=(200, 30, 30), size=(8, 8)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return path


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_edit_jsonl_resolves_images_relative_to_the_file_and_keeps_metadata(tmp_path, monkeypatch):
    _png(tmp_path / "data" / "img" / "a.png")
    _png(tmp_path / "data" / "img" / "b.png", (0, 0, 255))
    f = _jsonl(tmp_path / "data" / "edits.jsonl", [
        {"prompt": "make it blue", "image": "img/a.png", "tag": "color"},
        {"prompt": "merge them", "image": ["img/a.png", "img/b.png"]},
    ])
    monkeypatch.chdir(tmp_path)  # paths resolve against the file's folder, not the cwd
    ps = load_prompt_set(f)
    assert ps.prompts == ["make it blue", "merge them"]
    assert ps.is_edit
    a, b = str((tmp_path / "data/img/a.png").resolve()), str((tmp_path / "data/img/b.png").resolve())
    assert ps.images == [[a], [a, b]]
    assert ps.metadata[0] == {"prompt": "make it blue", "image": a, "tag": "color"}
    # the split keeps each prompt's image with it
    train, test = load_splits(PromptConfig(file=f, test_fraction=0.5, split_seed=0))
    assert test is not None and sorted(train.images + test.images) == sorted(ps.images)


def test_text_prompts_are_not_edits(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("a cat\n")
    ps = load_prompt_set(str(f))
    assert not ps.is_edit and ps.images == [[]]


@pytest.mark.parametrize("make, image, message", [
    (lambda d: None, "gone.png", r"line 2: input image '.*gone\.png' does not exist"),
    (lambda d: (d / "x.png").write_bytes(b"not a png at all"), "x.png",
     r"line 2: input image '.*x\.png' is not an image"),
    (lambda d: (d / "t.png").write_bytes(_png(d / "full.png", size=(64, 64)).read_bytes()[:60]),
     "t.png", r"line 2: input image '.*t\.png' (is not a valid image|cannot be read)"),
    (lambda d: (d / "dir.png").mkdir(), "dir.png", r"line 2: input image '.*dir\.png' does not exist"),
    (lambda d: None, 3, r"line 2: expected 'image' to be a path or a list of 1 to 8 paths, got 3"),
    (lambda d: None, [], r"line 2: expected 'image' to be a path or a list"),
])
def test_bad_input_image_is_one_line_naming_the_file_and_the_line(tmp_path, make, image, message):
    _png(tmp_path / "ok.png")
    make(tmp_path)
    f = _jsonl(tmp_path / "e.jsonl", [{"prompt": "fine", "image": "ok.png"},
                                      {"prompt": "bad", "image": image}])
    with pytest.raises(PromptError, match=message) as e:
        load_prompt_set(f)
    assert "\n" not in str(e.value) and "e.jsonl" in str(e.value)


def test_unreadable_image_is_named(tmp_path):
    import os
    if os.geteuid() == 0:
        pytest.skip("root reads files whatever their mode")
    p = _png(tmp_path / "locked.png")
    p.chmod(0)
    f = _jsonl(tmp_path / "e.jsonl", [{"prompt": "x", "image": "locked.png"}])
    with pytest.raises(PromptError, match=r"line 1: input image '.*locked\.png' cannot be read"):
        load_prompt_set(f)


def test_a_file_mixing_edit_and_text_prompts_is_refused(tmp_path):
    _png(tmp_path / "a.png")
    f = _jsonl(tmp_path / "e.jsonl", [{"prompt": "x", "image": "a.png"}, {"prompt": "y"}])
    with pytest.raises(PromptError, match=r"line 2: no 'image' field, but line 1 has one"):
        load_prompt_set(f)
