"""The EMA of the trained weights (train.ema_decay, digenrl/rl/ema.py): its arithmetic, skipped
steps, evaluation with it, its checkpoint and final/ema/, and the config's refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from digenrl.config import ConfigError, load_config, resolve_mode
from digenrl.rl.checkpoint import (
    CheckpointError,
    commit_checkpoint,
    latest_checkpoint,
    load_trainer_state,
    save_trainer_state,
)
from digenrl.rl.ema import EMA_FILE, ema_weights, live_weights
from digenrl.rl.evaluate import eval_policies
from digenrl.rl.policy import build_policy

LORA = ["model.lora_rank=2", 'model.dtype="bfloat16"']


def _policy(*sets: str, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return build_policy(load_config(None, ['model.path="random"', f"run.seed={seed}", *sets]))


def _step(policy: Any, seed: int, *, nan: bool = False) -> dict[str, Any]:
    """One optimizer step on random gradients (NaN in the first if ``nan``)."""
    for i, p in enumerate(policy.params):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed * 1000 + i))
        if nan and i == 0:
            p.grad.view(-1)[0] = float("nan")
    return policy.optimizer_step()


def _copy(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in sd.items()}


@pytest.mark.parametrize("sets", [[], LORA], ids=["full", "bf16-lora"])
def test_ema_after_three_steps_equals_the_hand_computed_average(sets: list[str]) -> None:
    policy = _policy("train.ema_decay=0.9", "train.lr=0.01", *sets)
    assert policy.ema is not None
    w = [_copy(live_weights(policy))]
    for s in range(3):
        _step(policy, s)
        w.append(_copy(live_weights(policy)))
    assert set(policy.ema.state) == set(policy.state_dict_for_sync())  # keyed like the sync state
    for k, ema in policy.ema.state.items():
        assert ema.dtype == torch.float32
        hand = w[0][k].double()
        for later in w[1:]:
            hand = 0.9 * hand + 0.1 * later[k].double()
        torch.testing.assert_close(ema.double(), hand, rtol=1e-6, atol=1e-7)
    # the weights moved, so the average is neither the first nor the last weights
    assert any(not torch.allclose(policy.ema.state[k], w[-1][k].float()) for k in w[0])
    assert any(not torch.allclose(policy.ema.state[k], w[0][k].float()) for k in w[0])


def test_a_skipped_step_leaves_the_ema_as_it_leaves_the_weights() -> None:
    policy = _policy("train.ema_decay=0.5", "train.lr=0.01")
    _step(policy, 0)
    before = _copy(policy.ema.state)
    weights = _copy(live_weights(policy))
    out = _step(policy, 1, nan=True)
    assert out["skipped"] and policy.version == 2
    # exact on purpose: a skipped step computes nothing on these tensors (same process, untouched)
    assert all(torch.equal(policy.ema.state[k], before[k]) for k in before)
    assert all(torch.equal(live_weights(policy)[k], weights[k]) for k in weights)
    _step(policy, 2)  # the next applied step moves it again
    assert any(not torch.equal(policy.ema.state[k], before[k]) for k in before)


def test_ema_is_off_by_default_and_evaluation_then_scores_the_policy() -> None:
    cfg = load_config(None, ['model.path="random"'])
    assert cfg.train.ema_decay == 0 and build_policy(cfg).ema is None
    assert eval_policies(cfg) == ["policy"]
    assert eval_policies(load_config(None, ["train.ema_decay=0.99"])) == ["ema"]
    assert eval_policies(load_config(None, ["train.ema_decay=0.99", 'eval.policy="both"'])) == ["policy", "ema"]


@pytest.mark.parametrize(("sets", "match"), [
    (["train.ema_decay=1.0"], r"train.ema_decay = 1.0: expected a value < 1"),
    (["train.ema_decay=-0.1"], r"train.ema_decay = -0.1: expected a value >= 0"),
    (['eval.policy="ema"'], r"eval.policy = 'ema': there are EMA weights only with train.ema_decay > 0"),
    (["train.ema_decay=0.9", "model.fsdp=true"], r"train.ema_decay = 0.9 with model.fsdp = true"),
])
def test_config_refuses_a_bad_ema_setting_in_one_line(sets: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(None, sets)


@pytest.mark.parametrize("sets", [[], LORA], ids=["full", "bf16-lora"])
def test_ema_weights_are_in_the_model_inside_the_block_and_the_trained_ones_come_back_exactly(
        sets: list[str]) -> None:
    policy = _policy("train.ema_decay=0.5", "train.lr=0.01", *sets)
    _step(policy, 0)
    _step(policy, 1)
    trained = _copy(policy.state_dict_for_sync())
    model_params = [p.detach().clone() for p in policy.model_params]
    with ema_weights(policy):
        inside = policy.state_dict_for_sync()
        assert all(torch.equal(inside[k], policy.ema.state[k].cpu()) for k in inside)
    after = policy.state_dict_for_sync()
    assert all(torch.equal(after[k], trained[k]) for k in trained)
    assert all(torch.equal(a, b) for a, b in zip(policy.model_params, model_params, strict=True))
    assert any(not torch.equal(inside[k], trained[k]) for k in trained)


def test_a_checkpoint_holds_the_ema_in_a_verified_file_and_restores_it_exactly(tmp_path: Path) -> None:
    src = _policy("train.ema_decay=0.9", "train.lr=0.01")
    _step(src, 0)
    save_trainer_state(tmp_path, src, {})
    commit_checkpoint(tmp_path, 1, {"scheduler": {}})
    ckpt = latest_checkpoint(tmp_path)
    assert EMA_FILE in ckpt.trainer["files"]
    dst = _policy("train.ema_decay=0.9", "train.lr=0.01")
    load_trainer_state(ckpt, dst)
    assert all(torch.equal(src.ema.state[k], dst.ema.state[k]) for k in src.ema.state)
    # the next steps of both agree bit for bit: nothing of the EMA was lost or rounded
    _step(src, 1)
    _step(dst, 1)
    assert all(torch.equal(src.ema.state[k], dst.ema.state[k]) for k in src.ema.state)
    # the file is verified like the others: a flipped byte makes the checkpoint unusable
    path = ckpt.path / EMA_FILE
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=EMA_FILE):
        latest_checkpoint(tmp_path)


def test_a_run_with_an_ema_refuses_a_checkpoint_without_one(tmp_path: Path) -> None:
    src = _policy("train.lr=0.01")
    _step(src, 0)
    save_trainer_state(tmp_path, src, {})
    commit_checkpoint(tmp_path, 1, {"scheduler": {}})
    with pytest.raises(CheckpointError, match="holds no EMA"):
        load_trainer_state(latest_checkpoint(tmp_path), _policy("train.ema_decay=0.9"))


EVAL = ['model.path="random"', "train.prompts_per_step=2", "train.group_size=2",
        "runtime.fragments_per_step=1", "sampler.num_steps=4", "prompts.test_fraction=0.1",
        "eval.prompts=2", "eval.samples_per_prompt=1", "eval.batch_size=2",
        'eval.terms=[{ name = "brightness" }]', "run.steps=2", "run.eval_every=2",
        "train.ema_decay=0.5", "train.lr=0.01", 'eval.policy="both"', *LORA]


@pytest.mark.slow
def test_a_run_with_an_ema_evaluates_it_and_saves_it_in_final_ema(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from digenrl.data.prompts import load_splits
    from digenrl.launch import launch, make_run_dir
    from digenrl.models import build_model
    from digenrl.rl.evaluate import build_eval_reward, evaluate
    from digenrl.telemetry.metrics import read_metrics

    cfg = resolve_mode(load_config(None, EVAL), "digenrl")
    run_dir = make_run_dir(cfg, str(tmp_path / "run"))
    summary = launch(cfg, run_dir)
    assert summary["accounting"]["in_flight"] == 0
    evals = read_metrics(run_dir, "eval")
    assert [r["policy_version"] for r in evals] == [0, 2]
    for r in evals:
        assert {"eval/brightness", "eval_ema/brightness", "eval_ema/samples"} <= set(r)
    assert evals[0]["eval/brightness"] == evals[0]["eval_ema/brightness"]  # version 0: the same weights
    final = run_dir / "final"
    for folder in (final, final / "ema"):
        assert (folder / "policy.safetensors").is_file()
        assert (folder / "pytorch_lora_weights.safetensors").is_file()  # what diffusers loads
    policy_sd, ema_sd = load_file(final / "policy.safetensors"), load_file(final / "ema" / "policy.safetensors")
    assert policy_sd.keys() == ema_sd.keys()
    assert any(not torch.equal(policy_sd[k], ema_sd[k]) for k in policy_sd)
    # final/ema/ loads into a fresh model and holds exactly the weights the run evaluated as EMA
    model = build_model(cfg.model, seed=cfg.run.seed, in_trainer=True,
                        embedded_guidance=cfg.sampler.embedded_guidance)
    model.load_sync_state_dict(ema_sd)
    _, test = load_splits(cfg.prompts)
    again = evaluate(model, cfg, test, build_eval_reward(cfg), version=2)
    assert again["eval/brightness"] == pytest.approx(evals[-1]["eval_ema/brightness"], abs=1e-6)
    assert (run_dir / "samples" / "eval_ema_v0002.png").is_file()
    assert (run_dir / "eval_ema" / "v0002.jsonl").is_file()
