"""Pure tensor helpers shared by models and losses (log-probs, entropies, per-sequence sums)."""
