"""Top-level configs of the training commands: ``SFTConfig``, ``RMConfig``, ``DPOConfig``,
``KTOConfig``, ``PPOConfig``.

Each composes only the groups its recipe reads, sets recipe defaults on them (learning rates,
batch sizes, checkpoint folders), and checks the combinations across groups in
``__post_init__``. Values that OpenRLHF patched after parsing (the critic's starting weights,
the total length budget) stay as given; the value in effect is a property here
(``critic_model_name_or_path``, ``max_len``).
"""

from __future__ import annotations

import re

from treadle.common.config import ConfigError, configclass
from treadle.trainer.config.algo import GROUP_ESTIMATORS, PROCESS_REWARD_ESTIMATORS, AlgoConfig
from treadle.trainer.config.ckpt import CheckpointConfig
from treadle.trainer.config.data import (
    KTODataConfig,
    PreferenceDataConfig,
    PromptDataConfig,
    SFTDataConfig,
)
from treadle.trainer.config.deepspeed import DeepSpeedConfig
from treadle.trainer.config.eval import EvalConfig, RLEvalConfig
from treadle.trainer.config.logger import LoggerConfig, WandbConfig
from treadle.trainer.config.model import (
    CriticConfig,
    DPOModelConfig,
    FrozenRefConfig,
    KTOModelConfig,
    PolicyConfig,
    RefConfig,
    RewardConfig,
    RMModelConfig,
    SFTModelConfig,
)
from treadle.trainer.config.optim import AdamConfig, OptimizerConfig, check_muon
from treadle.trainer.config.rollout import VLLM_LORA_RANKS, RolloutConfig, VLLMConfig
from treadle.trainer.config.teacher import OnPolicyTeacherConfig
from treadle.trainer.config.train import RLTrainConfig, TrainConfig


def _require(value: object, flag: str) -> None:
    if not value:
        raise ConfigError(f"{flag} is required")


def _check_supervised(cfg: SFTConfig | RMConfig | DPOConfig | KTOConfig) -> None:
    """Checks every single-model recipe shares: required paths, batching, evaluation."""
    OptimizerConfig.__post_init__(cfg)
    check_muon(cfg, cfg.ds)
    _require(cfg.actor.model_name_or_path, "--actor.model_name_or_path")
    _require(cfg.data.dataset, "--data.dataset")
    if cfg.train.dynamic_batch_enable and not cfg.ds.packing_samples:
        raise ConfigError("--train.dynamic_batch_enable needs --ds.packing_samples")
    if cfg.ckpt.best_metric_key not in ("", "none") and not cfg.eval.dataset:
        raise ConfigError(f"--ckpt.best_metric_key {cfg.ckpt.best_metric_key} needs --eval.dataset")


@configclass
class SFTConfig(OptimizerConfig):
    """Supervised fine-tuning: next-token loss on the responses of (input, output) rows."""

    adam: AdamConfig = AdamConfig(lr=5e-6)
    """AdamW settings."""
    actor: SFTModelConfig = SFTModelConfig()
    """The model being fine-tuned."""
    data: SFTDataConfig = SFTDataConfig()
    """Training data."""
    train: TrainConfig = TrainConfig(micro_batch_size=8, max_epochs=2)
    """Loop shape."""
    ds: DeepSpeedConfig = DeepSpeedConfig()
    """DeepSpeed, precision, packing, LoRA."""
    ckpt: CheckpointConfig = CheckpointConfig(path="./ckpt/checkpoints_sft")
    """Checkpoints."""
    logger: LoggerConfig = LoggerConfig(wandb=WandbConfig(project="treadle_sft"))
    """Metric logging."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation."""
    local_rank: int = -1
    """Set by the deepspeed launcher (--local_rank=N); torchrun uses LOCAL_RANK instead."""

    def __post_init__(self) -> None:
        _check_supervised(self)


