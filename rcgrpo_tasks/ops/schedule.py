"""THE scheduler of a plan's stages: which stage starts when, and what happens after a failure or a stop.

One loop serves every runner of the pipeline: `rcgrpo run-plan` (`ops.plan_runner`: commands in this
checkout), the flow on one machine and the retrain flow (flows/dvc_tasks.py: `dvc repro` as Prefect tasks) and
the flow across work pools (flows/grid.py: each stage a run of the stage deployment on the pool its resources
name). Each runner says how a stage starts (`start`: a `Running` to poll, or an `Ended` at once, e.g. a stage
skipped) and what a stage costs of which capacity; the rule is here, once:

- a stage starts once every stage of the plan it depends on has ended `ran` or `skipped`, and while its cost
  fits in what is free (`capacity`, `cost`: run-plan's `--jobs` slots and `--gpus` devices; no capacity: every
  ready stage starts at once, and what bounds the width is the runner's own, the work pools' concurrency
  limits of Prefect in the flow across pools);
- side by side, the stages most others wait for start first (`descendants`: a cheap stand-in for the critical
  path); one at a time, the plan's order;
- after the first failure nothing new starts, the stages running finish, the rest end `not_run`; with
  `keep_going` (as `dvc repro --keep-going`) only what is downstream of a failure ends `not_run`;
- a stop (SIGTERM, Ctrl-C, a flow's timeout: any BaseException in the loop) stops every running stage,
  records it `stopped`, and propagates.

Written here because neither DVC (one stage at a time in one workspace) nor Prefect (its task futures wait on
`wait_for` but start every ready task; its concurrency limits bound tasks only through a server) orders a
DAG's stages under capacities.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rcgrpo_tasks.ops.inputs import InputError
from rcgrpo_tasks.ops.pipeline import PlannedStage

FINISHED = ("ran", "skipped")
"""What lets a dependent stage start."""
ENDED = ("failed", "stopped", "not_run")
"""What blocks every stage downstream of it."""


@dataclass(frozen=True)
class Ended:
    """How a stage ended: `ran` | `skipped` | `failed` | `stopped` | `not_run`, why (one line), and whatever
    the runner returns with it (an exit code, a lock entry)."""

    status: str
    reason: str = ""
    detail: Any = None


class Running(Protocol):
    """A stage under way, polled from the scheduler's thread."""

    def poll(self) -> Ended | None:
        """None while the stage runs; then how it ended."""

    def stop(self) -> None:
        """Stop it now (its whole process group, its flow run)."""


def descendants(stages: Sequence[PlannedStage]) -> dict[str, int]:
    """{stage: how many stages depend on it, directly or not} (`stages`: a plan, in topological order): side by
    side, the stages most others wait for start first (a cheap stand-in for the critical path)."""
    below: dict[str, set[str]] = {s.name: set() for s in stages}
    for stage in reversed(stages):  # every dependent comes later
        for up in stage.upstream:
            if up in below:
                below[up] |= {stage.name} | below[stage.name]
    return {name: len(found) for name, found in below.items()}


def start_order(stages: Sequence[PlannedStage], side_by_side: bool) -> list[PlannedStage]:
    """The order ready stages are started in: the plan's, or (side by side) most dependents first, the plan's
    order breaking ties (sorted() is stable)."""
    if not side_by_side:
        return list(stages)
    weight = descendants(stages)
    return sorted(stages, key=lambda s: -weight[s.name])


def blocker(stage: PlannedStage, results: Mapping[str, Ended], names: set[str]) -> str | None:
    """The first upstream stage of the plan that ended without finishing (None: none did)."""
    return next((u for u in stage.upstream if u in names and u in results and results[u].status in ENDED), None)


def ready(stage: PlannedStage, results: Mapping[str, Ended], names: set[str]) -> bool:
    return all(u in results and results[u].status in FINISHED for u in stage.upstream if u in names)


