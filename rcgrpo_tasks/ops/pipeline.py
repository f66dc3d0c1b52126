"""The DVC pipeline as a plan that runs where DVC is not installed.

A lent GPU host has CUDA and PyTorch but no package index, so DVC (and its ~100 dependencies) cannot be
installed there. DVC still decides everything it knows about: `dvc_stages` asks DVC itself, where the plan
is made, for every stage of `dvc.yaml` (foreach/matrix expanded, topological order), its commands, its
outputs and whether it is up to date (`dvc status`). `run_plan` then runs that plan on the host with no DVC:

- a stage DVC found up to date (`done`) runs only if one of its cached outputs is missing on the host (an
  output too large to travel, such as the base model, is rebuilt from the same deps: the data stages are
  byte-reproducible); a stage DVC found stale always runs, once, in plan order;
- a stage's outputs are removed before it runs (as `dvc repro` does), and the first failing stage stops
  the run (later stages would read missing inputs);
- after every stage the bundle (`write_bundle`: per-stage wall times and logs, the plan, params, every
  `cache: false` metric/plot/table and the small cached output files) is rewritten atomically, so a lease
  that ends mid-run still returns what finished.

Departures from `dvc repro`, on purpose: no hashes are computed or compared (a fresh host has nothing
stale but what is missing) and no `dvc.lock` is written (the host's outputs are results to bring back, not
artifacts to cache).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rcgrpo_tasks.ops import procs
from rcgrpo_tasks.ops.inputs import InputError, read_json
from rcgrpo_tasks.ops.outputs import atomic_path, write_json

PLAN_FORMAT = 1
BUNDLE_FILE_MAX_BYTES = 2 * 1024 * 1024
"""Cached output files up to this size go into the bundle (per-entry results, reports, controllability
trajectories); larger ones (models, datasets, policy samples) stay on the host."""


@dataclass(frozen=True)
class PlannedStage:
    """One expanded `dvc.yaml` stage (`evaluate@rctp`, `rl@rctp-rc_grpo`, ...)."""

    name: str
    cmds: tuple[str, ...]
    upstream: tuple[str, ...]
    outs: tuple[str, ...]
    """Cached outputs: what the stage makes and later stages read."""
    records: tuple[str, ...] = ()
    """`cache: false` outputs (metrics, plots, tables): small, and what a run is read by."""
    done: bool = False
    """DVC found the stage up to date where the plan was made."""


@dataclass
class StageRun:
    """What happened to one stage in `run_plan`."""

    status: str  # ran | skipped | failed | stopped | not_run
    reason: str
    wall_s: float = 0.0
    rc: int | None = None
    log: str | None = None


@dataclass
class RunRecord:
    """The whole run: per-stage results in plan order, and the total wall time."""

    stages: dict[str, StageRun] = field(default_factory=dict)
    wall_s: float = 0.0

    def to_json(self) -> dict:
        ran = [s.wall_s for s in self.stages.values() if s.status in ("ran", "failed", "stopped")]
        return {"wall_s": round(self.wall_s, 1), "stage_wall_s_sum": round(sum(ran), 1),
                "stages": {k: asdict(v) for k, v in self.stages.items()}}


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
            planned = []
            for s in stages:
                cmds = (s.cmd,) if isinstance(s.cmd, str) else tuple(s.cmd)
                planned.append(PlannedStage(
                    address(s), cmds, tuple(address(d) for d in graph.successors(s) if isinstance(d, PipelineStage)),
                    tuple(str(o.def_path) for o in s.outs if o.use_cache),
                    tuple(str(o.def_path) for o in s.outs if not o.use_cache),
                    done=stale is not None and s.addressing not in stale))
            return planned
    except DvcException as exc:  # not a DVC project, a broken dvc.yaml, ...: one line naming the project
        raise InputError(f"{repo_dir}: DVC cannot read the pipeline: {exc}") from exc


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
        stages.append(PlannedStage(row["name"], cmds, upstream, _strings(row.get("outs", []), f"{where}: 'outs'"),
                                   _strings(row.get("records", []), f"{where}: 'records'"), row.get("done", False)))
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


# -- running it (no DVC needed) -----------------------------------------------------------------------------

def decide(stages: list[PlannedStage], root: Path) -> list[tuple[PlannedStage, str | None]]:
    """(stage, why it must run on this host, or None: skipped) for every stage of the plan, in order, by the
    rule of the module docstring. A stage that runs because it was stale (or because a stage upstream of it
    did) may change its outputs, so what depends on it runs too; an up-to-date stage that runs only to
    rebuild a missing output writes the same bytes, so what depends on it stays up to date."""
    changed: set[str] = set()
    out = []
    for stage in stages:
        upstream = [u for u in stage.upstream if u in changed]
        missing = [o for o in stage.outs if not (root / o).exists()]
        if not stage.done:
            reason = "stale where the plan was made"
        elif upstream:
            reason = f"upstream {upstream[0]} re-ran"
        elif missing:
            reason = f"output missing here: {missing[0]}"
        else:
            reason = None
        if not stage.done or upstream:
            changed.add(stage.name)
        out.append((stage, reason))
    return out


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def run_stage(stage: PlannedStage, root: Path, log_path: Path, env: dict[str, str],
              echo: Callable[[str], None]) -> tuple[int, float]:
    """Run `stage`'s commands in order (`bash -c`, in `root`, each in its own process group, its output
    appended to `log_path` and echoed line by line); (exit code of the first failing command or 0, wall s).
    A SIGTERM/SIGHUP to this process stops the running command's whole group, then propagates."""
    for out in (*stage.outs, *stage.records):
        _remove(root / out)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log_path, "a", encoding="utf-8") as log:
        for cmd in stage.cmds:
            log.write(f"$ {cmd}\n")
            log.flush()
            proc = procs.start_group(["bash", "-c", cmd], cwd=root, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1)
            try:
                for line in proc.stdout:
                    log.write(line)
                    echo(f"  {stage.name} | {line.rstrip()}")
                rc = proc.wait()
            except BaseException:
                procs.stop_group(proc)
                raise
            if rc != 0:
                return rc, time.monotonic() - t0
    return 0, time.monotonic() - t0


