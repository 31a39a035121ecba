"""Wan2.2 A14B's experts placed over TSP trainer ranks (digenrl/rl/experts.py): which rank
holds which expert, a rank that never loads the other, the step two placed ranks take against
one rank holding both (real gloo processes), what is synced, saved and checkpointed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from digenrl.config import ResolvedConfig, load_config, resolve_mode
from tests.conftest import SUITE_SETS
from tests.pipelines import MAX_TEXT_TOKENS, SMALL, write_pipeline_folder

# tests/pipelines.py _wan22: boundary_ratio 0.875; 4 steps at the suite's shift put indices 0, 1
# on the high-noise expert (transformer) and 2, 3 on the low-noise one (transformer_2)
HIGH, LOW = ("transformer",), ("transformer_2",)
BOTH = ("transformer", "transformer_2")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_pipeline_folder("wan22", tmp_path_factory.mktemp("wan22") / "pipe")


def _cfg(folder: Path, *extra: str, mode: str = "digenrl") -> ResolvedConfig:
    return resolve_mode(load_config(None, [
        *SUITE_SETS, f'model.path="{folder}"', 'model.family="wan"', f"model.max_text_tokens={MAX_TEXT_TOKENS}",
        *[f"model.{k}={v}" for k, v in SMALL.items()], "train.prompts_per_step=2", "train.group_size=2",
        "runtime.fragments_per_step=1", "sampler.num_steps=4", 'train.timesteps="all"', "run.steps=2",
        'runtime.tag="never"', *extra]), mode)


def test_each_tsp_rank_holds_the_experts_of_its_timesteps_and_generating_ranks_hold_both(folder: Path) -> None:
    from digenrl.rl.experts import expert_of_index, placement_for

    cfg = _cfg(folder)
    assert expert_of_index(cfg, 0.875) == ["transformer", "transformer", "transformer_2", "transformer_2"]
    two = placement_for(cfg, 2)
    assert two is not None and two.held == (HIGH, LOW) and two.trained == BOTH and two.partial
    assert [two.code(r) for r in (0, 1)] == [1, 2] and two.source("transformer_2") == 1
    one = placement_for(cfg, 1)  # one rank trains every index: both, nothing to place
    assert one is not None and one.held == (BOTH,) and not one.partial
    # 3 ranks split 4 indices 1 / 1 / 2 (owners_for): rank 1 owns index 1 (high)
    assert placement_for(cfg, 3).held == (HIGH, HIGH, LOW)  # type: ignore[union-attr]
    # rank 0 evaluates (it denoises whole trajectories): it holds both, rank 1 only its own
    evals = placement_for(_cfg(folder, "run.eval_every=1", 'prompts.test_fraction=0.5'), 2)
    assert evals is not None and evals.held == (BOTH, LOW) and evals.holders("transformer_2") == [0, 1]
    for extra in (('runtime.tag="always"',), ("train.ema_decay=0.9",)):  # every rank holds both
        assert placement_for(_cfg(folder, *extra), 2).held == (BOTH, BOTH)  # type: ignore[union-attr]
    assert placement_for(_cfg(folder, mode="colocated"), 2).held == (BOTH, BOTH)  # type: ignore[union-attr]
    assert placement_for(_cfg(write_pipeline_folder("wan", folder.parent / "wan21")), 2) is None


def test_fsdp_is_refused_where_a_trainer_rank_would_hold_both_experts(folder: Path) -> None:
    from digenrl.config import ConfigError
    from digenrl.launch import check_runtime_support

    check_runtime_support(_cfg(folder, "model.fsdp=true", "cluster.trainers=2"))  # one expert a rank
    with pytest.raises(ConfigError, match=r"trainer rank 0 of 2 would hold both experts \(rank 0 evaluates"):
        check_runtime_support(_cfg(folder, "model.fsdp=true", "cluster.trainers=2", "run.eval_every=1",
                                   "prompts.test_fraction=0.5"))
    with pytest.raises(ConfigError, match=r"trainer rank 0 of 2 would hold both experts \(colocated ranks"):
        check_runtime_support(_cfg(folder, "model.fsdp=true", "cluster.trainers=2", mode="colocated"))


def test_with_all_trained_indices_on_one_side_the_other_expert_is_neither_held_trained_nor_synced(
        folder: Path, tmp_path: Path) -> None:
    """``train_experts = "both"`` and a window of high-noise indices only: no rank holds
    transformer_2, nothing of it is published or saved."""
    from digenrl.rl.experts import placement_for
    from digenrl.rl.learner import save_final
    from digenrl.rl.policy import build_policy

    cfg = _cfg(folder, "model.lora_rank=4", 'train.timesteps="window"', "train.window_lo=0",
               "train.window_size=2", "train.window_hi=2")
    placement = placement_for(cfg, 2)
    assert placement is not None and placement.trained == HIGH and placement.held == (HIGH, HIGH)
    assert not placement.partial  # every rank holds every trained expert: the plain all-reduce
    policy = build_policy(cfg, world_size=2, rank=1)
    assert policy.model.transformer.transformer_2 is None and policy.placement is None
    assert {k.split(".")[0] for k in policy.whole_sync_state()} == {"transformer"}
    save_final(policy, tmp_path)
    assert (tmp_path / "final" / "pytorch_lora_weights.safetensors").is_file()
    assert not (tmp_path / "final" / "transformer_2").exists()


def test_a_rank_never_loads_the_expert_it_does_not_use(folder: Path) -> None:
    """Rank 1 of two: transformer is not a module of its model (no parameter, no storage), its
    optimizer holds transformer_2's LoRA only, and a row routed to transformer is an error."""
    from digenrl.rl.policy import build_policy

    policy = build_policy(_cfg(folder, "model.lora_rank=4"), world_size=2, rank=1)
    experts = policy.model.transformer
    assert experts.held == LOW and experts.transformer is None
    assert {n.split(".")[0] for n, _ in experts.named_parameters()} == {"transformer_2"}
    assert experts.absent["transformer"].blocks[0].ffn.net[2].weight.is_meta  # config and shapes only
    assert set(policy.expert_index) == {"transformer_2"}
    trained = {id(p) for p in policy.params}
    assert trained == {id(p) for n, p in experts.named_parameters() if "lora_" in n}
    assert {id(p) for g in policy.optimizer.param_groups for p in g["params"]} == trained
    cond = policy.model.encode_prompts(["a red fox"])
    x = torch.zeros(1, *policy.model.latent_shape)
    policy.model.velocity(x, 0.4, cond)  # its own expert
    with pytest.raises(RuntimeError, match=r"routed to transformer, which this process does not hold"):
        policy.model.velocity(x, 0.95, cond)


