"""The Prefect tasks of the `rcgrpo` flow that drive DVC (flows/rcgrpo_flow.py): one stage's `dvc repro` in its own
process group (`run_stage`), the stages side by side (`run_stages`), and the transfers with the DVC remote.

`run_stages` runs a plan's stages as tasks on the flow's thread pool, at most `jobs` at a time, by the one
scheduler of the pipeline (`ops.schedule`, as `rcgrpo run-plan --jobs` runs them). DVC allows
several `dvc repro` in one checkout (it releases its repo lock while a stage's command runs, and each waits
for it here: `--wait-for-lock`); stages side by side write different outputs, so DVC's per-path locks never
clash, and each records its own entry in dvc.lock.
"""

from __future__ import annotations

import collections
import os
import queue
import re
import subprocess
import threading
from pathlib import Path

from prefect import get_run_logger, task
from prefect.runtime import task_run

from rcgrpo_tasks.ops import schedule, stops
from rcgrpo_tasks.ops.pipeline import PlannedStage
from rcgrpo_tasks.ops.plan_runner import BIN, stage_env
from rcgrpo_tasks.ops.schedule import Ended

SKIP_MARKERS = ("didn't change, skipping", "is cached - skipping run")
_GROUPS: set[subprocess.Popen] = set()  # the process groups `stream` runs now, for a stop on the flow's thread
_GROUPS_LOCK = threading.Lock()


class StageFailed(RuntimeError):
    """A DVC stage exited non-zero; the message carries the tail of its output."""


class TransferFailed(RuntimeError):
    """`dvc pull` / `dvc push` failed (after the retries)."""



def default_remote(repo_dir: str | Path) -> str | None:
    out = subprocess.run([str(BIN / "dvc"), "remote", "default"], cwd=repo_dir, capture_output=True, text=True)
    name = out.stdout.strip()
    return name if out.returncode == 0 and name else None


def ensure_remote(repo_dir: str | Path) -> str | None:
    """The default DVC remote; if none and `RCGRPO_DVC_REMOTE_URL` is set (containers, K8s pods), add it
    to `.dvc/config.local` (untracked) with `AWS_ENDPOINT_URL_S3` as endpoint. Never writes credentials."""
    name = default_remote(repo_dir)
    url = os.environ.get("RCGRPO_DVC_REMOTE_URL")
    if name or not url:
        return name
    dvc = str(BIN / "dvc")
    cmds = [[dvc, "remote", "add", "--local", "--force", "--default", "shared", url]]
    if os.environ.get("AWS_ENDPOINT_URL_S3"):
        cmds.append([dvc, "remote", "modify", "--local", "shared", "endpointurl", os.environ["AWS_ENDPOINT_URL_S3"]])
    for cmd in cmds:
        subprocess.run(cmd, cwd=repo_dir, check=True, capture_output=True)
    return "shared"


def stream(cmd: list[str], cwd: str | Path, env: dict[str, str], log, tail_lines: int = 40,
           grace_s: float = 20.0) -> tuple[int, str, str]:
    """Run `cmd` as the leader of its own process group, forwarding each output line to `log`; returns
    (exit code, last stdout lines, last stderr lines). Whatever interrupts the wait (Prefect's cancel or
    timeout, SIGTERM, Ctrl-C) stops the whole group before it propagates: nothing is left running."""
    lines: queue.Queue = queue.Queue()
    tails = {"out": collections.deque(maxlen=tail_lines), "err": collections.deque(maxlen=tail_lines)}
    proc = stops.start_group(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, text=True, errors="replace")
    with _GROUPS_LOCK:
        _GROUPS.add(proc)

    def pump(pipe, name: str) -> None:
        for line in pipe:
            lines.put((name, line.rstrip()))
        lines.put((name, None))

    for pipe, name in ((proc.stdout, "out"), (proc.stderr, "err")):
        threading.Thread(target=pump, args=(pipe, name), daemon=True).start()
    try:
        open_pipes = 2
        while open_pipes:
            try:  # a timeout, so an exception sent to this thread (Prefect's task timeout) gets in
                name, line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                open_pipes -= 1
                continue
            tails[name].append(line)
            log(line)
        proc.wait()
    finally:
        if proc.poll() is None or stops.group_alive(proc.pid):
            stops.stop_group(proc, grace_s)
        with _GROUPS_LOCK:
            _GROUPS.discard(proc)
    return proc.returncode, "\n".join(tails["out"]), "\n".join(tails["err"])


