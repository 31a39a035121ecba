"""The catalogue of hostile but decodable messages (a spoofing, out-of-bounds adversary), in one place.

``bench/faults.py`` (its hostile peer), ``tests/test_fuzz_node.py`` (semantic fuzzing of live
nodes) and ``tests/test_hostile.py`` (each refusal, in process) build their messages here, so
a field added to the protocol is added once: mypy checks every constructor call below
(``pyproject.toml`` lists this file), where a copy of them in the bench went stale twice
(``Commit.discard``, ``Consumed.policy_version``) and hung it. It lives with the tests, outside
the package: a production run uses none of it.

Two parts:

* **Builders**, one per message a peer sends the coordinator or a trainer's data socket: every
  field set to a value an honest peer could send, a few parameters for what the callers vary.
  The data plane's (:func:`chunk`, :func:`commit`) are the tests' shared ones
  (``tests/factories.py``).
  The Hypothesis strategies of ``tests/test_fuzz_node.py`` are ``st.builds`` over them.
* **Attacks**: what the adversary sends, each a builder with the values no honest peer
  sends. :func:`coordinator_attack` and :func:`trainer_attack` are the bench's rounds.
"""

from __future__ import annotations

from digenrl.core.types import Role
from digenrl.transport.protocol import (
    Chunk,
    Commit,
    Consumed,
    Heartbeat,
    Hello,
    JSONDict,
    Message,
    StepDone,
    VersionAnnounce,
)
from tests.factories import chunk as chunk  # re-exported: the catalogue's data-plane builders
from tests.factories import commit as commit

INT64_MAX = (1 << 63) - 1
FAR_STEP = 10**12  # a step no run reaches
BAD_FRAGMENT = 99  # beyond any run's fragments_per_step here

# ----------------------------------------------------------------------------- builders


def hello(node_id: str, role: Role = "trainer", *, incarnation: int = 1, data_endpoint: str | None = None,
          weights_endpoint: str | None = None) -> Hello:
    """A node's Hello; a trainer names loopback placeholders for its sockets, others none."""
    trainer = role == "trainer"
    return Hello(node_id=node_id, role=role, gpu="cpu", incarnation=incarnation, pid=1, host="h",
                 data_endpoint=(("tcp://127.0.0.1:1" if trainer else "") if data_endpoint is None
                                else data_endpoint),
                 weights_endpoint=(("tcp://127.0.0.1:2" if trainer else "") if weights_endpoint is None
                                   else weights_endpoint))


def heartbeat(node_id: str = "trainer-0", *, incarnation: int = 1, seq: int = 0, gpu: JSONDict | None = None,
              stats: JSONDict | None = None) -> Heartbeat:
    return Heartbeat(node_id=node_id, incarnation=incarnation, policy_version=0, state="running", seq=seq,
                     gpu={} if gpu is None else gpu, stats={} if stats is None else stats)


def consumed(task_id: int = 1, step: int = 0, fragment: int = 0, *, rank: int = 0, trained: int = 2,
             policy_version: int = 0, train_seconds: float = 0.1) -> Consumed:
    return Consumed(task_id=task_id, step=step, fragment=fragment, rank=rank, policy_version=policy_version,
                    trained=trained, discarded={}, train_seconds=train_seconds)


def step_done(step: int = 0, version: int = 1, metrics: JSONDict | None = None) -> StepDone:
    return StepDone(step=step, version=version, metrics={} if metrics is None else metrics)


def version_announce(version: int = 1, step: int = 1) -> VersionAnnounce:
    return VersionAnnounce(version=version, step=step, nparts=1, nbytes=1, checksum="x",
                           segments=[], segment_since=[], segment_parts=[], segment_sums=[])


# ----------------------------------------------------------------------------- the attacks


def future_step_done(i: int = 0) -> StepDone:
    """A StepDone for step 1000 + i (20 of them added rows to metrics.jsonl)."""
    return step_done(1000 + i, 1001 + i, {"reward_mean": 99.0})


def overflowing_consumed(i: int = 0) -> Consumed:
    """A Consumed claiming 2**63 - 1 trajectories trained."""
    return consumed(1 + i, trained=INT64_MAX)


def future_announce() -> VersionAnnounce:
    """Version 10**6 (from trainer-0's routing id it killed the coordinator)."""
    return version_announce(10**6, 10**6)


def bad_stats_heartbeat(node_id: str = "trainer-0", seq: int = 0) -> Heartbeat:
    """Heartbeat stats with a string where a number goes (the schema refuses it)."""
    return heartbeat(node_id, seq=seq, stats={"busy_s": "x"})


def hijacking_hello(node_id: str = "trainer-0") -> Hello:
    """A Hello taking a live trainer's id with a far incarnation and a garbage data endpoint."""
    return hello(node_id, incarnation=1 << 40, data_endpoint="tcp://garbage:1", weights_endpoint="")


def out_of_run_commit(task_id: int = 1, node_id: str = "rollout-0") -> Commit:
    """A Commit for fragment 99 (with one fragment per step it finished the step on its own)."""
    return commit(task_id, fragment=BAD_FRAGMENT, node_id=node_id)


def out_of_run_chunk(task_id: int = 1) -> Chunk:
    """A Chunk for step 10**12, beyond the staleness window of any run."""
    return chunk(task_id, step=FAR_STEP)


def coordinator_attack(i: int) -> list[Message]:
    """Round ``i`` of what a peer that never said a valid Hello sends the coordinator."""
    return [future_step_done(i), overflowing_consumed(i), future_announce(), bad_stats_heartbeat(seq=i),
            hijacking_hello(), out_of_run_commit(1 + i)]


def trainer_attack(i: int, node_id: str) -> Message:
    """Message ``i`` a rogue rollout (``node_id``) sends a trainer's data socket: work for slots
    outside the run, chunks and commits in turn."""
    task = 10**9 + i
    return out_of_run_chunk(task) if i % 2 else out_of_run_commit(task, node_id)

