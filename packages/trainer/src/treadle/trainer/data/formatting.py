"""Rows -> token sequences with target masks, for every recipe.

Text mode wraps the input in ``--data.input_template`` (``User: {}\\nAssistant: ``) or takes it
raw, appends the answer and the EOS token, and learns the answer. Chat mode
(``--data.apply_chat_template``) renders messages with the tokenizer's chat template; the tokens
of an assistant turn are those the template adds between the conversation rendered up to that
turn with a generation prompt and rendered including it (so any template works, with or without
``{% generation %}`` markers; a template that re-renders earlier turns differently is an error).
Sequences are tokenised piecewise and concatenated, never re-tokenised as one string.

Rows are tokenised one by one by a per-row function (``_sft_row`` ...), in the Formatter's
``workers`` processes (``--data.dataloader_num_workers``, ``data.workers``); what needs the
whole dataset (KTO's mismatched pairs, sample numbering) happens afterwards, in row order, so
the samples are the same for any worker count.

Not here: loading rows (``sources``) and batching (``batching``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from treadle.trainer.data.samples import Sample, TokenSeq
from treadle.trainer.data.sources import Row
from treadle.trainer.data.workers import map_rows

T = TypeVar("T")


class Formatter:
    """Turns row values into token ids with one tokenizer and one text convention, in ``workers``
    processes (0: this one)."""

    def __init__(self, tokenizer: Any, *, input_template: str | None, apply_chat_template: bool,
                 workers: int = 0) -> None:
        self.tok = tokenizer
        self.template = input_template
        self.chat_mode = apply_chat_template
        self.workers = workers
        if apply_chat_template and not getattr(tokenizer, "chat_template", None):
            from treadle.common.config import ConfigError  # noqa: PLC0415

            raise ConfigError("--data.apply_chat_template: the tokenizer has no chat template (set --data.tokenizer_chat_template)")

    def map(self, fn: Callable[[Row], T], rows: Sequence[Row]) -> list[T]:
        """``[fn(r) for r in rows]`` in this formatter's worker processes (``data.workers``)."""
        return map_rows(fn, rows, workers=self.workers)

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def render(self, messages: list[dict], *, generation_prompt: bool = False) -> list[int]:
        out = self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt,
                                           return_dict=False)
        return list(out)

    def messages(self, row: Row, key: str, role: str = "user") -> list[dict]:
        """The value of ``key`` as chat messages (a string becomes one ``role`` message)."""
        value = row.get(key, (str, list))
        if isinstance(value, str):
            return [{"role": role, "content": value}]
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise row.error(key, f"message {i} must be a dict with string 'role' and 'content', got {m!r:.60}")
        return list(value)

    def prompt_text(self, row: Row, key: str) -> str:
        value = row.get(key)
        return self.template.format(value) if self.template else value

    def turns(self, row: Row, key: str, msgs: list[dict], learn_all: bool) -> TokenSeq:
        """A conversation whose assistant turns (all, or only the last) are targets."""
        assistant = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if not assistant:
            raise row.error(key, "the conversation has no assistant message to learn")
        ids = self.render(msgs)
        target = [False] * len(ids)
        for i in assistant if learn_all else assistant[-1:]:
            start = len(self.render(msgs[:i], generation_prompt=True)) if i else 0
            end = self.render(msgs[: i + 1])
            if end != ids[: len(end)]:
                raise row.error(key, "the chat template renders a conversation prefix differently from the whole")
            target[start:len(end)] = [True] * (len(end) - start)
        return TokenSeq.of(ids, target)

    def prompt_and_answer(self, row: Row, prompt_key: str | None, answer_key: str) -> TokenSeq:
        """Prompt (optional) followed by the answer; the answer's tokens are the targets."""
        if not self.chat_mode:
            prompt = self.encode(self.prompt_text(row, prompt_key)) if prompt_key else []
            answer = self.encode(row.get(answer_key)) + [self.tok.eos_token_id]
            return TokenSeq.of(prompt + answer, [False] * len(prompt) + [True] * len(answer))
        if prompt_key is None:  # the answer is a whole conversation ending with the assistant's turn
            msgs = self.messages(row, answer_key)
            if msgs[-1]["role"] != "assistant":
                raise row.error(answer_key, "the conversation must end with the assistant's answer")
            return self.turns(row, answer_key, msgs, learn_all=False)
        msgs = self.messages(row, prompt_key)
        return self.turns(row, answer_key, msgs + self.messages(row, answer_key, role="assistant"), learn_all=False)


def _kept(seq: TokenSeq, max_len: int) -> TokenSeq | None:
    seq = seq.truncated(max_len)
    return seq if seq.num_targets else None


