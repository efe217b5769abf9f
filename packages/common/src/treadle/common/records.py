"""Typed records: everything that crosses a process boundary in treadle.

Each record is a keyword-only ``msgspec.Struct``; the codec (``treadle.common.codec``) turns
one into a msgpack header plus out-of-band array buffers and back, validating every field's
type on the way in. Arrays are ``numpy.ndarray`` (a ``torch.Tensor`` where the sender sent one
and torch is importable). Records never hold pickled objects or ``dict[str, Any]`` payload bags;
the only free-form maps (``info``, ``args``, ``provenance``) are checked to hold msgpack-native
values (None, bool, int, float, str, bytes, and lists/maps of those).

What this module deliberately does not do: transport (see ``rpc``), config (see ``config``).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec

#: An array field: ``numpy.ndarray``, or ``torch.Tensor`` when the sender sent a tensor. The
#: codec decodes the data; the record's ``__post_init__`` checks rank and length.
Array = Annotated[Any, "numpy.ndarray | torch.Tensor"]

#: Records by wire name; filled by ``Record.__init_subclass__``. The codec looks types up here.
RECORD_TYPES: dict[str, type[Record]] = {}

FinishReason = Literal["stop", "length", "abort", "error"]
MAX_TOP_LOGPROBS = 20
"""Most alternatives per sampled token a request may ask for (OpenAI's and vLLM's default limit)."""
Transport = Literal["inline", "collective", "cuda_ipc"]


class Record(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """Base of every wire record; subclasses register themselves under their class name."""

    wire_name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.wire_name = cls.__name__
        RECORD_TYPES[cls.__name__] = cls


def check_native(value: Any, where: str, depth: int = 0) -> None:
    """Raise ``ValueError`` unless ``value`` is made of msgpack-native types only."""
    if depth > 32:
        raise ValueError(f"{where}: nested deeper than 32 levels")
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_native(v, f"{where}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: map keys must be str, got {type(k).__name__} {k!r}")
            check_native(v, f"{where}.{k}", depth + 1)
        return
    raise ValueError(f"{where}: {type(value).__name__} is not a msgpack-native type")


def _length(a: Any) -> int:
    return int(a.shape[0])


def is_array(a: Any) -> bool:
    """True for numpy arrays and torch tensors (duck-typed: common never imports torch)."""
    return hasattr(a, "ndim") and hasattr(a, "shape") and hasattr(a, "dtype")


def _check_1d(name: str, a: Any, n: int | None = None) -> None:
    if not is_array(a):
        raise ValueError(f"{name} must be an array, got {type(a).__name__} {str(a)[:80]}")
    if a.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {tuple(a.shape)}")
    if n is not None and _length(a) != n:
        raise ValueError(f"{name} has length {_length(a)}, expected {n} (one per response token)")


def _check_top(name: str, a: Any, n: int) -> None:
    """``a`` is [n, k] with 1 <= k <= MAX_TOP_LOGPROBS (the alternatives of n sampled tokens)."""
    if not is_array(a):
        raise ValueError(f"{name} must be an array, got {type(a).__name__} {str(a)[:80]}")
    if a.ndim != 2 or a.shape[0] != n or not 1 <= a.shape[1] <= MAX_TOP_LOGPROBS:
        raise ValueError(f"{name} must have shape [{n}, k] (one row per response token, 1 <= k <= "
                         f"{MAX_TOP_LOGPROBS}), got {tuple(a.shape)}")


class SamplingParams(Record, frozen=True):
    """How an engine samples; mirrors vLLM's SamplingParams subset that RL needs."""

    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    top_k: int = -1
    """Top-k cut-off; -1 disables it."""
    max_tokens: int = 16
    """Upper bound on response tokens per sample."""
    min_tokens: int = 0
    """Stop tokens are ignored until this many tokens were generated."""
    stop_token_ids: list[int] = []
    """Token ids that end a sample (kept as the sample's last token)."""
    seed: int | None = None
    """Per-request sampling seed; None draws one."""
    logprobs: bool = True
    """Return the logprob of every sampled token (of the sampling distribution)."""
    prompt_logprobs: bool = False
    """Also return the logprob of every prompt token after the first (the canary uses it)."""
    top_logprobs: int = 0
    """Also return, per sampled token, the ``top_logprobs`` most likely tokens of the sampling
    distribution and their logprobs (vLLM's ``logprobs=k``: the top k, plus the sampled token's
    own in ``logprobs``); 0..``MAX_TOP_LOGPROBS``, needs ``logprobs``; 0 (RL): none on the wire."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if not self.temperature >= 0:  # NaN too: one NaN row made the engine fail its whole batch
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"SamplingParams.top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("SamplingParams.top_logprobs needs logprobs=True")


class GenerateRequest(Record):
    """Token-in generation request for one prompt (``sampling.n`` samples)."""

    prompt_token_ids: Array
    """int32 [P]: the prompt, already tokenized; never re-tokenized downstream."""
    sampling: SamplingParams = SamplingParams()
    """How to sample."""
    key: str = ""
    """Caller's stable id for this request (failover and idempotency); empty: none."""
    min_version: int = -1
    """Only an engine holding weight version >= this may serve it; -1: any."""

    def __post_init__(self) -> None:
        _check_1d("GenerateRequest.prompt_token_ids", self.prompt_token_ids)
        if _length(self.prompt_token_ids) == 0:
            raise ValueError("GenerateRequest.prompt_token_ids is empty: a prompt needs >= 1 token")


