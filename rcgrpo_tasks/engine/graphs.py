"""CUDA graph of the `hf` session's decode step (CUDA only; the CPU runs the same step eagerly).

A small model's decode step is hundreds of tiny kernels whose launches (and Python) cost more than the
GPU work; one graph replay launches them all at once. `StepGraph(step, device)` runs `step` eagerly the
first time, on a side stream (the warm-up PyTorch asks for before a capture: lazy cuBLAS/cuDNN set-up,
allocator pools), then captures it and replays the capture on every later call. `step` must be graph-safe:
device tensors updated in place, no host reads, no Python state that changes between calls (the session's
step reads its column and position from device tensors; see `rcgrpo_tasks.engine.hf`). A capture that fails
(an op that cannot be captured, e.g. in a custom attention) warns once and the step runs eagerly: slower,
same results.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable


class StepGraph:
    """Eager warm-up, then capture and replay of a graph-safe `step()` on a CUDA device."""

    def __init__(self, step: Callable[[], None], device):
        self.step, self.device = step, device
        self.graph = None
        self.eager = False
        self.calls = 0

    def run(self) -> None:
        import torch

        self.calls += 1
        if self.graph is not None:
            self.graph.replay()
            return
        if self.eager:
            self.step()
            return
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