def test_a_rollout_takes_a_version_of_one_expert_and_keeps_the_other(folder: Path) -> None:
    from digenrl.config import ModelConfig
    from digenrl.models import build_model
    from digenrl.models.adapter import SyncStateError

    model = build_model(ModelConfig(family="wan", path=str(folder), max_text_tokens=MAX_TEXT_TOKENS, lora_rank=4,
                                    **SMALL))
    full = model.sync_state_dict()
    low_before = {k: v.clone() for k, v in full.items() if k.startswith("transformer_2.")}
    high = {k: v + 1 for k, v in full.items() if k.startswith("transformer.")}
    model.load_sync_state_dict(high)
    after = model.sync_state_dict()
    assert all(torch.equal(after[k], v) for k, v in high.items())
    assert all(torch.equal(after[k], v) for k, v in low_before.items())  # untouched
    with pytest.raises(SyncStateError, match="missing"):  # an expert it carries must be whole
        model.load_sync_state_dict(dict(list(high.items())[1:]))


def _fragment(folder: Path, cfg: ResolvedConfig) -> tuple[dict, dict, list[float]]:
    """One fragment (2 prompts x 2) denoised by a model holding both experts, as a rollout
    does: the same records in every process (seeded)."""
    from digenrl.models import build_model
    from digenrl.rl.sampler import rollout, seeded_generators

    model = build_model(cfg.model, seed=cfg.run.seed)
    cond = model.encode_prompts(["a red fox", "a red fox", "a blue bird", "a blue bird"])
    with torch.no_grad():
        records = {r.index: r for r in rollout(model, cond, generator=seeded_generators([1, 2, 3, 4]),
                                               sampler_cfg=cfg.sampler)}
    return records, cond, [0.1, 0.7, 0.4, 0.2]


