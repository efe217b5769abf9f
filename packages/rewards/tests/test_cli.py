"""`treadle-rewards serve`: the pinned flag set, config checks, and the real command end to end."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import tomllib

from treadle.common.config import dump_yaml, flag_names, load_yaml, parse
from treadle.rewards.cli import main
from treadle.rewards.config import ServeConfig

FLAGS = [
    "--batch.max_batch_size", "--batch.max_request_samples", "--batch.max_wait_ms", "--cache.path", "--cache.size",
    "--code.binary", "--code.cpu_s", "--code.fsize_mb", "--code.isolation", "--code.max_tests", "--code.memory_mb",
    "--code.no_binary", "--code.no_stop_on_failure", "--code.nproc", "--code.stop_on_failure", "--code.wall_s",
    "--config", "--failure_reward", "--format.pattern", "--functions", "--help", "--http.host", "--http.max_body_mb",
    "--http.port", "--http.token", "--http.token_file", "--math.extraction", "--math.max_answer_chars",
    "--math.max_response_chars", "--metrics_port", "--rm.append_eos",
    "--rm.device", "--rm.dtype", "--rm.max_len", "--rm.micro_batch_size", "--rm.no_append_eos", "--rm.no_normalize",
    "--rm.normalize", "--rm.path", "--rm.weight", "--score_from", "--shaping.length_unit", "--shaping.max_new_tokens",
    "--shaping.overlong_buffer_len", "--shaping.overlong_penalty_factor", "--shaping.stop_properly_penalty_coef",
    "--shaping.stop_texts", "--shaping.tokenizer", "--weights", "--workers.isolate_failures", "--workers.memory_mb",
    "--workers.no_isolate_failures", "--workers.num_workers", "--workers.start_timeout_s", "--workers.timeout_s",
    "--zmq.curve_dir", "--zmq.endpoint", "--zmq.max_in_flight", "-h",
]


def test_flag_set_is_pinned():
    assert flag_names(ServeConfig) == FLAGS


def test_flags_parse_into_the_typed_tree_and_yaml_round_trips(tmp_path):
    cfg = parse(ServeConfig, ["--functions", "math", "format", "--weights", "1.0", "0.1", "--code.cpu_s", "2",
                              "--http.port", "0", "--http.token", "t", "--shaping.stop_properly_penalty_coef", "0",
                              "--shaping.stop_texts", "<|im_end|>"])
    assert cfg.functions == ("math", "format") and cfg.weights == (1.0, 0.1) and cfg.code.cpu_s == 2.0
    text = dump_yaml(cfg)
    assert "token: null" in text  # secrets never reach a dump
    assert load_yaml(ServeConfig, text).functions == cfg.functions


def test_bad_flags_exit_2_with_the_reason(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--functions", "math", "--weights", "1", "2"])
    assert e.value.code == 2 and "--weights has 2 values" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["bogus"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "treadle-rewards serve" in capsys.readouterr().out


def test_console_script_is_declared():
    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["treadle-rewards"] == "treadle.rewards.cli:main"


def test_serve_runs_until_sigterm():
    proc = subprocess.Popen([sys.executable, "-m", "treadle.rewards.cli", "serve", "--functions", "format",
                             "--workers.num_workers", "1", "--http.port", "0", "--zmq.endpoint", "tcp://127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=dict(os.environ))
    try:
        line = proc.stdout.readline()
        http = re.search(r"http=(\S+)", line).group(1)
        assert requests.get(http + "/health", timeout=10).json()["components"] == ["format"]
        r = requests.post(http + "/get_reward", json={"query": ["<think>x</think><answer>y</answer>"]}, timeout=10)
        assert r.json()["rewards"] == [1.0]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
