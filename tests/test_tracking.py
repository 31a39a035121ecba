"""Experiment trackers (telemetry/tracking.py): each real package in its offline mode writes
what the coordinator hands it, read back with the package's own reader where it has one; a
tracker that fails is logged and dropped while the others and the run go on; one launched run
leaves a wandb, an MLflow and a SwanLab run holding its scalars, evaluation scores and grids."""

from __future__ import annotations

import json
import struct
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
import yaml

from digenrl.config import ConfigError, load_config
from digenrl.telemetry.metrics import MetricsWriter, StepMetrics
from digenrl.telemetry.tracking import (
    Trackers,
    check_trackers,
    grid_caption,
    images_due,
    open_trackers,
)
from tests.conftest import SMALL, launch_command, launch_env

GRID = np.arange(8 * 12 * 3, dtype=np.uint8).reshape(8, 12, 3)


def _step(step: int, reward: float) -> StepMetrics:
    return StepMetrics(step=step, policy_version=step + 1, wall_time=1.0 + step, step_seconds=1.0,
                       samples_per_s=4.0, reward_mean=reward, reward_std=0.1, loss=0.5, kl=0.0,
                       clipfrac=0.0, ratio_max_dev=0.0, grad_norm=float("nan"), max_staleness=1,
                       mean_staleness=0.5, zero_adv_groups=0, trained=4, discarded=0,
                       busy={"trainer-0": 0.75}, reward_terms={"jpeg": reward})


def _drive(run_dir: Path, sets: list[str]) -> MetricsWriter:
    """Two steps, one evaluation and two grids through the writer, as the coordinator does."""
    cfg = load_config(None, sets)
    writer = MetricsWriter(run_dir, trackers=open_trackers(cfg, run_dir))
    writer.write(_step(0, -1.5))
    writer.write_eval(1, 3.0, {"eval/brightness": 0.25, "eval/samples": 4})
    writer.write(_step(1, -1.25))
    writer.write_samples(0, "train", GRID, row_prompts=["a red circle", "a blue square"])
    writer.write_samples(1, "eval", GRID, "1: a red circle\n2: a green star")
    writer.trackers.wait_idle()
    return writer


# ----------------------------------------------------------------------------- readers

def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version),
    then LevelDB-log blocks of 32 KiB whose records (7-byte header: CRC, length, type
    full/first/middle/last) carry wandb's own ``Record`` messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            rec = pb.Record()
            rec.ParseFromString(pending)
            pending = b""
            yield rec


def wandb_history(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any], Path]:
    """(each logged row as {key: value}, the run's config, its folder) of the one offline run."""
    (folder,) = (run_dir / "wandb").glob("offline-run-*")
    (log,) = folder.glob("run-*.wandb")
    rows: list[dict[str, Any]] = []
    config: dict[str, Any] = {}
    for rec in wandb_records(log):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row: dict[str, Any] = {}
            for i in rec.history.item:  # a media value comes as items keyed (key, its field)
                if i.key or len(i.nested_key) == 1:
                    row[i.key or i.nested_key[0]] = json.loads(i.value_json)
                else:
                    row.setdefault(i.nested_key[0], {})["/".join(i.nested_key[1:])] = json.loads(i.value_json)
            rows.append(row)
        elif kind == "run":
            config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
    return rows, config, folder


def swanlab_records(run_dir: Path) -> tuple[list[dict[str, Any]], Path]:
    """The records of the one SwanLab run under ``run_dir/swanlog``, read by swanlab's reader."""
    from google.protobuf.json_format import MessageToDict
    from swanlab.proto.swanlab.record.v1 import record_pb2
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    (folder,) = (run_dir / "swanlog").glob("run-*")
    (log,) = folder.glob("run-*.swanlab")
    reader = DataStoreReader()
    reader.open(log)
    out = []
    for data in reader:
        rec = record_pb2.Record()
        rec.ParseFromString(data)
        out.append(MessageToDict(rec))
    reader.close()
    return out, folder


