"""Set-up of a PPO-family run: models, rollout daemon and clients, executors, weight sender, log.

``build_parts(cfg)`` returns everything ``trainers.ppo`` drives, built on every rank; what only
rank 0 uses (the daemon, the clients, the executors, the trajectory log, the metrics file) is
None on the others. Each helper builds one thing from the typed config.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from treadle.common.config import ConfigError
from treadle.common.log import get_logger
from treadle.common.metrics import MetricsLogger
from treadle.common.records import SamplingParams
from treadle.trainer.checkpoint.checkpointer import Checkpointer
from treadle.trainer.config.commands import PPOConfig
from treadle.trainer.config.data import check_mixture, split_list
from treadle.trainer.daemon import DTYPES, OwnedDaemon, daemon_spec, engine_gpus
from treadle.trainer.data.sources import DataError, Row, load_mixture
from treadle.trainer.models.loading import load_causal_lm, load_tokenizer
from treadle.trainer.models.reference import Reference
from treadle.trainer.rl.generation import Generator, Prompt
from treadle.trainer.strategy.deepspeed import DistInfo, build_engine
from treadle.trainer.trainers import build

log = get_logger(__name__)


@dataclass(slots=True, kw_only=True)
class PPOParts:
    """Everything a PPO run holds (rank-0-only parts are None elsewhere)."""

    cfg: PPOConfig
    dist: DistInfo
    tokenizer: Any
    prompts: list[Prompt]
    eval_prompts: list[Prompt]
    ring: Any  # this rank's RingGroup under ring attention, else None
    dp: Any  # the data-parallel view (rank, world, group)
    actor: Any  # DeepSpeed engine
    critic: Any | None  # DeepSpeed engine (gae only, trained in the ranks)
    reference: Reference | None
    reward_model: Any | None  # frozen RewardModel on the device
    prm: Any | None = None  # frozen ProcessRewardModel (--reward.prm_model_name_or_path), as the reward model
    prm_separator: tuple[int, ...] = ()  # the PRM's step separator in the actor's token ids
    teacher: Reference | None = None  # frozen teacher of on-policy distillation (--teacher.model_name_or_path)
    checkpointer: Checkpointer
    opt_steps_per_rl_step: int
    ema: Any | None = None  # ActorEMA with --train.enable_ema
    daemon: OwnedDaemon | None = None
    sync_client: Any | None = None  # SyncRolloutClient (weights, sleep/wake)
    generator: Generator | None = None
    sender: Any | None = None  # WeightSender (every rank)
    trajlog: Any | None = None  # TrajectoryLog
    metrics: MetricsLogger | None = None
    closers: list[Any] | None = None
    remote_critic: Any | None = None  # rank 0's RemoteCritic with --critic.remote_url


def prompt_of(row: Row, cfg: PPOConfig) -> Prompt:
    """A dataset row as an episode prompt: chat messages, or text through ``--data.input_template``."""
    data = cfg.data
    value = row.get(data.input_key, (str, list))
    if data.apply_chat_template:
        prompt: Any = [{"role": "user", "content": value}] if isinstance(value, str) else list(value)
    else:
        if not isinstance(value, str):
            raise row.error(data.input_key, "a list of messages needs --data.apply_chat_template")
        prompt = data.input_template.format(value) if data.input_template else value
    label = row.data.get(data.label_key) if data.label_key else None
    if data.label_key and label is None:
        raise row.error(data.label_key, "missing or null label (--data.label_key)")
    return Prompt(prompt=prompt, label=label)


def load_prompts(cfg: PPOConfig) -> tuple[list[Prompt], list[Prompt]]:
    data = cfg.data
    probs = check_mixture("--data.prompt_dataset", data.prompt_dataset, "--data.prompt_probs", data.prompt_probs)
    rows = load_mixture(split_list(data.prompt_dataset), probs, data.prompt_split, data.max_samples, cfg.train.seed)
    prompts = [prompt_of(r, cfg) for r in rows]
    evaluation: list[Prompt] = []
    if cfg.eval.dataset:
        names = split_list(cfg.eval.dataset)
        eval_rows = load_mixture(names, [1.0 / len(names)] * len(names), cfg.eval.split, 1 << 62, cfg.train.seed)
        evaluation = [prompt_of(r, cfg) for r in eval_rows]
    groups = cfg.rollout.batch_size
    if len(prompts) * cfg.train.num_episodes < groups:
        raise DataError(f"--data.prompt_dataset has {len(prompts)} prompts x {cfg.train.num_episodes} episodes, "
                        f"fewer than one rollout batch (--rollout.batch_size {groups})")
    return prompts, evaluation


def opt_steps_per_rl_step(cfg: PPOConfig) -> int:
    """Optimizer steps per RL step (the config checked that the rollout divides into them)."""
    return cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt // cfg.train.batch_size


def batchings(cfg: PPOConfig, *, pad_id: int, device: Any, ring: Any, dp_group: Any) -> tuple[Any, Any]:
    """(training, scoring) micro-batching of a run's models (``rl.update.Batching``): training by
    ``--train.micro_batch_size``, scoring by ``--rollout.micro_batch_size``, by tokens with
    ``--train.dynamic_batch_enable``."""
    from treadle.trainer.rl.update import Batching  # noqa: PLC0415

    dynamic = cfg.train.dynamic_batch_enable
    common = {"packing": cfg.ds.packing_samples, "pad_id": pad_id, "device": device, "ring": ring, "dp_group": dp_group}
    train = Batching(micro_batch=cfg.train.micro_batch_size,
                     token_budget=cfg.train.max_tokens_per_gpu if dynamic else None, **common)
    scoring = Batching(micro_batch=cfg.rollout.micro_batch_size,
                       token_budget=(cfg.rollout.max_tokens_per_gpu or cfg.train.max_tokens_per_gpu) if dynamic else None,
                       **common)
    return train, scoring


def engine_options(cfg: PPOConfig, world: int, dp_world: int, total_opt_steps: int) -> dict[str, int]:
    """``build_engine``'s batch and schedule arguments for a world of ``world`` ranks (``dp_world``
    data-parallel); ConfigError when ``--train.batch_size`` does not divide into them."""
    from treadle.trainer.strategy.deepspeed import grad_accum_steps  # noqa: PLC0415

    train = cfg.train
    gas = grad_accum_steps(train.batch_size, train.micro_batch_size, dp_world)
    return {"micro_batch": train.micro_batch_size, "grad_accum": gas, "world": world, "total_steps": total_opt_steps}


def critic_engine(cfg: PPOConfig, options: dict[str, int], *, is_main: bool) -> Any:
    """The critic's DeepSpeed engine from ``cfg.critic_model_name_or_path`` (the trainer's ranks, or a critic server's)."""
    from treadle.trainer.models.critic import Critic  # noqa: PLC0415

    if is_main:
        log.info("critic starts from %s (%s)%s", cfg.critic_model_name_or_path, cfg.critic_origin,
                 "" if cfg.critic.model_name_or_path else ": --critic.model_name_or_path unset (OpenRLHF's default)")
    torch.manual_seed(cfg.train.seed)  # its value head starts alike wherever it trains (ranks or a critic server)
    critic = Critic.from_pretrained(cfg.critic_model_name_or_path, cfg.ds,
                                    gradient_checkpointing=cfg.actor.gradient_checkpointing_enable)
    return build_engine(critic, cfg.ds, cfg.critic, **options)


