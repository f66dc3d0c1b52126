"""Stage `promote`: register the best RC-GRPO adapter and move the registry alias `champion` if it wins.

Reads a metrics JSON (the `report` stage's `report.json`, or any JSON holding one held-out accuracy per
candidate, located by `metric_key` with `{label}` substituted) and one model folder per candidate
(`--candidate LABEL=DIR`, e.g. `rctp-rc_grpo=models/rl/rctp-rc_grpo`). The candidate with the highest
held-out accuracy is logged as the `model` artifact of an MLflow `promote` run and registered as a new
version of `model_name`. The alias (`champion`) moves to it only if its accuracy beats the current
champion's by more than `min_improvement`: a tie keeps the current champion; no champion (or a champion
whose accuracy was never recorded) means the candidate becomes champion. The decision, the reason and
both numbers go to the run (metrics + tags), to the version's tags, and to `--out` (JSON, DVC metric).

Run: `rcgrpo promote --params params.yaml --report results/report/report.json \
  --candidate rctp-rc_grpo=models/rl/rctp-rc_grpo --out results/promote/decision.json`.
Departs from the paper: the paper has no registry; this is the project's deployment gate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import typer

from rcgrpo_tasks.config import ConfigError, load_config
from rcgrpo_tasks.io import InputError, write_json

ACC_TAG = "heldout_accuracy"


@dataclass(frozen=True)
class PromoteConfig:
    model_name: str = "rcgrpo-agent"
    """Registered model name in the MLflow registry."""
    alias: str = "champion"
    """Alias that points at the serving model; moved only when the candidate wins."""
    metric_key: str = "rows.{label}.overall.accuracy"
    """Dotted path to a candidate's held-out accuracy in the metrics JSON; `{label}` = candidate label."""
    min_improvement: float = 0.0
    """The candidate must beat the champion by strictly more than this (same unit as the metric)."""

    def __post_init__(self) -> None:
        if not self.model_name or not self.alias:
            raise ValueError("model_name and alias must be non-empty")
        if self.min_improvement < 0:
            raise ValueError(f"min_improvement must be >= 0, got {self.min_improvement}")


def read_accuracy(metrics: dict, key: str, label: str, where: str = "metrics") -> float:
    node = metrics
    path = key.format(label=label)
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise InputError(f"{where}: no value at {path!r} (candidate {label!r})")
        node = node[part]
    try:
        value = float(node)
    except (TypeError, ValueError) as exc:
        raise InputError(f"{where}: {path!r} is not a number: {node!r}") from exc
    if math.isnan(value):
        raise InputError(f"{where}: {path!r} is NaN")
    return value


def decide(candidate: float, champion: float | None, min_improvement: float = 0.0) -> tuple[bool, str]:
    """(promote?, reason). Pure: ties keep the champion; a missing champion loses by default."""
    if champion is None or math.isnan(champion):
        return True, "no comparable champion"
    if candidate > champion + min_improvement:
        return True, f"candidate {candidate:.4g} beats champion {champion:.4g}"
    if candidate == champion:
        return False, f"tie at {candidate:.4g}: champion kept"
    return False, f"candidate {candidate:.4g} does not beat champion {champion:.4g} (+{min_improvement:g})"


def _champion(client, name: str, alias: str) -> tuple[object | None, float | None]:
    """The version the alias points at and its recorded accuracy (None if no alias / no number)."""
    try:
        version = client.get_model_version_by_alias(name, alias)
    except Exception as exc:  # RESOURCE_DOES_NOT_EXIST: no registered model or no alias yet
        if "RESOURCE_DOES_NOT_EXIST" in str(exc) or "not found" in str(exc).lower():
            return None, None
        raise
    value = version.tags.get(ACC_TAG)
    return version, float(value) if value is not None else None


def _register(client, name: str, source: str, run_id: str, tags: dict):
    """A new version of `name` from a plain artifact folder (MLflow 3's `register_model("runs:/...")`
    wants a logged model; an adapter folder is not one)."""
    try:
        client.get_registered_model(name)
    except Exception as exc:
        if "RESOURCE_DOES_NOT_EXIST" not in str(exc) and "not found" not in str(exc).lower():
            raise
        client.create_registered_model(name)
    return client.create_model_version(name, source=source, run_id=run_id, tags=tags)


