"""Emulated accelerators (``model.path = "emulated"``): recipe shapes, cost-model seconds, no CPU.

The seconds an emulated call waits are compared with the cost model's own functions (the
same arithmetic in the same process, so equality is exact up to float summation order:
``approx`` with rel 1e-9). That the waits use no CPU is checked with the process's CPU time
against a wall-clock wait long enough (0.3 s) that a busy loop could not hide.
"""

from __future__ import annotations

import time

import pytest
import torch

from digenrl.config import load_config
from digenrl.core import costmodel as cm
from digenrl.core.plan import plan_for_step
from digenrl.models import build_model
from digenrl.models.emulated import EmulatedClock, EmulationError, latent_shape, weight_numel
from digenrl.models.meta import latent_shape_of
from digenrl.rl.fragment import FragmentJob
from digenrl.rl.learner import Learner
from digenrl.rl.policy import build_policy
from digenrl.rl.rewards import build_reward

SMALL = ["model.path=\"emulated\"", "model.emulate.time_scale=0.0001", "model.emulate.weight_scale=1e-5",
         "model.emulate.latent_scale=0.01", "model.fsdp=false"]


def _cfg(recipe: str, *extra: str):
    return load_config(f"configs/models/{recipe}.toml", [*SMALL, *extra])


def test_latents_and_weight_sets_have_the_recipes_sizes_scaled_by_the_knobs() -> None:
    flux = load_config("configs/models/flux.toml", ["model.path=\"emulated\""])
    assert latent_shape(flux.model) == (16, 90, 90) == cm.MODELS["flux"].latent_shape
    assert cm.MODELS["flux"].latent_bytes == 2 * 16 * 90 * 90  # the shape is the cm 1 byte count
    assert weight_numel(flux.model) == int(2 * 11.8e9) // 2  # bf16, full fine-tune
    wan = load_config("configs/models/wan.toml", ["model.path=\"emulated\"", "model.emulate.latent_scale=0.25"])
    assert latent_shape(wan.model) == (16, 21, 30, 52)  # sides x sqrt(0.25), frames kept
    assert latent_shape_of(wan.model) == latent_shape(wan.model)
    qwen = _cfg("qwenimage")  # LoRA rank 64: the adapter (~1% of 20.4B params) is the weight set
    assert weight_numel(qwen.model) == int(cm.trainable_bytes(cm.MODELS["qwenimage"], 64) * 1e-5) // 2


def test_an_emulated_model_on_cpu_or_of_an_unpriced_family_is_refused_in_one_line() -> None:
    with pytest.raises(EmulationError, match="declare an accelerator"):
        build_model(_cfg("flux").model, gpu="cpu")
    tiny = load_config(None, ["model.path=\"emulated\""])  # the tiny sd3 has no GPU figures
    with pytest.raises(EmulationError, match="prices only"):
        build_model(tiny.model, gpu="H100")


def test_a_wait_sleeps_without_cpu_and_repays_a_late_wake_up() -> None:
    clock = EmulatedClock(scale=0.5)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    clock.wait(0.6)  # 0.3 s of wall time
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    assert wall >= 0.3 and cpu < 0.25 * wall, (wall, cpu)
    clock.debt = 0.1  # a wake-up 0.1 s late: the next wait is that much shorter
    t0 = time.perf_counter()
    clock.wait(0.2)
    assert time.perf_counter() - t0 < 0.1 + 0.05 and clock.emulated_s == pytest.approx(0.8)


def test_generation_training_and_the_optimizer_take_the_cost_models_seconds() -> None:
    cfg = _cfg("flux", "train.kl_beta=0.01")  # full fine-tune with a frozen KL reference copy
    rollout = build_model(cfg.model, seed=0, gpu="H20")
    trained, sde = plan_for_step(cfg, 0)
    g = cfg.train.group_size
    job = FragmentJob(model=rollout, cfg=cfg, prompts=["a cat"], seeds=list(range(g)), sde_steps=sde,
                      trained_steps=trained, reward_fn=build_reward(cfg.reward.terms))
    records, result = job.run_all()
    gen = g * cfg.sampler.num_steps * cm.forward_s("H20", "flux", "rollout") + g * cm.reward_s("H20", "flux")
    assert rollout.clock.emulated_s == pytest.approx(gen, rel=1e-9)

    policy = build_policy(cfg, 1, "H100")
    learner = Learner(policy, cfg)
    learner.train_fragment(records=records, cond=result.cond, rewards=result.rewards, gen_version=0,
                           n_trained_total=len(trained), sigma_max=1.0)
    wl = cm.Workload(model="flux", num_steps=cfg.sampler.num_steps, trained_steps=len(trained),
                     cfg_gen=False, cfg_train=False, grad_ckpt=True, kl=True, lora_rank=0, fsdp=False)
    costs = cm.node_costs("H100", wl)
    # forward + backward (checkpointing) + the frozen reference's forward: the planner's train_step_s
    assert policy.model.clock.emulated_s == pytest.approx(g * len(trained) * costs.train_step_s, rel=1e-9)
    before = policy.model.clock.emulated_s
    metrics = learner.finish_step()
    assert policy.model.clock.emulated_s - before == pytest.approx(costs.optimizer_s, rel=1e-9)
    assert metrics["grad_norm"] > 0  # the weights get a gradient: the next version differs


