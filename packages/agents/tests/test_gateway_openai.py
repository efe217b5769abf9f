"""More of OpenAI's API through the gateway, driven by the official ``openai`` client on a real hf
rollout daemon: streaming (the client's iterator, usage chunk, ``[DONE]``), stop strings,
``n > 1``, ``/v1/completions``, the refusals (400 naming the field) and ``/metrics``, and for
each, that the session records exactly the tokens the client was shown (what training uses).
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import numpy as np
import openai
import pytest

from treadle.agents.api import Episode, StepResult
from treadle.agents.client import SyncGatewayClient
from treadle.agents.executor import ExecutorConfig, MultiTurnExecutor
from treadle.agents.gateway.responses import cut_at_stop, text_pieces, token_deltas
from treadle.common.records import SamplingParams

USER = [{"role": "user", "content": "Tell me a story about a lighthouse."}]


def oai(gw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)


def extra(session: str, **kw: Any) -> dict[str, Any]:
    return {"session_id": session, "return_token_ids": True, **kw}


def test_stream_matches_the_unstreamed_reply_and_records_the_same_tokens(gateway, chat) -> None:
    client = oai(gateway)
    plain = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=12, logprobs=True,
                                           extra_body=extra("plain-1"))
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=12,
                                                 logprobs=True, stream=True, stream_options={"include_usage": True},
                                                 extra_body=extra("stream-1")))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == plain.usage.completion_tokens
    assert last.usage.prompt_tokens == plain.usage.prompt_tokens
    assert body[0].choices[0].delta.role == "assistant" and body[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text == plain.choices[0].message.content
    streamed_ids = [t for c in body for t in (c.choices[0].model_extra.get("token_ids") or [])]
    streamed_lps = [e.logprob for c in body if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed_ids == plain.choices[0].model_extra["token_ids"] and len(streamed_lps) == 12
    [p] = SyncGatewayClient(gateway.url).trajectories("plain-1")
    [s] = SyncGatewayClient(gateway.url).finish("stream-1", reward=1.0)
    assert s.response_token_ids.tolist() == streamed_ids == p.response_token_ids.tolist()
    np.testing.assert_allclose(s.rollout_logprobs, streamed_lps, atol=1e-6)
    assert s.loss_mask.all() and s.prompt_token_ids.tolist() == chat.prompt_ids(USER).tolist()


def test_raw_event_stream_ends_with_done(gateway) -> None:
    body = {"messages": USER, "max_tokens": 3, "stream": True, "seed": 1}
    req = urllib.request.Request(gateway.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = [e for e in resp.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert all("usage" not in json.loads(e[6:]) for e in events[:-1])  # no include_usage: no usage chunk


def test_stop_string_cuts_the_reply_and_the_recorded_tokens(gateway, chat) -> None:
    client = oai(gateway)
    full = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=16,
                                          extra_body=extra("stop-0"))
    text, ids = full.choices[0].message.content, full.choices[0].model_extra["token_ids"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert len(stop) == 2, text
    cut = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=16, stop=[stop, "\x00"],
                                         extra_body=extra("stop-1"))
    assert cut.choices[0].message.content == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
    kept = cut.choices[0].model_extra["token_ids"]
    assert kept == ids[:len(kept)] and len(kept) < len(ids)
    assert stop in chat.decode(kept)[text.find(stop):] and stop not in chat.decode(kept[:-1])[text.find(stop):]
    # the next turn: the recorded tokens are the cut ones, then the whole closing text (no stop token was sampled)
    messages = [*USER, cut.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
    nxt = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=4,
                                         extra_body=extra("stop-1"))
    assert nxt.model_extra["drift"]["kind"] == "render"  # the recorded tokens hold the stop string, the text not
    [t] = SyncGatewayClient(gateway.url).finish("stop-1", reward=0.0)
    (a0, b0), (a1, _) = t.info["spans"]
    assert t.response_token_ids[a0:b0].tolist() == kept
    obs = chat.observation_ids(messages[2:], last_token=kept[-1], stopped=False)
    assert t.response_token_ids[b0:a1].tolist() == obs.tolist() and chat.decode(obs, skip_special_tokens=False)\
        .startswith("<|im_end|>\n")


def test_n_choices_fork_the_session_one_trajectory_each(gateway) -> None:
    client = oai(gateway)
    r = client.chat.completions.create(model="tiny", messages=USER, n=3, seed=7, max_tokens=8, logprobs=True,
                                       extra_body=extra("group-1"))
    assert [c.index for c in r.choices] == [0, 1, 2] and r.model_extra["session_id"] == "group-1"
    names = [c.model_extra["session_id"] for c in r.choices]
    assert names == ["group-1-n0", "group-1-n1", "group-1-n2"]
    assert len({tuple(c.model_extra["token_ids"]) for c in r.choices}) == 3  # seed + i: the choices differ
    assert r.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in r.choices)
    gw = SyncGatewayClient(gateway.url)
    for name, c in zip(names, r.choices, strict=True):
        [t] = gw.finish(name, reward=1.0, group_id="group-1")
        assert t.response_token_ids.tolist() == c.model_extra["token_ids"] and t.group_id == "group-1"
        np.testing.assert_allclose(t.rollout_logprobs, [e.logprob for e in c.logprobs.content], atol=1e-6)
    with pytest.raises(Exception, match="404|no such session"):
        gw.trajectories("group-1")  # a fresh session's choices are the sessions

    chunks = list(client.chat.completions.create(model="tiny", messages=USER, n=2, seed=7, max_tokens=8, stream=True,
                                                 extra_body=extra("group-2")))
    for i in range(2):
        ids = [t for c in chunks for ch in c.choices if ch.index == i for t in (ch.model_extra.get("token_ids") or [])]
        assert ids == r.choices[i].model_extra["token_ids"]  # same seeds: the same samples as the unstreamed n = 3
        [t] = gw.trajectories(f"group-2-n{i}")
        assert t.response_token_ids.tolist() == ids
    with pytest.raises(openai.APIStatusError) as e:  # its choices' sessions are still open
        client.chat.completions.create(model="tiny", messages=USER, n=2, max_tokens=2, extra_body=extra("group-2"))
    assert e.value.status_code == 409


def test_completions_text_and_token_prompts_extend_one_session(gateway, chat) -> None:
    client = oai(gateway)
    prompt = "Once upon a time"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=1,
                                  extra_body=extra("cmpl-1"))
    c = r.choices[0]
    ids = c.model_extra["token_ids"]
    assert r.object == "text_completion" and c.text == chat.decode(ids) and c.finish_reason == "length"
    assert "".join(c.logprobs.tokens) == chat.decode(ids, skip_special_tokens=False)
    assert c.logprobs.text_offset[0] == 0 and len(c.logprobs.token_logprobs) == 6
    # a token prompt that extends the recorded tokens continues the same trajectory, its new tokens masked out
    more = chat.encode(" The end.").tolist()
    follow = [*chat.encode(prompt).tolist(), *ids, *more]
    chunks = list(client.completions.create(model="tiny", prompt=follow, max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=extra("cmpl-1")))
    streamed = [t for ch in chunks for x in ch.choices for t in (x.model_extra.get("token_ids") or [])]
    assert chunks[-1].usage.prompt_tokens == len(follow) and chunks[-1].usage.completion_tokens == 4
    [t] = SyncGatewayClient(gateway.url).finish("cmpl-1", reward=1.0)
    assert t.prompt_token_ids.tolist() == chat.encode(prompt).tolist()
    assert t.response_token_ids.tolist() == [*ids, *more, *streamed]
    assert t.loss_mask.tolist() == [1] * 6 + [0] * len(more) + [1] * 4
    assert "".join(x.text for ch in chunks for x in ch.choices) == chat.decode(streamed)


@pytest.fixture(scope="module")
def reference(model_dir) -> Any:
    """reference(prompt_ids, ids, T) -> float64 [R, V]: log_softmax(logits / T) of the HF model at
    each completion token, computed here from the model folder (not through any engine)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def at(prompt_ids: list[int], ids: list[int], temperature: float) -> np.ndarray:
        x = torch.tensor([[*prompt_ids, *ids]])
        with torch.no_grad():
            logits = model(x).logits[0, len(prompt_ids) - 1:-1].double()
        return torch.log_softmax(logits / temperature, -1).numpy()

    return at


