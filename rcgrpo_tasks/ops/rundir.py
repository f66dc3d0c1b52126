"""The checkout's run folder, `.rcgrpo/run/`: what only matters while a stage runs, kept out of the folders DVC
tracks, so a lock a kill leaves behind never makes a stage that depends on an output's folder changed in `dvc
status`, nor shows as an untracked file in git.

- Output locks (`ops.outputs.output_lock`): `<run>/<output path relative to the checkout, quoted>.lock`; each
  names its holder's pid and every temp or backup the holder staged beside the output, so whoever finds the
  lock free later (the next writer, or `sweep`) removes what a killed holder left half-written.
- Process markers (`marker`): `<run>/proc-<pid>-<start>.json`, held (`flock`) by a stage process for its life.
- `sweep` removes every lock and marker no live process holds, with the temps they list.

A checkout has a run folder when `.rcgrpo/run` exists at its root (git keeps the folder, ignores its files);
elsewhere (a test's temp folder) locks stay beside their outputs and nothing is marked. The folder is a dep of
the pipeline's root stage (dvc.yaml `check_params`): a marker or lock left by a killed process makes that stage
changed, so the next `dvc repro` runs it, and it sweeps them and closes the dead runs (`ops.recovery`), even
when every other stage then comes from DVC's run cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from rcgrpo_tasks.ops.stops import proc_start_time

RUN_DIR = Path(".rcgrpo") / "run"
LOCK_SUFFIX = ".lock"
MARKER_PREFIX = "proc-"
MAX_NAME = 200
"""Longest lock file name kept readable; a longer output path is hashed (file names stop at 255 bytes)."""


def _abspath(path: str | Path) -> Path:
    return Path(os.path.abspath(path))  # not resolve(): a symlinked folder keeps its place in the checkout


def find(path: str | Path) -> Path | None:
    """The run folder of the checkout holding `path` (the nearest folder above it, or it, with `RUN_DIR`)."""
    here = _abspath(path)
    for folder in (here, *here.parents):
        if (folder / RUN_DIR).is_dir():
            return folder / RUN_DIR
    return None


def lock_file(output: str | Path) -> Path | None:
    """Where the lock of `output` lives in its checkout's run folder; None outside a checkout with one."""
    run = find(_abspath(output).parent)
    if run is None:
        return None
    rel = _abspath(output).relative_to(run.parent.parent).as_posix()
    name = quote(rel, safe="")
    if len(name) > MAX_NAME:
        name = f"{hashlib.sha256(rel.encode()).hexdigest()[:16]}-{name[-(MAX_NAME - 17):]}"
    return run / f"{name}{LOCK_SUFFIX}"


def _lines(fd: int) -> list[str]:
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    return data.decode(errors="replace").splitlines()


def remove_listed(fd: int) -> list[str]:
    """Remove what a lock file (open as `fd`, its `flock` held) lists beyond its holder's pid: the temps and
    backups a holder staged (`note`); only names of the form `.<name>.*` (what `ops.outputs` stages), so a
    damaged file never removes anything else. Returns the paths removed."""
    removed = []
    for line in _lines(fd)[1:]:
        path = Path(line.strip())
        if not line.strip() or not path.is_absolute() or not path.name.startswith("."):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists() or path.is_symlink():
            with contextlib.suppress(OSError):
                path.unlink()
        else:
            continue
        removed.append(str(path))
    return removed


def note(fd: int, path: str | Path) -> None:
    """Append `path` (a temp or backup staged for the locked output) to the lock file open as `fd`."""
    os.lseek(fd, 0, os.SEEK_END)
    os.write(fd, f"{_abspath(path)}\n".encode())


@dataclass(frozen=True)
class Swept:
    """One lock or marker `sweep` removed: its file, what it said, and the temps it listed."""

    path: str
    kind: str  # lock | process
    holder: str
    removed: tuple[str, ...] = ()


def _take(path: Path) -> int | None:
    """An open fd holding `path`'s flock when no live process holds it (None: held, or gone)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def sweep(run: Path) -> list[Swept]:
    """Remove every lock and process marker in `run` that no live process holds (its holder was killed: a
    holder that ends removes its own), and the temps each lock lists. Safe beside live stages: a held file is
    left alone, and a writer that opened a lock file just removed here retries on a fresh one (the inode
    check in `ops.outputs`)."""
    swept = []
    for path in sorted(run.iterdir()) if run.is_dir() else []:
        kind = "lock" if path.name.endswith(LOCK_SUFFIX) else "process" if path.name.startswith(MARKER_PREFIX) else None
        if kind is None or (fd := _take(path)) is None:
            continue
        try:
            lines = _lines(fd)
            removed = remove_listed(fd) if kind == "lock" else []
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        finally:
            os.close(fd)
        holder = lines[0].strip() if lines else ""
        swept.append(Swept(str(path), kind, _describe(holder) if kind == "process" else holder, tuple(removed)))
    return swept


def _describe(line: str) -> str:
    """A process marker's first line (`marker`'s JSON) as `<stage or command> (pid N)`."""
    try:
        info = json.loads(line)
        return f"{info.get('dvc_stage') or info.get('what') or '?'} (pid {info.get('pid', '?')})"
    except (ValueError, AttributeError):
        return line[:200]


@contextlib.contextmanager
def marker(what: str, cwd: str | Path = ".") -> Iterator[Path | None]:
    """Mark this process as a stage running in the checkout holding `cwd` while the body runs (None outside a
    checkout with a run folder): a file held with `flock` and removed at the end, which a SIGKILL leaves
    behind, unheld, for `sweep`. `what`: the command, recorded in it."""
    run = find(cwd)
    if run is None:
        yield None
        return
    path = run / f"{MARKER_PREFIX}{os.getpid()}-{proc_start_time(os.getpid()) or 0}.json"
    info = {"pid": os.getpid(), "host": socket.gethostname(), "what": what, "argv": sys.argv,
            "dvc_stage": os.environ.get("DVC_STAGE", "")}
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(fd, fcntl.LOCK_EX)  # blocks only while a sweep looks at a file of this name
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # swept between our open and flock: make it again
    os.ftruncate(fd, 0)
    os.write(fd, (json.dumps(info) + "\n").encode())
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        os.close(fd)