def engines(cfg: PPOConfig, dist: DistInfo, dp_world: int, total_opt_steps: int) -> tuple[Any, Any | None]:
    """(actor engine, critic engine or None: no critic, or one trained apart, ``--critic.remote_url``)."""
    kw = engine_options(cfg, dist.world, dp_world, total_opt_steps)
    actor = load_causal_lm(cfg.actor.model_name_or_path, cfg.ds, trainable=True,
                           gradient_checkpointing=cfg.actor.gradient_checkpointing_enable,
                           reentrant=cfg.actor.gradient_checkpointing_reentrant)
    actor_engine = build_engine(actor, cfg.ds, cfg.actor, **kw)
    in_ranks = cfg.critic_model_name_or_path is not None and cfg.critic.remote_url is None
    return actor_engine, critic_engine(cfg, kw, is_main=dist.is_main) if in_ranks else None


def remote_critic(cfg: PPOConfig, *, total_opt_steps: int, pad_id: int) -> tuple[Any, Any]:
    """Rank 0 with ``--critic.remote_url``: (the client, the future of its ``setup``), once the
    server answers and has accepted the run's flags (ConfigError naming its reason: before any
    model loads here). The server loads the critic while the ranks load the actor."""
    from treadle.trainer.models.remote_critic import RemoteCritic  # noqa: PLC0415

    curve = None
    if cfg.critic.curve_dir:
        from treadle.common.rpc import load_client_keys  # noqa: PLC0415

        curve = load_client_keys(cfg.critic.curve_dir)
    client = RemoteCritic(cfg.critic.remote_url, curve=curve)
    try:
        client.wait_ready()
        setup = client.check(cfg, total_opt_steps=total_opt_steps, pad_id=pad_id)
        return client, client.setup_async(setup)
    except BaseException:
        client.close()
        raise


