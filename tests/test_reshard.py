"""Resuming a run on another trainer rank count: ``digenrl launch --resume RUN_DIR --trainers N``.

Nothing in a checkpoint depends on the rank count (``digenrl/rl/checkpoint.py``): a sharded
(``dcp/``) checkpoint reshards through torch.distributed.checkpoint, a whole one is read by
every rank, the coordinator's snapshot holds no ranks. What a config cannot train with is
refused in one line before any process starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from digenrl.config import ConfigError, load_config, resolve_mode, to_toml
from digenrl.rl.checkpoint import commit_checkpoint, latest_checkpoint, save_trainer_state
from tests.conftest import SMALL, launch_run, set_args

# 2 prompts x 2 generations in 2 fragments, K = 1: step v + 1 is generated while step v
# trains, so the cut has attempts in flight; TSP spreads each fragment over both ranks
SHARDED = [*SMALL, "run.steps=3", "run.checkpoint_every=1", "cluster.trainers=2", "model.fsdp=true"]


def _published(log: Path, version: int) -> str:
    """The checksum trainer rank 0 published ``version`` with, after its last resume."""
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    start = max(i for i, r in enumerate(rows) if r.get("event") == "resumed from checkpoint")
    return next(r["checksum"] for r in rows[start:]
                if r.get("event") == "weights published" and r.get("version") == version)


@pytest.mark.slow
def test_a_run_of_two_sharded_ranks_killed_mid_run_resumes_on_one_with_exact_accounting(
        tmp_path: Path) -> None:
    from digenrl.models import build_model
    from digenrl.rl.checkpoint import checkpoint_weights
    from digenrl.telemetry.metrics import read_metrics
    from digenrl.transport.weights import publish_parts

    run = tmp_path / "run"
    r = launch_run("--mode", "digenrl", "--run-dir", str(run), *set_args(SHARDED), crash="commit:2")
    assert r.returncode == -9, r.stderr[-2000:]  # the whole launch was SIGKILLed with work in flight
    ckpt = latest_checkpoint(run)
    assert ckpt is not None and ckpt.version in (1, 2) and ckpt.trainer["layout"] == "dcp"
    assert sorted(p.name for p in (ckpt.path / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    # the checkpoint's weights, read whole from the two ranks' shards, as a rollout receives them
    cfg = load_config(run / "config.toml")
    got = checkpoint_weights(ckpt.path, build_model(cfg.model, seed=cfg.run.seed))
    assert got is not None and got[0] == ckpt.version
    stored = publish_parts(got[1])[1]
    assert stored == ckpt.coordinator["announce"]["checksum"]  # what the two ranks published

    r = launch_run("--resume", str(run), "--trainers", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming with 1 trainer rank(s) (the run had 2)" in r.stdout
    assert load_config(run / "config.toml").cluster.trainers == 1  # the run dir says what ran
    # exact on purpose: the one rank loaded the stored float32 bits and published them; the
    # set checksum covers every tensor's name, dtype, shape and bytes (transport/frames.py)
    assert _published(run / "logs" / "trainer-0.log", ckpt.version) == stored
    summary = json.loads((run / "summary.json").read_text())
    acc = summary["accounting"]
    assert acc["admitted"] == acc["trained"] + sum(acc["discarded"].values()) and acc["in_flight"] == 0
    assert acc["discarded"].get("restart", 0) > 0  # the cut's attempts in flight, counted once
    assert summary["slots"]["consumed"] == summary["slots"]["expected"] == 3 * 2
    assert summary["resumed_from"] == [ckpt.version]
    assert [row["step"] for row in read_metrics(run)] == [0, 1, 2]
    assert (run / "final" / "policy.safetensors").is_file()


# ---------------------------------------------------------------------------- refusals


def _resume(run_dir: Path, *flags: str) -> Any:
    """``digenrl launch --resume RUN_DIR FLAGS``'s config as the launch would resume it."""
    from digenrl.cli import build_parser, launch_inputs
    from digenrl.launch import prepare_resume

    cfg, opts = launch_inputs(build_parser().parse_args(["launch", "--resume", str(run_dir), *flags]))
    assert opts.resume is not None
    prepare_resume(cfg, opts.resume)
    return cfg


def _colocated_run(tmp_path: Path, sets: list[str]) -> Path:
    """A colocated run dir of 2 ranks with a committed checkpoint at version 1."""
    from digenrl.rl.policy import build_policy

    cfg = resolve_mode(load_config(None, ['model.path="random"', "cluster.trainers=2", *sets]), "colocated")
    (tmp_path / "config.toml").write_text(to_toml(cfg))
    policy = build_policy(cfg)
    policy.version = 1
    save_trainer_state(tmp_path, policy, {})
    commit_checkpoint(tmp_path, 1, {"colocated": {"ranks": [[3, {"zero_advantage": 1}], [2, {"restart": 2}]]}})
    return tmp_path


