"""model.offload = "optimizer": the float32 masters and AdamW state on the host, the parameters
and gradients on the device (digenrl/rl/offload.py).

On this CPU-only machine "host" and "device" are the same memory, so what these tests show is
the structure (the optimizer updates separate float32 tensors, the device side keeps no float32
master) and that the step is the same step: the offloaded policy runs the trainer's own path
(Learner.train_fragment, Learner.finish_step, Policy.optimizer_step) on a tiny real SD3
pipeline folder and ends with the weights and optimizer state of the policy without offload.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from digenrl.config import ConfigError, load_config
from tests.pipelines import MAX_TEXT_TOKENS, write_pipeline_folder

PROMPTS = ["a red circle", "a red circle", "a blue square", "a blue square"]
REWARDS = [[0.1, 0.7, 0.4, 0.2], [0.9, 0.3, 0.5, 0.6], [0.2, 0.8, 0.6, 0.1]]


@pytest.fixture(scope="module")
def sd3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_pipeline_folder("sd3", tmp_path_factory.mktemp("offload") / "sd3")


def _cfg(folder: Path, offload: str, *sets: str):
    return load_config(None, [f'model.path="{folder}"', 'model.family="sd3"', f'model.offload="{offload}"',
                              f"model.max_text_tokens={MAX_TEXT_TOKENS}", "model.height=32", "model.width=32",
                              "sampler.num_steps=2", 'train.timesteps="all"', "train.group_size=2",
                              "train.lr=1e-3", "train.max_grad_norm=0.5", *sets])


def _policy(cfg, world_size: int = 1):
    from digenrl.rl.policy import build_policy

    torch.manual_seed(0)
    return build_policy(cfg, world_size=world_size)


@pytest.fixture
def one_rank_group(tmp_path: Path):
    """A gloo group of one: a policy built "as a rank of 2" is sharded (FSDP2) over it."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _train(cfg, policy, steps: range) -> list[dict[str, float]]:
    """``steps`` optimizer steps through the trainer's Learner, each on a fresh rollout of the
    policy (seeded by the step)."""
    from digenrl.rl.learner import Learner
    from digenrl.rl.sampler import rollout, seeded_generators

    learner, out = Learner(policy, cfg), []
    for step in steps:
        cond = policy.model.encode_prompts(PROMPTS)
        with torch.no_grad():
            records = {r.index: r for r in rollout(policy.model, cond, sampler_cfg=cfg.sampler,
                                                   generator=seeded_generators([10 * step + i for i in range(4)]))}
        learner.train_fragment(records=records, cond=cond, rewards=REWARDS[step], gen_version=policy.version,
                               n_trained_total=len(records), sigma_max=policy.sigma_max)
        out.append(learner.finish_step())
    return out


def _assert_same_state(a, b) -> None:
    """Model tensors, masters (the sync state) and AdamW state: equal bit for bit (sharded:
    gathered whole; the optimizer state by parameter name)."""
    from digenrl.rl.sharding import full

    ma, mb = a.model.transformer.state_dict(), b.model.transformer.state_dict()
    assert ma.keys() == mb.keys()
    assert all(torch.equal(full(ma[k]), full(mb[k])) for k in ma)
    sa, sb = a.state_dict_for_sync(), b.state_dict_for_sync()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    oa, ob = (_by_name(p) for p in (a, b))
    assert oa.keys() == ob.keys() and oa
    assert all(torch.equal(torch.as_tensor(oa[n][k]), torch.as_tensor(ob[n][k])) for n in oa for k in oa[n])


def _by_name(policy) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW's state by parameter name, whole (sharded: gathered)."""
    state = policy.optimizer_state()["state"]
    if policy.sharded:
        return dict(state)
    names = {id(p): n for n, p in policy.model.transformer.named_parameters()}
    return {names[id(p)]: state[i] for i, p in enumerate(policy.model_params) if i in state}


CASES = {"full-float32": ["model.lora_rank=0"],
         "lora-bfloat16": ["model.lora_rank=2", 'model.dtype="bfloat16"']}


