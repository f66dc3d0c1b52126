"""Clean stops: a stage never outlives the pipeline that started it, and a stop always unwinds.

- `die_with_parent()` (called by the `rcgrpo` entry point when it runs as a DVC stage): the kernel sends
  SIGTERM to the stage when its parent dies (`prctl(PR_SET_PDEATHSIG)`, Linux). DVC runs a stage as
  `$SHELL -c CMD`; bash execs a single command, so the parent is `dvc repro` itself, but `sh` (dash) stays
  in between and does not die with dvc, so when the parent is a shell a daemon thread also watches the
  shell's parent and sends the same SIGTERM when it is gone. Without this a signal to `dvc repro` left
  the stage running; it later wrote outputs and a FINISHED MLflow run that `dvc.lock` never recorded.
- `raise_on_terminate()`: SIGTERM/SIGHUP raise `Terminated` (a BaseException, like KeyboardInterrupt), so
  `finally` blocks run: temp outputs are removed and the MLflow run ends KILLED instead of RUNNING.
- `start_group` / `stop_group`: run a command in its own session (process group) and stop the WHOLE group
  (SIGTERM, then SIGKILL after a grace period), so a cancelled or timed-out Prefect task never leaves
  `dvc repro` or its stage behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
SHELLS = {"sh", "dash", "bash", "zsh", "ksh", "fish"}
WATCH_INTERVAL_S = 1.0


class Terminated(BaseException):
    """The process got SIGTERM/SIGHUP; raised where it was running so cleanup code runs."""

    def __init__(self, signum: int):
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.signum = signum


def _raise(signum, _frame):
    # The first signal starts the unwinding; a repeat (the group's SIGTERM, then the parent-death one)
    # must not interrupt the cleanup it started. SIGKILL stays the hard stop.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise Terminated(signum)


def raise_on_terminate() -> dict:
    """SIGTERM and SIGHUP raise Terminated in the main thread (only where they still have their default
    action: an embedding program's own handlers are kept). Returns the replaced handlers for `restore`."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    replaced = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            replaced[sig] = signal.signal(sig, _raise)
    return replaced


def restore(replaced: dict) -> None:
    """Put back the handlers `raise_on_terminate` replaced."""
    for sig, handler in replaced.items():
        signal.signal(sig, handler)


def proc_start_time(pid: int) -> str | None:
    """Start time of `pid` in clock ticks since boot (Linux /proc); None if there is no such process.
    (pid, start time) names a process uniquely even after its pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def alive(pid: int, start: str | None = None) -> bool:
    """Whether process `pid` (with that start time, when given and /proc exists) is still running."""
    if Path("/proc").is_dir():
        now = proc_start_time(pid)
        return now is not None and (start is None or now == start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _watch(pid: int, start: str | None) -> None:
    while alive(pid, start):
        time.sleep(WATCH_INTERVAL_S)
    os.kill(os.getpid(), signal.SIGTERM)


def die_with_parent() -> bool:
    """Get SIGTERM when the parent (or, behind a shell, the shell's parent) exits. Linux only; returns
    whether a watch is in place. Harmless to call twice."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)
    if _comm(parent) in SHELLS:
        grand = _ppid(parent)
        if grand and grand > 1:
            start = proc_start_time(grand)
            threading.Thread(target=_watch, args=(grand, start), name="rcgrpo-parent-watch", daemon=True).start()
    return True


def start_group(cmd: list[str], die_with_us: bool = False, **kwargs) -> subprocess.Popen:
    """Popen `cmd` as the leader of a new session, so `stop_group` reaches it and all its children.
    `die_with_us`: the leader gets SIGTERM when this process dies, even by SIGKILL (Linux; a new session
    is out of reach of this one's signals otherwise)."""
    if die_with_us and sys.platform.startswith("linux"):
        kwargs["preexec_fn"] = _term_on_parent_death
    return subprocess.Popen(cmd, start_new_session=True, **kwargs)


def _term_on_parent_death() -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def stop_group(proc: subprocess.Popen, grace_s: float = 20.0, leader_first: bool = False) -> int | None:
    """SIGTERM the process group led by `proc` and wait until every member is gone (the leader may exit
    before its children); SIGKILL whatever is left after `grace_s`. Returns the leader's exit code (None
    if it could not be reaped). Safe on a group that already exited. `leader_first`: the SIGTERM goes to
    the leader alone (a launcher that passes it on to its workers: they must get it once, not twice)."""
    deadline = time.monotonic() + grace_s
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if leader_first and sig == signal.SIGTERM:
                os.kill(proc.pid, sig)
            else:
                os.killpg(proc.pid, sig)
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader, or the group stays "alive" as a zombie
            if not group_alive(proc.pid):
                return proc.returncode
            time.sleep(0.1)
        deadline = time.monotonic() + 5.0
    proc.poll()
    return proc.returncode


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` still exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
