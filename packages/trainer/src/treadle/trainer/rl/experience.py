"""Experience: trajectories turned into what PPO-family losses read, and batched for the models.

An ``Experience`` is one trajectory seen from the trainer: its full token sequence (prompt +
response), the positions of its *action* tokens (response tokens the policy sampled,
``loss_mask == 1``; environment tokens are context only), and per-action arrays filled in stages:
the rollout engine's logprobs (from the trajectory), the trainer's old-policy, reference and
teacher logprobs and the critic's values (forward passes), then rewards, advantages and returns (the
pure math of ``rl.advantages``). A trajectory's per-token (process) rewards, when its agent gave
them, become the action array ``process_rewards`` (``rl.returns`` adds them to the token rewards).
Action arrays are ``[L]``; batched they are right-padded ``[B, L]`` with a mask, the layout of
every function in ``rl/``.

``collate`` builds the model batch (padded or packed, ``data.batching``) plus ``flat_index``: for
action ``j`` of sequence ``b`` the flat position (row * T + column) of its token in the model's
``[R, T]`` outputs, so ``token_values.reshape(-1)[flat_index]`` picks per-action values from any
per-token output (logprobs, entropies, values) in either layout.

Not here: the forward passes and the loop (``trainers.ppo``), the math (``rl.advantages`` & co.).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from treadle.common.records import Trajectory
from treadle.trainer.data.batching import SeqBatch, pack_batch, pad_batch
from treadle.trainer.data.samples import Sample, TokenSeq

ACTION_FIELDS = ("rollout_logp", "process_rewards", "old_logp", "ref_logp", "teacher_logp", "values", "advantages",
                 "returns", "is_weights")


@dataclass(slots=True, kw_only=True)
class Experience:
    """One trajectory, from the trainer's side (see the module docstring)."""

    traj: Trajectory
    """The trajectory as generated (tokens, rollout logprobs, reward, versions)."""
    ids: np.ndarray
    """[S] int64: prompt + response tokens."""
    pos: np.ndarray
    """[L] int64: position in ``ids`` of each action token, increasing."""
    reward: float = 0.0
    """Shaped episode reward (what the advantage estimator sees)."""
    staleness: int = 0
    """Trainer weight version at training minus the oldest version that sampled this trajectory."""
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    """Per-action float32 [L] arrays by name (``ACTION_FIELDS``)."""

    @property
    def num_actions(self) -> int:
        return int(self.pos.shape[0])

    @property
    def response_length(self) -> int:
        return int(np.asarray(self.traj.response_token_ids).shape[0])


def from_trajectory(traj: Trajectory) -> Experience:
    """The experience of ``traj``: its rollout logprobs become the ``rollout_logp`` action array,
    its ``token_rewards`` (when set) the ``process_rewards`` one (``process_rewards_of``)."""
    prompt = np.asarray(traj.prompt_token_ids, dtype=np.int64)
    response = np.asarray(traj.response_token_ids, dtype=np.int64)
    mask = np.asarray(traj.loss_mask).astype(bool)
    pos = np.flatnonzero(mask).astype(np.int64) + prompt.shape[0]
    arrays = {"rollout_logp": np.asarray(traj.rollout_logprobs, dtype=np.float32)[mask]}
    if traj.token_rewards is not None:
        arrays["process_rewards"] = process_rewards_of(traj, mask)
    return Experience(traj=traj, ids=np.concatenate([prompt, response]), pos=pos, arrays=arrays)


def process_rewards_of(traj: Trajectory, mask: np.ndarray) -> np.ndarray:
    """[L] float32: ``traj.token_rewards`` at the action tokens (``mask``, the loss mask as bool).

    Raises ``ValueError`` naming the trajectory and the position for a non-finite value, or for a
    non-zero one on an environment token (loss mask 0): those are context, not steps of the
    policy, so a reward there has no action to credit (an agent gives process rewards per action
    token, ``treadle.agents.api.StepResult.token_rewards``).
    """
    tr = np.asarray(traj.token_rewards, dtype=np.float32)
    bad = np.flatnonzero(~np.isfinite(tr))
    if bad.size:
        raise ValueError(f"trajectory {traj.uid!r}: token_rewards[{bad[0]}] = {tr[bad[0]]} is not finite")
    off = np.flatnonzero((tr != 0) & ~mask)
    if off.size:
        raise ValueError(f"trajectory {traj.uid!r}: token_rewards[{off[0]}] = {tr[off[0]]:g} lies on an environment "
                         f"token (loss_mask 0; {off.size} such); process rewards go on the policy's own tokens")
    return tr[mask].copy()


