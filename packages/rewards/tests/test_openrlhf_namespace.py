"""Reward files that import ``openrlhf``: served helpers score right, anything else fails at load, named."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import requests

from treadle.rewards.config import RMConfig, WorkerConfig
from treadle.rewards.loader import FunctionSpec, load, parse_ref
from treadle.rewards.openrlhf import namespace
from treadle.rewards.openrlhf.math_utils import extract_boxed_answer, grade_answer

pytest.importorskip("math_verify")
torch = pytest.importorskip("torch")

# Written the way OpenRLHF's examples/python/math_reward_func.py is: its imports and call pattern.
MATH_FILE = """
    import torch

    from openrlhf.utils import extract_boxed_answer, grade_answer


    def reward_func(queries, prompts, labels, **kwargs):
        rewards = []
        for query, prompt, label in zip(queries, prompts, labels):
            response = query[len(prompt):] if prompt in query else query
            rewards.append(1.0 if grade_answer(extract_boxed_answer(response), label) else 0.0)
        rewards = torch.tensor(rewards, dtype=torch.float)
        return {"rewards": rewards, "scores": rewards, "extra_logs": {"math_accuracy": rewards.mean()}}
"""
PROMPTS = ["What is 1/2 + 0?", "2+2?", "6*7?", "Name the prime after 2."]
RESPONSES = [" It is \\boxed{\\frac{1}{2}}.", " \\boxed{5}", " The answer is 42.", " So \\boxed{3}"]
LABELS = ["0.5", "4", "42", "3"]
EXPECTED = [1.0, 0.0, 0.0, 1.0]  # right (another spelling), wrong, no box, right
QUERIES = [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]
MISSING = "openrlhf.utils.get_tokenizer"


@pytest.fixture(autouse=True)
def fresh_namespace():
    """Each test starts and ends without treadle's openrlhf modules."""
    namespace.uninstall()
    yield
    namespace.uninstall()


def test_an_openrlhf_math_reward_file_loads_and_scores(write_file):
    loaded = load(parse_ref(str(write_file("math_reward_func.py", MATH_FILE))))
    out = loaded.fn(QUERIES, PROMPTS, LABELS)
    assert out["rewards"].tolist() == EXPECTED and out["scores"].tolist() == EXPECTED
    assert out["extra_logs"]["math_accuracy"].item() == pytest.approx(0.5)


def test_the_daemon_serves_it_over_openrlhfs_http_contract(serve, write_file):
    d = serve(functions=(str(write_file("math_reward_func.py", MATH_FILE)),), workers=WorkerConfig(num_workers=1))
    body = {"query": QUERIES, "prompts": PROMPTS, "labels": LABELS}
    reply = requests.post(d.daemon.addresses.http + "/get_reward", json=body, timeout=60).json()
    assert reply["rewards"] == EXPECTED
    assert reply["extra_logs"]["math_reward_func/math_accuracy"] == [0.5] * 4


def test_helpers_grade_as_treadles_math_verifier():
    assert extract_boxed_answer("so \\boxed{\\frac{1}{2}} and \\boxed{x^{2}}.") == "x^{2}"  # the last box
    assert extract_boxed_answer("no box") is None and extract_boxed_answer(None) is None
    assert grade_answer("\\frac12", "0.5") and grade_answer("1/2", 0.5) and grade_answer("2", {"answer": "2"})
    assert not grade_answer("3", "4") and not grade_answer(None, "4") and not grade_answer("4", None)
    with pytest.raises(ValueError, match="characters"):
        grade_answer("1", "1" * 2000)  # a label too long to parse fails its sample instead of scoring 0


@pytest.mark.parametrize(("source", "named"), [
    ("from openrlhf.utils import extract_boxed_answer, get_tokenizer\n", MISSING),
    ("import openrlhf.models\n", "openrlhf.models"),
    ("from openrlhf import trainer\n", "openrlhf.trainer"),
    ("def helper():\n    from openrlhf.utils.math_utils import remove_boxed\n",  # would fail only when called
     "openrlhf.utils.math_utils.remove_boxed"),
])
def test_a_missing_openrlhf_name_fails_at_load_naming_it(write_file, source, named):
    path = write_file("reward.py", source + "def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n")
    with pytest.raises(namespace.OpenRLHFImportError, match=rf"reward\.py:\d+: {named} is not provided") as e:
        parse_ref(str(path))
    assert "extract_boxed_answer and grade_answer" in str(e.value)  # says what treadle provides
    with pytest.raises(namespace.OpenRLHFImportError, match=named):
        load(FunctionSpec(name="r", source=str(path)))  # a spec built without parse_ref is checked too


def test_the_daemon_refuses_such_a_file_before_it_loads_a_model(serve, write_file, tmp_path):
    path = write_file("reward.py", f"from openrlhf.utils import {MISSING.rsplit('.', 1)[1]}\n"
                                   "def reward_func(q, p, l):\n    return [0.0] * len(q)\n")
    with pytest.raises(namespace.OpenRLHFImportError, match=MISSING):
        serve(functions=(str(path),), rm=RMConfig(path=str(tmp_path / "no_model_here")))  # not reached


def test_names_imported_at_run_time_are_refused_by_name_too():
    assert namespace.install()
    with pytest.raises(ImportError, match=f"{MISSING} is not provided"):
        from openrlhf.utils import get_tokenizer  # noqa: F401
    with pytest.raises(ImportError, match="openrlhf.datasets is not provided"):
        importlib.import_module("openrlhf.datasets")
    import openrlhf.utils
    with pytest.raises(AttributeError, match="openrlhf.utils.get_strategy is not provided"):
        openrlhf.utils.get_strategy  # noqa: B018
    from openrlhf.utils.math_utils import grade_answer as served
    assert served is grade_answer


def test_an_import_the_file_guards_is_left_to_it(write_file):
    path = write_file("reward.py", """
        try:
            from openrlhf.utils import get_tokenizer
        except ImportError:
            get_tokenizer = None

        def reward_func(queries, prompts, labels):
            return [float(get_tokenizer is None)] * len(queries)
    """)
    assert load(parse_ref(str(path))).fn(["q"], ["p"], ["l"]) == [1.0]


def test_works_after_treadle_agents_registered_its_plain_modules():
    """treadle-agents' install_openrlhf_alias puts plain modules in sys.modules: they gain the reward names."""
    root, utils = types.ModuleType("openrlhf"), types.ModuleType("openrlhf.utils")
    root.__path__, utils.__path__ = [], []
    root.utils = utils
    sys.modules.update({"openrlhf": root, "openrlhf.utils": utils})
    assert namespace.install()
    from openrlhf.utils import extract_boxed_answer as served
    assert served is extract_boxed_answer
    with pytest.raises(ImportError, match=MISSING):
        from openrlhf.utils import get_tokenizer  # noqa: F401


@pytest.mark.skipif(importlib.util.find_spec("treadle.agents") is None, reason="treadle-agents not installed")
def test_agent_files_still_import_openrlhf_utils_agent_after_a_reward_file():
    namespace.install()
    from openrlhf.utils.agent import AgentInstanceBase

    import treadle.agents.openrlhf as agent_api
    assert AgentInstanceBase is agent_api.AgentInstanceBase