@configclass
class RMConfig(OptimizerConfig):
    """Reward-model training on preference pairs (Bradley-Terry)."""

    adam: AdamConfig = AdamConfig(lr=9e-6)
    """AdamW settings."""
    actor: RMModelConfig = RMModelConfig()
    """The reward model being trained (OpenRLHF's README calls its flags --actor.*)."""
    data: PreferenceDataConfig = PreferenceDataConfig()
    """Training data."""
    train: TrainConfig = TrainConfig()
    """Loop shape."""
    ds: DeepSpeedConfig = DeepSpeedConfig()
    """DeepSpeed, precision, packing, LoRA, value-head name."""
    ckpt: CheckpointConfig = CheckpointConfig(path="./ckpt/checkpoints_rm")
    """Checkpoints."""
    logger: LoggerConfig = LoggerConfig(wandb=WandbConfig(project="treadle_rm"))
    """Metric logging."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation."""
    local_rank: int = -1
    """Set by the deepspeed launcher (--local_rank=N); torchrun uses LOCAL_RANK instead."""

    def __post_init__(self) -> None:
        _check_supervised(self)


@configclass
class DPOConfig(OptimizerConfig):
    """Direct preference optimisation (DPO, IPO, cDPO) on preference pairs against a frozen reference."""

    adam: AdamConfig = AdamConfig(lr=5e-7)
    """AdamW settings."""
    actor: DPOModelConfig = DPOModelConfig()
    """The policy being trained, and the preference loss."""
    ref: FrozenRefConfig = FrozenRefConfig()
    """The frozen reference policy."""
    data: PreferenceDataConfig = PreferenceDataConfig()
    """Training data."""
    train: TrainConfig = TrainConfig()
    """Loop shape."""
    ds: DeepSpeedConfig = DeepSpeedConfig()
    """DeepSpeed, precision, packing, LoRA."""
    ckpt: CheckpointConfig = CheckpointConfig(path="./ckpt/checkpoints_dpo")
    """Checkpoints."""
    logger: LoggerConfig = LoggerConfig(wandb=WandbConfig(project="treadle_dpo"))
    """Metric logging."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation."""
    local_rank: int = -1
    """Set by the deepspeed launcher (--local_rank=N); torchrun uses LOCAL_RANK instead."""

    def __post_init__(self) -> None:
        _check_supervised(self)


@configclass
class KTOConfig(OptimizerConfig):
    """Kahneman-Tversky optimisation on unpaired (prompt, answer, desirable?) rows against a frozen reference."""

    adam: AdamConfig = AdamConfig(lr=5e-7)
    """AdamW settings."""
    actor: KTOModelConfig = KTOModelConfig()
    """The policy being trained, and the KTO loss weights."""
    ref: FrozenRefConfig = FrozenRefConfig()
    """The frozen reference policy."""
    data: KTODataConfig = KTODataConfig()
    """Training data."""
    train: TrainConfig = TrainConfig()
    """Loop shape."""
    ds: DeepSpeedConfig = DeepSpeedConfig()
    """DeepSpeed, precision, packing, LoRA."""
    ckpt: CheckpointConfig = CheckpointConfig(path="./ckpt/checkpoints_kto")
    """Checkpoints."""
    logger: LoggerConfig = LoggerConfig(wandb=WandbConfig(project="treadle_kto"))
    """Metric logging."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation."""
    local_rank: int = -1
    """Set by the deepspeed launcher (--local_rank=N); torchrun uses LOCAL_RANK instead."""

    def __post_init__(self) -> None:
        _check_supervised(self)
        if self.train.batch_size < 2:
            raise ConfigError("KTO estimates its KL baseline from mismatched pairs of a batch: --train.batch_size must be >= 2")


