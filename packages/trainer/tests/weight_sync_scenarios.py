"""Weight-sync scenarios under ``torchrun`` (gloo, 1 or 2 ranks), sending a ZeRO-3 engine's
weights to a running rollout daemon (hf backend, fp32, serving tiny model "a"); run by
test_weight_sender.py. Every rank writes ``<out>/rank<r>.json``; the test asserts.

On a ZeRO-3 engine of tiny model "b", each sync after a training step of its own:

- 64 KiB buckets with a canary; the same version again (refused before anything is gathered);
  the next version with the same sender; one tensor per broadcast; inline. After each sync:
  the daemon's prompt logprobs against the engine's own forward, its weight digest against
  the digest of ``full_state_dict`` (an independent gather), its version;
- a sender whose dtype the engine does not serve (refused after the broadcast);
- a peft LoRA model (nonzero B) under ZeRO-3, sent merged, against its own forward;
- peer reads (rank 0 reads the other ranks' partitions; here through ``CopiedPeerReads``, a
  named fake of the CUDA IPC mapping): a sync, the same version again (refused while rank 0
  was already packing), and a sync after the daemon left the group (rejoined, walked again).

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
            "updated": r.updated, "failed": r.failed, "seconds": r.seconds, "engine_seconds": r.engine_seconds,
            "stamps": r.stamps}


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
    # ramped buckets: the tied embedding (> 64 KiB) goes last, the first buckets hold 8 KiB, 16 KiB, ...
    sender = WeightSender(engine, config=SenderConfig(bucket_bytes=64 << 10, canary_token_ids=CANARY, ramp=3),
                          client=client, zero_stage=3, is_main=main)
    train_step(engine, v)
    out["bucketed"] = {"report": report(sender.sync(v)), **check(engine, client)}
    out["sent_order"] = [it.name for it in sender._in_send_order(sender._plan(sender._module, sender._dtype))]
    out["model_order"] = [it.name for it in sender._plan(sender._module, sender._dtype)]
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
    out["coalesced_equals_deepspeed"] = [gathers_agree(m) for m in (engine.module, lora.module)]
    out.update(peer_reads(engine, client, main, v + 6))
    return out


class CopiedPeerReads:
    """A named fake of ``PeerReads`` for CPU runs (its neighbour, CUDA IPC, needs GPUs): at
    ``prepare`` every rank's partitions reach rank 0 as copies over gloo, and rank 0 reads those
    copies as if they were the other ranks' mapped memory. What it exercises is the sender's
    peer-read path: the walk on rank 0 alone, the update announced before it, refusals and
    rejoins handled by rank 0 while the other ranks wait for the outcome."""

    def __init__(self, group) -> None:  # noqa: ANN001
        from treadle.trainer.weights.peers import PeerReads

        self._real = PeerReads(group, direct=True)  # its rows (``rows``): views of the copies
        self.active = False
        self.generation = 0

    def prepare(self, params, *, main: bool) -> bool:  # noqa: ANN001
        world = dist.get_world_size()
        local = torch.cat([p.ds_tensor.reshape(-1) for p in params])
        copies = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(copies, local)
        if main:
            where, at = {}, 0
            for p in params:
                nbytes = p.ds_tensor.numel() * p.ds_tensor.element_size()
                where[id(p)] = [(c.view(torch.uint8), at, nbytes) for c in copies[1:]]
                at += nbytes
            self._real._where = where
            self._real._kept.clear()  # new copies at every sync: the views into the last ones are stale
            self._real.generation += 1  # and so are the packing views kept under the rows' name
            self.generation = self._real.generation
        self.active = True
        return True

    def rows(self, params):  # noqa: ANN001, ANN201
        return self._real.rows(params)

    def close(self) -> None:
        self._real.close()


def peer_reads(engine, client, main: bool, v: int) -> dict:  # noqa: ANN001
    """The peer-read path of the sender on CPU (``CopiedPeerReads``); see the module docstring."""
    from treadle.trainer.weights import sender as sender_mod
    from treadle.trainer.weights.sender import SenderConfig, WeightSender

    out = {}
    real, sender_mod.PeerReads = sender_mod.PeerReads, CopiedPeerReads
    try:
        with WeightSender(engine, config=SenderConfig(bucket_bytes=64 << 10, peer_reads=True, ramp=2), client=client,
                          zero_stage=3, is_main=main) as s:
            train_step(engine, v)
            out["peer"] = {"report": report(s.sync(v)), **check(engine, client)}
            out["peer_active"] = s._peers is not None and s._peers.active
            out["peer_same_version"] = attempt(lambda: s.sync(v))
            if main:
                client.leave_weight_group()  # as after a daemon restart: the next update is refused, rejoined
            train_step(engine, v + 1)
            out["peer_rejoined"] = {"report": report(s.sync(v + 1)), **check(engine, client)}
    finally:
        sender_mod.PeerReads = real
    return out


def gathers_agree(module: torch.nn.Module) -> bool:
    """The sender's one-collective-a-bucket values (an all-gather, and a gather to rank 0 read
    there) equal DeepSpeed's GatheredParameters', bit for bit, for every item (merged LoRA
    weights included). Collective."""
    import torch.distributed as dist

    from treadle.rollout.engine.weights import plan_buckets
    from treadle.trainer.weights.gather import gathered, plan

    items = plan(module)
    sizes = plan_buckets([it.nbytes for it in items], 64 << 10)
    values = []
    for coalesce, only_first in ((False, False), (True, False), (True, True)):
        keep = not only_first or dist.get_rank() == 0
        got = {}
        for lo, hi in gathered(items, sizes, zero3=True, coalesce=coalesce, keep=keep, only_first=only_first):
            if keep:
                got.update({it.name: it.value().clone() for it in items[lo:hi]})
        values.append(got)
    same = [v.keys() == values[0].keys() and all(torch.equal(v[k], values[0][k]) for k in v) for v in values[1:] if v]
    # the sender's walk: each bucket scattered from the gathered partitions straight into its
    # packed layout (odd sizes included: ZeRO-3's padded last partition) = packing DeepSpeed's values
    from treadle.rollout.engine.weights import unpack_bucket
    from treadle.trainer.weights.gather import Kept, bucket_bytes, packed, prepare_pulls
    from treadle.trainer.weights.peers import PeerReads

    main = dist.get_rank() == 0
    # peer reads on CPU: no rank can share its partitions over CUDA IPC, so every rank falls back
    # to the gathers alike (the walk below would hang otherwise) and the bytes are the same
    peers = PeerReads(None)
    pull = prepare_pulls(items, sizes, peers, zero3=True, main=main)
    flats = [(lo, hi, f.clone()) for lo, hi, f in packed(
        items, sizes, lambda lo, hi: torch.full((bucket_bytes(items[lo:hi]) + 8,), 7, dtype=torch.uint8),
        zero3=True, main=main, peers=peers if pull else None, kept=Kept()) if f is not None]
    same.append(not pull and not peers.active)
    # every rank learnt it from rank 0's answer: later syncs gather at once, without asking again
    # (one rank: nothing to read, never asked)
    same.append((peers.disabled or dist.get_world_size() == 1)
                and not prepare_pulls(items, sizes, peers, zero3=True, main=main))
    if main:
        for lo, hi, flat in flats:
            _, views = unpack_bucket([it.dtype_name for it in items[lo:hi]], [it.shape for it in items[lo:hi]], flat=flat)
            same.append(all(torch.equal(v, values[0][it.name]) for it, v in zip(items[lo:hi], views, strict=True)))
        same.append(len(flats) == len(sizes))
    return len(same) == (5 + len(sizes) if main else 3) and all(same)


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
