"""Weight updates across the pool, the weight-broadcast group, and keeping the latest weights.

Inline updates (``InlineWeights``: the tensors in the message) fan out to every live engine, and
so do cuda_ipc ones (``IpcWeights``: handles of a colocated sender's GPU buckets, which each
engine opens itself; the front end never holds those bytes, so it keeps no weights from them).
Collective updates (``CollectiveWeights``) go over a torch.distributed group built by ``join``:
the sender is rank 0 and hosts the ``TCPStore``; engine ``k`` takes ranks
``base_k .. base_k + TP*PP - 1``; with ``--keep_weights`` and gloo the front end itself takes the
last rank and receives every bucket. Both ``join`` and ``update_collective`` are streams: they
first yield ``accepted`` (the group's world size and the sender's spec) and only then start
receiving, so a refused request costs the sender no broadcast and never hangs it.

Keeping the weights: after each update that at least one engine accepted, the front end holds
that version's tensors (inline: the arrays it received; collective over gloo: the buckets it
received as the keeper rank). A new or restarted engine is brought to that version inline, with
the same canary, before it takes work (``catch_up``); a LoRA adapter update is kept as such (the
adapter alone: an engine catches up on its own base weights, so a run keeps to one kind). Over NCCL the front end does not join
(NCCL allows one rank per GPU, and the engines' workers hold them), and neither it nor an
engine started with ``--no_keep_weights`` has the bytes: such an engine waits (state ``behind``,
no work) until the sender, told the group is stale, rebuilds it and sends the next version.

Relays: when the engines span two or more nodes (``--engine_placement ray``), ``relay_layout``
puts one worker per node in the sender's group and the node's other workers in a relay group it
roots (``WeightGroupSpec.relay_prefix``), so a broadcast crosses the network once per node. gloo's
broadcast is a tree either way, so a member that dies mid-broadcast can starve the ranks below it:
``_receive_all`` gives up on those after a grace (they are killed and restart) instead of holding
the update for the group's timeout.

Membership: a group has fixed ranks, so any change (an engine added, removed, died or
restarted) makes it stale; the next collective update then fails at once with
``WeightGroupStale`` (before ``accepted``: nothing was broadcast), telling the sender to
rebuild it with ``join`` and resend. So does an update that names another group than the
pool's (its store's ``host:port``): a second sender joined since, and the first one's
broadcasts would go where no engine listens. Before any join it fails with ``NoWeightGroup``.

Canary: engines check the update's canary themselves; one whose logprobs differ
(``CanaryMismatch``) is quarantined (no work) and the updater gets ``EnginesQuarantined`` naming
it, while the engines that passed serve the new version.

What this module does not do: send weights (the trainer does), or load them (the engines).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from treadle.common.errors import (
    BadRequest,
    CanaryMismatch,
    EngineDead,
    EnginesQuarantined,
    NoEngine,
    NoWeightGroup,
    WeightGroupStale,
)
from treadle.common.log import get_logger
from treadle.common.records import (
    CollectiveWeights,
    Control,
    InlineWeights,
    IpcWeights,
    WeightGroupSpec,
)
from treadle.rollout.client import UPDATABLE_STATES

log = get_logger(__name__)
UPDATABLE = UPDATABLE_STATES  # engines an update goes to
STARVED_GRACE_S = 5.0  # after a member died mid-broadcast: the others' extra wait (``_receive_all``)


@dataclass(slots=True, kw_only=True)
class Group:
    """The weight-broadcast group the pool's engines (and the keeper) joined."""

    spec: WeightGroupSpec  # the sender's (rank 0)
    members: dict[str, int]  # engine id -> its first rank (in its relay's group for a relayed engine)
    keeper_rank: int  # the front end's rank; -1: not a member
    epoch: int  # the pool's membership epoch when the group was built
    keeper: Any = field(default=None, repr=False)  # the front end's WeightGroup
    relays: dict[str, list[str]] = field(default_factory=dict)  # relay group -> engine ids, its relay first

    @property
    def endpoint(self) -> str:
        """``host:port`` of the group's store (the sender's): what tells two groups apart."""
        return f"{self.spec.host}:{self.spec.port}"


