"""The wire protocol: every message that travels between DigenRL nodes.

Messages are frozen, keyword-only dataclasses registered once with the codec
(:mod:`digenrl.transport.codec`, which documents the frame layout). Fields are ints
(64-bit), floats, str, ``Literal`` sets of strings (checked on decode: a role or state
outside the set is a ProtocolError), bool, bytes, lists of those, msgpack-able dicts,
``torch.Tensor`` and ``dict[str, torch.Tensor]``; tensors travel as raw frames, everything
else in the msgpack header. Compare messages with :func:`messages_equal` (tensors bit for bit).

Who sends what, and which receive loop handles it (a loop counts and logs, rate-limited,
any message it has no branch for: ``Actor.unexpected``)::

    node -> coordinator (control DEALER -> ROUTER)   Hello, Heartbeat, Commit, Consumed,
                                                     VersionAnnounce (rank 0), StepDone (rank 0),
                                                     Samples (rank 0), TagOffer (trainers)
    coordinator -> node (ROUTER -> DEALER)           Welcome, Heartbeat (the answer to every
                                                     beat), Assign, Revoke, VersionAnnounce
                                                     (rollouts that missed one), Shutdown
    coordinator -> rollouts (PUB -> SUB)             VersionAnnounce, Shutdown
    rollout/TAG trainer -> trainer rank (PUSH->PULL) Chunk, Commit
    rollout -> its weights upstream (DEALER->ROUTER) WeightsRequest; answered by WeightsPart or
                                                     WeightsMissing, and by WeightsPending now
                                                     and then while the part is still on its
                                                     way to the upstream. The upstream is trainer
                                                     rank 0 or, relaying, another rollout
                                                     (core/relay.py; coordinator: WeightsRoute)
    coordinator -> rollout (ROUTER -> DEALER)        WeightsRoute (where to fetch from)
    rollout -> coordinator (control)                 WeightsHeld (a version arrived verified)

A node of another protocol version is refused at its first message (the Hello) with a
one-line Shutdown naming both versions (:class:`~digenrl.transport.sockets.Router`).

Typical use::

    frames = encode(Chunk(task_id=..., x_t=x_t_NCHW, ...))
    msg = decode(frames, max_frame_bytes=cfg.transport.max_frame_bytes)  # ProtocolError only
"""

from __future__ import annotations

from typing import Literal

import torch

from digenrl.core.types import Role
from digenrl.transport.codec import (
    DEFAULT_MAX_FRAMES,
    DEFAULT_MAX_HEADER_BYTES,
    DTYPES,
    INT_MAX,
    INT_MIN,
    PROTOCOL_VERSION,
    JSONDict,
    Message,
    decode,
    encode,
    message,
    message_types,
    messages_equal,
    tensor_checksum,
)
from digenrl.transport.errors import ProtocolError, VersionMismatch

__all__ = [
    "DEFAULT_MAX_FRAMES", "DEFAULT_MAX_HEADER_BYTES", "DTYPES", "INT_MAX", "INT_MIN",
    "PROTOCOL_VERSION", "Assign", "Chunk", "CleanSample", "Commit", "Consumed", "Heartbeat", "Hello",
    "JSONDict", "Message", "NodeState", "ProtocolError", "Revoke", "Role", "Samples", "Score", "Scored", "Shutdown",
    "StepDone", "TagOffer", "VersionAnnounce", "VersionMismatch", "WeightsHeld", "WeightsMissing",
    "WeightsPart", "WeightsPending", "WeightsRequest", "WeightsRoute", "Welcome", "decode", "encode",
    "message", "message_types", "messages_equal", "tensor_checksum",
]

NodeState = Literal["running", "stopping"]
"""A node's state in its heartbeats: ``running`` until it was asked to stop (a Shutdown, a
SIGTERM drain, a lost coordinator), ``stopping`` after. The coordinator's answer to a beat
always says ``running``."""

@message("hello")
class Hello(Message):
    """A node introduces itself to the coordinator (first message on the control socket)."""

    node_id: str  # stable name of the node, e.g. "rollout-0"
    role: Role  # "rollout" | "trainer" | "reward" (the coordinator says no Hello)
    gpu: str  # GPU type the node declares (H100, L40S, cpu, ...)
    incarnation: int  # bumps on every restart, so the coordinator can drop a dead twin's work
    pid: int  # OS process id, for operators
    host: str  # host name, for operators
    data_endpoint: str  # trainer: its PULL for chunks and commits; reward: its ROUTER for Score; rollout: ""
    weights_endpoint: str  # its weights ROUTER address (trainer rank 0 serves, a rollout relays; reward: "")


