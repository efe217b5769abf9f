"""`make demo` (tools/demo.py and its demo_* modules).

Default suite: the generated dataset is deterministic, held out and correctly labelled, and the
teacher errs only where it should; the scorer is the trainer's math verifier; the command lines
parse with treadle-train's own parsers into the intended run; metric tailing reads whole lines.
Slow: the whole demo on a shrunken budget leaves its artifacts (not its accuracy gain: a few
GRPO steps prove nothing; the full run's numbers are in the report that came with this test).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo(tool):
    """The demo modules, loaded in import order (tools/ is not a package)."""
    task = tool("demo_task")
    steps = tool("demo_steps")
    return type("Demo", (), {"task": task, "steps": steps, "report": tool("demo_report")})


def test_problems_are_every_one_and_two_digit_pair_once(demo):
    problems = demo.task.all_problems()
    assert len(problems) == len({(p.a, p.b) for p in problems}) == 1900  # 100*10 + 10*100 - 10*10 both-single
    assert all(min(p.a, p.b) <= 9 and max(p.a, p.b) <= 99 for p in problems)
    assert demo.task.Problem(a=27, b=5).carries and not demo.task.Problem(a=23, b=5).carries


def test_dataset_is_deterministic_and_seeded(demo):
    cfg = demo.task.TaskConfig(seed=3, eval_size=100, sft_rows=300)
    assert demo.task.make_dataset(cfg) == demo.task.make_dataset(cfg)
    other = demo.task.make_dataset(demo.task.TaskConfig(seed=4, eval_size=100, sft_rows=300))
    assert other.eval != demo.task.make_dataset(cfg).eval


def test_labels_are_true_sums_and_eval_is_held_out(demo):
    ds = demo.task.make_dataset(demo.task.TaskConfig(seed=0, eval_size=200, sft_rows=2000))
    for row in ds.rl + ds.eval:
        p = demo.task.parse_prompt(row["prompt"])
        assert row["label"] == str(p.a + p.b)
    held_out = {r["prompt"] for r in ds.eval}
    assert len(held_out) == 200
    assert not held_out & {r["prompt"] for r in ds.rl}
    assert not held_out & {r["prompt"] for r in ds.sft}
    assert len(ds.rl) + len(ds.eval) == 1900


def _sft_errors(demo, carry_error: float) -> tuple[list[bool], list[bool]]:
    """(wrong flags of carrying SFT rows, wrong flags of the others)."""
    ds = demo.task.make_dataset(demo.task.TaskConfig(seed=0, eval_size=100, sft_rows=4000, carry_error=carry_error))
    carrying, plain = [], []
    for row in ds.sft:
        p = demo.task.parse_prompt(row["prompt"])
        wrong = row["answer"] != f"\\boxed{{{p.a + p.b}}}"
        if wrong:
            assert row["answer"] == f"\\boxed{{{p.a + p.b - 10}}}"  # the only mistake: a dropped carry
        (carrying if p.carries else plain).append(wrong)
    return carrying, plain


def test_teacher_forgets_only_carries_at_the_given_rate(demo):
    carrying, plain = _sft_errors(demo, 0.5)
    assert not any(plain)
    assert 0.45 < sum(carrying) / len(carrying) < 0.55  # ~1,800 carrying rows: 0.5 +- 0.025 at 2 sigma
    assert not any(_sft_errors(demo, 0.0)[0])
    assert all(_sft_errors(demo, 1.0)[0])


def test_write_dataset_round_trips(demo, tmp_path):
    ds = demo.task.make_dataset(demo.task.TaskConfig(seed=0, eval_size=50, sft_rows=20))
    files = demo.task.write_dataset(ds, tmp_path)
    assert [json.loads(line) for line in files.sft.read_text().splitlines()] == ds.sft
    assert [json.loads(line) for line in files.eval.read_text().splitlines()] == ds.eval


def test_score_is_the_math_verifier_on_the_last_box(demo):
    responses = ["\\boxed{32}", "\\boxed{22}", "32", "\\boxed{3} so \\boxed{32}", "\\boxed{ 32 }", "\\boxed{32"]
    assert demo.task.score(["27+5="] * 6, responses, ["32"] * 6) == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]


def test_episodes_give_exactly_the_requested_steps(demo):
    for steps, prompts, available in [(48, 32, 1400), (3, 4, 1400), (100, 32, 1400), (7, 5, 6)]:
        r = demo.steps.Recipe(rl_steps=steps, rl_prompts=prompts)
        passes, used = r.episodes(available)
        assert used <= available
        assert used * passes // prompts == steps, (steps, prompts, available)


def test_commands_parse_into_the_intended_runs(demo, tmp_path):
    from treadle.trainer.config import parse_ppo, parse_sft

    r = demo.steps.Recipe()
    sft = parse_sft(demo.steps.sft_command(r, model=tmp_path / "m", data=tmp_path / "s.jsonl", out=tmp_path / "o")[4:])
    assert sft.train.batch_size == r.sft_batch and sft.data.output_key == "answer" and sft.ds.param_dtype == "fp32"
    argv = demo.steps.ppo_command(r, model=tmp_path / "m", prompts=tmp_path / "p.jsonl", num_prompts=1400,
                                  eval_data=tmp_path / "e.jsonl", endpoint="tcp://127.0.0.1:5", out=tmp_path / "o")
    ppo = parse_ppo(argv[4:])
    assert ppo.reward.remote_urls == ("math",) and ppo.algo.advantage.estimator == "group_norm"
    assert ppo.vllm.endpoint == "tcp://127.0.0.1:5" and ppo.eval.temperature == 0.0
    assert ppo.train.batch_size == ppo.rollout.batch_size * ppo.rollout.n_samples_per_prompt  # one step per rollout
    assert ppo.data.max_samples * ppo.train.num_episodes // ppo.rollout.batch_size == r.rl_steps
    assert ppo.max_len <= 64  # the demo's daemons serve --engine.max_model_len 64
    assert ppo.algo.kl.init_coef == 0 and not ppo.uses_reference  # no reference model by default
    with_kl = dataclasses.replace(r, kl_coef=1e-3)  # --recipe.kl_coef: the SFT model as the reference
    gpu = parse_ppo(demo.steps.ppo_command(with_kl, model=tmp_path / "m", prompts=tmp_path / "p.jsonl", num_prompts=1400,
                                           eval_data=tmp_path / "e.jsonl", endpoint="tcp://127.0.0.1:5",
                                           out=tmp_path / "o", gpu=True)[4:])
    assert gpu.algo.kl.init_coef == 1e-3 and gpu.uses_reference and gpu.vllm.sync_backend == "cuda_ipc"


def test_metrics_tail_reads_only_complete_lines(demo, tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = demo.steps.MetricsTail(path)
    assert tail.poll() == []
    path.write_text('{"step": 1}\n{"step": 2')
    assert tail.poll() == [{"step": 1}]
    with path.open("a") as fh:
        fh.write(', "loss": 0.5}\n')
    assert tail.poll() == [{"step": 2, "loss": 0.5}]
    assert [r["step"] for r in tail.rows] == [1, 2]


def test_examples_show_fixed_problems_first(demo):
    ev = demo.steps.EvalResult
    before = ev(greedy=0.5, sampled=0.4, greedy_carry=0.0, greedy_no_carry=1.0,
                answers={"27+5=": "\\boxed{22}", "3+4=": "\\boxed{7}", "8+8=": "\\boxed{16}"})
    after = ev(greedy=0.7, sampled=0.5, greedy_carry=1.0, greedy_no_carry=0.5,
               answers={"27+5=": "\\boxed{32}", "3+4=": "\\boxed{17}", "8+8=": "\\boxed{16}"})
    rows = demo.report.example_rows(before, after, {"27+5=": "32", "3+4=": "7", "8+8=": "16"})
    assert rows == [("27+5=", "\\boxed{22}", "\\boxed{32}", "32"), ("3+4=", "\\boxed{7}", "\\boxed{17}", "7")]
    assert demo.report.improved(before, after) and not demo.report.improved(after, before)


@pytest.mark.slow
def test_demo_on_a_small_budget_leaves_its_artifacts(tmp_path):
    out, model = tmp_path / "run", tmp_path / "tiny"
    cmd = [sys.executable, str(TOOLS / "demo.py"), "--model", str(model), "--out", str(out), "--eval_size", "40",
           "--recipe.sft_steps", "150", "--recipe.rl_steps", "4", "--recipe.rl_prompts", "4",
           "--recipe.group_size", "4", "--recipe.eval_every", "2", "--recipe.sampled_n", "2", "--no_require_improvement"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=TOOLS.parent)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert (model / "config.json").is_file()  # step (a) built the missing model
    results = json.loads((out / "results.json").read_text())
    for side in ("before", "after"):
        assert set(results[side]) == {"greedy", "sampled", "greedy_carry", "greedy_no_carry"}
        assert all(0.0 <= v <= 1.0 for v in results[side].values())
    assert results["weights_match"] is True  # the exported model is what the last broadcast served
    assert results["recipe"]["rl_steps"] == 4
    rows = [json.loads(line) for line in (out / "rl" / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert sum("eval/pass@1" in r for r in rows) == 2
    assert (out / "demo.png").stat().st_size > 10_000
    assert (out / "rl" / "model" / "model.safetensors").is_file()
    assert (out / "logs" / "ppo.log").is_file() and (out / "logs" / "rollout-rl.log").is_file()
    assert "accuracy, greedy" in proc.stdout
