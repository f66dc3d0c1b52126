"""Reward labels: trajectories to the sft and rctp chat datasets (the label_rewards stage runs `label`)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rcgrpo.goal import check_levels, format_goal, place_goal, remove_goal
from rcgrpo_tasks.data.chat import assistant_token_mask
from rcgrpo_tasks.data.dataset import GenerateConfig
from rcgrpo_tasks.data.gate import require_passed
from rcgrpo_tasks.data.pairing import FailureRule, Pairing, check_policy_rows, rctp_rows
from rcgrpo_tasks.env.prompt import reward_tokens
from rcgrpo_tasks.env.rewards import reward_value
from rcgrpo_tasks.ops.config import ConfigError, read_sections
from rcgrpo_tasks.ops.inputs import InputError, read_jsonl

DATASETS = ("sft", "rctp")


def load_reward_tokens(params_path: str | Path) -> tuple[str, ...]:
    """THE reward tokens of a pipeline, lowest first, as its params file says (`label_rewards.tokens`; the
    default pair when the section leaves them out), checked (`rcgrpo.goal.check_levels`) and remembered as read
    (`ops.config.check_params_unchanged`). Every stage that conditions on a reward goal reads them here."""
    return reward_tokens(read_sections(params_path, "label_rewards"))


@dataclass(frozen=True)
class LabelConfig:
    signal: Literal["reward", "partial_credit"]
    """Binned into tokens: `reward` (generate_trajectories' R, binary) or `partial_credit` (0..1)."""
    tokens: tuple[str, ...]
    """Reward tokens, lowest level first (the paper: low, high)."""
    thresholds: tuple[float, ...]
    """signal >= thresholds[i] gives tokens[i + 1]; one fewer than tokens, strictly increasing."""
    failures: FailureRule
    """rctp: where an entry's failure comes from: `near_miss` | `on_policy` (else drop) | `mixed` (own, else
    near-miss); data.pairing."""
    base_failures: bool
    """rctp, paired: also pair every other generate-set entry with a base-model failure (data.pairing)."""
    pairing: Pairing
    """rctp: `paired` (every prompt under both tokens) | `unpaired` (one token per prompt; with near_miss:
    the generate set as is)."""
    seed: int
    """Seeds the unpaired side assignment and balancing."""
    count_tokens: bool
    """Tokenize every row (chat template + masks) to report token counts."""

    def __post_init__(self) -> None:
        check_levels(self.tokens)
        if len(self.thresholds) != len(self.tokens) - 1:
            raise ValueError(f"thresholds: need {len(self.tokens) - 1} for {len(self.tokens)} tokens, "
                             f"got {list(self.thresholds)}")
        # Both signals live in [0, 1]; a threshold outside (0, 1] would put every row on one token.
        if any(not 0.0 < th <= 1.0 for th in self.thresholds):
            raise ValueError(f"thresholds must lie in (0, 1] (the signal's range), got {list(self.thresholds)}")
        if any(b <= a for a, b in zip(self.thresholds, self.thresholds[1:])):
            raise ValueError(f"thresholds must be strictly increasing, got {list(self.thresholds)}")
        if self.base_failures and self.pairing != "paired":
            raise ValueError("base_failures adds pairs: it needs pairing: paired")


def token_for(value: float, cfg: LabelConfig, success: bool | None = None) -> str:
    """The reward token of a signal value: the highest level whose threshold it reaches. With `success`
    given, a success gets the highest token and a failure at most the second highest."""
    level = sum(1 for t in cfg.thresholds if value >= t)
    if success is not None:
        level = len(cfg.tokens) - 1 if success else min(level, len(cfg.tokens) - 2)
    return cfg.tokens[level]


def signal_of(row: dict, cfg: LabelConfig, reward_fn: str) -> float:
    if cfg.signal == "reward":
        value = row["provenance"].get("reward")
        return float(value if value is not None else reward_value(row["score"], reward_fn))
    script = row["provenance"].get("script_score")
    score = script if row["protocol"] == "paper" and script else row["score"]
    return float(score["partial_credit"])


# ----------------------------------------------------------------------------------------------------
# The stage


def label_rows(rows: list[dict], cfg: LabelConfig, reward_fn: str) -> dict[str, list[dict]]:
    """The two datasets from validated trajectory rows (same order as the input)."""
    out: dict[str, list[dict]] = {name: [] for name in DATASETS}
    for row in rows:
        reward = float(row["provenance"]["reward"])
        messages = remove_goal(row["messages"], format_goal(row.get("reward_token")))  # a policy's own goal
        token = token_for(signal_of(row, cfg, reward_fn), cfg, success=reward == 1.0)
        base = {"trajectory_id": row["trajectory_id"], "entry_id": row["entry_id"], "reward": reward,
                "kind": row["provenance"].get("kind")}
        out["rctp"].append({"messages": place_goal(messages, format_goal(token), "first_user"), **base,
                            "reward_token": token})
        if reward == 1.0:
            out["sft"].append({"messages": messages, **base, "reward_token": None})
    return out


def dataset_stats(rows: list[dict], tokenizer: Any | None) -> dict:
    stats: dict[str, Any] = {
        "n_rows": len(rows),
        "class_balance": dict(sorted(Counter(str(r["reward_token"]) for r in rows).items())),
        "mean_reward": round(sum(r["reward"] for r in rows) / len(rows), 4) if rows else None,
    }
    if tokenizer is not None and rows:
        lengths, assistant = [], 0
        for r in rows:
            ids, mask = assistant_token_mask(tokenizer, r["messages"])
            lengths.append(len(ids))
            assistant += sum(mask)
        stats["tokens"] = {"total": sum(lengths), "assistant": assistant, "mean": round(sum(lengths) / len(rows), 1),
                           "max": max(lengths)}
    return stats


def read_policy(cfg: LabelConfig, policy: str | Path | None, policy_validation: str | Path | None) -> list[dict]:
    """The gated on-policy samples ([] when none are given and the design needs none)."""
    if not policy:
        if cfg.failures != "near_miss":
            raise ConfigError(f"label_rewards.failures: {cfg.failures!r} needs the on-policy samples "
                              "(--policy, the sample_policy output)")
        return []
    require_passed(policy_validation or Path(policy).parent / "validation", policy)
    rows = read_jsonl(policy)
    check_policy_rows(rows, str(policy))
    return rows


def rctp_trajectories(cfg: LabelConfig, generated: list[dict], policy: list[dict]) -> tuple[list[dict], dict]:
    """The trajectory rows of the RCTP set and its pairing stats; fails on an empty or unbalanced set."""
    rows, stats = rctp_rows(generated, policy, cfg.failures, cfg.pairing, cfg.seed, cfg.base_failures)
    if not rows:
        raise InputError(f"label_rewards: the rctp design (failures {cfg.failures}, pairing {cfg.pairing}) "
                         f"keeps no row: {stats}")
    designed = cfg.pairing == "paired" or cfg.failures != "near_miss"
    if designed and stats["n_success"] != stats["n_failure"]:  # 1:1 by construction: a violation is a bug
        raise RuntimeError(f"rctp set not 1:1 ({stats['n_success']} successes, {stats['n_failure']} failures)")
    return rows, stats


def _tokenizer(cfg: LabelConfig, model_dir: str | Path):
    if not cfg.count_tokens:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def build(name: str, cfg: LabelConfig, gen: GenerateConfig, trajectories: str | Path, validation: str | Path,
          policy: str | Path | None = None, policy_validation: str | Path | None = None) -> tuple[list[dict], dict]:
    """(dataset rows, pairing stats) of `name`; raises ValidationFailed before anything else if an input
    trajectory file did not pass the gate."""
    if name not in DATASETS:
        raise ConfigError(f"--dataset must be one of {list(DATASETS)}, got {name!r}")
    require_passed(validation, trajectories)
    generated = read_jsonl(trajectories)
    if name == "sft":
        return label_rows(generated, cfg, gen.reward)["sft"], {}
    rows, stats = rctp_trajectories(cfg, generated, read_policy(cfg, policy, policy_validation))
    return label_rows(rows, cfg, gen.reward)["rctp"], stats


def labelled(name: str, cfg: LabelConfig, gen: GenerateConfig, trajectories: str | Path, validation: str | Path,
             model_dir: str | Path, policy: str | Path | None = None,
             policy_validation: str | Path | None = None) -> tuple[list[dict], dict]:
    """(rows, metrics) of dataset `name` (`DATASETS`); raises ValidationFailed (and writes nothing, the caller
    publishes) if an input did not pass the gate."""
    t0 = time.perf_counter()
    rows, stats = build(name, cfg, gen, trajectories, validation, policy, policy_validation)
    metrics = {"dataset": name, **dataset_stats(rows, _tokenizer(cfg, model_dir)),
               "tokens_used": list(cfg.tokens), "signal": cfg.signal}
    if stats:
        metrics["pairing"] = stats
    metrics["seconds"] = round(time.perf_counter() - t0, 2)
    return rows, metrics
