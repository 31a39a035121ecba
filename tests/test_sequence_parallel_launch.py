"""``digenrl launch --trainers 2 --set train.sequence_parallel=2``: the two trainer ranks form
one sequence-parallel group and train tiny Wan, FLUX, FLUX.2 and Z-Image pipeline folders end to end (real
processes, sockets and gloo groups), with the ledger's accounting exact; four ranks at SP = 2
(two groups, with and without FSDP2) give a one-trainer run's weights, and so does a rollout
node sampling over two processes (``cluster.rollout_gpus = 2``).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from digenrl.telemetry.metrics import read_metrics
from tests.conftest import SUITE_SETS, final_weights
from tests.pipelines import MAX_TEXT_TOKENS, SMALL, write_pipeline_folder

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _launch(run_dir: Path, folder: Path, family: str, trainers: int, extra: list[str], steps: int = 2) -> dict:
    sizes = {k: v for k, v in SMALL.items() if k != "num_frames" or family == "wan"}
    sets = [*SUITE_SETS, f'model.path="{folder}"', f'model.family="{family}"', "model.lora_rank=4",
            f"model.max_text_tokens={MAX_TEXT_TOKENS}", *[f"model.{k}={v}" for k, v in sizes.items()],
            "train.prompts_per_step=2", "train.group_size=2", "sampler.num_steps=4", *extra]
    proc = subprocess.run(
        [sys.executable, "-m", "digenrl.cli", "launch", "--steps", str(steps), "--trainers", str(trainers),
         "--run-dir", str(run_dir), *[a for s in sets for a in ("--set", s)]],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary: dict = json.loads((run_dir / "summary.json").read_text())
    acc = summary["accounting"]
    assert summary["steps"] == steps and acc["in_flight"] == 0
    assert acc["admitted"] == acc["trained"] + sum(acc["discarded"].values())
    assert acc["trained"] == steps * 4  # steps of 2 prompts x 2 generations, none lost
    assert summary["recovery"]["trainer_resets"] == 0 and summary["restarts"] == {}
    return summary


def _joined_degree(run_dir: Path, rank: int) -> int:
    rows = [json.loads(line) for line in (run_dir / "logs" / f"trainer-{rank}.log").read_text().splitlines()
            if '"joined"' in line]
    return int(rows[0]["sequence_parallel"])


@pytest.mark.parametrize("family", ["wan", "flux", "flux2", "zimage"])
def test_two_trainer_ranks_train_one_sequence_parallel_group_end_to_end(tmp_path: Path, family: str) -> None:
    folder = write_pipeline_folder(family, tmp_path / family)
    run_dir = tmp_path / "sp2"
    _launch(run_dir, folder, family, 2, ["train.sequence_parallel=2", "runtime.staleness=0"])
    assert _joined_degree(run_dir, 0) == _joined_degree(run_dir, 1) == 2
    rows = read_metrics(run_dir)
    # K = 0: the trainer recomputes the rollout's own samples (the rollout's plain forward,
    # the group's sharded one), so the first ratio is 1 to within float32 rounding
    assert rows[0]["max_staleness"] == 0 and rows[0]["ratio_max_dev"] <= 1e-5
    assert all(r["trained"] == 4 for r in rows)


@pytest.fixture(scope="module")
def one_trainer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the Wan folder, a one-trainer run of one step with two fragments at K = 0)."""
    root = tmp_path_factory.mktemp("sp_one")
    folder = write_pipeline_folder("wan", root / "wan")
    _launch(root / "one", folder, "wan", 1, GROUPS_EXTRA, steps=1)
    return folder, root / "one"


GROUPS_EXTRA = ["runtime.staleness=0", "runtime.fragments_per_step=2"]


@pytest.mark.parametrize("fsdp", [False, True])
def test_two_groups_of_two_ranks_give_the_one_trainer_update(tmp_path: Path, one_trainer: tuple[Path, Path],
                                                             fsdp: bool) -> None:
    """Four trainer ranks at SP = 2 are two groups, each planned as one rank: the step's two
    fragments go one to each group (data parallelism over groups), and the update is the
    one-trainer update, also with FSDP2 sharding the parameters over the four ranks. One
    step: a second would sample with weights that differ in the last bits, which a
    discontinuous reward (JPEG size) may turn into other rewards."""
    from digenrl.telemetry.trace import read_trace

    folder, one = one_trainer
    groups = tmp_path / "groups"
    _launch(groups, folder, "wan", 4, ["train.sequence_parallel=2", f"model.fsdp={str(fsdp).lower()}",
                                       *GROUPS_EXTRA], steps=1)
    _, spans = read_trace(groups / "trace.json")
    trained = {s.node for s in spans if s.name == "fragment_train"}
    assert trained >= {f"trainer-{r}" for r in range(4)}  # leaders and followers of both groups
    a, b = final_weights(groups), final_weights(one)
    assert a.keys() == b.keys()
    assert any(float(v.abs().max()) > 0 for k, v in a.items() if "lora_B" in k)  # LoRA B starts at 0: it trained
    for k in a:  # float32: gradients differ in the last bits (summation order), Adam keeps that small
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)


def test_a_rollout_over_two_processes_samples_what_one_process_samples(tmp_path: Path,
                                                                        one_trainer: tuple[Path, Path]) -> None:
    """``cluster.rollout_gpus = 2``: the rollout node starts a follower and samples with the
    sequence-parallel forward (actors/rolloutgroup.py); at K = 0 the step trains the same
    samples, so the update is the one-process rollout's."""
    folder, one = one_trainer
    run_dir = tmp_path / "rollout2"
    _launch(run_dir, folder, "wan", 1, ["cluster.rollout_gpus=2", *GROUPS_EXTRA], steps=1)
    log = (run_dir / "logs" / "rollout-0-follower-1.stderr").read_text()
    assert "follower 1: served" in log and "served 0 " not in log  # it ran the forward passes
    assert read_metrics(run_dir)[0]["ratio_max_dev"] <= 1e-5
    a, b = final_weights(run_dir), final_weights(one)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
