"""The daemon end to end over ZeroMQ and HTTP: OpenRLHF reward files unchanged, misbehaving
functions failing only their samples, sandbox escapes with the daemon still serving, CURVE."""

from __future__ import annotations

import os

import pytest
import requests

from treadle.common.config import ConfigError
from treadle.common.records import same
from treadle.common.rpc import generate_keys, load_client_keys
from treadle.rewards.client import HttpRewardClient, SyncRewardClient
from treadle.rewards.config import CodeConfig, HttpConfig, ServeConfig, WorkerConfig, ZmqConfig

# OpenRLHF's examples/python/reward_func.py, as its users write it: torch tensors, a print.
OPENRLHF_EXAMPLE = """
    import torch


    def reward_func(queries, prompts, labels, **kwargs):
        # queries is prompts + responses
        # labels is answers
        print(queries)
        reward = torch.randint(0, 2, (len(queries),)).float()

        # rewards is used the calculate the advantage (with format reward)
        # scores is used in dynamic filtering (0-1 reward)
        # extra_logs is used to log the info into wandb
        return {"rewards": reward, "scores": reward, "extra_logs": {"dummy_scores": reward}}
"""

# In the style of OpenRLHF's math_reward_func.py: lists in, a tensor and a scalar log out.
OPENRLHF_STYLE_EXACT = """
    import torch


    def reward_func(queries, prompts, labels, **kwargs):
        rewards = []
        for query, prompt, label in zip(queries, prompts, labels):
            response = query[len(prompt):] if prompt in query else query
            if label == "explode":
                raise RuntimeError("cannot grade this one")
            if label == "hang":
                import time
                time.sleep(3600)
            rewards.append(1.0 if response.strip() == label else 0.0)
        rewards_tensor = torch.tensor(rewards, dtype=torch.float)
        return {"rewards": rewards_tensor, "scores": rewards_tensor,
                "extra_logs": {"accuracy": rewards_tensor.mean()}}
"""


def test_openrlhf_example_file_runs_unchanged(serve, write_file):
    pytest.importorskip("torch")
    d = serve(functions=(str(write_file("reward_func.py", OPENRLHF_EXAMPLE)),), workers=WorkerConfig(num_workers=1))
    with SyncRewardClient(d.daemon.addresses.zmq) as client:
        res = client.score(["p1 r1", "p2 r2", "p3 r3"], ["p1", "p2", "p3"], ["a", "b", "c"])
    assert set(res.rewards.tolist()) <= {0.0, 1.0} and res.failed == [False] * 3
    assert res.scores.tolist() == res.rewards.tolist()
    assert res.extra_logs["reward_func/dummy_scores"] == res.rewards.tolist()
    comp = res.provenance["components"][0]
    assert comp["api"] == "openrlhf" and comp["function"] == "reward_func" and len(comp["sha256"]) == 64


def test_raising_and_hanging_samples_fail_alone_and_the_daemon_keeps_serving(serve, write_file):
    pytest.importorskip("torch")
    path = write_file("exact.py", OPENRLHF_STYLE_EXACT)
    d = serve(functions=(str(path),), workers=WorkerConfig(num_workers=1, timeout_s=3.0))
    prompts = ["Q1 ", "Q2 ", "Q3 "]
    queries = ["Q1 yes", "Q2 no", "Q3 yes"]
    with SyncRewardClient(d.daemon.addresses.zmq, timeout_s=60) as client:
        res = client.score(queries, prompts, ["yes", "explode", "no"])
        assert res.rewards.tolist() == [1.0, 0.0, 0.0] and res.failed == [False, True, False]
        assert "RuntimeError: cannot grade this one" in res.errors[1]
        assert res.extra_logs["exact/accuracy"] == [1.0, 0.0, 0.0] and res.extra_logs["reward_failed"][1] == 1.0
        hung = client.score(queries[:1], prompts[:1], ["hang"])
        assert hung.failed == [True] and "timed out after 3.0 s" in hung.errors[0]
        after = client.score(queries, prompts, ["yes", "yes", "yes"])  # a fresh worker took over
        assert after.rewards.tolist() == [1.0, 0.0, 1.0]
        assert client.health()["status"] == "ok"
    metrics = requests.get(d.daemon.addresses.http + "/metrics", timeout=10).text
    assert 'treadle_rewards_failed_samples_total{component="exact"} 2.0' in metrics
    assert 'treadle_rewards_worker_events_total{component="exact",event="timeout"} 1.0' in metrics


