"""The pipeline's one scheduler (`ops.schedule.run_dag`) on built plans with stand-in stages: invariants over
random DAGs (no stage starts before what it depends on ended well, capacities never exceeded, every stage
ends exactly once), the failure and keep-going rules, a stop, and resources (`ops.resources`) as the plan and
run-plan read them."""

from __future__ import annotations

import random

import pytest
import yaml
from helpers import REPO_ROOT

from rcgrpo_tasks.ops import resources, schedule
from rcgrpo_tasks.ops.config import ConfigError, deep_merge
from rcgrpo_tasks.ops.inputs import InputError
from rcgrpo_tasks.ops.pipeline import PlannedStage
from rcgrpo_tasks.ops.schedule import Ended
from rcgrpo_tasks.sweep.params_check import check_file


class Clock:
    """Stand-in stages that end after a number of polls; records what ran when."""

    def __init__(self, durations: dict[str, int], fail: set[str] = frozenset()):
        self.durations, self.fail = durations, fail
        self.tick, self.events, self.running = 0, [], set()

    def start(self, stage: PlannedStage):
        clock = self
        clock.events.append(("start", stage.name, clock.tick))
        clock.running.add(stage.name)

        class Job:
            left = clock.durations[stage.name]

            def poll(self):
                clock.tick += 1
                self.left -= 1
                if self.left > 0:
                    return None
                clock.running.discard(stage.name)
                clock.events.append(("end", stage.name, clock.tick))
                return Ended("failed" if stage.name in clock.fail else "ran")

            def stop(self):
                clock.running.discard(stage.name)

        return Job()


def random_plan(rng: random.Random, n: int) -> list[PlannedStage]:
    stages = []
    for i in range(n):
        ups = tuple(f"s{j}" for j in range(i) if rng.random() < 0.3)
        stages.append(PlannedStage(f"s{i}", ("true",), ups, (), gpus=rng.choice([0, 0, 1, 2])))
    return stages


@pytest.mark.parametrize("seed", range(20))
def test_random_dags_respect_dependencies_and_capacities(seed):
    rng = random.Random(seed)
    plan = random_plan(rng, 12)
    clock = Clock({s.name: rng.randint(1, 5) for s in plan})
    capacity = {"jobs": rng.randint(1, 3), "gpu": 2}
    peak = {"jobs": 0, "gpu": 0}

    def start(stage):
        job = clock.start(stage)
        used = [s for s in plan if s.name in clock.running]
        peak["jobs"] = max(peak["jobs"], len(used))
        peak["gpu"] = max(peak["gpu"], sum(s.gpus for s in used))
        return job

    ended = schedule.run_dag(plan, start, capacity=capacity, cost=lambda s: {"jobs": 1, "gpu": s.gpus}, poll_s=0)
    assert set(ended) == {s.name for s in plan} and {e.status for e in ended.values()} == {"ran"}
    assert peak["jobs"] <= capacity["jobs"] and peak["gpu"] <= capacity["gpu"]
    when = {(kind, name): t for kind, name, t in clock.events}
    for stage in plan:
        for up in stage.upstream:
            assert when[("end", up)] <= when[("start", stage.name)], (up, stage.name)


def test_after_a_failure_nothing_new_starts_unless_keep_going():
    a, b, c, d = (PlannedStage(n, ("true",), u, ()) for n, u in (("a", ()), ("b", ("a",)), ("c", ()), ("d", ("c",))))
    clock = Clock({"a": 1, "b": 1, "c": 3, "d": 1}, fail={"a"})
    ended = schedule.run_dag([a, b, c, d], clock.start, capacity={"jobs": 2}, poll_s=0)
    assert ended["a"].status == "failed" and ended["c"].status == "ran"  # c was running: it finished
    assert ended["b"].status == ended["d"].status == "not_run"
    clock = Clock({"a": 1, "b": 1, "c": 3, "d": 1}, fail={"a"})
    ended = schedule.run_dag([a, b, c, d], clock.start, capacity={"jobs": 2}, poll_s=0, keep_going=True)
    assert ended["b"].reason == "upstream a did not finish" and ended["d"].status == "ran"


def test_unbounded_starts_every_ready_stage_at_once_and_a_stop_stops_them():
    plan = [PlannedStage(f"x{i}", ("true",), (), ()) for i in range(5)]
    clock = Clock({s.name: 10**6 for s in plan})
    stopped = []

    def start(stage):
        job = clock.start(stage)
        if len(clock.running) == len(plan):
            raise KeyboardInterrupt  # the stop arrives once all five run
        job.stop = lambda name=stage.name: stopped.append(name)
        return job

    results: dict = {}
    with pytest.raises(KeyboardInterrupt):
        schedule.run_dag(plan, start, poll_s=0, results=results)
    assert sorted(stopped) == ["x0", "x1", "x2", "x3"] and {e.status for e in results.values()} == {"stopped"}


def test_a_stage_that_can_never_fit_is_refused_before_any_starts():
    plan = [PlannedStage("rl", ("true",), (), (), gpus=8)]
    with pytest.raises(InputError, match="stage rl needs gpu 8 > 4 available here"):
        schedule.run_dag(plan, lambda s: pytest.fail("started"), capacity={"jobs": 1, "gpu": 4},
                         cost=lambda s: {"jobs": 1, "gpu": s.gpus})


def _params(*profiles: str) -> dict:
    merged = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    for p in profiles:
        merged = deep_merge(merged, yaml.safe_load((REPO_ROOT / "configs" / f"{p}.yaml").read_text()))
    return merged


def test_resources_follow_the_profile_item_keys_win():
    default = resources.resources_of(_params(), "p")
    paper, gpu = resources.resources_of(_params("paper"), "p"), resources.resources_of(_params("gpu"), "p")
    stages = ["prepare_data", "sft", "rctp@0", "rl_rctp@0-rc_grpo", "evaluate@base", "controllability@1", "report"]
    assert {s: str(default.of(s)) for s in stages} == dict.fromkeys(stages, "cpu")
    assert [paper.of(s).gpus for s in stages] == [0, 8, 8, 8, 1, 1, 0]
    assert [gpu.of(s).gpus for s in stages] == [0, 1, 1, 1, 1, 1, 0]
    item = resources.ResourcesConfig({"rl_rctp": {"gpu": 8}, "rl_rctp@0-grpo": "cpu"})
    assert item.of("rl_rctp@0-grpo").kind == "cpu" and item.of("rl_rctp@1-grpo").gpus == 8


@pytest.mark.parametrize("bad", [{"gpu": 0}, {"gpu": 1.5}, {"gpu": True}, "gpu", {"gpus": 1}, {"gpu": 1, "cpu": 1}])
def test_a_bad_resource_fails_naming_its_stage(bad):
    with pytest.raises(ValueError, match=r"stages\.sft: `cpu` or \{gpu: N\}"):
        resources.ResourcesConfig({"sft": bad})


def test_an_unknown_stage_in_resources_fails_the_params_check(tmp_path):
    params = _params()
    params["resources"] = {"stages": {"rl_rctpp": {"gpu": 1}}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    (tmp_path / "dvc.yaml").write_text((REPO_ROOT / "dvc.yaml").read_text())
    with pytest.raises(ConfigError, match=r"resources: stages: \['rl_rctpp'\] name no stage of"):
        check_file(tmp_path / "params.yaml")
