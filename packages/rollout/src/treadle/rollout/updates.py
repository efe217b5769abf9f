"""Weight updates across the pool, the weight-broadcast group, and keeping the latest weights.

Inline updates (tensors in the ``WeightUpdate``) fan out to every live engine, and so do
``cuda_ipc`` ones (handles of a colocated sender's GPU buckets, which each engine opens itself;
the front end never holds those bytes, so it keeps no weights from them). Collective
updates go over a torch.distributed group built by ``join``: the sender is rank 0 and hosts
the ``TCPStore``; engine ``k`` takes ranks ``base_k .. base_k + TP*PP - 1``; with
``--keep_weights`` and gloo the front end itself takes the last rank and receives every bucket.
Both ``join`` and ``update_collective`` are streams: they first yield ``accepted`` (the group's
world size and the sender's spec) and only then start receiving, so a refused request costs the
sender no broadcast and never hangs it.

Keeping the weights: after each update that at least one engine accepted, the front end holds
that version's tensors (inline: the arrays it received; collective over gloo: the buckets it
received as the keeper rank). A new or restarted engine is brought to that version inline, with
the same canary, before it takes work (``catch_up``). Over NCCL the front end does not join
(NCCL allows one rank per GPU, and the engines' workers hold them), and neither it nor an
engine started with ``--no_keep_weights`` has the bytes: such an engine waits (state ``behind``,
no work) until the sender, told the group is stale, rebuilds it and sends the next version.

Membership: a group has fixed ranks, so any change (an engine added, removed, died or
restarted) makes it stale; the next collective update then fails at once with
``WeightGroupStale`` (before ``accepted``: nothing was broadcast), telling the sender to
rebuild it with ``join`` and resend. So does an update that names another group than the
pool's (its store's ``host:port``): a second sender joined since, and the first one's
broadcasts would go where no engine listens.

Canary: engines check the update's canary themselves; one whose logprobs differ is
quarantined (no work) and the updater gets ``EnginesQuarantined`` naming it, while the engines
that passed serve the new version.

Direct updates (``route``, ``book``): a client on this host may send an inline or cuda_ipc
update straight to the engines' own endpoints (``RolloutClient.update_weights(direct=True)``),
sparing the relay through this front end, and then tell it what they answered; the front end
books that as it books an update it relayed (version, ready, quarantine), except that it keeps
no weights from it. ``route`` names the engines an update goes to and the membership epoch;
``book`` answers ``stale`` when the membership changed since, or an engine was left out, so
that the client asks for the route again.

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

from treadle.common.errors import BadRequest, TreadleError
from treadle.common.log import get_logger
from treadle.common.records import Control, WeightUpdate
from treadle.rollout.answers import Answers
from treadle.rollout.errors import NoEngine, WeightGroupStale, is_canary, tagged

log = get_logger(__name__)
UPDATABLE = ("ready", "quarantined", "behind")  # engines an update goes to


@dataclass(slots=True, kw_only=True)
class Kept:
    """The latest weights the pool accepted, to catch engines up with."""

    update: WeightUpdate  # inline, with its tensors and canary


@dataclass(slots=True, kw_only=True)
class Group:
    """The weight-broadcast group the pool's engines (and the keeper) joined."""

    spec: dict[str, Any]  # host, port, world_size, backend, timeout_s (rank 0 is the sender)
    members: dict[str, int]  # engine id -> its first rank
    keeper_rank: int  # the front end's rank; -1: not a member
    epoch: int  # the pool's membership epoch when the group was built
    keeper: Any = field(default=None, repr=False)  # the front end's WeightGroup


def _endpoint(spec: dict[str, Any]) -> str:
    """``host:port`` of a group's store (the sender's): what tells two groups apart."""
    return f"{spec.get('host')}:{spec.get('port')}"


