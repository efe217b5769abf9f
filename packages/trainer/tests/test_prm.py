"""Process reward models: the loss by hand, step-labelled rows, ``treadle-train prm`` learning the
labels of a tiny synthetic set, and PPO's ``--reward.prm_model_name_or_path`` putting the PRM's
step scores on the separator tokens, reaching the advantages as ``rl.returns`` says (by hand on
``rl.prm`` + ``finalize``; end to end, slow: a ``treadle-train ppo`` run on an hf rollout daemon
scores exactly the separators its policy sampled)."""

from __future__ import annotations

import collections
import json
import math
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from treadle_testing import rollout_daemon

from treadle.common.config import ConfigError
from treadle.common.records import Trajectory
from treadle.trainer.config import parse_ppo, parse_prm
from treadle.trainer.losses.prm import step_accuracy, step_bce_loss
from treadle.trainer.rl.experience import from_trajectory
from treadle.trainer.rl.prm import step_ends
from treadle.trainer.rl.returns import ReturnsConfig, finalize

GOOD, BAD = ["apple", "cherry", "mango"], ["banana", "delta", "kilo"]  # a step is correct iff its word is GOOD


def test_step_bce_loss_by_hand():
    z, y = torch.tensor([0.0, 2.0, -1.0]), torch.tensor([1.0, 0.0, 0.25])
    # l = softplus(z) - y z: ln 2 = 0.693147; ln(1 + e^2) = 2.126928; ln(1 + e^-1) + 0.25 = 0.313262 + 0.25
    torch.testing.assert_close(step_bce_loss(z, y), torch.tensor([0.693147, 2.126928, 0.563262]), atol=1e-6, rtol=0)
    # predicted class z > 0 vs label > 0.5: (no, yes) wrong, (yes, no) wrong, (no, no) right
    assert step_accuracy(z, y).tolist() == [0.0, 0.0, 1.0]


def test_step_bce_loss_is_openrlhfs_two_token_cross_entropy():
    # OpenRLHF's PRMLoss: cross-entropy over the (positive, negative) token logits, targets [y, 1 - y]
    g = torch.Generator().manual_seed(0)
    pair, y = torch.randn(5, 2, generator=g), torch.rand(5, generator=g)
    ce = torch.nn.functional.cross_entropy(pair, torch.stack([y, 1 - y], -1), reduction="none")
    torch.testing.assert_close(step_bce_loss(pair[:, 0] - pair[:, 1], y), ce)


def _fmt(tokenizer):
    from treadle.trainer.data.formatting import Formatter

    return Formatter(tokenizer, input_template=None, apply_chat_template=False)


def _rows(rows):
    from treadle.trainer.data.sources import Row

    return [Row(data=r, file="d.jsonl", index=i) for i, r in enumerate(rows)]


def _samples(tokenizer, rows, **kw):
    from treadle.trainer.data.steps import step_samples

    args = dict(max_len=1024, prompt_key="prompt", completions_key="completions", input_key="input",
                label_key="labels", step_separator="\n", placeholder_token=None, reward_tokens=None)
    return step_samples(_rows(rows), _fmt(tokenizer), **{**args, **kw})


def test_trl_rows_label_each_separators_last_token(tokenizer):
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    row = {"prompt": "count fox", "completions": ["apple golf", "banana"], "labels": [True, False]}
    (sample,), dropped = _samples(tokenizer, [row], step_separator=" ;")
    sep = enc(" ;")
    want = enc("count fox") + enc("apple golf") + sep + enc("banana") + sep  # each piece on its own
    seq = sample.seqs[0]
    assert dropped == 0 and seq.ids.tolist() == want
    ends = [len(enc("count fox") + enc("apple golf") + sep) - 1, len(want) - 1]
    assert np.flatnonzero(seq.target).tolist() == ends and sample.step_labels == (1.0, 0.0)
    # truncated inside the second step: only the first step's label is left; to before it: row dropped
    (short,), _ = _samples(tokenizer, [row], step_separator=" ;", max_len=ends[1])
    assert short.step_labels == (1.0,) and short.seqs[0].num_targets == 1
    assert _samples(tokenizer, [row], step_separator=" ;", max_len=ends[0]) == ([], 1)


