"""Configuration of ``treadle-rewards serve``: a typed tree; the command line is generated from it.

Flags are the dotted field paths (``--functions math format --weights 1.0 0.1``,
``--rm.path ./rm``, ``--http.port 5000``, ``--code.cpu_s 2``); ``--config FILE.yaml`` gives
defaults. Every group checks itself; ``ServeConfig`` checks the combinations (something to
serve, one weight per function, no open binds without a token / CURVE keys).

OpenRLHF's ``python -m openrlhf.cli.serve_rm`` flags are aliases of the same fields
(``--reward.model_name_or_path`` = ``--rm.path``, ``--port`` = ``--http.port``, ... see
``RMConfig`` and ``HttpConfig``); its flags treadle does not implement are refused by name
(``OPENRLHF_REFUSED``, checked by ``refuse_openrlhf_flags`` before parsing). Defaults stay
treadle's: loopback, float32, the model on CUDA when there is one.

Not here: building anything from it (``daemon``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from treadle.common.config import ConfigError, alias, configclass, find_flag, secret, switch_only
from treadle.common.rpc.transport import is_loopback, off_loopback


@configclass
class MathConfig:
    """The built-in ``math`` function (math-verify on the last \\boxed{} answer)."""

    extraction: Literal["boxed", "any"] = "boxed"
    """boxed: only a \\boxed{} answer counts; any: without one, math-verify searches the response's end."""
    max_response_chars: int = 8192
    """Only the last N characters of a response are searched for its answer (a box opening before them is missed)."""
    max_answer_chars: int = 1024
    """Longest answer (box content) or label parsed; a longer answer scores wrong, a longer label fails the sample
    (math-verify's parse time grows fast with length: ~0.3 s at 1 KiB, 5 s at 16 KiB)."""

    def __post_init__(self) -> None:
        if self.max_response_chars < 1 or self.max_answer_chars < 1:
            raise ConfigError(f"--math.max_response_chars and --math.max_answer_chars must be >= 1, got "
                              f"{self.max_response_chars} and {self.max_answer_chars}")


@configclass
class FormatConfig:
    """The built-in ``format`` function."""

    pattern: str = "think_answer"
    """A name in treadle.rewards.format_reward.FORMATS (think_answer, think_boxed, boxed) or a regex."""


@configclass
class CodeConfig:
    """The built-in ``code`` function: sandbox limits for each test run, and scoring."""

    cpu_s: float = 5.0
    """CPU seconds per test run."""
    wall_s: float = 10.0
    """Wall-clock seconds per test run (the whole process group is killed then)."""
    memory_mb: int = 512
    """Address-space limit per test run, MiB."""
    nproc: int = 32
    """Processes per test run (enforced with namespace isolation)."""
    fsize_mb: int = 16
    """Largest file (and stdout) a test run may write, MiB."""
    isolation: Literal["auto", "namespaces", "rlimits"] = "auto"
    """namespaces needs root; auto uses it when it works, else rlimits + an audit hook."""
    binary: bool = False
    """Reward 1.0 only when every test passes (else the pass rate)."""
    stop_on_failure: bool = False
    """Stop a sample's tests at the first failure (faster; the pass rate is then a lower bound)."""
    max_tests: int = 64
    """Run at most this many tests per sample."""

    def __post_init__(self) -> None:
        if not (self.cpu_s > 0 and self.wall_s > 0 and self.memory_mb >= 64 and self.nproc >= 1
                and self.fsize_mb >= 1 and self.max_tests >= 1):
            raise ConfigError("--cpu_s and --wall_s must be > 0, --memory_mb >= 64, --nproc, --fsize_mb and "
                              f"--max_tests >= 1; got {self.cpu_s}, {self.wall_s}, {self.memory_mb}, "
                              f"{self.nproc}, {self.fsize_mb}, {self.max_tests}")


