"""tools/tiny_model.py: determinism, HF load, tokenizer identity and round trip, chat template."""

from __future__ import annotations

import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

TOOLS = Path(__file__).resolve().parents[1]
VARIED = ["12+7=19", "What is 3*4? The answer is 12.", "1234567890", "3.14159 -42 1e-6 0x1F",
          "  two  spaces\n\nnewlines\r\n\ttab\t", "Café naïve Zürich 東京 서울 ☀ ✓ → ½ π",
          "don't I'll WE'RE they've", "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
          "<|im_start|> half-special <|im_end", "", " ", "\n", "emoji 🙂👍🏽 and zero\u200bwidth",
          "The answer is 1024.\nuser: 7*8=?\nassistant: 56"]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_same_seed_gives_byte_identical_files_in_another_process(tiny_build, tmp_path):
    # A fresh process: Rust hash seeds and torch RNG state differ, the files must not.
    out = tmp_path / "again"
    subprocess.run([sys.executable, str(TOOLS / "make_tiny_model.py"), "--preset", "tiny",
                    "--out", str(out), "--seed", "0"], check=True, capture_output=True)
    first, second = _files(tiny_build.out), _files(out)
    assert set(first) >= {"config.json", "model.safetensors", "tokenizer.json",
                          "tokenizer_config.json", "chat_template.jinja", "generation_config.json"}
    assert first == second


def test_other_seed_changes_weights_only(tiny_model, tiny_build, tmp_path):
    other = _files(tiny_model.build("tiny", tmp_path, seed=1).out)
    first = _files(tiny_build.out)
    assert other["model.safetensors"] != first["model.safetensors"]
    assert {k: v for k, v in other.items() if k != "model.safetensors"} == \
           {k: v for k, v in first.items() if k != "model.safetensors"}


def test_hf_loads_and_runs_a_forward_pass(tiny_model, tiny_build):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_build.out).eval()
    spec = tiny_model.PRESETS["tiny"]
    assert model.dtype == torch.float32 and model.config.vocab_size == spec.vocab_size == 512
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, like Qwen2.5-0.5B
    assert sum(p.numel() for p in model.parameters()) == tiny_build.num_parameters
    ids = torch.tensor([[1, 5, 6, 7, 8], [1, 9, 10, 11, 12]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (2, 5, 512) and torch.isfinite(logits).all()
    # Random init with std 0.02: close to uniform, so mean log p is near -ln(512) = -6.24.
    logp = torch.log_softmax(logits, -1).mean(-1)
    assert torch.allclose(logp, torch.full_like(logp, -6.24), atol=0.1)


def test_small_preset_size_and_untied_head(tiny_model, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    info = tiny_model.build("small", tmp_path, seed=0)
    assert info.vocab_size == 4096 and 10_000_000 <= info.num_parameters <= 30_000_000
    model = AutoModelForCausalLM.from_pretrained(info.out).eval()
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 4096)


def test_preset_rejects_head_dim_vllm_cpu_cannot_run(tiny_model):
    with pytest.raises(ValueError, match="head_dim"):
        tiny_model.Preset(vocab_size=512, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                          tie_word_embeddings=True)


@pytest.fixture(scope="module")
def trained(tiny_model):
    """The tokenizers-library tokenizer as trained, before transformers ever saw it."""
    return tiny_model.train_tokenizer(512)


@pytest.mark.parametrize("text", VARIED)
def test_loaded_tokenizer_matches_trained_one(trained, tiny_tokenizer, text):
    assert tiny_tokenizer(text, add_special_tokens=False)["input_ids"] == trained.encode(text).ids


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=60))
def test_any_text_same_ids_and_round_trips(trained, tiny_tokenizer, text):
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert ids == trained.encode(text).ids
    assert tiny_tokenizer.decode(ids) == unicodedata.normalize("NFC", text)  # NFC normalizer


@given(digits=st.text(alphabet="0123456789", min_size=1, max_size=30))
def test_digits_are_one_token_each(tiny_tokenizer, digits):
    assert len(tiny_tokenizer.encode(digits, add_special_tokens=False)) == len(digits)


def test_special_tokens(tiny_model, tiny_tokenizer):
    tok = tiny_tokenizer
    assert [tok.convert_tokens_to_ids(t) for t in tiny_model.SPECIAL_TOKENS] == [0, 1, 2]
    assert (tok.pad_token, tok.eos_token, tok.bos_token) == ("<|endoftext|>", "<|im_end|>", None)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2  # each special is one id, never split into pieces
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert tok.encode("x", add_special_tokens=True) == tok.encode("x", add_special_tokens=False)


MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"}]


def test_chat_template_renders_chatml(tiny_tokenizer):
    text = tiny_tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?"
                    "<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3+3?"
                    "<|im_end|>\n")


def test_generation_prompt_ends_with_assistant_header(tiny_model, tiny_tokenizer):
    tok = tiny_tokenizer
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True,
                                  return_dict=False)
    header = tok.encode(tiny_model.ASSISTANT_HEADER, add_special_tokens=False)
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert ids[-len(header):] == header and header[0] == 1
    assert ids == tok.encode(text, add_special_tokens=False)


def test_assistant_mask_covers_reply_and_stop_token(tiny_tokenizer):
    tok = tiny_tokenizer
    out = tok.apply_chat_template(MESSAGES[:3], tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "4<|im_end|>"
    assert mask[-1] == 0  # the newline after <|im_end|> is template, not reply


def test_corpus_is_what_make_corpus_generates(tool):
    corpus = tool("make_corpus")
    path = TOOLS / "data" / "corpus.txt"
    assert path.stat().st_size < 400_000
    assert path.read_text(encoding="utf-8") == corpus.generate()
