"""What the engines answered one weight update, sorted the same way wherever it is read: by the
front end for an update it relayed (``updates``), by a client for one it sent direct
(``direct``).

``Answers.sort`` splits the replies into engines that loaded it, engines whose canary differed
(they loaded it and are quarantined) and engines that failed; ``report`` is what the client's
``update_weights`` returns, ``error`` what it raises instead: ``EnginesQuarantined`` when a canary
failed anywhere, else the first failure when no engine loaded it.

Light on purpose (the client imports it): no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from treadle.rollout.errors import EnginesQuarantined, is_canary, refine, tagged


@dataclass(slots=True, kw_only=True)
class Answers:
    version: int
    updated: list[str]  # engine ids, in the order asked
    quarantined: dict[str, str]  # engine id -> the canary's message
    failed: dict[str, Any]  # engine id -> the exception it raised (or its message, as a client booked it)
    loads: dict[str, dict[str, float]]  # per engine that loaded it: its stamps (``Engine.last_load``)
    events: dict[str, bytes]  # per engine that answered before its copies finished: its CUDA IPC event

    @classmethod
    def sort(cls, version: int, replies: dict[str, Any], first: dict[str, float]) -> Answers:
        """``replies``: engine id -> its answer (a ``Control``) or the exception it raised;
        ``first``: the stamp that goes before each engine's own (``received`` or ``sent``)."""
        out = cls(version=version, updated=[], quarantined={}, failed={}, loads={}, events={})
        for engine_id, r in replies.items():
            if isinstance(r, BaseException):
                r = refine(r)
                if is_canary(r):
                    out.quarantined[engine_id] = r.message
                else:
                    out.failed[engine_id] = r
                continue
            out.updated.append(engine_id)
            out.loads[engine_id] = {**first, **(r.args.get("load") or {})}
            if r.args.get("event"):
                out.events[engine_id] = r.args["event"]
        return out

    def failures(self) -> dict[str, str]:
        return {k: str(v) for k, v in self.failed.items()}

    def error(self) -> BaseException | None:
        """What the update's caller gets instead of the report, or None."""
        if self.quarantined:
            return tagged(EnginesQuarantined, f"weight version {self.version}: "
                          + "; ".join(f"{k}: {v}" for k, v in self.quarantined.items()))
        if not self.updated:
            return next(iter(self.failed.values()))
        return None

    def report(self) -> dict[str, Any]:
        return {"version": self.version, "updated": list(self.updated), "failed": self.failures(), "loads": self.loads,
                **({"events": self.events} if self.events else {})}
