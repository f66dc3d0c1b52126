"""Prefect 3 flow `rcgrpo`: the DVC pipeline as Prefect tasks under one MLflow parent run.

What it does, in order:
1. profile: ALWAYS applied first, from the pristine params (`rcgrpo params --profile`, ops.config): every
   deployment pins one (`default` = the committed params.yaml), so a smoke run can never leak its
   budgets into `full`; an unknown profile fails the run at once, listing the valid ones, params.yaml
   untouched;
2. preflight: the MLflow tracking store must answer (clear error before any training; retried briefly,
   since a server that is just starting is a transient failure);
3. opens an MLflow parent run `pipeline@<profile>` (params: flow parameters + the merged params file;
   tags: git commit, profile, params hash) and hands its id to every stage through
   `RCGRPO_PARENT_RUN_ID`, so each stage's own `tracking.stage_run` becomes a nested child run;
4. discovers the stages from `dvc.yaml` with DVC itself (foreach/matrix expanded, topological order), so
   stages that land later are picked up without touching this file; `stages=[...]` selects some (a
   foreach group by its prefix, e.g. `sft` = every `sft@...`), their upstream stages are included;
5. pull = `dvc fetch` (network only: retried with backoff, S3 is the transient part) + `dvc checkout`
   (local, best effort) so a fresh worker starts from the remote;
6. one Prefect task per stage: `dvc repro --single-item <stage>` in its OWN process group (never
   retried: training is deterministic, a retry would only fail again slower). A failing stage fails its
   task and the flow with the stage's name, exit code and the last lines of its stderr (in the task's
   failure, the flow run's logs and `prefect deployment run ... --watch`); a cancelled, timed-out
   (`stage_timeout_s`) or SIGTERMed task stops the whole group (dvc and the stage; SIGKILL after a grace
   period), and the stage's MLflow run ends KILLED; unchanged stages are skipped by DVC;
7. `dvc push` (retried with backoff) so other workers and `dvc pull` elsewhere get the outputs;
8. records `dvc.lock` hashes on the parent run, ends any child run still RUNNING as KILLED (its stage
   process is gone), and closes the parent FINISHED (FAILED on any error, with the error as a tag).

Run locally: `python flows/rcgrpo_flow.py --profile smoke` (or `prefect deployment run rcgrpo/full`
against a server + worker, see docs/operations.md). Credentials only come from the environment; they are
never flow parameters, so they never reach Prefect's database, logs or MLflow params.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import yaml
from prefect import flow, get_run_logger, task
from prefect.runtime import flow_run, task_run

from rcgrpo_tasks.ops import config, pipeline, profiles, stops, tracking, tracking_log, tracking_store

BIN = Path(sys.executable).parent
SKIP_MARKERS = ("didn't change, skipping", "is cached - skipping run")


class StageFailed(RuntimeError):
    """A DVC stage exited non-zero; the message carries the tail of its output."""


class TransferFailed(RuntimeError):
    """`dvc pull` / `dvc push` failed (after the retries)."""


# -- pure helpers (unit-tested without Prefect) ---------------------------------------------------------

def discover_stages(repo_dir: str | Path) -> dict[str, list[str]]:
    """{stage: [upstream stages]} for every dvc.yaml stage, foreach/matrix expanded, in topological order
    (DVC resolves it: `ops.pipeline.dvc_stages`)."""
    return {s.name: list(s.upstream) for s in pipeline.dvc_stages(repo_dir, with_status=False, main_only=False)}


plan = pipeline.select
"""Stages to run, in order: `selected` (exact names or foreach prefixes) plus everything upstream."""


def lock_hashes(repo_dir: str | Path) -> dict[str, str]:
    """Short sha256 of dvc.lock and of each stage's lock entry (deps, params, outs hashes)."""
    path = Path(repo_dir) / "dvc.lock"
    if not path.is_file():
        return {}
    text = path.read_text()
    out = {"dvc.lock.sha256": hashlib.sha256(text.encode()).hexdigest()[:16]}
    for name, entry in ((yaml.safe_load(text) or {}).get("stages") or {}).items():
        blob = json.dumps(entry, sort_keys=True, default=str).encode()
        out[f"dvc.lock.{name}"] = hashlib.sha256(blob).hexdigest()[:16]
    return out


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


