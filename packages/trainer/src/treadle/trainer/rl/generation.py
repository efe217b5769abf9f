"""Rank 0's side of an RL step before training: prompts -> agent executor -> rollout daemon -> groups.

Prompts come in one deterministic stream (``PromptStream``): episode ``e`` visits the prompt set in
a permutation seeded by ``seed + e``; a prompt's position in the stream is its ``seq``, which names
its group in the trajectory log (a resumed run skips the seqs already there). Each prompt becomes
``n`` episodes sharing ``group_id`` ``g<seq>``, with uids ``<seq>.<i>`` and per-sample seeds, run by
an executor of ``treadle.agents`` (single-turn with a reward source, or an OpenRLHF agent file) on
the rollout daemon. A group is complete when its ``n`` trajectories are.

Two ways to run it:

- ``collect(count)``: generate ``count`` groups now and return them (synchronous and colocated
  modes: the weights cannot change meanwhile).
- ``start_async(batch, per_step, max_ahead)``: a producer task keeps generating rounds of ``batch``
  prompts in the background (``--rollout.vllm_generate_batch_size``; more than a step's
  ``per_step`` groups over-samples). A round starts once the groups started before it, plus its
  own, exceed those the trained steps consumed (as of the last ``publish``) by at most
  ``(max_ahead + 1) x per_step``, or at once when the trainer has taken every group started (it is
  waiting for more: filtering ate them). A step takes at least ``per_step`` groups, so a group is
  trained at most ``max_ahead`` versions after its round started (the trainer drops any that come
  later, e.g. behind a slow group). Finished groups wait in a queue; ``next_group`` takes one.

All asyncio work runs on one ``LoopThread``; the trainer calls these methods from its own thread.
Not here: rewards shaping, experience, training (``experience``, ``trainers.ppo``).
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from treadle.common.log import get_logger
from treadle.common.records import SamplingParams, Trajectory
from treadle.common.rpc import LoopThread

log = get_logger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class Prompt:
    """One dataset prompt, as episodes receive it."""

    prompt: str | list[dict[str, Any]]
    """Text (templated) or chat messages."""
    label: Any
    """Label handed to the reward / environment (msgpack-native)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Group:
    """The ``n`` trajectories of one prompt, in sample order."""

    seq: int
    """Position of the prompt in the prompt stream."""
    trajectories: list[Trajectory]

    @property
    def failed(self) -> bool:
        """Whether any sample failed (the group is then not trained: its baseline would be biased)."""
        return any(t.finish_reason == "error" for t in self.trajectories)


class PromptStream:
    """The deterministic order prompts are generated in, over ``episodes`` passes."""

    def __init__(self, prompts: Sequence[Prompt], *, episodes: int, seed: int, done: frozenset[int] = frozenset()) -> None:
        self.prompts = list(prompts)
        self.episodes = episodes
        self.seed = seed
        self.done = done
        self._it = self._iter()

    @property
    def total(self) -> int:
        """Prompts over all episodes."""
        return len(self.prompts) * self.episodes

    def _iter(self) -> Iterator[tuple[int, Prompt]]:
        n = len(self.prompts)
        for e in range(self.episodes):
            order = np.random.default_rng(self.seed + e).permutation(n)
            for pos, i in enumerate(order.tolist()):
                seq = e * n + pos
                if seq not in self.done:
                    yield seq, self.prompts[i]

    def take(self, count: int) -> list[tuple[int, Prompt]]:
        """The next ``count`` (seq, prompt) pairs (fewer at the end of the stream)."""
        out = []
        for item in self._it:
            out.append(item)
            if len(out) == count:
                break
        return out


def sample_seed(seed: int, key: str) -> int:
    """A per-turn sampling seed from the run's seed and the turn's key: reproducible, distinct (pure)."""
    return int(np.random.SeedSequence([seed, zlib.crc32(key.encode())]).generate_state(1)[0] >> 1)


class SeededSampler:
    """A ``treadle.agents`` sampler that gives every turn its own seed, derived from its key
    (``<seq>.<i>`` or ``<seq>.<i>:<turn>``), so a rerun samples the same tokens."""

    def __init__(self, inner: Any, seed: int) -> None:
        self.inner = inner
        self.seed = seed

    async def sample(self, prompt_ids: np.ndarray, sampling: SamplingParams, *, key: str) -> Any:
        seeded = msgspec.structs.replace(sampling, seed=sample_seed(self.seed, key))
        return await self.inner.sample(prompt_ids, seeded, key=key)


