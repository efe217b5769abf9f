"""The few vLLM types OpenRLHF agent code touches, as plain objects (vLLM is never imported).

OpenRLHF hands an agent executor a vLLM ``SamplingParams`` and an ``llm_engine`` whose
``generate(prompt_token_ids, sampling_params)`` returns a vLLM ``RequestOutput``; user code reads
``sampling_params.max_tokens`` / ``.logprobs``, sets ``max_tokens``, deep-copies it, and reads
``output.outputs[0].token_ids / .text / .logprobs[i][token_id].logprob / .finish_reason``.
These classes carry exactly that, and convert to and from treadle's ``SamplingParams``; any
object with the same attributes (a real vLLM ``SamplingParams``) converts too.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from treadle.common.records import SamplingParams


@dataclass(slots=True, kw_only=True)
class VllmSamplingParams:
    """Mutable, vLLM-shaped sampling parameters (the attributes agent code uses)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    logprobs: int | None = 1  # vLLM: number of top logprobs; None: none
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def clone(self) -> VllmSamplingParams:
        return copy.deepcopy(self)

    @classmethod
    def from_treadle(cls, sp: SamplingParams) -> VllmSamplingParams:
        return cls(n=sp.n, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, max_tokens=sp.max_tokens,
                   min_tokens=sp.min_tokens, stop_token_ids=list(sp.stop_token_ids), seed=sp.seed,
                   logprobs=1 if sp.logprobs else None, prompt_logprobs=1 if sp.prompt_logprobs else None)


def to_treadle(sp: Any, *, default_max_tokens: int = 16) -> SamplingParams:
    """treadle ``SamplingParams`` from a treadle, vLLM-shaped, or real vLLM sampling object."""
    if isinstance(sp, SamplingParams):
        return sp
    top_k = int(getattr(sp, "top_k", -1) or -1)
    max_tokens = getattr(sp, "max_tokens", None) or default_max_tokens
    return SamplingParams(
        n=int(getattr(sp, "n", 1) or 1), temperature=float(getattr(sp, "temperature", 1.0)),
        top_p=float(getattr(sp, "top_p", 1.0)), top_k=-1 if top_k <= 0 else top_k, max_tokens=int(max_tokens),
        min_tokens=min(int(getattr(sp, "min_tokens", 0) or 0), int(max_tokens)),
        stop_token_ids=[int(t) for t in (getattr(sp, "stop_token_ids", None) or [])],
        seed=getattr(sp, "seed", None), logprobs=getattr(sp, "logprobs", 1) is not None)


@dataclass(frozen=True, slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True, kw_only=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass(slots=True, kw_only=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
