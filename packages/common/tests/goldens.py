"""Canonical example messages of every record type, and the committed golden frames.

``python packages/common/tests/goldens.py`` (re)writes ``goldens/v<PROTOCOL_MAJOR>/<Type>.msgpack``:
each file is a msgpack array of the message's frames (bytes). Only regenerate on purpose: a
changed golden means older peers can no longer read what we send. When the wire changes
incompatibly, bump ``PROTOCOL_MAJOR`` and keep the old directory: its goldens must then fail
with a clear ``VersionMismatch`` (or still decode, if a compatibility path exists).
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import numpy as np

from treadle.common.codec import PROTOCOL_MAJOR, encode
from treadle.common.records import (
    Ack,
    CollectiveWeights,
    Control,
    CriticCheckpoint,
    CriticReady,
    CriticSetup,
    CriticTrainRequest,
    CriticTrainResult,
    CriticValues,
    CriticValuesRequest,
    Error,
    GenerateRequest,
    GenerateResult,
    InlineWeights,
    IpcWeights,
    LoraAdapter,
    RewardRequest,
    RewardResult,
    SamplingParams,
    Trajectory,
    TrajectoryBatch,
    WeightGroupSpec,
)

GOLDEN_DIR = Path(__file__).parent / "goldens"


def _traj(seed: int, n: int) -> Trajectory:
    rng = np.random.default_rng(seed)
    return Trajectory(
        prompt_token_ids=np.arange(5, dtype=np.int32),
        response_token_ids=rng.integers(0, 1000, n, dtype=np.int32),
        rollout_logprobs=-rng.random(n, dtype=np.float32),
        loss_mask=(np.arange(n) % 3 != 0).astype(np.uint8),
        reward=1.0, token_rewards=np.linspace(0, 1, n, dtype=np.float32), score=0.5,
        min_policy_version=3, max_policy_version=4, truncated=True, finish_reason="length",
        uid="traj-1", group_id="g-1", extra_logs={"acc": 1.0}, info={"label": "42", "row": 7, "tags": ["a", None]},
    )


def examples() -> dict[str, tuple[object, dict]]:
    """Wire name -> (record, encode kwargs). Deterministic: goldens are built from these."""
    sp = SamplingParams(n=4, temperature=0.7, top_p=0.9, top_k=20, max_tokens=64, stop_token_ids=[2, 3], seed=11,
                        prompt_logprobs=True)
    big = np.arange(1024, dtype=np.float32)  # 4 KiB: travels as its own frame
    group = WeightGroupSpec(host="10.0.0.1", port=29500, world_size=5, rank=1, backend="nccl", timeout_s=60.0)
    return {
        "SamplingParams": (sp, {"id": 1, "op": "call", "method": "noop"}),
        "GenerateRequest": (GenerateRequest(prompt_token_ids=np.array([1, 2, 3], np.int32), sampling=sp, key="r1",
                                            min_version=2), {"id": 2, "op": "call", "method": "generate"}),
        "GenerateResult": (GenerateResult(response_token_ids=np.arange(600, dtype=np.int32),
                                          logprobs=np.full(600, -0.5, np.float32), finish_reason="stop", index=1,
                                          key="r1", weight_version=3, engine_id="e0"), {"id": 2, "op": "chunk"}),
        "Trajectory": (_traj(0, 16), {"id": 3, "op": "data"}),
        "TrajectoryBatch": (TrajectoryBatch(trajectories=[_traj(1, 8), _traj(2, 700)], step=9), {"id": 4, "op": "call",
                                                                                                 "method": "push"}),
        "RewardRequest": (RewardRequest(queries=["1+1=2", "2+2=5"], prompts=["1+1=", "2+2="], labels=["2", "4"],
                                        key="k"), {"id": 5, "op": "call", "method": "reward"}),
        "RewardResult": (RewardResult(rewards=np.array([1.0, 0.0], np.float32), scores=np.array([1.0, 0.0], np.float32),
                                      failed=[False, True], errors=["", "timeout"], extra_logs={"len": [5.0, 5.0]},
                                      provenance={"fn": "math", "hash": "abc"}), {"id": 5, "op": "reply"}),
        "InlineWeights": (InlineWeights(version=7, names=["w", "b"], dtypes=["float32", "int64"], shapes=[[32, 32], [3]],
                                        tensors=[big.reshape(32, 32), np.array([1, 2, 3])],
                                        canary_token_ids=np.array([5, 6, 7], np.int32),
                                        canary_logprobs=np.array([-1.0, -2.0], np.float32)),
                          {"id": 6, "op": "call", "method": "update_weights"}),
        "WeightGroupSpec": (group, {"id": 10, "op": "call", "method": "join_weight_group"}),
        "CollectiveWeights": (CollectiveWeights(version=8, names=["w", "b", "c"], dtypes=["bfloat16", "float32", "int64"],
                                                shapes=[[4096, 64], [64], [3]], bucket_sizes=[1, 2], group=group,
                                                canary_tolerance=1e-4),
                              {"id": 11, "op": "call", "method": "update_weights"}),
        "IpcWeights": (IpcWeights(version=9, names=["w", "b"], dtypes=["bfloat16", "float32"], shapes=[[4096, 64], [64]],
                                  bucket_sizes=[2], handles=[b"\x81\xa6format\x01"]),
                       {"id": 12, "op": "call", "method": "update_weights_abort"}),
        "LoraAdapter": (LoraAdapter(rank=16, alpha=32.0, target_modules=["q_proj", "v_proj"]),
                        {"id": 13, "op": "call", "method": "noop"}),
        "Control": (Control(op="stats", args={"in_flight": 3, "ok": True, "engines": [{"id": "e0", "load": 0.5}]}),
                    {"id": 7, "op": "reply"}),
        "Error": (Error(code="busy", message="in-flight limit 4 reached", retryable=True), {"id": 8, "op": "error"}),
        "Ack": (Ack(note="done"), {"id": 9, "op": "reply"}),
        "CriticSetup": (CriticSetup(config="critic:\n  value_clip: 0.5\n", total_opt_steps=12, pad_id=0),
                        {"id": 14, "op": "call", "method": "setup"}),
        "CriticReady": (CriticReady(world=2, model="/models/rm", trained_steps=3), {"id": 14, "op": "reply"}),
        "CriticValuesRequest": (CriticValuesRequest(trajectories=[_traj(3, 8)]), {"id": 15, "op": "call",
                                                                               "method": "values"}),
        "CriticValues": (CriticValues(values=np.linspace(-1, 1, 8, dtype=np.float32)), {"id": 15, "op": "reply"}),
        "CriticTrainRequest": (CriticTrainRequest(step=4, uids=["u3"], returns=np.full(8, 0.25, np.float32)),
                               {"id": 16, "op": "call", "method": "train"}),
        "CriticTrainResult": (CriticTrainResult(metrics={"critic/loss": 0.125, "critic/lr": 9e-6}),
                              {"id": 16, "op": "reply"}),
        "CriticCheckpoint": (CriticCheckpoint(path="/ckpt/.tmp-step_00000004"), {"id": 17, "op": "call",
                                                                                "method": "save"}),
    }


def frames_of(name: str) -> list[bytes]:
    rec, kw = examples()[name]
    return [bytes(memoryview(f).cast("B")) for f in encode(rec, **kw)]


def write(version: int = PROTOCOL_MAJOR) -> list[Path]:
    out = GOLDEN_DIR / f"v{version}"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in examples():
        path = out / f"{name}.msgpack"
        path.write_bytes(msgspec.msgpack.encode(frames_of(name)))
        written.append(path)
    return written


if __name__ == "__main__":
    for p in write():
        print(p)
    sys.exit(0)