def bundle_members(stages: list[PlannedStage], root: Path, extra: list[Path], record: RunRecord) -> list[Path]:
    """Files (relative to `root`) the bundle holds: of every stage that ran or was found done in `record`,
    its records and its cached outputs that are files of at most BUNDLE_FILE_MAX_BYTES (a stage not reached
    yet contributes nothing: what is on disk for it is not this run's); then the files/folders in `extra`
    (logs, the plan, params)."""
    found: list[Path] = []
    for s in stages:
        if record.stages.get(s.name, StageRun("not_run", "")).status not in ("ran", "skipped", "failed", "stopped"):
            continue
        for rel in s.records:
            path = root / rel
            if path.is_file():
                found.append(path)
        for rel in s.outs:
            path = root / rel
            if path.is_file() and path.stat().st_size <= BUNDLE_FILE_MAX_BYTES:
                found.append(path)
    for path in extra:
        if path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            found.append(path)
    seen, unique = set(), []
    for path in found:
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(path)
    return unique


def write_bundle(out: str | Path, members: list[Path], root: Path, record: RunRecord) -> Path:
    """`out` (a .tar.gz) = `members` under their paths relative to `root` (others under their own name),
    plus `timings.json` (the run record); written to a temporary file and renamed, so a reader never sees
    half a bundle."""
    out = Path(out)
    with atomic_path(out) as tmp, tarfile.open(tmp, "w:gz") as tar:
        blob = json.dumps(record.to_json(), indent=1).encode()
        info = tarfile.TarInfo("timings.json")
        info.size, info.mtime = len(blob), int(time.time())
        tar.addfile(info, io.BytesIO(blob))
        for path in members:
            try:
                arc = path.resolve().relative_to(root.resolve())
            except ValueError:
                arc = Path(path.name)
            tar.add(path, arcname=str(arc), recursive=False)
    return out


def stage_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The stages' environment: a stage dies with the runner (as under DVC) and prints as it goes."""
    env = dict(os.environ if base is None else base)
    env["RCGRPO_DIE_WITH_PARENT"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_plan(stages: list[PlannedStage], root: str | Path, logs: str | Path, bundle: str | Path | None = None,
             extra: list[Path] | None = None, env: dict[str, str] | None = None,
             echo: Callable[[str], None] | None = None) -> RunRecord:
    """Run `stages` (a plan, in order) in `root` by the rule of the module docstring; stop at the first
    failing stage (the rest are `not_run`). The bundle, if asked for, is rewritten after every stage and
    once more at the end, also after a failure or a stop (SIGTERM/SIGHUP: the running stage's group is
    stopped, recorded as `stopped`, then `procs.Terminated` propagates)."""
    root, logs = Path(root), Path(logs)
    echo = echo or (lambda line: print(line, flush=True))
    env = stage_env(env)
    record = RunRecord()
    extra = [logs, *(extra or [])]
    t_start = time.monotonic()

    def refresh() -> None:
        record.wall_s = time.monotonic() - t_start
        if bundle is not None:
            write_bundle(bundle, bundle_members(stages, root, extra, record), root, record)

    handlers = procs.raise_on_terminate()
    failed = False
    try:
        for stage, reason in decide(stages, root):
            if failed:
                record.stages[stage.name] = StageRun("not_run", "an earlier stage failed")
                continue
            if reason is None:
                record.stages[stage.name] = StageRun("skipped", "up to date where the plan was made")
                echo(f"[run-plan] {stage.name}: skipped (up to date where the plan was made, outputs present)")
                continue
            echo(f"[run-plan] {stage.name}: running ({reason})")
            log = logs / f"{stage.name}.log"
            record.stages[stage.name] = StageRun("running", reason, log=str(log))
            t0 = time.monotonic()
            try:
                rc, wall = run_stage(stage, root, log, env, echo)
            except procs.Terminated:
                record.stages[stage.name] = StageRun("stopped", reason, time.monotonic() - t0, None, str(log))
                raise
            failed = rc != 0
            record.stages[stage.name] = StageRun("failed" if failed else "ran", reason, round(wall, 1), rc, str(log))
            echo(f"[run-plan] {stage.name}: {'FAILED (exit %d)' % rc if failed else 'done'} in {wall:.1f} s")
            refresh()
    finally:
        procs.restore(handlers)
        refresh()
    return record


def timing_table(record: RunRecord) -> str:
    """A plain-text table of the run: stage, status, wall seconds; then the sum of the stages that ran."""
    lines = [f"{'stage':<28} {'status':<8} {'wall_s':>8}"]
    for name, run in record.stages.items():
        lines.append(f"{name:<28} {run.status:<8} {run.wall_s:>8.1f}")
    total = record.to_json()
    lines.append(f"{'stages run, sum':<37} {total['stage_wall_s_sum']:>8.1f}")
    lines.append(f"{'wall, end to end':<37} {total['wall_s']:>8.1f}")
    return "\n".join(lines)


def describe(stages: list[PlannedStage], root: Path) -> list[str]:
    """One line per stage: what `run_plan` would do here and why (a dry look, runs nothing)."""
    return [f"{s.name}: {'run (' + reason + ')' if reason else 'skip'}" for s, reason in decide(stages, root)]
