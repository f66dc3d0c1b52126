"""tracking.py against a real temp sqlite MLflow store (no server)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rcgrpo_tasks.ops import tracking, tracking_log, tracking_store


@dataclasses.dataclass(frozen=True)
class _Cfg:
    lr: float = 1e-5
    categories: tuple = ("base", "miss_func")
    inner: dict = dataclasses.field(default_factory=lambda: {"k": 1})
    s3_secret_key: str = "should-not-appear"


@pytest.fixture(autouse=True)
def _a_secret_in_the_environment(monkeypatch):
    """A credential the runs must never record (`test_stage_run_logs_params_metrics_artifacts_nested`)."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "TESTSECRETVALUE123")


def _client():
    import mlflow

    return mlflow.MlflowClient(tracking_store.tracking_uri())


def test_stage_run_logs_params_metrics_artifacts_nested(store, tmp_path, monkeypatch):
    parent = tracking.open_run("flow", params={"profile": "smoke"}, tags={"kind": "parent"})
    monkeypatch.setenv(tracking.PARENT_ENV, parent)
    f = tmp_path / "a.txt"
    f.write_text("hello")
    cfg = dataclasses.replace(_Cfg(), inner={"k": 1, "note": "uses TESTSECRETVALUE123 inline"})
    with tracking.stage_run("prepare_data", cfg, tags={"extra": 1}) as run:
        tracking_log.log_metrics({"acc": 0.5, "n": 3, "skip": None}, step=1)
        tracking_log.log_artifact(f)
        tracking_log.log_table([{"a": 1, "b": "x"}, {"a": 2, "b": "y"}], "rows")
        tracking_log.log_dict({"x": [1, 2]}, "d.json")
        run_id = run.info.run_id
    tracking.close_run(parent, tags={"dvc.lock": "abc"})
    client = _client()
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED"
    assert got.info.run_name == "prepare_data"
    assert got.data.tags["mlflow.parentRunId"] == parent
    assert got.data.tags["rcgrpo.stage"] == "prepare_data" and got.data.tags["extra"] == "1"
    assert got.data.params["lr"] == "1e-05"
    assert json.loads(got.data.params["categories"]) == ["base", "miss_func"]
    assert got.data.params["inner.k"] == "1"
    assert got.data.params["s3_secret_key"] == tracking_log.REDACTED
    assert got.data.params["inner.note"] == tracking_log.REDACTED
    assert "TESTSECRETVALUE123" not in json.dumps(got.data.params)
    assert got.data.metrics == {"acc": 0.5, "n": 3.0}
    names = {a.path for a in client.list_artifacts(run_id)}
    assert {"a.txt", "rows.json", "d.json"} <= names
    p = client.get_run(parent)
    assert p.info.status == "FINISHED" and p.data.tags["dvc.lock"] == "abc"
    assert p.data.params["profile"] == "smoke"


def test_body_error_marks_run_failed_and_propagates(store):
    with pytest.raises(ZeroDivisionError):
        with tracking.stage_run("boom", None) as run:
            run_id = run.info.run_id
            _ = 1 / 0
    assert _client().get_run(run_id).info.status == "FAILED"


def test_bad_metric_raises_tracking_error(store):
    with tracking.stage_run("bad", None):
        with pytest.raises(tracking_store.TrackingError, match="not a number"):
            tracking_log.log_metrics({"x": "abc"})
        with pytest.raises(tracking_store.TrackingError, match="does not exist"):
            tracking_log.log_artifact("/nonexistent/file")


def test_check_tracking_local_ok(store):
    assert tracking_store.check_tracking().startswith("sqlite:///")


def test_check_tracking_unreachable_server_fails_fast(monkeypatch):
    import socket

    with socket.socket() as s:  # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    with pytest.raises(tracking_store.TrackingError, match="unreachable"):
        tracking_store.check_tracking(timeout=2)


def test_flatten_and_safe_params():
    flat = tracking_log.flatten({"a": {"b": 1, "c": [1, 2]}, "password": "p"})
    assert flat == {"a.b": 1, "a.c": "[1, 2]", "password": "p"}
    assert tracking_log.safe_params({"db_password": "x", "max_new_tokens": 5}) == {
        "db_password": tracking_log.REDACTED, "max_new_tokens": "5"}


def test_uri_credentials_never_in_messages(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://alice:hunter2@127.0.0.1:1")
    with pytest.raises(tracking_store.TrackingError) as err:
        tracking_store.check_tracking(timeout=1)
    assert "hunter2" not in str(err.value) and "//***@127.0.0.1:1" in str(err.value)


# -- runs comparable, never RUNNING, never silent ------------------------------------------------

REPO_ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def _script(body: str, *args: str, **popen):
    import subprocess
    import sys
    import textwrap

    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(body), *args], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def test_experiment_kind_opens_the_ui_on_runs(store, monkeypatch):
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "made-elsewhere")
    exp_id = _client().create_experiment("made-elsewhere")  # e.g. by an older version: no kind tag
    assert tracking_store.experiment_id() == exp_id
    assert _client().get_experiment(exp_id).tags[tracking_store.EXPERIMENT_KIND_TAG] == "custom_model_development"


