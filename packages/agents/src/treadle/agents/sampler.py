"""One policy turn, token in and token out, through the rollout daemon's client.

``RolloutSampler.sample(prompt_ids, sampling, key=...)`` returns a ``Turn``: the sampled ids,
their logprobs and the weight version of every generate call that produced them. Two things
happen under the hood:

- retryable daemon errors are retried with exponential backoff (at most 1 s apart): ``Busy``
  (the pool is at its in-flight limit: the daemon answered, so it is back-pressure, not a fault)
  for as long as it lasts, the others (``EngineDead``, ``NoEngine``, timeouts) for at most
  ``retry_budget_s``, counted from the first of them (a round of more samples than
  ``--max_in_flight_samples`` failed every sample past the limit after 60 s);
- a sample aborted by a weight update (finish reason "abort", partial tokens kept) is resumed
  from its partial tokens on the new weights, so a turn may span two policy versions (the
  Trajectory's min/max policy version record it).

Anything with the same ``sample`` coroutine is a ``Sampler`` (tests use fakes for failure
injection). Not here: episodes (``executor``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import numpy as np

from treadle.common.errors import Busy, TreadleError
from treadle.common.records import GenerateResult, SamplingParams


@dataclass(frozen=True, slots=True, kw_only=True)
class Turn:
    """What the policy sampled for one prompt."""

    token_ids: np.ndarray
    """int32 [A]: sampled tokens, stop token included when one ended the turn."""
    logprobs: np.ndarray
    """float32 [A]: logprob of each token under the sampling distribution (0 if not returned)."""
    versions: tuple[int, ...]
    """Weight version of each generate call that contributed (usually one)."""
    finish_reason: str
    """The last call's finish reason: "stop", "length", "abort" (resumes exhausted), "error"."""
    top_token_ids: np.ndarray | None = None
    """int32 [A, k]: each token's k most likely alternatives when ``sampling.top_logprobs = k``."""
    top_logprobs: np.ndarray | None = None
    """float32 [A, k]: their logprobs, most likely first."""

    @property
    def stopped(self) -> bool:
        return self.finish_reason == "stop"


class Sampler(Protocol):
    async def sample(self, prompt_ids: np.ndarray, sampling: SamplingParams, *, key: str) -> Turn: ...


def with_max_tokens(sampling: SamplingParams, max_tokens: int) -> SamplingParams:
    """``sampling`` for one sample of at most ``max_tokens`` (min_tokens clipped to it)."""
    return msgspec.structs.replace(sampling, n=1, max_tokens=max_tokens,
                                   min_tokens=min(sampling.min_tokens, max_tokens))


def turn_of(results: list[GenerateResult]) -> Turn:
    """One ``Turn`` from consecutive results (an aborted sample and its resumptions)."""
    ids = [np.asarray(r.response_token_ids, dtype=np.int32) for r in results]
    lps = [np.zeros(i.shape[0], np.float32) if r.logprobs is None else np.asarray(r.logprobs, np.float32)
           for r, i in zip(results, ids, strict=True)]
    tops: dict[str, np.ndarray] = {}
    if all(r.top_token_ids is not None for r in results):
        tops = {"top_token_ids": np.concatenate([np.asarray(r.top_token_ids, np.int32) for r in results]),
                "top_logprobs": np.concatenate([np.asarray(r.top_logprobs, np.float32) for r in results])}
    return Turn(token_ids=np.concatenate(ids), logprobs=np.concatenate(lps),
                versions=tuple(int(r.weight_version) for r in results), finish_reason=results[-1].finish_reason,
                **tops)


class RolloutSampler:
    """``Sampler`` over a ``treadle.rollout.client.RolloutClient`` (shared by all episodes)."""

    def __init__(self, client: Any, *, retry_budget_s: float = 60.0, max_resumes: int = 4) -> None:
        self.client = client
        self.retry_budget_s = retry_budget_s
        self.max_resumes = max_resumes
        self.retries = 0  # retryable errors seen (a gauge of pool pressure)
        self.resumes = 0  # aborted samples resumed on new weights

    async def _generate(self, prompt_ids: np.ndarray, sampling: SamplingParams, key: str) -> GenerateResult:
        deadline = None  # set by the first retryable error other than Busy
        delay = 0.02
        while True:
            try:
                return (await self.client.generate(prompt_ids, sampling, key=key))[0]
            except TreadleError as e:
                if not e.retryable:
                    raise
                if not isinstance(e, Busy):
                    deadline = deadline or time.monotonic() + self.retry_budget_s
                    if time.monotonic() + delay > deadline:
                        raise
                self.retries += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def sample(self, prompt_ids: np.ndarray, sampling: SamplingParams, *, key: str) -> Turn:
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        results: list[GenerateResult] = []
        left = sampling.max_tokens
        for attempt in range(self.max_resumes + 1):
            res = await self._generate(prompt, with_max_tokens(sampling, left), f"{key}.{attempt}" if attempt else key)
            results.append(res)
            got = int(np.asarray(res.response_token_ids).shape[0])
            left -= got
            if res.finish_reason != "abort" or left <= 0:
                break
            self.resumes += 1  # weights changed mid-turn: continue the same turn on the new ones
            prompt = np.concatenate([prompt, np.asarray(res.response_token_ids, np.int32)])
        turn = turn_of(results)
        if turn.finish_reason == "abort" and left <= 0:
            turn = dataclasses.replace(turn, finish_reason="length")
        return turn