def frozen_models(cfg: PPOConfig, dist: DistInfo, ring: Any) -> tuple[Reference | None, Any | None]:
    """(reference or None, reward model or None), frozen; the reference sharded by ZeRO-3 under
    --ds.zero_stage 3 (``build.reference``), the reward model on this rank's device."""
    from treadle.trainer.models.reward_model import RewardModel  # noqa: PLC0415

    reference = None
    if (cfg.uses_reference or cfg.algo.kl.use_loss) and cfg.ref.remote_url:
        reference = remote_reference(cfg)
    elif cfg.uses_reference or cfg.algo.kl.use_loss:
        path = cfg.ref.model_name_or_path or cfg.actor.model_name_or_path
        reference = build.reference(path, cfg.ds, dist, offload=cfg.ref.offload, ring=ring)
    reward_model = None
    if cfg.reward.model_paths:  # one (the config refuses a list)
        reward_model = RewardModel.from_pretrained(cfg.reward.model_paths[0], cfg.ds).eval().requires_grad_(False)
        reward_model.to("cpu" if cfg.reward.offload else dist.device)  # --reward.offload: visits the device to score
    return reference, reward_model


def remote_reference(cfg: PPOConfig) -> Any:
    """``--ref.remote_url``: this rank's client of the daemon serving the reference, once it answers."""
    from treadle.rollout.client import SyncRolloutClient  # noqa: PLC0415
    from treadle.trainer.models.reference import RemoteReference  # noqa: PLC0415

    curve = None
    if cfg.ref.curve_dir:
        from treadle.common.rpc import load_client_keys  # noqa: PLC0415

        curve = load_client_keys(cfg.ref.curve_dir)
    client = SyncRolloutClient(cfg.ref.remote_url, curve=curve)
    try:
        client.wait_ready(timeout=600.0)
    except BaseException:
        client.close()
        raise
    log.info("reference: scored by the daemon at --ref.remote_url", extra={"fields": {"endpoint": cfg.ref.remote_url}})
    return RemoteReference(client)


def check_teacher_tokenizer(student: str, teacher: str) -> None:
    """Refuse a teacher whose token ids do not mean the student's, from the tokenizers and the config
    (before any weights load). On-policy distillation compares the two models' log-probs of the
    student's sampled token ids, so the tokenizers must agree id for id and the teacher's logits must
    cover every id; unlike ``treadle-train kd`` (which compares whole distributions) the embedding
    sizes may differ (a model family pads its larger models' embeddings beyond the tokenizer)."""
    from transformers import AutoConfig  # noqa: PLC0415

    vocab = [load_tokenizer(path, use_fast=True).get_vocab() for path in (student, teacher)]
    if vocab[0] != vocab[1]:
        other = sorted(set(vocab[0].items()) ^ set(vocab[1].items()), key=lambda kv: kv[1])[:1]
        raise ConfigError(f"--teacher.model_name_or_path {teacher}: its tokenizer is not the student's ({student}: "
                          f"{len(vocab[0])} vs {len(vocab[1])} tokens, first difference {other[0] if other else '?'}); "
                          "on-policy distillation scores the student's token ids with the teacher")
    rows = AutoConfig.from_pretrained(teacher).get_text_config().vocab_size
    if rows < max(vocab[0].values()) + 1:
        raise ConfigError(f"--teacher.model_name_or_path {teacher}: its logits cover {rows} token ids, the tokenizer "
                          f"has ids up to {max(vocab[0].values())}")


