"""Grid workers on the local stack (`rcgrpo stack up --grid-workers N --git-url URL`): N Prefect process workers of
the CPU pool, each in a directory of its own under `<state>/workers/` (its clone of URL, its DVC cache, and its
HOME, TMPDIR, cache and Prefect home there too, so nothing it writes lands elsewhere), each one stage at a time
(`--limit 1`, one CPU thread), the pool's own Prefect concurrency limit N, and the stage deployment
`stage/cpu` (prefect.yaml) made from this project's code with URL as its repository. What the parent flow
across pools (`--dispatch pools`) needs on one machine: workers that share nothing but git, the stack's S3
remote and its servers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rcgrpo_tasks.ops.stack_state import REPO_ROOT, Stack, StackError, spawn

PREFIX = "grid-"
"""Grid workers' names in stack.json (`grid-w1`, ...); `stack down` stops them first."""
QUERY_S = "2"
"""How often a grid worker asks for runs (Prefect's default, 10 s, would add up to 10 s to every stage)."""


def names(n: int) -> list[str]:
    return [f"{PREFIX}w{i}" for i in range(1, n + 1)]


def worker_env(stack: Stack, base: dict[str, str], where: Path, code_dir: Path) -> dict[str, str]:
    """A grid worker's environment: `base` (the client env, the S3 keys from the caller's environment), its
    own directory for everything a process writes, this project's code for the stage flow."""
    env = {**base, "RCGRPO_WORKER_DIR": str(where), "RCGRPO_CODE_DIR": str(code_dir), "HOME": str(where),
           "TMPDIR": str(where / "tmp"), "XDG_CACHE_HOME": str(where / "cache"), "PREFECT_HOME": str(where / "prefect"),
           "PREFECT_WORKER_QUERY_SECONDS": QUERY_S, "PREFECT_WORKER_PREFETCH_SECONDS": QUERY_S,
           "PYTHONDONTWRITEBYTECODE": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def prefect(env: dict[str, str], *args: str, cwd: Path) -> None:
    cmd = [str(Path(sys.executable).parent / "prefect"), *args]
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise StackError(f"prefect {' '.join(args[:3])} failed: {(done.stdout + done.stderr).strip()[-800:]}")


def deploy(stack: Stack, base: dict[str, str], n: int, git_url: str, code_dir: Path = REPO_ROOT) -> None:
    """The CPU pool with its concurrency limit `n`, and the stage deployment made from `code_dir`'s prefect.yaml
    with `git_url` as the repository workers fetch commits from."""
    pool = stack.services["work_pools"]["cpu"]
    env = {**base, "RCGRPO_GIT_URL": git_url}
    prefect(env, "work-pool", "create", pool, "--type", "process", "--overwrite", cwd=code_dir)
    prefect(env, "work-pool", "set-concurrency-limit", pool, str(n), cwd=code_dir)
    prefect(env, "--no-prompt", "deploy", "--name", "cpu", cwd=code_dir)


def start(stack: Stack, name: str, base: dict[str, str], code_dir: Path = REPO_ROOT) -> dict:
    """Start grid worker `name` in `<state>/workers/<name>` (kept across restarts: its clone and DVC cache)."""
    where = stack.state_dir / "workers" / name.removeprefix(PREFIX)
    (where / "tmp").mkdir(parents=True, exist_ok=True)
    env = worker_env(stack, base, where, code_dir)
    cmd = [str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool",
           stack.services["work_pools"]["cpu"], "--name", name.removeprefix(PREFIX), "--limit", "1"]
    return spawn(stack, name, cmd, env, cwd=where)


def base_env(stack: Stack) -> dict[str, str]:
    """What every grid worker and the deployment step start from: this environment, the stack's client env."""
    return {**os.environ, **stack.client_env(), "PREFECT_HOME": str(stack.state_dir / "prefect")}
