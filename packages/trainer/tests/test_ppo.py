"""``treadle-train ppo`` end to end on CPU: a real rollout daemon (vLLM's CPU build) on the tiny
model, a reward function file, DeepSpeed ZeRO-3, the weight sender over gloo, the trajectory log.

One daemon serves the whole module (runs connect with ``--vllm.endpoint``; each run first brings
it to its own weights). The toy task is verifiable: the reward is the share of digit characters in
the response, which a randomly initialised model already hits now and then, so GRPO has signal.

- first step: KL to the reference exactly 0 and engine-vs-trainer logprob gap <= 1e-3 (default suite);
- a GRPO run raises the mean reward;
- an asynchronous run keeps every sample within the staleness bound;
- a trainer killed (SIGKILL) mid-run and resumed trains every logged trajectory exactly once.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from treadle_testing import critic_server, rollout_daemon

REWARD = '''
import torch

def reward_func(queries, prompts, labels):
    out = []
    for q, p in zip(queries, prompts):
        text = q[len(p):] if q.startswith(p) else q
        chars = [c for c in text if not c.isspace()]
        out.append(sum(c.isdigit() for c in chars) / max(1, len(chars)))
    r = torch.tensor(out, dtype=torch.float32)
    return {"rewards": r, "scores": r, "extra_logs": {"digits": r}}
'''
WORDS = ["apple", "banana", "cherry", "delta", "echo", "fox", "golf", "hotel"]


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ppo_task")
    rows = [{"prompt": f"numbers for {WORDS[i % 8]} {WORDS[(i * 3) % 8]}:", "label": str(i % 10)} for i in range(64)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "reward.py").write_text(REWARD)
    return {"prompts": root / "prompts.jsonl", "reward": root / "reward.py"}


@pytest.fixture(scope="module")
def daemon(tiny, helpers):
    with serving(tiny, helpers, "--backend", "vllm") as endpoint:
        yield endpoint


def serving(tiny: Path, helpers, *flags: str):
    """A one-engine ``treadle-rollout serve`` of the tiny model (fp32) with ``flags``, ready; its endpoint."""
    return rollout_daemon(tiny, helpers.child_env(), "--engine.dtype", "float32", "--engine.max_model_len", "256",
                          *flags)


def ppo_args(tiny: Path, task: dict[str, Path], ckpt: Path, endpoint: str, *extra: str) -> list[str]:
    return ["ppo", "--actor.model_name_or_path", str(tiny), "--data.prompt_dataset", str(task["prompts"]),
            "--data.input_key", "prompt", "--data.label_key", "label", "--reward.remote_url", str(task["reward"]),
            "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "8",
            "--rollout.batch_size", "4", "--train.batch_size", "32", "--train.micro_batch_size", "16",
            "--rollout.micro_batch_size", "16", "--rollout.max_new_tokens", "12", "--data.prompt_max_len", "32",
            "--actor.adam.lr", "3e-3", "--actor.num_gpus_per_node", "1", "--ds.param_dtype", "fp32",
            "--ds.zero_stage", "3", "--vllm.endpoint", endpoint, "--vllm.bucket_mb", "1",
            "--ckpt.path", str(ckpt / "ckpt"), "--ckpt.output_dir", str(ckpt / "model"),
            "--rollout.logprobs", *extra]  # the engines' logprobs: the gap checks below read them


def run_ppo(args: list[str], helpers, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "treadle.trainer.cli", *args], env={**helpers.child_env(), **env},
                          capture_output=True, text=True, timeout=timeout, cwd=helpers.root)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


def metrics(ckpt: Path) -> list[dict]:
    return [json.loads(line) for line in (ckpt / "ckpt" / "metrics.jsonl").read_text().splitlines()]


def test_first_step_exact_and_run_artifacts(tiny, task, daemon, helpers, tmp_path):
    run_ppo(ppo_args(tiny, task, tmp_path, daemon, "--algo.kl.init_coef", "0.01", "--data.max_samples", "12",
                     "--eval.dataset", str(task["prompts"]), "--eval.n_samples_per_prompt", "2",
                     "--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", "mask"),
            helpers)
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["kl"] == 0.0  # the policy is the reference, computed the same way
    assert all(r["logprob_gap/max"] <= 1e-3 for r in rows)  # engines sample from the trainer's weights, every step
    # and every sync's canary (on by default: 16 tokens scored by the engine) came back within fp32's 1e-3
    assert all(0.0 <= r["sync/canary_gap"] <= 1e-3 for r in rows)
    assert all(r["is/kept_frac"] == 1.0 for r in rows)  # so IcePop keeps every token
    assert rows[-1]["kl"] > 0.0  # after an update (the first has lr 0: warm-up) the policy moved
    assert rows[2]["version"] == rows[0]["version"] + 2  # one new weight version per step
    assert "eval/pass@1" in rows[-1] and 0.0 <= rows[-1]["eval/pass@1"] <= 1.0
    for key in ("reward/mean", "entropy", "actor/clip_frac", "actor/ppo_clip_ratio", "actor/ppo_kl",
                "response_length/mean", "staleness/max",
                "time/generate", "time/experience", "time/train", "time/sync"):
        assert key in rows[0], key
    assert (tmp_path / "model" / "model.safetensors").is_file()
    assert (tmp_path / "ckpt" / "curves.png").is_file()
    assert (tmp_path / "ckpt" / "config.yaml").is_file()


def test_a_reference_served_apart_scores_the_sampled_tokens(tiny, task, daemon, helpers, tmp_path):
    """``--ref.remote_url``: the KL's reference is a hf rollout daemon of the starting model, not
    a model in the ranks. At the sampling temperature (0.9 here) and packed, its first-step KL is
    the ranks' own to fp32 rounding (the policy is the reference); then the policy moves away."""
    with serving(tiny, helpers, "--backend", "hf") as ref_url:
        proc = run_ppo(ppo_args(tiny, task, tmp_path, daemon, "--algo.kl.init_coef", "0.01", "--data.max_samples", "12",
                                "--rollout.temperature", "0.9", "--ds.packing_samples", "--ref.remote_url", ref_url),
                       helpers, TREADLE_LOG_LEVEL="INFO")
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert abs(rows[0]["kl"]) < 1e-6 < rows[-1]["kl"], [r["kl"] for r in rows]  # fp32 rounding; then it moved
    assert "reference: scored by the daemon at --ref.remote_url" in proc.stdout + proc.stderr


