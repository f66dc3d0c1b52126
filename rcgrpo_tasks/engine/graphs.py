"""CUDA graph of the `hf` session's decode step (CUDA only; the CPU runs the same step eagerly).

A small model's decode step is hundreds of tiny kernels whose launches (and Python) cost more than the
GPU work; one graph replay launches them all at once. `StepGraph(step, device, model)` runs `step` eagerly
the first time, on a side stream (the warm-up PyTorch asks for before a capture: lazy cuBLAS/cuDNN set-up,
allocator pools), then captures it and replays the capture on every later call. `step` must be graph-safe:
device tensors updated in place, no host reads, no Python state that changes between calls (the session's
step reads its column and position from device tensors; see `rcgrpo_tasks.engine.hf`). A capture that fails
(an op that cannot be captured, e.g. in a custom attention) warns once and the step runs eagerly: slower,
same results.

- `decode_path(device_type, cuda_graphs)`: which of the three step loops a session runs (the decision a
  test checks on any host); `graphs_wanted` the backend's `cuda_graphs` setting resolved.
- `DecodeState`: a call's decode state, device tensors the step updates in place.
- `device_side_indices(model)`: PEFT's trainable-token layers (the reward-token rows an RL policy trains)
  build their row index from a Python list at every forward, a host-to-device copy that a capture refuses
  ("Cannot copy between CPU and CUDA tensors during CUDA graph capture"); for a capture each reads a tensor
  made once on its weight's device instead (same weights, same results).
- `CaptureCheck`: the capture's preconditions checked on any device, the CPU included: a dispatch mode that
  records, while a step runs, what a capture would refuse or replay wrongly: host data made into tensors,
  host reads of device values, tensors on another device, and which pre-existing tensors the step reads
  (a replay reads exactly those, so two calls must read the same ones).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable

GRAPH = "graph"
"""A captured CUDA graph of the step, replayed; attention over the whole capacity (static shapes)."""
EAGER = "eager"
"""Eager CUDA steps (graphs off): attention over the columns in use."""
CPU = "cpu"
"""Eager CPU steps over the whole capacity (`hf.HFSession._runner` says why)."""


def graphs_wanted(device_type: str, setting: bool | None) -> bool:
    """The backend's `cuda_graphs`: on for a CUDA model unless the setting is False; never on the CPU."""
    return device_type == "cuda" and setting is not False


def decode_path(device_type: str, cuda_graphs: bool) -> str:
    """`GRAPH`, `EAGER` or `CPU`: how a session on `device_type` runs its decode steps."""
    if device_type == "cpu":
        return CPU
    return GRAPH if cuda_graphs else EAGER


class StepGraph:
    """Eager warm-up, then capture and replay of a graph-safe `step()` on a CUDA device. `model`: the model
    the step runs (its trainable-token layers read device-side indices during warm-up and capture)."""

    def __init__(self, step: Callable[[], None], device, model=None):
        self.step, self.device, self.model = step, device, model
        self.graph = None
        self.eager = False
        self.calls = 0
        self.keep: list = []  # tensors the captured kernels read that nothing else holds (freed = garbage)

    def run(self) -> None:
        import torch

        self.calls += 1
        if self.graph is not None:
            self.graph.replay()
            return
        if self.eager:
            self.step()
            return
        with device_side_indices(self.model) as made:
            self.keep = made
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # the warm-up is this call's real step
                self.step()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):  # records the next step; nothing runs until replay()
                    self.step()
            except Exception as exc:  # noqa: BLE001 - any capture failure: fall back to eager steps
                warnings.warn(f"CUDA graph capture of the decode step failed ({type(exc).__name__}: {exc}); "
                              "decoding eagerly", RuntimeWarning, stacklevel=2)
                torch.cuda.synchronize(self.device)
                self.eager = True
                return
        self.graph = graph


class DecodeState:
    """A call's decode state as device tensors updated in place (what a captured graph reads and writes):
    `column` is the cache column the first decode step feeds, `caps` each row's token budget, `seeds` its
    sampling seed (int64, on `dev`), `stops` the stop ids."""

    def __init__(self, column: int, caps: list[int], steps: int, seeds, stops: list[int], dev):
        import torch

        rows = len(caps)
        self.caps = torch.tensor(caps, dtype=torch.int64, device=dev)
        self.stops = torch.tensor(stops or [-1], dtype=torch.int64, device=dev)
        self.seeds = seeds
        self.tok = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.live = torch.ones(rows, dtype=torch.bool, device=dev)
        self.t = torch.zeros(1, dtype=torch.int64, device=dev)  # the step being recorded
        self.write_at = torch.full((1,), column, dtype=torch.int64, device=dev)  # the column a step feeds
        self.out_tok = torch.full((rows, steps), -1, dtype=torch.int64, device=dev)
        self.out_lp = torch.zeros((rows, steps), dtype=torch.float32, device=dev)

    def select(self, index) -> DecodeState:
        """The state of rows `index` (int64 tensor) alone, copied (a narrowed decode, `hf.HFSession`)."""
        sub = DecodeState.__new__(DecodeState)
        for name in ("caps", "seeds", "tok", "live", "out_tok", "out_lp"):
            setattr(sub, name, getattr(self, name)[index])
        sub.stops, sub.t, sub.write_at = self.stops, self.t.clone(), self.write_at.clone()
        return sub

    def put(self, index, sub: DecodeState) -> None:
        """Write a narrowed state `sub` of rows `index` back into this one."""
        for name in ("tok", "live", "out_tok", "out_lp"):
            getattr(self, name)[index] = getattr(sub, name)
        self.t.copy_(sub.t)
        self.write_at.copy_(sub.write_at)

    def record(self, tok, lp) -> None:
        """Store step t's tokens for the rows live at it; a row stays live unless it stopped or hit its cap."""
        import torch

        self.out_tok.index_copy_(1, self.t, torch.where(self.live, tok, -1)[:, None])
        self.out_lp.index_copy_(1, self.t, lp[:, None])
        stopped = (tok[:, None] == self.stops[None, :]).any(dim=1)
        self.live &= ~stopped & (self.t + 1 < self.caps)
        self.tok.copy_(tok)


