"""evaluate stage: greedy rollouts of one model on one side of the split (`--side`: test, held out, what is
reported; dev, what designs are chosen on), and pass@1 from answers sampled as RL
samples them (`evaluate.pass_samples` per entry at `rl.temperature` / `rl.top_p`); metrics, report, plot, MLflow.

Reads: `params.yaml:evaluate`, a model folder (`--model`), an optional adapter / fine-tuned folder
(`--adapter`), the split (`--split data/split.json`, `--side`) and entries (`--entries`, default
bfcl-eval). `--reward-token` conditions every rollout (`<|high_reward|>` for reward-conditioned models;
empty for base/SFT). One definition serves every model through DVC `foreach` (`evaluate@base`, ...).
Writes `--out` (atomically; replaced as a whole):
- `results.jsonl`: per entry `id`, `category`, `result` (BFCL result format), `valid` (success under the
  evaluated protocol: paper reward 1 for `paper`, the official verdict for `official`), `official_valid`,
  `error_type`, `paper_reward`, `partial_credit`, `termination`, `n_steps`, `n_model_tokens`, and with
  pass@1 `pass_samples` (the sampled answers' verdicts) and `pass1` (their mean);
- `trajectories.jsonl` (full trajectories), `metrics.json` (accuracy per category and overall with 95%
  bootstrap CIs, partial credit, terminations, tokens, time), `report.md`, `accuracy.png` (bar chart
  with CIs) and `accuracy.csv` (the same numbers, for `dvc plots show`);
- with `official_full: true` also `official/` (same files) for BFCL's official protocol on all 800 entries.
Logs params, metrics, the per-entry table (`mlflow.log_table`), report and plot to an MLflow child run;
a tracking failure fails the stage (and, the output being atomic, leaves nothing behind).

Does the model still read its token (`evaluate.margin`, reward-conditioned evaluations of a model with both
reward tokens): `metrics.json` also holds the teacher-forced margin on the evaluated entries and the
reward-token rows' distance (`data.margin.read_token`, forward passes only, in float32 whatever the decoding
dtype: `HFBackend.exact_model`): RL rewards the low token for success too and can erode what RCTP taught.

Reward-token guidance (`evaluate.guidance` > 0, beyond the paper): reward-conditioned evaluations decode
with `SamplingParams.guidance` (hf backend); `metrics.json` records the scale used (`guidance`).

Partial credit: `official` = fraction of turns passing (scoring.partial_credit); `paper` = fraction of
gold calls the model made (multiset, arguments bound to parameter names) — the paper view has no turn
boundaries, so per-turn credit is undefined there.
Budget (`params.yaml:evaluate`): greedy, a stratified `limit` of the held-out entries, `max_outputs` of
`max_new_tokens`, `batch_rows` rows decoded together, entries sharing a system prompt batched so it is
prefilled once, bf16 where the CPU has it (costs per model: docs/log.md).
"""

from __future__ import annotations

from pathlib import Path

import typer

from rcgrpo_tasks.data.labels import load_reward_tokens
from rcgrpo_tasks.data.margin import REPLAY_OUTPUTS, has_tokens, read_token
from rcgrpo_tasks.engine.backend import reward_pair_ids
from rcgrpo_tasks.engine.backend_registry import load_backend
from rcgrpo_tasks.engine.compute import load_compute, resolve_compute
from rcgrpo_tasks.env.entries import read_entries, select_entries, stratified
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.evaluation.accuracy import (
    EvaluateConfig,
    RLSampling,
    check_side,
    flat_metrics,
    guidance_of,
    pass_sampling,
    report_markdown,
    run_eval,
    write_outputs,
)
from rcgrpo_tasks.evaluation.formats import split_title
from rcgrpo_tasks.ops import tracking, tracking_log
from rcgrpo_tasks.ops.cli import cli_errors
from rcgrpo_tasks.ops.config import as_dict, load_config, load_keys
from rcgrpo_tasks.ops.outputs import write_json, write_text


def _log(folder: Path, rows: list[dict], summary: dict, official: dict | None) -> None:
    metrics = flat_metrics(summary)
    if official:
        metrics.update(flat_metrics(official, "official_"))
    tracking.log_metrics(metrics)
    tracking.log_table([{**r, "result": str(r["result"])} for r in rows], "per_entry")
    for name in ("metrics.json", "report.md", "accuracy.png", "accuracy.csv"):
        tracking.log_artifact(folder / name)


app = typer.Typer(add_completion=False)


