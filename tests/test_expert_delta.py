"""Weight sync of a two-expert (Wan2.2 A14B) folder sends only the experts a step changed.

A real policy on the tiny Wan2.2 folder takes three steps whose trained indices fall on one
expert each (``mix`` window of 2 sliding by 2: indices 0, 1 on ``transformer``, then 2, 3 on
``transformer_2``, then 0, 1 again). Its versions are built as trainer rank 0 builds them,
served from a ROUTER by :func:`serve_weights`, and followed over loopback by real
:class:`WeightFollower` s loading real rollout models; rank 0's egress is read from its
socket's own byte counter.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
import zmq.asyncio

from digenrl.actors.following import WeightFollower
from digenrl.config import ResolvedConfig
from digenrl.rl.experts import split_by_expert
from digenrl.telemetry.trace import SpanRecorder
from digenrl.transport.options import SocketOptions
from digenrl.transport.protocol import VersionAnnounce
from digenrl.transport.sockets import Dealer, Router
from digenrl.transport.weights import WeightStore, build_version, serve_weights
from tests.pipelines import write_pipeline_folder
from tests.test_wan22_experts import _cfg, _fragment

OPTS = SocketOptions(max_frame_bytes=8 << 20, hwm=16)
WAIT = 20.0
HIGH, LOW = "transformer", "transformer_2"
# step 0 trains indices 0, 1 (transformer), step 1 indices 2, 3 (transformer_2), step 2 0, 1
MIX = ('train.timesteps="mix"', "train.window_lo=0", "train.window_size=2", "train.window_hi=4",
       "train.window_shift_every=1", "train.window_stride=2", "run.steps=3", "model.lora_rank=4",
       "train.lr=1e-2", "train.weight_decay=0.1")


def _nbytes(sd: dict[str, torch.Tensor], expert: str | None = None) -> int:
    return sum(t.numel() * t.element_size() for k, t in sd.items() if expert is None or k.startswith(expert + "."))


def _of(sd: dict[str, torch.Tensor], expert: str) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in sd.items() if k.startswith(expert + ".")}


def _adam(policy: Any, expert: str) -> list[dict[str, torch.Tensor]]:
    state = policy.optimizer.state
    return [{n: t.clone() for n, t in state[policy.params[i]].items()} for i in policy.expert_index[expert]
            if policy.params[i] in state]


class _Trained:
    """The policy's three steps: each version's sync state, what each step changed, its optimizer state."""

    def __init__(self, folder: Path) -> None:
        from digenrl.rl.learner import Learner
        from digenrl.rl.policy import build_policy

        self.cfg: ResolvedConfig = _cfg(folder, *MIX)
        self.policy = policy = build_policy(self.cfg, world_size=1)
        learner = Learner(policy, self.cfg)
        records, cond, rewards = _fragment(folder, _cfg(folder, "model.lora_rank=4"))
        self.states = [policy.state_dict_for_sync()]
        self.adam: list[dict[str, list[dict[str, torch.Tensor]]]] = [{HIGH: [], LOW: []}]
        self.changed: list[tuple[str, ...] | None] = []
        self.metrics: list[dict[str, float]] = []
        for step, indices in enumerate(([0, 1], [2, 3], [0, 1])):
            learner.train_fragment(records={t: records[t] for t in indices}, cond=cond, rewards=rewards,
                                   gen_version=step, n_trained_total=2, sigma_max=policy.sigma_max)
            # the all-reduce of one rank (the identity), as trainer ranks reduce: it turns a None
            # gradient into zeros, which AdamW would step
            self.metrics.append(learner.finish_step(lambda flat: None))
            self.changed.append(learner.last_changed)
            self.states.append(policy.state_dict_for_sync())
            self.adam.append({e: _adam(policy, e) for e in (HIGH, LOW)})


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> _Trained:
    return _Trained(write_pipeline_folder("wan22", tmp_path_factory.mktemp("wan22") / "pipe"))


def test_an_expert_no_trained_index_of_the_step_fell_on_keeps_its_weights_and_adam_state_bit_for_bit(
        trained: _Trained) -> None:
    """Step 1 trains transformer_2 only: transformer, which step 0 gave AdamW moments and which
    weight decay would shrink, is left exactly as it was (exact: the same tensors, untouched)."""
    s0, s1, s2, s3 = trained.states
    assert trained.changed == [(HIGH,), (LOW,), (HIGH,)]
    assert [m["expert/changed"] for m in trained.metrics] == [1, 2, 1]
    for before, after, moved, kept in ((s0, s1, HIGH, LOW), (s1, s2, LOW, HIGH), (s2, s3, HIGH, LOW)):
        assert all(torch.equal(v, after[k]) for k, v in _of(before, kept).items())
        assert any(not torch.equal(v, after[k]) for k, v in _of(before, moved).items())
    adam1, adam2 = trained.adam[1][HIGH], trained.adam[2][HIGH]
    assert adam1 and any(float(s["exp_avg"].abs().max()) > 0 for s in adam1)  # momentum that would move it
    assert len(adam1) == len(adam2) and all(
        all(torch.equal(t, b[n]) for n, t in a.items()) for a, b in zip(adam1, adam2, strict=True))
    assert trained.adam[1][LOW] == []  # step 0 never stepped transformer_2: no AdamW state at all


def test_a_zero_gradient_would_have_moved_the_untouched_expert(tmp_path: Path) -> None:
    """The contrast that makes the test above meaningful: the same policy, given zero gradients
    for transformer after a step that moved it, changes it when the step names every expert."""
    from digenrl.rl.policy import build_policy

    policy = build_policy(_cfg(write_pipeline_folder("wan22", tmp_path / "pipe"), *MIX), world_size=1)
    for p in policy.params:
        p.grad = torch.ones_like(p)
    policy.optimizer_step()
    before = _of(policy.state_dict_for_sync(), HIGH)
    for p in policy.params:
        p.grad = torch.zeros_like(p)
    policy.optimizer_step(experts=(LOW,))
    assert all(torch.equal(v, policy.state_dict_for_sync()[k]) for k, v in before.items())
    for p in policy.params:
        p.grad = torch.zeros_like(p)
    policy.optimizer_step(experts=(HIGH, LOW))
    assert any(not torch.equal(v, policy.state_dict_for_sync()[k]) for k, v in before.items())


# ----------------------------------------------------------------------------- over sockets

class _Rollout:
    """A rollout's model and WeightFollower, fetching from rank 0's ROUTER."""

    def __init__(self, name: str, cfg: ResolvedConfig, ctx: zmq.asyncio.Context, rank0_ep: str,
                 control_ep: str) -> None:
        from digenrl.models import build_model

        self.model = build_model(cfg.model, seed=cfg.run.seed)
        self.weights, self.control = Dealer(ctx, options=OPTS), Dealer(ctx, options=OPTS)
        self.weights.connect(rank0_ep)
        self.control.connect(control_ep)
        self.recorder = SpanRecorder(name, "rollout")
        self.loaded: list[set[str]] = []  # the experts each apply loaded
        self.follower = WeightFollower(node_id=name, cfg=cfg, control=self.control, weights=self.weights,
                                       load=self._load, in_thread=self._in_thread, recorder=self.recorder,
                                       log=structlog.get_logger(), unexpected=lambda *a: None)
        self.task = asyncio.ensure_future(self.follower.prefetch_loop())

    def _load(self, sd: dict[str, torch.Tensor]) -> None:
        self.loaded.append({k.split(".")[0] for k in sd})
        self.model.load_sync_state_dict(sd)

    async def _in_thread(self, name: str, fn: Any, *a: Any, **args: Any) -> Any:
        return await asyncio.to_thread(fn, *a)

    async def follow(self, ann: VersionAnnounce) -> None:
        self.follower.on_announce(ann)
        await asyncio.wait_for(self.follower.catch_up(floor=ann.version), WAIT)

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.weights.close()
        self.control.close()


class _Rank0:
    """Trainer rank 0's weights: versions built as TrainerActor._publish builds them, served."""

    def __init__(self, trained: _Trained) -> None:
        self.trained = trained
        self.ctx = zmq.asyncio.Context()
        self.router, self.coordinator = Router(self.ctx, options=OPTS), Router(self.ctx, options=OPTS)
        self.endpoint = self.router.bind("tcp://127.0.0.1:*")
        self.control_ep = self.coordinator.bind("tcp://127.0.0.1:*")
        self.store = WeightStore()
        self.task = asyncio.ensure_future(serve_weights(self.router, self.store))
        self.rollouts: list[_Rollout] = []

    def publish(self, version: int) -> VersionAnnounce:
        changed = () if version == 0 else self.trained.changed[version - 1]
        sync = self.trained.states[version]
        sd = {k: v for k, v in sync.items() if changed is None or k.split(".")[0] in changed}
        before = self.store.get(self.store.newest) if version > 0 else None
        asm = build_version(version, split_by_expert(sd), before)
        self.store.begin(asm)
        return asm.announce(step=version)

    def rollout(self) -> _Rollout:
        self.rollouts.append(_Rollout(f"rollout-{len(self.rollouts)}", self.trained.cfg, self.ctx,
                                      self.endpoint, self.control_ep))
        return self.rollouts[-1]

    def sent(self) -> int:
        return self.router.statistics().bytes_sent

    async def close(self) -> None:
        for r in self.rollouts:
            await r.close()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.router.close()
        self.coordinator.close()
        self.ctx.destroy(linger=0)


