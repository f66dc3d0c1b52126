"""THE output writer of the package: outputs appear all at once or not at all, and two writers of one
output never both succeed.

`atomic_outputs`, `atomic_path`, `atomic_dir`, `write_*`: every output is built in a temp sibling (same
filesystem) and renamed into place when the body succeeds; `atomic_outputs` publishes several outputs
together (datasets and metrics) and rolls the already-renamed ones back if a later rename fails. Each output
holds an exclusive `fcntl` lock while it is written (in the checkout's run folder, `ops.rundir`; elsewhere
`.<name>.lock` beside it), so a second writer fails at once naming the holder's pid; the lock lists the temps
staged for the output, so the next writer removes what a killed one left. OS errors (read-only folder, file
too large, disk full) become OutputError naming the final path, not the temp; so do the writers that report a
full disk without an OSError (torch's zip writer, safetensors: `disk_full`). Inputs are read by `ops.inputs`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import re
import resource
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from rcgrpo_tasks.ops import rundir
from rcgrpo_tasks.ops.inputs import InputError


class OutputError(InputError):
    """An output could not be written (permissions, size, disk, a concurrent writer); names the path.

    A subclass of InputError so every stage's existing `except InputError` exits 2 with the message."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_HELD: dict[str, tuple[int, int]] = {}  # lock path -> (fd, depth): re-entrant within one process
_TEMPS: dict[Path, Path] = {}  # staged temp -> its final output, so nested writers name the real path


def public_path(path: str | Path) -> Path:
    """`path` with any staged temp prefix replaced by the output it will become (for messages)."""
    path = Path(path)
    changed = True
    while changed:
        changed = False
        for tmp, final in _TEMPS.items():
            if path == tmp or tmp in path.parents:
                path, changed = final / path.relative_to(tmp), True
                break
    return path


def _write_error(path: Path, exc: OSError) -> OutputError:
    """OutputError naming the final output path (never the temp) and the OS reason."""
    path = public_path(path)
    reason = exc.strerror or str(exc)
    hint = {errno.EACCES: "no write permission", errno.EPERM: "no write permission",
            errno.EROFS: "read-only filesystem", errno.EFBIG: "file too large (size limit)",
            errno.ENOSPC: "disk full"}.get(exc.errno or -1)
    return OutputError(f"cannot write {path}: {hint + ' - ' if hint else ''}{reason}")


DISK_FULL = re.compile(r"no space left|file too large|disk quota|file write failed|failed writing file|"
                       r"filetoolarge|storagefull|os error (27|28|122)|inline_container\.cc.*unexpected pos|"
                       r"PytorchStreamWriter failed",
                       re.I)
"""How torch's zip writer (`inline_container.cc`: a RuntimeError such as `unexpected pos` or `PytorchStreamWriter
failed writing file`) and safetensors (SafetensorError) report a full disk or a file over the size limit:
neither raises OSError, and neither names the path."""


def disk_full(exc: BaseException) -> bool:
    """Whether `exc` is a write that failed for lack of space or over the file size limit (`ulimit -f`)."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
    return isinstance(exc, Exception) and bool(DISK_FULL.search(str(exc)))


def _mib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def space_note(path: str | Path) -> str:
    """What limits writes under `path`: free space on its filesystem and any file size limit."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    notes = []
    with contextlib.suppress(OSError):
        notes.append(f"{_mib(shutil.disk_usage(folder).free)} free there")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        notes.append(f"file size limit {_mib(limit)} (ulimit -f)")
    return ", ".join(notes)


def disk_full_error(paths: str | Path | list[Path], exc: BaseException) -> OutputError:
    """OutputError naming the output(s) `paths` (never a temp) for a `disk_full` error: one line."""
    paths = [Path(p) for p in paths] if isinstance(paths, list) else [Path(paths)]
    text = str(exc).strip()
    first = text.splitlines()[0][:300] if text else type(exc).__name__
    note = space_note(paths[0]) if paths else ""
    named = ", ".join(str(public_path(p)) for p in paths) or "output"
    return OutputError(f"{named}: could not be written (disk full or file too large: {first}){'; ' + note if note else ''}")


def lock_path(path: str | Path) -> Path:
    """The lock file guarding output `path`: in its checkout's run folder (`ops.rundir.lock_file`), else
    `.<name>.lock` in the same folder."""
    path = Path(path)
    return rundir.lock_file(path) or path.with_name(f".{path.name}.lock")