EXTRA = ("train.lr=1e-2", "train.max_grad_norm=1e-3")  # a norm that clips: the clip uses both experts'


def _placed_worker(rank: int, folder: str, store: str, out: str, lora: int, world: int,
                   extra: tuple[str, ...]) -> None:
    """One of two gloo trainer ranks of a placed run: its own indices of one fragment, the
    step's reduction and optimizer step, then the whole state gathered on rank 0, and a
    second placed policy loading that state back."""
    from safetensors.torch import load_file

    from digenrl.core.plan import owners_for
    from digenrl.rl.checkpoint import save_trainer_state, version_dir
    from digenrl.rl.learner import Learner, save_final
    from digenrl.rl.policy import build_policy
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        cfg = _cfg(Path(folder), f"model.lora_rank={lora}", *EXTRA, *extra)
        policy = build_policy(cfg, world_size=world, rank=rank)
        learner = Learner(policy, cfg)
        records, cond, rewards = _fragment(Path(folder), cfg)
        owners = owners_for(sorted(records), world, True, 0, 1)
        mine = {t: r for t, r in records.items() if owners[t] == rank}
        learner.train_fragment(records=mine, cond=cond, rewards=rewards, gen_version=0, n_trained_total=4,
                               sigma_max=policy.sigma_max)

        def all_reduce(t: torch.Tensor) -> None:
            dist.all_reduce(t)

        assert learner.reduce_gradients(all_reduce)
        metrics = learner.finish_step()
        # a version whose step changed transformer_2 only: rank 0 gathers that expert alone
        whole_now = policy.whole_sync_state(keep=rank == 0)
        low_only = policy.whole_sync_state(keep=rank == 0, experts=("transformer_2",))
        low_gathered = rank != 0 or (low_only.keys() == {k for k in whole_now if k.startswith("transformer_2.")}
                                     and bool(low_only) and all(torch.equal(v, whole_now[k]) for k, v in low_only.items()))
        # what a checkpoint and final/ hold: written by rank 0, the experts it lacks sent by rank 1
        run = Path(out) / "run"
        save_trainer_state(run, policy, {}, write=rank == 0)
        save_final(policy, run, write=rank == 0)
        dist.barrier()
        ckpt = version_dir(run, 1)
        again = build_policy(cfg, world_size=world, rank=rank)  # a resume: every rank reads the whole files
        again.load_sync_state(load_file(ckpt / "policy.safetensors"))
        again.load_optimizer_state(torch.load(ckpt / "optimizer.pt", weights_only=True))
        mine, back = policy.state_dict_for_sync(), again.state_dict_for_sync()
        opt_mine, opt_back = policy.optimizer.state_dict()["state"], again.optimizer.state_dict()["state"]
        reloaded = mine.keys() == back.keys() and all(torch.equal(v, back[k]) for k, v in mine.items()) \
            and opt_mine.keys() == opt_back.keys() and all(
                torch.equal(t, opt_back[i][n]) for i, s in opt_mine.items() for n, t in s.items())
        torch.save({"metrics": metrics, "reloaded": reloaded, "low_gathered": low_gathered, "held": list(policy.model.transformer.held),
                    "trained": sorted(policy.expert_index)}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


EVAL = ("run.eval_every=1", "prompts.test_fraction=0.5")  # rank 0 evaluates: it holds both experts


@pytest.mark.parametrize(("lora", "world", "extra"), [(4, 2, ()), (0, 2, ()), (4, 3, ()), (4, 2, EVAL)],
                         ids=["lora", "full", "lora-3-ranks", "lora-rank0-both"])
def test_placed_ranks_take_the_step_one_rank_holding_both_takes(folder: Path, tmp_path: Path, lora: int,
                                                                  world: int, extra: tuple[str, ...]) -> None:
    """Two ranks: rank 0 trains indices 0, 1 on transformer alone, rank 1 indices 2, 3 on
    transformer_2 alone (three: ranks 0 and 1 one index each of transformer, reduced over their
    group); the gradient norm that clips spans both. The whole state rank 0 gathers (weights and
    AdamW moments) equals one policy's training all four indices on both experts, within 1e-6
    relative: the clipping norm is combined from per-expert norms, and with three ranks a
    gradient is summed over two processes instead of accumulated in one (rounding apart)."""
    from digenrl.rl.learner import Learner
    from digenrl.rl.policy import build_policy

    torch.multiprocessing.spawn(_placed_worker, args=(str(folder), str(tmp_path / "store"), str(tmp_path), lora,
                                                      world, extra), nprocs=world)
    from safetensors.torch import load_file

    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    # 3 ranks own indices [0], [1], [2, 3]: ranks 0 and 1 share transformer, whose gradients
    # then sum over their group of two
    held = {2: [["transformer"], ["transformer_2"]], 3: [["transformer"], ["transformer"], ["transformer_2"]]}[world]
    if extra == EVAL:  # rank 0 trains transformer and, with rank 1 (the whole group), transformer_2
        held = [list(BOTH), ["transformer_2"]]
    assert [r["held"] for r in ranks] == [r["trained"] for r in ranks] == held
    assert all(r["reloaded"] for r in ranks)  # each rank took its own expert back from the whole files
    assert ranks[0]["low_gathered"]  # a gather of one expert brings rank 0 that expert, whole, alone
    metrics = ranks[0]["metrics"]
    assert {k: v for k, v in metrics.items() if k.startswith("expert/")} == {
        "expert/t0": 0, "expert/t1": 0, "expert/t2": 1, "expert/t3": 1, "expert/changed": 3,
        **{f"expert/held/r{r}": {("transformer",): 1, ("transformer_2",): 2, BOTH: 3}[tuple(h)]
           for r, h in enumerate(held)}}

    cfg = _cfg(folder, f"model.lora_rank={lora}", *EXTRA, *extra)
    ref = build_policy(cfg, world_size=1)
    assert ref.placement is None and ref.model.transformer.held == BOTH
    learner = Learner(ref, cfg)
    records, cond, rewards = _fragment(folder, cfg)
    learner.train_fragment(records=records, cond=cond, rewards=rewards, gen_version=0, n_trained_total=4,
                           sigma_max=ref.sigma_max)
    want = learner.finish_step()
    assert want["grad_norm"] > 1e-3  # the clip is active
    assert metrics["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6)
    ckpt = tmp_path / "run" / "checkpoint"
    got = load_file(next(ckpt.rglob("policy.safetensors")))
    sd = ref.state_dict_for_sync()
    assert got.keys() == sd.keys() and {k.split(".")[0] for k in sd} == set(BOTH)
    base = build_policy(cfg, world_size=1).state_dict_for_sync()
    for k, v in sd.items():
        torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-9)
    assert all(any(not torch.equal(sd[k], base[k]) for k in sd if k.startswith(e + ".")) for e in BOTH)  # both moved
    opt, got_opt = ref.optimizer_state(), torch.load(next(ckpt.rglob("optimizer.pt")), weights_only=True)
    assert got_opt["param_groups"][0]["params"] == opt["param_groups"][0]["params"]
    assert got_opt["state"].keys() == opt["state"].keys()
    for i, s in opt["state"].items():
        for name, t in s.items():
            torch.testing.assert_close(got_opt["state"][i][name], t, rtol=1e-6, atol=1e-12)
    one = build_policy(cfg, world_size=1)  # the checkpoint resumed by one trainer holding both
    one.load_sync_state(got)
    one.load_optimizer_state(got_opt)
    assert all(torch.equal(v, got[k]) for k, v in one.state_dict_for_sync().items())
    final = tmp_path / "run" / "final"
    assert load_file(final / "policy.safetensors").keys() == sd.keys()
    if lora:  # diffusers' files of both experts, the low one's from rank 1
        assert (final / "pytorch_lora_weights.safetensors").is_file()
        assert (final / "transformer_2" / "pytorch_lora_weights.safetensors").is_file()
    else:
        assert (final / "config.json").is_file() and (final / "transformer_2" / "config.json").is_file()


@pytest.mark.slow
def test_a_placed_run_killed_in_step_three_resumes_to_the_weights_of_an_uninterrupted_run(
        folder: Path, tmp_path: Path) -> None:
    """digenrl launch, two TSP trainer ranks each holding one expert, K = 0, a checkpoint every
    step: the coordinator killed at step 2's first commit, the run resumed from the checkpoint
    rank 0 wrote with rank 1's expert and AdamW state in it. Its final weights equal those of
    the same run left alone, bit for bit (same machine, threads and inputs; each expert's
    gradient comes from one rank, so no reduction order differs)."""
    import signal

    from digenrl.rl.checkpoint import latest_checkpoint
    from tests.conftest import final_weights, launch_run, set_args

    sets = [f'model.path="{folder}"', 'model.family="wan"', f"model.max_text_tokens={MAX_TEXT_TOKENS}",
            *[f"model.{k}={v}" for k, v in SMALL.items()], "train.prompts_per_step=2", "train.group_size=2",
            "runtime.fragments_per_step=1", "sampler.num_steps=4", 'train.timesteps="all"', "run.steps=4",
            "run.checkpoint_every=1", "runtime.staleness=0", "cluster.trainers=2", "model.lora_rank=4"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    r = launch_run("--mode", "digenrl", "--run-dir", str(whole), *set_args(sets))
    assert r.returncode == 0, r.stderr[-3000:]
    r = launch_run("--mode", "digenrl", "--run-dir", str(cut), *set_args(sets), crash="commit:2")
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert latest_checkpoint(cut).version == 2  # type: ignore[union-attr]
    r = launch_run("--resume", str(cut))
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = final_weights(whole), final_weights(cut)
    assert a.keys() == b.keys() and {k.split(".")[0] for k in a} == set(BOTH)
    assert all(torch.equal(a[k], b[k]) for k in a)  # exact: see the docstring
    held = sorted((e["rank"], e["experts"]) for n in ("trainer-0", "trainer-1")
                  for line in (cut / "logs" / f"{n}.log").read_text().splitlines() if '"experts held"' in line
                  for e in [json.loads(line)])
    # each rank, in both launches (a node may join as the other rank after the restart)
    assert held == [(0, ["transformer"])] * 2 + [(1, ["transformer_2"])] * 2


def _sharded_worker(rank: int, folder: str, store: str, out: str, world: int) -> None:
    """One of ``world`` gloo trainer ranks of a placed run with ``model.fsdp = true``: each
    expert sharded over the ranks that hold it; one fragment's step (ranks with fewer passes
    pad with idle passes on their own expert), final/ and a DCP checkpoint, which a second
    sharded placed policy loads back."""
    from digenrl.actors.resume import sharded_vote
    from digenrl.core.plan import owners_for
    from digenrl.rl.checkpoint import DCP_DIR, save_trainer_state, version_dir
    from digenrl.rl.learner import Learner, save_final
    from digenrl.rl.policy import build_policy
    from digenrl.rl.sharding import load_sharded, step_passes
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        cfg = _cfg(Path(folder), "model.lora_rank=4", "model.fsdp=true", *EXTRA)
        policy = build_policy(cfg, world_size=world, rank=rank)
        assert policy.sharded and policy.placement is not None
        learner = Learner(policy, cfg)
        records, cond, rewards = _fragment(Path(folder), cfg)
        owners = owners_for(sorted(records), world, True, 0, 1)
        mine = {t: r for t, r in records.items() if owners[t] == rank}
        learner.train_fragment(records=mine, cond=cond, rewards=rewards, gen_version=0, n_trained_total=4,
                               sigma_max=policy.sigma_max)
        pad = step_passes(sorted(records), world, True, 1)

        def all_reduce(t: torch.Tensor) -> None:
            dist.all_reduce(t)

        stopped, _ = sharded_vote(learner, all_reduce, stop=False, drain=False, pad_to=pad)
        assert not stopped
        metrics = learner.finish_step(pad_to=pad)
        # a version whose step changed transformer_2 only: its shards alone are gathered to rank 0
        whole_now = policy.whole_sync_state(keep=rank == 0)
        low_only = policy.whole_sync_state(keep=rank == 0, experts=("transformer_2",))
        low_gathered = rank != 0 or (low_only.keys() == {k for k in whole_now if k.startswith("transformer_2.")}
                                     and bool(low_only) and all(torch.equal(v, whole_now[k]) for k, v in low_only.items()))
        run = Path(out) / "run"
        save_trainer_state(run, policy, {}, write=rank == 0)
        save_final(policy, run, write=rank == 0)
        dist.barrier()
        again = build_policy(cfg, world_size=world, rank=rank)
        load_sharded(version_dir(run, 1) / DCP_DIR, again)
        mine_sd, back = policy.state_dict_for_sync(), again.state_dict_for_sync()
        reloaded = mine_sd.keys() == back.keys() and all(torch.equal(v, back[k]) for k, v in mine_sd.items())
        meshes = {p.device_mesh.size() for p in policy.params}  # DTensors over the expert's holders
        torch.save({"metrics": metrics, "reloaded": reloaded, "held": list(policy.model.transformer.held),
                    "meshes": meshes, "low_gathered": low_gathered}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_sharded_placed_experts_take_the_step_one_unsharded_rank_holding_both_takes(
        folder: Path, tmp_path: Path) -> None:
    """``model.fsdp = true`` over three ranks: transformer sharded over ranks 0 and 1 (one
    index each), transformer_2 on rank 2 (indices 2, 3; ranks 0 and 1 pad one idle pass
    each on transformer). final/ (rank 0 receives transformer_2 from rank 2) and the DCP
    checkpoint's weights and AdamW moments equal one unsharded policy's training all four
    indices on both experts, within 1e-6 relative (reduce-scattered sums, per-expert norms)."""
    from safetensors.torch import load_file

    from digenrl.rl.learner import Learner
    from digenrl.rl.policy import build_policy
    from digenrl.rl.sharding import whole_state

    world = 3
    torch.multiprocessing.spawn(_sharded_worker, args=(str(folder), str(tmp_path / "store"), str(tmp_path), world),
                                nprocs=world)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    assert [r["held"] for r in ranks] == [["transformer"], ["transformer"], ["transformer_2"]]
    assert [r["meshes"] for r in ranks] == [{2}, {2}, {1}]
    assert all(r["reloaded"] for r in ranks)
    assert ranks[0]["low_gathered"]  # one expert's shards, gathered alone
    metrics = ranks[0]["metrics"]
    assert {k: v for k, v in metrics.items() if k.startswith("expert/")} == {
        "expert/t0": 0, "expert/t1": 0, "expert/t2": 1, "expert/t3": 1, "expert/changed": 3,
        "expert/held/r0": 1, "expert/held/r1": 1, "expert/held/r2": 2}

    cfg = _cfg(folder, "model.lora_rank=4", *EXTRA)
    ref = build_policy(cfg, world_size=1)
    learner = Learner(ref, cfg)
    records, cond, rewards = _fragment(folder, cfg)
    learner.train_fragment(records=records, cond=cond, rewards=rewards, gen_version=0, n_trained_total=4,
                           sigma_max=ref.sigma_max)
    want = learner.finish_step()
    assert metrics["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6)
    sd = ref.state_dict_for_sync()
    final = load_file(tmp_path / "run" / "final" / "policy.safetensors")
    assert final.keys() == sd.keys()
    for k, v in sd.items():
        torch.testing.assert_close(final[k], v, rtol=1e-6, atol=1e-9)
    state = whole_state(next((tmp_path / "run" / "checkpoint").glob("v*")) / "dcp")
    names = [n for n, p in ref.model.transformer.named_parameters() if p.requires_grad]
    assert set(state["model"]) == set(names)  # both experts' LoRA, each from its own ranks' shards
    for i, s in ref.optimizer_state()["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state["optim"]["state"][names[i]][name], s[name], rtol=1e-6, atol=1e-12)
