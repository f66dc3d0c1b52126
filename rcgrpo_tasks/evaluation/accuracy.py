"""A model's accuracy: its rollouts on one side of the split (either task; `check_side`: test, held out, what is
reported, or dev, what designs are chosen on), scored, summarised with bootstrap CIs (the evaluate stage runs
`run_eval`).

Two measures per entry: the greedy answer (`valid`), and pass@1 estimated from `pass_samples` answers
sampled as RL samples (`rl.temperature`, `rl.top_p`): the share of them that succeed. RL sharpens the
sampling distribution, which greedy alone can hide. An entry's i-th sample has the same row seed for every
model (`engine.rollout.run_groups`: seeded by the stage's seed, the entry and i), so two models' pass@1 are
paired entry by entry and sample by sample."""

from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from rcgrpo.goal import DEFAULT_LEVELS
from rcgrpo.stats import bootstrap_ci, check_n_boot
from rcgrpo_tasks.engine.backend import SamplingParams, reward_pair_ids
from rcgrpo_tasks.engine.decoding import MAX_OUTPUTS, DecodeConfig, check_sampling
from rcgrpo_tasks.engine.rollout import run_rollouts
from rcgrpo_tasks.engine.trajectory import as_stage_output, write_trajectories
from rcgrpo_tasks.env.contract import Entry
from rcgrpo_tasks.env.paper import ROWS
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.env.tasks import ALL_CATEGORIES, get_task, paper_overall, task_of
from rcgrpo_tasks.evaluation.formats import SIDES, side_name
from rcgrpo_tasks.evaluation.plots import accuracy_plot
from rcgrpo_tasks.ops.cli import Progress
from rcgrpo_tasks.ops.config import flat_field
from rcgrpo_tasks.ops.inputs import InputError
from rcgrpo_tasks.ops.outputs import write_jsonl, write_text


@dataclass(frozen=True)
class RLSampling:
    """How RL samples its rollouts: params `rl`'s `temperature` and `top_p`, read key by key
    (`ops.config.load_keys`), not through the RL trainer's config; pass@1 and controllability's sampled arm
    sample as RL does."""

    temperature: float
    """RL's sampling temperature (> 0: RL samples)."""
    top_p: float
    """RL's nucleus sampling."""

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError("need temperature > 0 (rollouts are sampled)")
        check_sampling(self.temperature, self.top_p)  # THE decoding bounds (`engine.decoding`)

    def applied(self, decode: DecodeConfig) -> DecodeConfig:
        """`decode` at RL's temperature and top_p."""
        return dataclasses.replace(decode, temperature=self.temperature, top_p=self.top_p)


@dataclass(frozen=True)
class EvaluateConfig:
    """params.yaml `evaluate`; the prompt (protocol, doc style, system prompt) is the shared `prompt` section."""

    decode: DecodeConfig = flat_field(DecodeConfig)
    """Sampling, budgets and engine (`engine.decoding`; flat keys). Greedy at temperature 0; `max_outputs`:
    model outputs per episode under `paper`."""
    seed: int
    """Sampling and bootstrap seed."""
    limit: int | None
    """Evaluate only N held-out entries, taken round-robin over categories (smoke profile); null = all."""
    official_full: bool
    """Also run BFCL's official protocol on every prepared entry (multi-turn: all 800; GPU profile)."""
    official_max_steps_per_turn: int
    """Model outputs per turn under the official protocol (`official_full`)."""
    n_bootstrap: int
    """Bootstrap resamples of every CI."""
    margin: bool
    """Reward-conditioned evaluations (a `--reward-token`, hf backend): also the teacher-forced margin on the
    evaluated entries and the reward-token rows' distance (`data.margin.read_token`, forward passes only), so
    every RCTP-based model, RL policies included, shows whether it still reads its token (RL rewards the low
    token for success too, which can erode it)."""
    guidance: float
    """Reward-token guidance scale w (0 = off; beyond the paper, `SamplingParams.guidance`): applied to
    reward-conditioned evaluations (a `--reward-token`); the others decode unguided and record w = 0.
    hf backend only; each guided row decodes a twin, so decoding costs ~2x."""
    pass_samples: int
    """Answers sampled per entry for pass@1, at `rl.temperature` / `rl.top_p` (`pass_sampling`); 0 = greedy
    only. pass@1 = the mean over entries of the share of an entry's samples that succeed."""

    def __post_init__(self) -> None:
        if not 0 <= self.pass_samples <= MAX_OUTPUTS:
            raise ValueError(f"pass_samples must be in [0, {MAX_OUTPUTS}]")
        if self.guidance < 0 or (self.guidance > 0 and self.decode.backend != "hf"):
            raise ValueError("guidance must be >= 0, and > 0 needs backend hf")
        check_n_boot(self.n_bootstrap)
        if self.limit is not None and self.limit < 1:
            raise ValueError("limit must be null or >= 1")
        if not 1 <= self.official_max_steps_per_turn <= MAX_OUTPUTS:
            raise ValueError(f"official_max_steps_per_turn must be in [1, {MAX_OUTPUTS}]")


