"""Multi-turn rollout engine: drives protocol episodes with a generation backend, records trajectories.

`run_group(backend, entry, n, protocol_cfg, sampling, reward_tokens)` is one GRPO group: n rollouts of one
entry in lockstep on one backend session (rollout i conditioned on reward_tokens[i]); the shared prompt
prefix is prefilled once and each rollout's KV cache is extended with each observation (`hf` backend).
`run_rollouts` runs many entries, packing several groups per session (`batch_rows`) so decoding is
batched; `replay_calls` drives the same engine with a scripted policy that emits given calls (gold replay,
expert trajectories). Every trajectory is scored with `rcgrpo_tasks.scoring.score_entry`.

Token bookkeeping (what RL trains on): the sequence is the chat template's rendering of the messages,
built incrementally: prompt tokens, then each completion's sampled ids verbatim (mask 1, with their
sampling log-probs), then the template tokens that close the assistant message and render the
environment's messages and the next generation prompt (mask 0). Only the text that the template adds
after the previous prompt is tokenized, so sampled ids are never re-tokenized. A rollout whose next
prompt would not fit the model's context ends with `context_limit` (the overflowing messages dropped).
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rcgrpo_tasks.backends import Backend, Completion, SamplingParams, ScriptedBackend
from rcgrpo_tasks.bfcl import Entry
from rcgrpo_tasks.calls import format_calls, parse_call_string
from rcgrpo_tasks.protocols import Episode, ProtocolConfig, initial_messages
from rcgrpo_tasks.scoring import score_entry
from rcgrpo_tasks.trajectory import Trajectory

ENGINE_VERSION = 1
DEFAULT_FINAL_TEXT = "I have completed the requested task."
"""What scripted replays say to end an official turn (any text that decodes to no call)."""


class ChatRenderer:
    """Chat-template rendering as token ids: full prompts and incremental continuations."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def text(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"] if text else []

    def continuation(self, prev_prompt: str, messages: list[dict], assistant_at: int, stop_token: str | None,
                     generation_prompt: bool) -> tuple[str, list[int]]:
        """(new full text, ids of what follows the sampled completion at `messages[assistant_at]`).

        `prev_prompt` is the rendering that the completion was sampled after; `stop_token` the sampled
        stop token's text (it is already in the sequence), None when the completion was cut at the length cap.
        """
        full = self.text(messages, generation_prompt)
        if not full.startswith(prev_prompt):
            raise ValueError("chat template re-renders earlier messages differently; incremental tokens impossible")
        tail = full[len(prev_prompt):]
        content = messages[assistant_at]["content"]
        at = tail.find(content) if content else 0
        after = tail[at + len(content):] if at >= 0 else tail
        if stop_token and after.startswith(stop_token):
            after = after[len(stop_token):]
        return full, self.ids(after)


