"""label_rewards stage: reward tokens for each trajectory, and the two chat datasets TRL fine-tunes on.

Reads `--trajectories` (`data/trajectories.jsonl`), `--validation` (`data/validation/`: refuses to run
unless its `passed.json` vouches for exactly this file), `--model-dir` (tokenizer + chat template, for
token counts) and `params.yaml` sections `label_rewards` plus `generate_trajectories.reward`. Writes
`--out-dir` (`data/datasets/`) atomically with two JSONL datasets, rows
`{"messages": [...], "trajectory_id", "entry_id", "reward_token", "reward"}`:
- `sft.jsonl`: successes only (R = 1), no reward token — the paper's SFT baseline;
- `rctp.jsonl`: every row, its reward token appended to the FIRST user message as
  `\\n\\n[Reward Goal: <token>]` (`protocols.format_reward_goal`, the same text RL and evaluate use).
`--metrics` gets row / token counts and class balance per dataset.

Reward tokens: `signal` (the generate_trajectories reward R, or partial credit) is binned by
`thresholds` into `tokens` (lowest first). Default binary: R=1 -> `<|high_reward|>`, R=0 ->
`<|low_reward|>`. A 3-level variant: `signal: partial_credit`, `tokens: [<|low_reward|>, <|mid_reward|>,
<|high_reward|>]`, `thresholds: [0.5, 1.0]`. For scripted rows under the paper protocol the partial credit
is the per-turn script's (`provenance.script_score`), since the merged protocol has a single turn.

Loss masks: `assistant_token_mask(tokenizer, messages) -> (input_ids, mask)` is THE mask used for SFT and
RCTP (the SFT stage imports it): 1 on assistant content tokens and the end-of-turn token that closes them,
0 on system/user/tool text and template scaffolding (`<|im_start|>assistant\\n`), computed from the chat
template's own rendering, so it works for any prefix-stable template (SmolLM2/Qwen ChatML included).

Run: `rcgrpo label-rewards --params params.yaml --trajectories data/trajectories.jsonl --validation
data/validation --model-dir models/base --out-dir data/datasets --metrics metrics/label_rewards.json`
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import typer

from rcgrpo_tasks.config import ConfigError, as_dict, load_config
from rcgrpo_tasks.generate_trajectories import GenerateConfig, reward_of
from rcgrpo_tasks.io import InputError, atomic_dir, read_jsonl, write_json, write_jsonl

DATASETS = ("sft", "rctp")


@dataclass(frozen=True)
class LabelConfig:
    signal: Literal["reward", "partial_credit"] = "reward"
    """Binned into tokens: `reward` (generate_trajectories' R, binary) or `partial_credit` (0..1)."""
    tokens: tuple[str, ...] = ("<|low_reward|>", "<|high_reward|>")
    """Reward tokens, lowest level first (the paper: low, high)."""
    thresholds: tuple[float, ...] = (0.5,)
    """signal >= thresholds[i] gives tokens[i + 1]; one fewer than tokens, strictly increasing."""
    count_tokens: bool = True
    """Tokenize every row (chat template + masks) to report token counts; ~10 s for 1.4k rows."""

    def __post_init__(self) -> None:
        if len(self.tokens) < 2 or len(set(self.tokens)) != len(self.tokens):
            raise ValueError(f"tokens: need >= 2 distinct reward tokens, got {list(self.tokens)}")
        if len(self.thresholds) != len(self.tokens) - 1:
            raise ValueError(f"thresholds: need {len(self.tokens) - 1} for {len(self.tokens)} tokens, "
                             f"got {list(self.thresholds)}")
        if any(b <= a for a, b in zip(self.thresholds, self.thresholds[1:])):
            raise ValueError(f"thresholds must be strictly increasing, got {list(self.thresholds)}")
        if any(not t.strip() or "]" in t for t in self.tokens):
            raise ValueError("tokens must be non-empty and must not contain ']' (it closes the reward goal)")


def token_for(value: float, cfg: LabelConfig) -> str:
    """The reward token of a signal value: the highest level whose threshold it reaches."""
    level = sum(1 for t in cfg.thresholds if value >= t)
    return cfg.tokens[level]


def signal_of(row: dict, cfg: LabelConfig, reward_fn: str) -> float:
    if cfg.signal == "reward":
        value = row["provenance"].get("reward")
        return float(value if value is not None else reward_of(row["score"], reward_fn))
    script = row["provenance"].get("script_score")
    score = script if row["protocol"] == "paper" and script else row["score"]
    return float(score["partial_credit"])


# ----------------------------------------------------------------------------------------------------
# Messages and masks


def strip_reward_goal(messages: list[dict], reward_token: str | None) -> list[dict]:
    """A copy of the chat without the reward goal a conditioned policy was given (if any)."""
    from rcgrpo_tasks.protocols import format_reward_goal

    out = copy.deepcopy(messages)
    suffix = format_reward_goal(reward_token)
    if suffix:
        first = next(m for m in out if m["role"] == "user")
        if first["content"].endswith(suffix):
            first["content"] = first["content"][: -len(suffix)]
    return out


def with_reward_goal(messages: list[dict], token: str) -> list[dict]:
    """A copy of the chat with `[Reward Goal: <token>]` appended to the first user message."""
    from rcgrpo_tasks.protocols import format_reward_goal

    out = copy.deepcopy(messages)
    first = next((m for m in out if m["role"] == "user"), None)
    if first is None:
        raise ValueError("trajectory has no user message to attach the reward goal to")
    first["content"] += format_reward_goal(token)
    return out


def _render(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(rendered chat, character spans of each assistant reply incl. the template's end-of-turn text)."""
    text = _render(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:
            raise ValueError("a chat cannot start with an assistant message")
        head = _render(tokenizer, messages[:i], generation_prompt=True)
        upto = _render(tokenizer, messages[: i + 1])
        if not (text.startswith(head) and text.startswith(upto) and len(upto) > len(head)):
            raise ValueError("chat template is not prefix-stable; cannot locate assistant tokens")
        spans.append((len(head), len(upto)))
    return text, spans


def assistant_token_mask(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(input_ids of the rendered chat, mask): 1 exactly on assistant content + its end-of-turn token.

    Tokens of system/user/tool messages, the `<|im_start|>assistant\\n` header and the newline after
    `<|im_end|>` get 0. `input_ids` equal `apply_chat_template(messages, tokenize=True)`.
    """
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    eos = tokenizer.eos_token_id
    mask = [0] * len(ids)
    j = 0
    for start, end in spans:
        while j < len(ids) and offsets[j][0] < start:
            j += 1
        while j < len(ids) and offsets[j][1] <= end:
            if offsets[j][1] > offsets[j][0]:
                mask[j] = 1
            j += 1
            if ids[j - 1] == eos:  # the reply's end-of-turn token is learned; what follows is template
                break
    return ids, mask


# ----------------------------------------------------------------------------------------------------
# The stage


def label_rows(rows: list[dict], cfg: LabelConfig, reward_fn: str) -> dict[str, list[dict]]:
    """The two datasets from validated trajectory rows (same order as the input)."""
    out: dict[str, list[dict]] = {name: [] for name in DATASETS}
    for row in rows:
        reward = float(row["provenance"]["reward"])
        messages = strip_reward_goal(row["messages"], row.get("reward_token"))
        token = token_for(signal_of(row, cfg, reward_fn), cfg)
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


def label(cfg: LabelConfig, gen: GenerateConfig, trajectories: str | Path, validation: str | Path,
          model_dir: str | Path, out_dir: str | Path) -> dict:
    """Write out_dir/{sft,rctp}.jsonl; returns the metrics. Raises ValidationFailed before writing anything
    if the trajectories did not pass the gate."""
    from rcgrpo_tasks.validate_trajectories import require_passed

    t0 = time.perf_counter()
    require_passed(validation, trajectories)
    rows = read_jsonl(trajectories)
    datasets = label_rows(rows, cfg, gen.reward)
    tokenizer = None
    if cfg.count_tokens:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    metrics = {name: dataset_stats(data, tokenizer) for name, data in datasets.items()}
    with atomic_dir(out_dir) as tmp:
        for name, data in datasets.items():
            write_jsonl(tmp / f"{name}.jsonl", data)
    metrics["tokens"] = list(cfg.tokens)
    metrics["signal"] = cfg.signal
    metrics["seconds"] = round(time.perf_counter() - t0, 2)
    return metrics


app = typer.Typer(add_completion=False)


@app.command()
def main(
    params: Path = typer.Option(Path("params.yaml"), help="params file (sections `label_rewards`, `generate_trajectories`)."),
    trajectories: Path = typer.Option(Path("data/trajectories.jsonl"), help="validated trajectory JSONL."),
    validation: Path = typer.Option(Path("data/validation"), help="validate_trajectories output folder."),
    model_dir: Path = typer.Option(Path("models/base"), help="model folder (tokenizer, chat template)."),
    out_dir: Path = typer.Option(Path("data/datasets"), help="output folder: sft.jsonl, rctp.jsonl."),
    metrics: Path = typer.Option(Path("metrics/label_rewards.json"), help="output metrics JSON."),
) -> None:
    """Map scores to reward tokens; write the sft and rctp chat datasets."""
    from rcgrpo_tasks.validate_trajectories import ValidationFailed

    try:
        cfg = load_config(LabelConfig, params, "label_rewards")
        gen = load_config(GenerateConfig, params, "generate_trajectories")
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    from rcgrpo_tasks import tracking

    with tracking.stage_run("label_rewards", {"label": as_dict(cfg), "reward": gen.reward}):
        try:
            record = label(cfg, gen, trajectories, validation, model_dir, out_dir)
        except (InputError, ValidationFailed) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from exc
        write_json(metrics, record)
        flat = {f"{name}.{k}": v for name in DATASETS for k, v in record[name].items() if isinstance(v, (int, float))}
        flat.update({f"{name}.tokens.{k}": v for name in DATASETS for k, v in record[name].get("tokens", {}).items()})
        tracking.log_metrics(flat)
        tracking.log_dict(record, "label_rewards_metrics.json")
    typer.echo(f"wrote {out_dir}: sft {record['sft']['n_rows']} rows, rctp {record['rctp']['n_rows']} rows "
               f"{record['rctp']['class_balance']} in {record['seconds']} s")


if __name__ == "__main__":
    app()
