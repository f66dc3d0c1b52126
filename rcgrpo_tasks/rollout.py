"""`rcgrpo rollout`: roll a model over BFCL entries and write trajectory JSONL (a tool, not a DVC stage).

Reads: a model folder (`--model`, e.g. `models/base`) and an optional PEFT adapter (`--adapter`); entries
from bfcl-eval (or `--entries data/entries.jsonl`), selected by `--ids`, `--split data/split.json
--split-name train|test`, `--categories`, `--limit`. Writes `--out` (trajectories JSONL, schema in
`rcgrpo_tasks/trajectory.py`), atomically: nothing is written unless every rollout finished.
Bad input (unknown entry ids, missing model folder, malformed adapter) fails before any generation.

Example: `rcgrpo rollout --model models/base --split data/split.json --split-name test --categories base
--limit 4 --g 4 --temperature 1.0 --reward-token '<|high_reward|>' --out results/rollouts.jsonl`
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from rcgrpo_tasks import bfcl
from rcgrpo_tasks.backends import ModelLoadError, SamplingParams
from rcgrpo_tasks.io import InputError, read_jsonl

app = typer.Typer(add_completion=False)


def load_entry_pool(entries_path: Path | None) -> dict[str, bfcl.Entry]:
    """Entries by id: from a prepare_data `entries.jsonl`, else straight from bfcl-eval."""
    if entries_path is None:
        return bfcl.entries_by_id()
    pool = {}
    for i, row in enumerate(read_jsonl(entries_path), 1):
        try:
            entry = bfcl.Entry.from_json(row)
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{entries_path}: row {i}: not an entry ({exc})") from exc
        pool[entry.id] = entry
    return pool


def select_entries(pool: dict[str, bfcl.Entry], ids: list[str] | None = None, split: Path | None = None,
                   split_name: str = "test", categories: list[str] | None = None,
                   limit: int | None = None) -> list[bfcl.Entry]:
    """Entries by explicit ids and/or split side, filtered by category, capped at `limit` (in order)."""
    from rcgrpo_tasks.prepare_data import load_split

    wanted: list[str] | None = list(ids) if ids else None
    if split is not None:
        try:
            side = load_split(split).get(split_name)
        except (FileNotFoundError, ValueError) as exc:
            raise InputError(str(exc)) from exc
        if side is None:
            raise InputError(f"{split}: no split named {split_name!r}")
        wanted = side if wanted is None else [i for i in wanted if i in set(side)]
    unknown = [i for i in (wanted or []) if i not in pool]
    if unknown:
        raise InputError(f"unknown entry id(s): {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    if categories:
        bad = [c for c in categories if c not in bfcl.CATEGORIES]
        if bad:
            raise InputError(f"unknown categories {bad}; expected some of {list(bfcl.CATEGORIES)}")
    chosen = [pool[i] for i in wanted] if wanted is not None else list(pool.values())
    chosen = [e for e in chosen if not categories or e.category in categories]
    if limit is not None:
        chosen = chosen[:limit]
    if not chosen:
        raise InputError("the selection is empty (check --ids / --split / --categories / --limit)")
    return chosen


class Progress:
    """tqdm bar over rollouts showing rollouts/s and model tokens/s."""

    def __init__(self, total: int, desc: str = "rollouts"):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, unit="rollout", dynamic_ncols=True)
        self.t0, self.tokens = time.perf_counter(), 0

    def __call__(self, trajs) -> None:
        self.tokens += sum(t.n_model_tokens for t in trajs)
        self.bar.update(len(trajs))
        dt = max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix({"rollouts/s": f"{self.bar.n / dt:.2f}", "tok/s": f"{self.tokens / dt:.1f}"})

    def close(self) -> None:
        self.bar.close()


def fail(exc: Exception) -> None:
    typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(2) from exc


@app.command()
def main(
    model: Path = typer.Option(..., help="model folder (prepare_model output)."),
    out: Path = typer.Option(..., help="trajectory JSONL to write."),
    adapter: Optional[Path] = typer.Option(None, help="PEFT adapter folder (sft/rl output)."),
    entries: Optional[Path] = typer.Option(None, help="entries JSONL (prepare_data); default: bfcl-eval."),
    ids: Optional[str] = typer.Option(None, help="comma-separated entry ids."),
    split: Optional[Path] = typer.Option(None, help="split JSON (prepare_data)."),
    split_name: str = typer.Option("test", help="train | test"),
    categories: Optional[str] = typer.Option(None, help="comma-separated categories."),
    limit: Optional[int] = typer.Option(None, help="at most this many entries."),
    g: int = typer.Option(1, help="rollouts per entry (a GRPO group)."),
    protocol: str = typer.Option("paper", help="paper | official"),
    doc_style: str = typer.Option("compact", help="compact | json | official"),
    system_prompt: str = typer.Option("bfcl", help="bfcl | short"),
    max_steps: int = typer.Option(20, help="paper: model outputs per episode; official: steps per turn."),
    reward_token: Optional[str] = typer.Option(None, help="e.g. '<|high_reward|>' (all rollouts)."),
    temperature: float = typer.Option(1.0), top_p: float = typer.Option(1.0),
    max_new_tokens: int = typer.Option(256), seed: Optional[int] = typer.Option(0),
    backend: str = typer.Option("hf", help="hf | vllm"),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 | auto"),
    batch_rows: int = typer.Option(8, help="rollouts decoded together in one session."),
) -> None:
    """Roll a model over BFCL entries and write trajectory JSONL."""
    from rcgrpo_tasks.backends import load_backend
    from rcgrpo_tasks.engine import run_rollouts
    from rcgrpo_tasks.trajectory import write_trajectories

    try:
        proto = protocol_config(protocol, doc_style, system_prompt, max_steps)
        sampling = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed)
        chosen = select_entries(load_entry_pool(entries), _csv(ids), split, split_name, _csv(categories), limit)
        kwargs = {"dtype": dtype} if backend == "hf" else {}
        engine_backend = load_backend(backend, model, adapter, **kwargs)
    except (InputError, ModelLoadError, ValueError) as exc:
        fail(exc)
    bar = Progress(len(chosen) * g)
    try:
        trajs = run_rollouts(engine_backend, chosen, g, proto, sampling, lambda e, i: reward_token,
                             batch_rows=batch_rows, provenance={"source": "rollout"}, progress=bar)
    finally:
        bar.close()
    write_trajectories(out, trajs)
    ok = sum(t.score["paper_reward"] for t in trajs)
    typer.echo(f"wrote {len(trajs)} trajectories to {out}; paper reward {ok:.0f}/{len(trajs)}")


def protocol_config(protocol: str, doc_style: str, system_prompt: str, max_steps: int):
    """ProtocolConfig with `max_steps` applied where the protocol counts steps."""
    from rcgrpo_tasks.protocols import ProtocolConfig

    steps = {"max_steps": max_steps} if protocol == "paper" else {"max_steps_per_turn": max_steps}
    if protocol not in ("paper", "official"):
        raise ValueError(f"unknown protocol {protocol!r}; expected 'paper' or 'official'")
    if doc_style not in ("compact", "json", "official") or system_prompt not in ("bfcl", "short"):
        raise ValueError(f"unknown doc_style {doc_style!r} or system_prompt {system_prompt!r}")
    return ProtocolConfig(protocol=protocol, doc_style=doc_style, system_prompt=system_prompt, **steps)


def _csv(text: str | None) -> list[str] | None:
    return [t.strip() for t in text.split(",") if t.strip()] if text else None


if __name__ == "__main__":
    app()
