"""End to end on CPU with real components and the tiny model: the stages and daemons working together.

- SFT -> RM -> PPO with a critic: each stage's HF export is the next stage's starting weights;
  the PPO run's step-1 rewards are exactly what the RM export, loaded by transformers as the
  seed's README shows, gives the logged trajectories.
- GRPO with a reward-function file served by ``treadle-rewards serve`` over OpenRLHF's HTTP
  contract (``--reward.remote_url http://.../get_reward``): what the file computed is what the
  trainer logged, and it saw each prompt with its label.
- A multi-turn agent from an OpenRLHF agent file (``--train.agent_func_path``): environment text
  is in the trajectories with loss mask 0, rewards follow the file's rule.
- Async mode through ``treadle-launch`` with a vLLM (CPU build) rollout daemon: staleness bound.
- Fault: one engine of a 2-engine ``treadle-rollout serve`` SIGKILLed while it generates; the
  pool restarts it and the PPO run carries on to the end, on-policy.

The trainer (``treadle-train ppo``) starts its own rollout daemon unless a test gives it one
(``--vllm.endpoint``). Every run's trajectories are read back from its trajectory log.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
AGENT_FILE = ROOT / "packages" / "agents" / "tests" / "agent_files" / "agent_func.py"

# An OpenRLHF reward file: the share of digit characters in the response; it also appends what
# it was given and what it returned to a log (the path is filled in when the file is written).
REWARD = '''
import json

def reward_func(queries, prompts, labels):
    out = []
    for q, p in zip(queries, prompts):
        text = q[len(p):] if q.startswith(p) else q
        chars = [c for c in text if not c.isspace()]
        out.append(sum(c.isdigit() for c in chars) / max(1, len(chars)))
    with open(LOG, "a") as f:
        for q, p, l, r in zip(queries, prompts, labels, out):
            f.write(json.dumps({"query": q, "prompt": p, "label": l, "reward": r}) + "\\n")
    return {"rewards": out, "scores": out}
'''


@pytest.fixture(scope="module")
def arith(tmp_path_factory) -> SimpleNamespace:
    """sft.jsonl (question "a+b=", response the sum), pref.jsonl (chosen the sum, rejected a wrong
    one), prompts.jsonl (prompt, label the sum)."""
    root = tmp_path_factory.mktemp("arith")
    rng = random.Random(0)
    sft, pref, prompts = [], [], []
    for _ in range(48):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        q, s = f"{a}+{b}=", a + b
        sft.append({"question": q, "response": str(s)})
        pref.append({"prompt": q, "chosen": str(s), "rejected": str(s + rng.randint(1, 5))})
        prompts.append({"prompt": q, "label": str(s)})
    for name, rows in (("sft", sft), ("pref", pref), ("prompts", prompts)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return SimpleNamespace(sft=root / "sft.jsonl", pref=root / "pref.jsonl", prompts=root / "prompts.jsonl",
                           labels={r["prompt"]: r["label"] for r in prompts})


def trainer(command: str, *args: str, helpers, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m treadle.trainer.cli COMMAND ARGS`` (one CPU process); fails with its output."""
    proc = subprocess.run([sys.executable, "-m", "treadle.trainer.cli", command, *args],
                          env=helpers.child_env(TREADLE_LOG_LEVEL="WARNING"), capture_output=True, text=True,
                          timeout=timeout, cwd=helpers.root)
    assert proc.returncode == 0, f"treadle-train {command} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def ppo_args(actor: Path, prompts: Path, out: Path, *extra: str, new_tokens: int = 8, prompt_len: int = 16) -> list[str]:
    """A small PPO-family run: 4 prompts per step, ZeRO-0, fp32, the HF engine; ``extra`` adds the rest."""
    return ["--actor.model_name_or_path", str(actor), "--data.prompt_dataset", str(prompts),
            "--data.input_key", "prompt", "--data.label_key", "label", "--rollout.batch_size", "4",
            "--train.micro_batch_size", "8", "--rollout.micro_batch_size", "8", "--rollout.max_new_tokens",
            str(new_tokens), "--data.prompt_max_len", str(prompt_len), "--actor.num_gpus_per_node", "1",
            "--ds.param_dtype", "fp32",
            "--ds.zero_stage", "0", "--vllm.backend", "hf", "--vllm.bucket_mb", "1",
            "--ckpt.path", str(out / "ckpt"), "--ckpt.output_dir", str(out / "model"),
            "--rollout.logprobs", *extra]  # the engines' logprobs: the gap checks read them


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "ckpt" / "metrics.jsonl").read_text().splitlines()]