class GenerateResult(Record):
    """One finished sample of a GenerateRequest: token out, with logprobs and weight version."""

    response_token_ids: Array
    """int32 [R]: sampled tokens, stop token included when one ended the sample."""
    logprobs: Array | None = None
    """float32 [R]: logprob of each sampled token under the sampling distribution."""
    prompt_logprobs: Array | None = None
    """float32 [P-1]: logprob of prompt tokens 1..P-1, when asked for."""
    finish_reason: FinishReason = "length"
    """Why the sample ended."""
    index: int = 0
    """Which of the request's n samples this is (0-based)."""
    key: str = ""
    """The request's key, echoed."""
    weight_version: int = 0
    """Policy version of the weights that produced every token of this sample."""
    engine_id: str = ""
    """Which engine served it."""
    top_token_ids: Array | None = None
    """int32 [R, k]: per sampled token, the k = ``sampling.top_logprobs`` most likely token ids of
    the sampling distribution, most likely first (k fewer only for a vocabulary below k); None
    when not asked for."""
    top_logprobs: Array | None = None
    """float32 [R, k]: their logprobs, descending (``-inf`` for tokens top-k / top-p cut away)."""

    def __post_init__(self) -> None:
        _check_1d("GenerateResult.response_token_ids", self.response_token_ids)
        n = _length(self.response_token_ids)
        if self.logprobs is not None:
            _check_1d("GenerateResult.logprobs", self.logprobs, n)
        if (self.top_token_ids is None) != (self.top_logprobs is None):
            raise ValueError("GenerateResult.top_token_ids and top_logprobs come together (one is None)")
        if self.top_token_ids is not None:
            _check_top("GenerateResult.top_token_ids", self.top_token_ids, n)
            _check_top("GenerateResult.top_logprobs", self.top_logprobs, n)
            if tuple(self.top_token_ids.shape) != tuple(self.top_logprobs.shape):
                raise ValueError(f"GenerateResult.top_token_ids has shape {tuple(self.top_token_ids.shape)}, "
                                 f"top_logprobs {tuple(self.top_logprobs.shape)}: they must match")