GAE = ["--algo.advantage.estimator", "gae", "--rollout.n_samples_per_prompt", "1", "--rollout.batch_size", "8",
       "--train.batch_size", "8", "--train.micro_batch_size", "4", "--rollout.micro_batch_size", "8",
       "--data.max_samples", "24", "--algo.kl.init_coef", "0.01"]


def test_a_critic_trained_apart_gives_the_run_the_ranks_own_critic(tiny, task, daemon, helpers, tmp_path):
    """``--critic.remote_url``: the critic values and trains in a critic server of its own (2 ranks,
    ZeRO-3 over gloo), not in the trainer's rank. Same seed, same samples: the run's critic losses,
    returns and rewards are those of the critic trained in the ranks, step for step. Then each run
    resumes from its checkpoint for 3 more steps, the apart one on a new server, which takes the
    critic's state from the trainer's checkpoint: still the same, step for step."""
    def both(arm: str, *more: str) -> subprocess.CompletedProcess:
        args = ppo_args(tiny, task, tmp_path / arm, daemon, *GAE, "--ckpt.save_steps", "1", *more)
        if arm == "ranks":
            return run_ppo(args, helpers)
        with critic_server(helpers.child_env(), helpers.root, ranks=2) as url:
            return run_ppo([*args, "--critic.remote_url", url, "--critic.num_gpus_per_node", "2",
                            "--critic.save_value_network"], helpers, TREADLE_LOG_LEVEL="INFO")

    for arm in ("ranks", "apart"):
        proc = both(arm)
        both(arm, "--ckpt.load_enable", "--train.num_episodes", "2")
    ranks, apart = metrics(tmp_path / "ranks"), metrics(tmp_path / "apart")
    assert [r["step"] for r in apart] == [1, 2, 3, 4, 5, 6]
    for key in ("critic/loss", "returns/mean", "reward/mean", "actor/policy_loss"):
        assert [r.get(key) for r in apart] == pytest.approx([r.get(key) for r in ranks], rel=1e-5, abs=1e-7), key
    assert "critic: trained apart by the server at --critic.remote_url" in proc.stderr
    assert (tmp_path / "apart" / "ckpt" / "step_00000006" / "critic").is_dir()  # in the trainer's checkpoint
    assert (tmp_path / "apart" / "model_critic" / "model.safetensors").is_file()  # exported by the server


