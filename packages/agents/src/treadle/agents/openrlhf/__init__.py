"""OpenRLHF's agent API (``openrlhf.utils.agent``), so a ``--train.agent_func_path`` file runs unchanged.

OpenRLHF's contract, as its trainer uses it: the file defines ``AgentExecutor``, a subclass of
``AgentExecutorBase`` built with no arguments, usually ``MultiTurnAgentExecutor`` bound to an
``AgentInstance`` (a subclass of ``AgentInstanceBase``, one instance per episode)::

    class AgentInstance(AgentInstanceBase):
        def __init__(self, *args, **kwargs): ...
        async def reset(self, states, **kwargs):  # states: {"observation": prompt, "label": label}
            return {"observation": text}
        async def step(self, states, **kwargs):   # states: {"observation_text", "action_text",
            return {"rewards": r,                 #          "label", "sampling_params"}
                    "scores": s,                  # optional: the last step's wins (default: reward sum)
                    "environment_feedback": text, # appended after the action, loss-masked
                    "done": bool,
                    "sampling_params": sp,        # optional: next turn's sampling
                    "extra_logs": {...}}          # the last step's are kept

    class AgentExecutor(MultiTurnAgentExecutor):
        def __init__(self):
            super().__init__(AgentInstance)

``executor.execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine)``
returns OpenRLHF's dict (prompt, label, observation_tokens, action_ranges, rollout_log_probs,
reward, scores, extra_logs, truncated). Here it runs treadle's ``MultiTurnExecutor`` (same
semantics) when ``llm_engine`` is treadle's ``EngineAdapter``; a file that overrides ``execute``
gets that adapter and a vLLM-shaped ``SamplingParams`` (``vllm_types``).
``treadle.agents.openrlhf.loader`` loads such files (registering this module as
``openrlhf.utils.agent`` when OpenRLHF itself is not installed) and turns their output into
Trajectories. ``async def __init__`` (older OpenRLHF examples) is supported.

A treadle extension: ``step``'s states also hold ``"action_token_ids"`` (the turn's sampled
tokens), and ``step`` may return ``"token_rewards"``, one number per action token (process
rewards, ``treadle.agents.api.StepResult.token_rewards``); an executor's own ``execute`` may return
them per ``observation_tokens`` entry, like ``rollout_log_probs``. OpenRLHF ignores both keys.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from typing import Any


class AgentInstanceBase(ABC):
    """One episode's environment, OpenRLHF's dict API."""

    @abstractmethod
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def reset(self, states: dict, **kwargs: Any) -> dict:
        return states

    @abstractmethod
    async def step(self, states: dict, **kwargs: Any) -> dict:
        raise NotImplementedError("AgentInstance.step is not implemented")


class AgentExecutorBase(ABC):
    """Runs one episode: ``execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine)``."""

    @abstractmethod
    async def execute(self, prompt: Any, label: Any, sampling_params: Any, max_length: int, hf_tokenizer: Any,
                      llm_engine: Any, **kwargs: Any) -> dict:
        raise NotImplementedError("AgentExecutorBase.execute is not implemented")


async def make_instance(cls: type) -> Any:
    """``cls()``, awaiting an ``async def __init__`` when the class has one."""
    init = cls.__init__
    if inspect.iscoroutinefunction(init):
        obj = cls.__new__(cls)
        await init(obj)
        return obj
    return cls()


def _engine(llm_engine: Any) -> Any:
    from treadle.agents.openrlhf.loader import EngineAdapter  # noqa: PLC0415  (cycle: loader imports us)

    if not isinstance(llm_engine, EngineAdapter):
        raise TypeError("treadle runs OpenRLHF executors with its own llm_engine (EngineAdapter); "
                        f"got {type(llm_engine).__name__}")
    return llm_engine


class MultiTurnAgentExecutor(AgentExecutorBase):
    """Generate -> ``AgentInstance.step`` -> append feedback, until done or ``max_length``."""

    def __init__(self, agent_instance_cls: type) -> None:
        if not (isinstance(agent_instance_cls, type) and issubclass(agent_instance_cls, AgentInstanceBase)):
            raise TypeError("AgentInstance must inherit from AgentInstanceBase")
        self.agent_instance_cls = agent_instance_cls

    async def execute(self, prompt: Any, label: Any, sampling_params: Any, max_length: int, hf_tokenizer: Any,
                      llm_engine: Any, **kwargs: Any) -> dict:
        from treadle.agents.openrlhf.loader import run_instance_episode  # noqa: PLC0415

        return await run_instance_episode(self.agent_instance_cls, prompt, label, sampling_params, max_length,
                                          _engine(llm_engine))


class SingleTurnAgentExecutor(AgentExecutorBase):
    """One generation, rewarded by ``remote_rm_url`` (a reward file, URL or daemon endpoint) if given."""

    def __init__(self, remote_rm_url: str | list[str] | None = None) -> None:
        urls = [remote_rm_url] if isinstance(remote_rm_url, str) else list(remote_rm_url or [])
        self.reward_ref = urls[0] if urls else None

    async def execute(self, prompt: Any, label: Any, sampling_params: Any, max_length: int, hf_tokenizer: Any,
                      llm_engine: Any, **kwargs: Any) -> dict:
        from treadle.agents.openrlhf.loader import run_single_turn  # noqa: PLC0415

        return await run_single_turn(self.reward_ref, prompt, label, sampling_params, max_length, _engine(llm_engine))


__all__ = ["AgentExecutorBase", "AgentInstanceBase", "MultiTurnAgentExecutor", "SingleTurnAgentExecutor",
           "make_instance"]