def test_openrlhf_placeholder_rows_and_label_errors(tokenizer):
    rows = [{"input": "q fox # apple # banana #", "labels": ["+", "-", "+"]}, {"input": "q #", "labels": [0.25]}]
    samples, _ = _samples(tokenizer, rows, placeholder_token="#", reward_tokens=("+", "-"))
    x = tokenizer("#", add_special_tokens=False)["input_ids"][0]
    assert [s.step_labels for s in samples] == [(1.0, 0.0, 1.0), (0.25,)]
    assert all((s.seqs[0].ids[s.seqs[0].target] == x).all() for s in samples)
    with pytest.raises(ConfigError, match=r"d.jsonl row 0: key 'labels': 2 labels for 3 steps"):
        _samples(tokenizer, [{"input": "a # b # c #", "labels": ["+", "-"]}], placeholder_token="#",
                 reward_tokens=("+", "-"))
    with pytest.raises(ConfigError, match=r"step 1's label '\?' is not one of --data.reward_tokens"):
        _samples(tokenizer, [{"input": "a # b #", "labels": ["+", "?"]}], placeholder_token="#",
                 reward_tokens=("+", "-"))
    with pytest.raises(ConfigError, match=r"step 0's label 2 is not"):
        _samples(tokenizer, [{"prompt": "p", "completions": ["a"], "labels": [2]}])
    with pytest.raises(ConfigError, match="--data.placeholder_token ' apple golf' is not one token"):
        _samples(tokenizer, rows, placeholder_token=" apple golf")


def test_prm_flags_refused_at_parse_time(tmp_path):
    base = ["--actor.model_name_or_path", "m", "--data.dataset", "d.jsonl"]
    assert parse_prm(base).data.step_marker == "\n"
    cfg = parse_prm([*base, "--data.placeholder_token", "ки", "--data.reward_tokens", "+", "-"])
    assert cfg.data.step_marker == "ки" and cfg.data.reward_tokens == ("+", "-")
    for extra, match in ((["--data.reward_tokens", "+", "-"], "needs|read only with --data.placeholder_token"),
                         (["--placeholder_token", "ки"], "use --data.placeholder_token"),
                         (["--reward_tokens", "+", "-"], "use --data.reward_tokens"),
                         (["--data.apply_chat_template"], "tokenised as raw text"),
                         (["--data.step_separator", ""], "--data.step_separator is empty")):
        with pytest.raises(ConfigError, match=match):
            parse_prm([*base, *extra])
    ppo = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p.jsonl", "--rollout.max_new_tokens", "8"]
    assert parse_ppo([*ppo, "--reward.prm_model_name_or_path", "some/prm",
                      "--algo.advantage.estimator", "reinforce"]).reward.prm_model_name_or_path == "some/prm"
    with pytest.raises(ConfigError, match="--algo.advantage.estimator group_norm cannot use"):
        parse_ppo([*ppo, "--reward.prm_model_name_or_path", "some/prm", "--algo.advantage.estimator", "group_norm",
                   "--rollout.n_samples_per_prompt", "2"])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))  # an outcome RM's folder
    with pytest.raises(ConfigError, match="its config.json has no step_separator"):
        parse_ppo([*ppo, "--reward.prm_model_name_or_path", str(tmp_path)])


def _step_rows(n, seed):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = [rng.choice(GOOD + BAD) for _ in range(rng.randint(1, 4))]
        rows.append({"prompt": "solve", "completions": [f"so {w}" for w in words], "labels": [w in GOOD for w in words]})
    return rows


