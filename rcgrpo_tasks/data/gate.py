"""The quality gate's stamp: `passed.json` vouches for one exact trajectory file (sha256 + row count).

validate_trajectories writes it only when every expectation passed; label_rewards (and anything else that
consumes trajectories) calls `require_passed` first, so a failed gate stops the pipeline even outside DVC.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from rcgrpo_tasks.ops.inputs import read_json

PASSED_FILE = "passed.json"
RESULT_FILE = "validation_result.json"


class ValidationFailed(RuntimeError):
    """The expectation suite failed; the message is the readable summary."""


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------------
# Rows -> one flat record per trajectory


def require_passed(validation_dir: str | Path, trajectories: str | Path) -> dict:
    """Raise ValidationFailed unless `validation_dir/passed.json` vouches for this exact file."""
    stamp = Path(validation_dir) / PASSED_FILE
    if not stamp.is_file():
        raise ValidationFailed(f"{trajectories} has not passed validate_trajectories ({stamp} missing; "
                               f"see {Path(validation_dir) / RESULT_FILE})")
    record = read_json(stamp)
    if record.get("sha256") != file_sha256(trajectories):
        raise ValidationFailed(f"{trajectories} changed since it passed validation ({stamp}); re-run "
                               "validate_trajectories")
    return record


def stamp(trajectories: Path, n_rows: int) -> dict:
    """The passed.json record for `trajectories`."""
    return {"trajectories": str(trajectories), "sha256": file_sha256(trajectories), "n_rows": n_rows}
