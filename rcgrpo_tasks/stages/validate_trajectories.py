"""validate_trajectories stage: a Great Expectations quality gate between generation and labelling.

Reads `--trajectories` (`data/trajectories.jsonl` from generate_trajectories), `--split` (`data/split.json`:
the held-out ids must not appear), `--model-dir` (`models/base/config.json`: the context length) and
`params.yaml` sections `validate_trajectories` plus `generate_trajectories.reward` /
`.success_fraction` (the gate checks what generation was configured to produce; one source of truth).
Writes `--out-dir` (`data/validation/`): `validation_result.json` (GX's full suite result),
`data_docs/` (GX's HTML report, if `data_docs: true`), and ONLY when every expectation passes,
`passed.json` (sha256 + row count of the validated file) — label_rewards refuses to run without a
`passed.json` matching its input, so a failed gate stops the pipeline even outside DVC. `--metrics`
gets counts, balance and pass/fail either way.

GX 1.x, used the documented way: an ephemeral context, a pandas data source with a dataframe asset, an
expectation suite, a validation definition and a checkpoint (with an UpdateDataDocs action). One row per
trajectory: scalar fields as they are, list/dict fields reduced to sizes, plus derived columns (reward,
success flag, token count, assistant message count, parses, label consistency). Expectations (`meta.check`
names them in messages): schema (exact column set), non-null fields, reward in {0, 1}, partial credit in
[0, 1], provenance source/kind/protocol in their allowed sets, >=1 assistant message, every row parses as a
Trajectory, token length within the model's context (minus room for the reward goal), expert rows score 1
and near-miss rows 0, success fraction within tolerance (not with `--no-balance`: raw on-policy samples from
sample_policy have the model's own success rate), unique trajectory ids, no held-out entry id, every id in
the train split.

A failed suite exits 1 with a summary: which check, how many rows, example values / trajectory ids.
GX is imported lazily (its import is slow). Run: `rcgrpo validate-trajectories --params params.yaml --trajectories
data/trajectories.jsonl --split data/split.json --model-dir models/base --out-dir data/validation
--metrics metrics/validate_trajectories.json`
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import typer

from rcgrpo_tasks.data.dataset import GenerateConfig
from rcgrpo_tasks.data.gate import RESULT_FILE
from rcgrpo_tasks.data.quality import ValidateConfig, validate
from rcgrpo_tasks.engine.models import model_context
from rcgrpo_tasks.env.entries import read_split
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.ops import tracking, tracking_log
from rcgrpo_tasks.ops.cli import GATE_EXIT, cli_errors
from rcgrpo_tasks.ops.config import as_dict, load_config
from rcgrpo_tasks.ops.inputs import InputError

# `id` (= entry_id) is what Trajectory.to_json adds so a trajectory file is also a BFCL result file.

app = typer.Typer(add_completion=False)
STAGE = "validate_trajectories"


def run_variant() -> str | None:
    """The DVC stage this gate runs inside when that is not its own (`sample_policy` runs it on its samples):
    the run is then `validate_trajectories@sample_policy`, named after the stage it gates."""
    dvc_stage = os.environ.get("DVC_STAGE", "").rsplit(":", 1)[-1]
    return dvc_stage if dvc_stage and dvc_stage.partition("@")[0] != STAGE else None


@app.command()
def main(
    params: Path = typer.Option(Path("params.yaml"), help="params file (sections `validate_trajectories`, `generate_trajectories`)."),
    trajectories: Path = typer.Option(Path("data/trajectories.jsonl"), help="trajectory JSONL to validate."),
    split: Path = typer.Option(Path("data/split.json"), help="train/test split (test ids must not appear)."),
    model_dir: Path = typer.Option(Path("models/base"), help="model folder (context length)."),
    out_dir: Path = typer.Option(Path("data/validation"), help="output folder: result JSON, data docs, passed.json."),
    metrics: Path = typer.Option(Path("metrics/validate_trajectories.json"), help="output metrics JSON."),
    balance: bool = typer.Option(True, help="check the success balance; --no-balance for raw on-policy samples."),
    side: str = typer.Option("train", help="split side the rows come from: train (fine-tuning sets; an RL prompt "
                             "there fails the gate) | rl (samples of RL's prompts)."),
) -> None:
    """Great Expectations quality gate on the trajectory set."""
    with cli_errors():
        cfg = load_config(ValidateConfig, params, "validate_trajectories")
        gen = load_config(GenerateConfig, params, "generate_trajectories")
        prompt = load_config(PromptConfig, params, "prompt")
        read_split(split)  # bad inputs refuse here, in a second, before any run (validate reads them again)
        if side not in ("train", "rl"):
            raise InputError(f"--side must be train or rl, got {side!r}")
        if not cfg.max_tokens:
            model_context(model_dir)
    run_params = {"validate": as_dict(cfg), "reward": gen.reward, "success_fraction": gen.success_fraction,
                  "protocol": prompt.protocol}
    with tracking.published_run(STAGE, run_params, outputs=(out_dir, metrics), variant=run_variant()) as (_, staged), \
            cli_errors(), tempfile.TemporaryDirectory() as docs:
        record, fails, text = validate(cfg, gen, prompt, trajectories, split, model_dir, out_dir, balance, metrics,
                                       staged=staged, docs_dir=Path(docs), side=side)
        tracking_log.log_metrics({k: v for k, v in record.items() if isinstance(v, (int, float))})
        tracking_log.set_tags({"rcgrpo.gate": "passed" if not fails else "failed"})
        tracking_log.log_artifact(staged.temp(out_dir) / RESULT_FILE)
        if cfg.data_docs:
            tracking_log.log_artifact(Path(docs), "data_docs")
    if fails:  # the failed result is published (to inspect); the stage fails
        typer.echo(f"{text}\nfull result: {out_dir / RESULT_FILE}", err=True)
        raise typer.Exit(GATE_EXIT)
    typer.echo(f"{trajectories}: all {record['n_expectations']} expectations passed ({record['n_rows']} rows, "
               f"success fraction {record['success_fraction']}); wrote {out_dir}")


if __name__ == "__main__":
    app()