def test_runs_table_url_selects_the_model_training_view(store, monkeypatch):
    assert tracking_store.runs_table_url() is None  # a local store has no UI link
    monkeypatch.setattr(tracking_store, "tracking_uri", lambda: "http://127.0.0.1:5000/")
    monkeypatch.setattr(tracking_store, "experiment_id", lambda: "7")
    assert tracking_store.runs_table_url() == "http://127.0.0.1:5000/#/experiments/7/runs?workflowType=machine_learning"


def test_runs_are_named_as_their_dvc_stage(store, monkeypatch):
    monkeypatch.delenv("DVC_STAGE", raising=False)
    assert tracking.run_name("evaluate_rl_rctp@0-rc_grpo") == "evaluate_rl_rctp@0-rc_grpo"  # a stage's name
    assert tracking.run_name("validate_trajectories", "pool_rctp@0") == "validate_trajectories@pool_rctp@0"
    assert tracking.run_name("report") == "report"
    monkeypatch.setenv("DVC_STAGE", "pool_rctp@0")
    assert tracking.run_name("sample_policy") == "pool_rctp@0"  # the stage DVC runs, whatever its module
    assert tracking.run_name("rctp@0") == "rctp@0"
    monkeypatch.setenv("DVC_STAGE", "sub/dvc.yaml:evaluate@base")
    with tracking.stage_run("evaluate", {"x": 1}) as run:
        run_id = run.info.run_id
    got = _client().get_run(run_id)
    assert got.info.run_name == "evaluate@base" and got.data.tags["rcgrpo.variant"] == "base"


def test_failed_run_carries_the_error_as_a_tag(store):
    with pytest.raises(ValueError):
        with tracking.stage_run("explode", None) as run:
            raise ValueError("the input was bad:\n  line 3")
    got = _client().get_run(run.info.run_id)
    assert got.info.status == "FAILED"
    assert got.data.tags[tracking.ERROR_TAG] == "ValueError: the input was bad: line 3"


def test_http_calls_are_bounded(monkeypatch):
    for key in tracking_store.HTTP_LIMITS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "5")  # a user's own choice wins
    tracking_store.mlflow_module()
    import os

    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "10" and os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "5"
    with tracking_store.quick():
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "5"


SLEEPER = """
import sys, time
from rcgrpo_tasks.cli import guarded
from rcgrpo_tasks.ops import tracking, tracking_log, tracking_store

def body():
    if sys.argv[1] == "forget":  # opened, never closed: the atexit hook must end it
        print(tracking.stage_run("forgotten").__enter__().info.run_id, flush=True)
        return 0
    with tracking.stage_run("sleeper", {"n": 1}) as run:
        print(run.info.run_id, flush=True)
        time.sleep(60)
    return 0

sys.exit(guarded("sleeper", body))
"""


def test_sigterm_ends_the_stage_run_killed_with_one_line(store):
    import signal

    proc = _script(SLEEPER, "sleep")
    run_id = proc.stdout.readline().strip()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.strip() == "error: rcgrpo sleeper terminated by SIGTERM; stopped, no output published"
    got = _client().get_run(run_id)
    assert got.info.status == "KILLED" and "SIGTERM" in got.data.tags[tracking.ERROR_TAG]


def test_sigkilled_stage_run_is_reaped_by_the_next_stage(store):
    import signal

    proc = _script(SLEEPER, "sleep")
    run_id = proc.stdout.readline().strip()
    proc.send_signal(signal.SIGKILL)  # no handler runs: the run stays RUNNING...
    proc.communicate(timeout=60)
    assert _client().get_run(run_id).info.status == "RUNNING"
    with tracking.stage_run("next_stage", None):  # ...until any later stage (or the flow's end) reaps it
        pass
    got = _client().get_run(run_id)
    assert got.info.status == "KILLED" and "process ended" in got.data.tags[tracking.ERROR_TAG]


def test_a_run_left_open_at_exit_ends_failed(store):
    proc = _script(SLEEPER, "forget")
    run_id = proc.stdout.readline().strip()
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    got = _client().get_run(run_id)  # not FINISHED, as MLflow's own exit hook would have it
    assert got.info.status == "FAILED" and "still open" in got.data.tags[tracking.ERROR_TAG]


# -- outputs and record: published together, claimed before the work ---------------------------------------


def test_published_run_logs_staged_outputs_under_their_final_names(store, tmp_path):
    out, folder = tmp_path / "m.json", tmp_path / "model"
    with tracking.published_run("stage_x", {"a": 1}, outputs=(out, folder)) as (run, staged):
        (staged.file(out)).write_text("{}")
        tracking_log.log_artifact(staged.temp(out))
        d = staged.dir(folder)
        (d / "w.safetensors").write_bytes(b"x")
        (d / "w.safetensors").chmod(0o600)  # what safetensors writes
        assert not out.exists()  # nothing appears before the run is recorded
    got = _client().get_run(run.info.run_id)
    assert got.info.status == "FINISHED" and out.read_text() == "{}"
    assert [a.path for a in _client().list_artifacts(run.info.run_id)] == ["m.json"]
    assert (folder / "w.safetensors").stat().st_mode & 0o777 == 0o644  # published for other users too


