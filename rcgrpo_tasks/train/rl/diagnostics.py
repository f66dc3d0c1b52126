"""The RC-GRPO mechanism per step: each optimizer step as a row of the rl stage's plots TSV, and the run summary.

RC-GRPO's premise: rollouts drawn with mixed reward tokens split into successes and failures, so fewer
groups have zero reward variance (no learning signal) than under GRPO. The rl stage logs, every step,
`frac_zero_std` (share of groups whose reward std < `advantages.ZERO_STD_TOL`), the advantage spread
(`adv_abs_mean` = mean |A|, `adv_std` = std of A over the batch) and `controllability_gap` (mean reward
of the step's high-token rollouts minus its low-token ones; NaN unless both tokens occur, i.e. always
under GRPO's `fixed` / `none` conditioning) in its plots TSV (`PLOT_COLUMNS`).

- `diagnostics_row` / `diag_metrics` / `DiagnosticsMixin`: TRL's averaged log of each optimizer step as a
  row of the plots TSV (resumable, in the checkpoint folder) and as MLflow metrics `diag/<column>`;
  `summarize`: the run summary (the metrics JSON the report reads).
- The summary's `mechanism` and `price`: `data.rl_steps.step_summary` (means with bootstrap CIs over steps);
  the report draws the mechanism columns (`evaluation.mechanism.plot_mechanism`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from rcgrpo.group_metrics import NONZERO_ADV, ZERO_STD_TOL, flat_kind, group_stats, level_names
from rcgrpo.stats import mcnemar_exact
from rcgrpo_tasks.data.rl_steps import finite, step_summary
from rcgrpo_tasks.env.failures import FAILURE_KINDS
from rcgrpo_tasks.ops.inputs import read_tsv
from rcgrpo_tasks.ops.outputs import write_tsv

STEP_MARKER = "loss"
"""A key of every optimizer step's TRL log (and of no other log): a step's row is written on it."""
LEVELS = ("high", "low", "none")
"""The token levels RL conditions on (`rcgrpo.group_metrics.level_names`): the columns per level."""
FAILURE_COLUMNS = tuple(f"fail_{kind}_{level}" for level in LEVELS for kind in FAILURE_KINDS)
"""Per token level, the share of its rollouts that failed with each kind (`env.failures`): what the spread a
token injects is made of (a low token that answers in prose adds `no_call` failures)."""
PLOT_COLUMNS = (
    "step", "reward", "reward_high", "reward_low", "reward_none", "controllability_gap", "frac_zero_std",
    "frac_flat_fail", "frac_flat_success", "adv_abs_mean", "adv_std", "kl", "clip_ratio", "loss", "reward_paper", "reward_official", "reward_partial",
    "model_tokens", "n_calls", "n_steps", "env_errors", "rollout_tokens_per_s", "rollout_s", "step_time",
    "rollouts_generated", "rollouts_trained", "groups_dropped", "useful_groups", "gen_rounds",
    "gen_tokens_per_useful_group", "frac_zero_std_generated", "step_skipped", "truncated", "logp_diff_mean",
    "logp_diff_max", "sampler_kl", "is_weight_mean", "is_weight_min", "is_capped",
    "nonzero_adv_high", "nonzero_adv_low", "nonzero_adv_none", *FAILURE_COLUMNS,
)
"""One row per optimizer step. A step that generated nothing (`num_iterations` or `minibatches` > 1 reuse
a generation batch) has no rollout columns (NaN) but its own loss, KL and clip fraction. `truncated`: TRL's
share of rollouts cut by a budget (`completions/clipped_ratio`); `logp_diff_*`, `sampler_kl`, `is_*`: the
sampler/trainer mismatch of the step's generation batch (`offpolicy`); `nonzero_adv_<level>`: the step's
rollouts of that token whose advantage is not 0 (the library's count: where the learning signal sits);
`fail_<kind>_<level>`: `FAILURE_COLUMNS`."""
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
                              "is_weight_mean", "is_weight_min", "is_capped", "nonzero_adv_high",
                              "nonzero_adv_low", "nonzero_adv_none", *FAILURE_COLUMNS)},
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
    rewards = finite([r.get("reward", float("nan")) for r in rows])  # steps that generated
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


def _level(levels: Sequence[str]):
    """reward token -> its level's name (`high`, `low`, `none`, `level<i>`; `rcgrpo.group_metrics.level_names`)."""
    names = level_names(levels)
    return lambda token: names.get(token, str(token))


def failure_counts(records: Sequence[Mapping], levels: Sequence[str]) -> dict[str, dict[str, int]]:
    """Per token level present: its rollouts, successes (paper reward 1: `failure` None on a scored rollout),
    unscored ones and each failure kind (`rollout.rollout_record`'s `failure`), counted over `records`."""
    level = _level(levels)
    out: dict[str, dict[str, int]] = {}
    for r in records:
        c = out.setdefault(level(r.get("reward_token")), {"rollouts": 0, "success": 0, "unscored": 0,
                                                           **dict.fromkeys(FAILURE_KINDS, 0)})
        c["rollouts"] += 1
        kind = r.get("failure")
        scored = (r.get("rewards") or {}).get("paper_reward") is not None
        c[kind if kind in FAILURE_KINDS else "success" if scored else "unscored"] += 1
    return out


def failure_shares(records: Sequence[Mapping], levels: Sequence[str]) -> dict[str, float]:
    """`rc/fail_<kind>_<level>`: per token level present, the share of its rollouts failing with each kind."""
    return {f"rc/fail_{kind}_{name}": c[kind] / c["rollouts"] for name, c in failure_counts(records, levels).items()
            for kind in FAILURE_KINDS}


def nonzero_advantages(records: Sequence[Mapping], levels: Sequence[str]) -> dict[str, int]:
    """Per token level present: the rollouts whose advantage is not 0 (|A| > `NONZERO_ADV`: a learning signal)."""
    level = _level(levels)
    out: dict[str, int] = {}
    for r in records:
        name = level(r.get("reward_token"))
        out[name] = out.get(name, 0) + (abs(float(r.get("advantage") or 0.0)) > NONZERO_ADV)
    return out


def group_flags(records: Sequence[Mapping], reward: str, levels: Sequence[str] = (),
                tol: float = ZERO_STD_TOL, threshold: float = 0.5) -> list[dict]:
    """Per generated group of a run (`rollout.rollout_record`s: step, group, entry, rewards, advantage): {step,
    group, entry_id, flat: None (reward spread) | "fail" | "success" (`rcgrpo.group_metrics.flat_kind`: zero std
    at a mean below `threshold` / at or above it), and
    with `levels` (the reward tokens): `rollouts` and `nonzero_adv` per token level}, in step and group order.
    The unit of the paired GRPO / RC-GRPO comparison (the same step and slot draw the same entry and seeds in
    both: `rollout.EngineRollout.group_specs`)."""
    by: dict[tuple[int, int], list] = {}
    for r in records:
        by.setdefault((int(r["step"]), int(r["group"])), []).append(r)
    out = []
    for (step, group), rs in sorted(by.items()):
        ((mu, sd),) = group_stats([float(r["rewards"].get(reward) or 0.0) for r in rs], len(rs))
        flat = flat_kind(mu, sd, threshold, tol)  # the library's one classification
        row = {"step": step, "group": group, "entry_id": rs[0]["entry_id"], "flat": flat}
        if levels:
            row["rollouts"] = {k: c["rollouts"] for k, c in failure_counts(rs, levels).items()}
            row["nonzero_adv"] = nonzero_advantages(rs, levels)
        out.append(row)
    return out


def pool_learning(records: Sequence[Mapping], reward: str, token: str | None = None,
                  per_visit: int | None = None) -> dict:
    """Does RL learn the prompts it trains on? Per pool prompt drawn at two steps or more, the mean reward of its
    group at its first visit vs its last (rollouts under `token` only, when given: RC-GRPO's high-token half,
    what evaluation conditions on); the prompts that rose and fell, and the exact sign test of those counts.
    `per_visit`: each visit read on its first `per_visit` such rollouts, visits with fewer left out, so cells
    that draw different numbers of high-token rollouts per visit (GRPO 4, RC-GRPO about 2) are compared on
    equal samples."""
    visits: dict[str, dict[int, list[float]]] = {}
    for r in records:
        if token is None or r.get("reward_token") == token:
            visits.setdefault(r["entry_id"], {}).setdefault(int(r["step"]), []).append(
                float(r["rewards"].get(reward) or 0.0))
    if per_visit is not None:
        visits = {e: {s: v[:per_visit] for s, v in steps.items() if len(v) >= per_visit} for e, steps in visits.items()}
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
            "token": token, "per_visit": per_visit}
