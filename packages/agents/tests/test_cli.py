"""``treadle-agents serve``: the flag set, refusals, and a real serve in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from typing import Any

import pytest

from treadle.agents.cli import main
from treadle.agents.gateway.config import GatewayConfig
from treadle.common.config import flag_names

FLAGS = ["--chat_template", "--config", "--default_max_tokens", "--help", "--host", "--max_length",
         "--max_sessions", "--max_tokenize_chars", "--model", "--port", "--request_timeout_s", "--rollout",
         "--rollout_curve_dir", "--served_model_name", "--session_ttl_s", "--token", "--token_file", "--tool_parser",
         "-h"]


def test_flag_set_is_pinned() -> None:
    assert flag_names(GatewayConfig) == FLAGS


@pytest.mark.parametrize(("argv", "needle"), [
    (["serve", "--model", "m", "--host", "0.0.0.0"], "not loopback"),
    (["serve"], "--model is required"),
    (["serve", "--model", "m", "--token_file", "/nonexistent/token"], "cannot read it"),
    (["oops"], "unknown command"),
])
def test_refusals_exit_2(argv: list[str], needle: str, capsys: Any) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.slow  # ~30 s: transformers' import dominates the gateway's start-up
def test_serve_subprocess(daemon: str, model_dir: Any, subprocess_env: dict[str, str]) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "treadle.agents", "serve", "--model", str(model_dir),
                             "--rollout", daemon, "--port", "0", "--served_model_name", "cli-model"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True, env=subprocess_env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("treadle-agents: serving http://127.0.0.1:"), line
        url = line.split()[2]
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
            assert json.loads(resp.read())["data"][0]["id"] == "cli-model"
        with urllib.request.urlopen(url + "/health", timeout=30) as resp:
            assert json.loads(resp.read())["status"] == "ok"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
