"""Security of the real daemons: open binds need credentials, wrong credentials get nothing, the
code sandbox holds, and no pickle is on the wire.

- Every daemon CLI started on a non-loopback address without CURVE keys (ZeroMQ) or a bearer
  token (HTTP) exits non-zero within seconds, naming the flag to set (so do the clients that
  would connect to one: ``treadle-rollout status``, the gateway's ``--rollout``).
- With credentials they serve on the machine's own (non-loopback) address: the right CURVE keys
  and tokens work; a stranger's keys, a wrong server key, plaintext, a missing or wrong token
  get nothing (ZeroMQ: no answer at all; HTTP: 401).
- Model-written code run by the reward daemon's ``code`` function (namespace isolation, and the
  rlimits fallback a non-root daemon gets) cannot reach the network, write outside its folder,
  read the daemon's secrets, fork past its limit, take the machine's memory, signal the daemon
  or leave a process behind, while the daemon keeps answering health checks.
- ``tools/check_no_pickle.py`` finds no pickle on the wire.
"""

from __future__ import annotations

import secrets
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

pytestmark = pytest.mark.chaos

ROOT = Path(__file__).resolve().parents[3]
TOKEN = secrets.token_hex(16)
UIDS = range(61000, 61064)  # the sandbox's uid pool (Sandbox's uid_base / uid_slots defaults)


