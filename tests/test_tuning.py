"""Tuning is a params change: a tuned value lives in params.yaml alone (tests/test_defaults.py), so changing it
touches no code file and DVC reruns only the stages whose `params:` name it, and what reads their outputs.
Shown on `rl.learning_rate`, read from dvc.yaml as DVC resolves it (no pipeline runs)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import grimp
import pytest
from helpers import REPO_ROOT

from rcgrpo_tasks.train.rl.config import RLConfig

PKG = REPO_ROOT / "rcgrpo_tasks"
WHOLE_READERS = {"load_config": 2, "read_sections": None}
"""Calls that read a whole section: the argument holding its name (None: every argument after the file)."""


@pytest.fixture(scope="module")
def pipeline() -> tuple[dict, dict, dict]:
    """({stage: params keys its dvc.yaml entry names}, {stage: its stage modules (one per command)}, {stage: the
    stages that read its outputs, at any distance})."""
    import networkx as nx
    from dvc.repo import Repo
    from dvc.stage import PipelineStage

    with Repo(str(REPO_ROOT)) as repo:
        graph = repo.index.graph  # edges point from a stage to the stages it depends on
        stages = [s for s in repo.index.stages if isinstance(s, PipelineStage) and ":" not in s.addressing]
        named = {s.addressing: [p for d in s.deps if hasattr(d, "params") for p in (d.params or [])] for s in stages}
        module = {s.addressing: [str(d.def_path) for d in s.deps if str(d.def_path).startswith("rcgrpo_tasks/stages/")]
                  for s in stages}
        readers = {s.addressing: {a.addressing for a in nx.ancestors(graph, s) if isinstance(a, PipelineStage)}
                   for s in stages}
    return named, module, readers


def _names(key: str, listed: list[str]) -> bool:
    """Whether a stage whose params list is `listed` depends on `key` (a section named whole covers its keys)."""
    return any(key == p or key.startswith(f"{p}.") for p in listed)


def test_a_learning_rate_change_reruns_the_rl_cells_and_what_reads_them_only(pipeline):
    named, _, readers = pipeline
    field = next(f for f in dataclasses.fields(RLConfig) if f.name == "learning_rate")
    assert field.default is dataclasses.MISSING, "rl.learning_rate has a code default: tuning it would be a code change"
    direct = {s for s, listed in named.items() if _names("rl.learning_rate", listed)}
    assert direct and all(s.startswith(("rl_sft@", "rl_rctp@")) for s in direct), direct
    rerun = direct | {r for s in direct for r in readers[s]}
    assert all(s.startswith(("rl_sft@", "rl_rctp@", "evaluate_rl_", "controllability_rl_")) or s in ("report", "promote")
               for s in rerun), rerun
    untouched = {"prepare_data", "sft", "evaluate@base", "evaluate@sft"} | {
        s for s in named if s.startswith(("rctp@", "sample_policy@", "pool_rctp@", "controllability@", "evaluate_rctp@"))}
    assert not rerun & untouched, sorted(rerun & untouched)
    # evaluate and controllability (before and after RL) sample as RL does: they name those keys, never the section
    for stage in (s for s in named if s.startswith(("evaluate", "controllability"))):
        assert "rl" not in named[stage] and any(p.startswith("rl.") for p in named[stage]), (stage, named[stage])


def _whole_sections(module: str) -> set[str]:
    """Sections a module reads whole (`load_config(Cls, params, "rl")`, `read_sections(params, "rl", ...)`,
    `load_compute`); `load_keys` reads keys, not a section."""
    tree = ast.parse((PKG.parent / (module.replace(".", "/") + ".py")).read_text())
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "id", getattr(node.func, "attr", None))
        if name == "load_compute":
            out.add("compute")
        elif name in WHOLE_READERS:
            at = WHOLE_READERS[name]
            args = node.args[at:at + 1] if at is not None else node.args[1:]
            out |= {a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return out


def test_a_stage_names_whole_only_the_sections_it_reads_whole(pipeline):
    """A section named whole in a stage's `params:` reruns it on any key of that section: only where the stage
    (its module or the library it imports) loads the section whole; where it reads a few keys, it names them
    (controllability and evaluate name `rl.temperature`, not `rl`, so a learning-rate change leaves them)."""
    named, module, _ = pipeline
    graph = grimp.build_graph("rcgrpo_tasks")
    wrong = {}
    for stage, listed in named.items():
        names = [Path(m).with_suffix("").as_posix().replace("/", ".") for m in module[stage]]
        seen = {*names, *(u for n in names for u in graph.find_upstream_modules(n))}
        read = set().union(*(_whole_sections(m) for m in seen if (PKG.parent / (m.replace(".", "/") + ".py")).is_file()))
        partly = [p for p in listed if "." not in p and p not in read]
        if partly:
            wrong[stage] = partly
    assert not wrong, f"sections named whole but read only in part (name the keys in dvc.yaml): {wrong}"