def result_row(traj, entry: Entry) -> dict:
    """One held-out entry's row: success under the evaluated protocol (`valid`: the paper reward under
    `paper`, the official verdict under `official`; single-turn: BFCL's AST verdict under both), the task's
    partial credit (`Task.partial_credit`) and the trajectory's bookkeeping."""
    s = traj.score
    paper = traj.protocol == "paper"
    partial, kind = task_of(entry).partial_credit(entry, s, traj.result, traj.protocol)
    return {
        "id": traj.entry_id, "task": task_of(entry).name, "category": traj.category, "protocol": traj.protocol,
        "result": traj.result, "valid": bool(s["paper_reward"] == 1.0) if paper else bool(s["valid"]),
        "official_valid": bool(s["valid"]), "error_type": s["error_type"], "paper_reward": s["paper_reward"],
        "partial_credit": partial, "partial_credit_kind": kind,
        "termination": traj.termination, "n_steps": traj.n_steps, "n_model_tokens": traj.n_model_tokens,
        "reward_token": traj.reward_token,
    }


def summarize(rows: list[dict], label: str, n_boot: int, seed: int) -> dict:
    """Accuracy (%) per category and overall (stratified) with 95% bootstrap CIs, as report.py draws them;
    where the rows carry pass@1 (`pass1`), the same for it."""
    def pct(vals, strata=None):
        lo, hi = bootstrap_ci(vals, strata, n_boot=n_boot, seed=seed)
        return {"accuracy": 100 * sum(vals) / len(vals), "ci": [100 * lo, 100 * hi]}

    def cell(subset, strata=None):
        out = {"n": len(subset), **pct([float(r["valid"]) for r in subset], strata),
               "partial_credit": sum(r["partial_credit"] for r in subset) / len(subset),
               "paper_reward": sum(r["paper_reward"] for r in subset) / len(subset)}
        if "pass1" in subset[0]:
            out["pass1"] = pct([r["pass1"] for r in subset], strata)
        return out

    cats = [c for c in ALL_CATEGORIES if any(r["category"] == c for r in rows)]
    overall = cell(rows, [r["category"] for r in rows])
    return {
        "label": label, "task": rows[0]["task"], "n": len(rows), "protocol": rows[0]["protocol"],
        "categories": {c: cell([r for r in rows if r["category"] == c]) for c in cats},
        "overall": overall, "accuracy": overall["accuracy"], "partial_credit": overall["partial_credit"],
        "paper_reward": overall["paper_reward"], "paper_table1_overall": None,
        "partial_credit_kind": rows[0]["partial_credit_kind"],
        "terminations": dict(collections.Counter(r["termination"] for r in rows)),
        "n_model_tokens": sum(r["n_model_tokens"] for r in rows),
        "mean_steps": sum(r["n_steps"] for r in rows) / len(rows),
    }


