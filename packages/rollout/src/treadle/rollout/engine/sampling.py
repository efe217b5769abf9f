"""Sampling math of the HF engine: the distribution vLLM samples from, and its logprobs.

Pure tensor functions over a batch of rows ``[B, V]``. They follow vLLM's sampler (v1, 0.32) so
that both backends report the same "processed" logprobs:

1. min-tokens: until a row has ``min_tokens`` tokens, its stop ids get logit ``-inf``;
2. greedy rows (``temperature < 1e-5``): ``logprobs = log_softmax(logits)``, token = argmax;
3. other rows: ``z = logits / T``; top-k keeps logits ``>=`` the k-th largest (ties kept);
   top-p sorts ascending, ``c_j = sum_{i<=j} softmax(z)_i`` over the sorted order, and drops
   entries with ``c_j <= 1 - p`` (the largest is always kept); ``logprobs = log_softmax(z)``;
   token ~ ``exp(logprobs)`` with the row's own ``torch.Generator`` when it has one;
4. a row asking for alternatives gets the top k of those same ``logprobs`` (vLLM's
   ``gather_logprobs``), ``-inf`` beyond what top-k / top-p kept.

What this module does not do: run the model or decide when a sample stops.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below it mean greedy


def mask_stop_tokens(logits: torch.Tensor, rows: Sequence[int], stop_ids: Sequence[Sequence[int]]) -> None:
    """In place: ``logits[r, stop_ids[j]] = -inf`` for each ``r = rows[j]`` (min-tokens rule)."""
    for r, ids in zip(rows, stop_ids, strict=True):
        if ids:
            logits[r, list(ids)] = float("-inf")


def top_k_top_p(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask ``z [B, V]`` to each row's top-k (``top_k[b] <= 0``: off) then top-p (``1.0``: off).

    Returns a new tensor with dropped entries at ``-inf``; see the module docstring for the rule.
    """
    z = z.clone()
    v = z.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v))
    if bool((k < v).any()):
        kth = torch.sort(z, dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
        z.masked_fill_(z < kth, float("-inf"))
    if bool((top_p < 1.0).any()):
        zs, idx = torch.sort(z, dim=-1, descending=False)
        cum = zs.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False
        zs.masked_fill_(drop, float("-inf"))
        z = z.scatter(1, idx, zs)
    return z


def processed_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor) -> torch.Tensor:
    """float32 [B, V]: log-probabilities of the distribution each row samples from.

    Greedy rows: ``log_softmax(logits)``; others: ``log_softmax(top_k_top_p(logits / T))``.
    """
    logits = logits.float()
    greedy = temperature < GREEDY_EPS
    t = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    z = logits / t.unsqueeze(1)
    if not bool(greedy.all()):
        masked = top_k_top_p(z, top_k, top_p)
        z = torch.where(greedy.unsqueeze(1), z, masked)
    return torch.log_softmax(z, dim=-1)


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 [B, k'] values, int64 [B, k'] token ids), k' = min(k, V): each row's k largest
    entries of ``logprobs [B, V]``, largest first (ties in any order)."""
    return torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1, sorted=True)


def sample(logprobs: torch.Tensor, greedy: torch.Tensor,
           generators: Sequence[torch.Generator | None], fallback: torch.Generator) -> torch.Tensor:
    """int64 [B]: argmax for greedy rows, else one draw from ``exp(logprobs[b])``.

    Row ``b`` draws with ``generators[b]`` when set (a seeded sample), else with ``fallback``.
    """
    out = logprobs.argmax(dim=-1)
    for b, g in enumerate(generators):
        if not bool(greedy[b]):
            probs = logprobs[b].exp()
            out[b] = torch.multinomial(probs, 1, generator=g if g is not None else fallback)[0]
    return out
