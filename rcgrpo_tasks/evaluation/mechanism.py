"""The report's picture of the RC-GRPO mechanism: GRPO beside RC-GRPO from the same init, per step.

`plot_mechanism(tsvs, out)`: a PNG with one row of panels per init and one panel per column
(`data.rl_steps.MECHANISM_COLUMNS`), each run (GRPO, RC-GRPO) a line over steps, its mean and CI in the
legend (`data.rl_steps.column_summary`). Runs are labelled `<init>-<algo>` (the grid's names, e.g.
`rctp-grpo`); runs sharing an init share a row. The rows are the rl stage's plots TSVs
(`train.rl.diagnostics`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from rcgrpo_tasks.data.rl_steps import MECHANISM_COLUMNS, column_summary
from rcgrpo_tasks.evaluation.plots import save_png
from rcgrpo_tasks.ops.inputs import read_tsv

TITLES = {"frac_zero_std": "zero-variance groups (share)", "adv_abs_mean": "advantage spread: mean |A|",
          "adv_std": "advantage spread: std A", "controllability_gap": "gap: R(high) - R(low)",
          "reward": "mean reward", "nonzero_adv_high": "high-token rollouts with A != 0"}


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
    lo, hi = f"{stats['ci_low']:.3g}", f"{stats['ci_high']:.3g}"
    return f"{label}: {stats['mean']:.3g} " + ("(no spread)" if lo == hi else f"[{lo}, {hi}]")


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
    fig = mechanism_figure({label: read_tsv(Path(path)) for label, path in tsvs.items()}, columns, title)
    out = Path(out)
    save_png(fig, out, dpi=110)
    return out
