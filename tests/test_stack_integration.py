"""The real local stack on loopback (SeaweedFS S3, MLflow server, Prefect server) + the flow on the smoke
profile, in a throw-away copy of the repo. Asserts: parent run with nested stage runs and metrics on the
MLflow server, MLflow artifacts and the DVC cache in the bucket, `dvc pull` into a fresh copy restores
outputs, the registry alias moves (and not for a worse model), no test credential in any log / MLflow
param / tracked file; faults: S3 killed mid-flow -> push retried then a clear failure, re-run after
restart skips finished stages; MLflow down at start -> clear error before any stage.

Marked `integration` and `slow` (~3-4 min of a core: `make test-all` runs it, so CI does). Every process it starts is stopped in a finalizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from helpers import REPO_ROOT, copy_tree, free_port_base

from rcgrpo_tasks.ops import stack as st
from rcgrpo_tasks.ops import stack_state

pytestmark = [pytest.mark.integration, pytest.mark.slow]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO_ROOT))
CHEAP_STAGES = ("prepare_data", "prepare_model")  # the cheap real stages, if dvc.yaml has them
KEY, SECRET = f"rcgrpoKEY{secrets.token_hex(6)}", f"rcgrpoSECRET{secrets.token_hex(12)}"

PROBE = """
import sys
from pathlib import Path
from rcgrpo_tasks.ops import tracking, tracking_log
out = Path("probe"); out.mkdir(exist_ok=True)
(out / "summary.txt").write_text("probe ok\\n")
with tracking.stage_run("probe", {"n": 3, "note": "no secrets here"}):
    tracking_log.log_metrics({"probe_metric": 0.75})
    tracking_log.log_artifact(out / "summary.txt")
