"""Several reward sources as one (``--reward.remote_url a,b,...``; ``treadle.agents.rewards``).

``sum`` and ``mean`` score every sample with every source and combine them (OpenRLHF's
``reward_fn``, ``torch.stack(rewards).sum(0)``, combined its sources up to 0.6.2); ``spread``
deals the samples out to replicas of one reward (OpenRLHF's URL list since 0.6.3). Real function
files and a real ``treadle-rewards`` daemon (ZeroMQ and HTTP) on loopback, plus fakes that
record which sample each source saw.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from treadle.agents.rewards import (
    CombinedReward,
    DaemonReward,
    FunctionReward,
    HttpReward,
    RewardFailed,
    Score,
    combine,
    reward_sources,
)

# reward 1.0, score 0.5, logs acc=1 / reward 0.25 (no score: the score is the reward), logs acc=0 and len
ONE = '''
def reward_func(queries, prompts, labels):
    return {"rewards": [1.0] * len(queries), "scores": [0.5] * len(queries), "extra_logs": {"acc": [1.0]}}
'''
QUARTER = '''
def reward_func(queries, prompts, labels):
    return {"rewards": [0.25] * len(queries), "extra_logs": {"acc": [0.0], "len": [float(len(queries[0]))]}}
'''


@pytest.fixture
def files(tmp_path: Path) -> tuple[str, str]:
    (tmp_path / "one.py").write_text(ONE)
    (tmp_path / "quarter.py").write_text(QUARTER)
    return str(tmp_path / "one.py"), str(tmp_path / "quarter.py")


def test_combine_by_hand() -> None:
    a = Score(reward=1.0, score=0.5, extra_logs={"acc": 1.0, "only_a": 7.0})
    b = Score(reward=0.25, score=0.25, extra_logs={"acc": 0.0})
    s = combine([a, b], "sum")
    assert (s.reward, s.score) == (1.25, 0.75)  # 1.0 + 0.25, 0.5 + 0.25
    assert s.extra_logs == {"reward/source0": 1.0, "score/source0": 0.5, "reward/source1": 0.25, "score/source1": 0.25,
                            "acc/source0": 1.0, "acc/source1": 0.0, "only_a": 7.0}  # a name two gave: per source
    m = combine([a, b], "mean")
    assert (m.reward, m.score) == (0.625, 0.375)  # 1.25 / 2, 0.75 / 2


def test_function_files_and_a_daemon_over_zmq_and_http_summed(aio, files) -> None:
    from treadle.rewards.config import HttpConfig, ServeConfig, ZmqConfig
    from treadle.rewards.daemon import DaemonThread

    one, quarter = files
    d = DaemonThread(ServeConfig(functions=(quarter,), http=HttpConfig(port=0),
                                 zmq=ZmqConfig(endpoint="tcp://127.0.0.1:0")))
    addrs = d.start()
    src = reward_sources([one, addrs.zmq, addrs.http + "/get_reward"], reduce="sum")
    try:
        assert isinstance(src, CombinedReward)
        assert [type(s) for s in src.sources] == [FunctionReward, DaemonReward, HttpReward]
        s = aio(src.score("q:abc", "q:", "L"))
    finally:
        aio(src.close())
        d.stop()
    assert s.reward == pytest.approx(1.5)  # 1.0 + 0.25 + 0.25
    assert s.score == pytest.approx(1.0)  # 0.5 + 0.25 + 0.25 (the quarter file gives no score: its reward)
    assert [s.extra_logs[f"reward/source{i}"] for i in range(3)] == [1.0, 0.25, 0.25]
    assert [s.extra_logs[f"score/source{i}"] for i in range(3)] == [0.5, 0.25, 0.25]
    # the daemon names its logs by component (quarter/acc) and adds reward_failed; both daemon
    # sources give each name, so each goes per source; the file's acc is the only plain "acc"
    assert s.extra_logs["acc"] == 1.0 and s.extra_logs["quarter/acc/source1"] == 0.0
    assert s.extra_logs["quarter/len/source1"] == s.extra_logs["quarter/len/source2"] == 5.0  # len("q:abc")
    assert s.extra_logs["reward_failed/source2"] == 0.0


def test_mean_of_two_files(aio, files) -> None:
    src = reward_sources(list(files), reduce="mean")
    s = aio(src.score("x", "", None))
    assert (s.reward, s.score) == (0.625, 0.375)  # (1.0 + 0.25) / 2, (0.5 + 0.25) / 2
    assert s.extra_logs["len"] == 1.0  # only the quarter file logs len: kept as named


class Recording:
    def __init__(self, reward: float, fail: bool = False) -> None:
        self.seen: list[str] = []
        self.reward, self.fail, self.closed = reward, fail, False

    async def score(self, query: str, prompt: str, label: Any) -> Score:
        self.seen.append(query)
        if self.fail:
            raise RewardFailed("judge down")
        return Score(reward=self.reward, score=self.reward)

    async def close(self) -> None:
        self.closed = True


def test_spread_deals_samples_to_replicas_in_turn(aio) -> None:
    a, b = Recording(1.0), Recording(2.0)
    src = CombinedReward([a, b], reduce="spread")
    got = [aio(src.score(f"q{k}", "", None)).reward for k in range(5)]
    assert got == [1.0, 2.0, 1.0, 2.0, 1.0] and a.seen == ["q0", "q2", "q4"] and b.seen == ["q1", "q3"]
    assert aio(src.score("q5", "", None)).extra_logs == {}  # nothing combined: the replica's own score
    aio(src.close())
    assert a.closed and b.closed


def test_one_failing_source_fails_the_sample_naming_it(aio) -> None:
    ok, bad = Recording(1.0), Recording(0.0, fail=True)
    src = CombinedReward([ok, bad], reduce="sum")
    with pytest.raises(RewardFailed, match=r"reward source 1: judge down"):
        aio(src.score("q", "", None))
    assert ok.seen == bad.seen == ["q"]  # both were asked, at once


def test_one_reference_is_the_plain_source(files) -> None:
    assert isinstance(reward_sources([files[0]]), FunctionReward)
    with pytest.raises(ValueError, match="two or more"):
        CombinedReward([Recording(1.0)])
    with pytest.raises(ValueError, match="no reward source"):
        reward_sources([])
