"""Where each stage runs: params `resources` (`ResourcesConfig`), read by `rcgrpo plan` / `rcgrpo run-plan` (a
stage waits for the devices it declares: `--gpus`) and by the flow across work pools (a stage goes to the pool
its resources name).

A params section, not dvc.yaml `meta`, because what a stage needs follows the profile (the CPU default: every
stage `cpu`; `gpu` and `paper`: the training, sampling, controllability and evaluation stages on GPUs, the
paper's RL cells on 8), and profiles overlay params.yaml; and because no stage lists it in its `params:`, where
a stage runs never reruns it (its outputs do not depend on the host that made them).

A value is `cpu` or `{gpu: N}` (N >= 1 devices); a key is a stage's dvc.yaml name (a foreach / matrix group
covers each of its items: `rl_rctp` is every `rl_rctp@<seed>-<algo>`) or one item (`rl_rctp@0-grpo`), the
item's own key first, then its group's; a stage named nowhere runs on `cpu`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rcgrpo_tasks.ops.config import from_dict

CPU = "cpu"
GPU = "gpu"
KINDS = (CPU, GPU)
"""The kinds of worker a stage names; each kind is one work pool (infra/services.yaml `work_pools`)."""


@dataclass(frozen=True)
class Resource:
    """What one stage needs: a kind of worker, and how many GPUs (0 on `cpu`)."""

    kind: str
    gpus: int = 0

    def __str__(self) -> str:
        return CPU if self.kind == CPU else f"gpu: {self.gpus}"


def parse_resource(value: Any, where: str) -> Resource:
    """`cpu` -> Resource(cpu); `{gpu: N}`, N an integer >= 1 -> Resource(gpu, N); else ValueError naming `where`."""
    if value == CPU:
        return Resource(CPU)
    if isinstance(value, dict) and set(value) == {GPU}:
        n = value[GPU]
        if isinstance(n, int) and not isinstance(n, bool) and n >= 1:
            return Resource(GPU, n)
    raise ValueError(f"{where}: `cpu` or {{gpu: N}} with N an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class ResourcesConfig:
    stages: dict
    """Stage (a dvc.yaml name, covering its foreach / matrix items, or one item) -> `cpu` or `{gpu: N}`; a
    stage named nowhere here runs on `cpu`."""

    def __post_init__(self) -> None:
        for name, value in self.stages.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"stages: keys are stage names, got {name!r}")
            parse_resource(value, f"stages.{name}")

    def of(self, stage: str) -> Resource:
        """The resource of stage `stage` (`rl_rctp@0-grpo`): its own key, else its group's (the name before
        `@`), else `cpu`."""
        group = stage.partition("@")[0]
        for key in (stage, group):
            if key in self.stages:
                return parse_resource(self.stages[key], f"stages.{key}")
        return Resource(CPU)

    def unknown(self, groups: set[str]) -> list[str]:
        """The keys of `stages` that name no stage of `groups` (dvc.yaml's stage names): a typo would run
        that stage on `cpu` silently."""
        return sorted(k for k in self.stages if k.partition("@")[0] not in groups)


def dvc_groups(repo_dir: str | Path) -> set[str] | None:
    """The stage names `repo_dir`/dvc.yaml declares (foreach / matrix groups unexpanded), read as YAML in
    milliseconds; None without a readable dvc.yaml."""
    try:
        stages = (yaml.safe_load((Path(repo_dir) / "dvc.yaml").read_text()) or {}).get("stages") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return set(stages) if isinstance(stages, dict) else None


def resources_of(params: dict, where: str) -> ResourcesConfig:
    """The `resources` section of a parsed params file (`where`: the file, for the message); a project whose
    params have no such section runs every stage on `cpu` (the pipeline's own params must have it:
    `sweep.params_check`)."""
    if "resources" not in params:
        return ResourcesConfig({})
    return from_dict(ResourcesConfig, params["resources"] or {}, where=f"{where}:resources")
