"""The gateway, driven by the official ``openai`` client: tool calls, token-exact sessions, drift."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import numpy as np
import openai
import pytest

from treadle.agents.api import Action, Episode
from treadle.agents.client import GatewayClient, GatewayError, SyncGatewayClient
from treadle.agents.envs import ArithmeticEnv, GuessingEnv, games
from treadle.agents.envs.arithmetic import CALCULATOR_TOOL, question
from treadle.agents.executor import ExecutorConfig, MultiTurnExecutor
from treadle.agents.gateway.config import GatewayConfig
from treadle.agents.tools import evaluate
from treadle.common.config import ConfigError
from treadle.common.records import SamplingParams

STOPS = {0, 2}


def oai(gw: Any, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def run_tool_agent(client: openai.OpenAI, session: str, expr: str, max_turns: int = 4) -> tuple[list[Any], list[dict]]:
    """A small tool-using agent: call the model; run its calculator calls; stop at a plain answer."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question(expr)}]
    replies = []
    for _ in range(max_turns):
        r = client.chat.completions.create(model="tiny", messages=messages, tools=[CALCULATOR_TOOL], temperature=0,
                                           max_tokens=64, logprobs=True,
                                           extra_body={"session_id": session, "return_token_ids": True})
        replies.append(r)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            value = evaluate(json.loads(call.function.arguments)["expression"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(value)})
    return replies, messages


def test_openai_client_tool_agent_and_stitched_trajectory(aio, gateway, chat, warm, sampler) -> None:
    replies, messages = run_tool_agent(oai(gateway), "agent-1", warm.ARITH_EXPR)
    first, second = replies
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content is None
    assert call.type == "function" and call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": warm.ARITH_EXPR}
    assert second.choices[0].message.content == f"<answer>{warm.ARITH_VALUE}</answer>"
    assert second.choices[0].finish_reason == "stop"
    assert "drift" not in (first.model_extra or {}) and "drift" not in (second.model_extra or {})
    assert first.model_extra["session_id"] == "agent-1" and first.model_extra["weight_version"] == 0

    [t] = SyncGatewayClient(gateway.url).finish("agent-1", reward=1.0, extra_logs={"calls": 1.0})
    assert (t.reward, t.score, t.uid, t.extra_logs) == (1.0, 1.0, "agent-1", {"calls": 1.0})
    assert t.info["drift"] == [] and t.info["turns"] == 2 and t.finish_reason == "stop"
    assert t.prompt_token_ids.tolist() == chat.prompt_ids(messages[:1], tools=[CALCULATOR_TOOL]).tolist()
    (a0, b0), (a1, b1) = t.info["spans"]
    resp = t.response_token_ids
    for (a, b), r in zip(t.info["spans"], replies, strict=True):  # one span per assistant turn, exact tokens
        assert resp[a:b].tolist() == r.choices[0].model_extra["token_ids"]
        assert t.loss_mask[a:b].all()
        np.testing.assert_allclose(t.rollout_logprobs[a:b], [c.logprob for c in r.choices[0].logprobs.content],
                                   atol=1e-6)
        assert r.usage.completion_tokens == b - a and r.usage.prompt_tokens == t.prompt_token_ids.shape[0] + a
    tool_obs = chat.observation_ids(messages[2:3], last_token=int(resp[b0 - 1]), stopped=True, tools=[CALCULATOR_TOOL])
    assert resp[b0:a1].tolist() == tool_obs.tolist() and not t.loss_mask[b0:a1].any() and b1 == resp.shape[0]

    # the same episode through the executor (greedy, same environment) gives the same tokens
    ep = Episode(prompt=messages[:1], label=warm.ARITH_VALUE, tools=[CALCULATOR_TOOL])
    ex = MultiTurnExecutor(env_factory=ArithmeticEnv, sampler=sampler, chat=chat,
                           sampling=SamplingParams(max_tokens=64, temperature=0.0), config=ExecutorConfig())
    e = aio(ex.run(ep))
    assert e.reward == 1.0 and e.response_token_ids.tolist() == resp.tolist() and e.loss_mask.tolist() == t.loss_mask.tolist()


