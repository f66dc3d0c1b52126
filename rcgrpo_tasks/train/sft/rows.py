"""The rows SFT / RCTP-FT train on: validation of a label_rewards chat dataset, their order, tokenization.

- `load_rows` validates every row (roles, an assistant message, the reward goal where a token is named) and
  names file:line of the first bad one;
- the order TRL sees: `balanced_order` (rows shuffled per reward token and interleaved, so any prefix keeps
  RCTP's balance; the data sampler reshuffles them), `pair_order` (each prompt's rows side by side, pairs
  shuffled; the trainer then keeps this order, so a pair's success and failure share a micro-batch) or
  `stratified_order` (pairs as in `pair_order`, alternating between the base-model-failure pairs and the
  others, so every optimizer step of an even number of pairs holds both kinds whatever the set's mix);
- `tokenize_rows` pre-tokenizes with THE assistant-token mask (`data.chat.assistant_token_mask`);
  `divergent_masks` then (`loss_on: divergent`) keeps in the loss only what follows the point where a pair's
  two answers part: the tokens both answers share teach "the same output under either token", the
  divergent ones are the only tokens that can teach the difference.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from rcgrpo.goal import format_goal
from rcgrpo_tasks.data.chat import assistant_token_mask
from rcgrpo_tasks.ops.inputs import InputError, read_jsonl

ROLES = {"system", "user", "assistant", "tool"}
ORDERS = ("balanced", "pairs", "stratified")
BASE_KIND = "policy"
"""The trajectory kind of a base-model sample in the generate set (`data.dataset`): a failure of this kind is a
format-divergent low side (the base model answers in prose), the other failures are the SFT model's own
(`on_policy`) or near misses."""
LOSS_ON = ("completion", "divergent")


def _row_error(row: Any, tokens: set[str], require_token: bool) -> str | None:
    msgs = row.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return "`messages` must be a non-empty list"
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            return f"messages[{i}] must be {{role: one of {sorted(ROLES)}, content: str}}"
    if not any(m["role"] == "assistant" for m in msgs):
        return "no assistant message (nothing to learn)"
    token = row.get("reward_token")
    if token is None:
        return "`reward_token` missing (this variant trains on reward-conditioned rows)" if require_token else None
    if token not in tokens:
        return f"reward_token {token!r} is not a configured token {sorted(tokens)} (label_rewards.tokens)"
    first = next((m for m in msgs if m["role"] == "user"), None)
    if first is None or not first["content"].endswith(format_goal(token)):
        return f"first user message does not end with the reward goal for {token}"
    return None


def load_rows(path: str | Path, tokens: tuple[str, ...], require_token: bool) -> list[dict]:
    """Validated rows of a label_rewards dataset; the first bad row raises InputError naming file:line."""
    path = Path(path)
    rows = read_jsonl(path)
    if not rows:
        raise InputError(f"{path}: dataset is empty")
    for lineno, row in enumerate(rows, 1):
        error = _row_error(row, set(tokens), require_token)
        if error:
            raise InputError(f"{path}: row {lineno}: {error}")
    return rows


def balanced_order(rows: list[dict], seed: int) -> list[dict]:
    """All rows, shuffled (seeded) and interleaved round-robin over reward tokens, so any prefix keeps
    RCTP's balance."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(str(row.get("reward_token")), []).append(row)
    rng = random.Random(seed)
    for key in sorted(groups):
        rng.shuffle(groups[key])
    out: list[dict] = []
    while any(groups.values()):
        for key in sorted(groups):
            if groups[key]:
                out.append(groups[key].pop())
    return out