@pytest.mark.parametrize("case", CASES)
def test_optimizer_offload_gives_the_update_of_a_run_without_it(sd3_folder: Path, case: str) -> None:
    """Two steps (the second reads AdamW's moments) with the optimizer on the host equal two
    without, bit for bit. Exact on purpose: same process, same inputs, and on a CPU the
    offloaded step runs the same kernels on the same float32 values (the device gradients are
    the same; clipping runs on them before the copy; the host AdamW is the CPU AdamW the
    policy without offload runs). On a GPU the two AdamW kernels differ (CUDA foreach against
    the CPU loop) and the weights agree to float32 rounding, not bit for bit."""
    base_cfg, off_cfg = _cfg(sd3_folder, "none", *CASES[case]), _cfg(sd3_folder, "optimizer", *CASES[case])
    base, off = _policy(base_cfg), _policy(off_cfg)
    assert off.host is not None and base.host is None
    before = {k: v.clone() for k, v in off.model.transformer.state_dict().items()}
    mb, mo = _train(base_cfg, base, range(2)), _train(off_cfg, off, range(2))
    assert [m["grad_norm"] for m in mb] == [m["grad_norm"] for m in mo]
    assert all(m["grad_norm"] > 0 for m in mo)
    _assert_same_state(base, off)
    after = off.model.transformer.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the steps moved the weights
    # where each side lives: the optimizer updates host float32 masters, not the device tensors
    ids = {id(p) for p in off.params} | {id(p) for p in off.model_params}
    assert all(id(m) not in ids and m.dtype == torch.float32 and m.device.type == "cpu" for m in off.masters)
    state = off.optimizer.state[off.masters[0]]
    assert state["exp_avg"].device.type == "cpu" and state["exp_avg"].dtype == torch.float32
    assert all(p.grad is None for p in (*off.params, *off.model_params))  # dropped after the step
    if off.has_masters:
        # the device keeps no float32 master: the gradient's leaf holds one broadcast scalar
        assert all(p.untyped_storage().nbytes() == 4 for p in off.params)
        assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(off.model_params, off.masters, strict=True))
    else:
        assert off.params == off.model_params  # float32 model: its own tensors take the gradients
        assert all(torch.equal(p, m) for p, m in zip(off.model_params, off.masters, strict=True))


def test_the_ema_of_an_offloaded_policy_is_the_ema_without_offload(sd3_folder: Path) -> None:
    """train.ema_decay averages what the optimizer updates (the host masters where offloaded):
    after two steps the EMA equals the one kept without offload, bit for bit (same process and
    inputs), and evaluating under it puts the trained weights back exactly."""
    from digenrl.rl.ema import ema_weights

    sets = ["model.lora_rank=2", 'model.dtype="bfloat16"', "train.ema_decay=0.5"]
    base_cfg, off_cfg = _cfg(sd3_folder, "none", *sets), _cfg(sd3_folder, "optimizer", *sets)
    base, off = _policy(base_cfg), _policy(off_cfg)
    _train(base_cfg, base, range(2))
    _train(off_cfg, off, range(2))
    assert base.ema is not None and off.ema is not None
    a, b = base.ema.state_dict(), off.ema.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    trained = off.state_dict_for_sync()
    assert any(not torch.equal(trained[k], b[k]) for k in b)  # the average is not the weights
    with ema_weights(off):
        held = off.state_dict_for_sync()
        assert all(torch.equal(held[k], b[k].to(held[k].dtype)) for k in b)
    after = off.state_dict_for_sync()
    assert all(torch.equal(after[k], trained[k]) for k in trained)
    _assert_same_state(base, off)


@pytest.mark.parametrize("case", CASES)
def test_an_offloaded_optimizer_checkpoint_resumes_bit_identically(sd3_folder: Path, tmp_path: Path,
                                                                   case: str) -> None:
    """A checkpoint of an offloaded policy after step 1, loaded into a fresh offloaded policy,
    continues exactly as the policy that wrote it (exact: same process, same inputs, same
    kernels). The optimizer file has the layout of one without offload: a checkpoint written
    without offload resumes with it, and the other way round."""
    from digenrl.rl.checkpoint import (
        commit_checkpoint,
        latest_checkpoint,
        load_trainer_state,
        save_trainer_state,
    )

    cfg, plain_cfg = _cfg(sd3_folder, "optimizer", *CASES[case]), _cfg(sd3_folder, "none", *CASES[case])
    src = _policy(cfg)
    _train(cfg, src, range(1))
    save_trainer_state(tmp_path / "a", src, {})
    commit_checkpoint(tmp_path / "a", 1, {"scheduler": {}})
    rng = torch.get_rng_state()
    resumed, plain = _policy(cfg), _policy(plain_cfg)
    for dst in (resumed, plain):
        torch.set_rng_state(rng)
        load_trainer_state(latest_checkpoint(tmp_path / "a"), dst)
        assert dst.version == 1
    _assert_same_state(src, resumed)
    _assert_same_state(src, plain)
    for p in (src, resumed, plain):
        _train(cfg, p, range(1, 3))
    _assert_same_state(src, resumed)
    _assert_same_state(src, plain)


