"""label_rewards stage: reward tokens for each trajectory, and the chat datasets TRL fine-tunes on.

One definition, two datasets (`--dataset`, dvc.yaml foreach `label_rewards@sft` / `label_rewards@rctp`):
- `sft`: from `--trajectories` (`data/trajectories.jsonl`, the generate set) alone: successes only (R = 1),
  no reward token — the paper's SFT baseline. It feeds sft@sft, so it must not depend on the SFT model.
- `rctp`: the generate set plus `--policy` (`data/policy/trajectories.jsonl`: the SFT model's own rollouts
  from `sample_policy`), chosen by the pairing rule (`data.pairing`; params `failures: near_miss |
  on_policy | mixed`, `pairing: paired | unpaired`; `unpaired` + `near_miss` is the generate set as is),
  each row's reward token appended to the FIRST user message as `\\n\\n[Reward Goal: <token>]`
  (`protocols.format_reward_goal`, the same text RL and evaluate use).
Rows `{"messages": [...], "trajectory_id", "entry_id", "reward_token", "reward"}` go to `--out`; `--metrics`
gets row / token counts, class balance and (rctp) the pairing counts. Every input trajectory file must
carry the GX gate's `passed.json` for exactly that file (`--validation`, `--policy-validation`): leakage,
unknown ids and label consistency are checked there; the 1:1 balance of the rctp set is checked here
(paired and on-policy designs are 1:1 by construction; a violation is a bug and fails the stage).

Reward tokens: `signal` (the generate_trajectories reward R, or partial credit) is binned by
`thresholds` into `tokens` (lowest first); a success (R = 1) always gets the highest token and a failure
never does (so a 3-level partial-credit design cannot put a failure under the success token).
Default binary: R=1 -> `<|high_reward|>`, R=0 -> `<|low_reward|>`. A 3-level variant: `signal:
partial_credit`, `tokens: [<|low_reward|>, <|mid_reward|>, <|high_reward|>]`, `thresholds: [0.5, 1.0]`:
failures with partial credit >= 0.5 get mid. For scripted rows under the paper protocol the partial credit
is the per-turn script's (`provenance.script_score`), since the merged protocol has a single turn; for
model rollouts under the paper protocol it is the scorer's per-turn credit of the merged turn (~0).

Loss masks: `data.chat.assistant_token_mask(tokenizer, messages) -> (input_ids, mask)` is THE mask used
for SFT and RCTP: 1 on assistant content tokens and the end-of-turn token that closes them,
0 on system/user/tool text and template scaffolding (`<|im_start|>assistant\\n`), computed from the chat
template's own rendering, so it works for any prefix-stable template (SmolLM2/Qwen ChatML included).

Run: `rcgrpo label-rewards --params params.yaml --dataset rctp --trajectories data/trajectories.jsonl
--validation data/validation --policy data/policy/trajectories.jsonl --policy-validation
data/policy/validation --model-dir models/base --out data/datasets/rctp.jsonl --metrics
metrics/label_rewards_rctp.json`
"""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import typer

from rcgrpo_tasks.data.chat import assistant_token_mask, strip_reward_goal, with_reward_goal
from rcgrpo_tasks.data.dataset import GenerateConfig
from rcgrpo_tasks.data.gate import ValidationFailed, require_passed
from rcgrpo_tasks.data.pairing import FailureRule, Pairing, check_policy_rows, rctp_rows
from rcgrpo_tasks.env.scoring import reward_value
from rcgrpo_tasks.ops import tracking
from rcgrpo_tasks.ops.cli import GATE_EXIT, cli_errors, fail
from rcgrpo_tasks.ops.config import ConfigError, as_dict, load_config
from rcgrpo_tasks.ops.io import InputError, atomic_outputs, read_jsonl, write_json, write_jsonl

DATASETS = ("sft", "rctp")


@dataclass(frozen=True)
class LabelConfig:
    signal: Literal["reward", "partial_credit"] = "reward"
    """Binned into tokens: `reward` (generate_trajectories' R, binary) or `partial_credit` (0..1)."""
    tokens: tuple[str, ...] = ("<|low_reward|>", "<|high_reward|>")
    """Reward tokens, lowest level first (the paper: low, high)."""
    thresholds: tuple[float, ...] = (0.5,)
    """signal >= thresholds[i] gives tokens[i + 1]; one fewer than tokens, strictly increasing."""
    failures: FailureRule = "mixed"
    """rctp: where an entry's failure comes from: `near_miss` | `on_policy` (else drop) | `mixed` (own, else
    near-miss); data.pairing."""
    pairing: Pairing = "paired"
    """rctp: `paired` (every prompt under both tokens) | `unpaired` (one token per prompt; with near_miss:
    the generate set as is, the pre-issue-17 behaviour)."""
    seed: int = 0
    """Seeds the unpaired side assignment and balancing."""
    count_tokens: bool = True
    """Tokenize every row (chat template + masks) to report token counts."""

    def __post_init__(self) -> None:
        if len(self.tokens) < 2 or len(set(self.tokens)) != len(self.tokens):
            raise ValueError(f"tokens: need >= 2 distinct reward tokens, got {list(self.tokens)}")
        if len(self.thresholds) != len(self.tokens) - 1:
            raise ValueError(f"thresholds: need {len(self.tokens) - 1} for {len(self.tokens)} tokens, "
                             f"got {list(self.thresholds)}")
        # Both signals live in [0, 1]; a threshold outside (0, 1] would put every row on one token.
        if any(not 0.0 < th <= 1.0 for th in self.thresholds):
            raise ValueError(f"thresholds must lie in (0, 1] (the signal's range), got {list(self.thresholds)}")
        if any(b <= a for a, b in zip(self.thresholds, self.thresholds[1:])):
            raise ValueError(f"thresholds must be strictly increasing, got {list(self.thresholds)}")
        if any(not t.strip() or "]" in t for t in self.tokens):
            raise ValueError("tokens must be non-empty and must not contain ']' (it closes the reward goal)")


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
        messages = strip_reward_goal(row["messages"], row.get("reward_token"))
        token = token_for(signal_of(row, cfg, reward_fn), cfg, success=reward == 1.0)
        base = {"trajectory_id": row["trajectory_id"], "entry_id": row["entry_id"], "reward": reward}
        out["rctp"].append({"messages": with_reward_goal(messages, token), **base, "reward_token": token})
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
    rows, stats = rctp_rows(generated, policy, cfg.failures, cfg.pairing, cfg.seed)
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