def _sft_row(row: Row, fmt: Formatter, *, input_key: str, output_key: str | None, multiturn: bool, pretrain: bool,
             max_len: int) -> TokenSeq | None:
    """One SFT row's sequence, truncated; None when no target token is left."""
    if output_key is not None:
        seq = fmt.prompt_and_answer(row, input_key, output_key)
    elif fmt.chat_mode:
        seq = fmt.turns(row, input_key, fmt.messages(row, input_key), learn_all=multiturn)
    else:  # pretraining text
        ids = fmt.encode(row.get(input_key)) + [fmt.tok.eos_token_id]
        seq = TokenSeq.of(ids, [True] * len(ids))
    if pretrain:
        seq = TokenSeq.of(seq.ids.tolist(), [True] * len(seq.ids))
    return _kept(seq, max_len)


def sft_samples(rows: Sequence[Row], fmt: Formatter, *, input_key: str, output_key: str | None,
                multiturn: bool, pretrain: bool, max_len: int) -> tuple[list[Sample], int]:
    """(samples, rows dropped for having no target token left after truncation)."""
    seqs = fmt.map(functools.partial(_sft_row, fmt=fmt, input_key=input_key, output_key=output_key,
                                     multiturn=multiturn, pretrain=pretrain, max_len=max_len), rows)
    kept = [s for s in seqs if s is not None]
    return [Sample(seqs=(s,), index=i) for i, s in enumerate(kept)], len(seqs) - len(kept)


def _pair_row(row: Row, fmt: Formatter, *, prompt_key: str | None, chosen_key: str, rejected_key: str,
              margin_key: str | None, max_len: int) -> tuple[TokenSeq, TokenSeq, float] | None:
    """(chosen, rejected, margin) of one preference row; None when either has no target left."""
    chosen = _kept(fmt.prompt_and_answer(row, prompt_key, chosen_key), max_len)
    rejected = _kept(fmt.prompt_and_answer(row, prompt_key, rejected_key), max_len)
    if chosen is None or rejected is None:
        return None
    return chosen, rejected, float(row.get(margin_key, (int, float))) if margin_key else 0.0


def pair_samples(rows: Sequence[Row], fmt: Formatter, *, prompt_key: str | None, chosen_key: str,
                 rejected_key: str, margin_key: str | None, max_len: int) -> tuple[list[Sample], int]:
    """(chosen/rejected samples, rows dropped); the margin is read only when ``margin_key`` is given."""
    pairs = fmt.map(functools.partial(_pair_row, fmt=fmt, prompt_key=prompt_key, chosen_key=chosen_key,
                                      rejected_key=rejected_key, margin_key=margin_key, max_len=max_len), rows)
    kept = [p for p in pairs if p is not None]
    return ([Sample(seqs=(c, r), index=i, margin=m) for i, (c, r, m) in enumerate(kept)],
            len(pairs) - len(kept))


def _label(row: Row, key: str) -> bool:
    value = row.get(key, (bool, int))
    if value not in (0, 1):
        raise row.error(key, f"expected true/false or 1/0, got {value!r}")
    return bool(value)


def _kto_row(row: Row, fmt: Formatter, *, input_key: str, output_key: str,
             label_key: str) -> tuple[Any, Any, bool]:
    """(prompt ids, answer ids, desirable) of one KTO row (pairing needs every row: ``kto_samples``)."""
    seq = fmt.prompt_and_answer(row, input_key, output_key)
    start = int(seq.target.argmax()) if seq.num_targets else len(seq.ids)
    return seq.ids[:start], seq.ids[start:], _label(row, label_key)


def kto_samples(rows: Sequence[Row], fmt: Formatter, *, input_key: str, output_key: str, label_key: str,
                max_len: int) -> tuple[list[Sample], int]:
    """KTO samples: (prompt_i + answer_i, prompt_i + answer_{i+1}) and the label of row i.

    The second sequence pairs each prompt with the next kept row's answer (cyclically): the
    mismatched pairs from which KTO estimates its KL baseline.
    """
    parts = fmt.map(functools.partial(_kto_row, fmt=fmt, input_key=input_key, output_key=output_key,
                                      label_key=label_key), rows)
    out, dropped = [], 0
    kept_parts = [p for p in parts if len(p[1])]
    for i, (prompt, answer, label) in enumerate(kept_parts):
        other = kept_parts[(i + 1) % len(kept_parts)][1]
        seqs = [_kept(TokenSeq.of([*prompt, *a], [False] * len(prompt) + [True] * len(a)), max_len)
                for a in (answer, other)]
        if seqs[0] is None or seqs[1] is None:
            dropped += 1
            continue
        out.append(Sample(seqs=(seqs[0], seqs[1]), index=len(out), desirable=label))
    return out, dropped + len(parts) - len(kept_parts)
