"""The HTTP server driven by real HTTP clients, with OpenRLHF's request and response handling."""

from __future__ import annotations

import pytest
import requests

from treadle.rewards.client import HttpRewardClient
from treadle.rewards.config import HttpConfig

Q = ["Q: half? A: <think>...</think><answer>\\boxed{0.5}</answer>", "Q: half? A: <think></think>\\boxed{2}"]
P = ["Q: half? A: ", "Q: half? A: "]
L = ["\\frac{1}{2}", "\\frac{1}{2}"]


def openrlhf_request_api_wrapper(url: str, data: dict) -> dict:
    """What OpenRLHF's remote_rm_utils.request_api_wrapper does with --remote_rm_url."""
    response = requests.post(url=url, json=data, headers={"Content-Type": "application/json"}, timeout=180)
    response.raise_for_status()
    return response.json()


@pytest.fixture(scope="module")
def daemon():
    from treadle.rewards.config import ServeConfig, ZmqConfig
    from treadle.rewards.daemon import DaemonThread

    d = DaemonThread(ServeConfig(functions=("math", "format"), weights=(1.0, 0.5), http=HttpConfig(port=0),
                                 zmq=ZmqConfig(endpoint=None)))
    d.start()
    yield d
    d.stop()


def test_openrlhf_client_gets_rewards_scores_and_extra_logs(daemon):
    torch = pytest.importorskip("torch")
    url = daemon.daemon.addresses.http + "/get_reward"
    # OpenRLHF sends micro-batches to the server and concatenates what comes back:
    infos = [openrlhf_request_api_wrapper(url, {"query": Q[i:i + 1], "prompts": P[i:i + 1], "labels": L[i:i + 1]})
             for i in range(2)]
    assert set(infos[0]) == {"rewards", "scores", "extra_logs"}
    rewards = torch.cat([torch.as_tensor(info["rewards"]) for info in infos], dim=0)
    scores = torch.cat([torch.as_tensor(info["scores"]) for info in infos], dim=0)
    logs = {k: torch.cat([torch.as_tensor(info["extra_logs"][k]) for info in infos], dim=0)
            for k in infos[0]["extra_logs"]}
    # math right + format ok (0.5) for the first; wrong with no <answer> tag for the second
    assert rewards.tolist() == [1.5, 0.0] and scores.tolist() == [1.0, 0.0]
    assert logs["math/correct"].tolist() == [1.0, 0.0] and logs["reward_failed"].tolist() == [0.0, 0.0]


def test_v1_route_client_health_info_and_metrics(daemon):
    base = daemon.daemon.addresses.http
    client = HttpRewardClient(base)
    res = client.score(Q, P, L, key="replay-me")
    assert res.rewards.tolist() == [1.5, 0.0] and res.failed == [False, False]
    assert [c["name"] for c in res.provenance["components"]] == ["math", "format"]
    again = client.score(Q, P, L, key="replay-me")
    assert again.rewards.tolist() == res.rewards.tolist() and again.provenance == res.provenance
    assert client.health()["status"] == "ok"
    assert requests.get(base + "/info", timeout=10).json()["components"][1]["weight"] == 0.5
    metrics = requests.get(base + "/metrics", timeout=10).text
    assert 'treadle_rewards_requests_total{transport="http"}' in metrics
    assert "treadle_rewards_cache_hits_total 1.0" in metrics


@pytest.mark.parametrize("body, status", [
    ({"prompts": []}, 400), ({"query": "not a list"}, 400), ({"query": ["a"], "prompts": ["1", "2"]}, 400),
    ({"query": ["a"], "labels": [{"answer": [1, 2]}]}, 200),
])
def test_bad_bodies_get_400_with_the_reason(daemon, body, status):
    r = requests.post(daemon.daemon.addresses.http + "/get_reward", json=body, timeout=10)
    assert r.status_code == status
    if status == 400:
        assert r.json()["error"]
    r = requests.post(daemon.daemon.addresses.http + "/get_reward", data=b"{not json", timeout=10)
    assert r.status_code == 400


def test_reusing_a_key_for_other_content_is_refused(daemon):
    url = daemon.daemon.addresses.http + "/v1/reward"
    assert requests.post(url, json={"query": Q[:1], "key": "k2"}, timeout=10).status_code == 200
    r = requests.post(url, json={"query": Q[1:], "key": "k2"}, timeout=10)
    assert r.status_code == 400 and "different request" in r.json()["error"]


def test_bearer_token(serve):
    d = serve(functions=("format",), http=HttpConfig(port=0, token="s3cret"))
    base = d.daemon.addresses.http
    body = {"query": Q, "prompts": P, "labels": L}
    assert requests.post(base + "/get_reward", json=body, timeout=10).status_code == 401
    wrong = requests.post(base + "/get_reward", json=body, headers={"Authorization": "Bearer nope"}, timeout=10)
    assert wrong.status_code == 401 and "Bearer" in wrong.headers["WWW-Authenticate"]
    ok = requests.post(base + "/get_reward", json=body, headers={"Authorization": "Bearer s3cret"}, timeout=10)
    assert ok.status_code == 200 and len(ok.json()["rewards"]) == 2
    # OpenRLHF's client cannot set headers: the token may ride in the URL instead
    assert openrlhf_request_api_wrapper(base + "/get_reward?access_token=s3cret", body)["rewards"]
    assert requests.get(base + "/metrics", timeout=10).status_code == 401
    assert requests.get(base + "/health", timeout=10).status_code == 200  # health stays open
    assert HttpRewardClient(base, token="s3cret").score(Q, P, L).rewards.shape == (2,)


def test_http_server_refuses_open_binds_without_a_token():
    import asyncio

    from treadle.common.rpc import InsecureEndpoint
    from treadle.rewards.http_server import HttpServer

    server = HttpServer(service=None)  # type: ignore[arg-type]  (never reached)
    with pytest.raises(InsecureEndpoint):
        asyncio.run(server.start("0.0.0.0", 0))