@configclass
class RMConfig:
    """A reward model (AutoModelForSequenceClassification, num_labels=1, or an OpenRLHF RM); needs the rm extra."""

    path: Annotated[str | None, alias("--reward.model_name_or_path")] = None
    """Model folder (treadle's RM output, OpenRLHF's, or any such HF model); None: no reward model."""
    weight: float = 1.0
    """Weight of the model's score in the combined reward."""
    dtype: Annotated[Literal["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"], alias("--ds.param_dtype")] = \
        "float32"
    """Compute dtype (fp32 / bf16 / fp16: OpenRLHF's spellings of the same)."""
    device: str = "auto"
    """Torch device (auto: cuda when torch sees a GPU, else cpu; cpu, cuda, cuda:1, ...)."""
    replicas: int = 1
    """Copies of the model, each scoring its own batches at once (data parallel): on CUDA one per GPU,
    cuda:0 ... cuda:R-1 of those visible (--device auto or cuda); on CPU R copies in host memory."""
    attn_implementation: Annotated[str | None, alias("--ds.attn_implementation")] = None
    """HF attention implementation (sdpa, eager, flash_attention_2 on CUDA with flash-attn, ...); None: transformers' choice."""
    max_len: Annotated[int, alias("--data.max_len")] = 2048
    """Longest input in tokens (longer ones lose their beginning)."""
    micro_batch_size: Annotated[int, alias("--batch_size")] = 16
    """Texts per forward pass."""
    append_eos: bool = False
    """Append the EOS token to every text (for models trained that way, as OpenRLHF's)."""
    normalize: Annotated[bool, alias("--reward.normalize_enable")] = False
    """Apply (r - mean) / std with the mean/std saved in the model's config."""
    value_head_prefix: Annotated[str, alias("--ds.value_head_prefix")] = "score"
    """Name of an OpenRLHF RM's head weights (<prefix>.weight); a value_head_prefix in the model's config wins."""
    disable_fast_tokenizer: Annotated[bool, alias("--data.disable_fast_tokenizer"), switch_only()] = False
    """Load the slow (Python) tokenizer."""

    def __post_init__(self) -> None:
        if self.max_len < 1 or self.micro_batch_size < 1:
            raise ConfigError(f"--max_len and --micro_batch_size must be >= 1, got {self.max_len}, {self.micro_batch_size}")
        if self.replicas < 1:
            raise ConfigError(f"--replicas must be >= 1, got {self.replicas}")
        if self.replicas > 1 and self.device not in ("auto", "cuda", "cpu"):
            raise ConfigError(f"--replicas {self.replicas} puts one copy on each GPU: --device auto, cuda or cpu, "
                              f"not one device ({self.device})")
        if not self.value_head_prefix.isidentifier():
            raise ConfigError(f"--value_head_prefix must be a Python identifier, got {self.value_head_prefix!r}")


@configclass
class WorkerConfig:
    """Worker processes that run rule functions (each function gets its own pool)."""

    num_workers: int = 2
    """Processes per function (batches run in parallel across them)."""
    timeout_s: float = 60.0
    """Per-call limit: a call running longer is killed and its samples fail."""
    memory_mb: int = 0
    """Address-space limit per worker, MiB (0: none)."""
    isolate_failures: bool = True
    """When a batch raises, retry it sample by sample so only the failing samples fail."""
    start_timeout_s: float = 120.0
    """How long a worker may take to load its function."""

    def __post_init__(self) -> None:
        if self.num_workers < 1 or not self.timeout_s > 0 or self.memory_mb < 0 or not self.start_timeout_s > 0:
            raise ConfigError("--num_workers must be >= 1, --timeout_s and --start_timeout_s > 0, "
                              f"--memory_mb >= 0; got {self.num_workers}, {self.timeout_s}, "
                              f"{self.start_timeout_s}, {self.memory_mb}")


@configclass
class BatchConfig:
    """Dynamic batching in front of every scorer."""

    max_batch_size: int = 64
    """Samples per scorer call."""
    max_wait_ms: float = 5.0
    """How long the first queued sample waits for company before its batch leaves."""
    max_request_samples: int = 65536
    """Largest request accepted."""

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_wait_ms < 0 or self.max_request_samples < 1:
            raise ConfigError(f"--max_batch_size and --max_request_samples must be >= 1 and --max_wait_ms >= 0; "
                              f"got {self.max_batch_size}, {self.max_request_samples}, {self.max_wait_ms}")


@configclass
class ShapingConfig:
    """Length shaping of the combined reward (DAPO overlong penalty, stop-properly penalty)."""

    overlong_buffer_len: int | None = None
    """DAPO: penalise the last this-many tokens before max_new_tokens (None: off)."""
    overlong_penalty_factor: float = 1.0
    """DAPO: the penalty at max_new_tokens."""
    max_new_tokens: int | None = None
    """The generation limit the penalty is measured against (needed with overlong_buffer_len)."""
    stop_properly_penalty_coef: float | None = None
    """For responses not ending with a stop text: coef >= 0 scales the reward, < 0 replaces it (None: off)."""
    stop_texts: tuple[str, ...] = ()
    """A response ending with one of these stopped properly (e.g. <|im_end|>)."""
    tokenizer: str | None = None
    """Count tokens with this HF tokenizer (default: the reward model's); needs the rm extra."""
    length_unit: Literal["tokens", "chars"] = "tokens"
    """Measure response length in tokens (needs a tokenizer) or characters."""

    def __post_init__(self) -> None:
        buffer, limit = self.overlong_buffer_len, self.max_new_tokens
        if buffer is not None and (limit is None or not 0 < buffer <= limit):
            raise ConfigError("--overlong_buffer_len needs --max_new_tokens and must be in (0, max_new_tokens]; "
                              f"got {buffer}, {limit}")
        coef = self.stop_properly_penalty_coef
        if coef is not None and (coef > 1 or not self.stop_texts):
            raise ConfigError(f"--stop_properly_penalty_coef must be <= 1 and needs --stop_texts; got {coef}, "
                              f"{list(self.stop_texts)}")

    @property
    def enabled(self) -> bool:
        return self.overlong_buffer_len is not None or self.stop_properly_penalty_coef is not None