def test_a_run_heals_a_daemon_whose_engine_an_earlier_update_quarantined(tiny, task, helpers, tmp_path):
    """A daemon given by --vllm.endpoint whose engine failed an earlier update's canary (quarantined:
    it takes no work) is still one the run can use: the trainer waits for engines that take an update,
    not for ready ones (that wait ran out after 600 s), and its first sync heals the engine."""
    import numpy as np
    from safetensors.numpy import load_file

    from treadle.common.records import InlineWeights
    from treadle.rollout.client import EnginesQuarantined, SyncRolloutClient

    weights = load_file(str(tiny / "model.safetensors"))  # the whole model: an update may not leave any out
    names = sorted(weights)
    bad = InlineWeights(version=1, names=names, dtypes=["float32"] * len(names),
                        shapes=[list(weights[n].shape) for n in names], tensors=[weights[n].astype(np.float32) for n in names],
                        canary_token_ids=np.arange(5, 21, dtype=np.int32), canary_logprobs=np.zeros(15, np.float32),
                        canary_tolerance=1e-4)  # the same weights, a canary no model gives
    with serving(tiny, helpers, "--backend", "hf") as endpoint:
        with SyncRolloutClient(endpoint) as rc:
            with pytest.raises(EnginesQuarantined):
                rc.update_weights(bad)
            assert rc.health()["status"] == "down"
        proc = run_ppo(ppo_args(tiny, task, tmp_path, endpoint, "--algo.kl.init_coef", "0", "--data.max_samples", "8"),
                       helpers, timeout=300, TREADLE_LOG_LEVEL="INFO")
        with SyncRolloutClient(endpoint) as rc:
            assert rc.health()["status"] == "ok"
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]
    assert "were quarantined by an earlier weight update" in proc.stderr


@pytest.mark.slow
def test_grpo_first_step_exact_then_reward_rises(tiny, task, daemon, helpers, tmp_path):
    run_ppo(ppo_args(tiny, task, tmp_path, daemon, "--algo.kl.init_coef", "0.01", "--train.num_episodes", "3",
                     "--eval.dataset", str(task["prompts"]), "--eval.steps", "8", "--eval.n_samples_per_prompt", "2"),
            helpers)
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 49))
    first = rows[0]
    assert first["kl"] == 0.0  # the policy is the reference, computed the same way
    assert first["logprob_gap/max"] <= 1e-3  # the engine sampled from exactly the trainer's weights
    assert all(r["logprob_gap/max"] <= 1e-3 for r in rows)  # and still does after every weight sync
    early = sum(r["reward/mean"] for r in rows[:6]) / 6
    late = sum(r["reward/mean"] for r in rows[-6:]) / 6
    assert late > early + 0.1, (early, late)
    assert any("eval/pass@1" in r for r in rows)
    assert (tmp_path / "model" / "model.safetensors").is_file()
    assert (tmp_path / "ckpt" / "curves.png").is_file()


@pytest.mark.slow
def test_async_run_keeps_the_staleness_bound(tiny, task, daemon, helpers, tmp_path):
    run_ppo(ppo_args(tiny, task, tmp_path, daemon, "--algo.kl.init_coef", "0", "--train.async_enable",
                     "--train.async_queue_size", "1", "--train.num_episodes", "1"), helpers)
    rows = metrics(tmp_path)
    assert len(rows) == 16
    assert all(r["staleness/max"] <= 1 for r in rows)
    assert any(r["staleness/max"] == 1 for r in rows)  # it did run ahead: generation overlapped training


