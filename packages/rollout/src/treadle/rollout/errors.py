"""Errors the rollout daemon names, and how a client recognises them after the wire.

They travel as the standard codes of ``treadle.common.errors`` (``bad_request``, ``internal``),
so any treadle client gets a sensible exception; the message starts with a fixed tag, and
``refine`` turns an exception carrying that tag back into the specific class (each class
subclasses the standard one, so ``except BadRequest`` still catches ``WeightGroupStale``).

What this module does not do: import anything heavy (the client uses it).
"""

from __future__ import annotations

from treadle.common.errors import BadRequest, InternalError, TreadleError


class WeightGroupStale(BadRequest):
    """The pool's membership changed since the weight group was built: nothing was sent.

    Rebuild it: close the sender's group, then ``join_weight_group`` again (the world size is
    in the reply) and resend the update.
    """

    tag = "weight group is stale"


class HeaderUnknown(BadRequest):
    """A weight update left its header out (``WeightUpdate.header_kept``) and the engine holds
    another one (or none: it restarted): nothing was touched. Send it again with the header."""

    tag = "weight header not held"


class EnginesQuarantined(InternalError):
    """The update loaded, but some engines failed its canary; they take no work until a later
    update passes on them (or they are restarted). The message names them and the differences."""

    tag = "canary mismatch, engines quarantined"


class NoEngine(TreadleError):
    """No engine could serve the request within ``--route_timeout_s`` (all down, quarantined,
    behind on weights or draining)."""

    code = "engine_dead"
    retryable = True
    tag = "no engine can serve"


_TAGGED = (WeightGroupStale, HeaderUnknown, EnginesQuarantined, NoEngine)


def is_canary(exc: BaseException) -> bool:
    """An engine's answer to a weight load that says its canary differed (it loaded, and is
    quarantined by the front end) rather than that the load failed."""
    return isinstance(exc, InternalError) and "canary" in exc.message


def tagged(cls: type[TreadleError], detail: str) -> TreadleError:
    """An instance of ``cls`` whose message starts with its tag (so ``refine`` can find it)."""
    return cls(f"{cls.tag}: {detail}")  # type: ignore[attr-defined]


def refine(exc: BaseException) -> BaseException:
    """The specific rollout error for a generic one from the wire (else ``exc`` itself)."""
    if not isinstance(exc, TreadleError):
        return exc
    for cls in _TAGGED:
        if exc.code == cls.code and exc.message.startswith(cls.tag):  # type: ignore[attr-defined]
            return cls(exc.message, retryable=exc.retryable)
    return exc
