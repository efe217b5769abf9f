"""Weight sync from a bf16 ZeRO-3 trainer on the GPUs (``torchrun``, 1 or 2 ranks) to two real
rollout daemons (hf backend, bf16): over NCCL to one on another GPU, over CUDA IPC to one on
rank 0's GPU, and over CUDA IPC from every rank to a daemon with an engine on each rank's GPU.
Run by test_gpu_weights.py; every rank writes ``<out>/rank<r>.json``.

For each transport, bucketed and per tensor, two syncs with one sender (a training step before
each, so every version differs; the second sync reuses the sender's group or IPC buffer).
After each sync: the daemon's weight digest against the digest of ``full_state_dict`` (an
independent gather; equal means bit-identical), its prompt logprobs against the trainer's own
forward, its version. Then a cuda_ipc update sent to the daemon on the other GPU, which must be
refused (recorded as the exception's class name on every rank) and change nothing.

``--cpu`` runs the collective part over gloo on CPU daemons (a dry run of this script).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from weight_sync_scenarios import attempt, hf_digest, report  # same folder (torchrun's sys.path[0])

PROBE = list(range(5, 60))
CANARY = tuple(range(3, 40))
BF16_TOL = 0.05  # the engine and the trainer run the same bf16 weights through their own kernels


def build(model: str, world: int):  # noqa: ANN201
    from treadle.trainer.config.deepspeed import DeepSpeedConfig
    from treadle.trainer.config.optim import AdamConfig, OptimizerConfig
    from treadle.trainer.models.loading import load_causal_lm
    from treadle.trainer.strategy.deepspeed import build_engine

    ds = DeepSpeedConfig(zero_stage=3, param_dtype="bf16", attn_implementation="sdpa")
    module = load_causal_lm(model, ds, trainable=True)
    optim = OptimizerConfig(adam=AdamConfig(lr=1e-3), lr_scheduler="constant", lr_warmup_ratio=0.0)
    return build_engine(module, ds, optim, micro_batch=1, grad_accum=1, world=world, total_steps=100)


def train_step(engine, seed: int) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    ids = torch.randint(3, 500, (1, 24), generator=g).to(engine.device)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()


def own_logprobs(module: torch.nn.Module, ids: list[int], device: torch.device) -> np.ndarray:
    x = torch.as_tensor(ids, device=device)[None]
    module.eval()
    with torch.no_grad():
        lp = torch.log_softmax(module(input_ids=x).logits[0, :-1].double(), -1)
    module.train()
    return lp.gather(1, x[0, 1:, None]).squeeze(1).cpu().numpy()


def check(engine, client) -> dict:  # noqa: ANN001
    """Daemon vs trainer after a sync (collective: every rank calls it)."""
    from treadle.trainer.checkpoint.export import full_state_dict

    mine = own_logprobs(engine.module, PROBE, engine.device)
    state = full_state_dict(engine, zero_stage=3, is_main=client is not None)
    if client is None:
        return {}
    got = client.prompt_logprobs(np.asarray(PROBE))
    digests = list(client.weight_digest().values())  # one per engine
    return {"gap": float(np.abs(got - mine).max()), "version": client.health()["version"], "engines": len(digests),
            "digest_ok": bool(digests) and digests == [hf_digest(state, tied=True)] * len(digests)}


def cases(cpu: bool) -> list[tuple[str, str, dict]]:
    """(name, which daemon, SenderConfig fields)."""
    from treadle.trainer.weights.sender import SenderConfig  # noqa: F401  (fields checked there)

    backend = "gloo" if cpu else "nccl"
    out = [("nccl_bucketed", "nccl", dict(backend=backend, bucket_bytes=64 << 10, canary_token_ids=CANARY,
                                          canary_tolerance=BF16_TOL)),
           ("nccl_per_tensor", "nccl", dict(backend=backend, bucket_bytes=0))]
    if not cpu:
        out += [("ipc_bucketed", "ipc", dict(transport="cuda_ipc", bucket_bytes=64 << 10, canary_token_ids=CANARY,
                                             canary_tolerance=BF16_TOL)),
                ("ipc_per_tensor", "ipc", dict(transport="cuda_ipc", bucket_bytes=0)),
                # an engine on each rank's GPU: every rank shares its copy, each engine maps its own
                ("ipc_every_rank", "pair", dict(transport="cuda_ipc", ipc_every_rank=True, bucket_bytes=64 << 10,
                                                canary_token_ids=CANARY, canary_tolerance=BF16_TOL))]
    return out


def run(a: argparse.Namespace, clients: dict, main: bool) -> dict:
    from treadle.trainer.weights.sender import SenderConfig, WeightSender

    engine, out = build(a.model, dist.get_world_size()), {}
    versions = {"nccl": 0, "ipc": 0, "pair": 0}
    for k, (name, daemon, fields) in enumerate(cases(a.cpu)):
        client, rounds = clients.get(daemon), []
        with WeightSender(engine, config=SenderConfig(**fields), client=client, zero_stage=3, is_main=main) as s:
            for j in range(2):
                versions[daemon] += 1
                train_step(engine, 10 * k + j)
                rounds.append({"report": report(s.sync(versions[daemon])), **check(engine, client)})
        out[name] = rounds
    # two senders taking turns on one daemon: each join replaces the daemon's group (the other
    # sender's is left, its NCCL communicator aborted); the replaced sender is told its group is
    # stale at its next update, rejoins and resends
    backend = "gloo" if a.cpu else "nccl"
    with WeightSender(engine, config=SenderConfig(backend=backend, bucket_bytes=64 << 10), client=clients.get("nccl"),
                      zero_stage=3, is_main=main) as first, \
            WeightSender(engine, config=SenderConfig(backend=backend, bucket_bytes=64 << 10),
                         client=clients.get("nccl"), zero_stage=3, is_main=main) as second:
        turns = []
        for j, s in enumerate((first, second, first)):
            train_step(engine, 100 + j)
            versions["nccl"] += 1
            turns.append({"report": report(s.sync(versions["nccl"])), **check(engine, client=clients.get("nccl"))})
        out["two_senders"] = turns
    if not a.cpu:  # IPC to the daemon on the other GPU: refused before anything changes
        client = clients.get("nccl")
        before = client.weight_digest() if main else None
        with WeightSender(engine, config=SenderConfig(transport="cuda_ipc"), client=client, zero_stage=3,
                          is_main=main) as s:
            out["ipc_elsewhere"] = attempt(lambda: s.sync(versions["nccl"] + 1))
        out["ipc_elsewhere_unchanged"] = (client.weight_digest() == before and
                                          client.health()["version"] == versions["nccl"]) if main else None
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--nccl_endpoint", required=True)
    parser.add_argument("--ipc_endpoint", default="")
    parser.add_argument("--pair_endpoint", default="", help="a daemon of one engine on each rank's GPU")
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true")
    a = parser.parse_args()
    from treadle.common.log import setup_logging
    from treadle.rollout.client import SyncRolloutClient
    from treadle.trainer.strategy.deepspeed import init_distributed, shutdown_distributed

    setup_logging("WARNING")
    info = init_distributed()
    clients = {}
    if info.is_main:
        clients["nccl"] = SyncRolloutClient(a.nccl_endpoint)
        if a.ipc_endpoint:
            clients["ipc"] = SyncRolloutClient(a.ipc_endpoint)
        if a.pair_endpoint:
            clients["pair"] = SyncRolloutClient(a.pair_endpoint)
    try:
        result = {"world": info.world, **run(a, clients, info.is_main)}
    except Exception:
        result = {"world": info.world, "error": traceback.format_exc()}
        raise
    finally:
        Path(a.out, f"rank{info.rank}.json").write_text(json.dumps(result, indent=1))
        for c in clients.values():
            c.close()
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
