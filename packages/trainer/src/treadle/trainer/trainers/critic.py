"""``treadle-train critic``: a PPO run's critic trained on devices of its own, for its trainer.

OpenRLHF places the critic apart with ``--critic.num_nodes`` / ``--critic.num_gpus_per_node``: an
actor group beside the policy's, which its driver asks for values and trains while the policy
trains. Here that group is one DeepSpeed world (one process, or torchrun's ranks, on any hosts),
and the trainer's rank 0 is its only client, over ZeroMQ (``models.remote_critic``):

- ``check`` / ``setup`` (``CriticSetup``: the trainer's resolved flags): refuse what cannot work
  before any weights load, then build the critic as the trainer's ranks would
  (``ppo_build.critic_engine``), or keep the one built for the same flags;
- ``values`` (``CriticValuesRequest``): every rank values its share of the step's batch
  (``rl.update.score``); the batch is kept for the step's ``train``;
- ``train`` (``CriticTrainRequest``): the step's optimizer steps toward the returns, the actor's
  batches in the actor's order (``rl.update.step_batches``), while the actor trains;
- ``save`` / ``load`` / ``export`` (``CriticCheckpoint``): the DeepSpeed state in the trainer's
  checkpoint folder under ``CRITIC_TAG`` (so a resume restores both at one step; ``load`` of ""
  goes back to the starting weights), or the HF model.

Rank 0 takes each request on its RPC thread and hands it to its main thread, which broadcasts it
to every rank (``rl.transfer.broadcast_message``); all ranks run it and rank 0 replies. While
idle, rank 0 broadcasts a no-op every ``IDLE_S``, so the others' wait never reaches the process
group's timeout. A request the flags refuse gets a BadRequest and the server goes on serving; a
failure inside the collective work fails the request and ends the server (its ranks may no longer
agree on where they are), and with it the trainer's run, which resumes from its last checkpoint.

Not here: the trainer's side (``models.remote_critic``, ``trainers.ppo``), the math (``rl.update``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import queue
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from treadle.common.config import ConfigError, load_yaml, to_dict
from treadle.common.errors import BadRequest, InternalError
from treadle.common.log import get_logger
from treadle.common.records import (
    Ack,
    CriticCheckpoint,
    CriticReady,
    CriticSetup,
    CriticTrainRequest,
    CriticTrainResult,
    CriticValues,
    CriticValuesRequest,
    Record,
)
from treadle.trainer.checkpoint.checkpointer import CRITIC_TAG
from treadle.trainer.config.commands import PPOConfig
from treadle.trainer.config.critic import CriticServeConfig
from treadle.trainer.rl.experience import Experience, from_trajectory
from treadle.trainer.rl.transfer import all_gather_arrays, broadcast_message, share_of
from treadle.trainer.rl.update import critic_step, score, step_batches
from treadle.trainer.strategy.deepspeed import DistInfo, init_distributed

log = get_logger(__name__)
IDLE_S = 30.0
"""Rank 0 broadcasts a no-op after this long without a request (far below the group's timeout)."""


def critic_view(cfg: PPOConfig, total_opt_steps: int) -> dict[str, Any]:
    """What decides the critic a run's flags build (pure): two setups with the same view keep the
    critic that is there (a restarted trainer resuming), any difference builds it again."""
    c = to_dict(cfg.critic)
    for local in ("remote_url", "curve_dir", "num_nodes", "num_gpus_per_node", "save_value_network"):
        c.pop(local, None)
    t, r = cfg.train, cfg.rollout
    return {"model": cfg.critic_model_name_or_path, "critic": c, "ds": to_dict(cfg.ds), "total_opt_steps": total_opt_steps,
            "batching": [t.batch_size, t.micro_batch_size, t.dynamic_batch_enable, t.max_tokens_per_gpu, t.seed,
                         r.micro_batch_size, r.max_tokens_per_gpu, cfg.actor.gradient_checkpointing_enable]}


@dataclasses.dataclass(slots=True)
class _Built:
    """The critic of one setup, on this rank."""

    cfg: PPOConfig
    view: dict[str, Any]
    setup: CriticSetup
    engine: Any
    train: Any  # rl.update.Batching
    scoring: Any
    dp: Any
    trained: int = 0
    """RL steps trained since built or loaded."""


class CriticServer:
    """Every rank: the critic and the requests rank 0 hands round (``handle``)."""

    def __init__(self, dist: DistInfo) -> None:
        self.dist = dist
        self.built: _Built | None = None
        self.batch: list[Experience] = []
        self._rings: dict[tuple[int, int], Any] = {}
        self.methods: dict[str, tuple[type[Record] | None, Callable[[Any], Record]]] = {
            "check": (CriticSetup, self.check), "setup": (CriticSetup, self.setup),
            "values": (CriticValuesRequest, self.values), "train": (CriticTrainRequest, self.train),
            "save": (CriticCheckpoint, self.save), "load": (CriticCheckpoint, self.load),
            "export": (CriticCheckpoint, self.export), "noop": (None, lambda msg: Ack())}

    def handle(self, method: str, msg: Record | None) -> Record:
        kind, fn = self.methods[method]
        if kind is not None and not isinstance(msg, kind):
            raise BadRequest(f"{method} takes a {kind.__name__}, got {type(msg).__name__}")
        if method not in ("check", "setup", "noop") and self.built is not None and msg.session != self.built.setup.session:
            raise BadRequest(f"{method}: this critic server serves another trainer's run now (the last setup's); "
                             "a trainer that lost it must start again (it resumes from its checkpoint)")
        return fn(msg)

    # -- set-up ----------------------------------------------------------------------------------

    def _config(self, req: CriticSetup) -> PPOConfig:
        """The trainer's flags, checked here as its own ranks check them; BadRequest naming the reason."""
        from treadle.trainer.trainers import build  # noqa: PLC0415

        try:
            cfg = load_yaml(PPOConfig, req.config)
            if cfg.critic_origin is None:
                raise ConfigError(f"the run has no critic (--algo.advantage.estimator {cfg.algo.advantage.estimator})")
            build.start(cfg, ring_supported=True, sleep_supported=True)  # its refusals; the group is joined already
            ring = max(cfg.ds.ring_attn_size, 1)
            if self.dist.world % ring:
                raise ConfigError(f"--ds.ring_attn_size {ring} must divide the critic server's {self.dist.world} ranks")
            from treadle.trainer.trainers.ppo_build import engine_options  # noqa: PLC0415

            engine_options(cfg, self.dist.world, self.dist.world // ring, req.total_opt_steps)
        except ConfigError as e:
            raise BadRequest(str(e)) from None
        return cfg

    def _ready(self, cfg: PPOConfig) -> CriticReady:
        return CriticReady(world=self.dist.world, model=str(cfg.critic_model_name_or_path),
                           trained_steps=self.built.trained if self.built is not None else 0)

    def check(self, req: CriticSetup) -> CriticReady:
        return self._ready(self._config(req))

    def setup(self, req: CriticSetup) -> CriticReady:
        cfg = self._config(req)
        view = critic_view(cfg, req.total_opt_steps)
        if self.built is None or self.built.view != view or self.built.setup.pad_id != req.pad_id:
            self._build(cfg, view, req)
        else:  # the same critic for the same flags (a restarted trainer: it loads its checkpoint next)
            self.built.cfg, self.built.setup, self.batch = cfg, req, []
        return self._ready(cfg)

    def _build(self, cfg: PPOConfig, view: dict[str, Any], req: CriticSetup) -> None:
        from treadle.trainer.ring.group import data_parallel, setup_ring  # noqa: PLC0415
        from treadle.trainer.trainers.ppo_build import batchings, critic_engine, engine_options  # noqa: PLC0415

        self._drop()
        key = (cfg.ds.ring_attn_size, cfg.ds.ring_attn_head_stride)
        if key not in self._rings:  # collective, once per shape
            self._rings[key] = setup_ring(*key, self.dist)
        ring = self._rings[key]
        dp = data_parallel(self.dist, ring)
        engine = critic_engine(cfg, engine_options(cfg, self.dist.world, dp.world, req.total_opt_steps),
                               is_main=self.dist.is_main)
        train, scoring = batchings(cfg, pad_id=req.pad_id, device=self.dist.device, ring=ring, dp_group=dp.group)
        self.built = _Built(cfg=cfg, view=view, setup=req, engine=engine, train=train, scoring=scoring, dp=dp)

    def _drop(self) -> None:
        """Release the critic there is (before another is built)."""
        if self.built is None:
            return
        engine, self.built, self.batch = self.built.engine, None, []
        destroy = getattr(engine, "destroy", None)
        if destroy is not None:
            destroy()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _need(self) -> _Built:
        if self.built is None:
            raise BadRequest("no critic yet: the trainer sends setup first")
        return self.built

    # -- a step ----------------------------------------------------------------------------------

    def values(self, req: CriticValuesRequest) -> CriticValues:
        b = self._need()
        exps = [from_trajectory(t) for t in req.trajectories]
        dp = b.dp
        score([exps[i] for i in share_of(len(exps), dp.world, dp.rank)], b.scoring, actor=None, reference=None,
              critic=b.engine, temperature=b.cfg.rollout.temperature)
        all_gather_arrays(exps, ["values"], self.dist.device, rank=dp.rank, world=dp.world, group=dp.group)
        self.batch = exps
        return CriticValues(values=np.concatenate([e.arrays["values"] for e in exps] or [np.zeros(0, np.float32)]))

    def train(self, req: CriticTrainRequest) -> CriticTrainResult:
        b = self._need()
        exps = self.batch
        if req.uids != [e.traj.uid for e in exps]:
            raise BadRequest(f"train of step {req.step}: its {len(req.uids)} trajectories are not the {len(exps)} "
                             "last valued (values comes first, for the same batch)")
        returns = np.asarray(req.returns, dtype=np.float32)
        if returns.shape[0] != sum(e.num_actions for e in exps):
            raise BadRequest(f"train of step {req.step}: {returns.shape[0]} returns for "
                             f"{sum(e.num_actions for e in exps)} action tokens")
        at = 0
        for e in exps:
            e.arrays["returns"] = returns[at:at + e.num_actions].copy()
            at += e.num_actions
        cfg, size, dp = b.cfg, b.cfg.train.batch_size, b.dp
        metrics: dict[str, list[float]] = {}
        for epoch in range(cfg.train.max_epochs):
            for batch in step_batches(len(exps), size, seed=cfg.train.seed, step=req.step, epoch=epoch):
                mine = [exps[int(batch[i])] for i in share_of(size, dp.world, dp.rank)]
                for name, v in critic_step(b.engine, mine, b.train, clip=cfg.critic.value_clip,
                                           world=self.dist.world).items():
                    metrics.setdefault(name, []).append(v)
        b.trained += 1
        return CriticTrainResult(metrics={name: float(np.mean(v)) for name, v in metrics.items()})

    # -- checkpoints -----------------------------------------------------------------------------

    def _under(self, path: str, root: str, flag: str) -> Path:
        """``path`` if it lies in ``root`` (the run's ``flag`` folder), else BadRequest: a client may
        only have the server write and read the run's own folders."""
        where, top = Path(path).resolve(), Path(root).resolve()
        if not where.is_relative_to(top):
            raise BadRequest(f"{path} is not inside the run's {flag} {top}")
        return where

    def save(self, req: CriticCheckpoint) -> Ack:
        b = self._need()
        self._under(req.path, b.cfg.ckpt.path, "--ckpt.path")
        if not b.cfg.ckpt.disable_ds:
            b.engine.save_checkpoint(req.path, tag=CRITIC_TAG, save_latest=False)
        return Ack(note=str(Path(req.path) / CRITIC_TAG))

    def load(self, req: CriticCheckpoint) -> Ack:
        b = self._need()
        if not req.path:  # a run starting afresh: the starting weights, if these trained since
            if b.trained:
                self._build(b.cfg, b.view, b.setup)
            return Ack(note="starting weights")
        self._under(req.path, b.cfg.ckpt.path, "--ckpt.path")  # DeepSpeed's torch.load: the run's own files only
        if not (Path(req.path) / CRITIC_TAG).is_dir():
            raise BadRequest(f"{req.path} holds no critic state ({CRITIC_TAG}/): saved without a critic or with "
                             "--ckpt.disable_ds, or not on a filesystem this server sees")
        loaded, _ = b.engine.load_checkpoint(req.path, tag=CRITIC_TAG, load_optimizer_states=True,
                                             load_lr_scheduler_states=True)
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load {CRITIC_TAG!r} from {req.path}")
        b.trained = 0
        return Ack(note=req.path)

    def export(self, req: CriticCheckpoint) -> Ack:
        """The critic in HF format (a sequence-classification model with its value head), as the
        trainer's own ``export_critic`` writes it."""
        from treadle.trainer.checkpoint.export import full_state_dict, save_reward_model  # noqa: PLC0415
        from treadle.trainer.models.loading import load_tokenizer  # noqa: PLC0415

        b = self._need()
        self._under(req.path, b.cfg.critic_output_dir, "--ckpt.output_dir (+ _critic)")
        state = full_state_dict(b.engine, zero_stage=b.cfg.ds.zero_stage, is_main=self.dist.is_main)
        if self.dist.is_main:
            tok = load_tokenizer(b.cfg.actor.model_name_or_path, use_fast=not b.cfg.data.disable_fast_tokenizer,
                                 chat_template=b.cfg.data.tokenizer_chat_template)
            module = b.engine.module
            save_reward_model(state, module.config, tok, req.path, head_prefix=module.head_prefix)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        return Ack(note=req.path)


class _Front:
    """Rank 0's RPC server: each call waits in ``queue`` for the main thread to run it on every rank."""

    def __init__(self, cfg: CriticServeConfig, methods: list[str]) -> None:
        from treadle.common.rpc import RpcServer, ServerThread, load_server_keys  # noqa: PLC0415

        self.queue: queue.Queue[tuple[str, Record | None, concurrent.futures.Future[Record]]] = queue.Queue()
        curve = load_server_keys(cfg.curve_dir) if cfg.curve_dir else None
        server = RpcServer(name="critic", endpoint=cfg.endpoint, curve=curve,
                           handlers={m: self._handler(m) for m in methods if m != "noop"})
        self.thread = ServerThread(server)

    def _handler(self, method: str) -> Any:
        async def handle(msg: Record | None, ctx: Any) -> Record:
            fut: concurrent.futures.Future[Record] = concurrent.futures.Future()
            self.queue.put((method, msg, fut))
            return await asyncio.wrap_future(fut)
        return handle

    def next(self) -> tuple[str, Record | None, concurrent.futures.Future[Record] | None]:
        try:
            return self.queue.get(timeout=IDLE_S)
        except queue.Empty:
            return "noop", None, None


def serve(cfg: CriticServeConfig) -> None:
    """Serve until killed (SIGTERM), or until a request fails inside the collective work."""
    dist = init_distributed(launched_by_deepspeed=cfg.local_rank >= 0)
    server = CriticServer(dist)
    front = _Front(cfg, list(server.methods)) if dist.is_main else None
    if front is not None:
        endpoint = front.thread.start()
        log.info("critic server ready", extra={"fields": {"endpoint": endpoint, "ranks": dist.world}})
        print(f"treadle-train critic: serving on {endpoint} ({dist.world} ranks)", flush=True)
    try:
        while True:
            method, msg, fut = front.next() if front is not None else ("", None, None)
            method, msg = broadcast_message(msg, dist.device, method=method)
            try:
                reply = server.handle(method, msg)
            except BadRequest as e:  # refused before any collective work: every rank refuses alike
                if fut is not None:
                    fut.set_exception(e)
                continue
            except Exception as e:
                if fut is not None:
                    fut.set_exception(InternalError(f"the critic server failed in {method}: {type(e).__name__}: {e}"))
                raise
            if fut is not None:
                fut.set_result(reply)
    finally:
        if front is not None:
            front.thread.stop()


def run(cfg: CriticServeConfig) -> None:
    serve(cfg)
