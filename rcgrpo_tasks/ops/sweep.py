"""Running a dev sweep: RL's levers tried side by side through the stages' own commands.

A sweep spec (YAML, e.g. `configs/sweeps/rl-dev.yaml`):

    cells: [rctp-grpo, rctp-rc_grpo]      # init-algo, as dvc.yaml's rl matrix names them
    common: {evaluate: {margin: false}}   # overrides every candidate gets
    candidates:
      default: {}
      lr-1e-3: {rl: {learning_rate: 1.0e-3}}

Each candidate is a params file: the project's `params.yaml` (as the current profile left it) with `common`
and then its own overrides deep-merged, written to `<out>/<candidate>/params.yaml` and checked by the
stages themselves (unknown keys fail before anything runs). Per candidate and cell the `rl` stage's own
command trains from the pipeline's init model (`models/sft/<init>`, the pool in `data/policy`), and the
`evaluate` stage's command scores the result on the DEV side (`--side dev`); each init is evaluated on dev
once; then the `report` stage's command builds each candidate's tables. Judging them is
`evaluation.design` (the design table, pooled replicates). Nothing here reads the held-out side.

Why by hand: no library here sweeps DVC stage commands over params files (DVC's experiments queue runs
`dvc exp run`, which needs DVC and a git workspace a GPU host has not; Prefect would sequence the same
commands). The commands are the stages' own, so a sweep cannot train or score differently from the pipeline.
"""

from __future__ import annotations

import concurrent.futures as futures
import shlex
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from rcgrpo_tasks.ops.config import ConfigError, deep_merge, read_params
from rcgrpo_tasks.ops.outputs import atomic_path, write_json, write_text
from rcgrpo_tasks.ops.plan_runner import stage_env

INITS = ("sft", "rctp")
ALGOS = ("grpo", "rc_grpo", "dynamic")


@dataclass(frozen=True)
class Spec:
    cells: tuple[str, ...]
    common: dict
    candidates: dict[str, dict]


def read_spec(path: Path) -> Spec:
    """The spec file, checked: cells of the rl matrix, a mapping of candidates (names usable as folders)."""
    raw = read_params(path)
    cells = tuple(raw.get("cells") or ())
    bad = [c for c in cells if c.partition("-")[0] not in INITS or c.partition("-")[2] not in ALGOS]
    if not cells or bad:
        raise ConfigError(f"{path}: cells must be init-algo names of the rl matrix "
                          f"({INITS} x {ALGOS}), got {list(cells) or 'none'}")
    candidates = raw.get("candidates")
    if not isinstance(candidates, dict) or not candidates:
        raise ConfigError(f"{path}: candidates must be a non-empty mapping name -> params overrides")
    for name, over in candidates.items():
        if not str(name).replace("-", "").replace("_", "").replace(".", "").isalnum() or not isinstance(over or {}, dict):
            raise ConfigError(f"{path}: candidates.{name}: a folder-safe name and a mapping of overrides")
    unknown = sorted(set(raw) - {"cells", "common", "candidates"})
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown}; expected cells, common, candidates")
    return Spec(cells, raw.get("common") or {}, {str(k): v or {} for k, v in candidates.items()})


def candidate_params(base: dict, spec: Spec, name: str, where: Path) -> dict:
    """`base` with the spec's common overrides, then the candidate's; a section `base` lacks is an error."""
    for over, label in ((spec.common, "common"), (spec.candidates[name], f"candidates.{name}")):
        unknown = sorted(set(over) - set(base))
        if unknown:
            raise ConfigError(f"{where}: {label}: section(s) {unknown} are not in params.yaml")
    return deep_merge(deep_merge(base, spec.common), spec.candidates[name])


def cell_token(cell: str, high: str) -> str:
    """The reward goal a cell is evaluated under (as dvc.yaml's evaluate items): every RCTP-based or
    RC-GRPO model under the high token, the SFT model's GRPO cells under none."""
    init, _, algo = cell.partition("-")
    return high if init == "rctp" or algo == "rc_grpo" else ""


def rl_command(params: Path, cell: str, out: Path) -> list[str]:
    init, _, algo = cell.partition("-")
    return ["rcgrpo", "rl", "--params", str(params), "--init", init, "--algo", algo, "--model-dir", "models/base",
            "--adapter-dir", f"models/sft/{init}", "--entries", "data/entries.jsonl", "--split", "data/split.json",
            "--out", str(out / "model"), "--checkpoints", str(out / "checkpoints"), "--metrics",
            str(out / "rl.json"), "--plots", str(out / "rl.tsv"), "--policy", "data/policy/trajectories.jsonl"]