@configclass
class PPOConfig:
    """PPO-family RL (PPO, REINFORCE++, REINFORCE++-baseline, GRPO, Dr. GRPO, RLOO) with vLLM rollouts."""

    actor: PolicyConfig = PolicyConfig(adam=AdamConfig(lr=1e-6))
    """The policy."""
    critic: CriticConfig = CriticConfig(adam=AdamConfig(lr=9e-6))
    """The value model (gae only)."""
    ref: RefConfig = RefConfig()
    """The KL reference."""
    reward: RewardConfig = RewardConfig()
    """Reward source and shaping."""
    teacher: OnPolicyTeacherConfig = OnPolicyTeacherConfig()
    """On-policy distillation: a frozen teacher's reverse KL on the sampled tokens in the advantages."""
    data: PromptDataConfig = PromptDataConfig()
    """Prompts."""
    rollout: RolloutConfig = RolloutConfig()
    """Sampling."""
    vllm: VLLMConfig = VLLMConfig()
    """Rollout engines."""
    algo: AlgoConfig = AlgoConfig()
    """Advantage estimator, IS correction, KL, filtering."""
    train: RLTrainConfig = RLTrainConfig()
    """Loop shape, colocation, async."""
    ds: DeepSpeedConfig = DeepSpeedConfig()
    """DeepSpeed, precision, packing, LoRA."""
    ckpt: CheckpointConfig = CheckpointConfig(path="./ckpt/checkpoints_ppo")
    """Checkpoints."""
    logger: LoggerConfig = LoggerConfig(wandb=WandbConfig(project="treadle_ppo"))
    """Metric logging."""
    eval: RLEvalConfig = RLEvalConfig()
    """Held-out evaluation by sampling."""
    local_rank: int = -1
    """Set by the deepspeed launcher (--local_rank=N); torchrun uses LOCAL_RANK instead."""

    def __post_init__(self) -> None:
        _require(self.actor.model_name_or_path, "--actor.model_name_or_path")
        _require(self.data.prompt_dataset, "--data.prompt_dataset")
        ppo_best_metric(self.ckpt.best_metric_key, self.eval.n_samples_per_prompt, bool(self.eval.dataset))
        _check_reward_source(self)
        _check_estimator(self)
        _check_policy_loss(self)
        _check_lengths_and_batches(self)
        _check_placements(self)
        _check_remote_reference(self)
        _check_remote_critic(self)
        _check_restarts(self)
        _check_colocation(self)
        _check_async(self)
        _check_weight_sync(self)
        _check_ema(self)
        check_muon(self.actor, self.ds, "actor.")
        check_muon(self.critic, self.ds, "critic.")

    @property
    def uses_reference(self) -> bool:
        """Whether a reference model is built (KL coefficient > 0)."""
        return self.algo.kl.init_coef > 0

    @property
    def uses_teacher(self) -> bool:
        """Whether a teacher is built (on-policy distillation, ``--teacher.model_name_or_path``)."""
        return self.teacher.model_name_or_path is not None

    @property
    def critic_origin(self) -> str | None:
        """The flag whose model the critic starts from (gae only; None: no critic). As OpenRLHF's
        train_ppo_ray: ``--critic.model_name_or_path`` when given, else the (first) reward model
        when rewards come from one, else (``--reward.remote_url`` or an agent) the actor's."""
        if self.algo.advantage.estimator != "gae":
            return None
        if self.critic.model_name_or_path:
            return "--critic.model_name_or_path"
        if self.reward.remote_url or self.train.agent_func_path or self.train.agent_cmd or not self.reward.model_paths:
            return "--actor.model_name_or_path"
        return "--reward.model_name_or_path"

    @property
    def critic_model_name_or_path(self) -> str | None:
        """The critic's starting weights in effect (``critic_origin``'s model); None: no critic."""
        origin = self.critic_origin
        if origin == "--critic.model_name_or_path":
            return self.critic.model_name_or_path
        if origin == "--reward.model_name_or_path":
            return self.reward.model_paths[0]
        return self.actor.model_name_or_path if origin else None

    @property
    def canary_size(self) -> int:
        """Tokens of the per-sync canary: ``--vllm.canary_tokens``, unset 16, or none with ring
        attention (its forward would need the prompt sharded over the ring)."""
        if self.vllm.canary_tokens is not None:
            return self.vllm.canary_tokens
        return 0 if self.ds.ring_attn_size > 1 else 16

    @property
    def engines_colocated(self) -> bool:
        """Whether the rollout engines share the trainer's GPUs: ``--train.colocate_all``, unless
        ``--train.async_enable``, where (as in OpenRLHF) colocate_all only colocates the trainer's
        models (which treadle always does) and the engines get GPUs of their own, to generate
        while the trainer trains."""
        return self.train.colocate_all and not self.train.async_enable

    @property
    def critic_output_dir(self) -> str:
        """Where ``--critic.save_value_network`` exports the critic: ``<--ckpt.output_dir>_critic``
        (OpenRLHF's ``save_path + "_critic"``)."""
        return self.ckpt.output_dir.rstrip("/") + "_critic"

    @property
    def max_len(self) -> int:
        """Token budget of prompt + response in effect."""
        if self.data.max_len is not None:
            return self.data.max_len
        assert self.rollout.max_new_tokens is not None  # checked in __post_init__
        return self.data.prompt_max_len + self.rollout.max_new_tokens