@pytest.fixture
async def rank0(trained: _Trained) -> AsyncIterator[_Rank0]:
    r = _Rank0(trained)
    yield r
    await r.close()


def _sample(model: Any, cfg: ResolvedConfig) -> list[torch.Tensor]:
    from digenrl.rl.sampler import rollout, seeded_generators

    cond = model.encode_prompts(["a red fox", "a blue bird"])
    with torch.no_grad():
        return [r.x_next for r in rollout(model, cond, generator=seeded_generators([5, 6]), sampler_cfg=cfg.sampler)]


async def test_a_version_carries_only_the_expert_its_step_changed_and_a_rollout_fetches_only_that(
        trained: _Trained, rank0: _Rank0) -> None:
    """(a) Each version sends rank 0's egress only the expert its step changed; (b) the rollout
    then samples with the kept expert's earlier weights and the changed one's new ones, equal to
    a model given the whole version (exact: same process, same values loaded); (c) a rollout
    joining at the last version receives both experts."""
    from digenrl.models import build_model

    v0 = rank0.publish(0)
    assert v0.nparts == 0 and v0.segments == []  # every node loads version 0 itself
    a = rank0.rollout()
    full = trained.states[3]
    sent_by_version: list[int] = []
    for version in (1, 2, 3):
        ann = rank0.publish(version)
        sent = rank0.sent()
        await a.follow(ann)
        sent_by_version.append(rank0.sent() - sent)
        assert a.follower.version == version  # marked at the new version, whatever it fetched
        changed = trained.changed[version - 1]
        assert changed is not None and a.loaded[-1] == set(changed)  # the apply loads only it
        assert [g for g, s in zip(ann.segments, ann.segment_since, strict=True) if s == version] == list(changed)
    assert rank0.store.get(3) is not None and [(g.name, g.since) for g in rank0.store.get(3).segments] == [
        (HIGH, 3), (LOW, 2)]
    high, low = _nbytes(full, HIGH), _nbytes(full, LOW)
    # each fetch moved one expert's bytes (plus frame headers), never the whole set
    for got, expert_bytes in zip(sent_by_version, (high, low, high), strict=True):
        assert expert_bytes <= got <= expert_bytes + 4096 < _nbytes(full)
    assert a.follower.fetcher.reused_parts >= 1  # v3 took transformer_2 from v2, not the wire

    whole = build_model(trained.cfg.model, seed=trained.cfg.run.seed)
    whole.load_sync_state_dict(dict(full))  # both experts in full
    mine = a.model.sync_state_dict()
    assert mine.keys() == full.keys() and all(torch.equal(mine[k], full[k].to(mine[k].dtype)) for k in full)
    assert all(torch.equal(mine[k], v.to(mine[k].dtype)) for k, v in _of(trained.states[2], LOW).items())
    got, want = _sample(a.model, trained.cfg), _sample(whole, trained.cfg)
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))

    late = rank0.rollout()
    sent = rank0.sent()
    ann3 = await asyncio.to_thread(lambda: rank0.store.get(3).announce(step=3))  # type: ignore[union-attr]
    await late.follow(ann3)
    assert late.loaded == [{HIGH, LOW}]
    assert _nbytes(full) <= rank0.sent() - sent <= _nbytes(full) + 8192
    assert all(torch.equal(x, y) for x, y in zip(_sample(late.model, trained.cfg), want, strict=True))


