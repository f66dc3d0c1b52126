"""The teacher-forced margin while RCTP trains: when does the model start to read its reward token?

`MarginCurveMixin` (a Trainer callback) measures `margin.teacher_forced_margin` of the model in
training on a fixed held-out contrast set, before the first step and every `every` optimizer steps (and at
the last), plus the reward-token rows' distance. Each point goes to MLflow (`margin`, `margin_ci_low`,
`margin_ci_high`, `token_rows_ratio`, at its step) and into `points` for the run's metrics JSON. Forward
passes only, in eval mode without gradient; training resumes unchanged (dropout state and RNG are not
touched by a no-grad eval forward). The points travel with every checkpoint (`callbacks.ResumableMixin`): a
resumed run keeps the points measured before its cut, logs them to its own MLflow run again, and measures at
the steps the uninterrupted run does (never at the step it resumes from).
"""

from __future__ import annotations

import time
from pathlib import Path

from rcgrpo_tasks.data.margin import REPLAY_OUTPUTS, contrast_set, teacher_forced_margin, token_row_distance
from rcgrpo_tasks.env.entries import split_entries, stratified
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.ops import tracking
from rcgrpo_tasks.train.common.callbacks import ResumableMixin, resumable_callback


class MarginCurveMixin(ResumableMixin):
    exported = ("points",)

    def __init__(self, entries: list, prompt: PromptConfig, tokens: tuple[str, str], every: int,
                 track: bool, seed: int = 0):
        self.entries, self.prompt, self.tokens, self.every = entries, prompt, tokens, every
        self.track, self.seed = track, seed
        self.items: list | None = None
        self.points: list[dict] = []

    def _measure(self, model, tokenizer, step: int) -> None:
        if any(p["step"] == step for p in self.points):
            return
        t0 = time.perf_counter()
        if self.items is None:
            proto = self.prompt.protocol_config(REPLAY_OUTPUTS)
            self.items, self.counts = contrast_set(self.entries, proto, tokenizer, self.tokens, seed=self.seed)
        stats = teacher_forced_margin(model, self.items, self.tokens, n_boot=1000, seed=self.seed)
        rows = token_row_distance(model, tokenizer, self.tokens, seed=self.seed)
        point = {"step": step, "margin": stats["margin"], "ci": stats["ci"],
                 "share_positive": stats["share_positive"], "n_entries": stats["n_entries"],
                 "kinds": {k: v["margin"] for k, v in stats["kinds"].items()},
                 "token_rows_distance": rows["distance"], "token_rows_ratio": rows["ratio"],
                 "seconds": round(time.perf_counter() - t0, 2)}
        self.points.append(point)
        self._log(point)

    def _log(self, point: dict) -> None:
        if self.track:
            tracking.log_metrics({"margin": point["margin"], "margin_ci_low": point["ci"][0],
                                  "margin_ci_high": point["ci"][1], "token_rows_ratio": point["token_rows_ratio"]},
                                 step=point["step"])

    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        self.restore(state)
        for point in self.points:  # a resumed run's MLflow run holds the whole curve
            self._log(point)
        if state.global_step == 0:
            self._measure(model, processing_class, 0)

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if state.global_step % self.every == 0 or state.global_step >= state.max_steps:
            self._measure(model, processing_class, state.global_step)


def margin_curve(entries_path: Path, split_path: Path, n_entries: int, prompt: PromptConfig,
                 tokens: tuple[str, str], every: int, track: bool, seed: int = 0):
    """The callback over the first `n_entries` dev entries (round-robin over categories): the curve is what
    RCTP's step count is chosen on, so it never reads the held-out side."""
    dev = split_entries(entries_path, split_path, "dev", None)
    return resumable_callback(MarginCurveMixin)(
        stratified(dev, n_entries), prompt, tokens, every, track, seed)
