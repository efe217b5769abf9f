"""Training data: rows from local files (or the HF hub), token sequences, batches.

- ``sources``: json / jsonl / parquet / csv files and folders -> rows that remember their file
  and row number; mixing several datasets by probability; ``DataError`` for malformed rows.
- ``formatting``: rows -> token sequences with target masks (input templates, chat templates,
  multi-turn SFT, preference pairs, KTO rows), truncation.
- ``workers``: one function over every row in ``--data.dataloader_num_workers`` processes, in
  order, with a progress bar (how ``formatting`` tokenises a dataset).
- ``batching``: padded and packed micro-batches, micro-batches by token budget.
- ``order``: the deterministic, resumable sample order of each optimizer step on each rank.
"""