@app.command()
def main(
    model: Path = typer.Option(..., help="model folder (prepare_model output)."),
    out: Path = typer.Option(..., help="output folder (replaced atomically)."),
    split: Path = typer.Option(Path("data/split.json"), help="split JSON (prepare_data)."),
    side: str = typer.Option("test", help="test (held out: what is reported) | dev (what designs are chosen on)."),
    params: Path = typer.Option(Path("params.yaml"), help="params file (section `evaluate`)."),
    adapter: str = typer.Option("", help="PEFT adapter / fine-tuned folder; empty = none."),
    reward_token: str = typer.Option("", help="reward goal for every rollout, e.g. '<|high_reward|>'; empty = none."),
    entries: Path | None = typer.Option(None, help="entries JSONL (prepare_data); default: bfcl-eval."),
    name: str = typer.Option("", help="label in metrics/report (default: the output folder's name)."),
    margin: bool = typer.Option(True, help="--no-margin: skip the teacher-forced margin `evaluate.margin` asks for "
                                "(where another stage measures it for the same model and entries)."),
    grid_seed: int | None = typer.Option(None, help="The grid seed of the measured model (params `grid.seeds`; "
                                         "MLflow tags rcgrpo.cell / rcgrpo.seed)."),
    pass1: bool = typer.Option(True, help="--no-pass1: greedy only, whatever `evaluate.pass_samples` says (the base "
                               "model answers in prose: its samples would cost minutes to score 0)."),
) -> None:
    """Evaluate a model on one side of the split (held out by default): metrics, report, plot."""
    label = name or out.name
    with cli_errors():
        cfg = load_config(EvaluateConfig, params, "evaluate")
        cfg.decode.check_context(model, f"{params}:evaluate.max_new_tokens")
        # pass@1 samples as RL does: its temperature and top_p
        sampled = pass_sampling(cfg, load_keys(RLSampling, params, "rl")) if cfg.pass_samples and pass1 else None
        prompt = load_config(PromptConfig, params, "prompt")
        tokens = load_reward_tokens(params)
        pool = read_entries(entries)
        held_out = stratified(select_entries(pool, split=split, side=check_side(side)), cfg.limit)
        # THE dtype rule, once: the backend decodes in it, the metrics record it whole
        compute = resolve_compute(load_compute(params), decode=cfg.decode.dtype, model_dir=model)
        backend = load_backend(cfg.decode.backend, model, adapter or None, **compute.backend_kwargs())
        if guidance_of(cfg, reward_token or None):  # a model without reward tokens fails here, before any run
            reward_pair_ids(backend.tokenizer, (tokens[-1], tokens[0]))
    stage = tracking_log.stage_name("evaluate", label, grid_seed)  # the run's name: its DVC stage's
    typer.echo(f"{stage}: decoding on {backend.describe().get('device', cfg.decode.backend)}")
    token = reward_token or None
    settings = {"model": str(model), "adapter": adapter or None, "reward_token": token, "side": side,
                "grid_seed": grid_seed, **as_dict(cfg),
                "prompt": as_dict(prompt), "backend_info": backend.describe()}
    run_params = {k: v for k, v in settings.items() if k != "backend_info"}
    with tracking.published_run(stage, run_params, outputs=(out,),
                                tags={"rcgrpo.eval_label": label, **tracking_log.grid_tags(label, grid_seed)}) as (_, staged):
        trajs, rows, summary = run_eval(cfg, prompt, backend, held_out, token, label, tokens, sampled)
        pair = (tokens[-1], tokens[0])
        if cfg.margin and margin and token and cfg.decode.backend == "hf" and has_tokens(backend.tokenizer, pair):
            summary.update(read_token(backend.exact_model(), backend.tokenizer, held_out, prompt.protocol_config(REPLAY_OUTPUTS),
                                      pair, seed=cfg.seed, n_boot=cfg.n_bootstrap,
                                      max_positions=backend.max_positions))
        official = None
        if cfg.official_full:
            o_trajs, o_rows, official = run_eval(cfg, PromptConfig(**{**as_dict(prompt), "protocol": "official"}), backend,
                                                list(pool.values()), token, label, tokens)
        tmp = staged.dir(out)
        write_outputs(tmp, trajs, rows, summary, split_title(summary["task"], side))
        if official:  # BFCL's official protocol on every prepared entry, whatever the side
            write_outputs(tmp / "official", o_trajs, o_rows, official,
                          f"BFCL v4 {official['task']}, every entry, official protocol")
        summary["dtype"] = compute.record()
        write_json(tmp / "metrics.json", {**summary, "settings": settings,
                                          **({"official": official} if official else {})})
        write_text(tmp / "report.md", report_markdown(summary, settings, official))
        _log(tmp, rows, summary, official)
    pass1 = summary["overall"].get("pass1")
    typer.echo(f"{label}: accuracy {summary['accuracy']:.1f}% greedy"
               + (f", pass@1 {pass1['accuracy']:.1f}%" if pass1 else "")
               + f" on {summary['n']} {side} entries ({prompt.protocol}); wrote {out}")


if __name__ == "__main__":
    app()