def trained(out: Path, tmp_path: Path) -> dict[int, list]:
    """Step -> the trajectories trained in it, from the run's trajectory log (read from a copy:
    reading every group means a ``recover(0)``, which appends a record)."""
    from treadle.trainer.rl.trajlog import TrajectoryLog

    copy = tmp_path / "trajectories-copy"
    shutil.copytree(out / "ckpt" / "trajectories", copy)
    with TrajectoryLog(copy) as tl:
        lineage = tl.lineage(10**9)
        by_uid = {t.uid: t for _, group in tl.recover(0).pending for t in group}
    return {step: [by_uid[u] for u in uids] for step, uids in lineage.items()}


@contextlib.contextmanager
def daemon(cmd: list[str], log: Path, helpers) -> Iterator[subprocess.Popen]:
    """A daemon in a session of its own, output to ``log``; SIGTERM at the end, then SIGKILL of its group."""
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, env=helpers.child_env(), stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=helpers.root)
    try:
        yield proc
    finally:
        tree = helpers.descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for p in tree:  # workers live in sessions of their own
            with contextlib.suppress(Exception):
                p.kill()


def console(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def reward_file(folder: Path) -> tuple[Path, Path]:
    """REWARD written to ``folder/reward.py`` logging to ``folder/reward_calls.jsonl``: (file, log)."""
    log = folder / "reward_calls.jsonl"
    (folder / "reward.py").write_text(f"LOG = {str(log)!r}\n{REWARD}")
    return folder / "reward.py", log


def running(proc: subprocess.Popen, log: Path, predicate: Callable[[], Any]) -> Callable[[], Any]:
    """``predicate``, failing with the process's log as soon as the process has exited."""
    def check() -> Any:
        if proc.poll() is not None:
            raise AssertionError(f"exited ({proc.returncode}) too early:\n{log.read_text()[-6000:]}")
        return predicate()
    return check


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


# ------------------------------------------------------------------------------------------ stages


def test_sft_then_rm_then_ppo_with_a_critic(tiny, arith, helpers, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    common = ["--train.batch_size", "8", "--train.micro_batch_size", "8", "--ds.param_dtype", "fp32",
              "--ds.zero_stage", "0", "--adam.lr", "1e-3", "--train.max_epochs", "1"]
    sft, rm, ppo = tmp_path / "sft", tmp_path / "rm", tmp_path / "ppo"
    trainer("sft", "--actor.model_name_or_path", str(tiny), "--data.dataset", str(arith.sft), "--data.input_key",
            "question", "--data.output_key", "response", *common, "--ckpt.path", str(sft / "ckpt"),
            "--ckpt.output_dir", str(sft / "model"), helpers=helpers)
    trainer("rm", "--actor.model_name_or_path", str(sft / "model"), "--data.dataset", str(arith.pref),
            "--data.prompt_key", "prompt", *common, "--ckpt.path", str(rm / "ckpt"), "--ckpt.output_dir",
            str(rm / "model"), helpers=helpers)
    assert len(metrics(sft)) == 6 and len(metrics(rm)) == 6
    assert json.loads((rm / "model" / "config.json").read_text())["architectures"] == ["Qwen2ForSequenceClassification"]

    trainer("ppo", *ppo_args(sft / "model", arith.prompts, ppo, "--algo.advantage.estimator", "gae",
                             "--reward.model_name_or_path", str(rm / "model"), "--critic.model_name_or_path",
                             str(rm / "model"), "--rollout.n_samples_per_prompt", "2", "--train.batch_size", "8",
                             "--data.max_samples", "12", "--algo.kl.init_coef", "0.01"), helpers=helpers)
    rows = metrics(ppo)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("critic/loss" in r and "reward/mean" in r for r in rows)
    assert rows[0]["kl"] == 0.0 and all(r["logprob_gap/max"] <= 1e-3 for r in rows)

    # The reward model the trainer scored with is the RM export: score step 1's trajectories with
    # it the way the seed's README does (hidden states -> score head -> last token).
    reward_model = AutoModelForSequenceClassification.from_pretrained(rm / "model", num_labels=1,
                                                                      dtype=torch.float32).eval()
    scores = []
    with torch.no_grad():
        for t in trained(ppo, tmp_path)[1]:
            ids = torch.tensor([[*t.prompt_token_ids.tolist(), *t.response_token_ids.tolist()]])
            scores.append(reward_model.score(reward_model.model(input_ids=ids).last_hidden_state)[0, -1, 0].item())
    assert len(scores) == 8
    assert sum(scores) / len(scores) == pytest.approx(rows[0]["reward/mean"], abs=1e-4)
    AutoModelForCausalLM.from_pretrained(ppo / "model")  # the policy's export loads for the next stage


def test_grpo_with_a_reward_file_served_over_http(tiny, arith, helpers, tmp_path):
    from treadle.integration.procs import free_ports

    reward, log = reward_file(tmp_path)
    http, zmq = free_ports(2)
    cmd = [console("treadle-rewards"), "serve", "--functions", str(reward), "--workers.num_workers",
           "1", "--http.port", str(http), "--zmq.endpoint", f"tcp://127.0.0.1:{zmq}"]
    with daemon(cmd, tmp_path / "rewards.log", helpers) as proc:
        helpers.wait_for(running(proc, tmp_path / "rewards.log", lambda: http_ok(f"http://127.0.0.1:{http}/health")),
                         120, what="the reward daemon")
        trainer("ppo", *ppo_args(tiny, arith.prompts, tmp_path, "--algo.advantage.estimator", "group_norm",
                                 "--reward.remote_url", f"http://127.0.0.1:{http}/get_reward",
                                 "--rollout.n_samples_per_prompt", "4", "--train.batch_size", "16",
                                 "--data.max_samples", "8", "--algo.kl.init_coef", "0"), helpers=helpers)
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    steps = trained(tmp_path, tmp_path)
    logged = sorted(t.reward for ts in steps.values() for t in ts)
    # what the file said, to float32 (the trainer's reward dtype)
    assert len(logged) == 32 and logged == pytest.approx(sorted(c["reward"] for c in calls), rel=1e-6)
    for c in calls:  # OpenRLHF's contract: query = prompt + response, with the row's label
        assert c["query"].startswith(c["prompt"]) and arith.labels[c["prompt"]] == c["label"]
    for step, ts in steps.items():
        assert rows[step - 1]["reward/mean"] == pytest.approx(sum(t.reward for t in ts) / len(ts), abs=1e-6)



def test_multi_turn_agent_from_an_openrlhf_agent_file(tiny, arith, helpers, tmp_path):
    MAX_LEN = 64  # noqa: N806
    from transformers import AutoTokenizer

    # The file's environment: the label must appear in the answer; up to 3 turns. Labels are
    # letters the untrained tiny model writes now and then, so both endings happen.
    prompts = tmp_path / "agent_prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "label": "ex"[i % 2]}) + "\n" for i, p in enumerate(arith.labels)))
    trainer("ppo", *ppo_args(tiny, prompts, tmp_path, "--algo.advantage.estimator", "rloo",
                             "--train.agent_func_path", str(AGENT_FILE), "--rollout.n_samples_per_prompt", "2",
                             "--train.batch_size", "8", "--data.max_samples", "8", "--algo.kl.init_coef", "0",
                             "--data.max_len", str(MAX_LEN)), helpers=helpers)
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    tok = AutoTokenizer.from_pretrained(tiny)
    trajs = [t for ts in trained(tmp_path, tmp_path).values() for t in ts]
    assert len(trajs) == 16
    for t in trajs:
        ids, mask, spans = t.response_token_ids.tolist(), t.loss_mask.tolist(), t.info["spans"]
        env_text = tok.decode([i for i, m in zip(ids, mask, strict=True) if m == 0])
        last_answer = tok.decode(ids[spans[-1][0]:spans[-1][1]], skip_special_tokens=True)
        correct = t.info["label"] in last_answer
        assert t.info["end"] in ("done", "budget") and 1 <= len(spans) <= 3
        assert all(mask[i] == 1 for a, b in spans for i in range(a, b))  # sampled tokens train ...
        assert sum(mask) == sum(b - a for a, b in spans)  # ... and the environment's text does not
        assert t.reward == (1.0 if correct else 0.0)
        assert t.extra_logs["step_idx"] == len(spans)
        # OpenRLHF's budget: a turn may sample all that is left of --data.max_len, and the
        # feedback after it is cut to fit; an episode that did not end by itself fills the budget
        full = t.prompt_token_ids.shape[0] + len(ids) == MAX_LEN
        assert full or t.info["end"] == "done"
        assert correct or len(spans) == 3 or t.info["end"] == "budget"  # a wrong answer ends only the last turn
        if not full:
            assert env_text.count("[INCORRECT]") == len(spans) - 1  # feedback after every wrong answer
            assert env_text.replace("[INCORRECT]", "").count("[CORRECT]") == 1  # and the closing one
    # seeded sampling: this run has both endings (if the tiny model changes, pick other labels)
    assert {t.reward for t in trajs} == {0.0, 1.0}, "every episode ended the same way: the test lost its point"


# ---------------------------------------------------------------------------------- modes, faults


@pytest.mark.slow
def test_async_run_through_the_launcher_keeps_the_staleness_bound(tiny, arith, helpers, tmp_path):
    """``treadle-launch``: a vLLM (CPU build) rollout daemon and an async GRPO run, queue size 1."""
    reward, _ = reward_file(tmp_path)
    args = [a for a in ppo_args(tiny, arith.prompts, tmp_path) if a not in ("--vllm.backend", "hf")]
    proc = helpers.launch(["--run_dir", str(tmp_path / "run"), "--", "rollout", "--no_cpu_bind", "--", "ppo", *args,
                           "--algo.advantage.estimator", "group_norm", "--reward.remote_url", str(reward),
                           "--rollout.n_samples_per_prompt", "4", "--train.batch_size", "16",
                           "--data.max_samples", "12", "--algo.kl.init_coef", "0", "--train.async_enable",
                           "--train.async_queue_size", "1"])
    out = helpers.finish(proc, 600)
    assert proc.returncode == 0, out[-6000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["staleness/max"] <= 1 for r in rows)
    # the launcher hands the trainer its daemon (--vllm.endpoint), so the trainer first syncs its
    # weights as version 1 (trainers/ppo.py _first_sync); step k trains at version k, then publishes k + 1
    assert [r["version"] for r in rows] == [2, 3, 4]
    for step, ts in trained(tmp_path, tmp_path).items():
        current = int(rows[step - 1]["version"]) - 1  # the weights this step trained from
        assert all(0 <= current - t.min_policy_version <= 1 for t in ts), step
    # it did run ahead: batch 2 was generated while step 1 trained (as in trainer/tests/test_ppo.py)
    assert any(r["staleness/max"] == 1 for r in rows[1:])
    rollout_cmd = helpers.run_json(tmp_path / "run")["components"]["rollout"]["cmd"]
    assert rollout_cmd[rollout_cmd.index("--backend") + 1] == "vllm"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_an_engine_killed_mid_step_is_restarted_and_the_run_carries_on(backend, tiny, arith, helpers, tmp_path):
    from treadle.integration.procs import free_port
    from treadle.rollout.client import SyncRolloutClient

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "treadle.rollout", "serve", "--model", str(tiny), "--engines", "2", "--backend",
           backend, "--endpoint", endpoint, "--engine.dtype", "float32", "--engine.max_model_len", "256", "--no_cpu_bind"]
    log, trainer_log = tmp_path / "rollout.log", tmp_path / "trainer.log"
    args = ppo_args(tiny, arith.prompts, tmp_path, "--algo.advantage.estimator", "group_norm", "--reward.remote_url",
                    str(reward_file(tmp_path)[0]), "--rollout.n_samples_per_prompt", "8", "--train.batch_size", "32",
                    "--algo.kl.init_coef", "0", "--vllm.endpoint", endpoint, new_tokens=48)  # 12 steps
    with daemon(cmd, log, helpers) as d, SyncRolloutClient(endpoint) as rc, open(trainer_log, "wb") as tlog:
        rc.wait_ready(timeout=300)
        before = {e["engine_id"]: e for e in rc.stats()["engines"]}
        run = subprocess.Popen([sys.executable, "-m", "treadle.trainer.cli", "ppo", *args], cwd=helpers.root,
                               env=helpers.child_env(TREADLE_LOG_LEVEL="INFO"), stdout=tlog, stderr=subprocess.STDOUT)
        try:
            # after step 2 (the weight group exists, engines are at version 2), while an engine generates
            helpers.wait_for(running(run, trainer_log, lambda: (tmp_path / "ckpt" / "metrics.jsonl").is_file()
                                     and len(metrics(tmp_path)) >= 2), 300, what="step 2")
            busy = helpers.wait_for(running(run, trainer_log, lambda: [e for e in rc.stats()["engines"] if e["load"]]),
                                    120, what="an engine with samples in flight")[0]
            os.kill(busy["pid"], signal.SIGKILL)
            run.wait(400)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
        out = trainer_log.read_text()
        assert run.returncode == 0, out[-8000:]
        health = rc.wait_ready(timeout=300)  # the restarted engine may still be starting when the run ends
        after = {e["engine_id"]: e for e in rc.stats()["engines"]}
        digests = rc.weight_digest()
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 13))  # 48 prompts / 4
    assert all(r["logprob_gap/max"] <= 1e-3 for r in rows)  # every sample came from the trainer's weights
    assert set(after) == set(before)
    killed = after[busy["engine_id"]]
    assert killed["restarts"] == 1 and killed["pid"] != busy["pid"]
    assert "rejoining" in out  # the sender found the weight group stale and built a new one
    assert len(set(digests.values())) == 1 and set(digests) == set(after)  # caught up: the same weights
    assert all(e["state"] == "ready" and e["version"] == health["version"] for e in after.values())
    assert health["version"] == rows[-1]["version"]
    assert f"exited with status {-signal.SIGKILL}" in log.read_text()
    assert d.poll() is None or d.returncode == 0



