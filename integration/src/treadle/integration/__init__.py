"""treadle.integration: launch every treadle component together (Ray or local processes)."""