def stage_env(parent_run_id: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("MLFLOW_RUN_ID", None)  # would make the stage resume that run instead of nesting
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # stage cmds call `rcgrpo` from this venv
    env["PYTHONUNBUFFERED"] = "1"
    # DVC runs a stage as `$SHELL -c CMD`: bash execs the command, so the stage's parent is dvc and dies
    # with it (ops.stops.die_with_parent); with sh (dash) in between it relies on the slower watch thread.
    env["SHELL"] = shutil.which("bash") or env.get("SHELL", "/bin/sh")
    env.setdefault("TQDM_MININTERVAL", "15")  # progress bars become log lines: one per 15 s is plenty
    if parent_run_id:
        env["RCGRPO_PARENT_RUN_ID"] = parent_run_id
    return env


def read_repo_params(repo_dir: str | Path) -> dict:
    return config.read_params(Path(repo_dir) / "params.yaml")


# -- tasks ----------------------------------------------------------------------------------------------

@task(name="check-tracking", retries=2, retry_delay_seconds=[2, 5])
def check_tracking() -> str:
    return tracking_store.check_tracking()


@task(name="open-parent-run", retries=2, retry_delay_seconds=[2, 5])
def open_parent_run(name: str, params: dict, tags: dict) -> str:
    return tracking.open_run(name, params=params, tags=tags)


@task(name="close-parent-run", retries=2, retry_delay_seconds=[2, 5])
def close_parent_run(run_id: str, status: str, tags: dict) -> list[str]:
    """Close the parent; first end KILLED any child still RUNNING (every stage process has exited by now,
    so such a run belongs to a stage that was killed or lost its tracking server). Returns those ids."""
    stale = tracking.reap_orphans(parent_run_id=run_id)
    if stale:
        get_run_logger().warning("ended %d stage run(s) left RUNNING as KILLED: %s", len(stale), ", ".join(stale))
    tracking.close_run(run_id, status=status, tags=tags)
    return stale


@task(name="apply-profile")
def apply_profile(repo_dir: str, profile: str) -> dict[str, str]:
    """Write params.yaml = pristine params + `profile` (`rcgrpo params --profile`), so DVC sees exactly
    which sections changed and reruns those stages. Returns what the parent run records."""
    params = Path(repo_dir) / "params.yaml"
    merged = profiles.apply_profile(None, profile, params)
    digest = tracking_log.params_hash(merged)
    get_run_logger().info("profile %r applied to %s from the pristine params (params sha256 %s)",
                          profile, params, digest)
    return {"rcgrpo.profile": profile, "rcgrpo.params_sha256": digest}


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

    rc, out, err = stream(cmd, repo_dir, stage_env(None), forward, tail_lines=4)
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
    rc, out, err = stream(cmd, repo_dir, stage_env(None), log.info, tail_lines=6)
    tail = "\n".join(t for t in (out, err) if t)
    if rc != 0:
        log.warning("dvc checkout incomplete (exit %d); the stages will rerun what is missing:\n%s", rc, tail)
    return rc == 0


@task(name="dvc-stage")
def run_stage(stage: str, repo_dir: str, env: dict[str, str], force: bool) -> str:
    """`dvc repro --single-item <stage>` in its own process group; returns 'ran' or 'skipped'. Raises
    StageFailed with the stage's name, exit code and last stderr lines (also logged as an error)."""
    log = get_run_logger()
    cmd = [str(BIN / "dvc"), "repro", "--single-item", *(["--force"] if force else []), stage]
    log.info("$ %s", " ".join(cmd[1:]))
    rc, out, err = stream(cmd, repo_dir, env, log.info, tail_lines=60)
    if rc != 0:
        message = failure_message(stage, rc, err or out)
        log.error(message)
        raise StageFailed(message)
    text = f"{out}\n{err}"
    return "skipped" if any(m in text for m in SKIP_MARKERS) and "Running stage" not in text else "ran"


# -- the flow -------------------------------------------------------------------------------------------

@flow(name="rcgrpo", log_prints=True)
def rcgrpo(
    profile: str = "default",
    stages: list[str] | None = None,
    force: bool = False,
    push: bool = True,
    pull: bool = True,
    repo_dir: str = ".",
    transfer_retries: int = 3,
    retry_delay_s: float = 10.0,
    stage_timeout_s: float | None = None,
) -> dict[str, Any]:
    """Run the DVC pipeline (or `stages` and their upstream) as Prefect tasks under one MLflow parent run.

    profile: `default` (the committed params), an overlay name in configs/ (e.g. `smoke`, `paper`) or a
        path to an overlay YAML; applied to the pristine params before anything else, every run.
    stages: stage names or foreach prefixes; default all. force: rerun even unchanged stages.
    push/pull: sync with the default DVC remote (skipped with a warning when none is configured).
    stage_timeout_s: stop a stage (its whole process group) that runs longer; default: no limit.
    """
    log = get_run_logger()
    repo = str(Path(repo_dir).resolve())
    profile_tags = apply_profile(repo, profile)
    uri = check_tracking()
    # The main pipeline only: other dvc.yaml files (retrain/, written by the retrain flow) are not its stages.
    order = plan({k: v for k, v in discover_stages(repo).items() if ":" not in k}, stages)
    log.info("tracking %s; profile %s; stages: %s", uri, profile, ", ".join(order))
    if tracking_store.runs_table_url():
        log.info("MLflow runs table: %s", tracking_store.runs_table_url())
    params = {"flow": {"profile": profile, "stages": stages, "force": force, "push": push, "pull": pull},
              "params": read_repo_params(repo)}
    parent = open_parent_run(f"pipeline@{profile}", params, {
        "git.commit": tracking.git_commit(), "prefect.flow_run_id": flow_run.id or "", "rcgrpo.plan": ",".join(order),
        **profile_tags})
    remote = ensure_remote(repo)
    if remote is None and (push or pull):
        log.warning("no default DVC remote configured: outputs stay in this workspace (no pull/push)")
    transfer = dvc_transfer.with_options(
        retries=transfer_retries, retry_delay_seconds=[retry_delay_s * 2**i for i in range(transfer_retries)])
    results: dict[str, str] = {}
    status, error, current = "FAILED", None, None
    try:
        if pull and remote:
            transfer("fetch", repo, order, remote, transfer_retries)
            dvc_checkout(repo, order)
        env = stage_env(parent)
        for stage in order:
            current = stage
            task_ = run_stage.with_options(name=stage, task_run_name=stage, timeout_seconds=stage_timeout_s)
            results[stage] = task_(stage, repo, env, force)
        current = None
        if push and remote:
            transfer("push", repo, order, remote, transfer_retries)
        status = "FINISHED"
    except BaseException as exc:
        error = exc
        stopped = isinstance(exc, (KeyboardInterrupt, TimeoutError)) or type(exc).__name__ == "TerminationSignal"
        status = "KILLED" if stopped else "FAILED"
        raise
    finally:
        tags = {**lock_hashes(repo), "rcgrpo.results": json.dumps(results)}
        if error is not None:
            tags["rcgrpo.error"] = tracking.describe_error(error)[:4000]
            if current:
                tags["rcgrpo.failed_stage"] = current
        with contextlib.suppress(Exception) if error is not None else contextlib.nullcontext():
            close_parent_run(parent, status, tags)
    log.info("done: %s (parent run %s)", results, parent)
    return {"parent_run_id": parent, "stages": results, "profile": profile}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="default")
    ap.add_argument("--stages", nargs="*")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--no-push", action="store_true")
    ap.add_argument("--no-pull", action="store_true")
    ap.add_argument("--repo-dir", default=".")
    ap.add_argument("--transfer-retries", type=int, default=3)
    ap.add_argument("--retry-delay-s", type=float, default=10.0)
    ap.add_argument("--stage-timeout-s", type=float)
    a = ap.parse_args(argv)
    # SIGTERM/SIGHUP unwind like Ctrl-C: the stage group is stopped (`stream`) and the interpreter exits
    # normally, so Prefect's atexit hook stops the temporary API server it started (none is left behind).
    handlers = stops.raise_on_terminate()
    try:
        result = rcgrpo(profile=a.profile, stages=a.stages, force=a.force, push=not a.no_push,
                        pull=not a.no_pull, repo_dir=a.repo_dir, transfer_retries=a.transfer_retries,
                        retry_delay_s=a.retry_delay_s, stage_timeout_s=a.stage_timeout_s)
    except (config.ConfigError, tracking_store.TrackingError, StageFailed) as exc:  # already in the flow's logs
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2 if not isinstance(exc, StageFailed) else 1
    except stops.Terminated as exc:
        print(f"error: flow {exc}; stages stopped", file=sys.stderr)
        return 128 + exc.signum
    finally:
        stops.restore(handlers)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
