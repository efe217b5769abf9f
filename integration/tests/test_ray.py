"""The Ray backend end to end on CPU (slow: a Ray cluster costs ~640 MB and seconds to start).

- ``treadle-launch --backend ray``: the same small GRPO run as the local test, every daemon a Ray
  actor running its own CLI main (vLLM's CPU build as the rollout engine here), the trainer in
  an actor; afterwards no actor's process tree and no part of the Ray cluster it started is left.
- ``python -m treadle.integration.train_ppo_ray`` with the seed's OpenRLHF PPO command line,
  shrunk to the tiny model, against a cluster from ``ray start --head`` (through RAY_ADDRESS, and
  through ``ray job submit`` when the installed Ray has its job API, i.e. ``ray[default]``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("ray")

# The seed's PPO command (seeds/000_5836f313df81d42f.txt), flags only, as in trainer/tests/test_config_cli.py.
SEED_PPO = """
   --ref.num_nodes 1 --ref.num_gpus_per_node 8 --reward.num_nodes 1 --reward.num_gpus_per_node 8
   --critic.num_nodes 1 --critic.num_gpus_per_node 8 --actor.num_nodes 1 --actor.num_gpus_per_node 8
   --vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all --vllm.gpu_memory_utilization 0.5
   --actor.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture --reward.model_name_or_path OpenRLHF/Llama-3-8b-rm-700k
   --ckpt.output_dir /openrlhf/examples/test_scripts/final/llama3-8b-rlhf
   --ckpt.path /openrlhf/examples/test_scripts/ckpt/llama3-8b-rlhf --ckpt.save_hf --train.batch_size 128
   --rollout.batch_size 1024 --train.dynamic_batch_enable --rollout.n_samples_per_prompt 1 --train.max_epochs 1
   --prompt_max_len 1024 --data.max_samples 100000 --generate_max_len 1024 --ds.zero_stage 3 --ds.param_dtype bf16
   --actor.adam.lr 5e-7 --critic.adam.lr 9e-6 --algo.kl.init_coef 0.01 --data.prompt_dataset OpenRLHF/prompt-collection-v0.1
   --data.input_key context_messages --data.apply_chat_template --reward.normalize_enable
   --actor.gradient_checkpointing_enable --ds.packing_samples --vllm.sync_backend nccl --vllm.enforce_eager
   --vllm.enable_sleep --ds.enable_sleep --logger.wandb.key {wandb_token}