@pytest.mark.slow
def test_a_launched_run_publishes_each_expert_when_its_step_changes_it_and_rollouts_relay_the_rest(
        tmp_path: Path) -> None:
    """``digenrl launch``, two trainer ranks, two rollouts chained by the relay (fanout 1): rank
    0 announces each version with the experts its step changed new and the other kept from
    before, every rollout takes the kept one from the version it holds (the second one also
    through the first), holds the final version, and no trajectory is staler than K."""
    import json

    from tests.conftest import launch_run, set_args
    from tests.pipelines import MAX_TEXT_TOKENS, SMALL

    folder = write_pipeline_folder("wan22", tmp_path / "pipe")
    sets = [f'model.path="{folder}"', 'model.family="wan"', f"model.max_text_tokens={MAX_TEXT_TOKENS}",
            *[f"model.{k}={v}" for k, v in SMALL.items()], "train.prompts_per_step=2", "train.group_size=2",
            "runtime.fragments_per_step=1", "sampler.num_steps=4", *MIX[:-2], "cluster.trainers=2",
            "cluster.rollouts=2", "runtime.weights_fanout=1"]
    run = tmp_path / "run"
    r = launch_run("--mode", "digenrl", "--run-dir", str(run), *set_args(sets))
    assert r.returncode == 0, r.stderr[-3000:]
    published = {d["version"]: d["segments"] for line in (run / "logs" / "trainer-0.log").read_text().splitlines()
                 if '"weights published"' in line for d in [json.loads(line)]}
    assert published == {0: {}, 1: {HIGH: 1}, 2: {HIGH: 1, LOW: 2}, 3: {HIGH: 3, LOW: 2}}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["expert/changed"] for r in rows] == [1, 2, 1] and rows[-1]["rejected_stale"] == 0
    summary = json.loads((run / "summary.json").read_text())
    weights = summary["weights"]
    assert weights["held_final"] == ["rollout-0", "rollout-1"] and weights["final_version"] == 3
    for node in ("rollout-0", "rollout-1"):
        spans = [json.loads(line) for line in (run / "trace" / f"{node}.jsonl").read_text().splitlines()
                 if '"weight_' in line and "fetch" in line]
        reused = {s["args"]["version"]: s["args"]["reused_parts"] for s in spans if "reused_parts" in s.get("args", {})}
        assert reused and max(reused) == 3, (node, reused)
        # each fetch took from the version fetched before it every expert that version carried
        # alike (one part each here: LoRA); a rollout busy generating may skip a version
        held: dict[str, int] = {}
        for v in sorted(reused):
            assert reused[v] == sum(1 for e, since in published[v].items() if held.get(e) == since), (node, reused)
            held = published[v]
