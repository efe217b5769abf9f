"""Plain records an engine reports: its stats and what ``sleep`` did; the tokens/s meter.

What this module does not do: measure anything by itself (``base.Engine`` feeds it).
"""

from __future__ import annotations

import collections
import time
from dataclasses import asdict, dataclass
from typing import Any

RATE_WINDOW_S = 30.0  # tokens/s is measured over this trailing window


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStats:
    """A snapshot of one engine's load and throughput (``as_dict`` is ``Control.args``-ready)."""

    engine_id: str
    backend: str
    weight_version: int
    running: int  # samples being generated now
    waiting: int  # samples admitted but not yet scheduled (queued, or held by a pause)
    gated: int  # requests waiting at the admission gate (weight load or sleep in progress)
    tokens_generated: int  # response tokens of finished samples since start
    samples_finished: int  # samples returned since start
    tokens_per_s: float  # response tokens per second over the last RATE_WINDOW_S seconds
    paused: bool  # the gate is closed (weight load or sleep)
    sleeping: bool
    broken: str  # why the engine refuses to generate ("" when healthy)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class SleepState:
    """What ``sleep`` did."""

    level: int  # the level asked for
    memory_released: bool  # whether weights / KV memory were actually given back
    weights_dropped: bool = False  # the weights are gone: a weight update must follow the wake
    note: str = ""  # how the backend honoured it (e.g. "sleep mode unsupported on CPU: paused only")


class Rate:
    """Tokens per second over a trailing window (events are (time, tokens))."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._events: collections.deque[tuple[float, int]] = collections.deque()
        self._sum = 0

    def add(self, tokens: int, now: float | None = None) -> None:
        self._events.append((time.monotonic() if now is None else now, tokens))
        self._sum += tokens

    def per_s(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self._events and self._events[0][0] < now - self.window_s:
            self._sum -= self._events.popleft()[1]
        return self._sum / self.window_s
