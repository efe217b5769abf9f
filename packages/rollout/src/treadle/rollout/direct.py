"""Direct weight updates: a client on the daemon's host sends an update to each engine's own
worker, not through the front end, and tells the front end afterwards.

A relayed update costs two more hops than the engines' load needs (client -> front end ->
worker and back), each a wake-up of an idle process: ~0.9 ms of a 5 ms cuda_ipc sync on one
H200 (docs/benchmarks.md). ``RolloutClient.update_weights(update, direct=True)`` instead:

1. reads the route once, ``weight_route`` on the front end: the engines an update goes to, the
   endpoint each one's worker serves on (``ipc://`` or loopback tcp: this host only), and the
   pool's membership epoch; it probes each worker once (``stats``) and keeps one client to it
   (``DirectRoute``);
2. sends the update to every worker at once (``update``), and sorts their answers as the front
   end sorts a relayed update's (``answers.Answers``): the same report, or the same error. An
   update that names its header (``WeightUpdate.header_id``) goes without it to the engines that
   answered that they keep it (``header``; 338 tensors' header is ~24 KB, ~2,400 objects to
   decode); an engine that no longer does refuses before touching anything (``HeaderUnknown``)
   and is sent the whole update at once;
3. tells the front end what they answered (``weights_loaded``) without waiting for it; the
   client's next call to the daemon waits for that first. The front end books it as a relayed
   update (version, ready, quarantine) and answers ``stale`` when the pool's engines changed
   since the route was read; the client then reads the route again at the next update.

An engine that restarted or joined after the route was read is not sent the update: like one
that joins after a relayed cuda_ipc update, it waits ("behind") for the next, which goes to it
through the new route. A route whose connection to a worker dropped is not used (the worker
died: the front end restarts it under a new membership epoch). The front end keeps no
weights from a direct update: use it for cuda_ipc (which the front end never holds anyway),
not for inline updates meant to catch new engines up.

What this module does not do: decide when to go direct (the caller's ``direct=``), or book
anything (the front end, ``updates.WeightCoordinator.book``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

import msgspec

from treadle.common.errors import TreadleError
from treadle.common.records import HEADER_FIELDS, WeightUpdate
from treadle.common.rpc import RpcClient
from treadle.rollout.answers import Answers
from treadle.rollout.errors import HeaderUnknown, refine

PROBE_TIMEOUT_S = 10.0  # a worker of a fresh route answers a ``stats`` within this, or the route is not used
_LOOPBACK = ("127.", "localhost", "::1")


def is_local(endpoint: str) -> bool:
    """``endpoint`` is on this host: ``ipc://`` or tcp to a loopback address."""
    if endpoint.startswith("ipc://"):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return host.startswith(_LOOPBACK)


def reachable(endpoint: str) -> bool:
    """A worker endpoint this process can connect to: loopback tcp, or an ``ipc://`` socket file
    it can see (a process in another mount namespace, a container, sees none)."""
    if endpoint.startswith("ipc://"):
        return os.path.exists(endpoint[len("ipc://"):])
    return is_local(endpoint)


class DirectRoute:
    """The engines of one ``weight_route`` answer, a client to each one's worker."""

    def __init__(self, epoch: int, clients: dict[str, RpcClient]) -> None:
        self.epoch = epoch
        self.clients = clients
        self.headers: dict[str, str] = {}  # engine id -> the update header it said it keeps (``header_id``)

    @classmethod
    async def open(cls, args: dict[str, Any]) -> DirectRoute | None:
        """The route the front end answered (``epoch``, ``engines``: id -> endpoint), its
        workers probed; None when one cannot be reached from here."""
        engines, epoch = dict(args.get("engines", {})), int(args.get("epoch", -1))
        if not engines or not all(isinstance(e, str) and reachable(e) for e in engines.values()):
            return None
        # the route is dropped when a connection drops: a call must not wait for a dead worker
        route = cls(epoch, {i: RpcClient(e, name=f"direct:{i}", fail_on_disconnect=True) for i, e in engines.items()})
        try:
            await asyncio.gather(*(c.call("stats", timeout=PROBE_TIMEOUT_S) for c in route.clients.values()))
        except TreadleError:
            await route.close()
            return None
        return route

    def usable(self) -> bool:
        """Every worker's connection is still up (one that dropped means it died)."""
        return all(c.connected for c in self.clients.values())

    async def close(self) -> None:
        for c in self.clients.values():
            with contextlib.suppress(Exception):
                await c.close()

    async def update(self, method: str, update: WeightUpdate, timeout: float, begun: float | None = None
                     ) -> tuple[dict[str, Any], dict[str, Any], BaseException | None]:
        """Send ``update`` to every engine of the route; ``(report, booking, error)``: the report
        the front end would answer, what to book there (``weights_loaded``'s args), and the error
        to raise once that is on its way (None: return the report). ``begun``: when the client's
        call started (on its loop), the first of each engine's stamps."""
        short = _without_header(update) if update.header_id and update.header_id in self.headers.values() else None
        sent = time.time()  # the first of each engine's stamps (a relayed update's is "received")
        replies = await self._call_all(method, timeout, {
            i: short if short is not None and self.headers.get(i) == update.header_id else update for i in self.clients})
        again = [i for i, r in replies.items() if isinstance(refine(r), HeaderUnknown)]  # it restarted meanwhile
        if again:
            replies.update(await self._call_all(method, timeout, dict.fromkeys(again, update)))
        for i, r in replies.items():  # the engines that keep this header are sent the next update without it
            header = None if isinstance(r, BaseException) else r.args.get("header")
            if header:
                self.headers[i] = header
            else:
                self.headers.pop(i, None)
        first = {"begun": begun, "sent": sent} if begun is not None else {"sent": sent}
        answers = Answers.sort(update.version, replies, first)
        booking = {"version": update.version, "epoch": self.epoch, "updated": answers.updated,
                   "quarantined": answers.quarantined, "failed": answers.failures()}
        return {**answers.report(), "direct": True}, booking, answers.error()

    async def _call_all(self, method: str, timeout: float, updates: dict[str, WeightUpdate]) -> dict[str, Any]:
        """Engine id -> its answer to ``updates[id]``, or the exception it raised."""
        replies = await asyncio.gather(*(self.clients[i].call(method, u, timeout=timeout) for i, u in updates.items()),
                                       return_exceptions=True)
        return dict(zip(updates, replies, strict=True))


def _without_header(update: WeightUpdate) -> WeightUpdate:
    """``update`` as sent to an engine that keeps its header: the header left out."""
    return msgspec.structs.replace(update, header_kept=True, **{f: [] for f in HEADER_FIELDS})
