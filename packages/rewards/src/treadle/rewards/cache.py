"""Idempotency cache: a request replayed with the same key gets the very same ``RewardResult``.

Keys are the callers' (``RewardRequest.key``; HTTP ``Idempotency-Key``). Each entry also keeps a
SHA-256 of the request's content: reusing a key for different content is refused
(``BadRequest``) instead of silently answering the old result. Concurrent requests with one
key are scored once (the later ones wait for the first). Entries are kept in LRU order up to
``size``; with ``path`` they are also appended to a JSON-lines file and loaded on start, so
replays survive a daemon restart (float32 values round-trip exactly through JSON). Results
with failed samples are cached too: a replay must see what the original run saw.

Not here: computing results (``service``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from treadle.common.errors import BadRequest
from treadle.common.records import RewardRequest, RewardResult

_canonical = msgspec.msgpack.Encoder(order="deterministic")


def request_hash(req: RewardRequest) -> str:
    """SHA-256 of the request's content (queries, prompts, labels; map keys sorted)."""
    return hashlib.sha256(_canonical.encode([req.queries, req.prompts, req.labels])).hexdigest()


def result_to_json(res: RewardResult) -> dict[str, Any]:
    return {"rewards": np.asarray(res.rewards, dtype=np.float32).tolist(),
            "scores": None if res.scores is None else np.asarray(res.scores, dtype=np.float32).tolist(),
            "failed": list(res.failed), "errors": list(res.errors),
            "extra_logs": {k: list(v) for k, v in res.extra_logs.items()}, "provenance": res.provenance}


def result_from_json(d: dict[str, Any]) -> RewardResult:
    return RewardResult(rewards=np.asarray(d["rewards"], dtype=np.float32),
                        scores=None if d["scores"] is None else np.asarray(d["scores"], dtype=np.float32),
                        failed=d["failed"], errors=d["errors"], extra_logs=d["extra_logs"],
                        provenance=d["provenance"])


class IdempotencyCache:
    """LRU map key -> (content hash, result), optionally persisted; bound to one event loop."""

    def __init__(self, size: int = 100_000, path: str | Path | None = None) -> None:
        if size < 0:
            raise ValueError(f"cache size must be >= 0, got {size}")
        self.size = size
        self._entries: OrderedDict[str, tuple[str, RewardResult]] = OrderedDict()
        self._inflight: dict[str, tuple[str, asyncio.Future[RewardResult]]] = {}
        self._path = Path(path) if path else None
        self._fh = None
        if self._path is not None:
            self._load(self._path)
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self._path.open("a", encoding="utf-8")

    def __len__(self) -> int:
        return len(self._entries)

    def _load(self, path: Path) -> None:
        if not path.exists():
            return
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
                self._put(row["key"], row["hash"], result_from_json(row["result"]))
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line of a killed daemon

    def _put(self, key: str, digest: str, result: RewardResult) -> None:
        self._entries[key] = (digest, result)
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def _check(self, key: str, digest: str, held: str) -> None:
        if held != digest:
            raise BadRequest(f"idempotency key {key!r} was already used for a different request "
                             "(content differs); use a new key per distinct request")

    async def get_or_compute(self, req: RewardRequest,
                             compute: Callable[[], Awaitable[RewardResult]]) -> tuple[RewardResult, bool]:
        """(result, True if it came from the cache); ``compute`` runs only for new keys."""
        if not req.key or self.size == 0:
            return await compute(), False
        digest = request_hash(req)
        hit = self._entries.get(req.key)
        if hit is not None:
            self._check(req.key, digest, hit[0])
            self._entries.move_to_end(req.key)
            return hit[1], True
        pending = self._inflight.get(req.key)
        if pending is not None:
            self._check(req.key, digest, pending[0])
            return await asyncio.shield(pending[1]), True
        fut: asyncio.Future[RewardResult] = asyncio.get_running_loop().create_future()
        self._inflight[req.key] = (digest, fut)
        try:
            result = await compute()
        except asyncio.CancelledError:
            fut.cancel()
            raise
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # mark it retrieved: waiters re-raise it, nobody else needs to
            raise
        finally:
            self._inflight.pop(req.key, None)
        fut.set_result(result)
        self._put(req.key, digest, result)
        if self._fh is not None:
            self._fh.write(json.dumps({"key": req.key, "hash": digest, "result": result_to_json(result)}) + "\n")
            self._fh.flush()
        return result, False

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
