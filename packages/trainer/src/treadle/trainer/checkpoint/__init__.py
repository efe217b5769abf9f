"""Checkpoints: resumable training state (``checkpointer``), HF-format export (``export``), and
the atomic-directory helpers both use (``atomic``)."""