def test_a_trainer_generating_is_priced_as_eager_generation_and_cfg_doubles_the_rows() -> None:
    cfg = _cfg("qwenimage")  # guidance 4: two CFG branches per step; LoRA adapter
    policy = build_policy(cfg, 1, "H100")
    trained, sde = plan_for_step(cfg, 0)
    g = cfg.train.group_size
    job = FragmentJob(model=policy.model, cfg=cfg, prompts=["a dog"], seeds=list(range(g)), sde_steps=sde,
                      trained_steps=trained, reward_fn=build_reward(cfg.reward.terms))
    job.run_all()
    want = g * cfg.sampler.num_steps * 2 * cm.forward_s("H100", "qwenimage", "trainer_gen") \
        + g * cm.reward_s("H100", "qwenimage")
    assert policy.model.clock.emulated_s == pytest.approx(want, rel=1e-9)


def test_rewards_are_a_deterministic_function_of_the_latents_and_the_ratio_is_exactly_one() -> None:
    cfg = _cfg("flux")
    model = build_model(cfg.model, seed=0, gpu="H800")
    trained, sde = plan_for_step(cfg, 0)
    runs = []
    for _ in range(2):
        job = FragmentJob(model=model, cfg=cfg, prompts=["a cat"], seeds=list(range(12)), sde_steps=sde,
                          trained_steps=trained, reward_fn=build_reward(cfg.reward.terms))
        runs.append(job.run_all())
    (rec_a, res_a), (_, res_b) = runs
    assert res_a.rewards == res_b.rewards and len(set(res_a.rewards)) > 1  # per-sample, not constant
    # same process, same weights, same inputs: the recompute is bit-identical (ratio exactly 1)
    policy = build_policy(cfg, 1, "H800")
    policy.load_sync_state(model.sync_state_dict())
    t = trained[0]
    v = policy.model.velocity(rec_a[t].x_t, rec_a[t].sigma, res_a.cond)
    with torch.no_grad():
        assert torch.equal(v, model.velocity(rec_a[t].x_t, rec_a[t].sigma, res_a.cond))


def test_a_lora_run_syncs_adapter_tensors_only() -> None:
    cfg = _cfg("qwenimage")
    model = build_model(cfg.model, seed=0, gpu="H20")
    sd = model.sync_state_dict()
    assert sd and all(k.startswith("lora_") for k in sd)
    assert sum(v.numel() for v in sd.values()) == weight_numel(cfg.model)


@pytest.mark.slow
def test_an_eight_node_emulated_cluster_trains_a_recipe_with_exact_accounting(tmp_path) -> None:
    """4 H20 rollouts + 4 H100 trainer ranks (FSDP, gloo) run the FLUX recipe, shrunk to 3 steps
    of 4 prompts: every process real, every node on its declared GPU type."""
    import json

    from digenrl.config import resolve_mode
    from digenrl.launch import launch, make_run_dir

    cfg = resolve_mode(load_config("configs/models/flux.toml", [
        "model.path=\"emulated\"", "model.emulate.time_scale=0.001", "model.emulate.latent_scale=0.004",
        "model.emulate.weight_scale=1e-6", "run.steps=3", "run.threads=1", "train.prompts_per_step=4",
        "train.group_size=4", "runtime.fragments_per_step=4", "cluster.rollouts=4", "cluster.trainers=4",
        "cluster.rollout_gpu=\"H20\"", "cluster.trainer_gpu=\"H100\""]))
    run_dir = make_run_dir(cfg, str(tmp_path / "run"))
    summary = launch(cfg, run_dir)
    acc = summary["accounting"]
    assert acc == {"admitted": 48, "trained": 48, "discarded": {}, "in_flight": 0}
    assert summary["slots"] == {"consumed": 12, "expected": 12} and summary["stop_reason"] == "done"
    gpus = {n: v["gpu"] for n, v in summary["nodes"].items()}
    assert gpus == {**{f"rollout-{i}": "H20" for i in range(4)}, **{f"trainer-{i}": "H100" for i in range(4)}}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert 0 < rows[0]["net_bytes"] < rows[-1]["net_bytes"]  # every node's traffic is counted


def test_an_emulated_node_imports_neither_diffusers_nor_peft_nor_transformers() -> None:
    """What the models package promises (models/__init__.py): a node of an emulated cluster
    loads the modules every node loads and builds its model without them (~2 s of imports a
    process, times 8-64 processes on the emulated cluster's few cores)."""
    from tests.conftest import heavy_imports_after

    code = (
        "import digenrl.actors.node, digenrl.actors.rollout, digenrl.actors.trainer\n"
        "from digenrl.config import load_config\n"
        "from digenrl.models import build_model\n"
        "from digenrl.rl.policy import build_policy\n"
        f"cfg = load_config('configs/models/flux.toml', {SMALL!r})\n"
        "build_model(cfg.model, seed=0, gpu='H20')\n"
        "build_policy(cfg, 1, 'H100')\n")
    assert heavy_imports_after(code) == []