def teacher_model(cfg: PPOConfig, dist: DistInfo, ring: Any) -> Reference | None:
    """The frozen teacher (``--teacher.model_name_or_path``) or None, placed like the reference
    (``build.reference``: ZeRO-3 shards or a replica, ``--teacher.offload``; collective under ZeRO-3)."""
    if not cfg.uses_teacher:
        return None
    return build.reference(cfg.teacher.model_name_or_path, cfg.ds, dist, offload=cfg.teacher.offload, ring=ring)


def rollout_logprobs(cfg: PPOConfig) -> bool:
    """Whether the engines return the sampled tokens' logprobs: the IS correction reads them, and
    ``--rollout.logprobs`` asks for them (the gap metrics); else the trajectories carry zeros."""
    return cfg.rollout.logprobs or cfg.algo.advantage.is_correction_on


def sampling_of(cfg: PPOConfig, *, temperature: float) -> SamplingParams:
    return SamplingParams(n=1, temperature=temperature, top_p=cfg.rollout.top_p,
                          max_tokens=cfg.rollout.max_new_tokens or cfg.max_len - cfg.data.prompt_max_len,
                          logprobs=rollout_logprobs(cfg))


def executor(cfg: PPOConfig, *, sampler: Any, chat: Any, sampling: SamplingParams, gateway: Any = None) -> Any:
    """The agent executor of ``--train.agent_func_path`` (multi-turn) or ``--train.agent_cmd``
    (programs through ``gateway``), else single-turn with a reward source."""
    from treadle.agents.executor import ExecutorConfig, SingleTurnExecutor  # noqa: PLC0415

    config = ExecutorConfig(max_length=cfg.max_len, episode_timeout_s=cfg.rollout.episode_timeout_s)
    if cfg.train.agent_cmd:
        from treadle.agents.program import ProgramExecutor  # noqa: PLC0415

        return ProgramExecutor(command=shlex.split(cfg.train.agent_cmd), gateway=gateway, sampler=sampler, chat=chat,
                               sampling=sampling, config=config, max_procs=cfg.train.agent_max_procs)
    if cfg.train.agent_func_path:
        from treadle.agents.openrlhf.loader import AgentFileExecutor  # noqa: PLC0415

        return AgentFileExecutor(cfg.train.agent_func_path, sampler=sampler, chat=chat, sampling=sampling, config=config)
    reward = None
    if cfg.reward.remote_urls:
        from treadle.agents.rewards import reward_sources  # noqa: PLC0415

        r = cfg.reward
        reward = reward_sources(r.remote_urls, reduce=r.remote_reduce, timeout_s=r.timeout_s, retry_s=r.retry_s,
                                curve_dir=r.curve_dir, token=r.bearer)
    return SingleTurnExecutor(reward=reward, sampler=sampler, chat=chat, sampling=sampling, config=config)


def log_reward_sources(cfg: PPOConfig) -> None:
    """Rank 0, at start: which source is ``reward/source<i>`` in the metrics, and how they combine;
    a warning where a list that OpenRLHF (since 0.6.3) reads as replicas is summed here."""
    urls, reduce = cfg.reward.remote_urls, cfg.reward.remote_reduce
    if len(urls) < 2:
        return
    log.info("reward: %d sources, %s", len(urls), {"sum": "summed", "mean": "averaged", "spread": "as replicas, "
             "each sample scored by one in turn"}[reduce],
             extra={"fields": {f"source{i}": u for i, u in enumerate(urls)}})
    remote = all(u.startswith(("http://", "https://", "tcp://", "ipc://")) for u in urls)
    if reduce != "spread" and remote:
        log.warning("--reward.remote_url lists %d remote rewards and --reward.remote_reduce is %s: every one scores "
                    "every sample and the rewards are %s (OpenRLHF's reward_fn, up to 0.6.2); if they are replicas "
                    "of one reward server (what OpenRLHF 0.6.3 and later read a URL list as), pass "
                    "--reward.remote_reduce spread", len(urls), reduce, "summed" if reduce == "sum" else "averaged")


