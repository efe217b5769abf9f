"""Start vLLM's CPU build in this process, for tools, tool tests and the interim demo.

vLLM reads its settings from environment variables, and some of them (threads, multiprocessing)
only count if set before vLLM or torch is imported. ``apply_env()`` is the one place tools set
them; each is documented in ``VLLM_CPU_ENV``. ``start_llm`` builds an ``LLM`` with the settings
PLATFORM.md found to work on a small CPU box; ``stop_llm`` frees it and the torch.distributed
group vLLM opened, so later code in the same process (a test session) can open its own.

It is not the rollout backend (packages/rollout owns that); it holds no treadle protocol code.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm import LLM


def vllm_cpu_env(cache_dir: Path) -> dict[str, str]:
    """The variables ``apply_env`` sets (unless already set), with why:

    - ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: engine core in this process; starts in ~2 s, not ~13 s.
    - ``OMP_NUM_THREADS=1``: in-process vLLM runs 5-10x slower on CPU without it.
    - ``VLLM_TARGET_DEVICE=cpu``: the platform is CPU even if a GPU library is importable.
    - ``VLLM_CACHE_ROOT``: compile caches under treadle's cache folder, not in ``~``.
    - ``VLLM_NO_USAGE_STATS=1``, ``VLLM_DO_NOT_TRACK=1``: no usage reports, nothing in ``~``.
    - ``VLLM_LOGGING_LEVEL=ERROR``: vLLM's start-up lines (info, and CPU-build warnings about
      missing Triton / tcmalloc that do not apply here) drown a tool's own output.
    - ``HF_HUB_OFFLINE=1``, ``TRANSFORMERS_OFFLINE=1``: models are local folders; never fetch.
    """
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
        "VLLM_TARGET_DEVICE": "cpu", "VLLM_CACHE_ROOT": str(cache_dir / "vllm"),
        "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "VLLM_LOGGING_LEVEL": "ERROR",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    }


def cache_dir() -> Path:
    """treadle's cache folder: the TREADLE_CACHE_DIR knob, else ./.cache."""
    from treadle.common import env

    return Path(env.get("TREADLE_CACHE_DIR") or ".cache").resolve()


def apply_env(environ: MutableMapping[str, str] = os.environ) -> Mapping[str, str]:
    """Set each of ``vllm_cpu_env`` the caller has not set already; returns what is now in effect.

    Call before importing torch or vLLM (``OMP_NUM_THREADS`` is read once, at OpenMP start-up).
    A value the user exported wins: we only fill gaps.
    """
    wanted = vllm_cpu_env(cache_dir())
    for name, value in wanted.items():
        environ.setdefault(name, value)
    return {name: environ[name] for name in wanted}


def start_llm(model: Path | str, *, max_model_len: int = 512, kv_cache_bytes: int = 64 << 20,
              seed: int = 0) -> LLM:
    """An fp32, eager, in-process vLLM ``LLM`` on CPU for ``model`` (a local folder).

    The KV cache is a fixed ``kv_cache_bytes`` (``gpu_memory_utilization`` would mean a share of
    host memory, which varies by machine). Chunked prefill is off with a batch budget of one full
    sequence, because a per-request seed with chunked prefill crashes vLLM's CPU sampler.
    """
    apply_env()
    from vllm import LLM

    return LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=max_model_len,
               kv_cache_memory_bytes=kv_cache_bytes, enable_chunked_prefill=False,
               max_num_batched_tokens=max(max_model_len, 2048), max_num_seqs=64, seed=seed,
               enable_prefix_caching=False, disable_log_stats=True)


def stop_llm(llm: LLM) -> None:
    """Shut the engine down and destroy the process groups vLLM created in this process."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
