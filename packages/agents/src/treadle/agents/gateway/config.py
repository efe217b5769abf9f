"""Typed configuration of ``treadle-agents serve`` (the CLI is generated from it).

A gateway binds loopback by default; binding any other address needs a bearer token (``--token``
or ``--token_file``), because the gateway spends the rollout pool's compute for whoever calls it.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from treadle.common.config import ConfigError, configclass, secret
from treadle.common.rpc.transport import is_loopback

DEFAULT_ROLLOUT = "tcp://127.0.0.1:5570"


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@configclass
class GatewayConfig:
    """treadle-agents serve: an OpenAI-compatible chat endpoint over the rollout pool that records token trajectories."""

    model: str = ""
    """HF model folder whose tokenizer (and chat template) the gateway uses: the one the rollout pool serves."""
    rollout: str = DEFAULT_ROLLOUT
    """The rollout daemon's endpoint (treadle-rollout serve)."""
    rollout_curve_dir: str = ""
    """CURVE keys for the rollout daemon (client.key_secret, server.key); empty: none."""
    host: str = "127.0.0.1"
    """Address to bind; anything but loopback needs --token or --token_file."""
    port: int = 8000
    """TCP port (0: a free one, printed at start)."""
    token: str | None = secret()
    """Bearer token every route but /health requires (Authorization: Bearer TOKEN)."""
    token_file: str = ""
    """File holding the bearer token (kept out of the process list); overrides --token."""
    served_model_name: str = ""
    """Model id /v1/models lists and responses name; empty: the model folder's name."""
    chat_template: str = ""
    """Chat template: empty (the tokenizer's), a built-in name (chatml_tools) or a .jinja file."""
    tool_parser: str = "hermes"
    """How tool calls are read from text: hermes (<tool_call>{json}</tool_call>) or none."""
    max_length: int = 4096
    """Longest session (prompt + every turn) in tokens; requests beyond it get HTTP 400."""
    default_max_tokens: int = 512
    """max_tokens of a request that sets none."""
    session_ttl_s: float = 3600.0
    """Sessions idle this long are dropped (with their recorded tokens)."""
    max_sessions: int = 100_000
    """Sessions kept at once; the least recently used beyond it are dropped."""
    request_timeout_s: float = 600.0
    """Longest wait for one generation."""
    max_tokenize_chars: int = 1 << 20
    """Most characters of text one request may have tokenized (a /tokenize prompt; a chat's message
    contents, tool-call arguments and tool schemas), and most tokens /detokenize takes; beyond it
    HTTP 413. Tokenizing takes ~1 s per MiB of text, on one thread beside the event loop."""

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("--model is required: the HF model folder whose tokenizer the rollout pool uses")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port must be a TCP port, got {self.port}")
        if not is_loopback_host(self.host) and not (self.token or self.token_file):
            raise ConfigError(f"--host {self.host} is not loopback: set --token or --token_file "
                              "(the gateway spends the rollout pool's compute for whoever calls it)")
        host = self.rollout.removeprefix("tcp://").rpartition(":")[0]
        if self.rollout.startswith("tcp://") and not is_loopback(host) and not self.rollout_curve_dir:
            raise ConfigError(f"--rollout {self.rollout} is not loopback: set --rollout_curve_dir (the CURVE keys "
                              "the rollout daemon's --curve_dir allows; make them with `treadle-keys generate DIR`)")
        if self.tool_parser not in ("hermes", "none"):
            raise ConfigError(f"--tool_parser must be hermes or none, got {self.tool_parser!r}")
        if self.max_length < 2 or self.default_max_tokens < 1 or self.max_sessions < 1:
            raise ConfigError("--max_length must be >= 2, --default_max_tokens and --max_sessions >= 1")
        if self.session_ttl_s <= 0 or self.request_timeout_s <= 0:
            raise ConfigError("--session_ttl_s and --request_timeout_s must be > 0")
        if self.max_tokenize_chars < 1:
            raise ConfigError(f"--max_tokenize_chars must be >= 1, got {self.max_tokenize_chars}")

    def bearer_token(self) -> str | None:
        """The token to require: --token_file's content (stripped), else --token, else None."""
        if self.token_file:
            try:
                text = Path(self.token_file).read_text(encoding="utf-8").strip()
            except OSError as e:
                raise ConfigError(f"--token_file {self.token_file}: cannot read it ({e.strerror})") from None
            if not text:
                raise ConfigError(f"--token_file {self.token_file} is empty")
            return text
        return self.token or None