class WeightCoordinator:
    """Runs updates, the group and catch-ups for one ``EnginePool`` (one at a time: ``lock``)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.lock = asyncio.Lock()
        self.kept: InlineWeights | None = None  # the latest weights the pool accepted, to catch engines up
        self.group: Group | None = None
        self._epoch = 0
        self._why = ""

    # ------------------------------------------------------------------ membership

    def membership_changed(self, why: str) -> None:
        self._epoch += 1
        self._why = why

    def stale_reason(self) -> str:
        g = self.group
        return "" if g is None or g.epoch == self._epoch else self._why

    def describe(self) -> dict[str, Any]:
        g = self.group
        kept = self.kept.version if self.kept is not None else None
        if g is None:
            return {"joined": False, "kept_version": kept}
        return {"joined": True, "world_size": g.spec.world_size, "members": dict(g.members),
                "keeper_rank": g.keeper_rank, "relays": {k: list(v) for k, v in g.relays.items()},
                "stale": self.stale_reason(), "kept_version": kept}

    # ------------------------------------------------------------------ catch-up

    async def catch_up(self, h: Any) -> None:
        """Bring a started engine to the kept version (inline), then let it take work."""
        async with self.lock:
            kept = self.kept
            if kept is not None and kept.version > h.version:
                try:
                    reply = await h.call("update_weights", kept)
                except CanaryMismatch as e:
                    self.pool.quarantine(h, e.message)
                    self.membership_changed(f"engine {h.engine_id} joined")
                    return
                h.version = int(reply.args["version"])
            if self.pool.sleeping:
                await h.call("sleep", Control(op="sleep", args={"level": self.pool.sleeping}))
            self.pool.mark_ready(h, h.version)
            self.membership_changed(f"engine {h.engine_id} joined")

    # ------------------------------------------------------------------ updates

    def check(self, update: Any) -> None:
        """Refuse what no engine may take, before anything is sent."""
        if not isinstance(update, (InlineWeights, IpcWeights, CollectiveWeights)):
            raise BadRequest(f"expected a weight update (InlineWeights, CollectiveWeights or IpcWeights), got "
                             f"{type(update).__name__}")
        if update.version <= self.pool.version:
            raise BadRequest(f"weight update version {update.version} is not newer than the pool's "
                             f"{self.pool.version}: versions must increase")

    async def update_fanned(self, update: InlineWeights | IpcWeights, mode: str) -> dict[str, Any]:
        """Load an inline or cuda_ipc ``update`` into every live engine; returns the report
        (raises as ``_settle``)."""
        received = time.time()
        async with self.lock:
            self.check(update)
            targets = self.pool.live(UPDATABLE)
            if not targets:
                raise NoEngine("no live engine to update")
            method = "update_weights_abort" if mode == "abort" else "update_weights"
            replies = await asyncio.gather(*(h.call(method, update) for h in targets), return_exceptions=True)
            return self._settle(update, targets, replies, update if isinstance(update, InlineWeights) else None,
                                received)

    def _group_for(self, update: CollectiveWeights) -> Group:
        """The group a collective ``update`` goes over; raises what refuses it."""
        g = self.group
        if g is None:
            raise NoWeightGroup("no weight group: call join_weight_group before a collective update")
        if self.stale_reason():
            raise WeightGroupStale(f"weight group is stale: {self.stale_reason()}. Close the sender's group, call "
                                   "join_weight_group again (new world size) and resend")
        if update.group is not None and f"{update.group.host}:{update.group.port}" != g.endpoint:
            # another sender joined since this one did: its broadcasts would go to a group
            # nobody here listens to, and the engines would wait for the other sender's
            raise WeightGroupStale(f"this update names the weight group at {update.group.host}:{update.group.port}, "
                                   f"the pool is in the group at {g.endpoint} (another sender joined since). Close "
                                   "the sender's group, join again and resend")
        self.check(update)
        return g

    async def update_collective(self, update: CollectiveWeights, mode: str) -> AsyncIterator[Control]:
        """Receive ``update``'s buckets on every member (and the keeper); yields accepted, updated."""
        received = time.time()
        async with self.lock:
            g = self._group_for(update)
            members = [self.pool.handles[i] for i in g.members]
            yield Control(op="accepted", args=msgspec.structs.asdict(g.spec))
            method = "receive_weights_abort" if mode == "abort" else "receive_weights"
            calls = [asyncio.ensure_future(h.call(method, update)) for h in members]
            if g.keeper is not None:
                calls.append(asyncio.ensure_future(asyncio.to_thread(_receive, g.keeper, update)))
            replies = await self._receive_all(g, members, calls, time.monotonic())
            kept = replies.pop() if g.keeper is not None else None
            if isinstance(kept, BaseException):
                log.error("the front end could not keep weight version %d: %s", update.version, kept)
            inline = None if kept is None or isinstance(kept, BaseException) else InlineWeights(
                version=update.version, names=update.names, dtypes=update.dtypes, shapes=update.shapes,
                canary_token_ids=update.canary_token_ids, canary_logprobs=update.canary_logprobs,
                canary_tolerance=update.canary_tolerance, adapter=update.adapter, tensors=kept)
            yield Control(op="updated", args=self._settle(update, members, replies, inline, received))

    async def _receive_all(self, g: Group, members: list[Any], calls: list[asyncio.Future[Any]],
                           started: float) -> list[Any]:
        """Every member's (and the keeper's, last) reply or exception.

        gloo broadcasts along a tree: members relay the buckets to one another, so a member that
        dies mid-broadcast starves the ranks below it, which would wait out the group's timeout
        (and hold the update, and the trainer, that long). Once a member died, the others get as
        long again as the update had taken, plus ``STARVED_GRACE_S``; a member still waiting then is
        killed (it restarts and catches up, as after any death) and the keeper's copy is dropped.
        """
        pending = set(calls)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if any(not t.cancelled() and isinstance(t.exception(), EngineDead) for t in done):
                break
        if pending:
            grace = STARVED_GRACE_S + (time.monotonic() - started)
            _, pending = await asyncio.wait(pending, timeout=grace)
        replies: list[Any] = []
        for i, call in enumerate(calls):
            if call in pending:
                call.cancel()
                why = (f"still waiting for weight buckets {grace:.1f} s after a member of the weight group died "
                       "mid-broadcast (its relay in gloo's tree)")
                if i < len(members):
                    log.error("engine %s is %s: killing it (it restarts and catches up)", members[i].engine_id, why)
                    members[i].kill()
                else:  # the keeper's thread waits out the group's timeout; the group is rebuilt anyway
                    log.error("the front end's keeper rank is %s: its copy is dropped", why)
                    g.keeper = None
                replies.append(EngineDead(f"{why}: killed"))
            else:
                replies.append(call.exception() if call.exception() is not None else call.result())
        return replies

    def _settle(self, update: Any, targets: list[Any], replies: list[Any], keep: InlineWeights | None,
                received: float) -> dict[str, Any]:
        """Book the engines' answers: quarantine the canary failures, move the pool to the version
        the others loaded, keep the weights; returns the report ``{"version", "updated": [ids],
        "failed": {id: why}, "loads": {id: stamps}, "canary": {id: gap}}`` (stamps: ``received``, when
        the update reached the front end, then the engine's ``Engine.last_load``; gap: the engine's
        canary max |logprob difference|, for the engines that scored one). Raises
        ``EnginesQuarantined`` when a canary failed anywhere, else the first failure when no
        engine loaded it."""
        updated, loads, quarantined, failed, canary = [], {}, {}, {}, {}
        for h, r in zip(targets, replies, strict=True):
            if isinstance(r, CanaryMismatch):
                quarantined[h.engine_id] = r.message
                self.pool.quarantine(h, r.message)
            elif isinstance(r, BaseException):
                failed[h.engine_id] = r
                log.error("engine %s did not take weight version %d: %s", h.engine_id, update.version, r)
            else:
                updated.append(h)
                loads[h.engine_id] = {"received": received, **(r.args.get("load") or {})}
                if r.args.get("canary") is not None:
                    canary[h.engine_id] = float(r.args["canary"])
        if updated:
            self.pool.set_version(update.version)
            for h in updated:
                self.pool.mark_ready(h, update.version)
            if keep is not None and self.pool.cfg.keep_weights:
                self.kept = keep
            elif isinstance(update, IpcWeights):  # an older kept version must not catch engines up
                self.kept = None
        if quarantined:
            raise EnginesQuarantined(f"canary mismatch, engines quarantined: weight version {update.version}: "
                                     + "; ".join(f"{k}: {v}" for k, v in quarantined.items()))
        if not updated:
            raise next(iter(failed.values()))
        return {"version": update.version, "updated": [h.engine_id for h in updated],
                "failed": {k: str(v) for k, v in failed.items()}, "loads": loads, "canary": canary}

    # ------------------------------------------------------------------ the group

    async def join(self, args: dict[str, Any]) -> AsyncIterator[Control]:
        """Build a new group of every live engine (+ the keeper); yields accepted, joined."""
        request = _group_args(args)
        async with self.lock:
            await self._leave()
            members = self.pool.live(UPDATABLE)
            if not members:
                raise NoEngine("no live engine to join a weight group")
            layout = relay_layout([(h.engine_id, h.proc.node if h.proc is not None else "") for h in members],
                                  self.pool.cfg.ranks_per_engine)
            r = layout.world_size
            # NCCL allows one rank per GPU and the engines hold them: the keeper joins gloo groups only.
            keeper_rank = r if self.pool.cfg.keep_weights and request["backend"] == "gloo" else -1
            try:
                spec = WeightGroupSpec(**request, world_size=r + (keeper_rank > 0), rank=0)
            except ValueError as e:
                raise BadRequest(f"join_weight_group: {e}") from None
            epoch = self._epoch
            ranks = layout.ranks
            yield Control(op="accepted", args={**msgspec.structs.asdict(spec), "ranks": ranks,
                                               "keeper_rank": keeper_rank})
            calls = [h.call("join_weight_group", layout.spec_of(h.engine_id, spec)) for h in members]
            if keeper_rank > 0:
                calls.append(asyncio.to_thread(_make_group, spec.with_rank(keeper_rank)))
            replies = await asyncio.gather(*calls, return_exceptions=True)
            keeper = replies.pop() if keeper_rank > 0 else None
            self.group = Group(spec=spec, members=ranks, keeper_rank=keeper_rank, epoch=epoch,
                               keeper=None if isinstance(keeper, BaseException) else keeper,
                               relays={k: list(v) for k, v in layout.relays.items()})
            for h in members:
                h.base_rank = ranks[h.engine_id]
            err = next((x for x in [*replies, keeper] if isinstance(x, BaseException)), None)
            if err is not None:
                self.membership_changed(f"joining the weight group failed: {err}")
                raise err
            yield Control(op="joined", args={"world_size": spec.world_size, "members": ranks,
                                             "keeper_rank": keeper_rank})

    async def leave(self) -> None:
        async with self.lock:
            await self._leave()

    async def _leave(self) -> None:
        g, self.group = self.group, None
        if g is None:
            return
        for h in self.pool.live(UPDATABLE):
            h.base_rank = 0
        await asyncio.gather(*(h.call("leave_weight_group", timeout=30.0) for h in self.pool.live(UPDATABLE)
                               if h.engine_id in g.members), return_exceptions=True)
        if g.keeper is not None:
            with contextlib.suppress(Exception):
                g.keeper.close()

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.leave(), 10.0)


