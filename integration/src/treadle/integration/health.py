"""Readiness of a launched daemon, asked through the daemon's own health call.

- rollout: ``RolloutClient.health`` answers, and every engine of the pool is ready;
- rewards, critic: the RPC server's built-in ``health`` answers (``RpcProbe``);
- agents: ``GET /health`` of the gateway answers 200 (it answers 503 until the rollout pool does).

A ``Probe`` makes one short attempt per ``check()`` so the caller can watch processes and
signals between attempts. Not here: waiting policy, timeouts, teardown (``supervise``).
"""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from typing import Any, Protocol

from treadle.integration.plan import Addresses

ATTEMPT_S = 2.0  # one health call's timeout: short, so Ctrl-C and dead processes are noticed quickly


class Probe(Protocol):
    def check(self) -> bool: ...

    def close(self) -> None: ...


class RolloutProbe:
    """Ready when the rollout daemon answers and all its engines are ready."""

    def __init__(self, endpoint: str, curve: Any = None) -> None:
        from treadle.rollout.client import SyncRolloutClient  # noqa: PLC0415

        self._client = SyncRolloutClient(endpoint, curve=curve)

    def check(self) -> bool:
        from treadle.common.errors import TreadleError  # noqa: PLC0415

        try:
            h = self._client.health(timeout=ATTEMPT_S)
        except (TreadleError, TimeoutError):
            return False
        return h.get("engines_ready", 0) >= max(len(h.get("engines", ())), 1)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._client.close()


class RpcProbe:
    """Ready when a treadle RPC server answers its built-in ``health``: the reward daemon binds
    only once its scorers run; the critic server once its ranks have joined their group (it loads
    its model when the trainer sends the run's flags)."""

    def __init__(self, endpoint: str, curve: Any = None) -> None:
        from treadle.common.rpc import SyncRpcClient  # noqa: PLC0415

        self._client = SyncRpcClient(endpoint, curve=curve, timeout_s=ATTEMPT_S)

    def check(self) -> bool:
        from treadle.common.errors import TreadleError  # noqa: PLC0415

        try:
            self._client.call("health")
        except (TreadleError, TimeoutError):
            return False
        return True

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._client.close()


class AllProbe:
    """Ready when every one of ``probes`` is (replicas of one daemon)."""

    def __init__(self, probes: list[Probe]) -> None:
        self.probes = probes

    def check(self) -> bool:
        return all(p.check() for p in self.probes)

    def close(self) -> None:
        for p in self.probes:
            p.close()


class HttpProbe:
    """Ready when ``GET {url}/health`` answers 200."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/") + "/health"

    def check(self) -> bool:
        try:
            with urllib.request.urlopen(self.url, timeout=ATTEMPT_S) as resp:
                body: Any = json.loads(resp.read() or b"{}")
                return resp.status == 200 and body.get("status") != "down"
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def close(self) -> None:
        pass


def probe_for(name: str, addresses: Addresses, curve: Any = None) -> Probe:
    """The readiness probe of daemon ``name`` at its address in ``addresses``; ``curve``: the run's
    CURVE client keys (``ClientCurve``), used for a ZeroMQ address off loopback."""
    def keys_for(endpoint: str) -> Any:
        from treadle.common.rpc.transport import off_loopback  # noqa: PLC0415

        return curve if endpoint.startswith("tcp://") and off_loopback(endpoint) else None

    if name in ("rollout", "reference"):
        endpoint = getattr(addresses, name) or ""
        return RolloutProbe(endpoint, keys_for(endpoint))
    if name in ("rewards", "critic"):  # rewards: one endpoint per replica, comma-separated
        probes = [RpcProbe(e, keys_for(e)) for e in (getattr(addresses, name) or "").split(",")]
        return probes[0] if len(probes) == 1 else AllProbe(probes)
    if name == "agents":
        return HttpProbe(addresses.agents or "")
    raise ValueError(f"no health probe for {name!r}")