def _script(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _machine_ip() -> str:
    """This machine's first non-loopback IPv4 address (the daemons bind it or 0.0.0.0)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    pytest.skip("no non-loopback IPv4 address on this machine")


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, port)) == 0


@pytest.fixture(scope="module")
def ip() -> str:
    return _machine_ip()


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """good: the daemons' folder (server pair, client pair, allow-list); other: a stranger's."""
    from treadle.common.rpc import generate_keys

    good, other = tmp_path_factory.mktemp("keys"), tmp_path_factory.mktemp("stranger-keys")
    generate_keys(good, clients=("client",))
    generate_keys(other, clients=("stranger",))
    token_file = tmp_path_factory.mktemp("secret") / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    return SimpleNamespace(good=good, other=other, token_file=token_file)


# ---------------------------------------------------------------------------------- refusals


def _refusals(tiny: Path, ip: str, free_port: Any) -> list[tuple[str, list[str], str]]:
    """(case, argv, the flag the message must name)."""
    p = free_port()
    rewards = [_script("treadle-rewards"), "serve", "--functions", "math"]
    rollout = [sys.executable, "-m", "treadle.rollout", "serve", "--model", str(tiny), "--backend", "hf"]
    agents = [_script("treadle-agents"), "serve", "--model", str(tiny), "--port", str(p)]
    return [
        ("rollout serve --endpoint tcp://0.0.0.0", [*rollout, "--endpoint", f"tcp://0.0.0.0:{p}"], "--curve_dir"),
        ("rollout serve --endpoint tcp://IP", [*rollout, "--endpoint", f"tcp://{ip}:{p}"], "--curve_dir"),
        ("rollout serve --endpoint tcp://*", [*rollout, "--endpoint", f"tcp://*:{p}"], "--curve_dir"),
        ("rollout status --endpoint tcp://IP", [_script("treadle-rollout"), "status", "--endpoint", f"tcp://{ip}:{p}"],
         "--curve_dir"),
        ("rewards --http.host 0.0.0.0", [*rewards, "--http.host", "0.0.0.0", "--http.port", str(p),
                                         "--zmq.endpoint", f"tcp://127.0.0.1:{free_port()}"], "--http.token"),
        ("rewards --zmq.endpoint tcp://IP", [*rewards, "--zmq.endpoint", f"tcp://{ip}:{p}", "--http.port",
                                            str(free_port())], "--zmq.curve_dir"),
        ("agents --host 0.0.0.0", [*agents, "--host", "0.0.0.0"], "--token"),
        ("agents --host IP --token ''", [*agents, "--host", ip, "--token", ""], "--token"),
        ("agents --rollout tcp://IP", [*agents, "--rollout", f"tcp://{ip}:{free_port()}"], "--rollout_curve_dir"),
    ]


def test_open_binds_without_credentials_refuse_to_start(tiny: Path, ip: str, chaos: Any, helpers: Any,
                                                        figures: Any) -> None:
    cases = _refusals(tiny, ip, chaos.free_port)
    failures = []
    for case, argv, flag in cases:
        start = time.monotonic()
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=helpers.child_env(),
                             stdin=subprocess.DEVNULL)
        seconds = time.monotonic() - start
        text = out.stdout + out.stderr
        ok = out.returncode != 0 and seconds < 30 and flag in text
        figures.record("security: open binds", case, f"exit {out.returncode} in {seconds:.1f} s, names {flag}: "
                       f"{flag in text}")
        if not ok:
            failures.append(f"{case}: exit {out.returncode} after {seconds:.1f} s:\n{text[-1500:]}")
    figures.record("security: open binds", "refused without credentials", f"{len(cases) - len(failures)}/{len(cases)}")
    assert not failures, "\n\n".join(failures)


def test_rollout_metrics_on_an_open_address_need_an_explicit_opt_in(tiny: Path, spawn: Any, chaos: Any) -> None:
    port = chaos.free_port()
    proc = spawn("open-metrics", chaos.rollout_argv(tiny, f"tcp://127.0.0.1:{chaos.free_port()}", "--backend", "hf",
                                                    "--metrics_host", "0.0.0.0", "--metrics_port", str(port)))
    deadline = time.monotonic() + 120
    while proc.alive() and not _listening("127.0.0.1", port) and time.monotonic() < deadline:
        time.sleep(0.3)
    serving = proc.alive() and _listening("127.0.0.1", port)
    proc.stop()
    assert not serving and proc.proc.returncode != 0, "serves metrics on 0.0.0.0 without a token"


# ---------------------------------------------------------------------------------- daemons with credentials


@pytest.fixture(scope="module")
def secure_rollout(spawn: Any, chaos: Any, tiny: Path, ip: str, keys: SimpleNamespace) -> SimpleNamespace:
    """Bound to 0.0.0.0 with CURVE; reached at the machine's own address."""
    from treadle.common.rpc import load_client_keys
    from treadle.rollout.client import SyncRolloutClient

    port = chaos.free_port()
    proc = spawn("secure-rollout", chaos.rollout_argv(tiny, f"tcp://0.0.0.0:{port}", "--backend", "hf", "--engines",
                                                      "1", "--curve_dir", str(keys.good)))
    endpoint, curve = f"tcp://{ip}:{port}", load_client_keys(keys.good)

    def ready() -> bool:
        with SyncRolloutClient(endpoint, curve=curve, timeout_s=5) as c:
            return c.health()["status"] == "ok"

    proc.wait_until(ready, timeout=300)
    return SimpleNamespace(proc=proc, endpoint=endpoint, curve=curve)


@pytest.fixture(scope="module")
def secure_rewards(spawn: Any, chaos: Any, ip: str, keys: SimpleNamespace) -> SimpleNamespace:
    """The code function in namespace isolation, ZeroMQ with CURVE and HTTP with a token file,
    both on 0.0.0.0; small sandbox limits (two cores here)."""
    from treadle.common.rpc import load_client_keys
    from treadle.rewards.client import SyncRewardClient

    zport, hport = chaos.free_port(), chaos.free_port()
    proc = spawn("secure-rewards", [_script("treadle-rewards"), "serve", "--functions", "code",
                                    "--zmq.endpoint", f"tcp://0.0.0.0:{zport}", "--zmq.curve_dir", str(keys.good),
                                    "--http.host", "0.0.0.0", "--http.port", str(hport), "--http.token_file",
                                    str(keys.token_file), *SANDBOX_FLAGS, "--code.isolation", "namespaces"])
    endpoint, curve = f"tcp://{ip}:{zport}", load_client_keys(keys.good)

    def ready() -> bool:
        with SyncRewardClient(endpoint, curve=curve, timeout_s=5) as c:
            return c.health()["status"] == "ok"

    proc.wait_until(ready, timeout=300)
    return SimpleNamespace(proc=proc, endpoint=endpoint, curve=curve, http=f"http://{ip}:{hport}", hport=hport)


@pytest.fixture(scope="module")
def secure_gateway(spawn: Any, chaos: Any, tiny: Path, ip: str, keys: SimpleNamespace,
                   secure_rollout: SimpleNamespace) -> SimpleNamespace:
    """On 0.0.0.0 with a token file, talking to the CURVE rollout daemon at the machine's address."""
    import requests

    port = chaos.free_port()
    url = f"http://{ip}:{port}"
    proc = spawn("secure-gateway", [_script("treadle-agents"), "serve", "--model", str(tiny), "--host", "0.0.0.0",
                                    "--port", str(port), "--token_file", str(keys.token_file), "--rollout",
                                    secure_rollout.endpoint, "--rollout_curve_dir", str(keys.good),
                                    "--default_max_tokens", "2"])
    proc.wait_until(lambda: requests.get(url + "/health", timeout=5).json()["status"] == "ok", timeout=300)
    return SimpleNamespace(proc=proc, http=url)


SANDBOX_FLAGS = ["--code.cpu_s", "1", "--code.wall_s", "20", "--code.memory_mb", "256", "--code.nproc", "8",
                 "--code.fsize_mb", "1", "--workers.num_workers", "2", "--workers.timeout_s", "120"]


# ---------------------------------------------------------------------------------- CURVE


def _plaintext_answered(endpoint: str, wait_s: float = 3.0) -> bool:
    """A DEALER without keys (past the client's own refusal) sends a health call: answered?"""
    import zmq

    from treadle.common.codec import encode

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart(encode(None, id=1, op="call", method="health"))
        return bool(sock.poll(int(wait_s * 1000)))
    finally:
        sock.close(linger=0)


def _curve_probes(endpoint: str, keys: SimpleNamespace, client_cls: Any) -> dict[str, str]:
    """Who gets an answer: the right keys, three kinds of wrong ones; "served" or why not."""
    from treadle.common.rpc import load_client_keys

    probes = {
        "right keys": load_client_keys(keys.good),
        "a stranger's keys": load_client_keys(keys.other, name="stranger",
                                              server_public_file=keys.good / "server.key"),
        "another server's public key (right client pair)": load_client_keys(
            keys.good, server_public_file=keys.other / "server.key"),
    }
    out = {}
    for name, curve in probes.items():
        try:
            with client_cls(endpoint, curve=curve, timeout_s=3) as c:
                out[name] = "served" if c.health() else "empty"
        except Exception as e:  # noqa: BLE001  (RequestTimeout expected: the handshake never completes)
            out[name] = type(e).__name__
    out["plaintext (no keys)"] = "served" if _plaintext_answered(endpoint) else "no answer"
    out["right keys, after the others"] = out["right keys"] and _health_with(endpoint, probes["right keys"],
                                                                              client_cls)
    return out


def _health_with(endpoint: str, curve: Any, client_cls: Any) -> str:
    with client_cls(endpoint, curve=curve, timeout_s=10) as c:
        return "served" if c.health()["status"] == "ok" else "not ok"


def _check_curve(name: str, probes: dict[str, str], figures: Any) -> None:
    for probe, got in probes.items():
        figures.record(f"security: CURVE {name}", probe, got)
    wrong = [p for p in probes if not p.startswith("right")]
    figures.record(f"security: CURVE {name}", "wrong-key clients served", f"{sum(probes[p] == 'served' for p in wrong)}"
                   f"/{len(wrong)}")
    assert probes["right keys"] == "served" and probes["right keys, after the others"] == "served", probes
    assert all(probes[p] != "served" for p in wrong), probes


def test_curve_rollout_on_an_open_address(secure_rollout: SimpleNamespace, keys: SimpleNamespace,
                                          figures: Any) -> None:
    from treadle.common.records import SamplingParams
    from treadle.rollout.client import SyncRolloutClient

    probes = _curve_probes(secure_rollout.endpoint, keys, SyncRolloutClient)
    with SyncRolloutClient(secure_rollout.endpoint, curve=secure_rollout.curve, timeout_s=120) as c:
        out = c.generate([1, 2, 3], SamplingParams(max_tokens=4))
    probes["right keys: generate"] = "served" if len(out[0].response_token_ids) == 4 else "wrong answer"
    _check_curve("rollout", probes, figures)


def test_curve_rewards_on_an_open_address(secure_rewards: SimpleNamespace, keys: SimpleNamespace,
                                          figures: Any) -> None:
    from treadle.rewards.client import SyncRewardClient

    _check_curve("rewards", _curve_probes(secure_rewards.endpoint, keys, SyncRewardClient), figures)


# ---------------------------------------------------------------------------------- bearer tokens


def _auth_variants(query_token: bool) -> dict[str, tuple[bool, dict[str, str], str]]:
    """name -> (is the right credential, headers, query string)."""
    same_length = TOKEN[:-1] + ("1" if TOKEN[-1] == "0" else "0")
    out = {"no token": (False, {}, ""), "wrong token": (False, {"Authorization": "Bearer nope"}, ""),
           "wrong token of the same length": (False, {"Authorization": f"Bearer {same_length}"}, ""),
           "right token, Basic scheme": (False, {"Authorization": f"Basic {TOKEN}"}, ""),
           "right token plus a suffix": (False, {"Authorization": f"Bearer {TOKEN}x"}, ""),
           "right token": (True, {"Authorization": f"Bearer {TOKEN}"}, "")}
    if query_token:  # the rewards daemon also takes ?access_token= (OpenRLHF's client sets no headers)
        out["wrong ?access_token="] = (False, {}, "?access_token=nope")
        out["right ?access_token="] = (True, {}, f"?access_token={TOKEN}")
    return out


def _check_tokens(name: str, url: str, calls: list[tuple[str, str, Any]], query_token: bool, figures: Any) -> None:
    """Each call with each credential: wrong ones 401, right ones 200; /health open."""
    import requests

    sec, wrong, right = f"security: token {name}", {}, {}
    for method, path, body in calls:
        for variant, (good, headers, query) in _auth_variants(query_token).items():
            status = requests.request(method, url + path + query, json=body, headers=headers, timeout=120).status_code
            (right if good else wrong)[f"{method} {path}: {variant}"] = status
    health = requests.get(url + "/health", timeout=30)
    for probe, status in {**wrong, **right, "GET /health, no token": health.status_code}.items():
        figures.record(sec, probe, status)
    figures.record(sec, "wrong or missing tokens rejected (401)", f"{sum(s == 401 for s in wrong.values())}/{len(wrong)}")
    assert all(s == 401 for s in wrong.values()), wrong
    assert all(s == 200 for s in right.values()), right
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_bearer_token_rewards_on_an_open_address(secure_rewards: SimpleNamespace, figures: Any) -> None:
    body = {"query": ["```python\nprint(3)\n```"], "prompts": [""], "labels": [{"tests": [{"input": "", "output": "3"}]}]}
    _check_tokens("rewards HTTP", secure_rewards.http, [("POST", "/get_reward", body), ("POST", "/v1/reward", body),
                                                        ("GET", "/metrics", None), ("GET", "/info", None)], True, figures)


def test_bearer_token_gateway_on_an_open_address(secure_gateway: SimpleNamespace, figures: Any) -> None:
    """/health answers "ok" without a token: the gateway reaches the rollout daemon over CURVE."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    _check_tokens("gateway HTTP", secure_gateway.http, [("GET", "/v1/models", None), ("POST", "/v1/chat/completions",
                  chat), ("POST", "/tokenize", {"prompt": "hi"}), ("GET", "/v1/sessions", None)], False, figures)


# ---------------------------------------------------------------------------------- the code sandbox

LABEL = {"tests": [{"input": "", "output": "3\n"}]}  # an escape that works prints 3 and scores 1.0


def _sandbox_pool_processes() -> list[str]:
    """Processes running as one of the sandbox's uids (a run's leftovers)."""
    out = []
    for p in psutil.process_iter(["pid", "uids", "cmdline"]):
        uids = p.info["uids"]
        if uids is not None and uids.real in UIDS:
            out.append(f"{p.info['pid']} uid {uids.real}: {' '.join(p.info['cmdline'] or [])[:80]}")
    return out


def _no_leftovers(wait_s: float = 5.0) -> bool:
    """No process of the sandbox's uid pool, within ``wait_s`` (the kernel reaps a killed run)."""
    deadline = time.monotonic() + wait_s
    while _sandbox_pool_processes():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _escapes(ip: str, hport: int, daemon_pid: int, token_file: Path, full: bool) -> dict[str, tuple[str, Any]]:
    """name -> (program, check after the run: True when contained by outside evidence too)."""
    tmp_target = Path("/tmp") / f"treadle-escape-{uuid.uuid4().hex}"
    repo_target = ROOT / ".cache" / "chaos" / f"escape-{uuid.uuid4().hex}"
    repo_target.parent.mkdir(parents=True, exist_ok=True)
    fork = ("import os, time\nfor i in range(64):\n    if os.fork() == 0:\n        time.sleep(30)\n"
            "        os._exit(0)\nprint(3)")
    out = {
        "network: the daemon's own HTTP port on 127.0.0.1": (
            f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{hport}/health', timeout=2)\nprint(3)",
            lambda: True),
        "file system: write /tmp": (f"open({str(tmp_target)!r}, 'w').write('x')\nprint(3)",
                                    lambda: not tmp_target.exists()),
        "fork: 64 sleeping children (nproc 8)": (fork, _no_leftovers),
        "memory: 2 GiB (limit 256 MiB)": ("x = bytearray(2 << 30)\nprint(3)", lambda: True),
    }
    if not full:  # rlimits (a daemon that is not root): the four the audit hook and rlimits answer
        return out
    return {**out,
            "network: the machine's address": (
                f"import socket\nsocket.create_connection(({ip!r}, {hport}), timeout=2)\nprint(3)", lambda: True),
            "file system: write into the checkout": (f"open({str(repo_target)!r}, 'w').write('x')\nprint(3)",
                                                     lambda: not repo_target.exists()),
            "file system: read the daemon's token file (0600)": (f"open({str(token_file)!r}).read()\nprint(3)",
                                                                 lambda: True),
            "cpu: an endless loop (1 CPU s)": ("while True:\n    pass", lambda: True),
            "signal: SIGKILL the daemon's pid": (f"import os\nos.kill({daemon_pid}, 9)\nprint(3)",
                                                 lambda: psutil.pid_exists(daemon_pid)),
            "signal: SIGKILL everything it can (kill -1)": ("import os\nos.kill(-1, 9)\nprint(3)",
                                                             lambda: psutil.pid_exists(daemon_pid)),
            "privilege: setuid(0)": ("import os\nos.setuid(0)\nprint(3)", lambda: True),
            "persistence: a setsid'd sleeper outliving the run": (
                "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(300)\n    os._exit(0)\n",
                _no_leftovers)}


