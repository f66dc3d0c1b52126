"""Prefect 3 flow `rcgrpo`: the DVC pipeline as Prefect tasks under one MLflow parent run.

What it does, in order:
1. preflight: the MLflow tracking store must answer (clear error before any training; retried briefly,
   since a server that is just starting is a transient failure);
2. with `profile`, materializes it into params.yaml (as `rcgrpo params --profile` does), so DVC reruns
   exactly the stages whose sections changed;
3. opens an MLflow parent run (params: flow parameters + the merged params file; tags: git commit) and
   hands its id to every stage through `RCGRPO_PARENT_RUN_ID`, so each stage's own `tracking.stage_run`
   becomes a nested child run;
4. discovers the stages from `dvc.yaml` with DVC itself (foreach/matrix expanded, topological order), so
   stages that land later are picked up without touching this file; `stages=[...]` selects some (a
   foreach group by its prefix, e.g. `sft` = every `sft@...`), their upstream stages are included;
5. pull = `dvc fetch` (network only: retried with backoff, S3 is the transient part) + `dvc checkout`
   (local, best effort) so a fresh worker starts from the remote;
6. one Prefect task per stage: `dvc repro --single-item <stage>` (never retried: training is
   deterministic, a retry would only fail again slower); a failing stage fails the flow with the
   stage's own error output; unchanged stages are skipped by DVC (a re-run redoes nothing finished);
7. `dvc push` (retried with backoff) so other workers and `dvc pull` elsewhere get the outputs;
8. records `dvc.lock` hashes on the parent run and closes it FINISHED (FAILED on any error).

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
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from prefect import flow, get_run_logger, task
from prefect.runtime import flow_run, task_run

BIN = Path(sys.executable).parent
SKIP_MARKERS = ("didn't change, skipping", "is cached - skipping run")


class StageFailed(RuntimeError):
    """A DVC stage exited non-zero; the message carries the tail of its output."""


class TransferFailed(RuntimeError):
    """`dvc pull` / `dvc push` failed (after the retries)."""


# -- pure helpers (unit-tested without Prefect) ---------------------------------------------------------

def discover_stages(repo_dir: str | Path) -> dict[str, list[str]]:
    """{stage: [upstream stages]} for every dvc.yaml stage, foreach/matrix expanded, in topological order."""
    import networkx as nx
    from dvc.repo import Repo
    from dvc.stage import PipelineStage

    with Repo(str(repo_dir)) as repo:
        graph = repo.index.graph  # edges point from a stage to the stages it depends on
        order = {s: i for i, s in enumerate(repo.index.stages)}
        stages = [s for s in nx.lexicographical_topological_sort(graph.reverse(), key=lambda s: order[s])
                  if isinstance(s, PipelineStage)]
        def address(stage) -> str:  # like Stage.addressing, but relative to the repo, not to the cwd
            rel = os.path.relpath(stage.dvcfile.path, repo.root_dir)
            return stage.name if rel == "dvc.yaml" else f"{rel}:{stage.name}"

        return {address(s): [address(d) for d in graph.successors(s) if isinstance(d, PipelineStage)]
                for s in stages}


def plan(stages: dict[str, list[str]], selected: list[str] | None) -> list[str]:
    """Stages to run, in order: `selected` (exact names or foreach prefixes) plus everything upstream."""
    if not selected:
        return list(stages)
    wanted: set[str] = set()
    for name in selected:
        hits = [s for s in stages if s == name or s.startswith(f"{name}@")]
        if not hits:
            raise ValueError(f"unknown stage {name!r}; dvc.yaml has: {', '.join(stages)}")
        wanted.update(hits)
    todo = list(wanted)
    while todo:
        for dep in stages[todo.pop()]:
            if dep not in wanted:
                wanted.add(dep)
                todo.append(dep)
    return [s for s in stages if s in wanted]


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


def stream(cmd: list[str], cwd: str | Path, env: dict[str, str], log, tail_lines: int = 40) -> tuple[int, str]:
    """Run `cmd`, forwarding each output line to `log`; returns (exit code, last lines of output)."""
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, text=True, errors="replace") as proc:
        for line in proc.stdout:
            line = line.rstrip()
            tail.append(line)
            log(line)
    return proc.returncode, "\n".join(tail)


def stage_env(parent_run_id: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("MLFLOW_RUN_ID", None)  # would make the stage resume that run instead of nesting
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # stage cmds call `rcgrpo` from this venv
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TQDM_MININTERVAL", "15")  # progress bars become log lines: one per 15 s is plenty
    if parent_run_id:
        env["RCGRPO_PARENT_RUN_ID"] = parent_run_id
    return env


def read_repo_params(repo_dir: str | Path) -> dict:
    from rcgrpo_tasks.config import read_params

    return read_params(Path(repo_dir) / "params.yaml")


# -- tasks ----------------------------------------------------------------------------------------------

@task(name="check-tracking", retries=2, retry_delay_seconds=[2, 5])
def check_tracking() -> str:
    from rcgrpo_tasks import tracking

    return tracking.check_tracking()


@task(name="open-parent-run", retries=2, retry_delay_seconds=[2, 5])
def open_parent_run(params: dict, tags: dict) -> str:
    from rcgrpo_tasks import tracking

    return tracking.open_run("rcgrpo-flow", params=params, tags=tags)


@task(name="close-parent-run", retries=2, retry_delay_seconds=[2, 5])
def close_parent_run(run_id: str, status: str, tags: dict) -> None:
    from rcgrpo_tasks import tracking

    tracking.close_run(run_id, status=status, tags=tags)


@task(name="apply-profile")
def apply_profile(repo_dir: str, profile: str) -> None:
    """Materialize the profile into params.yaml (`rcgrpo params --profile`), so DVC sees exactly which
    sections changed and reruns those stages. `git checkout params.yaml` returns to the default."""
    from rcgrpo_tasks.config import apply_profile as materialize

    params = Path(repo_dir) / "params.yaml"
    materialize(params, profile, params)
    get_run_logger().warning("profile %r written into %s", profile, params)


@task(name="dvc-transfer")
def dvc_transfer(verb: str, repo_dir: str, targets: list[str], remote: str, retries: int) -> None:
    """`dvc fetch` / `dvc push` of the planned stages' outputs and run cache: network only, so a failure
    here is transient (S3 down, timeouts) and the task is retried with backoff."""
    log = get_run_logger()
    cmd = [str(BIN / "dvc"), verb, "--run-cache", "--remote", remote, *targets]
    attempt = task_run.run_count or 1
    log.info("dvc %s (attempt %d/%d): %s", verb, attempt, retries + 1, " ".join(cmd[1:]))
    rc, tail = stream(cmd, repo_dir, stage_env(None), log.info, tail_lines=4)
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
    rc, tail = stream(cmd, repo_dir, stage_env(None), log.info, tail_lines=6)
    if rc != 0:
        log.warning("dvc checkout incomplete (exit %d); the stages will rerun what is missing:\n%s", rc, tail)
    return rc == 0


@task(name="dvc-stage")
def run_stage(stage: str, repo_dir: str, env: dict[str, str], force: bool) -> str:
    """`dvc repro --single-item <stage>`; returns 'ran' or 'skipped'. Raises StageFailed with its output."""
    log = get_run_logger()
    cmd = [str(BIN / "dvc"), "repro", "--single-item", *(["--force"] if force else []), stage]
    log.info("$ %s", " ".join(cmd[1:]))
    rc, tail = stream(cmd, repo_dir, env, log.info, tail_lines=60)
    if rc != 0:
        raise StageFailed(f"stage {stage!r} failed (exit {rc}):\n{tail}")
    return "skipped" if any(m in tail for m in SKIP_MARKERS) and "Running stage" not in tail else "ran"


# -- the flow -------------------------------------------------------------------------------------------

@flow(name="rcgrpo", log_prints=True)
def rcgrpo(
    profile: str | None = None,
    stages: list[str] | None = None,
    force: bool = False,
    push: bool = True,
    pull: bool = True,
    repo_dir: str = ".",
    transfer_retries: int = 3,
    retry_delay_s: float = 10.0,
) -> dict[str, Any]:
    """Run the DVC pipeline (or `stages` and their upstream) as Prefect tasks under one MLflow parent run.

    profile: overlay name in configs/ (e.g. `smoke`, `paper`) or a path to an overlay YAML; it is
        materialized into params.yaml (like `rcgrpo params --profile`) before any stage runs.
    stages: stage names or foreach prefixes; default all. force: rerun even unchanged stages.
    push/pull: sync with the default DVC remote (skipped with a warning when none is configured).
    """
    log = get_run_logger()
    repo = str(Path(repo_dir).resolve())
    uri = check_tracking()
    if profile:
        apply_profile(repo, profile)
    order = plan(discover_stages(repo), stages)
    log.info("tracking %s; stages: %s", uri, ", ".join(order))
    from rcgrpo_tasks.tracking import git_commit

    params = {"flow": {"profile": profile, "stages": stages, "force": force, "push": push, "pull": pull},
              "params": read_repo_params(repo)}
    parent = open_parent_run(params, {"git.commit": git_commit(), "prefect.flow_run_id": flow_run.id or "",
                                      "rcgrpo.plan": ",".join(order)})
    remote = ensure_remote(repo)
    if remote is None and (push or pull):
        log.warning("no default DVC remote configured: outputs stay in this workspace (no pull/push)")
    transfer = dvc_transfer.with_options(
        retries=transfer_retries, retry_delay_seconds=[retry_delay_s * 2**i for i in range(transfer_retries)])
    results: dict[str, str] = {}
    status, error = "FAILED", None
    try:
        if pull and remote:
            transfer("fetch", repo, order, remote, transfer_retries)
            dvc_checkout(repo, order)
        env = stage_env(parent)
        for stage in order:
            results[stage] = run_stage.with_options(name=stage, task_run_name=stage)(stage, repo, env, force)
        if push and remote:
            transfer("push", repo, order, remote, transfer_retries)
        status = "FINISHED"
    except BaseException as exc:
        error = exc
        raise
    finally:
        tags = {**lock_hashes(repo), "rcgrpo.results": json.dumps(results)}
        if error is not None:
            tags["rcgrpo.error"] = f"{type(error).__name__}: {str(error)[:500]}"
        with contextlib.suppress(Exception) if error is not None else contextlib.nullcontext():
            close_parent_run(parent, status, tags)
    log.info("done: %s (parent run %s)", results, parent)
    return {"parent_run_id": parent, "stages": results}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile")
    ap.add_argument("--stages", nargs="*")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--no-push", action="store_true")
    ap.add_argument("--no-pull", action="store_true")
    ap.add_argument("--repo-dir", default=".")
    ap.add_argument("--transfer-retries", type=int, default=3)
    ap.add_argument("--retry-delay-s", type=float, default=10.0)
    a = ap.parse_args(argv)
    result = rcgrpo(profile=a.profile, stages=a.stages, force=a.force, push=not a.no_push,
                    pull=not a.no_pull, repo_dir=a.repo_dir, transfer_retries=a.transfer_retries,
                    retry_delay_s=a.retry_delay_s)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
