"""Fuzzing the real daemons: >= 100,000 hostile ZeroMQ messages per socket, malformed HTTP bodies
per endpoint. Nothing may crash, every addressable message gets its one terminal reply (an
``Error`` for anything invalid), memory stays bounded, and valid requests still work after.

ZeroMQ sockets fuzzed (every ``RpcServer`` in packages/*/src): the rollout front end
(``python -m treadle.rollout serve``), its engine worker's ipc socket (``treadle.rollout.worker``,
reachable by the daemon's user through ``--run_dir``), and the reward daemon
(``treadle-rewards serve``). HTTP servers: the reward daemon's (/get_reward, /v1/reward, ...)
and the agent gateway (``treadle-agents serve``). What counts as addressable, and what is
silent by design, is in ``_wire``'s docstring.

The daemons run with ``TREADLE_MAX_FRAME_BYTES`` = 1 MiB (and the reward daemon with
``--http.max_body_mb 1``) so that over-limit frames and bodies are cheap to send; the code paths
are the ones the defaults take. Messages are seeded: a failure names the seed and the message.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from treadle.common.codec import decode, encode
from treadle.common.records import (
    Control,
    GenerateRequest,
    InlineWeights,
    RewardRequest,
    SamplingParams,
)
from treadle.common.rpc import SyncRpcClient
from treadle.common.rpc.transport import hard_limit

pytestmark = pytest.mark.chaos


def _load_wire() -> Any:
    """``_wire.py`` beside this file (tests are imported by path here: --import-mode=importlib)."""
    name = "treadle_chaos_wire"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("_wire.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before exec: dataclasses look their module up by name
        spec.loader.exec_module(module)
    return sys.modules[name]


wire = _load_wire()
Base = wire.Base

LIMIT = 1 << 20  # TREADLE_MAX_FRAME_BYTES of the fuzzed daemons
FRAMES = 100_000  # per socket, after a warm-up of WARM
WARM = 10_000
WINDOW = 256  # terminal replies outstanding at once
SEED = 20261201
# Memory bounds (MiB), on the fuzzed process alone, from after the warm-up. Measured here: +0.1
# to +0.5 from half-way to the end, +1 to +4 from the warm-up to the end (allocator arenas
# settling). A leak of ~125 bytes or more per message (6 MiB / 50,000) fails the second-half
# bound. Peak: the window of requests in flight, a few of them a frame limit (1 MiB) each.
SECOND_HALF_GROWTH_MB = 6.0
TOTAL_GROWTH_MB = 24.0
PEAK_OVER_BASE_MB = 128.0


def _prompt(n: int, dtype: Any = np.int32) -> np.ndarray:
    return np.arange(1, n + 1, dtype=dtype)


def _gen(prompt: np.ndarray | None = None, **sampling: Any) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=_prompt(5) if prompt is None else prompt,
                           sampling=SamplingParams(**{"max_tokens": 2, **sampling}), key="fuzz")


SHARED_BASES = [Base(method="health"), Base(method="stats", record=Control(op="stats", args={"a": [1, 2.5, "x"]})),
                Base(method="health", record=_gen(_prompt(600))),  # 2400 B: a buffer frame of its own
                Base(method="no_such_method", record=Control(op="x"), weight=0.3)]
ROLLOUT_BASES = [*SHARED_BASES, Base(method="generate", record=_gen(), weight=0.5),
                 Base(method="prompt_logprobs", record=_gen()),
                 Base(method="abort", record=Control(op="abort", args={"key": "fuzz-nobody"}), weight=0.5)]
A = wire.inline_array
GEN = _gen()
# Wrong values for the engine (sent unmutated to the front end and to the worker alike): wrong
# record types, and fields the records' own checks refuse, patched into the encoded body.
ENGINE_WRONG = [("generate", Control(op="x"), None), ("generate", None, None), ("prompt_logprobs", None, None),
                ("generate", _gen(np.array([10**6, 2**31 - 1, 3], np.int32)), None),  # beyond the vocabulary
                ("generate", _gen(np.array([-5, 3], np.int32)), None),
                ("generate", GEN, {"prompt_token_ids": A(np.zeros(0, np.int32))}),
                ("generate", GEN, {"prompt_token_ids": A(np.array([1.5, 2.5], np.float32))}),
                ("generate", GEN, {"prompt_token_ids": A(_prompt(6).reshape(2, 3))}),
                ("generate", GEN, {"prompt_token_ids": A(np.array([2**40], np.int64))}),
                ("generate", GEN, {"sampling.max_tokens": 0}), ("generate", GEN, {"sampling.max_tokens": -1}),
                ("generate", GEN, {"sampling.n": 0}), ("generate", GEN, {"sampling.temperature": -1.0}),
                ("generate", GEN, {"sampling.temperature": float("nan")}), ("generate", GEN, {"sampling.top_p": 2.0}),
                ("generate", GEN, {"sampling.top_k": -7}), ("generate", GEN, {"sampling.seed": -1}),
                ("generate", GEN, {"sampling.seed": 2**64 - 1}), ("generate", GEN, {"sampling.min_tokens": 50}),
                ("generate", GEN, {"sampling.stop_token_ids": [-1, 2**40]}),
                ("prompt_logprobs", _gen(np.array([1], np.int32)), None),
                ("prompt_logprobs", _gen(np.array([10**6, 2], np.int32)), None),
                ("update_weights", Control(op="x"), None),
                ("update_weights", InlineWeights(version=1, names=["no.such.weight"], dtypes=["float32"],
                                                 shapes=[[2]], tensors=[np.zeros(2, np.float32)]), None),
                ("update_weights", InlineWeights(version=1, names=["w"], dtypes=["float32"], shapes=[[2]],
                                                 tensors=[np.zeros(2, np.float32)]), {"shapes": [[3]]})]
ROLLOUT_WRONG = [*ENGINE_WRONG, ("generate", GEN, {"sampling.n": 10**6}),
                 ("scale", Control(op="scale", args={"engines": "many"}), None),
                 ("scale", Control(op="scale", args={"engines": 0}), None), ("scale", None, None),
                 ("sleep", Control(op="sleep", args={"level": 7}), None),
                 ("sleep", Control(op="sleep", args={"level": "x"}), None),
                 ("abort", Control(op="abort", args={}), None), ("abort", None, None), ("weight_digest", None, None),
                 ("reset_prefix_cache", None, None)]
# The worker trusts its front end to bound samples (no n=10**6 there); its sleep/close are left alone.
WORKER_WRONG = [*ENGINE_WRONG, ("abort", Control(op="abort", args={}), None), ("abort", None, None)]
REWARD = RewardRequest(queries=["so \\boxed{4}"], prompts=["so "], labels=["4"])
REWARDS_BASES = [*SHARED_BASES, Base(method="reward", record=REWARD, weight=1.5),
                 Base(method="reward", record=RewardRequest(queries=["a", "b \\boxed{1}"], prompts=["a", "b "],
                                                            labels=[{"x": [1, 2.5, None]}, 1]))]
REWARDS_WRONG = [("reward", Control(op="x"), None), ("reward", None, None),
                 ("reward", REWARD, {"prompts": ["a", "b"]}), ("reward", REWARD, {"labels": ["1"] * 3}),
                 ("reward", REWARD, {"queries": []}), ("reward", REWARD, {"queries": "not a list"}),
                 ("reward", REWARD, {"queries": [1, 2]}), ("reward", REWARD, {"labels": [A(np.zeros(3))]}),
                 ("reward", RewardRequest(queries=["x"] * 70_000), None),
                 ("reward", RewardRequest(queries=["\\boxed{"], labels=[2**64 - 1]), None),
                 ("reward", RewardRequest(queries=["\\boxed{1}"], labels=[float("nan")]), None),
                 ("reward", RewardRequest(queries=["\\boxed{" * 2000 + "}" * 1999], labels=["1"]), None),
                 ("reward", RewardRequest(queries=["x"], labels=[[[[[[["deep"]]]]]]]), None)]


# ---------------------------------------------------------------------------------- daemons


def _script(name: str) -> str:
    """A console script of the venv running the tests (the daemon's real entry point)."""
    return str(Path(sys.executable).with_name(name))


@pytest.fixture(scope="module")
def fuzz_rollout(spawn: Any, chaos: Any, tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """One hf engine; 4 samples in flight at most (the rest of a flood's generates get Busy)."""
    from treadle.rollout.client import SyncRolloutClient

    run_dir = tmp_path_factory.mktemp("fuzz-rollout-run")
    endpoint = f"tcp://127.0.0.1:{chaos.free_port()}"
    proc = spawn("fuzz-rollout", chaos.rollout_argv(tiny, endpoint, "--engines", "1", "--backend", "hf",
                                                    "--max_in_flight_samples", "4", "--run_dir", str(run_dir),
                                                    "--health_interval_s", "1"),
                 TREADLE_MAX_FRAME_BYTES=str(LIMIT))
    proc.wait_until(lambda: chaos.zmq_health(endpoint, SyncRolloutClient)["status"] == "ok", timeout=300)
    return SimpleNamespace(proc=proc, endpoint=endpoint, worker=f"ipc://{run_dir}/e0.sock")


@pytest.fixture(scope="module")
def fuzz_rewards(spawn: Any, chaos: Any) -> SimpleNamespace:
    """The math function (one worker), ZeroMQ and HTTP; bodies over 1 MiB are refused."""
    from treadle.rewards.client import SyncRewardClient

    zport, hport = chaos.free_port(), chaos.free_port()
    endpoint = f"tcp://127.0.0.1:{zport}"
    proc = spawn("fuzz-rewards", [_script("treadle-rewards"), "serve", "--functions", "math",
                                  "--zmq.endpoint", endpoint, "--http.port", str(hport), "--http.max_body_mb", "1",
                                  "--workers.num_workers", "1", "--workers.timeout_s", "10"],
                 TREADLE_MAX_FRAME_BYTES=str(LIMIT))
    proc.wait_until(lambda: chaos.zmq_health(endpoint, SyncRewardClient)["status"] == "ok", timeout=300)
    return SimpleNamespace(proc=proc, endpoint=endpoint, http=f"http://127.0.0.1:{hport}", max_body=1 << 20)


@pytest.fixture(scope="module")
def fuzz_gateway(spawn: Any, chaos: Any, tiny: Path, fuzz_rollout: SimpleNamespace) -> SimpleNamespace:
    """The agent gateway on the fuzz rollout daemon; 2 new tokens by default, 64-token sessions."""
    import requests

    port = chaos.free_port()
    url = f"http://127.0.0.1:{port}"
    proc = spawn("fuzz-gateway", [_script("treadle-agents"), "serve", "--model", str(tiny), "--rollout",
                                  fuzz_rollout.endpoint, "--port", str(port), "--default_max_tokens", "2",
                                  "--max_length", "64"])
    proc.wait_until(lambda: requests.get(url + "/health", timeout=5).status_code == 200, timeout=300)
    return SimpleNamespace(proc=proc, http=url, max_body=64 << 20)


def _pid_of(proc: Any, fragment: str) -> int:
    import psutil

    for p in [psutil.Process(proc.proc.pid), *psutil.Process(proc.proc.pid).children(recursive=True)]:
        if fragment in " ".join(p.cmdline()):
            return p.pid
    raise LookupError(f"no process of {proc.name} runs {fragment!r}")


def _rss(pid: int) -> float:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.NoSuchProcess:
        return 0.0


# ---------------------------------------------------------------------------------- ZeroMQ


def _target(name: str, request: pytest.FixtureRequest) -> SimpleNamespace:
    """endpoint, the Proc, the pid whose socket is fuzzed, bases, fixed calls, a valid call after."""
    if name == "rewards":
        from treadle.rewards.client import SyncRewardClient

        d = request.getfixturevalue("fuzz_rewards")

        def after() -> bool:
            with SyncRewardClient(d.endpoint, timeout_s=60) as c:
                return c.score(["so \\boxed{4}"], ["so "], ["4"]).rewards.tolist() == [1.0]

        return SimpleNamespace(endpoint=d.endpoint, proc=d.proc, pid=d.proc.proc.pid, bases=REWARDS_BASES,
                               fixed=REWARDS_WRONG, after=after)
    d = request.getfixturevalue("fuzz_rollout")
    if name == "rollout":
        from treadle.rollout.client import SyncRolloutClient

        def after() -> bool:
            with SyncRolloutClient(d.endpoint, timeout_s=120) as c:
                return len(c.generate([1, 2, 3], SamplingParams(max_tokens=3))[0].response_token_ids) == 3

        return SimpleNamespace(endpoint=d.endpoint, proc=d.proc, pid=d.proc.proc.pid, bases=ROLLOUT_BASES,
                               fixed=ROLLOUT_WRONG, after=after)

    def after_worker() -> bool:
        with SyncRpcClient(d.worker) as c:
            out = list(c.stream("generate", _gen(max_tokens=3), timeout=120))
        return len(out) == 1 and len(out[0].response_token_ids) == 3

    bases = [b for b in ROLLOUT_BASES if b.method != "generate"] + [Base(method="generate", record=GEN, weight=0.2)]
    return SimpleNamespace(endpoint=d.worker, proc=d.proc, pid=_pid_of(d.proc, "treadle.rollout.worker"),
                           bases=bases, fixed=WORKER_WRONG, after=after_worker)


ZMQ_TARGETS = ["rollout", "rollout-worker", "rewards"]
FLOOD_TARGETS = ZMQ_TARGETS


def _record_flood(figures: Any, sec: str, runs: list[Any]) -> None:
    errors = sum((r.errors for r in runs), start=type(runs[0].errors)())
    total = sum(r.sent for r in runs)
    figures.record(sec, "messages sent", total)
    figures.record(sec, "frames sent", sum(r.frames_sent for r in runs))
    figures.record(sec, "terminal replies (reply / end / error)", sum(r.replies for r in runs))
    figures.record(sec, "replies that are Error records", sum(errors.values()))
    for code, count in sorted(errors.items()):
        figures.record(sec, f"  Error code {code}", count)
    figures.record(sec, "silent by design (well-formed cancel)", sum(r.silent_by_design for r in runs))
    figures.record(sec, "addressable messages unanswered", sum(r.unanswered for r in runs))
    figures.record(sec, "extra or undecodable replies", sum(r.extra + r.undecodable_replies for r in runs))
    figures.record(sec, "messages/s; window widenings after 3 s without a reply", f"{total / sum(r.seconds for r in runs):.0f}"
                   f"; {sum(r.stalls for r in runs)}")


@pytest.mark.parametrize("name", FLOOD_TARGETS)
def test_zmq_flood(name: str, request: pytest.FixtureRequest, figures: Any) -> None:
    """>= 100,000 hostile messages: no crash, one terminal reply per addressable message (an
    Error for every invalid one), memory flat from the first half to the second, still serving."""
    t = _target(name, request)
    fuzzer = wire.Fuzzer(SEED, t.bases, wire.fixed_calls(t.fixed), LIMIT)
    messages = iter(fuzzer.message, None)
    rss = lambda: _rss(t.pid)  # noqa: E731
    with wire.RssSampler(rss) as mem:
        warm = wire.flood(t.endpoint, messages, WARM, limit=LIMIT, window=WINDOW)
        base = rss()
        first = wire.flood(t.endpoint, messages, FRAMES // 2, limit=LIMIT, window=WINDOW)
        mid = rss()
        second = wire.flood(t.endpoint, messages, FRAMES // 2, limit=LIMIT, window=WINDOW)
        end = rss()
    runs = [warm, first, second]
    alive = t.proc.alive() and _rss(t.pid) > 0
    sec = f"fuzz zmq: {name}"
    _record_flood(figures, sec, runs)
    figures.record(sec, "crashes (fuzzed process exited)", 0 if alive else 1)
    figures.record(sec, "RSS after warm-up / half-way / end / peak",
                   f"{base:.1f} / {mid:.1f} / {end:.1f} / {mem.peak:.1f}", "MiB")
    figures.record(sec, "message kinds", dict(sorted(fuzzer.kinds.items())))
    assert alive, f"{name} died during the flood (seed {SEED}):\n{t.proc.tail()}"
    examples = "\n".join(e for r in runs for e in r.examples)
    assert sum(r.unanswered for r in runs) == 0, f"seed {SEED}: addressable messages unanswered:\n{examples}"
    assert sum(r.extra + r.undecodable_replies for r in runs) == 0
    assert t.after(), f"{name}: a valid request failed after the flood"
    assert end - mid < SECOND_HALF_GROWTH_MB and end - base < TOTAL_GROWTH_MB, (base, mid, end)
    assert mem.peak - base < PEAK_OVER_BASE_MB, (base, mem.peak)


@pytest.mark.parametrize("name", ZMQ_TARGETS)
def test_zmq_frame_past_the_hard_limit_drops_only_its_connection(name: str, request: pytest.FixtureRequest,
                                                                  figures: Any) -> None:
    """A frame past ZMQ_MAXMSGSIZE (hard_limit(1 MiB) = 64 MiB): libzmq drops that connection
    (no reply: the server never sees it), the sender's socket reconnects and is served, and a
    bystander connected all along is served too."""
    t = _target(name, request)
    size = hard_limit(LIMIT) + 1
    health = [bytes(f) for f in encode(None, id=7, op="call", method="health")]
    with SyncRpcClient(t.endpoint) as bystander:
        bystander.call("health", timeout=30)
        replies, served_after = wire.drop_oversize(t.endpoint, size, health)
        bystander_ok = bystander.call("health", timeout=30) is not None
    sec = f"fuzz zmq: {name}"
    figures.record(sec, f"{size} B frame (past the hard limit): replies", replies)
    figures.record(sec, "  same socket served after reconnecting / bystander served",
                   f"{served_after} / {bystander_ok}")
    assert t.proc.alive() and replies == 0 and served_after and bystander_ok


def test_a_poisoned_request_does_not_fail_its_batch(fuzz_rollout: SimpleNamespace, figures: Any) -> None:
    """temperature=NaN passed SamplingParams' check (NaN < 0 is False) and made the hf engine
    fail the whole batch it landed in: every other caller's samples in it ended "error". Now
    the codec refuses it (bad_message) and the neighbours finish normally."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(fuzz_rollout.endpoint)
    good = _gen(max_tokens=8, temperature=1.0)
    try:
        sock.send_multipart(wire.patched("generate", good, None, 1))
        sock.send_multipart(wire.patched("generate", good, {"sampling.temperature": float("nan")}, 2))
        sock.send_multipart(wire.patched("generate", good, None, 3))
        finish, errors, done = {}, {}, set()
        while len(done) < 3 and sock.poll(60_000):
            m = decode(sock.recv_multipart())
            if m.op == "chunk":
                finish[m.id] = m.msg.finish_reason
            elif m.op == "error":
                errors[m.id] = m.msg.code
            if m.op in ("end", "error", "reply"):
                done.add(m.id)
    finally:
        sock.close(linger=0)
    figures.record("fuzz zmq: rollout", "NaN-temperature request: answer / neighbours' finish reasons",
                   f"{errors.get(2)} / {finish.get(1)}, {finish.get(3)}")
    assert errors == {2: "bad_message"} and finish[1] in ("length", "stop") and finish[3] in ("length", "stop")


# ---------------------------------------------------------------------------------- HTTP

SID = "fuzz-session"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 1.0}
RW = {"query": ["so \\boxed{4}"], "prompts": ["so "], "labels": ["4"]}
# (daemon fixture, method, path, valid body, requests)
HTTP_ENDPOINTS = [
    ("fuzz_rewards", "POST", "/get_reward", RW, 2000), ("fuzz_rewards", "POST", "/v1/reward", RW, 2000),
    ("fuzz_rewards", "GET", "/health", {}, 300), ("fuzz_rewards", "GET", "/metrics", {}, 300),
    ("fuzz_rewards", "GET", "/info", {}, 300),
    ("fuzz_gateway", "POST", "/v1/chat/completions", CHAT, 2500),
    ("fuzz_gateway", "POST", "/tokenize", {"messages": CHAT["messages"], "add_generation_prompt": True}, 2500),
    ("fuzz_gateway", "POST", "/detokenize", {"tokens": [1, 2, 3]}, 2500),
    ("fuzz_gateway", "POST", f"/v1/sessions/{SID}/finish", {"reward": 1.0, "extra_logs": {"a": 1}, "info": {}}, 1000),
    ("fuzz_gateway", "GET", "/health", {}, 300), ("fuzz_gateway", "GET", "/v1/models", {}, 300),
    ("fuzz_gateway", "GET", "/v1/sessions", {}, 300), ("fuzz_gateway", "GET", f"/v1/sessions/{SID}", {}, 300),
    ("fuzz_gateway", "DELETE", "/v1/sessions/no-such-session", {}, 300),
]


def _new_session(url: str) -> None:
    import requests

    r = requests.post(url + "/v1/chat/completions", json={**CHAT, "session_id": SID}, timeout=120)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("daemon, method, path, valid, n", HTTP_ENDPOINTS,
                         ids=[f"{d[5:]}:{m}:{p}" for d, m, p, *_ in HTTP_ENDPOINTS])
def test_http_malformed_bodies(daemon: str, method: str, path: str, valid: Any, n: int,
                               request: pytest.FixtureRequest, figures: Any) -> None:
    """Every answer is 2xx (a body that happens to be fine) or a 4xx JSON error: no 5xx, no reset
    connection, the process alive and healthy after."""
    import requests

    d = request.getfixturevalue(daemon)
    cases = wire.HttpCases(SEED + n + len(path), valid, d.max_body).take(n)
    after = None
    if "/sessions/" in path and method != "DELETE":
        _new_session(d.http)

        async def after(status: int) -> None:  # a 200 finish closed the session: open it again
            if status == 200 and path.endswith("/finish"):
                await asyncio.to_thread(_new_session, d.http)

    before = _rss(d.proc.proc.pid)
    tally = asyncio.run(wire.send_cases(d.http + path, cases, method=method, after=after))
    rss = _rss(d.proc.proc.pid)
    health = requests.get(d.http + "/health", timeout=30)
    sec = f"fuzz http: {daemon[5:]} {method} {path}"
    figures.record(sec, "requests (2xx / 4xx / 5xx / no answer)",
                   f"{tally.sent} ({sum(v for k, v in tally.status.items() if k < 300)} / "
                   f"{sum(v for k, v in tally.status.items() if 400 <= k < 500)} / {tally.server_errors} / "
                   f"{tally.transport_errors})")
    figures.record(sec, "statuses", dict(sorted(tally.status.items())))
    figures.record(sec, "4xx without a JSON error body (of which aiohttp parser 400s)",
                   f"{tally.not_json_4xx} ({tally.parser_4xx})")
    figures.record(sec, "requests/s; server RSS before / after", f"{tally.sent / tally.seconds:.0f}; "
                   f"{before:.1f} / {rss:.1f} MiB")
    problems = "\n".join(tally.examples[:10])
    assert d.proc.alive() and health.status_code == 200, d.proc.tail()
    assert tally.server_errors == 0 and tally.transport_errors == 0, problems
    assert tally.not_json_4xx == tally.parser_4xx, problems
    assert set(tally.status) <= {200, 400, 404, 405, 413}, tally.status
