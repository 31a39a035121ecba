"""Mistakes are refused by the launcher before any process starts, and a node that refuses
its configuration stops the run instead of being restarted into the same refusal."""

from __future__ import annotations

from pathlib import Path

import pytest

from digenrl.config import ConfigError
from digenrl.launch import launch, make_run_dir
from tests.factories import tiny_config

SMALL = ["run.steps=2", "runtime.fragments_per_step=1", "sampler.num_steps=2",
         "train.timesteps=\"all\""]  # over the suite's tiny run


def _cfg(*extra: str, mode: str = "digenrl"):
    return tiny_config(*SMALL, *extra, mode=mode)


@pytest.mark.parametrize(("extra", "message"), [
    (['reward.terms=[{name = "jpeg_compresibility"}]'], r"reward 'jpeg_compresibility': unknown"),
    (['reward.terms=[{name = "tests.reward_plugins:no_such_function"}]'], r"no function 'no_such_function'"),
    (['reward.terms=[{name = "tests.reward_plugins:Threshold", args = {levle = 3}}]'],
     r"reward 'tests.reward_plugins:Threshold': args \{'levle': 3\} do not fit"),
    (['model.path="/nonexistent/flux"', 'model.family="flux"'], r"model\.path '/nonexistent/flux' does not exist"),
    (['model.height=30'], r"model\.height = 30: sd3 needs a multiple of 4 pixels"),
    (['run.eval_every=1', 'prompts.test_fraction=0.25', 'eval.terms=[{name = "clipscor"}]'],
     r"eval\.terms: reward 'clipscor': unknown"),
])
def test_a_config_mistake_is_refused_by_the_launcher_before_any_process_starts(tmp_path: Path, extra, message):
    cfg = _cfg(*extra)
    run_dir = make_run_dir(cfg, str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=message):
        launch(cfg, run_dir)
    assert not list((run_dir / "logs").glob("*.stderr"))  # no child was ever started


@pytest.mark.slow
def test_a_node_refusing_its_configuration_stops_the_run_without_a_restart(tmp_path: Path):
    # the launcher can only check the plug-in's name and args; building it fails in every node
    cfg = _cfg('reward.terms=[{name = "tests.reward_plugins:MissingWeights"}]')
    run_dir = make_run_dir(cfg, str(tmp_path / "run"))
    with pytest.raises(RuntimeError, match=r"run failed: (trainer|rollout)-0 refused the configuration: "
                                           r"digenrl-node: reward 'MissingWeights': weights folder "
                                           r"'/nonexistent/reward-model' does not exist"):
        launch(cfg, run_dir)
    import json
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"] == {}
