"""A local stack's description and its processes' bookkeeping (`ops.stack` starts and stops the services).

- `Stack`: the state folder, the ports and `infra/services.yaml` (names, env vars, settings); `make_stack`
  reuses the ports of a stack already running from the folder.
- `<state>/stack.json` records each started process as pid + start time (`read_state`, `write_state`), so
  `alive` and `kill` never touch a recycled pid; `spawn` starts a server in its own process group, `kill`
  stops recorded groups (SIGTERM, then SIGKILL after a timeout: SeaweedFS may hang on SIGTERM), and
  `wait_http` health-checks one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]  # rcgrpo_tasks/ops/stack_state.py -> the checkout
SERVICES_FILE = REPO_ROOT / "infra" / "services.yaml"
ORDER = ("s3", "mlflow", "prefect", "worker")  # start order; stop is the reverse


class StackError(RuntimeError):
    """A stack service failed to start, is unhealthy, or the environment is incomplete."""


def load_services(path: Path = SERVICES_FILE) -> dict:
    return yaml.safe_load(Path(path).read_text())


@dataclass(frozen=True)
class Stack:
    state_dir: Path
    ports: dict[str, int]
    host: str = "127.0.0.1"
    services: dict = field(default_factory=load_services, repr=False)

    @property
    def bucket(self) -> str:
        return self.services["bucket"]

    def url(self, name: str) -> str:
        return f"http://{self.host}:{self.ports[name]}"

    def fill(self, template: str, hosts: dict[str, str] | None = None) -> str:
        """Substitute {<service>} ports, {<service>_host} hosts and the scalar settings."""
        values = {**self.ports, **{k: v for k, v in self.services.items() if isinstance(v, str)}}
        values.update({f"{name}_host": (hosts or {}).get(name, self.host) for name in self.services["services"]})
        return template.format(**values)

    def client_env(self) -> dict[str, str]:
        return {k: self.fill(v) for k, v in self.services["client_env"].items()}

    def log(self, name: str) -> Path:
        return self.state_dir / "logs" / f"{name}.log"


def default_ports(services: dict, base: int | None = None) -> dict[str, int]:
    """Ports from services.yaml, or a consecutive block from `base` (grpc = port + 1, so step 2)."""
    names = ["s3", "mlflow", "prefect", "master", "volume", "filer"]
    if base is None:
        return {**{k: v["port"] for k, v in services["services"].items()}, **services["seaweedfs_ports"]}
    return {name: base + 2 * i for i, name in enumerate(names)}


def make_stack(state_dir: str | Path = ".stack", port_base: int | None = None) -> Stack:
    state = Path(state_dir).resolve()
    saved = state / "stack.json"
    if saved.is_file():
        recorded = json.loads(saved.read_text())
        if port_base is None:  # reuse the ports of a stack already there
            return Stack(state, recorded["ports"])
        wanted = default_ports(load_services(), port_base)
        if wanted != recorded["ports"] and any(alive(r) for r in recorded.get("procs", {}).values()):
            raise StackError(f"a stack is running from {state} on other ports; `rcgrpo stack down` first")
    return Stack(state, default_ports(load_services(), port_base))


# -- process bookkeeping ------------------------------------------------------------------------------

def read_state(stack: Stack) -> dict:
    path = stack.state_dir / "stack.json"
    return json.loads(path.read_text()) if path.is_file() else {"ports": stack.ports, "procs": {}}


def write_state(stack: Stack, state: dict) -> None:
    state["ports"] = stack.ports
    path = stack.state_dir / "stack.json"
    path.write_text(json.dumps(state, indent=2))
    pids = stack.state_dir / "pids"
    pids.mkdir(exist_ok=True)
    for name in [*ORDER, *(n for n in state["procs"] if n not in ORDER)]:
        pid_file = pids / f"{name}.pid"
        if name in state["procs"]:
            pid_file.write_text(f"{state['procs'][name]['pid']}\n")
        else:
            pid_file.unlink(missing_ok=True)


def alive(rec: dict) -> bool:
    """True only if the recorded pid is still the process we started (same start time)."""
    import psutil

    try:
        proc = psutil.Process(rec["pid"])
        return abs(proc.create_time() - rec["create_time"]) < 1.0 and proc.status() != "zombie"
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def spawn(stack: Stack, name: str, cmd: list[str], env: dict[str, str], cwd: Path | None = None) -> dict:
    import psutil

    stack.log(name).parent.mkdir(parents=True, exist_ok=True)
    with open(stack.log(name), "ab") as log:
        log.write(f"\n=== {time.strftime('%F %T')} starting {name}: {cmd[0]} ...\n".encode())
        log.flush()
        # own session = own process group, so stop() can end the server with its workers and nothing else
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=cwd, start_new_session=True)
    return {"pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time(), "cmd": cmd[:2]}


def reap(rec: dict) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(rec["pid"], os.WNOHANG)  # only succeeds if we are its parent


def kill(recs: list[dict], timeouts: list[float]) -> None:
    """SIGTERM the recorded process groups together; SIGKILL each one still alive after its own timeout
    (SeaweedFS can hang on SIGTERM). Only processes whose pid AND start time match are touched."""
    for rec in recs:  # a server that died on its own is a zombie until its parent (maybe us) reaps it
        reap(rec)
    live = [(r, t) for r, t in zip(recs, timeouts) if alive(r)]
    killed: set[int] = set()
    for rec, _ in live:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(rec["pid"], signal.SIGTERM)
    start = time.monotonic()
    while live and time.monotonic() - start < max(t for _, t in live) + 10:
        for rec, limit in live:
            reap(rec)
            if time.monotonic() - start > limit and rec["pid"] not in killed:
                killed.add(rec["pid"])
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(rec["pid"], signal.SIGKILL)
        live = [(r, t) for r, t in live if alive(r)]
        time.sleep(0.2)
    for rec in recs:  # the ones that just died are zombies until reaped
        reap(rec)


def wait_http(url: str, timeout: float, name: str, stack: Stack, ok=lambda status: status == 200) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=3) as resp:
                if ok(resp.status):
                    return
                last = f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            if ok(exc.code):
                return
            last = f"HTTP {exc.code}"
        except (OSError, urllib.error.URLError) as exc:
            last = str(exc)
        time.sleep(0.5)
    tail = stack.log(name).read_text(errors="replace")[-2000:] if stack.log(name).is_file() else ""
    raise StackError(f"{name} not healthy at {url} after {timeout:.0f}s ({last}); log {stack.log(name)}:\n{tail}")