def label_one(name: str, cfg: LabelConfig, gen: GenerateConfig, trajectories: str | Path, validation: str | Path,
              model_dir: str | Path, out: str | Path, metrics_out: str | Path | None = None,
              policy: str | Path | None = None, policy_validation: str | Path | None = None) -> dict:
    """Write dataset `name` to `out` (and its metrics to `metrics_out`) together; returns the metrics.
    Nothing is written if an input fails a check."""
    t0 = time.perf_counter()
    rows, stats = build(name, cfg, gen, trajectories, validation, policy, policy_validation)
    metrics = {"dataset": name, **dataset_stats(rows, _tokenizer(cfg, model_dir)),
               "tokens_used": list(cfg.tokens), "signal": cfg.signal}
    if stats:
        metrics["pairing"] = stats
    metrics["seconds"] = round(time.perf_counter() - t0, 2)
    with atomic_outputs() as staged:
        write_jsonl(staged.file(out), rows)
        if metrics_out is not None:
            write_json(staged.file(metrics_out), metrics)
    return metrics


def label(cfg: LabelConfig, gen: GenerateConfig, trajectories: str | Path, validation: str | Path,
          model_dir: str | Path, out_dir: str | Path, policy: str | Path | None = None,
          policy_validation: str | Path | None = None, metrics_out: str | Path | None = None) -> dict:
    """Write out_dir/{sft,rctp}.jsonl (and the metrics JSON `metrics_out`) together; returns the metrics.
    Raises ValidationFailed before writing anything if an input did not pass the gate."""
    t0 = time.perf_counter()
    built = {name: build(name, cfg, gen, trajectories, validation, policy, policy_validation) for name in DATASETS}
    tokenizer = _tokenizer(cfg, model_dir)
    metrics: dict[str, Any] = {name: dataset_stats(rows, tokenizer) for name, (rows, _) in built.items()}
    metrics["rctp"]["pairing"] = built["rctp"][1]
    metrics["tokens"] = list(cfg.tokens)
    metrics["signal"] = cfg.signal
    metrics["seconds"] = round(time.perf_counter() - t0, 2)
    with atomic_outputs() as staged:
        tmp = staged.dir(out_dir)
        for name, (rows, _) in built.items():
            write_jsonl(tmp / f"{name}.jsonl", rows)
        if metrics_out is not None:
            write_json(staged.file(metrics_out), metrics)
    return metrics


def _flat_metrics(record: dict) -> dict:
    """Numeric metrics under MLflow-safe names (`class_balance.<|high_reward|>` -> `class_balance.high_reward`)."""
    return {re.sub(r"[^\w\-. :/]", "", k): v for k, v in tracking.flatten(record).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


app = typer.Typer(add_completion=False)


@app.command()
def main(
    params: Path = typer.Option(Path("params.yaml"), help="params file (sections `label_rewards`, `generate_trajectories`)."),
    dataset: str = typer.Option("rctp", help="sft (experts, no token) | rctp (reward-conditioned, paired)."),
    trajectories: Path = typer.Option(Path("data/trajectories.jsonl"), help="validated generate-set JSONL."),
    validation: Path = typer.Option(Path("data/validation"), help="its validate_trajectories folder."),
    policy: str = typer.Option("", help="rctp: validated on-policy samples (sample_policy); empty = none."),
    policy_validation: str = typer.Option("", help="their validation folder; empty = <policy folder>/validation."),
    model_dir: Path = typer.Option(Path("models/base"), help="model folder (tokenizer, chat template)."),
    out: Path = typer.Option(None, help="output dataset JSONL; default data/datasets/<dataset>.jsonl."),
    metrics: Path = typer.Option(None, help="output metrics JSON; default metrics/label_rewards_<dataset>.json."),
) -> None:
    """Map scores to reward tokens; write the sft or the rctp chat dataset."""
    out = out or Path(f"data/datasets/{dataset}.jsonl")
    metrics = metrics or Path(f"metrics/label_rewards_{dataset}.json")
    with cli_errors():
        cfg = load_config(LabelConfig, params, "label_rewards")
        gen = load_config(GenerateConfig, params, "generate_trajectories")
    with tracking.stage_run("label_rewards", {"label": as_dict(cfg), "reward": gen.reward, "dataset": dataset},
                            tags={"rcgrpo.dataset": dataset}), cli_errors():
        try:
            record = label_one(dataset, cfg, gen, trajectories, validation, model_dir, out, metrics, policy or None,
                               policy_validation or None)
        except ValidationFailed as exc:
            fail(exc, GATE_EXIT)
        tracking.log_metrics(_flat_metrics(record))
        tracking.log_dict(record, f"label_rewards_{dataset}_metrics.json")
    typer.echo(f"wrote {out}: {record['n_rows']} rows {record['class_balance']}"
               + (f", {record['pairing']['prompts_used']} prompts ({cfg.failures}, {cfg.pairing})"
                  if "pairing" in record else "") + f" in {record['seconds']} s")


if __name__ == "__main__":
    app()
