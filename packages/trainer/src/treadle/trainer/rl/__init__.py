"""The PPO-family RL trainer's pieces (PPO, REINFORCE++, REINFORCE++-baseline, RLOO, GRPO,
Dr. GRPO, GSPO). The math modules are pure tensor functions, never given a config object, with
variants chosen by name through one dict per module keyed like ``treadle.trainer.config.algo``:
``advantages`` (group baselines, per-token rewards, returns, GAE, whitening), ``kl`` (k1/k2/k3
estimators, the adaptive KL controller), ``policy_loss`` (per-token PPO/GSPO/value losses and
their step-wide aggregations), ``correction`` (importance sampling for rollout/trainer drift)
and ``shaping`` (episode reward shaping, DAPO's dynamic filtering). The math knows nothing of
models, micro-batches, ranks or the wire; the other modules here do that plumbing.
"""
