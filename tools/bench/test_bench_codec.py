"""Benchmark 1 (foundation): encode+decode of 512 trajectories x 2,048 tokens.

treadle's codec vs pickle protocol 5 with out-of-band buffers vs plain msgpack (arrays inline as
bytes). Same data, same run; `make bench` prints the ratios (tools/bench/report.py).
"""

from __future__ import annotations

import pickle

import msgpack
import numpy as np
import pytest

from treadle.common.codec import decode, encode
from treadle.common.records import Trajectory, TrajectoryBatch

pytestmark = pytest.mark.bench
N, T, P = 512, 2048, 256


@pytest.fixture(scope="module")
def batch() -> TrajectoryBatch:
    rng = np.random.default_rng(0)
    trajs = [
        Trajectory(
            prompt_token_ids=rng.integers(0, 32000, P, dtype=np.int32),
            response_token_ids=rng.integers(0, 32000, T, dtype=np.int32),
            rollout_logprobs=-rng.random(T, dtype=np.float32),
            loss_mask=np.ones(T, np.uint8), reward=float(i % 2), uid=f"u{i}", group_id=f"g{i // 8}",
            min_policy_version=1, max_policy_version=1, info={"row": i},
        )
        for i in range(N)
    ]
    return TrajectoryBatch(trajectories=trajs, step=1)


def _info(benchmark, role: str, batch: TrajectoryBatch) -> None:
    benchmark.group = "codec: 512 trajectories x 2048 tokens, encode+decode"
    benchmark.extra_info["role"] = role
    benchmark.extra_info["bytes"] = sum(
        t.prompt_token_ids.nbytes + t.response_token_ids.nbytes + t.rollout_logprobs.nbytes + t.loss_mask.nbytes
        for t in batch.trajectories)


def test_treadle_codec(benchmark, batch):
    _info(benchmark, "treadle", batch)

    def run():
        return decode(encode(batch)).msg

    out = benchmark(run)
    assert len(out.trajectories) == N and np.array_equal(out.trajectories[7].response_token_ids,
                                                          batch.trajectories[7].response_token_ids)


def test_pickle5_out_of_band(benchmark, batch):
    _info(benchmark, "baseline", batch)

    def run():
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
        return pickle.loads(data, buffers=[b.raw() for b in buffers])

    out = benchmark(run)
    assert len(out.trajectories) == N


def test_plain_msgpack(benchmark, batch):
    _info(benchmark, "plain-msgpack", batch)
    arrays = ("prompt_token_ids", "response_token_ids", "rollout_logprobs", "loss_mask")
    dtypes = {"prompt_token_ids": np.int32, "response_token_ids": np.int32, "rollout_logprobs": np.float32,
              "loss_mask": np.uint8}

    def run():
        rows = [{**{k: getattr(t, k).tobytes() for k in arrays}, "reward": t.reward, "uid": t.uid,
                 "group_id": t.group_id, "info": t.info} for t in batch.trajectories]
        data = msgpack.packb({"step": batch.step, "trajectories": rows})
        back = msgpack.unpackb(data)
        return [Trajectory(**{**r, **{k: np.frombuffer(r[k], dtypes[k]) for k in arrays}})
                for r in back["trajectories"]]

    out = benchmark(run)
    assert len(out) == N
