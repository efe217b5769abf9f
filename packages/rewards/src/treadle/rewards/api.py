"""The reward-function API: treadle's typed form and OpenRLHF's ``reward_func`` form.

Two kinds of function are accepted, sync or ``async``:

- **OpenRLHF's** (a user's file runs unchanged)::

      def reward_func(queries, prompts, labels, **kwargs):
          return {"rewards": r, "scores": s, "extra_logs": {"acc": a}}

  ``queries`` are prompt + response texts, ``prompts`` the prompt texts, ``labels`` the
  dataset's reference answers. ``rewards`` (required) and ``scores`` are a torch tensor, a numpy
  array or a list of N numbers; ``extra_logs`` values are per-sample (N numbers) or one scalar,
  which is repeated N times. A bare tensor/list instead of a dict is taken as the rewards.
- **native**: ``fn(batch: RewardBatch) -> RewardOutput``, marked with ``@native``; it may fail
  single samples (``RewardOutput.failed``) instead of raising for the whole batch.

``normalize_output`` turns either result into a checked ``RewardOutput`` (N finite floats; a
non-finite reward fails its sample). Not here: running functions in worker processes
(``workers``), loading them from files (``loader``), combining several (``service``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def response_of(query: str, prompt: str) -> str:
    """The response part of ``query``: what follows ``prompt`` when the query starts with it."""
    return query[len(prompt):] if prompt and query.startswith(prompt) else query


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardBatch:
    """N samples to score; every list has N entries."""

    queries: list[str]
    """Prompt + response text of each sample."""
    prompts: list[str]
    """Prompt text of each sample ("" when the caller sent none)."""
    labels: list[Any]
    """Reference answer / label of each sample (None when the caller sent none)."""

    def __post_init__(self) -> None:
        n = len(self.queries)
        if len(self.prompts) != n or len(self.labels) != n:
            raise ValueError(f"RewardBatch: {n} queries but {len(self.prompts)} prompts and {len(self.labels)} labels")

    def __len__(self) -> int:
        return len(self.queries)

    @property
    def responses(self) -> list[str]:
        """Each query with its prompt removed."""
        return [response_of(q, p) for q, p in zip(self.queries, self.prompts, strict=True)]

    def select(self, index: Sequence[int]) -> RewardBatch:
        """The samples at ``index``, in that order."""
        return RewardBatch(queries=[self.queries[i] for i in index], prompts=[self.prompts[i] for i in index],
                           labels=[self.labels[i] for i in index])


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardOutput:
    """What a reward function gives for a batch of N samples."""

    rewards: list[float]
    """[N] reward used for training (0.0 where the sample failed)."""
    scores: list[float] | None = None
    """[N] verifier score (filtering, pass@k); None: same as rewards."""
    extra_logs: dict[str, list[float]] = field(default_factory=dict)
    """name -> [N] per-sample metrics."""
    failed: list[bool] = field(default_factory=list)
    """[N] True where this function could not score the sample; empty: none failed."""
    errors: list[str] = field(default_factory=list)
    """[N] why each failed sample failed ("" elsewhere); empty when none failed."""

    def __post_init__(self) -> None:
        n = len(self.rewards)
        if self.scores is not None and len(self.scores) != n:
            raise ValueError(f"RewardOutput: {n} rewards but {len(self.scores)} scores")
        for k, v in self.extra_logs.items():
            if len(v) != n:
                raise ValueError(f"RewardOutput: {n} rewards but extra_logs[{k!r}] has {len(v)} values")
        for name in ("failed", "errors"):
            got = len(getattr(self, name))
            if got not in (0, n):
                raise ValueError(f"RewardOutput: {n} rewards but {got} {name}")

    @classmethod
    def failure(cls, n: int, message: str) -> RewardOutput:
        """Every one of ``n`` samples failed with ``message``."""
        return cls(rewards=[0.0] * n, failed=[True] * n, errors=[message] * n)

    def is_failed(self, i: int) -> bool:
        return bool(self.failed) and self.failed[i]


def native(fn: F | None = None, *, version: str = "1") -> Any:
    """Mark ``fn(batch: RewardBatch) -> RewardOutput`` as a native reward function.

    ``version`` goes into every result's provenance: bump it when the function's behaviour
    changes, so replayed runs can tell. Usable bare (``@native``) or with arguments.
    """
    def mark(f: F) -> F:
        f.__treadle_native__ = True  # type: ignore[attr-defined]
        f.__treadle_version__ = version  # type: ignore[attr-defined]
        return f

    return mark(fn) if fn is not None else mark


def is_native(fn: Any) -> bool:
    """True for functions marked with ``@native``."""
    return bool(getattr(fn, "__treadle_native__", False))


def _number(x: Any, where: str) -> float:
    if hasattr(x, "item"):  # numpy / torch scalars and 0-d arrays
        x = x.item()
    if isinstance(x, bool):
        return float(x)
    if not isinstance(x, (int, float)):
        raise TypeError(f"{where}: expected a number, got {type(x).__name__} {str(x)[:80]}")
    return float(x)


def to_floats(value: Any, n: int, where: str, *, broadcast: bool = False) -> list[float]:
    """``value`` (tensor, array, list, or a scalar when ``broadcast``) as N Python floats."""
    if hasattr(value, "detach"):  # torch: leave the graph, come to the CPU
        value = value.detach().cpu()
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        if broadcast:
            return [_number(value, where)] * n
        raise TypeError(f"{where}: expected {n} numbers (tensor or list), got {type(value).__name__}")
    if len(value) != n:
        raise ValueError(f"{where}: expected {n} values (one per query), got {len(value)}")
    out = []
    for i, x in enumerate(value):
        if isinstance(x, (list, tuple)):
            raise TypeError(f"{where}[{i}] is a sequence: per-token rewards are not supported, give one number per sample")
        out.append(_number(x, f"{where}[{i}]"))
    return out


def _fail_non_finite(out: RewardOutput) -> RewardOutput:
    bad = [not math.isfinite(r) for r in out.rewards]
    if not any(bad):
        return out
    failed = [f or b for f, b in zip(out.failed or [False] * len(bad), bad, strict=True)]
    errors = [(e or f"non-finite reward {r}") if b else e
              for e, b, r in zip(out.errors or [""] * len(bad), bad, out.rewards, strict=True)]
    rewards = [0.0 if b else r for r, b in zip(out.rewards, bad, strict=True)]
    return RewardOutput(rewards=rewards, scores=out.scores, extra_logs=out.extra_logs, failed=failed, errors=errors)


def normalize_output(out: Any, n: int, where: str = "reward function") -> RewardOutput:
    """Check and convert what a reward function returned for ``n`` samples into a ``RewardOutput``.

    Raises ``TypeError`` / ``ValueError`` naming what was wrong (the caller fails the batch).
    """
    if isinstance(out, RewardOutput):
        if len(out.rewards) != n:
            raise ValueError(f"{where} returned {len(out.rewards)} rewards for {n} samples")
        return _fail_non_finite(out)
    if not isinstance(out, dict):
        return _fail_non_finite(RewardOutput(rewards=to_floats(out, n, f"{where} result")))
    if "rewards" not in out:
        raise ValueError(f"{where} returned a dict without 'rewards' (keys: {sorted(out)[:10]})")
    rewards = to_floats(out["rewards"], n, f"{where}: rewards")
    scores = None if out.get("scores") is None else to_floats(out["scores"], n, f"{where}: scores")
    logs = out.get("extra_logs") or {}
    if not isinstance(logs, dict):
        raise TypeError(f"{where}: extra_logs must be a dict, got {type(logs).__name__}")
    extra = {str(k): to_floats(v, n, f"{where}: extra_logs[{k!r}]", broadcast=True) for k, v in logs.items()}
    return _fail_non_finite(RewardOutput(rewards=rewards, scores=scores, extra_logs=extra))


def concat_outputs(outputs: list[RewardOutput]) -> RewardOutput:
    """Concatenate outputs of consecutive slices; extra_logs missing in a slice read 0.0 there."""
    keys = sorted({k for o in outputs for k in o.extra_logs})
    rewards, scores, failed, errors = [], [], [], []
    logs: dict[str, list[float]] = {k: [] for k in keys}
    any_scores = any(o.scores is not None for o in outputs)
    for o in outputs:
        n = len(o.rewards)
        rewards += o.rewards
        scores += o.scores if o.scores is not None else o.rewards
        failed += o.failed or [False] * n
        errors += o.errors or [""] * n
        for k in keys:
            logs[k] += o.extra_logs.get(k, [0.0] * n)
    return RewardOutput(rewards=rewards, scores=scores if any_scores else None, extra_logs=logs,
                        failed=failed if any(failed) else [], errors=errors if any(failed) else [])
