"""Build the tiny Qwen2-architecture models every treadle test, benchmark and demo runs on.

``build(preset, out, seed)`` writes a randomly initialised ``Qwen2ForCausalLM`` (safetensors) and a
byte-level BPE tokenizer trained on tools/data/corpus.txt into ``out``, offline and
deterministically: the same preset and seed give byte-identical files. The tokenizer is trained
with exactly the pipeline transformers 5 rebuilds for any Qwen2 model (NFC, Qwen2's split regex
with digits one by one, byte-level), because ``AutoTokenizer`` ignores the saved pre-tokenizer of
a Qwen2 model (PLATFORM.md); tests check that saved and loaded tokenizers agree.

It does not train the model (weights are random; RL demos warm-start it themselves), download
anything, or cache anything outside ``out``. The CLI is tools/make_tiny_model.py.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # heavy imports stay inside the functions that need them
    import tokenizers
    from transformers import PreTrainedTokenizerBase, Qwen2Config

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"
PresetName = Literal["tiny", "small", "qwen0.5b", "qwen1.5b"]

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2 in every tokenizer built here

# Qwen2's pre-tokenizer regex, as transformers' Qwen2Tokenizer hard-codes it: `\p{N}` alone splits
# numbers into single digits, so "123" is always three tokens.
QWEN2_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                     r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

# Qwen-style ChatML. The assistant's content and its <|im_end|> sit inside {% generation %} so
# `return_assistant_tokens_mask` marks exactly what the policy must learn to emit (the stop token
# included, the header and the newline after <|im_end|> excluded). No default system prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
ASSISTANT_HEADER = "<|im_start|>assistant\n"
# Head sizes vLLM 0.32's CPU attention backend supports (CPUAttentionBackend.get_supported_head_sizes).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@dataclass(frozen=True, slots=True, kw_only=True)
class Preset:
    """Shape of one model size. head_dim = hidden_size / num_attention_heads must be one vLLM's
    CPU build accepts (``VLLM_CPU_HEAD_SIZES``; 16 fails)."""

    vocab_size: int  # tokenizer size == embedding rows (no padding rows)
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        head_dim, rem = divmod(self.hidden_size, self.num_attention_heads)
        if rem or head_dim not in VLLM_CPU_HEAD_SIZES:
            raise ValueError(f"head_dim {self.hidden_size}/{self.num_attention_heads} must be one "
                             f"of {VLLM_CPU_HEAD_SIZES} (vLLM CPU's attention kernels)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.vocab_size <= 256 + len(SPECIAL_TOKENS):
            raise ValueError("vocab_size must exceed the 256 byte tokens plus the special tokens")


PRESETS: dict[str, Preset] = {
    # Tied embeddings, like Qwen2.5-0.5B: the case that breaks naive weight reloads (PLATFORM.md).
    "tiny": Preset(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True),
    # Untied, like Qwen2.5-7B, so the other lm_head path is exercised too. ~12M parameters.
    "small": Preset(vocab_size=4096, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                    num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False),
    # Qwen2.5-0.5B's and -1.5B's layers (tied, GQA) with this tokenizer's vocabulary: GPU runs.
    "qwen0.5b": Preset(vocab_size=4096, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen1.5b": Preset(vocab_size=4096, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class BuildInfo:
    """What ``build`` wrote."""

    out: Path  # the model folder
    preset: str
    seed: int
    num_parameters: int  # unique parameters (a tied embedding counted once)
    vocab_size: int  # tokenizer size == config.vocab_size
    seconds: float  # wall time of the whole build


def qwen2_pipeline() -> tokenizers.Tokenizer:
    """An untrained BPE ``tokenizers.Tokenizer`` with Qwen2's normalizer, pre-tokenizer and
    decoder, as transformers' ``Qwen2Tokenizer.__init__`` sets them."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(vocab_size: int, corpus: Path = CORPUS) -> tokenizers.Tokenizer:
    """Byte-level BPE of exactly ``vocab_size`` entries: specials at ids 0..2, the 256 byte
    symbols, then merges."""
    from tokenizers import AddedToken, pre_tokenizers, trainers

    tok = qwen2_pipeline()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(corpus)], trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"{corpus} yields only {tok.get_vocab_size()} BPE entries, not "
                           f"{vocab_size}: lower the preset's vocab_size or enlarge the corpus")
    return tok


def wrap_tokenizer(trained: tokenizers.Tokenizer, max_length: int) -> PreTrainedTokenizerBase:
    """The transformers tokenizer ``AutoTokenizer`` will rebuild for a Qwen2 model, made from the
    trained vocabulary and merges, with ChatML specials and template."""
    from transformers import Qwen2Tokenizer

    model = json.loads(trained.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return Qwen2Tokenizer(
        vocab=model["vocab"], merges=merges, unk_token=None, bos_token=None,
        eos_token=IM_END, pad_token=ENDOFTEXT, extra_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE, model_max_length=max_length,
        errors="replace", clean_up_tokenization_spaces=False, split_special_tokens=False)


def model_config(preset: Preset, tokenizer: PreTrainedTokenizerBase) -> Qwen2Config:
    """Qwen2Config for ``preset``: fp32, rope theta and norm eps as Qwen2.5, ChatML stop tokens."""
    from transformers import Qwen2Config

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return Qwen2Config(
        vocab_size=preset.vocab_size, hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size, num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=preset.tie_word_embeddings, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        hidden_act="silu", use_sliding_window=False, dtype="float32",
        bos_token_id=ids[ENDOFTEXT], eos_token_id=ids[IM_END], pad_token_id=ids[ENDOFTEXT])


def _write_model(config: Qwen2Config, seed: int, out: Path) -> int:
    """Random-init the model from ``seed`` on CPU, save it; returns its unique parameter count."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG as it was
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, pad_token_id=config.pad_token_id,
        eos_token_id=[config.eos_token_id, config.bos_token_id])
    model.save_pretrained(out, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


def build(preset: PresetName | str, out: Path | str, seed: int = 0,
          corpus: Path = CORPUS) -> BuildInfo:
    """Write model + tokenizer for ``preset`` into ``out`` (created; existing files overwritten)."""
    start = time.perf_counter()
    spec = PRESETS[preset]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    trained = train_tokenizer(spec.vocab_size, corpus)
    tokenizer = wrap_tokenizer(trained, spec.max_position_embeddings)
    tokenizer.save_pretrained(out)
    n = _write_model(model_config(spec, tokenizer), seed, out)
    return BuildInfo(out=out, preset=preset, seed=seed, num_parameters=n,
                     vocab_size=len(tokenizer), seconds=time.perf_counter() - start)