class Trajectory(Record):
    """One episode, token in and token out: what the trainer learns from.

    ``loss_mask`` is 0 on response tokens an environment wrote (multi-turn observations), 1 on
    tokens the policy sampled. Policy versions bound the weights that produced the sampled
    tokens (they differ only when weights changed mid-episode in async/partial rollout).
    """

    prompt_token_ids: Array
    """int32 [P]: prompt tokens."""
    response_token_ids: Array
    """int32 [R]: everything after the prompt: policy tokens and environment tokens."""
    rollout_logprobs: Array
    """float32 [R]: logprob of each response token under the rollout policy (0 where masked)."""
    loss_mask: Array
    """uint8 [R]: 1 where the policy sampled the token (trainable), 0 where the environment wrote it."""
    reward: float | None = None
    """Scalar episode reward; None until scored."""
    token_rewards: Array | None = None
    """float32 [R]: per-token rewards (process rewards), when the reward gives them."""
    score: float | None = None
    """Verifier score used for filtering and pass@k (may differ from the shaped reward)."""
    min_policy_version: int = 0
    """Oldest weight version that produced any of the sampled tokens."""
    max_policy_version: int = 0
    """Newest weight version that produced any of the sampled tokens."""
    truncated: bool = False
    """True when the episode hit its token budget rather than ending by itself."""
    finish_reason: FinishReason = "stop"
    """Why the last generation ended."""
    uid: str = ""
    """Unique id of this trajectory (durable trajectory log key)."""
    group_id: str = ""
    """Id shared by the samples of one prompt (GRPO/RLOO groups)."""
    extra_logs: dict[str, float] = {}
    """Scalar metrics from the reward/environment, logged per step."""
    info: dict[str, Any] = {}
    """Free-form, msgpack-native only (e.g. the label, the dataset row id)."""

    def __post_init__(self) -> None:
        _check_1d("Trajectory.prompt_token_ids", self.prompt_token_ids)
        _check_1d("Trajectory.response_token_ids", self.response_token_ids)
        n = _length(self.response_token_ids)
        _check_1d("Trajectory.rollout_logprobs", self.rollout_logprobs, n)
        _check_1d("Trajectory.loss_mask", self.loss_mask, n)
        if self.token_rewards is not None:
            _check_1d("Trajectory.token_rewards", self.token_rewards, n)
        if self.min_policy_version > self.max_policy_version:
            raise ValueError(
                f"Trajectory.min_policy_version {self.min_policy_version} > "
                f"max_policy_version {self.max_policy_version}"
            )
        check_native(self.info, "Trajectory.info")


class TrajectoryBatch(Record):
    """Several trajectories in one message (rollout -> trainer)."""

    trajectories: list[Trajectory]
    """The episodes, in the order they were produced."""
    step: int = 0
    """Trainer step these were collected for."""


class RewardRequest(Record):
    """Score a batch of samples (OpenRLHF's remote reward contract, plus an idempotency key)."""

    queries: list[str]
    """Prompt + response text of each sample."""
    prompts: list[str] = []
    """Prompt text of each sample (same length as queries, or empty)."""
    labels: list[Any] = []
    """Reference answers / labels (msgpack-native), same length as queries, or empty."""
    key: str = ""
    """Idempotency key: a replayed request with the same key gets the cached result."""

    def __post_init__(self) -> None:
        n = len(self.queries)
        for name in ("prompts", "labels"):
            got = len(getattr(self, name))
            if got not in (0, n):
                raise ValueError(f"RewardRequest.{name} has {got} items, expected 0 or {n} (len(queries))")
        check_native(self.labels, "RewardRequest.labels")


class RewardResult(Record):
    """Rewards for a RewardRequest, one per query."""

    rewards: Array
    """float32 [N]: reward used for training."""
    scores: Array | None = None
    """float32 [N]: verifier score (filtering, pass@k); defaults to rewards when absent."""
    failed: list[bool] = []
    """Per sample: True when the reward function failed (raised or timed out) for it."""
    errors: list[str] = []
    """Per sample: the failure's message, empty where it succeeded."""
    extra_logs: dict[str, list[float]] = {}
    """Per-sample metrics keyed by name."""
    provenance: dict[str, Any] = {}
    """Function or model name, version or hash, sandbox limits (msgpack-native)."""

    def __post_init__(self) -> None:
        _check_1d("RewardResult.rewards", self.rewards)
        check_native(self.provenance, "RewardResult.provenance")