class WeightCoordinator:
    """Runs updates, the group and catch-ups for one ``EnginePool`` (one at a time: ``lock``)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.lock = asyncio.Lock()
        self.kept: Kept | None = None
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
        kept = self.kept.update.version if self.kept is not None else None
        if g is None:
            return {"joined": False, "kept_version": kept}
        return {"joined": True, "world_size": g.spec["world_size"], "members": dict(g.members),
                "keeper_rank": g.keeper_rank, "stale": self.stale_reason(), "kept_version": kept}

    # ------------------------------------------------------------------ catch-up

    async def catch_up(self, h: Any) -> None:
        """Bring a started engine to the kept version (inline), then let it take work."""
        async with self.lock:
            kept = self.kept
            if kept is not None and kept.update.version > h.version:
                try:
                    reply = await h.call("update_weights", kept.update)
                except TreadleError as e:
                    if not is_canary(e):
                        raise
                    self.pool.quarantine(h, e.message)
                    self.membership_changed(f"engine {h.engine_id} joined")
                    return
                h.version = int(reply.args["version"])
            if self.pool.sleeping:
                await h.call("sleep", Control(op="sleep", args={"level": self.pool.sleeping}))
            self.pool.mark_ready(h, h.version)
            self.membership_changed(f"engine {h.engine_id} joined")

    # ------------------------------------------------------------------ updates

    def check(self, update: WeightUpdate, transport: str) -> None:
        if update.header_kept:  # the engines keep headers for their direct senders; new engines catch up whole
            raise BadRequest(f"weight update {update.version} leaves its header out (header_kept): the daemon relays "
                             "and keeps whole updates only; leave headers out of direct updates to the engines")
        if update.transport != transport:
            raise BadRequest(f"expected a {transport} weight update, got transport {update.transport!r}"
                             + (" (cuda_ipc is for engines colocated with the sender)" if update.transport == "cuda_ipc" else ""))
        if update.version <= self.pool.version:
            raise BadRequest(f"weight update version {update.version} is not newer than the pool's "
                             f"{self.pool.version}: versions must increase")

    async def update_inline(self, update: WeightUpdate, mode: str) -> dict[str, Any]:
        """Load ``update`` (inline or cuda_ipc) into every live engine; returns the report (raises
        as ``_settle``)."""
        received = time.time()
        async with self.lock:
            self.check(update, "cuda_ipc" if update.transport == "cuda_ipc" else "inline")
            targets = self.pool.live(UPDATABLE)
            if not targets:
                raise tagged(NoEngine, "no live engine to update")
            method = "update_weights_abort" if mode == "abort" else "update_weights"
            replies = await asyncio.gather(*(h.call(method, update) for h in targets), return_exceptions=True)
            return self._settle(update, targets, replies, lambda: update if update.transport == "inline" else None,
                                received)

    def _group_for(self, update: WeightUpdate) -> Group:
        """The group a collective ``update`` goes over; raises what refuses it."""
        g = self.group
        if g is None:
            raise BadRequest("no weight group: call join_weight_group before a collective update")
        if self.stale_reason():
            raise tagged(WeightGroupStale, f"{self.stale_reason()}. Close the sender's group, call "
                                           "join_weight_group again (new world size) and resend")
        if update.group and _endpoint(update.group) != _endpoint(g.spec):
            # another sender joined since this one did: its broadcasts would go to a group
            # nobody here listens to, and the engines would wait for the other sender's
            raise tagged(WeightGroupStale, f"this update names the weight group at {_endpoint(update.group)}, the "
                                           f"pool is in the group at {_endpoint(g.spec)} (another sender joined "
                                           "since). Close the sender's group, join again and resend")
        self.check(update, "collective")
        return g

    async def arm(self, update: WeightUpdate) -> dict[str, Any]:
        """Arm every member for ``update`` (``Engine.arm_weights``: the next collective update,
        sent later); returns ``{"version", "armed": [engine ids], "failed": {id: why}}``, or
        raises the first refusal when none armed. Refused when the front end keeps weights as a
        member (gloo): it receives only with the update's request, which every broadcast would
        wait for, so arming would gain nothing."""
        async with self.lock:
            g = self._group_for(update)
            if g.keeper_rank > 0:
                raise BadRequest("the daemon cannot arm a weight receive: its front end keeps the weights as a "
                                 "member of this gloo group and receives only with the update (--no_keep_weights "
                                 "or NCCL to arm)")
            members = [self.pool.handles[i] for i in g.members]
            replies = await asyncio.gather(*(h.call("arm_weights", update) for h in members), return_exceptions=True)
        failed = {h.engine_id: r for h, r in zip(members, replies, strict=True) if isinstance(r, BaseException)}
        if len(failed) == len(members):
            raise next(iter(failed.values()))
        return {"version": update.version, "armed": [h.engine_id for h in members if h.engine_id not in failed],
                "failed": {k: str(v) for k, v in failed.items()}}

    async def update_collective(self, update: WeightUpdate, mode: str) -> AsyncIterator[Control]:
        """Receive ``update``'s buckets on every member (and the keeper); yields accepted, updated."""
        received = time.time()
        async with self.lock:
            g = self._group_for(update)
            members = [self.pool.handles[i] for i in g.members]
            yield Control(op="accepted", args={**g.spec, "rank": 0})
            method = "receive_weights_abort" if mode == "abort" else "receive_weights"
            calls = [h.call(method, update) for h in members]
            if g.keeper is not None:
                calls.append(asyncio.to_thread(_receive, g.keeper, update))
            replies = await asyncio.gather(*calls, return_exceptions=True)
            kept = replies.pop() if g.keeper is not None else None
            if isinstance(kept, BaseException):
                log.error("the front end could not keep weight version %d: %s", update.version, kept)
            inline = None if kept is None or isinstance(kept, BaseException) else \
                msgspec.structs.replace(update, transport="inline", bucket_sizes=[], group={}, tensors=kept)
            yield Control(op="updated", args=self._settle(update, members, replies, lambda: inline, received))

    def _settle(self, update: WeightUpdate, targets: list[Any], replies: list[Any], keep: Any,
                received: float) -> dict[str, Any]:
        """Book the engines' answers (``_book``) and keep the weights; raise ``EnginesQuarantined``
        or (nothing loaded anywhere) the first error (``Answers``). ``received``: when the update
        reached the front end, the first of each engine's stamps."""
        answers = Answers.sort(update.version, {h.engine_id: r for h, r in zip(targets, replies, strict=True)},
                               {"received": received})
        self._book(answers, [h for h in targets if h.engine_id in answers.updated])
        if answers.updated:
            kept = keep()
            if kept is not None and self.pool.cfg.keep_weights:
                self.kept = Kept(update=kept)
            elif update.transport == "cuda_ipc":  # an older kept version must not catch engines up
                self.kept = None
        if (error := answers.error()) is not None:
            raise error
        return answers.report()

    def _book(self, answers: Answers, updated: list[Any]) -> None:
        """Quarantine the canary failures, move the pool to the version ``updated`` (handles)
        loaded, log the failures."""
        for engine_id, why in answers.quarantined.items():
            if (h := self.pool.handles.get(engine_id)) is not None:
                self.pool.quarantine(h, why)
        if updated:
            self.pool.set_version(answers.version)
            for h in updated:
                self.pool.mark_ready(h, answers.version)
        for engine_id, e in answers.failed.items():
            log.error("engine %s did not take weight version %d: %s", engine_id, answers.version, e)

    # ------------------------------------------------------------------ direct updates

    def route(self) -> dict[str, Any]:
        """The engines a direct update goes to (id -> the endpoint their worker serves on) and the
        membership epoch they were read at."""
        targets = self.pool.live(UPDATABLE)
        if not targets:
            raise tagged(NoEngine, "no live engine to update")
        return {"epoch": self._epoch, "engines": {h.engine_id: h.spec.endpoint for h in targets}}

    async def book(self, args: dict[str, Any]) -> dict[str, Any]:
        """Book a direct update's outcome (``args``: version, epoch, updated [ids], quarantined
        {id: why}, failed {id: why}) as ``_settle`` books a relayed one; returns
        ``{"version", "booked", "stale"}`` (``stale``: why the client should ask for the route
        again, or "")."""
        try:
            epoch = int(args["epoch"])
            answers = Answers(version=int(args["version"]), updated=list(args["updated"]),
                              quarantined={str(k): str(v) for k, v in dict(args.get("quarantined", {})).items()},
                              failed=dict(args.get("failed", {})), loads={}, events={})
        except (KeyError, TypeError, ValueError) as e:
            raise BadRequest(f"weights_loaded needs version, epoch, updated[, quarantined, failed], got {args!r}: "
                             f"{e}") from None
        version = answers.version
        async with self.lock:
            if version <= self.pool.version:
                raise BadRequest(f"direct weight update {version} is not newer than the pool's {self.pool.version}")
            updated = [h for i in answers.updated
                       if (h := self.pool.handles.get(i)) is not None and h.alive and h.state in UPDATABLE]
            self._book(answers, updated)
            if updated:
                self.kept = None  # the front end never held these bytes: an older version must not catch up engines
            left = sorted({h.engine_id for h in self.pool.live(UPDATABLE)}
                          - {*answers.updated, *answers.quarantined, *answers.failed})
            stale = f"the pool's engines changed since the route was read ({self._why})" if epoch != self._epoch \
                else f"engines {left} were not sent the update" if left else ""
            return {"version": version, "booked": [h.engine_id for h in updated], "stale": stale}

    # ------------------------------------------------------------------ the group

    async def join(self, args: dict[str, Any]) -> AsyncIterator[Control]:
        """Build a new group of every live engine (+ the keeper); yields accepted, joined."""
        spec = _group_args(args)
        async with self.lock:
            await self._leave()
            members = self.pool.live(UPDATABLE)
            if not members:
                raise tagged(NoEngine, "no live engine to join a weight group")
            ranks, r = {}, 1
            for h in members:
                ranks[h.engine_id], r = r, r + self.pool.cfg.ranks_per_engine
            # NCCL allows one rank per GPU and the engines hold them: the keeper joins gloo groups only.
            keeper_rank = r if self.pool.cfg.keep_weights and spec["backend"] == "gloo" else -1
            spec["world_size"] = r + (keeper_rank > 0)
            epoch = self._epoch
            yield Control(op="accepted", args={**spec, "rank": 0, "ranks": ranks, "keeper_rank": keeper_rank})
            calls = [h.call("join_weight_group", Control(op="join", args={**spec, "rank": ranks[h.engine_id]}))
                     for h in members]
            if keeper_rank > 0:
                calls.append(asyncio.to_thread(_make_group, {**spec, "rank": keeper_rank}))
            replies = await asyncio.gather(*calls, return_exceptions=True)
            keeper = replies.pop() if keeper_rank > 0 else None
            self.group = Group(spec=spec, members=ranks, keeper_rank=keeper_rank, epoch=epoch,
                               keeper=None if isinstance(keeper, BaseException) else keeper)
            for h in members:
                h.base_rank = ranks[h.engine_id]
            err = next((x for x in [*replies, keeper] if isinstance(x, BaseException)), None)
            if err is not None:
                self.membership_changed(f"joining the weight group failed: {err}")
                raise err
            yield Control(op="joined", args={"world_size": spec["world_size"], "members": ranks,
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


def _make_group(spec: dict[str, Any]) -> Any:
    """The keeper's membership (blocks until every member joined; run in a thread)."""
    from treadle.rollout.engine.group import GroupSpec, WeightGroup

    return WeightGroup(GroupSpec.from_dict(spec))


def _receive(group: Any, update: WeightUpdate) -> list[Any]:
    """Every tensor of ``update`` as the keeper receives it, in host memory (run in a thread)."""
    from treadle.rollout.engine.group import receive_buckets

    return [t for _, t in receive_buckets(group, update.names, update.dtypes, update.shapes,
                                         update.bucket_sizes, device="cpu")]
