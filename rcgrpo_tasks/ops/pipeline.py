"""The DVC pipeline as a plan that runs where DVC is not installed.

A lent GPU host has CUDA and PyTorch but no package index, so DVC (and its ~100 dependencies) cannot be
installed there. DVC still decides everything it knows about: `dvc_stages` asks DVC itself, where the plan
is made, for every stage of `dvc.yaml` (foreach/matrix expanded, topological order), its commands, its
outputs and whether it is up to date (`dvc status`). `plan_runner.run_plan` then runs that plan on the host
with no DVC:

- a stage DVC found up to date (`done`) runs only if one of its cached outputs is missing on the host (an
  output too large to travel, such as the base model, is rebuilt from the same deps: the data stages are
  byte-reproducible); a stage DVC found stale always runs, once, after every stage it depends on (in plan
  order, or several side by side: `jobs`);
- a stage recorded in dvc.lock since the plan was made (`recorded_since`: `run-plan --dvc-commit` records each
  stage as it ends, so the same command run again after a cut finds them) is skipped, and counts as re-run for
  what depends on it; a plan whose params.yaml or dvc.yaml changed since is refused, naming the command that
  re-plans;
- a stage's outputs are removed before it runs (as `dvc repro` does), once its commands are found on PATH
  (nothing is removed for a stage that cannot start), and the first failing stage stops the run (later
  stages would read missing inputs; the stages already running side by side finish);
- after every stage the bundle (`write_bundle`: per-stage wall times and logs, the plan, params, every
  `cache: false` metric/plot/table and the small cached output files) is rewritten atomically, so a lease
  that ends mid-run still returns what finished.

Departures from `dvc repro`, on purpose: no hashes are computed or compared (a fresh host has nothing
stale but what is missing) and no `dvc.lock` is written (the host's outputs are results to bring back, not
artifacts to cache).

A stage run again elsewhere (the dev sweep: the `rl` stage's command with a candidate's params file and its
own output folders) is a `variant` of the planned stage: its command with named options' values replaced
or dropped and arguments appended, so the command stays the one DVC resolved, changed only where said.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rcgrpo_tasks.ops.config import read_params
from rcgrpo_tasks.ops.inputs import InputError, read_json
from rcgrpo_tasks.ops.outputs import write_json
from rcgrpo_tasks.ops.resources import resources_of

PLAN_FORMAT = 1
ROOT_CHECK = "check_params"
"""The pipeline's root stage: the whole params file checked before any other stage works (`rcgrpo check-params`).
Where a project's dvc.yaml declares it, `rcgrpo plan`, `rcgrpo params` and the flow run the same check first."""


def declares_root_check(repo_dir: str | Path) -> bool:
    """Whether `repo_dir`/dvc.yaml declares the root check stage (`ROOT_CHECK`); read as YAML, in milliseconds."""
    import yaml

    path = Path(repo_dir) / "dvc.yaml"
    try:
        stages = (yaml.safe_load(path.read_text()) or {}).get("stages") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return False
    return isinstance(stages, dict) and ROOT_CHECK in stages


@dataclass(frozen=True)
class PlannedStage:
    """One expanded `dvc.yaml` stage (`evaluate_rctp@0`, `rl_rctp@0-rc_grpo`, ...)."""

    name: str
    cmds: tuple[str, ...]
    upstream: tuple[str, ...]
    outs: tuple[str, ...]
    """Cached outputs: what the stage makes and later stages read."""
    records: tuple[str, ...] = ()
    """`cache: false` outputs (metrics, plots, tables): small, and what a run is read by."""
    done: bool = False
    """DVC found the stage up to date where the plan was made."""
    gpus: int = 0
    """The GPUs the stage declares (params `resources`: `ops.resources`); 0: a `cpu` stage."""


# -- making the plan (where DVC is installed) ------------------------------------------------------------

