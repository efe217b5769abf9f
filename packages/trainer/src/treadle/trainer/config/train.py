"""The training loop's shape (the ``train`` group): batch sizes, epochs, seed, and for RL the
episode count, model colocation, asynchronous rollout and dynamic batching.

Batch sizes count samples: ``batch_size`` is global (one optimizer step), ``micro_batch_size``
is per GPU and forward pass. The loop itself lives in the trainers.
"""

from __future__ import annotations

from treadle.common.config import ConfigError, configclass


@configclass
class TrainConfig:
    """Loop settings of every recipe."""

    batch_size: int = 128
    """Global batch: samples per optimizer step, summed over data-parallel ranks."""
    micro_batch_size: int = 1
    """Samples per GPU per forward/backward pass (gradients accumulate up to batch_size)."""
    max_epochs: int = 1
    """Passes over the training data (RL: over each rollout batch)."""
    seed: int = 42
    """Seed of data order, initialisation and sampling."""
    full_determinism_enable: bool = False
    """Deterministic kernels and ordering (slower) for reproducible runs."""
    dynamic_batch_enable: bool = False
    """Form micro-batches by token budget (max_tokens_per_gpu) instead of sample count (needs ds.packing_samples)."""
    max_tokens_per_gpu: int = 16192
    """Token budget of a training micro-batch with dynamic batching."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "micro_batch_size", "max_epochs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size % self.micro_batch_size:
            raise ConfigError(
                f"--batch_size {self.batch_size} is not a multiple of --micro_batch_size {self.micro_batch_size}"
            )
        if self.max_tokens_per_gpu < 1:
            raise ConfigError(f"--max_tokens_per_gpu must be >= 1, got {self.max_tokens_per_gpu}")


_EMA_BETA = 0.992


@configclass
class RLTrainConfig(TrainConfig):
    """Loop settings of PPO-family RL."""

    num_episodes: int = 1
    """Passes over the prompt dataset."""
    colocate_all: bool = False
    """Actor, critic, reference, reward and the vLLM engines share the same GPUs (hybrid engine).
    With async_enable only the trainer's models do (as always): the engines get GPUs of their own
    and generate while the trainer trains (OpenRLHF's behaviour; a warning says so)."""
    colocate_actor_ref: bool = False
    """Actor and reference share GPUs."""
    colocate_critic_reward: bool = False
    """Critic and reward model share GPUs."""
    async_enable: bool = False
    """Generate the next rollout batch while training on the current one."""
    async_queue_size: int = 1
    """Async staleness bound: rollout batches generated ahead of training (larger: more off-policy)."""
    partial_rollout_enable: bool = False
    """Async only: update weights mid-generation instead of waiting (samples may mix policy versions)."""
    agent_func_path: str | None = None
    """Python file of a (multi-turn) agent executor; rewards then come from the agent."""
    agent_cmd: str | None = None
    """Command of an agent program, run once per episode: it reads the episode as a JSON line on
    stdin, talks to the model through OpenAI's chat API at $OPENAI_BASE_URL (treadle's gateway,
    recording the exact tokens), and prints {"reward": ...} last; rewards then come from it."""
    agent_max_procs: int = 64
    """Agent programs (--agent_cmd) running at once."""
    enable_ema: bool = False
    """Keep an exponential moving average of the actor's weights and export it (final model and
    --ckpt.save_hf copies) instead of the actor; the engines still sample from the actor
    (OpenRLHF's --train.enable_ema; ``models.ema``)."""
    ema_beta: float = _EMA_BETA
    """EMA decay, in [0, 1]: after each actor optimizer step ema = beta * ema + (1 - beta) * weights
    (OpenRLHF's default 0.992); only with enable_ema."""
    max_restarts: int = 0
    """Restarts of a failed run from its last checkpoint, up to this many: the launcher does them
    (train_ppo_ray, treadle-launch, as its --max_restarts), the trainer alone when only it failed;
    needs --ckpt.save_steps. treadle-train ppo on its own refuses it (nothing there could restart it)."""

    def __post_init__(self) -> None:
        TrainConfig.__post_init__(self)
        if self.num_episodes < 1:
            raise ConfigError(f"--num_episodes must be >= 1, got {self.num_episodes}")
        if self.async_queue_size < 1:
            raise ConfigError(f"--async_queue_size must be >= 1, got {self.async_queue_size}")
        if self.agent_max_procs < 1:
            raise ConfigError(f"--agent_max_procs must be >= 1, got {self.agent_max_procs}")
        if self.partial_rollout_enable and not self.async_enable:
            raise ConfigError("--partial_rollout_enable needs --async_enable")
        if self.max_restarts < 0:
            raise ConfigError(f"--max_restarts must be >= 0, got {self.max_restarts}")
        if not 0.0 <= self.ema_beta <= 1.0:
            raise ConfigError(f"--ema_beta must be in [0, 1], got {self.ema_beta}")
        if self.ema_beta != _EMA_BETA and not self.enable_ema:
            raise ConfigError(f"--ema_beta {self.ema_beta} is the decay of --enable_ema's average, which is off: "
                              "add --enable_ema or drop --ema_beta")
