# An OpenRLHF agent file whose AgentExecutor overrides execute() and post-processes the result.
from typing import Any

import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.step_idx = 0
        self.max_steps = 3

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> dict[str, Any]:
        observation_text = states["observation_text"]
        action_text = states["action_text"]
        label = states["label"]

        self.step_idx += 1
        correct = label in action_text
        done = correct or self.step_idx >= self.max_steps
        reward = torch.tensor(1.0) if correct else torch.tensor(0.0)

        environment_feedback = (
            "\n\nHuman: [CORRECT]\n</s>"
            if done
            else "\n\nHuman: [INCORRECT]\nPlease analyze the issues and try again.\n</s>\n\nAssistant: "
        )

        return {
            "rewards": reward,
            "scores": reward,
            "environment_feedback": environment_feedback,
            "done": done,
            "sampling_params": states.get("sampling_params"),
            "extra_logs": {"step_idx": torch.tensor(self.step_idx), "obs_len": len(observation_text)},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, **kwargs):
        # You could override the execute function to add custom agent running logic
        output = await super().execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine)
        output["extra_logs"]["custom"] = 1.0
        return output
