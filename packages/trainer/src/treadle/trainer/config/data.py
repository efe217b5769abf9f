"""Datasets and how their rows become token sequences (the ``data`` group), one class per recipe.

SFT reads (input, output) rows, reward-model / DPO training reads (prompt, chosen, rejected)
rows, PPO reads prompts (+ labels for rule rewards). Several datasets mix by probabilities:
``--data.dataset a,b,c --data.dataset_probs 0.2,0.3,0.5``. Loading and tokenising is the
trainer's dataset module's job.
"""

from __future__ import annotations

from typing import Annotated, Any

from treadle.common.config import ConfigError, alias, configclass

_PROB_TOLERANCE = 1e-6


def split_list(spec: str | None) -> tuple[str, ...]:
    """``"a, b,c"`` -> ``("a", "b", "c")``; None or empty -> ``()``."""
    return tuple(part.strip() for part in (spec or "").split(",") if part.strip())


def check_mixture(datasets_flag: str, datasets: str | None, probs_flag: str, probs: str | None) -> tuple[float, ...]:
    """The mixing probabilities: one per dataset, each >= 0, summing to 1 (ConfigError otherwise)."""
    names = split_list(datasets)
    if probs is None:
        return tuple(1.0 / len(names) for _ in names) if names else ()
    try:
        values = tuple(float(p) for p in split_list(probs))
    except ValueError:
        raise ConfigError(f"{probs_flag} must be comma-separated numbers, got {probs!r}") from None
    if len(values) != len(names):
        raise ConfigError(
            f"{probs_flag} {probs!r} gives {len(values)} probabilities for {len(names)} datasets in {datasets_flag}"
        )
    if any(not v >= 0 for v in values) or abs(sum(values) - 1.0) > _PROB_TOLERANCE:
        raise ConfigError(f"{probs_flag} {probs!r} must be >= 0 and sum to 1 (sum is {sum(values):g})")
    return values


def _check_text(cfg: Any) -> None:
    template = cfg.input_template
    if template is not None and "{}" not in template:
        raise ConfigError(f"--input_template {template!r} has no '{{}}' where the input goes")
    if template is not None and cfg.apply_chat_template:
        raise ConfigError("--input_template and --apply_chat_template both set: the chat template would win; pass one")
    if cfg.max_samples < 1:
        raise ConfigError(f"--max_samples must be >= 1, got {cfg.max_samples}")
    if cfg.dataloader_num_workers < 0:
        raise ConfigError(f"--dataloader_num_workers must be >= 0, got {cfg.dataloader_num_workers}")


@configclass
class TextDataConfig:
    """How rows become text (shared by every recipe)."""

    input_template: str | None = None
    """Template wrapping the input, with {} where it goes (e.g. User: {}\\nAssistant: ); None: raw."""
    apply_chat_template: bool = False
    """Format rows with the tokenizer's chat template (inputs are lists of messages)."""
    tokenizer_chat_template: str | None = None
    """A Jinja chat template that replaces the tokenizer's own."""
    max_samples: int = 1_000_000
    """Use at most this many rows of the (mixed) training data."""
    disable_fast_tokenizer: bool = False
    """Load the slow (Python) tokenizer."""
    dataloader_num_workers: int = 0
    """Processes that tokenise the dataset before training (one rank per host tokenises; the others read its cache); 0: the trainer's own process. The samples are the same for any count."""

    def __post_init__(self) -> None:
        _check_text(self)


@configclass
class SFTDataConfig(TextDataConfig):
    """SFT rows: an input and the output to learn."""

    dataset: str | None = None
    """Training dataset(s): HF names or local paths, comma-separated (required)."""
    dataset_probs: str | None = None
    """Mixing probabilities, one per dataset, comma-separated; None: uniform."""
    dataset_split: str = "train"
    """Split to read."""
    input_key: str = "input"
    """Row key of the input (a string, or messages with apply_chat_template)."""
    output_key: str | None = None
    """Row key of the target output; None: the input holds the whole conversation."""
    multiturn: bool = False
    """Learn every assistant turn of a conversation (needs apply_chat_template)."""
    max_len: int = 2048
    """Longest sample in tokens; longer ones are truncated (a sample left without target tokens is dropped)."""

    def __post_init__(self) -> None:
        _check_text(self)
        check_mixture("--dataset", self.dataset, "--dataset_probs", self.dataset_probs)
        if self.multiturn and not self.apply_chat_template:
            raise ConfigError("--multiturn needs --apply_chat_template")
        if self.max_len < 1:
            raise ConfigError(f"--max_len must be >= 1, got {self.max_len}")


