"""The small GRPO task of the launcher benchmarks (``tools/bench/bench_restart.py``,
``bench_remote_reference.py``): the tiny model, ``prompts`` prompts, and a rule reward file (the
share of digits in a sample), all written under ``work``."""

from __future__ import annotations

import json
from pathlib import Path

REWARD = '''
def reward_func(queries, prompts, labels):
    out = [sum(c.isdigit() for c in q) / max(1, len(q)) for q in queries]
    return {"rewards": out, "scores": out}
'''


def digit_task(work: Path, prompts: int) -> tuple[Path, Path, Path]:
    """(model folder, prompt dataset, reward file) under ``work``."""
    from tiny_model import build  # noqa: PLC0415

    model = build("tiny", work / "tiny", seed=0).out
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"numbers for item {i}:", "label": str(i % 10)}) + "\n"
                            for i in range(prompts)))
    reward = work / "reward.py"
    reward.write_text(REWARD)
    return model, data, reward