def fits(need: Mapping[str, int], free: Mapping[str, int]) -> bool:
    """Whether a cost fits in what is free; a kind the capacity does not name is not bounded."""
    return all(n <= free[kind] for kind, n in need.items() if kind in free)


def check_costs(stages: Sequence[PlannedStage], capacity: Mapping[str, int],
                cost: Callable[[PlannedStage], Mapping[str, int]]) -> None:
    """InputError naming the first stage whose cost can never fit (it would wait forever)."""
    for stage in stages:
        need = cost(stage)
        over = [f"{kind} {n} > {capacity[kind]}" for kind, n in need.items() if kind in capacity and n > capacity[kind]]
        if over:
            raise InputError(f"stage {stage.name} needs {', '.join(over)} available here: it can never start")


def run_dag(stages: Sequence[PlannedStage], start: Callable[[PlannedStage], Running | Ended], *,
            capacity: Mapping[str, int] | None = None,
            cost: Callable[[PlannedStage], Mapping[str, int]] | None = None, keep_going: bool = False,
            poll_s: float = 0.1, on_end: Callable[[PlannedStage, Ended], Ended] | None = None,
            results: MutableMapping[str, Ended] | None = None) -> dict[str, Ended]:
    """{stage: Ended} of `stages` (a plan, in topological order) by the rule of the module docstring, filled
    into `results` as each stage ends (a caller holds what ended also when this raises). `start(stage)`
    returns a `Running` or, for a stage that needs no run, an `Ended`; `on_end(stage, ended)` is called on
    the scheduler's thread, one stage at a time, as each stage ends, and returns what is recorded (a runner
    that cannot record a stage's success turns it into a failure). `capacity` ({kind: units}) and `cost`
    ({kind: units} of a stage, default one `jobs` unit) bound what runs at once; no capacity: unbounded."""
    capacity = dict(capacity or {})
    cost = cost or (lambda _s: {"jobs": 1})
    check_costs(stages, capacity, cost)
    results = {} if results is None else results
    names = {s.name for s in stages}
    pending = start_order(stages, side_by_side=capacity.get("jobs") != 1)
    free = dict(capacity)
    running: dict[str, tuple[PlannedStage, Running]] = {}
    failed = False

    def end(stage: PlannedStage, ended: Ended) -> None:
        nonlocal failed
        if on_end is not None:
            ended = on_end(stage, ended)
        results[stage.name] = ended
        failed |= ended.status in ("failed", "stopped")

    def launch() -> None:
        for stage in list(pending):
            if (up := blocker(stage, results, names)) is not None:
                pending.remove(stage)
                results[stage.name] = Ended("not_run", f"upstream {up} did not finish")
            elif ready(stage, results, names) and fits(cost(stage), free):
                pending.remove(stage)
                job = start(stage)
                if isinstance(job, Ended):
                    end(stage, job)
                    continue
                for kind, n in cost(stage).items():
                    if kind in free:
                        free[kind] -= n
                running[stage.name] = (stage, job)

    def reap() -> None:
        for name, (stage, job) in list(running.items()):
            ended = job.poll()
            if ended is None:
                continue
            del running[name]
            for kind, n in cost(stage).items():
                if kind in free:
                    free[kind] += n
            end(stage, ended)

    try:
        while pending or running:
            reap()
            if failed and not keep_going:
                for stage in pending:
                    results[stage.name] = Ended("not_run", "an earlier stage failed")
                pending.clear()
            before = len(pending)
            launch()
            if running:
                time.sleep(poll_s)
            elif pending and len(pending) == before:  # cannot happen with a plan in topological order
                raise InputError(f"stages wait on stages that never ran: {[s.name for s in pending]}")
    except BaseException:
        for name, (_stage, job) in list(running.items()):
            job.stop()
            results[name] = Ended("stopped", "stopped with the run")
        raise
    return dict(results)
