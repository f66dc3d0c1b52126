"""Where models run: the `device` setting, descriptions for logs/metrics, and out-of-memory recognition.

- `resolve_device(setting)`: `auto` | `cpu` | `cuda` | `cuda:N` -> a `torch.device`. `auto` is CUDA when
  it is available, else the CPU. Asking for CUDA where there is none (or for a GPU index that does not
  exist) is a ConfigError: a run never falls back to the CPU silently.
- `placement(model)`: `{"device": "cuda:0", "dtype": "bfloat16", "device_name": ...}` for logs, MLflow
  params and stage metrics.
- `is_memory_error(exc)`: CUDA out-of-memory, or the cuDNN attention failure that memory pressure causes
  (`RuntimeError: Expected mha_graph.execute(...).is_good()`): the errors the rollout loop answers by
  splitting a batch in half (`rcgrpo_tasks.engine.rollout`).
"""

from __future__ import annotations

import re

from rcgrpo_tasks.ops.config import ConfigError

DEVICE_SETTINGS = "auto | cpu | cuda | cuda:N"
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")

# Messages of errors that mean "this batch did not fit": torch's OOM class covers the CUDA caching
# allocator; the others come from code that allocates on its own (cuDNN's attention graph, cuBLAS
# workspaces, the CPU allocator) and surface as a plain RuntimeError.
_MEMORY_MESSAGES = ("out of memory", "mha_graph.execute", "CUBLAS_STATUS_ALLOC_FAILED",
                    "CUDNN_STATUS_ALLOC_FAILED", "DefaultCPUAllocator: can't allocate memory")


class MemorySplitWarning(RuntimeWarning):
    """A batch hit a memory error and was split in half to continue (`rcgrpo_tasks.engine.rollout`)."""


def resolve_device(setting: str = "auto"):
    """The `torch.device` for a `device` setting; ConfigError for a bad value or a CUDA device that is absent.

    `auto` picks `cuda` (the current CUDA device) when CUDA is available, else `cpu`. An explicit `cuda` /
    `cuda:N` is honoured or refused, never replaced by the CPU.
    """
    import torch

    value = str(setting).strip().lower()
    if not _DEVICE_RE.match(value):
        raise ConfigError(f"device {setting!r}: expected {DEVICE_SETTINGS}")
    if value == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if value == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"device {setting!r}: CUDA is not available on this machine (torch "
                          f"{torch.__version__}, built for CUDA {torch.version.cuda}); use device: cpu or auto")
    index = int(value.split(":")[1]) if ":" in value else None
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise ConfigError(f"device {setting!r}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    return torch.device(value)


def placement(model) -> dict:
    """Where `model` runs, for logs and metrics: device (with index on CUDA), dtype and the GPU's name."""
    import torch

    param = next(model.parameters())
    device = param.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    out = {"device": str(device), "dtype": str(param.dtype).replace("torch.", "")}
    if device.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(device)
    return out


def is_memory_error(exc: BaseException) -> bool:
    """True for CUDA OOM (`torch.OutOfMemoryError`) and the allocation failures of cuDNN / cuBLAS."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _MEMORY_MESSAGES)


def free_memory() -> None:
    """After a memory error: collect the failed step's tensors (reference cycles of its frames) and return
    CUDA's cached blocks, so a smaller retry starts from a clean pool."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
