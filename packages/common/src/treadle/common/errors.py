"""Named exceptions for typed ``Error`` replies: one class per error code.

A service answers a failure with ``records.Error(code=..., message=...)``; the client turns it
back into the exception registered for that code here, so callers catch ``Busy`` or
``EngineDead`` rather than parse strings.
"""

from __future__ import annotations


class TreadleError(Exception):
    """Base of every treadle error that can travel as an ``Error`` reply."""

    code = "internal"
    retryable = False

    def __init__(self, message: str = "", *, retryable: bool | None = None) -> None:
        super().__init__(message)
        self.message = message
        if retryable is not None:
            self.retryable = retryable


class CodecError(TreadleError):
    """A frame could not be encoded or decoded (bad msgpack, bad buffer reference, bad field)."""

    code = "bad_message"


class VersionMismatch(CodecError):
    """The peer speaks another protocol major version."""

    code = "version_mismatch"


class FrameTooLarge(CodecError):
    """A frame exceeds the receiver's size limit."""

    code = "frame_too_large"


class BadRequest(TreadleError):
    """The request decoded but its content is invalid for the method."""

    code = "bad_request"


class UnknownMethod(TreadleError):
    """No handler is registered under that method name."""

    code = "unknown_method"


class Busy(TreadleError):
    """The service is at its in-flight limit; retry later."""

    code = "busy"
    retryable = True


class RequestTimeout(TreadleError):
    """No reply came within the deadline."""

    code = "timeout"
    retryable = True


class Cancelled(TreadleError):
    """The request was cancelled before it finished."""

    code = "cancelled"


class EngineDead(TreadleError):
    """The engine serving the request died."""

    code = "engine_dead"
    retryable = True


class Unauthorized(TreadleError):
    """Authentication failed (wrong CURVE key or bearer token)."""

    code = "unauthorized"


class ServiceClosed(TreadleError):
    """The service or client is shutting down or already closed."""

    code = "closed"
    retryable = True


class ConnectionLost(ServiceClosed):
    """The connection to the service dropped while the request was in flight.

    The server died, restarted or closed its socket: the request may or may not have run.
    Raised by the client itself (never sent by a server); the client reconnects on its own, so
    a retry of an idempotent request can pass. A ``ServiceClosed``, so code that treats a
    closed service as gone (failover to another engine) treats this the same way.
    """

    code = "connection_lost"
    retryable = True


class InternalError(TreadleError):
    """The handler raised an unexpected exception."""

    code = "internal"


class WeightMismatch(BadRequest):
    """A weight update's names, shapes or dtypes do not fit the engine's model; nothing was loaded."""

    code = "weight_mismatch"


class WeightGroupStale(BadRequest):
    """The pool's membership changed since the weight group was built, or another sender's group
    replaced it: nothing was sent. Close the sender's group, join again (the new world size is in
    the reply) and resend."""

    code = "weight_group_stale"


class NoWeightGroup(BadRequest):
    """A collective update came before any group was joined (or after the daemon restarted):
    nothing was sent; join, then resend."""

    code = "no_weight_group"


class CanaryMismatch(InternalError):
    """The weights loaded, but the engine's canary logprobs differ from the sender's."""

    code = "canary_mismatch"


class EnginesQuarantined(InternalError):
    """The update loaded, but some engines failed its canary; they take no work until a later
    update passes on them (or they are restarted). The message names them and the differences."""

    code = "engines_quarantined"


class NoEngine(EngineDead):
    """No engine could serve the request (all down, quarantined, behind on weights or draining)."""

    code = "no_engine"
    retryable = True


ERRORS: dict[str, type[TreadleError]] = {
    cls.code: cls
    for cls in (
        CodecError, VersionMismatch, FrameTooLarge, BadRequest, UnknownMethod, Busy,
        RequestTimeout, Cancelled, EngineDead, Unauthorized, ServiceClosed, ConnectionLost, InternalError,
        WeightMismatch, WeightGroupStale, NoWeightGroup, CanaryMismatch, EnginesQuarantined, NoEngine,
    )
}


def error_for(code: str, message: str, retryable: bool = False) -> TreadleError:
    """The exception instance for a wire error code (unknown codes become ``InternalError``)."""
    cls = ERRORS.get(code, InternalError)
    if cls is InternalError and code != "internal":
        message = f"[{code}] {message}"
    return cls(message, retryable=retryable)
