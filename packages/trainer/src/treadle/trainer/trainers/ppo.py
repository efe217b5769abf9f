"""PPO-family RL (PPO, REINFORCE++, REINFORCE++-baseline, GRPO, Dr. GRPO, RLOO): the loop.

One RL step: rank 0 gathers ``--rollout.batch_size`` complete groups (``n`` samples per prompt)
from the generator (synchronously, in rounds of ``--rollout.vllm_generate_batch_size`` prompts,
or from the asynchronous producer's queue), appends each to
the durable trajectory log before using it, drops failed groups, groups outside DAPO's filter and
(async) samples staler than ``--train.async_queue_size`` versions, and broadcasts the
trajectories to every rank. Every rank scores its share (old-policy / reference / teacher logprobs,
values; ``rl.update.score``), the shares are exchanged, and every rank computes the same
rewards, KL and advantages (``rl.returns``). Then ``--train.max_epochs`` passes over the batch
in optimizer steps of ``--train.batch_size`` samples (critic, then actor unless frozen), a
``mark_step`` record in the log, and the weight broadcast to the engines as the next version.

Resume (``--ckpt.load_enable``): the newest checkpoint restores the actor, critic, KL coefficient
and step ``c``; the log then gives back every group completed but not trained by step ``c``
(trained first, in log order) and the prompts already completed (never generated again), and
the engines get the checkpoint's weights before generating: each completed trajectory is
trained exactly once in the resumed run's history. The whole loop is in view in ``fit`` (the
documented exception to short functions).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from treadle.common.config import ConfigError
from treadle.common.log import get_logger
from treadle.common.metrics import plot_curves
from treadle.common.records import Trajectory
from treadle.trainer.checkpoint.checkpointer import CRITIC_TAG, TrainState
from treadle.trainer.config.commands import PPOConfig, ppo_best_metric
from treadle.trainer.models import remote_critic
from treadle.trainer.rl.experience import Experience, from_trajectory
from treadle.trainer.rl.generation import Group, PromptStream
from treadle.trainer.rl.kl import KLController
from treadle.trainer.rl.returns import ReturnsConfig, finalize
from treadle.trainer.rl.shaping import dynamic_filter
from treadle.trainer.rl.transfer import (
    all_gather_arrays,
    broadcast_arrays,
    broadcast_trajectories,
    share_of,
)
from treadle.trainer.rl.update import PolicyLoss, actor_step, critic_step, score, step_batches
from treadle.trainer.strategy.deepspeed import all_reduce
from treadle.trainer.trainers.ppo_build import (
    PPOParts,
    batchings,
    build_parts,
    close_parts,
    rollout_logprobs,
)

log = get_logger(__name__)


class PPOTrainer:
    """Drives a PPO-family run over the parts ``ppo_build`` made."""

    def __init__(self, parts: PPOParts) -> None:
        self.p = parts
        self.cfg: PPOConfig = parts.cfg
        self.dist = parts.dist
        cfg = self.cfg
        kl = cfg.algo.kl
        self.kl = KLController(coef=kl.init_coef, target=kl.target, horizon=kl.horizon)
        self.batching, self.score_batching = batchings(cfg, pad_id=parts.tokenizer.pad_token_id or 0,
                                                       device=self.dist.device, ring=parts.ring, dp_group=parts.dp.group)
        self.version = 0
        self._offloaded = False
        self.pending: collections.deque[Group] = collections.deque()
        self.first_error: str | None = None  # rank 0: the first failed sample's error, for the end-of-run summary
        self.stream: PromptStream | None = None

    # -- configuration views -------------------------------------------------------------------

    @property
    def critic_apart(self) -> bool:
        """The critic trains in a critic server (``--critic.remote_url``), which rank 0 drives."""
        return self.cfg.critic.remote_url is not None

    @property
    def gspo_rollout_ratio(self) -> bool:
        """GSPO with the IS correction: its sequence ratio is taken against the rollout's logprobs
        (OpenRLHF's), and no correction weights are computed."""
        return self.cfg.actor.policy_loss_type == "gspo" and self.cfg.algo.advantage.is_correction_on

    def policy_loss(self) -> PolicyLoss:
        a, kl = self.cfg.actor, self.cfg.algo.kl
        low, high = a.clip_low_high
        return PolicyLoss(kind=a.policy_loss_type, clip_low=low, clip_high=high, dual_clip=a.dual_clip,
                          entropy_coef=a.entropy_coef, aggregation=a.aggregation,
                          kl_coef=self.kl.coef if kl.use_loss else 0.0, kl_estimator=kl.estimator,
                          temperature=self.cfg.rollout.temperature, kl_unbiased_gradient=kl.unbiased_gradient,
                          ratio_to_rollout=self.gspo_rollout_ratio, rollout_logprobs=rollout_logprobs(self.cfg))

    def returns_config(self) -> ReturnsConfig:
        c = self.cfg
        adv, kl, r = c.algo.advantage, c.algo.kl, c.reward
        weighted = adv.is_correction_on and not self.gspo_rollout_ratio
        return ReturnsConfig(
            estimator=adv.estimator, group_size=c.rollout.n_samples_per_prompt, gamma=adv.gamma, lambd=adv.lambd,
            std_norm=not adv.no_std_norm, kl_coef=self.kl.coef if self.p.reference is not None else 0.0,
            kl_estimator=kl.estimator, kl_in_reward=not kl.use_loss, clip_range=r.clip_range,
            max_new_tokens=c.rollout.max_new_tokens or c.max_len - c.data.prompt_max_len,
            overlong_buffer_len=r.overlong_buffer_len, overlong_penalty_factor=r.overlong_penalty_factor,
            stop_properly_coef=r.stop_properly_penalty_coef,
            is_level=adv.is_correction_level if weighted else None, is_mode=adv.is_correction_mode,
            is_gating=adv.is_correction_gating, is_band=adv.is_band, discount_env_tokens=adv.discount_env_tokens,
            distill_coef=c.teacher.kl_coef, rollout_logprobs=rollout_logprobs(c))

    @property
    def needs_old_logp(self) -> bool:
        """Whether experiences need a scoring pass of the policy before training.

        Not when training is strictly on-policy (one optimizer step per rollout batch: the weights
        that the step's forwards see are those the old-policy pass would see) and nothing else reads
        the old logprobs before the step (the KL penalty in the reward, the IS correction, the
        teacher's reverse-KL advantage): the actor step then uses its own detached logprobs, saving a
        forward over the whole batch, as TRL does. Reference and critic are still scored.
        """
        c = self.cfg
        kl_in_reward = self.p.reference is not None and not c.algo.kl.use_loss
        return (c.train.max_epochs > 1 or self.p.opt_steps_per_rl_step > 1 or kl_in_reward
                or c.algo.advantage.is_correction_on or self.p.reference is not None or self.p.teacher is not None)

    @property
    def total_steps(self) -> int:
        return len(self.p.prompts) * self.cfg.train.num_episodes // self.cfg.rollout.batch_size

    # -- rank 0: gathering a batch ---------------------------------------------------------------

    def _next_group(self) -> Group | None:
        """The next completed group: a pending one from the log, else a freshly generated one."""
        if self.pending:
            return self.pending.popleft()
        gen, cfg = self.p.generator, self.cfg
        if cfg.train.async_enable:
            group = gen.next_group()
        else:
            assert self.stream is not None
            items = self.stream.take(cfg.rollout.generate_batch_size)  # a round; a step may take several
            if not items:
                return None
            groups = gen.collect(items)
            self._sleep()  # colocated: free the engines' memory for training; woken again to load weights
            group, rest = groups[0], groups[1:]
            for g in rest:
                self.p.trajlog.append_group(g.seq, g.trajectories)
            self.pending.extend(rest)
        if group is not None:
            self.p.trajlog.append_group(group.seq, group.trajectories)
        return group

    def _keep(self, group: Group, dropped: list[str], counts: dict[str, int]) -> bool:
        cfg = self.cfg
        if group.failed:
            counts["failed_groups"] += 1
            if self.first_error is None:
                self.first_error = next(str(t.info.get("error", "")) for t in group.trajectories
                                        if t.finish_reason == "error")
        elif cfg.algo.dynamic_filtering_enable and not bool(dynamic_filter(
                torch.tensor([t.score if t.score is not None else (t.reward or 0.0) for t in group.trajectories]),
                len(group.trajectories), *cfg.algo.dynamic_filtering_range)[0]):
            counts["filtered_groups"] += 1
        elif cfg.train.async_enable and max(self.version - t.min_policy_version for t in group.trajectories) \
                > cfg.train.async_queue_size:
            counts["stale_groups"] += 1
        else:
            return True
        dropped.extend(t.uid for t in group.trajectories)
        return False

    def gather_batch(self) -> tuple[list[Trajectory], list[str], dict[str, int]]:
        """Rank 0: (trajectories of ``batch_size`` kept groups, dropped uids, counts); fewer at the end."""
        kept: list[Group] = []
        dropped: list[str] = []
        counts: dict[str, int] = collections.Counter()
        while len(kept) < self.cfg.rollout.batch_size:
            group = self._next_group()
            if group is None:
                break
            if self._keep(group, dropped, counts):
                kept.append(group)
        if len(kept) < self.cfg.rollout.batch_size:  # the prompt stream ran out: not a full step
            dropped.extend(t.uid for g in kept for t in g.trajectories)
            kept = []
        return [t for g in kept for t in g.trajectories], dropped, dict(counts)

    def _wake(self) -> None:
        """Colocated runs: the engines wake to load weights, generate (and evaluate), then sleep."""
        if self.cfg.vllm.enable_sleep:
            self.p.sync_client.wake()

    def _sleep(self) -> None:
        if self.cfg.vllm.enable_sleep:
            self.p.sync_client.sleep(level=1)

    def _offload_models(self) -> dict[str, float]:
        """``--ds.enable_sleep``: move the ZeRO-3 engines' states (weights, gradients, optimizer) to
        host memory while the colocated engines generate; ``_reload_models`` brings them back. On a
        CPU-only machine everything already lives in host memory: nothing to do. Returns this
        rank's GPU memory held by torch's allocator before and after (GiB), as metrics."""
        if not (self.cfg.ds.enable_sleep and torch.cuda.is_available() and not self._offloaded):
            return {}
        before = torch.cuda.memory_reserved()
        self.p.sender.release()  # its kept buffers and views would pin GPU memory meanwhile
        for engine in (self.p.actor, self.p.critic):
            if engine is not None:
                engine.offload_states()
        torch.cuda.empty_cache()
        self._offloaded = True
        return {"sleep/gpu_gib_before": before / 2**30, "sleep/gpu_gib_after": torch.cuda.memory_reserved() / 2**30}

    def _reload_models(self) -> None:
        if self._offloaded:
            for engine in (self.p.actor, self.p.critic):
                if engine is not None:
                    engine.reload_states()
            self._offloaded = False

    # -- every rank: experience and updates ------------------------------------------------------

    def experiences(self, trajs: Sequence[Trajectory]) -> tuple[list[Experience], dict[str, float]]:
        """Scored, finalised experiences of ``trajs`` (same on every rank) and their metrics."""
        exps = [from_trajectory(t) for t in trajs]
        for e in exps:
            e.reward = float(e.traj.reward or 0.0)
            e.staleness = self.version - e.traj.min_policy_version
        dp = self.p.dp
        apart = self.p.remote_critic.values_async(trajs) if self.p.remote_critic is not None else None
        mine = [exps[i] for i in share_of(len(exps), dp.world, dp.rank)]
        policy = self.p.actor if self.needs_old_logp else None
        sums = score(mine, self.score_batching, actor=policy, reference=self.p.reference,
                     critic=self.p.critic, temperature=self.cfg.rollout.temperature, teacher=self.p.teacher)
        names = (["old_logp"] if policy is not None else []) + (["ref_logp"] if self.p.reference is not None else []) \
            + (["values"] if self.p.critic is not None else []) + (["teacher_logp"] if self.p.teacher is not None else [])
        all_gather_arrays(exps, names, self.dist.device, rank=dp.rank, world=dp.world, group=dp.group)
        if self.critic_apart:  # valued by the critic server meanwhile; rank 0 has them, the others get them
            if apart is not None:
                reply = remote_critic.result(apart, self.cfg.critic.remote_url, "values")
                for e, v in zip(exps, remote_critic.split_values(reply, [e.num_actions for e in exps]), strict=True):
                    e.arrays["values"] = v
            broadcast_arrays(exps, "values", self.dist.device)
        if self.p.reward_model is not None:
            self._score_with_reward_model(exps)
        steps = self._score_with_prm(exps) if self.p.prm is not None else None
        ent, tokens = all_reduce([sums.get("entropy", 0.0), sums.get("tokens", 0.0)], self.dist.device, group=dp.group)
        metrics = finalize(exps, self.returns_config())
        staleness = np.array([e.staleness for e in exps])
        if tokens:
            metrics["entropy"] = ent / tokens
        if steps is not None:
            metrics["prm/steps_mean"] = steps / len(exps)
        metrics.update({"staleness/mean": float(staleness.mean()),
                        "staleness/max": float(staleness.max()), "kl_coef": self.kl.coef,
                        "score/mean": float(np.mean([t.score if t.score is not None else (t.reward or 0.0) for t in trajs]))})
        return exps, metrics

    @torch.no_grad()
    def _score_with_reward_model(self, exps: list[Experience]) -> None:
        """Set every experience's reward to the reward model's (normalised) score, each data-parallel
        rank scoring its share as for the reference and the critic, but in whole micro-batches: the
        batch is cut into micro-batches of ``--rollout.micro_batch_size`` first and those are shared
        out, so a sample is scored beside the same others (the same padding, the same rounding)
        whatever the rank count. A sum over the ranks (each score on one rank, 0.0 on the others)
        then gives every rank every score exactly."""
        from treadle.trainer.models.reward_model import on_device  # noqa: PLC0415
        from treadle.trainer.models.value_model import token_values  # noqa: PLC0415
        from treadle.trainer.rl.experience import collate  # noqa: PLC0415

        rm = self.p.reward_model
        mean, std = 0.0, 1.0
        if self.cfg.reward.normalize_enable:  # the statistics the RM trainer stored with the model
            mean = float(getattr(rm.config, "reward_mean", 0.0))
            std = float(getattr(rm.config, "reward_std", 1.0)) or 1.0
        size, dp = self.score_batching.micro_batch, self.p.dp
        micro = [list(range(lo, min(lo + size, len(exps)))) for lo in range(0, len(exps), size)]
        scores = [0.0] * len(exps)
        with on_device(rm, self.dist.device, offload=self.cfg.reward.offload):
            for idx in (micro[k] for k in share_of(len(micro), dp.world, dp.rank)):
                ab = collate([exps[i] for i in idx], packing=self.batching.packing, pad_id=self.batching.pad_id,
                             device=self.dist.device)
                values = rm.scores(token_values(rm, ab.batch, self.p.ring), ab.batch).float().cpu().tolist()
                for i, value in zip(idx, values, strict=True):
                    scores[i] = value
        for e, value in zip(exps, all_reduce(scores, self.dist.device, group=dp.group), strict=True):
            e.reward = (value - mean) / std

    def _score_with_prm(self, exps: list[Experience]) -> int:
        """Add the PRM's step scores to the experiences' process rewards (``rl.prm``); the steps scored."""
        from treadle.trainer.models.reward_model import on_device  # noqa: PLC0415
        from treadle.trainer.rl.prm import add_prm_rewards  # noqa: PLC0415

        dp = self.p.dp
        with on_device(self.p.prm, self.dist.device, offload=self.cfg.reward.offload) as prm:
            return add_prm_rewards(prm, exps, self.p.prm_separator, micro_batch=self.score_batching.micro_batch,
                                   packing=self.batching.packing, pad_id=self.batching.pad_id, device=self.dist.device,
                                   ring=self.p.ring, rank=dp.rank, world=dp.world, group=dp.group)

    def train_on(self, exps: list[Experience], step: int) -> dict[str, float]:
        """``max_epochs`` passes over ``exps`` in optimizer steps; critic then actor."""
        cfg = self.cfg
        metrics: dict[str, list[float]] = collections.defaultdict(list)
        loss = self.policy_loss()
        size = cfg.train.batch_size
        actor_frozen = step <= cfg.critic.freezing_steps and (self.p.critic is not None or self.critic_apart)
        apart = None  # the critic server trains on the same order while the actor trains here
        if self.p.remote_critic is not None:
            apart = self.p.remote_critic.train_async(step, [e.arrays["returns"] for e in exps])
        for epoch in range(cfg.train.max_epochs):
            for batch in step_batches(len(exps), size, seed=cfg.train.seed, step=step, epoch=epoch):
                mine = [exps[int(batch[i])] for i in share_of(size, self.p.dp.world, self.p.dp.rank)]
                if self.p.critic is not None:
                    for name, v in critic_step(self.p.critic, mine, self.batching, clip=cfg.critic.value_clip,
                                               world=self.dist.world).items():
                        metrics[name].append(v)
                if not actor_frozen:
                    for name, v in actor_step(self.p.actor, mine, self.batching, loss, self.dist.world).items():
                        metrics[name].append(v)
                    if self.p.ema is not None:  # --train.enable_ema: after each actor optimizer step
                        self.p.ema.update()
        out = {name: float(np.mean(v)) for name, v in metrics.items()}
        if apart is not None:
            out.update(remote_critic.result(apart, cfg.critic.remote_url, "train").metrics)
        return out

    # -- checkpoints ---------------------------------------------------------------------------

    def _more_engines(self) -> dict[str, Any]:
        return {CRITIC_TAG: self.p.critic} if self.p.critic is not None else {}

    def _write_more(self, folder: Path) -> None:
        """Every rank, into a checkpoint being written: the EMA's slices; the critic server's state
        (rank 0 asks it to write there: the folder must be one both see)."""
        if self.p.ema is not None:
            self.p.ema.save(folder, self.dist.rank)
        if self.p.remote_critic is not None and not self.cfg.ckpt.disable_ds:
            self.p.remote_critic.save(str(folder.resolve()))
            if not (folder / CRITIC_TAG).is_dir():
                raise RuntimeError(f"the critic server saved into {folder.resolve()}, which this host does not see "
                                   "there: --ckpt.path must be on a filesystem the trainer and the critic server share")

    def save(self, state: TrainState) -> Path:
        write_hf = self.export if self.cfg.ckpt.save_hf else None
        path = self.p.checkpointer.save(self.p.actor, state, write_hf=write_hf, more_engines=self._more_engines(),
                                        extra={"version": self.version, "kl_coef": self.kl.coef},
                                        write_more=self._write_more)
        if self.dist.is_main:
            self.p.trajlog.compact(state.global_step)
            log.info("checkpoint saved", extra={"fields": {"path": str(path), "step": state.global_step}})
        return path

    def resume(self) -> TrainState:
        ckpt = self.p.checkpointer
        latest = ckpt.latest() if self.cfg.ckpt.load_enable else None
        if self.p.remote_critic is not None:  # the server's critic to the same step (or its starting weights)
            self.p.remote_critic.load("" if latest is None else str(latest.resolve()))
        if latest is None:
            return TrainState()
        state = ckpt.load(self.p.actor, latest, more_engines=self._more_engines())
        if self.p.ema is not None:  # restored on every rank, or restarted on every rank
            loaded = self.p.ema.load(latest, self.dist.rank)
            if all_reduce([float(loaded)], self.dist.device)[0] < self.dist.world:
                if self.dist.is_main:
                    log.warning("the checkpoint in %s holds no EMA slices of this run's shape (saved without "
                                "--train.enable_ema, or by another rank count or ZeRO stage): the EMA starts "
                                "again from the resumed weights", latest)
                self.p.ema.reset()
        extra = ckpt.read_extra(latest)
        self.version = int(extra.get("version", state.global_step))
        self.kl = KLController(coef=float(extra.get("kl_coef", self.kl.coef)), target=self.kl.target,
                               horizon=self.kl.horizon)
        if self.dist.is_main:
            log.info("resumed", extra={"fields": {"path": str(latest), "step": state.global_step}})
        return state

    def export(self, out: Path) -> None:
        """The actor in HF format (collective); its EMA's weights with ``--train.enable_ema``."""
        from treadle.trainer.checkpoint.export import full_state_dict, lora_adapter, save_causal_lm  # noqa: PLC0415

        state = full_state_dict(self.p.actor, zero_stage=self.cfg.ds.zero_stage, is_main=self.dist.is_main)
        adapter = lora_adapter(self.p.actor, zero_stage=self.cfg.ds.zero_stage, is_main=self.dist.is_main)
        if self.p.ema is not None:
            state = self.p.ema.apply(state, is_main=self.dist.is_main)
        if self.dist.is_main:
            module = self.p.actor.module
            base = module.get_base_model() if hasattr(module, "get_base_model") else module
            save_causal_lm(state, base.config, self.p.tokenizer, out, adapter=adapter)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    def export_critic(self, out: Path) -> None:
        """The critic in HF format (collective; ``--critic.save_value_network``): a sequence-
        classification model with its value head, as a trained reward model is exported."""
        from treadle.trainer.checkpoint.export import full_state_dict, save_reward_model  # noqa: PLC0415

        if self.critic_apart:  # the critic server writes it
            if self.p.remote_critic is not None:
                self.p.remote_critic.export(str(out.resolve()))
            return
        state = full_state_dict(self.p.critic, zero_stage=self.cfg.ds.zero_stage, is_main=self.dist.is_main)
        if self.dist.is_main:
            module = self.p.critic.module
            save_reward_model(state, module.config, self.p.tokenizer, out, head_prefix=module.head_prefix)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    def sync_weights(self, version: int) -> dict[str, float]:
        if self.dist.is_main:
            self._wake()  # engines load weights awake (colocated: they slept through training)
        report = self.p.sender.sync(version)
        self.version = version
        if self.dist.is_main and self.cfg.train.async_enable:
            self.p.generator.publish(version)
        canary = {} if report.canary_gap is None else {"sync/canary_gap": report.canary_gap}
        return {"sync/seconds": report.seconds, "sync/bytes": float(report.bytes), **canary}

    def _first_sync(self, state: TrainState) -> None:
        """Bring the engines to the trainer's weights before the first rollout.

        Engine versions only grow, and a daemon may outlive runs (``--vllm.endpoint``): only a fresh
        run on the daemon it started itself (version 0, serving the actor's starting weights) needs
        nothing; any other start (a resume; a daemon given by ``--vllm.endpoint``, which may serve
        another model) sends the weights as a version newer than both.
        """
        served = 0
        if self.dist.is_main:
            self.p.sync_client.wake()  # a daemon left asleep (a colocated run that died) would refuse work
            served = self.p.sync_client.health()["version"]
        served = int(all_reduce([served], self.dist.device, op="max")[0])
        if state.global_step == 0 and served == 0 and self.cfg.vllm.endpoint is None:
            self.version = 0  # the daemon this run started serves the actor's starting weights
            return
        self.sync_weights(max(self.version, served) + 1)

    def _stop_flag(self, stop: bool) -> bool:
        return bool(all_reduce([1.0 if stop else 0.0], self.dist.device, op="max")[0])

    # -- the loop ------------------------------------------------------------------------------

    def fit(self) -> TrainState:
        from tqdm.auto import tqdm  # noqa: PLC0415

        cfg, main = self.cfg, self.dist.is_main
        state = self.resume()
        if main:
            recovered = self.p.trajlog.recover(state.global_step)
            self.pending.extend(Group(seq=seq, trajectories=list(ts)) for seq, ts in recovered.pending)
            self.stream = PromptStream(self.p.prompts, episodes=cfg.train.num_episodes, seed=cfg.train.seed,
                                       done=recovered.done_seqs)
        self._first_sync(state)
        if main and cfg.train.async_enable:
            self.p.generator.publish(self.version)
            self.p.generator.start_async(self.stream, batch=cfg.rollout.generate_batch_size,
                                         per_step=cfg.rollout.batch_size, max_ahead=cfg.train.async_queue_size)
        total = self.total_steps
        bar = tqdm(total=total, initial=state.global_step, disable=not main, desc="ppo", dynamic_ncols=True)
        saved_at = state.global_step if state.global_step else None
        drops: collections.Counter[str] = collections.Counter()  # rank 0: groups dropped over the run
        while state.global_step < total:
            t0 = time.perf_counter()
            trajs, dropped, counts = self.gather_batch() if main else (None, [], {})
            drops.update(counts)
            t_gen = time.perf_counter()
            if self._stop_flag(main and not trajs):
                break
            trajs = broadcast_trajectories(trajs, state.global_step + 1, self.dist.device)
            self._reload_models()
            exps, metrics = self.experiences(trajs)
            t_exp = time.perf_counter()
            step = state.global_step + 1
            metrics.update(self.train_on(exps, step))
            metrics.setdefault("entropy", metrics.get("actor/entropy", float("nan")))
            for k in ("mean", "max"):  # measured in the actor's step when no scoring pass ran
                if f"actor/logprob_gap_{k}" in metrics:
                    metrics.setdefault(f"logprob_gap/{k}", metrics[f"actor/logprob_gap_{k}"])
            self.kl = self.kl.updated(metrics.get("kl", 0.0), len(exps))
            t_train = time.perf_counter()
            if main:
                self.p.trajlog.mark_step(step, used=[t.uid for t in trajs], dropped=dropped)
            metrics.update(self.sync_weights(self.version + 1))
            metrics.update(self._offload_models())
            state = TrainState(global_step=step, epoch=state.epoch, best_metric=state.best_metric,
                               best_step=state.best_step)
            t_sync = time.perf_counter()
            metrics.update({f"batch/{k}": float(v) for k, v in counts.items()})
            metrics.update({"time/generate": t_gen - t0, "time/experience": t_exp - t_gen, "time/train": t_train - t_exp,
                            "time/sync": t_sync - t_train, "samples": float(len(exps)), "version": float(self.version)})
            improved = False
            if self.p.eval_prompts and cfg.eval.steps > 0 and step % cfg.eval.steps == 0 or \
                    self.p.eval_prompts and step == total:
                improved = self._evaluate(metrics, state)
                if improved:
                    state = TrainState(global_step=step, epoch=state.epoch, best_metric=metrics[self._best_key()],
                                       best_step=step)
            metrics["time/step"] = time.perf_counter() - t0
            if main:
                self.p.metrics.log(step, metrics)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}")
            if improved or (cfg.ckpt.save_steps > 0 and step % cfg.ckpt.save_steps == 0):
                self.save(state)
                saved_at = step
        bar.close()
        if main and cfg.train.async_enable:
            self.p.generator.stop()
        if state.global_step < total:
            self._ran_out(state.global_step, total, drops)
        if saved_at != state.global_step:
            self.save(state)
        self.export(Path(cfg.ckpt.output_dir))
        if cfg.critic.save_value_network:  # the config allows it with a critic (gae) only
            self.export_critic(Path(cfg.critic_output_dir))
        return state

    def _ran_out(self, done: int, total: int, drops: collections.Counter[str]) -> None:
        """The prompts ran out before ``total`` steps (groups were dropped: filtered, failed or
        stale): a warning naming rank 0's counts, or, when not one step was trained, a ConfigError on
        every rank (``done`` is the same on all), before anything is exported."""
        lo, hi = self.cfg.algo.dynamic_filtering_range
        first = (f"; the first: {self.first_error[:500]}" if self.dist.is_main else "; the first is in rank 0's log") \
            if self.first_error is not None or not self.dist.is_main else ""
        names = {"filtered_groups": f"filtered by --algo.dynamic_filtering_range {lo:g} {hi:g}",
                 "failed_groups": f"failed (a sample's generation, reward or agent raised{first})",
                 "stale_groups": f"older than --train.async_queue_size {self.cfg.train.async_queue_size}"}
        keys = sorted(names)  # rank 0 counted; every rank names the same counts
        counts = all_reduce([float(drops.get(k, 0)) for k in keys], self.dist.device, op="max")
        why = "; ".join(f"{int(n)} {names[k]}" for k, n in zip(keys, counts, strict=True) if n)
        msg = f"the prompts ran out after {done} of {total} steps: groups dropped: {why or 'none'}"
        if done == 0:
            raise ConfigError(f"no step was trained; {msg}")
        log.warning(msg)

    def _best_key(self) -> str | None:
        """The eval metric that picks the best checkpoint; None: none is kept."""
        cfg = self.cfg
        return ppo_best_metric(cfg.ckpt.best_metric_key, cfg.eval.n_samples_per_prompt, bool(self.p.eval_prompts))

    def _evaluate(self, metrics: dict[str, float], state: TrainState) -> bool:
        """Rank 0 samples the eval set; returns (on every rank) whether the best metric improved."""
        improved = 0.0
        if self.dist.is_main:
            start = time.perf_counter()
            metrics.update(self.p.generator.evaluate(self.p.eval_prompts, n=self.cfg.eval.n_samples_per_prompt))
            metrics["time/eval"] = time.perf_counter() - start
            key = self._best_key()
            value = None if key is None else metrics.get(key)
            if value is not None and (state.best_metric is None or value > state.best_metric):
                improved = 1.0
        flag = all_reduce([improved], self.dist.device, op="max")[0] > 0
        if flag and not self.dist.is_main:
            metrics[self._best_key()] = float("nan")  # only rank 0's value is real; state holds rank 0's
        return flag

    def close(self) -> None:
        if self.p.metrics is not None:
            self.p.metrics.close()
            path = self.p.metrics.path
            if path.is_file() and path.stat().st_size:
                plot_curves(path, path.with_name("curves.png"), title="PPO")


def run(cfg: PPOConfig) -> TrainState:
    parts = build_parts(cfg)
    trainer = PPOTrainer(parts)
    try:
        return trainer.fit()
    finally:
        try:
            trainer.close()
        finally:
            close_parts(parts)