def failure_message(stage: str, rc: int, stderr_tail: str, n_lines: int = 20) -> str:
    """`stage 'X' failed (exit N): <its last error line>` + its last stderr lines. N is the stage command's
    own exit code when DVC reports it (`exited with N`), else dvc's."""
    lines = [line for line in stderr_tail.splitlines() if line.strip()]
    exited = [m for line in lines if (m := re.search(r"exited with (-?\d+)", line))]
    code = int(exited[-1].group(1)) if exited else rc
    own = [line for line in lines if not line.startswith(("ERROR: failed to reproduce", "ERROR: "))]
    cause = own[-1].strip() if own else (lines[-1].strip() if lines else "no error output")
    tail = "\n".join(line[:500] for line in lines[-n_lines:])
    return f"stage {stage!r} failed (exit {code}): {cause[:500]}\n--- last stderr lines of {stage} ---\n{tail}"


MISSING_CACHE = "do not exist neither locally nor on remote"
"""What `dvc fetch` warns when the remote lacks outputs that dvc.lock records."""


def missing_cache_note(line: str, remote: str) -> str | None:
    """What DVC's "Some of the cache files do not exist neither locally nor on remote" means in a pull (None:
    `line` is not that warning). On a fresh machine it is expected, not an error: dvc.lock records outputs
    that the remote `remote` has no copy of (a fresh remote, or a workspace that never pushed them); the
    stages producing them run again in `dvc repro` (and `dvc push` stores them at the end)."""
    if MISSING_CACHE not in line:
        return None
    return (f"(the warning above is expected on a fresh machine: remote {remote!r} holds no copy of some outputs "
            "dvc.lock records; the stages that make them will run again and the push at the end stores them)")


@task(name="dvc-transfer")
def dvc_transfer(verb: str, repo_dir: str, targets: list[str], remote: str, retries: int) -> None:
    """`dvc fetch` / `dvc push` of the planned stages' outputs and run cache: network only, so a failure
    here is transient (S3 down, timeouts) and the task is retried with backoff. DVC's missing-cache warning
    is followed by what it means here (`missing_cache_note`)."""
    log = get_run_logger()
    cmd = [str(BIN / "dvc"), verb, "--run-cache", "--remote", remote, *targets]
    attempt = task_run.run_count or 1
    log.info("dvc %s (attempt %d/%d): %s", verb, attempt, retries + 1, " ".join(cmd[1:]))
    notes: list[str] = []

    def forward(line: str) -> None:
        log.info(line)
        if not notes and (note := missing_cache_note(line, remote)):
            notes.append(note)

    rc, out, err = stream(cmd, repo_dir, stage_env(), forward, tail_lines=4)
    for note in notes:
        log.info(note)
    tail = "\n".join(t for t in (out, err) if t)
    if rc != 0:
        short = "\n".join(line[:300] for line in tail.splitlines())
        raise TransferFailed(f"dvc {verb} with remote {remote!r} failed (exit {rc}, attempt {attempt}/"
                             f"{retries + 1}); is the S3 server up? Last output:\n{short}")