def _own_address() -> str | None:
    """An IPv4 address of this machine that is not loopback (the stand-in for another host's view of it)."""
    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family.name == "AF_INET" and not a.address.startswith("127."):
                return a.address
    return None


@pytest.mark.slow
def test_grpo_against_daemons_off_loopback_with_curve_keys_and_a_token(tiny, arith, helpers, tmp_path):
    """The daemons bound on a non-loopback address, as on another host: they serve only with
    CURVE (ZeroMQ) and a bearer token (HTTP); the trainer reaches them with --vllm.curve_dir,
    --reward.curve_dir or --reward.token_file, and hosts its weight group on --vllm.sync_host."""
    from treadle.common.rpc import generate_keys, load_client_keys
    from treadle.integration.procs import free_ports
    from treadle.rollout.client import SyncRolloutClient

    host = _own_address()
    if host is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    keys, token = tmp_path / "keys", tmp_path / "token"
    generate_keys(keys)
    token.write_text("s3cret-token\n")
    token.chmod(0o600)
    rport, zport, hport = free_ports(3)
    rollout_ep, reward_ep = f"tcp://{host}:{rport}", f"tcp://{host}:{zport}"
    rollout = [sys.executable, "-m", "treadle.rollout", "serve", "--model", str(tiny), "--engines", "1", "--backend",
               "hf", "--endpoint", rollout_ep, "--curve_dir", str(keys), "--engine.dtype", "float32",
               "--engine.max_model_len", "256", "--no_cpu_bind"]
    rewards = [console("treadle-rewards"), "serve", "--functions", str(reward_file(tmp_path)[0]), "--workers.num_workers",
               "1", "--zmq.endpoint", reward_ep, "--zmq.curve_dir", str(keys), "--http.host", host, "--http.port",
               str(hport), "--http.token_file", str(token)]
    common = ("--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4", "--train.batch_size",
              "16", "--data.max_samples", "8", "--algo.kl.init_coef", "0", "--vllm.endpoint", rollout_ep,
              "--vllm.curve_dir", str(keys), "--vllm.sync_host", host)
    with daemon(rollout, tmp_path / "rollout.log", helpers), daemon(rewards, tmp_path / "rewards.log", helpers), \
            SyncRolloutClient(rollout_ep, curve=load_client_keys(keys)) as rc:
        rc.wait_ready(timeout=300)
        helpers.wait_for(lambda: http_ok(f"http://{host}:{hport}/health"), 120, what="the reward daemon")
        for name, reward in (("zmq", ["--reward.remote_url", reward_ep, "--reward.curve_dir", str(keys)]),
                             ("http", ["--reward.remote_url", f"http://{host}:{hport}/get_reward",
                                       "--reward.token_file", str(token)])):
            out = tmp_path / name
            trainer("ppo", *ppo_args(tiny, arith.prompts, out, *common, *reward), helpers=helpers)
            rows = metrics(out)
            assert [r["step"] for r in rows] == [1, 2], name
            assert all(r["logprob_gap/max"] <= 1e-3 for r in rows), name  # the engine runs the synced weights
        assert rc.health()["version"] >= 2


