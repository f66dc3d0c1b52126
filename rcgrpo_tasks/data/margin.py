"""Does a reward-conditioned model read its token? The teacher-forced margin, from forward passes only.

For an entry with an expert answer E and a near miss N of kind k (a well-formed answer that scores 0):

    margin_k = [lp(E | high) - lp(E | low)] - [lp(N | high) - lp(N | low)]

where lp(x | token) is the summed log-probability of the model's tokens of x (the completion mask: the
assistant's tokens, never the prompt or the environment's) with the reward goal of `token` in the prompt.
It is 0 for a model that ignores its token (up to the packed forward's float rounding, ~1e-5: the test
bounds it at 5e-5), whatever it thinks of E and N, and positive when the
high token moves probability toward the success relative to the failure. Sampling cannot see a shift of a
tenth of a nat on a 135M model (a sampled gap has SE ~0.09 at 16 entries x 3 samples); this can.

- `contrast_set`: per entry the expert replay and one verified near miss per kind (replayed through the
  rollout engine with real observations, kept only if it scores 0; seeded attempts), under both tokens:
  the same token bookkeeping a rollout has (`engine.rollout.replay_calls`). Entries whose expert does not
  score 1 or whose replay does not fit the context are skipped and counted.
- `sequence_logprobs`: summed log-probs of the masked tokens, no gradient; whole entries' contrast sets
  (both tokens) packed as one prefix tree (`engine.shared_prefix`): every shared prompt token once.
- `margin_stats`: per kind and overall (per entry: the mean over its kinds), the mean with its 95 %
  percentile-bootstrap CI over entries and the share of entries above 0.
Beyond the paper: the paper shows controllability by sampling only.
Why here, in `data/`: it is read by both training (the RCTP margin curve while RCTP-FT trains,
`train.sft.margin_curve`) and evaluation after it (`evaluation.controllability`, the evaluate stage), which are
siblings that never import each other, so it sits in the layer right below both.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from itertools import groupby

from rcgrpo.stats import bootstrap_ci, mean
from rcgrpo_tasks.engine.rollout import replay_calls
from rcgrpo_tasks.engine.shared_prefix import target_hidden, trunk_and_head, trunk_tokens
from rcgrpo_tasks.env.tasks import task_of

EXPERT = "expert"
REPLAY_OUTPUTS = 64
"""Output budget of the replays (`PromptConfig.protocol_config(REPLAY_OUTPUTS)`): room for any gold script,
so an expert is never cut by a stage's decoding budget."""


@dataclass(frozen=True)
class Contrast:
    """One teacher-forced sequence: an entry's expert answer or near miss (`kind`) under one reward token."""

    entry_id: str
    kind: str
    token: str
    token_ids: tuple[int, ...]
    mask: tuple[int, ...]


def _replay(entry, proto, script, tokenizer, token: str, max_positions: int):
    return replay_calls(entry, proto, script, tokenizer, reward_token=token, max_positions=max_positions,
                        provenance={"source": "margin"})


def _near_miss(entry, kind: str, proto, tokenizer, token: str, seed: int, attempts: int, max_positions: int):
    """(script, its replay under `token`) of the first seeded perturbation of `kind` whose replay scores 0
    (None: the kind yields none here)."""
    task = task_of(entry)
    seen = set()
    for attempt in range(attempts):
        p = task.perturb(entry, kind, random.Random(f"{seed}:margin:{entry.id}:{kind}:{attempt}"))
        if p is None or p.turns in seen:
            continue
        seen.add(p.turns)
        traj = _replay(entry, proto, p.turns, tokenizer, token, max_positions)
        if traj.termination != "context_limit" and traj.reward == 0.0:
            return p.turns, traj
    return None


