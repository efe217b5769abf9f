"""``treadle.agents.client`` stays light: importing it pulls in no torch, vLLM or transformers."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "vllm", "transformers", "deepspeed", "ray")


def test_client_import_is_light(subprocess_env: dict[str, str]) -> None:
    code = ("import sys, treadle.agents.client, treadle.agents.jsonio\n"
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env, check=True)
    assert out.stdout.strip() == "[]", out.stdout
