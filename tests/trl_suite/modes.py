"""The names TRL's GRPO test module sees as `GRPOTrainer` / `GRPOConfig` in each harness mode (`mode_classes`).

- `baseline`: TRL's own `trl.GRPOTrainer` / `trl.GRPOConfig`, untouched.
- `none`, `rc`: thin subclasses of `rcgrpo.RCGRPOTrainer` / `rcgrpo.RCGRPOConfig` whose only change is that
  `conditioning` is fixed to the mode. Everything a test passes goes through as it is; nothing else is added, so
  an `RCGRPOConfig` default that differs from `GRPOConfig`'s shows as the test would see it in a user's script.
  A trainer built with `args=None` gets the mode's config named as `RCGRPOTrainer` names its own default
  (`<model>-RCGRPO`): without it `RCGRPOTrainer` would build an `RCGRPOConfig` with the default `"rc"`.
The subclasses are module attributes under their own names (`RCGRPOConfig_none`, ...): the Trainer pickles its
arguments into checkpoints, and pickle finds a class by module and name. Importing this module imports TRL.
"""

from __future__ import annotations

from dataclasses import dataclass

from trl import GRPOConfig, GRPOTrainer

from rcgrpo import RCGRPOConfig, RCGRPOTrainer

MODES = ("baseline", "none", "rc")


def _subclasses(mode: str) -> tuple[type, type]:
    @dataclass
    class ModeConfig(RCGRPOConfig):
        __doc__ = f"`RCGRPOConfig` with `conditioning` fixed to {mode!r}."

        def __post_init__(self):
            self.conditioning = mode
            super().__post_init__()

    class ModeTrainer(RCGRPOTrainer):
        __doc__ = f"`RCGRPOTrainer` whose default `args` is the {mode!r} config."

        def __init__(self, model, reward_funcs=None, args=None, **kwargs):
            if args is None:
                name = model if isinstance(model, str) else (model.config._name_or_path or "model")
                args = ModeConfig(f"{name.split('/')[-1]}-RCGRPO")
            super().__init__(model, reward_funcs, args, **kwargs)

    for cls, base in ((ModeTrainer, "RCGRPOTrainer"), (ModeConfig, "RCGRPOConfig")):
        cls.__name__ = cls.__qualname__ = f"{base}_{mode}"
        globals()[cls.__name__] = cls
    return ModeTrainer, ModeConfig


CLASSES = {"baseline": (GRPOTrainer, GRPOConfig), "none": _subclasses("none"), "rc": _subclasses("rc")}


def mode_classes(mode: str) -> tuple[type, type]:
    """`(trainer, config)` classes for `mode` (one of `MODES`)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return CLASSES[mode]