def as_sample(exp: Experience, index: int) -> Sample:
    """A one-sequence ``Sample`` whose targets are the action tokens."""
    target = np.zeros(exp.ids.shape[0], dtype=bool)
    target[exp.pos] = True
    return Sample(seqs=(TokenSeq(ids=exp.ids, target=target),), index=index)


@dataclass(frozen=True, slots=True, kw_only=True)
class ActionBatch:
    """A model batch of experiences plus their action layout."""

    batch: SeqBatch
    """Model inputs (padded or packed)."""
    flat_index: Tensor
    """[B, L] long: flat position in the [R, T] outputs of each action token (0 on padding)."""
    mask: Tensor
    """[B, L] bool: real action tokens."""
    arrays: dict[str, Tensor]
    """Per-action [B, L] float32 tensors (0 on padding), for the names asked for."""

    def actions(self, token_values: Tensor) -> Tensor:
        """[B, L] per-action values of a per-token ``[R, T]`` output (differentiable; 0 on padding)."""
        picked = token_values.reshape(-1)[self.flat_index]
        return picked * self.mask


def _pad(rows: Sequence[np.ndarray], width: int, dtype: np.dtype) -> np.ndarray:
    out = np.zeros((len(rows), width), dtype=dtype)
    for k, r in enumerate(rows):
        out[k, : r.shape[0]] = r
    return out


def collate(exps: Sequence[Experience], *, packing: bool, pad_id: int, names: Sequence[str] = (),
            device: torch.device | str = "cpu") -> ActionBatch:
    """The batch of ``exps`` on ``device`` with the action arrays ``names``."""
    samples = [as_sample(e, k) for k, e in enumerate(exps)]
    batch = pack_batch(samples) if packing else pad_batch(samples, pad_id)
    width = max(1, max(e.num_actions for e in exps))
    if packing:
        starts = np.concatenate([[0], np.cumsum([e.ids.shape[0] for e in exps])[:-1]])
        flat = [e.pos + s for e, s in zip(exps, starts, strict=True)]
    else:
        t = batch.input_ids.shape[1]
        flat = [e.pos + k * t for k, e in enumerate(exps)]
    mask = _pad([np.ones(e.num_actions, dtype=bool) for e in exps], width, np.dtype(bool))
    arrays = {n: torch.from_numpy(_pad([e.arrays[n] for e in exps], width, np.dtype(np.float32))).to(device)
              for n in names}
    return ActionBatch(batch=batch.to(device), flat_index=torch.from_numpy(_pad(flat, width, np.dtype(np.int64))).to(device),
                       mask=torch.from_numpy(mask).to(device), arrays=arrays)


def stack(exps: Sequence[Experience], name: str) -> tuple[Tensor, Tensor]:
    """([B, L] float32 of action array ``name``, [B, L] bool mask) of the whole batch (CPU)."""
    width = max(1, max(e.num_actions for e in exps))
    values = _pad([e.arrays[name] for e in exps], width, np.dtype(np.float32))
    mask = _pad([np.ones(e.num_actions, dtype=bool) for e in exps], width, np.dtype(bool))
    return torch.from_numpy(values), torch.from_numpy(mask)


def env_gaps(exps: Sequence[Experience]) -> Tensor:
    """[B, L] float64: environment tokens between each action token and the next action token
    (pos[j + 1] - pos[j] - 1; 0 after a row's last action and on padding), for
    ``rl.advantages``' OpenRLHF layout of multi-turn trajectories."""
    rows = [np.append(np.diff(e.pos) - 1, 0)[: e.num_actions] for e in exps]
    width = max(1, max(e.num_actions for e in exps))
    return torch.from_numpy(_pad(rows, width, np.dtype(np.float64)))


def unstack(exps: Sequence[Experience], name: str, values: Tensor) -> None:
    """Store row ``b`` of ``values`` [B, L] as action array ``name`` of ``exps[b]``."""
    v = values.detach().float().cpu().numpy()
    for k, e in enumerate(exps):
        e.arrays[name] = v[k, : e.num_actions].copy()
