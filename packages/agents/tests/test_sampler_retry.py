"""RolloutSampler's retries: Busy (the pool at its in-flight limit) is back-pressure and waits as long
as it lasts; the other retryable errors (an engine died, none left) get ``retry_budget_s``.

The client is a stand-in for ``treadle.rollout.client.RolloutClient`` (the neighbour of the thing
under test): it raises the errors it is given, then answers."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from treadle.agents.sampler import RolloutSampler
from treadle.common.errors import BadRequest, Busy, EngineDead
from treadle.common.records import GenerateResult, SamplingParams


class ScriptedClient:
    """Raises each error of ``errors`` on successive calls, then returns one finished sample."""

    def __init__(self, errors: list[Exception]) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def generate(self, prompt_ids, sampling, *, key):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        ids = np.array([5, 6], np.int32)
        return [GenerateResult(response_token_ids=ids, logprobs=np.zeros(2, np.float32), finish_reason="stop")]


def sample(sampler: RolloutSampler):
    return asyncio.run(sampler.sample(np.array([1, 2], np.int32), SamplingParams(max_tokens=4, logprobs=True), key="k"))


def test_busy_is_waited_out_past_the_retry_budget():
    client = ScriptedClient([Busy("full")] * 6)
    turn = sample(RolloutSampler(client, retry_budget_s=0.0))  # a budget of 0 would fail at the first other error
    assert turn.token_ids.tolist() == [5, 6] and client.calls == 7


def test_other_retryable_errors_get_the_budget_and_then_fail():
    client = ScriptedClient([Busy("full"), EngineDead("gone"), EngineDead("gone")])
    with pytest.raises(EngineDead, match="gone"):
        sample(RolloutSampler(client, retry_budget_s=0.0))
    assert client.calls == 2  # the Busy was retried, the first EngineDead was over budget


def test_a_request_error_is_not_retried():
    client = ScriptedClient([BadRequest("bad")])
    with pytest.raises(BadRequest):
        sample(RolloutSampler(client, retry_budget_s=60.0))
    assert client.calls == 1
