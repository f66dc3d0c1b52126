"""Judging a dev sweep (`sweep.run` ran it): the design table and replicates pooled, on dev entries only.

- `design_rows`: one row per (candidate, cell) from the candidate's `report.json` (the report stage's own:
  dev accuracy vs the init paired over entries, the fixed probe's change, zero-variance groups of RC-GRPO vs
  GRPO paired group by group) and the chains' wall seconds;
- `pooled_rows`: replicate sweeps of one spec pooled per candidate, paired over dev entries against the init
  and the `default` candidate, with the spread between runs (a GPU run does not repeat itself bit for bit).
- `premise_reading` (in each design row): with the spec's `premise: true`, q and the gap on dev of the init
  (before RL) and of the cell's policy (after it), and the token gap on RL's own pool by thirds of training;
  `pooled_cells` puts them per cell over replicates (one per grid seed): what an ablation aimed at the
  premise's erosion is chosen on.
"""

from __future__ import annotations

from pathlib import Path

from rcgrpo_tasks.data.rl_steps import thirds
from rcgrpo_tasks.evaluation.formats import ci, num
from rcgrpo_tasks.evaluation.results_table import load_eval
from rcgrpo_tasks.evaluation.stats import paired_bootstrap_ci
from rcgrpo_tasks.ops.inputs import read_json, read_tsv
from rcgrpo_tasks.sweep.run import Spec


def design_rows(out: Path, spec: Spec) -> list[dict]:
    """One row per (candidate, cell) from the candidates' report.json and the chains' timings."""
    timings = read_json(out / "timings.json") if (out / "timings.json").is_file() else {}
    rows = []
    for name in spec.candidates:
        report = out / name / "report.json"
        got = read_json(report) if report.is_file() else {}
        contrast = got.get("rc_grpo_vs_grpo") or {}
        for cell in spec.cells:
            row = (got.get("rows") or {}).get(cell) or {}
            probe = (row.get("rl_probe") or {}).get("change") or {}
            zero = (contrast.get(cell) or {}).get("zero_std_paired")
            rows.append({"candidate": name, "cell": cell, "overrides": spec.candidates[name],
                         "dev_accuracy": (row.get("overall") or {}).get("accuracy"), "n_dev": row.get("n"),
                         "vs_init": row.get("vs_init"), "probe_change": probe or None,
                         "rc_grpo_vs_grpo_zero_std": zero or None, **premise_reading(out, name, cell),
                         "seconds": (timings.get(f"{name}/{cell}") or {}).get("seconds"),
                         "status": (timings.get(f"{name}/{cell}") or {}).get("status", "not run")})
    return rows


def _check(path: Path) -> dict | None:
    """q and the sampled gap of a controllability check's metrics (None where it did not run)."""
    if not path.is_file():
        return None
    s = read_json(path)["sampled"]
    return {"q": s["premise"]["q"], "q_ci": s["premise"]["q_ci"], "gap": s["gap"], "gap_ci": s["gap_ci"]}


def premise_reading(out: Path, name: str, cell: str) -> dict:
    """A cell's premise on dev: its init's check (before RL), its policy's (after RL: `premise: true`), and the
    token gap on RL's own pool by thirds of training (its rl.tsv; RC-family cells)."""
    tsv = out / name / cell / "rl.tsv"
    gaps = [t["controllability_gap"] for t in thirds(read_tsv(tsv), ("controllability_gap",))] if tsv.is_file() else []
    return {"premise_before": _check(out / "init" / "ctl-rctp.json"), "premise_after": _check(out / name / cell / "ctl.json"),
            "gap_thirds": gaps if any(g is not None for g in gaps) else None}


def _q(check: dict | None) -> str:
    return "n/a" if not check else f"{ci(check['q'], check['q_ci'], '.2f')}, gap {ci(check['gap'], check['gap_ci'], '+.2f')}"


def _ci(d: dict | None, key: str, spec: str) -> str:
    """`value [low, high]` of a paired difference (`ci`) or a probe change (`ci_low`, `ci_high`); n/a if none."""
    if not d:
        return "n/a"
    return ci(d.get(key), d["ci"] if "ci" in d else (d.get("ci_low"), d.get("ci_high")), spec)


