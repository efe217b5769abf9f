"""On-policy distillation in ``treadle-train ppo`` (``--teacher.model_name_or_path``, ``rl.distill``):
the per-token reverse-KL advantage by hand, its place after the estimator (``rl.returns.finalize``),
the teacher's log-probs reaching the experiences (``rl.update.score``), the refusals (at parse time,
and a teacher of another tokenizer before any weights load), a run on the hf engine with no task
reward where the student's reverse KL to the teacher falls step by step, and the same first-step
signal from a replicated, a ZeRO-3 sharded (and offloaded) and a ring-attention teacher."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from treadle_testing import load_tool, rollout_daemon

from treadle.common.config import ConfigError
from treadle.common.records import Trajectory
from treadle.trainer.config import parse_ppo
from treadle.trainer.rl.distill import distill_advantages, reverse_kl
from treadle.trainer.rl.experience import from_trajectory
from treadle.trainer.rl.returns import ReturnsConfig, finalize


def test_distill_advantage_and_reverse_kl_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -14.0, 0.0]])
    teacher = torch.tensor([[-1.5, -0.5, -0.5], [-1.0, -1.0, -9.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    # d = logp - teacher: row 0: 0.5, -1.5, 0; row 1: -2, -13 (clamped to -10), padding
    # a = -2 d: -1, 3, 0; 4, 20; 0 on padding (its d = 9 is not a sampled token)
    torch.testing.assert_close(distill_advantages(logp, teacher, mask, 2.0),
                               torch.tensor([[-1.0, 3.0, 0.0], [4.0, 20.0, 0.0]]))
    # the logged mean is unclamped: (0.5 - 1.5 + 0 - 2 - 13) / 5 = -16 / 5
    assert reverse_kl(logp, teacher, mask) == pytest.approx(-3.2)
    with pytest.raises(ValueError, match="teacher_logp has shape"):
        distill_advantages(logp, teacher[:, :2], mask, 1.0)


def test_its_policy_gradient_is_the_reverse_kls_gradient():
    # one state, V = 6: the PPO loss with a_y = -(log pi(y) - log T(y)), in expectation over y ~ pi (each
    # token weighted by pi(y), exactly), has the gradient of KL(pi || T) in the logits (discount 0)
    from treadle.trainer.rl.policy_loss import ppo_clip

    g = torch.Generator().manual_seed(3)
    z, t = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True), torch.randn(6, generator=g, dtype=torch.float64)
    logp = torch.log_softmax(z, -1)[:, None]  # [V, 1]: every token as a one-token sample
    teacher = torch.log_softmax(t, -1)[:, None]
    mask = torch.ones(6, 1, dtype=torch.bool)
    adv = distill_advantages(logp.detach(), teacher, mask, 1.0)
    loss = ppo_clip(logp, logp.detach(), adv, mask, clip_low=0.2, clip_high=0.2).loss
    (pg,) = torch.autograd.grad((logp.detach().exp() * loss).sum(), z)
    kl = (torch.softmax(z, -1) * (torch.log_softmax(z, -1) - torch.log_softmax(t, -1))).sum()
    (exact,) = torch.autograd.grad(kl, z)
    torch.testing.assert_close(pg, exact)


def _exps(rewards, lengths, seed=0):
    rng = np.random.default_rng(seed)
    exps = []
    for k, (r, n) in enumerate(zip(rewards, lengths, strict=True)):
        traj = Trajectory(prompt_token_ids=np.array([1, 2], np.int32), response_token_ids=np.arange(3, 3 + n, dtype=np.int32),
                          rollout_logprobs=np.zeros(n, np.float32), loss_mask=np.ones(n, np.uint8), reward=r, uid=str(k))
        e = from_trajectory(traj)
        e.reward = r
        e.arrays["old_logp"] = rng.uniform(-3, 0, n).astype(np.float32)
        exps.append(e)
    return exps


def _returns_config(**kw):
    base = dict(estimator="group_norm", group_size=2, gamma=1.0, lambd=1.0, std_norm=True, kl_coef=0.0,
                kl_estimator="k1", kl_in_reward=True, clip_range=(-10.0, 10.0), max_new_tokens=8,
                overlong_buffer_len=None, overlong_penalty_factor=1.0, stop_properly_coef=None, is_level=None)
    return ReturnsConfig(**{**base, **kw})


@pytest.mark.parametrize("estimator", ["group_norm", "reinforce", "gae"])
def test_the_teachers_advantage_is_added_after_the_estimator(estimator):
    rewards, lengths = [1.0, 0.0, 0.5, 0.5], [3, 2, 4, 1]
    plain, distilled = _exps(rewards, lengths), _exps(rewards, lengths)
    teacher = [np.random.default_rng(9 + k).uniform(-3, 0, n).astype(np.float32) for k, n in enumerate(lengths)]
    for e, t in zip(distilled, teacher, strict=True):
        e.arrays["teacher_logp"] = t
    for e in plain + distilled:
        e.arrays["values"] = np.zeros(e.num_actions, np.float32)
    finalize(plain, _returns_config(estimator=estimator, distill_coef=0.5))
    metrics = finalize(distilled, _returns_config(estimator=estimator, distill_coef=0.5))
    for p, d, t in zip(plain, distilled, teacher, strict=True):
        # A_t = A_task_t - 0.5 (old_t - teacher_t): unnormalised, undiscounted, whatever the estimator
        want = p.arrays["advantages"] - 0.5 * (d.arrays["old_logp"] - t)
        np.testing.assert_allclose(d.arrays["advantages"], want, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(d.arrays["returns"], p.arrays["returns"])  # the critic's targets stay
    diff = np.concatenate([e.arrays["old_logp"] - t for e, t in zip(distilled, teacher, strict=True)])
    assert metrics["distill/reverse_kl"] == pytest.approx(float(diff.mean()), rel=1e-6)
    assert not any(np.allclose(d.arrays["advantages"], p.arrays["advantages"]) for p, d in zip(plain, distilled, strict=True))


def test_pure_distillation_with_no_reward_is_the_negative_log_ratio():
    exps = _exps([0.0] * 4, [2, 3, 1, 2])
    for e in exps:
        e.arrays["teacher_logp"] = e.arrays["old_logp"] + np.linspace(-1, 1, e.num_actions).astype(np.float32)
    finalize(exps, _returns_config(distill_coef=1.0))
    for e in exps:  # GRPO's advantages of equal rewards are 0: what is left is -(old - teacher) = linspace
        np.testing.assert_allclose(e.arrays["advantages"], np.linspace(-1, 1, e.num_actions), atol=1e-6)
    del exps[0].arrays["old_logp"]
    for e in exps[1:]:
        del e.arrays["old_logp"]
    with pytest.raises(ValueError, match="finalize needs old_logp"):
        finalize(exps, _returns_config(distill_coef=1.0))


def test_score_fills_the_teachers_logprobs_of_the_sampled_tokens(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    from treadle.trainer.models.reference import Reference
    from treadle.trainer.rl.update import Batching, score

    teacher_path = sharpened(tiny, tmp_path / "teacher", 4.0)
    exps = _exps([0.0, 0.0, 0.0], [3, 5, 2])
    model = AutoModelForCausalLM.from_pretrained(teacher_path, dtype=torch.float32).eval()
    teacher = Reference(model, torch.device("cpu"))
    for packing in (False, True):
        b = Batching(micro_batch=2, token_budget=None, packing=packing, pad_id=0, device=torch.device("cpu"))
        score(exps, b, actor=None, reference=None, critic=None, temperature=0.7, teacher=teacher)
        for e in exps:  # the teacher's own reading at temperature 0.7, at each sampled token
            with torch.no_grad():
                logits = model(input_ids=torch.from_numpy(e.ids)[None]).logits[0].float() / 0.7
            want = torch.log_softmax(logits, -1)[torch.from_numpy(e.pos - 1), torch.from_numpy(e.ids[e.pos])]
            np.testing.assert_allclose(e.arrays["teacher_logp"], want.numpy(), rtol=1e-5, atol=1e-5)


PPO_BASE = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p.jsonl", "--algo.advantage.estimator",
            "group_norm", "--rollout.n_samples_per_prompt", "4", "--actor.num_gpus_per_node", "1",
            "--rollout.batch_size", "8", "--train.batch_size", "8", "--rollout.max_new_tokens", "8"]


@pytest.mark.parametrize(("extra", "message"), [
    ([], "no reward: set .* or distil from --teacher.model_name_or_path"),
    (["--teacher.model_name_or_path", "t", "--teacher.kl_coef", "-0.5"], r"--teacher\.kl_coef must be >= 0, got -0\.5"),
    (["--teacher.model_name_or_path", "t", "--teacher.kl_coef", "0"], r"--teacher\.kl_coef 0 with --teacher\.model_name_or_path adds nothing"),
    (["--teacher.model_name_or_path", ""], r"--teacher\.model_name_or_path is empty"),
    (["--teacher.offload", "--reward.remote_url", "r.py"], r"--teacher\.offload keeps a teacher in CPU memory: it needs --teacher\.model_name_or_path"),
])
def test_refused_at_parse_time(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_ppo([*PPO_BASE, *extra])


def test_the_teacher_alone_is_a_signal_for_every_estimator():
    for est in ("group_norm", "rloo", "dr_grpo", "reinforce", "gae"):
        argv = [*PPO_BASE, "--teacher.model_name_or_path", "t", "--teacher.kl_coef", "2", "--teacher.offload"]
        cfg = parse_ppo([a if a != "group_norm" else est for a in argv])
        assert cfg.uses_teacher and (cfg.teacher.kl_coef, cfg.teacher.offload) == (2.0, True)
    assert not parse_ppo([*PPO_BASE, "--reward.remote_url", "r.py"]).uses_teacher


def test_a_teacher_of_another_tokenizer_is_refused_before_weights_load(tiny, tmp_path, helpers):
    from treadle.trainer.trainers.ppo_build import check_teacher_tokenizer

    other = load_tool("tiny_model").build("small", tmp_path / "small", seed=0).out  # a 4096-token tokenizer
    with pytest.raises(ConfigError, match="its tokenizer is not the student's"):
        check_teacher_tokenizer(str(tiny), str(other))
    short = shutil.copytree(tiny, tmp_path / "short")
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))
    with pytest.raises(ConfigError, match="its logits cover 300 token ids, the tokenizer has ids up to 511"):
        check_teacher_tokenizer(str(tiny), str(short))
    check_teacher_tokenizer(str(tiny), str(tiny))
    # through the command: refused (exit 2, one line) before the process group, the data or any model
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
    paths = {"m": str(tiny), "p.jsonl": str(tmp_path / "p.jsonl")}
    argv = [paths.get(a, a) for a in PPO_BASE]
    proc = subprocess.run([sys.executable, "-m", "treadle.trainer.cli", "ppo", *argv, "--teacher.model_name_or_path",
                           str(other), "--vllm.endpoint", "tcp://127.0.0.1:9"], env=helpers.child_env(),
                          capture_output=True, text=True, timeout=300, cwd=helpers.root)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "its tokenizer is not the student's" in proc.stderr


def sharpened(src, dst, gain: float):
    """A copy of ``src`` whose final RMSNorm gain is multiplied by ``gain``: its logits are ``gain``
    times the original's, so its distributions are the original's sharpened (a teacher that knows
    what to say, as far as the tiny model's own preferences go)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * gain
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def hf_daemon(model, helpers):
    return rollout_daemon(model, helpers.child_env(), "--backend", "hf")


WORDS = ["apple", "banana", "cherry", "delta", "echo", "fox", "golf", "hotel"]


def exact_reverse_kl(student, teacher, prompts, tokenizer) -> float:
    """KL(student || teacher) of the next-token distributions, summed over the vocabulary, mean over
    every position of ``prompts`` (no sampling noise)."""
    from transformers import AutoModelForCausalLM

    s, t = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in (student, teacher))
    total, count = 0.0, 0
    with torch.no_grad():
        for text in prompts:
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            ls, lt = torch.log_softmax(s(ids).logits[0], -1), torch.log_softmax(t(ids).logits[0], -1)
            kl = (ls.exp() * (ls - lt)).sum(-1)
            total, count = total + float(kl.sum()), count + kl.numel()
    return total / count


