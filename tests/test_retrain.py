"""The `retrain` flow with a fake champion: two rounds in a row each train a NEW candidate from the
registry's current champion (fresh seeds: never a cached no-op), evaluate candidate and champion on the
same entries, and the real paired gate (`rcgrpo promote --champion-eval`) decides; its decision is
logged. The stages are tiny scripts standing in for rl/evaluate (the real ones are tested elsewhere)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import REPO_ROOT, config_from_params, write_params

sys.path.insert(0, str(REPO_ROOT))
from flows import retrain_flow as rf  # noqa: E402
from rcgrpo_tasks.ops import tracking  # noqa: E402

PY = sys.executable
FAKE = """
import json, sys, yaml
from pathlib import Path
what = sys.argv[1]
if what == "train":  # a candidate one step better than the champion, marked with the round's seed
    seed = yaml.safe_load(Path("retrain/params.yaml").read_text())["rl"]["seed"]
    q = int(Path("retrain/champion/model/quality.txt").read_text())
    out = Path("retrain/candidate"); out.mkdir(parents=True, exist_ok=True)
    (out / "quality.txt").write_text(str(q + 1)); (out / "seed.txt").write_text(str(seed))
else:  # evaluate MODEL OUT: quality q solves the first 10*q of 40 entries
    q = int(Path(sys.argv[2], "quality.txt").read_text())
    out = Path(sys.argv[3]); out.mkdir(parents=True, exist_ok=True)
    rows = [{"id": f"multi_turn_base_{i}", "protocol": "paper", "valid": i < 10 * q} for i in range(40)]
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
    (out / "metrics.json").write_text(json.dumps({"settings": {"limit": 40, "model": sys.argv[2]}}))
"""
TEMPLATE = f"""
stages:
  train:
    wdir: ..
    cmd: {PY} fake.py train
    deps: [fake.py, retrain/champion/champion.json, retrain/champion/model]
    params:
      - retrain/params.yaml: [rl]
    outs: [retrain/candidate]
  evaluate:
    foreach:
      candidate: retrain/candidate
      champion: retrain/champion/model
    do:
      wdir: ..
      cmd: {PY} fake.py evaluate ${{item}} retrain/eval/${{key}}
      deps: [fake.py, "${{item}}"]
      outs: ["retrain/eval/${{key}}"]
  promote:
    wdir: ..
    cmd: rcgrpo promote --params retrain/params.yaml --eval-dir retrain/eval --candidate candidate=retrain/candidate
      --champion-eval retrain/eval/champion --out retrain/decision.json
    deps: [retrain/candidate, retrain/eval/candidate, retrain/eval/champion]
    params:
      - retrain/params.yaml: [promote]
    metrics:
      - retrain/decision.json:
          cache: false
"""


def test_next_round_resumes_an_undecided_round_and_shifts_seeds(tmp_path):
    import yaml

    from rcgrpo_tasks.ops.profiles import current_profile

    assert rf.next_round({}, 3) == {"round": 1, "champion_version": 3, "decided": False, "resumed": False}
    assert rf.next_round({"round": 4, "decided": True}, 5)["round"] == 5
    assert rf.next_round({"round": 4, "decided": False}, 5) == {"round": 4, "decided": False, "resumed": True}
    text = rf.round_params({"rl": {"seed": 7, "lr": 1}, "evaluate": {"seed": 0}}, "smoke", 3)
    assert yaml.safe_load(text) == {"rl": {"seed": 10, "lr": 1}, "evaluate": {"seed": 0}}
    (tmp_path / "p.yaml").write_text(text)
    assert current_profile(tmp_path / "p.yaml") == "smoke"  # promote's gate compares this profile


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def _repo(root: Path) -> Path:
    repo = root / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run([str(Path(PY).parent / "dvc"), "init", "-q"], cwd=repo, check=True)
    (repo / "fake.py").write_text(FAKE)
    (repo / "retrain.fake.yaml").write_text(textwrap.dedent(TEMPLATE))
    write_params(repo / "params.yaml", {"rl": {"seed": 100}, "promote": {"model_name": "retrain-test"}})
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"], cwd=repo, check=True)
    return repo


def test_two_rounds_each_train_a_new_candidate_and_the_paired_gate_decides(tmp_path, harness, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("MLFLOW_ARTIFACT_ROOT", str(tmp_path / "artifacts"))
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "retrain-test")
    monkeypatch.delenv("RCGRPO_PARENT_RUN_ID", raising=False)
    repo = _repo(tmp_path)
    with pytest.raises(rf.NoChampion, match="run the full pipeline first"):
        rf.retrain(repo_dir=str(repo), template="retrain.fake.yaml")

    from rcgrpo_tasks.evaluation import promotion as pr

    seed_model = tmp_path / "champion0"
    seed_model.mkdir()
    (seed_model / "quality.txt").write_text("1")
    rows = [{"id": f"multi_turn_base_{i}", "protocol": "paper", "valid": i < 10} for i in range(40)]
    (tmp_path / "eval0").mkdir()
    (tmp_path / "eval0" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval0" / "metrics.json").write_text(json.dumps({"settings": {"limit": 40}}))
    cfg = config_from_params(pr.PromoteConfig, "promote", model_name="retrain-test")
    with tracking.stage_run("promote", cfg) as run:  # the fake champion v1
        pr.promote(cfg, {"seed": (seed_model, pr.read_eval(tmp_path / "eval0", "seed"))}, run)

    first = rf.retrain(repo_dir=str(repo), template="retrain.fake.yaml")
    assert first["round"] == 1 and first["champion_version"] == 1
    assert first["stages"]["retrain/dvc.yaml:train"] == "ran"
    assert first["decision"]["decision"] == "promoted" and first["decision"]["diff"] == pytest.approx(25.0)
    assert (repo / "retrain/candidate/seed.txt").read_text() == "101"

    second = rf.retrain(repo_dir=str(repo), template="retrain.fake.yaml")
    assert second["round"] == 2 and second["champion_version"] == first["decision"]["candidate_version"]
    assert second["stages"]["retrain/dvc.yaml:train"] == "ran"  # fresh seeds + new champion: not cached
    assert (repo / "retrain/candidate/seed.txt").read_text() == "102"
    assert (repo / "retrain/champion/model/quality.txt").read_text() == "2"  # trained from the NEW champion
    assert second["decision"]["decision"] == "promoted" and second["decision"]["champion_accuracy"] == 50.0

    import mlflow

    client = mlflow.MlflowClient()
    parent = client.get_run(second["parent_run_id"])
    assert parent.info.run_name == "retrain@default" and parent.data.tags["retrain.decision"] == "promoted"
    assert "paired entries" in parent.data.tags["retrain.reason"]
    champ = client.get_model_version_by_alias("retrain-test", "champion")
    assert int(champ.version) == second["decision"]["candidate_version"]
    status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True).stdout
    assert set(status.split()) <= {"??", "retrain/"}  # only the round's pipeline files, nothing else dirty

    # A retrain/ folder DVC cannot see (git-ignored) must fail the round, not pass as "nothing new".
    (repo / ".gitignore").write_text("/retrain/\n")
    with pytest.raises(RuntimeError, match="no stages of retrain/dvc.yaml found"):
        rf.retrain(repo_dir=str(repo), template="retrain.fake.yaml")