def play_guessing_through_gateway(gw: Any, session: str, ep: Episode, seed: int) -> None:
    client = SyncGatewayClient(gw.url)
    env = GuessingEnv(max_turns=3)
    loop = __import__("asyncio").new_event_loop()
    messages = list(loop.run_until_complete(env.reset(ep)))
    for turn in range(3):
        r = client.chat(messages, session_id=session, max_tokens=6, seed=seed, return_token_ids=True)
        msg = r["choices"][0]["message"]
        ids = np.asarray(r["choices"][0]["token_ids"], np.int32)
        res = loop.run_until_complete(env.step(Action(text=msg["content"], token_ids=ids, finish_reason="stop",
                                                      turn=turn, stopped=int(ids[-1]) in STOPS)))
        messages += [msg, *res.observation]
        if res.done:
            break


def test_executor_and_gateway_agree_token_by_token(aio, gateway, sampler, chat) -> None:
    ep = games(1, seed=5)[0]
    ex = MultiTurnExecutor(env_factory=lambda: GuessingEnv(max_turns=3), sampler=sampler, chat=chat,
                           sampling=SamplingParams(max_tokens=6, seed=9), config=ExecutorConfig(max_turn_tokens=6))
    e = aio(ex.run(ep))
    play_guessing_through_gateway(gateway, "guess-1", ep, seed=9)
    [g] = SyncGatewayClient(gateway.url).trajectories("guess-1")
    for name in ("prompt_token_ids", "response_token_ids", "loss_mask"):
        assert getattr(g, name).tolist() == getattr(e, name).tolist(), name
    np.testing.assert_allclose(g.rollout_logprobs, e.rollout_logprobs, atol=1e-5)
    assert g.info["spans"] == e.info["spans"]


def test_drift_is_reported_and_recorded_tokens_kept(gateway, chat) -> None:
    client = SyncGatewayClient(gateway.url)
    messages = [{"role": "user", "content": "Say something."}]
    replies = []
    for turn in range(3):
        r = client.chat(messages, session_id="drift-1", max_tokens=8, seed=turn, return_token_ids=True)
        replies.append(r)
        # the agent hands the reply back reformatted (frameworks do): a leading space added, or the
        # reply's own leading whitespace dropped (one more space before a reply that starts with
        # spaces could tokenize to the same first tokens). The same turn for the conversation, but
        # the template now renders other tokens than the policy sampled, from the reply's first on
        sampled = r["choices"][0]["message"]["content"]
        content = sampled.lstrip() if sampled[:1].isspace() else " " + sampled
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "More."}]
    assert "drift" not in replies[0]
    drifts = [r["drift"] for r in replies[1:]]
    assert [d["kind"] for d in drifts] == ["render", "render"] and [d["turn"] for d in drifts] == [1, 2]
    [t] = client.trajectories("drift-1")
    assert t.info["drift"] == drifts and t.info["turns"] == 3
    p = t.prompt_token_ids.shape[0]
    for (a, b), r in zip(t.info["spans"], replies, strict=True):
        assert t.response_token_ids[a:b].tolist() == r["choices"][0]["token_ids"]  # never re-tokenized
    assert drifts[0]["at_token"] == p + t.info["spans"][0][0]  # where the first reply begins
    recorded = np.concatenate([t.prompt_token_ids, t.response_token_ids])
    rendered = chat.prompt_ids(messages[:3])
    at = drifts[0]["at_token"]
    assert recorded[:at].tolist() == rendered[:at].tolist() and recorded[at] != rendered[at]
    # the continuation after each reply is the template's closing + the new user turn, not a re-render
    (a0, b0), (a1, _) = t.info["spans"][:2]
    last = int(t.response_token_ids[b0 - 1])
    cont = chat.observation_ids(messages[2:3], last_token=last, stopped=last in STOPS)
    assert t.response_token_ids[b0:a1].tolist() == cont.tolist()