@pytest.mark.parametrize("case", CASES)
def test_sharded_with_the_optimizer_offloaded_gives_the_update_of_sharded_without(
        sd3_folder: Path, one_rank_group: None, case: str) -> None:
    """FSDP2 with model.offload = "optimizer": the float32 shards (the masters) and their
    gradients stay on the device, AdamW's state goes to the host; two steps equal two without
    offload bit for bit (same process and inputs; on a CPU the same AdamW kernels run on the
    same float32 values, plain tensors here, DTensors there)."""
    sets = [*CASES[case], "model.fsdp=true"]
    base_cfg, off_cfg = _cfg(sd3_folder, "none", *sets), _cfg(sd3_folder, "optimizer", *sets)
    base, off = _policy(base_cfg, world_size=2), _policy(off_cfg, world_size=2)  # as a rank of 2
    assert base.sharded and off.sharded and off.host is not None
    mb, mo = _train(base_cfg, base, range(2)), _train(off_cfg, off, range(2))
    assert [m["grad_norm"] for m in mb] == [m["grad_norm"] for m in mo] and mo[0]["grad_norm"] > 0
    _assert_same_state(base, off)
    assert all(m.device.type == "cpu" and id(m) not in {id(p) for p in off.model_params} for m in off.masters)


def test_a_sharded_offloaded_checkpoint_resumes_bit_identically_in_either_mode(
        sd3_folder: Path, one_rank_group: None, tmp_path: Path) -> None:
    """A sharded checkpoint (torch.distributed.checkpoint) of a policy with the optimizer
    offloaded, after one step, loaded into a fresh sharded policy with it, a sharded one
    without it and a single unsharded trainer with it: each holds the writer's weights and
    AdamW state exactly, and the sharded ones continue exactly as the writer (exact: same
    process, same inputs, the same kernels; an unsharded trainer computes its passes another
    way, tests/test_fsdp.py). And a sharded checkpoint written without offload resumes with it."""
    from digenrl.rl.checkpoint import (
        commit_checkpoint,
        latest_checkpoint,
        load_trainer_state,
        save_trainer_state,
    )

    sets = ["model.lora_rank=0", "model.fsdp=true"]
    cfg, plain_cfg = _cfg(sd3_folder, "optimizer", *sets), _cfg(sd3_folder, "none", *sets)
    for writer_cfg in (cfg, plain_cfg):
        src = _policy(writer_cfg, world_size=2)
        _train(writer_cfg, src, range(1))
        run = tmp_path / ("off" if writer_cfg is cfg else "plain")
        save_trainer_state(run, src, {})
        commit_checkpoint(run, 1, {"scheduler": {}})
        assert latest_checkpoint(run).trainer["layout"] == "dcp"
        readers = [_policy(cfg, world_size=2)]
        if writer_cfg is cfg:
            readers += [_policy(plain_cfg, world_size=2), _policy(_cfg(sd3_folder, "optimizer", "model.lora_rank=0"))]
        for dst in readers:
            load_trainer_state(latest_checkpoint(run), dst)
            assert dst.version == 1
            _assert_same_state(src, dst)
        sharded = [p for p in readers if p.sharded]
        for p in (src, *sharded):
            _train(cfg, p, range(1, 3))
        for dst in sharded:
            _assert_same_state(src, dst)


