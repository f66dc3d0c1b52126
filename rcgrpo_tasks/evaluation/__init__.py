"""Evaluation library: held-out evaluation, the controllability check, the results table, the promotion gate,
scoring a BFCL result file (`rcgrpo score`)."""
