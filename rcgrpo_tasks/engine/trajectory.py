"""Trajectory records: one rollout (multi-turn or single-turn), as JSONL rows with a versioned schema.

A trajectory carries everything later stages need without re-running the model:
- the chat (`messages`: system/user/assistant/tool dicts) and the whole rendered token sequence
  (`token_ids`), with `prompt_len` (tokens before the first model generation), `completion_mask`
  (1 = sampled by the model, 0 = prompt / environment / chat-template tokens) and `logprobs` (the
  sampling log-prob of each model token, 0.0 elsewhere) — what GRPO needs for its ratio and masks;
- `result`: the model's calls as BFCL result format (turns -> steps -> call strings), so
  `rcgrpo score` and bfcl-eval's checker can read it; `score`: the shared scorer's verdict;
- bookkeeping: termination reason, step/token counts, wall time, provenance (model, adapter, sampling).

Rows are validated on load (`Trajectory.from_json`): a wrong schema version or inconsistent lengths raise
`TrajectoryError` naming the field, so a corrupt file never feeds training silently.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from rcgrpo_tasks.ops.inputs import InputError, read_jsonl
from rcgrpo_tasks.ops.outputs import write_jsonl

SCHEMA_VERSION = 1
PROTOCOLS = ("official", "paper")
TERMINATIONS = ("done", "completed", "step_limit", "context_limit", "error")
DATASET_WALL_TIME = 0.0
"""`wall_time_s` of the rows a DVC stage stores as a dataset (generate_trajectories, sample_policy): a
timing in every row would make the stage's output hash differ on every run and machine, so `dvc.lock`
could never vouch for it; those stages report their timings in their metrics instead."""


class TrajectoryError(ValueError):
    """A trajectory row is malformed; the message names the field."""


def new_trajectory_id() -> str:
    return uuid.uuid4().hex


def as_stage_output(trajs: Iterable[Trajectory], namespace: str) -> list[Trajectory]:
    """`trajs` as a DVC stage stores them (evaluate, controllability): each id derived from `namespace`, the
    row's position and its entry (uuid5) and wall time `DATASET_WALL_TIME`, so the same rollouts are the
    same bytes on every run; the stage's metrics keep the timings."""
    return [dataclasses.replace(t, trajectory_id=uuid.uuid5(uuid.NAMESPACE_URL, f"rcgrpo:{namespace}:{i}:{t.entry_id}").hex,
                                wall_time_s=DATASET_WALL_TIME)
            for i, t in enumerate(trajs)]


@dataclass
class Trajectory:
    entry_id: str
    category: str
    protocol: str
    reward_token: str | None
    messages: list[dict]
    token_ids: list[int]
    prompt_len: int
    completion_mask: list[int]
    logprobs: list[float]
    result: list[list[list[str]]]
    termination: str
    n_steps: int
    n_model_tokens: int
    wall_time_s: float
    score: dict | None = None
    provenance: dict = field(default_factory=dict)
    trajectory_id: str = field(default_factory=new_trajectory_id)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.schema_version != SCHEMA_VERSION:
            raise TrajectoryError(f"schema_version {self.schema_version!r} != supported {SCHEMA_VERSION}")
        if self.protocol not in PROTOCOLS:
            raise TrajectoryError(f"protocol {self.protocol!r} not in {PROTOCOLS}")
        if self.termination not in TERMINATIONS:
            raise TrajectoryError(f"termination {self.termination!r} not in {TERMINATIONS}")
        n = len(self.token_ids)
        if len(self.completion_mask) != n or len(self.logprobs) != n:
            raise TrajectoryError(
                f"token_ids ({n}), completion_mask ({len(self.completion_mask)}) and logprobs "
                f"({len(self.logprobs)}) must have the same length"
            )
        if not 0 <= self.prompt_len <= n:
            raise TrajectoryError(f"prompt_len {self.prompt_len} outside [0, {n}]")
        if any(self.completion_mask[: self.prompt_len]):
            raise TrajectoryError("completion_mask has model tokens inside the prompt")
        if not isinstance(self.result, list) or not all(
            isinstance(t, list) and all(isinstance(s, list) for s in t) for t in self.result
        ):
            raise TrajectoryError("result must be turns -> steps -> call strings")

    @property
    def reward(self) -> float | None:
        """The paper's binary reward (None when unscored)."""
        return None if self.score is None else float(self.score["paper_reward"])

    def to_json(self) -> dict:
        """Row dict; `id` repeats `entry_id` so a G=1 file is also a BFCL result file (`rcgrpo score`)."""
        return {"id": self.entry_id, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, d: dict) -> "Trajectory":
        if not isinstance(d, dict):
            raise TrajectoryError(f"expected an object, got {type(d).__name__}")
        if "id" in d:
            if d["id"] != d.get("entry_id"):
                raise TrajectoryError(f"id {d['id']!r} != entry_id {d.get('entry_id')!r}")
            d = {k: v for k, v in d.items() if k != "id"}
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(n for n in names if n not in d and n not in ("score", "provenance", "trajectory_id"))
        unknown = sorted(set(d) - names)
        if missing or unknown:
            raise TrajectoryError(f"missing field(s) {missing}, unknown field(s) {unknown}")
        try:
            return cls(**d)
        except TypeError as exc:
            raise TrajectoryError(str(exc)) from exc


def write_trajectories(path: str | Path, trajectories: Iterable[Trajectory]) -> int:
    """Write trajectories as JSONL atomically; returns the number written."""
    return write_jsonl(path, (t.to_json() for t in trajectories))


def read_trajectories(path: str | Path) -> list[Trajectory]:
    """A trajectory JSONL, every row validated; a bad row raises InputError naming the file and line."""
    out = []
    for lineno, row in enumerate(read_jsonl(path), 1):
        try:
            out.append(Trajectory.from_json(row))
        except TrajectoryError as exc:
            raise InputError(f"{path}: row {lineno}: {exc}") from exc
    return out
