"""Executors: turn prompts into Trajectories, token in and token out, many episodes at once.

- ``SingleTurnExecutor``: one generation, then a reward from a ``RewardSource`` (function file,
  reward daemon, or OpenRLHF-style URL; ``treadle.agents.rewards``).
- ``MultiTurnExecutor``: generate -> ``env.step`` -> append the observation's tokens (loss mask
  0) -> repeat, until the environment says done, ``max_turns`` turns were played, or the token
  budget ``max_length`` (prompt + response) is spent. Reward = sum of step rewards; score and
  extra_logs = the last step's (OpenRLHF's MultiTurnAgentExecutor semantics); a step's per-token
  rewards (``StepResult.token_rewards``, treadle's) go on its turn's tokens of
  ``Trajectory.token_rewards``. Each turn may sample all that is left of ``max_length``
  (``turn_max_tokens``: OpenRLHF's budget), unless ``max_turn_tokens`` caps it;
  ``sampling.max_tokens`` then only sets the room the prompt leaves.

Both run each episode as its own asyncio task under ``episode_timeout_s``; ``run_many`` keeps up
to ``max_in_flight`` of them in flight (thousands are fine: an episode is a coroutine, and one
rollout client multiplexes every request on one socket). An episode that fails (the
environment raises, the reward fails, a timeout, the daemon gives up) does not raise: it comes
back as a Trajectory with ``finish_reason="error"``, ``info["error"]`` and
``info["failed_stage"]`` ("reset", "generate", "step", "tokenize", "reward"), holding the tokens
played so far, and is counted in ``stats`` and logged. Filter them out before training.

``truncated`` is True when the episode ended on the budget or on ``max_turns`` rather than by
itself (``info["end"]`` says which: "done", "budget", "max_turns", "stop"/"length" for a single
turn). An over-long prompt keeps its last ``max_length - max_tokens`` tokens (OpenRLHF's rule,
``info["prompt_truncated"]`` = the original length). Not here: the gateway (``gateway``).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from treadle.agents.api import Action, Environment, Episode, StepResult, close_env
from treadle.agents.builder import EpisodeBuilder
from treadle.agents.chat import ChatFormat
from treadle.agents.rewards import RewardSource
from treadle.agents.sampler import Sampler, Turn, with_max_tokens
from treadle.common.config import ConfigError, configclass
from treadle.common.log import get_logger
from treadle.common.records import SamplingParams, Trajectory

log = get_logger(__name__)


@configclass
class ExecutorConfig:
    """Limits of every episode an executor runs."""

    max_length: int = 2048
    """Token budget of an episode: prompt + every turn + every observation (OpenRLHF's
    ``--data.max_len``, default 2048 there too). Keep it within the engines' max_model_len:
    a multi-turn turn may ask for all of it."""
    max_turns: int = 0
    """Policy turns per episode; 0: no limit (until done or the budget)."""
    max_turn_tokens: int | None = None
    """Most tokens one turn of a multi-turn episode samples; None: all that is left of
    ``max_length`` (OpenRLHF's MultiTurnAgentExecutor). Single-turn episodes sample
    ``sampling.max_tokens``."""
    episode_timeout_s: float = 600.0
    """Wall-clock limit of one episode; 0: none."""
    max_in_flight: int = 4096
    """Episodes ``run_many`` keeps running at once."""

    def __post_init__(self) -> None:
        if self.max_length < 2:
            raise ConfigError(f"--max_length must be >= 2, got {self.max_length}")
        if self.max_turns < 0 or self.episode_timeout_s < 0:
            raise ConfigError("--max_turns and --episode_timeout_s must be >= 0")
        if self.max_in_flight < 1:
            raise ConfigError(f"--max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.max_turn_tokens is not None and self.max_turn_tokens < 1:
            raise ConfigError(f"--max_turn_tokens must be >= 1 (or None), got {self.max_turn_tokens}")


def turn_max_tokens(max_length: int, length: int, cap: int | None) -> int:
    """Tokens the next turn of a multi-turn episode may sample: what is left of the episode's
    budget, ``max_length - length`` (OpenRLHF's ``sampling_params.max_tokens = max_length -
    len(current_obs_tokens)`` before every turn), at most ``cap`` when one is set. <= 0: none."""
    room = max_length - length
    return room if cap is None else min(cap, room)


def prompt_keep(max_length: int, max_tokens: int) -> int:
    """Tokens an over-long prompt keeps (its last ones): ``max_length - max_tokens``, the room
    OpenRLHF's executors leave for the first generation, at least 1."""
    return max(1, max_length - max_tokens)


@dataclass(slots=True)
class ExecutorStats:
    """Counters since the executor was built."""

    started: int = 0
    finished: int = 0
    failed: int = 0
    timed_out: int = 0
    turns: int = 0
    failures_by_stage: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class EpisodeState:
    """One episode in progress; outlives a timeout so the partial episode can be reported."""

    episode: Episode
    uid: str
    stage: str = "reset"
    builder: EpisodeBuilder | None = None
    reward: float = 0.0
    score: float | None = None
    extra_logs: dict[str, float] = field(default_factory=dict)
    finish: str = "stop"
    notes: dict[str, Any] = field(default_factory=dict)  # goes into the Trajectory's info


def floats_of(logs: Any) -> dict[str, float]:
    out = {}
    for k, v in dict(logs or {}).items():
        item = getattr(v, "item", None)
        out[str(k)] = float(item() if callable(item) else v)
    return out


class ExecutorBase:
    """Episode bookkeeping shared by the executors: timeouts, failures, concurrency, stats."""

    def __init__(self, *, sampler: Sampler, chat: ChatFormat, sampling: SamplingParams,
                 config: ExecutorConfig = ExecutorConfig()) -> None:
        if sampling.n != 1:
            raise ValueError(f"executors sample one continuation per episode (sampling.n={sampling.n}); "
                             "give each sample of a group its own Episode with a shared group_id")
        self.sampler, self.chat, self.sampling, self.config = sampler, chat, sampling, config
        self.stats = ExecutorStats()

    async def _play(self, st: EpisodeState) -> Trajectory:
        raise NotImplementedError

    def _prompt_ids(self, st: EpisodeState, prompt: Any) -> EpisodeBuilder:
        ids = self.chat.prompt_ids(prompt, tools=st.episode.tools)
        keep = prompt_keep(self.config.max_length, self.sampling.max_tokens)
        if ids.shape[0] > keep:
            log.warning("episode %s: prompt of %d tokens cut to its last %d", st.uid, ids.shape[0], keep)
            st.notes["prompt_truncated"] = int(ids.shape[0])
            ids = ids[-keep:]
        return EpisodeBuilder(ids)

    async def _turn(self, st: EpisodeState, sampling: SamplingParams, max_tokens: int, key: str) -> Turn:
        assert st.builder is not None
        st.stage = "generate"
        turn = await self.sampler.sample(st.builder.tokens(), with_max_tokens(sampling, max_tokens), key=key)
        st.builder.add_turn(turn.token_ids, turn.logprobs, turn.versions)
        st.finish = turn.finish_reason
        self.stats.turns += 1
        return turn

    def _info(self, st: EpisodeState, **more: Any) -> dict[str, Any]:
        info = dict(st.episode.info)
        if st.episode.label is not None:
            info["label"] = st.episode.label
        return {**info, **st.notes, **more}

    def _failed(self, st: EpisodeState, stage: str, error: str) -> Trajectory:
        self.stats.failed += 1
        self.stats.failures_by_stage[stage] = self.stats.failures_by_stage.get(stage, 0) + 1
        log.warning("episode %s failed at %s: %s", st.uid, stage, error)
        b = st.builder or EpisodeBuilder(np.zeros(0, np.int32))
        return b.build(reward=None, finish_reason="error", uid=st.uid, group_id=st.episode.group_id,
                       extra_logs=st.extra_logs, info=self._info(st, error=error, failed_stage=stage))

    async def run(self, episode: Episode) -> Trajectory:
        """One episode; never raises for the episode's own failures (see the module docstring)."""
        st = EpisodeState(episode=episode, uid=episode.uid or uuid.uuid4().hex)
        self.stats.started += 1
        timeout = self.config.episode_timeout_s or None
        try:
            traj = await asyncio.wait_for(self._play(st), timeout)
        except asyncio.TimeoutError:
            self.stats.timed_out += 1
            return self._failed(st, st.stage, f"timed out after {timeout:g} s (episode_timeout_s) in {st.stage}")
        except Exception as e:  # the episode's failure is data, not a crash of the batch
            return self._failed(st, st.stage, f"{type(e).__name__}: {e}")
        self.stats.finished += 1
        return traj

    async def as_completed(self, episodes: Iterable[Episode]) -> AsyncIterator[Trajectory]:
        """Trajectories as episodes finish, at most ``max_in_flight`` running at once."""
        it = iter(episodes)
        running: set[asyncio.Task[Trajectory]] = set()
        try:
            while True:
                for ep in it:
                    running.add(asyncio.ensure_future(self.run(ep)))
                    if len(running) >= self.config.max_in_flight:
                        break
                if not running:
                    return
                done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    yield task.result()
        finally:
            for task in running:
                task.cancel()

    async def run_many(self, episodes: Iterable[Episode]) -> list[Trajectory]:
        """Every episode's Trajectory, in input order."""
        eps = list(episodes)
        sem = asyncio.Semaphore(self.config.max_in_flight)

        async def one(ep: Episode) -> Trajectory:
            async with sem:
                return await self.run(ep)

        return list(await asyncio.gather(*(one(ep) for ep in eps)))


class SingleTurnExecutor(ExecutorBase):
    """One generation per episode, scored by ``reward`` (None: reward left unset)."""

    def __init__(self, *, reward: RewardSource | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.reward = reward

    async def _play(self, st: EpisodeState) -> Trajectory:
        ep = st.episode
        st.stage = "tokenize"
        st.builder = self._prompt_ids(st, ep.prompt)
        budget = self.config.max_length - st.builder.length
        turn = await self._turn(st, self.sampling, min(self.sampling.max_tokens, budget), st.uid)
        reward = score = None
        if self.reward is not None:
            st.stage = "reward"
            prompt_text = ep.prompt if isinstance(ep.prompt, str) else self.chat.render(ep.prompt, tools=ep.tools)
            query = self.chat.decode(st.builder.tokens(), skip_special_tokens=False)
            s = await self.reward.score(query, prompt_text, ep.label)
            reward, score, st.extra_logs = s.reward, s.score, dict(s.extra_logs)
        return st.builder.build(reward=reward, score=score, truncated=turn.finish_reason == "length",
                                finish_reason=turn.finish_reason, uid=st.uid, group_id=ep.group_id,
                                extra_logs=st.extra_logs, info=self._info(st, end=turn.finish_reason))


class MultiTurnExecutor(ExecutorBase):
    """Episodes against a fresh environment from ``env_factory()`` each."""

    def __init__(self, *, env_factory: Callable[[], Environment], **kw: Any) -> None:
        super().__init__(**kw)
        self.env_factory = env_factory

    def _record(self, st: EpisodeState, res: StepResult) -> None:
        if not isinstance(res, StepResult):
            raise TypeError(f"env.step must return a StepResult, got {type(res).__name__}")
        st.reward += float(res.reward)
        st.score = None if res.score is None else float(res.score)
        st.extra_logs = floats_of(res.extra_logs)
        if res.token_rewards is not None:  # process rewards of the turn just played
            assert st.builder is not None
            st.builder.reward_last_turn(res.token_rewards)

    def _observe(self, st: EpisodeState, res: StepResult, turn: Turn) -> bool:
        """Append the observation; False when it did not fit in the budget (cut to fit)."""
        assert st.builder is not None
        st.stage = "tokenize"
        last = int(turn.token_ids[-1]) if turn.token_ids.shape[0] else None
        ids = self.chat.observation_ids(res.observation, last_token=last, stopped=turn.stopped,
                                        tools=st.episode.tools)
        room = self.config.max_length - st.builder.length
        st.builder.add_observation(ids[:room])
        return ids.shape[0] <= room

    async def _loop(self, st: EpisodeState, env: Environment) -> str:
        """Play turns until the episode ends; returns why ("done", "budget", "max_turns")."""
        assert st.builder is not None
        sampling, n, cfg = self.sampling, 0, self.config
        while True:
            if cfg.max_turns and n >= cfg.max_turns:
                return "max_turns"
            max_tokens = turn_max_tokens(cfg.max_length, st.builder.length, cfg.max_turn_tokens)
            if max_tokens <= 0:
                return "budget"
            turn = await self._turn(st, sampling, max_tokens, f"{st.uid}:{n}")
            action = Action(text=self.chat.decode(turn.token_ids), token_ids=turn.token_ids,
                            finish_reason=turn.finish_reason, turn=n, stopped=turn.stopped)
            st.stage = "step"
            res = await env.step(action)
            self._record(st, res)
            n += 1
            fits = self._observe(st, res, turn)
            if res.done:
                return "done"
            if not fits:
                return "budget"
            sampling = res.sampling or sampling

    async def _play(self, st: EpisodeState) -> Trajectory:
        ep = st.episode
        env = self.env_factory()
        try:
            obs = await env.reset(ep)
            st.stage = "tokenize"
            st.builder = self._prompt_ids(st, obs)
            end = await self._loop(st, env)
        finally:
            try:
                await close_env(env)
            except Exception as e:  # a failing close must not turn a good episode into a failed one
                log.warning("episode %s: env.close raised %s: %s", st.uid, type(e).__name__, e)
        score = st.reward if st.score is None else st.score
        finish = st.finish if st.finish in ("stop", "length", "abort") else "stop"
        return st.builder.build(reward=st.reward, score=score, truncated=end != "done", finish_reason=finish,
                                uid=st.uid, group_id=ep.group_id, extra_logs=st.extra_logs,
                                info=self._info(st, end=end))
