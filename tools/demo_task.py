"""The `make demo` task: generated addition problems, a flawed teacher, and the verifier's score.

Problems are ``a+b=`` with one operand in 0..9 and the other in 0..99 (1,900 distinct pairs),
split once by a seeded shuffle into a held-out evaluation set and a training set. Three files
come out of ``make_dataset``:

- SFT rows ``{"prompt": "27+5=", "answer": "\\boxed{32}"}`` written by a *teacher* that forgets
  the carry on a share (``carry_error``) of the problems that have one (``27+5`` -> ``\\boxed{22}``);
- RL prompts ``{"prompt": "27+5=", "label": "32"}`` over the training problems;
- evaluation prompts, the same shape, over the held-out problems.

Why a flawed teacher: on this 2-core machine a tiny model warm-started by a short SFT on
*correct* answers (``carry_error=0``, 1,000 steps) gained +9.0, +1.4 and +6.2 points of greedy
accuracy from 48 GRPO steps over seeds 0, 1, 2: real but small and seed-dependent, because an
outcome reward teaches arithmetic slowly. A teacher with a systematic error is what a verifier
reward is for: the SFT model learns the error with everything else, and the verifier (which
knows the true sum) pushes it out: +23.4, +27.4 and +12.8 points over the same seeds with the
demo's 96 steps (the carrying sums alone: +48, +66, +30). ``carry_error=0`` gives the plain
variant.

``score`` is the exact reward function the trainer runs for ``--reward.remote_url math``
(treadle.rewards' ``math`` built-in: the last ``\\boxed{}`` must equal the label), so the before
and after accuracies and the RL reward mean the same thing. Pure except ``score`` (imports
math-verify). Not here: processes, daemons, plots (``demo_steps``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True, kw_only=True)
class Problem:
    """One addition ``a + b``."""

    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def total(self) -> int:
        return self.a + self.b

    @property
    def carries(self) -> bool:
        """Whether the units digits carry into the tens (``27+5``: 7 + 5 >= 10)."""
        return self.a % 10 + self.b % 10 >= 10


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskConfig:
    """How the dataset is drawn."""

    seed: int = 0  # the split, the SFT draw and the teacher's mistakes
    eval_size: int = 500  # held-out problems (never in SFT or RL data)
    sft_rows: int = 48_000  # SFT rows, drawn with replacement from the training problems
    carry_error: float = 0.5  # share of carrying SFT rows where the teacher forgets the carry

    def __post_init__(self) -> None:
        if not 0 < self.eval_size < len(all_problems()):
            raise ValueError(f"eval_size must be in 1..{len(all_problems()) - 1}, got {self.eval_size}")
        if self.sft_rows < 1:
            raise ValueError(f"sft_rows must be >= 1, got {self.sft_rows}")
        if not 0.0 <= self.carry_error <= 1.0:
            raise ValueError(f"carry_error must be in [0, 1], got {self.carry_error}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Dataset:
    """The three row lists, ready for jsonl."""

    sft: list[dict[str, str]]  # {"prompt", "answer"}: the teacher's answer in \boxed{}
    rl: list[dict[str, str]]  # {"prompt", "label"}: training problems, true sums
    eval: list[dict[str, str]]  # {"prompt", "label"}: held-out problems, true sums


@dataclass(frozen=True, slots=True, kw_only=True)
class DataFiles:
    """Where ``write_dataset`` put the rows."""

    sft: Path
    rl: Path
    eval: Path


def all_problems() -> list[Problem]:
    """Every ``a+b`` with one operand in 0..9 and the other in 0..99, each pair once, sorted."""
    pairs = {(a, b) for a in range(100) for b in range(10)} | {(b, a) for a in range(100) for b in range(10)}
    return [Problem(a=a, b=b) for a, b in sorted(pairs)]


def split(seed: int, eval_size: int) -> tuple[list[Problem], list[Problem]]:
    """(training problems, held-out problems): a seeded shuffle, the first ``eval_size`` held out."""
    problems = all_problems()
    random.Random(seed).shuffle(problems)
    return problems[eval_size:], problems[:eval_size]


def teacher_answer(p: Problem, forget_carry: bool) -> int:
    """The teacher's sum: right, or without the carry (``27+5`` -> 22) when it forgets."""
    return p.total - 10 if forget_carry and p.carries else p.total


def boxed(value: int | str) -> str:
    return f"\\boxed{{{value}}}"


def make_dataset(cfg: TaskConfig) -> Dataset:
    """The demo's rows; the same ``cfg`` always gives the same rows."""
    train, held_out = split(cfg.seed, cfg.eval_size)
    rng = random.Random(f"sft-{cfg.seed}")
    sft = []
    for _ in range(cfg.sft_rows):
        p = rng.choice(train)
        forget = rng.random() < cfg.carry_error
        sft.append({"prompt": p.prompt, "answer": boxed(teacher_answer(p, forget))})
    rl = [{"prompt": p.prompt, "label": str(p.total)} for p in train]
    evaluation = [{"prompt": p.prompt, "label": str(p.total)} for p in held_out]
    return Dataset(sft=sft, rl=rl, eval=evaluation)


def write_jsonl(path: Path, rows: Sequence[dict[str, str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_dataset(ds: Dataset, folder: Path) -> DataFiles:
    return DataFiles(sft=write_jsonl(folder / "sft.jsonl", ds.sft), rl=write_jsonl(folder / "rl.jsonl", ds.rl),
                     eval=write_jsonl(folder / "eval.jsonl", ds.eval))


def parse_prompt(prompt: str) -> Problem:
    """``"27+5="`` -> Problem(a=27, b=5)."""
    a, b = prompt.removesuffix("=").split("+")
    return Problem(a=int(a), b=int(b))


_VERIFIER = None


def score(prompts: Sequence[str], responses: Sequence[str], labels: Sequence[str]) -> list[float]:
    """1.0 per response whose last ``\\boxed{}`` equals its label, else 0.0: treadle.rewards'
    ``math`` built-in, called as the trainer calls it (query = prompt + response)."""
    global _VERIFIER  # built once: it imports math-verify (sympy), ~1 s
    from treadle.rewards.api import RewardBatch  # noqa: PLC0415
    from treadle.rewards.math_reward import math_reward  # noqa: PLC0415

    if _VERIFIER is None:
        _VERIFIER = math_reward()
    queries = [p + r for p, r in zip(prompts, responses, strict=True)]
    out = _VERIFIER(RewardBatch(queries=queries, prompts=list(prompts), labels=list(labels)))
    return [float(s) for s in (out.scores if out.scores is not None else out.rewards)]
