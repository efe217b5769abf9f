"""RPC safety rules: loopback-only without keys, CURVE allow/deny, the treadle-keys CLI."""

from __future__ import annotations

import asyncio
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from treadle.common.errors import RequestTimeout
from treadle.common.records import Ack, Control
from treadle.common.rpc import (
    InsecureEndpoint,
    RpcClient,
    RpcServer,
    ServerThread,
    SyncRpcClient,
    generate_keys,
    load_client_keys,
    load_server_keys,
)
from treadle.common.rpc.security import main as keys_main
from treadle.common.rpc.transport import check_endpoint, is_loopback

SRC = str(Path(__file__).resolve().parents[1] / "src")


def async_test(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(asyncio.wait_for(fn(*args, **kwargs), 30.0))

    return wrapper


async def whoami(msg, ctx):
    return Control(op="whoami", args={"key": ctx.client_key})


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:0", "tcp://*:5555", "tcp://192.168.1.20:0",
                                      "tcp://eth0:0", "tcp://example.org:80"])
def test_non_loopback_bind_without_keys_refuses_with_how_to(endpoint):
    server = RpcServer(endpoint=endpoint, handlers={"whoami": whoami})
    with pytest.raises(InsecureEndpoint, match="treadle-keys generate DIR"):
        ServerThread(server).start()
    with pytest.raises(InsecureEndpoint, match="without CURVE keys"):
        RpcClient(endpoint)


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("127.3.2.1", True), ("localhost", True),
                                                ("[::1]", True), ("0.0.0.0", False), ("*", False),
                                                ("10.0.0.1", False), ("lo", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_endpoint_normalisation():
    assert check_endpoint("tcp://127.0.0.1:0", secure=False, role="bind") == "tcp://127.0.0.1:*"
    assert check_endpoint("ipc:///tmp/x", secure=False, role="bind") == "ipc:///tmp/x"
    assert check_endpoint("tcp://0.0.0.0:9", secure=True, role="bind") == "tcp://0.0.0.0:9"
    with pytest.raises(ValueError, match="unsupported endpoint"):
        check_endpoint("udp://127.0.0.1:9", secure=False, role="bind")
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        check_endpoint("tcp://127.0.0.1", secure=False, role="bind")


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    good = tmp_path_factory.mktemp("keys")
    generate_keys(good, clients=("client", "trainer0"))
    other = tmp_path_factory.mktemp("other")
    generate_keys(other, clients=("stranger",))
    return good, other


def test_generated_key_layout(keys):
    good, _ = keys
    names = sorted(p.name for p in good.iterdir())
    assert names == ["authorized_clients", "client.key", "client.key_secret", "server.key", "server.key_secret",
                     "trainer0.key", "trainer0.key_secret"]
    assert sorted(p.name for p in (good / "authorized_clients").iterdir()) == ["client.key", "trainer0.key"]
    assert (good / "server.key_secret").stat().st_mode & 0o077 == 0
    assert "secret-key" not in (good / "authorized_clients" / "client.key").read_text()


@async_test
async def test_curve_allows_listed_clients_and_rejects_others(keys):
    good, other = keys
    # A non-loopback bind is fine with keys; clients still connect over loopback.
    server = RpcServer(name="secure", endpoint="tcp://0.0.0.0:0", handlers={"whoami": whoami},
                       curve=load_server_keys(good))
    endpoint = await server.start()
    port = endpoint.rsplit(":", 1)[1]
    local = f"tcp://127.0.0.1:{port}"
    allowed = load_client_keys(good, name="trainer0")
    stranger = load_client_keys(other, name="stranger", server_public_file=good / "server.key")
    try:
        async with RpcClient(local, curve=allowed) as client:
            out = await client.call("whoami", Ack(), timeout=10)
            assert out.args["key"] == allowed.public_key.decode()
        async with RpcClient(local, curve=stranger) as client:
            with pytest.raises(RequestTimeout):
                await client.call("whoami", Ack(), timeout=0.5)
        async with RpcClient(local) as plaintext:
            with pytest.raises(RequestTimeout):
                await plaintext.call("whoami", Ack(), timeout=0.5)
        async with RpcClient(local, curve=load_client_keys(good)) as client:  # still serving
            assert (await client.call("whoami", Ack(), timeout=10)).args["key"]
        assert server.stats()["requests"] == 2
    finally:
        await server.close(grace_s=0.5)


def test_sync_client_with_keys_from_the_env_knob(keys, monkeypatch):
    good, _ = keys
    monkeypatch.setenv("TREADLE_CURVE_DIR", str(good))
    with ServerThread(RpcServer(handlers={"whoami": whoami}, curve=load_server_keys())) as st, \
            SyncRpcClient(st.endpoint, curve=load_client_keys()) as client:
        assert client.call("whoami", timeout=10).args["key"] == load_client_keys().public_key.decode()


def test_keys_cli_writes_loadable_keys(tmp_path, capsys):
    keys_main(["generate", str(tmp_path / "k"), "--clients", "a", "b"])
    assert "allow-list" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "k" / "authorized_clients").iterdir()) == ["a.key", "b.key"]
    before = (tmp_path / "k" / "server.key").read_bytes()
    keys_main(["generate", str(tmp_path / "k")])  # keeps existing keys without --overwrite
    assert (tmp_path / "k" / "server.key").read_bytes() == before
    assert load_client_keys(tmp_path / "k", name="a").server_public_key == load_server_keys(tmp_path / "k").public_key
    with pytest.raises(SystemExit):
        keys_main(["generate", str(tmp_path / "bad"), "--clients", "server"])


def test_keys_cli_flag_set_is_pinned(capsys):
    with pytest.raises(SystemExit):
        keys_main(["generate", "--help"])
    flags = set(re.findall(r"--[a-z][a-z-]*", capsys.readouterr().out))
    assert flags == {"--help", "--clients", "--overwrite", "--no-overwrite"}


def test_keys_cli_runs_as_a_module(tmp_path):
    out = subprocess.run([sys.executable, "-m", "treadle.common.rpc.security", "generate", str(tmp_path)],
                         capture_output=True, text=True, env={"PYTHONPATH": SRC}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "RuntimeWarning" not in out.stderr
    assert (tmp_path / "server.key_secret").exists()