def dvc_stages(repo_dir: str | Path, with_status: bool = True, main_only: bool = True) -> list[PlannedStage]:
    """Every stage of `repo_dir`/dvc.yaml (with `main_only=False`, of every dvc.yaml under it, named
    `<file>:<stage>` outside the root one), expanded and in DVC's topological order (ties in file order), as
    DVC itself resolves it. `with_status`: mark the stages `dvc status` finds up to date as `done` (hashes
    every dep: seconds to minutes)."""
    import networkx as nx
    from dvc.exceptions import DvcException
    from dvc.repo import Repo
    from dvc.stage import PipelineStage

    try:
        with Repo(str(repo_dir)) as repo:
            graph = repo.index.graph  # edges point from a stage to the stages it depends on
            order = {s: i for i, s in enumerate(repo.index.stages)}

            def address(stage) -> str:  # like Stage.addressing, but relative to the repo, not to the cwd
                rel = os.path.relpath(stage.dvcfile.path, repo.root_dir)
                return stage.name if rel == "dvc.yaml" else f"{rel}:{stage.name}"

            stages = [s for s in nx.lexicographical_topological_sort(graph.reverse(), key=lambda s: order[s])
                      if isinstance(s, PipelineStage) and (not main_only or ":" not in address(s))]
            stale = set(repo.status(targets=[s.addressing for s in stages], with_deps=False)) if with_status else None
            where = Path(repo_dir) / "params.yaml"
            resources = resources_of(read_params(where) if where.is_file() else {}, str(where))
            planned = []
            for s in stages:
                cmds = (s.cmd,) if isinstance(s.cmd, str) else tuple(s.cmd)
                planned.append(PlannedStage(
                    address(s), cmds, tuple(address(d) for d in graph.successors(s) if isinstance(d, PipelineStage)),
                    tuple(str(o.def_path) for o in s.outs if o.use_cache),
                    tuple(str(o.def_path) for o in s.outs if not o.use_cache),
                    done=stale is not None and s.addressing not in stale, gpus=resources.of(address(s)).gpus))
            return planned
    except DvcException as exc:  # not a DVC project, a broken dvc.yaml, ...: one line naming the project
        raise InputError(f"{repo_dir}: DVC cannot read the pipeline: {exc}") from exc


PLANNED_FILES = ("params.yaml", "dvc.yaml")
"""The files a plan is made from: a plan whose files changed since is refused (`recorded_since`)."""