def mlflow_run(run_dir: Path) -> tuple[Any, str]:
    """(an MlflowClient on the local store, the run id) of the one run under ``run_dir/mlruns``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    (exp,) = [e for e in client.search_experiments() if e.name == "digenrl"]
    (run,) = client.search_runs([exp.experiment_id])
    return client, run.info.run_id


def _steps(rows: list[Mapping[str, Any]], key: str) -> list[int]:
    return [r["step"] for r in rows if key in r]


# ----------------------------------------------------------------------------- each backend

def test_wandb_offline_run_holds_the_config_the_scalars_by_step_and_the_grids(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    writer = _drive(tmp_path, ['tracking.backends=["wandb"]'])
    assert writer.trackers.names == ["wandb"] and not writer.trackers.failed
    writer.close()
    rows, config, folder = wandb_history(tmp_path)
    assert config["train"]["group_size"] == load_config(None).train.group_size
    assert [(r["step"], r["reward_mean"]) for r in rows if "reward_mean" in r] == [(0, -1.5), (1, -1.25)]
    assert [(r["step"], r["busy/trainer-0"]) for r in rows if "busy/trainer-0" in r] == [(0, .75), (1, .75)]
    assert _steps(rows, "eval/brightness") == [1]
    assert not any("grad_norm" in r for r in rows)  # NaN is no value (written as null)
    (train,) = [r["samples/train"] for r in rows if "samples/train" in r]
    assert train["caption"] == "row 1: a red circle\nrow 2: a blue square"
    assert (train["width"], train["height"]) == (12, 8)
    image = folder / "files" / train["path"]
    from PIL import Image
    assert np.array_equal(np.asarray(Image.open(image).convert("RGB")), GRID)
    assert _steps(rows, "samples/eval") == [1]


def test_swanlab_offline_run_holds_the_config_the_scalars_and_the_grids(tmp_path):
    writer = _drive(tmp_path, ['tracking.backends=["swanlab"]', 'tracking.mode="offline"'])
    assert writer.trackers.names == ["swanlab"] and not writer.trackers.failed
    writer.close()
    records, folder = swanlab_records(tmp_path)
    scalars = [r["scalar"] for r in records if "scalar" in r]
    assert [(int(s.get("step", 0)), s["value"]["number"]) for s in scalars if s["key"] == "reward_mean"] == \
        [(0, -1.5), (1, -1.25)]
    assert [int(s.get("step", 0)) for s in scalars if s["key"] == "eval/brightness"] == [1]
    media = {m["key"]: m for m in (r["media"] for r in records if "media" in r)}
    assert set(media) == {"samples/train", "samples/eval"}
    (item,) = media["samples/train"]["value"]["items"]
    assert "a blue square" in json.dumps(item)
    assert (folder / "media" / "image" / item["filename"]).is_file()
    config = yaml.safe_load((folder / "files" / "config.yaml").read_text())
    assert config["train"]["value"]["group_size"] == load_config(None).train.group_size


def test_mlflow_local_store_holds_metrics_by_step_params_and_the_grids(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the tracker sets it for its store
    writer = _drive(tmp_path, ['tracking.backends=["mlflow"]', 'tracking.run_name="first"'])
    assert writer.trackers.names == ["mlflow"] and not writer.trackers.failed
    writer.close()
    client, run_id = mlflow_run(tmp_path)
    run = client.get_run(run_id)
    assert run.info.run_name == "first" and run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "reward_mean")] == [(0, -1.5), (1, -1.25)]
    assert [m.step for m in client.get_metric_history(run_id, "eval/brightness")] == [1]
    assert client.get_metric_history(run_id, "grad_norm") == []
    assert run.data.params["train.group_size"] == str(load_config(None).train.group_size)
    images = [a.path for a in client.list_artifacts(run_id, "images")]
    assert any(p.startswith("images/samples~train+step+0") and p.endswith(".png") for p in images), images
    assert any(p.startswith("images/samples~eval+step+1") for p in images), images
    caption = Path(client.download_artifacts(run_id, "samples/train/step_000000.txt", str(tmp_path / "dl")))
    assert caption.read_text() == "row 1: a red circle\nrow 2: a blue square"


def test_tensorboard_logs_the_scalars_by_step_the_grids_and_the_config(tmp_path):
    """The default tracker; its package is the ``metrics`` extra, which the suite's install
    leaves out (every run would then write tb/): this runs where it is installed."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    writer = _drive(tmp_path, ['tracking.backends=["tensorboard"]'])
    assert writer.trackers.names == ["tensorboard"]
    writer.close()
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(0, -1.5), (1, -1.25)]
    assert [e.step for e in acc.Scalars("eval/brightness")] == [1]
    assert "grad_norm" not in acc.Tags()["scalars"]
    assert [(e.step, e.width, e.height) for e in acc.Images("samples/train")] == [(0, 12, 8)]
    assert {"config/text_summary", "samples/train/prompts/text_summary"} <= set(acc.Tags()["tensors"])