def contrast_set(entries: list, proto, tokenizer, tokens: tuple[str, str], kinds: tuple[str, ...] | None = None,
                 seed: int = 0, attempts: int = 8, max_positions: int = 8192) -> tuple[list[Contrast], dict]:
    """(sequences, counts): every entry's expert and one near miss per kind (default: every kind the task
    knows), each under `tokens` = (high, low). The near miss is chosen once per entry and kind (under the
    high token's prompt; the low prompt differs only in its reward goal), so both tokens see the same text."""
    high, low = tokens
    out: list[Contrast] = []
    counts = {"entries": 0, "entries_skipped": 0, "near_misses": {}}
    for entry in entries:
        task = task_of(entry)
        expert = task.expert_script(entry)
        first = _replay(entry, proto, expert, tokenizer, high, max_positions)
        if first.reward != 1.0 or first.termination == "context_limit":
            counts["entries_skipped"] += 1
            continue
        scripts = {EXPERT: (expert, first)}  # each with its verified replay under the high token
        for kind in kinds if kinds is not None else task.perturbations:
            if kind in task.perturbations:
                found = _near_miss(entry, kind, proto, tokenizer, high, seed, attempts, max_positions)
                if found is not None:
                    scripts[kind] = found
                    counts["near_misses"][kind] = counts["near_misses"].get(kind, 0) + 1
        if len(scripts) == 1:
            counts["entries_skipped"] += 1
            continue
        counts["entries"] += 1
        for kind, (script, under_high) in scripts.items():
            for token, t in ((high, under_high), (low, _replay(entry, proto, script, tokenizer, low, max_positions))):
                out.append(Contrast(entry.id, kind, token, tuple(t.token_ids), tuple(t.completion_mask)))
    return out, counts


MARGIN_CHUNK_TOKENS = 1024
"""Tokens one margin forward packs (after sharing: its prefix tree's), whole entries' contrast sets; an entry
larger than this is one forward of its own. Whole entries so that an entry's prompt runs once (its twelve
sequences split across two forwards ran it twice); ~1k because the dense mask grows with its square while
the trunk's tokens barely fall beyond it (docs/log.md, "Shared prefix")."""


def sequence_logprobs(model, items: list[Contrast], shared: bool = True) -> list[float]:
    """Summed log p of each item's masked tokens under `model` (eval mode, no gradient), in item order.

    Consecutive items of one entry (its expert and near misses under both tokens) stay in one chunk, and whole
    entries fill a chunk up to `MARGIN_CHUNK_TOKENS` tokens of its prefix tree (`margin_chunks`); a chunk is
    one forward of that tree (`engine.shared_prefix`): the prompt its items share runs once (the system prompt
    once for the chunk's entries), each answer attends to its own prefix only, and the LM head runs on the
    masked positions only. `shared=False`: the padded forward of each chunk (bench)."""
    import torch

    device = next(model.parameters()).device
    out: list[float] = []
    was_training = model.training
    model.eval()
    try:
        trunk, head = trunk_and_head(model)
        with torch.no_grad():
            for chunk in margin_chunks(items):
                out += _chunk_logprobs(trunk, head, chunk, device, shared)
    finally:
        model.train(was_training)
    return out


def margin_chunks(items: list[Contrast], budget: int = MARGIN_CHUNK_TOKENS) -> list[list[Contrast]]:
    """`items` in order, cut only between entries (runs of one `entry_id`), each chunk as many whole entries as
    fit `budget` tokens of their prefix tree (`trunk_tokens`); an entry over `budget` is a chunk alone."""
    chunks: list[list[Contrast]] = []
    chunk: list[Contrast] = []
    for _, run in groupby(items, key=lambda c: c.entry_id):
        run = list(run)
        if chunk and trunk_tokens([list(c.token_ids) for c in chunk + run]) > budget:
            chunks.append(chunk)
            chunk = []
        chunk += run
    return chunks + [chunk] if chunk else chunks


def _chunk_logprobs(trunk, head, chunk: list[Contrast], device, shared: bool) -> list[float]:
    import torch

    width = max(len(c.token_ids) for c in chunk)
    ids = torch.zeros((len(chunk), width), dtype=torch.long)
    attn = torch.zeros((len(chunk), width), dtype=torch.long)
    keep = torch.zeros((len(chunk), width), dtype=torch.bool)
    for r, c in enumerate(chunk):
        ids[r, : len(c.token_ids)] = torch.tensor(c.token_ids)
        attn[r, : len(c.token_ids)] = 1
        keep[r, : len(c.mask)] = torch.tensor(c.mask, dtype=torch.bool)
    keep[:, 0] = False  # nothing predicts a sequence's first token
    ids, attn, keep = ids.to(device), attn.to(device), keep.to(device)
    hidden = target_hidden(trunk, ids, attn, keep, 0 if shared else None)
    lp = torch.log_softmax(head(hidden).float(), dim=-1).gather(-1, ids[keep][:, None])[:, 0]
    sums = torch.zeros(len(chunk), device=lp.device).index_add_(0, keep.nonzero(as_tuple=True)[0], lp)
    return [float(v) for v in sums]


