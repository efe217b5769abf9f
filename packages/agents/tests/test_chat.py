"""ChatFormat: tokens of prompts and observations, and the turn boundary, token by token."""

from __future__ import annotations

import numpy as np
import pytest

from treadle.agents.chat import ChatFormat, TemplateError, load_template
from treadle.agents.envs.arithmetic import CALCULATOR_TOOL

IM_START, IM_END, EOT = 1, 2, 0  # ids of tools/tiny_model.py's special tokens


def test_encode_adds_nothing_and_parses_special_tokens(chat: ChatFormat) -> None:
    ids = chat.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert ids[0] == IM_START and IM_END in ids.tolist()
    assert chat.encode("hi").tolist() == chat.tokenizer("hi", add_special_tokens=False)["input_ids"]
    assert chat.encode("").shape == (0,) and chat.encode("").dtype == np.int32
    assert chat.decode(chat.encode("Higher. 42")) == "Higher. 42"


def test_prompt_ids_text_as_is_and_messages_through_the_template(chat: ChatFormat) -> None:
    text = "User: hi\nAssistant:"
    assert chat.prompt_ids(text).tolist() == chat.encode(text).tolist()
    msgs = [{"role": "user", "content": "Compute 1 + 1."}]
    rendered = chat.render(msgs, tools=[CALCULATOR_TOOL])
    assert rendered.startswith("<|im_start|>system\n# Tools") and rendered.endswith("<|im_start|>assistant\n")
    assert chat.prompt_ids(msgs, tools=[CALCULATOR_TOOL]).tolist() == chat.encode(rendered).tolist()


def test_continuation_after_a_stopped_turn(chat: ChatFormat) -> None:
    msgs = [{"role": "user", "content": "Higher."}]
    text = chat.continuation(msgs, last_token=IM_END, stopped=True)
    assert text == "\n<|im_start|>user\nHigher.<|im_end|>\n<|im_start|>assistant\n"
    # the turn's own <|im_end|> + this text is exactly what the template renders after the content
    full = chat.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": "A"}, *msgs])
    assert full.endswith("A<|im_end|>" + text)


def test_continuation_closes_a_cut_turn(chat: ChatFormat) -> None:
    text = chat.continuation([{"role": "user", "content": "go"}], last_token=300, stopped=False)
    assert text.startswith("<|im_end|>\n<|im_start|>user\ngo")
    assert chat.continuation([], last_token=IM_END, stopped=True) == "\n"


def test_continuation_of_tool_results_uses_the_tools_template(chat: ChatFormat) -> None:
    obs = [{"role": "tool", "content": "5"}, {"role": "tool", "content": "6"}]
    text = chat.continuation(obs, last_token=IM_END, stopped=True, tools=[CALCULATOR_TOOL])
    assert text == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n6\n"
                    "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    ids = chat.observation_ids(obs, last_token=IM_END, stopped=True, tools=[CALCULATOR_TOOL])
    assert ids.tolist() == chat.encode(text).tolist()
    assert chat.observation_ids("raw", last_token=IM_END, stopped=True).tolist() == chat.encode("raw").tolist()


def test_templates_that_cannot_continue_are_refused(chat: ChatFormat) -> None:
    # renders only the last message: a longer conversation is no extension of a shorter one
    last_only = "{{ messages[-1]['role'] + ': ' + messages[-1]['content'] }}"
    cf = ChatFormat(chat.tokenizer, last_only)
    with pytest.raises(TemplateError, match="drops assistant content|extension"):
        cf.continuation([{"role": "user", "content": "x"}], last_token=IM_END, stopped=True)
    with pytest.raises(TemplateError, match="neither a built-in"):
        load_template("no_such_template")
    assert load_template("") is None and "tool_call" in load_template("chatml_tools")
