"""The config tree: shipped configs load, mistakes are named precisely, overrides work."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from digenrl.config import (
    MODES,
    Config,
    ConfigError,
    config_from_dict,
    default_config_text,
    describe_fields,
    load_config,
    read_resolved,
    resolve_mode,
    to_dict,
    to_toml,
)

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "configs").glob("**/*.toml"))
RUN_CONFIGS = [p for p in SHIPPED if "clusters" not in p.parts]


def test_the_embedded_default_is_configs_tiny_cpu() -> None:
    assert (ROOT / "configs" / "tiny-cpu.toml").read_text() == default_config_text()


def test_the_default_trains_on_one_judge_and_evaluates_with_the_other_at_start_and_end() -> None:
    # the real default (by path: the suite's fixture only changes load_config(None, ...))
    cfg = load_config(ROOT / "configs" / "tiny-cpu.toml")
    assert [t.name for t in cfg.reward.terms] == ["shapes_judge"]
    assert [t.name for t in cfg.eval.terms] == ["shapes_attributes", "pixel_std"]
    assert cfg.prompts.test_file == "builtin:prompts-test.txt"
    # evaluated at version 0 and at the end only (eval_due: 0, multiples of eval_every, the last)
    assert cfg.run.eval_every >= cfg.run.steps
    assert cfg.eval.samples_per_prompt * 40 >= 640  # enough samples for the 3-SE criterion


@pytest.mark.parametrize("sets, named", [
    (["sampler.base_tail=2", "model.lora_rank=0"], "model.lora_rank = 0"),
    (["sampler.base_tail=8"], "expected fewer than sampler.num_steps = 8"),
    (["sampler.base_tail=2", 'train.timesteps="all"'], "train.timesteps = 'all'"),
    (["sampler.base_tail=2", "train.window_hi=8"], "train.window_hi = 8"),
    (["sampler.base_tail=2", "eval.num_steps=2"], "eval.num_steps = 2"),
])
def test_a_base_tail_that_would_swallow_trained_or_all_steps_is_refused(sets: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config(None, ["model.lora_rank=8", *sets])


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_run_config_loads_in_every_mode(path: Path) -> None:
    cfg = load_config(path)
    for mode in MODES:
        assert resolve_mode(cfg, mode).run.mode == mode


def test_a_misspelled_key_names_the_dotted_key_and_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"unknown key train\.lrr: expected one of .*\blr\b"):
        load_config(None, ["train.lrr=1e-4"])


def test_a_misspelled_key_in_a_file_is_named_too(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("[sampler]\nnum_step = 4\n")
    with pytest.raises(ConfigError, match=r"unknown key sampler\.num_step"):
        load_config(p)


def test_a_wrong_type_names_key_value_and_expectation() -> None:
    with pytest.raises(ConfigError, match=r"train\.lr = 'fast': expected a number"):
        load_config(None, ["train.lr=fast"])
    with pytest.raises(ConfigError, match=r"runtime\.tsp = 1: expected true or false"):
        load_config(None, ["runtime.tsp=1"])


def test_an_out_of_range_value_names_the_bound() -> None:
    with pytest.raises(ConfigError, match=r"runtime\.staleness = -1: expected a value >= 0"):
        load_config(None, ["runtime.staleness=-1"])
    with pytest.raises(ConfigError, match=r"run\.mode = 'fast': expected one of"):
        load_config(None, ["run.mode=fast"])


def test_inconsistent_fragments_are_refused_with_both_fields_named() -> None:
    with pytest.raises(ConfigError, match=r"fragments_per_step = 3.*prompts_per_step = 4"):
        load_config(None, ["runtime.fragments_per_step=3"])


def test_a_missing_file_and_bad_toml_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nsteps = 1\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_overrides_set_nested_lists_and_strings() -> None:
    cfg = load_config(None, ['reward.terms=[{name="brightness", weight=2.0}]', "model.path=random",
                             "train.adam_betas=[0.8, 0.9]"])
    assert cfg.reward.terms[0].name == "brightness" and cfg.reward.terms[0].weight == 2.0
    assert cfg.model.path == "random"
    assert cfg.train.adam_betas == (0.8, 0.9)


def test_modes_fix_the_knobs_the_design_table_names() -> None:
    cfg = load_config(None)
    colo = resolve_mode(cfg, "colocated")
    assert (colo.runtime.staleness, colo.runtime.fragments_per_step, colo.cluster.rollouts) == (0, 1, 0)
    sync = resolve_mode(cfg, "disagg-sync")
    assert (sync.runtime.staleness, sync.runtime.tsp, sync.runtime.tag) == (0, False, "never")


def test_the_resolved_config_round_trips_through_toml() -> None:
    import tomllib
    cfg = resolve_mode(load_config(None, ["train.lr=1e-5"]), "digenrl")
    again = config_from_dict(tomllib.loads(to_toml(cfg)))
    assert again == cfg


@pytest.mark.parametrize("mode", MODES)
def test_a_config_written_resolved_reads_back_resolved_and_an_unresolved_one_is_refused(mode: str) -> None:
    cfg = resolve_mode(load_config(None, ["cluster.rollouts=2"]), mode)
    assert read_resolved(to_toml(cfg)) == cfg
    if mode == "digenrl":
        return  # K, TSP and TAG are the user's in digenrl mode: any values are resolved
    unresolved = to_toml(load_config(None, [f"run.mode={mode!r}"]))  # K = 1 as configured
    with pytest.raises(ConfigError, match=rf"^Welcome: runtime\.staleness = 1: run\.mode = '{mode}' "
                                          r"fixes it to 0 \(not a resolved config\)$"):
        read_resolved(unresolved, "Welcome")


def test_strings_and_keys_toml_must_escape_or_quote_round_trip() -> None:
    """The hand-written writer this replaced emitted a newline raw and left dotted keys of
    reward args unquoted: both read back wrong or not at all."""
    import tomllib

    from digenrl.config import PromptConfig, RewardConfig, RewardTerm
    awkward = 'a "quoted"\\path\nwith a newline\tand a tab'
    cfg = Config(prompts=PromptConfig(file=awkward), reward=RewardConfig(terms=[RewardTerm(
        name="pkg.mod:Scorer", args={"model.path": awkward, "sizes": [1, 2], "nested": {"k": 0.5}})]))
    assert config_from_dict(tomllib.loads(to_toml(cfg))) == cfg


def test_every_field_has_help() -> None:
    assert all(help_ for _, _, help_ in describe_fields(Config))


@given(st.integers(min_value=1, max_value=10_000))
def test_any_positive_step_count_is_accepted(n: int) -> None:
    assert load_config(None, [f"run.steps={n}"]).run.steps == n


def test_to_dict_is_plain_data() -> None:
    d = to_dict(load_config(None))
    assert isinstance(d["reward"]["terms"][0], dict) and isinstance(d["train"]["adam_betas"], list)


def test_a_run_dirs_config_with_the_old_inert_faults_table_still_loads_and_a_live_one_is_refused() -> None:
    """Run dirs written when slowdowns were a config section hold ``[faults]`` with its
    defaults; they must still resume. A table that would slow something down is refused."""
    import tomllib
    text = to_toml(load_config())
    old = text + "\n[faults]\nslowdown = 1.0\nslowdown_nodes = []\ntrainer_slowdown = 1.0\n"
    assert to_toml(config_from_dict(tomllib.loads(old))) == text
    with pytest.raises(ConfigError, match="DIGENRL_FAILPOINTS"):
        config_from_dict(tomllib.loads(text + "\n[faults]\nslowdown = 5.0\n"))
