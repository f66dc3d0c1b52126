"""rcgrpo: Reward-Conditioned GRPO for tool-calling agents on BFCL v4 (single-turn AST and multi-turn tasks).

Nothing runs at import: stage modules are imported by the `rcgrpo` CLI, DVC or Prefect when needed.
"""

__version__ = "0.1.0"
