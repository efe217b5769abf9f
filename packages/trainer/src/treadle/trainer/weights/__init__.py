"""Sending the trainer's weights to the rollout engines (the trainer's side of a weight update).

``sender.WeightSender`` is what the RL loop calls after each policy update: a collective over
the trainer's ranks that gathers the weights (ZeRO-3 partitions included, LoRA adapters merged)
bucket by bucket and has rank 0 broadcast them to the rollout daemon's engines over a
torch.distributed group (or send them inline, or share CUDA IPC handles with engines on rank
0's GPU). ``gather`` decides what is sent and in which naming; ``sender`` speaks the daemon's
protocol.

The receiving side (bucket layout, the group itself, checks, loading) is ``treadle.rollout``'s.
"""
