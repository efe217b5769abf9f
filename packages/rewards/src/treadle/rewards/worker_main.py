"""A reward-function worker process: load one function, then score batches read from stdin.

Started by ``workers.FunctionPool`` as ``python -m treadle.rewards.worker_main SPEC_JSON``.
Protocol on the pipes: frames of a 4-byte big-endian length and a msgpack map (no pickle).
The worker first writes ``{"ready": true, "provenance": {...}}`` (or ``{"ready": false,
"error": ...}`` and exits), then answers each ``{"queries", "prompts", "labels"}`` with
``{"ok": true, "rewards", "scores", "extra_logs", "failed", "errors"}`` or ``{"ok": false,
"error"}``. The protocol uses a private copy of fd 1; the function's own ``print`` output goes
to stderr (the daemon's log), so a chatty ``reward_func`` cannot corrupt it.

A batch call that raises is retried one sample at a time (``isolate_failures``), so only the
samples that really fail are failed. Hangs are the parent's business: it kills this process.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import resource
import struct
import sys
import traceback
from typing import Any, BinaryIO

import msgspec

from treadle.rewards.api import RewardBatch, RewardOutput, concat_outputs, normalize_output
from treadle.rewards.loader import FunctionSpec, LoadedFunction, load

_LEN = struct.Struct(">I")
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


def write_frame(out: BinaryIO, obj: Any) -> None:
    body = _enc.encode(obj)
    out.write(_LEN.pack(len(body)) + body)
    out.flush()


def read_frame(inp: BinaryIO) -> Any | None:
    head = inp.read(_LEN.size)
    if len(head) < _LEN.size:
        return None  # the parent closed the pipe: exit
    (size,) = _LEN.unpack(head)
    return _dec.decode(inp.read(size))


def _call_once(loaded: LoadedFunction, batch: RewardBatch, loop: asyncio.AbstractEventLoop) -> RewardOutput:
    if loaded.native:
        out = loaded.fn(batch)
    else:
        out = loaded.fn(list(batch.queries), list(batch.prompts), list(batch.labels))
    if inspect.isawaitable(out):
        out = loop.run_until_complete(out)
    return normalize_output(out, len(batch), f"reward function {loaded.provenance.get('name')!r}")


def _error_text(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
    return f"{type(e).__name__}: {e}{where}"[:1000]


def invoke(loaded: LoadedFunction, batch: RewardBatch, *, isolate: bool,
           loop: asyncio.AbstractEventLoop) -> RewardOutput:
    """Score ``batch``; a raising batch is retried per sample when ``isolate`` (else all fail)."""
    try:
        return _call_once(loaded, batch, loop)
    except Exception as e:
        if not isolate or len(batch) == 1:
            return RewardOutput.failure(len(batch), _error_text(e))
    singles = []
    for i in range(len(batch)):
        try:
            singles.append(_call_once(loaded, batch.select([i]), loop))
        except Exception as e:
            singles.append(RewardOutput.failure(1, _error_text(e)))
    return concat_outputs(singles)


def _reply(out: RewardOutput) -> dict[str, Any]:
    return {"ok": True, "rewards": out.rewards, "scores": out.scores, "extra_logs": out.extra_logs,
            "failed": out.failed, "errors": out.errors}


def serve(spec: FunctionSpec, inp: BinaryIO, out: BinaryIO, *, isolate: bool) -> None:
    """Load ``spec`` and answer requests until stdin closes."""
    try:
        loaded = load(spec)
    except BaseException as e:
        write_frame(out, {"ready": False, "error": f"loading {spec.source}: {_error_text(e)}"})
        return
    write_frame(out, {"ready": True, "provenance": loaded.provenance})
    loop = asyncio.new_event_loop()
    while (req := read_frame(inp)) is not None:
        try:
            batch = RewardBatch(queries=req["queries"], prompts=req["prompts"], labels=req["labels"])
            write_frame(out, _reply(invoke(loaded, batch, isolate=isolate, loop=loop)))
        except Exception as e:  # a malformed request or an unencodable result: say so, keep serving
            write_frame(out, {"ok": False, "error": _error_text(e)})


def _die_with_parent() -> None:
    """SIGKILL this worker when the daemon dies, even in the middle of a hung call (Linux)."""
    if sys.platform == "linux":
        import ctypes  # noqa: PLC0415

        ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL


def main() -> None:
    _die_with_parent()
    cfg = json.loads(sys.argv[1])
    if cfg.get("memory_mb"):
        limit = int(cfg["memory_mb"]) << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # print() in user code now goes to stderr
    spec = FunctionSpec(**cfg["spec"])
    serve(spec, sys.stdin.buffer, proto_out, isolate=bool(cfg.get("isolate", True)))


if __name__ == "__main__":
    main()
