"""A supervised warm start for the tiny test model: it memorizes a few conversations.

A randomly initialised model never calls a tool or answers anything, so nothing downstream of a
parse would be exercised. ``warm_start`` trains the tiny model (full-sequence next-token loss,
AdamW, fp32, CPU, fixed seed) on chat transcripts rendered by the same chat template the tests
use, until greedy decoding reproduces each assistant turn; a few hundred steps, a few seconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from treadle.agents.envs.arithmetic import CALCULATOR_TOOL, question
from treadle.agents.tools import format_tool_call

ARITH_EXPR = "2 + 3"
ARITH_VALUE = 5


def arithmetic_transcript() -> list[dict[str, Any]]:
    """user question -> calculator call -> tool result -> answer (the arithmetic env's format)."""
    call = {"id": "call_0", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": ARITH_EXPR})}}
    return [{"role": "user", "content": question(ARITH_EXPR)},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": str(ARITH_VALUE)},
            {"role": "assistant", "content": f"<answer>{ARITH_VALUE}</answer>"}]


def warm_start(model_dir: Path, chat: Any, *, steps: int = 300, lr: float = 1e-2, seed: int = 0) -> float:
    """Train the model in ``model_dir`` in place on the transcripts; returns the final loss."""
    import torch
    from transformers import AutoModelForCausalLM

    text = chat.render(arithmetic_transcript(), tools=[CALCULATOR_TOOL], add_generation_prompt=False)
    assert format_tool_call("calculator", {"expression": ARITH_EXPR}) in text
    ids = torch.tensor(chat.encode(text.rstrip("\n")), dtype=torch.long)[None]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    loss = torch.tensor(0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: same result on any machine, no stalls on a busy one
    try:
        for _ in range(steps):
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            if loss.item() < 3e-3:
                break
    finally:
        torch.set_num_threads(threads)
    model.eval().save_pretrained(str(model_dir), safe_serialization=True)
    return float(loss.item())