@configclass
class PreferenceDataConfig(TextDataConfig):
    """Preference rows (reward models, DPO-family): a prompt with a chosen and a rejected answer."""

    dataset: str | None = None
    """Training dataset(s): HF names or local paths, comma-separated (required)."""
    dataset_probs: str | None = None
    """Mixing probabilities, one per dataset, comma-separated; None: uniform."""
    dataset_split: str = "train"
    """Split to read."""
    prompt_key: str | None = None
    """Row key of the prompt; None: the prompt is inside chosen/rejected."""
    chosen_key: Annotated[str, alias("--chosen_key")] = "chosen"
    """Row key of the preferred answer (also --chosen_key, as in OpenRLHF's README)."""
    rejected_key: Annotated[str, alias("--rejected_key")] = "rejected"
    """Row key of the dispreferred answer (also --rejected_key, as in OpenRLHF's README)."""
    margin_key: str = "margin"
    """Row key of the per-pair margin (read only with the reward model's margin loss)."""
    max_len: int = 512
    """Longest prompt + answer in tokens; longer sequences are truncated."""

    def __post_init__(self) -> None:
        _check_text(self)
        check_mixture("--dataset", self.dataset, "--dataset_probs", self.dataset_probs)
        if self.chosen_key == self.rejected_key:
            raise ConfigError(f"--chosen_key and --rejected_key are both {self.chosen_key!r}")
        if self.max_len < 1:
            raise ConfigError(f"--max_len must be >= 1, got {self.max_len}")


@configclass
class KTODataConfig(TextDataConfig):
    """KTO rows: a prompt, one answer, and whether that answer is desirable (unpaired feedback)."""

    dataset: str | None = None
    """Training dataset(s): HF names or local paths, comma-separated (required)."""
    dataset_probs: str | None = None
    """Mixing probabilities, one per dataset, comma-separated; None: uniform."""
    dataset_split: str = "train"
    """Split to read."""
    input_key: str = "input"
    """Row key of the prompt (a string, or messages with apply_chat_template)."""
    output_key: str = "output"
    """Row key of the answer."""
    label_key: str = "label"
    """Row key of the desirability label (true / false, or 1 / 0)."""
    max_len: int = 512
    """Longest prompt + answer in tokens; longer sequences are truncated."""

    def __post_init__(self) -> None:
        _check_text(self)
        check_mixture("--dataset", self.dataset, "--dataset_probs", self.dataset_probs)
        if len({self.input_key, self.output_key, self.label_key}) < 3:
            raise ConfigError("--input_key, --output_key and --label_key must be three different keys")
        if self.max_len < 1:
            raise ConfigError(f"--max_len must be >= 1, got {self.max_len}")


@configclass
class PromptDataConfig(TextDataConfig):
    """RL prompts, with optional labels for rule-based rewards."""

    prompt_dataset: str | None = None
    """Prompt dataset(s): HF names or local paths, comma-separated (required)."""
    prompt_probs: str | None = None
    """Mixing probabilities, one per prompt dataset, comma-separated; None: uniform."""
    prompt_split: str = "train"
    """Split to read."""
    input_key: str = "input"
    """Row key of the prompt."""
    label_key: str | None = None
    """Row key of the label handed to reward functions and agents."""
    prompt_max_len: Annotated[int, alias("--prompt_max_len")] = 1024
    """Longest prompt in tokens (also --prompt_max_len, as in OpenRLHF's README)."""
    max_len: int | None = None
    """Longest prompt + response in tokens; None: prompt_max_len + rollout.max_new_tokens."""
    max_samples: int = 100_000_000
    """Use at most this many prompts."""

    def __post_init__(self) -> None:
        _check_text(self)
        if self.dataloader_num_workers:
            raise ConfigError(f"--dataloader_num_workers {self.dataloader_num_workers}: treadle-train ppo tokenises no "
                              "data itself (prompts go to the rollout engines as text or messages, which tokenise "
                              "them), so there is nothing for data-loading workers to do; drop the flag")
        check_mixture("--prompt_dataset", self.prompt_dataset, "--prompt_probs", self.prompt_probs)
        if self.prompt_max_len < 1:
            raise ConfigError(f"--prompt_max_len must be >= 1, got {self.prompt_max_len}")
        if self.max_len is not None and not self.max_len > self.prompt_max_len:
            raise ConfigError(
                f"--max_len {self.max_len} leaves no room to generate after --prompt_max_len {self.prompt_max_len}"
            )
