"""Run OpenRLHF agent files (``--train.agent_func_path``) on treadle's executors.

``AgentFileExecutor(path, sampler=..., chat=..., sampling=..., config=...)`` is a treadle
executor (``run``, ``run_many``, ``as_completed``, failed episodes on record) for a file
written for OpenRLHF:

- the file is loaded as OpenRLHF loads it (``importlib`` from the path); when OpenRLHF itself is
  not installed, ``openrlhf.utils.agent`` (and ``openrlhf.utils.logging_utils.init_logger``) are
  registered as aliases of treadle's compatible module first, so its imports work unchanged;
- its ``AgentExecutor()`` is built with no arguments (OpenRLHF's current contract);
- an executor that keeps ``MultiTurnAgentExecutor.execute`` runs natively: its ``AgentInstance``
  becomes a treadle environment (``AgentInstanceEnv``) under ``MultiTurnExecutor``;
- an executor that overrides ``execute`` is called with OpenRLHF's arguments (a vLLM-shaped
  ``SamplingParams``, the HF tokenizer, and ``EngineAdapter`` as ``llm_engine``), and the dict it
  returns becomes a Trajectory (``from_openrlhf``): prompt = tokens before the first action
  range, loss mask 1 inside the ranges, policy versions from the engine calls it made. Action
  tokens that differ from what the engine sampled (re-tokenized text) are counted in
  ``info["action_mismatch"]``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import logging
import sys
import types
import uuid
from pathlib import Path
from typing import Any

import numpy as np

import treadle.agents.openrlhf as compat
from treadle.agents.api import Action, Episode, StepResult
from treadle.agents.executor import (
    EpisodeState,
    ExecutorConfig,
    MultiTurnExecutor,
    SingleTurnExecutor,
    floats_of,
)
from treadle.agents.openrlhf.vllm_types import (
    CompletionOutput,
    Logprob,
    RequestOutput,
    VllmSamplingParams,
    to_treadle,
)
from treadle.agents.sampler import Sampler, Turn, with_max_tokens
from treadle.common.log import get_logger
from treadle.common.records import SamplingParams, Trajectory

log = get_logger(__name__)


def _scalar(x: Any) -> float:
    item = getattr(x, "item", None)
    return float(item() if callable(item) else x)


def _floats(x: Any) -> list[float]:
    """A tensor, array or list of numbers as Python floats (flattened)."""
    x = x.detach().cpu() if hasattr(x, "detach") else x
    return [float(v) for v in np.asarray(x, dtype=np.float64).reshape(-1)]


class EngineAdapter:
    """OpenRLHF's ``llm_engine`` over a treadle ``Sampler``; records every turn it sampled.
    ``max_turn_tokens``: the executor's (``ExecutorConfig``), for episodes a file's own
    ``execute`` runs through ``MultiTurnAgentExecutor.execute``."""

    def __init__(self, sampler: Sampler, chat: Any, key: str, max_turn_tokens: int | None = None) -> None:
        self.sampler, self.chat, self.key, self.max_turn_tokens = sampler, chat, key, max_turn_tokens
        self.turns: list[Turn] = []

    async def sample(self, prompt_ids: np.ndarray, sampling: SamplingParams, *, key: str) -> Turn:
        """The ``Sampler`` protocol (native runs through this adapter record their turns too)."""
        turn = await self.sampler.sample(prompt_ids, sampling, key=key)
        self.turns.append(turn)
        return turn

    async def generate(self, prompt_token_ids: Any, sampling_params: Any, multi_modal_data: Any = None) -> RequestOutput:
        if multi_modal_data:
            raise NotImplementedError("treadle's rollout daemon serves text models only")
        sp = to_treadle(sampling_params)
        prompt = [int(t) for t in prompt_token_ids]
        turn = await self.sample(np.asarray(prompt, np.int32), with_max_tokens(sp, sp.max_tokens),
                                 key=f"{self.key}:{len(self.turns)}")
        ids = turn.token_ids.tolist()
        lps = [{t: Logprob(float(lp))} for t, lp in zip(ids, turn.logprobs.tolist(), strict=True)]
        out = CompletionOutput(index=0, text=self.chat.decode(ids), token_ids=ids,
                               cumulative_logprob=float(turn.logprobs.sum()),
                               logprobs=lps if sp.logprobs else None, finish_reason=turn.finish_reason)
        return RequestOutput(request_id=uuid.uuid4().hex, prompt_token_ids=prompt, outputs=[out])


class AgentInstanceEnv:
    """A treadle environment around one OpenRLHF ``AgentInstance`` (a fresh one per episode)."""

    def __init__(self, instance_cls: type, sampling: SamplingParams) -> None:
        self.instance_cls = instance_cls
        self.sampling = VllmSamplingParams.from_treadle(sampling)
        self.instance: Any = None
        self.observation_text = ""
        self.label: Any = None

    async def reset(self, episode: Episode) -> str:
        self.instance = await compat.make_instance(self.instance_cls)
        self.label = episode.label
        res = await self.instance.reset({"observation": episode.prompt, "label": episode.label})
        obs = res["observation"] if isinstance(res, dict) else res
        if not isinstance(obs, str):
            raise TypeError(f"AgentInstance.reset must return {{'observation': str}}, got {type(obs).__name__}")
        self.observation_text = obs
        return obs

    async def step(self, action: Action) -> StepResult:
        # action_token_ids: treadle's extension, for per-token rewards ("token_rewards", one per action token)
        states = {"observation_text": self.observation_text, "action_text": action.text, "label": self.label,
                  "sampling_params": self.sampling, "action_token_ids": action.token_ids.tolist()}
        r = await self.instance.step(states)
        feedback = r.get("environment_feedback", "") or ""
        self.observation_text += action.text + feedback
        sampling = None
        if r.get("sampling_params") is not None:
            self.sampling = r["sampling_params"]
            sampling = to_treadle(self.sampling)
        per_token = r.get("token_rewards")  # treadle's extension (StepResult.token_rewards); OpenRLHF has none
        return StepResult(observation=feedback, reward=_scalar(r.get("rewards", 0.0)),
                          score=None if r.get("scores") is None else _scalar(r["scores"]), done=bool(r["done"]),
                          extra_logs=floats_of(r.get("extra_logs")), sampling=sampling,
                          token_rewards=None if per_token is None else _floats(per_token))


def to_openrlhf(traj: Trajectory, prompt: Any, label: Any) -> dict[str, Any]:
    """OpenRLHF's executor output for a Trajectory (observation_tokens include the prompt)."""
    p = int(traj.prompt_token_ids.shape[0])
    return {"prompt": prompt, "label": label,
            "observation_tokens": np.concatenate([traj.prompt_token_ids, traj.response_token_ids]).tolist(),
            "action_ranges": [(p + a, p + b) for a, b in traj.info.get("spans", [])],
            "rollout_log_probs": [0.0] * p + traj.rollout_logprobs.tolist(),
            "reward": traj.reward, "scores": traj.score, "extra_logs": dict(traj.extra_logs),
            "truncated": traj.truncated,
            "token_rewards": None if traj.token_rewards is None else [0.0] * p + traj.token_rewards.tolist()}


