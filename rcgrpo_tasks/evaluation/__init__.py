"""Evaluation library: held-out evaluation, the controllability check, the results table, the promotion gate."""
