"""Running a dev sweep: RL's levers tried side by side through the pipeline's own stage commands.

A sweep spec (YAML, e.g. `configs/sweeps/rl-dev.yaml`):

    cells: [rctp-grpo, rctp-rc_grpo]      # RL cells of the pipeline (params `grid.rl`)
    seed: 0                               # the grid seed whose init models the cells start from (default 0)
    premise: false                        # also the controllability check on dev, before and after RL
    common: {evaluate: {margin: false}}   # overrides every candidate gets
    candidates:
      default: {}
      lr-1e-3: {rl: {learning_rate: 1.0e-3}}

Each candidate is a params file: the project's `params.yaml` (as the current profile left it) with `common`
and then its own overrides deep-merged, written to `<out>/<candidate>/params.yaml` and checked by the
stages themselves (unknown keys fail before anything runs). The sweep is a plan (`sweep_plan`) of
`pipeline.variant`s of the pipeline's planned stages (dvc.yaml as DVC resolves it: `rcgrpo plan`), each the
planned command with only these substitutions (`rl_args`, `evaluate_args`, `report_args`, `report_add`):

- per candidate and cell, the cell's rl stage (`rl_<init>@<seed>-<algo>`): `--params` the candidate's file; `--out`, `--checkpoints`,
  `--metrics`, `--plots` in `<out>/<candidate>/<cell>/` (`model`, `checkpoints`, `rl.json`, `rl.tsv`); it
  trains from the pipeline's init model and RL pool, as planned;
- then its evaluation (`evaluate_rl_<init>@<seed>-<algo>`): `--params` the candidate's file, `--model` that cell's model, `--out`
  `<out>/<candidate>/<cell>/eval`, and `--side dev` appended;
- each init once (`evaluate@sft`, `evaluate_rctp@<seed>`): `--params` `<out>/init/params.yaml` (params + `common`), `--out`
  `<out>/init/<init>`, `--side dev`;
- per candidate, `report`: `--params` the candidate's file; `--table`, `--json`, `--plot` in
  `<out>/<candidate>/` (`table.md`, `report.json`, `accuracy.png`); what it reads (`--eval-root`,
  `--rl-root`) and the inputs and plots the sweep does not make (`--controllability-root`, `--agree-root`,
  `--mechanism`, `--probe`) dropped; appended: `--eval` for each init and cell
  (the folders above), `--rl` for each cell (its `rl.json`), `--no-track`.

With `premise: true` (the premise before and after RL, on dev): the seed's RCTP check (`controllability@<seed>`,
as `init/controllability@rctp`: `--params` `<out>/init/params.yaml`, `--metrics` `<out>/init/ctl-rctp.json`,
`--trajectories` dropped) and, per candidate and RCTP-init cell, the check on its policy
(`controllability_rl_rctp@<seed>-<algo>`: `--params`, `--model-dir` that cell's model, `--metrics`
`<out>/<candidate>/<cell>/ctl.json`), both with `--side dev` appended.

Every other argument is the planned one. No sweep stage may read an output of a pipeline stage other than
those the cells start from (`check_reads`), and those must exist before it starts (`missing_inputs`). `plan_runner.run_plan` runs the plan (`jobs` side by
side, one log per stage, the bundle; `keep_going`: one candidate's failure does not stop the others);
`chain_timings` turns its record into `<out>/timings.json` (per chain: rl + evaluate). Judging them is
`sweep.design` (the design table, pooled replicates). Nothing here reads the held-out side.

Why no sweep library: DVC's experiments queue runs `dvc exp run`, which needs DVC and a git workspace a GPU
host has not; the plan runner already runs the pipeline's commands there.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from rcgrpo_tasks.ops.config import ConfigError, deep_merge, read_params
from rcgrpo_tasks.ops.names import ALGOS, INITS
from rcgrpo_tasks.ops.outputs import write_json, write_text
from rcgrpo_tasks.ops.pipeline import PlannedStage, Substitution, select, variant, write_plan
from rcgrpo_tasks.ops.plan_runner import RunRecord, StageRun, bundle_members, run_plan, write_bundle

RESERVED = frozenset({"init", "logs"})
"""Folders of `<out>` that are the sweep's own, not a candidate's."""


@dataclass(frozen=True)
class Spec:
    cells: tuple[str, ...]
    common: dict
    candidates: dict[str, dict]
    seed: int = 0
    """The grid seed whose RCTP model and pool the cells start from (its stages must be in the plan)."""
    premise: bool = False
    """Also the controllability check on dev: the seed's RCTP model, and every RCTP-init cell's policy."""

    def stages(self, cell: str) -> tuple[str, str]:
        """(rl stage, evaluate stage) of `cell` in the pipeline (dvc.yaml's names for the grid seed)."""
        init, _, algo = cell.partition("-")
        return f"rl_{init}@{self.seed}-{algo}", f"evaluate_rl_{init}@{self.seed}-{algo}"

    def init_stage(self, init: str) -> str:
        """The pipeline stage that evaluates an init: the shared SFT model's, or the seed's RCTP model's."""
        return "evaluate@sft" if init == "sft" else f"evaluate_rctp@{self.seed}"


def read_spec(path: Path, seed: int | None = None) -> Spec:
    """The spec file, checked: cells of the rl grid (init-algo), a mapping of candidates (names usable as folders);
    `seed` (a replicate on another grid seed) overrides the spec's."""
    raw = read_params(path)
    cells = tuple(raw.get("cells") or ())
    bad = [c for c in cells if c.partition("-")[0] not in INITS or c.partition("-")[2] not in ALGOS]
    if not cells or bad:
        raise ConfigError(f"{path}: cells must be init-algo names of the rl grid "
                          f"({INITS} x {ALGOS}), got {list(cells) or 'none'}")
    candidates = raw.get("candidates")
    if not isinstance(candidates, dict) or not candidates:
        raise ConfigError(f"{path}: candidates must be a non-empty mapping name -> params overrides")
    for name, over in candidates.items():
        if not str(name).replace("-", "").replace("_", "").replace(".", "").isalnum() or not isinstance(over or {}, dict):
            raise ConfigError(f"{path}: candidates.{name}: a folder-safe name and a mapping of overrides")
        if str(name) in RESERVED:
            raise ConfigError(f"{path}: candidates.{name}: the sweep's own folder; name it otherwise")
    unknown = sorted(set(raw) - {"cells", "common", "candidates", "seed", "premise"})
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown}; expected cells, common, candidates, seed, premise")
    seed = raw.get("seed", 0) if seed is None else seed
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"{path}: seed must be a grid seed (an integer >= 0), got {seed!r}")
    premise = raw.get("premise", False)
    if not isinstance(premise, bool):
        raise ConfigError(f"{path}: premise must be true or false, got {premise!r}")
    return Spec(cells, raw.get("common") or {}, {str(k): v or {} for k, v in candidates.items()}, seed, premise)


