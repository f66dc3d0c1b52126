"""The Great Expectations quality gate on a trajectory set (the validate_trajectories stage runs `validate`)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from rcgrpo_tasks.data.dataset import KINDS, SOURCES, GenerateConfig
from rcgrpo_tasks.data.gate import PASSED_FILE, RESULT_FILE, stamp
from rcgrpo_tasks.engine.models import model_context
from rcgrpo_tasks.engine.trajectory import TERMINATIONS, Trajectory, TrajectoryError
from rcgrpo_tasks.env.entries import read_split
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.env.rewards import reward_value
from rcgrpo_tasks.env.tasks import LEGACY_TASK
from rcgrpo_tasks.ops.inputs import read_jsonl
from rcgrpo_tasks.ops.outputs import OutputSet, atomic_outputs, write_json

# `id` (= entry_id) is what Trajectory.to_json adds so a trajectory file is also a BFCL result file.


TRAJECTORY_FIELDS: tuple[str, ...] = ("id", *(f.name for f in fields(Trajectory)))
NULLABLE_FIELDS = frozenset({"reward_token"})
DERIVED: tuple[str, ...] = ("task", "source", "kind", "reward", "is_success", "partial_credit", "n_tokens",
                            "n_assistant", "parses", "label_consistent")


@dataclass(frozen=True)
class ValidateConfig:
    success_tolerance: float
    """Allowed |observed - configured| success fraction (configured: generate_trajectories.success_fraction)."""
    max_tokens: int | None
    """Longest allowed trajectory in tokens; null = the model's max_position_embeddings - goal_reserve."""
    goal_reserve: int
    """Tokens kept free for the `[Reward Goal: <token>]` suffix label_rewards adds."""
    min_rows: int
    """Fewest rows a usable dataset may have."""
    max_examples: int
    """Example values / ids per failed expectation in the summary."""
    data_docs: bool
    """Also build GX's HTML data docs (logged to the stage's MLflow run; not a DVC output: they hold run
    times and ids, so they would change the output's hash on every run)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.success_tolerance < 1.0:
            raise ValueError("success_tolerance must be in [0, 1)")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1 or null")
        if self.goal_reserve < 0 or self.min_rows < 0 or self.max_examples < 1:
            raise ValueError("goal_reserve, min_rows must be >= 0 and max_examples >= 1")


def _size(value: Any) -> Any:
    return len(value) if isinstance(value, (list, dict)) else value


def _flat(row: dict, reward_fn: str) -> dict:
    """Scalar view of one row: raw fields (lists/dicts as sizes) plus derived columns."""
    out = {k: _size(v) for k, v in row.items()}
    prov = row.get("provenance") if isinstance(row.get("provenance"), dict) else {}
    score = row.get("score") if isinstance(row.get("score"), dict) else None
    msgs = row.get("messages") if isinstance(row.get("messages"), list) else []
    try:
        Trajectory.from_json(row)
        parses = all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs)
    except (TrajectoryError, TypeError, ValueError):
        parses = False
    reward = prov.get("reward")
    try:
        recomputed = reward_value(score, reward_fn)
    except (KeyError, TypeError, ValueError):
        recomputed = None
    expected = {"expert": 1.0, "near_miss": 0.0}.get(prov.get("source"), reward)
    out.update({
        "task": prov.get("task"),
        "source": prov.get("source"),
        "kind": prov.get("kind"),
        "reward": reward,
        "is_success": 1.0 if reward == 1.0 else 0.0,
        "partial_credit": score.get("partial_credit") if score else None,
        "n_tokens": len(row["token_ids"]) if isinstance(row.get("token_ids"), list) else None,
        "n_assistant": sum(1 for m in msgs if isinstance(m, dict) and m.get("role") == "assistant"),
        "parses": parses,
        "label_consistent": reward is not None and reward == recomputed and reward == expected,
    })
    return out


def trajectory_frame(rows: list[dict], reward_fn: str):
    import pandas as pd

    return pd.DataFrame([_flat(r, reward_fn) for r in rows])


# ----------------------------------------------------------------------------------------------------
# The suite


def build_expectations(gx, cfg: ValidateConfig, gen: GenerateConfig, protocol: str, split: dict[str, list[str]],
                       max_tokens: int, balance: bool = True, side: str = "train") -> list:
    """The expectation suite; every expectation carries `meta.check`, the name used in messages.

    `balance=False` leaves out `success_balance`: for raw on-policy samples (sample_policy), whose success
    rate is the model's, not a configured mix (label_rewards checks the 1:1 of the set it builds from them).
    `side`: the split side the set's entries must come from: `train` (every set a fine-tuning stage may read:
    an RL prompt there is refused by name, `no_rl_leakage`) or `rl` (samples of RL's prompts: its pool).
    """
    E = gx.expectations

    def named(check: str, exp):
        exp.meta = {"check": check}
        return exp

    out = [
        named("schema", E.ExpectTableColumnsToMatchSet(column_set=list(TRAJECTORY_FIELDS) + list(DERIVED),
                                                      exact_match=True)),
        named("min_rows", E.ExpectTableRowCountToBeBetween(min_value=cfg.min_rows)),
    ]
    for col in TRAJECTORY_FIELDS + ("task", "source", "kind", "reward", "partial_credit", "n_tokens"):
        if col not in NULLABLE_FIELDS:
            out.append(named(f"not_null:{col}", E.ExpectColumnValuesToNotBeNull(column=col)))
    out += [
        named("reward_values", E.ExpectColumnValuesToBeInSet(column="reward", value_set=[0.0, 1.0])),
        named("partial_credit_range", E.ExpectColumnValuesToBeBetween(column="partial_credit", min_value=0.0,
                                                                       max_value=1.0)),
        named("provenance_source", E.ExpectColumnValuesToBeInSet(column="source", value_set=list(SOURCES))),
        named("provenance_kind", E.ExpectColumnValuesToBeInSet(column="kind", value_set=list(KINDS))),
        named("protocol", E.ExpectColumnValuesToBeInSet(column="protocol", value_set=[protocol])),
        # Rows of another task than the split's (a stale trajectory file after a task switch) are not vouched for.
        named("task", E.ExpectColumnValuesToBeInSet(column="task",
                                                    value_set=[split.get("task", LEGACY_TASK)])),
        named("termination", E.ExpectColumnValuesToBeInSet(column="termination", value_set=list(TERMINATIONS))),
        named("has_assistant_message", E.ExpectColumnValuesToBeBetween(column="n_assistant", min_value=1)),
        named("parses", E.ExpectColumnValuesToBeInSet(column="parses", value_set=[True])),
        named("token_length", E.ExpectColumnValuesToBeBetween(column="n_tokens", min_value=1, max_value=max_tokens)),
        named("label_consistent", E.ExpectColumnValuesToBeInSet(column="label_consistent", value_set=[True])),
        *([named("success_balance", E.ExpectColumnMeanToBeBetween(
            column="is_success", min_value=max(0.0, gen.success_fraction - cfg.success_tolerance),
            max_value=min(1.0, gen.success_fraction + cfg.success_tolerance)))] if balance else []),
        named("unique_trajectory_id", E.ExpectColumnValuesToBeUnique(column="trajectory_id")),
        named("no_test_leakage", E.ExpectColumnValuesToNotBeInSet(column="entry_id", value_set=sorted(split["test"]))),
        # The dev side is what designs are chosen on: a training row of it would flatter every choice.
        named("no_dev_leakage", E.ExpectColumnValuesToNotBeInSet(column="entry_id",
                                                                 value_set=sorted(split["dev"]))),
        # Rows of entries the split does not know (typos, another data version) are not vouched for.
        named("known_entry_id", E.ExpectColumnValuesToBeInSet(column="entry_id", value_set=sorted(split[side]))),
    ]
    if side == "train":  # RL learns on prompts no fine-tuning set holds: what it learns must transfer
        out.append(named("no_rl_leakage", E.ExpectColumnValuesToNotBeInSet(column="entry_id",
                                                                           value_set=sorted(split["rl"]))))
    return out


def import_gx():
    """great_expectations, imported on first use, with its usage analytics off."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")  # no phoning home from a pipeline stage
    import great_expectations as gx

    return gx