def ppo_best_metric(key: str, eval_n: int, has_eval: bool) -> str | None:
    """The eval metric ``--ckpt.best_metric_key`` names for PPO, or None when no best checkpoint
    is kept ('none', or no ``--eval.dataset``: as in OpenRLHF, the key then picks nothing, so
    its commands keep parsing). Empty means ``eval/pass@1``; OpenRLHF's spelling
    ``eval_default_passK`` means ``eval/pass@K`` (treadle evaluates one data source, "default").
    A key no eval produces is a ConfigError naming those it does, with or without an eval set."""
    if key == "none":
        return None
    produced = ["eval/pass@1", f"eval/pass@{eval_n}", "eval/reward_mean"]
    openrlhf = re.fullmatch(r"eval_(\w+?)_pass(\d+)", key)
    if openrlhf and openrlhf.group(1) == "default":
        key = f"eval/pass@{int(openrlhf.group(2))}"
    if key and key not in produced:
        names = ", ".join(dict.fromkeys(produced + ["eval_default_pass1", f"eval_default_pass{eval_n}"]))
        raise ConfigError(f"--ckpt.best_metric_key {key!r} is no metric the eval produces "
                          f"(with --eval.n_samples_per_prompt {eval_n}: {names})")
    return (key or "eval/pass@1") if has_eval else None


def _check_reward_source(cfg: PPOConfig) -> None:
    reward, agent = cfg.reward, cfg.train.agent_func_path or cfg.train.agent_cmd
    if cfg.train.agent_func_path and cfg.train.agent_cmd:
        raise ConfigError("--train.agent_func_path and --train.agent_cmd are both set: episodes come from one agent")
    flag = "--train.agent_func_path" if cfg.train.agent_func_path else "--train.agent_cmd"
    if reward.model_name_or_path and reward.remote_url:
        raise ConfigError("--reward.model_name_or_path and --reward.remote_url are both set: rewards come from one of them")
    if agent and (reward.model_name_or_path or reward.remote_url):
        raise ConfigError(f"{flag} computes rewards itself: drop --reward.model_name_or_path/--reward.remote_url")
    if not (reward.model_name_or_path or reward.remote_url or agent or reward.prm_model_name_or_path
            or cfg.uses_teacher):
        raise ConfigError("no reward: set --reward.model_name_or_path, --reward.remote_url, --train.agent_func_path, "
                          "--train.agent_cmd or --reward.prm_model_name_or_path, or distil from "
                          "--teacher.model_name_or_path")
    est = cfg.algo.advantage.estimator
    if reward.prm_model_name_or_path and est not in PROCESS_REWARD_ESTIMATORS:
        raise ConfigError(f"--reward.prm_model_name_or_path gives per-token rewards, which --algo.advantage.estimator "
                          f"{est} cannot use (its group baseline is taken on the episode reward only); use one of "
                          f"{sorted(PROCESS_REWARD_ESTIMATORS)}")
    if len(reward.model_paths) > 1:
        raise ConfigError(f"--reward.model_name_or_path lists {len(reward.model_paths)} models; this trainer scores "
                          "with one reward model (several are not implemented; OpenRLHF since 0.6.3 takes one too). "
                          "To combine several, serve each (treadle-rewards serve) and list them in "
                          "--reward.remote_url with --reward.remote_reduce sum or mean")
    _check_remote_reduce(reward.remote_urls, reward.remote_reduce)
    rule_reward = bool(reward.remote_url or agent)
    if cfg.algo.dynamic_filtering_enable and not rule_reward:
        raise ConfigError("--algo.dynamic_filtering_enable filters on scores: needs --reward.remote_url or --train.agent_func_path")
    if cfg.eval.dataset and not rule_reward:
        raise ConfigError("--eval.dataset scores with the reward function: needs --reward.remote_url or --train.agent_func_path")


def _check_remote_reduce(urls: tuple[str, ...], reduce: str) -> None:
    """``--reward.remote_reduce`` combines several ``--reward.remote_url`` sources; ``spread``
    deals samples across replicas of one remote reward, which function files (run in this
    process) cannot be."""
    if len(urls) < 2 and reduce != "sum":
        raise ConfigError(f"--reward.remote_reduce {reduce} combines several --reward.remote_url sources; "
                          f"{len(urls)} given")
    files = [u for u in urls if not u.startswith(("http://", "https://", "tcp://", "ipc://"))]
    if reduce == "spread" and len(urls) > 1 and files:
        raise ConfigError(f"--reward.remote_reduce spread deals samples across replicas of one remote reward "
                          f"(http(s)://, tcp://, ipc://); {files[0]!r} is a function file run in this process: "
                          "use sum or mean to combine it with the others")


