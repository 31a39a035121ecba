"""The coordinator's identity gate: which node a control message comes from, and whether it may say it.

A node's id is bound at Hello to its ZeroMQ routing id (the node sets it to its id; the
ROUTER refuses a second connection with a live routing id, handover is off), to its
incarnation and, under CurveZMQ, to the name of the key its connection was admitted with
(``user``, ZeroMQ's User-Id). :meth:`IdentityGate.check` names why a message is dropped
unseen (counted in summary.json ``refused``, docs/metrics.md), or returns None.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from digenrl.transport.protocol import (
    Commit,
    Consumed,
    Heartbeat,
    Hello,
    Samples,
    StepDone,
    TagOffer,
    VersionAnnounce,
)
from digenrl.transport.security import CLIENT_KEY, node_security


class IdentityGate:
    """The bindings of node ids to routing ids, incarnations and key names, and the rules.

    ``control``: the coordinator's ROUTER, whose context's ZAP allow-list names the keys
    that belong to one node each.
    """

    def __init__(self, control: Any) -> None:
        self.control = control
        self.peer_ids: dict[bytes, str] = {}    # routing id -> node id, bound at Hello
        self.bound: dict[str, int] = {}         # node id -> incarnation of its Hello
        self.keys: dict[str, str | None] = {}   # node id -> its CURVE key's name

    def check(self, peer: bytes, msg: Any, user: str | None, *,
              nodes: Mapping[str, Mapping[str, Any]], steps: int, version: int) -> str | None:
        """Why ``msg`` from ``peer`` is dropped unseen, or None. A key named after a node id
        speaks only as that node and that node only with it, the shared ``client`` key as
        any other id, and a restart (a newer incarnation) must come with the key the id was
        first bound to. Every later message must come from a bound peer with that key, claim
        only that id and incarnation, and be a message its role sends (``nodes``: node id ->
        its ``role`` and ``rank``; reports from trainer ranks, StepDone, VersionAnnounce and
        Samples from rank 0 only, within the run's ``steps``; ``version``: the ledger's)."""
        if isinstance(msg, Hello):
            if peer != msg.node_id.encode():
                return "hello_id_not_routing_id"
            if user is not None:
                if user != msg.node_id and user in self._own_keys():
                    return "key_of_another_node"  # rollout-3's key claiming rollout-4
                if msg.node_id in self._own_keys() and user != msg.node_id:
                    return "id_has_its_own_key"  # the shared key claiming an id with its own
            if msg.node_id in self.keys and self.keys[msg.node_id] != user:
                return "hello_from_another_key"
            bound = self.bound.get(msg.node_id)
            if bound is not None and msg.incarnation <= bound:
                return "hello_of_a_live_incarnation"  # a restart has a newer incarnation
            return None
        node_id = self.peer_ids.get(peer)
        if node_id is None:
            return "before_hello"
        if user != self.keys.get(node_id):
            return "key_not_bound_to_id"
        claimed = getattr(msg, "node_id", None)
        if claimed is not None and claimed != node_id:
            return "claims_another_id"
        if isinstance(msg, Heartbeat) and msg.incarnation != self.bound.get(node_id):
            return "another_incarnation"
        node = nodes.get(node_id, {})
        if isinstance(msg, Consumed | StepDone | VersionAnnounce | TagOffer | Samples):
            if node.get("role") != "trainer":
                return "not_a_trainer"
            if isinstance(msg, Consumed | TagOffer) and msg.rank != node.get("rank"):
                return "not_its_rank"
            if isinstance(msg, StepDone | VersionAnnounce | Samples) and node.get("rank") != 0:
                return "not_rank_0"
        if isinstance(msg, StepDone) and not (msg.step == version < steps and msg.version == msg.step + 1):
            return "step_outside_the_run"
        if isinstance(msg, VersionAnnounce) and not msg.version <= steps:
            return "version_outside_the_run"
        if isinstance(msg, Samples) and not msg.step <= steps:
            return "step_outside_the_run"
        if isinstance(msg, Consumed | Commit) and not msg.step < steps:
            return "step_outside_the_run"
        return None

    def admitted(self, msg: Hello, user: str | None) -> None:
        """A Hello passed the gate: its id's key from now on, kept across :meth:`unbind_all`
        (a restart has the same key)."""
        self.keys[msg.node_id] = user

    def bind(self, peer: bytes, msg: Hello) -> None:
        """``peer`` speaks as ``msg``'s node id and incarnation from now on."""
        self.peer_ids[peer] = msg.node_id
        self.bound[msg.node_id] = msg.incarnation

    def unbind_all(self) -> None:
        """Forget every routing id and incarnation (the keys stay): every node restarts and
        binds anew, and late messages of the old processes are dropped."""
        self.peer_ids.clear()
        self.bound.clear()

    def _own_keys(self) -> frozenset[str]:
        """Client key names of the control socket's ZAP allow-list other than the shared one."""
        return node_security(self.control.zmq_socket.context).key_names() - {CLIENT_KEY}
