"""Start a handler coroutine at once, inside the caller; hand it to a task only if it waits.

Most RPC handlers (health, lookups, an echo) finish without ever waiting, and for them a task
per request costs more than the work: on Python 3.11 creating, registering, scheduling and
finishing one takes about 3 us, and its first step waits for the next loop turn.
``Starter.start`` runs the coroutine's first step right away instead. If the step finishes, the
caller gets the result or the exception at once; if it suspends, a task carries it on from
there, as if it had been started by ``create_task``.

What stays as with a task from the start (Python 3.12's eager tasks work the same way):

- ``asyncio.current_task()`` during the first step is already the task that will carry the
  coroutine on if it suspends: a spare task, started in advance and idle, is lent as the current
  task and kept by a coroutine that suspends. ``asyncio.timeout``, ``TaskGroup`` and libraries
  that cancel "the current task" therefore bind to the right one.
- Every step runs in one copy of the caller's context (what ``create_task`` would have copied).
- Cancelling the carrying task cancels the coroutine where it waits, also before the task ran.

What differs: the first step runs before ``start`` returns, inside the caller's call stack, and
coroutines that finish at once share the idle spare as their ``current_task()``. When no started
spare is at hand (just after one was kept), ``start`` falls back to a plain ``create_task``.

Not here: what is run (``server``).
"""

from __future__ import annotations

import asyncio
import contextvars
import types
from collections.abc import Callable, Coroutine, Generator
from typing import Any

# Python 3.12+ swaps the current task with one call (what its own eager tasks use). Before
# that, the current task of each loop lives in one dict, which ``_enter_task``/``_leave_task``
# (five calls per swap) only check and write: writing it directly costs a third of that.
_swap_current_task = getattr(asyncio.tasks, "_swap_current_task", None)
_current_tasks: dict[Any, Any] = (
    {} if _swap_current_task is not None else asyncio.tasks._current_tasks)  # type: ignore[attr-defined]
_copy_context = contextvars.copy_context


Then = Callable[..., Coroutine[Any, Any, None]]
"""``then(awaitable, *args)``: the coroutine that awaits the handler and deals with its outcome."""


class Starter:
    """Eager first steps for one event loop; see the module docstring."""

    __slots__ = ("_loop", "_name", "_spare", "_job", "_ready")

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str) -> None:
        self._loop = loop
        self._name = name
        self._spare: asyncio.Task[None] | None = None
        self._job: asyncio.Future[tuple[Any, ...]] | None = None
        self._ready = False

    def start(self, coro: Coroutine[Any, Any, Any], then: Then,
              *args: Any) -> tuple[asyncio.Task[None] | None, Any]:
        """Run ``coro``'s first step now.

        Returns ``(None, result)`` when the step finished (and raises what it raised). When it
        suspended, returns ``(task, None)``: the task runs ``then(rest_of_coro, *args)``.
        """
        job, loop = self._job, self._loop
        if job is None or job.done() or not self._ready:
            if job is None or job.done():
                self._new_spare()
            return loop.create_task(then(coro, *args)), None
        spare = self._spare
        ctx = _copy_context()
        try:
            if _swap_current_task is not None:
                prev = _swap_current_task(loop, spare)
                try:
                    pending = ctx.run(coro.send, None)
                finally:
                    _swap_current_task(loop, prev)
            else:
                current = _current_tasks
                prev = current.get(loop)
                current[loop] = spare
                try:
                    pending = ctx.run(coro.send, None)
                finally:
                    if prev is None:
                        del current[loop]
                    else:
                        current[loop] = prev
        except StopIteration as done:
            return None, done.value
        self._job = None  # the spare is taken; the next start makes another
        if job.done():  # the step cancelled its own (the spare) task: go on in a new one, cancelled
            return loop.create_task(then(_resume(coro, ctx, pending, True), *args)), None
        job.set_result((then, coro, ctx, pending, args))
        return spare, None

    def close(self) -> None:
        """Cancel the idle spare (a spare that carries a coroutine is not idle any more)."""
        if self._job is not None and self._spare is not None:
            self._spare.cancel()
        self._job = self._spare = None

    def _new_spare(self) -> None:
        self._ready = False
        job = self._job = self._loop.create_future()
        self._spare = self._loop.create_task(self._carry(job), name=self._name)

    async def _carry(self, job: asyncio.Future[tuple[Any, ...]]) -> None:
        if self._job is job:
            self._ready = True  # waiting inside the try below: a cancel now reaches the work
        cancel = False
        try:
            then, coro, ctx, pending, args = await job
        except asyncio.CancelledError:
            if not job.done() or job.cancelled():
                raise  # cancelled while idle: the starter makes a new spare when it needs one
            then, coro, ctx, pending, args = job.result()
            cancel = True  # cancelled after it was handed work but before it ran
        await then(_resume(coro, ctx, pending, cancel), *args)


@types.coroutine
def _resume(coro: Coroutine[Any, Any, Any], ctx: contextvars.Context, pending: Any,
            cancel: bool) -> Generator[Any, Any, Any]:
    """Go on driving ``coro``, suspended on ``pending``, each step inside ``ctx``.

    The carrying task sees ``pending`` as what it waits on, so its cancel cancels that future
    and then throws into ``coro``, as for a task that had run ``coro`` from the start.
    """
    exc: BaseException | None = None
    if cancel and not (asyncio.isfuture(pending) and pending.cancel()):
        exc = asyncio.CancelledError()
    send, throw = coro.send, coro.throw
    while True:
        if exc is None:
            try:
                value = yield pending
            except GeneratorExit:
                ctx.run(coro.close)
                raise
            except BaseException as e:  # thrown in by the task: cancellation, a failed future
                exc = e
        try:
            if exc is None:
                pending = ctx.run(send, value)
            else:
                pending, exc = ctx.run(throw, exc), None
        except StopIteration as stop:
            return stop.value