def test_a_single_trainers_checkpoint_loads_into_a_sharded_policy_with_the_optimizer_offloaded(
        sd3_folder: Path, one_rank_group: None, tmp_path: Path) -> None:
    """A whole checkpoint (one unsharded trainer: optimizer state by parameter index) into a
    sharded policy with the optimizer offloaded: the same weights and AdamW state exactly, and
    the same next steps to within 1e-6 (sharded passes sum in another order than unsharded
    ones, tests/test_fsdp.py)."""
    from digenrl.rl.checkpoint import (
        commit_checkpoint,
        latest_checkpoint,
        load_trainer_state,
        save_trainer_state,
    )

    src_cfg = _cfg(sd3_folder, "none", "model.lora_rank=0")
    src = _policy(src_cfg)
    _train(src_cfg, src, range(1))
    save_trainer_state(tmp_path, src, {})
    commit_checkpoint(tmp_path, 1, {"scheduler": {}})
    dst = _policy(_cfg(sd3_folder, "optimizer", "model.lora_rank=0", "model.fsdp=true"), world_size=2)
    load_trainer_state(latest_checkpoint(tmp_path), dst)
    _assert_same_state(src, dst)
    for p in (src, dst):
        _train(src_cfg, p, range(1, 3))
    a, b = src.state_dict_for_sync(), dst.state_dict_for_sync()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)


def test_offload_modes_that_do_not_fit_the_sharding_are_one_line_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"^model.offload = 'params' with model.fsdp = false: [^\n]*$"):
        load_config(None, ['model.offload="params"'])
    with pytest.raises(ConfigError, match=r"model\.offload"):
        load_config(None, ['model.offload="everything"'])


@pytest.mark.slow
def test_a_launched_offloaded_run_killed_and_resumed_ends_where_a_plain_run_ends(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """``digenrl launch`` (disagg-sync) with model.offload = "optimizer", SIGKILLed in step 3 and
    resumed from its checkpoint, ends with the final weights of the uninterrupted run without
    offload (tests/test_resume.py's, shared), bit for bit: same machine and thread count, the
    same arithmetic (see the first test here), and the checkpoint restores the host masters and
    AdamW state exactly."""
    from tests.conftest import final_weights
    from tests.test_resume import SETS, _interrupt_and_resume, whole_run

    whole = whole_run(tmp_path_factory, "disagg-sync")
    cut, _ = _interrupt_and_resume(tmp_path, "disagg-sync", "commit:2", versions=(2,),
                                   sets=[*SETS, 'model.offload="optimizer"'])
    a, b = final_weights(whole), final_weights(cut)
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_two_unsharded_ranks_with_the_optimizer_offloaded_train_the_update_of_two_without(
        tmp_path: Path) -> None:
    """Two colocated trainer ranks (unsharded: the step's gradients are summed over them in one
    all-reduce) in bf16, where the device side of an offloaded policy keeps only float32
    gradient leaves: the final weights equal a run without offload bit for bit (same machine,
    thread count and inputs, the same kernels on the same values)."""
    from digenrl.config import resolve_mode
    from digenrl.launch import launch, make_run_dir
    from tests.conftest import SMALL, final_weights

    weights = {}
    for offload in ("none", "optimizer"):
        cfg = resolve_mode(load_config(None, [*SMALL, "cluster.trainers=2", 'model.dtype="bfloat16"',
                                              "run.steps=2", f'model.offload="{offload}"']), "colocated")
        run_dir = make_run_dir(cfg, str(tmp_path / offload))
        assert launch(cfg, run_dir)["accounting"]["in_flight"] == 0
        weights[offload] = final_weights(run_dir)
    a, b = weights["none"], weights["optimizer"]
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_two_sharded_ranks_with_the_optimizer_offloaded_killed_and_resumed_end_where_a_plain_run_ends(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two colocated FSDP2 ranks with the optimizer offloaded, SIGKILLed in step 3 and resumed
    from their DCP checkpoint (each rank's host moments written and read as its shards), end
    bit for bit where the uninterrupted sharded run without offload ends (tests/test_fsdp.py's,
    shared): same machine and thread count, and AdamW on a rank's host shard is the
    elementwise step it takes on the device shard."""
    from tests.conftest import final_weights
    from tests.test_fsdp import SHARDED_RESUME_SETS, sharded_whole_run
    from tests.test_resume import _interrupt_and_resume

    whole = sharded_whole_run(tmp_path_factory)
    cut, _ = _interrupt_and_resume(tmp_path, "colocated", "generate:2", versions=(2,),
                                   sets=[*SHARDED_RESUME_SETS, 'model.offload="optimizer"'],
                                   killed="exited with codes [-9, -9]")
    a, b = final_weights(whole), final_weights(cut)
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a)