class _HealthPoller:
    """Health calls in a loop (its own client, a thread) while a ``with`` block runs."""

    def __init__(self, endpoint: str, curve: Any) -> None:
        self.endpoint, self.curve = endpoint, curve
        self.answered = self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from treadle.rewards.client import SyncRewardClient

        with SyncRewardClient(self.endpoint, curve=self.curve, timeout_s=10) as c:
            while not self._stop.wait(0.2):
                try:
                    ok = c.health()["status"] == "ok"
                except Exception:  # noqa: BLE001
                    ok = False
                self.answered += ok
                self.failed += not ok

    def __enter__(self) -> _HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def _run_escapes(name: str, endpoint: str, curve: Any, escapes: dict[str, tuple[str, Any]], proc: Any,
                 figures: Any) -> None:
    from treadle.rewards.client import SyncRewardClient

    programs = [f"```python\n{code}\n```" for code, _ in escapes.values()] + ["```python\nprint(1 + 2)\n```"]
    with _HealthPoller(endpoint, curve) as health, SyncRewardClient(endpoint, curve=curve, timeout_s=600) as c:
        res = c.score(programs, [""] * len(programs), [LABEL] * len(programs))
    sec = f"security: sandbox ({name})"
    contained = []
    for (escape, (_, check)), reward, hits, failed in zip(escapes.items(), res.rewards.tolist(),
                                                          res.extra_logs["code/limit_hits"], res.failed, strict=False):
        # failed: the sandbox could not even start (scored failure_reward, proves nothing)
        held = not failed and (reward == 0.0 or escape.startswith("persistence")) and check()
        contained.append(held)
        figures.record(sec, escape, f"{'contained' if held else 'NOT CONTAINED'} (reward {reward:g}, limit hit "
                       f"{hits:g}{', sample failed' if failed else ''})")
    figures.record(sec, "escapes contained", f"{sum(contained)}/{len(contained)}")
    figures.record(sec, "health checks answered during the escapes", f"{health.answered}/"
                   f"{health.answered + health.failed}")
    figures.record(sec, "an honest program after them scores", res.rewards.tolist()[-1])
    assert all(contained), dict(zip(escapes, contained, strict=True))
    assert res.rewards.tolist()[-1] == 1.0 and proc.alive(), proc.tail()
    assert health.failed == 0 and health.answered > 0
    assert _no_leftovers(), _sandbox_pool_processes()


