"""Remote rewards retry what may pass and give up on what won't (``treadle.agents.rewards``).

The daemon killed and restarted under a running trainer is `make chaos`'s test; here the retry
rule itself, against a real closed port and a real reward daemon with a real ZeroMQ socket.
"""

from __future__ import annotations

import socket
import time

import pytest

from treadle.agents.rewards import DaemonReward, HttpReward, RewardFailed, backoff_s, retrying
from treadle.common.errors import BadRequest, Busy


def test_backoff_doubles_up_to_the_cap() -> None:
    assert [backoff_s(a) for a in (1, 2, 3, 4, 5, 6)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]


def test_retrying_passes_after_retryable_errors_and_stops_at_others(aio) -> None:
    calls = []

    async def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise Busy("full")
        return "ok"

    assert aio(retrying(flaky, retry_s=30, what="x", retryable=lambda e: e.retryable)) == "ok"
    assert len(calls) == 3

    async def wrong():
        calls.append(1)
        raise BadRequest("label missing")

    calls.clear()
    with pytest.raises(RewardFailed, match=r"x \(not retryable\): BadRequest: label missing"):
        aio(retrying(wrong, retry_s=30, what="x", retryable=lambda e: e.retryable))
    assert len(calls) == 1


def test_retrying_gives_up_after_retry_s(aio) -> None:
    async def down():
        raise Busy("still down")

    t0 = time.monotonic()
    with pytest.raises(RewardFailed, match=r"after 2 attempt\(s\) over 1 s: Busy: still down"):
        aio(retrying(down, retry_s=1.0, what="x", retryable=lambda e: e.retryable))
    assert time.monotonic() - t0 < 10


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_http_reward_retries_a_refused_connection_then_fails_naming_it(aio) -> None:
    src = HttpReward(f"http://127.0.0.1:{_closed_port()}/get_reward", timeout_s=2, retry_s=1.0)
    try:
        with pytest.raises(RewardFailed, match=r"reward URL .* after 2 attempt\(s\).*ClientConnectorError"):
            aio(src.score("q", "p", "1"))
    finally:
        aio(src.close())


def test_daemon_reward_timeouts_are_retried_then_fail(aio) -> None:
    # nothing listens: every attempt times out (a killed daemon looks the same to the client)
    src = DaemonReward(f"tcp://127.0.0.1:{_closed_port()}", timeout_s=0.3, retry_s=1.0)
    try:
        with pytest.raises(RewardFailed, match=r"reward daemon .* attempt\(s\) over 1 s: RequestTimeout"):
            aio(src.score("q", "p", "1"))
    finally:
        aio(src.close())


def test_a_credentialed_reward_daemon_answers_the_trainers_keys_and_token_only(aio, tmp_path) -> None:
    """A reward daemon off loopback must run with CURVE (ZeroMQ) and a bearer token (HTTP); the
    trainer's ``--reward.curve_dir`` / ``--reward.token`` reach it through ``reward_source``."""
    from treadle.agents.rewards import reward_source
    from treadle.common.rpc import generate_keys
    from treadle.rewards.config import HttpConfig, ServeConfig, ZmqConfig
    from treadle.rewards.daemon import DaemonThread

    generate_keys(tmp_path)
    d = DaemonThread(ServeConfig(functions=("format",), http=HttpConfig(port=0, token="s3cret"),
                                 zmq=ZmqConfig(endpoint="tcp://127.0.0.1:0", curve_dir=str(tmp_path))))
    d.start()
    good = "<think>a</think><answer>b</answer>"
    zmq, url = d.daemon.addresses.zmq, f"{d.daemon.addresses.http}/get_reward"
    sources = {"zmq_keys": reward_source(zmq, curve_dir=str(tmp_path), timeout_s=30, retry_s=0),
               "zmq_none": reward_source(zmq, timeout_s=0.5, retry_s=0),
               "http_token": reward_source(url, token="s3cret", timeout_s=30, retry_s=0),
               "http_none": reward_source(url, timeout_s=30, retry_s=0)}
    try:
        assert aio(sources["zmq_keys"].score(good, "", None)).reward == 1.0
        assert aio(sources["http_token"].score(good, "", None)).reward == 1.0
        with pytest.raises(RewardFailed, match="RequestTimeout"):  # the CURVE handshake never completes
            aio(sources["zmq_none"].score(good, "", None))
        with pytest.raises(RewardFailed, match=r"not retryable.*401"):
            aio(sources["http_none"].score(good, "", None))
    finally:
        for src in sources.values():
            aio(src.close())
        d.stop()