def _top(row: np.ndarray, k: int) -> list[int]:
    return np.argsort(-row, kind="stable")[:k].tolist()


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs_are_the_models_five_most_likely(gateway, chat, reference, stream) -> None:
    client = oai(gateway)
    sid = f"top5-chat-{stream}"
    kw = {"model": "tiny", "messages": USER, "temperature": 0.8, "seed": 3, "max_tokens": 8, "logprobs": True,
          "top_logprobs": 5, "extra_body": extra(sid)}
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        entries = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
        ids = [t for c in chunks for ch in c.choices for t in (ch.model_extra.get("token_ids") or [])]
        prompt_ids = chunks[0].model_extra["prompt_token_ids"]
    else:
        r = client.chat.completions.create(**kw)
        entries, ids = r.choices[0].logprobs.content, r.choices[0].model_extra["token_ids"]
        prompt_ids = r.model_extra["prompt_token_ids"]
    want = reference(prompt_ids, ids, 0.8)  # T = 0.8, no top-k / top-p: the sampling distribution
    assert len(entries) == len(ids) == 8
    for t, (e, tok) in enumerate(zip(entries, ids, strict=True)):
        assert e.token == chat.token_text(tok) and e.bytes == list(e.token.encode("utf-8"))
        assert abs(e.logprob - want[t][tok]) <= 1e-4
        lps = [a.logprob for a in e.top_logprobs]
        assert len(lps) == 5 and lps == sorted(lps, reverse=True)
        np.testing.assert_allclose(lps, want[t][_top(want[t], 5)], atol=1e-4)
        assert [a.token for a in e.top_logprobs] == [chat.token_text(i) for i in _top(want[t], 5)]
        assert all(a.bytes == list(a.token.encode("utf-8")) for a in e.top_logprobs)
        if tok in _top(want[t], 5):  # the sampled token among them: the same logprob as its own entry
            assert abs(lps[_top(want[t], 5).index(tok)] - e.logprob) <= 1e-6
    [traj] = SyncGatewayClient(gateway.url).finish(sid, reward=1.0)  # training sees the sampled tokens only
    assert traj.response_token_ids.tolist() == ids
    np.testing.assert_allclose(traj.rollout_logprobs, [e.logprob for e in entries], atol=1e-6)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_logprobs_5_give_the_sampled_token_and_the_five_most_likely(gateway, chat, reference,
                                                                                 stream) -> None:
    client = oai(gateway)
    kw = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "logprobs": 5,
          "extra_body": extra(f"top5-cmpl-{stream}")}
    if stream:
        chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices and c.choices[0].logprobs]
        tops = [m for c in chunks for m in c.choices[0].logprobs.top_logprobs]
        ids = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
        lps = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
        prompt_ids = chunks[0].model_extra["prompt_token_ids"]
    else:
        r = client.completions.create(**kw)
        tops, lps = r.choices[0].logprobs.top_logprobs, r.choices[0].logprobs.token_logprobs
        ids, prompt_ids = r.choices[0].model_extra["token_ids"], r.model_extra["prompt_token_ids"]
    want = reference(prompt_ids, ids, 1.0)  # greedy: the plain log_softmax
    assert len(tops) == len(ids) == 6
    for t, (m, tok) in enumerate(zip(tops, ids, strict=True)):
        best = _top(want[t], 5)
        assert best[0] == tok  # greedy: the sampled token is the most likely one, listed once
        assert m == pytest.approx({chat.token_text(i): want[t][i] for i in best}, abs=1e-4)
        assert m[chat.token_text(tok)] == pytest.approx(lps[t], abs=1e-6)