def design_markdown(rows: list[dict]) -> str:
    """The design table: candidate, cell, dev accuracy, vs init (paired over dev entries), probe change."""
    def zero(z: dict | None) -> str:
        if not z:
            return ""
        return (f"{z['cell']:.2f} vs {z['grpo']:.2f} over {z['groups']} groups "
                f"({z['only_cell']} vs {z['only_grpo']}, p = {z['mcnemar_p']:.2g})")

    lines = ["| candidate | cell | dev accuracy % | vs init (pts, paired) | probe change (paired) | zero-variance "
             "vs GRPO (paired) | q after RL on dev (before: the init's) | pool token gap by thirds | wall s | status |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        acc = "n/a" if r["dev_accuracy"] is None else f"{r['dev_accuracy']:.1f} (n={r['n_dev']})"
        secs = "n/a" if r["seconds"] is None else f"{r['seconds']:.0f}"
        after = "n/a" if not r.get("premise_after") else f"{_q(r['premise_after'])} ({_q(r.get('premise_before'))})"
        gaps = " / ".join(num(g, "+.2f") for g in r["gap_thirds"]) if r.get("gap_thirds") else "n/a"
        lines.append(f"| {r['candidate']} | {r['cell']} | {acc} | {_ci(r['vs_init'], 'diff', '+.1f')} | "
                     f"{_ci(r['probe_change'], 'mean', '+.3f')} | {zero(r['rc_grpo_vs_grpo_zero_std'])} | {after} | "
                     f"{gaps} | {secs} | {r['status']} |")
    return "\n".join(lines) + "\n"


def _dev_correct(folder: Path) -> dict[str, float]:
    return {e["entry_id"]: float(e["correct"]) for e in load_eval(folder.name, folder).entries}


def _mean_by_entry(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each entry's mean correctness over `runs`, on the entries every run scored ({} without runs)."""
    if not runs:
        return {}
    ids = sorted(set.intersection(*(set(x) for x in runs)))
    return {i: sum(x[i] for x in runs) / len(runs) for i in ids}


def pooled_rows(replicates: list[Path], spec: Spec, baseline: str = "default", seed: int = 0) -> list[dict]:
    """Per candidate, pooled over its cells and the replicate sweeps (the same spec run again; a GPU run does
    not repeat itself bit for bit): each dev entry's mean correctness over cells x replicates, minus the
    baseline candidate's and minus the init's, paired over dev entries (95 % bootstrap CI), and the spread
    of its cell runs' dev accuracies (max - min over cells x replicates)."""
    def runs(name: str) -> list[dict[str, float]]:
        return [_dev_correct(r / name / c / "eval") for r in replicates for c in spec.cells
                if (r / name / c / "eval" / "results.jsonl").is_file()]

    inits = {c.partition("-")[0] for c in spec.cells}
    init_mean = _mean_by_entry([_dev_correct(r / "init" / i) for r in replicates for i in sorted(inits)
                                if (r / "init" / i).is_dir()])
    base = _mean_by_entry(runs(baseline))
    rows = []
    for name in spec.candidates:
        cell_runs = runs(name)
        mine, accs = _mean_by_entry(cell_runs), [100 * sum(x.values()) / len(x) for x in cell_runs]
        if not mine:
            continue
        row = {"candidate": name, "runs": len(accs), "dev_accuracy": sum(accs) / len(accs),
               "spread": max(accs) - min(accs)}
        for key, other in (("vs_init", init_mean), ("vs_baseline", base if name != baseline else {})):
            common = sorted(set(mine) & set(other))
            if common:
                d, lo, hi = paired_bootstrap_ci([mine[i] for i in common], [other[i] for i in common], seed=seed)
                row[key] = {"diff": 100 * d, "ci": [100 * lo, 100 * hi], "n": len(common)}
        rows.append(row)
    return rows


def pooled_markdown(rows: list[dict], baseline: str) -> str:
    lines = [f"| candidate | cell runs | dev accuracy % (mean) | spread over cell runs (pts) | vs init (pts, paired "
             f"over dev entries) | vs {baseline} (pts, paired) |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['candidate']} | {r['runs']} | {r['dev_accuracy']:.1f} | {r['spread']:.1f} | "
              f"{_ci(r.get('vs_init'), 'diff', '+.1f')} | {_ci(r.get('vs_baseline'), 'diff', '+.1f')} |" for r in rows]
    return "\n".join(lines) + "\n"




def pooled_cells(replicates: list[Path], spec: Spec) -> list[dict]:
    """Per (candidate, cell) over the replicate sweeps (one per grid seed): each run's dev accuracy, the q of its
    policy after RL on dev beside its init's, and the token gap on its pool in the first and last third of
    training, with their means: what an ablation aimed at the premise's erosion is chosen on."""
    rows = []
    for name in spec.candidates:
        for cell in spec.cells:
            runs = []
            for r in replicates:
                report = r / name / "report.json"
                row = ((read_json(report).get("rows") or {}).get(cell) or {}) if report.is_file() else {}
                runs.append({"run": r.name, "dev_accuracy": (row.get("overall") or {}).get("accuracy"),
                             **premise_reading(r, name, cell)})
            rows.append({"candidate": name, "cell": cell, "runs": runs, **{k: _mean_of(runs, k) for k in (
                "dev_accuracy", "q_before", "q_after", "gap_first", "gap_last")}})
    return rows


def _value(run: dict, key: str):
    if key == "dev_accuracy":
        return run["dev_accuracy"]
    if key in ("q_before", "q_after"):
        check = run["premise_before" if key == "q_before" else "premise_after"]
        return check["q"] if check else None
    gaps = run.get("gap_thirds") or []
    return (gaps[0] if key == "gap_first" else gaps[-1]) if gaps else None


def _mean_of(runs: list[dict], key: str) -> float | None:
    vals = [v for v in (_value(r, key) for r in runs) if v is not None and v == v]
    return sum(vals) / len(vals) if vals else None


def cells_markdown(rows: list[dict]) -> str:
    """Per (candidate, cell): dev accuracy, q before / after RL on dev and the pool's token gap, first vs last
    third of training, each as the mean over runs and the per-run values."""
    def per(r: dict, key: str, spec: str) -> str:
        return f"{num(r[key], spec)} ({', '.join(num(_value(x, key), spec) for x in r['runs'])})"

    lines = ["| candidate | cell | runs | dev accuracy % | q before RL (dev) | q after RL (dev) | pool token gap, first "
             "third | last third |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['candidate']} | {r['cell']} | {len(r['runs'])} | {per(r, 'dev_accuracy', '.1f')} | "
              f"{per(r, 'q_before', '.2f')} | {per(r, 'q_after', '.2f')} | {per(r, 'gap_first', '+.2f')} | "
              f"{per(r, 'gap_last', '+.2f')} |" for r in rows]
    return "\n".join(lines) + "\n"
