"""Reward functions on hand-made images, the weighted sum, plug-ins and every error path."""

import math
import random

import pytest
import torch

from digenrl.config import RewardTerm
from digenrl.data.shapes import COLOURS, make_example
from digenrl.rl.rewards import BUILTIN, RewardError, build_reward, prompt_colours


def flat(rgb: tuple[int, int, int], n: int = 1, size: int = 32) -> torch.Tensor:
    return torch.tensor(rgb, dtype=torch.uint8).view(1, 3, 1, 1).expand(n, 3, size, size).clone()


def noise(n: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, 32, 32), generator=g, dtype=torch.uint8)


def two_colour(shape_rgb, bg_rgb) -> torch.Tensor:
    """A 32x32 image: background colour with a 12x12 block of the shape colour."""
    img = flat(bg_rgb)
    img[:, :, 10:22, 10:22] = torch.tensor(shape_rgb, dtype=torch.uint8).view(1, 3, 1, 1)
    return img


def test_flat_image_compresses_better_than_noise():
    images = torch.cat([flat((120, 60, 200)), noise()])
    comp = BUILTIN["jpeg_compressibility"](images, ["", ""])
    incomp = BUILTIN["jpeg_incompressibility"](images, ["", ""])
    assert comp[0] > comp[1]
    assert incomp[1] > incomp[0]
    assert torch.equal(comp, -incomp)
    assert comp.dtype == torch.float32 and comp.shape == (2,)


def test_brightness_orders_white_grey_black_and_spans_unit_interval():
    images = torch.cat([flat((255, 255, 255)), flat((128, 128, 128)), flat((0, 0, 0))])
    b = BUILTIN["brightness"](images, ["", "", ""])
    assert b[0].item() == pytest.approx(1.0, abs=1e-6)
    assert b[2].item() == 0.0
    assert b[0] > b[1] > b[2]


def test_brightness_weighs_green_more_than_blue_as_bt709():
    b = BUILTIN["brightness"](torch.cat([flat((0, 255, 0)), flat((0, 0, 255))]), ["", ""])
    assert b[0].item() == pytest.approx(0.7152, abs=1e-5)
    assert b[1].item() == pytest.approx(0.0722, abs=1e-5)


def test_colour_statistics_are_zero_on_grey_and_high_on_pure_red():
    images = torch.cat([flat((128, 128, 128)), flat((255, 0, 0))])
    for name in ("saturation", "colourfulness", "redness"):
        grey, red = BUILTIN[name](images, ["", ""]).tolist()
        assert grey == pytest.approx(0.0, abs=1e-6), name
        assert red > 0.5, name
    assert BUILTIN["redness"](flat((0, 0, 255)), [""]).item() < 0


def test_colourfulness_of_two_colour_image_exceeds_flat_one():
    two = two_colour((220, 30, 30), (35, 70, 220))
    c = BUILTIN["colourfulness"](torch.cat([flat((35, 70, 220)), two]), ["", ""])
    assert c[1] > c[0]


def test_pixel_std_is_zero_on_a_flat_field_and_a_bernoulli_std_on_black_and_white():
    block = two_colour((0, 0, 0), (255, 255, 255))  # a black square on white
    share = (block[0, 0] == 255).float().mean().item()  # the fraction of white values
    s = BUILTIN["pixel_std"](torch.cat([flat((40, 90, 200)), block]), ["", ""])
    assert s[0].item() == 0.0
    # all values are 0 or 1 (after / 255): the std of a Bernoulli(share) sample, unbiased
    n = block[0, 0].numel()  # values per channel
    expected = math.sqrt(share * (1 - share) * n / (n - 1))
    assert s[1].item() == pytest.approx(expected, rel=1e-5)


def test_prompt_colours_are_found_in_order():
    assert prompt_colours("a Red triangle on a blue background") == ["red", "blue"]
    assert prompt_colours("a white cross on a reddish background") == ["white", "red"]
    assert prompt_colours("a sunset") == []