def _check_estimator(cfg: PPOConfig) -> None:
    est, n = cfg.algo.advantage.estimator, cfg.rollout.n_samples_per_prompt
    if est != "gae":
        critic = cfg.critic
        for flag, used in (("--critic.model_name_or_path", critic.model_name_or_path is not None),
                           ("--critic.freezing_steps", critic.freezing_steps > 0),
                           ("--critic.save_value_network", critic.save_value_network)):
            if used:
                raise ConfigError(f"{flag} is set but --algo.advantage.estimator {est} uses no critic (only gae does)")
    lora_export = cfg.ds.lora.rank > 0 and (cfg.ds.zero_stage == 3 or cfg.ds.load_in_4bit)
    if cfg.critic.save_value_network and lora_export:
        raise ConfigError("--critic.save_value_network: exporting a value model with LoRA adapters under "
                          "--ds.zero_stage 3 or --ds.load_in_4bit is not implemented yet (use --ds.zero_stage 2 "
                          "without --ds.load_in_4bit)")
    if est in GROUP_ESTIMATORS and n < 2:
        raise ConfigError(
            f"--algo.advantage.estimator {est} compares the samples of a prompt: "
            f"needs --rollout.n_samples_per_prompt >= 2, got {n}"
        )
    if cfg.algo.dynamic_filtering_enable and n < 2:
        raise ConfigError(f"--algo.dynamic_filtering_enable needs --rollout.n_samples_per_prompt >= 2, got {n}")


def _check_ema(cfg: PPOConfig) -> None:
    """The actor's EMA (``models.ema``) averages whole trainable parameters, not LoRA adapters
    (whose export merges them; OpenRLHF's EMA model has no adapters, so its parameter list no
    longer lines up with the actor's)."""
    if cfg.train.enable_ema and cfg.ds.lora.rank > 0:
        raise ConfigError(f"--train.enable_ema with --ds.lora.rank {cfg.ds.lora.rank}: an EMA of LoRA adapters "
                          "is not implemented; drop one of them")


def _check_policy_loss(cfg: PPOConfig) -> None:
    """Combinations of the actor's loss with the IS correction that would otherwise be ignored."""
    adv = cfg.algo.advantage
    not_token_ratio = (adv.is_correction_level, adv.is_correction_mode, adv.is_correction_gating) != ("token", "mask", "ratio")
    # OpenRLHF's GSPO reads only the level: the sequence ratio is taken against the rollout's logprobs
    if cfg.actor.policy_loss_type == "gspo" and adv.is_correction_on and not_token_ratio:
        raise ConfigError(
            "--actor.policy_loss_type gspo corrects for the rollout engine by taking its sequence ratio against the "
            "rollout's logprobs: it takes --algo.advantage.is_correction_level token only (got level "
            f"{adv.is_correction_level}, --algo.advantage.is_correction_mode {adv.is_correction_mode}, "
            f"--algo.advantage.is_correction_gating {adv.is_correction_gating}); for token weights use "
            "--actor.policy_loss_type gspo_token")


def _check_lengths_and_batches(cfg: PPOConfig) -> None:
    rollout, ds, actor = cfg.rollout, cfg.ds, cfg.actor
    if cfg.data.max_len is None and rollout.max_new_tokens is None:
        raise ConfigError("no length budget: set --data.max_len or --rollout.max_new_tokens")
    generate, ahead = rollout.vllm_generate_batch_size, cfg.train.async_queue_size
    if generate is not None and generate > rollout.batch_size and not cfg.train.async_enable:
        raise ConfigError(
            f"--rollout.vllm_generate_batch_size {generate} > --rollout.batch_size {rollout.batch_size} "
            "over-samples and needs --train.async_enable"
        )
    if generate is not None and cfg.train.async_enable and generate > (ahead + 1) * rollout.batch_size:
        # a round is trained over generate / batch_size steps: its last groups would exceed the bound
        raise ConfigError(
            f"--rollout.vllm_generate_batch_size {generate} > (--train.async_queue_size {ahead} + 1) x "
            f"--rollout.batch_size {rollout.batch_size}: a round's last groups would be trained more than "
            f"{ahead} versions after it started; raise --train.async_queue_size or generate fewer")
    if cfg.train.dynamic_batch_enable and not ds.packing_samples:
        raise ConfigError("--train.dynamic_batch_enable needs --ds.packing_samples")
    samples = rollout.batch_size * rollout.n_samples_per_prompt
    if samples % cfg.train.batch_size:
        raise ConfigError(f"--rollout.batch_size x --rollout.n_samples_per_prompt = {samples} samples per rollout "
                          f"must be a multiple of --train.batch_size {cfg.train.batch_size}")
    ranks = actor.num_nodes * actor.num_gpus_per_node // (ds.ring_attn_size * ds.tensor_parallel_size)
    micro_batches = rollout.batch_size * rollout.n_samples_per_prompt // rollout.micro_batch_size
    if micro_batches < ranks:
        raise ConfigError(
            f"--rollout.batch_size x --rollout.n_samples_per_prompt / --rollout.micro_batch_size = {micro_batches} "
            f"micro-batches cannot feed {ranks} actor data-parallel ranks"
        )