def check_side(side: str) -> str:
    """The split side a measurement reads: test (held out: what is reported) | dev (what designs are chosen
    on); anything else (train included) is an InputError."""
    if side not in SIDES:
        raise InputError(f"--side must be {' or '.join(SIDES)}, got {side!r}")
    return side


def guidance_of(cfg: EvaluateConfig, reward_token: str | None) -> float:
    """The guidance scale a run decodes with: `cfg.guidance` for a reward-conditioned run, else 0."""
    return cfg.guidance if reward_token else 0.0


def pass_sampling(cfg: EvaluateConfig, rl: RLSampling) -> SamplingParams | None:
    """How pass@1's answers are sampled: as RL samples (`rl`'s temperature and top_p), with evaluate's budgets
    and seed; None when `pass_samples` is 0."""
    if not cfg.pass_samples:
        return None
    return rl.applied(cfg.decode).sampling(cfg.seed)


def _rollouts(cfg: EvaluateConfig, backend, entries: list[Entry], k: int, proto, sampling: SamplingParams,
              reward_token: str | None, label: str, arm: str) -> list:
    """k rollouts of every entry (k consecutive per entry) in sessions of `batch_rows` rows, with a progress bar."""
    bar = Progress(len(entries) * k, desc=f"evaluate {label} ({proto.protocol}, {arm})")
    try:
        return run_rollouts(backend, entries, k, proto, sampling, lambda e, i: reward_token,
                            batch_rows=cfg.decode.batch_rows, progress=bar,
                            provenance={"source": "evaluate", "label": label, "arm": arm})
    finally:
        bar.close()


def run_eval(cfg: EvaluateConfig, prompt: PromptConfig, backend, entries: list[Entry], reward_token: str | None,
             label: str, tokens: tuple[str, ...] = DEFAULT_LEVELS,
             sampled: SamplingParams | None = None) -> tuple[list, list[dict], dict]:
    """(greedy trajectories, per-entry rows, summary) of `entries` under `prompt.protocol`. With `sampled`
    (`pass_sampling`) also `cfg.pass_samples` sampled answers per entry: each row's `pass_samples` (their
    verdicts) and `pass1` (their mean), the summary's `pass1` cells and `pass_at_1` settings. `tokens`: the
    pipeline's reward tokens, lowest first (guidance contrasts the highest with the lowest; both arms)."""
    protocol = prompt.protocol
    proto = prompt.protocol_config(cfg.decode.max_outputs if protocol == "paper" else cfg.official_max_steps_per_turn)
    w = guidance_of(cfg, reward_token)
    guide = {"guidance": w, "guidance_pair": reward_pair_ids(backend.tokenizer, (tokens[-1], tokens[0])) if w else None}
    t0 = time.perf_counter()
    trajs = _rollouts(cfg, backend, entries, 1, proto, cfg.decode.sampling(cfg.seed, **guide), reward_token, label,
                      "greedy")
    wall = time.perf_counter() - t0
    rows = [result_row(t, e) for t, e in zip(trajs, entries)]
    k = cfg.pass_samples if sampled is not None else 0
    if k:
        samples = _rollouts(cfg, backend, entries, k, proto, dataclasses.replace(sampled, **guide), reward_token,
                            label, "sampled")
        for i, row in enumerate(rows):
            row["pass_samples"] = [result_row(t, entries[i])["valid"] for t in samples[i * k:(i + 1) * k]]
            row["pass1"] = sum(row["pass_samples"]) / k
    summary = summarize(rows, label, cfg.n_bootstrap, cfg.seed)
    summary.update(guidance=w, wall_time_s=round(wall, 1), rollouts_per_s=len(rows) / wall,
                   model_tokens_per_s=summary["n_model_tokens"] / wall)
    if k:
        summary["pass_at_1"] = {"samples": k, "temperature": sampled.temperature, "top_p": sampled.top_p,
                                "wall_time_s": round(time.perf_counter() - t0 - wall, 1)}
    return trajs, rows, summary