# An agent program as users write them: the OpenAI SDK, configured only by the environment the
# trainer gives it (OPENAI_BASE_URL, OPENAI_API_KEY); two turns; the share of digits as reward.
OPENAI_AGENT = '''
import json, sys
from openai import OpenAI

episode = json.loads(sys.stdin.readline())
client = OpenAI()
messages = [{"role": "user", "content": episode["prompt"]}]
first = client.chat.completions.create(model="policy", messages=messages, max_tokens=64).choices[0].message.content
messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "digits only"}]
second = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
text = (first + second).replace(" ", "")
print(json.dumps({"reward": sum(c.isdigit() for c in text) / max(1, len(text)), "extra_logs": {"chars": len(text)}}))
'''


@pytest.mark.slow
def test_grpo_with_an_openai_sdk_agent_program(tiny, arith, helpers, tmp_path):
    pytest.importorskip("openai")
    agent = tmp_path / "agent.py"
    agent.write_text(OPENAI_AGENT)
    trainer("ppo", *ppo_args(tiny, arith.prompts, tmp_path, "--algo.advantage.estimator", "group_norm",
                             "--train.agent_cmd", f"{sys.executable} {agent}", "--rollout.n_samples_per_prompt", "2",
                             "--train.batch_size", "8", "--data.max_samples", "8",
                             "--algo.kl.init_coef", "0", new_tokens=6, prompt_len=64), helpers=helpers)
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    steps = trained(tmp_path, tmp_path)
    for step, ts in steps.items():
        assert len(ts) == 8
        for t in ts:
            mask = np.asarray(t.loss_mask)
            spans = t.info["spans"]
            # two sampled turns (each at most the run's 6 new tokens, whatever the program asked),
            # the second user message between them out of the loss
            assert t.info["turns"] == 2 and all(1 <= e - s <= 6 for s, e in spans)
            assert mask[spans[0][0]:spans[0][1]].all() and not mask[spans[0][1]:spans[1][0]].any()
            assert 0.0 <= t.reward <= 1.0 and "chars" in t.extra_logs
        assert rows[step - 1]["reward/mean"] == pytest.approx(sum(t.reward for t in ts) / len(ts), abs=1e-6)
