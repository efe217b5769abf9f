#!/usr/bin/env python3
"""Benchmark: the policy's forward + backward with the LM head on every column vs only on the
columns that predict a trained token (``forward_logprobs(targets_only=True)``), same run,
interleaved, medians.

A packed row of ``--samples`` RL-shaped sequences (``--prompt`` untrained tokens, then
``--response`` trained ones), the loss a sum of log-probs and entropies at the trained tokens
(what PPO's actor step reads). Models built from a config, random init: the ``small`` test
model's shape at its own vocabulary and at larger ones (the LM head's share grows with it).

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_target_logprobs.py --json .cache/bench_target_logprobs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from treadle.trainer.data.batching import pack_batch
from treadle.trainer.data.samples import Sample, TokenSeq
from treadle.trainer.models.actor import Actor


def build(vocab: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).float()


def batch(vocab: int, samples: int, prompt: int, response: int):  # noqa: ANN201
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(samples):
        ids = torch.randint(3, vocab, (prompt + response,), generator=g).tolist()
        rows.append(Sample(seqs=(TokenSeq.of(ids, [j >= prompt for j in range(prompt + response)]),), index=i))
    return pack_batch(rows)


def step(actor: Actor, b, targets_only: bool) -> float:  # noqa: ANN001
    start = time.perf_counter()
    out = actor(b, with_entropy=True, targets_only=targets_only)
    m = b.target_mask
    (out.logprobs[m].sum() + 0.01 * out.entropy[m].sum()).backward()
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocabs", default="4096,32000,151936")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt", type=int, default=192)
    p.add_argument("--response", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default="")
    a = p.parse_args()
    results = []
    for vocab in (int(v) for v in a.vocabs.split(",")):
        model = build(vocab)
        actor, b = Actor(model), batch(vocab, a.samples, a.prompt, a.response)
        times = {False: [], True: []}
        for r in range(a.repeats + 1):
            for only in ((False, True) if r % 2 == 0 else (True, False)):
                model.zero_grad(set_to_none=True)
                t = step(actor, b, only)
                if r:
                    times[only].append(t)
        full, only = statistics.median(times[False]), statistics.median(times[True])
        paired = statistics.median(f / o for f, o in zip(times[False], times[True], strict=True))
        row = {"vocab": vocab, "tokens": int(b.input_ids.numel()), "trained": int(b.target_mask.sum()),
               "full_s": full, "targets_only_s": only, "speedup_medians": full / only, "speedup_paired": paired}
        results.append(row)
        print(f"vocab {vocab:>7}: every column {full * 1e3:8.1f} ms, target columns {only * 1e3:8.1f} ms, "
              f"{full / only:.2f}x (paired {paired:.2f}x)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "threads": torch.get_num_threads(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