def _logprobs(out: dict[str, Any], ranges: list[tuple[int, int]], turns: list[Turn], p: int, n: int) -> np.ndarray:
    given = out.get("rollout_log_probs")
    if given is not None and len(given) >= p + n:
        return np.asarray(given[p:p + n], np.float32)
    lps = np.zeros(n, np.float32)
    for (a, b), t in zip(ranges, turns, strict=False):  # the engine's logprobs, where the lengths agree
        if b - a == t.logprobs.shape[0]:
            lps[a - p:b - p] = t.logprobs
    return lps


def from_openrlhf(out: dict[str, Any], turns: list[Turn], *, uid: str, group_id: str,
                  info: dict[str, Any]) -> Trajectory:
    """A Trajectory from OpenRLHF's executor output and the turns the engine served."""
    obs = np.asarray(out["observation_tokens"], np.int32)
    ranges = [(int(a), int(b)) for a, b in out.get("action_ranges") or []]
    p = ranges[0][0] if ranges else int(obs.shape[0])
    resp = obs[p:]
    mask = np.zeros(resp.shape[0], np.uint8)
    for a, b in ranges:
        mask[a - p:b - p] = 1
    lps = _logprobs(out, ranges, turns, p, int(resp.shape[0])) * mask
    mismatch = sum(1 for (a, b), t in zip(ranges, turns, strict=False) if not np.array_equal(obs[a:b], t.token_ids))
    versions = [v for t in turns for v in t.versions] or [0]
    reward = None if out.get("reward") is None else _scalar(out["reward"])
    score = None if out.get("scores") is None else _scalar(out["scores"])
    finish = turns[-1].finish_reason if turns and turns[-1].finish_reason in ("stop", "length", "abort") else "stop"
    given = out.get("token_rewards")  # treadle's extension: per observation token, like rollout_log_probs
    token_rewards = None if given is None else np.asarray(_floats(given)[p:], np.float32)
    return Trajectory(prompt_token_ids=obs[:p], response_token_ids=resp, rollout_logprobs=lps.astype(np.float32),
                      loss_mask=mask, reward=reward, token_rewards=token_rewards, score=score, min_policy_version=min(versions),
                      max_policy_version=max(versions), truncated=bool(out.get("truncated", False)),
                      finish_reason=finish, uid=uid, group_id=group_id, extra_logs=floats_of(out.get("extra_logs")),
                      info={**info, "spans": [[a - p, b - p] for a, b in ranges], "turns": len(ranges),
                            "action_mismatch": mismatch})


