"""The gateway's tokenizer work: refused past ``max_tokenize_chars`` (413 naming the limit and the
size), and done beside the event loop, never on it, so other requests are served meanwhile.

A stand-in tokenizer (words -> ids) records the thread it runs on and can be made to block, so
the test needs no model and no rollout daemon (none of these routes asks the pool anything).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import aiohttp
import pytest

from treadle.agents.chat import ChatFormat
from treadle.agents.gateway.config import GatewayConfig
from treadle.agents.gateway.server import Gateway, text_chars
from treadle.common.config import ConfigError

LIMIT = 1000


class WordTokenizer:
    """One id per word (its length); "BLOCK" waits until ``release`` is set."""

    def __init__(self) -> None:
        self.threads: list[int] = []
        self.blocked = threading.Event()
        self.release = threading.Event()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.threads.append(threading.get_ident())
        if "BLOCK" in text:
            self.blocked.set()
            assert self.release.wait(30), "the test never released the tokenizer"
        return [len(w) for w in text.split()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.threads.append(threading.get_ident())
        return " ".join("w" * i for i in ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], *, tokenize: bool,
                            add_generation_prompt: bool, **kw: Any) -> str:
        text = " ".join(f"<{m['role']}> {m.get('content') or ''}" for m in messages)
        return text + (" <assistant>" if add_generation_prompt else "")


def _endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"  # nobody serves it: these routes never ask


async def _post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url, json=body) as r:
        return r.status, await r.json()


@pytest.mark.timeout(60)
def test_over_limit_text_gets_413_and_tokenizing_never_blocks_the_loop() -> None:
    tok = WordTokenizer()

    async def main() -> None:
        cfg = GatewayConfig(model="fake", port=0, rollout=_endpoint(), max_tokenize_chars=LIMIT)
        gw = Gateway(cfg, chat=ChatFormat(tok))
        url = await gw.start()
        try:
            async with aiohttp.ClientSession() as http:
                await refusals(http, url)
                assert tok.threads == []  # refused before the tokenizer saw anything
                await served_beside_a_busy_tokenizer(http, url, tok)
        finally:
            await gw.close()

    asyncio.run(main())
    assert tok.threads and threading.get_ident() not in tok.threads  # the loop ran on this thread


async def refusals(http: aiohttp.ClientSession, url: str) -> None:
    over = "x" * (LIMIT + 1)
    for path, body, what in [
        ("/tokenize", {"prompt": over}, "characters of text to tokenize"),
        ("/tokenize", {"messages": [{"role": "user", "content": over}]}, "characters of text to tokenize"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": over}]}, "characters of text"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "tools": [{"type": "function", "function": {"name": over}}]}, "characters"),
        ("/detokenize", {"tokens": [1] * (LIMIT + 1)}, "tokens to detokenize"),
    ]:
        status, out = await _post(http, url + path, body)
        err = out["error"]
        assert (status, err["code"]) == (413, "text_too_long"), (path, out)
        assert what in err["message"] and f"at most {LIMIT:,}" in err["message"]
        assert "--max_tokenize_chars" in err["message"] and "1,0" in err["message"]  # the size: 1,001 or more


async def served_beside_a_busy_tokenizer(http: aiohttp.ClientSession, url: str, tok: WordTokenizer) -> None:
    busy = asyncio.ensure_future(_post(http, url + "/tokenize", {"prompt": "BLOCK two three"}))
    while not tok.blocked.is_set():  # until the tokenizer is inside encode (polled: no clock involved)
        assert not busy.done(), busy.result()
        await asyncio.sleep(0.01)
    # The tokenizer thread is stuck; the loop still answers (had encode run on it, this would hang).
    async with http.get(url + "/v1/models") as r:
        assert r.status == 200 and (await r.json())["data"][0]["id"] == "fake"
    status, _ = await _post(http, url + "/tokenize", {"prompt": "y" * (LIMIT + 1)})
    assert status == 413  # refusals need no tokenizer either
    assert not busy.done()
    tok.release.set()
    assert await busy == (200, {"tokens": [5, 3, 5], "count": 3, "max_model_len": 4096})
    status, out = await _post(http, url + "/tokenize", {"messages": [{"role": "user", "content": "a bb"}]})
    assert (status, out["tokens"]) == (200, [6, 1, 2, 11])  # "<user> a bb <assistant>"
    status, out = await _post(http, url + "/detokenize", {"tokens": [1, 2]})
    assert (status, out) == (200, {"prompt": "w ww"})


def test_text_chars_counts_every_string_of_a_json_value() -> None:
    assert text_chars([{"role": "user", "content": "abc"}, None, [1, "de"], ("f",)]) == 4 + 4 + 7 + 3 + 2 + 1
    assert text_chars("x" * 10) == 10 and text_chars(None) == 0


def test_the_limit_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="--max_tokenize_chars must be >= 1"):
        GatewayConfig(model="m", max_tokenize_chars=0)
    assert GatewayConfig(model="m").max_tokenize_chars == 1 << 20
