"""The promotion gate: a paired comparison of a candidate with the registry's champion on the same held-out entries (the promote stage runs `promote`)."""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rcgrpo_tasks.evaluation.stats import paired_bootstrap_ci
from rcgrpo_tasks.ops import tracking
from rcgrpo_tasks.ops.inputs import InputError, read_json, read_jsonl

ACC_TAG = "heldout_accuracy"
RESULTS_ARTIFACT = "eval/results.jsonl"
EVAL_TAGS = ("eval.protocol", "eval.settings", "eval.entries_sha256", "eval.n")
NOT_COMPARED = frozenset({"model", "adapter", "reward_token", "backend_info", "n_bootstrap", "batch_rows"})
"""Evaluation settings that do not change a verdict (which model; how many rows decode together, as a row
samples the same in any batch; the CI's resamples): everything else must match for a paired comparison."""


@dataclass(frozen=True, kw_only=True)
class PromoteConfig:
    model_name: str
    """Registered model name in the MLflow registry."""
    alias: str
    """Alias that points at the serving model; moved only when the candidate wins the paired gate."""
    metric_key: str = "rows.{label}.overall.accuracy"
    """Unused since the paired gate (it reads per-entry results); kept so params files carrying it load."""
    min_improvement: float
    """Percentage points the paired CI's lower bound of (candidate - champion) accuracy must exceed."""
    n_bootstrap: int
    """Bootstrap resamples of the paired per-entry differences."""
    level: float
    """Confidence level of the paired CI."""
    seed: int
    """Seed of the bootstrap (a rerun reproduces the decision)."""

    def __post_init__(self) -> None:
        if not self.model_name or not self.alias:
            raise ValueError("model_name and alias must be non-empty")
        if self.min_improvement < 0:
            raise ValueError(f"min_improvement must be >= 0, got {self.min_improvement}")
        if self.n_bootstrap < 100:
            raise ValueError(f"n_bootstrap must be >= 100, got {self.n_bootstrap}")
        if not 0.5 <= self.level < 1:
            raise ValueError(f"level must be in [0.5, 1), got {self.level}")


@dataclass(frozen=True)
class EvalRecord:
    """One model's per-entry held-out results and the evaluation settings that produced them (read from the
    evaluation itself, never from the caller's params)."""

    label: str
    protocol: str
    settings: dict
    """The evaluate stage's settings (budgets, sampling, prompt), less `NOT_COMPARED`."""
    results: dict[str, float]  # entry id -> 1.0 (valid) / 0.0
    source: str

    @property
    def entries_sha256(self) -> str:
        return hashlib.sha256("\n".join(sorted(self.results)).encode()).hexdigest()[:16]

    @property
    def accuracy(self) -> float:
        """Accuracy in %, as evaluate and report print it."""
        return 100.0 * sum(self.results.values()) / len(self.results)

    def tags(self) -> dict[str, str]:
        return {"eval.protocol": self.protocol, "eval.settings": json.dumps(self.settings, sort_keys=True),
                "eval.entries_sha256": self.entries_sha256, "eval.n": str(len(self.results)),
                ACC_TAG: f"{self.accuracy:.6g}"}


def parse_results(rows: list[dict], label: str, settings: dict, where: str) -> EvalRecord:
    """EvalRecord from evaluate's per-entry rows; a row without a string `id` / boolean `valid`, a
    duplicate id, mixed protocols or no rows raise InputError naming `where`."""
    results: dict[str, float] = {}
    protocols = set()
    for i, row in enumerate(rows, 1):
        entry_id, valid = row.get("id"), row.get("valid")
        if not isinstance(entry_id, str) or not isinstance(valid, bool):
            raise InputError(f"{where}: row {i} needs a string 'id' and a boolean 'valid'")
        if entry_id in results:
            raise InputError(f"{where}: row {i}: duplicate entry id {entry_id!r}")
        results[entry_id] = float(valid)
        protocols.add(str(row.get("protocol", "")))
    if not results:
        raise InputError(f"{where}: no per-entry results")
    if len(protocols) != 1:
        raise InputError(f"{where}: rows mix protocols {sorted(protocols)}")
    return EvalRecord(label, protocols.pop(), settings, results, where)