def log_placement(cfg: PPOConfig, gpu_ids: tuple[int, ...]) -> None:
    """Rank 0, at start: the warning OpenRLHF gives for --train.colocate_all with --train.async_enable,
    saying what runs instead (``gpu_ids``: those of the daemon started here, () on CPU)."""
    if not cfg.train.colocate_all or cfg.engines_colocated:
        return
    if cfg.vllm.endpoint:
        where = f"the daemon at --vllm.endpoint {cfg.vllm.endpoint} places its engines itself"
    else:
        where = f"the engines run on GPU(s) {list(gpu_ids)}" if gpu_ids else "the engines run in processes of their own"
    transport, backend = sync_route(cfg, cuda=torch.cuda.is_available())
    log.warning("--train.colocate_all with --train.async_enable: as in OpenRLHF, only the trainer's models share GPUs "
                "(actor, critic, reference, reward model, as in every treadle run), not the rollout engines; %s and "
                "generate while the trainer trains; weights over %s", where,
                transport if transport == "cuda_ipc" else backend)


def own_engine_gpus(cfg: PPOConfig, world: int) -> tuple[int, ...]:
    """The GPUs of the daemon the trainer starts itself (none on CPU or with --vllm.endpoint);
    ConfigError when this host cannot give them (checked before anything loads)."""
    if cfg.vllm.endpoint is not None or not torch.cuda.is_available():
        return ()
    v = cfg.vllm
    return engine_gpus(engine_gpus=v.num_engines * v.tensor_parallel_size, colocate=cfg.engines_colocated,
                       trainer_gpus=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                       visible=torch.cuda.device_count(), mask=os.environ.get("CUDA_VISIBLE_DEVICES"))


def check_reward_file(cfg: PPOConfig) -> None:
    """Each reward function file (``--reward.remote_url f.py``) exists and imports nothing treadle
    lacks (``openrlhf.*``): refused before any model loads, not when the executor starts."""
    from treadle.rewards.loader import parse_ref  # noqa: PLC0415

    for url in cfg.reward.remote_urls:
        if url.startswith(("http://", "https://", "tcp://", "ipc://")):
            continue
        try:
            parse_ref(url)
        except (ValueError, ImportError) as e:
            raise ConfigError(f"--reward.remote_url {url!r}: {e}") from None


def rollout_side(parts: PPOParts) -> None:
    """Rank 0: the daemon (started here unless --vllm.endpoint), clients, executors."""
    from treadle.agents.chat import ChatFormat  # noqa: PLC0415
    from treadle.agents.sampler import RolloutSampler  # noqa: PLC0415
    from treadle.common.rpc import LoopThread  # noqa: PLC0415
    from treadle.rollout.client import RolloutClient, SyncRolloutClient  # noqa: PLC0415
    from treadle.trainer.rl.generation import SeededSampler  # noqa: PLC0415

    cfg = parts.cfg
    log_reward_sources(cfg)
    endpoint = cfg.vllm.endpoint
    if endpoint is None:
        spec = dataclasses.replace(daemon_spec(cfg), gpu_ids=own_engine_gpus(cfg, parts.dist.world))
        log_placement(cfg, spec.gpu_ids)
        parts.daemon = OwnedDaemon(spec)
        parts.closers.append(parts.daemon.stop)
        endpoint = parts.daemon.endpoint
    else:
        log_placement(cfg, ())
    curve = None
    if cfg.vllm.endpoint is not None and cfg.vllm.curve_dir:
        from treadle.common.rpc import load_client_keys  # noqa: PLC0415

        curve = load_client_keys(cfg.vllm.curve_dir)
    parts.sync_client = SyncRolloutClient(endpoint, curve=curve)
    parts.closers.append(parts.sync_client.close)
    if parts.daemon is not None:
        seconds = parts.daemon.wait_ready(parts.sync_client)
        log.info("rollout daemon ready", extra={"fields": {"endpoint": endpoint, "seconds": round(seconds, 1)}})
    else:  # engines that can take this run's first weight sync (a good update heals a quarantined one)
        health = parts.sync_client.wait_ready(timeout=600.0, updatable=True)
        if health.get("quarantined"):
            log.warning("the rollout daemon's engines %s were quarantined by an earlier weight update; this run's "
                        "first sync replaces their weights", sorted(health["quarantined"]),
                        extra={"fields": {"reasons": health["quarantined"]}})
    lt = LoopThread(name="ppo-rollout")
    parts.closers.append(lt.stop)

    async def make_client() -> RolloutClient:
        return RolloutClient(endpoint, curve=curve)

    client = lt.run(make_client())
    parts.closers.append(lambda: lt.run(client.close()) if lt.alive else None)
    chat = ChatFormat(parts.tokenizer, cfg.data.tokenizer_chat_template)
    sampler = SeededSampler(RolloutSampler(client), cfg.train.seed)
    gateway = agent_gateway(parts, lt, chat=chat, client=client, sampler=sampler, endpoint=endpoint)
    train_ex = executor(cfg, sampler=sampler, chat=chat, sampling=sampling_of(cfg, temperature=cfg.rollout.temperature),
                        gateway=gateway)
    eval_ex = executor(cfg, sampler=sampler, chat=chat, sampling=sampling_of(cfg, temperature=cfg.eval.temperature),
                       gateway=gateway)
    parts.generator = Generator(executor=train_ex, eval_executor=eval_ex, n=cfg.rollout.n_samples_per_prompt, lt=lt)


