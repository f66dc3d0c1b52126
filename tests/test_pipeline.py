"""`rcgrpo plan` / `rcgrpo run-plan` (ops.pipeline): the DVC pipeline as DVC resolves it, run where DVC is
not installed. A tiny DVC repo for the plan; hand-built plans of shell commands for the run rule, the stop
at a failure and the bundle."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest
from helpers import REPO_ROOT
from typer.testing import CliRunner

from rcgrpo_tasks.ops import pipeline, plan_runner, schedule
from rcgrpo_tasks.ops.inputs import InputError
from rcgrpo_tasks.stages import plan as plan_cli
from rcgrpo_tasks.stages import run_plan as run_cli

DVC = str(Path(sys.executable).parent / "dvc")
DVC_YAML = """
stages:
  make:
    cmd: echo a > a.txt
    outs: [a.txt]
  each:
    foreach: [x, y]
    do:
      cmd:
        - cat a.txt > ${item}.txt
        - echo 1 > m_${item}.json
      deps: [a.txt]
      outs:
        - ${item}.txt
      metrics:
        - m_${item}.json:
            cache: false
"""


def _sh(cwd: Path, *cmd: str) -> None:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.fixture()
def dvc_repo(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _sh(repo, "git", "init", "-q")
    _sh(repo, DVC, "init", "-q")
    (repo / "dvc.yaml").write_text(textwrap.dedent(DVC_YAML))
    (repo / "params.yaml").write_text("x: 1\n")
    _sh(repo, DVC, "repro", "make")
    return repo


def test_plan_is_dvcs_expanded_order_with_up_to_date_stages_marked(dvc_repo, tmp_path):
    stages = pipeline.dvc_stages(dvc_repo)
    assert [s.name for s in stages] == ["make", "each@x", "each@y"]
    assert [s.done for s in stages] == [True, False, False]
    assert stages[1].cmds == ("cat a.txt > x.txt", "echo 1 > m_x.json")
    assert stages[1].outs == ("x.txt",) and stages[1].records == ("m_x.json",) and stages[1].upstream == ("make",)
    out, archive = tmp_path / "plan.json", tmp_path / "outs.tar.gz"
    res = CliRunner().invoke(plan_cli.app, ["--out", str(out), "--repo", str(dvc_repo),
                                            "--outputs-archive", str(archive)])
    assert res.exit_code == 0, res.output
    read, meta = pipeline.read_plan(out)
    assert read == stages and meta["carried"] == ["a.txt"] and meta["profile"] == "default"
    with tarfile.open(archive) as tar:
        assert tar.getnames() == ["a.txt"]


def test_dvc_commit_records_each_finished_stage_so_a_plan_after_a_cut_runs_only_the_rest(dvc_repo, tmp_path):
    """`run-plan --dvc-commit` as `make study` runs it: a run that ended after each@x (here: only each@x was
    asked for) leaves each@x in dvc.lock, and the plan made next marks it done and each@y still to run."""
    plan = tmp_path / "plan.json"
    assert CliRunner().invoke(plan_cli.app, ["--out", str(plan), "--repo", str(dvc_repo)]).exit_code == 0
    res = CliRunner().invoke(run_cli.app, ["--plan", str(plan), "--root", str(dvc_repo), "--stage", "each@x",
                                           "--logs", str(tmp_path / "logs"), "--dvc-commit"])
    assert res.exit_code == 0, res.output
    assert {s.name: s.done for s in pipeline.dvc_stages(dvc_repo)} == {"make": True, "each@x": True, "each@y": False}


def test_a_failing_on_done_stops_the_run_as_a_failing_stage_would(tmp_path):
    def refuse(stage):
        raise RuntimeError(f"cannot record {stage.name}")

    lines = []
    rec = plan_runner.run_plan(_chain(False, False), tmp_path, tmp_path / "logs", echo=lines.append, on_done=refuse)
    assert _status(rec) == {"a": "failed", "b": "not_run"}
    assert "[run-plan] a: finished, but on_done failed: cannot record a" in lines


def _stage(name, cmds, outs=(), upstream=(), done=False, records=()):
    return pipeline.PlannedStage(name, tuple(cmds), tuple(upstream), tuple(outs), tuple(records), done)


def _chain(done_a: bool, done_b: bool):
    return [_stage("a", ["echo A >> a.txt"], ["a.txt"], done=done_a),
            _stage("b", ["cat a.txt > b.txt", "echo '{}' > mb.json"], ["b.txt"], ["a"], done_b, ["mb.json"])]


def _status(record):
    return {k: v.status for k, v in record.stages.items()}


def test_up_to_date_stages_run_only_for_a_missing_output_and_stale_ones_always(tmp_path):
    lines = []
    stages = _chain(True, True)
    (tmp_path / "a.txt").write_text("A\n")
    (tmp_path / "b.txt").write_text("old\n")
    rec = plan_runner.run_plan(stages, tmp_path, tmp_path / "logs", echo=lines.append)
    assert _status(rec) == {"a": "skipped", "b": "skipped"} and (tmp_path / "b.txt").read_text() == "old\n"
    (tmp_path / "a.txt").unlink()  # a rebuild of a missing output (same deps) leaves b up to date
    rec = plan_runner.run_plan(stages, tmp_path, tmp_path / "logs", echo=lines.append)
    assert _status(rec) == {"a": "ran", "b": "skipped"} and (tmp_path / "a.txt").read_text() == "A\n"
    assert rec.stages["a"].reason == "output missing here: a.txt"
    rec = plan_runner.run_plan(_chain(False, True), tmp_path, tmp_path / "logs", echo=lines.append)
    assert _status(rec) == {"a": "ran", "b": "ran"} and rec.stages["b"].reason == "upstream a re-ran"
    assert (tmp_path / "a.txt").read_text() == "A\n"  # outputs are removed before a stage runs (as dvc does)
    assert (tmp_path / "b.txt").read_text() == "A\n" and (tmp_path / "mb.json").is_file()
    assert any(line.startswith("[run-plan] b: done in") for line in lines)


def test_a_failing_stage_stops_the_run_and_the_bundle_says_so(tmp_path):
    stages = [_stage("a", ["echo partial; exit 3"], ["a.txt"]), _stage("b", ["echo B > b.txt"], ["b.txt"], ["a"])]
    plan = tmp_path / "plan.json"
    pipeline.write_plan(stages, plan, {"profile": "t"})
    bundle = tmp_path / "out" / "run.tar.gz"
    res = CliRunner().invoke(run_cli.app, ["--plan", str(plan), "--root", str(tmp_path), "--bundle", str(bundle),
                                           "--logs", str(tmp_path / "logs")])
    assert res.exit_code == 2
    assert f"error: run-plan: stage a failed (exit 3); its log: {tmp_path / 'logs' / 'a.log'}" in res.output
    assert not (tmp_path / "b.txt").exists()
    (tmp_path / "b.txt").write_text("an old b")  # on disk, but not this run's: stays out of the bundle
    res = CliRunner().invoke(run_cli.app, ["--plan", str(plan), "--root", str(tmp_path), "--bundle", str(bundle),
                                           "--logs", str(tmp_path / "logs")])
    with tarfile.open(bundle) as tar:
        assert "b.txt" not in tar.getnames()
        timings = json.load(tar.extractfile("timings.json"))
        assert "partial" in tar.extractfile("logs/a.log").read().decode()
        assert "plan.json" in tar.getnames()
    assert timings["stages"]["a"]["status"] == "failed" and timings["stages"]["a"]["rc"] == 3
    assert timings["stages"]["b"]["status"] == "not_run"


def _waits_for(me: str, other: str) -> str:
    """A command that marks itself started and succeeds only if `other` starts while it runs (<= 10 s)."""
    return (f"touch {me}.started; for i in $(seq 200); do [ -f {other}.started ] && break; sleep 0.05; done; "
            f"[ -f {other}.started ] && echo {me} > {me}.txt")


def test_jobs_run_independent_stages_side_by_side_and_dependents_after_them(tmp_path):
    stages = [_stage("a", ["echo A > a.txt"], ["a.txt"]),
              _stage("b", [_waits_for("b", "c")], ["b.txt"], ["a"]),
              _stage("c", [_waits_for("c", "b")], ["c.txt"], ["a"]),
              _stage("d", ["cat a.txt b.txt c.txt > d.txt"], ["d.txt"], ["b", "c"])]
    lines = []
    rec = plan_runner.run_plan(stages, tmp_path, tmp_path / "logs", jobs=2, echo=lines.append)
    assert _status(rec) == {"a": "ran", "b": "ran", "c": "ran", "d": "ran"}
    assert (tmp_path / "d.txt").read_text() == "A\nb\nc\n"
    started = [line.split(":")[0] for line in lines if line.endswith("(stale where the plan was made)")]
    assert started == ["[run-plan] a", "[run-plan] b", "[run-plan] c", "[run-plan] d"]
    assert schedule.descendants(stages) == {"a": 3, "b": 1, "c": 1, "d": 0}
    assert plan_runner.stage_env({}, jobs=2)["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))
    assert "OMP_NUM_THREADS" not in plan_runner.stage_env({}, jobs=1)


def test_each_stage_runs_with_dvc_s_stage_variables(tmp_path):
    # A stage names its MLflow run from $DVC_STAGE (ops.tracking.run_name): run-plan sets it as `dvc repro` does.
    stages = [_stage("pool_rctp@0", ['echo "$DVC_STAGE $DVC_ROOT" > p.txt'], ["p.txt"]),
              _stage("label_rewards@sft", ['echo "$DVC_STAGE" > l.txt'], ["l.txt"])]
    rec = plan_runner.run_plan(stages, tmp_path, tmp_path / "logs", jobs=2, echo=lambda line: None,
                               env={k: v for k, v in os.environ.items() if k != "DVC_STAGE"})
    assert _status(rec) == {"pool_rctp@0": "ran", "label_rewards@sft": "ran"}
    assert (tmp_path / "p.txt").read_text() == f"pool_rctp@0 {tmp_path}\n"
    assert (tmp_path / "l.txt").read_text() == "label_rewards@sft\n"


def test_jobs_start_the_stages_most_others_wait_for_first(tmp_path):
    stages = [_stage("leaf", ["echo l > l.txt"], ["l.txt"]),
              _stage("trunk", ["echo t > t.txt"], ["t.txt"]),
              _stage("next", ["cat t.txt > n.txt"], ["n.txt"], ["trunk"])]
    lines = []
    plan_runner.run_plan(stages, tmp_path, tmp_path / "logs", jobs=2, echo=lines.append)
    started = [line.split(":")[0] for line in lines if line.endswith("(stale where the plan was made)")]
    assert started[:2] == ["[run-plan] trunk", "[run-plan] leaf"]
    lines.clear()
    plan_runner.run_plan(stages, tmp_path, tmp_path / "logs", jobs=1, echo=lines.append)
    assert [line.split(":")[0] for line in lines if line.endswith("(stale where the plan was made)")] == [
        "[run-plan] leaf", "[run-plan] trunk", "[run-plan] next"]


def test_jobs_after_a_failure_start_nothing_new_and_let_the_running_stages_finish(tmp_path):
    stages = [_stage("x", ["sleep 0.3; exit 4"], ["x.txt"]),
              _stage("y", ["sleep 1; echo y > y.txt"], ["y.txt"]),
              _stage("z", ["echo z > z.txt"], ["z.txt"], ["x"]),
              _stage("w", ["echo w > w.txt"], ["w.txt"])]
    rec = plan_runner.run_plan(stages, tmp_path, tmp_path / "logs", jobs=2, echo=lambda _: None)
    assert _status(rec) == {"x": "failed", "y": "ran", "z": "not_run", "w": "not_run"}
    assert (tmp_path / "y.txt").read_text() == "y\n" and not (tmp_path / "w.txt").exists()
    with pytest.raises(InputError, match="jobs must be >= 1"):
        plan_runner.run_plan(stages, tmp_path, tmp_path / "logs", jobs=0)
    stages.append(_stage("v", ["echo v > v.txt"], ["v.txt"], ["z"]))  # downstream of x, one stage removed
    rec = plan_runner.run_plan(stages, tmp_path, tmp_path / "logs", jobs=2, echo=lambda _: None, keep_going=True)
    assert _status(rec) == {"x": "failed", "y": "ran", "w": "ran", "z": "not_run", "v": "not_run"}
    assert rec.stages["v"].reason == "upstream z did not finish" and (tmp_path / "w.txt").is_file()


def test_a_variant_substitutes_only_the_named_options_and_never_writes_the_planned_outputs():
    """A stage run again elsewhere: named options moved or dropped, its outputs moving with them; an output
    left where the pipeline writes it, or an option the command lacks, is an error."""
    stage = _stage("t@a", ["tool run --params params.yaml --in data/x --out res/a --eval a=res/a --eval b=res/b "
                           "--plot=res/p.png --flag"], ["res/a/out.json"], records=["res/p.png"])
    v = pipeline.variant(stage, "sw/t@a", {"--params": "sw/p.yaml", "--out": "sw/a", "--eval": {"b": "sw/b"},
                                           "--plot": None}, ["--side", "dev"], ["up"])
    assert shlex.split(v.cmds[0]) == ["tool", "run", "--params", "sw/p.yaml", "--in", "data/x", "--out", "sw/a",
                                      "--eval", "b=sw/b", "--flag", "--side", "dev"]
    assert (v.outs, v.records, v.upstream, v.done) == (("sw/a/out.json",), (), ("up",), False)
    with pytest.raises(InputError, match="output res/a/out.json is under no substituted option"):
        pipeline.variant(stage, "v", {"--params": "p"})
    with pytest.raises(InputError, match="no --nope, --eval c="):
        pipeline.variant(stage, "v", {"--out": "o", "--plot": "q", "--nope": "z", "--eval": {"c": "z"}})
    with pytest.raises(InputError, match="shell syntax"):
        pipeline.variant(_stage("s", ["a --out x && b"], ["x"]), "v", {"--out": "o"})


def test_bundle_holds_records_and_small_outputs_not_large_ones(tmp_path):
    big = plan_runner.BUNDLE_FILE_MAX_BYTES + 1
    stages = [_stage("a", [f"head -c {big} /dev/zero > big.bin; echo r > rec.json; echo s > small.txt"],
                     ["big.bin", "small.txt"], records=["rec.json"])]
    bundle = tmp_path / "b.tar.gz"
    rec = plan_runner.run_plan(stages, tmp_path, tmp_path / "logs", bundle, echo=lambda _: None)
    assert _status(rec) == {"a": "ran"}
    with tarfile.open(bundle) as tar:
        assert sorted(tar.getnames()) == ["logs/a.log", "rec.json", "small.txt", "timings.json"]
    assert "stages run, sum" in plan_runner.timing_table(rec)


def test_selection_keeps_what_the_wanted_stages_need():
    upstream = {"prep": [], "train@x": ["prep"], "train@y": ["prep"], "eval@x": ["train@x"]}
    assert pipeline.select(upstream, ["eval"]) == ["prep", "train@x", "eval@x"]
    assert pipeline.select(upstream, ["train"]) == ["prep", "train@x", "train@y"]
    assert pipeline.select(upstream, None) == list(upstream)
    with pytest.raises(InputError, match="unknown stage 'nope'"):
        pipeline.select(upstream, ["nope"])


@pytest.mark.parametrize("plan, match", [
    ({"format": 99, "stages": []}, "'format' is 99"),
    ({"format": 1, "stages": []}, "'stages' must be a non-empty list"),
    ({"format": 1, "stages": [{"name": "a", "cmds": []}]}, "stage 'a': 'cmds' is empty"),
    ({"format": 1, "stages": [{"name": "b", "cmds": ["x"], "upstream": ["a"]}]}, "upstream \\['a'\\] not listed"),
    ({"format": 1, "stages": [{"name": "a", "cmds": ["x"], "done": "yes"}]}, "'done' must be true or false"),
])
def test_a_malformed_plan_fails_naming_the_file_and_field(tmp_path, plan, match):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    with pytest.raises(InputError, match=match) as err:
        pipeline.read_plan(path)
    assert str(path) in str(err.value)
    res = CliRunner().invoke(run_cli.app, ["--plan", str(path), "--dry-run"])
    assert res.exit_code == 2 and "error:" in res.output


def test_plan_outside_a_dvc_project_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "out" / "plan.json"
    res = CliRunner().invoke(plan_cli.app, ["--out", str(out), "--repo", str(tmp_path / "nothing-here"),
                                            "--outputs-archive", str(tmp_path / "out" / "outs.tar.gz")])
    assert res.exit_code == 2 and "DVC cannot read the pipeline" in res.output
    assert not (tmp_path / "out").exists()


def test_a_stop_ends_the_running_stages_records_them_stopped_and_keeps_the_bundle(tmp_path):
    """SIGTERM to `rcgrpo run-plan --jobs 2` while two stages run: both process groups end, the bundle says
    `stopped` for them (a stage not reached is not in it), and the runner exits non-zero."""
    import signal
    import time

    stages = [_stage("a", ["echo $$ > a.pid; sleep 60"], ["a.txt"]), _stage("b", ["echo $$ > b.pid; sleep 60"], ["b.txt"]),
              _stage("c", ["echo C > c.txt"], ["c.txt"], ["a", "b"])]
    plan, bundle = tmp_path / "plan.json", tmp_path / "run.tar.gz"
    pipeline.write_plan(stages, plan)
    proc = subprocess.Popen([sys.executable, "-m", "rcgrpo_tasks.cli", "run-plan", "--plan", str(plan), "--root",
                             str(tmp_path), "--bundle", str(bundle), "--logs", str(tmp_path / "logs"), "--jobs", "2"])
    deadline = time.monotonic() + 60
    while not ((tmp_path / "a.pid").is_file() and (tmp_path / "b.pid").is_file()) and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) != 0
    for name in ("a", "b"):
        pid = int((tmp_path / f"{name}.pid").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with tarfile.open(bundle) as tar:
        timings = json.load(tar.extractfile("timings.json"))
    assert {k: v["status"] for k, v in timings["stages"].items()} == {"a": "stopped", "b": "stopped"}


def test_the_same_plan_after_a_cut_skips_what_dvc_lock_recorded_since_and_refuses_a_changed_pipeline(dvc_repo, tmp_path):
    """`run-plan --dvc-commit` cut after each@x: the same command with the same plan (no re-plan) finds each@x in
    dvc.lock and runs only each@y; a plan whose params.yaml changed since is refused, naming the re-plan."""
    plan = tmp_path / "plan.json"
    assert CliRunner().invoke(plan_cli.app, ["--out", str(plan), "--repo", str(dvc_repo)]).exit_code == 0
    logs = ["--logs", str(tmp_path / "logs")]
    res = CliRunner().invoke(run_cli.app, ["--plan", str(plan), "--root", str(dvc_repo), "--stage", "each@x",
                                           "--dvc-commit", *logs])
    assert res.exit_code == 0, res.output
    made = (dvc_repo / "x.txt").stat().st_mtime_ns
    res = CliRunner().invoke(run_cli.app, ["--plan", str(plan), "--root", str(dvc_repo), "--dvc-commit", *logs])
    assert res.exit_code == 0, res.output
    assert "recorded in dvc.lock since it was made: each@x" in res.output
    assert "[run-plan] each@x: skipped (recorded in dvc.lock since the plan was made, outputs present)" in res.output
    assert "[run-plan] each@y: running (stale where the plan was made)" in res.output
    assert (dvc_repo / "x.txt").stat().st_mtime_ns == made
    assert all(s.done for s in pipeline.dvc_stages(dvc_repo))
    (dvc_repo / "params.yaml").write_text("x: 2\n")
    res = CliRunner().invoke(run_cli.app, ["--plan", str(plan), "--root", str(dvc_repo), *logs])
    assert res.exit_code == 2 and "params.yaml changed since the plan was made" in res.output
    assert f"re-plan: `rcgrpo plan --out {plan}`" in res.output and "running" not in res.output


def test_a_stage_recorded_since_the_plan_counts_as_rerun_for_what_depends_on_it(tmp_path):
    stages = _chain(False, True)  # a was stale, b up to date where the plan was made
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("x\n")
    assert [r for _, r in pipeline.decide(stages, tmp_path, {"a"})] == [None, "upstream a re-ran"]
    assert [r for _, r in pipeline.decide(stages, tmp_path, {"a", "b"})] == [None, None]
    (tmp_path / "a.txt").unlink()
    assert pipeline.decide(stages, tmp_path, {"a", "b"})[0][1] == (
        "recorded since the plan was made, but its output is missing here: a.txt")


def test_the_root_check_re_running_reruns_nothing_after_it(tmp_path):
    """Its output holds the same bytes whatever the params say: the stages after it run for their own reasons
    only (as under DVC), run or recorded since the plan."""
    root = pipeline.ROOT_CHECK
    stages = [_stage(root, ["true"], records=[".rcgrpo/params-checked"]),
              _stage("a", ["echo A > a.txt"], ["a.txt"], [root], done=True),
              _stage("b", ["cat a.txt > b.txt"], ["b.txt"], ["a"], done=False)]
    (tmp_path / "a.txt").write_text("A\n")
    for recorded in (set(), {root}):
        assert [r for _, r in pipeline.decide(stages, tmp_path, recorded)] == [
            None if recorded else "stale where the plan was made", None, "stale where the plan was made"]


def test_run_plan_started_by_its_path_runs_its_environments_commands_and_removes_nothing_it_cannot_start(tmp_path):
    """`.venv/bin/rcgrpo run-plan` with the environment off PATH: the stage commands still find `rcgrpo`; a stage
    whose command is nowhere fails with 127 and its outputs stay as they were."""
    stages = [_stage("uses", ["rcgrpo --help > help.txt"], ["help.txt"]),
              _stage("nowhere", ["no-such-tool-here --out kept.txt"], ["kept.txt"], ["uses"])]
    plan = tmp_path / "plan.json"
    pipeline.write_plan(stages, plan)
    (tmp_path / "kept.txt").write_text("an earlier result\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([str(Path(sys.executable).parent / "rcgrpo"), "run-plan", "--plan", str(plan), "--root",
                           str(tmp_path), "--logs", str(tmp_path / "logs")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "stage nowhere failed (exit 127)" in done.stderr, done.stdout + done.stderr
    assert (tmp_path / "help.txt").read_text().startswith("Usage: rcgrpo")
    assert (tmp_path / "kept.txt").read_text() == "an earlier result\n"
    log = (tmp_path / "logs" / "nowhere.log").read_text()
    assert "no-such-tool-here: command not found on PATH" in log and "nothing of nowhere was removed" in log