def _sha(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()[:16]


def lock_entries(repo_dir: str | Path) -> dict[str, str]:
    """{stage: short sha256 of its dvc.lock entry (cmd, deps, params, outs hashes)}; {} without a dvc.lock.
    Read as YAML: no DVC needed (a lent host compares a plan with its copy of the lock)."""
    import yaml

    path = Path(repo_dir) / "dvc.lock"
    if not path.is_file():
        return {}
    stages = (yaml.safe_load(path.read_text()) or {}).get("stages") or {}
    return {name: _sha(json.dumps(entry, sort_keys=True, default=str).encode()) for name, entry in stages.items()}


def plan_state(repo_dir: str | Path) -> dict:
    """What a plan records of the project it was made from (`meta`): the planned files' hashes and dvc.lock's
    entries, for `recorded_since`."""
    root = Path(repo_dir)
    return {"files": {f: _sha((root / f).read_bytes()) for f in PLANNED_FILES if (root / f).is_file()},
            "lock": lock_entries(root)}


def recorded_since(stages: list[PlannedStage], meta: dict, root: str | Path, replan: str) -> set[str]:
    """The planned stages recorded in `root`/dvc.lock since the plan was made (their entry changed: a
    `run-plan --dvc-commit` or a `dvc repro` finished them). InputError naming `replan` (the command that
    makes a fresh plan) when params.yaml or dvc.yaml changed since: the plan's commands and states may no
    longer be the pipeline's. A plan without the record (`plan_state`) or a root without dvc.lock: none."""
    if "lock" not in meta or not (Path(root) / "dvc.lock").is_file():
        return set()
    now = plan_state(root)
    moved = [f for f, sha in (meta.get("files") or {}).items() if now["files"].get(f) != sha]
    if moved:
        raise InputError(f"{' and '.join(moved)} changed since the plan was made: its stages and their states may "
                         f"no longer be the pipeline's; re-plan: `{replan}`")
    then = meta["lock"]
    return {s.name for s in stages if s.name in now["lock"] and now["lock"][s.name] != then.get(s.name)}


def write_plan(stages: list[PlannedStage], path: str | Path, meta: dict | None = None) -> None:
    """The plan as JSON (`format`, `meta`, `stages`), published atomically."""
    write_json(path, {"format": PLAN_FORMAT, "meta": meta or {}, "stages": [asdict(s) for s in stages]})


def _strings(value, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InputError(f"{where}: must be a list of strings")
    return tuple(value)


def read_plan(path: str | Path) -> tuple[list[PlannedStage], dict]:
    """(stages, meta) of a plan `write_plan` wrote; a malformed plan fails naming the file and field."""
    data = read_json(path)
    if data.get("format") != PLAN_FORMAT:
        raise InputError(f"{path}: 'format' is {data.get('format')!r}, expected {PLAN_FORMAT} (write it with "
                         "`rcgrpo plan` from this version)")
    rows = data.get("stages")
    if not isinstance(rows, list) or not rows:
        raise InputError(f"{path}: 'stages' must be a non-empty list")
    stages, names = [], set()
    for i, row in enumerate(rows):
        where = f"{path}: stages[{i}]"
        if not isinstance(row, dict) or not isinstance(row.get("name"), str) or not row["name"]:
            raise InputError(f"{where}: needs a string 'name'")
        where = f"{path}: stage {row['name']!r}"
        if row["name"] in names:
            raise InputError(f"{where}: listed twice")
        cmds = _strings(row.get("cmds"), f"{where}: 'cmds'")
        if not cmds:
            raise InputError(f"{where}: 'cmds' is empty")
        upstream = _strings(row.get("upstream", []), f"{where}: 'upstream'")
        unknown = [u for u in upstream if u not in names]
        if unknown:
            raise InputError(f"{where}: upstream {unknown} not listed before it (a plan is in topological order)")
        if not isinstance(row.get("done", False), bool):
            raise InputError(f"{where}: 'done' must be true or false")
        gpus = row.get("gpus", 0)
        if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 0:
            raise InputError(f"{where}: 'gpus' must be an integer >= 0, got {gpus!r}")
        stages.append(PlannedStage(row["name"], cmds, upstream, _strings(row.get("outs", []), f"{where}: 'outs'"),
                                   _strings(row.get("records", []), f"{where}: 'records'"), row.get("done", False),
                                   gpus))
        names.add(row["name"])
    meta = data.get("meta", {})
    return stages, meta if isinstance(meta, dict) else {}


def select(upstream: Mapping[str, Sequence[str]], wanted: list[str] | None) -> list[str]:
    """Stage names to run, in the order of `upstream` ({stage: the stages it depends on}, topologically
    ordered): `wanted` (exact names or foreach/matrix prefixes: `evaluate` = every `evaluate@...`) and
    everything upstream of them; None or empty = all."""
    if not wanted:
        return list(upstream)
    keep: set[str] = set()
    for name in wanted:
        hits = [s for s in upstream if s == name or s.startswith(f"{name}@")]
        if not hits:
            raise InputError(f"unknown stage {name!r}; the pipeline has: {', '.join(upstream)}")
        keep.update(hits)
    todo = list(keep)
    while todo:
        for up in upstream[todo.pop()]:
            if up not in keep:
                keep.add(up)
                todo.append(up)
    return [s for s in upstream if s in keep]


# -- a stage run again elsewhere ----------------------------------------------------------------------------

Substitution = str | Mapping[str, str] | None
"""What `variant` does to one option: a string = its value; {label: path} = a repeatable `LABEL=PATH`
option keeps exactly these labels, each with its new path; None = every occurrence dropped."""
SHELL_SYNTAX = frozenset({"|", "||", "&&", ";", "&", ">", ">>", "<"})


def _swap(tokens: list[str], args: Mapping[str, Substitution], where: str) -> tuple[list[str], dict]:
    """(the new argv, {old path: new path, or None where dropped}) of one command under `args`."""
    out, moved, seen = [], {}, set()
    i = 0
    while i < len(tokens):
        opt, eq, inline = tokens[i].partition("=")
        if opt not in args or not opt.startswith("--"):
            out.append(tokens[i])
            i += 1
            continue
        if not eq and i + 1 == len(tokens):
            raise InputError(f"{where}: {opt} has no value")
        value, i = (inline, i + 1) if eq else (tokens[i + 1], i + 2)
        new = args[opt]
        if isinstance(new, str):
            moved[value] = new
            out += [opt, new]
        elif new is not None and value.partition("=")[0] in new:
            label, _, path = value.partition("=")
            moved[path] = new[label]
            out += [opt, f"{label}={new[label]}"]
            seen.add((opt, label))
        else:  # dropped: an output under it is not made by the variant (unless a kept option moves it)
            moved.setdefault(value.partition("=")[2] if isinstance(new, Mapping) else value, None)
        seen.add(opt)
    missing = [o for o, new in args.items() if new is not None and o not in seen]
    missing += [f"{o} {label}=" for o, new in args.items() if isinstance(new, Mapping)
                for label in new if (o, label) not in seen]
    if missing:
        raise InputError(f"{where}: the command has no {', '.join(missing)} to substitute (dvc.yaml changed?)")
    return out, moved


def _move(path: str, moved: Mapping[str, str | None], where: str) -> str | None:
    """`path` under the longest old value in `moved` that holds it, moved to the new one (None: dropped)."""
    hits = [old for old in moved if path == old or path.startswith(old.rstrip("/") + "/")]
    if not hits:
        raise InputError(f"{where}: output {path} is under no substituted option: the variant would "
                         "overwrite the pipeline's own")
    old = max(hits, key=len)
    new = moved[old]
    return None if new is None else new + path[len(old):]


def variant(stage: PlannedStage, name: str, args: Mapping[str, Substitution], add: Sequence[str] = (),
            upstream: Sequence[str] = ()) -> PlannedStage:
    """`stage` (one command, an argv without shell syntax) run again as `name` after `upstream`: every
    `--opt VALUE` / `--opt=VALUE` of an option in `args` substituted (`Substitution`), `add` appended, the
    rest of the command as planned. Every output must lie under a substituted option's old value (it moves
    with it, or is dropped with it), so a variant never writes where the pipeline's stage does; an option
    to substitute that the command lacks is an error (a string or label substitution; None drops what is
    there), so a renamed option in dvc.yaml fails here instead of running the planned path."""
    where = f"variant {name} of {stage.name}"
    if len(stage.cmds) != 1:
        raise InputError(f"{where}: {len(stage.cmds)} commands; a variant substitutes in one")
    tokens = shlex.split(stage.cmds[0])
    if SHELL_SYNTAX & set(tokens):
        raise InputError(f"{where}: the command uses shell syntax; a variant substitutes in one argv")
    argv, moved = _swap(tokens, args, where)
    outs = [_move(p, moved, where) for p in stage.outs]
    records = [_move(p, moved, where) for p in stage.records]
    return PlannedStage(name, (shlex.join([*argv, *add]),), tuple(upstream), tuple(p for p in outs if p),
                        tuple(p for p in records if p), gpus=stage.gpus)


# -- running it (no DVC needed) -----------------------------------------------------------------------------

def decide(stages: list[PlannedStage], root: Path, recorded: set[str] | frozenset = frozenset()
           ) -> list[tuple[PlannedStage, str | None]]:
    """(stage, why it must run on this host, or None: skipped) for every stage of the plan, in order, by the
    rule of the module docstring. A stage that runs because it was stale (or because a stage upstream of it
    did) may change its outputs, so what depends on it runs too; an up-to-date stage that runs only to
    rebuild a missing output writes the same bytes, so what depends on it stays up to date; so does the root
    check (`ROOT_CHECK`), whose output holds the same bytes whatever it checked (DVC, which compares hashes,
    reruns nothing after it either). A stage in `recorded` (`recorded_since`) has run since the plan was made:
    skipped while its outputs are here, and re-run for what depends on it."""
    changed: set[str] = set()
    out = []
    for stage in stages:
        upstream = [u for u in stage.upstream if u in changed]
        missing = [o for o in stage.outs if not (root / o).exists()]
        changes = stage.name != ROOT_CHECK
        if stage.name in recorded:
            reason = f"recorded since the plan was made, but its output is missing here: {missing[0]}" if missing \
                else None
            if changes:
                changed.add(stage.name)
            out.append((stage, reason))
            continue
        if not stage.done:
            reason = "stale where the plan was made"
        elif upstream:
            reason = f"upstream {upstream[0]} re-ran"
        elif missing:
            reason = f"output missing here: {missing[0]}"
        else:
            reason = None
        if (not stage.done or upstream) and changes:
            changed.add(stage.name)
        out.append((stage, reason))
    return out


def describe(stages: list[PlannedStage], root: Path, recorded: set[str] | frozenset = frozenset()) -> list[str]:
    """One line per stage: what `run_plan` would do here and why (a dry look, runs nothing)."""
    return [f"{s.name}: {'run (' + reason + ')' if reason else 'skip'}" for s, reason in decide(stages, root, recorded)]
