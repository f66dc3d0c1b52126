"""The RC-GRPO mechanism per step: GRPO vs RC-GRPO from the same init on one step axis.

RC-GRPO's premise: rollouts drawn with mixed reward tokens split into successes and failures, so fewer
groups have zero reward variance (no learning signal) than under GRPO. The rl stage logs, every step,
`frac_zero_std` (share of groups whose reward std < `advantages.ZERO_STD_TOL`), the advantage spread
(`adv_abs_mean` = mean |A|, `adv_std` = std of A over the batch) and `controllability_gap` (mean reward
of the step's high-token rollouts minus its low-token ones; NaN unless both tokens occur, i.e. always
under GRPO's `fixed` / `none` conditioning) in its plots TSV (`train.grpo_trainer.PLOT_COLUMNS`).

- `step_summary(rows)`: mean of each of those columns over the steps where it is defined, with a 95 %
  percentile-bootstrap CI over steps (`ops.stats.bootstrap_ci`). Steps of one run are not independent
  (the policy drifts, entries repeat), so the CI describes the spread of the logged steps, not a
  population; compare runs by their curves as well.
- `plot_mechanism(tsvs, out)`: a PNG with one row of panels per init and one panel per column, each run
  (GRPO, RC-GRPO) a line over steps, its mean and CI in the legend. Runs are labelled `<init>-<algo>`
  (the grid's names, e.g. `rctp-grpo`); runs sharing an init share a row.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from rcgrpo_tasks.ops.stats import bootstrap_ci
from rcgrpo_tasks.train.runs import read_tsv

MECHANISM_COLUMNS = ("frac_zero_std", "adv_abs_mean", "adv_std", "controllability_gap", "reward")
"""Per-step columns that show the mechanism, in plotting order."""
TITLES = {"frac_zero_std": "zero-variance groups (share)", "adv_abs_mean": "advantage spread: mean |A|",
          "adv_std": "advantage spread: std A", "controllability_gap": "gap: R(high) - R(low)",
          "reward": "mean reward"}


def _finite(values: Sequence[float]) -> list[float]:
    return [float(v) for v in values if v is not None and not math.isnan(float(v))]


def column_summary(values: Sequence[float], seed: int = 0) -> dict:
    """{mean, ci_low, ci_high, steps} of the finite `values` (one per step); None fields when there are none."""
    xs = _finite(values)
    if not xs:
        return {"mean": None, "ci_low": None, "ci_high": None, "steps": 0}
    lo, hi = bootstrap_ci(xs, seed=seed)
    return {"mean": sum(xs) / len(xs), "ci_low": lo, "ci_high": hi, "steps": len(xs)}


def step_summary(rows: Sequence[Mapping], columns: Sequence[str] = MECHANISM_COLUMNS, seed: int = 0) -> dict:
    """{column: column_summary} over the step rows of one run (a missing column counts as undefined)."""
    return {c: column_summary([r.get(c, float("nan")) for r in rows], seed) for c in columns}


def run_groups(labels: Sequence[str]) -> dict[str, list[str]]:
    """Labels `<init>-<algo>` grouped by init, in first-seen order ({"rctp": ["rctp-grpo", "rctp-rc_grpo"]});
    a label without `-` is its own group."""
    groups: dict[str, list[str]] = {}
    for label in labels:
        groups.setdefault(label.split("-", 1)[0] if "-" in label else label, []).append(label)
    return groups


def _legend(label: str, stats: dict) -> str:
    if stats["mean"] is None:
        return f"{label}: n/a"
    return f"{label}: {stats['mean']:.3g} [{stats['ci_low']:.3g}, {stats['ci_high']:.3g}]"


def mechanism_figure(runs: Mapping[str, Sequence[Mapping]], columns: Sequence[str] = MECHANISM_COLUMNS,
                     title: str = "RC-GRPO mechanism per step"):
    """The matplotlib figure of `runs` ({label: step rows}): rows = inits, columns = `columns`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = run_groups(list(runs))
    fig, axes = plt.subplots(len(groups), len(columns), figsize=(3.6 * len(columns), 2.9 * len(groups)),
                             squeeze=False)
    for i, (init, labels) in enumerate(groups.items()):
        for j, col in enumerate(columns):
            ax = axes[i][j]
            for label in labels:
                rows = runs[label]
                steps = [r.get("step", k + 1) for k, r in enumerate(rows)]
                ys = [r.get(col, float("nan")) for r in rows]
                ax.plot(steps, ys, marker="o", markersize=3, label=_legend(label, column_summary(ys)))
            ax.set_title(f"{init}: {TITLES.get(col, col)}", fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=7, title="mean [95% CI]", title_fontsize=7)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def plot_mechanism(tsvs: Mapping[str, str | Path], out: str | Path, columns: Sequence[str] = MECHANISM_COLUMNS,
                   title: str = "RC-GRPO mechanism per step") -> Path:
    """Write the PNG of `mechanism_figure` for the rl plots TSVs `tsvs` ({"rctp-grpo": path, ...}) to
    `out`, atomically; returns `out`. A missing or empty TSV is drawn as an empty line (its run never logged
    a step)."""
    import matplotlib.pyplot as plt

    fig = mechanism_figure({label: read_tsv(Path(path)) for label, path in tsvs.items()}, columns, title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out)
    return out
