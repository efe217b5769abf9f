"""Sending the trainer's weights to the rollout engines (the trainer's side of a weight update).

``sender.WeightSender`` is what the RL loop calls after each policy update: plan (``plan``: the
tensors, their names and dtypes), send (one of three transports, each its own module:
``collective``, ``cuda_ipc``, ``inline``; ``gather`` walks the buckets, gathering ZeRO-3
partitions one bucket at a time), report. ``outcome`` makes every rank return or raise alike.

The protocol both sides share (records, bucket layout, the broadcast group, CUDA IPC handles) is
``treadle.common``'s; the receiving side is ``treadle.rollout``'s.
"""
