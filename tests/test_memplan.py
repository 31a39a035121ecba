"""digenrl/sim/memplan.py: saved-activation bytes counted on the meta device against the
same forward measured on the CPU (real tensors, real tiny transformers)."""

from __future__ import annotations

import pytest
from torch.nn.attention import SDPBackend, sdpa_kernel

from digenrl.models import families
from digenrl.sim.memplan import training_forward_saved_bytes


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_the_meta_count_equals_the_bytes_a_cpu_training_forward_saves(family: str) -> None:
    """Exact: the meta forward runs the same ops on the same shapes as the CPU forward with
    math attention (the path the meta device takes), so the saved bytes are equal."""
    kw = dict(family=family, transformer_kwargs=families.TINY_CONFIGS[family], px=64, batch=2,
              text=(16, 32, 32), lora_rank=4)
    planned = training_forward_saved_bytes(**kw, device="meta")  # type: ignore[arg-type]
    with sdpa_kernel(SDPBackend.MATH):
        measured = training_forward_saved_bytes(**kw, device="cpu")  # type: ignore[arg-type]
    assert planned == measured > 0


def test_the_count_is_linear_in_batch_and_grows_with_resolution() -> None:
    """Each sample adds the same bytes (per-sample activations); a few saved tensors do not
    depend on the batch (rotary / position tables), so the check is on differences."""
    kw = dict(family="flux", transformer_kwargs=families.TINY_CONFIGS["flux"], text=(16, 32, 32), lora_rank=4)
    b1, b2, b3 = (training_forward_saved_bytes(**kw, px=32, batch=b) for b in (1, 2, 3))  # type: ignore[arg-type]
    assert b3 - b2 == b2 - b1 > 0
    assert training_forward_saved_bytes(**kw, px=64, batch=1) > 2 * b1  # type: ignore[arg-type]


# -- digenrl plan --memory against the trainer's own step measured on the CPU --------------------

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from digenrl.config import load_config, resolve_mode  # noqa: E402
from digenrl.sim.memory import MemoryPlanner  # noqa: E402
from digenrl.sim.memplan import LiveBytes, measure_trainer_step  # noqa: E402
from tests.pipelines import MAX_TEXT_TOKENS, write_pipeline_folder  # noqa: E402

#: plan vs measured: the plan's loss head is the SDE step's log-prob alone (the real one adds the
#: ratio's statistics, a few latent-sized tensors) and its prompt is padded to model.max_text_tokens
#: (a real encoder may pad to the longest prompt); measured 0.5-5 % on these folders.
TOLERANCE = 0.10
CASES = [("sd3", []), ("flux", ["model.lora_rank=0"]), ("wan", ['model.dtype="bfloat16"']),
         ("hunyuanvideo", ["model.gradient_checkpointing=true"]), ("zimage", [])]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("memplan")
    return {f: write_pipeline_folder(f, root / f) for f in {c[0] for c in CASES}}


def _cfg(folder: Path, family: str, extra: list[str]):  # type: ignore[no-untyped-def]
    return load_config(None, [f'model.family="{family}"', f'model.path="{folder}"', f"model.max_text_tokens={MAX_TEXT_TOKENS}", "model.height=32",
                              "model.width=48", "model.lora_rank=4", "train.prompts_per_step=2", "train.group_size=2",
                              "sampler.base_tail=0", *(["model.num_frames=5"] if family in ("wan", "hunyuanvideo") else []),
                              *extra])


@pytest.mark.parametrize(("family", "extra"), CASES, ids=[f"{f}{''.join(e)}" for f, e in CASES])
def test_the_trainer_plan_is_within_tolerance_of_the_cpu_measured_peak(family: str, extra: list[str],
                                                                       folders: dict[str, Path]) -> None:
    cfg = _cfg(folders[family], family, extra)
    planner = MemoryPlanner(cfg, trainer_gpu="cpu", rollout_gpu="cpu")
    plan = planner.trainer(planner.setting())
    measured = measure_trainer_step(resolve_mode(cfg, "colocated"))
    assert measured["step_peak"] > 0 and plan.parts["weights"] > 0
    assert abs(plan.total / measured["peak"] - 1) <= TOLERANCE, (plan.parts, measured)


