"""ops/outputs.py: the one JSON/JSONL reader on hostile lines, all-or-nothing outputs, write faults that name
the path, and the lock that refuses a second writer of one output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rcgrpo_tasks.ops import inputs, outputs

HOSTILE = [
    b'{"id": "a", "n": 1}\n',                       # 1 good
    b"[" * 5000 + b"]" * 5000 + b"\n",              # 2 nested 5,000 deep: RecursionError inside json
    b'{"id": "\xff\xfe bad utf8"}\n',               # 3 invalid UTF-8
    b'{"id": "' + b"x" * 20000 + b'"}\n',            # 4 over the (test) line cap
    b"[1, 2, 3]\n",                                 # 5 not an object
    b"{not json\n",                                 # 6 bad JSON
    b"   \n",                                       # 7 blank: skipped, not an error
    b'{"id": "b", "s": "caf\xc3\xa9"}\n',           # 8 good (UTF-8)
    b'{"id": "c"}',                                 # 9 good, no final newline
]


@pytest.fixture()
def hostile(tmp_path) -> Path:
    path = tmp_path / "hostile.jsonl"
    path.write_bytes(b"".join(HOSTILE))
    return path


def test_lenient_reader_reports_every_bad_line_and_keeps_the_good(hostile):
    rows, errors = inputs.read_jsonl_numbered(hostile, max_line_bytes=12000)
    assert [(n, r["id"]) for n, r in rows] == [(1, "a"), (8, "b"), (9, "c")]
    assert rows[1][1]["s"] == "café"
    assert errors == [
        f"{hostile}:2: invalid JSON (nested too deeply)",
        f"{hostile}:3: invalid UTF-8 at byte 8",
        f"{hostile}:4: line longer than 12000 bytes",
        f"{hostile}:5: expected a JSON object, got list",
        f"{hostile}:6: invalid JSON at column 2 (Expecting property name enclosed in double quotes)",
    ]


def test_strict_reader_stops_at_the_first_bad_line(hostile):
    with pytest.raises(inputs.InputError, match=rf"^{hostile}:2: invalid JSON \(nested too deeply\)$"):
        inputs.read_jsonl(hostile)
    with pytest.raises(inputs.InputError, match=":2: "):
        inputs.read_jsonl_numbered(hostile, strict=True)


def test_huge_line_is_skipped_without_losing_line_numbers(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_bytes(b'{"i": 1}\n' + b'{"x": "' + b"y" * (3 << 20) + b'"}\n' + b'{"i": 3}\n')
    rows, errors = inputs.read_jsonl_numbered(path, max_line_bytes=1 << 20)
    assert [(n, r["i"]) for n, r in rows] == [(1, 1), (3, 3)]
    assert errors == [f"{path}:2: line longer than {1 << 20} bytes"]


def test_bom_on_first_line_and_crlf_are_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\r\n{"a": 2}\r\n')
    assert inputs.read_jsonl(path) == [{"a": 1}, {"a": 2}]


def test_unreadable_inputs_name_the_path(tmp_path):
    with pytest.raises(inputs.InputError, match=rf"{tmp_path}/nope.jsonl: file not found"):
        inputs.read_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(inputs.InputError, match="is a folder"):
        inputs.read_jsonl(tmp_path)


def test_json_errors_name_file_line_and_column_once(tmp_path):
    """A multi-line document's error names its line (split.json, trainer_state.json: every `read_json`), and a
    message of `json` ending in "at" is not followed by a second "at"."""
    doc = tmp_path / "split.json"
    doc.write_text('{\n  "train": ["a"],\n  "test": \n}\n')
    with pytest.raises(inputs.InputError) as exc:
        inputs.read_json(doc)
    assert str(exc.value) == f"{doc}:4: invalid JSON at column 1 (Expecting value)"
    doc.write_text('{\n  "train": ["a')
    with pytest.raises(inputs.InputError) as exc:
        inputs.read_json(doc)
    assert str(exc.value) == f"{doc}:2: invalid JSON at column 13 (Unterminated string)"
    doc.write_bytes(b'{\n  "train": ["\xff"]}')
    with pytest.raises(inputs.InputError, match=rf"^{doc}:2: invalid UTF-8 at byte 13$"):
        inputs.read_json(doc)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"a": 1}\n{"a": "x\u0001"}\n')
    assert inputs.read_jsonl_numbered(rows)[1] == [f"{rows}:2: invalid JSON at column 9 (Invalid control character)"]
    for error in inputs.read_jsonl_numbered(rows)[1]:
        assert " at at " not in error


def test_read_json_guards(tmp_path):
    ok = tmp_path / "ok.json"
    ok.write_text('{"a": [1, 2]}')
    assert inputs.read_json(ok) == {"a": [1, 2]}
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 5000 + "]" * 5000)
    with pytest.raises(inputs.InputError, match=rf"{deep}: invalid JSON \(nested too deeply\)"):
        inputs.read_json(deep, want=None)
    listed = tmp_path / "list.json"
    listed.write_text("[1]")
    with pytest.raises(inputs.InputError, match="expected a JSON dict, got list"):
        inputs.read_json(listed)
    with pytest.raises(inputs.InputError, match="larger than 4 bytes"):
        inputs.read_json(ok, max_bytes=4)
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"a": "\x80"}')
    with pytest.raises(inputs.InputError, match="invalid UTF-8"):
        inputs.read_json(bad)


# -- writing ---------------------------------------------------------------------------------------------

def test_outputs_appear_together_or_not_at_all(tmp_path):
    data, metrics, folder = tmp_path / "d.jsonl", tmp_path / "m.json", tmp_path / "folder"
    outputs.write_json(metrics, {"old": True})
    with pytest.raises(RuntimeError):
        with outputs.atomic_outputs() as out:
            outputs.write_jsonl(out.file(data), [{"a": 1}])
            (out.dir(folder) / "x.txt").write_text("x")
            raise RuntimeError("the metrics step failed")
    assert not data.exists() and not folder.exists()
    assert json.loads(metrics.read_text()) == {"old": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]  # no temp, no lock file left

    with outputs.atomic_outputs() as out:
        outputs.write_jsonl(out.file(data), [{"a": 1}])
        (out.dir(folder) / "x.txt").write_text("x")
        outputs.write_json(out.file(metrics), {"new": True})
    assert inputs.read_jsonl(data) == [{"a": 1}] and (folder / "x.txt").read_text() == "x"
    assert json.loads(metrics.read_text()) == {"new": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "folder", "m.json"]
    assert oct(data.stat().st_mode & 0o777) != oct(0o600)  # not mkstemp's owner-only mode


def test_a_failed_rename_rolls_back_the_outputs_already_published(tmp_path, monkeypatch):
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    outputs.write_json(first, {"v": 1})
    outputs.write_json(second, {"v": 1})
    real = os.replace
    def flaky(src, dst):
        if Path(dst) == second and str(src).endswith(".tmp"):  # publishing fails, restoring works
            raise OSError(28, "No space left on device", str(dst))
        return real(src, dst)
    monkeypatch.setattr(outputs.os, "replace", flaky)
    with pytest.raises(outputs.OutputError, match=rf"cannot write {second}: disk full"):
        with outputs.atomic_outputs() as out:
            outputs.write_json(out.file(first), {"v": 2})   # write_json's own rename is inside the temp: fine
            outputs.write_json(out.file(second), {"v": 2})
    monkeypatch.setattr(outputs.os, "replace", real)
    assert json.loads(first.read_text()) == {"v": 1} and json.loads(second.read_text()) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first.json", "second.json"]


HOLDER = """
import sys, time
from rcgrpo_tasks.ops import inputs, outputs
with outputs.atomic_dir(sys.argv[1]) as tmp:
    print("locked", flush=True)
    time.sleep(30)
