"""Agent programs through the gateway (``treadle.agents.program``): a real subprocess speaking
OpenAI's chat API over HTTP to a real gateway on a real rollout daemon (hf engine, tiny model).
The program is plain Python with ``urllib`` (an OpenAI SDK client given the same base URL does
the same requests; the integration suite runs one)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from treadle.agents.program import AgentProgramError, parse_result

AGENT = '''
import json, os, sys, time, urllib.request

episode = json.loads(sys.stdin.readline())
mode = os.environ.get("MODE", "ok")
if mode == "crash":
    print("boom: the environment fell over", file=sys.stderr)
    sys.exit(3)
if mode == "sleep":
    open(os.environ["PIDFILE"], "w").write(str(os.getpid()))
    time.sleep(60)
if mode == "silent":
    print(json.dumps({"reward": 1.0}))
    sys.exit(0)

def chat(messages):
    body = json.dumps({"model": "any", "messages": messages, "max_tokens": 100, "temperature": 0.0}).encode()
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body,
                                 headers={"Content-Type": "application/json",
                                          "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]

messages = [{"role": "user", "content": episode["prompt"]}]
first = chat(messages)
messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "again, shorter"}]
second = chat(messages)
if mode == "garbage":
    print("done, no result")
else:
    print("some log line")
    print(json.dumps({"reward": 1.0 if episode["label"] in second else 0.5, "extra_logs": {"chars": len(second)}}))
'''


@pytest.fixture(scope="module")
def gateway(aio: Any, model_dir: Path, daemon: str, rollout: Any, sampler: Any, chat: Any) -> Any:
    from treadle.agents.gateway.config import GatewayConfig
    from treadle.agents.gateway.server import Gateway

    gw = Gateway(GatewayConfig(model=str(model_dir), port=0, rollout=daemon, chat_template="chatml_tools"),
                 chat=chat, rollout=rollout, sampler=sampler)
    aio(gw.start())
    yield gw
    aio(gw.close())


def _executor(tmp_path: Path, gateway: Any, sampler: Any, chat: Any, mode: str, timeout: float = 120.0) -> Any:
    from treadle.agents.executor import ExecutorConfig
    from treadle.agents.program import ProgramExecutor
    from treadle.common.records import SamplingParams

    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent(AGENT))
    return ProgramExecutor(command=[sys.executable, str(script)], gateway=gateway, sampler=sampler, chat=chat,
                           env={"MODE": mode, "PIDFILE": str(tmp_path / "pid")},
                           sampling=SamplingParams(max_tokens=6, temperature=1.0, seed=7),
                           config=ExecutorConfig(max_length=512, episode_timeout_s=timeout))


def test_a_program_plays_two_turns_and_its_session_becomes_the_trajectory(aio, gateway, sampler, chat, tmp_path):
    from treadle.agents.api import Episode

    ex = _executor(tmp_path, gateway, sampler, chat, "ok")
    eps = [Episode(prompt=f"count to {i}", label="1", group_id="g") for i in range(3)]
    trajs = aio(ex.run_many(eps), timeout=300)
    for t in trajs:
        assert t.finish_reason != "error", t.info
        assert t.reward in (1.0, 0.5) and t.group_id == "g" and "chars" in t.extra_logs
        assert t.info["turns"] == 2 and len(t.info["spans"]) == 2
        spans = t.info["spans"]
        mask = np.asarray(t.loss_mask)
        # each sampled turn is trainable and at most the run's max_tokens long (the program asked for
        # 100 at temperature 0: the run's sampling wins); the text between the turns is not
        for start, end in spans:
            assert 1 <= end - start <= 6 and mask[start:end].all()
        assert not mask[spans[0][1]:spans[1][0]].any() and spans[1][0] > spans[0][1]
        assert np.all(np.asarray(t.rollout_logprobs)[mask.astype(bool)] < 0)
    assert not gateway.sessions  # every episode's session was taken and dropped
    assert ex.stats.finished == 3 and ex.stats.failed == 0


@pytest.mark.parametrize(("mode", "message"), [
    ("crash", r"exited with code 3; its standard error ends:\nboom: the environment fell over"),
    ("garbage", "its last line is not JSON: 'done, no result'"),
    ("silent", "made no chat request"),
])
def test_a_program_that_breaks_the_contract_fails_its_episode_naming_why(aio, gateway, sampler, chat, tmp_path,
                                                                          mode, message):
    import re

    from treadle.agents.api import Episode

    ex = _executor(tmp_path, gateway, sampler, chat, mode)
    t = aio(ex.run(Episode(prompt="hi", label="1")), timeout=300)
    assert t.finish_reason == "error" and t.info["failed_stage"] == "agent"
    assert re.search(message, t.info["error"]), t.info["error"]
    assert not gateway.sessions


def test_no_more_than_max_procs_programs_run_at_once_and_waiting_is_not_timed(aio, gateway, sampler, chat, tmp_path):
    from treadle.agents.api import Episode
    from treadle.agents.executor import ExecutorConfig
    from treadle.agents.program import ProgramExecutor
    from treadle.common.records import SamplingParams

    script = tmp_path / "slow.py"  # records how many copies run at once, through a lock file
    script.write_text(textwrap.dedent('''
        import fcntl, json, os, sys, time
        sys.stdin.readline()
        path = os.environ["COUNT"]
        def bump(d):
            with open(path, "a+") as f:
                fcntl.flock(f, fcntl.LOCK_EX); f.seek(0); now, peak = (json.loads(f.read() or "[0, 0]"))
                now += d; peak = max(peak, now); f.seek(0); f.truncate(); f.write(json.dumps([now, peak]))
        bump(1); time.sleep(1.5); bump(-1)
        print(json.dumps({"reward": 1.0}))
    '''))
    count = tmp_path / "count"
    ex = ProgramExecutor(command=[sys.executable, str(script)], gateway=gateway, sampler=sampler, chat=chat,
                         env={"COUNT": str(count)}, max_procs=2, sampling=SamplingParams(max_tokens=4),
                         config=ExecutorConfig(max_length=64, episode_timeout_s=4.0))
    trajs = aio(ex.run_many([Episode(prompt="hi") for _ in range(6)]), timeout=120)
    # every program made no request: each episode fails for that, after running its full 1.5 s;
    # 6 programs two at a time take 3 rounds (~4.5 s > the 4 s timeout), yet none timed out
    assert all("made no chat request" in t.info["error"] for t in trajs)
    assert ex.stats.timed_out == 0 and json.loads(count.read_text()) == [0, 2]
    with pytest.raises(ValueError, match="max_procs must be >= 1, got 0"):
        ProgramExecutor(command=["x"], gateway=gateway, sampler=sampler, chat=chat, max_procs=0,
                        sampling=SamplingParams())


def test_a_program_past_the_episode_timeout_is_killed(aio, gateway, sampler, chat, tmp_path):
    from treadle.agents.api import Episode

    ex = _executor(tmp_path, gateway, sampler, chat, "sleep", timeout=3.0)
    t = aio(ex.run(Episode(prompt="hi", label="1")), timeout=60)
    assert t.finish_reason == "error" and "timed out after 3 s" in t.info["error"]
    pid = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):  # its process group was killed, and reaped
        os.kill(pid, 0)
    assert ex.stats.timed_out == 1


@pytest.mark.parametrize(("stdout", "message"), [
    ("", "printed nothing"),
    ('{"reward": "high"}', 'no finite numeric "reward"'),
    ('{"reward": NaN}', 'no finite numeric "reward"'),
    ('{"reward": 1, "score": "x"}', '"score" must be a number'),
    ('{"reward": 1, "extra_logs": {"a": "b"}}', '"extra_logs" must map names to numbers'),
])
def test_result_lines_are_checked(stdout, message):
    with pytest.raises(AgentProgramError, match=message):
        parse_result(stdout)


def test_the_last_json_line_is_the_result():
    assert parse_result('log\n{"reward": 0}\n{"reward": 2, "score": 1, "extra_logs": {"k": 3}}\n\n') == (2.0, 1.0, {"k": 3.0})
    assert json.loads('{"reward": 1}')  # sanity: plain JSON is what programs print
