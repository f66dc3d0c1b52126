"""Generation backends behind one interface: token-id prompts in, sampled token ids + log-probs out.

`Backend.session()` returns a `Session` whose `generate(keys, prompts, sampling)` continues a set of
rollouts (one row per key). A session may keep state between calls; callers pass each row's WHOLE
sequence so far and the backend decides what it can reuse:
- `hf` (CPU or CUDA, also the in-memory model TRL trains: `HFBackend.from_model(model, tokenizer)`):
  transformers with a hand-written decode loop over one preallocated KV cache per session
  (`rcgrpo_tasks/engine/hf.py`): all rows of a call decoded together, prompt prefixes shared by rows
  (the system prompt + task of a GRPO group) prefilled once, and at later steps each row's cache extended
  with only the new tokens (tool observations, next user turn) instead of re-prefilling the
  conversation. Log-probs are those of the sampling distribution `softmax(logits / T)` (T = 1 when
  greedy) — what TRL recomputes for the GRPO ratio; top-p truncation is not folded in.
- `vllm` (`engine/vllm.py`; the `[gpu]` extra on CUDA, `make vllm-venv` on a CPU): vLLM's offline engine with
  automatic prefix caching (the same reuse, done by vLLM) and LoRA requests for adapters. Import-guarded.
- `scripted`: a policy from a script or callable (tests, expert/gold replay); no model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Sequence

DEFAULT_MAX_POSITIONS = 8192


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    max_new_tokens: int = 256
    """Per model output (one step)."""
    seed: int | None = None
    guidance: float = 0.0
    """Reward-token guidance scale w (0 = off; beyond the paper): the next-token logits are
    `l_goal + w * (l_goal - l_other)`, `l_goal` with the row's own reward goal, `l_other` with the other
    token in its place (classifier-free guidance between the two goals, arXiv 2306.17806). `hf` only."""
    guidance_pair: tuple[int, int] | None = None
    """Token ids (high, low) of the two reward goals; needed when `guidance` > 0 (`reward_pair_ids`)."""

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_new_tokens < 1:
            raise ValueError(f"invalid sampling params {self}")
        if self.guidance < 0 or (self.guidance > 0 and (self.guidance_pair is None or len(set(self.guidance_pair)) != 2)):
            raise ValueError(f"guidance must be >= 0, and > 0 needs two distinct guidance_pair ids: {self}")


@dataclass
class Completion:
    token_ids: list[int]
    """Sampled ids, including the stop token when the model produced one."""
    logprobs: list[float]
    text: str
    """Decoded text without the stop token."""
    finish_reason: str
    """`stop` (a stop token) or `length`."""


class Session:
    """Continues a set of rollouts; see module docstring."""

    def generate(self, keys: Sequence[Hashable], prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 max_new_tokens: Sequence[int] | None = None) -> list[Completion]:
        raise NotImplementedError

    def seed_rows(self, seeds: Mapping[Hashable, int]) -> None:
        """Give rows (by key) their own sampling seeds, so a row samples the same tokens whatever else is in its
        batch. Backends without per-row seeds ignore it (`vllm` seeds per request)."""

    def close(self) -> None:
        pass


class Backend:
    name = "base"
    tokenizer: Any
    max_positions: int = DEFAULT_MAX_POSITIONS

    def session(self) -> Session:
        raise NotImplementedError

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Completion]:
        """One-shot batch generation (a fresh session)."""
        sess = self.session()
        try:
            return sess.generate(list(range(len(prompts))), prompts, sampling)
        finally:
            sess.close()

    def describe(self) -> dict:
        return {"backend": self.name}

    @property
    def stop_ids(self) -> set[int]:
        return stop_token_ids(self.tokenizer)


def stop_token_ids(tokenizer, generation_config=None) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    extra = getattr(generation_config, "eos_token_id", None)
    ids.update(extra if isinstance(extra, (list, tuple)) else [extra] if extra is not None else [])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")  # ChatML turn end, eos or not
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return ids


def reward_pair_ids(tokenizer, tokens: tuple[str, str]) -> tuple[int, int]:
    """Ids of the (high, low) reward tokens, for `SamplingParams.guidance_pair`; a tokenizer without them
    (a model never RCTP-trained) raises ValueError naming the token."""
    ids = []
    for tok in tokens:
        i = tokenizer.convert_tokens_to_ids(tok)
        if not isinstance(i, int) or i == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(i) != tok:
            raise ValueError(f"guidance: the tokenizer has no token {tok!r} (only reward-conditioned models "
                             f"can be guided)")
        ids.append(i)
    return ids[0], ids[1]


def decode_text(tokenizer, ids: list[int], stops: set[int]) -> str:
    body = ids[:-1] if ids and ids[-1] in stops else ids
    return tokenizer.decode(body, skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------- scripted
class ScriptedBackend(Backend):
    """A policy without a model: `policy(key, step, prompt_ids) -> text`, or per-key lists of texts.

    Completions are the text's tokens plus the stop token, with log-prob 0.0. When a list script runs out
    the policy answers "" (ends the turn / episode).
    """

    name = "scripted"

    def __init__(self, tokenizer, policy: Callable[[Hashable, int, list[int]], str] | dict | list,
                 max_positions: int = DEFAULT_MAX_POSITIONS):
        self.tokenizer, self.max_positions = tokenizer, max_positions
        if callable(policy):
            self.policy = policy
        else:
            scripts = dict(enumerate(policy)) if isinstance(policy, list) else dict(policy)
            self.policy = lambda key, step, _ids: (scripts[key][step] if step < len(scripts[key]) else "")
        self.eos = tokenizer.eos_token_id

    def session(self) -> Session:
        return _ScriptedSession(self)


class _ScriptedSession(Session):
    def __init__(self, backend: ScriptedBackend):
        self.b, self.steps = backend, {}

    def generate(self, keys, prompts, sampling, max_new_tokens=None):
        out = []
        for i, (key, prompt) in enumerate(zip(keys, prompts)):
            step = self.steps.get(key, 0)
            self.steps[key] = step + 1
            text = self.b.policy(key, step, list(prompt))
            ids = self.b.tokenizer.encode(text, add_special_tokens=False)
            cap = max_new_tokens[i] if max_new_tokens is not None else sampling.max_new_tokens
            finish = "stop" if len(ids) < cap else "length"
            ids = ids[:cap - 1] + [self.b.eos] if finish == "stop" else ids[:cap]
            out.append(Completion(ids, [0.0] * len(ids), decode_text(self.b.tokenizer, ids, {self.b.eos}), finish))
        return out
