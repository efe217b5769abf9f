"""Distributed wiring: the DeepSpeed engine built from the typed config (``deepspeed``)."""
