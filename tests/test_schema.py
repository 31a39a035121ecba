"""Typed validation at the protocol boundary: well-typed messages with hostile values are
refused by decode (ProtocolError, reason "invalid"), honest ones pass untouched."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from digenrl.transport import schema
from digenrl.transport.protocol import (
    Chunk,
    Commit,
    Consumed,
    Heartbeat,
    ProtocolError,
    StepDone,
    TagOffer,
    decode,
    encode,
    message_types,
)
from tests.factories import chunk, clean_sample, commit

LIMIT = 1 << 24


def _heartbeat(**kw: Any) -> Heartbeat:
    args: dict[str, Any] = dict(node_id="rollout-0", incarnation=1, policy_version=0, state="running",
                                seq=1, gpu={"available": False, "reason": "no NVML", "gpus": []},
                                stats={"busy_s": 1.0, "wall_s": 2.0, "bad_frames": 0})
    return Heartbeat(**{**args, **kw})


def _chunk(**kw: Any) -> Chunk:
    return chunk(**{"t_index": 2, "x_t": torch.zeros(4, 2, 3), **kw})


def _commit(**kw: Any) -> Commit:
    return commit(**{"prompt_ids": [3, 4], "n": 4, "reward_terms": {"jpeg": [1.0] * 4},
                     "images": torch.zeros(4, 3, 8, 8, dtype=torch.uint8), **kw})


def _roundtrip(msg: Any) -> Any:
    return decode(encode(msg), max_frame_bytes=LIMIT)


HONEST = [
    _heartbeat(), _heartbeat(gpu={"available": True, "reason": "", "gpus": [
        {"index": 0, "name": "H100", "mem_free_mb": 1.0, "power_w": None, "temp_c": 40.0}]}),
    _chunk(), clean_sample(), _commit(), _commit(rewards=[math.nan] * 4),  # a reward function may return NaN
    Consumed(task_id=3, step=1, fragment=0, rank=0, policy_version=0, trained=3, discarded={"zero_advantage": 1},
             train_seconds=0.2),
    StepDone(step=0, version=1, metrics={"reward_mean": 0.5, "grad_norm": math.nan, "trained": 16}),
    TagOffer(node_id="trainer-0", rank=0, free_mb=-1.0),
]


@pytest.mark.parametrize("msg", HONEST, ids=lambda m: type(m).__name__)
def test_honest_messages_pass_the_schema(msg: Any) -> None:
    assert type(_roundtrip(msg)) is type(msg)


HOSTILE = [
    # regression: a Heartbeat whose stats.busy_s is a string killed the coordinator
    ("stats value a string", _heartbeat(stats={"busy_s": "x"}), "stats"),
    ("stats nested", _heartbeat(stats={"busy_s": {"a": 1}}), "stats"),
    ("stats too many keys", _heartbeat(stats={f"k{i}": 1 for i in range(1000)}), "stats"),
    ("gpu garbage", _heartbeat(gpu={"gpus": [[1, 2]]}), "gpu"),
    ("negative incarnation", _heartbeat(incarnation=-5), "incarnation"),
    ("node id empty", _heartbeat(node_id=""), "node_id"),
    ("node id with control characters", _heartbeat(node_id="rollout-0\n{\"x\":1}"), "node_id"),
    ("step 10**12 is fine for the schema, a version of -1 is not", _chunk(policy_version=-1), "policy_version"),
    ("sigma above 1", _chunk(sigma=7.0), "sigma"),
    ("sigma NaN", _chunk(sigma=math.nan), "sigma"),
    ("x_next of another shape", _chunk(x_next=torch.zeros(4, 2, 2)), "x_t"),
    ("log_prob of another length", _chunk(log_prob=torch.zeros(5)), "log_prob"),
    ("integer latents", _chunk(x_t=torch.zeros(4, 2, 3, dtype=torch.int32),
                               x_next=torch.zeros(4, 2, 3, dtype=torch.int32)), "x_t"),
    ("clean sample of a negative version", clean_sample(policy_version=-1), "policy_version"),
    ("clean sample fragment past 2**20", clean_sample(fragment=1 << 20), "fragment"),
    ("clean sample of integer latents", clean_sample(x0=torch.zeros(4, 2, 3, dtype=torch.int64)), "x0"),
    ("clean sample without a batch dimension", clean_sample(x0=torch.zeros(5)), "x0"),
    ("consumed of a negative version", Consumed(task_id=1, step=0, fragment=0, rank=0, policy_version=-2,
                                                trained=1, discarded={}, train_seconds=0.1), "policy_version"),
    ("gen_seconds inf", _commit(gen_seconds=math.inf), "gen_seconds"),
    ("rewards not whole groups", _commit(rewards=[0.5] * 3), "rewards"),
    ("reward terms of strings", _commit(reward_terms={"jpeg": ["a"]}), "reward_terms"),
    ("images float", _commit(images=torch.zeros(2, 2)), "images"),
    # regression: a spoofed Consumed with trained = 2**63-1
    ("trained 2**63-1", Consumed(task_id=1, step=0, fragment=0, rank=0, policy_version=0, trained=2**63 - 1, discarded={},
                                 train_seconds=0.1), "trained"),
    ("discarded negative", Consumed(task_id=1, step=0, fragment=0, rank=0, policy_version=0, trained=1,
                                    discarded={"stale": -3}, train_seconds=0.1), "discarded"),
    ("metrics of strings", StepDone(step=0, version=1, metrics={"reward_mean": "99"}), "metrics"),
    ("free_mb NaN", TagOffer(node_id="trainer-0", rank=0, free_mb=math.nan), "free_mb"),
]


@pytest.mark.parametrize(("msg", "field"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_a_well_typed_message_with_a_hostile_value_is_refused_naming_the_field(msg: Any, field: str) -> None:
    with pytest.raises(ProtocolError, match=field) as e:
        _roundtrip(msg)
    assert e.value.reason == "invalid"


def test_every_message_type_has_rules_for_its_non_tensor_fields() -> None:
    across = {"chunk": {"sigma", "sigma_next"}}  # checked together in schema.WHOLE
    for tag, cls in message_types().items():
        # tensors and bools carry no range; Literals ("literal:a|b") are closed sets the codec checks
        fields = {n for n, k in cls.KINDS.items()
                  if k not in ("tensor", "tensors", "bool") and not k.startswith("literal:")}
        unruled = fields - set(schema.RULES.get(tag, {})) - across.get(tag, set())
        assert unruled == set(), (tag, unruled)