def test_top_logprobs_of_tokens_cut_away_are_floored_in_strict_json(gateway) -> None:
    """top_k=2 leaves 3 of the 5 alternatives at -inf: sent as -9999.0 (OpenAI's), never -Infinity."""
    body = {"messages": USER, "max_tokens": 3, "seed": 1, "logprobs": True, "top_logprobs": 5, "top_k": 2}
    req = urllib.request.Request(gateway.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        raw = resp.read().decode()

    def refuse(name: str) -> float:
        raise AssertionError(f"not JSON: {name}")

    out = json.loads(raw, parse_constant=refuse)
    for e in out["choices"][0]["logprobs"]["content"]:
        lps = [a["logprob"] for a in e["top_logprobs"]]
        assert len(lps) == 5 and all(lp > -9999.0 for lp in lps[:2]) and lps[2:] == [-9999.0] * 3


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"messages": USER, "frequency_penalty": 0.5}, "frequency_penalty", "unsupported_parameter"),
    ({"messages": USER, "logit_bias": {"1": 5}}, "logit_bias", "unsupported_parameter"),
    ({"messages": USER, "n": 129}, "n", "invalid_request_error"),
    ({"messages": USER, "n": 0}, "n", "invalid_request_error"),
    ({"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_request_error"),
    ({"messages": USER, "stop": [""]}, "stop", "invalid_request_error"),
    ({"messages": USER, "stop": 3}, "stop", "invalid_request_error"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_request_error"),
    ({"messages": USER, "logprobs": True, "top_logprobs": -1}, "top_logprobs", "invalid_request_error"),
    ({"messages": USER, "top_logprobs": 1}, "top_logprobs", "invalid_request_error"),
    ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options", "invalid_request_error"),
    ({"messages": USER, "temperature": -1}, "temperature", "invalid_request_error"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages[0]", "invalid_request_error"),
])
def test_bad_chat_input_gets_a_400_naming_the_field(gateway, body, param, code) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        oai(gateway).chat.completions.create(model="tiny", **body)
    assert (e.value.param, e.value.code) == (param, code), e.value.message
    if param == "messages[0]":
        assert "vision" in e.value.message


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": ""}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"), ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "suffix": "y"}, "suffix"), ({"prompt": "x", "best_of": 2}, "best_of")])
def test_bad_completion_input_gets_a_400_naming_the_field(gateway, body, param) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        oai(gateway).completions.create(model="tiny", **body)
    assert e.value.param == param, e.value.message