@task(name="dvc-checkout")
def dvc_checkout(repo_dir: str, targets: list[str]) -> bool:
    """Outputs from the (fetched) cache into the workspace. Best effort, never retried: leftovers of a
    failed stage can block it, and `dvc repro` reruns or restores whatever is still missing."""
    log = get_run_logger()
    cmd = [str(BIN / "dvc"), "checkout", "--allow-missing", *targets]
    rc, out, err = stream(cmd, repo_dir, stage_env(), log.info, tail_lines=6)
    tail = "\n".join(t for t in (out, err) if t)
    if rc != 0:
        log.warning("dvc checkout incomplete (exit %d); the stages will rerun what is missing:\n%s", rc, tail)
    return rc == 0


@task(name="dvc-stage")
def run_stage(stage: str, repo_dir: str, env: dict[str, str], force: bool) -> str:
    """`dvc repro --single-item <stage>` in its own process group; returns 'ran' or 'skipped'. Raises
    StageFailed with the stage's name, exit code and last stderr lines (also logged as an error)."""
    log = get_run_logger()
    cmd = [str(BIN / "dvc"), "--wait-for-lock", "repro", "--single-item", *(["--force"] if force else []), stage]
    log.info("$ %s", " ".join(cmd[1:]))
    rc, out, err = stream(cmd, repo_dir, env, log.info, tail_lines=60)
    if rc != 0:
        message = failure_message(stage, rc, err or out)
        log.error(message)
        raise StageFailed(message)
    text = f"{out}\n{err}"
    return "skipped" if any(m in text for m in SKIP_MARKERS) and "Running stage" not in text else "ran"


def stop_running(grace_s: float = 20.0) -> None:
    """Stop every stage group `stream` runs now (SIGTERM, SIGKILL after `grace_s`): a stop that reaches the flow's
    thread does not reach the task threads, whose stages run in their own sessions."""
    with _GROUPS_LOCK:
        running = list(_GROUPS)
    for proc in running:
        stops.stop_group(proc, grace_s)


class TaskJob:
    """A `run_stage` task future as the scheduler polls it (`ops.schedule.Running`)."""

    def __init__(self, future):
        self.future = future

    def poll(self) -> Ended | None:
        if not self.future.wrapped_future.done():
            return None
        try:
            return Ended(self.future.result())
        except Exception as exc:  # the stage's own error (StageFailed, a task timeout)
            return Ended("failed", str(exc).splitlines()[0] if str(exc) else type(exc).__name__, exc)

    def stop(self) -> None:
        stop_running()
        self.future.wait(timeout=30)


def run_stages(stages: list[PlannedStage], repo_dir: str, env: dict[str, str], force: bool, jobs: int,
               timeout_s: float | None, results: dict[str, str] | None = None) -> dict[str, str]:
    """{stage: 'ran' | 'skipped' | 'failed'} of `stages` (a plan, in order), each a `run_stage` task named after
    it on the flow's thread pool, at most `jobs` at a time, scheduled by `ops.schedule.run_dag` (THE scheduler,
    as `rcgrpo run-plan --jobs`: each stage once those it depends on are done, the stages most others wait for
    first), filled into `results` as each stage ends (so a caller holds what finished also when this raises).
    After a failure nothing new starts, the stages running finish, and the first failure is raised. A stop
    (SIGTERM, Ctrl-C, a timeout of the flow) stops every running stage's group before it propagates."""
    log = get_run_logger()
    results = {} if results is None else results

    def start(stage: PlannedStage) -> TaskJob:
        run = run_stage.with_options(name=stage.name, task_run_name=stage.name, timeout_seconds=timeout_s)
        log.info("stage %s started", stage.name)
        return TaskJob(run.submit(stage.name, repo_dir, env, force))

    def on_end(stage: PlannedStage, ended: Ended) -> Ended:
        results[stage.name] = ended.status
        log.info("stage %s %s", stage.name, ended.status)
        return ended

    ended = schedule.run_dag(stages, start, capacity={"jobs": jobs}, poll_s=0.5, on_end=on_end)
    failure = next((e.detail for e in ended.values() if e.status == "failed"), None)
    if failure is not None:
        raise failure
    return results
