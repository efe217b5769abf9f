"""``torch.compile`` with an eager fall-back: a function compiled on first use that runs
uncompiled from the first failure to compile on, after one warning (no Triton, no compiler, an
operation the compiler does not support: the same math, unfused). Several wrappers can share one
failure (the decoder layers of a model: one failed compile stops the others' attempts).

Used by the log-prob chunks (``ops.logprobs``) and the compiled decoder layers
(``strategy.deepspeed.compile_layers``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from treadle.common.log import get_logger

log = get_logger(__name__)


class CompiledOrEager:
    """``fn`` through ``torch.compile(fn, **compile_kw)``; ``fn`` itself from the first exception
    of ``catch`` on (in this wrapper or any sharing ``failed``), after a warning naming ``what``
    (and ``hint``). An out-of-memory error is the step's, not the compiler's: raised as it is."""

    __slots__ = ("catch", "compiled", "failed", "fn", "hint", "what")

    def __init__(self, fn: Callable[..., Any], what: str, *, catch: tuple[type[Exception], ...] = (Exception,),
                 failed: list[bool] | None = None, hint: str = "", **compile_kw: Any) -> None:
        self.fn, self.what, self.catch, self.hint = fn, what, catch, hint
        self.failed = failed if failed is not None else [False]
        self.compiled: Callable[..., Any] | None = torch.compile(fn, **compile_kw)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is not None and not self.failed[0]:
            try:
                return self.compiled(*args, **kwargs)
            except torch.OutOfMemoryError:
                raise
            except self.catch as e:
                log.warning("%s run eagerly: torch.compile failed (%s: %s)%s", self.what, type(e).__name__,
                            str(e)[:500], self.hint)
                self.failed[0], self.compiled = True, None
        return self.fn(*args, **kwargs)
