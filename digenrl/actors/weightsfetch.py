"""A rollout's side of the weights relay: its route, fetching a version, serving it on.

:class:`WeightsRelay` belongs to a rollout's :class:`~digenrl.actors.following.WeightFollower`
(which decides *when* to fetch: prefetch, catch-up at a trajectory boundary). It fetches each version
from the node's *upstream* (``WeightsRoute`` from the coordinator; trainer rank 0 until told
otherwise, :mod:`digenrl.core.relay` picks the tree), keeping ``WEIGHTS_WINDOW`` part requests
in flight, and serves every part it has verified to its own downstream as the part lands. A
route change mid-fetch re-asks the parts in flight from the new upstream (parts already
verified are kept); an upstream silent for the liveness timeout (``heartbeat_s x
heartbeat_misses``) is bypassed for rank 0 for the rest of that version. Liveness is per hop:
an upstream still receiving a part says so with ``WeightsPending`` every ``heartbeat_s``, so a
rollout deep in a chain waits for parts that are on their way instead of bypassing (its
upstream's own timeout guards the hop above); an upstream that keeps saying so while no part
lands for ``STALL_SILENCES`` timeouts is bypassed too; ``WeightsMissing`` (the upstream moved on
to a newer version) ends the fetch with :class:`WeightsSuperseded`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from digenrl.actors.base import Log, Loop
from digenrl.config import Config
from digenrl.transport.errors import Closed
from digenrl.transport.protocol import (
    VersionAnnounce,
    WeightsHeld,
    WeightsMissing,
    WeightsPart,
    WeightsPending,
    WeightsRequest,
    WeightsRoute,
)
from digenrl.transport.socketio import Socket
from digenrl.transport.weights import WeightAssembly, WeightStore, serve_weights


class FetchingActor(Protocol):
    """What a fetch needs of its caller (a :class:`~digenrl.actors.following.WeightFollower` is one):
    its log, a busy span around the fetch, and where unexpected messages are counted."""

    log: Log

    def working(self, name: str, **args: Any) -> AbstractContextManager[None]: ...
    def unexpected(self, socket: str, msg: object, why: str = ...) -> None: ...

WEIGHTS_WINDOW = 2
"""Part requests a fetch keeps in flight: one landing while the next is on the wire."""
STALL_SILENCES = 12
"""An upstream that answers only ``WeightsPending`` for this many liveness timeouts in a row
(no part landing) is bypassed like a silent one: alive is not enough, it must deliver."""


class WeightsSuperseded(Exception):
    """The upstream will never hold the version being fetched (it moved to ``newest``)."""

    def __init__(self, version: int, newest: int) -> None:
        super().__init__(f"weights v{version}: superseded upstream (it holds v{newest})")
        self.version, self.newest = version, newest


class WeightsRelay:
    """Fetches versions along the relay tree and serves what it holds (see the module doc).

    ``weights``: the DEALER to trainer rank 0; ``relay``: this node's own weights ROUTER (None:
    it serves nothing); ``connect(endpoint)``: a new DEALER to an upstream the coordinator
    names; ``store``: the versions held and being received (served from ``relay``);
    ``control``: where ``WeightsHeld`` goes once a version is whole.
    """

    def __init__(self, *, node_id: str, cfg: Config, control: Socket, weights: Socket | None,
                 store: WeightStore, relay: Socket | None = None,
                 connect: Callable[[str], Socket] | None = None) -> None:
        self.node_id = node_id
        self.cfg = cfg
        self.control = control
        self.weights = weights
        self.store = store
        self.relay = relay
        self.connect = connect
        self.lock = asyncio.Lock()  # one fetch at a time
        self.upstream_endpoint = ""  # "" = trainer rank 0 (self.weights)
        self._upstream: Socket | None = None  # DEALER to a relaying rollout
        self._rerouted = asyncio.Event()
        self.fallbacks = 0  # fetches that bypassed a silent or stalled upstream for rank 0
        self.stale_parts = 0  # parts answering a request of a fetch that was cancelled
        self.received_bytes = 0  # tensor bytes of the parts received (not those taken from a held version)
        self.reused_parts = 0  # parts of fetched versions taken from a version held here

    def on_route(self, msg: WeightsRoute) -> None:
        """Fetch from ``msg.upstream`` from now on ("" = trainer rank 0); a fetch in flight
        re-asks its outstanding parts there."""
        if msg.upstream == self.upstream_endpoint:
            return
        old, self._upstream = self._upstream, None
        if msg.upstream:
            if self.connect is None:
                raise RuntimeError("a WeightsRoute needs WeightsRelay(connect=...)")
            self._upstream = self.connect(msg.upstream)
        self.upstream_endpoint = msg.upstream
        if old is not None:
            old.close()
        self._rerouted.set()

    def serve_loop(self, actor: FetchingActor) -> Loop:
        """The background loop serving this node's held versions on its weights ROUTER."""
        async def relay() -> None:
            if self.relay is not None:  # "still receiving" every beat, twice a timeout at least
                rt = self.cfg.runtime
                await serve_weights(self.relay, self.store, actor.unexpected, keepalive_s=min(
                    rt.heartbeat_s, rt.heartbeat_s * rt.heartbeat_misses / 2))
        return relay

    async def fetch(self, actor: FetchingActor, ann: VersionAnnounce, span: str) -> dict[str, torch.Tensor]:
        """Every tensor of ``ann``'s version (:meth:`fetch_version`, whole tensors out)."""
        return (await self.fetch_version(actor, ann, span)).state_dict()

    async def fetch_version(self, actor: FetchingActor, ann: VersionAnnounce, span: str) -> WeightAssembly:
        """``ann``'s version, verified: the segments the newest version held whole here carries
        alike are taken from it, every other part comes from the upstream, verified as it
        lands (and served on from here meanwhile). Raises :class:`WeightsSuperseded`."""
        async with self.lock:
            asm = WeightAssembly.announced(ann)
            held = self.store.whole_below(ann.version)
            if held is not None:
                asm.prefill(held)
            self.store.begin(asm)
            try:
                with actor.working(span, version=ann.version, reused_parts=asm.reused):
                    await self._fetch_parts(actor, asm)
                    await asyncio.to_thread(asm.verify)
            except BaseException:
                self.store.abandon(ann.version)
                raise
        self.reused_parts += asm.reused
        await self.control.send(WeightsHeld(node_id=self.node_id, version=ann.version))
        return asm

    async def _fetch_parts(self, actor: FetchingActor, asm: WeightAssembly) -> None:
        rt = self.cfg.runtime
        silent_s = rt.heartbeat_s * rt.heartbeat_misses
        in_flight: set[int] = set()
        bypass = False  # the upstream went silent: rank 0 serves the rest of this version
        delivered_at = time.monotonic()  # the last part landed (or the fetch began)
        while missing := asm.missing():
            sock = self.weights if bypass or self._upstream is None else self._upstream
            if sock is None:
                raise RuntimeError(f"{self.node_id}: fetching weights v{asm.version} without a weights socket")
            self._rerouted.clear()
            due = [p for p in missing if p not in in_flight][:max(0, WEIGHTS_WINDOW - len(in_flight))]
            exchange = asyncio.ensure_future(self._exchange(sock, asm.version, due, in_flight))
            rerouted = asyncio.ensure_future(self._rerouted.wait())
            try:
                done, _ = await asyncio.wait({exchange, rerouted}, timeout=silent_s,
                                             return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:  # the node stops: its sockets close under the exchange,
                exchange.cancel()           # which must not outlive the fetch and fail unheard
                rerouted.cancel()
                raise
            rerouted.cancel()
            if not done and sock is not self.weights:
                bypass = True
                self.fallbacks += 1
                actor.log.warning("weights upstream silent; fetching from trainer rank 0",
                                  version=asm.version, upstream=self.upstream_endpoint, silent_s=silent_s)
            if exchange not in done or exchange.cancelled() or isinstance(exchange.exception(), Closed):
                # silent, or re-routed (closing the old socket cancels or ends its receive):
                # the requests in flight there are lost; ask again, from the new upstream
                exchange.cancel()
                await asyncio.gather(exchange, return_exceptions=True)
                in_flight.clear()
                continue
            msg = exchange.result()
            if self._rerouted.is_set():  # answered just as the route changed: keep the part,
                in_flight.clear()        # and ask the new upstream for the rest
            if isinstance(msg, WeightsPending) and msg.version == asm.version:
                # alive and still receiving: wait on, unless it has delivered nothing for long
                stalled = time.monotonic() - delivered_at
                if stalled > STALL_SILENCES * silent_s and sock is not self.weights:
                    bypass, in_flight = True, set()
                    self.fallbacks += 1
                    actor.log.warning("weights upstream stalled; fetching from trainer rank 0",
                                      version=asm.version, upstream=self.upstream_endpoint,
                                      stalled_s=round(stalled, 1), landed_there=msg.landed)
                continue
            if isinstance(msg, WeightsMissing) and msg.version == asm.version:
                raise WeightsSuperseded(asm.version, msg.newest)
            if not isinstance(msg, WeightsPart | WeightsMissing):
                actor.unexpected("weights", msg)
            elif msg.version != asm.version or isinstance(msg, WeightsMissing):
                self.stale_parts += 1  # the answer to a fetch that was abandoned
            else:
                in_flight.discard(msg.part)
                if msg.part not in asm.parts:  # the same part twice (asked again): once is enough
                    await asyncio.to_thread(asm.add, msg.part, dict(msg.tensors), msg.checksum)
                    self.received_bytes += sum(t.numel() * t.element_size() for t in msg.tensors.values())
                    self.store.landed()
                    delivered_at = time.monotonic()

    @staticmethod
    async def _exchange(sock: Socket, version: int, due: list[int], in_flight: set[int]) -> Any:
        """Ask for the ``due`` parts, then the next answer."""
        for part in due:
            await sock.send(WeightsRequest(version=version, part=part))
            in_flight.add(part)
        _, msg = await sock.recv()
        return msg
