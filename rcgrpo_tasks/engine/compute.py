"""The params.yaml `compute` section: where every stage that decodes or trains runs.

- `ComputeConfig.device`: `auto` | `cpu` | `cuda` | `cuda:N`; `resolve()` turns it into a
  `torch.device` through `rcgrpo_tasks.engine.device.resolve_device` (CUDA asked for where there is none
  is a ConfigError: a run never falls back to the CPU silently).
- `cpu_bf16`: off | on | auto, THE dtype rule's CPU setting (`engine.dtype`);
- `load_compute(params_path)`: the section of a params file (every key there: no defaults); a missing or
  unknown key is a ConfigError.
- `resolve_compute(compute, decode=..., train=..., trains=...)`: THE dtype rule applied once per stage, a
  `ResolvedCompute` (device, decoding dtype, training bf16, where each came from, what `auto` measured) that
  the stage passes down and records whole; `check_resolved`: the refusal of the layers below.
The method is `resolve()`, not `device()`: the dataclass field is `device` (the params key).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from rcgrpo_tasks.engine.device import DEVICE_SETTINGS, resolve_device
from rcgrpo_tasks.engine.dtype import check_setting, cpu_bf16, decode_rule, train_rule
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


UNRESOLVED = ("auto", None)
"""What a stage asks for and only `resolve_compute` may turn into a concrete choice: a decoding `dtype: auto`,
RL's `rollout_dtype: auto`, a training `bf16: null`."""


@dataclass(frozen=True)
class ResolvedCompute:
    """Where a stage runs and in what, decided once per stage (`resolve_compute`) from params `compute` and the
    stage's own requests, passed down whole to what decodes or trains and recorded whole in its metrics
    (`record`). The layers below take these values and refuse an unresolved one (`check_resolved`)."""

    device: str
    """The device it runs on (`torch.device` as text: cpu, cuda, cuda:N)."""
    cpu_bf16: str
    """params `compute.cpu_bf16` it was resolved under."""
    decode_dtype: str | None
    """float32 | bfloat16 the stage decodes in (RL: its rollouts; `live`: sampled from the training model
    itself); None: the stage decodes nothing."""
    train_bf16: bool | None
    """bf16 autocast of its training; None: the stage trains nothing."""
    decode_source: str | None
    """Where the decoding dtype came from: explicit (the stage's own dtype) | gpu | params off | params on |
    measured auto."""
    train_source: str | None
    """Where the training choice came from (as `decode_source`)."""
    measured: dict | None = None
    """`auto` on a CPU: the calibration's record (`engine.dtype.measured`: decode and train speed-ups, its
    shape, threads, torch, cache file) and the speed-up it had to reach; None where nothing was measured."""

    @property
    def device_type(self) -> str:
        return self.device.split(":", 1)[0]

    def backend_kwargs(self) -> dict:
        """`load_backend` keyword arguments: the resolved decoding dtype and the device."""
        if self.decode_dtype in (None, "live"):
            raise ValueError(f"a {self.decode_dtype or 'non-decoding'} resolution loads no decoding backend")
        return {"dtype": self.decode_dtype, "device": self.device}

    def record(self) -> dict:
        """What a stage's metrics say about where and in what it computed: the whole resolution."""
        return dataclasses.asdict(self)


def check_resolved(value, what: str):
    """`value` when a stage resolved it; ValueError naming `what` for `auto` / null (an unresolved setting must not
    silently become float32 below the stage)."""
    if value in UNRESOLVED:
        raise ValueError(f"{what} {value!r} reached a layer below the stage unresolved: the stage resolves it once "
                         "(engine.compute.resolve_compute) and passes the outcome down")
    return value


def resolve_compute(compute: ComputeConfig, *, decode: str | None = None, train: bool | None = None,
                    trains: bool = False, model_dir: str | Path | None = None, device=None,
                    gpu_decode: str | None = None) -> ResolvedCompute:
    """THE dtype rule (`engine.dtype`) applied once for a stage: `decode` its decoding dtype (auto | float32 |
    bfloat16 | live; None: it decodes nothing), `train` its bf16 flag when it `trains` (None: the rule);
    `model_dir`: the shape an `auto` calibration times; `device`: the `torch.device` the stage already placed
    itself on (training: `placement.train_device`), else `compute.device` resolved; `gpu_decode`: what `auto`
    decodes in on a GPU when not the rule's (RL: `live`, the training model itself)."""
    place = device if device is not None else compute.resolve()
    kind, measured = place.type, None
    dtype = source = flag = t_source = None
    if decode is not None:
        if decode == "auto" and kind != "cpu" and gpu_decode is not None:
            dtype, source = gpu_decode, "gpu"
        else:
            dtype, source = decode_rule(decode, kind, compute.cpu_bf16, model_dir)
    if trains:
        flag, t_source = train_rule(train, kind, compute.cpu_bf16, model_dir)
    if "measured auto" in (source, t_source):
        measured = cpu_bf16(compute.cpu_bf16, model_dir)["measured"]
    return ResolvedCompute(str(place), compute.cpu_bf16, dtype, flag, source, t_source, measured)
