"""vLLM's CPU build serves the tiny model, token-in/token-out, with the HF model's logprobs."""

from __future__ import annotations

import pytest

PROMPTS = [[{"role": "user", "content": "What is 3+4?"}],
           [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Tell me about the moon."}],
           [{"role": "user", "content": "12*7=?"}]]


def test_apply_env_fills_gaps_and_keeps_user_values(tool):
    vllm_cpu = tool("vllm_cpu")
    environ = {"OMP_NUM_THREADS": "2"}
    effective = vllm_cpu.apply_env(environ)
    assert environ["OMP_NUM_THREADS"] == "2" == effective["OMP_NUM_THREADS"]
    assert environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert environ["VLLM_CACHE_ROOT"].endswith("vllm")
    assert set(effective) == set(environ)


@pytest.fixture(scope="module")
def sampled(llm, tiny_tokenizer):
    """(prompt ids, vLLM output) per prompt: 2 samples of 24 tokens each, with sampled-token and
    prompt logprobs."""
    from vllm import SamplingParams, TokensPrompt

    ids = [tiny_tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=False)
           for m in PROMPTS]
    params = [SamplingParams(n=2, max_tokens=24, temperature=1.0, seed=i, logprobs=0,
                             prompt_logprobs=0, ignore_eos=True, detokenize=False)
              for i in range(len(ids))]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)
    return list(zip(ids, outs, strict=True))


def test_generates_token_ids_with_sampled_logprobs(sampled):
    for prompt, out in sampled:
        assert list(out.prompt_token_ids) == prompt
        assert len(out.outputs) == 2
        for c in out.outputs:
            assert len(c.token_ids) == 24 == len(c.logprobs)
            assert all(0 <= t < 512 for t in c.token_ids)
            assert all(set(step) == {t} for t, step in zip(c.token_ids, c.logprobs, strict=True))


def _hf_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= 1 from one fp32 forward pass."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def test_sampled_and_prompt_logprobs_match_hf(sampled, tiny_build):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_build.out).eval()
    gaps = []
    for prompt, out in sampled:
        vllm_prompt = [step[t].logprob for t, step in zip(prompt[1:], out.prompt_logprobs[1:],
                                                              strict=True)]
        gaps += [abs(a - b) for a, b in zip(vllm_prompt, _hf_logprobs(model, prompt), strict=True)]
        for c in out.outputs:
            hf = _hf_logprobs(model, prompt + list(c.token_ids))[len(prompt) - 1:]
            vl = [step[t].logprob for t, step in zip(c.token_ids, c.logprobs, strict=True)]
            gaps += [abs(a - b) for a, b in zip(vl, hf, strict=True)]
    print(f"max |logprob_vllm - logprob_hf| over {len(gaps)} tokens: {max(gaps):.2e}")
    assert max(gaps) <= 1e-4


def test_same_seed_same_tokens(llm, sampled):
    from vllm import SamplingParams, TokensPrompt

    prompt, out = sampled[0]
    params = SamplingParams(n=2, max_tokens=24, temperature=1.0, seed=0, logprobs=0,
                            ignore_eos=True, detokenize=False)
    again = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
