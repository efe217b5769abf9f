"""Step-labelled rows -> PRM samples: one token sequence whose targets are each step's last token.

Two row formats, as the two trainers users come from read them:

- TRL's ``PRMTrainer`` (the default): ``prompt`` (a string), ``completions`` (a list of step
  strings), ``labels`` (one bool per step). The sequence is prompt + step_1 + sep + step_2 + sep
  ... (each piece tokenised on its own, ``--data.step_separator`` after every step, the last
  included), and step k's label sits on the last token of the separator after it, as TRL's
  ``tokenize_row``. TRL prepends the tokenizer's BOS token; treadle does not (PPO scores the
  actor's own token ids, which carry a BOS only if the prompt's template puts one there).
- OpenRLHF's ``train_prm`` (``--data.placeholder_token`` set): ``input`` is the whole text with
  a placeholder token (Math-Shepherd's ``ки``) closing each step, ``label`` one label per
  placeholder, in order: a string among ``--data.reward_tokens`` (the first is the positive
  one) or a number in [0, 1] (a soft label). The text is tokenised whole; the placeholder must
  be one token of the tokenizer.

Truncation to ``--data.max_len`` keeps the first tokens and the labels of the steps whose last
token survived; a row with none left is dropped. Not here: the loss (``losses.prm``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from treadle.trainer.data.formatting import Formatter
from treadle.trainer.data.samples import Sample, TokenSeq
from treadle.trainer.data.sources import Row


def _step_label(row: Row, key: str, k: int, value: object, reward_tokens: tuple[str, str] | None) -> float:
    if isinstance(value, bool) or (isinstance(value, (int, float)) and 0 <= value <= 1):
        return float(value)
    if isinstance(value, str) and reward_tokens is not None and value in reward_tokens:
        return 1.0 if value == reward_tokens[0] else 0.0
    tokens = f"one of --data.reward_tokens {list(reward_tokens)}, " if reward_tokens else ""
    raise row.error(key, f"step {k}'s label {value!r:.40} is not {tokens}true/false or a number in [0, 1]")


def _labels(row: Row, key: str, steps: int, reward_tokens: tuple[str, str] | None) -> list[float]:
    values = row.get(key, list)
    if len(values) != steps:
        raise row.error(key, f"{len(values)} labels for {steps} steps")
    return [_step_label(row, key, k, v, reward_tokens) for k, v in enumerate(values)]


def _trl_row(row: Row, fmt: Formatter, *, prompt_key: str, completions_key: str, label_key: str,
             separator: list[int]) -> tuple[list[int], list[bool], list[float]]:
    ids = fmt.encode(fmt.prompt_text(row, prompt_key))
    target = [False] * len(ids)
    steps = row.get(completions_key, list)
    if not all(isinstance(s, str) for s in steps):
        raise row.error(completions_key, "expected a list of step strings")
    for step in steps:
        piece = fmt.encode(step) + separator
        ids += piece
        target += [False] * (len(piece) - 1) + [True]
    return ids, target, _labels(row, label_key, len(steps), None)


def _placeholder_row(row: Row, fmt: Formatter, *, input_key: str, label_key: str, placeholder: int,
                     reward_tokens: tuple[str, str] | None) -> tuple[list[int], list[bool], list[float]]:
    ids = fmt.encode(fmt.prompt_text(row, input_key))
    target = [t == placeholder for t in ids]
    return ids, target, _labels(row, label_key, sum(target), reward_tokens)


def _row(row: Row, fmt: Formatter, *, max_len: int, **kw: object) -> tuple[TokenSeq, tuple[float, ...]] | None:
    ids, target, labels = _placeholder_row(row, fmt, **kw) if "placeholder" in kw else _trl_row(row, fmt, **kw)
    first = int(target[0])  # a step ending at token 0 has no context to score it from (TokenSeq drops it)
    seq = TokenSeq.of(ids[:max_len], target[:max_len])
    return (seq, tuple(labels[first:first + seq.num_targets])) if seq.num_targets else None


def separator_ids(tokenizer: object, separator: str) -> list[int]:
    """The token ids of ``separator`` (no special tokens); ValueError when it encodes to none."""
    ids = list(tokenizer(separator, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError(f"the step separator {separator!r} encodes to no token")
    return ids


def step_samples(rows: Sequence[Row], fmt: Formatter, *, max_len: int, prompt_key: str, completions_key: str,
                 input_key: str, label_key: str, step_separator: str, placeholder_token: str | None,
                 reward_tokens: tuple[str, str] | None) -> tuple[list[Sample], int]:
    """(PRM samples, rows dropped for having no labelled step left after truncation)."""
    if placeholder_token is None:
        kw: dict[str, object] = dict(prompt_key=prompt_key, completions_key=completions_key, label_key=label_key,
                                     separator=separator_ids(fmt.tok, step_separator))
    else:
        from treadle.common.config import ConfigError  # noqa: PLC0415

        encoded = fmt.encode(placeholder_token)
        if len(encoded) != 1:
            raise ConfigError(f"--data.placeholder_token {placeholder_token!r} is not one token of the tokenizer "
                              f"(it encodes to {encoded})")
        placeholder = encoded[0]
        kw = dict(input_key=input_key, label_key=label_key, placeholder=placeholder, reward_tokens=reward_tokens)
    out = fmt.map(functools.partial(_row, fmt=fmt, max_len=max_len, **kw), rows)
    kept = [r for r in out if r is not None]
    return [Sample(seqs=(s,), index=i, step_labels=labels) for i, (s, labels) in enumerate(kept)], len(out) - len(kept)
