"""Run each of OpenRLHF's example scripts for real on this CPU machine until it logs its first
training step, and print a markdown table of what happened (issue 34's closing note).

A developer tool, not a test. Each script's argument list is taken exactly as the test modules
build it (``packages/trainer/tests/test_openrlhf_rl_scripts.py``: the 7 RL scripts and the VLM
one; ``test_openrlhf_offline_scripts.py``: SFT / RM / DPO), with the tiny model. The test tables
already carry the GPU substitutions (GPU and engine counts, ``sdpa`` for flash-attn, ``--vllm.sync_backend
nccl`` dropped); they are listed in the table from the rows' ``#`` comments. Added here, each
named in the table:

- datasets: a small local JSONL with the script's own keys (chat lists under ``context_messages``,
  ``prompt`` / ``label`` math rows, ``question`` / ``response``, ``chosen`` / ``rejected`` chats);
- ``reward_func.py`` / ``math_reward_func.py`` / ``agent_func.py``: local files with OpenRLHF's
  interface and imports (``REWARD_FUNC``, ``MATH_REWARD_FUNC``, ``AGENT_FUNC`` below);
- output, checkpoint and log paths: a folder per script under ``--out``'s folder;
- batch sizes and lengths shrunk, by flags appended after the script's (tyro takes the last value).

Each command runs as ``.venv/bin/python -m treadle.trainer.cli <command> ...`` (and one PPO script
also as ``python -m treadle.integration.train_ppo_ray``), one at a time, and is stopped once
``<--ckpt.path>/metrics.jsonl`` has its first step, or at the timeout::

    .venv/bin/python tools/openrlhf_scripts.py [--only train_sft.sh ...] [--timeout 240]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packages" / "trainer" / "tests"))
sys.path.insert(0, str(ROOT / "tools" / "testing"))

import test_openrlhf_offline_scripts as offline  # noqa: E402
import test_openrlhf_rl_scripts as rl  # noqa: E402

REWARD_FUNC = '''\
import torch


def reward_func(queries, prompts, labels, **kwargs):
    """OpenRLHF's example interface: a random 0/1 reward per sample."""
    reward = torch.randint(0, 2, (len(queries),)).float()
    return {"rewards": reward, "scores": reward, "extra_logs": {"dummy_scores": reward}}
'''

MATH_REWARD_FUNC = '''\
from typing import List

import torch

from openrlhf.utils import extract_boxed_answer, grade_answer


def reward_func(queries: List[str], prompts: List[str], labels: List[str], **kwargs) -> dict:
    """1 for a \\\\boxed{} answer equal to the label; else the response's share of digits / 2, so
    that a random tiny model's groups are not all 0 (and all filtered by dynamic filtering)."""
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):] if isinstance(prompt, str) and query.startswith(prompt) else query
        if grade_answer(extract_boxed_answer(response), label):
            rewards.append(1.0)
        else:
            chars = [c for c in response if not c.isspace()]
            rewards.append(0.5 * sum(c.isdigit() for c in chars) / max(1, len(chars)))
    r = torch.tensor(rewards, dtype=torch.float)
    return {"rewards": r, "scores": r, "extra_logs": {"math_accuracy": (r == 1.0).float().mean()}}
'''

AGENT_FUNC = '''\
import random
from typing import Any, Dict

import torch