def agent_gateway(parts: PPOParts, lt: Any, *, chat: Any, client: Any, sampler: Any, endpoint: str) -> Any:
    """With ``--train.agent_cmd``: a gateway on loopback sharing the trainer's rollout client and
    seeded sampler, for the agent programs; None otherwise."""
    cfg = parts.cfg
    if not cfg.train.agent_cmd:
        return None
    from treadle.agents.gateway.config import GatewayConfig  # noqa: PLC0415
    from treadle.agents.gateway.server import Gateway  # noqa: PLC0415

    gw = Gateway(GatewayConfig(model=cfg.actor.model_name_or_path, port=0, rollout=endpoint, max_length=cfg.max_len),
                 chat=chat, rollout=client, sampler=sampler)
    url = lt.run(gw.start())
    parts.closers.append(lambda: lt.run(gw.close()) if lt.alive else None)
    log.info("agent gateway for --train.agent_cmd", extra={"fields": {"url": url}})
    return gw


def sender(parts: PPOParts) -> Any:
    from treadle.trainer.weights.sender import SenderConfig, WeightSender  # noqa: PLC0415

    cfg = parts.cfg
    transport, backend = sync_route(cfg, cuda=torch.cuda.is_available())
    tolerance = cfg.vllm.canary_tolerance or (1e-3 if cfg.ds.param_dtype == "fp32" else 0.5)
    conf = SenderConfig(transport=transport, backend=backend, bucket_bytes=cfg.vllm.bucket_mb << 20,
                        dtype=DTYPES[cfg.ds.param_dtype], mode="abort" if cfg.train.partial_rollout_enable else "wait",
                        host=cfg.vllm.sync_host, canary_token_ids=canary_ids(parts.tokenizer, cfg.canary_size),
                        canary_tolerance=tolerance, adapters=cfg.vllm.sync_adapters,
                        ipc_every_rank=ipc_every_rank(cfg, transport))
    return WeightSender(parts.actor, config=conf, client=parts.sync_client, zero_stage=cfg.ds.zero_stage,
                        is_main=parts.dist.is_main)


CANARY_TEXT = ("The weights of a policy reach its rollout engines after every step; a canary checks "
               "that they arrived whole. 0 1 2 3 4 5 6 7 8 9 + - = ( ) [ ] { } < > ! ? . , ; :")


def canary_ids(tokenizer: Any, n: int) -> tuple[int, ...]:
    """The first ``n`` token ids of ``CANARY_TEXT`` (repeated as needed) in the actor's tokenizer:
    the canary prompt the engines score after each sync; () for ``n`` 0 (pure but for the tokenizer)."""
    if n == 0:
        return ()
    ids: list[int] = []
    while len(ids) < n:
        more = tokenizer(CANARY_TEXT, add_special_tokens=False)["input_ids"]
        if not more:
            raise ConfigError("--vllm.canary_tokens: the actor's tokenizer encodes the canary text to no tokens; "
                              "set --vllm.canary_tokens 0")
        ids += more
    return tuple(int(i) for i in ids[:n])


