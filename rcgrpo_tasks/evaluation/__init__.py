"""Evaluation library: a model's accuracy on the held-out or dev side, the controllability check, the results
table, the promotion gate, scoring a BFCL result file (`rcgrpo score`)."""
