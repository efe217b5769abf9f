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
from treadle.rewards.config import OPENRLHF_REFUSED, RMConfig, ServeConfig

FLAGS = [
    "--batch.max_batch_size", "--batch.max_request_samples", "--batch.max_wait_ms", "--batch_size", "--cache.path",
    "--cache.size", "--code.binary", "--code.cpu_s", "--code.fsize_mb", "--code.isolation", "--code.max_tests",
    "--code.memory_mb", "--code.no_binary", "--code.no_stop_on_failure", "--code.nproc", "--code.stop_on_failure",
    "--code.wall_s", "--config", "--data.disable_fast_tokenizer", "--data.max_len", "--ds.attn_implementation",
    "--ds.param_dtype", "--ds.value_head_prefix", "--failure_reward", "--format.pattern", "--functions", "--help",
    "--host", "--http.host", "--http.max_body_mb", "--http.port", "--http.token", "--http.token_file",
    "--math.extraction", "--math.max_answer_chars", "--math.max_response_chars", "--metrics_port", "--port",
    "--reward.model_name_or_path", "--reward.no_normalize_enable", "--reward.normalize_enable", "--rm.append_eos",
    "--rm.attn_implementation", "--rm.device", "--rm.disable_fast_tokenizer", "--rm.dtype", "--rm.max_len",
    "--rm.micro_batch_size", "--rm.no_append_eos", "--rm.no_normalize", "--rm.normalize", "--rm.path", "--rm.replicas",
    "--rm.value_head_prefix", "--rm.weight", "--score_from", "--shaping.length_unit", "--shaping.max_new_tokens",
    "--shaping.overlong_buffer_len", "--shaping.overlong_penalty_factor", "--shaping.stop_properly_penalty_coef",
    "--shaping.stop_texts", "--shaping.tokenizer", "--weights", "--workers.isolate_failures", "--workers.memory_mb",
    "--workers.no_isolate_failures", "--workers.num_workers", "--workers.start_timeout_s", "--workers.timeout_s",
    "--zmq.curve_dir", "--zmq.endpoint", "--zmq.max_in_flight", "-h",
]
# OpenRLHF's examples/scripts/serve_remote_rm.sh (python -m openrlhf.cli.serve_rm), flag for flag.
OPENRLHF_SERVE_RM = ["--reward.model_name_or_path", "OpenRLHF/Llama-3-8b-rm-700k", "--port", "5000",
                     "--ds.param_dtype", "bf16", "--ds.attn_implementation", "flash_attention_2",
                     "--reward.normalize_enable", "--data.max_len", "8192", "--batch_size", "16"]


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


def test_openrlhf_serve_rm_flags_reach_the_same_fields():
    cfg = parse(ServeConfig, OPENRLHF_SERVE_RM)
    assert cfg.rm == RMConfig(path="OpenRLHF/Llama-3-8b-rm-700k", dtype="bf16", attn_implementation="flash_attention_2",
                              normalize=True, max_len=8192, micro_batch_size=16)
    assert cfg.http.port == 5000
    treadle = ["--rm.path", "OpenRLHF/Llama-3-8b-rm-700k", "--http.port", "5000", "--rm.dtype", "bf16",
               "--rm.attn_implementation", "flash_attention_2", "--rm.normalize", "--rm.max_len", "8192",
               "--rm.micro_batch_size", "16"]
    assert parse(ServeConfig, treadle) == cfg  # one server, two spellings
    more = parse(ServeConfig, ["--rm.path", "m", "--ds.value_head_prefix", "value_head", "--data.disable_fast_tokenizer",
                               "--host", "127.0.0.2"])
    assert (more.rm.value_head_prefix, more.rm.disable_fast_tokenizer, more.http.host) == ("value_head", True, "127.0.0.2")


@pytest.mark.parametrize("flag", sorted(OPENRLHF_REFUSED))
def test_serve_rm_flags_treadle_does_not_implement_are_refused_by_name(capsys, flag):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--rm.path", "m", flag])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{flag} (OpenRLHF's serve_rm) is not supported" in err


def test_openrlhfs_open_host_still_needs_a_token(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", *OPENRLHF_SERVE_RM, "--host", "0.0.0.0"])
    assert e.value.code == 2 and "refusing to serve HTTP on 0.0.0.0 without --http.token" in capsys.readouterr().err


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