def candidate_params(base: dict, spec: Spec, name: str, where: Path) -> dict:
    """`base` with the spec's common overrides, then the candidate's; a section `base` lacks is an error."""
    for over, label in ((spec.common, "common"), (spec.candidates[name], f"candidates.{name}")):
        unknown = sorted(set(over) - set(base))
        if unknown:
            raise ConfigError(f"{where}: {label}: section(s) {unknown} are not in params.yaml")
    return deep_merge(deep_merge(base, spec.common), spec.candidates[name])


def rl_args(params: Path, folder: Path) -> dict[str, Substitution]:
    """The rl stage's substitutions: the candidate's params, every output in the cell's folder."""
    return {"--params": str(params), "--out": str(folder / "model"), "--checkpoints": str(folder / "checkpoints"),
            "--metrics": str(folder / "rl.json"), "--plots": str(folder / "rl.tsv")}


def evaluate_args(params: Path, out: Path, model: Path | None = None) -> dict[str, Substitution]:
    """The evaluate stage's substitutions: the params, the output folder and (a cell) the RL model."""
    return {"--params": str(params), "--out": str(out), **({"--model": str(model)} if model else {})}


def controllability_args(params: Path, metrics: Path, model: Path | None = None) -> dict[str, Substitution]:
    """The controllability stage's substitutions: the params, the metrics file, and (a cell) the RL model; the
    init's check drops its trajectories (the cross-stage check is the pipeline's)."""
    return {"--params": str(params), "--metrics": str(metrics),
            **({"--model-dir": str(model)} if model else {"--trajectories": None})}


