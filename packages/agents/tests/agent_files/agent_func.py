# An agent file written for OpenRLHF (`--train.agent_func_path agent_func.py`), in the style of
# OpenRLHF's examples/python/agent_func.py. treadle must run it unchanged.
from typing import Any

import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


# A simple n-step environment: the label must appear in the answer
class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.step_idx = 0
        self.max_steps = 3

    async def reset(self, states: dict, **kwargs):
        """Initialize the environment and return the initial observation

        Args:
            states: Dictionary containing observation (the prompt) and label

        Returns:
            dict: {"observation": the initial observation text}
        """
        return {"observation": states["observation"]}  # Return original text observation

    async def step(self, states: dict, **kwargs) -> dict[str, Any]:
        """Execute one step of verification and return environment feedback

        Returns:
            Dict[str, Any]: rewards, scores, environment_feedback, done, sampling_params, extra_logs
        """
        observation_text = states["observation_text"]
        action_text = states["action_text"]
        label = states["label"]

        self.step_idx += 1
        correct = label in action_text
        done = correct or self.step_idx >= self.max_steps
        reward = torch.tensor(1.0) if correct else torch.tensor(0.0)

        # Generate environment feedback based on whether episode is done
        environment_feedback = (
            "\n\nHuman: [CORRECT]\n</s>"
            if done
            else "\n\nHuman: [INCORRECT]\nPlease analyze the issues and try again.\n</s>\n\nAssistant: "
        )

        return {
            "rewards": reward,  # Rewards for advantage calculation
            "scores": reward,  # Scores for dynamic filtering (0-1 reward)
            "environment_feedback": environment_feedback,  # Environment feedback text
            "done": done,  # Boolean indicating if the episode is complete
            "sampling_params": states.get("sampling_params"),  # Parameters for vLLM sampling in next step
            "extra_logs": {"step_idx": torch.tensor(self.step_idx), "obs_len": len(observation_text)},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
