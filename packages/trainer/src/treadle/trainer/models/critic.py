"""The critic role of PPO: a value for every token (V(s_t) after token t).

Same network shape as the reward model (backbone + linear head); the PPO trainer reads all
token values instead of the last one. Value losses live with the RL losses, not here.
"""

from __future__ import annotations

from treadle.trainer.models.value_model import ValueModel


class Critic(ValueModel):
    """backbone + value head; ``forward`` gives ``[R, T]`` values."""
