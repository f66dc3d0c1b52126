"""Rollout engine: drives episodes (of any task, `env.tasks`) with a generation backend, records trajectories.

`run_group(backend, entry, n, protocol_cfg, sampling, reward_tokens)` is one GRPO group: n rollouts of one
entry in lockstep on one backend session (rollout i conditioned on reward_tokens[i]); the shared prompt
prefix is prefilled once and each rollout's KV cache is extended with each observation (`hf` backend).
`run_groups` decodes many groups together (all in one session, or whole groups packed `batch_rows` rows
to a session) with per-rollout seeds, so a rollout's tokens do not depend on its batch; `run_seeded_groups`
decodes groups that each carry their own sampling seed in one session (RL's generation batch); `run_rollouts`
runs g rollouts of many entries through it; `replay_calls` drives the same engine with a scripted policy
that emits given calls (gold replay, expert trajectories). Every trajectory is scored by its episode (the
task's scorer: `env.multi_turn.scoring.score_entry` for multi-turn, BFCL's AST checker for single-turn).

Memory pressure: a step that fails with CUDA out-of-memory (or cuDNN's attention error under it) splits
its batch's unfinished rollouts in half and continues each half on a fresh session, with a
`MemorySplitWarning`; finished rollouts are kept; a single rollout that does not fit raises.

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
import warnings
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rcgrpo_tasks.engine.backend import Backend, Completion, SamplingParams, ScriptedBackend
from rcgrpo_tasks.engine.device import MemorySplitWarning, free_memory, is_memory_error
from rcgrpo_tasks.engine.sampling import row_seed
from rcgrpo_tasks.engine.trajectory import Trajectory
from rcgrpo_tasks.env.contract import Entry, Episode
from rcgrpo_tasks.env.prompt import ProtocolConfig
from rcgrpo_tasks.env.tasks import task_of

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
    """Run episodes in lockstep on one backend session; returns their scored trajectories (same order).

    Episode i samples with row seed `row_seed(sampling.seed, i)` (unseeded when `sampling.seed` is None).
    """
    return _run(backend, episodes, [sampling] * len(episodes), list(range(len(episodes))), provenance)


def _run(backend: Backend, episodes: Sequence[Episode], samplings: Sequence[SamplingParams], indices: Sequence[int],
         provenance: dict | None) -> list[Trajectory]:
    """Episodes decoded together; episode i samples with seed `row_seed(samplings[i].seed, indices[i])` and
    records `samplings[i]` (they differ only in seed). Splits the batch on memory errors (`_drive`)."""
    t0 = time.perf_counter()
    renderer = ChatRenderer(backend.tokenizer)
    rollouts = [_start(ep, i, renderer) for i, ep in enumerate(episodes)]
    seeds = {i: row_seed(sp.seed, j) for i, (sp, j) in enumerate(zip(samplings, indices)) if sp.seed is not None}
    _drive(backend, rollouts, samplings[0] if samplings else None, renderer, seeds, t0)
    for r in rollouts:  # rollouts that ended before their first generation (context limit)
        r.wall_time_s = r.wall_time_s or time.perf_counter() - t0
    described = backend.describe()
    return [_to_trajectory(r, {"backend": described, "sampling": dataclasses.asdict(sp), "engine": ENGINE_VERSION,
                               **(provenance or {})})
            for r, sp in zip(rollouts, samplings)]


def _drive(backend: Backend, rollouts: list[_Rollout], sampling: SamplingParams, renderer: ChatRenderer,
           seeds: dict[int, int], t0: float) -> None:
    """Run `rollouts` to the end. When a batch does not fit in memory (`is_memory_error`), its unfinished
    rollouts are split in half and each half runs on a fresh session (re-prefilled from the rollout's
    sequence so far), with a `MemorySplitWarning`; finished rollouts are kept. Rows seeded per rollout
    sample the same tokens in a half as in the whole batch. A single row that does not fit raises."""
    batches = [rollouts]
    while batches:
        batch = batches.pop()
        error = _drive_batch(backend, batch, sampling, renderer, seeds, t0)
        if error is None:
            continue
        left = [r for r in batch if not r.episode.done]
        half = (len(left) + 1) // 2
        warnings.warn(f"{error}: out of memory decoding {len(left)} rollouts together; retrying as "
                      f"{half} + {len(left) - half} ({len(batch) - len(left)} finished kept)", MemorySplitWarning,
                      stacklevel=2)
        free_memory()
        batches += [left[half:], left[:half]]  # the first half runs next


def _drive_batch(backend: Backend, rollouts: list[_Rollout], sampling: SamplingParams, renderer: ChatRenderer,
                 seeds: dict[int, int], t0: float) -> str | None:
    """Run `rollouts` on one session until all are done (None), or until a memory error hits a step of more
    than one rollout (its description; the rollouts are as they were before that step)."""
    session = backend.session()
    session.seed_rows({r.key: seeds[r.key] for r in rollouts if r.key in seeds})
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
            try:
                completions = session.generate([r.key for r in active], [r.token_ids for r in active], sampling, caps)
            except Exception as exc:
                if not is_memory_error(exc):
                    raise
                if len(active) == 1:
                    exc.add_note(f"rcgrpo: one rollout ({len(active[0].token_ids)} tokens) does not fit in memory, "
                                 "even alone")
                    raise
                # The description only: the exception's traceback holds the failed step's tensors.
                return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
            for r, comp in zip(active, completions):
                _advance(r, comp, renderer, backend)
                if r.episode.done:
                    r.wall_time_s = time.perf_counter() - t0
    finally:
        session.close()
    return None


def _to_trajectory(r: _Rollout, provenance: dict) -> Trajectory:
    ep = r.episode
    score = ep.score().to_json()
    return Trajectory(
        entry_id=ep.entry.id, category=ep.entry.category, protocol=ep.cfg.protocol,
        reward_token=ep.reward_token, messages=ep.messages, token_ids=r.token_ids, prompt_len=r.prompt_len,
        completion_mask=r.mask, logprobs=r.logprobs, result=ep.result, termination=ep.termination or "error",
        n_steps=ep.n_steps, n_model_tokens=sum(r.mask), wall_time_s=round(r.wall_time_s, 3), score=score,
        provenance={**provenance, "task": task_of(ep.entry).name, "protocol": ep.cfg.record()},
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
    return run_groups(backend, [(entry, tokens)], protocol_cfg, sampling, provenance)[0]


def run_groups(backend: Backend, groups: Sequence[tuple[Entry, Sequence[str | None]]], protocol_cfg: ProtocolConfig,
               sampling: SamplingParams, provenance: dict | None = None, batch_rows: int | None = None,
               progress: Callable[[list[Trajectory]], None] | None = None) -> list[list[Trajectory]]:
    """GRPO groups `(entry, reward token per rollout)` decoded together: every rollout of every group in one
    session (`batch_rows=None`), or whole groups packed `batch_rows` rows to a session, in the given order.

    Rollout i of a group samples with seed `row_seed(group_seed(sampling.seed, entry.id), i)`, so its tokens
    do not depend on which groups share its batch (up to float rounding of the batched logits): decoding all
    groups at once gives the rollouts that one `run_group` per group gives. `progress` gets each session's
    trajectories.
    """
    chunks: list[list[int]] = []
    for k, (_, tokens) in enumerate(groups):
        rows = sum(len(groups[j][1]) for j in chunks[-1]) if chunks else 0
        if chunks and (batch_rows is None or rows + len(tokens) <= batch_rows):
            chunks[-1].append(k)
        else:
            chunks.append([k])
    out: list[list[Trajectory]] = [[] for _ in groups]
    for chunk in chunks:
        episodes, samplings, indices = [], [], []
        for k in chunk:
            entry, tokens = groups[k]
            sp = dataclasses.replace(sampling, seed=group_seed(sampling.seed, entry.id))
            episodes += [task_of(entry).episode(entry, protocol_cfg, t) for t in tokens]
            samplings += [sp] * len(tokens)
            indices += range(len(tokens))
        trajs = _run(backend, episodes, samplings, indices, provenance)
        at = 0
        for k in chunk:
            out[k], at = trajs[at:at + len(groups[k][1])], at + len(groups[k][1])
        if progress:
            progress(trajs)
    return out


def run_seeded_groups(backend: Backend, groups: Sequence[tuple[Entry, Sequence[str | None], SamplingParams]],
                      protocol_cfg: ProtocolConfig, provenance: dict | None = None) -> list[list[Trajectory]]:
    """GRPO groups `(entry, reward token per rollout, sampling)`, each with its OWN sampling seed, all decoded
    in one session (RL: every group of a generation batch at once).

    Rollout i of a group samples with seed `row_seed(group_seed(sampling.seed, entry.id), i)`, exactly as
    `run_group(backend, entry, n, protocol_cfg, sampling, tokens)` seeds it, so decoding the groups together
    gives the rollouts one `run_group` per group gives (up to float rounding of the batched logits), while
    the backend decodes every row in one batch and prefills each distinct prompt prefix once. The samplings
    may differ only in their seed (one decode loop serves every row)."""
    shared = {dataclasses.replace(sp, seed=None) for _, _, sp in groups}
    if len(shared) > 1:
        raise ValueError(f"run_seeded_groups: samplings differ in more than their seed: {sorted(map(str, shared))}")
    episodes, samplings, indices = [], [], []
    for entry, tokens, sampling in groups:
        sp = dataclasses.replace(sampling, seed=group_seed(sampling.seed, entry.id))
        episodes += [task_of(entry).episode(entry, protocol_cfg, t) for t in tokens]
        samplings += [sp] * len(tokens)
        indices += range(len(tokens))
    trajs = _run(backend, episodes, samplings, indices, provenance) if episodes else []
    out, at = [], 0
    for _, tokens, _ in groups:
        out.append(trajs[at:at + len(tokens)])
        at += len(tokens)
    return out


def run_rollouts(backend: Backend, entries: Sequence[Entry], g: int, protocol_cfg: ProtocolConfig,
                 sampling: SamplingParams, reward_token_fn: Callable[[Entry, int], str | None] | None = None,
                 batch_rows: int | None = 8, provenance: dict | None = None,
                 progress: Callable[[list[Trajectory]], None] | None = None) -> list[Trajectory]:
    """g rollouts of every entry (returned in entry order, g consecutive per entry).

    Groups are packed `batch_rows` rows to a session (whole groups only; None = all entries in one session)
    so decoding is batched (`run_groups`). Entries are first ordered by system prompt (= by their set of
    tool classes): entries packed together then share the whole system prompt, which the session
    prefills once for all their rows.
    """
    order = sorted(range(len(entries)),
                   key=lambda i: (task_of(entries[i]).initial_messages(entries[i], protocol_cfg)[0]["content"], i))
    groups = [(entries[j], [reward_token_fn(entries[j], i) if reward_token_fn else None for i in range(g)])
              for j in order]
    done = run_groups(backend, groups, protocol_cfg, sampling, provenance, batch_rows, progress)
    by_entry = dict(zip(order, done))
    return [t for j in range(len(entries)) for t in by_entry[j]]


def replay_steps(entry: Entry, protocol_cfg: ProtocolConfig, turns_of_calls: Sequence[Sequence],
                 final_text: str = DEFAULT_FINAL_TEXT) -> list[str]:
    """The model outputs that replay `turns_of_calls` (the entry's task renders them: `Task.replay_texts`)."""
    return task_of(entry).replay_texts(entry, protocol_cfg, turns_of_calls, final_text)


def replay_calls(entry: Entry, protocol_cfg: ProtocolConfig, turns_of_calls: Sequence[Sequence], tokenizer,
                 reward_token: str | None = None, final_text: str = DEFAULT_FINAL_TEXT,
                 max_positions: int = 1_000_000, provenance: dict | None = None) -> Trajectory:
    """A scripted rollout that emits the given calls (e.g. `entry.ground_truth`) with real observations."""
    texts = replay_steps(entry, protocol_cfg, turns_of_calls, final_text)
    backend = ScriptedBackend(tokenizer, [texts], max_positions=max_positions)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=1_000_000)
    return run_episodes(backend, [task_of(entry).episode(entry, protocol_cfg, reward_token)], sampling,
                        {"source": "replay", **(provenance or {})})[0]
