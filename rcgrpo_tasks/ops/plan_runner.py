"""Running a plan (`ops.pipeline`) where DVC is not installed: the stages by the rule of `pipeline.decide`,
several side by side when asked (`jobs`), each stage's log, and one results bundle rewritten after every
stage, so a lease that ends mid-run still returns what finished."""

from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rcgrpo_tasks.ops import schedule, stops
from rcgrpo_tasks.ops.inputs import InputError
from rcgrpo_tasks.ops.outputs import atomic_path
from rcgrpo_tasks.ops.pipeline import PlannedStage, decide
from rcgrpo_tasks.ops.schedule import Ended

BUNDLE_FILE_MAX_BYTES = 2 * 1024 * 1024
"""Cached output files up to this size go into the bundle (per-entry results, reports, controllability
trajectories); larger ones (models, datasets, policy samples) stay on the host."""
POLL_S = 0.1
"""How often a running stage is polled (its output is copied as it comes, by a reader thread)."""


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


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


NOT_FOUND = 127
"""A stage whose command is not on PATH ends as bash would end it (`command not found`)."""


def unstartable(cmds: tuple[str, ...], root: Path, env: dict[str, str]) -> list[str]:
    """The first words of `cmds` that bash would not find with `env`'s PATH in `root` (`command -v`: builtins,
    keywords, functions and executables count): a stage with any of them cannot start."""
    words = []
    for cmd in cmds:
        try:
            first = shlex.split(cmd)[:1]
        except ValueError:  # unbalanced quotes: bash itself will say so
            first = []
        words += [w for w in first if "=" not in w]  # `VAR=x cmd`: bash checks at run time
    probe = "for w; do command -v -- \"$w\" >/dev/null || echo \"$w\"; done"
    found = subprocess.run(["bash", "-c", probe, "_", *words], cwd=root, env=env, capture_output=True, text=True)
    return found.stdout.split()


