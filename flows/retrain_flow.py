"""Prefect 3 flow `retrain`: scheduled retraining that retrains.

A round, in order (the `retrain` deployment runs it weekly; its schedule is inactive by default):
1. the profile is applied from the pristine params, as in `rcgrpo` (flows/rcgrpo_flow.py), and the MLflow
   server is checked;
2. `resolve-champion`: the registry alias (`promote.model_name` @ `promote.alias`) is resolved; its model
   folder is downloaded to `retrain/champion/model` and `retrain/champion/champion.json` records the
   version. Both are DEPENDENCIES of the retrain stages, so DVC sees a new champion;
3. `retrain/params.yaml` = the profile's params + this round's seeds (`rl.seed`, `sample_policy.seed`
   when present: base seed + round). A new round starts only when the previous one reached its
   decision; a round that failed is resumed (DVC skips what it finished). New seeds = fresh on-policy
   samples from the champion, so a round is never a cached no-op;
4. the stages of `flows/retrain.dvc.yaml` (`template`, copied to `retrain/dvc.yaml` in the worker's
   checkout, never committed, so a fresh clone's `dvc status` and the main `dvc repro` (which reads
   ./dvc.yaml) never see them): the champion's own samples of RL's prompts choose the round's pool
   (`rl.pool_band`, as the pipeline's pool_rctp stage), train a candidate from the champion on fresh on-policy
   rollouts (RC-GRPO), evaluate candidate AND champion on the same held-out entries under the same
   protocol and evaluation settings, `rcgrpo promote --champion-eval`: the alias moves only when the paired
   bootstrap CI of the difference clears `promote.min_improvement` (rcgrpo_tasks/stages/promote.py);
5. the decision (promoted / kept / refused, with the paired CI) is logged to the flow run and to the
   MLflow parent run `retrain@<profile>`; a round where DVC had nothing to run says so.

No champion yet: the flow fails at step 2 and says to run the full pipeline first.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from prefect import flow, get_run_logger, task
from prefect.runtime import flow_run

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `flows` as a package under a deployment
from flows.rcgrpo_flow import (  # noqa: E402
    apply_profile,
    check_tracking,
    close_parent_run,
    lock_hashes,
    open_parent_run,
    run_stages,
    stage_env,
)
from rcgrpo_tasks.evaluation.promotion import PromoteConfig  # noqa: E402
from rcgrpo_tasks.ops import pipeline, tracking, tracking_store  # noqa: E402
from rcgrpo_tasks.ops.config import load_with, read_params  # noqa: E402
from rcgrpo_tasks.ops.outputs import atomic_dir, write_json, write_text  # noqa: E402
from rcgrpo_tasks.ops.profiles import GENERATED  # noqa: E402

PIPELINE = "retrain/dvc.yaml"
TEMPLATE = "flows/retrain.dvc.yaml"
ROUND_FILE = "retrain/round.json"
CHAMPION_DIR = "retrain/champion"
PARAMS_FILE = "retrain/params.yaml"
DECISION_FILE = "retrain/decision.json"
SEEDED = ("rl", "sample_policy")  # sections whose `seed` a round shifts: fresh samples each round


class NoChampion(RuntimeError):
    """The registry has no champion to retrain from."""


def next_round(state: dict, champion_version: int) -> dict:
    """The round to run: the previous one again if it never reached a decision (resume), else a new one."""
    if state and not state.get("decided"):
        return {**state, "resumed": True}
    return {"round": int(state.get("round", 0)) + 1, "champion_version": champion_version, "decided": False,
            "resumed": False}


def round_params(params: dict, profile: str, round_no: int) -> str:
    """retrain/params.yaml text: the profile's params with each seeded section's `seed` shifted by the
    round; the header keeps `rcgrpo params` format (the profile a round ran under stays readable)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in params.items()}
    for section in SEEDED:
        if isinstance(out.get(section), dict):
            out[section]["seed"] = int(out[section].get("seed", 0)) + round_no
    return (f"{GENERATED}{profile}` + retrain round {round_no} (seeds shifted). Written by flows/retrain_flow.py.\n"
            + yaml.safe_dump(out, sort_keys=False))


@task(name="resolve-champion", retries=2, retry_delay_seconds=[2, 5])
def resolve_champion(repo_dir: str, model_name: str, alias: str) -> dict[str, Any]:
    """Write retrain/champion/{champion.json, model/} for the version `alias` points at (downloaded only
    when the version changed). Raises NoChampion without one."""
    mlflow = tracking_store.mlflow_module()
    client = mlflow.MlflowClient()
    try:
        version = client.get_model_version_by_alias(model_name, alias)
    except Exception as exc:
        raise NoChampion(f"registry has no {model_name}@{alias} ({tracking_store.reason(exc)}): run the full "
                         "pipeline first (its promote stage registers the first champion)") from exc
    info = {"model_name": model_name, "alias": alias, "version": int(version.version),
            "run_id": version.run_id, "source": version.source}
    folder = Path(repo_dir) / CHAMPION_DIR
    record = folder / "champion.json"
    old = json.loads(record.read_text()) if record.is_file() else None
    if old != info or not (folder / "model").is_dir():
        with atomic_dir(folder / "model") as tmp:
            tracking_store.call("download champion", mlflow.artifacts.download_artifacts,
                          artifact_uri=version.source, dst_path=str(tmp))
            inner = tmp / Path(version.source).name  # download_artifacts nests the folder's own name
            if inner.is_dir():
                for child in inner.iterdir():
                    child.rename(tmp / child.name)
                inner.rmdir()
        write_json(record, info)
    get_run_logger().info("champion: %s v%s (%s)", model_name, info["version"], version.source)
    return info


