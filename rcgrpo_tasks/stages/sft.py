"""sft stage: SFT (experts only) and RCTP-FT (reward-token-labelled mixed data) with TRL + PEFT LoRA.

One command, two kinds of run (`dvc.yaml`: `sft`, and `rctp@<seed>` once per grid seed): `--variant` picks the
overrides in `params.yaml:sft.variants` (the paper: 2 epochs SFT, 5 epochs RCTP); `--grid-seed` adds the grid
seed to the variant's seed and tags the MLflow run.
Reads: `--model-dir` (base model folder, `prepare_model`), `--data` (a `label_rewards` chat dataset:
rows `{"messages", "trajectory_id", "entry_id", "reward_token", "reward"}`), `params.yaml` sections `sft`,
`label_rewards` (its `tokens` are the reward tokens) and `compute` (`device`: auto | cpu | cuda; it logs
one line saying where it trains and records `placement` in the metrics JSON and MLflow params; a
micro-batch that runs out of memory is halved and the gradient accumulation doubled, with a warning).
Writes: `--out` (atomically): a standard PEFT adapter folder + the extended tokenizer + `rcgrpo_sft.json`
(or, with `full_finetune`, a full model folder); `--metrics` (JSON summary), `--plots` (per-step TSV for
`dvc plots`); `--checkpoints` (periodic Trainer checkpoints, a DVC `persist` output: a killed run re-run
with the same params, inputs and training code resumes from the last complete one; others discard them).
Processes: params `compute.processes` N > 1 runs this command again under `accelerate launch` in N processes
(`train.common.distributed`; docs/multi-gpu.md): micro-batch `batch_size` per process, the main process alone writes.
SIGTERM (dvc / Prefect cancel): one line on stderr; the current step is checkpointed (or, past `callbacks.STOP_GRACE_S`,
the run stops at once), the MLflow run ends KILLED, nothing is published, exit 143.
MLflow (via `tracking`): params (config, data/model hashes), step metrics (loss, lr, grad norm, tokens/s),
system metrics, the final adapter (`mlflow.transformers`, base = the local model folder).

How it trains (`rcgrpo_tasks.train.sft`): loss on assistant tokens only (`data.chat.assistant_token_mask`,
the ONE mask of the project); the reward tokens (`<|low_reward|>`, `<|high_reward|>`, any configured level)
added as special tokens, the embeddings resized, their rows trained through PEFT `trainable_token_indices`
(saved in the adapter, ~KBs); CPU speed knobs compared by bench/sft_throughput.py.
Consumers load a trained model with `rcgrpo_tasks.engine.models.load_trained(model_dir, adapter_dir)`
(tokenizer from the adapter folder, base embeddings resized to it, then `PeftModel.from_pretrained`).
Run: `rcgrpo sft --variant rctp --grid-seed 0 --model-dir models/base --data data/datasets/rctp.jsonl
--init-adapter models/sft/sft --out models/rctp/0 --checkpoints checkpoints/rctp/0 --metrics metrics/rctp/0.json
--plots plots/rctp/0.tsv`.
RCTP from the SFT model (`init: sft`, `--init-adapter models/sft/sft`): the SFT adapter merged into the
base, then a fresh LoRA and the reward-token rows; the output is the merged model folder. `margin_every`:
the teacher-forced margin on dev entries (`--entries`, `--split`) along training (metrics JSON
`margin_curve`, MLflow `margin`).
Departures from the paper: LoRA (+ trainable reward-token rows) instead of full fine-tuning by default,
tiny step budgets on CPU (`configs/paper.yaml` holds the paper's values).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import typer

from rcgrpo_tasks.engine.compute import load_compute
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.ops.cli import cli_errors
from rcgrpo_tasks.ops.config import load_config, seeded
from rcgrpo_tasks.train.common import distributed, placement
from rcgrpo_tasks.train.sft.config import SftRun
from rcgrpo_tasks.train.sft.run import load_sft_config, train_variant

app = typer.Typer(add_completion=False)


@app.command()
def main(
    variant: str = typer.Option(..., help="Variant in params.yaml:sft.variants (sft | rctp)."),
    params: Path = typer.Option(Path("params.yaml"), help="Params file (sections `sft`, `label_rewards`, `compute`)."),
    model_dir: Path = typer.Option(Path("models/base"), help="Base model folder (prepare_model)."),
    data: Path = typer.Option(..., help="Chat dataset JSONL (label_rewards: sft.jsonl or rctp.jsonl)."),
    out: Path = typer.Option(..., help="Output: PEFT adapter folder (+ tokenizer), replaced atomically."),
    checkpoints: Path = typer.Option(..., help="Checkpoint folder (resume point; emptied on other params)."),
    metrics: Path | None = typer.Option(None, help="Output: summary metrics JSON."),
    plots: Path | None = typer.Option(None, help="Output: per-step TSV (dvc plots)."),
    init_adapter: str = typer.Option("", help="sft@sft output to start from (params `init: sft`); empty = none."),
    entries: Path | None = typer.Option(None, help="Entries JSONL (prepare_data): the margin curve's held-out entries."),
    split: Path | None = typer.Option(None, help="Split JSON (prepare_data): the margin curve's dev side."),
    grid_seed: int | None = typer.Option(None, help="The grid seed of an RCTP run (params `grid.seeds`): the "
                                         "variant's seed + it seeds the run; MLflow tags rcgrpo.cell / rcgrpo.seed."),
) -> None:
    """SFT / RCTP fine-tuning with TRL SFTTrainer + PEFT LoRA."""
    options = dict(locals())  # this command's arguments, to run it again under a launch
    spec = SftRun(variant, model_dir, data, out, checkpoints, metrics, plots,
                  Path(init_adapter) if init_adapter else None, entries, split, grid_seed)
    with cli_errors():
        cfg, tokens = load_sft_config(params, variant)
        cfg = replace(cfg, seed=seeded(cfg.seed, grid_seed))
        prompt = load_config(PromptConfig, params, "prompt") if cfg.margin_every else None  # the margin curve's
        compute = load_compute(params)
        device = placement.train_device(compute.device)  # a device this machine lacks fails here, before anything loads
        spec = spec.reading(cfg)
        spec.check()
        spec.check_against(cfg)
        if distributed.should_launch(compute):  # N processes: this command again, under accelerate launch
            raise typer.Exit(distributed.relaunch(compute, device, "sft", options))
        summary = train_variant(cfg, tokens, spec, compute=compute, prompt=prompt)
    if summary:
        typer.echo(json.dumps({k: summary.get(k) for k in ("variant", "steps", "loss_first", "loss_last",
                                                           "tokens_per_s", "train_s", "resumed_from")}))


if __name__ == "__main__":
    app()