def sync_route(cfg: PPOConfig, *, cuda: bool) -> tuple[str, str]:
    """``(transport, backend)`` of the weight sync (pure). ``--vllm.sync_backend`` unset picks per
    placement: where the engines share the trainer's GPUs (``engines_colocated``:
    ``--train.colocate_all`` without ``--train.async_enable``) cuda_ipc on CUDA, every rank sharing a
    copy on its GPU (``ipc_every_rank``: OpenRLHF's per-GPU IPC handles), and so is ``nccl`` there
    (OpenRLHF's meaning of its default); else nccl on CUDA, gloo on CPU. A backend given is used
    as given, or refused (ConfigError) where it cannot work: what only the config decides is
    refused at parse time (``config.commands``), what needs CUDA here. cuda_ipc: engines on the
    trainer's GPUs copy out of its packed buckets."""
    backend = cfg.vllm.sync_backend
    v = cfg.vllm
    if cuda and v.sync_adapters and v.backend == "vllm" and v.endpoint is None and cfg.ds.param_dtype == "fp32":
        raise ConfigError("--vllm.sync_adapters with --ds.param_dtype fp32: the daemon this trainer starts serves "
                          "fp32 on its GPU, and vLLM's LoRA kernels take only fp16 / bf16 (its engine would fail to "
                          "start); use --ds.param_dtype bf16, or drop --vllm.sync_adapters (merged weights are sent)")
    if backend == "cuda_ipc":
        if not cuda:
            raise ConfigError("--vllm.sync_backend cuda_ipc shares GPU memory: it needs CUDA (on CPU, gloo)")
        return "cuda_ipc", "nccl"
    if backend == "nccl" and not cuda:
        raise ConfigError("--vllm.sync_backend nccl needs CUDA: on CPU use gloo, or leave it unset")
    if backend in (None, "nccl") and cuda and cfg.engines_colocated:
        return "cuda_ipc", "nccl"  # as OpenRLHF: NCCL cannot hold two processes of one GPU in a group
    if backend is None:
        backend = "nccl" if cuda else "gloo"
    return "collective", backend


def ipc_every_rank(cfg: PPOConfig, transport: str) -> bool:
    """Whether every rank shares a cuda_ipc copy (the engines are on every trainer GPU), not rank 0
    alone (an engine on rank 0's GPU). Pure."""
    return transport == "cuda_ipc" and cfg.engines_colocated


def process_reward_model(cfg: PPOConfig, dist: DistInfo, tokenizer: Any) -> tuple[Any | None, tuple[int, ...]]:
    """(the frozen PRM or None, its step separator's token ids in the actor's tokenizer), placed as the
    reward model (``--reward.offload`` too)."""
    path = cfg.reward.prm_model_name_or_path
    if path is None:
        return None, ()
    from treadle.trainer.data.steps import separator_ids  # noqa: PLC0415
    from treadle.trainer.models.reward_model import ProcessRewardModel  # noqa: PLC0415

    prm = ProcessRewardModel.from_pretrained(path, cfg.ds).eval().requires_grad_(False)
    marker = getattr(prm.config, "step_separator", None)
    if not marker:
        raise ConfigError(f"--reward.prm_model_name_or_path {path}: its config has no step_separator "
                          "(treadle-train prm records it)")
    prm.to("cpu" if cfg.reward.offload else dist.device)
    return prm, tuple(separator_ids(tokenizer, marker))