def test_colour_match_is_high_for_matching_image_and_low_for_swapped_or_wrong_colours():
    prompt = "a red square on a bluish background"
    match = two_colour(COLOURS["red"], COLOURS["blue"])
    swapped = two_colour(COLOURS["blue"], COLOURS["red"])
    wrong = two_colour(COLOURS["yellow"], COLOURS["white"])
    no_shape = flat(COLOURS["blue"])
    r = BUILTIN["prompt_colour_match"](torch.cat([match, swapped, wrong, no_shape]), [prompt] * 4)
    assert r[0].item() == pytest.approx(1.0, abs=1e-6)
    assert r[0] > r[1] and r[0] > r[2] and r[0] > r[3]
    assert r[2] < r[3]  # a blue background alone still half-matches the prompt


def test_colour_match_makes_the_prompt_matter():
    rng = random.Random(3)
    img, prompt = make_example(rng, "a green circle on a black background")
    other = "a purple circle on a orangish background"
    r = BUILTIN["prompt_colour_match"](torch.stack([img, img]), [prompt, other])
    assert r[0] > 0.95 and r[1] < 0.7


def test_colour_match_names_the_prompt_without_colours():
    with pytest.raises(RewardError, match=r"prompt_colour_match.*'a sunset'"):
        BUILTIN["prompt_colour_match"](flat((0, 0, 0)), ["a sunset"])


def test_build_reward_returns_weighted_sum_and_each_term():
    images = torch.cat([flat((255, 0, 0)), flat((0, 0, 0)), noise()])
    prompts = ["a red square on a black background"] * 3
    reward = build_reward([RewardTerm(name="brightness", weight=2.0),
                           RewardTerm(name="redness", weight=-0.5)])
    total, parts = reward(images, prompts)
    assert reward.names == ["brightness", "redness"]
    assert set(parts) == {"brightness", "redness"}
    expected = 2.0 * BUILTIN["brightness"](images, prompts) - 0.5 * BUILTIN["redness"](images, prompts)
    torch.testing.assert_close(total, expected)
    assert total.dtype == torch.float32 and total.shape == (3,)


def test_plugin_module_function_is_imported_and_called():
    green, red = flat((0, 200, 0)), flat((200, 0, 0))
    reward = build_reward([RewardTerm(name="reward_plugins:green_fraction", weight=1.0)])
    total, parts = reward(torch.cat([green, red]), ["", ""])
    assert total.tolist() == [1.0, 0.0]
    assert torch.equal(parts["reward_plugins:green_fraction"], total)


@pytest.mark.parametrize("name, message", [
    ("sharpness", "unknown"),
    ("no_such_module_xyz:f", "cannot import module"),
    ("reward_plugins:missing", "no function 'missing'"),
    ("reward_plugins:NOT_A_FUNCTION", "no function"),
])
def test_unresolvable_reward_name_is_rejected_at_build_time(name, message):
    with pytest.raises(RewardError, match=message) as info:
        build_reward([RewardTerm(name=name)])
    assert repr(name) in str(info.value)


@pytest.mark.parametrize("fn, message", [
    ("raises", "raised RuntimeError: reward server unreachable"),
    ("wrong_shape", r"shape \(2, 1\), expected \(2,\)"),
    ("integer_dtype", "dtype torch.int64"),
    ("returns_list", "returned list"),
    ("nan_second", "nan at index 1 is not finite"),
])
def test_misbehaving_plugin_raises_reward_error_naming_it(fn, message):
    reward = build_reward([RewardTerm(name="brightness"), RewardTerm(name=f"reward_plugins:{fn}")])
    with pytest.raises(RewardError, match=message) as info:
        reward(torch.cat([flat((0, 0, 0)), flat((9, 9, 9))]), ["", ""])
    assert f"'reward_plugins:{fn}'" in str(info.value)


def test_bad_inputs_and_duplicate_terms_are_rejected():
    reward = build_reward([RewardTerm(name="brightness")])
    with pytest.raises(RewardError, match="expected uint8 images"):
        reward(torch.zeros(1, 3, 8, 8), [""])
    with pytest.raises(RewardError, match="2 images but 1 prompts"):
        reward(flat((0, 0, 0), n=2), [""])
    with pytest.raises(RewardError, match="'brightness': listed twice"):
        build_reward([RewardTerm(name="brightness"), RewardTerm(name="brightness", weight=2.0)])
    with pytest.raises(RewardError, match="at least one"):
        build_reward([])


