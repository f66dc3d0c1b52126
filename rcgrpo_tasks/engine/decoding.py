"""THE decoding settings of every stage that rolls a model: sampling, output budgets, engine.

`DecodeConfig` is composed into each decoding stage's config (`EvaluateConfig`, `SampleConfig`,
`GenerateConfig`, `ControllabilityConfig`, `RLConfig`) with `ops.config.flat_field`, so its keys sit flat in
the stage's own params section (`evaluate.max_new_tokens`) and are checked here, once. A stage exposes the
keys it owns; the others are fixed by the stage and say where they come from (controllability samples at
`rl.temperature`; RL's engine is the trainer's own policy). The seed is not here: every stage's `seed`
seeds more than decoding (entry samples, bootstrap, perturbations), so it stays the stage's and is passed
to `sampling`. Where a stage decodes is params `compute.device` (`engine.compute`), shared by all stages.

The upper bounds are far above any real run and exist to fail fast, before any work, on a typo such as
`max_new_tokens: 100000000`. Where a stage knows its model, `check_context` holds `max_new_tokens` to what
that model can hold: one output beside a prompt within its `max_position_embeddings`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rcgrpo_tasks.engine.backend import SamplingParams
from rcgrpo_tasks.engine.models import model_context
from rcgrpo_tasks.ops.config import ConfigError

MAX_NEW_TOKENS = 131_072
"""Per model output: the longest context of any model this pipeline targets."""
PROMPT_FLOOR = 64
"""Fewest tokens an episode's first prompt takes (the chat template's markers, a system prompt, a question):
an output budget must leave at least this room in the model's context."""
MAX_OUTPUTS = 1_000
"""Model outputs per episode / per turn."""
MAX_BATCH_ROWS = 16_384
MAX_TEMPERATURE = 100.0


def check_sampling(temperature: float, top_p: float) -> None:
    """THE bounds of a temperature and a top_p (ValueError outside them)."""
    if not 0 <= temperature <= MAX_TEMPERATURE or not 0 < top_p <= 1:
        raise ValueError(f"need 0 <= temperature <= {MAX_TEMPERATURE} and 0 < top_p <= 1")


@dataclass(frozen=True)
class DecodeConfig:
    """How a stage decodes (its params section holds these keys flat)."""

    temperature: float
    """Sampling temperature; 0 = greedy."""
    top_p: float
    """Nucleus sampling."""
    max_outputs: int
    """Model outputs per episode (`paper` protocol) or per turn (`official`); the prompt is params `prompt`."""
    max_new_tokens: int
    """Tokens per model output (one step of an episode)."""
    backend: Literal["hf", "vllm"]
    """Inference engine: `hf` (the project's transformers decoder) or `vllm` (vLLM: the `[gpu]` extra on CUDA, the
    CPU vLLM environment `make vllm-venv` on a CPU); docs/engine.md "vLLM" has the choice, docs/log.md
    the measurements."""
    dtype: Literal["float32", "bfloat16", "auto"]
    """Weights dtype; `auto` = THE dtype rule (`engine.dtype`: bf16 on a GPU with bf16, on a CPU as params
    `compute.cpu_bf16` says), resolved once by the stage (`engine.compute.resolve_compute`), both backends."""
    batch_rows: int
    """Rollouts decoded together in one session (hf)."""

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_p)
        for name, cap in (("max_outputs", MAX_OUTPUTS), ("max_new_tokens", MAX_NEW_TOKENS),
                          ("batch_rows", MAX_BATCH_ROWS)):
            if not 1 <= getattr(self, name) <= cap:
                raise ValueError(f"{name} must be in [1, {cap}], got {getattr(self, name)}")

    def check_context(self, model_dir: str | Path, key: str) -> None:
        """ConfigError naming `key` (e.g. `params.yaml:evaluate.max_new_tokens`) and the model's context when one
        output of `max_new_tokens` cannot fit in the context of `model_dir` beside a prompt (`PROMPT_FLOOR`).
        Reads only config.json, so it fails before any weights load; a folder without one is left to the loader.
        A longer prompt leaves less room: the rollout cuts each output to the room its prompt leaves."""
        if not (Path(model_dir) / "config.json").is_file():
            return
        context = model_context(model_dir)
        if self.max_new_tokens > context - PROMPT_FLOOR:
            raise ConfigError(f"{key} {self.max_new_tokens}: one output cannot fit in the context of {model_dir} "
                              f"({context} positions, config.json max_position_embeddings) beside a prompt of at "
                              f"least {PROMPT_FLOOR} tokens; use at most {context - PROMPT_FLOOR}")

    def sampling(self, seed: int | None, **extra) -> SamplingParams:
        """The engine's per-call sampling parameters (`extra`: guidance)."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, max_new_tokens=self.max_new_tokens,
                              seed=seed, **extra)