def build_parts(cfg: PPOConfig) -> PPOParts:
    """Everything, in the order that fails fastest on bad input (data before models before daemons)."""
    from treadle.trainer.ring.group import data_parallel  # noqa: PLC0415

    # What depends on this machine (CUDA) is refused here, before anything starts; what the config
    # alone decides was refused when it was parsed.
    if cfg.train.max_restarts:  # a launcher takes it off the trainer's flags and restarts the run itself
        raise ConfigError(f"--train.max_restarts {cfg.train.max_restarts}: restarting a failed run is the launcher's; "
                          "run it under python -m treadle.integration.train_ppo_ray or treadle-launch")
    sync_route(cfg, cuda=torch.cuda.is_available())
    if cfg.ds.enable_sleep and cfg.ds.adam_offload and torch.cuda.is_available():
        raise ConfigError("--ds.enable_sleep moves the optimizer's states off the GPU with ZeRO-3's offload_states, "
                          "which takes DeepSpeed's FusedAdam only; --ds.adam_offload runs DeepSpeed's CPU Adam: "
                          "pick one")
    if cfg.uses_teacher:
        check_teacher_tokenizer(cfg.actor.model_name_or_path, cfg.teacher.model_name_or_path)
    dist = build.start(cfg, ring_supported=True, sleep_supported=True)
    check_reward_file(cfg)
    if dist.is_main:
        own_engine_gpus(cfg, dist.world)
    ring = build.ring_group(cfg, dist)
    dp = data_parallel(dist, ring)
    tok = load_tokenizer(cfg.actor.model_name_or_path, use_fast=not cfg.data.disable_fast_tokenizer,
                         chat_template=cfg.data.tokenizer_chat_template)
    prompts, eval_prompts = load_prompts(cfg)
    per_step = opt_steps_per_rl_step(cfg)
    rl_steps = len(prompts) * cfg.train.num_episodes // cfg.rollout.batch_size
    total_opt_steps = max(1, rl_steps * per_step * cfg.train.max_epochs)
    apart, setup = None, None
    if cfg.critic.remote_url and dist.is_main:
        apart, setup = remote_critic(cfg, total_opt_steps=total_opt_steps, pad_id=tok.pad_token_id or 0)
    try:
        actor, critic = engines(cfg, dist, dp.world, total_opt_steps)
        if setup is not None:
            from treadle.trainer.models.remote_critic import result  # noqa: PLC0415

            ready = result(setup, cfg.critic.remote_url, "setup")
            log.info("critic: trained apart by the server at --critic.remote_url",
                     extra={"fields": {"endpoint": cfg.critic.remote_url, "ranks": ready.world, "model": ready.model}})
    except BaseException:
        if apart is not None:
            apart.close()
        raise
    reference, reward_model = frozen_models(cfg, dist, ring)
    prm, prm_separator = process_reward_model(cfg, dist, tok)
    teacher = teacher_model(cfg, dist, ring)
    parts = PPOParts(cfg=cfg, dist=dist, tokenizer=tok, prompts=prompts, eval_prompts=eval_prompts, ring=ring, dp=dp,
                     actor=actor,
                     critic=critic, reference=reference, reward_model=reward_model, prm=prm, prm_separator=prm_separator,
                     teacher=teacher, checkpointer=build.checkpointer(cfg, dist), opt_steps_per_rl_step=per_step,
                     closers=[], remote_critic=apart)
    if apart is not None:
        parts.closers.append(apart.close)
    if teacher is not None:
        parts.closers.append(teacher.close)
    if reference is not None and cfg.ref.remote_url:
        parts.closers.append(reference.close)
    if cfg.train.enable_ema:
        from treadle.trainer.models.ema import ActorEMA  # noqa: PLC0415

        parts.ema = ActorEMA(actor.module, beta=cfg.train.ema_beta, zero3=cfg.ds.zero_stage == 3)
    try:
        if dist.is_main:
            from treadle.trainer.rl.trajlog import TrajectoryLog  # noqa: PLC0415

            parts.trajlog = TrajectoryLog(Path(cfg.ckpt.path) / "trajectories")
            parts.closers.append(parts.trajlog.close)
            parts.metrics = build.metrics_logger(cfg, dist, "ppo")
            rollout_side(parts)
        parts.sender = sender(parts)
        parts.closers.append(parts.sender.close)
    except BaseException:
        close_parts(parts)
        raise
    return parts


def close_parts(parts: PPOParts) -> None:
    """Release in reverse order of creation; keeps going past failures."""
    for fn in reversed(parts.closers or []):
        try:
            fn()
        except Exception as e:  # a failing close must not hide the run's own error
            log.warning("closing %s failed: %s", getattr(fn, "__qualname__", fn), e)
    parts.closers = []