def test_sandbox_escapes_through_the_daemon_and_it_still_serves(serve):
    d = serve(functions=("code",), workers=WorkerConfig(num_workers=2, timeout_s=60.0),
              code=CodeConfig(cpu_s=1, wall_s=20, memory_mb=256, nproc=8, fsize_mb=1))
    escapes = {
        "network": "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\nprint(3)",
        "write": "open('/tmp/treadle-daemon-escape.txt', 'w').write('x')\nprint(3)",
        "fork_bomb": "import os\nwhile True:\n    os.fork()",
        "loop": "while True:\n    pass",
        "memory": "x = bytearray(1 << 30)\nprint(3)",
        "honest": "a, b = map(int, input().split())\nprint(a + b)",
    }
    label = {"tests": [{"input": "1 2\n", "output": "3\n"}]}
    queries = [f"```python\n{code}\n```" for code in escapes.values()]
    with SyncRewardClient(d.daemon.addresses.zmq, timeout_s=120) as client:
        res = client.score(queries, [""] * len(queries), [label] * len(queries))
        assert res.rewards.tolist() == [0, 0, 0, 0, 0, 1.0] and res.failed == [False] * len(queries)
        assert not os.path.exists("/tmp/treadle-daemon-escape.txt")
        assert res.extra_logs["code/limit_hits"][3] == 1.0  # the loop hit the CPU limit
        assert client.health()["status"] == "ok"
        again = client.score(queries[-1:], [""], [label])
        assert again.rewards.tolist() == [1.0]
    sandbox = res.provenance["components"][0]["sandbox"]
    assert sandbox["cpu_s"] == 1 and sandbox["isolation"] in ("namespaces", "rlimits")


def test_same_service_over_zeromq_and_http_with_replay(serve):
    d = serve(functions=("math",), workers=WorkerConfig(num_workers=1))
    q, p, lab = ["x \\boxed{4}", "x \\boxed{5}"], ["x ", "x "], ["4", "4"]
    with SyncRewardClient(d.daemon.addresses.zmq) as z:
        r_zmq = z.score(q, p, lab, key="step-7")
        r_replay = z.score(q, p, lab, key="step-7")
    r_http = HttpRewardClient(d.daemon.addresses.http).score(q, p, lab, key="step-7")
    assert r_zmq.rewards.tolist() == [1.0, 0.0]
    assert same(r_zmq, r_replay)
    assert r_http.rewards.tolist() == r_zmq.rewards.tolist() and r_http.provenance == r_zmq.provenance


def test_curve_keys_on_zeromq(serve, tmp_path):
    generate_keys(tmp_path)
    d = serve(functions=("format",), zmq=ZmqConfig(endpoint="tcp://127.0.0.1:0", curve_dir=str(tmp_path)),
              http=HttpConfig(port=None))
    with SyncRewardClient(d.daemon.addresses.zmq, curve=load_client_keys(tmp_path)) as client:
        assert client.score(["<think>a</think><answer>b</answer>"]).rewards.tolist() == [1.0]


@pytest.mark.parametrize("fields, match", [
    (dict(), "nothing to serve"),
    (dict(functions=("math",), weights=(1.0, 2.0)), "--weights has 2 values"),
    (dict(functions=("math",), http=HttpConfig(host="0.0.0.0")), "without --http.token"),
    (dict(functions=("math",), zmq=ZmqConfig(endpoint="tcp://0.0.0.0:5555")), "without --zmq.curve_dir"),
    (dict(functions=("math",), http=HttpConfig(port=None), zmq=ZmqConfig(endpoint=None)), "both servers are off"),
])
def test_unsafe_or_empty_configs_are_refused(fields, match):
    with pytest.raises(ConfigError, match=match):
        ServeConfig(**fields)
    ServeConfig(functions=("math",), http=HttpConfig(host="0.0.0.0", token="t"))  # with a token it is fine
