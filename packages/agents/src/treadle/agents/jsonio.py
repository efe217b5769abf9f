"""Trajectories as JSON, for the gateway's HTTP routes (light: numpy and treadle.common only).

Arrays become lists (token ids as ints, logprobs as the exact float32 values written as JSON
numbers, which read back bit-identical) and every other field keeps its name, so
``trajectory_from_json(trajectory_to_json(t))`` equals ``t`` (``records.same``). ZeroMQ users get
the binary codec instead (``treadle.common.codec``); this is for HTTP and humans.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from treadle.common.records import Trajectory

_ARRAYS = {"prompt_token_ids": np.int32, "response_token_ids": np.int32, "rollout_logprobs": np.float32,
           "loss_mask": np.uint8, "token_rewards": np.float32}


def trajectory_to_json(t: Trajectory) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in t.__struct_fields__:
        value = getattr(t, name)
        out[name] = None if value is None else np.asarray(value).tolist() if name in _ARRAYS else value
    return out


def trajectory_from_json(d: dict[str, Any]) -> Trajectory:
    kw = {k: (np.asarray(v, dtype=_ARRAYS[k]) if k in _ARRAYS and v is not None else v) for k, v in d.items()}
    return Trajectory(**kw)
