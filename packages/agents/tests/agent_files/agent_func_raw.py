# A fully custom OpenRLHF executor: token-level generation through llm_engine, its own output dict.
from copy import deepcopy

from openrlhf.utils.agent import AgentExecutorBase


class AgentExecutor(AgentExecutorBase):
    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, **kwargs):
        prompt_token_ids = hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        sampling_params.max_tokens = 5
        request_output = await llm_engine.generate(prompt_token_ids, deepcopy(sampling_params))
        action_token_ids = list(request_output.outputs[0].token_ids)
        observation_token_ids = prompt_token_ids + action_token_ids
        return {
            "prompt": prompt,
            "label": label,
            "observation_tokens": observation_token_ids,
            "action_ranges": [(len(prompt_token_ids), len(observation_token_ids))],
            "rollout_log_probs": None,
            "reward": 0.5,
            "scores": 0.25,
            "extra_logs": {"action_len": len(action_token_ids)},
        }
