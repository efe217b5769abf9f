"""Model roles: the trained model of SFT/RM, and PPO's actor, critic, reference and reward.

One class per role, each with only the settings that role reads. Trained PPO roles carry their
own optimizer (``--actor.adam.lr``, ``--critic.adam.lr``). The actor's ``num_nodes`` x
``num_gpus_per_node`` are the trainer's ranks; the critic, reference and reward model always run
in those ranks too (OpenRLHF's colocated placement), so their own placement flags default to None
(the actor's) and another value is refused (``commands``). Loading models is the trainer's job;
nothing here touches weights.

The model a single-model recipe trains (``ModelConfig`` and its subclasses) sits at ``--actor.*``,
as OpenRLHF's README spells it; OpenRLHF's cli code and example scripts for SFT / RM / DPO spell
the same group ``--model.*``, so each of its fields also takes ``--model.<field>`` (declared on the
field with ``_model``), and DPO's ``--model.ipo_enable`` switch is ``--actor.loss_type ipo``. PPO's
roles have no ``--model.*`` spelling: OpenRLHF's PPO says ``--actor.*`` too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from treadle.common.config import ConfigError, alias, configclass, secret, value_alias
from treadle.trainer.config.optim import OptimizerConfig
from treadle.trainer.config.rollout import require_client_keys


def _model(field: str) -> Any:
    """``Annotated`` metadata: OpenRLHF's ``--model.<field>`` spelling of a single-model recipe's field."""
    return alias(f"--model.{field}")


def _check_model(cfg: Any) -> None:
    if cfg.model_name_or_path == "":
        raise ConfigError("--model_name_or_path is empty: give a HF model name or path")


def _check_placement(cfg: Any) -> None:
    if any(n is not None and n < 1 for n in (cfg.num_nodes, cfg.num_gpus_per_node)):
        raise ConfigError(
            f"--num_nodes and --num_gpus_per_node must be >= 1, got {cfg.num_nodes} x {cfg.num_gpus_per_node}"
        )


@configclass
class ModelConfig:
    """A model trained by a single-model recipe (SFT, RM, DPO, ...)."""

    model_name_or_path: Annotated[str | None, _model("model_name_or_path")] = None
    """HF model name or local path to start from (required)."""
    gradient_checkpointing_enable: Annotated[bool, _model("gradient_checkpointing_enable")] = False
    """Recompute activations in the backward pass to save memory."""
    gradient_checkpointing_reentrant: Annotated[bool, _model("gradient_checkpointing_reentrant")] = False
    """Use the reentrant flavour of torch checkpointing."""
    aux_loss_coef: Annotated[float, _model("aux_loss_coef")] = 0.0
    """Weight of the MoE load-balancing loss (0: off)."""

    def __post_init__(self) -> None:
        _check_model(self)
        if not self.aux_loss_coef >= 0:
            raise ConfigError(f"--aux_loss_coef must be >= 0, got {self.aux_loss_coef}")


@configclass
class SFTModelConfig(ModelConfig):
    """The model fine-tuned by SFT."""

    pretrain_mode_enable: Annotated[bool, _model("pretrain_mode_enable")] = False
    """Continued pre-training: loss on every token, prompts included."""
    loss_agg_mode: Annotated[Literal["token-mean", "seq-mean-token-mean"], _model("loss_agg_mode")] = "token-mean"
    """token-mean: every target token of the step weighs the same; seq-mean-token-mean: each sequence's
    token mean, averaged over the step's sequences (OpenRLHF's SFTLoss(token_level_loss=False))."""


@configclass
class RMModelConfig(ModelConfig):
    """The reward model being trained (a value head on a causal LM)."""

    loss_type: Annotated[Literal["sigmoid", "logexp"], _model("loss_type")] = "sigmoid"
    """Pairwise loss: -log sigmoid(r_chosen - r_rejected), or log(1 + exp(r_rejected - r_chosen))."""
    margin_loss_enable: Annotated[bool, _model("margin_loss_enable")] = False
    """Subtract the dataset's per-pair margin inside the loss."""
    compute_fp32_loss_enable: Annotated[bool, _model("compute_fp32_loss_enable")] = False
    """Compute the loss in fp32: accepted for OpenRLHF's scripts, and what treadle always does
    (``losses.rm`` casts the scores to fp32 whatever this says)."""