def test_live_bytes_counts_new_storages_once_and_not_views_or_in_place_results() -> None:
    """Exact: byte counts of tensors made in this process."""
    w = torch.ones(1000)  # made before the block: its transpose and in-place update add nothing
    with LiveBytes() as live:
        a = torch.zeros(100)          # 400 B
        v = a.view(10, 10)            # a view: nothing new
        w.add_(1.0)                   # in place on a tensor made outside: nothing new
        b = a * 2                     # 400 B
        del a, b                      # a's storage lives on in v
        assert live.live == 400 and live.peak == 800
        del v
    assert live.live == 0 and live.peak == 800


def test_plan_memory_on_a_missing_folder_is_one_line_naming_it(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    missing = tmp_path / "nowhere"
    cfg.write_text(f'[model]\nfamily = "flux"\npath = "{missing}"\n')
    proc = subprocess.run([sys.executable, "-m", "digenrl.cli", "plan", "--memory", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.strip().splitlines() if x]
    assert len(lines) == 1 and str(missing) in lines[0]


def test_plan_memory_of_a_folder_prints_each_role_and_whether_it_fits(folders: dict[str, Path], tmp_path: Path) -> None:
    import json

    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[model]\nfamily = "sd3"\npath = "{folders["sd3"]}"\nmax_text_tokens = 24\nheight = 32\nwidth = 48\n')
    proc = subprocess.run([sys.executable, "-m", "digenrl.cli", "plan", "--memory", "--json", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert set(report["roles"]) == {"trainer", "rollout"}
    for row in report["roles"].values():
        assert row["fits"] and row["peak_bytes"] == sum(row["parts"].values()) > 0


def test_a_published_size_model_that_does_not_fit_names_the_smallest_setting_that_does() -> None:
    """Z-Image (6B) at 1024 px, a full fine-tune in bf16 on one H100: weights, masters, AdamW and
    the foreach step's temporaries alone pass 80 GiB; FSDP2 offload moves them to the host."""
    from digenrl.sim.memory import memory_plan, verdict

    cfg = load_config(None, ['model.family="zimage"', 'model.path="random"', 'model.dtype="bfloat16"',
                             "model.lora_rank=0", "sampler.base_tail=0", "train.kl_beta=0.0",
                             "train.prompts_per_step=1", "train.group_size=2", 'cluster.gpu="H100"'])
    report = memory_plan(cfg)
    trainer = report["roles"]["trainer"]
    assert not trainer["fits"] and trainer["fits_with"] is not None
    assert trainer["fits_with"]["peak_bytes"] <= trainer["capacity_bytes"] < trainer["peak_bytes"]
    line = verdict("trainer", trainer)
    assert "> 80 GiB on H100; fits with" in line and trainer["fits_with"]["change"] in line


def test_sequence_parallelism_divides_the_image_tokens_activations_and_keeps_the_text(folders: dict[str, Path]) -> None:
    """train.sequence_parallel = N plans a rank's forward over 1/N of the latent's tokens with the
    whole prompt: the activations shrink, by less than N (the replicated text, the weights' LoRA)."""
    import dataclasses

    cfg = _cfg(folders["wan"], "wan", [])
    planner = MemoryPlanner(cfg, trainer_gpu="cpu", rollout_gpu="cpu")
    one = planner.setting()
    assert one.sequence_parallel == 1  # read with a default where the config has no such key
    a1 = planner.trace(one.rows, 1, False)[0].activations
    a2 = planner.trace(one.rows, 2, False)[0].activations
    assert a1 / 2 < a2 < a1
    assert planner.trainer(dataclasses.replace(one, sequence_parallel=2)).total < planner.trainer(one).total