def promote(cfg: PromoteConfig, metrics: dict, candidates: dict[str, Path], where: str = "metrics") -> dict:
    """Register the best candidate and move the alias if it wins; returns the decision record."""
    from rcgrpo_tasks import tracking

    if not candidates:
        raise InputError("no --candidate given")
    scores = {label: read_accuracy(metrics, cfg.metric_key, label, where) for label in candidates}
    best = max(scores, key=lambda label: scores[label])
    model_dir = Path(candidates[best])
    if not model_dir.is_dir() or not any(model_dir.iterdir()):
        raise InputError(f"{model_dir}: model folder of candidate {best!r} is missing or empty")
    with tracking.stage_run("promote", cfg, tags={"promote.candidate": best}) as run:
        client = tracking.mlflow_module().MlflowClient()
        old, old_acc = tracking.call("read champion", _champion, client, cfg.model_name, cfg.alias)
        tracking.log_artifact(model_dir, "model")
        version = tracking.call("register model version", _register, client, cfg.model_name,
                                f"{run.info.artifact_uri}/model", run.info.run_id,
                                {ACC_TAG: str(scores[best]), "label": best})
        promoted, reason = decide(scores[best], old_acc, cfg.min_improvement)
        if old is not None and old_acc is None:
            reason = f"champion v{old.version} has no recorded {ACC_TAG}: replaced"
        if promoted:
            tracking.call("set alias", client.set_registered_model_alias, cfg.model_name, cfg.alias,
                           version.version)
        record = {"model_name": cfg.model_name, "alias": cfg.alias, "candidate": best,
                  "candidate_version": int(version.version), "candidate_accuracy": scores[best],
                  "champion_version": int(old.version) if old is not None else None,
                  "champion_accuracy": old_acc, "promoted": promoted, "reason": reason,
                  "all_candidates": scores, "run_id": run.info.run_id}
        tracking.log_metrics({"candidate_accuracy": scores[best], "champion_accuracy": old_acc,
                              "promoted": int(promoted)})
        tracking.set_tags({"promote.decision": "promoted" if promoted else "kept", "promote.reason": reason})
        tracking.log_dict(record, "decision.json")
        tracking.call("tag version", client.set_model_version_tag, cfg.model_name, version.version,
                       "promote.decision", "promoted" if promoted else "kept")
    return record


app = typer.Typer(add_completion=False)


@app.command()
def main(
    params: Path = typer.Option(Path("params.yaml"), help="Params file (section `promote`)."),
    report: Path = typer.Option(..., help="Metrics JSON with the candidates' held-out accuracy."),
    candidate: list[str] = typer.Option(..., help="LABEL=MODEL_DIR of a candidate adapter (repeat)."),
    out: Path = typer.Option(Path("results/promote/decision.json"), help="Output: decision JSON."),
) -> None:
    """Register the best RC-GRPO adapter and move the `champion` alias if it wins."""
    import json

    from rcgrpo_tasks.tracking import TrackingError

    try:
        cfg = load_config(PromoteConfig, params, "promote")
        pairs = dict(c.split("=", 1) for c in candidate if "=" in c)
        if len(pairs) != len(candidate):
            raise InputError(f"--candidate must be LABEL=DIR, got {candidate}")
        if not report.is_file():
            raise InputError(f"{report}: metrics JSON not found; run the report stage")
        record = promote(cfg, json.loads(report.read_text()), {k: Path(v) for k, v in pairs.items()}, str(report))
    except (ConfigError, InputError, TrackingError, json.JSONDecodeError) as exc:
        typer.echo(f"promote: {exc}", err=True)
        raise typer.Exit(2) from exc
    write_json(out, record)
    typer.echo(f"{record['candidate']} v{record['candidate_version']}: "
               f"{'PROMOTED' if record['promoted'] else 'kept champion'} ({record['reason']})")


if __name__ == "__main__":
    app()
