"""The RC-GRPO mechanism per step: GRPO vs RC-GRPO from the same init on one step axis.

RC-GRPO's premise: rollouts drawn with mixed reward tokens split into successes and failures, so fewer
groups have zero reward variance (no learning signal) than under GRPO. The rl stage logs, every step,
`frac_zero_std` (share of groups whose reward std < `advantages.ZERO_STD_TOL`), the advantage spread
(`adv_abs_mean` = mean |A|, `adv_std` = std of A over the batch) and `controllability_gap` (mean reward
of the step's high-token rollouts minus its low-token ones; NaN unless both tokens occur, i.e. always
under GRPO's `fixed` / `none` conditioning) in its plots TSV (`PLOT_COLUMNS`).

- `diagnostics_row` / `diag_metrics` / `DiagnosticsMixin`: TRL's averaged log of each optimizer step as a
  row of the plots TSV (resumable, in the checkpoint folder) and as MLflow metrics `diag/<column>`;
  `summarize`: the run summary (the metrics JSON the report reads).
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

from rcgrpo_tasks.ops.plots import save_png
from rcgrpo_tasks.ops.stats import bootstrap_ci, mcnemar_exact
from rcgrpo_tasks.train.common.runs import read_tsv, write_tsv
from rcgrpo_tasks.train.rl.advantages import ZERO_STD_TOL, group_stats

MECHANISM_COLUMNS = ("frac_zero_std", "adv_abs_mean", "adv_std", "controllability_gap", "reward")
"""Per-step columns that show the mechanism, in plotting order."""
TITLES = {"frac_zero_std": "zero-variance groups (share)", "adv_abs_mean": "advantage spread: mean |A|",
          "adv_std": "advantage spread: std A", "controllability_gap": "gap: R(high) - R(low)",
          "reward": "mean reward"}
STEP_MARKER = "loss"
"""A key of every optimizer step's TRL log (and of no other log): a step's row is written on it."""
PLOT_COLUMNS = (
    "step", "reward", "reward_high", "reward_low", "reward_none", "controllability_gap", "frac_zero_std",
    "frac_flat_fail", "frac_flat_success", "adv_abs_mean", "adv_std", "kl", "clip_ratio", "loss", "reward_paper", "reward_official", "reward_partial",
    "model_tokens", "n_calls", "n_steps", "env_errors", "rollout_tokens_per_s", "rollout_s", "step_time",
    "rollouts_generated", "rollouts_trained", "groups_dropped", "useful_groups", "gen_rounds",
    "gen_tokens_per_useful_group", "frac_zero_std_generated", "step_skipped", "truncated", "logp_diff_mean",
    "logp_diff_max", "sampler_kl", "is_weight_mean", "is_weight_min", "is_capped",
)
"""One row per optimizer step. A step that generated nothing (`num_iterations` or `minibatches` > 1 reuse
a generation batch) has no rollout columns (NaN) but its own loss, KL and clip fraction. `truncated`: TRL's
share of rollouts cut by a budget (`completions/clipped_ratio`); `logp_diff_*`, `sampler_kl`, `is_*`: the
sampler/trainer mismatch of the step's generation batch (`offpolicy`)."""
PRICE_COLUMNS = ("frac_zero_std_generated", "rollouts_generated", "useful_groups", "gen_tokens_per_useful_group")
"""Per-step columns of what the learning signal cost (summarized with CIs over steps, as the mechanism)."""
_SOURCES = {  # plot column -> key of TRL's averaged step logs
    "reward": "rc/reward", "reward_high": "rc/reward_high", "reward_low": "rc/reward_low",
    "reward_none": "rc/reward_none", "controllability_gap": "rc/controllability_gap",
    "frac_zero_std": "rc/frac_zero_std", "frac_flat_fail": "rc/frac_flat_fail",
    "frac_flat_success": "rc/frac_flat_success", "adv_abs_mean": "rc/adv_abs_mean", "adv_std": "rc/adv_std", "kl": "kl",
    "clip_ratio": "clip_ratio/region_mean", "loss": "loss", "reward_paper": "rewards/paper_reward/mean",
    "reward_official": "rewards/official_verdict/mean", "reward_partial": "rewards/partial_credit/mean",
    "model_tokens": "rc/model_tokens", "n_calls": "rc/n_calls", "n_steps": "rc/n_steps",
    "env_errors": "rc/env_errors", "rollout_tokens_per_s": "rc/rollout_tokens_per_s",
    "rollout_s": "rc/rollout_s", "step_time": "step_time",
    **{c: f"rc/{c}" for c in ("rollouts_generated", "rollouts_trained", "groups_dropped", "useful_groups",
                              "gen_rounds", "gen_tokens_per_useful_group", "frac_zero_std_generated",
                              "step_skipped", "logp_diff_mean", "logp_diff_max", "sampler_kl",
                              "is_weight_mean", "is_weight_min", "is_capped")},
    "truncated": "completions/clipped_ratio",
}


# ---------------------------------------------------------------- per-step rows and the run summary


