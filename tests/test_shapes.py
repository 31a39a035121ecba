"""The procedural shapes world: deterministic scenes, parseable prompts, colours where expected."""

import random

import pytest
import torch

from digenrl.data.prompts import PromptError, builtin_prompts, load_prompts
from digenrl.data.shapes import (
    COLOURS,
    SHAPES,
    PromptParseError,
    Scene,
    all_prompts,
    make_batch,
    make_example,
    parse_prompt,
    render,
)


def test_same_seed_gives_same_images_and_prompts():
    a_img, a_p = make_batch(random.Random(7), 6)
    b_img, b_p = make_batch(random.Random(7), 6)
    c_img, _ = make_batch(random.Random(8), 6)
    assert torch.equal(a_img, b_img) and a_p == b_p
    assert not torch.equal(a_img, c_img)
    assert a_img.dtype == torch.uint8 and a_img.shape == (6, 3, 32, 32)


def test_every_generated_prompt_parses_back_to_its_parts():
    rng = random.Random(0)
    for _ in range(50):
        _, prompt = make_example(rng)
        shape, colour, background = parse_prompt(prompt)
        assert shape in SHAPES and colour in COLOURS and background in COLOURS
        assert colour != background


def test_swapped_colours_give_different_bags_of_words():
    # The tiny models' prompt encoder is order-blind, so the words themselves must differ.
    a = Scene(shape="circle", colour="red", background="blue", cx=16.0, cy=16.0, radius=8.0)
    b = Scene(shape="circle", colour="blue", background="red", cx=16.0, cy=16.0, radius=8.0)
    assert sorted(a.prompt.split()) != sorted(b.prompt.split())
    assert parse_prompt(a.prompt) == ("circle", "red", "blue")
    assert parse_prompt("a red circle on a blue background") == ("circle", "red", "blue")


def test_grammar_has_every_shape_colour_background_combination():
    prompts = all_prompts()
    assert len(prompts) == len(set(prompts)) == len(SHAPES) * len(COLOURS) * (len(COLOURS) - 1)


@pytest.mark.parametrize("shape", SHAPES)
def test_shape_colour_at_centre_and_background_colour_in_corners(shape):
    scene = Scene(shape=shape, colour="red", background="blue", cx=16.0, cy=16.0, radius=9.0)
    img = render(scene)
    assert img[:, 16, 16].tolist() == list(COLOURS["red"])
    for y, x in ((0, 0), (0, 31), (31, 0), (31, 31)):
        assert img[:, y, x].tolist() == list(COLOURS["blue"])


def test_shapes_differ_in_area_and_edges_are_anti_aliased():
    masks = {}
    for shape in SHAPES:
        img = render(Scene(shape=shape, colour="white", background="black", cx=16.0, cy=16.0, radius=10.0))
        masks[shape] = img[0]
    assert len({int((m > 128).sum()) for m in masks.values()}) == len(SHAPES)
    values = masks["circle"].unique()
    assert len(values) > 2  # intermediate values on the rim


def test_prompted_example_follows_the_prompt_and_stays_inside_the_image():
    rng = random.Random(1)
    for _ in range(20):
        img, prompt = make_example(rng, "a yellow triangle on a purple background")
        assert prompt == "a yellow triangle on a purplish background"
        border = torch.cat([img[:, 0], img[:, -1], img[:, :, 0], img[:, :, -1]], dim=1)
        assert (border == torch.tensor(COLOURS["purple"], dtype=torch.uint8).view(3, 1)).all()
        assert (img == torch.tensor(COLOURS["yellow"], dtype=torch.uint8).view(3, 1, 1)).all(0).any()


@pytest.mark.parametrize("prompt, word", [
    ("a red hexagon on a bluish background", "hexagon"),
    ("a pink circle on a bluish background", "pink"),
    ("a red circle on a pinkish background", "pinkish"),
    ("a red circle", "expected 'a <colour>"),
])
def test_prompt_outside_grammar_is_rejected_naming_the_word(prompt, word):
    with pytest.raises(PromptParseError, match=word):
        parse_prompt(prompt)


def test_builtin_prompt_set_is_a_few_dozen_grammar_prompts():
    prompts = builtin_prompts()
    assert 24 <= len(prompts) <= 100
    assert load_prompts("") == prompts
    for p in prompts:
        parse_prompt(p)


def test_prompt_file_skips_blank_and_comment_lines(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("# header\n\n  a cat  \n#a dog\na red circle on a blue background\n")
    assert load_prompts(str(f)) == ["a cat", "a red circle on a blue background"]


def test_missing_or_empty_prompt_file_names_the_file(tmp_path):
    with pytest.raises(PromptError, match=r"nope\.txt"):
        load_prompts(str(tmp_path / "nope.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n\n")
    with pytest.raises(PromptError, match=r"empty\.txt.*no prompts"):
        load_prompts(str(empty))