PreferenceLoss = Literal["sigmoid", "ipo"]


@configclass
class DPOModelConfig(ModelConfig):
    """The policy trained by DPO / IPO / cDPO."""

    loss_type: Annotated[PreferenceLoss, _model("loss_type"), value_alias("--model.ipo_enable", "ipo")] = "sigmoid"
    """sigmoid: DPO (cDPO when label_smoothing > 0); ipo: IPO's squared loss (--model.ipo_enable,
    OpenRLHF's switch, alone means ipo)."""
    beta: Annotated[float, _model("beta")] = 0.1
    """Strength of the implicit KL constraint (DPO's beta; IPO's regulariser tau)."""
    label_smoothing: Annotated[float, _model("label_smoothing")] = 0.0
    """cDPO: assumed share of flipped preference labels, in [0, 0.5)."""
    nll_loss_coef: Annotated[float, _model("nll_loss_coef")] = 0.0
    """Weight of an SFT loss on the chosen answers added to the preference loss (0: off)."""

    def __post_init__(self) -> None:
        ModelConfig.__post_init__(self)
        if not self.beta > 0:
            raise ConfigError(f"--beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"--label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing > 0 and self.loss_type == "ipo":
            raise ConfigError("--label_smoothing (cDPO) applies to --loss_type sigmoid, not ipo (--model.ipo_enable)")
        if not self.nll_loss_coef >= 0:
            raise ConfigError(f"--nll_loss_coef must be >= 0, got {self.nll_loss_coef}")


@configclass
class KTOModelConfig(ModelConfig):
    """The policy trained by KTO."""

    beta: Annotated[float, _model("beta")] = 0.1
    """Strength of the implicit KL constraint."""
    desirable_weight: Annotated[float, _model("desirable_weight")] = 1.0
    """Loss weight of desirable answers (lambda_D)."""
    undesirable_weight: Annotated[float, _model("undesirable_weight")] = 1.0
    """Loss weight of undesirable answers (lambda_U)."""

    def __post_init__(self) -> None:
        ModelConfig.__post_init__(self)
        if not self.beta > 0:
            raise ConfigError(f"--beta must be > 0, got {self.beta}")
        if not (self.desirable_weight > 0 and self.undesirable_weight > 0):
            raise ConfigError("--desirable_weight and --undesirable_weight must be > 0")


@configclass
class FrozenRefConfig:
    """The frozen reference policy of DPO / KTO."""

    model_name_or_path: str | None = None
    """Reference weights; None: the policy's starting weights."""
    offload: bool = False
    """Keep the reference in CPU memory: its ZeRO-3 parameter shards (ZeRO param offload) under --ds.zero_stage 3, else the whole replica between uses."""
    precompute_enable: bool = False
    """Compute every reference log-prob once before training, then free the reference model."""

    def __post_init__(self) -> None:
        _check_model(self)


@configclass
class TrainedRoleConfig(OptimizerConfig):
    """A model PPO trains: placement + optimizer."""

    model_name_or_path: str | None = None
    """HF model name or local path to start from."""
    num_nodes: int = 1
    """Nodes of the trainer's ranks (the actor's DeepSpeed group; every other model runs in them too)."""
    num_gpus_per_node: int = 8
    """GPUs per node of the trainer's ranks: one rank per GPU."""

    def __post_init__(self) -> None:
        OptimizerConfig.__post_init__(self)
        _check_model(self)
        _check_placement(self)


@configclass
class PolicyConfig(TrainedRoleConfig):
    """PPO's actor: the policy being trained."""

    gradient_checkpointing_enable: bool = False
    """Recompute activations in the backward pass (actor and critic)."""
    gradient_checkpointing_reentrant: bool = False
    """Use the reentrant flavour of torch checkpointing."""
    aux_loss_coef: float = 0.0
    """Weight of the MoE load-balancing loss (0: off)."""
    policy_loss_type: Literal["ppo", "gspo", "gspo_token"] = "ppo"
    """ppo: token-level ratio clipping; gspo: GSPO's sequence ratio, back-propagated through its mean
    (OpenRLHF's; seq-mean-token-mean); gspo_token: GSPO-token, the sequence ratio with each token's own
    advantage in its gradient (any aggregation)."""
    eps_clip: float = 0.2
    """PPO clip range: ratios are clipped to [1 - eps, 1 + eps]."""
    eps_clip_low_high: tuple[float, float] | None = None
    """Asymmetric clip (low, high): ratios clipped to [1 - low, 1 + high]; None: (eps_clip, eps_clip)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens; None: off."""
    entropy_coef: float | None = None
    """Entropy bonus weight; 0 only logs the entropy; None: neither."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] | None = None
    """How per-token policy losses are averaged: over every token of the step, per sequence then over
    sequences, or summed per sequence then averaged over sequences (Dr. GRPO's constant normaliser);
    None: the loss type's own (seq-mean-token-mean for gspo, else token-mean)."""

    def __post_init__(self) -> None:
        TrainedRoleConfig.__post_init__(self)
        if not self.eps_clip > 0:
            raise ConfigError(f"--eps_clip must be > 0, got {self.eps_clip}")
        if self.eps_clip_low_high is not None and not all(e > 0 for e in self.eps_clip_low_high):
            raise ConfigError(f"--eps_clip_low_high must both be > 0, got {list(self.eps_clip_low_high)}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ConfigError(f"--dual_clip must be > 1, got {self.dual_clip}")
        if not self.aux_loss_coef >= 0:
            raise ConfigError(f"--aux_loss_coef must be >= 0, got {self.aux_loss_coef}")
        if self.policy_loss_type == "gspo" and self.loss_agg_mode not in (None, "seq-mean-token-mean"):
            raise ConfigError(f"--policy_loss_type gspo is a sequence-level loss (seq-mean-token-mean), got --loss_agg_mode "
                              f"{self.loss_agg_mode}: drop --loss_agg_mode, or use --policy_loss_type gspo_token")

    @property
    def aggregation(self) -> str:
        """The loss aggregation in effect (``loss_agg_mode``, else the loss type's own)."""
        if self.loss_agg_mode is not None:
            return self.loss_agg_mode
        return "seq-mean-token-mean" if self.policy_loss_type == "gspo" else "token-mean"

    @property
    def clip_low_high(self) -> tuple[float, float]:
        """(low, high) clip widths in effect."""
        return self.eps_clip_low_high or (self.eps_clip, self.eps_clip)


@configclass
class CriticConfig(TrainedRoleConfig):
    """PPO's value model (only with the gae advantage estimator).

    model_name_or_path None starts the critic, as OpenRLHF does, from the (first) reward model
    when rewards come from one, else (--reward.remote_url, an agent) from the actor's starting
    weights with a fresh value head; PPOConfig.critic_model_name_or_path gives the path in effect.
    """

    num_nodes: int | None = None
    """Nodes of the critic; None: the actor's. Another value than the actor's places the critic
    apart: treadle-launch / train_ppo_ray start a critic server there (``treadle-train critic``);
    with --critic.remote_url the server's ranks must number num_nodes x num_gpus_per_node."""
    num_gpus_per_node: int | None = None
    """GPUs per node of the critic; None: the actor's (as num_nodes)."""
    remote_url: str | None = None
    """A critic server (tcp://HOST:PORT of ``treadle-train critic --endpoint ...``, a DeepSpeed group
    on devices of its own) that values and trains the critic, so the trainer's ranks hold none;
    None: the critic trains in the ranks."""
    curve_dir: str = ""
    """CURVE client keys for a --critic.remote_url off loopback (client.key_secret, server.key)."""
    value_clip: float | None = 0.5
    """Value-loss clip range around the old values; None: unclipped."""
    freezing_steps: int = -1
    """Train only the critic for this many first steps (actor frozen) to warm it up; -1: off."""
    save_value_network: bool = False
    """Also export the critic at the end, in HF format (AutoModelForSequenceClassification, head
    --ds.value_head_prefix), to <--ckpt.output_dir>_critic as OpenRLHF does."""

    def __post_init__(self) -> None:
        TrainedRoleConfig.__post_init__(self)
        if self.value_clip is not None and not self.value_clip > 0:
            raise ConfigError(f"--value_clip must be > 0 (or None), got {self.value_clip}")
        if self.freezing_steps < -1:
            raise ConfigError(f"--freezing_steps must be -1 (off) or >= 0, got {self.freezing_steps}")
        if self.remote_url is not None:
            if not self.remote_url.startswith("tcp://"):
                raise ConfigError(f"--critic.remote_url {self.remote_url}: a critic server's ZeroMQ address, tcp://HOST:PORT")
            require_client_keys(self.remote_url, self.curve_dir, "--critic.curve_dir")
        elif self.curve_dir:
            raise ConfigError("--critic.curve_dir are keys for --critic.remote_url, which is not set")


@configclass
class RefConfig:
    """The frozen reference policy of the KL penalty (created only when algo.kl.init_coef > 0)."""

    model_name_or_path: str | None = None
    """Reference weights; None: the actor's starting weights."""
    num_nodes: int | None = None
    """Nodes of the reference; None: the actor's. The reference runs in the trainer's ranks beside
    the actor, or in a daemon of its own (--ref.remote_url); another value than the actor's is refused."""
    num_gpus_per_node: int | None = None
    """GPUs per node of the reference; None: the actor's (another value is refused, as num_nodes)."""
    offload: bool = False
    """Keep the reference in CPU memory: its ZeRO-3 parameter shards (ZeRO param offload) under --ds.zero_stage 3, else the whole replica between uses."""
    remote_url: str | None = None
    """A rollout daemon serving the reference (tcp://HOST:PORT of `treadle-rollout serve --backend hf
    --model REF`, on devices of its own) that scores the sampled tokens at the sampling temperature,
    so the trainer's ranks hold no reference; None: the reference runs in the ranks."""
    curve_dir: str = ""
    """CURVE client keys for a --ref.remote_url off loopback (client.key_secret, server.key)."""

    def __post_init__(self) -> None:
        _check_model(self)
        _check_placement(self)
        if self.remote_url is not None:
            if not self.remote_url.startswith("tcp://"):
                raise ConfigError(f"--ref.remote_url {self.remote_url}: a rollout daemon's ZeroMQ address, tcp://HOST:PORT")
            given = [f for f, on in (("--ref.model_name_or_path", self.model_name_or_path is not None),
                                     ("--ref.offload", self.offload)) if on]
            if given:
                raise ConfigError(f"{' and '.join(given)} with --ref.remote_url {self.remote_url}: the reference "
                                  "daemon holds and serves its own model; drop them")
            require_client_keys(self.remote_url, self.curve_dir, "--ref.curve_dir")
        elif self.curve_dir:
            raise ConfigError("--ref.curve_dir are keys for --ref.remote_url, which is not set")


def _check_prm_folder(path: str | None) -> None:
    """A local PRM folder must say where its steps end (``step_separator``, written by ``treadle-train prm``)."""
    if path == "":
        raise ConfigError("--reward.prm_model_name_or_path is empty: give a treadle-train prm output folder")
    if path is None:
        return
    config = Path(path) / "config.json"
    if config.is_file() and not json.loads(config.read_text()).get("step_separator"):
        raise ConfigError(f"--reward.prm_model_name_or_path {path}: its config.json has no step_separator, which "
                          "treadle-train prm records (a process reward model trained elsewhere: add the separator "
                          "its steps end with there, e.g. \"step_separator\": \"\\n\")")


@configclass
class RewardConfig:
    """Where rewards come from (a reward model, or a remote / Python reward) and how they are shaped."""

    model_name_or_path: str | None = None
    """Reward model(s), comma-separated; the first also initialises the critic."""
    prm_model_name_or_path: str | None = None
    """A process reward model (``treadle-train prm``): its score at each step separator of a
    response (sigmoid of its logit there) is added as a per-token reward on that token
    (``rl.prm``); gae, reinforce and reinforce_baseline only."""
    remote_url: str | None = None
    """Reward source(s), comma-separated: a .py file defining reward_func (or math / format / code),
    an HTTP endpoint (OpenRLHF's /get_reward), or a treadle-rewards daemon (tcp:// or ipc://)."""
    remote_reduce: Literal["sum", "mean", "spread"] = "sum"
    """How several --remote_url sources make one reward. sum / mean: every source scores every
    sample, reward and score are their sum / mean (sum: OpenRLHF's reward_fn, which combined its
    reward sources up to 0.6.2), each source's own in the metrics as reward/source<i> and
    score/source<i>; spread: the sources are replicas of one remote reward, each sample is scored
    by one of them in turn (OpenRLHF's meaning of a URL list since 0.6.3)."""
    timeout_s: float = 60.0
    """Limit of one call to a remote reward (reward daemon or URL)."""
    retry_s: float = 600.0
    """A remote reward that fails in a way that may pass (down, restarting, timed out, busy) is
    retried for this long before the sample counts as failed."""
    curve_dir: str = ""
    """CURVE client keys (client.key_secret + server.key, `treadle-keys generate`) for a
    `treadle-rewards serve` at tcp://; needed when it is not on loopback."""
    token: str | None = secret()
    """Bearer token sent to an HTTP reward URL (a `treadle-rewards serve --http.token`)."""
    token_file: str | None = None
    """Read that token from this file instead (keeps it out of `ps`)."""
    num_nodes: int | None = None
    """Nodes of the reward model; None: the actor's. It runs in the trainer's ranks beside the actor
    (a placement of its own is not implemented): another value than the actor's is refused."""
    num_gpus_per_node: int | None = None
    """GPUs per node of the reward model; None: the actor's (another value is refused, as num_nodes)."""
    offload: bool = False
    """Keep the reward model in CPU memory between uses: it visits the accelerator only while it scores."""
    normalize_enable: bool = False
    """Normalise reward-model scores with the running mean/std stored in the model."""
    clip_range: tuple[float, float] = (-10.0, 10.0)
    """Rewards are clipped to [low, high]."""
    overlong_buffer_len: float | None = None
    """DAPO overlong shaping: penalise responses within this many tokens of the limit; None: off."""
    overlong_penalty_factor: float = 1.0
    """Largest overlong penalty (reached at the length limit)."""
    stop_properly_penalty_coef: float | None = None
    """Truncated samples: >= 0 scales their reward by it (in [0, 1]); < 0 replaces it; None: off."""

    def __post_init__(self) -> None:
        _check_model(self)
        _check_placement(self)
        if not self.timeout_s > 0 or self.retry_s < 0:
            raise ConfigError(f"--reward.timeout_s must be > 0 and --reward.retry_s >= 0, got "
                              f"{self.timeout_s} and {self.retry_s}")
        for url in self.remote_urls:
            require_client_keys(url, self.curve_dir, "--reward.curve_dir")
        _check_prm_folder(self.prm_model_name_or_path)
        if self.token_file is not None and not Path(self.token_file).is_file():
            raise ConfigError(f"--reward.token_file {self.token_file} is not a file")
        low, high = self.clip_range
        if not low < high:
            raise ConfigError(f"--clip_range must be low < high, got {list(self.clip_range)}")
        if self.overlong_buffer_len is not None and not self.overlong_buffer_len > 0:
            raise ConfigError(f"--overlong_buffer_len must be > 0, got {self.overlong_buffer_len}")
        coef = self.stop_properly_penalty_coef
        if coef is not None and coef > 1:
            raise ConfigError(f"--stop_properly_penalty_coef must be <= 1 (a scale in [0, 1] or a negative reward), got {coef}")

    @property
    def model_paths(self) -> tuple[str, ...]:
        """The reward models, split."""
        return tuple(p.strip() for p in (self.model_name_or_path or "").split(",") if p.strip())

    @property
    def remote_urls(self) -> tuple[str, ...]:
        """The remote rewards, split."""
        return tuple(u.strip() for u in (self.remote_url or "").split(",") if u.strip())

    @property
    def bearer(self) -> str | None:
        """The HTTP bearer token: ``token_file``'s first line, else ``token``."""
        if self.token_file is not None:
            return Path(self.token_file).read_text().strip() or None
        return self.token