def diagnostics_row(logs: dict, step: int) -> dict:
    """TRL's averaged step logs -> one row of the plots TSV (PLOT_COLUMNS; NaN where a value is missing)."""
    row: dict = {"step": step}
    for col, key in _SOURCES.items():
        value = logs.get(key)
        row[col] = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else float("nan")
    return row


def diag_metrics(logs: dict, step: int) -> dict:
    """A step's row as MLflow metrics `diag/<column>` (the same names live and when replayed after a resume)."""
    return {f"diag/{k}": v for k, v in diagnostics_row(logs, step).items() if k != "step" and not math.isnan(v)}


def summarize(rows: list[dict]) -> dict:
    """Per-run summary of the step rows: mean over steps (NaN-free) of each diagnostic, the last reward, and
    `mechanism` = {column: {mean, ci_low, ci_high, steps}} (95 % bootstrap CI over steps,
    `step_summary`) for the zero-variance share, the advantage spread, the gap and the reward, and the
    largest sampler/trainer log-prob gap of the run (`max_logp_diff_max`)."""
    out: dict = {"steps": len(rows)}
    for col in PLOT_COLUMNS[1:]:
        vals = [r[col] for r in rows if col in r and not math.isnan(r[col])]
        out[f"mean_{col}"] = sum(vals) / len(vals) if vals else None
    rewards = _finite([r.get("reward", float("nan")) for r in rows])  # steps that generated
    out["last_reward"] = rewards[-1] if rewards else None
    for col in ("rollouts_generated", "rollouts_trained", "groups_dropped", "useful_groups", "step_skipped"):
        vals = [r[col] for r in rows if not math.isnan(r.get(col, float("nan")))]
        out[f"total_{col}"] = sum(vals) if vals else None
    gen, useful = out["total_rollouts_generated"], out["total_useful_groups"]
    out["rollouts_per_useful_group"] = gen / useful if gen is not None and useful else None
    worst = [r["logp_diff_max"] for r in rows if not math.isnan(r.get("logp_diff_max", float("nan")))]
    out["max_logp_diff_max"] = max(worst) if worst else None
    out["price"] = step_summary(rows, PRICE_COLUMNS)
    out["mechanism"] = step_summary(rows)
    return out


class DiagnosticsMixin:
    """Every step's row -> `tsv` (rows of later steps, redone after a resume, replace the old ones)."""

    def __init__(self, tsv: Path):
        self.tsv = tsv

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or STEP_MARKER not in logs:
            return
        row = diagnostics_row(logs, state.global_step)
        kept = [r for r in read_tsv(self.tsv) if r["step"] < state.global_step]
        write_tsv(self.tsv, kept + [row], PLOT_COLUMNS)


def group_flags(records: Sequence[Mapping], reward: str, tol: float = ZERO_STD_TOL) -> list[dict]:
    """Per generated group of a run (`rollout.rollout_record`s: step, group, entry, rewards): {step, group,
    entry_id, flat: None (reward spread) | "fail" | "success" (zero std at mean <= 0.5 / above)}, in step and
    group order. The unit of the paired GRPO / RC-GRPO comparison (the same step and slot draw the same entry
    and seeds in both: `rollout.EngineRollout.group_specs`)."""
    by: dict[tuple[int, int], list] = {}
    for r in records:
        by.setdefault((int(r["step"]), int(r["group"])), []).append(r)
    out = []
    for (step, group), rs in sorted(by.items()):
        ((mu, sd),) = group_stats([float(r["rewards"].get(reward) or 0.0) for r in rs], len(rs))
        flat = None if sd >= tol else ("fail" if mu <= 0.5 else "success")  # as `advantages.flat_fractions`
        out.append({"step": step, "group": group, "entry_id": rs[0]["entry_id"], "flat": flat})
    return out


def pool_learning(records: Sequence[Mapping], reward: str, token: str | None = None) -> dict:
    """Does RL learn the prompts it trains on? Per pool prompt drawn at two steps or more, the mean reward of its
    group at its first visit vs its last (rollouts under `token` only, when given: RC-GRPO's high-token half,
    what evaluation conditions on); the prompts that rose and fell, and the exact sign test of those counts."""
    visits: dict[str, dict[int, list[float]]] = {}
    for r in records:
        if token is None or r.get("reward_token") == token:
            visits.setdefault(r["entry_id"], {}).setdefault(int(r["step"]), []).append(
                float(r["rewards"].get(reward) or 0.0))
    firsts, lasts = [], []
    for steps in visits.values():
        if len(steps) >= 2:
            first, last = steps[min(steps)], steps[max(steps)]
            firsts.append(sum(first) / len(first))
            lasts.append(sum(last) / len(last))
    up = sum(b > a for a, b in zip(firsts, lasts))
    down = sum(b < a for a, b in zip(firsts, lasts))
    n = len(firsts)
    return {"prompts": n, "up": up, "down": down, "ties": n - up - down, "sign_p": mcnemar_exact(up, down),
            "first_mean": sum(firsts) / n if n else float("nan"), "last_mean": sum(lasts) / n if n else float("nan"),
            "token": token}


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
    fig = mechanism_figure({label: read_tsv(Path(path)) for label, path in tsvs.items()}, columns, title)
    out = Path(out)
    save_png(fig, out, dpi=110)
    return out