@task(name="start-round")
def start_round(repo_dir: str, profile: str, champion_version: int, template: str = TEMPLATE) -> dict:
    """Pick the round (new or resumed), write its params file and the round's DVC pipeline file (from
    `template`); returns the round state."""
    repo = Path(repo_dir)
    (repo / "retrain").mkdir(exist_ok=True)
    ignore = repo / "retrain" / ".gitignore"
    if not ignore.is_file():
        # DVC refuses a git-ignored dvc.yaml: ignore the round's files, not the pipeline and its lock.
        write_text(ignore, "# Written by flows/retrain_flow.py (per checkout).\n/*\n!/.gitignore\n!/dvc.yaml\n!/dvc.lock\n")
    text = (repo / template).read_text()
    if not (repo / PIPELINE).is_file() or (repo / PIPELINE).read_text() != text:
        write_text(repo / PIPELINE, text)
    state_path = repo / ROUND_FILE
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    state = next_round(state, champion_version)
    write_text(repo / PARAMS_FILE, round_params(read_params(repo / "params.yaml"), profile, state["round"]))
    write_json(state_path, state)
    get_run_logger().info("retrain round %d (%s) from champion v%d", state["round"],
                          "resumed" if state["resumed"] else "fresh seeds", champion_version)
    return state


@flow(name="retrain", log_prints=True)
def retrain(profile: str = "default", repo_dir: str = ".", template: str = TEMPLATE,
            stage_timeout_s: float | None = None) -> dict[str, Any]:
    """One retraining round from the registry's champion (see the module docstring).

    profile: as in the `rcgrpo` flow (pinned by the deployment). template: the DVC file of the round's
    stages (repo-relative). stage_timeout_s: stop a stage (its whole process group) that runs longer.
    """
    log = get_run_logger()
    repo = str(Path(repo_dir).resolve())
    profile_tags = apply_profile(repo, profile)
    check_tracking()
    promote_cfg = load_with(PromoteConfig, Path(repo) / "params.yaml", "promote")
    champion = resolve_champion(repo, promote_cfg.model_name, promote_cfg.alias)
    state = start_round(repo, profile, champion["version"], template)
    prefix = f"{PIPELINE}:"
    planned = [s for s in pipeline.dvc_stages(repo, with_status=False, main_only=False) if s.name.startswith(prefix)]
    order = [s.name for s in planned]
    if not order:  # e.g. retrain/ git-ignored: DVC then skips its dvc.yaml, and an empty round would look done
        raise RuntimeError(f"no stages of {PIPELINE} found by DVC in {repo}; is retrain/ ignored by git or "
                           f".dvcignore? (DVC skips ignored folders)")
    parent = open_parent_run(f"retrain@{profile}", {"round": state, "champion": champion}, {
        "git.commit": tracking.git_commit(), "prefect.flow_run_id": flow_run.id or "", "rcgrpo.plan": ",".join(order),
        "retrain.round": state["round"], "retrain.champion_version": champion["version"], **profile_tags})
    results: dict[str, str] = {}
    status, tags = "FAILED", {}
    error: BaseException | None = None
    try:
        env = stage_env(parent_run_id=parent)
        run_stages(planned, repo, env, False, 1, stage_timeout_s, results)  # one at a time: the round is a chain
        decision = json.loads((Path(repo) / DECISION_FILE).read_text())
        if all(r == "skipped" for r in results.values()):
            log.warning("nothing new: round %d from champion v%d was already decided (%s)", state["round"],
                        champion["version"], decision.get("decision"))
        log.info("gate (paired, %s entries): %s - %s", decision.get("n_entries"), decision.get("decision"),
                 decision.get("reason"))
        write_json(Path(repo) / ROUND_FILE, {**state, "decided": True, "decision": decision.get("decision")})
        tags = {"retrain.decision": decision.get("decision"), "retrain.reason": decision.get("reason", "")[:4000]}
        status = "FINISHED"
        return {"parent_run_id": parent, "round": state["round"], "stages": results, "decision": decision,
                "champion_version": champion["version"]}
    except BaseException as exc:
        error = exc
        tags["rcgrpo.error"] = f"{type(exc).__name__}: {str(exc)[:4000]}"
        raise
    finally:
        tags.update({**lock_hashes(Path(repo) / Path(PIPELINE).parent), "rcgrpo.results": json.dumps(results)})
        with contextlib.suppress(Exception) if error is not None else contextlib.nullcontext():
            close_parent_run(parent, status, tags)