"""


def test_second_writer_of_one_output_fails_with_a_lock_message(tmp_path):
    out = tmp_path / "eval"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(outputs.OutputError, match=rf"{out} is being written by another process \(pid {holder.pid}"):
            with outputs.atomic_dir(out):
                pass
    finally:
        holder.kill()
        holder.wait()
    with outputs.atomic_dir(out) as tmp:  # the holder's death released the lock
        (tmp / "a").write_text("a")
    assert (out / "a").exists() and not outputs.lock_path(out).exists()


def test_same_process_may_nest_writes_under_one_output(tmp_path):
    out = tmp_path / "o.json"
    with outputs.atomic_path(out) as outer:
        outputs.write_json(out, {"inner": True})  # the same process: re-entrant, not "another process"
        outer.write_text('{"outer": true}')
    assert json.loads(out.read_text()) == {"outer": True}


WRITER = """
import resource, sys
from rcgrpo_tasks.ops import inputs, outputs
if sys.argv[2] == "fsize":
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    with outputs.atomic_outputs() as out:
        outputs.write_json(out.file(sys.argv[1] + "/metrics.json"), {"x": 1})
        outputs.write_text(out.file(sys.argv[1] + "/data.txt"), "y" * 100000)
except outputs.OutputError as exc:
    print(exc)
    sys.exit(2)
"""


def _writer(folder: Path, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WRITER, str(folder), mode], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent, timeout=60)


def test_file_too_large_names_the_output_and_writes_nothing(tmp_path):
    r = _writer(tmp_path, "fsize")
    assert r.returncode == 2, r.stderr
    assert f"cannot write {tmp_path}/data.txt: file too large" in r.stdout
    assert list(tmp_path.iterdir()) == []  # metrics.json was staged too: nothing published, no temps


def test_read_only_folder_names_the_output(tmp_path, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    if os.geteuid() == 0:  # root ignores permission bits: make the folder refuse new files as the OS would
        def refuse(*args, dir=None, **kwargs):
            raise PermissionError(13, "Permission denied", str(Path(dir) / "x"))
        monkeypatch.setattr(outputs.tempfile, "mkstemp", refuse)
        monkeypatch.setattr(outputs.os, "open", lambda p, *a, **k: refuse(dir=folder))
    try:
        with pytest.raises(outputs.OutputError, match=rf"cannot write {folder}/metrics.json: no write permission"):
            outputs.write_json(folder / "metrics.json", {"x": 1})
    finally:
        monkeypatch.undo()
        folder.chmod(0o755)
    assert list(folder.iterdir()) == []