# ----------------------------------------------------------------------------- failures

class Recorder:
    """A tracker that keeps what it is given; ``fail_at``: the call (1-based) that raises."""

    def __init__(self, name: str, fail_at: int = 0) -> None:
        self.name, self.fail_at, self.calls = name, fail_at, 0
        self.seen: list[tuple[int, dict[str, float]]] = []
        self.closed = False

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise ConnectionError("tracker server went away")
        self.seen.append((step, dict(values)))

    def image(self, step: int, key: str, image: Any, caption: str) -> None:
        self.seen.append((step, {key: float(image.size[0])}))

    def close(self) -> None:
        self.closed = True


def _cannot_open() -> Recorder:
    raise PermissionError("no login")


def test_a_tracker_that_raises_is_logged_and_dropped_and_the_others_go_on(tmp_path):
    bad, good = Recorder("bad", fail_at=2), Recorder("good")
    with structlog.testing.capture_logs() as logs:
        trackers = Trackers([("bad", lambda: bad), ("never", _cannot_open), ("good", lambda: good)])
        writer = MetricsWriter(tmp_path, trackers=trackers)
        for step in range(3):
            writer.write(_step(step, -1.0 - step))
        writer.write_samples(2, "train", GRID, "row 1: a cat")
        trackers.wait_idle()
        assert trackers.names == ["good"]
        writer.close()
    failed = [e for e in logs if e["event"] == "tracker_failed"]
    assert [(e["tracker"], e["at"]) for e in failed] == [("never", "open"), ("bad", "scalars")]
    assert "ConnectionError: tracker server went away" in failed[1]["error"]
    assert trackers.failed == {"never": "PermissionError: no login",
                               "bad": "ConnectionError: tracker server went away"}
    assert [s for s, _ in bad.seen] == [0] and bad.closed  # dropped after its failure, closed
    assert [s for s, _ in good.seen] == [0, 1, 2, 2] and good.closed
    assert good.seen[1][1]["reward_mean"] == -2.0
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3  # the run's own record


def test_a_hung_tracker_fills_a_bounded_queue_and_new_rows_are_dropped_not_waited_for(monkeypatch):
    import threading

    import digenrl.telemetry.tracking as tracking

    monkeypatch.setattr(tracking, "BACKLOG", 4)
    release = threading.Event()

    class Hung(Recorder):
        def scalars(self, step: int, values: Mapping[str, float]) -> None:
            release.wait(30)
            super().scalars(step, values)

    hung = Hung("hung")
    trackers = Trackers([("hung", lambda: hung)])
    with structlog.testing.capture_logs() as logs:
        for step in range(20):  # returns at once although the tracker does not move
            trackers.scalars(step, {"loss": 1.0})
        release.set()
        trackers.close()
    assert trackers.dropped_jobs > 0 and len(hung.seen) == 20 - trackers.dropped_jobs
    assert [e["event"] for e in logs].count("tracker_backlog") == 1


def test_choosing_a_tracker_checks_its_package_and_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "swanlab" else real(n, *a))
    with pytest.raises(ValueError, match=r"^tracking.backends: 'swanlab' needs the swanlab package: "
                                         r"pip install 'digenrl\[tracking\]'$"):
        check_trackers(load_config(None, ['tracking.backends=["wandb", "swanlab"]']).tracking)
    check_trackers(load_config(None, ['tracking.backends=["tensorboard"]']).tracking)  # the default
    with pytest.raises(ConfigError, match="listed twice"):
        load_config(None, ['tracking.backends=["wandb", "wandb"]'])
    with pytest.raises(ConfigError, match=r"tracking.backends\[0\] = 'neptune': expected one of"):
        load_config(None, ['tracking.backends=["neptune"]'])


def test_grids_go_at_the_first_last_and_every_nth_step_and_captions_name_rows_or_samples():
    cfg = load_config(None, ["run.steps=10", "tracking.images_every=4"])
    assert [s for s in range(10) if images_due(s, cfg)] == [0, 4, 8, 9]
    assert not any(images_due(s, load_config(None, ["tracking.images_every=0"])) for s in range(60))
    assert not images_due(0, load_config(None, ["tracking.backends=[]"]))
    assert grid_caption(["a", "a", "b", "b"], 2) == "row 1: a\nrow 2: b"
    assert grid_caption(["a", "b", "c"], 2) == "1: a\n2: b\n3: c"