# ----------------------------------------------------------------------------- args and metadata


def test_function_term_gets_its_args_and_the_prompts_metadata():
    reward = build_reward([RewardTerm(name="reward_plugins:prompt_length", args={"scale": 2.0})])
    total, _ = reward(flat((0, 0, 0), n=2), ["a", "b"], [{"prompt": "a", "count": 1},
                                                          {"prompt": "b", "count": 3}])
    assert total.tolist() == [2.0, 6.0]


def test_plain_function_of_images_and_prompts_still_works_when_metadata_is_given():
    reward = build_reward([RewardTerm(name="reward_plugins:green_fraction")])
    total, _ = reward(flat((0, 200, 0)), ["x"], [{"prompt": "x", "tag": "t"}])
    assert total.tolist() == [1.0]


def test_class_term_is_built_once_with_its_args():
    import reward_plugins
    before = reward_plugins.Threshold.built
    reward = build_reward([RewardTerm(name="reward_plugins:Threshold", args={"level": 100})])
    for _ in range(3):
        total, _ = reward(torch.cat([flat((200, 200, 200)), flat((10, 10, 10))]), ["", ""])
        assert total.tolist() == [1.0, 0.0]
    assert reward_plugins.Threshold.built == before + 1


@pytest.mark.parametrize("name, args, message", [
    ("reward_plugins:Threshold", {"levle": 1}, "args .*levle.* do not fit Threshold"),
    ("reward_plugins:prompt_length", {"sclae": 1.0}, "args .*sclae.* do not fit its signature"),
])
def test_args_that_do_not_fit_the_term_are_rejected_at_build_time(name, args, message):
    with pytest.raises(RewardError, match=message):
        build_reward([RewardTerm(name=name, args=args)])


def test_mapping_term_needs_a_key_for_training_and_reports_every_value_in_evaluation():
    images, prompts = flat((0, 0, 0), n=2), ["", ""]
    with pytest.raises(RewardError, match=r"several values .*shape, all.*set the term's key"):
        build_reward([RewardTerm(name="reward_plugins:attributes")])(images, prompts)
    keyed = build_reward([RewardTerm(name="reward_plugins:attributes", key="all", label="judge")])
    total, parts = keyed(images, prompts)
    assert total.tolist() == [0.5, 0.5] and set(parts) == {"judge"}
    assert set(keyed.evaluate(images, prompts)) == {"judge/shape", "judge/all"}
    with pytest.raises(RewardError, match="key = 'colour' is not among its values"):
        build_reward([RewardTerm(name="reward_plugins:attributes", key="colour")])(images, prompts)


def test_one_reward_listed_twice_needs_distinct_labels():
    reward = build_reward([RewardTerm(name="brightness"),
                           RewardTerm(name="brightness", label="brightness_x2", weight=2.0)])
    total, parts = reward(flat((255, 255, 255)), [""])
    assert set(parts) == {"brightness", "brightness_x2"} and total.item() == pytest.approx(3.0)


def test_metadata_count_must_match_the_prompts():
    reward = build_reward([RewardTerm(name="reward_plugins:prompt_length")])
    with pytest.raises(RewardError, match="2 prompts but 1 metadata records"):
        reward(flat((0, 0, 0), n=2), ["a", "b"], [{"count": 1}])


def test_reward_args_round_trip_through_the_config_toml(tmp_path):
    from digenrl.config import load_config, to_toml
    path = tmp_path / "c.toml"
    path.write_text('[reward]\nterms = [{ name = "http", weight = 0.5, label = "geneval", '
                    'args = { url = "http://127.0.0.1:1/", timeout_s = 3.0, headers = { a = "b" } } }]\n')
    cfg = load_config(path)
    (term,) = cfg.reward.terms
    assert term.args == {"url": "http://127.0.0.1:1/", "timeout_s": 3.0, "headers": {"a": "b"}}
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg
