"""rcgrpo: Reward-Conditioned GRPO for multi-turn tool-calling agents on BFCL v4 multi-turn.

Nothing runs at import: stage modules are imported by the `rcgrpo` CLI, DVC or Prefect when needed.
"""

__version__ = "0.1.0"