def test_colocated_rank_0_logs_its_rows_train_grids_and_evaluation_to_the_trackers(tmp_path, monkeypatch):
    """In colocated mode rank 0 is the coordinator: it opens the trackers, and its own grids
    and evaluations go to them (here MLflow's local store)."""
    from digenrl.actors.colocated import run_colocated
    from digenrl.config import resolve_mode

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    cfg = resolve_mode(load_config(None, [*SMALL, "run.steps=2", "run.eval_every=2", "prompts.test_fraction=0.1",
                                          "eval.prompts=2", "eval.samples_per_prompt=2",
                                          'eval.terms=[{ name = "brightness" }]', "tracking.images_every=1",
                                          'tracking.backends=["mlflow"]']), "colocated")
    run_colocated(cfg, tmp_path)
    client, run_id = mlflow_run(tmp_path)
    assert [m.step for m in client.get_metric_history(run_id, "reward_mean")] == [0, 1]
    assert [m.step for m in client.get_metric_history(run_id, "eval/brightness")] == [0, 2]
    images = [a.path for a in client.list_artifacts(run_id, "images")]
    assert sorted(p.split("+")[2] for p in images if p.startswith("images/samples~train") and p.endswith(".png")) \
        == ["0", "1"]
    assert sum(p.startswith("images/samples~eval+") and p.endswith(".png") for p in images) == 2
    caption = Path(client.download_artifacts(run_id, "samples/eval/step_000002.txt", str(tmp_path / "dl")))
    lines = caption.read_text().splitlines()  # 2 prompts x 2 samples: one grid row each
    assert len(lines) == 2 and all(line.startswith(f"row {i + 1}: ") for i, line in enumerate(lines))


# ----------------------------------------------------------------------------- a launched run

@pytest.mark.slow
def test_a_launched_run_logs_its_rows_scores_and_grids_to_wandb_mlflow_and_swanlab_offline(tmp_path, monkeypatch):
    """The coordinator alone logs: trainer rank 0 sends it the grids (``Samples``), its writer
    hands rows and grids to the trackers, offline by the packages' own environment."""
    run_dir = tmp_path / "run"
    sets = [*SMALL, "run.eval_every=2", "prompts.test_fraction=0.1", "eval.prompts=2",
            "eval.samples_per_prompt=1", 'eval.terms=[{ name = "brightness" }]',
            'tracking.backends=["wandb", "mlflow", "swanlab"]']
    env = dict(launch_env(), WANDB_MODE="offline", SWANLAB_MODE="offline")
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run(launch_command("--steps", "2", "--run-dir", str(run_dir), sets=sets), env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tracker_failed" not in proc.stderr, proc.stderr[-3000:]

    rows, config, folder = wandb_history(run_dir)
    assert config["tracking"]["backends"] == ["wandb", "mlflow", "swanlab"]
    assert _steps(rows, "reward_mean") == [0, 1] and _steps(rows, "loss") == [0, 1]
    assert _steps(rows, "eval/brightness") == [0, 2]
    train = [r for r in rows if "samples/train" in r]
    assert [r["step"] for r in train] == [0, 1]
    # a fragment of the step: 1 of its 2 prompts, one grid row of its 2 samples
    assert all(r["samples/train"]["caption"].count("\n") == 0 and r["samples/train"]["caption"].startswith("row 1: ")
               for r in train)
    assert all((folder / "files" / r["samples/train"]["path"]).is_file() for r in train)
    assert _steps(rows, "samples/eval") == [0, 2]

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # what the coordinator's tracker set
    client, run_id = mlflow_run(run_dir)
    assert [m.step for m in client.get_metric_history(run_id, "reward_mean")] == [0, 1]
    assert [m.step for m in client.get_metric_history(run_id, "eval/brightness")] == [0, 2]
    images = [a.path for a in client.list_artifacts(run_id, "images")]
    assert sum(p.startswith("images/samples~train") and p.endswith(".png") for p in images) == 2

    records, _ = swanlab_records(run_dir)
    keys = {r["scalar"]["key"] for r in records if "scalar" in r}
    assert {"reward_mean", "eval/brightness", "loss"} <= keys
    assert {r["media"]["key"] for r in records if "media" in r} == {"samples/train", "samples/eval"}
