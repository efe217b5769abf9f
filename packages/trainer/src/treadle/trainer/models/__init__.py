"""Model roles, one class per role: ``Actor`` (policy log-probs), ``Reference`` (frozen),
``RewardModel`` (backbone + score head), ``Critic`` (backbone + value head); ``loading`` builds
the underlying transformers modules (dtype, attention kernel, gradient checkpointing, LoRA)."""