def compared_settings(metrics: dict, where: str) -> dict:
    """The settings of an evaluate `metrics.json` that must match for a paired comparison."""
    settings = metrics.get("settings") if isinstance(metrics, dict) else None
    if not isinstance(settings, dict):
        raise InputError(f"{where}: no 'settings' (not an evaluate output)")
    return {k: v for k, v in settings.items() if k not in NOT_COMPARED}


def read_eval(folder: Path, label: str) -> EvalRecord:
    """The evaluate stage's `results.jsonl` in `folder`, with the settings of its `metrics.json`."""
    folder = Path(folder)
    metrics = folder / "metrics.json"
    if not metrics.is_file():
        raise InputError(f"{metrics}: not found (an evaluate output folder holds results.jsonl and metrics.json)")
    settings = compared_settings(read_json(metrics), str(metrics))
    return parse_results(read_jsonl(folder / "results.jsonl"), label, settings, str(folder / "results.jsonl"))


def incomparable(candidate: EvalRecord, champion: EvalRecord) -> str | None:
    """Why the two records cannot be paired (None: same protocol, settings and entries)."""
    if candidate.protocol != champion.protocol:
        return (f"protocol differs: candidate {candidate.protocol!r}, champion {champion.protocol!r}; evaluate both "
                "under the same protocol (the retrain flow re-evaluates the champion) before comparing")
    keys = sorted(set(candidate.settings) | set(champion.settings))
    differ = [f"{k}: candidate {candidate.settings.get(k)!r}, champion {champion.settings.get(k)!r}"
              for k in keys if candidate.settings.get(k) != champion.settings.get(k)]
    if differ:
        return (f"evaluation settings differ ({'; '.join(differ)[:1000]}); evaluate both with the same settings "
                "(the retrain flow re-evaluates the champion) before comparing")
    if set(candidate.results) != set(champion.results):
        shared = len(set(candidate.results) & set(champion.results))
        return (f"entry sets differ: candidate {len(candidate.results)}, champion {len(champion.results)}, "
                f"{shared} shared; evaluate both on the same held-out entries")
    return None


def paired_gate(candidate: EvalRecord, champion: EvalRecord | None, cfg: PromoteConfig) -> dict:
    """{'decision': promoted|kept|refused, 'reason', 'diff', 'ci'} of the candidate against the champion.
    Pure: the CI is a paired bootstrap over the shared entries, in percentage points."""
    if champion is None:
        return {"decision": "promoted", "reason": "no champion yet", "diff": None, "ci": None}
    why = incomparable(candidate, champion)
    if why is not None:
        return {"decision": "refused", "reason": f"comparison refused: {why}", "diff": None, "ci": None}
    ids = sorted(candidate.results)
    diff, lo, hi = paired_bootstrap_ci([100 * candidate.results[i] for i in ids],
                                       [100 * champion.results[i] for i in ids],
                                       n_boot=cfg.n_bootstrap, seed=cfg.seed, level=cfg.level)
    ci = f"{diff:+.2f} pp, {cfg.level:.0%} CI [{lo:+.2f}, {hi:+.2f}] over {len(ids)} paired entries"
    if lo > cfg.min_improvement:
        return {"decision": "promoted", "reason": f"candidate beats champion: {ci}", "diff": diff, "ci": [lo, hi]}
    return {"decision": "kept", "reason": f"not better by more than {cfg.min_improvement:g} pp: {ci}",
            "diff": diff, "ci": [lo, hi]}


def _champion(client, name: str, alias: str):
    """The version the alias points at (None if no registered model or no alias yet)."""
    try:
        return client.get_model_version_by_alias(name, alias)
    except Exception as exc:  # RESOURCE_DOES_NOT_EXIST: no registered model or no alias yet
        if "RESOURCE_DOES_NOT_EXIST" in str(exc) or "not found" in str(exc).lower():
            return None
        raise


