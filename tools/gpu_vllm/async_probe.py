#!/usr/bin/env python3
"""Where vLLM's AsyncLLM loses generation speed against ``LLM.generate`` (issue 30, benchmark 1).

treadle's vLLM backend (``VllmEngine``) runs ``AsyncLLM`` with the engine core in its own
process or not (``--engine.multiprocess``), streams each request's outputs as deltas, and asks
for per-request seeds and the sampled tokens' logprobs. On the 0.5B shape it generated ~17k new
tokens/s where ``LLM.generate`` alone did ~40k. One configuration per run of this script (vLLM
reads its environment once per process):

    python3 tools/gpu_vllm/async_probe.py --multiprocess 0 --kind delta --out /tmp/out/p.json

Each run: one AsyncLLM (bf16, compiled, 0.35 of the GPU, prefix caching off, as treadle's), 256
prompts of 16-64 random tokens, each sampled for exactly 256 tokens at temperature 1, all in
flight at once; variants ``rl`` (a seed per request + the sampled tokens' logprobs, processed
logprobs: what treadle asks) and ``plain`` (neither), two rounds each after a warm-up.
"""
import argparse
import asyncio
import json
import os
import sys
import time

SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
             intermediate_size=4864, tie_word_embeddings=True)
VOCAB = 4096  # treadle's qwen0.5b preset (the 17k figure's)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--multiprocess", type=int, default=0)
    p.add_argument("--kind", choices=("delta", "final"), default="delta")
    p.add_argument("--models", default="/tmp/models")
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", default="rl,plain", help="rl, plain, seed (seeds alone), logprobs (alone)")
    p.add_argument("--logprobs-mode", default="processed_logprobs")
    return p.parse_args()


def build(path):
    if os.path.exists(os.path.join(path, "config.json")):
        return
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, **SHAPE)
    torch.manual_seed(0)
    with torch.device("cuda"):
        Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    torch.cuda.empty_cache()


async def main(a):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = str(a.multiprocess)
    path = os.path.join(a.models, "qwen2-0.5b-v4096")
    build(path)
    import torch
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    res = {"args": vars(a)}
    t = time.time()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=path, dtype="bfloat16", gpu_memory_utilization=0.35, max_model_len=1024, max_num_seqs=256,
        enable_prefix_caching=False, skip_tokenizer_init=True, logprobs_mode=a.logprobs_mode, seed=0,
        generation_config="vllm", disable_log_stats=False))
    res["init_s"] = round(time.time() - t, 1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (int(torch.randint(16, 65, (1,), generator=g)),), generator=g).tolist()
               for _ in range(a.prompts)]
    kind = RequestOutputKind.DELTA if a.kind == "delta" else RequestOutputKind.FINAL_ONLY
    ids = iter(range(10 ** 9))

    async def one(p, sp):
        n = 0
        async for out in engine.generate({"prompt_token_ids": p}, sp, f"r{next(ids)}"):
            n += sum(len(o.token_ids) for o in out.outputs) if a.kind == "delta" else 0
            last = out
        return n if a.kind == "delta" else sum(len(o.token_ids) for o in last.outputs)

    async def round_(variant):
        def sp(i):
            extra = {"rl": dict(seed=i, logprobs=0), "seed": dict(seed=i), "logprobs": dict(logprobs=0)}.get(variant, {})
            return SamplingParams(temperature=1.0, max_tokens=a.max_tokens, min_tokens=a.max_tokens, ignore_eos=True,
                                  detokenize=False, output_kind=kind, **extra)
        t = time.time()
        counts = await asyncio.gather(*(one(p, sp(i)) for i, p in enumerate(prompts)))
        dt = time.time() - t
        return {"seconds": round(dt, 3), "new_tokens": sum(counts), "new_tokens_per_s": round(sum(counts) / dt, 1)}

    await round_("plain")  # warm-up (compile, graphs)
    for variant in a.variants.split(","):
        res[variant] = [await round_(variant) for _ in range(a.rounds)]
        print(a.multiprocess, a.kind, variant, res[variant], flush=True)
    engine.shutdown()
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