def test_a_lost_tracking_server_publishes_nothing(store, tmp_path, monkeypatch):
    import mlflow

    real = mlflow.end_run

    def gone(status="FINISHED"):
        if status == "FINISHED":
            raise ConnectionError("tracking server gone")
        return real(status=status)

    monkeypatch.setattr(mlflow, "end_run", gone)
    out = tmp_path / "metrics.json"
    with pytest.raises(tracking_store.TrackingError, match="tracking server gone"):
        with tracking.published_run("stage_y", outputs=(out,)) as (run, staged):
            staged.file(out).write_text("{}")
    assert not out.exists() and not list(tmp_path.iterdir())
    assert _client().get_run(run.info.run_id).info.status == "FAILED"


def test_a_failed_publish_ends_the_finished_run_failed(store, tmp_path):
    from rcgrpo_tasks.ops.outputs import OutputError

    out = tmp_path / "metrics.json"
    with pytest.raises(OutputError, match="metrics.json"):
        with tracking.published_run("stage_z", outputs=(out,)) as (run, staged):
            staged.file(out).unlink()  # the temp is gone at publish time
    got = _client().get_run(run.info.run_id)
    assert got.info.status == "FAILED" and "temporary was removed" in got.data.tags[tracking.ERROR_TAG]


def test_a_second_writer_fails_before_its_work(store, tmp_path):
    """The claim is taken when the run opens, not at publish time: a second writer of the same output fails
    at once, naming the holder, instead of both finishing and one result being lost."""
    import subprocess
    import sys

    from rcgrpo_tasks.ops.outputs import OutputError

    out = tmp_path / "eval"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from rcgrpo_tasks.ops.outputs import claim_outputs\n"
        f"with claim_outputs({str(out)!r}):\n    print('held', flush=True); time.sleep(30)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputError, match=rf"is being written by another process \(pid {holder.pid}"):
            with tracking.published_run("evaluate", outputs=(out,)):
                raise AssertionError("the work must not start")
        assert holder.poll() is None  # refused while the holder still holds it: it did not wait for the release
    finally:
        holder.kill()
        holder.wait()


def test_a_failed_command_records_its_message(store, tmp_path):
    from rcgrpo_tasks.ops.cli import CommandFailed, fail

    with pytest.raises(CommandFailed):
        with tracking.stage_run("stage_f") as run:
            fail("params.yaml:evaluate.limit: must be null or >= 1")
    tag = _client().get_run(run.info.run_id).data.tags[tracking.ERROR_TAG]
    assert tag == "CommandFailed: params.yaml:evaluate.limit: must be null or >= 1"
    with pytest.raises(CommandFailed):  # the whole message, past any `;` (ParamsChanged lists keys with `; `)
        with tracking.stage_run("stage_g") as run:
            fail("params changed while x ran: a.b (1 -> 2); c.d (3 -> 4); nothing was published: rerun it")
    tag = _client().get_run(run.info.run_id).data.tags[tracking.ERROR_TAG]
    assert tag == "CommandFailed: params changed while x ran: a.b (1 -> 2); c.d (3 -> 4); nothing was published: rerun it"


def test_stages_started_side_by_side_share_a_fresh_sqlite_store(tmp_path):
    """Four processes touching one new sqlite store at once (stages under `run-plan --jobs`) all get the
    same experiment: MLflow's schema creation is serialised (`tracking_store._first_touch`), not raced."""
    import os
    import subprocess
    import sys

    code = "from rcgrpo_tasks.ops import tracking_store; print(tracking_store.experiment_id())"
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'new' / 'mlflow.db'}",
           "MLFLOW_ARTIFACT_ROOT": str(tmp_path / "art")}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err[-500:] for _, err in outs]
    assert len({out.strip() for out, _ in outs}) == 1


def test_mlflow_telemetry_is_off_unless_the_user_turns_it_on(tmp_path):
    """In a process without pytest's or a CI's markers (MLflow turns its telemetry off under those itself), the
    tracking module's MLflow has telemetry off; a user's own MLFLOW_DISABLE_TELEMETRY=false is kept."""
    import os
    import subprocess
    import sys

    from mlflow.telemetry.utils import _is_ci_env_or_testing

    code = ("from rcgrpo_tasks.ops import tracking_store; tracking_store.mlflow_module(); "
            "from mlflow.telemetry.utils import is_telemetry_disabled; print(is_telemetry_disabled())")
    markers = {"PYTEST_CURRENT_TEST", "CI", "GITHUB_ACTIONS", "DO_NOT_TRACK", "MLFLOW_DISABLE_TELEMETRY"}
    env = {k: v for k, v in os.environ.items() if k not in markers}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path}/mlflow.db"
    for given, disabled in ((None, "True"), ("false", "False")):
        run_env = env if given is None else {**env, "MLFLOW_DISABLE_TELEMETRY": given}
        done = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, check=True)
        assert done.stdout.strip().splitlines()[-1] == disabled, (given, done.stdout, done.stderr[-2000:])
    assert _is_ci_env_or_testing()  # why the check needs its own process