from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    """1 to 3 turns, then a random 0/1 reward (OpenRLHF's example environment's interface)."""

    def __init__(self, *args, **kwargs):
        self.turn, self.turns = 0, random.randint(1, 3)

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> Dict[str, Any]:
        done = self.turn >= self.turns
        reward = torch.randint(0, 2, (1,)).float() if done else torch.tensor(0.0)
        self.turn += 1
        return {"rewards": reward, "scores": reward, "done": done,
                "environment_feedback": "\\n\\nHuman: [DONE]\\n" if done else "\\n\\nHuman: try again\\n\\nAssistant: ",
                "sampling_params": states.get("sampling_params", None), "extra_logs": {"dummy_scores": reward}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''

FILES = {"reward_func.py": REWARD_FUNC, "math_reward_func.py": MATH_REWARD_FUNC, "agent_func.py": AGENT_FUNC}
WORDS = ["apple", "banana", "cherry", "delta", "echo", "fox", "golf", "hotel"]
DATASET_FLAGS = ("--data.prompt_dataset", "--data.dataset", "--eval.dataset")
PATH_FLAGS = ("--ckpt.output_dir", "--ckpt.path", "--logger.tensorboard_dir")


@dataclass
class Script:
    name: str
    command: str  # ppo / sft / rm / dpo
    argv: list[str]
    table_subs: list[str]  # what the test table substitutes (its rows' comments)
    entry: str = "treadle.trainer.cli"
    short_cache: bool = False  # TREADLE_CACHE_DIR under /tmp: Ray's socket paths must stay under 108 bytes


@dataclass
class Outcome:
    result: str = ""
    seconds: float | None = None
    subs: list[str] = field(default_factory=list)
    error: str = ""


def table_notes(module: object, name: str) -> list[str]:
    """The ``#`` comments of a table's rows (``flag value  # was X``), from the test module's source."""
    src = inspect.getsource(module)
    start = src.index(f"\n{name}") if f"\n{name}" in src else src.index(f"def {name}")
    block = src[start:src.index("\n\n\n" if name.startswith("_") else "\n]\n", start)]
    notes = []
    for line in block.splitlines():
        if m := re.search(r'\(\["(--[\w.]+)", ("[^"]*"|[^\]]*)[^#]*#\s*(.*)$', line):
            flag, value, comment = m[1], m[2].strip('"'), m[3].strip()
            notes.append("tiny model" if value.startswith("TINY") or "TINY" in value else f"{flag} {value} ({comment})")
        elif m := re.match(r"\s*#\s*(--\S+ \S+): dropped", line):
            notes.append(f"{m[1]} dropped")
    return list(dict.fromkeys(notes))


def scripts(model: str) -> list[Script]:
    out = []
    for name, rows in rl.SCRIPTS.items():
        var = "_reinforce_baseline" if name.startswith("train_reinforce") else name.upper().replace(".", "_")
        out.append(Script(name, "ppo", rl.argv(rows, model, treadle_spelling=False), table_notes(rl, var)))
    vlm = [*rl.argv(rl.TRAIN_VLM_MATH_HYBRID_ENGINE_SH, model, treadle_spelling=False), *sum(rl.VLM_FLAGS, [])]
    out.append(Script("train_vlm_math_hybrid_engine.sh", "ppo", vlm, table_notes(rl, "TRAIN_VLM_MATH_HYBRID_ENGINE_SH")))
    text = [row for row in rl.TRAIN_VLM_MATH_HYBRID_ENGINE_SH if row[0] != rl.KL_LOSS_WITHOUT_COEF[0]]
    out.append(Script("train_vlm_math_hybrid_engine.sh minus its image flags and --algo.kl.use_loss", "ppo",
                      rl.argv(text, model, treadle_spelling=False), out[-1].table_subs))
    for name, (command, rows) in offline.SCRIPTS.items():
        var = name.upper().replace(".", "_")
        out.append(Script(name, command, offline.argv(rows, model), table_notes(offline, var)))
    moe = offline.TRAIN_SFT_MIXTRAL_LORA_SH
    out.append(Script("train_sft_mixtral_lora.sh minus --model.aux_loss_coef", "sft",
                      offline.argv([r for r in moe if r[0][0] != "--model.aux_loss_coef"], model),
                      table_notes(offline, "TRAIN_SFT_MIXTRAL_LORA_SH")))
    ray = next(s for s in out if s.name == "train_ppo_with_reward_fn.sh")
    out.append(Script(ray.name, "ppo", ray.argv, ray.table_subs, entry="treadle.integration.train_ppo_ray",
                      short_cache=True))
    return out


def last_values(argv: list[str]) -> dict[str, str]:
    """Each flag's last single value (switches map to '')."""
    flags: dict[str, str] = {}
    for i, word in enumerate(argv):
        if word.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            flags[word] = "" if nxt.startswith("--") else nxt
    return flags


def dataset_rows(command: str, flags: dict[str, str], n: int) -> tuple[list[dict], str]:
    """Rows with the script's keys, and a description naming them."""
    rows = []
    for i in range(n):
        a, b = WORDS[i % 8], WORDS[(3 * i + 1) % 8]
        if command == "ppo":
            key, label = flags.get("--data.input_key", "input"), flags.get("--data.label_key")
            if label:  # math rows: a prompt string and its answer
                rows.append({key: f"What is {i} + {i % 5}? Put the answer in \\boxed{{}}.", label: str(i + i % 5)})
            else:
                rows.append({key: [{"role": "user", "content": f"Say {a} {b}."}]})
        elif command == "sft":
            rows.append({flags["--data.input_key"]: f"repeat {a} {b}", flags["--data.output_key"]: f"{a} {b}"})
        else:  # rm / dpo: whole conversations, as OpenRLHF's preference mixtures
            user = {"role": "user", "content": f"repeat {a} {b}"}
            rows.append({flags["--data.chosen_key"]: [user, {"role": "assistant", "content": f"{a} {b}"}],
                         flags["--data.rejected_key"]: [user, {"role": "assistant", "content": f"{b} {a} {a}"}]})
    return rows, ", ".join(k if not isinstance(v, list) else f"{k} (chat)" for k, v in rows[0].items())


def shrunk(command: str, flags: dict[str, str]) -> list[str]:
    """Appended after the script's flags: one-CPU batch sizes and lengths."""
    if command != "ppo":
        return ["--train.batch_size", "2", "--train.micro_batch_size", "1", "--data.max_samples", "8",
                "--data.max_len", "256"]
    samples = 2 * int(flags.get("--rollout.n_samples_per_prompt", "1"))
    half = str(max(1, samples // 2))
    extra = ["--rollout.batch_size", "2", "--train.batch_size", str(samples), "--rollout.micro_batch_size", half,
             "--train.micro_batch_size", half, "--data.max_samples", "16", "--data.prompt_max_len", "128",
             "--data.max_len", "256", "--rollout.max_new_tokens", "16"]
    if "--eval.n_samples_per_prompt" in flags:
        extra += ["--eval.n_samples_per_prompt", "2"]
    return extra


def prepare(script: Script, run_dir: Path) -> tuple[list[str], list[str], Path]:
    """(argv, the substitutions made here, where metrics.jsonl will be)."""
    argv, subs = list(script.argv), []
    flags = last_values(argv)
    for i, word in enumerate(argv[:-1]):
        value = argv[i + 1]
        if word in DATASET_FLAGS:
            rows, keys = dataset_rows(script.command, flags, 2 if word == "--eval.dataset" else 16)
            path = run_dir / f"{word.split('.')[0].strip('-')}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            argv[i + 1] = str(path)
            subs.append(f"{word} {value} -> local JSONL ({keys})")
        elif word in ("--reward.remote_url", "--train.agent_func_path") and value.endswith(".py"):
            path = run_dir / Path(value).name
            path.write_text(FILES[path.name])
            argv[i + 1] = str(path)
            subs.append(f"{path.name} -> local file, same interface")
        elif word in PATH_FLAGS:
            argv[i + 1] = str(run_dir / word.split(".")[-1])
    if "--ckpt.path" not in flags:
        argv += ["--ckpt.path", str(run_dir / "path")]
    subs.append("output / ckpt / log paths -> a temp dir")
    extra = shrunk(script.command, flags)
    stride = flags.get("--ds.ring_attn_head_stride")
    model = flags.get("--actor.model_name_or_path") or flags["--model.model_name_or_path"]
    kv_heads = json.loads((Path(model) / "config.json").read_text())["num_key_value_heads"]
    if stride and kv_heads % int(stride):  # the tiny model has 1 KV head
        extra += ["--ds.ring_attn_head_stride", "1"]
    subs.append("appended: " + " ".join(extra))
    return argv + extra, subs, Path(argv[argv.index("--ckpt.path") + 1]) / "metrics.jsonl"


def leftovers(markers: list[str]) -> list[str]:
    """Processes still running whose command line names one of ``markers`` (the tiny model, a run's
    files, its Ray session: started by a run, e.g. a rollout daemon its trainer did not stop),
    killed; their names."""
    names = []
    for pid_dir in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(m in cmdline for m in markers) and int(pid_dir.name) != os.getpid() and "openrlhf_scripts.py" not in cmdline:
            names.append(f"{pid_dir.name} {' '.join(cmdline.split()[1:4])[:60]}")
            with contextlib.suppress(OSError):
                os.kill(int(pid_dir.name), signal.SIGTERM)
    if names:
        time.sleep(15)
        for name in names:
            with contextlib.suppress(OSError):
                os.killpg(int(name.split()[0]), signal.SIGKILL)
    return names


def first_error(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in lines:
        if re.search(r"error: |Error: |Error$", line) and "warn" not in line.lower():
            return line[:300]
    return lines[-1][:300] if lines else ""


def run(script: Script, run_dir: Path, timeout: float) -> Outcome:
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh folder: no metrics or checkpoint of an earlier run
    run_dir.mkdir(parents=True)
    argv, subs, metrics = prepare(script, run_dir)
    cmd = [sys.executable, "-m", script.entry, *([script.command] if script.entry.endswith(".cli") else []), *argv]
    (run_dir / "command.txt").write_text(" ".join(cmd) + "\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "TORCH_EXTENSIONS_DIR": str(ROOT / ".cache" / "torch_extensions"),
           "HF_HOME": str(ROOT / ".cache" / "hf"), "TREADLE_RUN_DIR": str(run_dir / "launch")}
    out = Outcome(subs=subs)
    markers = [str(run_dir.parent)]
    if script.short_cache:
        env["TREADLE_CACHE_DIR"] = tempfile.mkdtemp(prefix="trd")
        markers.append(env["TREADLE_CACHE_DIR"])
        out.subs.append("TREADLE_CACHE_DIR=/tmp/trd… (Ray's sockets under ./.cache/ray pass its 107-byte limit here)")
    start = time.monotonic()
    with open(run_dir / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        while proc.poll() is None and time.monotonic() - start < timeout:
            if metrics.exists() and any('"step"' in line for line in metrics.read_text().splitlines()):
                out.seconds = time.monotonic() - start
                break
            time.sleep(1)
        stopped = proc.poll() is None
        if stopped:  # as Ctrl-C does (the trainer / launcher stop what they started), then SIGKILL
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    left = leftovers(markers)
    if script.short_cache:
        shutil.rmtree(env["TREADLE_CACHE_DIR"], ignore_errors=True)
    if out.seconds is None and metrics.exists() and metrics.read_text().strip():
        out.seconds = time.monotonic() - start
    text = (run_dir / "log.txt").read_text(errors="replace")
    if stopped:
        out.result = "stopped after step 1" if out.seconds is not None else f"timeout ({timeout:.0f} s)"
    else:
        out.result = f"rc {proc.returncode}"
    if left:
        out.result += f"; {len(left)} processes left running ({', '.join(left)}): killed here"
    if out.seconds is None or (not stopped and proc.returncode):
        out.error = first_error(text)
    return out


def table(rows: list[tuple[Script, Outcome]]) -> str:
    lines = ["| script | command | result | s to step 1 | substitutions (test table; here) | first error line |",
             "|---|---|---|---|---|---|"]
    for s, o in rows:
        command = s.command if s.entry.endswith(".cli") else f"{s.command} via `python -m {s.entry}`"
        secs = f"{o.seconds:.0f}" if o.seconds is not None else "-"
        subs = "; ".join(s.table_subs) + "; **here:** " + "; ".join(o.subs)
        cells = [s.name, command, o.result, secs, subs, o.error.replace("|", "\\|") or "-"]
        lines.append("| " + " | ".join(c.replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", help="script names (all when omitted)")
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--out", type=Path, default=ROOT / ".cache" / "s21" / "openrlhf_scripts.md")
    args = p.parse_args()
    from treadle_testing import load_tool

    work = args.out.resolve().parent / "openrlhf_runs"
    model = load_tool("tiny_model").build("tiny", work / "tiny", seed=0).out
    done = []
    for i, script in enumerate(scripts(str(model))):
        if args.only and script.name not in args.only:
            continue
        load = os.getloadavg()[0]
        print(f"[{time.strftime('%H:%M:%S')}] {script.name} ({script.entry}); load {load:.1f}", file=sys.stderr,
              flush=True)
        slug = re.sub(r"[^\w.]+", "_", script.name.removesuffix(".sh"))
        outcome = run(script, work / f"{i:02d}-{slug}", args.timeout)
        print(f"  -> {outcome.result}, {outcome.seconds}, {outcome.error}", file=sys.stderr, flush=True)
        done.append((script, outcome))
    text = table(done)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
