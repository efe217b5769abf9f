"""Score texts with a reward model: any ``AutoModelForSequenceClassification`` with one label.

That covers treadle's own RM trainer output and other Hugging Face reward models (a
``*ForSequenceClassification`` head, ``num_labels=1``), and OpenRLHF's: its reward model class
saves the base model's config (architectures ``["RewardModel"]``, no ``num_labels``) and a
one-output head named ``value_head_prefix`` (its config's, else the argument), which loads
here as the HF class's ``score`` head with ``num_labels=1``. A checkpoint whose weights do not
cover the model (a head under another name) is refused rather than served with a random head.
The score of a text is the head's output at its last non-pad token, as the HF class computes it.
Options follow OpenRLHF's ``serve_rm``: ``attn_implementation``, ``append_eos`` (add the EOS
token after stripping trailing pads/EOS, for models trained that way), ``normalize`` ((r - mean)
/ std with the ``mean``/``std`` saved in the model's config). Long texts are truncated from the
left, so the response is kept (OpenRLHF's server cuts the end).

Inference runs in a thread (one batch at a time, micro-batches sorted by length to pad
little); the event loop stays free. Scores depend slightly on which texts share a batch
(padding changes float rounding): the idempotency cache, not recomputation, makes replays exact.

This module imports torch and transformers (the ``rm`` extra); nothing imports it unless a
reward model is configured. Not here: rule functions (``workers``), batching (``batching``).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import re
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from treadle.rewards.api import RewardBatch, RewardOutput

DType = Literal["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"]
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                                  "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Compute dtypes by name (fp32 / bf16 / fp16: OpenRLHF's spellings)."""


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


def resolve_device(device: str) -> torch.device:
    """``auto``: cuda when torch sees a GPU (OpenRLHF's server loads with ``device_map="auto"``), else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def check_attn(attn_implementation: str | None, device: torch.device) -> None:
    """Refuse flash-attention where it cannot run (transformers' own error names neither flag nor fix)."""
    if attn_implementation is None or not attn_implementation.startswith("flash_attention"):
        return
    if device.type != "cuda" or importlib.util.find_spec("flash_attn") is None:
        raise ValueError(f"--rm.attn_implementation (OpenRLHF: --ds.attn_implementation) {attn_implementation} needs "
                         f"a CUDA device and the flash-attn package (device: {device}); use sdpa")


def _is_sequence_classifier(config: Any) -> bool:
    return any(a.endswith("ForSequenceClassification") for a in config.architectures or [])


def load_model(path: str, *, dtype: torch.dtype, attn_implementation: str | None = None,
               value_head_prefix: str = "score") -> Any:
    """The reward model at ``path`` as an HF sequence classifier with one output (see the module docstring)."""
    config = AutoConfig.from_pretrained(path)
    kw: dict[str, Any] = {"dtype": dtype, "output_loading_info": True}
    if attn_implementation is not None:
        kw["attn_implementation"] = attn_implementation
    if not _is_sequence_classifier(config):  # OpenRLHF's RewardModel: the base config, a head of one output
        config.num_labels = 1
    prefix = getattr(config, "value_head_prefix", None) or value_head_prefix  # OpenRLHF: the config's wins
    if prefix != "score":
        kw["key_mapping"] = {rf"^{re.escape(prefix)}\.": "score."}
    model, info = AutoModelForSequenceClassification.from_pretrained(path, config=config, **kw)
    if model.config.num_labels != 1:
        raise ValueError(f"{path}: a reward model has num_labels=1, this one has {model.config.num_labels}")
    if info["missing_keys"]:
        raise ValueError(f"{path}: the checkpoint has no weights for {_some(info['missing_keys'])} (unused in it: "
                         f"{_some(info['unexpected_keys']) or 'none'}); an OpenRLHF RM's head is named by "
                         "--rm.value_head_prefix: refusing to serve randomly initialised weights")
    return model


def _some(keys: Any, n: int = 4) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:n]) + (" ..." if len(keys) > n else "")


class RewardModelScorer:
    """A loaded reward model; ``await score(batch)`` scores ``batch.queries``."""

    def __init__(self, path: str, *, dtype: DType = "float32", device: str = "auto", max_len: int = 2048,
                 micro_batch_size: int = 16, append_eos: bool = False, normalize: bool = False,
                 attn_implementation: str | None = None, value_head_prefix: str = "score",
                 use_fast: bool = True) -> None:
        self.device = resolve_device(device)
        check_attn(attn_implementation, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(path, truncation_side="left", use_fast=use_fast)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = load_model(path, dtype=DTYPES[dtype], attn_implementation=attn_implementation,
                                value_head_prefix=value_head_prefix)
        self.model.to(self.device).eval()
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
            "architecture": (self.model.config.architectures or ["?"])[0],
            "dtype": str(DTYPES[dtype]).removeprefix("torch."),
            "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
            "max_len": max_len, "micro_batch_size": micro_batch_size, "append_eos": append_eos,
            "normalize": normalize,
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


def replica_devices(device: str, replicas: int) -> list[str]:
    """The devices of ``replicas`` copies (pure but for CUDA's presence and count): one GPU each on
    CUDA, ``cpu`` each on CPU; ValueError when fewer GPUs are visible than copies."""
    resolved = resolve_device(device)
    if replicas == 1:
        return [device]
    if resolved.type != "cuda":
        return ["cpu"] * replicas
    if torch.cuda.device_count() < replicas:
        raise ValueError(f"--rm.replicas {replicas}: one copy per GPU, but {torch.cuda.device_count()} are visible "
                         "(CUDA_VISIBLE_DEVICES)")
    return [f"cuda:{i}" for i in range(replicas)]


class ReplicaPool:
    """Copies of one reward model on several devices: each batch goes to a free copy, so up to
    ``size`` batches score at once (the daemon's batcher runs that many)."""

    def __init__(self, scorers: list[RewardModelScorer]) -> None:
        self.scorers = scorers
        self._free: asyncio.Queue[RewardModelScorer] = asyncio.Queue()
        for s in scorers:
            self._free.put_nowait(s)
        self.provenance = dict(scorers[0].provenance)
        if len(scorers) > 1:
            self.provenance["replicas"] = len(scorers)

    @property
    def size(self) -> int:
        return len(self.scorers)

    async def score(self, batch: RewardBatch) -> RewardOutput:
        scorer = await self._free.get()
        try:
            return await scorer.score(batch)
        finally:
            self._free.put_nowait(scorer)
