"""FSDP2 sharding of the trainer (``model.fsdp = true``) on CPU, gloo, real processes.

The sharded update must equal the unsharded one: the ranks' reduce-scattered gradients are
sums like the unsharded all-reduce, and padding passes (ranks that train fewer timesteps)
move nothing. Checkpoints go through torch.distributed.checkpoint: each rank writes its own
shard, and any rank count (or one unsharded trainer) loads them back bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from digenrl.config import load_config, resolve_mode
from digenrl.rl.learner import Learner
from digenrl.rl.sharding import pass_count, step_passes
from tests.conftest import SMALL as TINY_RUN
from tests.conftest import final_weights, shared_dir

SMALL = [*TINY_RUN, "run.steps=2", "runtime.fragments_per_step=1", "cluster.trainers=2"]


def test_pass_counts_follow_the_tsp_plan() -> None:
    # 3 trained timesteps, 2 ranks, 1 fragment: TSP splits 1 / 2, so rank 0 pads one pass
    assert [pass_count([0, 1, 2], 2, True, 0, 1, r) for r in (0, 1)] == [1, 2]
    assert step_passes([0, 1, 2], 2, True, 1) == 2
    # 2 fragments of 3: one fragment per rank (data parallel), 3 passes each, nothing to pad
    assert [sum(pass_count([0, 1, 2], 2, True, f, 2, r) for f in (0, 1)) for r in (0, 1)] == [3, 3]
    # one rank owns everything
    assert pass_count([0, 1], 1, True, 0, 1, 0) == step_passes([0, 1], 1, True, 1) == 2


@pytest.fixture
def one_rank_group(tmp_path: Path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_sharded_policy_pads_with_passes_that_move_no_gradient(one_rank_group: None) -> None:
    from digenrl.rl.policy import build_policy

    cfg = load_config(None, ["model.path=\"random\"", "model.fsdp=true", "train.group_size=2"])
    policy = build_policy(cfg, world_size=2)  # as a rank of 2 would; the group here has one
    assert policy.sharded
    learner = Learner(policy, cfg)
    # a fragment whose groups all tie has zero advantages: nothing to train, but the plan gave
    # this rank 2 timesteps of it, so it runs 2 idle passes
    learner.train_fragment(records={}, cond={}, rewards=[1.0, 1.0], gen_version=0,
                           n_trained_total=2, sigma_max=1.0, passes=2)
    assert learner.stats.passes == 2
    assert all(float(g.abs().max()) == 0.0 for g in policy.grads_snapshot())
    with pytest.raises(RuntimeError, match="lockstep"):
        learner.finish_step(pad_to=1)  # the step's plan says 1: this rank ran more
    learner.stats.passes = 0
    metrics = learner.finish_step(pad_to=3)
    assert policy.version == 1 and metrics["grad_norm"] == 0.0


def test_a_sharded_bf16_policy_keeps_float32_masters_and_computes_what_a_bf16_rollout_does(
        one_rank_group: None) -> None:
    from digenrl.models import build_model
    from digenrl.rl.grpo import group_advantages
    from digenrl.rl.policy import build_policy
    from digenrl.rl.sampler import rollout, seeded_generators
    from digenrl.rl.sharding import full
    from tests.conftest import assert_same_weights

    cfg = load_config(None, ["model.path=\"random\"", "model.fsdp=true", "model.dtype=\"bfloat16\"",
                             "model.lora_rank=2", "sampler.num_steps=2", "train.timesteps=\"all\"",
                             "train.lr=1e-2"])
    policy = build_policy(cfg, world_size=2)
    assert policy.sharded and all(p.dtype == torch.float32 for p in policy.params)  # the masters
    cond = policy.model.encode_prompts(["a red square", "a red square", "a blue circle", "a blue circle"])
    adv, stats = group_advantages(torch.tensor([0.1, 0.5, 0.2, 0.9]), [0, 0, 1, 1])
    for _ in range(2):  # at the initial weights, then after a step
        # a rollout's copy: every parameter bf16, the trainer's float32 masters rounded into it
        rollout_model = build_model(cfg.model, seed=cfg.run.seed)  # the same base weights
        rollout_model.load_sync_state_dict(policy.state_dict_for_sync())
        # FSDP computes with the masters (and frozen weights) cast to bf16: the rollout's bits
        own = {k: full(v).to(torch.bfloat16) for k, v in policy.model.transformer.state_dict().items()}
        assert_same_weights(rollout_model.transformer.state_dict(), own)
        records = {r.index: r for r in rollout(rollout_model, cond, generator=seeded_generators([1, 2, 3, 4]),
                                               sampler_cfg=cfg.sampler)}
        out = policy.fragment_loss_backward(records, cond, adv, stats.keep, batch_size_total=4, n_trained_total=2)
        # two instances and code paths (tests/conftest.py): 0 here; a different precision layout
        # (fp32 LoRA or norms, autocast) moves it by ~1e-3
        assert out["n"] == 8 and out["ratio_max_dev"] <= 1e-5
        policy.optimizer_step()


def _run(tmp_path: Path, mode: str, fsdp: bool, extra: list[str]) -> dict[str, torch.Tensor]:
    from digenrl.launch import launch, make_run_dir

    cfg = resolve_mode(load_config(None, [*SMALL, *extra, f"model.fsdp={str(fsdp).lower()}"]), mode)
    run_dir = make_run_dir(cfg, str(tmp_path / f"{mode}-{fsdp}"))
    summary = launch(cfg, run_dir)
    acc = summary["accounting"]
    assert acc["admitted"] == acc["trained"] + sum(acc["discarded"].values()) and acc["in_flight"] == 0
    return final_weights(run_dir)


def _unsharded(factory: pytest.TempPathFactory, mode: str, extra: list[str]) -> dict[str, torch.Tensor]:
    """The final weights of the unsharded run of ``mode`` and ``extra``, launched once per
    session: the reference of the sharded run and of the teardown fault."""
    name = "fsdp-unsharded-" + "-".join([mode, *extra]).translate(str.maketrans('/="', "___"))

    def make(folder: Path) -> None:
        _run(folder, mode, False, extra)

    folder = shared_dir(factory, name, make)
    return final_weights(folder / f"{mode}-False")


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "extra"), [
    ("colocated", []),
    # 3 trained timesteps over 2 TSP ranks: one rank pads; LoRA with its KL reference, and
    # activation checkpointing re-running sharded blocks in backward; the ranks meet through a
    # file in the run folder (cluster.rendezvous: what trainer ranks on several hosts use)
    ("digenrl", ["train.window_size=3", "train.window_hi=3", "model.lora_rank=4",
                 "train.kl_beta=0.01", "model.gradient_checkpointing=true", 'cluster.rendezvous="file"']),
])
def test_two_sharded_ranks_train_the_same_update_as_two_unsharded(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, mode: str, extra: list[str]) -> None:
    plain, sharded = _unsharded(tmp_path_factory, mode, extra), _run(tmp_path, mode, True, extra)
    assert plain.keys() == sharded.keys()
    for k in plain:
        torch.testing.assert_close(sharded[k], plain[k], rtol=0, atol=1e-6, msg=k)
    assert any(float((plain[k] != 0).float().sum()) for k in plain)  # it did train something


#: Two colocated FSDP2 ranks, 4 steps with a checkpoint after each (the killed-and-resumed runs).
SHARDED_RESUME_SETS = ["run.steps=4", "run.checkpoint_every=1", "model.path=\"random\"",
                       "train.prompts_per_step=2", "train.group_size=2", "sampler.num_steps=4",
                       "cluster.trainers=2", "model.fsdp=true"]


def sharded_whole_run(factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run of :data:`SHARDED_RESUME_SETS`, launched once per session: the
    reference of the sharded resume here and in tests/test_offload.py."""
    from tests.conftest import launch_run, set_args

    def make(folder: Path) -> None:
        r = launch_run("--mode", "colocated", "--run-dir", str(folder / "run"), *set_args(SHARDED_RESUME_SETS))
        assert r.returncode == 0, r.stderr[-3000:]

    return shared_dir(factory, "fsdp-sharded-whole", make) / "run"