@pytest.fixture(scope="module")
def prm_run(tiny, tmp_path_factory, helpers):
    out = tmp_path_factory.mktemp("prm")
    for name, n, seed in (("train", 96, 0), ("eval", 32, 1)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _step_rows(n, seed)))
    cmd = [sys.executable, "-m", "treadle.trainer.cli", "prm", "--actor.model_name_or_path", str(tiny),
           "--data.dataset", str(out / "train.jsonl"), "--eval.dataset", str(out / "eval.jsonl"), "--eval.steps", "6",
           "--data.step_separator", " ;", "--train.batch_size", "16", "--train.micro_batch_size", "4",
           "--train.max_epochs", "3", "--adam.lr", "3e-3", "--ds.param_dtype", "fp32", "--ds.zero_stage", "0",
           "--ckpt.path", str(out / "ckpt"), "--ckpt.output_dir", str(out / "model"), "--ckpt.best_metric_key", "none"]
    proc = subprocess.run(cmd, env=helpers.child_env(), capture_output=True, text=True, timeout=600, cwd=helpers.root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_prm_training_learns_the_step_labels(prm_run, tokenizer):
    from treadle.trainer.config.deepspeed import DeepSpeedConfig
    from treadle.trainer.data.batching import pad_batch
    from treadle.trainer.models.reward_model import ProcessRewardModel

    rows = [json.loads(line) for line in (prm_run / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    assert train[0]["loss"] > 0.5 and np.mean([r["loss"] for r in train[-3:]]) < 0.5 * train[0]["loss"]
    assert evals[-1]["eval_acc"] > 0.9 and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    # the export: a reward-model folder recording its separator, whose step logits classify held-out steps
    config = json.loads((prm_run / "model" / "config.json").read_text())
    assert config["step_separator"] == " ;"
    prm = ProcessRewardModel.from_pretrained(str(prm_run / "model"), DeepSpeedConfig(param_dtype="fp32")).eval()
    samples, _ = _samples(tokenizer, _step_rows(32, 7), step_separator=" ;")
    batch = pad_batch(samples, tokenizer.pad_token_id or 0)
    with torch.no_grad():
        logits = prm.step_logits(prm(**batch.model_inputs()), batch)
    labels = torch.tensor([y for s in samples for y in s.step_labels])
    assert step_accuracy(logits, labels).mean() > 0.9


def test_two_ranks_and_other_micro_batches_train_the_same(prm_run, tiny, helpers, tmp_path):
    # the loss is the mean over every labelled step of the optimizer step, whatever the split: one rank with
    # padded micro-batches of 4 (prm_run) and two ZeRO-2 ranks with packed micro-batches of 2 log the same
    # losses at every step (so the same gradients: a different one would move step k + 1's loss)
    out = tmp_path / "two"
    helpers.torchrun(["-m", "treadle.trainer.cli", "prm", "--actor.model_name_or_path", str(tiny),
                      "--data.dataset", str(prm_run / "train.jsonl"), "--data.step_separator", " ;",
                      "--train.batch_size", "16", "--train.micro_batch_size", "2", "--ds.packing_samples",
                      "--train.max_epochs", "3", "--adam.lr", "3e-3", "--ds.param_dtype", "fp32", "--ds.zero_stage", "2",
                      "--ckpt.path", str(out / "ckpt"), "--ckpt.output_dir", str(out / "model")])
    def losses(folder):
        return [json.loads(line)["loss"] for line in (folder / "ckpt" / "metrics.jsonl").read_text().splitlines()
                if "loss" in json.loads(line)]
    one, two = losses(prm_run), losses(out)  # the same 18 steps (3 epochs: the same learning-rate schedule)
    assert len(one) == len(two) == 18 and len(set(np.round(one, 4))) == 18  # steps differ: not constants compared
    np.testing.assert_allclose(two, one, rtol=1e-5)


def _traj(tokenizer, prompt, response, reward, uid):
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    r = [t for piece in response for t in tokenizer(piece, add_special_tokens=False)["input_ids"]]
    return Trajectory(prompt_token_ids=np.array(p, np.int32), response_token_ids=np.array(r, np.int32),
                      rollout_logprobs=np.full(len(r), -0.5, np.float32), loss_mask=np.ones(len(r), np.uint8),
                      reward=reward, uid=uid)


def test_step_ends_match_the_separator_in_the_response_only():
    ids = np.array([7, 9, 1, 7, 9, 2, 7, 9])  # prompt [7, 9, 1], response [7, 9, 2, 7, 9]
    assert step_ends(ids, np.arange(3, 8), 3, [7, 9]).tolist() == [1, 4]  # the prompt's [7, 9] is not a step
    assert step_ends(ids, np.arange(4, 8), 4, [7, 9]).tolist() == [3]  # a separator needs its whole span in the response
    assert step_ends(ids, np.arange(3, 8), 3, [9]).tolist() == [1, 4]


def test_ppo_prm_scores_the_separator_tokens_and_moves_the_advantages(prm_run, tokenizer):
    from treadle.trainer.config.deepspeed import DeepSpeedConfig
    from treadle.trainer.data.steps import separator_ids
    from treadle.trainer.models.reward_model import ProcessRewardModel
    from treadle.trainer.rl.prm import add_prm_rewards

    prm = ProcessRewardModel.from_pretrained(str(prm_run / "model"), DeepSpeedConfig(param_dtype="fp32")).eval()
    sep = separator_ids(tokenizer, json.loads((prm_run / "model" / "config.json").read_text())["step_separator"])
    trajs = [_traj(tokenizer, "solve", ["so apple", " ;", "so banana", " ;", " fox"], 1.0, "a"),
             _traj(tokenizer, "solve", ["so kilo", " ;"], 0.0, "b")]
    cfg = ReturnsConfig(estimator="reinforce", group_size=1, gamma=1.0, lambd=1.0, std_norm=True, kl_coef=0.0,
                        kl_estimator="k1", kl_in_reward=True, clip_range=(-10.0, 10.0), max_new_tokens=16,
                        overlong_buffer_len=None, overlong_penalty_factor=1.0, stop_properly_coef=None, is_level=None)
    for packing in (False, True):
        exps = [from_trajectory(t) for t in trajs]
        for e in exps:
            e.reward = float(e.traj.reward)
        steps = add_prm_rewards(prm, exps, sep, micro_batch=1, packing=packing, pad_id=tokenizer.pad_token_id or 0,
                                device=torch.device("cpu"), ring=None, rank=0, world=1)
        assert steps == 3
        for e in exps:  # the PRM's own reading of the whole sequence, at each separator's last token
            with torch.no_grad():
                z = prm(input_ids=torch.from_numpy(e.ids)[None]).squeeze(0)
            ends = step_ends(e.ids, e.pos, len(e.traj.prompt_token_ids), sep)
            want = np.zeros(e.num_actions, np.float32)
            want[ends] = torch.sigmoid(z[e.pos[ends]]).numpy()
            np.testing.assert_allclose(e.arrays["process_rewards"], want, rtol=1e-5, atol=1e-6)
            assert (e.arrays["process_rewards"] != 0).sum() == len(ends)
        # a trained PRM: "so apple ;" scores high, "so banana ;" and "so kilo ;" low
        p = [e.arrays["process_rewards"][e.arrays["process_rewards"] != 0] for e in exps]
        assert p[0][0] > 0.5 > p[0][1] and p[1][0] < 0.5
        finalize(exps, cfg)
        # reinforce: r_t = p_t + [t last] R; G_t = sum_{k >= t} r_k; advantages = G whitened over the batch's tokens
        g = [np.cumsum((e.arrays["process_rewards"] + np.eye(e.num_actions)[-1] * e.reward)[::-1])[::-1] for e in exps]
        for e, gi in zip(exps, g, strict=True):
            np.testing.assert_allclose(e.arrays["returns"], gi, rtol=1e-5)
        flat = np.concatenate(g)
        np.testing.assert_allclose(np.concatenate([e.arrays["advantages"] for e in exps]),
                                   (flat - flat.mean()) / flat.std(), rtol=1e-4, atol=1e-5)
        assert not math.isclose(exps[1].arrays["returns"][0], 0.0)  # without the PRM: R = 0 everywhere on row b
    plain = [from_trajectory(t) for t in trajs]
    for e in plain:
        e.reward = float(e.traj.reward)
    finalize(plain, cfg)
    assert plain[1].arrays["returns"].tolist() == [0.0] * plain[1].num_actions


CONSTANT = '''
def reward_func(queries, prompts, labels):
    return {"rewards": [0.0] * len(queries)}
'''


def hf_daemon(model, helpers):
    return rollout_daemon(model, helpers.child_env(), "--backend", "hf")


def _ppo(tiny, tmp_path, endpoint, prm, name, helpers):
    args = ["ppo", "--actor.model_name_or_path", str(tiny), "--data.prompt_dataset", str(tmp_path / "prompts.jsonl"),
            "--data.input_key", "prompt", "--reward.remote_url", str(tmp_path / "reward.py"),
            "--reward.prm_model_name_or_path", str(prm), "--algo.advantage.estimator", "reinforce",
            "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "2", "--train.batch_size", "8",
            "--train.micro_batch_size", "8", "--rollout.micro_batch_size", "8", "--rollout.max_new_tokens", "12",
            "--data.prompt_max_len", "16", "--actor.num_gpus_per_node", "1", "--ds.param_dtype", "fp32",
            "--ds.zero_stage", "0", "--vllm.endpoint", endpoint, "--train.num_episodes", "1", "--data.max_samples", "2",
            "--ckpt.path", str(tmp_path / name / "ckpt"), "--ckpt.output_dir", str(tmp_path / name / "model")]
    proc = subprocess.run([sys.executable, "-m", "treadle.trainer.cli", *args], env=helpers.child_env(),
                          capture_output=True, text=True, timeout=600, cwd=helpers.root)
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = [json.loads(line) for line in (tmp_path / name / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    from treadle.trainer.rl.trajlog import TrajectoryLog

    with TrajectoryLog(tmp_path / name / "ckpt" / "trajectories") as tl:
        trajs = [t for _, group in tl.recover(0).pending for t in group]
    return rows, trajs


def _with_separator(src, dst, separator):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["step_separator"] = separator
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.slow
def test_ppo_run_scores_every_separator_the_policy_sampled(prm_run, tiny, tokenizer, helpers, tmp_path):
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"solve {w}:"}) + "\n" for w in GOOD[:2]))
    (tmp_path / "reward.py").write_text(CONSTANT)
    with hf_daemon(tiny, helpers) as endpoint:
        _, trajs = _ppo(tiny, tmp_path, endpoint, prm_run / "model", "first", helpers)
        # the response token sampled most often whose text encodes back to it: the second run's step separator;
        # the same seed and weights sample the same responses, so its steps are exactly that token's occurrences
        counts = collections.Counter(t for tr in trajs for t in np.asarray(tr.response_token_ids).tolist())
        sep, count = next((t, c) for t, c in counts.most_common()
                          if tokenizer(tokenizer.decode([t]), add_special_tokens=False)["input_ids"] == [t])
        prm = _with_separator(prm_run / "model", tmp_path / "prm", tokenizer.decode([sep]))
        rows, again = _ppo(tiny, tmp_path, endpoint, prm, "second", helpers)
    assert [t.response_token_ids.tolist() for t in again] == [t.response_token_ids.tolist() for t in trajs]
    (row,) = rows
    assert row["prm/steps_mean"] == pytest.approx(count / len(trajs))
    # the outcome reward is 0: what the samples got is the PRM's sigmoids, one in (0, 1) per step
    assert 0 < row["reward/process_mean"] < row["prm/steps_mean"]
