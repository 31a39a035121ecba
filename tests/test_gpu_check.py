"""bench/gpu_check.py --cpu: the device check's every section that runs without a GPU, at tiny
sizes, so that a GPU session spends its minutes on the GPU, not on the script's bugs. The
default_run section is skipped: it is one more launch (~100 s here), of the embedded config in
digenrl mode as tests/test_launch.py's (at smaller settings), and its report is the same ``_run_report`` that k0_bf16's goes through here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _gpu_check() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    return gpu_check


@pytest.mark.slow
def test_gpu_check_cpu_subset_runs_and_reports_every_section(tmp_path: Path) -> None:
    gpu_check = _gpu_check()
    out = tmp_path / "check.json"
    assert gpu_check.main(["--cpu", "--out", str(out), "--skip", "default_run"]) == 0
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert report["ok"] and report["device"] == "cpu" and report["cpu_mode"]
    assert set(sections) == {"build", "k0_bf16", "transformers", "memory", "offload", "staging", "rollout"}  # no NVML here
    # optimizer offload: a third of the device bytes per trained parameter, the same weights
    offload = sections["offload"]
    assert offload["device_bytes_per_param"] == {"none": 18.0, "optimizer": 6.0}
    assert offload["weights_max_abs_diff"] == 0.0
    assert report["skipped"] == ["default_run"]
    assert sections["build"]["missing"] == [] and sections["build"]["torch"]
    # two processes, bf16 compute with float32 masters, K = 0: every step's first ratio is 1 exactly
    k0 = sections["k0_bf16"]
    assert k0["ratio_max_dev"] == [0.0, 0.0] and k0["nodes"] == {"rollout-0": "cpu", "trainer-0": "cpu"}
    assert k0["accounting"]["in_flight"] == 0 and k0["returncode"] == 0
    cases = sections["transformers"]["cases"]
    assert set(cases) == {"sd3@32", "sd3@64", "flux@32", "flux@64"}
    assert all(c["first_ratio_max_dev"] == 0.0 and not c["skipped"] and c["lora_params"] > 0 for c in cases.values())
    # chunks through the staging path and real sockets come back bit for bit, and pooled
    # buffers are reused (only once their send completed: a reuse too soon breaks `exact`)
    staged = sections["staging"]
    assert staged["exact"] and staged["pools"]["device_to_host"]["reused"] > 0
    assert staged["goodput"]["256k"]["staged_MBps"] > 0 and staged["goodput"]["256k"]["raw_MBps"] > 0
    # the rollout comparison ran all three contenders on the tiny FLUX folder
    roll = sections["rollout"]
    assert roll["rollout_over_pipeline"] > 0 and roll["batched_over_fragment"] > 0 and roll["pixels"] == 64 * 64
    assert set(roll["forward_ms_by_rows"]) == {"1", "2", "4", "8"}


# Distribution name -> the module it installs, where they differ.
_IMPORT_NAMES = {"pyzmq": "zmq", "nvidia-ml-py": "pynvml", "pillow": "PIL", "tomli-w": "tomli_w"}


def test_gpu_check_looks_for_every_runtime_dependency() -> None:
    """The GPU image lacks some of this package's dependencies (they travel as wheels,
    docs/benchmarks.md): the check's build section must name every one, so a missing one is
    reported up front instead of failing a later section with an ImportError."""
    import re
    import tomllib

    spec = importlib.util.spec_from_file_location("gpu_check_needed", ROOT / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].strip().lower() for d in deps}
    wanted = {_IMPORT_NAMES.get(n, n.replace("-", "_")) for n in names} - {"torch"}  # imported first
    assert wanted - set(gpu_check.NEEDED) == set()


def test_the_json_is_written_after_each_section_so_a_killed_check_keeps_what_finished(tmp_path: Path) -> None:
    gpu_check = _gpu_check()
    out_path = tmp_path / "check.json"
    out: dict[str, Any] = {"sections": {}}
    gpu_check._section(out, "build", lambda: {"ok": True, "torch": "x"}, out_path)
    first = json.loads(out_path.read_text())
    assert first["sections"]["build"]["torch"] == "x" and first["ok"]

    def broken() -> dict[str, Any]:
        raise RuntimeError("device lost")

    gpu_check._section(out, "nvml", broken, out_path)  # a failing section is recorded, and written
    second = json.loads(out_path.read_text())
    assert second["sections"]["nvml"]["error"] == "RuntimeError: device lost"
    assert not second["ok"] and set(second["sections"]) == {"build", "nvml"}


def test_evaluation_rows_are_not_counted_as_steps(tmp_path: Path) -> None:
    gpu_check = _gpu_check()
    rows = [{"step": 0, "policy_version": 0, "eval/reward": 0.5},          # the evaluation before training
            {"step": 0, "policy_version": 1, "ratio_max_dev": 0.0},        # the one training step
            {"step": 1, "policy_version": 1, "eval/reward": 0.6}]          # the final evaluation
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["ratio_max_dev"] for r in gpu_check._metrics(tmp_path)] == [0.0]


def test_only_runs_the_named_sections_and_records_the_rest_as_skipped(tmp_path: Path) -> None:
    gpu_check = _gpu_check()
    out = tmp_path / "check.json"
    assert gpu_check.main(["--cpu", "--out", str(out), "--only", "build"]) == 0
    report = json.loads(out.read_text())
    assert set(report["sections"]) == {"build"}
    assert set(report["skipped"]) == set(gpu_check.SECTIONS) - {"build"}
    with pytest.raises(SystemExit):
        gpu_check.main(["--cpu", "--out", str(out), "--only", "bogus"])


def test_the_flux_dev_case_is_flux_1_dev_shaped_with_its_guidance_embedding() -> None:
    """Built on the meta device (shapes only, no memory): FLUX.1-dev is guidance-distilled, so
    its transformer embeds the guidance value, and it has about 11.9 B parameters."""
    import diffusers
    import torch

    gpu_check = _gpu_check()
    with torch.device("meta"):
        flux = diffusers.FluxTransformer2DModel(**gpu_check.FLUX_DEV)
    assert flux.config.guidance_embeds
    assert any("guidance_embedder" in name for name, _ in flux.named_parameters())
    assert 11.5e9 < sum(p.numel() for p in flux.parameters()) < 12.5e9


def test_the_rollout_section_compares_the_rollout_batching_and_the_pipeline(tmp_path: Path) -> None:
    gpu_check = _gpu_check()
    out = tmp_path / "check.json"
    assert gpu_check.main(["--cpu", "--out", str(out), "--only", "rollout"]) == 0
    roll = json.loads(out.read_text())["sections"]["rollout"]
    assert roll["ok"] and roll["size"] == 64 and roll["device"] == "cpu"
    for key in ("fragment", "batched", "pipeline"):
        assert roll[f"{key}_samples_per_s"] > 0 and roll[f"{key}_forward_s"] > 0 and roll[f"{key}_decode_s"] > 0
    assert roll["rollout_over_pipeline"] == pytest.approx(
        roll["fragment_samples_per_s"] / roll["pipeline_samples_per_s"])


def test_the_memory_section_counts_on_the_meta_device_what_the_cpu_forward_saves(tmp_path: Path) -> None:
    gpu_check = _gpu_check()
    out = tmp_path / "check.json"
    assert gpu_check.main(["--cpu", "--out", str(out), "--only", "memory"]) == 0
    cases = json.loads(out.read_text())["sections"]["memory"]["cases"]
    assert set(cases) == {"sd3@32", "sd3@64", "flux@32", "flux@64", "wan@16x16x5"}
    assert all(c["planned_saved_bytes"] == c["measured_saved_bytes"] > 0 for c in cases.values())
    # the plan of a whole step (meta device) beside the step measured on the CPU
    assert all(c["measured_peak_bytes"] > 0 and abs(c["plan_error"]) <= 0.1 for c in cases.values())
