"""Interim demo: generate token-in/token-out with logprobs from a tiny model on vLLM's CPU build.

    make demo    # builds .cache/models/tiny, then runs this with --model .cache/models/tiny

Renders a few chat prompts with the model's chat template, hands vLLM the token ids (never
text), and prints prompt / completion / mean sampled-token logprob, plus how long start-up and
generation took. The model is random, so completions are noise; the point is that the pipeline
(tokenizer, template, engine, logprobs) works on a fresh machine in seconds. The real RL
end-to-end demo replaces this once the trainer exists.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import tyro
import vllm_cpu

if TYPE_CHECKING:
    from vllm import LLM

PROMPTS = (
    ("user", "What is 3+4?"),
    ("user", "Tell me about the moon."),
    ("system", "You solve arithmetic problems step by step.", "user", "What is 12*7?"),
    ("user", "Hello!"),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Args:
    """Generate from a local model with vLLM on CPU and print logprobs."""

    model: Path = Path(".cache/models/tiny")  # folder written by tools/make_tiny_model.py
    max_tokens: int = 16  # new tokens per prompt
    temperature: float = 1.0  # sampling temperature (logprobs are of the unscaled distribution)
    seed: int = 0  # sampling seed of the first prompt (prompt i uses seed + i * n)
    n: int = 2  # samples per prompt


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    """One sampled completion."""

    prompt: str  # last user message
    completion: str  # decoded completion (special tokens shown)
    num_tokens: int
    mean_logprob: float  # mean over completion tokens of log p(token), nats


def _messages(turns: tuple[str, ...]) -> list[dict[str, str]]:
    return [{"role": r, "content": c} for r, c in zip(turns[::2], turns[1::2], strict=True)]


def generate(llm: LLM, args: Args) -> list[Row]:
    """Token-in/token-out: template -> ids -> vLLM -> ids + logprobs -> rows."""
    from vllm import SamplingParams, TokensPrompt

    tok = llm.get_tokenizer()
    ids = [tok.apply_chat_template(_messages(t), add_generation_prompt=True, tokenize=True,
                                   return_dict=False) for t in PROMPTS]
    # One seed per prompt: a random model's distribution is nearly flat, so a shared seed would
    # sample the same tokens for every prompt. vLLM seeds sample j of a request with seed + j.
    params = [SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature,
                             seed=args.seed + i * args.n, logprobs=0, detokenize=False)
              for i in range(len(ids))]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)
    rows = []
    for turns, out in zip(PROMPTS, outs, strict=True):
        for c in out.outputs:
            lps = [step[t].logprob for t, step in zip(c.token_ids, c.logprobs, strict=True)]
            rows.append(Row(prompt=turns[-1], completion=tok.decode(c.token_ids),
                            num_tokens=len(c.token_ids), mean_logprob=sum(lps) / max(len(lps), 1)))
    return rows


def table(rows: list[Row]) -> str:
    """A fixed-width text table; completions shown as Python literals (they are random bytes)."""
    head = f"{'prompt':<26} {'completion':<50} {'tokens':>6} {'mean logprob':>12}"
    lines = [head, "-" * len(head)]
    for r in rows:
        text = repr(r.completion)
        text = text if len(text) <= 50 else text[:47] + "..."
        lines.append(f"{r.prompt[:26]:<26} {text:<50} {r.num_tokens:>6} {r.mean_logprob:>12.4f}")
    return "\n".join(lines)


def main() -> None:
    args = tyro.cli(Args)
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"no model at {args.model}: run `make models` or "
                         f"tools/make_tiny_model.py --out {args.model}")
    vllm_cpu.apply_env()
    t0 = time.perf_counter()
    llm = vllm_cpu.start_llm(args.model, seed=args.seed)
    t1 = time.perf_counter()
    try:
        rows = generate(llm, args)
        t2 = time.perf_counter()
    finally:
        vllm_cpu.stop_llm(llm)
    print(table(rows))
    total = sum(r.num_tokens for r in rows)
    print(f"\nengine start {t1 - t0:.1f}s; generated {total} tokens for {len(rows)} samples "
          f"in {t2 - t1:.2f}s ({total / (t2 - t1):.0f} tokens/s)")


if __name__ == "__main__":
    main()