def pair_order(rows: list[dict], seed: int) -> list[dict]:
    """Every row, each prompt's rows (same `entry_id`: its success and its failure under the two tokens)
    side by side, the prompts shuffled (seeded) and each pair's inner order seeded too (so neither token
    always comes first). With a micro-batch of 2 and this order kept, a pair's two rows are one
    micro-batch: their shared tokens pull the two token rows together within one step, and their
    divergent tokens are what separates them (the design this option measures: docs/rl.md)."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(str(row.get("entry_id")), []).append(row)
    rng = random.Random(f"{seed}:pairs")
    keys = sorted(groups)
    rng.shuffle(keys)
    out: list[dict] = []
    for key in keys:
        pair = sorted(groups[key], key=lambda r: str(r.get("reward_token")))
        if rng.random() < 0.5:
            pair.reverse()
        out += pair
    return out


def pair_stratum(pair: list[dict]) -> str:
    """`base` when the pair's failure is a base-model sample (`BASE_KIND`: a low side that parts from the
    success at the first answer token), else `own` (the SFT model's own failure or a near miss)."""
    return "base" if any(r.get("kind") == BASE_KIND and not r.get("reward") for r in pair) else "own"


def stratified_order(rows: list[dict], seed: int) -> list[dict]:
    """Every pair of `pair_order` (same seeded pair order and inner order), dealt so that the pairs alternate
    between the two strata (`pair_stratum`: base, own), the larger stratum once through and the smaller one
    cycled, reshuffled (seeded) on each pass. With 2 pairs an optimizer step (micro-batch 2, accumulation 2)
    every step holds one base pair and one own pair. Rows without a partner (no pair) count as `own`. A set
    with one stratum only is `pair_order`. Rows need `kind` (label_rewards writes the trajectory's kind)."""
    if any("kind" not in r for r in rows):
        raise InputError("row_order stratified needs each row's trajectory `kind` (re-run label_rewards)")
    flat = pair_order(rows, seed)
    pairs: list[list[dict]] = []
    for row in flat:
        if pairs and pairs[-1][0].get("entry_id") == row.get("entry_id"):
            pairs[-1].append(row)
        else:
            pairs.append([row])
    strata = {"base": [p for p in pairs if pair_stratum(p) == "base"],
              "own": [p for p in pairs if pair_stratum(p) == "own"]}
    if not strata["base"] or not strata["own"]:
        return flat
    big, small = sorted(strata.values(), key=len, reverse=True)
    rng = random.Random(f"{seed}:strata")
    dealt, pool = [], []
    for pair in big:
        if not pool:
            pool = list(small)
            rng.shuffle(pool)
        dealt += [pair, pool.pop()] if big is strata["base"] else [pool.pop(), pair]
    return [r for pair in dealt for r in pair]


def ordered(rows: list[dict], order: str, seed: int) -> list[dict]:
    """`rows` in the configured order (`ORDERS`)."""
    if order not in ORDERS:
        raise ValueError(f"row order must be one of {ORDERS}, got {order!r}")
    if order == "stratified":
        return stratified_order(rows, seed)
    return pair_order(rows, seed) if order == "pairs" else balanced_order(rows, seed)


def tokenize_rows(rows: list[dict], tokenizer, max_length: int, limit: int | None = None,
                  loss_on: str = "completion") -> tuple[list[dict], dict]:
    """Pre-tokenized TRL rows `{input_ids, assistant_masks}` cut to max_length, and token statistics.

    Rows left without an assistant token by the cut are skipped; with `limit`, stops at that many usable
    rows (so a budget of N examples trains on N, not on N minus the ones that did not fit). `loss_on:
    divergent`: each pair's shared answer prefix out of the loss (`divergent_masks`).
    """
    if loss_on not in LOSS_ON:
        raise ValueError(f"loss_on must be one of {LOSS_ON}, got {loss_on!r}")
    out, lengths, dropped, cut, sources = [], [], 0, 0, []
    for k, row in enumerate(rows):
        if limit is not None and len(out) >= limit:
            break
        ids, mask = assistant_token_mask(tokenizer, row["messages"])
        lengths.append(len(ids))
        if len(ids) > max_length:
            cut += 1
            ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask):
            dropped += 1
            continue
        out.append({"input_ids": ids, "assistant_masks": mask})
        sources.append(k)
    shared = divergent_masks(out, [rows[k] for k in sources]) if loss_on == "divergent" else 0
    stats = {"rows": len(rows), "rows_seen": len(lengths), "rows_used": len(out), "rows_truncated": cut,
             "rows_dropped_no_assistant": dropped, "tokens": sum(len(r["input_ids"]) for r in out),
             "assistant_tokens": sum(sum(r["assistant_masks"]) for r in out), "shared_tokens_masked": shared,
             "length_mean": round(sum(lengths) / len(lengths), 1), "length_max": max(lengths)}
    if not out:
        raise InputError(f"no row keeps an assistant token within max_length={max_length} "
                         f"(longest chat {stats['length_max']} tokens): raise sft.max_length")
    return out, stats


def _parting(a: list[int], b: list[int], start: int) -> int:
    """First position >= start where the two sequences differ (the shorter length where one is a prefix)."""
    n = min(len(a), len(b))
    return next((i for i in range(start, n) if a[i] != b[i]), n)


def divergent_masks(tokenized: list[dict], rows: list[dict]) -> int:
    """In place: for every prompt with exactly two rows under different reward tokens (a pair), the
    assistant mask of both rows is cleared before the first position where their sequences part after the
    prompt (the prompts differ only in their one-id reward token, so positions align). Rows of other
    prompts keep their mask. Returns the assistant tokens taken out of the loss."""
    by: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        by.setdefault(str(row.get("entry_id")), []).append(i)
    removed = 0
    for members in by.values():
        if len(members) != 2 or len({rows[i].get("reward_token") for i in members}) != 2:
            continue
        a, b = (tokenized[i] for i in members)
        first = min(a["assistant_masks"].index(1), b["assistant_masks"].index(1))
        cut = _parting(a["input_ids"], b["input_ids"], first)
        for r in (a, b):
            removed += sum(r["assistant_masks"][:cut])
            r["assistant_masks"] = [0] * min(cut, len(r["assistant_masks"])) + r["assistant_masks"][cut:]
    return removed