def test_resume_takes_another_trainer_count_and_records_it(tmp_path: Path, capsys: Any) -> None:
    run = _colocated_run(tmp_path, ["train.prompts_per_step=4"])
    cfg = _resume(run, "--trainers", "4")
    assert cfg.cluster.trainers == 4 and load_config(run / "config.toml").cluster.trainers == 4
    assert "resuming with 4 trainer rank(s) (the run had 2)" in capsys.readouterr().out
    cfg = _resume(run, "--set", "cluster.trainers=1")  # the same through --set
    assert cfg.cluster.trainers == 1 and load_config(run / "config.toml").cluster.trainers == 1


@pytest.mark.parametrize(("flags", "why"), [
    (["--trainers", "0"], r"^--trainers 0: expected at least 1$"),
    # colocated ranks split the step's prompts: 2 prompts over 3 ranks cannot be
    (["--trainers", "3"], r"^--resume .*: cluster\.trainers = 3: colocated ranks split "
                          r"train\.prompts_per_step = 2 evenly; use a divisor of it$"),
    (["--set", "cluster.trainers=3"], r"cluster\.trainers = 3: colocated ranks split"),
    (["--mode", "digenrl"], r"--mode cannot be changed on resume"),
])
def test_resume_refuses_in_one_line_a_trainer_count_the_run_cannot_use(
        tmp_path: Path, flags: list[str], why: str) -> None:
    run = _colocated_run(tmp_path, ["train.prompts_per_step=2"])
    before = (run / "config.toml").read_text()
    with pytest.raises(ConfigError, match=why) as e:
        _resume(run, *flags)
    assert "\n" not in str(e.value)
    assert (run / "config.toml").read_text() == before  # nothing recorded for a refused resume


def test_a_fresh_colocated_launch_refuses_ranks_that_do_not_split_the_prompts() -> None:
    from digenrl.launch import check_runtime_support

    cfg = resolve_mode(load_config(None, ['model.path="random"', "train.prompts_per_step=2",
                                          "cluster.trainers=3"]), "colocated")
    with pytest.raises(ConfigError, match=r"^cluster\.trainers = 3: colocated ranks split"):
        check_runtime_support(cfg)


# ---------------------------------------------------------------------------- what each rank loads


def test_a_colocated_resume_on_fewer_or_more_ranks_keeps_the_run_totals(tmp_path: Path) -> None:
    from digenrl.rl.checkpoint import colocated_resume
    from digenrl.rl.policy import build_policy

    run = _colocated_run(tmp_path, [])
    policy = build_policy(load_config(None, ['model.path="random"']))
    # rank 0 carries both saved ranks' counts, every other rank none: the sums stay right for
    # one rank or four (the summary adds the ranks' counts up)
    assert colocated_resume(run, policy, 0) == (1, 5, {"zero_advantage": 1, "restart": 2})
    assert colocated_resume(run, policy, 3) == (1, 0, {})
    assert policy.version == 1


@pytest.fixture
def one_rank_group(tmp_path: Path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_single_trainers_whole_checkpoint_loads_into_a_sharded_policy(
        one_rank_group: None, tmp_path: Path) -> None:
    from digenrl.rl.checkpoint import load_trainer_state
    from digenrl.rl.policy import build_policy

    sets = ['model.path="random"', "train.group_size=2"]
    src = build_policy(load_config(None, sets))  # one trainer: unsharded, a whole checkpoint
    x = torch.randn(2, *src.model.latent_shape, generator=torch.Generator().manual_seed(1))
    src.model.velocity(x, 0.5, src.model.encode_prompts(["a", "b"])).pow(2).mean().backward()
    src.optimizer_step()  # a real step: the optimizer has state to move
    save_trainer_state(tmp_path, src, {})
    commit_checkpoint(tmp_path, 1, {"scheduler": {}})
    dst = build_policy(load_config(None, [*sets, "model.fsdp=true"]), world_size=2)  # as a rank of 2
    assert dst.sharded
    load_trainer_state(latest_checkpoint(tmp_path), dst)
    # exact on purpose: the stored float32 bits, moved into shards and gathered back
    want, have = src.state_dict_for_sync(), dst.state_dict_for_sync()
    assert want.keys() == have.keys() and all(torch.equal(want[k], have[k]) for k in want)
    # the optimizer state saved by parameter index arrives by parameter name, every tensor exact
    saved, loaded = src.optimizer.state_dict(), dst.optimizer_state()
    names = [n for g in loaded["param_groups"] for n in g["params"]]
    assert len(names) == len(saved["state"]) > 0
    for i, state in saved["state"].items():
        assert all(torch.equal(torch.as_tensor(loaded["state"][names[i]][k]), torch.as_tensor(v))
                   for k, v in state.items()), names[i]
    assert dst.version == 1