async def run_instance_episode(instance_cls: type, prompt: Any, label: Any, sampling_params: Any, max_length: int,
                               engine: EngineAdapter) -> dict[str, Any]:
    """``MultiTurnAgentExecutor.execute`` on treadle's executor; raises if the episode failed."""
    sp = to_treadle(sampling_params)
    ex = MultiTurnExecutor(env_factory=lambda: AgentInstanceEnv(instance_cls, sp), sampler=engine, chat=engine.chat,
                           sampling=sp, config=ExecutorConfig(max_length=max_length, episode_timeout_s=0,
                                                              max_turn_tokens=engine.max_turn_tokens))
    traj = await ex.run(Episode(prompt=prompt, label=label, uid=engine.key))
    if traj.finish_reason == "error":
        raise RuntimeError(traj.info["error"])
    return to_openrlhf(traj, prompt, label)


async def run_single_turn(reward_ref: str | None, prompt: Any, label: Any, sampling_params: Any, max_length: int,
                          engine: EngineAdapter) -> dict[str, Any]:
    """``SingleTurnAgentExecutor.execute`` on treadle's executor."""
    from treadle.agents.rewards import reward_source  # noqa: PLC0415

    reward = reward_source(reward_ref) if reward_ref else None
    try:
        ex = SingleTurnExecutor(reward=reward, sampler=engine, chat=engine.chat, sampling=to_treadle(sampling_params),
                                config=ExecutorConfig(max_length=max_length, episode_timeout_s=0))
        traj = await ex.run(Episode(prompt=prompt, label=label, uid=engine.key))
    finally:
        if reward is not None:
            await reward.close()
    if traj.finish_reason == "error":
        raise RuntimeError(traj.info["error"])
    return to_openrlhf(traj, prompt, label)


def install_openrlhf_alias() -> bool:
    """Register ``openrlhf.utils.agent`` -> ``treadle.agents.openrlhf`` unless OpenRLHF is installed."""
    if "openrlhf" in sys.modules or importlib.util.find_spec("openrlhf") is not None:
        return False
    root, utils = types.ModuleType("openrlhf"), types.ModuleType("openrlhf.utils")
    logging_utils = types.ModuleType("openrlhf.utils.logging_utils")
    logging_utils.init_logger = logging.getLogger  # type: ignore[attr-defined]
    root.__path__, utils.__path__ = [], []  # packages, so submodule imports resolve through sys.modules
    root.utils, utils.agent, utils.logging_utils = utils, compat, logging_utils  # type: ignore[attr-defined]
    sys.modules.update({"openrlhf": root, "openrlhf.utils": utils, "openrlhf.utils.agent": compat,
                        "openrlhf.utils.logging_utils": logging_utils})
    return True


def load_agent_module(path: str | Path) -> types.ModuleType:
    """Import an agent file by path, as OpenRLHF does (nothing added to ``sys.path``)."""
    path = Path(path)
    if path.suffix != ".py" or not path.is_file():
        raise ValueError(f"agent file {str(path)!r} must be an existing .py file")
    install_openrlhf_alias()
    name = f"treadle_agent_file_{path.stem}_{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and typing look the module up by name
    spec.loader.exec_module(module)
    return module


def _build_user_executor(path: str | Path) -> Any:
    module = load_agent_module(path)
    cls = getattr(module, "AgentExecutor", None)
    if not isinstance(cls, type):
        raise ValueError(f"{path} defines no AgentExecutor class (OpenRLHF's agent file contract)")
    try:
        return cls()
    except TypeError as e:
        raise ValueError(f"{path}: AgentExecutor() must take no arguments (OpenRLHF's current contract): {e}") from e


class AgentFileExecutor(MultiTurnExecutor):
    """A treadle executor for an OpenRLHF agent file (see the module docstring)."""

    def __init__(self, path: str | Path, **kw: Any) -> None:
        self.user = _build_user_executor(path)
        self.native = (isinstance(self.user, compat.MultiTurnAgentExecutor)
                       and type(self.user).execute is compat.MultiTurnAgentExecutor.execute)
        instance_cls = getattr(self.user, "agent_instance_cls", None)
        super().__init__(env_factory=lambda: AgentInstanceEnv(instance_cls, self.sampling), **kw)
        self.path = str(path)

    async def _play(self, st: EpisodeState) -> Trajectory:
        if not isinstance(st.episode.prompt, str):
            # OpenRLHF's dataset hands agent files the prompt as text, chat template applied
            # (--data.apply_chat_template); its AgentInstance.reset returns text
            st.episode = dataclasses.replace(st.episode, prompt=self.chat.render(st.episode.prompt,
                                                                                 tools=st.episode.tools))
        if self.native:
            return await super()._play(st)
        ep = st.episode
        engine = EngineAdapter(self.sampler, self.chat, st.uid, self.config.max_turn_tokens)
        st.stage = "execute"
        out = await self.user.execute(prompt=ep.prompt, label=ep.label,
                                      sampling_params=VllmSamplingParams.from_treadle(self.sampling),
                                      max_length=self.config.max_length, hf_tokenizer=self.chat.tokenizer,
                                      llm_engine=engine)
        self.stats.turns += len(engine.turns)
        return from_openrlhf(out, engine.turns, uid=st.uid, group_id=ep.group_id, info=self._info(st))