def premise_stages(by_name: dict[str, PlannedStage], spec: Spec, name: str, out: Path, rl: dict[str, str]) -> list:
    """With `spec.premise`: the controllability check on dev of each RCTP-init cell's policy after its rl stage
    (`rl`: cell -> the sweep's rl stage name)."""
    folder = out / name
    return [variant(_planned(by_name, f"controllability_rl_rctp@{spec.seed}-{cell.partition('-')[2]}"),
                    f"{name}/controllability@{cell}",
                    controllability_args(folder / "params.yaml", folder / cell / "ctl.json", folder / cell / "model"),
                    EVALUATE_ADD, [rl[cell]]) for cell in spec.cells if spec.premise and cell.startswith("rctp-")]


EVALUATE_ADD = ("--side", "dev")
"""What the sweep appends to evaluate: it judges on the dev side, never on the held-out one."""


REPORT_DROPS = ("--eval-root", "--rl-root", "--controllability-root", "--agree-root", "--mechanism", "--probe",
                "--endpoints")
"""The report's options a sweep drops: what it reads of the pipeline (the sweep appends its own `--eval` and
`--rl`), the inputs the sweep does not make, the plots it does not need to judge."""


def report_args(params: Path, folder: Path) -> dict[str, Substitution]:
    """The report stage's substitutions: the candidate's params, the tables in its folder; what it reads
    (`--eval`, `--rl` or their roots) and the inputs and plots the sweep does not make dropped."""
    return {"--params": str(params), "--table": str(folder / "table.md"), "--json": str(folder / "report.json"),
            "--plot": str(folder / "accuracy.png"), **dict.fromkeys(REPORT_DROPS)}


def report_add(folder: Path, cells: tuple[str, ...], init_dir: Path, inits: list[str]) -> list[str]:
    """What the sweep appends to report: the inits' and the cells' dev evaluations and RL metrics from the
    sweep's folders as `--eval LABEL=DIR` / `--rl LABEL=JSON` (the report's explicit form), and `--no-track`
    (its tables are files of the sweep, not runs of the pipeline)."""
    evals = [f"{i}={init_dir / i}" for i in inits] + [f"{c}={folder / c / 'eval'}" for c in cells]
    rls = [f"{c}={folder / c / 'rl.json'}" for c in cells]
    return [*(a for e in evals for a in ("--eval", e)), *(a for r in rls for a in ("--rl", r)), "--no-track"]


def _planned(stages: dict[str, PlannedStage], name: str) -> PlannedStage:
    if name not in stages:
        raise ConfigError(f"the pipeline has no stage {name}: a sweep's cells are RL cells of the pipeline "
                          "(params `grid`, as the plan was made)")
    return stages[name]