@pytest.mark.slow
def test_killed_and_resumed_trains_each_trajectory_once(tiny, task, daemon, helpers, tmp_path):
    from treadle.trainer.rl.trajlog import TrajectoryLog

    args = ppo_args(tiny, task, tmp_path, daemon, "--algo.kl.init_coef", "0", "--train.num_episodes", "1",
                    "--ckpt.save_steps", "3", "--ckpt.load_enable")
    proc = subprocess.Popen([sys.executable, "-m", "treadle.trainer.cli", *args], env=helpers.child_env(),
                            cwd=helpers.root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics_file = tmp_path / "ckpt" / "metrics.jsonl"
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:  # kill after step 5: step 3's checkpoint exists, steps 4-5 are lost
        if metrics_file.is_file() and len(metrics_file.read_text().splitlines()) >= 5:
            break
        assert proc.poll() is None, proc.stderr.read()[-4000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run_ppo(args, helpers)
    rows = metrics(tmp_path)
    steps = [r["step"] for r in rows]
    assert steps[-1] == 16 and set(steps) == set(range(1, 17))
    with TrajectoryLog(tmp_path / "ckpt" / "trajectories") as tl:
        lineage = tl.lineage(16)
        state = tl.recover(16)
    used = [u for step in sorted(lineage) for u in lineage[step]]
    assert len(used) == len(set(used)) == 16 * 32  # none twice
    assert not state.pending  # none skipped: every logged group was trained
    assert sorted(lineage) == list(range(1, 17))


AGENT_FILE = Path(__file__).resolve().parents[2] / "agents" / "tests" / "agent_files" / "agent_func.py"
VARIANTS = {
    # PPO with a critic started from a reward model (the tiny LM + a fresh value head scores)
    "gae_critic_reward_model": ["--algo.advantage.estimator", "gae", "--rollout.n_samples_per_prompt", "1",
                                "--rollout.batch_size", "8", "--train.batch_size", "8", "--train.micro_batch_size", "8",
                                "--rollout.micro_batch_size", "8", "--reward.remote_url", "",
                                "--reward.model_name_or_path", "{tiny}", "--critic.num_gpus_per_node", "1",
                                "--reward.num_gpus_per_node", "1", "--algo.kl.init_coef", "0.01",
                                "--critic.save_value_network", "--reward.offload"],
    "rloo_multi_turn_agent": ["--algo.advantage.estimator", "rloo", "--reward.remote_url", "",
                              "--train.agent_func_path", str(AGENT_FILE), "--rollout.max_new_tokens", "6"],
    "reinforce_two_epochs_gspo_is": ["--algo.advantage.estimator", "reinforce_baseline", "--train.max_epochs", "2",
                                     "--actor.policy_loss_type", "gspo", "--actor.loss_agg_mode", "seq-mean-token-mean",
                                     "--algo.advantage.is_correction_level", "token", "--actor.entropy_coef", "0.001"],
    "dr_grpo_colocated_sleep": ["--algo.advantage.estimator", "dr_grpo", "--train.colocate_all", "--vllm.enable_sleep",
                                "--ref.num_gpus_per_node", "1", "--algo.kl.init_coef", "0.01", "--algo.kl.use_loss",
                                "--algo.kl.estimator", "k3", "--ds.packing_samples"],
    "async_partial_rollout_dapo": ["--train.async_enable", "--train.partial_rollout_enable",
                                   "--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0.0", "0.9",
                                   "--reward.overlong_buffer_len", "4"],
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_run_and_log(variant, tiny, task, daemon, helpers, tmp_path):
    extra = [a.replace("{tiny}", str(tiny)) for a in VARIANTS[variant]]
    args = ppo_args(tiny, task, tmp_path, daemon, "--data.max_samples", "8", "--train.num_episodes", "1", *extra)
    if "" in args:  # a flag set to "" above removes it (the reward file) from the base arguments
        k = args.index("")
        del args[k - 1:k + 1]
        del args[args.index("--reward.remote_url"):args.index("--reward.remote_url") + 2]
    run_ppo(args, helpers)
    rows = metrics(tmp_path)
    assert rows and all(r["samples"] > 0 for r in rows)
    assert all(r["logprob_gap/max"] <= 1e-3 or variant.startswith("async") for r in rows)
    if "critic" in variant:
        assert "critic/loss" in rows[0]
        assert (tmp_path / "model_critic" / "model.safetensors").is_file()  # --critic.save_value_network
    if variant.startswith("async"):
        assert all(r["staleness/max"] <= 1 for r in rows)


CONSTANT = '''
def reward_func(queries, prompts, labels):
    return {"rewards": [0.5] * len(queries), "extra_logs": {"constant": [1.0] * len(queries)}}
'''


@pytest.mark.slow
def test_gae_without_a_critic_flag_starts_the_critic_from_the_actor(tiny, task, daemon, helpers, tmp_path):
    """OpenRLHF's default (train_ppo_ray): gae, rewards from --reward.remote_url, no
    --critic.model_name_or_path: the critic starts from the actor's weights (a fresh value head)."""
    proc = run_ppo(ppo_args(tiny, task, tmp_path, daemon, "--data.max_samples", "8", "--train.num_episodes", "1",
                            *VARIANTS["gae_critic_reward_model"][:12]), helpers, TREADLE_LOG_LEVEL="INFO")
    assert f"critic starts from {tiny} (--actor.model_name_or_path): --critic.model_name_or_path unset" in proc.stderr
    rows = metrics(tmp_path)
    assert rows and all("critic/loss" in r and r["samples"] > 0 for r in rows)


def test_a_run_whose_every_group_is_filtered_fails_naming_the_filter(tiny, task, daemon, helpers, tmp_path):
    """Every group's mean reward (0.5, a constant) outside --algo.dynamic_filtering_range 0.6 1:
    the prompts run out with no step trained. That exited 0 with nothing logged; now it exits
    non-zero naming the filter and the count, before any export."""
    (tmp_path / "constant.py").write_text(CONSTANT)
    args = ppo_args(tiny, task, tmp_path, daemon, "--data.max_samples", "8", "--train.num_episodes", "1",
                    "--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0.6", "1.0")
    args[args.index(str(task["reward"]))] = str(tmp_path / "constant.py")
    proc = subprocess.run([sys.executable, "-m", "treadle.trainer.cli", *args], env=helpers.child_env(),
                          capture_output=True, text=True, timeout=600, cwd=helpers.root)
    assert proc.returncode != 0
    assert ("no step was trained; the prompts ran out after 0 of 2 steps: groups dropped: "
            "8 filtered by --algo.dynamic_filtering_range 0.6 1") in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "model" / "model.safetensors").exists()


@pytest.mark.slow
def test_colocate_all_with_async_runs_async_with_its_own_engines(tiny, task, helpers, tmp_path):
    """--train.colocate_all --train.async_enable, refused before: as OpenRLHF, a warning, then an
    asynchronous run whose engines (a daemon the trainer starts, hf backend) are not colocated."""
    args = ppo_args(tiny, task, tmp_path, "", "--data.max_samples", "12", "--train.num_episodes", "1",
                    "--algo.kl.init_coef", "0", "--train.colocate_all", "--train.async_enable",
                    "--vllm.backend", "hf")
    del args[args.index("--vllm.endpoint"):args.index("--vllm.endpoint") + 2]
    proc = run_ppo(args, helpers)
    assert ("--train.colocate_all with --train.async_enable: as in OpenRLHF, only the trainer's models share GPUs"
            in proc.stderr), proc.stderr[-3000:]
    assert "the engines run in processes of their own and generate while the trainer trains; weights over gloo" \
        in proc.stderr
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["staleness/max"] <= 1 for r in rows)
    assert any(r["staleness/max"] == 1 for r in rows)  # generation ran ahead of training: asynchronous


@pytest.mark.slow
def test_two_reward_files_are_summed_and_logged_per_source(tiny, task, daemon, helpers, tmp_path):
    """--reward.remote_url digits.py,constant.py: every sample scored by both, the reward their sum
    (OpenRLHF's reward_fn), each source's mean in the metrics; --reward.remote_reduce mean halves it."""
    constant = tmp_path / "constant.py"
    constant.write_text(CONSTANT)
    for reduce, div in (("sum", 1.0), ("mean", 2.0)):
        out = tmp_path / reduce
        run_ppo(ppo_args(tiny, task, out, daemon, "--data.max_samples", "8", "--train.num_episodes", "1",
                         "--reward.remote_url", f"{task['reward']},{constant}", "--reward.remote_reduce", reduce),
                helpers)
        rows = metrics(out)
        assert rows
        for r in rows:
            assert r["reward/source1"] == 0.5 and r["constant"] == 1.0  # the constant file's, as it named it
            assert 0.0 <= r["reward/source0"] <= 1.0 and "digits" in r  # the digit share
            assert r["reward/mean"] == pytest.approx((r["reward/source0"] + 0.5) / div)
            assert r["score/mean"] == pytest.approx((r["score/source0"] + 0.5) / div)


@pytest.mark.slow
def test_two_ranks_zero3_data_parallel_and_ring(tiny, task, daemon, helpers, tmp_path):
    """2 data-parallel ranks, then 1 x a ring of 2: the same first step (same seeded samples, the
    same normalised loss), ZeRO-3 both."""
    runs = {}
    for name, extra in (("dp", []), ("ring", ["--ds.ring_attn_size", "2"])):
        out = tmp_path / name
        args = ppo_args(tiny, task, out, daemon, "--algo.kl.init_coef", "0.01", "--data.max_samples", "12",
                        "--actor.num_gpus_per_node", "2", "--train.micro_batch_size", "8",
                        "--rollout.micro_batch_size", "8", "--ds.packing_samples", *extra)
        helpers.torchrun(["-m", "treadle.trainer.cli", *args], nproc=2)
        rows = runs[name] = metrics(out)
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert rows[0]["kl"] == 0.0 and all(r["logprob_gap/max"] <= 1e-3 for r in rows)
        assert (out / "model" / "model.safetensors").is_file()
    dp, ring = runs["dp"][0], runs["ring"][0]
    assert dp["reward/mean"] == ring["reward/mean"]
    for key in ("actor/policy_loss", "actor/grad_norm", "entropy"):
        assert abs(dp[key] - ring[key]) <= 1e-4 * max(1.0, abs(dp[key])), (key, dp[key], ring[key])


OWN_DAEMON = ("--vllm.backend", "hf", "--train.colocate_all", "--ref.num_gpus_per_node", "1")
# vLLM on the trainer's GPU (fp32 like the trainer, eager: these steps are short), a third of its memory
OWN_VLLM = ("--vllm.backend", "vllm", "--train.colocate_all", "--ref.num_gpus_per_node", "1",
            "--vllm.gpu_memory_utilization", "0.3", "--vllm.enforce_eager")


@pytest.mark.gpu
@pytest.mark.parametrize(("sync", "own_daemon"), [
    pytest.param("cuda_ipc", None, id="cuda_ipc"),
    pytest.param("gloo", None, id="gloo"),
    pytest.param("cuda_ipc", OWN_DAEMON, id="cuda_ipc_own_daemon"),
    pytest.param("cuda_ipc", (*OWN_DAEMON, "--vllm.enable_sleep", "--ds.enable_sleep"), id="cuda_ipc_own_daemon_sleep"),
    pytest.param("cuda_ipc", OWN_VLLM, id="vllm_cuda_ipc_own_daemon"),
    pytest.param("cuda_ipc", (*OWN_VLLM, "--vllm.enable_sleep", "--ds.enable_sleep"), id="vllm_cuda_ipc_own_daemon_sleep"),
])
def test_ppo_on_one_gpu_with_an_engine_on_that_gpu(sync, own_daemon, tiny, task, helpers, tmp_path):
    """On the GPU machine: the trainer (ZeRO-3, one rank) and an engine (hf, or vLLM in the
    ``vllm_`` cases, whose weights arrive through its workers' cuda_ipc load) share GPU 0, so the
    weights cannot go over NCCL (it refuses two processes of one GPU in a group); each step's
    new weights reach the engine over CUDA IPC or over gloo, and the engine samples from them.
    ``own_daemon``: no --vllm.endpoint but these flags: the trainer starts the daemon with
    --train.colocate_all, which puts its engine on the trainer's GPU (``engine_gpus``); with the
    sleep flags both sides also free their GPU memory while the other works."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    args = ppo_args(tiny, task, tmp_path, "", "--data.max_samples", "12", "--algo.kl.init_coef", "0.01",
                    "--vllm.sync_backend", sync)
    if own_daemon:
        del args[args.index("--vllm.endpoint"):args.index("--vllm.endpoint") + 2]
        run_ppo([*args, *own_daemon], helpers)
    else:
        with serving(tiny, helpers, "--backend", "hf", "--engine.device", "cuda", "--gpu_ids", "0") as endpoint:
            args[args.index("--vllm.endpoint") + 1] = endpoint
            run_ppo(args, helpers)
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["version"] == rows[0]["version"] + 2  # one new weight version per step
    assert rows[-1]["kl"] > 0.0  # the policy moved, and
    assert all(r["logprob_gap/max"] <= 1e-3 for r in rows), [r["logprob_gap/max"] for r in rows]  # the engine has it
    if "--ds.enable_sleep" in (own_daemon or ()):  # the trainer gave its GPU memory up while the engine generated
        held = [(r["sleep/gpu_gib_before"], r["sleep/gpu_gib_after"]) for r in rows]
        assert all(after < before for before, after in held), held


@pytest.mark.gpu
def test_ppo_on_one_gpu_scores_its_reference_in_a_daemon_of_its_own(tiny, task, helpers, tmp_path):
    """``--ref.remote_url`` on the GPU machine: the reference is a second hf daemon on CUDA (fp32 as
    the trainer), scoring every sequence at the sampling temperature; the first step's KL is the
    ranks' own to float rounding, and the run trains (the engine syncs over CUDA IPC as above)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    on_gpu = ("--backend", "hf", "--engine.device", "cuda", "--gpu_ids", "0")
    with serving(tiny, helpers, *on_gpu) as endpoint, serving(tiny, helpers, *on_gpu) as ref_url:
        run_ppo(ppo_args(tiny, task, tmp_path, endpoint, "--data.max_samples", "12", "--algo.kl.init_coef", "0.01",
                         "--vllm.sync_backend", "cuda_ipc", "--rollout.temperature", "0.9", "--ref.remote_url", ref_url),
                helpers)
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert abs(rows[0]["kl"]) < 1e-4 < rows[-1]["kl"], [r["kl"] for r in rows]


@pytest.mark.gpu
def test_ppo_on_one_gpu_trains_its_critic_in_a_critic_server(tiny, task, helpers, tmp_path):
    """``--critic.remote_url`` on the GPU machine: the critic server is a DeepSpeed engine on CUDA
    (its own process and NCCL world; one GPU, so beside the trainer and the engine on GPU 0). gae,
    3 steps: values and critic losses come back, a checkpoint holds the server's critic state,
    and the server exports the value model."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    on_gpu = ("--backend", "hf", "--engine.device", "cuda", "--gpu_ids", "0")
    with serving(tiny, helpers, *on_gpu) as endpoint, critic_server(helpers.child_env(), helpers.root) as url:
        run_ppo(ppo_args(tiny, task, tmp_path, endpoint, *GAE, "--vllm.sync_backend", "cuda_ipc", "--ckpt.save_steps",
                         "1", "--critic.remote_url", url, "--critic.save_value_network"), helpers)
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["critic/loss"] > 0 for r in rows), rows
    assert (tmp_path / "ckpt" / "step_00000003" / "critic").is_dir()
    assert (tmp_path / "model_critic" / "model.safetensors").is_file()


@pytest.mark.gpu
def test_ppo_on_one_gpu_sends_only_the_lora_adapter_into_vllm_over_cuda_ipc(tiny, task, helpers, tmp_path):
    """``--vllm.sync_adapters`` on the GPU: vLLM (on the trainer's GPU) serves its own base model
    with the adapter each step sends over CUDA IPC (its workers stage the adapter from the
    sender's buckets, ``treadle_save_ipc``). bf16 on both sides: vLLM's LoRA kernels take no fp32
    (refused at start-up, ``test_lora_sync``). The engine samples from the trainer's policy
    within bf16's tolerance, and a sync is the adapter's bytes, not the model's."""
    import torch
    from safetensors import safe_open

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    args = ppo_args(tiny, task, tmp_path, "", "--data.max_samples", "12", "--algo.kl.init_coef", "0.01",
                    "--vllm.sync_backend", "cuda_ipc", "--ds.lora.rank", "8", "--vllm.sync_adapters")
    del args[args.index("--vllm.endpoint"):args.index("--vllm.endpoint") + 2]
    args[args.index("--ds.param_dtype") + 1] = "bf16"
    run_ppo([*args, *OWN_VLLM], helpers)
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["version"] == rows[0]["version"] + 2
    assert all(r["logprob_gap/mean"] <= 0.05 for r in rows), [r["logprob_gap/mean"] for r in rows]
    with safe_open(str(tiny / "model.safetensors"), "pt") as f:
        model_bytes = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys()) * 2  # in bf16  # noqa: SIM118 (safe_open has no __iter__)
    assert all(0 < r["sync/bytes"] * 4 < model_bytes for r in rows), ([r["sync/bytes"] for r in rows], model_bytes)