def per_entry_margins(items: list[Contrast], logprobs: list[float], tokens: tuple[str, str]) -> dict[str, dict[str, float]]:
    """{entry: {kind: margin}} from the items' log-probs (kinds with both tokens of both answers only)."""
    high, low = tokens
    lp: dict[tuple[str, str, str], float] = {(c.entry_id, c.kind, c.token): v for c, v in zip(items, logprobs)}
    out: dict[str, dict[str, float]] = {}
    for entry, kind, token in lp:
        if kind == EXPERT or token != high or (entry, kind, low) not in lp or (entry, EXPERT, high) not in lp:
            continue
        expert = lp[(entry, EXPERT, high)] - lp[(entry, EXPERT, low)]
        out.setdefault(entry, {})[kind] = expert - (lp[(entry, kind, high)] - lp[(entry, kind, low)])
    return out


def _summary(values: list[float], n_boot: int, seed: int) -> dict:
    lo, hi = bootstrap_ci(values, n_boot=n_boot, seed=seed)
    return {"margin": mean(values), "ci": [lo, hi], "n_entries": len(values),
            "share_positive": sum(v > 0 for v in values) / len(values) if values else float("nan")}


TRIVIAL_KINDS = ("dropped_call",)
"""Near misses a model separates without reading its task: for a one-call answer `dropped_call` is the empty
answer. The `realistic` margin leaves them out."""


def margin_stats(margins: dict[str, dict[str, float]], n_boot: int = 2000, seed: int = 0) -> dict:
    """Overall (per entry: the mean over its kinds), over the realistic kinds (the same without
    `TRIVIAL_KINDS`) and per kind: mean margin, 95 % bootstrap CI over entries, entries, share of entries
    with a positive margin."""
    overall = [mean(list(m.values())) for m in margins.values() if m]
    real = [[v for k, v in m.items() if k not in TRIVIAL_KINDS] for m in margins.values()]
    kinds = sorted({k for m in margins.values() for k in m})
    return {**_summary(overall, n_boot, seed), "realistic": _summary([mean(r) for r in real if r], n_boot, seed),
            "kinds": {k: _summary([m[k] for m in margins.values() if k in m], n_boot, seed) for k in kinds}}


def teacher_forced_margin(model, items: list[Contrast], tokens: tuple[str, str], n_boot: int = 2000,
                          seed: int = 0) -> dict:
    """`margin_stats` of `model` on a `contrast_set` (forward passes only)."""
    return margin_stats(per_entry_margins(items, sequence_logprobs(model, items), tokens), n_boot, seed)


def token_row_distance(model, tokenizer, tokens: tuple[str, str], sample: int = 2000, seed: int = 0) -> dict:
    """Distance between the two reward tokens' input-embedding rows, and its ratio to the median distance
    between real tokens (`sample` random pairs of the original vocabulary): ~0 when the rows are still the
    shared mean they started from, ~1 when they sit as far apart as two ordinary tokens."""
    import torch

    emb = model.get_input_embeddings()  # its forward: PEFT's trainable-token rows included while training
    device = next(model.parameters()).device
    a, b = (tokenizer.convert_tokens_to_ids(t) for t in tokens)
    real = min(a, b)  # added tokens sit after the original vocabulary
    g = torch.Generator().manual_seed(seed)
    i, j = torch.randint(0, real, (sample,), generator=g), torch.randint(0, real, (sample,), generator=g)
    with torch.no_grad():
        pair = emb(torch.tensor([a, b], device=device)).float()
        typical = float((emb(i.to(device)).float() - emb(j.to(device)).float()).norm(dim=-1).median())
    distance = float((pair[0] - pair[1]).norm())
    return {"distance": distance, "median_real_distance": typical,
            "ratio": distance / typical if typical > 0 else float("nan")}


def has_tokens(tokenizer, tokens: tuple[str, ...]) -> bool:
    """Every token is one id of the tokenizer's vocabulary (a model an sft stage gave the reward tokens)."""
    vocab = tokenizer.get_vocab()
    return all(t in vocab and tokenizer(t, add_special_tokens=False)["input_ids"] == [vocab[t]] for t in tokens)


def read_token(model, tokenizer, entries: list, proto, tokens: tuple[str, str], kinds: tuple[str, ...] | None = None,
               seed: int = 0, n_boot: int = 2000, max_positions: int = 8192) -> dict:
    """Does `model` read its token, from forward passes: {"margin": `margin_stats` + the contrast set's
    counts, "token_rows": `token_row_distance`} on `entries` under `tokens` = (high, low)."""
    items, counts = contrast_set(entries, proto, tokenizer, tokens, kinds, seed, max_positions=max_positions)
    return {"margin": {**teacher_forced_margin(model, items, tokens, n_boot, seed), "contrast_set": counts},
            "token_rows": token_row_distance(model, tokenizer, tokens, seed=seed)}