def write_outputs(folder: Path, trajs: list, rows: list[dict], summary: dict, title: str) -> None:
    """results.jsonl, trajectories.jsonl, accuracy.csv and accuracy.png under `title` (`split_title`: the task
    and the side of the split the entries come from)."""
    write_jsonl(folder / "results.jsonl", rows)
    write_trajectories(folder / "trajectories.jsonl", as_stage_output(trajs, f"evaluate:{summary.get('label', '')}"))
    lines = ["category,accuracy,ci_low,ci_high,n"]
    for cat, c in [*summary["categories"].items(), ("overall", summary["overall"])]:
        lines.append(f"{cat},{c['accuracy']:.2f},{c['ci'][0]:.2f},{c['ci'][1]:.2f},{c['n']}")
    write_text(folder / "accuracy.csv", "\n".join(lines) + "\n")
    accuracy_plot([{**summary, "paper_table1_overall": paper_overall(summary["task"], summary["label"])}],
                  folder / "accuracy.png", dict(ROWS), title)



def report_markdown(summary: dict, settings: dict, official: dict | None) -> str:
    def pct(c: dict | None) -> str:
        return "n/a" if c is None else f"{c['accuracy']:.1f} [{c['ci'][0]:.1f}, {c['ci'][1]:.1f}]"

    def table(s: dict) -> list[str]:
        out = ["| category | n | greedy accuracy % [95% CI] | pass@1 % [95% CI] | partial credit | paper reward |",
               "|---|---|---|---|---|---|"]
        for cat, c in [*s["categories"].items(), ("**overall**", s["overall"])]:
            out.append(f"| {cat} | {c['n']} | {pct(c)} | {pct(c.get('pass1'))} | "
                       f"{c['partial_credit']:.3f} | {c['paper_reward']:.3f} |")
        return out

    lines = [f"# Evaluation: {summary['label']} ({summary['task']})", ""]
    lines += [f"- {k}: `{v}`" for k, v in settings.items()]
    lines += ["", f"## {side_name(settings['side']).capitalize()} split, `{summary['task']}` task, "
              f"`{summary['protocol']}` protocol", "",
              *table(summary), ""]
    p = summary.get("pass_at_1")
    sampled = (f"pass@1: the mean share of {p['samples']} answers per entry sampled at T = {p['temperature']}, "
               f"top-p {p['top_p']}, that succeed; " if p else "pass@1: not sampled (pass_samples 0); ")
    lines.append(f"Accuracy: {get_task(summary['task']).accuracy}, greedy; {sampled}"
                 f"partial credit: {summary['partial_credit_kind']}; CIs: 95% percentile bootstrap over entries "
                 "(overall stratified by category).")
    lines += ["", f"Terminations: {summary['terminations']}; mean steps {summary['mean_steps']:.2f}; "
              f"{summary['n_model_tokens']} model tokens in {summary['wall_time_s']} s "
              f"({summary['model_tokens_per_s']:.1f} tok/s, {summary['rollouts_per_s']:.2f} rollouts/s).", "",
              "![accuracy](accuracy.png)", ""]
    if official:
        lines += ["## Official protocol, all entries", "", *table(official), "",
                  f"Terminations: {official['terminations']}.", ""]
    return "\n".join(lines)


def flat_metrics(summary: dict, prefix: str = "") -> dict:
    out = {f"{prefix}accuracy": summary["accuracy"], f"{prefix}partial_credit": summary["partial_credit"],
           f"{prefix}paper_reward": summary["paper_reward"], f"{prefix}n_model_tokens": summary["n_model_tokens"],
           f"{prefix}wall_time_s": summary["wall_time_s"], f"{prefix}model_tokens_per_s": summary["model_tokens_per_s"]}
    out.update({f"{prefix}accuracy_{c}": v["accuracy"] for c, v in summary["categories"].items()})
    if "pass1" in summary["overall"]:
        out[f"{prefix}pass1"] = summary["overall"]["pass1"]["accuracy"]
        out.update({f"{prefix}pass1_{c}": v["pass1"]["accuracy"] for c, v in summary["categories"].items()})
    return out