def _note(output: Path, staged: Path) -> None:
    """Record `staged` (a temp or backup of `output`) in its held lock, for the next holder after a kill."""
    held = _HELD.get(str(lock_path(output).resolve()))
    if held is not None:
        rundir.note(held[0], staged)


@contextlib.contextmanager
def output_lock(path: str | Path) -> Iterator[Path]:
    """Hold an exclusive lock on output `path` (re-entrant in this process). A second process gets an
    OutputError at once naming the output and the holder's pid. The lock file is removed on release; the
    inode check after `flock` makes that safe (a waiter that locked a just-removed file retries)."""
    path = Path(path)
    lock = lock_path(path)
    created = [d for d in (path.parent, *path.parent.parents) if not d.exists()]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _write_error(path, exc) from exc
    key = str(lock.resolve())
    if key in _HELD:
        fd, depth = _HELD[key]
        _HELD[key] = (fd, depth + 1)
        try:
            yield lock
        finally:
            fd, depth = _HELD[key]
            _HELD[key] = (fd, depth - 1)
        return
    try:
        fd = _acquire(lock, path)
    except OSError as exc:
        raise _write_error(path, exc) from exc
    _HELD[key] = (fd, 1)
    try:
        yield lock
    finally:
        del _HELD[key]
        with contextlib.suppress(OSError):
            lock.unlink()
        os.close(fd)
        for folder in created:  # folders made only to hold the lock go again when nothing was published
            with contextlib.suppress(OSError):
                folder.rmdir()


SWEEP_WAIT_S = 1.0  # a busy lock is retried this long first: `rundir.sweep` holds a free one for an instant


def _acquire(lock: Path, path: Path) -> int:
    deadline = time.monotonic() + SWEEP_WAIT_S
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").split("\n")[0].strip() or "?"
            os.close(fd)
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            raise OutputError(f"{path} is being written by another process (pid {holder}, lock {lock}); "
                              "two writers to one output are refused: wait for it or choose another output") from None
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            rundir.remove_listed(fd)  # a killed holder's half-written temps: ours to remove, we hold the lock
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)  # the previous holder removed the file between our open and flock: retry