@pytest.mark.slow
def test_a_sharded_run_killed_mid_run_resumes_bit_identical(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    from tests.test_resume import _interrupt_and_resume

    whole = sharded_whole_run(tmp_path_factory)
    cut, _ = _interrupt_and_resume(tmp_path, "colocated", "generate:2", versions=(2,), sets=SHARDED_RESUME_SETS,
                                   killed="exited with codes [-9, -9]")
    a, b = final_weights(whole), final_weights(cut)
    # exact on purpose: same machine and thread count, so a resumed run must replay the same arithmetic
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)



@pytest.mark.slow
def test_a_sharded_checkpoint_is_written_shard_by_shard_and_loads_on_another_rank_count(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    run, stores = tmp_path / "run", tmp_path / "stores"
    run.mkdir()
    stores.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # two ranks save, then three load (and rank 0 alone, unsharded): see tests/dcp_worker.py
    procs = [subprocess.Popen([sys.executable, "-m", "tests.dcp_worker", str(r), str(run), str(stores)],
                              env=env, stderr=subprocess.PIPE, text=True) for r in range(3)]
    errors = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(e[-2000:] for e in errors)
    vdir = run / "checkpoint" / "v000001"
    # each rank wrote its own shard file (nothing gathered): no whole-weights file exists
    assert sorted(p.name for p in (vdir / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (vdir / "policy.safetensors").exists() and not (vdir / "optimizer.pt").exists()
    manifest = json.loads((vdir / "manifest.json").read_text())
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(manifest["files"])
    ref = torch.load(run / "reference.pt", weights_only=True)
    assert any(float(s["exp_avg"].abs().max()) > 0 for s in ref["optim"].values())  # a real step
    for name in ("loaded-3", "loaded-1", "loaded-1-bf16"):  # resharded over 3; unsharded; masters
        got = torch.load(run / f"{name}.pt", weights_only=True)
        assert got["version"] == ref["version"] == 1, name
        # exact on purpose: a checkpoint moves float32 bytes, it must not change one
        assert got["weights"].keys() == ref["weights"].keys(), name
        # trained parameters travel as their float32 masters, also into a bfloat16 model
        assert all(got["weights"][k].dtype == torch.float32 for k in ref["optim"]), name
        # a bfloat16 model keeps its buffers (the positional table) in bfloat16: those are
        # compared after the same rounding; everything float32 is compared as it is
        assert all(torch.equal(got["weights"][k], ref["weights"][k].to(got["weights"][k].dtype))
                   for k in ref["weights"]), name
        assert got["optim"].keys() == ref["optim"].keys(), name
        for param, state in ref["optim"].items():
            assert all(torch.equal(torch.as_tensor(got["optim"][param][k]), torch.as_tensor(v))
                       for k, v in state.items()), (name, param)
    # a publish's gather: rank 0 holds the whole set, the other ranks joined and kept nothing
    kept = torch.load(run / "kept-3.pt", weights_only=True)
    assert kept.keys() == ref["weights"].keys()
    # exact on purpose: float32 bytes moved through the checkpoint and the gather, never computed on
    assert all(torch.equal(kept[k], ref["weights"][k]) for k in kept)
    assert [(run / f"kept-by-rank-{r}.txt").read_text() for r in (1, 2)] == ["0", "0"]


def test_digenrl_eval_reads_a_sharded_checkpoint_whole(one_rank_group: None, tmp_path: Path) -> None:
    from digenrl.launch import evaluate_run, make_run_dir
    from digenrl.models import build_model
    from digenrl.rl.checkpoint import checkpoint_weights, save_trainer_state
    from digenrl.rl.policy import build_policy
    from tests.test_evaluate import TINY

    cfg = load_config(None, [*TINY, "model.fsdp=true", "run.eval_every=1", 'eval.terms=[{ name = "brightness" }]'])
    run_dir = make_run_dir(cfg, str(tmp_path / "run"))
    policy = build_policy(cfg, world_size=2)  # sharded, as a rank of 2 would; the group has one
    x = torch.randn(2, *policy.model.latent_shape, generator=torch.Generator().manual_seed(1))
    policy.model.velocity(x, 0.5, policy.model.encode_prompts(["a", "b"])).pow(2).mean().backward()
    policy.optimizer_step()
    vdir = save_trainer_state(run_dir, policy, {}, write=True)
    assert (vdir / "dcp" / ".metadata").is_file() and not (vdir / "policy.safetensors").exists()
    trained = policy.state_dict_for_sync()
    base = build_model(cfg.model, seed=cfg.run.seed)
    before = {k: v.clone() for k, v in base.sync_state_dict().items()}
    got = checkpoint_weights(vdir, base)
    assert got is not None and got[0] == 1 and got[1].keys() == trained.keys()
    # exact on purpose: the shards hold the trained float32 tensors, stitched back unchanged
    assert all(torch.equal(got[1][k], trained[k]) for k in trained)
    assert any(not torch.equal(before[k], trained[k]) for k in trained)  # the step moved weights
    assert evaluate_run(run_dir, str(vdir), out_dir=tmp_path / "eval")["policy_version"] == 1


@pytest.mark.slow
def test_a_rank_that_dies_in_the_teardown_after_the_run_does_not_fail_it(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """gloo can abort a rank as it tears its process group down, after the run is done and
    saved: the launch reports the completed run (weights and totals as with no fault) and
    names the rank, instead of failing the run. A rank lost before the summary still fails it
    (tests/test_resume.py kills a colocated rank mid-run)."""
    from digenrl.faults import CRASH_ENV

    plain = _unsharded(tmp_path_factory, "colocated", [])  # the same run, no fault
    monkeypatch.setenv(CRASH_ENV, "teardown:1")  # rank 1 is SIGKILLed once every rank is done
    killed = _run(tmp_path / "killed", "colocated", False, [])
    err = capfd.readouterr().err
    assert "the run completed, but rank 1 (-9) exited abnormally in the teardown" in err
    # exactness is the point (nothing of the run lost or changed by the kill): both launches
    # run in this session, on the same CPU, with the same ranks, seeds, threads and inputs
    assert plain.keys() == killed.keys() and all(torch.equal(plain[k], killed[k]) for k in plain)


def test_a_launch_without_its_summary_fails_whatever_the_exit_codes(tmp_path: Path) -> None:
    from digenrl.actors.base import RunFailed
    from digenrl.launch import colocated_outcome

    summary = tmp_path / "colocated-summary.json"
    for codes in ([0, 0], [0, -6], [1, 0]):
        with pytest.raises(RunFailed, match=r"exited with codes"):
            colocated_outcome(codes, summary, tmp_path)
    summary.write_text('{"trained": 8}')
    assert colocated_outcome([0, 0], summary, tmp_path) == {"trained": 8}


def _sharded_vote_worker(rank: int, store: str, out: str) -> None:
    """One of two gloo ranks of a sharded policy: a step's end with no vote, then one where
    rank 1 was told to stop (a drain) before any of the step's passes while rank 0 trained."""
    from digenrl.actors.resume import sharded_vote
    from digenrl.rl.policy import build_policy
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        cfg = load_config(None, ["model.path=\"random\"", "model.fsdp=true", "train.group_size=2"])
        learner = Learner(build_policy(cfg, world_size=2), cfg)

        def all_reduce(t: torch.Tensor) -> None:
            dist.all_reduce(t)

        results: list[object] = []
        learner.idle(1 if rank == 0 else 0)  # step 0: rank 0 ran one pass, rank 1 none
        results.append(sharded_vote(learner, all_reduce, stop=False, drain=False, pad_to=2))
        learner.finish_step(pad_to=2)
        results.append(learner.policy.version)
        # step 1: rank 0 runs two passes, then reaches the step's end; rank 1, stopping, pads
        # all three of the step's passes (two of them pair with rank 0's) and votes
        if rank == 0:
            learner.idle(2)
        results.append(sharded_vote(learner, all_reduce, stop=rank == 1, drain=rank == 1, pad_to=3))
        results.append([learner.policy.version, learner.stats.passes])
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def test_a_sharded_rank_told_to_stop_pads_the_steps_passes_and_votes_so_no_rank_steps(tmp_path: Path) -> None:
    """Sharded ranks' collectives run inside every pass and pair up pass for pass only at the
    step's end. A rank told to stop therefore pads to the step's pass count before it votes:
    the other rank's remaining passes pair with its idle ones instead of waiting for good.
    Both learn that a rank stopped, and that the stop was a drain (so that both write their
    shard of the drain checkpoint), and neither takes the step."""
    torch.multiprocessing.spawn(_sharded_vote_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0[:2] == r1[:2] == [[False, False], 1]  # no vote: the step is taken
    assert r0[2] == r1[2] == [True, True]
    assert r0[3] == r1[3] == [1, 3]  # still version 1; every rank ran the step's 3 passes


def _one_step_weights(offload: str) -> dict[str, torch.Tensor]:
    from digenrl.rl.grpo import group_advantages
    from digenrl.rl.policy import build_policy
    from digenrl.rl.sampler import rollout, seeded_generators
    from digenrl.rl.sharding import full

    cfg = load_config(None, ["model.path=\"random\"", "model.fsdp=true", f'model.offload="{offload}"',
                             "model.lora_rank=2", "sampler.num_steps=2", "train.timesteps=\"all\"", "train.lr=1e-2"])
    policy = build_policy(cfg, world_size=2)
    assert policy.sharded
    cond = policy.model.encode_prompts(["a red square", "a red square", "a blue circle", "a blue circle"])
    adv, stats = group_advantages(torch.tensor([0.1, 0.5, 0.2, 0.9]), [0, 0, 1, 1])
    with torch.no_grad():
        records = {r.index: r for r in rollout(policy.model, cond, generator=seeded_generators([1, 2, 3, 4]),
                                               sampler_cfg=cfg.sampler)}
    policy.fragment_loss_backward(records, cond, adv, stats.keep, batch_size_total=4, n_trained_total=2)
    assert policy.optimizer_step()["grad_norm"] > 0  # a step that moves the LoRA weights
    return {k: full(v).detach().clone() for k, v in policy.model.transformer.state_dict().items()}


def test_parameter_offload_gives_the_update_of_a_run_without_it(one_rank_group: None) -> None:
    """model.offload = "params" (FSDP2's CPUOffloadPolicy) moves where the shards live, not what
    the step computes: the same weights after one step. Tolerance 1e-6 relative: on the CPU the
    offloaded copies are the same float32 values, but the two instances are built and sharded
    separately (summation order inside the kernels may differ)."""
    base, offloaded = _one_step_weights("none"), _one_step_weights("params")
    assert base.keys() == offloaded.keys()
    moved = [k for k in base if "lora" in k]
    assert moved
    for k in base:
        torch.testing.assert_close(offloaded[k], base[k], rtol=1e-6, atol=1e-7)


def test_offload_without_fsdp_is_a_one_line_config_error() -> None:
    from digenrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"model.offload = 'params' with model.fsdp = false"):
        load_config(None, ['model.offload="params"'])
