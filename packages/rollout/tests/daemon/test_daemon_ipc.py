"""A cuda_ipc weight update through the daemon (front end -> every engine's worker -> engine).

On CPU no engine can open CUDA IPC handles: the update must come back as a typed
``BadRequest`` naming why, from every engine, with the pool's version and weights unchanged
(``hf_daemon`` is left as it was). The GPU path itself is tested on the GPU machine
(packages/trainer/tests/test_gpu_weights.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from treadle.common.errors import BadRequest

PROMPT = np.arange(5, 30, dtype=np.int32)


def _ipc_update():
    spec = importlib.util.spec_from_file_location("treadle_rollout_test_ipc", Path(__file__).parents[1] / "test_ipc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ipc_update


def test_cuda_ipc_update_on_cpu_engines_is_a_typed_refusal(hf_daemon, aio, models, tools):
    health = hf_daemon.call(aio, lambda rc: rc.health())
    digests = hf_daemon.call(aio, lambda rc: rc.weight_digest())
    scores = hf_daemon.call(aio, lambda rc: rc.prompt_logprobs(PROMPT))
    update = _ipc_update()(tools.checkpoint(models["b"]), int(health["version"]) + 1)
    with pytest.raises(BadRequest, match="cuda_ipc needs an engine on a CUDA device"):
        hf_daemon.call(aio, lambda rc: rc.update_weights(update))
    after = hf_daemon.call(aio, lambda rc: rc.health())
    assert after["version"] == health["version"] and after["status"] == "ok" and not after["quarantined"]
    assert hf_daemon.call(aio, lambda rc: rc.weight_digest()) == digests
    np.testing.assert_array_equal(hf_daemon.call(aio, lambda rc: rc.prompt_logprobs(PROMPT)), scores)
