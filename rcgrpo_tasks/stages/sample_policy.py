"""sample_policy stage: a model's own rollouts on one side of the split: the SFT model on train entries (the
on-policy half of the RCTP data: `sample_policy@rctp`), and each RL init on RL's prompts (`--side rl`, the
init's reward goal: `sample_policy@pool-<init>`), whose success per prompt chooses RL's pool (`rl.pool_band`).

Reads `--model-dir` (`models/base`) + `--adapter-dir` (`models/sft/sft`, loaded through the backend
registry exactly as `evaluate` loads a trained output: `engine.hf.HFBackend` -> `engine.models.load_trained`),
`--entries` / `--split` (prepare_data; the `--side` sampled) and params sections `sample_policy`
(`data.onpolicy.SampleConfig`), `prompt` (THE shared prompt) and `generate_trajectories.reward` (THE
definition of success R for every trajectory set). Writes `--out` (trajectory JSONL, the schema of
`data/trajectories.jsonl`, `provenance.source = policy`, `provenance.kind = on_policy`) and `--metrics`
(success rate on train, entries with both outcomes, samples used, rounds, timings), both atomically.

Sampling: every chosen entry is rolled `samples_per_entry` times per round at `temperature` (paper: 0.7),
all entries of a round decoded together; an entry is sampled again while it lacks a success or a failure,
up to `max_samples_per_entry` (`data.onpolicy`). Every rollout is kept, scored by the shared scorer, with
provenance (model, adapter, backend, sampling, round, sample index, seeds). Rollouts are cut where the
trajectory sets are cut (model context minus the reward goal's room), so the GX gate's length check holds.
In dvc.yaml the same stage then gates the file (`rcgrpo validate-trajectories --no-balance`: leakage,
unknown ids, schema, labels; no balance check on raw samples); label_rewards@rctp pairs and balances.

Run: `rcgrpo sample-policy --params params.yaml --model-dir models/base --adapter-dir models/sft/sft
--entries data/entries.jsonl --split data/split.json --out data/policy/trajectories.jsonl
--metrics metrics/sample_policy.json`
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import typer

from rcgrpo_tasks.data.dataset import GenerateConfig, check_task
from rcgrpo_tasks.data.onpolicy import SampleConfig, pick_entries, sample_policy
from rcgrpo_tasks.engine.backend_registry import load_backend
from rcgrpo_tasks.engine.compute import load_compute, resolve_compute
from rcgrpo_tasks.engine.models import model_context
from rcgrpo_tasks.engine.trajectory import write_trajectories
from rcgrpo_tasks.env.entries import split_entries
from rcgrpo_tasks.env.prompt import GOAL_RESERVE, PromptConfig
from rcgrpo_tasks.env.tasks import task_of_entries
from rcgrpo_tasks.ops import tracking, tracking_log
from rcgrpo_tasks.ops.cli import Progress, cli_errors
from rcgrpo_tasks.ops.config import as_dict, load_config, seeded
from rcgrpo_tasks.ops.inputs import InputError
from rcgrpo_tasks.ops.outputs import write_json

app = typer.Typer(add_completion=False)


@app.command()
def main(
    params: Path = typer.Option(Path("params.yaml"), help="params (sections `sample_policy`, `prompt`, `generate_trajectories`)."),
    model_dir: Path = typer.Option(Path("models/base"), help="base model folder (prepare_model)."),
    adapter_dir: str = typer.Option("models/sft/sft", help="sft-stage output sampled (empty = the base model)."),
    entries: Path = typer.Option(Path("data/entries.jsonl"), help="entries JSONL (prepare_data)."),
    split: Path = typer.Option(Path("data/split.json"), help="split JSON (prepare_data)."),
    side: str = typer.Option("train", help="the split side sampled: train (the SFT part: RCTP's own failures) | "
                             "rl (RL's prompts: its pool is chosen by their success)."),
    reward_token: str = typer.Option("", help="reward goal of every rollout (an RCTP init: '<|high_reward|>'); "
                                     "empty = none."),
    out: Path = typer.Option(Path("data/policy/trajectories.jsonl"), help="output: every rollout, trajectory JSONL."),
    metrics: Path = typer.Option(Path("metrics/sample_policy.json"), help="output: metrics JSON."),
    grid_seed: int | None = typer.Option(None, help="The grid seed of this run (params `grid.seeds`; MLflow tags "
                                         "rcgrpo.cell / rcgrpo.seed): sample_policy.seed + it seeds the sampling."),
) -> None:
    """Sample the SFT model on train entries until each has a success and a failure (capped)."""
    with cli_errors():
        cfg = load_config(SampleConfig, params, "sample_policy")
        cfg = replace(cfg, seed=seeded(cfg.seed, grid_seed))
        prompt = load_config(PromptConfig, params, "prompt")
        gen = load_config(GenerateConfig, params, "generate_trajectories")
        if side not in ("train", "rl"):
            raise InputError(f"--side must be train or rl, got {side!r}")
        train = split_entries(entries, split, side)
        check_task(gen, prompt, task_of_entries(train))
        chosen = pick_entries(train, cfg, side)
        if not chosen:
            raise InputError(f"{split}: no {side} entries in categories {list(cfg.categories or [])} (empty: any)")
        cfg.decode.check_context(model_dir, f"{params}:sample_policy.max_new_tokens")
        # THE dtype rule, once: the backend decodes in it, the metrics record it whole
        compute = resolve_compute(load_compute(params), decode=cfg.decode.dtype, model_dir=model_dir)
        backend = load_backend(cfg.decode.backend, model_dir, adapter_dir or None,
                               **compute.backend_kwargs())  # before any MLflow run
        # Cut rollouts where the trajectory sets are cut: the model's context minus the reward goal's room.
        backend.max_positions = min(backend.max_positions, gen.max_tokens or model_context(model_dir) - GOAL_RESERVE)
    typer.echo(f"sample_policy: decoding on {backend.describe().get('device', cfg.decode.backend)}")
    origin = {"model": str(model_dir), "adapter": adapter_dir or None, "policy_backend": cfg.decode.backend,
              "side": side}
    run_params = {"sample_policy": as_dict(cfg), "prompt": as_dict(prompt), "reward": gen.reward, **origin}
    tags = tracking_log.grid_tags("rctp" if reward_token else "sft", grid_seed)
    with tracking.published_run("sample_policy", run_params, outputs=(out, metrics), tags=tags) as (_, staged), \
            cli_errors():
        bar = Progress(len(chosen) * cfg.max_samples_per_entry, "on-policy samples (at most)")
        try:
            rows, record = sample_policy(backend, chosen, cfg, prompt.protocol_config(cfg.decode.max_outputs), gen.reward,
                                         origin, progress=bar, reward_token=reward_token or None)
        finally:
            bar.close()
        record["n_side_entries"], record["side"], record["reward_token"] = len(train), side, reward_token or None
        record["dtype"] = compute.record()
        record["reward_fn"] = gen.reward
        write_trajectories(staged.file(out), rows)
        write_json(staged.file(metrics), record)
        tracking_log.log_metrics({k: v for k, v in record.items()
                              if isinstance(v, (int, float)) and not isinstance(v, bool)})
        tracking_log.log_dict(record, "sample_policy_metrics.json")
    typer.echo(f"wrote {out}: {record['samples']} samples of {record['n_entries']} {side} entries in "
               f"{record['rounds']} round(s); success rate {record['success_rate_first_round']} (first round), "
               f"{record['entries_with_both']} entries with both outcomes, in {record['seconds']} s")


if __name__ == "__main__":
    app()