def _check_placements(cfg: PPOConfig) -> None:
    """The critic, reference and reward model run in the trainer's ranks beside the actor (no
    placements of their own): their placement flags are unset (None: the actor's) or the actor's."""
    a = cfg.actor
    for role, what in (("critic", "the critic"), ("ref", "the reference"), ("reward", "the reward model")):
        other = getattr(cfg, role)
        if role == "critic" and other.remote_url is not None:
            continue  # the critic server's ranks: checked against its answer at start (``models.remote_critic``)
        given = [(name, mine, theirs) for name, mine, theirs in (("num_nodes", other.num_nodes, a.num_nodes),
                 ("num_gpus_per_node", other.num_gpus_per_node, a.num_gpus_per_node)) if mine is not None]
        if any(mine != theirs for _, mine, theirs in given):
            flags = ", ".join(f"--{role}.{name} {mine}" for name, mine, _ in given)
            apart = {"reward": " (under treadle-launch or train_ppo_ray, a reward model given 1 node x G GPUs and no "
                               "--train.colocate_critic_reward is served apart by a reward daemon)",
                     "critic": " (under treadle-launch or train_ppo_ray it trains apart in a critic server; else start "
                               "one with `treadle-train critic --endpoint tcp://HOST:PORT` there and give "
                               "--critic.remote_url)",
                     "ref": " (to score it on devices of its own, serve it with `treadle-rollout serve --backend hf "
                            "--model REF` there and give --ref.remote_url)"}.get(role, "")
            raise ConfigError(
                f"{flags}: {what} runs in the trainer's ranks beside the actor (a placement of its own is not "
                f"implemented here{apart}): leave it unset or equal to the actor's (--actor.num_nodes {a.num_nodes} x "
                f"--actor.num_gpus_per_node {a.num_gpus_per_node})")


def _check_restarts(cfg: PPOConfig) -> None:
    """``--train.max_restarts`` resumes from checkpoints: the run must save some before its end."""
    if cfg.train.max_restarts and cfg.ckpt.save_steps == -1:
        raise ConfigError(f"--train.max_restarts {cfg.train.max_restarts} resumes from the trainer's checkpoints, but "
                          "--ckpt.save_steps -1 saves one only at the end: give --ckpt.save_steps N")


def _check_remote_critic(cfg: PPOConfig) -> None:
    """``--critic.remote_url`` trains the critic apart: only where there is one (gae), and not
    where the flags put it on the trainer's GPUs."""
    url = cfg.critic.remote_url
    if url is None:
        return
    if cfg.critic_origin is None:
        raise ConfigError(f"--critic.remote_url {url}: no critic is used (--algo.advantage.estimator "
                          f"{cfg.algo.advantage.estimator}; only gae has one): drop it")
    shared = [f for f, on in (("--train.colocate_all", cfg.train.colocate_all),
                              ("--train.colocate_critic_reward", cfg.train.colocate_critic_reward)) if on]
    if shared:
        raise ConfigError(f"--critic.remote_url {url} with {' and '.join(shared)}: the critic trains apart, on the "
                          "critic server's devices, not beside the trainer's models: drop one of them")


def _check_remote_reference(cfg: PPOConfig) -> None:
    """``--ref.remote_url`` scores the reference: only where there is one to score (a KL term)."""
    if cfg.ref.remote_url is not None and not (cfg.uses_reference or cfg.algo.kl.use_loss):
        raise ConfigError(f"--ref.remote_url {cfg.ref.remote_url}: no reference is used (--algo.kl.init_coef 0 without "
                          "--algo.kl.use_loss): drop it, or give the KL term a coefficient")