def test_metrics_count_requests_and_tokens(start_gateway) -> None:
    gw = start_gateway()
    client = oai(gw)
    client.chat.completions.create(model="tiny", messages=USER, max_tokens=5, n=2, seed=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=USER, n=1000)
    with urllib.request.urlopen(gw.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    lines = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if not ln.startswith("#")}
    assert lines['treadle_gateway_requests_total{route="/v1/chat/completions",status="200"}'] == 1
    assert lines['treadle_gateway_requests_total{route="/v1/chat/completions",status="400"}'] == 1
    assert lines["treadle_gateway_completion_tokens_total"] == 10 and lines["treadle_gateway_sessions"] == 2
    assert lines['treadle_gateway_request_seconds_count{route="/v1/chat/completions"}'] == 2


class EchoPromptEnv:
    """An environment whose first observation is the episode's prompt (here: with an image part)."""

    async def reset(self, episode: Episode) -> Any:
        return episode.prompt

    async def step(self, action: Any) -> StepResult:
        return StepResult(observation="", reward=0.0, done=True)


def test_executor_refuses_a_vision_prompt_by_name(aio, sampler, chat) -> None:
    ep = Episode(prompt=[{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                      {"type": "image_url", "image_url": {"url": "data:,"}}]}])
    ex = MultiTurnExecutor(env_factory=EchoPromptEnv, sampler=sampler, chat=chat, sampling=SamplingParams(max_tokens=4),
                           config=ExecutorConfig())
    t = aio(ex.run(ep))
    assert t.finish_reason == "error" and "vision" in t.info["error"] and "not supported" in t.info["error"]