def test_sandbox_contains_escapes_while_the_daemon_serves(secure_rewards: SimpleNamespace, ip: str,
                                                          keys: SimpleNamespace, figures: Any) -> None:
    """Namespace isolation (the daemon runs as root here): every escape fails; health answered."""
    escapes = _escapes(ip, secure_rewards.hport, secure_rewards.proc.proc.pid, keys.token_file, full=True)
    _run_escapes("namespaces", secure_rewards.endpoint, secure_rewards.curve, escapes, secure_rewards.proc, figures)


def test_sandbox_rlimits_fallback_contains_the_basic_escapes(spawn: Any, chaos: Any, figures: Any) -> None:
    """The fallback a daemon that is not root gets (rlimits + audit hook), forced here. Signals
    and privilege are not tried: under it the code runs with the daemon's (root's) rights."""
    from treadle.rewards.client import SyncRewardClient

    zport, hport = chaos.free_port(), chaos.free_port()
    endpoint = f"tcp://127.0.0.1:{zport}"
    proc = spawn("rlimits-rewards", [_script("treadle-rewards"), "serve", "--functions", "code", "--zmq.endpoint",
                                     endpoint, "--http.port", str(hport), *SANDBOX_FLAGS, "--code.isolation", "rlimits"])
    proc.wait_until(lambda: chaos.zmq_health(endpoint, SyncRewardClient)["status"] == "ok", timeout=300)
    try:
        escapes = _escapes("127.0.0.1", hport, proc.proc.pid, Path("/nonexistent"), full=False)
        _run_escapes("rlimits fallback", endpoint, None, escapes, proc, figures)
    finally:
        proc.stop()


# ---------------------------------------------------------------------------------- no pickle


def test_no_pickle_on_the_wire(figures: Any) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "check_no_pickle.py")], capture_output=True, text=True,
                         timeout=120)
    summary = out.stdout.strip().splitlines()[-1]
    findings = int(summary.split(" finding(s)")[0].rsplit(" ", 1)[1])
    allowed = int(summary.split(" allowed")[0].rsplit(" ", 1)[1])
    figures.record("security: pickle", "pickle uses on the wire (tools/check_no_pickle.py)", findings)
    figures.record("security: pickle", "allowed local uses (Ray launcher calls, DeepSpeed checkpoint load)", allowed)
    assert out.returncode == 0 and findings == 0, out.stdout
