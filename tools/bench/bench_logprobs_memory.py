#!/usr/bin/env python3
"""Peak memory and time of the token log-prob forward + backward: treadle's chunked
``ops.logprobs.picked_logprobs`` against the plain fp32 formula (``z = logits.float();
z.gather(ids) - logsumexp(z)``), on the logits of one row of ``--tokens`` positions over a
``--vocab``-sized vocabulary (bf16, as a trainer's LM head gives them).

Each variant runs in its own process (peak RSS, ``ru_maxrss``, is per process), the rise over
the RSS with the logits already allocated is reported, and the two are interleaved
``--repeats`` times. CPU; on CUDA the same code saves the same bytes of device memory.

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_logprobs_memory.py --tokens 4096 --vocab 151936
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def _rss() -> int:
    with open("/proc/self/statm") as f:
        import os  # noqa: PLC0415

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(variant: str, tokens: int, vocab: int) -> dict:
    import torch  # noqa: PLC0415

    from treadle.trainer.ops.logprobs import picked_logprobs  # noqa: PLC0415

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, tokens + 1, vocab, generator=g).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, vocab, (1, tokens), generator=g)
    before = _rss()
    t0 = time.perf_counter()
    if variant == "chunked":
        lp = picked_logprobs(logits[:, :-1], ids)
    else:
        z = logits[:, :-1].float()
        lp = z.gather(-1, ids[..., None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
    lp.sum().backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"variant": variant, "rise_bytes": peak - before, "seconds": seconds}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", default="")
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.tokens, a.vocab)))
        return 0
    runs: dict[str, list[dict]] = {"plain": [], "chunked": []}
    for _ in range(a.repeats):
        for variant in runs:
            out = subprocess.run([sys.executable, __file__, "--worker", variant, "--tokens", str(a.tokens),
                                  "--vocab", str(a.vocab)], capture_output=True, text=True, check=True)
            runs[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
    mib = 1 << 20
    print(f"{a.tokens} positions x {a.vocab} vocabulary, bf16 logits ({2 * a.tokens * a.vocab / mib:,.0f} MiB), "
          f"median of {a.repeats}")
    print("| variant | memory added by forward + backward | per position | seconds |")
    print("| --- | --- | --- | --- |")
    for variant, rs in runs.items():
        rise = statistics.median(r["rise_bytes"] for r in rs)
        secs = statistics.median(r["seconds"] for r in rs)
        print(f"| {variant} | {rise / mib:,.0f} MiB | {rise / a.tokens / 1024:,.0f} KiB | {secs:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