class OutputSet:
    """Outputs staged by `atomic_outputs`: `file(path)` / `dir(path)` return the temp to write into."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self._stack = stack
        self.staged: list[tuple[Path, Path]] = []  # (final, temp)

    def _stage(self, path: str | Path, make) -> Path:
        path = Path(path)
        if any(final == path for final, _ in self.staged):
            raise ValueError(f"output {path} staged twice")
        self._stack.enter_context(output_lock(path))
        try:
            tmp = Path(make(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        except OSError as exc:
            raise _write_error(path, exc) from exc
        _note(path, tmp)
        self.staged.append((path, tmp))
        _TEMPS[tmp] = path
        return tmp

    def file(self, path: str | Path) -> Path:
        """Temp file (created empty) that becomes `path` on commit."""
        def make(**kw):
            fd, name = tempfile.mkstemp(**kw)
            os.close(fd)
            return name
        return self._stage(path, make)

    def dir(self, path: str | Path) -> Path:
        """Temp folder (created empty) that replaces folder `path` on commit."""
        return self._stage(path, tempfile.mkdtemp)

    def temp(self, path: str | Path) -> Path:
        """The temp already staged for output `path`."""
        return next(tmp for final, tmp in self.staged if final == Path(path))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _publishable(tmp: Path, mask: int) -> None:
    """Modes as any new file would get (umask): mkstemp/mkdtemp and writers such as safetensors create
    owner-only files, which would lock other users and containers out of a shared output."""
    os.chmod(tmp, (0o777 if tmp.is_dir() else 0o666) & ~mask)
    if tmp.is_dir():
        for root, dirs, files in os.walk(tmp):
            for name in dirs:
                os.chmod(os.path.join(root, name), 0o777 & ~mask)
            for name in files:
                path = os.path.join(root, name)
                if not os.path.islink(path):
                    os.chmod(path, (os.stat(path).st_mode | 0o666) & ~mask & 0o777)


def _commit(staged: list[tuple[Path, Path]]) -> None:
    """Rename every temp into place; on any failure undo the renames already done and restore the old
    outputs, so the set is published whole or not at all (barring a crash inside this loop)."""
    mask = _umask()
    done: list[tuple[Path, Path, Path | None]] = []  # (final, temp, backup of the old output)
    try:
        for final, tmp in staged:
            if not tmp.exists():
                raise FileNotFoundError(errno.ENOENT, "its temporary was removed before commit", str(tmp))
            _publishable(tmp, mask)
            backup = None
            if final.exists() or final.is_symlink():
                backup = final.with_name(f".{final.name}.old.{os.getpid()}")
                _note(final, backup)
                _remove(backup)
                os.replace(final, backup)
            try:
                os.replace(tmp, final)
            except OSError:
                if backup is not None:
                    os.replace(backup, final)
                raise
            done.append((final, tmp, backup))
    except OSError as exc:
        failed = final
        for final, tmp, backup in reversed(done):
            with contextlib.suppress(OSError):
                os.replace(final, tmp)
                if backup is not None:
                    os.replace(backup, final)
        raise _write_error(failed, exc) from exc
    for _, _, backup in done:
        if backup is not None:
            _remove(backup)


def _translate(exc: OSError, staged: list[tuple[Path, Path]]) -> OutputError | None:
    """An OSError from writing a temp, renamed to the output it belongs to (None: not ours)."""
    name = str(exc.filename or "")
    for final, tmp in staged:
        if name and (name == str(tmp) or name.startswith(f"{tmp}{os.sep}")):
            return _write_error(final, exc)
    if not name and exc.errno in (errno.EFBIG, errno.ENOSPC, errno.EROFS, errno.EDQUOT):
        return _write_error(Path(", ".join(str(public_path(f)) for f, _ in staged) or "output"), exc)
    return None


@contextlib.contextmanager
def claim_outputs(*paths: str | Path | None) -> Iterator[None]:
    """Hold the output locks of `paths` (None skipped) for the whole body: a stage claims its outputs
    before its work, so a second writer of any of them fails at once instead of after the work."""
    with contextlib.ExitStack() as stack:
        for path in paths:
            if path is not None:
                stack.enter_context(output_lock(path))
        yield


@contextlib.contextmanager
def atomic_outputs(before_commit: Callable[[], None] | None = None) -> Iterator[OutputSet]:
    """Stage several outputs and publish them together when the body succeeds:

        with atomic_outputs() as out:
            write_jsonl(out.file(dataset), rows)      # any writer works on the temp path
            d = out.dir(folder); ...                  # a folder output
            write_json(out.file(metrics), record)

    The body's error (or a failed rename) leaves every previous output untouched and no temp behind.
    OS errors name the final output path; a concurrent writer of any of the outputs gets OutputError.
    `before_commit` runs after the body and before the renames (the stage's run record): its error
    publishes nothing."""
    with contextlib.ExitStack() as stack:
        outputs = OutputSet(stack)
        try:
            yield outputs
            if before_commit is not None:
                before_commit()
            _commit(outputs.staged)
        except OSError as exc:
            translated = _translate(exc, outputs.staged)
            if translated is None:
                raise
            raise translated from exc
        except Exception as exc:
            if isinstance(exc, OutputError) or not disk_full(exc):
                raise
            raise disk_full_error([final for final, _ in outputs.staged], exc) from exc
        finally:
            for _, tmp in outputs.staged:
                _TEMPS.pop(tmp, None)
                if tmp.exists() or tmp.is_symlink():
                    _remove(tmp)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp file path next to `path`; on success rename it to `path`, on error delete it."""
    with atomic_outputs() as out:
        yield out.file(path)


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temp directory next to `path`; on success replace `path` with it, on error delete it."""
    with atomic_outputs() as out:
        yield out.dir(path)


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | Path, obj: object) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> int:
    n = 0
    with atomic_path(path) as tmp, tmp.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
            n += 1
    return n


def format_cell(value: Any) -> str:
    """A TSV cell: "" for no value (None, NaN), integral numbers exactly, other floats to 6 significant digits."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:.6g}"
    return str(value)


def write_tsv(path: Path, rows: list[dict], columns: tuple[str, ...]) -> None:
    """A per-step plots file (`dvc plots`; read back by `ops.inputs.read_tsv`): a header of `columns`, one
    line per row (missing = empty)."""
    lines = ["\t".join(columns)] + ["\t".join(format_cell(r.get(c)) for c in columns) for r in rows]
    write_text(path, "\n".join(lines) + "\n")