def sweep_plan(planned: list[PlannedStage], spec: Spec, names: list[str], out: Path) -> list[PlannedStage]:
    """The sweep as a plan, in order: each init's evaluation on dev, then per candidate its cells (rl, then
    evaluate on dev) and its report; each stage a `pipeline.variant` of `planned` (the module docstring's
    substitutions), checked by `check_reads`."""
    by_name = {s.name: s for s in planned}
    inits = sorted({c.partition("-")[0] for c in spec.cells})
    init_dir = out / "init"
    plan = [variant(_planned(by_name, spec.init_stage(i)), f"init/evaluate@{i}",
                    evaluate_args(init_dir / "params.yaml", init_dir / i), EVALUATE_ADD) for i in inits]
    if spec.premise and "rctp" in inits:
        plan.append(variant(_planned(by_name, f"controllability@{spec.seed}"), "init/controllability@rctp",
                            controllability_args(init_dir / "params.yaml", init_dir / "ctl-rctp.json"), EVALUATE_ADD))
    for name in names:
        params, folder = out / name / "params.yaml", out / name
        for cell in spec.cells:
            rl_stage, eval_stage = spec.stages(cell)
            rl = variant(_planned(by_name, rl_stage), f"{name}/rl@{cell}", rl_args(params, folder / cell))
            plan += [rl, variant(_planned(by_name, eval_stage), f"{name}/evaluate@{cell}",
                                 evaluate_args(params, folder / cell / "eval", folder / cell / "model"),
                                 EVALUATE_ADD, [rl.name])]
        plan += premise_stages(by_name, spec, name, out, {c: f"{name}/rl@{c}" for c in spec.cells})
        ups = [f"init/evaluate@{i}" for i in inits] + [f"{name}/{k}@{c}" for c in spec.cells for k in ("rl", "evaluate")]
        plan.append(variant(_planned(by_name, "report"), f"{name}/report", report_args(params, folder),
                            report_add(folder, spec.cells, init_dir, inits), ups))
    check_reads(plan, planned, spec)
    return plan


def _overlap(a: str, b: str) -> bool:
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def _reads(plan: list[PlannedStage], planned: list[PlannedStage], spec: Spec) -> Iterator[tuple]:
    """(sweep stage, argument, the path it names, the pipeline stage that makes it, whether the cells start
    from that stage) for every argument of the sweep's commands that names a pipeline output."""
    rls = {spec.stages(c)[0] for c in spec.cells}
    given = set(select({s.name: s.upstream for s in planned}, sorted(rls))) - rls
    made = [(p, s.name) for s in planned for p in (*s.outs, *s.records)]
    for stage in plan:
        for token in shlex.split(stage.cmds[0]):
            for path in {token, token.partition("=")[2]} - {""}:
                yield from ((stage, token, path, who, who in given) for p, who in made if _overlap(path, p))


def check_reads(plan: list[PlannedStage], planned: list[PlannedStage], spec: Spec) -> None:
    """No argument of a sweep stage names an output of a pipeline stage the cells do not start from (the
    cells' own rl stages and everything after them): a sweep reads the pipeline's data and inits, and
    otherwise only what it made. An option dvc.yaml adds to a stage fails here until the sweep substitutes
    or drops it."""
    for stage, token, _, who, given in _reads(plan, planned, spec):
        if not given:
            raise ConfigError(f"sweep stage {stage.name}: {token!r} names what pipeline stage {who} makes, "
                              "which the sweep neither runs nor moves (sweep.run substitutes each stage's "
                              "options: add this one there)")


def missing_inputs(plan: list[PlannedStage], planned: list[PlannedStage], spec: Spec,
                   root: Path) -> dict[str, list[str]]:
    """{pipeline stage: the paths it makes that the sweep reads and `root` lacks}: what to run first."""
    missing: dict[str, list[str]] = {}
    for _, _, path, who, _ in _reads(plan, planned, spec):
        if not (root / path).exists() and path not in missing.get(who, []):
            missing.setdefault(who, []).append(path)
    return missing