@contextlib.contextmanager
def device_side_indices(model):
    """While open, every PEFT trainable-token layer of `model` (None: none) merges its trained rows through
    an index tensor made here, once, on its weight's device; yields those tensors (whoever captures must
    hold them as long as the graph). Layers without the attributes this relies on are left as they are."""
    import torch

    made, patched = [], []
    for module in model.modules() if model is not None else ():
        if not _trainable_tokens_layer(module) or "get_merged_weights" in vars(module):
            continue
        device = module.base_layer.weight.device
        index = {name: torch.tensor(ids, dtype=torch.int64, device=device)
                 for name, ids in module.token_indices.items()}
        made += index.values()
        module.get_merged_weights = functools.partial(_merged_weights, module, index)
        patched.append(module)
    try:
        yield made
    finally:
        for module in patched:
            del module.get_merged_weights


def _trainable_tokens_layer(module) -> bool:
    return all(hasattr(module, a) for a in ("get_merged_weights", "token_indices", "trainable_tokens_delta",
                                             "base_layer"))


def _merged_weights(layer, index: dict, active_adapters):
    """PEFT's `TrainableTokensLayer.get_merged_weights` with the row index of each adapter from `index`."""
    weight = layer.base_layer.weight
    for name in active_adapters:
        weight = weight.index_copy(0, index[name], layer.trainable_tokens_delta[name].to(weight))
    return weight


class CaptureCheck:
    """`with CaptureCheck(device) as check: step()` records in `check.hazards` what a CUDA graph capture of
    the step would refuse or replay wrongly, and in `check.reads` the storages of the tensors the step read
    that it did not make (weights, cache, decode state), each with the first op that read it. Runs the
    step's ops unchanged, on any device."""

    HOST_DATA = ("aten::lift_fresh", "aten::lift_fresh_copy", "aten::lift")
    """Host data (a list, a number, an array) made into a tensor: a host-to-device copy on a GPU."""
    HOST_READS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::equal")
    """Ops whose result the host waits for (`.item()`, `bool()`, data-dependent shapes): no capture."""

    def __init__(self, device):
        import torch

        self.device = torch.device(device)
        self.hazards: list[str] = []
        self.reads: dict[int, str] = {}
        self._made: set[int] = set()
        self._mode = None

    def __enter__(self) -> CaptureCheck:
        self._mode = _recording_mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

    def seen(self, op: str, args, out) -> None:
        """One dispatched op: its inputs `args` and outputs `out` (pytrees of tensors and values)."""
        from torch.utils._pytree import tree_leaves

        if op in self.HOST_DATA:
            self.hazards.append(f"{op}: host data made into a tensor inside the step")
        elif op in self.HOST_READS:
            self.hazards.append(f"{op}: the host reads a device value inside the step")
        for t in _tensors(tree_leaves(args)):
            key = _storage(t)
            if key not in self._made:
                self.reads.setdefault(key, f"{op} {tuple(t.shape)} {t.dtype}")
                if self._elsewhere(t, made=False):
                    self.hazards.append(f"{op}: reads a {t.device} tensor {tuple(t.shape)} made before the step")
        for t in _tensors(tree_leaves(out)):
            key = _storage(t)
            if key not in self.reads:
                self._made.add(key)
            if self._elsewhere(t, made=True):
                self.hazards.append(f"{op}: makes a {t.device} tensor {tuple(t.shape)}")

    def _elsewhere(self, t, made: bool) -> bool:
        """Off the step's device; a 0-dim CPU tensor the step made (a Python number as an op's operand)
        is passed to kernels by value and is not."""
        if t.device.type == self.device.type and (self.device.index is None or t.device == self.device):
            return False
        return not (made and t.device.type == "cpu" and t.dim() == 0)


def _recording_mode(check: CaptureCheck):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            check.seen(func._schema.name, (args, kwargs), out)
            return out

    return Recording()


def _tensors(leaves):
    import torch

    return [x for x in leaves if isinstance(x, torch.Tensor)]


def _storage(t) -> int:
    """The address of `t`'s storage (views share it); 0 for a tensor without one."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0
