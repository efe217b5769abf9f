"""Process rewards from a process reward model (``--reward.prm_model_name_or_path``).

Each response is cut into steps by the PRM's step separator (the ``step_separator`` its
``treadle-train prm`` export records, tokenised by the actor's tokenizer): a step ends at the
last token of each occurrence of the separator's token ids among the response's action tokens.
The PRM (``models.reward_model.ProcessRewardModel``) reads the whole sequence once, and the
sigmoid of its logit at a step's end, the probability that the step is correct, is the process
reward there: p_t = sigmoid(z_t) at step ends, 0 elsewhere (Math-Shepherd's step-by-step PPO,
Wang et al. 2024, sec. 3.4). ``rl.returns`` adds them to the token rewards beside the KL term
and the outcome reward on the last token (r_t = p_t - kl_coef kl_t + [t last] R'), so they
reach the advantages of ``gae`` / ``reinforce`` / ``reinforce_baseline`` only (the config refuses
the others). They add to an agent's own per-token rewards where both are given.

What a step is follows the tokens, not the text: a separator merged into a neighbouring token
(a BPE token for ".\\n") is not one, as it was not in the PRM's training sequences (TRL's and
treadle's tokenise each step and separator apart). A response's last step without a separator
after it gets no process reward (its outcome comes from the reward model or function).
OpenRLHF's PPO has no process reward models.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from treadle.trainer.rl.experience import Experience, collate
from treadle.trainer.rl.transfer import share_of
from treadle.trainer.strategy.deepspeed import all_reduce


def step_ends(ids: np.ndarray, pos: np.ndarray, start: int, separator: Sequence[int]) -> np.ndarray:
    """Indices j into the action positions ``pos`` (``[L]`` increasing positions in ``ids``) whose
    token closes an occurrence of ``separator`` lying wholly at or after ``start`` (the response's
    first position): ``ids[pos[j] - k + 1 : pos[j] + 1] == separator`` with k = len(separator)."""
    sep = np.asarray(separator, dtype=ids.dtype)
    k = sep.shape[0]
    ok = [j for j, p in enumerate(pos.tolist()) if p - k + 1 >= start and np.array_equal(ids[p - k + 1:p + 1], sep)]
    return np.asarray(ok, dtype=np.int64)


@torch.no_grad()
def add_prm_rewards(prm: Any, exps: Sequence[Experience], separator: Sequence[int], *, micro_batch: int,
                    packing: bool, pad_id: int, device: torch.device, ring: Any, rank: int, world: int,
                    group: Any = None) -> int:
    """Add p_t = sigmoid(PRM logit) at every step end (``step_ends``) to each experience's
    ``process_rewards`` action array (created, zero elsewhere, for an experience with a step end);
    returns the number of steps scored. Each data-parallel rank scores its share of whole
    micro-batches (``micro_batch`` experiences; as the reward model), and a sum over ranks gives
    every rank every score (collective: every rank calls it with the same ``exps``)."""
    from treadle.trainer.models.value_model import token_values  # noqa: PLC0415

    ends = [step_ends(e.ids, e.pos, len(e.traj.prompt_token_ids), separator) for e in exps]
    offset = np.concatenate([[0], np.cumsum([len(x) for x in ends])]).tolist()
    scores = [0.0] * offset[-1]
    micro = [list(range(lo, min(lo + micro_batch, len(exps)))) for lo in range(0, len(exps), micro_batch)]
    for idx in (micro[k] for k in share_of(len(micro), world, rank)):
        ab = collate([exps[i] for i in idx], packing=packing, pad_id=pad_id, device=device)
        probs = torch.sigmoid(ab.actions(token_values(prm, ab.batch, ring))).float().cpu().numpy()
        for row, i in enumerate(idx):
            scores[offset[i]:offset[i + 1]] = probs[row, ends[i]].tolist()
    if world > 1 and scores:
        scores = all_reduce(scores, device, group=group)
    for i, e in enumerate(exps):
        if len(ends[i]):
            p = e.arrays.get("process_rewards", np.zeros(e.num_actions, dtype=np.float32)).copy()
            p[ends[i]] += np.asarray(scores[offset[i]:offset[i + 1]], dtype=np.float32)
            e.arrays["process_rewards"] = p
    return offset[-1]