@dataclass
class _Rollout:
    episode: Episode
    key: int
    prompt_text: str
    token_ids: list[int]
    prompt_len: int
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    wall_time_s: float = 0.0

    def append(self, ids: list[int], model: bool, logprobs: list[float] | None = None) -> None:
        self.token_ids += ids
        self.mask += [1 if model else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


def _start(episode: Episode, key: int, renderer: ChatRenderer) -> _Rollout:
    text = renderer.text(episode.messages, True)
    ids = renderer.ids(text)
    return _Rollout(episode, key, text, list(ids), len(ids), [0] * len(ids), [0.0] * len(ids))


def _advance(r: _Rollout, comp: Completion, renderer: ChatRenderer, backend: Backend) -> None:
    """Feed one completion to the episode and extend the token sequence with the environment's reply."""
    r.append(comp.token_ids, True, comp.logprobs)
    n_before = len(r.episode.messages)
    r.episode.step(comp.text)  # appends the assistant message and whatever the environment adds
    stop = None
    if comp.finish_reason == "stop" and comp.token_ids:
        stop = renderer.tok.convert_ids_to_tokens(comp.token_ids[-1])
    gen = not r.episode.done
    text, ids = renderer.continuation(r.prompt_text, r.episode.messages, n_before, stop, gen)
    if len(r.token_ids) + len(ids) + (1 if gen else 0) > backend.max_positions:
        # The observation / next turn does not fit: drop it and end the rollout on the closed assistant turn.
        r.episode.truncate(n_before + 1, "context_limit")
        text, ids = renderer.continuation(r.prompt_text, r.episode.messages, n_before, stop, False)
    r.prompt_text = text
    r.append(ids, False)


def run_episodes(backend: Backend, episodes: Sequence[Episode], sampling: SamplingParams,
                 provenance: dict | None = None) -> list[Trajectory]:
    """Run episodes in lockstep on one backend session; returns their scored trajectories (same order)."""
    t0 = time.perf_counter()
    renderer = ChatRenderer(backend.tokenizer)
    rollouts = [_start(ep, i, renderer) for i, ep in enumerate(episodes)]
    session = backend.session()
    try:
        while active := [r for r in rollouts if not r.episode.done]:
            caps = []
            for r in active:
                room = backend.max_positions - len(r.token_ids)
                if room < 1:
                    r.episode.terminate("context_limit")
                caps.append(min(sampling.max_new_tokens, room))
            active = [r for r in active if not r.episode.done]
            caps = [c for c in caps if c >= 1]
            if not active:
                break
            completions = session.generate([r.key for r in active], [r.token_ids for r in active], sampling, caps)
            for r, comp in zip(active, completions):
                _advance(r, comp, renderer, backend)
                if r.episode.done:
                    r.wall_time_s = time.perf_counter() - t0
    finally:
        session.close()
    for r in rollouts:  # rollouts that ended before their first generation (context limit)
        r.wall_time_s = r.wall_time_s or time.perf_counter() - t0
    base = {"backend": backend.describe(), "sampling": dataclasses.asdict(sampling), "engine": ENGINE_VERSION}
    base.update(provenance or {})
    return [_to_trajectory(r, base) for r in rollouts]


def _to_trajectory(r: _Rollout, provenance: dict) -> Trajectory:
    ep = r.episode
    score = score_entry(ep.entry, ep.result).to_json()
    return Trajectory(
        entry_id=ep.entry.id, category=ep.entry.category, protocol=ep.cfg.protocol,
        reward_token=ep.reward_token, messages=ep.messages, token_ids=r.token_ids, prompt_len=r.prompt_len,
        completion_mask=r.mask, logprobs=r.logprobs, result=ep.result, termination=ep.termination or "error",
        n_steps=ep.n_steps, n_model_tokens=sum(r.mask), wall_time_s=round(r.wall_time_s, 3), score=score,
        provenance={**provenance, "protocol": dataclasses.asdict(ep.cfg)},
    )


def group_seed(seed: int | None, entry_id: str) -> int | None:
    """Per-entry seed: results do not depend on which other entries ran or in what order."""
    return None if seed is None else (seed * 1_000_003 + zlib.crc32(entry_id.encode())) % (2**63)


def run_group(backend: Backend, entry: Entry, n: int, protocol_cfg: ProtocolConfig, sampling: SamplingParams,
              reward_tokens: Sequence[str | None] | None = None, provenance: dict | None = None) -> list[Trajectory]:
    """One GRPO group: n rollouts of `entry`, rollout i conditioned on reward_tokens[i]."""
    tokens = list(reward_tokens) if reward_tokens is not None else [None] * n
    if len(tokens) != n:
        raise ValueError(f"reward_tokens has {len(tokens)} items for a group of {n}")
    episodes = [Episode(entry, protocol_cfg, t) for t in tokens]
    sp = dataclasses.replace(sampling, seed=group_seed(sampling.seed, entry.id))
    return run_episodes(backend, episodes, sp, provenance)


def run_rollouts(backend: Backend, entries: Sequence[Entry], g: int, protocol_cfg: ProtocolConfig,
                 sampling: SamplingParams, reward_token_fn: Callable[[Entry, int], str | None] | None = None,
                 batch_rows: int = 8, provenance: dict | None = None,
                 progress: Callable[[list[Trajectory]], None] | None = None) -> list[Trajectory]:
    """g rollouts of every entry (returned in entry order, g consecutive per entry).

    Groups are packed `batch_rows` rows to a session (whole groups only) so decoding is batched. Entries
    are first ordered by system prompt (= by their set of tool classes): entries packed together then
    share the whole system prompt, which the session prefills once for all their rows.
    """
    per_batch = max(1, batch_rows // g)
    order = sorted(range(len(entries)), key=lambda i: (initial_messages(entries[i], protocol_cfg)[0]["content"], i))
    done: dict[int, list[Trajectory]] = {}
    for start in range(0, len(order), per_batch):
        chunk = order[start:start + per_batch]
        episodes = [Episode(entries[j], protocol_cfg, reward_token_fn(entries[j], i) if reward_token_fn else None)
                    for j in chunk for i in range(g)]
        sp = dataclasses.replace(sampling, seed=group_seed(sampling.seed, entries[chunk[0]].id))
        trajs = run_episodes(backend, episodes, sp, provenance)
        for k, j in enumerate(chunk):
            done[j] = trajs[k * g:(k + 1) * g]
        if progress:
            progress(trajs)
    return [t for j in range(len(entries)) for t in done[j]]


def replay_steps(entry: Entry, protocol_cfg: ProtocolConfig, turns_of_calls: Sequence[Sequence],
                 final_text: str = DEFAULT_FINAL_TEXT) -> list[str]:
    """The model outputs that replay `turns_of_calls` (per turn: call strings = one step, or a list of steps)."""
    steps_per_turn = [[list(t)] if t and isinstance(t[0], str) else [list(s) for s in t] for t in turns_of_calls]
    render = lambda step: format_calls([parse_call_string(c) for c in step])  # noqa: E731
    texts: list[str] = []
    if protocol_cfg.protocol == "paper":
        texts = [render(s) for steps in steps_per_turn for s in steps if s]
        return texts + ["[done()]"]
    for steps in steps_per_turn:
        texts += [render(s) for s in steps if s] + [final_text]
    return texts


def replay_calls(entry: Entry, protocol_cfg: ProtocolConfig, turns_of_calls: Sequence[Sequence], tokenizer,
                 reward_token: str | None = None, final_text: str = DEFAULT_FINAL_TEXT,
                 max_positions: int = 1_000_000, provenance: dict | None = None) -> Trajectory:
    """A scripted rollout that emits the given calls (e.g. `entry.ground_truth`) with real observations."""
    texts = replay_steps(entry, protocol_cfg, turns_of_calls, final_text)
    backend = ScriptedBackend(tokenizer, [texts], max_positions=max_positions)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=1_000_000)
    return run_episodes(backend, [Episode(entry, protocol_cfg, reward_token)], sampling,
                        {"source": "replay", **(provenance or {})})[0]