"""


def add_stages(repo: Path, stages: dict) -> None:
    dvc_yaml = repo / "dvc.yaml"
    data = yaml.safe_load(dvc_yaml.read_text())
    data["stages"].update(stages)
    dvc_yaml.write_text(yaml.safe_dump(data, sort_keys=False))


def run(cmd: list[str], cwd: Path, env: dict, log: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(map(str, cmd))}\n{out.stdout}\n{out.stderr}\n")
    return out


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("stack")
    repo = copy_tree(root / "repo")
    stack = stack_state.make_stack(root / "state", port_base=free_port_base())
    old = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ.update({"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET})
    try:
        t0 = time.monotonic()
        client_env = st.up(stack, repo=repo)
        print(f"stack up in {time.monotonic() - t0:.1f}s")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_", "RCGRPO_"))}
        env.update(client_env)
        env.update({"PREFECT_HOME": str(root / "prefect-client"), "PATH": f"{BIN}{os.pathsep}{env['PATH']}"})
        yield {"root": root, "repo": repo, "stack": stack, "env": env, "log": root / "run.log"}
    finally:
        st.down(stack)
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def flow_cmd(*args: str) -> list[str]:
    return [str(BIN / "python"), "flows/rcgrpo_flow.py", "--profile", "smoke", "--retry-delay-s", "1", *args]


def _mlflow(lab):
    import mlflow

    return mlflow.MlflowClient(lab["env"]["MLFLOW_TRACKING_URI"])


def _s3_keys(lab, prefix: str) -> list[str]:
    import boto3

    s3 = boto3.client("s3", endpoint_url=lab["env"]["AWS_ENDPOINT_URL_S3"], aws_access_key_id=KEY,
                      aws_secret_access_key=SECRET, region_name="us-east-1")
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=lab["stack"].bucket, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def _sha(path: Path) -> str:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def first_run(lab):
    repo = lab["repo"]
    (repo / "probe_stage.py").write_text(PROBE)
    from flows.rcgrpo_flow import discover_stages

    existing = [s for s in CHEAP_STAGES if s in discover_stages(repo)]
    assert "prepare_data" in existing
    add_stages(repo, {"probe": {"cmd": "python probe_stage.py", "deps": ["probe_stage.py", "data/split.json"],
                                "outs": ["probe"]}})
    t0 = time.monotonic()
    out = run(flow_cmd("--stages", *existing, "probe"), repo, lab["env"], lab["log"])
    print(f"flow run in {time.monotonic() - t0:.1f}s")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {"stages": [*existing, "probe"], "result": result}


def test_parent_run_nested_runs_metrics_and_s3_artifacts(lab, first_run):
    client = _mlflow(lab)
    parent = client.get_run(first_run["result"]["parent_run_id"])
    assert parent.info.status == "FINISHED" and parent.info.run_name == "pipeline@smoke"
    assert "dvc.lock.sha256" in parent.data.tags and "git.commit" in parent.data.tags
    assert parent.data.params["flow.profile"] == "smoke"
    exp = client.get_experiment_by_name("rcgrpo")
    children = client.search_runs([exp.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    by_name = {r.info.run_name: r for r in children}
    assert by_name["probe"].data.metrics["probe_metric"] == 0.75
    assert all(r.info.status == "FINISHED" for r in children)
    if "prepare_model" in first_run["stages"]:
        assert "prepare_model" in by_name and by_name["prepare_model"].data.metrics
    keys = _s3_keys(lab, "mlartifacts/")
    assert any(k.endswith("summary.txt") for k in keys), keys[:20]


def test_dvc_push_and_pull_into_fresh_copy(lab, first_run):
    assert _s3_keys(lab, "dvc/files/md5/"), "dvc push left no cache files in the bucket"
    fresh = copy_tree(lab["root"] / "fresh")
    add_stages(fresh, {"probe": {"cmd": "python probe_stage.py", "deps": ["probe_stage.py", "data/split.json"],
                                 "outs": ["probe"]}})
    shutil.copy2(lab["repo"] / "dvc.lock", fresh / "dvc.lock")
    st.configure_dvc(lab["stack"], fresh)
    out = run([str(BIN / "dvc"), "pull", *first_run["stages"]], fresh, lab["env"], lab["log"])
    assert out.returncode == 0, out.stdout + out.stderr
    lock = yaml.safe_load((lab["repo"] / "dvc.lock").read_text())["stages"]
    outs = [o["path"] for s in first_run["stages"] for o in lock[s].get("outs", [])
            if not o["path"].startswith("metrics/")]  # metrics are cache: false (git-tracked)
    assert outs
    for rel in outs:
        assert _sha(fresh / rel) == _sha(lab["repo"] / rel), rel


def test_registry_alias_moves_only_for_a_better_model(lab, first_run):
    root, env = lab["root"], lab["env"]
    model = root / "adapter"
    model.mkdir(exist_ok=True)
    (model / "adapter_config.json").write_text(json.dumps({"r": 4}))
    (model / "adapter_model.safetensors").write_bytes(os.urandom(256))
    params = root / "promote_params.yaml"
    promote = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())["promote"]  # every tuned value, as shipped
    params.write_text(yaml.safe_dump({"promote": {**promote, "model_name": "rcgrpo-agent-it"}}))
    decisions = []
    for acc in (40.0, 35.0):  # per-entry results (the paired gate): 16 then 14 of 40 entries solved
        evals = root / f"eval_{acc}" / "rctp-rc_grpo"
        evals.mkdir(parents=True, exist_ok=True)
        rows = [{"id": f"multi_turn_base_{i}", "protocol": "paper", "valid": i < acc * 0.4} for i in range(40)]
        (evals / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        # the settings each evaluation ran under: the gate pairs only evaluations made alike
        (evals / "metrics.json").write_text(json.dumps({"settings": {"limit": 40, "max_new_tokens": 64}}))
        out_json = root / f"decision_{acc}.json"
        out = run([str(BIN / "rcgrpo"), "promote", "--params", str(params), "--eval-dir", str(evals.parent),
                   "--candidate", f"rctp-rc_grpo={model}", "--out", str(out_json)], root, env, lab["log"])
        assert out.returncode == 0, out.stdout + out.stderr
        decisions.append(json.loads(out_json.read_text()))
    assert decisions[0]["promoted"] and not decisions[1]["promoted"]
    assert decisions[1]["champion_accuracy"] == 40.0 and decisions[1]["candidate_accuracy"] == 35.0
    champ = _mlflow(lab).get_model_version_by_alias("rcgrpo-agent-it", "champion")
    assert int(champ.version) == decisions[0]["candidate_version"]
    assert any("/model/adapter_config.json" in k for k in _s3_keys(lab, "mlartifacts/"))


def test_s3_down_mid_flow_then_rerun_skips_finished_stages(lab, first_run):
    repo, env = lab["repo"], lab["env"]
    pid_file = lab["stack"].state_dir / "pids" / "s3.pid"
    # A test-only stage that kills the S3 server: the fault lands between the stages and the push.
    add_stages(repo, {"kill_s3": {"cmd": f"kill -9 -$(cat {pid_file}) && echo killed > killed.txt",
                                  "deps": ["probe"], "outs": ["killed.txt"]}})
    stages = [*first_run["stages"], "kill_s3"]
    t0 = time.monotonic()
    # botocore's own retries (AWS_MAX_ATTEMPTS) would multiply the flow's; keep the test short
    out = run(flow_cmd("--stages", *stages, "--transfer-retries", "2"), repo, dict(env, AWS_MAX_ATTEMPTS="1"),
              lab["log"])
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "dvc push" in text and "attempt 3/3" in text and "is the S3 server up?" in text, text[-3000:]
    assert text.count("dvc push (attempt") == 3
    print(f"failing run in {time.monotonic() - t0:.1f}s")
    st.up(lab["stack"])  # restarts only what is down (S3), same ports and data
    out = run(flow_cmd("--stages", *stages), repo, env, lab["log"])
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["stages"].values()) == {"skipped"}, result
    assert "Running stage" not in out.stdout + out.stderr


def test_mlflow_down_at_start_fails_before_any_stage(lab, first_run):
    env = dict(lab["env"], MLFLOW_TRACKING_URI=f"http://127.0.0.1:{free_port_base()}")
    out = run(flow_cmd("--stages", "prepare_data", "--force"), lab["repo"], env, lab["log"])
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "is unreachable" in text and "make stack-up" in text
    assert "Running stage" not in text and "repro" not in text


def test_no_credentials_in_logs_params_or_tracked_files(lab, first_run):
    stack = lab["stack"]
    texts = {str(p): p.read_text(errors="replace") for p in (stack.state_dir / "logs").glob("*.log")}
    texts["run.log"] = lab["log"].read_text()
    texts["env.sh"] = (stack.state_dir / "env.sh").read_text()
    api = lab["env"]["PREFECT_API_URL"]
    offset, prefect_logs = 0, []
    while True:
        req = urllib.request.Request(f"{api}/logs/filter", data=json.dumps({"limit": 200, "offset": offset}).encode(),
                                     headers={"Content-Type": "application/json"})
        batch = json.loads(urllib.request.urlopen(req, timeout=30).read())
        prefect_logs += [b["message"] for b in batch]
        offset += len(batch)
        if len(batch) < 200:
            break
    assert len(prefect_logs) > 20  # the stage output really went to Prefect
    texts["prefect-logs"] = "\n".join(prefect_logs)
    client = _mlflow(lab)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], max_results=1000)
    assert runs
    texts["mlflow"] = json.dumps([[r.data.params, r.data.tags] for r in runs])
    for rel in ("params.yaml", "dvc.yaml", "dvc.lock", ".dvc/config", ".dvc/config.local"):
        texts[rel] = (lab["repo"] / rel).read_text()
    for name, text in texts.items():
        assert KEY not in text and SECRET not in text, f"test credential leaked into {name}"
    ident = stack.state_dir / "s3-identities.json"  # the one place they live: the S3 server's own file
    assert oct(ident.stat().st_mode & 0o777) == "0o600"