class StageJob:
    """One stage's commands run in order (`bash -c`, in `root`, each in its own process group), its output
    appended to `log_path` and echoed line by line. Started and polled from the caller's thread (a child
    started from a worker thread would get its parent-death signal when that thread ends); one reader
    thread per command copies the output. A stage's outputs are removed before it starts (as dvc does), once
    its commands are found (`unstartable`): a stage that cannot start ends at once with exit 127, nothing of
    it removed."""

    def __init__(self, stage: PlannedStage, root: Path, log_path: Path, env: dict[str, str],
                 echo: Callable[[str], None]):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        # What `dvc repro` gives a stage's command: a stage names its MLflow run by `$DVC_STAGE`
        # (`ops.tracking.run_name`), so the same stage run here is named as under DVC.
        env = {**env, "DVC_STAGE": stage.name, "DVC_ROOT": str(root)}
        self.stage, self.root, self.env, self.echo = stage, root, env, echo
        self.log = open(log_path, "a", encoding="utf-8")  # noqa: SIM115 (closed when the stage ends)
        self.todo = list(stage.cmds)
        self.t0 = time.monotonic()
        self.rc: int | None = None
        self.wall_s = 0.0
        missing = unstartable(stage.cmds, root, env)
        if missing:
            line = (f"{', '.join(missing)}: command not found on PATH ({env.get('PATH', '')}); nothing of "
                    f"{stage.name} was removed")
            self.log.write(line + "\n")
            echo(f"  {stage.name} | {line}")
            self._end(NOT_FOUND)
            return
        for out in (*stage.outs, *stage.records):
            _remove(root / out)
        self._next()

    def _next(self) -> None:
        cmd = self.todo.pop(0)
        self.log.write(f"$ {cmd}\n")
        self.log.flush()
        self.proc = stops.start_group(["bash", "-c", cmd], cwd=self.root, env=self.env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1)
        self.reader = threading.Thread(target=self._pump, args=(self.proc,), daemon=True)
        self.reader.start()

    def _pump(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.log.write(line)
            self.echo(f"  {self.stage.name} | {line.rstrip()}")

    def _end(self, rc: int | None) -> None:
        self.rc, self.wall_s = rc, time.monotonic() - self.t0
        self.log.close()

    def poll(self) -> int | None:
        """None while the stage runs; then the exit code of its first failing command, or 0."""
        if self.log.closed:  # ended (`_end`): its exit code, None if stopped
            return self.rc
        rc = self.proc.poll()
        if rc is None:
            return None
        self.reader.join()
        if rc != 0 or not self.todo:
            self._end(rc)
            return rc
        self._next()
        return None

    def stop(self) -> None:
        """Stop the running command's whole group (SIGTERM, then SIGKILL)."""
        stops.stop_group(self.proc)
        self.reader.join(timeout=5)
        self._end(None)


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


BIN = Path(sys.executable).parent
"""This environment's executables (`rcgrpo`, `dvc`): a stage command finds them first, also when the runner
was started by its path (`.venv/bin/rcgrpo run-plan`) without the environment on PATH."""


def stage_env(base: dict[str, str] | None = None, jobs: int = 1, parent_run_id: str | None = None
              ) -> dict[str, str]:
    """THE environment of a stage command, run by `run_plan` or by the flow's `dvc repro` (`base`, default this
    process's): `BIN` first on PATH; the stage dies with whatever started it (as under DVC) and prints as it
    goes (progress bars as a log line every 15 s); no `MLFLOW_RUN_ID` (the stage would resume that run instead
    of nesting), and `parent_run_id`, if any, as the parent its run nests under; DVC runs a stage as `$SHELL -c
    CMD`, and bash execs the command, so the stage's parent is dvc itself (`ops.stops.die_with_parent`); with
    `jobs` stages side by side each gets its share of the cores for its CPU threads (unless the caller set
    OMP_NUM_THREADS), so they do not oversubscribe the host."""
    env = dict(os.environ if base is None else base)
    env.pop("MLFLOW_RUN_ID", None)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["RCGRPO_DIE_WITH_PARENT"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["SHELL"] = shutil.which("bash") or env.get("SHELL", "/bin/sh")
    env.setdefault("TQDM_MININTERVAL", "15")
    if parent_run_id:
        env["RCGRPO_PARENT_RUN_ID"] = parent_run_id
    if jobs > 1:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    return env


class PlanJob:
    """A `StageJob` as the scheduler polls it (`ops.schedule.Running`): exit 0 ran, else failed."""

    def __init__(self, job: StageJob):
        self.job = job

    def poll(self) -> Ended | None:
        rc = self.job.poll()
        if rc is None:
            return None
        return Ended("ran" if rc == 0 else "failed", "" if rc == 0 else f"exit {rc}", rc)

    def stop(self) -> None:
        self.job.stop()


def gpu_env(env: dict[str, str], devices: list[int]) -> dict[str, str]:
    """`env` with the stage's own devices as the only visible ones (`--gpus`; none asked: unchanged)."""
    return {**env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))} if devices else env


