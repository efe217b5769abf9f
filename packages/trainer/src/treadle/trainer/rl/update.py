"""The model work of one RL step: scoring experiences (no gradients) and one optimizer step of the
actor or the critic.

Every function here runs on every trainer rank with that rank's share of the experiences; under
ZeRO-3 each forward gathers parameters collectively, so all ranks run the same number of
micro-batches (``micro_groups`` equalises them, as the supervised loop does).

Normalisation (STYLE.md habit 3): before an optimizer step the data-parallel ranks all-reduce the
step's units of the loss aggregation (tokens, or sequences); each micro-batch contributes
``total / units`` and is multiplied by the world size before ``backward`` (DeepSpeed averages
gradients over all ranks), so the gradient is the same however the step is split into
micro-batches and ranks. Under ring attention the ranks of a ring hold the same experiences and
compute the same (gathered) loss; their partial gradients add up in DeepSpeed's reduction.

Not here: the math (``rl.policy_loss``, ``rl.kl``), the loop (``trainers.ppo``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from treadle.trainer.data.batching import by_count, by_tokens, split_to
from treadle.trainer.models.actor import Actor
from treadle.trainer.models.value_model import token_values
from treadle.trainer.rl._masked import zero_pad
from treadle.trainer.rl.experience import ActionBatch, Experience, as_sample, collate
from treadle.trainer.rl.kl import KL_ESTIMATORS, unbiased_kl_gradient
from treadle.trainer.rl.policy_loss import AGGREGATIONS, POLICY_LOSSES, value_loss
from treadle.trainer.strategy.deepspeed import all_reduce


@dataclass(frozen=True, slots=True, kw_only=True)
class Batching:
    """How a rank's experiences are cut into micro-batches."""

    micro_batch: int
    """Experiences per micro-batch (by count)."""
    token_budget: int | None
    """Tokens per micro-batch (dynamic batching); None: by count."""
    packing: bool
    """Pack sequences into one row instead of padding."""
    pad_id: int
    """Padding token."""
    device: torch.device
    """Where the models compute."""
    ring: Any = None
    """This rank's ring (``treadle.trainer.ring``) under ring attention; None: whole sequences."""
    dp_group: Any = None
    """The data-parallel group that sums losses and metrics (None: every rank)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyLoss:
    """The actor's loss settings (from ``--actor.*`` and ``--algo.kl.*``)."""

    kind: str
    """"ppo", "gspo" or "gspo_token" (``POLICY_LOSSES``)."""
    clip_low: float
    clip_high: float
    dual_clip: float | None
    entropy_coef: float | None
    """Entropy bonus weight; 0: only logged; None: entropy not computed."""
    aggregation: str
    """``AGGREGATIONS`` key."""
    kl_coef: float
    """Weight of the KL loss term (0: KL is in the reward or off)."""
    kl_estimator: str
    """``KL_ESTIMATORS`` key."""
    temperature: float
    """Sampling temperature (logprobs are of the sampling distribution)."""
    kl_unbiased_gradient: bool = False
    """The KL loss term back-propagates the reverse KL's importance-weighted gradient (``kl.unbiased_kl_gradient``)."""
    ratio_to_rollout: bool = False
    """The policy ratio is taken against the rollout engine's logprobs instead of the old policy's
    (GSPO with the IS correction, as OpenRLHF's); the IS weights are then not applied."""
    rollout_logprobs: bool = True
    """The experiences carry the engines' logprobs (False: zeros; no gap metrics)."""


