"""Loss functions as pure tensor functions, one module per concern.

- ``sft``: next-token negative log-likelihood with a step-wide token-mean normaliser.
- ``rm``: pairwise (Bradley-Terry) reward-model losses, optional margin.
- ``prm``: process reward models: binary cross-entropy on per-step logits.
- ``preference``: DPO, cDPO, IPO and KTO.

They take tensors and scalars, never a config object; each docstring gives the formula, shapes,
reduction and paper. Turning a per-item loss into the step's mean (summing over micro-batches
and ranks) is the trainers' job: see ``treadle.trainer.trainers.base``.
"""