def run_suite(df, expectations: list, docs_dir: Path | None) -> dict:
    """Run the suite through a GX checkpoint; returns GX's suite validation result as a JSON dict."""
    gx = import_gx()
    from great_expectations.checkpoint import UpdateDataDocsAction
    from great_expectations.data_context.types.base import ProgressBarsConfig

    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
    batch = (ctx.data_sources.add_pandas("trajectories").add_dataframe_asset("rows")
             .add_batch_definition_whole_dataframe("all_rows"))
    suite = ctx.suites.add(gx.ExpectationSuite(name="trajectories", expectations=expectations))
    vd = ctx.validation_definitions.add(gx.ValidationDefinition(name="trajectories", data=batch, suite=suite))
    actions = []
    if docs_dir is not None:
        ctx.add_data_docs_site(site_name="local", site_config={
            "class_name": "SiteBuilder",
            "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(Path(docs_dir).resolve())},
            "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"}})
        actions.append(UpdateDataDocsAction(name="data_docs", site_names=["local"]))
    checkpoint = ctx.checkpoints.add(gx.Checkpoint(name="trajectory_gate", validation_definitions=[vd],
                                                   actions=actions, result_format={"result_format": "COMPLETE"}))
    result = checkpoint.run(batch_parameters={"dataframe": df})
    (suite_result,) = result.run_results.values()
    return suite_result.to_json_dict()