"""


def shrunk_seed(tiny: Path, chat: Path, out: Path) -> list[str]:
    """The seed's flags with sizes for one CPU: 1 "GPU" per role, 1 engine, tiny model, 2 steps.

    Dropped: ``--ds.enable_sleep`` (it offloads ZeRO-3 states to host memory between phases, which
    means nothing on a CPU-only machine), ``--vllm.sync_backend nccl`` (it needs CUDA; on GPUs
    with ``--train.colocate_all`` it means CUDA IPC, as in OpenRLHF; unset, colocated engines on
    CPU get gloo) and the wandb key.
    Added: ``--vllm.backend hf`` (a faster start than vLLM's CPU build for a 2-step run).
    """
    values = {"--ref.num_gpus_per_node": "1", "--reward.num_gpus_per_node": "1", "--critic.num_gpus_per_node": "1",
              "--actor.num_gpus_per_node": "1", "--vllm.num_engines": "1", "--vllm.tensor_parallel_size": "1",
              "--actor.model_name_or_path": str(tiny), "--reward.model_name_or_path": str(tiny),
              "--ckpt.output_dir": str(out / "final"), "--ckpt.path": str(out / "ckpt"), "--train.batch_size": "4",
              "--rollout.batch_size": "4", "--prompt_max_len": "32", "--data.max_samples": "8",
              "--generate_max_len": "8", "--data.prompt_dataset": str(chat)}
    words = shlex.split(SEED_PPO)
    args: list[str] = []
    i = 0
    while i < len(words):
        flag = words[i]
        has_value = i + 1 < len(words) and not words[i + 1].startswith("--")
        if flag in ("--ds.enable_sleep", "--vllm.sync_backend", "--logger.wandb.key"):
            i += 2 if has_value else 1
            continue
        args.append(flag)
        if has_value:
            args.append(values.get(flag, words[i + 1]))
        i += 2 if has_value else 1
    return [*args, "--vllm.backend", "hf"]


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


@pytest.fixture(scope="module")
def ray_head(helpers, tmp_path_factory):
    """``ray start --head --block`` on free ports (never `ray stop`: it would stop every cluster here)."""
    from treadle.integration.procs import free_ports

    gcs, dash, client, agent = free_ports(4)
    dashboard = importlib.util.find_spec("aiohttp_cors") is not None  # ray[default]'s job API
    env = helpers.child_env(PATH=f"{Path(sys.executable).parent}:{helpers.child_env()['PATH']}")
    cmd = [_ray_bin(), "start", "--head", "--block", "--port", str(gcs), "--num-cpus", "4",
           "--temp-dir", str(helpers.cache / "ray"), "--disable-usage-stats", "--dashboard-host", "127.0.0.1",
           "--dashboard-port", str(dash), "--ray-client-server-port", str(client),
           "--dashboard-agent-listen-port", str(agent), f"--include-dashboard={str(dashboard).lower()}"]
    log = tmp_path_factory.mktemp("ray_head") / "ray_head.log"
    with open(log, "wb") as out:
        head = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"127.0.0.1:{gcs}"
    try:
        helpers.wait_for(lambda: subprocess.run([_ray_bin(), "status", "--address", address], env=env,
                                                capture_output=True).returncode == 0, 120, head, "the Ray head")
        if dashboard:
            _wait_dashboard(helpers, f"http://127.0.0.1:{dash}", head)
        yield {"address": address, "dashboard": f"http://127.0.0.1:{dash}" if dashboard else None, "env": env,
               "pid": head.pid}
    finally:
        tree = helpers.descendants(head.pid)
        head.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(30)
        for p in [*tree, *helpers.descendants(head.pid)]:
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(ProcessLookupError):
            head.kill()
        head.wait()


def _wait_dashboard(helpers, url: str, head) -> None:
    import urllib.request

    def up() -> bool:
        try:
            with urllib.request.urlopen(url + "/api/version", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    helpers.wait_for(up, 120, head, "the Ray dashboard")


def metrics(ckpt: Path) -> list[dict]:
    return [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]


def test_ray_backend_runs_the_small_grpo_run(tiny, task, helpers, tmp_path):
    run = tmp_path / "run"
    args = ["--backend", "ray", "--ray.address", "local", "--ray.num_cpus", "4", "--run_dir", str(run),
            "--", "rollout", "--no_cpu_bind", "--", "rewards", "--functions", str(task.reward), "--workers.num_workers",
            "1", "--", "ppo", *helpers.ppo_flags(tiny, task, tmp_path)]
    proc = helpers.launch(args)
    record = helpers.wait_for(lambda: (r := helpers.run_json(run)) and "trainer" in r.get("components", {}) and r,
                              600, proc, "the trainer to start")
    pids = [c["pid"] for c in record["components"].values()]
    seen = helpers.descendants(proc.pid) + [p for pid in pids for p in [psutil.Process(pid), *helpers.descendants(pid)]]
    out = helpers.finish(proc, 600)
    assert proc.returncode == 0, out[-6000:]
    time.sleep(1.0)  # Ray's own processes of the local cluster exit right after the driver
    assert not helpers.survivors(seen)

    record = helpers.run_json(run)
    assert record["backend"] == "ray" and record["ray"]["started_local_cluster"]
    comps = record["components"]
    assert {n: c["exit_code"] for n, c in comps.items()} == {"rollout": 0, "rewards": 0, "trainer": 0}
    assert len({c["node_id"] for c in comps.values()}) == 1
    assert len({c["pid"] for c in comps.values()}) == 3  # one actor process each
    assert [r["step"] for r in metrics(tmp_path / "ckpt")] == [1, 2]
    assert "treadle-rollout: serving" in (run / "rollout.log").read_text()  # the actor ran the daemon's own CLI
    assert "treadle-rewards: serving" in (run / "rewards.log").read_text()
    assert (run / "trainer.log").stat().st_size > 0


def _check_seed_run(run_dir: Path, out: Path) -> None:
    record = read_json(run_dir / "run.json")
    assert record["exit_code"] == 0
    assert record["ray"]["bundles"] == [{"CPU": 2.0}]  # --train.colocate_all: trainer and engines share one
    assert set(record["components"]) == {"rollout", "trainer"}
    rows = metrics(out / "ckpt")
    assert [r["step"] for r in rows] == [1, 2]
    assert (out / "final" / "model.safetensors").is_file()  # --ckpt.save_hf


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def _only_run_dir(parent: Path) -> Path:
    runs = list(parent.glob("launch-*"))
    assert len(runs) == 1, runs
    return runs[0]


def test_train_ppo_ray_with_the_seed_flags_on_a_ray_start_cluster(ray_head, tiny, task, helpers, tmp_path):
    runs = tmp_path / "runs"
    env = {**ray_head["env"], "RAY_ADDRESS": ray_head["address"], "TREADLE_RUN_DIR": str(runs)}
    proc = helpers.launch(shrunk_seed(tiny, task.chat, tmp_path), module="treadle.integration.train_ppo_ray", env=env)
    out = helpers.finish(proc, 600)
    assert proc.returncode == 0, out[-6000:]
    _check_seed_run(_only_run_dir(runs), tmp_path)
    assert read_json(_only_run_dir(runs) / "run.json")["ray"]["started_local_cluster"] is False


def test_train_ppo_ray_through_ray_job_submit(ray_head, tiny, task, helpers, tmp_path):
    if ray_head["dashboard"] is None:
        pytest.skip("the installed Ray has no job API (install treadle-integration[ray-jobs], i.e. ray[default])")
    runs = tmp_path / "runs"
    runtime_env = {"env_vars": {"TREADLE_RUN_DIR": str(runs)}}
    cmd = [_ray_bin(), "job", "submit", "--address", ray_head["dashboard"], "--runtime-env-json",
           json.dumps(runtime_env), "--", "python", "-m", "treadle.integration.train_ppo_ray",
           *shrunk_seed(tiny, task.chat, tmp_path)]
    proc = subprocess.run(cmd, env=ray_head["env"], capture_output=True, text=True, timeout=600, cwd=helpers.root)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "succeeded" in proc.stdout + proc.stderr
    _check_seed_run(_only_run_dir(runs), tmp_path)


def test_rays_temp_folder_fits_its_socket_paths(tmp_path):
    """A checkout deep in the tree made ``./.cache/ray`` too long for Ray's AF_UNIX socket paths
    (Ray died with a raw OSError): the default falls back to the system temp folder, and a given
    ``--ray.temp_dir`` that is too deep is refused naming the flag."""
    from treadle.common.config import ConfigError
    from treadle.integration.ray_backend import AF_UNIX_MAX, RAY_SOCKET_SUFFIX, ray_temp_dir

    assert ray_temp_dir("", Path("/tmp/c")) == Path("/tmp/c/ray")  # short enough: kept
    deep = tmp_path / ("d" * 80)
    fallback = ray_temp_dir("", deep)
    assert fallback != deep / "ray" and len(str(fallback)) + RAY_SOCKET_SUFFIX <= AF_UNIX_MAX
    assert ray_temp_dir("/tmp/ray", deep) == Path("/tmp/ray")
    with pytest.raises(ConfigError, match=r"^--ray\.temp_dir .*too long for Ray's socket paths"):
        ray_temp_dir(str(deep / "ray"), tmp_path)