@dataclass(frozen=True, slots=True)
class RelayLayout:
    """Who receives from whom in one weight group (``relay_layout``)."""

    ranks: dict[str, int]  # engine id -> its first worker's rank, in the sender's group or in its relay's
    relays: dict[str, tuple[str, ...]]  # relay group name -> its engines, the relay's (in the sender's group) first
    world_size: int  # the sender's group: the sender + its members' ranks (a keeper comes on top)
    ranks_per_engine: int = 1

    def spec_of(self, engine_id: str, top: WeightGroupSpec) -> WeightGroupSpec:
        """The spec engine ``engine_id``'s first worker joins with (``top``: the sender's group,
        rank 0); its other workers derive theirs (``weights.worker_spec``)."""
        for name, engines in self.relays.items():
            size = len(engines) * self.ranks_per_engine
            if engine_id == engines[0]:
                return msgspec.structs.replace(top, rank=self.ranks[engine_id], relay_prefix=name, relay_size=size)
            if engine_id in engines:
                return msgspec.structs.replace(top, rank=self.ranks[engine_id], world_size=size, prefix=name)
        return top.with_rank(self.ranks[engine_id])


def relay_layout(engines: list[tuple[str, str]], ranks_per_engine: int) -> RelayLayout:
    """The weight group of ``engines`` ((engine id, node) in join order), ``ranks_per_engine``
    workers (tensor x pipeline parallel ranks) each.

    Flat (every worker a member of the sender's group) unless the engines span two or more
    nodes: then the engines of a node with two or more workers in all form a relay group. Its
    first engine's first worker is the node's one member of the sender's group and passes every
    broadcast on as rank 0 of the relay group, where that engine's other workers take ranks 1 ..
    and the node's other engines the next ones, so the network carries one copy per node instead
    of one per worker.
    """
    by_node: dict[str, list[str]] = {}
    for engine_id, node in engines:
        by_node.setdefault(node, []).append(engine_id)
    spread = len(by_node) >= 2
    relays = {f"relay/{node}": tuple(ids) for node, ids in by_node.items()
              if spread and len(ids) * ranks_per_engine >= 2}
    ranks, r = {}, 1
    in_relay = {e: k * ranks_per_engine for ids in relays.values() for k, e in enumerate(ids)}
    leaders = {ids[0] for ids in relays.values()}
    for engine_id, _ in engines:
        if engine_id in leaders:
            ranks[engine_id], r = r, r + 1  # its worker 0 alone is in the sender's group
        elif engine_id in in_relay:
            ranks[engine_id] = in_relay[engine_id]
        else:
            ranks[engine_id], r = r, r + ranks_per_engine
    return RelayLayout(ranks=ranks, relays=relays, world_size=r, ranks_per_engine=ranks_per_engine)


