"""The params.yaml `compute` section: where every stage that decodes or trains runs.

- `ComputeConfig.device`: `auto` | `cpu` | `cuda` | `cuda:N`; `resolve()` turns it into a
  `torch.device` through `rcgrpo_tasks.engine.device.resolve_device` (CUDA asked for where there is none
  is a ConfigError: a run never falls back to the CPU silently).
- `cpu_bf16`: off | on | auto, THE dtype rule's CPU setting (`engine.dtype`);
- `load_compute(params_path)`: the section of a params file (every key there: no defaults); a missing or
  unknown key is a ConfigError.
The method is `resolve()`, not `device()`: the dataclass field is `device` (the params key).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from rcgrpo_tasks.engine.device import DEVICE_SETTINGS, resolve_device
from rcgrpo_tasks.engine.dtype import check_setting
from rcgrpo_tasks.ops.config import load_config

SECTION = "compute"
_SETTING = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


@dataclass(frozen=True, kw_only=True)
class ComputeConfig:
    device: str
    """`auto` (CUDA when available, else the CPU) | `cpu` | `cuda` | `cuda:N`."""
    processes: int
    """Training processes of the `sft` and `rl` stages on this machine. 1: the stage trains in its own
    process. N > 1: the stage runs itself under `accelerate launch` with N processes (one per GPU; gloo
    processes on the CPU), so `dvc repro` and the Prefect flow run it unchanged."""
    accelerate_config: str | None = None
    """accelerate config file for a launch (e.g. configs/accelerate_zero3.yaml: DeepSpeed ZeRO-3); null =
    plain data parallel (DDP: NCCL on GPUs, gloo on the CPU). Its `num_processes` is overridden by
    `processes`."""
    cpu_bf16: str
    """bf16 on a CPU (`engine.dtype`): `off` (float32: every host the same numbers) | `on` | `auto` (what this
    host measured once: decoding and training decided apart). A stage's explicit dtype wins; CUDA takes bf16
    wherever the GPU has it."""

    def __post_init__(self) -> None:
        # The format is checked here (no torch import); availability only when resolved.
        if not _SETTING.match(str(self.device).strip().lower()):
            raise ValueError(f"device {self.device!r}: expected {DEVICE_SETTINGS}")
        if isinstance(self.processes, bool) or not isinstance(self.processes, int) or self.processes < 1:
            raise ValueError(f"processes {self.processes!r}: expected an integer >= 1")
        if self.accelerate_config is not None and not str(self.accelerate_config).strip():
            raise ValueError("accelerate_config: expected a file path or null")
        check_setting(self.cpu_bf16)

    def resolve(self):
        """The `torch.device` this setting names on this machine (ConfigError when it is absent)."""
        return resolve_device(self.device)


def load_compute(params_path: str | Path) -> ComputeConfig:
    """The `compute` section of `params_path`; a missing section or key, a bad key or value raise ConfigError
    naming the file and field."""
    return load_config(ComputeConfig, params_path, SECTION)