class WeightGroupSpec(Record, frozen=True):
    """Where and how to join a weight-broadcast group (``weights.WeightGroup``)."""

    host: str
    """The sender's TCPStore address."""
    port: int
    """The sender's TCPStore port."""
    world_size: int
    """The sender plus every receiving worker of every engine (1 + engines * TP * PP, + a keeper)."""
    rank: int = 0
    """This member's rank; an engine is given its first worker's, worker w takes rank + w."""
    backend: Literal["gloo", "nccl"] = "gloo"
    """gloo on CPU, nccl between GPUs."""
    timeout_s: float = 120.0
    """How long joining and each broadcast may take."""
    prefix: str = ""
    """The group's name in the sender's store: "" for the sender's own group; a node's relay group
    (``relay_prefix`` of its rank 0) otherwise, whose members receive from that rank 0, not the sender."""
    relay_prefix: str = ""
    """Set on one member per node (a relay): it passes every broadcast it receives on to the node's
    relay group of this name, as that group's rank 0; "": none."""
    relay_size: int = 0
    """Members of that relay group, the relay included."""

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError(f"WeightGroupSpec.world_size must be >= 2 (sender + engine), got {self.world_size}")
        if bool(self.relay_prefix) != (self.relay_size >= 2):
            raise ValueError(f"WeightGroupSpec.relay_prefix {self.relay_prefix!r} needs relay_size >= 2, got "
                             f"{self.relay_size}")
        if self.relay_prefix and self.relay_prefix == self.prefix:
            raise ValueError(f"WeightGroupSpec.relay_prefix {self.relay_prefix!r} names the member's own group")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"WeightGroupSpec.rank {self.rank} outside [0, {self.world_size})")
        if not 0 < self.port < 65536:
            raise ValueError(f"WeightGroupSpec.port {self.port} is not a TCP port")
        if not self.timeout_s > 0:
            raise ValueError(f"WeightGroupSpec.timeout_s must be > 0, got {self.timeout_s}")

    def with_rank(self, rank: int) -> WeightGroupSpec:
        return msgspec.structs.replace(self, rank=rank)


class LoraAdapter(Record, frozen=True):
    """The LoRA adapter an adapter-only weight update carries (PEFT's ``LoraConfig``, the fields
    serving needs): module ``m`` with weight ``W`` computes ``W x + (alpha / rank) * B (A x)``."""

    rank: int
    """r: ``lora_A`` is [r, in], ``lora_B`` [out, r]."""
    alpha: float
    """Scaling numerator: the adapter's product is scaled by alpha / rank."""
    target_modules: list[str]
    """The adapted modules, as PEFT matches them (a module's name or its last components: ``q_proj``,
    ``model.layers.0.mlp.up_proj``), resolved: never ``all-linear``."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoraAdapter.rank must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"LoraAdapter.alpha must be > 0, got {self.alpha}")
        if not self.target_modules:
            raise ValueError("LoraAdapter.target_modules is empty")


class WeightUpdate(Record):
    """What every weight update says, whatever carries its bytes: a versioned list of tensors.

    Not sent itself: one of its transports' records is (``InlineWeights``, ``CollectiveWeights``,
    ``IpcWeights``). Tensor ``i`` is ``names[i]`` of ``dtypes[i]`` and ``shapes[i]``; buckets hold
    consecutive tensors, in order (``treadle.common.weights``).
    """

    transport: ClassVar[Transport]

    version: int
    """Weight version these tensors become (monotonic per policy)."""
    names: list[str]
    """Parameter names, in HF checkpoint naming."""
    dtypes: list[str]
    """Torch dtype names ("bfloat16", "float32", ...), one per tensor."""
    shapes: list[list[int]]
    """Shape of each tensor."""
    canary_token_ids: Array | None = None
    """int32 [C]: fixed prompt the engine scores after loading (optional)."""
    canary_logprobs: Array | None = None
    """float32 [C-1]: the sender's prompt logprobs for the canary; engines must match them."""
    canary_tolerance: float = 1e-3
    """Largest allowed absolute difference between canary logprobs."""
    adapter: LoraAdapter | None = None
    """None: the tensors are the model's own (they replace its weights, and drop any adapter).
    Set: they are this LoRA adapter's, in PEFT's file names (``base_model.model.<module>.lora_A.weight``
    ...), served on top of the engine's base weights in place of its previous adapter."""

    def __post_init__(self) -> None:
        n = len(self.names)
        if len(self.dtypes) != n or len(self.shapes) != n:
            raise ValueError(f"{type(self).__name__}: {n} names but {len(self.dtypes)} dtypes and "
                             f"{len(self.shapes)} shapes")
        sizes = getattr(self, "bucket_sizes", [])
        if sizes and (sum(sizes) != n or min(sizes) < 1):
            raise ValueError(f"{type(self).__name__}.bucket_sizes must be >= 1 each and sum to {n}, "
                             f"got {sizes[:8]} (sum {sum(sizes)})")


