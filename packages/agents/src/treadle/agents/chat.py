"""Text <-> tokens at the edges of an episode: prompts, observations, and the turn boundary.

The rule is that tokens the policy sampled are never re-tokenized: an episode's token list is
the prompt's tokens, then for each turn the sampled ids exactly as the engine returned them,
then the observation's ids. Only text that an environment (or a chat client) wrote is
tokenized, always on its own and with ``add_special_tokens=False`` (no BOS in mid-sequence);
special-token text in it (``<|im_start|>``) becomes the special token.

The boundary after a turn, for chat-message observations (``continuation``): the template
renders an assistant turn as ``header + content + end`` (ChatML: ``end = "<|im_end|>\\n"``),
but the policy's tokens stop at its stop token. The text appended is therefore

    closing  = end, minus the stop token's text when the turn ended with that stop token
               (ChatML: "\\n"; a turn cut by max_tokens gets the whole end: "<|im_end|>\\n")
    delta    = render(base + new, add_generation_prompt) minus render(base)

with ``base`` a fixed [user, assistant(SENTINEL)] conversation, so the template's own system
prompt, tool header and turn markup are produced exactly as it would for a full conversation.
Templates whose rendering of a longer conversation does not extend that of a shorter one
(some strip reasoning from earlier turns) cannot give a delta: ``ChatFormat`` raises
``TemplateError`` and such environments should return text observations.

Not here: sampling (``sampler``), trajectories (``builder``). transformers is imported only by
``ChatFormat.load``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from treadle.agents.api import Message, Observation

SENTINEL = "\u2063treadle-turn-sentinel\u2063"  # invisible separator: no real content contains it
_BASE: list[Message] = [{"role": "user", "content": "?"}, {"role": "assistant", "content": SENTINEL}]
BUILTIN_TEMPLATES = ("chatml_tools",)
"""Templates shipped in treadle/agents/templates (``<name>.jinja``)."""


class TemplateError(ValueError):
    """The chat template cannot render what was asked (or not as a continuation)."""


def refuse_non_text(content: Sequence[Any], where: str) -> None:
    """``TemplateError`` unless every part of a list ``content`` is ``{"type": "text", "text": str}``.

    treadle is text-only: image (vision) and audio parts are refused by name rather than dropped,
    so that a multi-modal prompt never trains on a conversation missing its images.
    """
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else type(p).__name__
        if kind == "text" and isinstance(p.get("text"), str):
            continue
        what = "vision (image) input" if kind in ("image_url", "image", "input_image") else f"{kind!r} content"
        raise TemplateError(f"{where}: content part {j} is {what}: treadle is text-only, multi-modal prompts "
                            "(vision, audio) are not supported; send text parts only")


def load_template(ref: str) -> str | None:
    """Template text for ``ref``: "" -> None (the tokenizer's own), a built-in name, or a file path."""
    if not ref:
        return None
    if ref in BUILTIN_TEMPLATES:
        return resources.files("treadle.agents").joinpath("templates", f"{ref}.jinja").read_text(encoding="utf-8")
    path = Path(ref)
    if not path.is_file():
        raise TemplateError(f"chat template {ref!r} is neither a built-in ({', '.join(BUILTIN_TEMPLATES)}) nor a file")
    return path.read_text(encoding="utf-8")


def _tools_key(tools: Sequence[dict[str, Any]] | None) -> str:
    return json.dumps(tools, sort_keys=True) if tools else ""


class ChatFormat:
    """A tokenizer plus a chat template: encode, decode, render, continue a conversation."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        """``tokenizer``: a transformers tokenizer; ``chat_template``: template text (None: its own)."""
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._ends: dict[str, tuple[str, str]] = {}  # tools key -> (assistant turn end, base text)

    @classmethod
    def load(cls, path: str | Path, chat_template: str = "") -> ChatFormat:
        """The tokenizer saved in ``path`` (a model folder) and ``load_template(chat_template)``."""
        from transformers import AutoTokenizer  # noqa: PLC0415  (heavy: only where a tokenizer is built)

        return cls(AutoTokenizer.from_pretrained(str(path)), load_template(chat_template))

    # ------------------------------------------------------------------ tokens

    def encode(self, text: str) -> np.ndarray:
        """int32 [T]: ``text`` tokenized on its own, no special tokens added."""
        ids = self.tokenizer.encode(text, add_special_tokens=False) if text else []
        return np.asarray(ids, dtype=np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included."""
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False)

    # ------------------------------------------------------------------ templates

    def render(self, messages: Sequence[Message], *, tools: Sequence[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages`` (text, not tokens)."""
        for i, m in enumerate(messages):
            if isinstance(m, dict) and isinstance(m.get("content"), list):
                refuse_non_text(m["content"], f"messages[{i}]")
        kw: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
        if tools:
            kw["tools"] = list(tools)
        if self.chat_template is not None:
            kw["chat_template"] = self.chat_template
        try:
            return self.tokenizer.apply_chat_template(list(messages), **kw)
        except Exception as e:  # jinja errors, templates that reject a role, ...
            raise TemplateError(f"the chat template could not render {len(messages)} messages: {e}") from e

    def prompt_ids(self, prompt: Observation, *, tools: Sequence[dict[str, Any]] | None = None) -> np.ndarray:
        """int32 [P]: a text prompt tokenized as is, or messages rendered with the generation prompt."""
        text = prompt if isinstance(prompt, str) else self.render(prompt, tools=tools, add_generation_prompt=True)
        return self.encode(text)

    def _end(self, tools: Sequence[dict[str, Any]] | None) -> tuple[str, str]:
        """(the text a rendered assistant turn has after its content, the rendered base conversation)."""
        key = _tools_key(tools)
        if key not in self._ends:
            base = self.render(_BASE, tools=tools, add_generation_prompt=False)
            at = base.rfind(SENTINEL)
            if at < 0:
                raise TemplateError("the chat template drops assistant content; use text observations")
            self._ends[key] = (base[at + len(SENTINEL):], base)
        return self._ends[key]

    def continuation(self, messages: Sequence[Message], *, last_token: int | None, stopped: bool,
                     tools: Sequence[dict[str, Any]] | None = None) -> str:
        """Text to append after an assistant turn so that ``messages`` follow it, then the
        generation prompt (see the module docstring for the boundary)."""
        end, base = self._end(tools)
        closing = end
        if stopped and last_token is not None:
            stop_text = self.token_text(last_token)
            if stop_text and end.startswith(stop_text):
                closing = end[len(stop_text):]
        if not messages:
            return closing
        full = self.render([*_BASE, *messages], tools=tools, add_generation_prompt=True)
        if not full.startswith(base):
            raise TemplateError("the chat template does not render a longer conversation as an extension "
                                "of a shorter one; the environment must return text observations")
        return closing + full[len(base):]

    def observation_ids(self, observation: Observation, *, last_token: int | None, stopped: bool,
                        tools: Sequence[dict[str, Any]] | None = None) -> np.ndarray:
        """int32 [O]: tokens of an observation appended after a turn (text: as is)."""
        if isinstance(observation, str):
            return self.encode(observation)
        return self.encode(self.continuation(observation, last_token=last_token, stopped=stopped, tools=tools))