@message("welcome")
class Welcome(Message):
    """The coordinator's answer to Hello: the run's config and where the peers are."""

    node_id: str  # echoes the Hello
    run_id: str  # the run this node joined
    config_toml: str  # the run's full config, so every node runs the same settings
    endpoints: JSONDict  # name -> ZeroMQ address (e.g. "trainer/0" -> "tcp://10.0.0.2:5601")
    rank: int  # rank among nodes of its role
    world_size: int  # number of nodes of its role


@message("heartbeat")
class Heartbeat(Message):
    """Periodic liveness and load report from a node to the coordinator."""

    node_id: str
    incarnation: int
    policy_version: int  # the weights version the node currently holds
    state: NodeState  # "running", or "stopping" once asked to stop (see NodeState)
    seq: int  # increases by one per heartbeat, so gaps show lost messages
    gpu: JSONDict  # NVML snapshot: free_mb, util, ...
    stats: JSONDict  # counters since the last heartbeat


@message("assign")
class Assign(Message):
    """A fragment task: generate these prompts' groups and stream their chunks."""

    task_id: int
    step: int  # training step the fragment belongs to
    fragment: int  # index of the fragment inside the step
    prompt_ids: list[int]  # indices into the prompt set
    prompts: list[str]  # the prompt texts, same order
    seeds: list[int]  # one noise seed per trajectory (len = len(prompts) * group_size)
    group_size: int  # generations per prompt (GRPO group)
    version_floor: int  # generate with a policy version >= this
    lease_s: float  # the task is revoked if not committed within this many seconds of starting
    sde_steps: list[int]  # denoising step indices sampled stochastically (and trained)
    owners: JSONDict  # str(timestep index) -> trainer rank that trains it (TSP)
    metadata: list[str]  # each prompt's metadata record as JSON text (the rewards get it), same order


@message("chunk")
class Chunk(Message):
    """One denoising step of a fragment's trajectories, streamed to the rank owning ``t_index``."""

    task_id: int
    step: int
    fragment: int
    t_index: int  # denoising step index
    sigma: float  # noise level at x_t
    sigma_next: float  # noise level at x_next
    policy_version: int  # version that generated the whole trajectory (TCSS)
    x_t: torch.Tensor  # latents before the step, (N, ...) with N trajectories
    x_next: torch.Tensor  # latents after the step, same shape
    log_prob: torch.Tensor  # (N,) behaviour log-prob of x_next, float32


@message("clean_sample")
class CleanSample(Message):
    """A forward-process fragment's final latents (DiffusionNFT, AWM): the whole of what the
    trainer needs besides the commit's rewards and conditioning. Sent once to every rank that
    owns one of the fragment's draw slots, before the commit; no per-step chunks, no log-probs."""

    task_id: int
    step: int
    fragment: int
    policy_version: int  # version that generated the whole trajectory (TCSS)
    x0: torch.Tensor  # final latents, (N, ...) with N trajectories, in the wire dtype


@message("commit")
class Commit(Message):
    """A fragment is fully generated and scored; sent last, after all its chunks."""

    task_id: int
    step: int
    fragment: int
    node_id: str
    policy_version: int
    prompt_ids: list[int]
    rewards: list[float]  # one per trajectory
    reward_terms: JSONDict  # term name -> list of per-trajectory values
    gen_seconds: float  # wall time generating the fragment
    cond: dict[str, torch.Tensor]  # conditioning the trainer needs (prompt embeddings, ...)
    images: torch.Tensor  # uint8 decoded samples for logging; may be empty
    discard: str  # "" normally; else why every trajectory is discarded untrained (rewards empty):
    #               "reward_failed", "reward_timeout" (a reward worker's failure, named, never a zero)


@message("score")
class Score(Message):
    """A rollout (or TAG helper) asks a reward worker to score a fragment's decoded samples."""

    task_id: int  # the fragment's attempt; the answer names it
    step: int
    images: torch.Tensor  # uint8 (N, 3, H, W), N = len(prompts)
    prompts: list[str]  # one per sample (each group's prompt repeated)
    metadata: list[str]  # one JSON record per sample, as Assign.metadata