def _check_colocation(cfg: PPOConfig) -> None:
    """The switches' own conditions. ``--train.colocate_actor_ref`` and ``--train.colocate_critic_reward``
    name what every run does (``_check_placements``); ``--train.colocate_all`` also puts the engines there,
    unless ``--train.async_enable`` (``PPOConfig.engines_colocated``)."""
    train, vllm, actor = cfg.train, cfg.vllm, cfg.actor
    reward_model = bool(cfg.reward.model_name_or_path)
    if cfg.engines_colocated:
        engine_gpus = vllm.num_engines * vllm.tensor_parallel_size
        if engine_gpus != actor.num_nodes * actor.num_gpus_per_node:
            raise ConfigError(
                f"--train.colocate_all: --vllm.num_engines x --vllm.tensor_parallel_size ({engine_gpus}) must equal "
                f"the actor's GPUs ({actor.num_nodes * actor.num_gpus_per_node})"
            )
    if train.colocate_critic_reward and not train.colocate_all and (cfg.critic_model_name_or_path is None
                                                                     or not reward_model):
        raise ConfigError("--train.colocate_critic_reward needs both a critic (gae) and a reward model")
    if vllm.enable_sleep and not train.colocate_all:
        raise ConfigError("--vllm.enable_sleep frees engine memory for colocated training: needs --train.colocate_all")
    if cfg.ds.enable_sleep and not (train.colocate_all or train.colocate_actor_ref or train.colocate_critic_reward):
        raise ConfigError("--ds.enable_sleep frees GPU memory for colocated models: needs a --train.colocate_* switch")
    if cfg.ds.enable_sleep and cfg.ds.zero_stage != 3:
        raise ConfigError(f"--ds.enable_sleep offloads ZeRO-3 states between phases: needs --ds.zero_stage 3, "
                          f"got {cfg.ds.zero_stage}")


def _check_async(cfg: PPOConfig) -> None:
    """``--train.colocate_all`` is taken with async (``engines_colocated``: the engines then get
    GPUs of their own, as OpenRLHF's "only colocates DeepSpeed models"); sleeping engines are not."""
    if cfg.train.async_enable and cfg.vllm.enable_sleep:
        raise ConfigError("--train.async_enable generates while training: engines cannot sleep (--vllm.enable_sleep)")


def _check_weight_sync(cfg: PPOConfig) -> None:
    """What ``--vllm.sync_backend`` cannot do whatever the machine (what needs CUDA is checked at
    start-up, ``trainers.ppo_build.sync_route``): refused, never replaced by another backend."""
    v = cfg.vllm
    if v.canary_tokens and cfg.ds.ring_attn_size > 1:
        raise ConfigError(f"--vllm.canary_tokens {v.canary_tokens} with --ds.ring_attn_size {cfg.ds.ring_attn_size}: the "
                          "canary's forward runs on one unsharded prompt, which a ring-attention actor cannot; leave "
                          "--vllm.canary_tokens unset (no canary with ring attention) or set it to 0")
    if v.sync_adapters and cfg.ds.lora.rank == 0:
        raise ConfigError("--vllm.sync_adapters sends LoRA adapters: it needs --ds.lora.rank > 0")
    if v.sync_adapters and cfg.ds.load_in_4bit:
        raise ConfigError("--vllm.sync_adapters with --ds.load_in_4bit: the engines' base is the unquantized model, "
                          "the trainer's the 4-bit one, so the adapter alone would not give the trained model there; "
                          "drop --vllm.sync_adapters (merged weights are sent)")
    if v.sync_adapters and v.backend == "vllm" and cfg.ds.lora.rank > VLLM_LORA_RANKS[-1]:
        raise ConfigError(f"--vllm.sync_adapters: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, "
                          f"--ds.lora.rank is {cfg.ds.lora.rank}")
    engine_gpus = v.num_engines * v.tensor_parallel_size
    if v.sync_backend == "cuda_ipc" and v.endpoint is None and engine_gpus > 1 and not cfg.engines_colocated:
        raise ConfigError(f"--vllm.sync_backend cuda_ipc serves engines on rank 0's GPU, and a daemon started here "
                          f"puts its {engine_gpus} engine GPUs on GPUs of their own; use gloo")