def champion_record(client, version) -> EvalRecord | None:
    """The per-entry record a version was registered with (None: a version from before the paired gate)."""
    if not all(t in version.tags for t in EVAL_TAGS) or not version.run_id:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = client.download_artifacts(version.run_id, RESULTS_ARTIFACT, tmp)
        rows = read_jsonl(path)
    where = f"{version.name} v{version.version} ({RESULTS_ARTIFACT})"
    record = parse_results(rows, f"v{version.version}", json.loads(version.tags["eval.settings"]), where)
    return EvalRecord(record.label, version.tags["eval.protocol"], record.settings, record.results, where)


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


def pick(candidates: dict[str, tuple[Path, EvalRecord]]) -> tuple[str, Path, EvalRecord]:
    """(label, model folder, record) of the most accurate candidate; its folder must hold a model."""
    if not candidates:
        raise InputError("no --candidate given")
    best = max(candidates, key=lambda label: candidates[label][1].accuracy)
    model_dir, cand = Path(candidates[best][0]), candidates[best][1]
    if not model_dir.is_dir() or not any(model_dir.iterdir()):
        raise InputError(f"{model_dir}: model folder of candidate {best!r} is missing or empty")
    return best, model_dir, cand


def promote(cfg: PromoteConfig, candidates: dict[str, tuple[Path, EvalRecord]], run,
            champion_eval: EvalRecord | None = None) -> dict:
    """Inside the active MLflow `run`: gate the best candidate against the champion and, unless the
    comparison is refused, register it as a new version (moving the alias if it wins); returns the decision.
    `champion_eval`: the champion's fresh per-entry record (else the one stored with its version)."""
    best, model_dir, cand = pick(candidates)
    client = tracking.mlflow_module().MlflowClient()
    old = tracking.call("read champion", _champion, client, cfg.model_name, cfg.alias)
    champ = champion_eval
    if champ is None and old is not None:
        champ = tracking.call("read champion results", champion_record, client, old)
    gate = paired_gate(cand, champ, cfg)
    if old is not None and champ is None:
        gate = {**gate, "decision": "promoted",
                "reason": f"champion v{old.version} has no per-entry record with its evaluation settings: replaced"}
    version = None
    if gate["decision"] != "refused":  # an incomparable candidate is not a model version of this line
        tracking.log_artifact(model_dir, "model")
        tracking.log_artifact(Path(cand.source), "eval")
        version = tracking.call("register model version", _register, client, cfg.model_name,
                                f"{run.info.artifact_uri}/model", run.info.run_id, {**cand.tags(), "label": best})
        tracking.call("tag version", client.set_model_version_tag, cfg.model_name, version.version,
                      "promote.decision", gate["decision"])
    if gate["decision"] == "promoted":
        tracking.call("set alias", client.set_registered_model_alias, cfg.model_name, cfg.alias, version.version)
    record = {"model_name": cfg.model_name, "alias": cfg.alias, "candidate": best,
              "candidate_version": int(version.version) if version is not None else None,
              "candidate_accuracy": cand.accuracy,
              "champion_version": int(old.version) if old is not None else None,
              "champion_accuracy": champ.accuracy if champ is not None else None,
              "promoted": gate["decision"] == "promoted", **gate, "protocol": cand.protocol,
              "settings": cand.settings, "n_entries": len(cand.results),
              "all_candidates": {label: c.accuracy for label, (_, c) in candidates.items()},
              "run_id": run.info.run_id}
    tracking.log_metrics({"candidate_accuracy": cand.accuracy, "champion_accuracy": record["champion_accuracy"],
                          "promoted": int(record["promoted"]), "paired_diff": gate["diff"],
                          "paired_ci_low": gate["ci"][0] if gate["ci"] else None,
                          "paired_ci_high": gate["ci"][1] if gate["ci"] else None})
    tracking.set_tags({"promote.decision": gate["decision"], "promote.reason": gate["reason"][:5000],
                       "promote.candidate": best})
    tracking.log_dict(record, "decision.json")
    return record