def step_batches(count: int, size: int, *, seed: int, step: int, epoch: int) -> list[np.ndarray]:
    """One epoch's optimizer steps over ``count`` experiences of an RL step: ``count // size``
    batches of ``size`` indices, a permutation seeded by (``seed``, ``step``, ``epoch``), so the
    actor and a critic trained apart (``trainers.critic``) take the same ones (pure)."""
    order = np.random.default_rng([seed, step, epoch]).permutation(count)
    return [order[k * size:(k + 1) * size] for k in range(count // size)]


def micro_groups(exps: Sequence[Experience], b: Batching) -> list[list[int]]:
    """Micro-batches (indices into ``exps``), as many on every rank."""
    samples = [as_sample(e, k) for k, e in enumerate(exps)]
    groups = by_tokens(samples, b.token_budget) if b.token_budget else by_count(samples, b.micro_batch)
    count = int(all_reduce([len(groups)], b.device, op="max")[0])
    groups = split_to(groups, count) if count > len(groups) else groups
    return [[s.index for s in g] for g in groups]


def _shift(values: Tensor) -> Tensor:
    """Values computed at each token -> the value of the state *before* each token (column 0 = 0)."""
    return torch.nn.functional.pad(values[:, :-1], (1, 0))


@torch.no_grad()
def score(exps: Sequence[Experience], b: Batching, *, actor: Any | None, reference: Any | None, critic: Any | None,
          temperature: float, teacher: Any | None = None) -> dict[str, float]:
    """Fill ``old_logp`` (+ entropy sums), ``ref_logp``, ``values`` and ``teacher_logp`` of ``exps`` for
    the models given (``actor`` None: the old-policy logprobs are not needed, see ``trainers.ppo``);
    the reference and the teacher score the sampled tokens alike (``models.reference.Reference``)."""
    sums: dict[str, float] = defaultdict(float)
    if actor is None and reference is None and critic is None and teacher is None:
        return dict(sums)
    for idx in micro_groups(exps, b):
        group = [exps[i] for i in idx]
        ab = collate(group, packing=b.packing, pad_id=b.pad_id, device=b.device)
        if actor is not None:
            out = Actor(actor, ring=b.ring)(ab.batch, temperature=temperature, with_entropy=True, targets_only=True)
            _store(group, "old_logp", ab.actions(out.logprobs), ab)
            sums["entropy"] += float(ab.actions(out.entropy).sum())
            sums["tokens"] += float(ab.mask.sum())
        if reference is not None:
            _store(group, "ref_logp", ab.actions(reference.logprobs(ab.batch, temperature=temperature, targets_only=True)), ab)
        if critic is not None:
            _store(group, "values", ab.actions(_shift(token_values(critic, ab.batch, b.ring))), ab)
        if teacher is not None:
            _store(group, "teacher_logp", ab.actions(teacher.logprobs(ab.batch, temperature=temperature, targets_only=True)), ab)
    return dict(sums)


def _store(group: Sequence[Experience], name: str, values: Tensor, ab: ActionBatch) -> None:
    v = values.float().cpu().numpy()
    for k, e in enumerate(group):
        e.arrays[name] = v[k, : e.num_actions].copy()


def _units(exps: Sequence[Experience], aggregation: str, b: Batching) -> float:
    agg = AGGREGATIONS[aggregation]
    mine = sum(agg.units(torch.ones(1, e.num_actions, dtype=torch.bool)) for e in exps)
    return max(all_reduce([mine], b.device, group=b.dp_group)[0], 1.0)


def actor_step(engine: Any, exps: Sequence[Experience], b: Batching, loss: PolicyLoss, world: int) -> dict[str, float]:
    """One optimizer step of the actor on this rank's ``exps``; metrics are step means over all ranks.

    Without ``old_logp`` arrays (strictly on-policy: one optimizer step per rollout batch, so the
    weights cannot change between sampling and this step's forwards) the old policy is the current
    one: ``old = logp.detach()``, which is what a separate scoring pass would have computed.

    The KL-loss and entropy terms are token means over the step whatever ``loss.aggregation`` says
    (OpenRLHF's ``aggregate_loss`` defaults for them); only the policy loss follows it."""
    on_policy = "old_logp" not in exps[0].arrays
    names = ["advantages", "is_weights", "rollout_logp"] + ([] if on_policy else ["old_logp"]) \
        + (["ref_logp"] if loss.kl_coef > 0 else [])
    rollout_ratio = loss.ratio_to_rollout
    agg = AGGREGATIONS[loss.aggregation]
    units = _units(exps, loss.aggregation, b)
    tok, tokens = AGGREGATIONS["token-mean"], _units(exps, "token-mean", b)
    groups = micro_groups(exps, b)
    sums: dict[str, float] = defaultdict(float)
    engine.train()
    for k, idx in enumerate(groups):
        ab = collate([exps[i] for i in idx], packing=b.packing, pad_id=b.pad_id, names=names, device=b.device)
        out = Actor(engine, ring=b.ring)(ab.batch, temperature=loss.temperature, with_entropy=True, targets_only=True)
        logp, m = ab.actions(out.logprobs), ab.mask
        old = logp.detach() if on_policy else ab.arrays["old_logp"]
        gap = ((old - ab.arrays["rollout_logp"]).abs() * m)
        sums["_gap_sum"] += float(gap.sum())
        sums["_gap_max"] = max(sums["_gap_max"], float(gap.max()))
        sums["_actions"] += float(m.sum())
        terms = POLICY_LOSSES[loss.kind](logp, ab.arrays["rollout_logp"] if rollout_ratio else old,
                                         ab.arrays["advantages"], m, clip_low=loss.clip_low, clip_high=loss.clip_high,
                                         dual_clip=loss.dual_clip, weights=None if rollout_ratio else ab.arrays["is_weights"])
        per_token, token_terms = terms.loss, torch.zeros_like(terms.loss)
        if loss.kl_coef > 0:
            kl = KL_ESTIMATORS[loss.kl_estimator](logp, ab.arrays["ref_logp"])
            if loss.kl_unbiased_gradient:
                kl = unbiased_kl_gradient(kl, logp, ab.arrays["ref_logp"], old)
            kl = kl * m
            token_terms = token_terms + loss.kl_coef * kl
            sums["_kl_loss"] += float(tok.total(kl.detach(), m))
        if out.entropy is not None:
            ent = ab.actions(out.entropy)
            sums["_entropy"] += float(tok.total(ent.detach(), m))
            if loss.entropy_coef:
                token_terms = token_terms - loss.entropy_coef * ent
        step_loss = agg.total(per_token, m) / units + tok.total(token_terms, m) / tokens
        engine.set_gradient_accumulation_boundary(k == len(groups) - 1)
        engine.backward(step_loss * world, scale_wrt_gas=False)
        engine.step()
        sums["policy_loss"] += float(agg.total(terms.loss.detach(), m))
        sums["clip_frac"] += float(agg.total(terms.clipped.float(), m))
        sums["_ppo_clipped"] += float(terms.ppo_clipped.sum())
        sums["_ppo_kl"] += float(zero_pad(old - logp.detach(), m).sum())
        sums["ratio"] += float(agg.total(terms.ratio.detach() * m, m))
    gap_max = all_reduce([sums.pop("_gap_max")], b.device, op="max")[0]
    token_keys = ("_gap_sum", "_actions", "_ppo_clipped", "_ppo_kl", "_kl_loss", "_entropy")
    gap_sum, actions, ppo_clipped, ppo_kl, kl_loss, entropy = all_reduce(
        [sums.pop(key, 0.0) for key in token_keys], b.device, group=b.dp_group)
    keys = sorted(sums)
    reduced = all_reduce([sums[key] for key in keys], b.device, group=b.dp_group)
    metrics = {f"actor/{key}": v / units for key, v in zip(keys, reduced, strict=True)}
    if loss.rollout_logprobs:
        metrics.update({"actor/logprob_gap_mean": gap_sum / max(actions, 1.0), "actor/logprob_gap_max": gap_max})
    # OpenRLHF's names: plain token means over the step, whatever the loss's aggregation
    per_token = max(actions, 1.0)
    metrics.update({"actor/ppo_clip_ratio": ppo_clipped / per_token, "actor/ppo_kl": ppo_kl / per_token,
                    "actor/entropy": entropy / per_token})
    if loss.kl_coef > 0:
        metrics["actor/kl_loss"] = kl_loss / per_token
    metrics["actor/lr"] = engine.get_lr()[0]
    norm = engine.get_global_grad_norm()
    if norm is not None:
        metrics["actor/grad_norm"] = float(norm)
    return metrics


def critic_step(engine: Any, exps: Sequence[Experience], b: Batching, *, clip: float | None, world: int) -> dict[str, float]:
    """One optimizer step of the critic (clipped value loss, token mean over the step)."""
    agg = AGGREGATIONS["token-mean"]
    units = _units(exps, "token-mean", b)
    groups = micro_groups(exps, b)
    total = 0.0
    engine.train()
    for k, idx in enumerate(groups):
        ab = collate([exps[i] for i in idx], packing=b.packing, pad_id=b.pad_id, names=["values", "returns"],
                      device=b.device)
        values = ab.actions(_shift(token_values(engine, ab.batch, b.ring)))
        per_token = value_loss(values, ab.arrays["values"], ab.arrays["returns"], ab.mask, clip=clip)
        step_loss = agg.total(per_token, ab.mask) / units
        engine.set_gradient_accumulation_boundary(k == len(groups) - 1)
        engine.backward(step_loss * world, scale_wrt_gas=False)
        engine.step()
        total += float(agg.total(per_token.detach(), ab.mask))
    metrics = {"critic/loss": all_reduce([total], b.device, group=b.dp_group)[0] / units,
               "critic/lr": engine.get_lr()[0]}
    norm = engine.get_global_grad_norm()
    if norm is not None:
        metrics["critic/grad_norm"] = float(norm)
    return metrics
