"""The OpenAI-compatible agent gateway (``treadle-agents serve``): see ``server``."""
