"""Ring-attention scenarios run by test_ring.py under ``torchrun --nproc_per_node N`` (gloo, CPU).
Rank 0 writes ``<out>/results.json``; the test asserts. One launch per world size keeps the
suite fast (start-up and imports dominate on a 2-core CPU). On a CUDA machine the same
scenarios run with NCCL, one GPU per rank (``test_ring.py``'s ``gpu`` test).

- ``attention``: the ring kernel against plain causal attention of the whole row, for every ring
  size dividing the world (2 and 4 on 4 ranks: two rings of 2, one of 4): outputs and dq, dk, dv
  in fp32 for one sequence (``causal``), several packed sequences with lengths that are not
  multiples of 2R, one of them a single token (``packed``), one odd-length sequence
  (``uneven``); grouped-query heads with head strides 1 and 2; small score tiles.
- ``model``: the tiny Qwen2 with ring attention against the same weights with SDPA on a packed
  batch: the actor's log-probs and entropies, the value model's values, and the parameter
  gradients (ring ranks' partial gradients summed over the ring).
- ``sft``: per-step SFT losses, gradient norms and the eval loss of ring size 1 against ring
  size 2 (ZeRO-2, and ZeRO-3 with gradient checkpointing), packed; on 4 ranks ring 2 means 2
  data-parallel slots x 2.
- ``recipes``: RM, DPO (reference on the fly) and KTO (reference precomputed) losses with ring
  size 2 against ring size 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

CASES = {"causal": [64], "packed": [13, 1, 30, 7, 21], "uneven": [37]}


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Plain causal attention per packed sequence: q [H, T, d], k, v [Hk, T, d] -> [H, T, d]."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(q.device)
    pos = torch.arange(q.shape[1], device=q.device)
    mask = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v


def _max_over_ranks(values: dict[str, float], device: torch.device) -> dict[str, float]:
    t = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(values, t.tolist(), strict=True))


def _one_attention(ring, device: torch.device, lengths: list[int], heads: tuple[int, int], stride: int,  # noqa: ANN001
                   budget: int | None = None, kernel: str | None = None) -> dict[str, float]:
    from dataclasses import replace

    from treadle.trainer.ring.attention import ring_attention
    from treadle.trainer.ring.blocks import plan
    from treadle.trainer.ring.layout import zigzag_layout
    from treadle.trainer.ring.shard import RingShard, gather_tokens

    ring = replace(ring, head_stride=stride)
    g = torch.Generator().manual_seed(sum(lengths) * 7 + heads[0])
    total, d = sum(lengths), 16
    q, w = torch.randn(heads[0], total, d, generator=g), torch.randn(1, total, heads[0], d, generator=g)
    k, v = torch.randn(heads[1], total, d, generator=g), torch.randn(heads[1], total, d, generator=g)
    q, w, k, v = (t.to(device) for t in (q, w, k, v))
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = _reference(*full, lengths)
    (ref.transpose(0, 1)[None] * w).sum().backward()
    layout = zigzag_layout(torch.tensor(lengths), ring.size, ring.rank)
    idx = layout.local_index.clamp(min=0).to(device)
    local = [t[:, idx].clone().requires_grad_(True) for t in (q, k, v)]  # padding slots: copies, never seen
    shard = RingShard(batch=None, next_ids=None, layout=layout, ring=ring, cu_seqlens=layout.cu_seqlens,
                      plan=plan(layout, device, budget=budget, kernel=kernel))
    out = ring_attention(*local, shard, d ** -0.5)
    whole = gather_tokens(out.transpose(0, 1)[None], shard)
    (whole * w).sum().backward()
    real = (layout.local_index >= 0).to(device)
    diffs = {"out": (whole[0].transpose(0, 1) - ref).abs().max().item()}
    for name, a, b in zip(("dq", "dk", "dv"), local, full, strict=True):
        expect = torch.where(real[None, :, None], b.grad[:, idx], torch.zeros_like(a.grad))
        diffs[name] = (a.grad - expect).abs().max().item()
    diffs["scale"] = max(ref.abs().max().item(), full[0].grad.abs().max().item())
    return diffs


def attention(a: argparse.Namespace, info) -> dict:  # noqa: ANN001
    from treadle.trainer.ring.group import setup_ring

    out, dev = {}, info.device
    kernels = ("math", "cpu_flash") if dev.type == "cpu" else ("math",)
    for size in (s for s in (2, 4) if info.world % s == 0):
        ring = setup_ring(size, 1, info)
        for name, lengths in CASES.items():
            out[f"R{size}/{name}"] = _max_over_ranks(_one_attention(ring, dev, lengths, (4, 2), 1), dev)
        out[f"R{size}/packed_stride2"] = _max_over_ranks(_one_attention(ring, dev, CASES["packed"], (4, 2), 2), dev)
        out[f"R{size}/packed_mha"] = _max_over_ranks(_one_attention(ring, dev, CASES["packed"], (2, 2), 1), dev)
        for kernel in kernels:  # small tiles: several per step, key ranges cut short
            for name in ("causal", "packed"):
                out[f"R{size}/{name}_tiles_{kernel}"] = _max_over_ranks(
                    _one_attention(ring, dev, CASES[name], (4, 2), 1, budget=64, kernel=kernel), dev)
    return out


def _samples(lengths: list[int]) -> list:
    from treadle.trainer.data.samples import Sample, TokenSeq

    g = torch.Generator().manual_seed(1)
    return [Sample(seqs=(TokenSeq.of(torch.randint(3, 500, (n,), generator=g).tolist(), [i % 3 != 0 for i in range(n)]),),
                   index=k) for k, n in enumerate(lengths)]


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def model(a: argparse.Namespace, info) -> dict:  # noqa: ANN001
    from treadle.trainer.config.deepspeed import DeepSpeedConfig
    from treadle.trainer.data.batching import pack_batch
    from treadle.trainer.models.actor import Actor
    from treadle.trainer.models.loading import load_causal_lm
    from treadle.trainer.models.value_model import ValueModel, token_values
    from treadle.trainer.ring.group import setup_ring

    dev = info.device
    batch = pack_batch(_samples([23, 9, 1, 40, 14])).to(dev)
    plain_ds = DeepSpeedConfig(param_dtype="fp32")
    plain = load_causal_lm(a.model, plain_ds, trainable=True).to(dev)
    ref = Actor(plain)(batch, with_entropy=True)
    (ref.logprobs * batch.target_mask).sum().backward()
    ref_grads = _grads(plain)
    torch.manual_seed(0)
    ref_values = ValueModel.from_pretrained(a.model, plain_ds).to(dev)(**batch.model_inputs())
    out = {}
    for size in (s for s in (2, 4) if info.world % s == 0):
        ring = setup_ring(size, 1, info)
        ds = DeepSpeedConfig(param_dtype="fp32", packing_samples=True, ring_attn_size=size)
        sharded = load_causal_lm(a.model, ds, trainable=True).to(dev)
        got = Actor(sharded, ring=ring)(batch, with_entropy=True)
        (got.logprobs * batch.target_mask).sum().backward()
        grads = _grads(sharded)
        for g in grads.values():
            dist.all_reduce(g, group=ring.group)  # each ring rank holds the part of its own tokens
        torch.manual_seed(0)
        values = token_values(ValueModel.from_pretrained(a.model, ds).to(dev), batch, ring)
        out[f"R{size}"] = _max_over_ranks({
            "logprobs": (got.logprobs - ref.logprobs).abs().max().item(),
            "entropy": (got.entropy - ref.entropy).abs().max().item(),
            "values": (values - ref_values).abs().max().item(),
            "grads": max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads),
            "missing_grads": float(len(set(ref_grads) ^ set(grads))),
            "attn": float(sharded.config._attn_implementation != "treadle_ring"),
        }, dev)
        out[f"R{size}"]["grad_scale"] = max(g.abs().max().item() for g in ref_grads.values())
    return out


def sft_argv(a: argparse.Namespace, name: str, *extra: str) -> list[str]:
    return ["--actor.model_name_or_path", a.model, "--data.dataset", f"{a.data}/sft.jsonl",
            "--data.input_key", "question", "--data.output_key", "response", "--data.input_template", "User: {}\nAssistant: ",
            "--data.max_samples", "24", "--train.batch_size", "8", "--train.micro_batch_size", "2",
            "--ds.param_dtype", "fp32", "--adam.lr", "1e-3", "--lr_warmup_ratio", "0", "--lr_scheduler", "constant",
            "--ds.packing_samples", "--eval.dataset", f"{a.out}/eval.jsonl", "--ckpt.path", f"{a.out}/{name}/ckpt",
            "--ckpt.output_dir", f"{a.out}/{name}/model", *extra]


def sft(a: argparse.Namespace, info, steps: int = 3) -> dict:  # noqa: ANN001
    from treadle.trainer.config import parse_sft
    from treadle.trainer.trainers.sft import build_trainer

    if info.rank == 0:  # 11 evaluation rows: uneven shares, so filler samples are exercised too
        rows = Path(a.data, "sft.jsonl").read_text().splitlines()[:11]
        Path(a.out, "eval.jsonl").write_text("".join(r + "\n" for r in rows))
    dist.barrier()
    variants = {"ring1_zero2": ["--ds.zero_stage", "2"],
                "ring2_zero2": ["--ds.zero_stage", "2", "--ds.ring_attn_size", "2"],
                "ring2_zero3": ["--ds.zero_stage", "3", "--ds.ring_attn_size", "2", "--actor.gradient_checkpointing_enable"]}
    if a.only_sft:
        variants = {k: v for k, v in variants.items() if k in a.only_sft.split(",")}
    out = {}
    for name, extra in variants.items():
        trainer = build_trainer(parse_sft(sft_argv(a, name, *extra)))
        rows = [trainer.train_step(0, s) for s in range(steps)]
        out[name] = {"loss": [r["loss"] for r in rows], "grad_norm": [r.get("grad_norm") for r in rows],
                     "tokens": [r["tokens"] for r in rows], "eval": trainer.evaluate()}
    return out


def recipes(a: argparse.Namespace, info, steps: int = 2) -> dict:  # noqa: ANN001
    from treadle.trainer.config import parse_dpo, parse_kto, parse_rm
    from treadle.trainer.trainers import dpo, kto, rm

    common = ["--actor.model_name_or_path", a.model, "--train.batch_size", "8", "--train.micro_batch_size", "2",
              "--ds.param_dtype", "fp32", "--adam.lr", "1e-3", "--lr_warmup_ratio", "0", "--lr_scheduler", "constant",
              "--data.max_samples", "16", "--ds.packing_samples", "--ds.zero_stage", "2"]
    pref = ["--data.dataset", f"{a.data}/pref.jsonl", "--data.prompt_key", "prompt"]
    runs = {"rm": (rm, parse_rm, pref), "dpo": (dpo, parse_dpo, pref),  # DPO: reference on the fly, on the ring
            "kto": (kto, parse_kto, ["--data.dataset", f"{a.data}/kto.jsonl", "--ref.precompute_enable"])}
    out = {}
    for size in ("1", "2"):
        for name, (module, parse, extra) in runs.items():
            run = f"{name}_ring{size}"
            trainer = module.build_trainer(parse([*common, *extra, "--ds.ring_attn_size", size, "--ckpt.path",
                                                  f"{a.out}/{run}/ckpt", "--ckpt.output_dir", f"{a.out}/{run}/model"]))
            out[run] = [trainer.train_step(0, s)["loss"] for s in range(steps)]
    return out


SCENARIOS = {"attention": attention, "model": model, "sft": sft, "recipes": recipes}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", default="")
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="attention,model")
    parser.add_argument("--only_sft", default="")
    a = parser.parse_args()
    from treadle.common.log import setup_logging

    setup_logging("WARNING")
    if {"sft", "recipes"} & set(a.only.split(",")):
        from treadle.trainer.strategy.deepspeed import init_distributed

        info = init_distributed()
    else:  # no DeepSpeed import: a plain group starts faster (gloo on CPU, NCCL on CUDA)
        from treadle.trainer.strategy.deepspeed import DistInfo

        cuda = torch.cuda.is_available()
        dist.init_process_group("nccl" if cuda else "gloo")
        local = dist.get_rank() % torch.cuda.device_count() if cuda else dist.get_rank()
        device = torch.device("cuda", local) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        info = DistInfo(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local, device=device)
    results = {"world": info.world}
    try:
        for name in a.only.split(","):
            results[name] = SCENARIOS[name](a, info)
        if info.rank == 0:
            Path(a.out, "results.json").write_text(json.dumps(results, indent=1))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