def _group_args(args: dict[str, Any]) -> dict[str, Any]:
    """host, port, backend, timeout_s from a join request (checked)."""
    known = {"host", "port", "backend", "timeout_s"}
    if extra := set(args) - known:
        raise BadRequest(f"join_weight_group: unknown keys {sorted(extra)} (known: {sorted(known)})")
    if not isinstance(args.get("host"), str) or not isinstance(args.get("port"), int):
        raise BadRequest(f"join_weight_group needs host (str) and port (int), got {args!r}")
    backend = args.get("backend", "gloo")
    if backend not in ("gloo", "nccl"):
        raise BadRequest(f"join_weight_group: backend must be 'gloo' or 'nccl', got {backend!r}")
    return {"host": args["host"], "port": args["port"], "backend": backend,
            "timeout_s": float(args.get("timeout_s", 120.0))}


def _make_group(spec: WeightGroupSpec) -> Any:
    """The keeper's membership (blocks until every member joined; run in a thread)."""
    from treadle.common.weights import WeightGroup

    return WeightGroup(spec)


def _receive(group: Any, update: CollectiveWeights) -> list[Any]:
    """Every tensor of ``update`` as the keeper receives it, in host memory (run in a thread)."""
    from treadle.common.weights import receive_buckets

    return [t for _, _, views in receive_buckets(group, update.dtypes, update.shapes, update.bucket_sizes)
            for t in views]
