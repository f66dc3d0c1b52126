"""Learning measured on a fixed probe: K prompts of RL's pool x S samples, with the same sampling seeds at every
checkpoint and in every cell, scored at step 0, the middle and the end of a run.

The training reward of a step is 8 rollouts on other prompts than the step before, so "first -> last third"
mixes learning with which prompts came up. The probe holds prompts and seeds fixed: the change of a prompt's
success rate between two checkpoints is the policy's, and two cells from one init are compared prompt by
prompt (paired). The probe has two halves: K prompts of the run's own pool (what RL trains on: learning) and
K_t prompts of RL's side outside the pool (`probe_transfer_entries`: prompts RL never trains on, from the
same distribution: transfer), each chosen by a seed that does not depend on the cell, so every cell of an
init probes the same prompts with the same seeds, and step 0 is the same policy in each of them
(tests/test_probe.py); held-out evaluation stays the measure of generalisation. Conditioning: the cell's evaluation token (`<|high_reward|>` under
`rc` and `fixed`, none under `none`), as evaluation conditions.

- `probe_ids`: the K entries; `probe_specs`: the engine groups (entry, S tokens, sampling with its fixed
  seed); `score_probe`: per entry, the mean reward of its S samples.
- `ProbeMixin` (a `TrainerCallback`, `callbacks.lazy_subclass`): scores the probe at the run's start (step 0),
  at `max_steps // 2` and at the end, on the same engine backend the rollouts use (the refreshed snapshot,
  the live model or vLLM; a run stopped early: at its last step), and appends each point to `PROBE_FILE` in
  the checkpoint folder (a resumed run keeps the points up to its checkpoint and measures the later ones again). `probe_summary`: the run's curve, the
  change from step 0 to the end per half, paired over the half's prompts: the mean with a bootstrap CI, the
  prompts up and down, and their exact sign test.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rcgrpo import draw
from rcgrpo.stats import bootstrap_ci, mcnemar_exact
from rcgrpo_tasks.engine import rollout as engine_rollout
from rcgrpo_tasks.env.rewards import reward_value
from rcgrpo_tasks.ops.inputs import read_jsonl

PROBE_FILE = "probe.jsonl"
"""One JSON line per probe point: {step, entries, rewards (per entry, mean of S), samples, n_pool (the first
n_pool entries are pool prompts, the rest transfer prompts)}."""


def probe_ids(pool: list[str], k: int, seed: int) -> list[str]:
    """K entries of the pool, drawn by `seed` from its sorted ids (independent of the pool's order)."""
    ids = sorted(pool)
    random.Random(f"rcgrpo-probe:{seed}").shuffle(ids)
    return ids[:k]


def probe_specs(entries: list, samples: int, token: str | None, sampling_for) -> list[tuple]:
    """Engine groups of the probe: (entry, `samples` x `token`, sampling), the sampling seed fixed per entry
    (`sampling_for(seed)`), so every checkpoint and every cell draws the same random numbers."""
    return [(e, [token] * samples, sampling_for(draw.token_seed(-1, 0, i))) for i, e in enumerate(entries)]


def score_probe(groups, reward: str) -> list[float]:
    """Per group (entry): the mean reward of its samples (a missing reward counts 0)."""
    return [sum(reward_value(t.score, reward) or 0.0 for t in grp) / len(grp) for grp in groups]


def read_points(folder: Path) -> list[dict]:
    """The probe points a run has written so far (`PROBE_FILE`), oldest first."""
    path = Path(folder) / PROBE_FILE
    return read_jsonl(path) if path.is_file() else []


class ProbeMixin:
    """Probe points at step 0, `max_steps // 2` and the end (module docstring). Set `trainer` before training."""

    def __init__(self, folder: Path, rollout, entries: list, samples: int, token: str | None, reward: str,
                 max_steps: int, n_pool: int | None = None):
        self.folder, self.rollout, self.entries = Path(folder), rollout, entries
        self.n_pool = len(entries) if n_pool is None else n_pool
        self.samples, self.token, self.reward = samples, token, reward
        self.steps = sorted({0, max_steps // 2, max_steps})
        self.trainer = None

    def _point(self, step: int) -> None:
        if step not in self.steps or self.trainer is None or any(p["step"] == step for p in read_points(self.folder)):
            return
        model = self.trainer.model
        was_training = model.training
        model.eval()
        try:
            backend = self.rollout.backend(self.trainer)
            specs = probe_specs(self.entries, self.samples, self.token, self.rollout.cfg.decode.sampling)
            groups = engine_rollout.run_seeded_groups(backend, specs, self.rollout.protocol)
        finally:
            model.train(was_training)
        rewards = score_probe(groups, self.reward)
        if not self.trainer.accelerator.is_main_process:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        row = {"step": step, "entries": [e.id for e in self.entries], "rewards": rewards, "samples": self.samples,
               "n_pool": self.n_pool}
        with (self.folder / PROBE_FILE).open("a") as fh:
            fh.write(json.dumps(row, sort_keys=True) + "\n")

    def on_train_begin(self, args, state, control, **kwargs):
        self._forget_after(state.global_step)
        self._point(state.global_step)

    def _forget_after(self, step: int) -> None:
        """Drop the points of steps after `step` (a cut run wrote them after its last checkpoint; the resumed
        run measures them again)."""
        path = self.folder / PROBE_FILE
        points = read_points(self.folder)
        if self.trainer is not None and self.trainer.accelerator.is_main_process and any(p["step"] > step for p in points):
            path.write_text("".join(json.dumps(p, sort_keys=True) + "\n" for p in points if p["step"] <= step))

    def on_step_end(self, args, state, control, **kwargs):
        self._point(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        # A run stopped early (divergence) ends on the policy it saves: probe that one as its end.
        if state.global_step not in self.steps:
            self.steps.append(state.global_step)
        self._point(state.global_step)


def change(start: list[float], end: list[float], seed: int = 0) -> dict:
    """end - start paired over prompts: the mean with a 95 % bootstrap CI, the prompts up / down and the exact
    sign test of those (a bootstrap of 12 prompts is never below 0 when none went down: the test says more)."""
    diffs = [b - a for a, b in zip(start, end)]
    if not diffs:
        return {"mean": float("nan"), "ci_low": float("nan"), "ci_high": float("nan"), "prompts": 0, "up": 0,
                "down": 0, "sign_p": 1.0}
    lo, hi = bootstrap_ci(diffs, seed=seed)
    up, down = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    return {"mean": sum(diffs) / len(diffs), "ci_low": lo, "ci_high": hi, "prompts": len(diffs), "up": up,
            "down": down, "sign_p": mcnemar_exact(up, down)}


def probe_summary(points: list[dict], seed: int = 0) -> dict | None:
    """{entries, steps, reward (mean per point, pool half), change: end - step 0 over the pool half's prompts
    (`change`: paired, the same prompts and seeds at both points), transfer: the same for the prompts outside
    the pool (None without them), per_entry: {step: rewards}}; None without a step-0 point and a later one."""
    by_step = {p["step"]: p for p in points}
    if 0 not in by_step or len(by_step) < 2:
        return None
    steps = sorted(by_step)
    k = by_step[0].get("n_pool", len(by_step[0]["rewards"]))
    start, end = by_step[0]["rewards"], by_step[steps[-1]]["rewards"]
    out = {"entries": by_step[0]["entries"][:k], "samples": by_step[0]["samples"], "steps": steps,
           "reward": [sum(by_step[s]["rewards"][:k]) / k for s in steps],
           "change": change(start[:k], end[:k], seed),
           "per_entry": {str(s): by_step[s]["rewards"][:k] for s in steps}, "transfer": None}
    if len(start) > k:
        n = len(start) - k
        out["transfer"] = {"entries": by_step[0]["entries"][k:], "change": change(start[k:], end[k:], seed),
                           "reward": [sum(by_step[s]["rewards"][k:]) / n for s in steps],
                           "per_entry": {str(s): by_step[s]["rewards"][k:] for s in steps}}
    return out
