"""Prompt files with metadata (txt, jsonl as flow_grpo writes it) and the held-out split."""

import json

import pytest

from digenrl.config import PromptConfig
from digenrl.data.prompts import PromptError, load_prompt_set, load_splits, split_off

GENEVAL = [  # flow_grpo's geneval metadata.jsonl lines, as they are
    {"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench"},
    {"tag": "two_object", "include": [{"class": "cow", "count": 1}, {"class": "dog", "count": 1}],
     "prompt": "a photo of a cow and a dog"},
    {"tag": "color_attr", "include": [{"class": "car", "count": 1, "color": "red"}],
     "exclude": [], "prompt": "a photo of a red car"},
]


def test_geneval_metadata_jsonl_loads_prompts_and_whole_records(tmp_path):
    f = tmp_path / "metadata.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in GENEVAL) + "\n")
    ps = load_prompt_set(str(f))
    assert ps.prompts == [r["prompt"] for r in GENEVAL]
    assert ps.metadata == GENEVAL


def test_text_file_gives_each_prompt_a_record_with_its_text(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("# comment\na cat\n\n a dog \n")
    assert load_prompt_set(str(f)).metadata == [{"prompt": "a cat"}, {"prompt": "a dog"}]


def test_json_lines_in_a_text_file_are_refused_instead_of_used_as_prompts(tmp_path):
    f = tmp_path / "metadata.txt"
    f.write_text("".join(json.dumps(r) + "\n" for r in GENEVAL))
    with pytest.raises(PromptError, match=r"every line is a JSON object; name the file \*.jsonl"):
        load_prompt_set(str(f))


@pytest.mark.parametrize("line, message", [
    ('{"text": "x"}', "line 2: expected a non-empty string field 'prompt', got None"),
    ('["a"]', "line 2: expected a JSON object, got list"),
    ("{not json", "line 2: not JSON"),
])
def test_malformed_jsonl_line_is_named(tmp_path, line, message):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(PromptError, match=message):
        load_prompt_set(str(f))


def test_held_out_split_is_deterministic_disjoint_and_ignores_the_run_seed(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("".join(f"prompt {i}\n" for i in range(40)))
    cfg = PromptConfig(file=str(f), test_fraction=0.25, split_seed=3)
    train, test = load_splits(cfg)
    assert test is not None and len(test) == 10 and len(train) == 30
    assert not set(train.prompts) & set(test.prompts)
    assert set(train.prompts) | set(test.prompts) == {f"prompt {i}" for i in range(40)}
    again = load_splits(cfg)
    assert again[0] == train and again[1] == test
    other = load_splits(PromptConfig(file=str(f), test_fraction=0.25, split_seed=4))[1]
    assert other is not None and other.prompts != test.prompts


def test_test_file_is_used_whole_and_the_train_file_untouched(tmp_path):
    (tmp_path / "train.txt").write_text("a\nb\n")
    (tmp_path / "test.jsonl").write_text('{"prompt": "c", "k": 1}\n')
    train, test = load_splits(PromptConfig(file=str(tmp_path / "train.txt"),
                                           test_file=str(tmp_path / "test.jsonl")))
    assert train.prompts == ["a", "b"] and test is not None and test.metadata == [{"prompt": "c", "k": 1}]


def test_builtin_test_set_is_shipped_disjoint_from_the_training_set_and_balanced():
    from collections import Counter

    from digenrl.data.shapes import SHAPES, parse_prompt
    train, test = load_splits(PromptConfig(test_file="builtin:prompts-test.txt"))
    assert test is not None and len(test) == 40 and not set(test.prompts) & set(train.prompts)
    assert Counter(parse_prompt(p)[0] for p in test.prompts) == {s: 8 for s in SHAPES}
    with pytest.raises(PromptError, match=r"'builtin:nope\.txt'"):
        load_prompt_set("builtin:nope.txt")


def test_split_that_leaves_nothing_to_train_is_refused():
    from digenrl.data.prompts import PromptSet
    with pytest.raises(PromptError, match="leaving none to train on"):
        split_off(PromptSet(["a", "b"]), 0.9, 0)


def test_eval_without_a_test_split_is_a_config_error():
    from digenrl.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=r"run.eval_every = 5: evaluation needs held-out prompts"):
        load_config(None, ["run.eval_every=5"])
    assert load_config(None, ["run.eval_every=5", "prompts.test_fraction=0.1"]).run.eval_every == 5