def run_plan(stages: list[PlannedStage], root: str | Path, logs: str | Path, bundle: str | Path | None = None,
             extra: list[Path] | None = None, env: dict[str, str] | None = None,
             echo: Callable[[str], None] | None = None, jobs: int = 1, keep_going: bool = False,
             on_done: Callable[[PlannedStage], None] | None = None, recorded: set[str] | frozenset = frozenset(),
             gpus: int | None = None) -> RunRecord:
    """Run `stages` (a plan, in order) in `root` by the rule of the module docstring, at most `jobs` at a
    time, scheduled by `ops.schedule.run_dag` (THE scheduler: a stage starts once every stage it depends on
    has finished; after the first failure nothing new starts, the stages running finish, the rest are
    `not_run`; `keep_going`, as `dvc repro --keep-going`: only the stages downstream of a failed one are
    `not_run`, the others still run: a sweep's candidates do not depend on each other). Side by side, stages
    share the host (on a GPU host: its devices; the stages here place small models and size nothing by free
    memory); `gpus`: the host's device count, a stage then runs only while the devices its resources declare
    (`PlannedStage.gpus`, params `resources`) are free, and sees only its own (`CUDA_VISIBLE_DEVICES`); None:
    no bound, every stage sees every device. The bundle, if asked for, is rewritten after every stage and once
    more at the end, also after a failure or a stop (SIGTERM/SIGHUP: the running stages' groups are stopped,
    recorded as `stopped`, then `stops.Terminated` propagates). `on_done(stage)` is called, one stage at a
    time, after each stage that ran and exited 0 (`rcgrpo run-plan --dvc-commit` records it in dvc.lock there,
    so that a plan made after a cut finds it up to date). `recorded`: the stages dvc.lock recorded since the
    plan was made (`pipeline.recorded_since`), skipped while their outputs are here."""
    if jobs < 1:
        raise InputError(f"jobs must be >= 1, got {jobs}")
    root, logs = Path(root), Path(logs)
    echo = echo or (lambda line: print(line, flush=True))
    env = stage_env(env, jobs)
    record = RunRecord()
    extra = [logs, *(extra or [])]
    reasons = {s.name: reason for s, reason in decide(stages, root, recorded)}
    devices = list(range(gpus or 0))
    held: dict[str, list[int]] = {}
    jobs_of: dict[str, StageJob] = {}
    t_start = time.monotonic()

    def refresh() -> None:
        record.wall_s = time.monotonic() - t_start
        if bundle is not None:
            write_bundle(bundle, bundle_members(stages, root, extra, record), root, record)

    def start(stage: PlannedStage) -> PlanJob | Ended:
        reason = reasons[stage.name]
        if reason is None:
            why = "recorded in dvc.lock since the plan was made" if stage.name in recorded else \
                "up to date where the plan was made"
            record.stages[stage.name] = StageRun("skipped", why)
            echo(f"[run-plan] {stage.name}: skipped ({why}, outputs present)")
            return Ended("skipped", why)
        echo(f"[run-plan] {stage.name}: running ({reason})")
        log = logs / f"{stage.name}.log"
        record.stages[stage.name] = StageRun("running", reason, log=str(log))
        if gpus is not None:
            held[stage.name] = [devices.pop(0) for _ in range(stage.gpus)]
        jobs_of[stage.name] = StageJob(stage, root, log, gpu_env(env, held.get(stage.name, [])), echo)
        return PlanJob(jobs_of[stage.name])

    def on_end(stage: PlannedStage, ended: Ended) -> Ended:
        devices.extend(held.pop(stage.name, []))
        if ended.status == "skipped":
            return ended
        rc = ended.detail
        if rc == 0 and on_done is not None:
            try:
                on_done(stage)
            except Exception as err:  # a run that cannot record its progress stops as after a failure
                echo(f"[run-plan] {stage.name}: finished, but on_done failed: {err}")
                rc, ended = 1, Ended("failed", f"on_done failed: {err}", 1)
        started, wall = record.stages[stage.name], jobs_of[stage.name].wall_s
        record.stages[stage.name] = StageRun("failed" if rc else "ran", started.reason, round(wall, 1), rc,
                                             started.log)
        echo(f"[run-plan] {stage.name}: {'FAILED (exit %d)' % rc if rc else 'done'} in {wall:.1f} s")
        refresh()
        return ended

    capacity = {"jobs": jobs, **({"gpu": gpus} if gpus is not None else {})}
    handlers = stops.raise_on_terminate()
    results: dict[str, Ended] = {}
    try:
        schedule.run_dag(stages, start, capacity=capacity, cost=lambda s: {"jobs": 1, "gpu": s.gpus},
                         keep_going=keep_going, poll_s=POLL_S, on_end=on_end, results=results)
    finally:
        stops.restore(handlers)
        for name, ended in results.items():
            if ended.status == "stopped":
                started = record.stages[name]
                record.stages[name] = StageRun("stopped", started.reason, round(jobs_of[name].wall_s, 1), None,
                                               started.log)
            elif ended.status == "not_run":
                record.stages[name] = StageRun("not_run", ended.reason)
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


