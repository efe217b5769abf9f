"""Code-execution reward: run a response's Python against the label's test cases in the sandbox.

The program is the last fenced code block of the response (```` ```python ````, ```` ```py ```` or
bare ```` ``` ````). The label (a map, or a JSON string of one) gives the tests in one of these
forms::

    {"tests": [{"input": "1 2\\n", "output": "3\\n"}, ...]}            stdin -> expected stdout
    {"inputs": [...], "outputs": [...]}  or  {"input_output": <that, maybe as JSON>}   (APPS/TACO)
    {"asserts": ["assert add(1, 2) == 3", ...]}                        each run after the program
    {"test": "def check(f): ...", "entry_point": "add"}                HumanEval: check(add)

Each test is its own sandbox run (fresh process and folder). The reward is the pass rate
(passed / tests), or 1.0 only when all pass (``binary``). stdout is compared line by line with
trailing whitespace and trailing blank lines ignored. No code block scores 0 (not a failure);
a label without tests, or a sandbox that cannot start, fails the sample.

Not here: the jail itself (``sandbox``), languages other than Python.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from treadle.rewards.api import RewardBatch, RewardOutput, native
from treadle.rewards.sandbox import Isolation, Sandbox, SandboxLimits, SandboxUnavailable

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(response: str) -> str | None:
    """The last fenced code block of ``response`` (python/py/untagged), or None."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else None


@dataclass(frozen=True, slots=True, kw_only=True)
class CodeTest:
    """One test: feed ``stdin`` and compare stdout with ``expected`` (None: exit 0 passes), after
    appending ``suffix`` to the program."""

    stdin: str = ""
    expected: str | None = None
    suffix: str = ""


def _as_map(label: Any) -> dict[str, Any]:
    if isinstance(label, str):
        try:
            label = json.loads(label)
        except ValueError:
            raise ValueError(f"label is not JSON: {label[:80]!r}") from None
    if not isinstance(label, dict):
        raise ValueError(f"label must be a map of tests, got {type(label).__name__}")
    return label


def parse_tests(label: Any) -> list[CodeTest]:
    """The test cases a label describes (see the module docstring); ValueError when it has none."""
    spec = _as_map(label)
    if "input_output" in spec:
        spec = _as_map(spec["input_output"])
    if "tests" in spec:
        tests = [CodeTest(stdin=str(t.get("input", "")), expected=str(t.get("output", ""))) for t in spec["tests"]]
    elif "inputs" in spec and "outputs" in spec:
        if len(spec["inputs"]) != len(spec["outputs"]):
            raise ValueError(f"{len(spec['inputs'])} inputs but {len(spec['outputs'])} outputs")
        tests = [CodeTest(stdin=str(i), expected=str(o)) for i, o in zip(spec["inputs"], spec["outputs"], strict=True)]
    elif "asserts" in spec:
        tests = [CodeTest(suffix=f"\n\n{a}\n") for a in spec["asserts"]]
    elif "test" in spec:
        call = f"\ncheck({spec['entry_point']})\n" if spec.get("entry_point") else ""
        tests = [CodeTest(suffix=f"\n\n{spec['test']}\n{call}")]
    else:
        raise ValueError(f"label has no tests (keys: {sorted(spec)[:8]})")
    if not tests:
        raise ValueError("label has an empty test list")
    return tests


def same_output(got: str, expected: str) -> bool:
    """Line-wise equality ignoring trailing whitespace on each line and trailing blank lines."""
    def norm(s: str) -> list[str]:
        lines = [line.rstrip() for line in s.replace("\r\n", "\n").split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    return norm(got) == norm(expected)


def pass_rate(sandbox: Sandbox, code: str, tests: list[CodeTest], *, stop_on_failure: bool = False) -> tuple[float, int]:
    """(fraction of ``tests`` the program passes, number of runs stopped by a limit)."""
    passed, limited = 0, 0
    for t in tests:
        res = sandbox.run(code + t.suffix, t.stdin)
        ok = res.status == "ok" and (t.expected is None or same_output(res.stdout, t.expected))
        passed += ok
        limited += res.status in ("timeout", "cpu_limit", "memory_limit", "output_limit")
        if not ok and stop_on_failure:
            break
    return passed / len(tests), limited


def code_reward(*, cpu_s: float = 5.0, wall_s: float = 10.0, memory_mb: int = 512, nproc: int = 32,
                fsize_mb: int = 16, isolation: Isolation = "auto", binary: bool = False,
                stop_on_failure: bool = False, max_tests: int = 64) -> Any:
    """The built-in ``code`` reward (see the module docstring); limits apply to each test run.

    extra_logs: ``has_code``, ``pass_rate``, ``limit_hits`` (runs stopped by a limit).
    """
    sandbox = Sandbox(SandboxLimits(cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb, nproc=nproc,
                                    fsize_mb=fsize_mb), isolation=isolation)

    @native(version="1")
    def score(batch: RewardBatch) -> RewardOutput:
        n = len(batch)
        rewards, scores, has_code, rates, hits = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
        failed, errors = [False] * n, [""] * n
        for i, (response, label) in enumerate(zip(batch.responses, batch.labels, strict=True)):
            code = extract_code(response)
            try:
                tests = parse_tests(label)[:max_tests]
                if code is None:
                    continue
                has_code[i] = 1.0
                rate, limited = pass_rate(sandbox, code, tests, stop_on_failure=stop_on_failure)
            except (ValueError, SandboxUnavailable) as e:
                failed[i], errors[i] = True, str(e)[:500]
                continue
            rates[i], hits[i] = rate, float(limited)
            scores[i] = float(rate == 1.0)
            rewards[i] = scores[i] if binary else rate
        return RewardOutput(rewards=rewards, scores=scores,
                            extra_logs={"has_code": has_code, "pass_rate": rates, "limit_hits": hits},
                            failed=failed if any(failed) else [], errors=errors if any(failed) else [])

    score.__treadle_info__ = {"sandbox": sandbox.describe(), "binary": binary}  # type: ignore[attr-defined]
    return score
