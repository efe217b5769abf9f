"""GPU: ``treadle-rollout serve`` with two vllm engines on one CUDA device.

test_daemon_vllm.py's own tests (logprobs against the HF model, inline and collective updates,
restart catch-up, stale groups), collected here against ``vllm_daemon``, whose engines run on
CUDA on the GPU machine (fp32, eager, 64 MiB KV each; exact with ``TRITON_F32_DEFAULT=ieee``, set
by tools/gpu_tests.sh). Leaves the daemon at weight version 3 (model "b"), as that module does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from treadle_testing import load_by_path

# device_count(), not is_available(): that asks the CUDA runtime, which poisons fork, and vLLM forks its
# engine core ("Cannot re-initialize CUDA in forked subprocess"); device_count() asks NVML.
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs CUDA")]

_suite = load_by_path("treadle_rollout_daemon_vllm", Path(__file__).with_name("test_daemon_vllm.py"))
globals().update({k: v for k, v in vars(_suite).items() if k.startswith("test_")})
