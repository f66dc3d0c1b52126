"""Stage `rl`: GRPO / RC-GRPO on TRL's `GRPOTrainer`, rolling out BFCL episodes of the pipeline's task.

What it does (one run of the grid init x algo, e.g. `rl_rctp@0-rc_grpo`; the library is `train/rl/`:
`run.py` one run end to end, `config.py`, `trainer.py`, ...; the method docs/rl.md):
1. Loads the init model: base + the SFT/RCTP adapter (`load_trained`), MERGED into the base weights, and
   hands TRL a fresh LoRA: TRL's reference (adapter disabled) is exactly the init, so the KL term anchors
   to the RCTP model, as in the paper, not to the raw base.
2. Trains with `GRPOTrainer(rollout_func=EngineRollout)`: the dataset rows are the ids of RL's pool (the
   split's `rl` side, prompts no fine-tuning stage saw, those whose success among the init's own samples
   `--pool` lies in `rl.pool_band`: `train.rl.pool.train_entries`); the rollout function runs the
   project's rollout engine on the current policy (on a CPU a merged copy refreshed every generation, in
   the dtype `rl.rollout_dtype` resolves to; on a GPU TRL's vLLM engine); multi_turn: the environment
   executes the model's calls between model steps, environment tokens carry no loss; single_turn: one
   output per rollout, scored by BFCL's AST checker.
3. Rewards come from the shared scorer: `reward` (params `rl.reward`, `env.rewards.Reward`: paper_reward =
   binary trajectory reward, default; official_verdict; partial_credit) drives the advantage; all three
   are logged.
4. Conditioning (`--conditioning`, default from the grid: `advantages.conditioning_for(init, algo)`):
   `rc` = each rollout draws its token i.i.d. (P(high)=p), advantage over the whole group (TRL's own
   group normalisation is exactly RC-GRPO's; see `train/rl/advantages.py`); `fixed` = every rollout the highest
   token; `none` = no token. The tokens are `label_rewards.tokens` (lowest first, highest last).
5. Diagnostics every step -> MLflow (`tracking`) and `--plots` TSV (`dvc plots`): reward overall and per
   token, controllability gap, fraction of zero-std groups (tolerance 1e-6), mean |A| and std of A, KL,
   clip fraction, completion / call / step counts, environment errors, rollout tokens/s, step time. The
   metrics JSON states the mechanism's averages (zero-variance share, advantage spread, gap, reward) with
   95 % bootstrap CIs over steps (`mechanism`); `evaluation.mechanism.plot_mechanism` draws GRPO vs RC-GRPO.
6. Checkpoints every `save_steps` into `--checkpoints` (machine-local resume state, not a DVC output); a
   re-run with the same params, inputs and training code resumes from the last one (other runs'
   checkpoints are discarded).
   SIGTERM (dvc / Prefect cancel): one line on stderr; the current step is checkpointed (or, past
   `callbacks.STOP_GRACE_S`, the run stops at once), the MLflow run ends KILLED, nothing is published, exit 143.
7. Placement: params `compute.device` (auto | cpu | cuda); one stderr line says where it trains, the
   metrics JSON and MLflow params carry `placement`; the rollout copy lives on the policy's device. A
   micro-batch that runs out of memory is halved and the accumulation doubled (same batch), with a warning.
8. Processes: params `compute.processes` N > 1 runs this command again under `accelerate launch` in N
   processes (`train.common.distributed`; docs/multi-gpu.md). Each decodes its own whole groups, seeded by their
   place in the batch, so the run equals one process at N x the micro-batch; the main process alone
   writes outputs, MLflow and diagnostics, from every process's rollouts. Every rollout (entry, token,
   rewards, advantage) is logged to `rollouts.jsonl` in the checkpoint folder.

Reads: params sections `rl`, `prompt` (the episode prompt every stage shares; `rl.max_outputs` is the
output budget), `compute` and `label_rewards.tokens`; `--model-dir`, `--adapter-dir`, `--entries`, `--split`.
Writes: `--out` (merged policy: HF model folder + tokenizer + `rl_adapter/` + `rcgrpo_model.json`,
atomically), `--metrics` (summary JSON), `--plots` (per-step TSV).
Run: `rcgrpo rl --init rctp --algo rc_grpo --model-dir models/base --adapter-dir models/rctp/0
--grid-seed 0 --entries data/entries.jsonl --split data/split.json --out models/rl/0/rctp-rc_grpo ...`.
Departures from the paper (docs/rl.md): tiny budgets on CPU (the paper: Qwen2.5-7B, G=5, batch 256,
400 steps -> `configs/paper.yaml`); LoRA on the merged init instead of full fine-tuning.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import typer

from rcgrpo_tasks.engine.compute import load_compute
from rcgrpo_tasks.ops.cli import cli_errors
from rcgrpo_tasks.ops.config import seeded
from rcgrpo_tasks.train.common import distributed, placement
from rcgrpo_tasks.train.rl.config import check_world
from rcgrpo_tasks.train.rl.run import load_rl_config, train_rl
from rcgrpo_tasks.train.rl.trainer import RLRun

app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])


@app.command()
def main(
    init: str = typer.Option(..., help="Init model kind: sft | rctp (names the grid cell; picks the conditioning)."),
    algo: str = typer.Option(..., help="grpo | rc_grpo | dynamic (GRPO with dynamic sampling)."),
    model_dir: Path = typer.Option(Path("models/base"), help="Base model folder (prepare_model)."),
    adapter_dir: Path | None = typer.Option(None, help="Init adapter (sft stage); omit to start from the base."),
    entries: Path = typer.Option(Path("data/entries.jsonl"), help="Entries JSONL (prepare_data)."),
    split: Path = typer.Option(Path("data/split.json"), help="Split JSON (prepare_data); the rl side is used."),
    out: Path = typer.Option(..., help="Output: merged policy folder (replaced atomically)."),
    checkpoints: Path = typer.Option(..., help="Checkpoint folder (kept across runs: resume point)."),
    metrics: Path | None = typer.Option(None, help="Output: summary metrics JSON."),
    plots: Path | None = typer.Option(None, help="Output: per-step diagnostics TSV."),
    conditioning: str | None = typer.Option(None, help="Override: rc | fixed | none (default: from init x algo)."),
    pool: str = typer.Option("", help="The init's samples of RL's prompts (sample_policy@pool-sft, "
                                      "pool_rctp@<seed>) for rl.pool_band; empty = none."),
    grid_seed: int | None = typer.Option(None, help="The grid seed of this run (params `grid.seeds`): rl.seed + it "
                                         "seeds the run; MLflow tags rcgrpo.cell / rcgrpo.seed."),
    params: Path = typer.Option(Path("params.yaml"), help="Params file (sections `rl`, `prompt`, `label_rewards`, "
                                                       "`compute`)."),
) -> None:
    """GRPO / RC-GRPO on TRL GRPOTrainer over the project's rollout engine."""
    options = dict(locals())  # this command's arguments, to run it again under a launch
    with cli_errors():
        cfg, protocol, levels = load_rl_config(params)
        cfg = replace(cfg, seed=seeded(cfg.seed, grid_seed))
        compute = load_compute(params)
        device = placement.train_device(compute.device)  # a device this machine lacks fails here, before anything loads
        spec = RLRun(init=init, algo=algo, model_dir=model_dir, adapter_dir=adapter_dir, entries=entries,
                     split=split, out=out, checkpoints=checkpoints, metrics=metrics, plots=plots,
                     conditioning=conditioning, pool=Path(pool) if pool else None, grid_seed=grid_seed)
        spec.check()
        if distributed.should_launch(compute):  # N processes: this command again, under accelerate launch
            check_world(cfg, compute.processes)  # whole groups per process, checked before anything starts
            raise typer.Exit(distributed.relaunch(compute, device, "rl", options))
        summary = train_rl(cfg, protocol, levels, spec, compute=compute)
    typer.echo(json.dumps({k: summary.get(k) for k in ("steps", "mean_reward", "mean_frac_zero_std",
                                                          "mean_controllability_gap", "resumed_from")}))


if __name__ == "__main__":
    app()
