"""Assemble one episode's tokens into a ``Trajectory``: sampled spans and masked observations.

An episode is ``prompt | turn_0 | obs_0 | turn_1 | obs_1 | ...``. The Trajectory's response is
everything after the prompt; per response token ``t``:

    loss_mask[t]        = 1 if t lies in a turn (the policy sampled it) else 0
    rollout_logprobs[t] = the engine's logprob of t under the sampling policy if sampled, else 0
    token_rewards[t]    = the per-token reward an environment gave t (``reward_last_turn``), else 0;
                          None (no array) when no turn got any

``info["spans"]`` lists each turn's ``[start, end)`` in response coordinates (one trainable span
per turn; two turns with nothing between them stay two spans, unlike runs of the mask).
Pure numpy: no tokenizer, no I/O. Not here: what the tokens are (``chat``, ``sampler``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from treadle.common.records import FinishReason, Trajectory


def spans_of(mask: np.ndarray) -> list[tuple[int, int]]:
    """``[start, end)`` of every run of ones in a 0/1 vector."""
    m = np.concatenate([[0], np.asarray(mask, dtype=np.int8), [0]])
    edges = np.flatnonzero(np.diff(m))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


class EpisodeBuilder:
    """Token list of one episode, grown turn by turn (appends only)."""

    def __init__(self, prompt_ids: np.ndarray | Sequence[int]) -> None:
        self.prompt = np.asarray(prompt_ids, dtype=np.int32).reshape(-1)
        self._ids: list[np.ndarray] = []
        self._lps: list[np.ndarray] = []
        self._mask: list[np.ndarray] = []
        self.spans: list[tuple[int, int]] = []
        self.versions: list[int] = []
        self.response_len = 0
        self._turn_rewards: dict[int, np.ndarray] = {}  # span start -> that turn's per-token rewards

    @property
    def length(self) -> int:
        """Prompt + response tokens so far."""
        return int(self.prompt.shape[0]) + self.response_len

    def tokens(self) -> np.ndarray:
        """int32 [length]: prompt and response so far (the next turn's prompt)."""
        return np.concatenate([self.prompt, *self._ids]) if self._ids else self.prompt

    def _append(self, ids: np.ndarray, lps: np.ndarray, mask_value: int) -> None:
        self._ids.append(ids)
        self._lps.append(lps)
        self._mask.append(np.full(ids.shape[0], mask_value, dtype=np.uint8))
        self.response_len += int(ids.shape[0])

    def add_turn(self, ids: np.ndarray | Sequence[int], logprobs: np.ndarray | None,
                 versions: Sequence[int]) -> tuple[int, int]:
        """Append sampled tokens (trainable); returns their ``[start, end)`` in the response."""
        ids = np.asarray(ids, dtype=np.int32).reshape(-1)
        lps = np.zeros(ids.shape[0], np.float32) if logprobs is None else np.asarray(logprobs, np.float32).reshape(-1)
        if lps.shape[0] != ids.shape[0]:
            raise ValueError(f"a turn has {ids.shape[0]} tokens but {lps.shape[0]} logprobs")
        start = self.response_len
        self._append(ids, lps, 1)
        self.spans.append((start, self.response_len))
        self.versions.extend(int(v) for v in versions)
        return start, self.response_len

    def reward_last_turn(self, rewards: np.ndarray | Sequence[float]) -> None:
        """Per-token rewards of the last turn, one per its tokens (``StepResult.token_rewards``)."""
        if not self.spans:
            raise ValueError("token_rewards before any turn")
        a, b = self.spans[-1]
        values = np.asarray(rewards, dtype=np.float32).reshape(-1)
        if values.shape[0] != b - a:
            raise ValueError(f"token_rewards has {values.shape[0]} values for a turn of {b - a} tokens "
                             "(one per action token)")
        self._turn_rewards[a] = values

    def _token_rewards(self) -> np.ndarray | None:
        if not self._turn_rewards:
            return None
        out = np.zeros(self.response_len, np.float32)
        for a, values in self._turn_rewards.items():
            out[a:a + values.shape[0]] = values
        return out

    def add_observation(self, ids: np.ndarray | Sequence[int]) -> None:
        """Append environment tokens (masked out of the loss, logprob 0)."""
        ids = np.asarray(ids, dtype=np.int32).reshape(-1)
        if ids.shape[0]:
            self._append(ids, np.zeros(ids.shape[0], np.float32), 0)

    def build(self, *, reward: float | None = None, score: float | None = None, truncated: bool = False,
              finish_reason: FinishReason = "stop", uid: str = "", group_id: str = "",
              extra_logs: dict[str, float] | None = None, info: dict[str, Any] | None = None) -> Trajectory:
        """The Trajectory (arrays concatenated once); ``info`` gains "spans" and "turns"."""
        def cat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
            return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)

        versions = self.versions or [0]
        return Trajectory(
            prompt_token_ids=self.prompt, response_token_ids=cat(self._ids, np.int32),
            rollout_logprobs=cat(self._lps, np.float32), loss_mask=cat(self._mask, np.uint8),
            reward=reward, token_rewards=self._token_rewards(), score=score, min_policy_version=min(versions), max_policy_version=max(versions),
            truncated=truncated, finish_reason=finish_reason, uid=uid, group_id=group_id,
            extra_logs=dict(extra_logs or {}),
            info={**(info or {}), "spans": [[a, b] for a, b in self.spans], "turns": len(self.spans)})