class CharDecoder:
    """ids are code points; 0xFFFD0 + n stands for the first byte of a split character."""

    def __call__(self, ids: Any) -> str:
        out = []
        for i in ids:
            out.append("\ufffd" if i >= 0xFFFD0 else chr(i))
        if ids and ids[-1] != 0xFFFD0 and any(i >= 0xFFFD0 for i in ids):  # the pair completes: "é"
            return "".join(out).replace("\ufffd", "", 1).replace(chr(0x301), "é")
        return "".join(out)


def test_cut_at_stop_and_text_pieces_by_hand() -> None:
    dec = CharDecoder()
    ids = [ord(c) for c in "abcXYdef"]
    assert cut_at_stop(dec, ids, ["XY", "ef"]) == (5, "abc")  # the earliest stop wins; XY ends at token 5
    assert cut_at_stop(dec, ids, ["zz"]) is None
    assert text_pieces(dec, ids, "abc") == ["a", "b", "c", "", "", "", "", ""]
    split = [ord("a"), 0xFFFD0, 0x301, ord("b")]  # "a", then "é" over two tokens, then "b"
    assert dec(split) == "aéb" and text_pieces(dec, split, "aéb") == ["a", "", "é", "b"]


def test_n_is_refused_in_a_trainer_owned_session(gateway) -> None:
    async def open_session() -> None:
        gateway.gateway.open_session("owned-1", SamplingParams(max_tokens=4))

    gateway.run(open_session())
    with pytest.raises(openai.BadRequestError) as e:
        oai(gateway).chat.completions.create(model="tiny", messages=USER, n=2, extra_body={"session_id": "owned-1"})
    assert e.value.param == "n" and "trainer" in e.value.message


def test_top_logprobs_in_a_trainer_owned_session(gateway) -> None:
    """The owner's sampling is kept (its max_tokens caps the reply); the alternatives are the agent's to ask."""
    async def open_session() -> None:
        gateway.gateway.open_session("owned-top", SamplingParams(max_tokens=4, seed=2))

    gateway.run(open_session())
    r = oai(gateway).chat.completions.create(model="tiny", messages=USER, max_tokens=10, logprobs=True, top_logprobs=3,
                                             extra_body={"session_id": "owned-top"})
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 3 for e in content)


def test_streamed_tool_call(gateway, warm) -> None:
    from treadle.agents.envs.arithmetic import CALCULATOR_TOOL, question

    msgs = [{"role": "user", "content": question(warm.ARITH_EXPR)}]
    chunks = list(oai(gateway).chat.completions.create(model="tiny", messages=msgs, tools=[CALCULATOR_TOOL],
                                                       temperature=0, max_tokens=64, stream=True,
                                                       extra_body=extra("tool-stream-1")))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name) for tc in calls] == [(0, "calculator")]
    assert json.loads(calls[0].function.arguments) == {"expression": warm.ARITH_EXPR}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    ids = [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])]
    [t] = SyncGatewayClient(gateway.url).trajectories("tool-stream-1")
    assert t.response_token_ids.tolist() == ids and len(ids) > 0


def test_token_deltas_add_up_on_the_real_tokenizer(chat) -> None:
    """Random ids (split characters, leading spaces, invalid bytes): the linear-time deltas are the
    decoded text, less an incomplete last character, and the stop cut is the fewest tokens."""
    rng = np.random.default_rng(0)
    for _ in range(100):
        ids = rng.integers(0, 512, size=int(rng.integers(1, 40))).tolist()
        full, joined = chat.decode(ids), "".join(token_deltas(chat.decode, ids))
        assert full.startswith(joined) and set(full[len(joined):]) <= {"\ufffd"}, ids
        assert "".join(text_pieces(chat.decode, ids, full)) == full
        stop = full[len(full) // 2:len(full) // 2 + 2]
        if len(stop) == 2 and "\ufffd" not in stop:
            k, text = cut_at_stop(chat.decode, ids, [stop])
            assert text == full[:full.find(stop)] and stop in chat.decode(ids[:k])[len(text):]
            assert stop not in chat.decode(ids[:k - 1])[len(text):]