@configclass
class HttpConfig:
    """The HTTP endpoint (OpenRLHF's POST /get_reward, plus /v1/reward, /health, /metrics)."""

    host: Annotated[str, alias("--host")] = "127.0.0.1"
    """Bind address; anything but loopback needs a token."""
    port: Annotated[int | None, alias("--port")] = 5000
    """Port (0: any free one; None: no HTTP server)."""
    token: str | None = secret()
    """Bearer token required on every endpoint but /health (None: none)."""
    token_file: str | None = None
    """Read the token from this file instead (keeps it out of `ps`)."""
    max_body_mb: int = 256
    """Largest request body, MiB."""


@configclass
class ZmqConfig:
    """The ZeroMQ endpoint (treadle RPC, method "reward")."""

    endpoint: str | None = "tcp://127.0.0.1:5555"
    """Bind endpoint (tcp://HOST:PORT, port 0 for any; ipc://PATH; None: no ZeroMQ server)."""
    curve_dir: str | None = None
    """CURVE key folder (treadle-keys generate DIR); needed for non-loopback endpoints."""
    max_in_flight: int = 1024
    """Requests in flight before the server answers Busy."""


@configclass
class CacheConfig:
    """The idempotency cache."""

    size: int = 100_000
    """Keys kept (LRU); 0 turns the cache off."""
    path: str | None = None
    """Also append entries to this JSON-lines file and load it on start (survives restarts)."""


@configclass
class ServeConfig:
    """Serve rule reward functions and/or a reward model over ZeroMQ and HTTP."""

    functions: tuple[str, ...] = ()
    """Rule functions: built-ins (math, format, code) and/or files (f.py for its reward_func, f.py:name)."""
    weights: tuple[float, ...] = ()
    """One weight per function (default 1.0 each); the reward model's is --rm.weight."""
    score_from: str = ""
    """Component whose score becomes the result's score (default: the first one)."""
    failure_reward: float = 0.0
    """Reward and score given to a sample a component failed on."""
    rm: RMConfig = RMConfig()
    math: MathConfig = MathConfig()
    format: FormatConfig = FormatConfig()
    code: CodeConfig = CodeConfig()
    workers: WorkerConfig = WorkerConfig()
    batch: BatchConfig = BatchConfig()
    shaping: ShapingConfig = ShapingConfig()
    http: HttpConfig = HttpConfig()
    zmq: ZmqConfig = ZmqConfig()
    cache: CacheConfig = CacheConfig()
    metrics_port: int | None = None
    """Also expose Prometheus metrics on this loopback port (they are always at HTTP /metrics)."""

    def __post_init__(self) -> None:
        if not self.functions and self.rm.path is None:
            raise ConfigError("nothing to serve: give --functions (math, format, code, file.py) and/or --rm.path")
        if self.weights and len(self.weights) != len(self.functions):
            raise ConfigError(f"--weights has {len(self.weights)} values for {len(self.functions)} --functions")
        if self.http.port is None and self.zmq.endpoint is None:
            raise ConfigError("both servers are off: set --http.port and/or --zmq.endpoint")
        has_token = self.http.token is not None or self.http.token_file is not None
        if self.http.port is not None and not is_loopback(self.http.host) and not has_token:
            raise ConfigError(f"refusing to serve HTTP on {self.http.host} without --http.token or "
                              "--http.token_file: anyone who can reach it could use this service")
        ep = self.zmq.endpoint
        if ep and off_loopback(ep) and self.zmq.curve_dir is None:
            raise ConfigError(f"refusing to bind {ep} without --zmq.curve_dir (CURVE keys: treadle-keys generate DIR)")
        if self.shaping.length_unit == "tokens" and self.shaping.enabled and self.shaping.overlong_buffer_len \
                is not None and self.shaping.tokenizer is None and self.rm.path is None:
            raise ConfigError("--shaping.overlong_buffer_len counts tokens: give --shaping.tokenizer (or --rm.path), "
                              "or --shaping.length_unit chars")


OPENRLHF_REFUSED: dict[str, str] = {
    "--ds.load_in_4bit": "4-bit (bitsandbytes) loading is not supported: serve the model in bf16 or fp16",
    "--ds.experts_implementation": "the MoE expert kernel is transformers' choice here",
    "--ds.packing_samples": "the server pads its micro-batches; packing is not implemented",
    "--use_ms": "ModelScope downloads are not supported: give a local folder or a Hugging Face name",
}
"""Flags of OpenRLHF's ``serve_rm`` that ``treadle-rewards serve`` does not implement, with why."""


def refuse_openrlhf_flags(args: Sequence[str]) -> None:
    """Raise ``ConfigError`` naming the first flag of ``OPENRLHF_REFUSED`` in ``args``."""
    if (found := find_flag(args, OPENRLHF_REFUSED)) is not None:
        name, key = found
        raise ConfigError(f"{name} (OpenRLHF's serve_rm) is not supported by treadle-rewards serve: "
                          f"{OPENRLHF_REFUSED[key]}")