def evaluate_command(params: Path, model: str, adapter: str, token: str, out: Path, name: str) -> list[str]:
    return ["rcgrpo", "evaluate", "--params", str(params), "--side", "dev", "--model", model, "--adapter", adapter,
            "--reward-token", token, "--entries", "data/entries.jsonl", "--split", "data/split.json",
            "--out", str(out), "--name", name]


def report_command(folder: Path, cells: tuple[str, ...], inits: set[str], init_dir: Path) -> list[str]:
    evals = [f"--eval={i}={init_dir / i}" for i in sorted(inits)]
    evals += [f"--eval={c}={folder / c / 'eval'}" for c in cells]
    rls = [f"--rl={c}={folder / c / 'rl.json'}" for c in cells]
    return ["rcgrpo", "report", *evals, *rls, "--table", str(folder / "table.md"), "--json",
            str(folder / "report.json"), "--plot", str(folder / "accuracy.png"), "--no-track"]


def run_chain(commands: list[list[str]], log: Path, env: dict[str, str]) -> tuple[int, float]:
    """Run `commands` one after another (stop at the first failure), output to `log`; (exit code, seconds)."""
    start = time.monotonic()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as fh:
        for cmd in commands:
            fh.write(f"$ {shlex.join(cmd)}\n")
            fh.flush()
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
            if rc:
                return rc, time.monotonic() - start
    return 0, time.monotonic() - start


def write_sweep_bundle(out: Path, bundle: Path) -> Path:
    """`bundle` (.tar.gz): the sweep folder without its models and checkpoints (what a GPU host sends back),
    rewritten after every chain so a lease that ends mid-sweep still returns what finished."""
    heavy = {"model", "checkpoints"}
    # Chains still running stage their outputs in hidden temporary folders that vanish when published.
    members = [p for p in sorted(out.rglob("*")) if p.is_file() and not heavy & set(p.relative_to(out).parts)
               and not any(part.startswith(".") for part in p.relative_to(out).parts)]
    with atomic_path(bundle) as tmp, tarfile.open(tmp, "w:gz") as tar:
        for p in members:
            try:
                tar.add(p, arcname=str(Path(out.name) / p.relative_to(out)))
            except FileNotFoundError:  # replaced between the listing and the read: the next bundle has it
                continue
    return bundle


def run_sweep(spec_path: Path, out: Path, params_path: Path, jobs: int = 1, only: list[str] | None = None,
              bundle: Path | None = None) -> tuple[Spec, list[str]]:
    """Every candidate x cell (rl, then evaluate on dev), `jobs` chains side by side, each init evaluated on
    dev beside them; then each candidate's report. Returns the spec and the candidates run; `timings.json`
    records each chain's status and seconds."""
    spec = read_spec(spec_path)
    names = [n for n in spec.candidates if not only or n in only]
    base = read_params(params_path)
    merged = {name: candidate_params(base, spec, name, spec_path) for name in names}  # all checked before any write
    out.mkdir(parents=True, exist_ok=True)
    files = {name: out / name / "params.yaml" for name in names}
    for name in names:
        write_text(files[name], yaml.safe_dump(merged[name], sort_keys=False))
    inits = {c.partition("-")[0] for c in spec.cells}
    init_dir, init_params = out / "init", out / "init" / "params.yaml"
    write_text(init_params, yaml.safe_dump(deep_merge(base, spec.common), sort_keys=False))
    env = stage_env(jobs=jobs)
    high = base["label_rewards"]["tokens"][-1]  # the highest level, as label_rewards orders them
    timings: dict[str, dict] = {}

    def record(key: str, rc: int, secs: float) -> None:
        timings[key] = {"status": "ok" if rc == 0 else f"failed (exit {rc})", "seconds": round(secs, 1)}
        write_json(out / "timings.json", timings)
        if bundle is not None:
            write_sweep_bundle(out, bundle)

    chains = {f"init/{i}": [evaluate_command(init_params, "models/base", f"models/sft/{i}",
                                             high if i == "rctp" else "", init_dir / i, i)] for i in sorted(inits)}
    for name in names:
        for cell in spec.cells:
            folder = out / name / cell
            chains[f"{name}/{cell}"] = [rl_command(files[name], cell, folder),
                                        evaluate_command(files[name], str(folder / "model"), "", cell_token(cell, high),
                                                         folder / "eval", cell)]
    with futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        running = {pool.submit(run_chain, cmds, out / "logs" / f"{key.replace('/', '__')}.log", env): key
                   for key, cmds in chains.items()}
        for done in futures.as_completed(running):
            record(running[done], *done.result())
    for name in names:
        if all(timings.get(f"{name}/{c}", {}).get("status") == "ok" for c in spec.cells):
            rc, secs = run_chain([report_command(out / name, spec.cells, inits, init_dir)],
                                 out / "logs" / f"{name}__report.log", env)
            record(f"{name}/report", rc, secs)
    return spec, names
