"""``treadle-train prm``: process-reward-model training on step-labelled rows (``PRMConfig``).

The rows are TRL's ``PRMTrainer`` format (prompt, completions, labels; ``--data.step_separator``
after each step), or OpenRLHF's ``train_prm`` format with ``--data.placeholder_token`` (and
``--data.reward_tokens``): ``data.steps`` reads both. The model is the reward model's (a value head
on a causal LM's backbone, ``--ds.value_head_prefix``), read at each step's last token.
"""

from __future__ import annotations

from treadle.common.config import ConfigError, configclass
from treadle.trainer.config.ckpt import CheckpointConfig
from treadle.trainer.config.commands import _check_supervised
from treadle.trainer.config.data import TextDataConfig, _check_text, check_mixture
from treadle.trainer.config.deepspeed import DeepSpeedConfig
from treadle.trainer.config.eval import EvalConfig
from treadle.trainer.config.logger import LoggerConfig, WandbConfig
from treadle.trainer.config.model import ModelConfig
from treadle.trainer.config.optim import AdamConfig, OptimizerConfig
from treadle.trainer.config.train import TrainConfig


@configclass
class PRMDataConfig(TextDataConfig):
    """Step-labelled rows: TRL's (prompt, completions, labels), or OpenRLHF's (input with placeholders, label)."""

    dataset: str | None = None
    """Training dataset(s): HF names or local paths, comma-separated (required)."""
    dataset_probs: str | None = None
    """Mixing probabilities, one per dataset, comma-separated; None: uniform."""
    dataset_split: str = "train"
    """Split to read."""
    prompt_key: str = "prompt"
    """Row key of the problem (TRL's format)."""
    completions_key: str = "completions"
    """Row key of the list of steps (TRL's format)."""
    label_key: str = "labels"
    """Row key of the step labels: one per step (true/false, a number in [0, 1], or one of --data.reward_tokens)."""
    step_separator: str = "\n"
    """Text put after every step, whose last token carries the step's label (TRL's step_separator);
    stored in the exported model, where PPO's --reward.prm_model_name_or_path finds it."""
    input_key: str = "input"
    """Row key of the whole text with placeholder tokens (OpenRLHF's format; read with --data.placeholder_token)."""
    placeholder_token: str | None = None
    """OpenRLHF's format: the token closing each step inside --data.input_key's text (Math-Shepherd: ки);
    None: TRL's format."""
    reward_tokens: tuple[str, str] | None = None
    """OpenRLHF's string labels: (positive, negative), e.g. + -; needs --data.placeholder_token."""
    max_len: int = 1024
    """Longest prompt + steps in tokens; longer rows are truncated (a row left with no labelled step is dropped)."""

    def __post_init__(self) -> None:
        _check_text(self)
        check_mixture("--dataset", self.dataset, "--dataset_probs", self.dataset_probs)
        if self.apply_chat_template:
            raise ConfigError("--data.apply_chat_template: PRM rows are tokenised as raw text (prompt, then each step "
                              "and separator), as TRL's PRMTrainer; use --data.input_template to wrap the prompt")
        if not self.step_separator:
            raise ConfigError("--data.step_separator is empty: each step's label sits on its separator's last token")
        if self.reward_tokens is not None and self.placeholder_token is None:
            raise ConfigError("--data.reward_tokens names OpenRLHF's string labels, read only with "
                              "--data.placeholder_token (TRL's format labels steps true/false)")
        if self.reward_tokens is not None and self.reward_tokens[0] == self.reward_tokens[1]:
            raise ConfigError(f"--data.reward_tokens {list(self.reward_tokens)}: the positive and negative token are the same")
        keys = (self.input_key, self.label_key) if self.placeholder_token else (
            self.prompt_key, self.completions_key, self.label_key)
        if len(set(keys)) < len(keys):
            raise ConfigError(f"the row keys {list(keys)} must differ")
        if self.max_len < 2:
            raise ConfigError(f"--max_len must be >= 2, got {self.max_len}")

    @property
    def step_marker(self) -> str:
        """What closes a step in this data (the placeholder token, else the separator): stored with the model."""
        return self.placeholder_token or self.step_separator


@configclass
class PRMConfig(OptimizerConfig):
    """Process-reward-model training on step-labelled rows (binary cross-entropy per step)."""

    adam: AdamConfig = AdamConfig(lr=1e-6)
    """AdamW settings (OpenRLHF's train_prm default learning rate)."""
    actor: ModelConfig = ModelConfig()
    """The PRM being trained (also --model.*)."""
    data: PRMDataConfig = PRMDataConfig()
    """Training data."""
    train: TrainConfig = TrainConfig()
    """Loop shape."""
    ds: DeepSpeedConfig = DeepSpeedConfig()
    """DeepSpeed, precision, packing, LoRA, value-head name."""
    ckpt: CheckpointConfig = CheckpointConfig(path="./ckpt/checkpoints_prm")
    """Checkpoints."""
    logger: LoggerConfig = LoggerConfig(wandb=WandbConfig(project="treadle_prm"))
    """Metric logging."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation."""
    local_rank: int = -1
    """Set by the deepspeed launcher (--local_rank=N); torchrun uses LOCAL_RANK instead."""

    def __post_init__(self) -> None:
        _check_supervised(self)