def test_history_edit_starts_a_new_segment(gateway) -> None:
    client = SyncGatewayClient(gateway.url)
    m = [{"role": "user", "content": "First question."}]
    r1 = client.chat(m, session_id="edit-1", max_tokens=4, seed=1)
    r2 = client.chat([{"role": "user", "content": "A different question."}, r1["choices"][0]["message"],
                      {"role": "user", "content": "and?"}], session_id="edit-1", max_tokens=4, seed=1)
    assert r2["drift"]["kind"] == "history" and r2["drift"]["at_message"] == 0
    ts = client.finish("edit-1", reward=0.5)
    assert [t.uid for t in ts] == ["edit-1", "edit-1.1"] and all(t.reward == 0.5 for t in ts)
    assert [t.info["turns"] for t in ts] == [1, 1] and ts[1].info["drift"][0]["kind"] == "history"
    with pytest.raises(GatewayError) as e:
        client.trajectories("edit-1")  # finish closed it
    assert e.value.status == 404


def test_session_without_id_and_async_client(aio, gateway) -> None:
    async def go() -> Any:
        async with GatewayClient(gateway.url) as gw:
            r = await gw.chat([{"role": "user", "content": "hi"}], max_tokens=3, seed=0)
            sid = r["session_id"]
            assert any(s["session_id"] == sid for s in await gw.sessions())
            [t] = await gw.trajectories(sid)
            await gw.delete(sid)
            assert all(s["session_id"] != sid for s in await gw.sessions())
            return r, t, await gw.models(), await gw.tokenize(prompt="<|im_start|>user\nhi"), await gw.health()

    r, t, models, ids, health = aio(go())
    assert t.response_token_ids.shape[0] == r["usage"]["completion_tokens"]
    assert models[0]["id"] == "tiny" and models[0]["max_model_len"] == 4096
    assert ids[0] == 1 and health["status"] == "ok" and health["rollout"]["status"] == "ok"


def post(url: str, body: Any, token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_token_errors_and_tokenize(start_gateway, chat) -> None:
    gw = start_gateway(token="s3cret", max_length=64, served_model_name="policy")
    with pytest.raises(openai.AuthenticationError):
        oai(gw, "wrong").models.list()
    assert [m.id for m in oai(gw, "s3cret").models.list().data] == ["policy"]
    with urllib.request.urlopen(gw.url + "/health", timeout=30) as resp:  # /health needs no token
        assert json.loads(resp.read())["status"] == "ok"
    url = gw.url + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    for body, code in [({"messages": msgs, "best_of": 2}, "unsupported_parameter"),
                       ({"messages": msgs, "n": 200}, "invalid_request_error"),
                       ({"messages": msgs, "stop": [1]}, "invalid_request_error"),
                       ({"messages": []}, "invalid_request_error"),
                       ({"messages": [{"role": "robot", "content": "x"}]}, "invalid_request_error"),
                       ({"messages": [{"role": "user", "content": "word " * 80}]}, "context_length_exceeded")]:
        status, err = post(url, body, "s3cret")
        assert (status, err["error"]["code"]) == (400, code), body
    status, out = post(gw.url + "/tokenize", {"messages": msgs}, "s3cret")
    assert status == 200 and out["tokens"] == chat.prompt_ids(msgs).tolist() and out["max_model_len"] == 64
    status, out = post(gw.url + "/detokenize", {"tokens": out["tokens"]}, "s3cret")
    assert out["prompt"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    status, out = post(gw.url + "/v1/sessions/nope/finish", {}, "s3cret")
    assert status == 404


def test_config_requires_a_token_off_loopback(tmp_path) -> None:
    with pytest.raises(ConfigError, match="not loopback"):
        GatewayConfig(model="m", host="0.0.0.0")
    (tmp_path / "tok").write_text("abc\n")
    cfg = GatewayConfig(model="m", host="0.0.0.0", token_file=str(tmp_path / "tok"))
    assert cfg.bearer_token() == "abc" and GatewayConfig(model="m", host="::1").bearer_token() is None
    with pytest.raises(ConfigError, match="--model"):
        GatewayConfig()
