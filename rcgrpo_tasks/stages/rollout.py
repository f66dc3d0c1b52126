"""`rcgrpo rollout`: roll a model over BFCL entries and write trajectory JSONL (a tool, not a DVC stage).

Reads: a model folder (`--model`, e.g. `models/base`) and an optional PEFT adapter (`--adapter`); entries
from bfcl-eval (or `--entries data/entries.jsonl`), selected by `--ids`, `--split data/split.json
--split-name train|dev|test`, `--categories`, `--limit`. Writes `--out` (trajectories JSONL, schema in
`rcgrpo_tasks/engine/trajectory.py`), atomically: nothing is written unless every rollout finished.
Bad input (unknown entry ids, missing model folder, malformed adapter) fails before any generation.
The prompt (protocol, doc style, system prompt) is the pipeline's `prompt` section of `--params`
(params.yaml), so a rollout sees what training and evaluation see; `--protocol` etc. override it.

Example: `rcgrpo rollout --model models/base --split data/split.json --split-name test --categories base
--limit 4 --g 4 --temperature 1.0 --reward-token '<|high_reward|>' --out results/rollouts.jsonl`
(`--guidance 1.0` adds reward-token guidance: `SamplingParams.guidance`, hf backend.)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer

from rcgrpo.goal import DEFAULT_LEVELS
from rcgrpo_tasks.data.labels import load_reward_tokens
from rcgrpo_tasks.engine.backend import reward_pair_ids
from rcgrpo_tasks.engine.backend_registry import load_backend
from rcgrpo_tasks.engine.compute import load_compute, resolve_compute
from rcgrpo_tasks.engine.decoding import DecodeConfig
from rcgrpo_tasks.engine.rollout import run_rollouts
from rcgrpo_tasks.engine.trajectory import write_trajectories
from rcgrpo_tasks.env.entries import read_entries, select_entries
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.ops.cli import Progress, cli_errors
from rcgrpo_tasks.ops.config import ConfigError, from_dict, read_sections

app = typer.Typer(add_completion=False)


def prompt_config(params: Path | None, **overrides: str | None) -> PromptConfig:
    """`prompt` section of `params` (if the file exists) with the non-None `overrides` applied (without a params
    file, the options must name every key)."""
    base = read_sections(params, "prompt").get("prompt") or {} if params is not None and params.is_file() else {}
    values = {**base, **{k: v for k, v in overrides.items() if v is not None}}
    return from_dict(PromptConfig, values, where=f"{params}:prompt with the rollout options")


@app.command()
def main(
    model: Path = typer.Option(..., help="model folder (prepare_model output)."),
    out: Path = typer.Option(..., help="trajectory JSONL to write."),
    adapter: Path | None = typer.Option(None, help="PEFT adapter folder (sft/rl output)."),
    entries: Path | None = typer.Option(None, help="entries JSONL (prepare_data); default: bfcl-eval."),
    ids: str | None = typer.Option(None, help="comma-separated entry ids."),
    split: Path | None = typer.Option(None, help="split JSON (prepare_data)."),
    split_name: str = typer.Option("test", help="train | dev | test"),
    categories: str | None = typer.Option(None, help="comma-separated categories."),
    limit: int | None = typer.Option(None, help="at most this many entries."),
    g: int = typer.Option(1, help="rollouts per entry (a GRPO group)."),
    params: Path = typer.Option(Path("params.yaml"), help="params file whose `prompt` section is the default."),
    protocol: str | None = typer.Option(None, help="paper | official (default: params prompt)"),
    doc_style: str | None = typer.Option(None, help="compact | json | official (default: params prompt)"),
    system_prompt: str | None = typer.Option(None, help="bfcl | short (default: params prompt)"),
    max_outputs: int = typer.Option(20, help="paper: model outputs per episode; official: steps per turn."),
    reward_token: str | None = typer.Option(None, help="e.g. '<|high_reward|>' (all rollouts)."),
    temperature: float = typer.Option(1.0), top_p: float = typer.Option(1.0),
    max_new_tokens: int = typer.Option(256), seed: int | None = typer.Option(0),
    backend: str = typer.Option("hf", help="hf | vllm"),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 | auto"),
    device: str | None = typer.Option(None, help="auto | cpu | cuda | cuda:N (default: params `compute.device`)."),
    batch_rows: int = typer.Option(8, help="rollouts decoded together in one session."),
    guidance: float = typer.Option(0.0, help="reward-token guidance w (hf; needs --reward-token; 0 = off)."),
) -> None:
    """Roll a model over BFCL entries and write trajectory JSONL."""
    with cli_errors():
        prompt = prompt_config(params, protocol=protocol, doc_style=doc_style, system_prompt=system_prompt)
        decode = from_dict(DecodeConfig, {"temperature": temperature, "top_p": top_p, "max_outputs": max_outputs,
                                          "max_new_tokens": max_new_tokens, "backend": backend, "dtype": dtype,
                                          "batch_rows": batch_rows}, where="rollout options")
        proto = prompt.protocol_config(decode.max_outputs)
        if guidance and not reward_token:
            raise ConfigError("--guidance needs --reward-token (guidance contrasts the two reward goals)")
        chosen = select_entries(read_entries(entries), _csv(ids), split, split_name, _csv(categories), limit)
        compute = load_compute(params)  # where it decodes and THE dtype rule's CPU setting: params alone
        compute = dataclasses.replace(compute, device=device) if device else compute
        decode.check_context(model, "--max-new-tokens")
        resolved = resolve_compute(compute, decode=decode.dtype, model_dir=model)  # THE dtype rule, once
        engine_backend = load_backend(decode.backend, model, adapter, **resolved.backend_kwargs())
        tokens = load_reward_tokens(params) if params.is_file() else DEFAULT_LEVELS
        pair = reward_pair_ids(engine_backend.tokenizer, (tokens[-1], tokens[0])) if guidance else None
        sampling = decode.sampling(seed, guidance=guidance, guidance_pair=pair)
    typer.echo(f"rollout: decoding on {engine_backend.describe().get('device', backend)}", err=True)
    bar = Progress(len(chosen) * g)
    try:
        trajs = run_rollouts(engine_backend, chosen, g, proto, sampling, lambda e, i: reward_token,
                             batch_rows=decode.batch_rows, provenance={"source": "rollout"}, progress=bar)
    finally:
        bar.close()
    write_trajectories(out, trajs)
    ok = sum(t.score["paper_reward"] for t in trajs)
    typer.echo(f"wrote {len(trajs)} trajectories to {out}; paper reward {ok:.0f}/{len(trajs)}")


def _csv(text: str | None) -> list[str] | None:
    return [t.strip() for t in text.split(",") if t.strip()] if text else None


if __name__ == "__main__":
    app()