class Generator:
    """Runs groups of episodes through executors on a background event loop."""

    def __init__(self, *, executor: Any, eval_executor: Any, n: int, lt: LoopThread) -> None:
        self.executor = executor
        self.eval_executor = eval_executor
        self.n = n
        self.lt = lt
        self._queue: asyncio.Queue[Group | BaseException] | None = None
        self._producer: asyncio.Future[Any] | None = None
        self._version = 0
        self._taken = 0  # groups next_group handed out
        self._consumed = 0  # of those, taken by the steps trained as of the last publish
        self._changed: asyncio.Condition | None = None

    async def _group(self, seq: int, prompt: Prompt, executor: Any = None, n: int | None = None) -> Group:
        from treadle.agents.api import Episode  # noqa: PLC0415

        ex = executor or self.executor
        eps = [Episode(prompt=prompt.prompt, label=prompt.label, uid=f"{seq}.{i}", group_id=f"g{seq}", info={"seq": seq})
               for i in range(n or self.n)]
        return Group(seq=seq, trajectories=list(await asyncio.gather(*(ex.run(ep) for ep in eps))))

    # -- synchronous ---------------------------------------------------------------------------

    def collect(self, items: Sequence[tuple[int, Prompt]]) -> list[Group]:
        """Generate a group for each (seq, prompt), all in flight together; in input order."""
        async def run() -> list[Group]:
            return list(await asyncio.gather(*(self._group(seq, p) for seq, p in items)))

        return self.lt.run(run())

    def evaluate(self, prompts: Sequence[Prompt], *, n: int) -> dict[str, float]:
        """pass@1 (mean score over all samples), pass@n (mean over prompts of the best score) and mean reward."""
        async def run() -> list[Group]:
            return list(await asyncio.gather(*(self._group(-1 - k, p, self.eval_executor, n)
                                               for k, p in enumerate(prompts))))

        groups = self.lt.run(run())
        scores = np.array([[_score(t) for t in g.trajectories] for g in groups], dtype=np.float64)
        rewards = np.array([[t.reward or 0.0 for t in g.trajectories] for g in groups], dtype=np.float64)
        return {"eval/pass@1": float(scores.mean()), f"eval/pass@{n}": float(scores.max(axis=1).mean()),
                "eval/reward_mean": float(rewards.mean()),
                "eval/failed": float(sum(t.finish_reason == "error" for g in groups for t in g.trajectories))}

    # -- asynchronous --------------------------------------------------------------------------

    def start_async(self, stream: PromptStream, *, batch: int, per_step: int, max_ahead: int) -> None:
        """Start the background producer over ``stream`` in rounds of ``batch`` prompts, for steps of
        ``per_step`` groups, at most ``max_ahead`` versions ahead (see the module docstring)."""
        async def start() -> None:
            self._queue = asyncio.Queue()
            self._changed = asyncio.Condition()
            self._producer = asyncio.ensure_future(self._produce(stream, batch, (max_ahead + 1) * per_step))

        self.lt.run(start())

    async def _produce(self, stream: PromptStream, batch: int, window: int) -> None:
        assert self._queue is not None and self._changed is not None
        started = 0
        try:
            while True:
                async with self._changed:
                    await self._changed.wait_for(
                        lambda started=started: started == self._taken or started + batch - self._consumed <= window)
                items = stream.take(batch)
                if not items:
                    break
                started += len(items)
                tasks = [asyncio.ensure_future(self._group(seq, p)) for seq, p in items]
                for fut in asyncio.as_completed(tasks):
                    await self._queue.put(await fut)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # surfaces in the trainer's next_group
            await self._queue.put(e)
            return
        await self._queue.put(StopAsyncIteration())

    def publish(self, version: int) -> None:
        """Tell the producer the trainer's weights are now at ``version``: the groups taken so far
        were consumed by the steps trained up to it."""
        async def bump() -> None:
            self._version, self._consumed = version, self._taken
            if self._changed is not None:
                async with self._changed:
                    self._changed.notify_all()

        self.lt.run(bump())

    def next_group(self, timeout: float | None = None) -> Group | None:
        """The next finished group of the producer; None when the stream is exhausted."""
        assert self._queue is not None and self._changed is not None, "start_async first"

        async def take() -> Group | BaseException:
            item = await self._queue.get()
            if isinstance(item, Group):
                self._taken += 1
                async with self._changed:
                    self._changed.notify_all()  # a trainer that took every group started needs more
            return item

        item = self.lt.run(take(), timeout=timeout)
        if isinstance(item, StopAsyncIteration):
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def stop(self) -> None:
        """Cancel the producer (in-flight episodes are dropped: they were never logged)."""
        async def cancel() -> None:
            if self._producer is not None:
                self._producer.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self._producer

        if self.lt.alive:
            self.lt.run(cancel())


def _score(t: Trajectory) -> float:
    if t.finish_reason == "error":
        return 0.0
    return float(t.score if t.score is not None else (t.reward or 0.0))
