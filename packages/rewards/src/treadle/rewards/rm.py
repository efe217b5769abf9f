"""Score texts with a reward model: any ``AutoModelForSequenceClassification`` with one label.

That covers treadle's own RM trainer output and other Hugging Face reward models (a
``*ForSequenceClassification`` head, ``num_labels=1``). The score of a text is the head's
output at its last non-pad token, as the HF class computes it. Options follow OpenRLHF's
``serve_rm``: ``append_eos`` (add the EOS token after stripping trailing pads/EOS, for models
trained that way), ``normalize`` ((r - mean) / std with the ``mean``/``std`` saved in the
model's config). Long texts are truncated from the left, so the response is kept.

Inference runs in a thread (one batch at a time, micro-batches sorted by length to pad
little); the event loop stays free. Scores depend slightly on which texts share a batch
(padding changes float rounding): the idempotency cache, not recomputation, makes replays exact.

This module imports torch and transformers (the ``rm`` extra); nothing imports it unless a
reward model is configured. Not here: rule functions (``workers``), batching (``batching``).
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from treadle.rewards.api import RewardBatch, RewardOutput

DType = Literal["float32", "bfloat16", "float16"]


def weights_sha256(path: str | Path) -> str:
    """SHA-256 over the model folder's weight files (name and bytes, sorted by name)."""
    h = hashlib.sha256()
    files = sorted(p for p in Path(path).iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))
    for p in files:
        h.update(p.name.encode())
        with p.open("rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


class RewardModelScorer:
    """A loaded reward model; ``await score(batch)`` scores ``batch.queries``."""

    def __init__(self, path: str, *, dtype: DType = "float32", device: str = "cpu", max_len: int = 2048,
                 micro_batch_size: int = 16, append_eos: bool = False, normalize: bool = False) -> None:
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path, truncation_side="left")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=getattr(torch, dtype))
        self.model.to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"{path}: a reward model has num_labels=1, this one has {self.model.config.num_labels}")
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.mean, self.std = 0.0, 1.0
        if normalize:
            mean, std = getattr(self.model.config, "mean", None), getattr(self.model.config, "std", None)
            if mean is None or std is None:
                raise ValueError(f"{path}: normalize needs 'mean' and 'std' in config.json (OpenRLHF's "
                                 "--normalize_reward saves them); this config has none")
            self.mean, self.std = float(mean), float(std)
        self.max_len, self.micro_batch_size, self.append_eos = max_len, micro_batch_size, append_eos
        self._lock = asyncio.Lock()
        self.provenance: dict[str, Any] = {
            "kind": "model", "source": str(Path(path).resolve()), "sha256": weights_sha256(path),
            "architecture": (self.model.config.architectures or ["?"])[0], "dtype": dtype,
            "max_len": max_len, "append_eos": append_eos, "normalize": normalize,
        }

    def _prepare(self, text: str) -> str:
        if not self.append_eos:
            return text
        tok = self.tokenizer
        for junk in (tok.pad_token, tok.eos_token):
            while junk and text.endswith(junk):
                text = text[: -len(junk)]
        return text + tok.eos_token

    @torch.no_grad()
    def score_texts(self, texts: list[str]) -> list[float]:
        """One float per text (blocking)."""
        texts = [self._prepare(t) for t in texts]
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = [0.0] * len(texts)
        for start in range(0, len(order), self.micro_batch_size):
            idx = order[start:start + self.micro_batch_size]
            enc = self.tokenizer([texts[i] for i in idx], return_tensors="pt", padding=True, truncation=True,
                                 max_length=self.max_len, add_special_tokens=False).to(self.device)
            logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
            values = ((logits[:, 0].float() - self.mean) / self.std).tolist()
            for i, v in zip(idx, values, strict=True):
                out[i] = v
        return out

    async def score(self, batch: RewardBatch) -> RewardOutput:
        async with self._lock:
            rewards = await asyncio.to_thread(self.score_texts, list(batch.queries))
        return RewardOutput(rewards=rewards)