def failures(result: dict, df, max_examples: int) -> list[dict]:
    """One record per failed expectation: check name, GX type, column, rows affected, examples."""
    out = []
    for r in result["results"]:
        if r["success"]:
            continue
        conf, res = r["expectation_config"], r.get("result") or {}
        idx = res.get("unexpected_index_list") or []
        ids = [str(df["trajectory_id"].iloc[i]) for i in idx[:max_examples]
               if "trajectory_id" in df and isinstance(i, int) and i < len(df)]
        err = (r.get("exception_info") or {}).get("exception_message")
        out.append({
            "check": (conf.get("meta") or {}).get("check", conf["type"]),
            "expectation": conf["type"],
            "column": conf["kwargs"].get("column"),
            "bounds": [conf["kwargs"].get("min_value"), conf["kwargs"].get("max_value")],
            "unexpected_count": res.get("unexpected_count"),
            "observed_value": res.get("observed_value"),
            "examples": (res.get("partial_unexpected_list") or [])[:max_examples],
            "trajectory_ids": ids,
            "error": err,
        })
    return out


def summary(fails: list[dict], n_expectations: int, path: Path, n_rows: int) -> str:
    lines = [f"validate_trajectories: {len(fails)} of {n_expectations} expectations failed on {path} "
             f"({n_rows} rows):"]
    for f in fails:
        what = f"{f['check']} [{f['expectation']}" + (f"(column={f['column']})]" if f["column"] else "]")
        if f["error"]:
            detail = f"could not run: {f['error']}"
        elif f["unexpected_count"] is not None:
            detail = f"{f['unexpected_count']} row(s); e.g. values {f['examples']!r} in {f['trajectory_ids']}"
        else:
            observed = f["observed_value"]
            observed = round(float(observed), 4) if isinstance(observed, (int, float)) else observed
            lo, hi = f["bounds"]
            detail = f"observed {observed!r}" + (f" (allowed {lo}..{hi})" if lo is not None or hi is not None else "")
        lines.append(f"  - {what}: {detail}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# The stage


RUN_KEYS = frozenset({"id", "checkpoint_id", "validation_id", "validation_time", "run_id", "ge_load_time"})
"""Keys of GX's result that name the run (UUIDs, timestamps), not the data: dropped, so the gate's output
is a function of its inputs and a rerun on the same file changes no downstream hash."""


def deterministic(result):
    """GX's validation result without its run-specific keys (`RUN_KEYS`), at any depth."""
    if isinstance(result, dict):
        return {k: deterministic(v) for k, v in result.items() if k not in RUN_KEYS}
    if isinstance(result, list):
        return [deterministic(v) for v in result]
    return result


def validate(cfg: ValidateConfig, gen: GenerateConfig, prompt: PromptConfig, trajectories: str | Path,
             split_path: str | Path, model_dir: str | Path, out_dir: str | Path,
             balance: bool = True, metrics_out: str | Path | None = None, staged: OutputSet | None = None,
             docs_dir: Path | None = None, side: str = "train") -> tuple[dict, list[dict], str]:
    """Run the gate; writes out_dir (the deterministic result JSON, passed.json only on success) and the
    metrics JSON (`metrics_out`) together: both appear or neither (a failed gate still writes both). With
    `staged` (a stage's `published_run`) they are staged there and published with the run record;
    `docs_dir` (with `cfg.data_docs`): where GX's HTML data docs go.
    `balance=False`: no success-balance check (raw on-policy samples, see `build_expectations`); `side`: the
    split side the rows must come from (`build_expectations`).

    Returns (metrics, failures, summary text). Corrupt input raises InputError naming file and line.
    """
    trajectories = Path(trajectories)
    rows = read_jsonl(trajectories)
    split = read_split(split_path)
    max_tokens = cfg.max_tokens or model_context(model_dir) - cfg.goal_reserve
    df = trajectory_frame(rows, gen.reward)
    with contextlib.nullcontext(staged) if staged is not None else atomic_outputs() as outputs:
        tmp = outputs.dir(out_dir)
        expectations = build_expectations(import_gx(), cfg, gen, prompt.protocol, split, max_tokens, balance, side)
        result = deterministic(run_suite(df, expectations, docs_dir if cfg.data_docs else None))
        write_json(tmp / RESULT_FILE, result)
        fails = failures(result, df, cfg.max_examples)
        if not fails:
            write_json(tmp / PASSED_FILE, stamp(trajectories, len(rows)))
        n_success = int(df["is_success"].sum()) if "is_success" in df else 0
        metrics = {
            "passed": not fails, "n_rows": len(rows), "n_expectations": len(expectations),
            "n_failed_expectations": len(fails), "failed_checks": [f["check"] for f in fails],
            "n_success": n_success, "n_failure": len(rows) - n_success,
            "success_fraction": round(n_success / len(rows), 4) if rows else None,
            "max_tokens_allowed": max_tokens,
            "n_tokens_max": int(df["n_tokens"].max()) if len(df) and df["n_tokens"].notna().any() else None,
        }
        if metrics_out is not None:
            write_json(outputs.file(metrics_out), metrics)
    text = summary(fails, len(expectations), trajectories, len(rows)) if fails else ""
    return metrics, fails, text
