"""Environment knobs, structured logging, metrics JSONL / PNG / Prometheus."""

from __future__ import annotations

import io
import json
import urllib.request

import numpy as np
import pytest

from treadle.common import env
from treadle.common.log import get_logger, setup_logging
from treadle.common.metrics import MetricsLogger, ServiceMetrics, plot_curves, read_jsonl


def test_knobs_typed_with_defaults_and_clear_errors():
    assert env.get("TREADLE_RPC_TIMEOUT_S", {}) == 60.0
    assert env.get("TREADLE_RPC_TIMEOUT_S", {"TREADLE_RPC_TIMEOUT_S": "2.5"}) == 2.5
    assert env.get("TREADLE_LOG_JSON", {"TREADLE_LOG_JSON": "yes"}) is True
    with pytest.raises(ValueError, match="TREADLE_MAX_FRAME_BYTES='lots': expected int"):
        env.get("TREADLE_MAX_FRAME_BYTES", {"TREADLE_MAX_FRAME_BYTES": "lots"})
    with pytest.raises(KeyError):
        env.get("TREADLE_NOT_A_KNOB", {})
    assert "TREADLE_LOG_LEVEL" in env.describe()


def test_json_logs_carry_fields():
    buf = io.StringIO()
    setup_logging("DEBUG", json_lines=True, stream=buf)
    get_logger("test").info("served", extra={"fields": {"requests": 3, "engine": "e0"}})
    row = json.loads(buf.getvalue().strip().splitlines()[-1])
    assert row["msg"] == "served" and row["requests"] == 3 and row["engine"] == "e0"
    assert row["logger"] == "treadle.test"
    setup_logging("INFO", json_lines=False)


def test_metrics_jsonl_and_png(tmp_path):
    with MetricsLogger(tmp_path / "m.jsonl") as m:
        for step in range(5):
            written = m.log(step, {"loss": 1.0 / (step + 1), "reward": np.float32(step), "text": "dropped",
                                   "nan": float("nan")})
    assert set(written) == {"loss", "reward"}
    rows = read_jsonl(tmp_path / "m.jsonl")
    assert [r["step"] for r in rows] == list(range(5)) and rows[4]["reward"] == 4.0
    (tmp_path / "m.jsonl").open("a").write('{"step": 5, "loss"')  # a torn line from a killed run
    assert len(read_jsonl(tmp_path / "m.jsonl")) == 5
    png = plot_curves(tmp_path / "m.jsonl", tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prometheus_registry_is_per_service_and_served_on_loopback():
    a, b = ServiceMetrics("rollout"), ServiceMetrics("rewards")
    a.counter("requests_total", "requests").inc(3)
    b.counter("requests_total", "requests").inc()
    assert b"treadle_rollout_requests_total 3.0" in a.exposition()
    assert b"treadle_rollout" not in b.exposition()
    server, _thread = a.serve(0)
    try:
        port = server.server_address[1]
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert b"treadle_rollout_requests_total 3.0" in body
    finally:
        server.shutdown()