def chain_timings(record: RunRecord, plan: list[PlannedStage]) -> dict[str, dict]:
    """{chain: {status, seconds}} as `sweep.design` reads `<out>/timings.json`: a chain is a cell's
    rl + evaluate (`<candidate>/<cell>`), an init's evaluation (`init/<init>`) or a report
    (`<candidate>/report`); `ok` when all its stages ran, else the first failure, stop or `not run`."""
    chains: dict[str, list[StageRun]] = {}
    for stage in plan:
        prefix, _, tail = stage.name.rpartition("/")
        chains.setdefault(f"{prefix}/{tail.partition('@')[2] or tail}", []).append(
            record.stages.get(stage.name, StageRun("not_run", "")))
    out = {}
    for key, runs in chains.items():
        failed = [r for r in runs if r.status == "failed"]
        status = (f"failed (exit {failed[0].rc})" if failed else "stopped" if any(r.status == "stopped" for r in runs)
                  else "ok" if all(r.status == "ran" for r in runs) else "not run")
        out[key] = {"status": status, "seconds": round(sum(r.wall_s for r in runs), 1)}
    return out


@dataclass(frozen=True)
class SweepRun:
    """A finished sweep: its spec, the candidates run, where, its plan and the plan runner's record."""

    spec: Spec
    names: list[str]
    out: Path
    root: Path
    plan: list[PlannedStage]
    record: RunRecord


def sweep_files(out: Path, names: list[str]) -> list[Path]:
    """The sweep's own files for the bundle beside its stages' results: logs, plan, params, timings, design."""
    return [out / "logs", out / "plan.json", out / "timings.json", out / "design.md", out / "design.json",
            out / "init" / "params.yaml", *(out / n / "params.yaml" for n in names)]


def write_sweep_bundle(run: SweepRun, bundle: Path) -> Path:
    """The plan runner's bundle of the sweep (results, logs, params; no models), rewritten now: after the
    design table, which is written once the plan has run."""
    members = bundle_members(run.plan, run.root, sweep_files(run.out, run.names), run.record)
    return write_bundle(bundle, members, run.root, run.record)


def _runner_lines(line: str) -> None:
    """Print the runner's own lines; each stage's output stays in its log (side by side it would interleave)."""
    if line.startswith("[run-plan]"):
        print(line, flush=True)


def run_sweep(spec_path: Path, out: Path, params_path: Path, planned: list[PlannedStage], jobs: int = 1,
              only: list[str] | None = None, bundle: Path | None = None, root: Path = Path("."),
              seed: int | None = None) -> SweepRun:
    """Every candidate x cell and each init, by `sweep_plan` from `planned` (the pipeline's plan), run in
    `root` by `plan_runner.run_plan` (`jobs` side by side, logs in `<out>/logs`, `bundle` rewritten after
    every stage, one failed chain not stopping the others); writes the candidates' params files, the sweep's
    `plan.json` and `timings.json` (`chain_timings`). Everything is checked before anything is written;
    `out` must lie inside `root` (the bundle keeps paths relative to it)."""
    spec = read_spec(spec_path, seed)
    names = [n for n in spec.candidates if not only or n in only]
    base = read_params(params_path)
    merged = {name: candidate_params(base, spec, name, spec_path) for name in names}
    try:
        out.resolve().relative_to(Path(root).resolve())
    except ValueError:
        raise ConfigError(f"--out {out}: must lie inside the project {root} (the bundle keeps paths relative "
                          "to it)") from None
    plan = sweep_plan(planned, spec, names, out)
    missing = missing_inputs(plan, planned, spec, Path(root))
    if missing:
        raise ConfigError(f"not found: {sorted(p for paths in missing.values() for p in paths)}: run the stages "
                          f"the sweep starts from first (`dvc repro {' '.join(missing)}`; without DVC: "
                          "`rcgrpo run-plan --stage ...`)")
    write_text(out / "init" / "params.yaml", yaml.safe_dump(deep_merge(base, spec.common), sort_keys=False))
    for name in names:
        write_text(out / name / "params.yaml", yaml.safe_dump(merged[name], sort_keys=False))
    write_plan(plan, out / "plan.json", {"spec": str(spec_path), "candidates": names})
    record = run_plan(plan, root, out / "logs", bundle, sweep_files(out, names), echo=_runner_lines, jobs=jobs,
                      keep_going=True)
    write_json(out / "timings.json", chain_timings(record, plan))
    return SweepRun(spec, names, out, Path(root), plan, record)