class InlineWeights(WeightUpdate):
    """The tensors inside the message (tests, tiny models: it must fit the frame limit)."""

    transport: ClassVar[Transport] = "inline"

    tensors: list[Array] = []
    """The tensors themselves, one per name."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.tensors) != len(self.names):
            raise ValueError(f"InlineWeights: {len(self.names)} names but {len(self.tensors)} tensors")
        for i, t in enumerate(self.tensors):
            if not is_array(t):
                raise ValueError(f"InlineWeights.tensors[{i}] must be an array, got {type(t).__name__}")
            if list(t.shape) != list(self.shapes[i]):
                raise ValueError(f"InlineWeights.tensors[{i}] ({self.names[i]}) has shape {list(t.shape)}, "
                                 f"header says {self.shapes[i]}")


class CollectiveWeights(WeightUpdate):
    """The buckets follow over the sender's broadcast group, one broadcast each, in order."""

    transport: ClassVar[Transport] = "collective"

    bucket_sizes: list[int] = []
    """Tensors in each bucket; empty: one tensor per bucket."""
    group: WeightGroupSpec | None = None
    """The group they travel over (its store's host:port tells one sender's group from another's)."""


class IpcWeights(WeightUpdate):
    """The buckets lie in the sender's GPU memory on the engine's own GPU (colocated), shared
    by CUDA IPC handles (``treadle.common.ipc``); the sender leaves them untouched until the
    engines answered, and the engines copy out of them before they answer."""

    transport: ClassVar[Transport] = "cuda_ipc"

    bucket_sizes: list[int] = []
    """Tensors in each bucket; empty: one tensor per bucket."""
    handles: list[bytes] = []
    """One handle per bucket (``ipc.encode_buckets``) for each GPU holding a copy (a trainer of
    several colocated ranks shares one per rank's GPU); an engine's workers take those on their
    own GPU (``ipc.handles_on``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        buckets = len(self.bucket_sizes) if self.bucket_sizes else len(self.names)
        if (len(self.handles) % buckets if buckets else len(self.handles)) or (buckets and not self.handles):
            raise ValueError(f"IpcWeights: {len(self.handles)} handles for {buckets} buckets (one per bucket "
                             "for each GPU holding a copy)")


class CriticSetup(Record):
    """Trainer rank 0 -> a critic server (``treadle-train critic``): the run it serves.

    The server reads everything else from ``config``, the trainer's own resolved flags, so one
    command line (the trainer's) decides the critic's model, optimizer and batching."""

    config: str
    """The trainer's resolved ``PPOConfig`` as YAML (``dump_yaml``; secrets nulled)."""
    total_opt_steps: int
    """Optimizer steps of the whole run (the length of the learning-rate schedule)."""
    pad_id: int
    """The actor tokenizer's padding token."""
    session: str = ""
    """The trainer's id for this run's requests: the server serves the last setup's session and
    refuses the others' requests (another trainer still talking to it)."""

    def __post_init__(self) -> None:
        if self.total_opt_steps < 1:
            raise ValueError(f"CriticSetup.total_opt_steps must be >= 1, got {self.total_opt_steps}")


class CriticReady(Record):
    """A critic server's answer to ``check`` / ``setup``."""

    world: int
    """The critic's ranks."""
    model: str
    """The folder its weights started from."""
    trained_steps: int = 0
    """RL steps trained since those weights (or the last checkpoint) were loaded; 0: fresh."""


class CriticValuesRequest(Record):
    """Trainer rank 0 -> critic: value every action token of these trajectories (one RL step's batch)."""

    trajectories: list[Trajectory]
    """The step's batch, in the trainer's order; the critic keeps it for the step's ``train``."""
    session: str = ""
    """The ``CriticSetup.session`` this request belongs to."""


class CriticValues(Record):
    """The critic's values: V(s) before each action token (loss mask 1), trajectory after trajectory."""

    values: Array
    """float32 [sum of the trajectories' action tokens]."""

    def __post_init__(self) -> None:
        _check_1d("CriticValues.values", self.values)


class CriticTrainRequest(Record):
    """Trainer rank 0 -> critic: the step's optimizer steps on the batch last valued, toward ``returns``."""

    step: int
    """The RL step (1-based): with ``--train.seed`` it fixes the order of the optimizer steps, as the actor's."""
    uids: list[str]
    """The batch's trajectory uids, in order: must be those of the last ``CriticValuesRequest``."""
    returns: Array
    """float32 [sum of action tokens]: each action token's return, in the order of ``CriticValues``."""
    session: str = ""
    """The ``CriticSetup.session`` this request belongs to."""

    def __post_init__(self) -> None:
        _check_1d("CriticTrainRequest.returns", self.returns)


class CriticTrainResult(Record):
    """The critic's step: its metrics (``critic/loss``, ``critic/lr``, ``critic/grad_norm``), step means."""

    metrics: dict[str, float] = {}
    """Metric name -> value."""


class CriticCheckpoint(Record):
    """Trainer rank 0 -> critic: ``save`` into / ``load`` from a checkpoint folder, or ``export`` in
    HF format there; ``load`` of "" restores the starting weights."""

    path: str
    """An absolute path every critic rank can reach (the trainer's shared checkpoint folder)."""
    session: str = ""
    """The ``CriticSetup.session`` this request belongs to."""


WEIGHT_UPDATES: dict[str, type[WeightUpdate]] = {
    cls.transport: cls for cls in (InlineWeights, CollectiveWeights, IpcWeights)}
"""Each transport's record, by transport name."""
del RECORD_TYPES["WeightUpdate"]  # the shared header: never sent on its own


class Control(Record):
    """Lifecycle and observability requests and replies (health, stats, sleep, wake, ...)."""

    op: str
    """What to do or what this reports: "health", "stats", "sleep", "wake", "reset_prefix_cache", ..."""
    args: dict[str, Any] = {}
    """Arguments or results, msgpack-native."""

    def __post_init__(self) -> None:
        check_native(self.args, "Control.args")


class Error(Record):
    """A typed failure reply; the client re-raises it as the exception named by ``code``."""

    code: str
    """Machine-readable kind: see ``treadle.common.errors.ERRORS``."""
    message: str
    """Human-readable: what was wrong, and the offending value."""
    retryable: bool = False
    """Whether the same request may succeed if sent again later."""


class Ack(Record):
    """An empty success reply."""

    note: str = ""
    """Optional human-readable detail."""


def same(a: Any, b: Any) -> bool:
    """Deep equality for records, lists, maps and arrays (arrays: same dtype, shape and values)."""
    if is_array(a) or is_array(b):
        if not (is_array(a) and is_array(b)):
            return False
        if str(a.dtype).removeprefix("torch.") != str(b.dtype).removeprefix("torch.") or tuple(a.shape) != tuple(b.shape):
            return False
        return bytes(_raw_bytes(a)) == bytes(_raw_bytes(b))
    if isinstance(a, Record) or isinstance(b, Record):
        return type(a) is type(b) and all(same(getattr(a, f), getattr(b, f)) for f in a.__struct_fields__)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _raw_bytes(a: Any) -> memoryview:
    """The bytes of an array or tensor (bit patterns, so NaNs compare equal to themselves)."""
    if hasattr(a, "untyped_storage"):  # torch: compare bit patterns through a byte view
        import torch  # noqa: PLC0415  (only reached with a tensor in hand)

        if a.numel() == 0:
            return memoryview(b"")
        return memoryview(a.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")
    import numpy as np  # noqa: PLC0415

    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
