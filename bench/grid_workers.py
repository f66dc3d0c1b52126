"""The grid across work pools on the local stack: the same stages on two workers, then on one, side by side in one
run; prints the wall times and their ratio (the goal: two workers at most 0.6x one), which stage ran where and
when, and what the fan-out itself costs a stage (checkout, pull, push, dispatch: the one-worker run's wall time
less its stages' own `dvc repro` seconds, per stage).

The project at HEAD (commit first) is cloned bare as the repository workers fetch from; `rcgrpo stack up
--grid-workers 2` starts SeaweedFS, MLflow, Prefect and two workers of `rcgrpo-cpu`, each one stage at a time
on one CPU thread, in its own directory. First the whole grid (`--stages`, both workers: its timeline is
printed too); then the timed pair, each in a fresh parent checkout with the first's dvc.lock, under a profile
layer that moves `rl.seed` (so what reruns is the root check and the RL cells, the independent part: 1 then 2
added to the seed, never the same runs twice; `--rl-steps` sets their length): two workers (the pool's limit 2),
then one (the other stopped, the limit 1).

    python bench/grid_workers.py --stages rl_rctp --profile smoke [--model-source DIR] [--rl-steps N] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO))


def stage_runs(api: str, since) -> list:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["stage"])), limit=200)
    return sorted((r for r in runs if r.state and r.state.name == "Completed" and r.start_time >= since),
                  key=lambda r: r.start_time)


def parent(root: Path, name: str, origin: Path, stack, env: dict, args: list[str], lock: Path | None = None) -> float:
    """Wall seconds of a parent run across the pools in a fresh clone `root/name` (with `lock` as its dvc.lock)."""
    from rcgrpo_tasks.ops import stack as st

    repo = root / name
    subprocess.run(["git", "clone", "-q", str(origin), str(repo)], check=True)
    st.configure_dvc(stack, repo)
    if lock is not None:
        (repo / "dvc.lock").write_text(lock.read_text())
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, str(REPO / "flows" / "rcgrpo_flow.py"), "--dispatch", "pools", *args],
                          cwd=repo, env={**env, "PREFECT_HOME": str(root / f"{name}-home"), "RCGRPO_DVC_REMOTE_URL": ""},
                          capture_output=True, text=True)
    wall = time.monotonic() - t0
    if done.returncode != 0:
        sys.exit(f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return wall


def seed_layer(root: Path, profile: str, plus: int, rl_steps: int | None) -> str:
    """`profile` with a layer moving `rl.seed` by `plus` (and setting `rl.max_steps` to `rl_steps` if given): only
    the root check and the RL cells change."""
    import yaml

    base = yaml.safe_load((REPO / "params.yaml").read_text())["rl"]["seed"]
    steps = f"  max_steps: {rl_steps}\n" if rl_steps else ""
    (root / f"seed{plus}.yaml").write_text(f"rl:\n  seed: {base + plus}\n{steps}")
    return f"{profile}+{root / f'seed{plus}.yaml'}"


def table(runs: list, t0) -> tuple[str, float]:
    lines = [f"{'stage':<28} {'worker':<7} {'start':>7} {'end':>7} {'repro':>7} {'checkout':>8} {'pull':>6} {'push':>6}"]
    repro = 0.0
    for r in runs:
        steps = r.state.result()["steps"]
        worker = next((t.split(":", 1)[1] for t in r.tags if t.startswith("worker:")), "?")
        repro += steps["stage_s"]
        lines.append(f"{r.name:<28} {worker:<7} {(r.start_time - t0).total_seconds():>7.1f} "
                     f"{(r.end_time - t0).total_seconds():>7.1f} {steps['stage_s']:>7.1f} {steps['checkout_s']:>8.1f} "
                     f"{steps['pull_s']:>6.1f} {steps['push_s']:>6.1f}")
    return "\n".join(lines), repro


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", nargs="+", default=["rl_rctp"])
    ap.add_argument("--profile", default="smoke")
    ap.add_argument("--model-source", help="prepare_model.source for the runs (a model folder; default: the "
                                           "profile's own)")
    ap.add_argument("--rl-steps", type=int, help="rl.max_steps of the timed pair's RL cells (default: the "
                                                   "profile's; the smoke's 2 steps make a cell mostly start-up)")
    ap.add_argument("--keep", type=Path, help="run in this folder and leave it (default: a temporary one)")
    a = ap.parse_args()
    from datetime import datetime, timezone

    from rcgrpo_tasks.ops import stack as st
    from rcgrpo_tasks.ops import stack_state
    from rcgrpo_tasks.ops.stack_grid import PREFIX

    root = a.keep or Path(tempfile.mkdtemp(prefix="grid-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    origin = root / "origin.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(REPO), str(origin)], check=True)
    profile = a.profile
    if a.model_source:
        (root / "model.yaml").write_text(f"prepare_model:\n  source: {a.model_source}\n")
        profile += f"+{root / 'model.yaml'}"
    os.environ.update({"AWS_ACCESS_KEY_ID": f"bench{secrets.token_hex(4)}",
                       "AWS_SECRET_ACCESS_KEY": secrets.token_hex(12), "OMP_NUM_THREADS": "1"})
    stack = stack_state.make_stack(root / "state", port_base=31200)
    try:
        client_env = st.up(stack, grid_workers=2, git_url=str(origin))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_", "RCGRPO_"))}
        env.update({**client_env, "PATH": f"{BIN}{os.pathsep}{env['PATH']}"})
        args = ["--stages", *a.stages, "--retry-delay-s", "2"]
        api = client_env["PREFECT_API_URL"]
        since = datetime.now(timezone.utc)
        grid = parent(root, "grid", origin, stack, env, ["--profile", profile, *args])
        runs_grid = stage_runs(api, since)
        since = datetime.now(timezone.utc)
        two = parent(root, "two", origin, stack, env, ["--profile", seed_layer(root, profile, 1, a.rl_steps), *args],
                     lock=root / "grid" / "dvc.lock")
        runs_two = stage_runs(api, since)
        st.down(stack, only=[f"{PREFIX}w2"])
        subprocess.run([str(BIN / "prefect"), "work-pool", "set-concurrency-limit", "rcgrpo-cpu", "1"],
                       env={**env, "PREFECT_HOME": str(root / "state" / "prefect")}, check=True, capture_output=True)
        since = datetime.now(timezone.utc)
        one = parent(root, "one", origin, stack, env, ["--profile", seed_layer(root, profile, 2, a.rl_steps), *args],
                     lock=root / "grid" / "dvc.lock")
        runs_one = stage_runs(api, since)
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: api}):  # the results come back through the server
            text_grid, _ = table(runs_grid, runs_grid[0].start_time)
            text_two, _ = table(runs_two, runs_two[0].start_time)
            text_one, repro_one = table(runs_one, runs_one[0].start_time)
    finally:
        st.down(stack)
    n = len(runs_one)
    print(f"the grid ({len(runs_grid)} stages, {a.stages}, profile {profile}) on two workers: {grid:.1f} s\n{text_grid}")
    steps = a.rl_steps or "the profile's"
    print(f"\nthe RL cells again (rl.seed moved, rl.max_steps {steps}; {n} stages): two workers {two:.1f} s, "
          f"one worker {one:.1f} s, ratio {two / one:.2f}")
    print(f"fan-out cost per stage (one worker: wall less the stages' own dvc repro seconds, per stage): "
          f"{(one - repro_one) / n:.1f} s")
    print("\ntwo workers, seconds from the first stage run's start:\n" + text_two)
    print("\none worker:\n" + text_one)
    (root / "bench.json").write_text(json.dumps({"grid_s": grid, "two_s": two, "one_s": one, "stages": n}))


if __name__ == "__main__":
    main()