@message("scored")
class Scored(Message):
    """A reward worker's answer to one Score: rewards, or the error that stopped it."""

    task_id: int
    rewards: list[float]  # one per sample; empty when error is set
    reward_terms: JSONDict  # term label -> list of per-sample values
    error: str  # "" or the reward's one-line error (the fragment is then discarded, named)
    seconds: float  # time the worker spent scoring the batch this request was in


@message("consumed")
class Consumed(Message):
    """A trainer rank finished with a fragment: credits return to the ledger."""

    task_id: int
    step: int
    fragment: int
    rank: int
    policy_version: int  # the version that generated the fragment (dates what was trained)
    trained: int  # trajectories trained
    discarded: dict[str, int]  # reason -> trajectories discarded
    train_seconds: float


@message("version_announce")
class VersionAnnounce(Message):
    """A new policy version exists; fetch it in ``nparts`` parts.

    The parts fall in *segments*, each changed as one (an expert of a two-expert model; ""
    the whole set otherwise), listed in part order. A segment carries the bytes published at
    version ``segment_since``: a node that holds that version or a newer one below this one
    already has them and fetches only the other segments (transport/weights.py). Empty
    segment lists: one segment, all ``nparts``, new at this version.
    """

    version: int
    step: int  # optimizer steps done
    nparts: int  # 0: nothing differs from the weights every node loads itself (version 0's)
    nbytes: int  # total payload bytes
    checksum: str  # weights.set_checksum over the parts' tensor_checksums
    segments: list[str]  # each segment's name, in part order
    segment_since: list[int]  # the version whose bytes it carries
    segment_parts: list[int]  # its parts (they sum to nparts)
    segment_sums: list[str]  # set_checksum over its parts' checksums


@message("weights_request")
class WeightsRequest(Message):
    """Ask the weight server for one part of a version."""

    version: int
    part: int


@message("weights_part")
class WeightsPart(Message):
    """One part of a weight set."""

    version: int
    part: int
    nparts: int
    checksum: str  # tensor_checksum of this part's tensors
    tensors: dict[str, torch.Tensor]  # parameter name -> tensor


@message("weights_missing")
class WeightsMissing(Message):
    """The server will never hold this part: the version was superseded or dropped."""

    version: int
    part: int
    newest: int  # the newest version the server holds or is fetching (-1: none)


@message("weights_pending")
class WeightsPending(Message):
    """The upstream is alive and still receiving this part (a relay deep in a chain): sent
    every keep-alive interval while a request waits, so the requester's silence timeout
    measures this hop, not the whole chain above it."""

    version: int
    part: int
    landed: int  # parts of the version the upstream holds verified so far


@message("weights_route")
class WeightsRoute(Message):
    """Where a rollout fetches weight parts from (a membership change re-links the relay)."""

    upstream: str  # a rollout's weights ROUTER address; "" = trainer rank 0's
    upstream_node: str  # that node's id, for logs ("" for rank 0)


@message("weights_held")
class WeightsHeld(Message):
    """A rollout holds ``version`` whole and verified (it can generate with it and serve it)."""

    node_id: str
    version: int


@message("step_done")
class StepDone(Message):
    """The trainer finished an optimizer step."""

    step: int
    version: int  # the version the step produced
    metrics: JSONDict  # train/* metrics of the step


@message("samples")
class Samples(Message):
    """Trainer rank 0 shows the coordinator a grid of samples, for the experiment trackers
    (telemetry/tracking.py); the coordinator alone logs them."""

    step: int  # kind "train": the training step; "eval" / "eval_ema": the evaluated version
    kind: Literal["train", "eval", "eval_ema"]
    grid: torch.Tensor  # uint8 (H, W, 3): the picture (telemetry/images.py's grid; videos: frames side by side)
    prompt_ids: list[int]  # train: each grid row's prompt (indices of the train split); else []
    caption: str  # eval: the grid's prompts (telemetry/tracking.grid_caption); train: ""


@message("tag_offer")
class TagOffer(Message):
    """A trainer rank is idle and can generate (trainer-assisted generation)."""

    node_id: str
    rank: int
    free_mb: float  # GPU memory headroom


@message("revoke")
class Revoke(Message):
    """The coordinator takes a task back (lease expired, node lost, ...)."""

    task_id: int
    reason: str


@message("shutdown")
class Shutdown(Message):
    """Stop now; ``reason`` says why (also used to refuse a peer)."""

    reason: str
