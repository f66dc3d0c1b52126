"""How long the pipeline takes to refuse what it refuses: the seconds the tests used to bound (a bound on a loaded
host is a flake; the tests check what ran and what was written instead).

Side by side in one run, each the median of `--repeat` tries, printed as a table:
- a bad params value (`grid.seeds: [-1]`) refused by `dvc repro`, `rcgrpo plan` and `rcgrpo params --profile` in a
  clone of HEAD with its first stage run (tests/test_params_check.py);
- a tracked command against an MLflow server nobody listens on (tests/test_stops.py);
- BFCL's AST decoder on each bomb it refuses, in CPU seconds (tests/test_ast_check.py).

    python bench/refusals.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BOMBS = ("f(x=9 ** 9 ** 9)", "f(x=1 << 10 ** 9)", "f(x=[0] * 10 ** 9)", "f(x=(2 ** 4000) * (2 ** 4000))",
         "[" + ", ".join(["f(x=[1, 2])"] * 3000) + "]")


def timed(cmd: list[str], cwd: Path, env: dict, repeat: int) -> tuple[float, int]:
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs), done.returncode


def params_refusals(root: Path, repeat: int) -> list[tuple[str, float, int]]:
    repo = root / "repo"
    subprocess.run(["git", "clone", "-q", str(REPO), str(repo)], check=True)  # HEAD: commit first
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_", "RCGRPO_"))}
    env.update({"PATH": f"{BIN}{os.pathsep}{env['PATH']}", "MLFLOW_TRACKING_URI": f"sqlite:///{root}/mlflow.db"})
    subprocess.run([str(BIN / "dvc"), "repro", "prepare_data"], cwd=repo, env=env, check=True, capture_output=True)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["grid"]["seeds"] = [-1]
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (repo / "configs" / "bad.yaml").write_text("grid:\n  seeds: [-1]\n")
    rows = []
    for label, cmd in (("dvc repro (grid.seeds: [-1])", [str(BIN / "dvc"), "repro"]),
                       ("rcgrpo plan", [str(BIN / "rcgrpo"), "plan", "--out", "plan.json"])):
        rows.append((label, *timed(cmd, repo, env, repeat)))
    subprocess.run(["git", "checkout", "-q", "--", "params.yaml"], cwd=repo, check=False)
    rows.append(("rcgrpo params --profile bad", *timed([str(BIN / "rcgrpo"), "params", "--profile", "bad"], repo, env,
                                                        repeat)))
    return rows


def tracking_refusal(repeat: int) -> tuple[str, float, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}"}
    return ("rcgrpo report, MLflow unreachable", *timed([str(BIN / "rcgrpo"), "report", "--x"], REPO, env, repeat))


def ast_bombs(repeat: int) -> list[tuple[str, float, int]]:
    from rcgrpo_tasks.env.ast_decode import AstDecodeError, decode_prompt

    rows = []
    for text in BOMBS:
        runs = []
        for _ in range(repeat):
            t0 = time.process_time()
            try:
                decode_prompt(text)
            except AstDecodeError:
                pass
            runs.append(time.process_time() - t0)
        rows.append((f"AST bomb {text[:24]!r} (CPU s)", statistics.median(runs), 0))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [*params_refusals(Path(tmp), a.repeat), tracking_refusal(a.repeat), *ast_bombs(a.repeat)]
    print(f"{'what is refused':<44} {'seconds':>8} {'exit':>5}")
    for label, seconds, rc in rows:
        print(f"{label:<44} {seconds:>8.2f} {rc:>5}")


if __name__ == "__main__":
    main()
