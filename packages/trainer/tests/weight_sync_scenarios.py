"""Weight-sync scenarios under ``torchrun`` (gloo, 1 or 2 ranks), sending a ZeRO-3 engine's
weights to a running rollout daemon (hf backend, fp32, serving tiny model "a"); run by
test_weight_sender.py. Every rank writes ``<out>/rank<r>.json``; the test asserts.

On a ZeRO-3 engine of tiny model "b", each sync after a training step of its own:

- 64 KiB buckets with a canary; the same version again (refused before anything is gathered);
  the next version with the same sender; one tensor per broadcast; inline. After each sync:
  the daemon's prompt logprobs against the engine's own forward, its weight digest against
  the digest of ``full_state_dict`` (an independent gather), its version;
- a sender whose dtype the engine does not serve (refused after the broadcast);
- a peft LoRA model (nonzero B) under ZeRO-3, sent merged, against its own forward.

Failures are recorded as the exception's class name on every rank.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

PROBE = list(range(5, 60))
CANARY = tuple(range(3, 40))


def hf_digest(state: dict[str, torch.Tensor], tied: bool) -> str:
    """The hf engine's ``weight_digest`` of a model holding ``state``: sha256 over its state
    dict sorted by name (a tied ``lm_head.weight`` included, as the embedding)."""
    state = dict(state)
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    h = hashlib.sha256()
    for name, t in sorted(state.items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def own_logprobs(module: torch.nn.Module, ids: list[int]) -> np.ndarray:
    """float64 [P-1] prompt logprobs of the module's own forward (collective under ZeRO-3)."""
    x = torch.as_tensor(ids)[None]
    module.eval()
    with torch.no_grad():
        lp = torch.log_softmax(module(input_ids=x).logits[0, :-1].double(), -1)
    module.train()
    return lp.gather(1, x[0, 1:, None]).squeeze(1).numpy()


def build(model: str, world: int, lora: bool = False):  # noqa: ANN201
    from treadle.trainer.config.deepspeed import DeepSpeedConfig, LoraConfig
    from treadle.trainer.config.optim import AdamConfig, OptimizerConfig
    from treadle.trainer.models.loading import load_causal_lm
    from treadle.trainer.strategy.deepspeed import build_engine

    ds = DeepSpeedConfig(zero_stage=3, param_dtype="fp32", lora=LoraConfig(rank=4 if lora else 0, alpha=8))
    module = load_causal_lm(model, ds, trainable=True)
    if lora:  # peft starts B at zero (a no-op adapter): make the merge matter
        g = torch.Generator().manual_seed(5)
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.data.copy_(0.05 * torch.randn(p.shape, generator=g))
    optim = OptimizerConfig(adam=AdamConfig(lr=1e-3), lr_scheduler="constant", lr_warmup_ratio=0.0)
    return build_engine(module, ds, optim, micro_batch=1, grad_accum=1, world=world, total_steps=100)


def train_step(engine, seed: int) -> None:  # noqa: ANN001
    ids = torch.randint(3, 500, (1, 24), generator=torch.Generator().manual_seed(seed + dist.get_rank()))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()


def check(engine, client, digest: bool = True) -> dict:  # noqa: ANN001
    """Daemon vs trainer after a sync (collective: every rank calls it)."""
    from treadle.trainer.checkpoint.export import full_state_dict

    mine = own_logprobs(engine.module, PROBE)
    state = full_state_dict(engine, zero_stage=3, is_main=client is not None) if digest else None
    if client is None:
        return {}
    got = client.prompt_logprobs(np.asarray(PROBE))
    out = {"gap": float(np.abs(got - mine).max()), "version": client.health()["version"]}
    if digest:
        out["digest_ok"] = list(client.weight_digest().values()) == [hf_digest(state, tied=True)]
    return out


def report(r) -> dict:  # noqa: ANN001
    return {"version": r.version, "tensors": r.tensors, "bytes": r.bytes, "buckets": r.buckets,
            "updated": r.updated, "failed": r.failed, "seconds": r.seconds, "engine_seconds": r.engine_seconds}


def attempt(fn) -> str:  # noqa: ANN001
    """The class name of what ``fn()`` raised ("" if nothing)."""
    try:
        fn()
    except Exception as e:  # the test asserts the class on every rank
        return type(e).__name__
    return ""


def zero3(a: argparse.Namespace, client, main: bool) -> dict:  # noqa: ANN001
    """Every check, on however many ranks torchrun started (see the module docstring)."""
    from treadle.trainer.weights.sender import SenderConfig, WeightSender

    engine, out, v = build(a.model, dist.get_world_size()), {}, a.version
    sender = WeightSender(engine, config=SenderConfig(bucket_bytes=64 << 10, canary_token_ids=CANARY),
                          client=client, zero_stage=3, is_main=main)
    train_step(engine, v)
    out["bucketed"] = {"report": report(sender.sync(v)), **check(engine, client)}
    out["same_version"] = attempt(lambda: sender.sync(v))
    train_step(engine, v + 1)
    out["next_version"] = {"report": report(sender.sync(v + 1)), **check(engine, client)}
    sender.close()
    for k, (name, cfg) in enumerate((("per_tensor", SenderConfig(bucket_bytes=0)),
                                     ("inline", SenderConfig(transport="inline"))), start=2):
        train_step(engine, v + k)
        with WeightSender(engine, config=cfg, client=client, zero_stage=3, is_main=main) as other:
            out[name] = {"report": report(other.sync(v + k)), **check(engine, client)}
    wrong = WeightSender(engine, config=SenderConfig(dtype="bfloat16", bucket_bytes=64 << 10), client=client,
                         zero_stage=3, is_main=main)
    out["wrong_dtype"] = attempt(lambda: wrong.sync(v + 4))
    out["after_wrong"] = client.health()["version"] if main else None
    wrong.close()
    lora = build(a.model, dist.get_world_size(), lora=True)
    train_step(lora, v + 5)
    with WeightSender(lora, config=SenderConfig(bucket_bytes=64 << 10), client=client, zero_stage=3,
                      is_main=main) as other:
        out["lora"] = {"report": report(other.sync(v + 5)), **check(lora, client)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--version", type=int, required=True)
    parser.add_argument("--out", required=True)
    a = parser.parse_args()
    from treadle.common.log import setup_logging
    from treadle.rollout.client import SyncRolloutClient
    from treadle.trainer.strategy.deepspeed import init_distributed, shutdown_distributed

    setup_logging("WARNING")
    info = init_distributed()
    client = SyncRolloutClient(a.endpoint) if info.is_main else None
    try:
        result = {"world": info.world, **zero3(a, client, info.is_main)}
        Path(a.out, f"rank{info.rank}.json").write_text(json.dumps(result, indent=1))
    finally:
        if client is not None:
            client.close()
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
