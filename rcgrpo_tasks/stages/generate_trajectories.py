"""generate_trajectories stage: the mixed-quality trajectory set RCTP fine-tuning learns from.

Reads `--entries` (`data/entries.jsonl`, `Entry.to_json` rows), `--split` (`data/split.json`; only the
`train` ids are used), `--model-dir` (`models/base`: its tokenizer renders every trajectory; its weights
are the default policy) and `params.yaml` sections `generate_trajectories` and `prompt`. Writes `--out` (trajectory JSONL, one
`rcgrpo_tasks.engine.trajectory.Trajectory.to_json()` row each) and `--metrics` (counts, balance, acceptance
rates, timings), both atomically.

Three sources (`provenance.source` / `provenance.kind`):
- `expert` / `expert`: each entry's ground-truth calls replayed through the rollout engine
  (`engine.replay_calls`), so the chat is exactly what a policy sees and the observations are the REAL
  environment outputs. Departure from the paper, whose expert observations were `{"status":"success"}`.
  An expert replay that does not score 1 is dropped and counted (`experts_dropped`), never kept.
- `policy` / `policy`: rollouts sampled from a model (`policy_model`, default `--model-dir`, optional
  LoRA `policy_adapter`) with the configured temperature / top-p / max_new_tokens, `policy_samples` per
  entry on `policy_entries` entries (`engine.run_group`).
- `near_miss` / `<kind>`: gold scripts perturbed (`rcgrpo_tasks.env.multi_turn.perturb`: wrong argument value, wrong
  function, dropped call, extra call, stopping early, wrong turn), re-executed and re-scored. A candidate
  is kept only if the replayed trajectory really scores 0 under the configured reward; harmless
  perturbations (an extra `ls`) are rejected, and the acceptance rate per kind goes to the metrics.
  Without them a 135M model's own samples (mostly prose) would teach only "low reward = prose".

Every row's `provenance` holds: source, kind, generator, model/adapter/sampling (policy), the
perturbation detail, `reward_fn` and `reward` (the configured reward: `paper_reward` by default, or the
official verdict), and for scripted rows `script_score`, the scorer run on the per-turn script (the paper
protocol merges all turns into one, so its own `score.valid` is always the official checker's
`force_terminated`; `script_score.valid` is what the official scorer says about the same calls made turn
by turn). `score` holds the engine's scorer output (official verdict, paper reward, partial credit).

Balance: successes = experts (+ policy successes); failures are drawn to `success_fraction` (paper 1:1 =
0.5) with the `failure_mix` shares per source; a source that runs short hands its quota to the others;
if all fall short the successes are subsampled so the ratio holds. Everything is seeded: the same params
and inputs give the same bytes (rows carry no wall time; the `rcgrpo` command fixes PYTHONHASHSEED, since
some bfcl-eval tool replies print a Python set).

Run: `rcgrpo generate-trajectories --params params.yaml --entries data/entries.jsonl --split
data/split.json --model-dir models/base --out data/trajectories.jsonl --metrics metrics/generate_trajectories.json`
"""

from __future__ import annotations

from pathlib import Path

import typer

from rcgrpo_tasks.data.dataset import GenerateConfig, check_task, generate
from rcgrpo_tasks.engine.compute import load_compute, resolve_compute
from rcgrpo_tasks.env.entries import split_entries
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.env.tasks import task_of_entries
from rcgrpo_tasks.ops import tracking, tracking_log
from rcgrpo_tasks.ops.cli import cli_errors
from rcgrpo_tasks.ops.config import as_dict, load_config
from rcgrpo_tasks.ops.outputs import write_json, write_jsonl

app = typer.Typer(add_completion=False)


@app.command()
def main(
    params: Path = typer.Option(Path("params.yaml"), help="params file (section `generate_trajectories`)."),
    entries: Path = typer.Option(Path("data/entries.jsonl"), help="entries JSONL from prepare_data."),
    split: Path = typer.Option(Path("data/split.json"), help="train/test id split from prepare_data."),
    model_dir: Path = typer.Option(Path("models/base"), help="model folder: tokenizer + default policy."),
    out: Path = typer.Option(Path("data/trajectories.jsonl"), help="output trajectory JSONL."),
    metrics: Path = typer.Option(Path("metrics/generate_trajectories.json"), help="output metrics JSON."),
) -> None:
    """Build the mixed-quality trajectory set (expert, policy, near-miss)."""
    with cli_errors():
        cfg = load_config(GenerateConfig, params, "generate_trajectories")
        prompt = load_config(PromptConfig, params, "prompt")
        check_task(cfg, prompt, task_of_entries(split_entries(entries, split, "train")))
        key = f"{params}:generate_trajectories.max_new_tokens"
        cfg.decode.check_context(cfg.policy_model or model_dir, key)
        # THE dtype rule, once: the policy rows decode in it, the metrics record it whole
        compute = resolve_compute(load_compute(params), decode=cfg.decode.dtype, model_dir=cfg.policy_model or model_dir)
    run_params = {**as_dict(cfg), "prompt": as_dict(prompt)}
    with tracking.published_run("generate_trajectories", run_params, outputs=(out, metrics)) as (_, staged), \
            cli_errors():
        rows, record = generate(cfg, prompt, entries, split, model_dir, compute)
        record["dtype"] = compute.record()
        write_jsonl(staged.file(out), (t.to_json() for t in rows))
        write_json(staged.file(metrics), record)
        tracking_log.log_metrics({"n_rows": record["n_rows"], "n_success": record["n_success"],
                              "n_failure": record["n_failure"], "success_fraction": record["success_fraction"],
                              "experts_dropped": record["experts_dropped"], "seconds": record["seconds"]["total"]})
        tracking_log.log_dict(record, "generate_trajectories_metrics.json")
    typer.echo(f"wrote {out}: {record['n_rows']} trajectories ({record['n_success']} success / "
               f"{record['n_failure']} failure; by kind {record['by_kind']}) in {record['seconds']['total']} s")


if __name__ == "__main__":
    app()