@pytest.fixture(scope="module")
def distill_task(tiny, tmp_path_factory):
    """The student (the tiny model's logits x 6), the teacher (the same model at x 2: a teacher the
    student can match exactly, its final-norm gain at 2, and far from it at the start), prompts."""
    root = tmp_path_factory.mktemp("distill")
    prompts = [f"say {WORDS[i % 8]} {WORDS[(i * 3) % 8]}:" for i in range(32)]
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return {"student": sharpened(tiny, root / "student", 6.0), "teacher": sharpened(tiny, root / "teacher", 2.0),
            "data": root / "prompts.jsonl", "prompts": prompts}


@pytest.fixture(scope="module")
def engine(tiny, helpers):
    with hf_daemon(tiny, helpers) as endpoint:  # each run's first sync brings it to the student's weights
        yield endpoint


def distill_run(task, endpoint, out, helpers, *extra, nproc=1):
    args = ["ppo", "--actor.model_name_or_path", str(task["student"]), "--teacher.model_name_or_path",
            str(task["teacher"]), "--data.prompt_dataset", str(task["data"]), "--data.input_key", "prompt",
            "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0",
            "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "4", "--train.batch_size", "16",
            "--train.micro_batch_size", "16", "--rollout.micro_batch_size", "16", "--rollout.max_new_tokens", "16",
            "--data.prompt_max_len", "16", "--actor.num_gpus_per_node", str(nproc), "--ds.param_dtype", "fp32",
            "--ds.zero_stage", "0", "--actor.adam.lr", "2e-3", "--train.num_episodes", "1",
            "--ckpt.path", str(out / "ckpt"), "--ckpt.output_dir", str(out / "model"), "--vllm.endpoint", endpoint,
            *extra]
    if nproc > 1:
        helpers.torchrun(["-m", "treadle.trainer.cli", *args], nproc=nproc)
    else:
        proc = subprocess.run([sys.executable, "-m", "treadle.trainer.cli", *args], env=helpers.child_env(),
                              capture_output=True, text=True, timeout=600, cwd=helpers.root)
        assert proc.returncode == 0, proc.stderr[-6000:]
    return [json.loads(line) for line in (out / "ckpt" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_distillation_alone_lowers_the_students_reverse_kl_to_the_teacher(distill_task, engine, tokenizer, helpers,
                                                                          tmp_path):
    rows = distill_run(distill_task, engine, tmp_path, helpers)
    kl = [r["distill/reverse_kl"] for r in rows]
    student, teacher, prompts = distill_task["student"], distill_task["teacher"], distill_task["prompts"]
    before, after = exact_reverse_kl(student, teacher, prompts, tokenizer), \
        exact_reverse_kl(tmp_path / "model", teacher, prompts, tokenizer)
    print("distill/reverse_kl per step:", [round(k, 4) for k in kl], f"exact on the prompts: {before:.4f} -> {after:.4f}")
    assert len(kl) == 8 and all(math.isfinite(k) for k in kl)
    assert all(r["reward/mean"] == 0.0 for r in rows)  # no task reward: the teacher is the only signal
    assert kl[0] > 0.5 and max(kl[-2:]) < 0.5 * kl[0], kl  # on the student's own samples, as logged
    assert after < 0.5 * before, (before, after)  # and exactly, on the exported model


@pytest.mark.slow
def test_a_sharded_or_ringed_teacher_gives_the_replicas_signal(distill_task, engine, helpers, tmp_path):
    """The first step (before any update: the same seeded samples) on one rank with a replica, on two
    ZeRO-3 ranks with the teacher sharded and offloaded, and on a ring of two: the same reverse KL."""
    short = ["--data.max_samples", "4"]  # one step
    runs = {"replica": distill_run(distill_task, engine, tmp_path / "replica", helpers, *short),
            "zero3": distill_run(distill_task, engine, tmp_path / "zero3", helpers, *short, "--ds.zero_stage", "3",
                                 "--teacher.offload", "--train.micro_batch_size", "8", "--rollout.micro_batch_size",
                                 "8", nproc=2),
            "ring": distill_run(distill_task, engine, tmp_path / "ring", helpers, *short, "--ds.zero_stage", "3",
                                "--ds.packing_samples", "--ds.ring_attn_size", "2", nproc=2)}
    first = {name: rows[0]["distill/reverse_kl"] for name, rows in runs.items()}
    print(first)
    assert first["replica"] > 0.5
    for name in ("zero3", "ring"):
        assert first[name] == pytest.approx(first["replica"], rel=1e-4, abs=1e-5), first
