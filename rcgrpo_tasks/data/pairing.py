"""Which trajectories RCTP fine-tunes on: the pairing rule over the generate set and the on-policy samples.

Inputs are trajectory rows (JSON dicts, both files gated by validate_trajectories): `generated`
(`data/trajectories.jsonl`: experts, near-misses, base-policy rows) and `policy` (`sample_policy`'s
on-policy rollouts of the SFT model, every sample in sampling order). Two params (label_rewards) choose
the design, so the data ablation (docs/data.md) can be re-run:

`failures` — where an entry's failure comes from, and so which prompts are used:
- `near_miss`: the entry's first near-miss row of the generate set (prompts: the generate set's entries);
- `on_policy`: the model's own first failure; entries without one are DROPPED (prompts: sampled entries);
- `mixed`: the model's own first failure, else the entry's near-miss (the fallback); entries with neither
  are dropped (prompts: sampled entries).
- `wrong_call`: the model's own first failure that holds a call (a wrong function or wrong arguments:
  `env.failures.is_wrong_call`), never its prose; entries without one are DROPPED (prompts: sampled entries).
  The low token then means "a call that is wrong", a contrast of content, where `on_policy` / `mixed` (and
  `base_failures`' prose) let it mean "do not call". Pair it with `base_failures: false`.
The success of an entry is always the model's own first success where it has one, else the expert replay.

`base_failures` (with `paired`): every further generate-set entry with a failure of the model RCTP-FT
started from (`models/base`: the generate set's `policy` rows, `generate_trajectories.policy_entries`) is
added as one more pair: its success (own, else the expert replay) under high, that failure under low. The
base model answers in prose, a failure it can produce on any prompt: what the paper's RCTP data hold (the
base model's own failures), and a low side the token can learn to steer on prompts it has not seen.

`pairing`:
- `paired`: every prompt used appears under BOTH tokens, once each: its success and its failure (an entry
  lacking either is dropped, counted by reason). 1:1 by construction.
- `unpaired`: each prompt appears under ONE token only, so the prompt alone tells which outcome follows
  (the issue's "on-policy, UNPAIRED" row): entries with only a success or only a failure give it; entries
  with both are split between the two sides (seeded) to even them out, and the larger side is then
  subsampled (seeded) to 1:1. With `failures: near_miss` it is today's behaviour: the generate set as it
  is (experts + near-misses balanced there, many entries under both tokens), no on-policy row.
Departure from the paper: its RCTP data are unpaired model rollouts; pairing is this project's design.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Literal

from rcgrpo_tasks.data.onpolicy import KIND as ON_POLICY_KIND
from rcgrpo_tasks.env.failures import is_wrong_call
from rcgrpo_tasks.ops.inputs import InputError

FailureRule = Literal["near_miss", "on_policy", "mixed", "wrong_call"]
Pairing = Literal["paired", "unpaired"]
FAILURE_RULES: tuple[str, ...] = ("near_miss", "on_policy", "mixed", "wrong_call")
PAIRINGS: tuple[str, ...] = ("paired", "unpaired")
SLOTS = ("own_success", "own_failure", "own_wrong_call", "expert", "near_miss", "base_failure")


def is_success(row: dict) -> bool:
    """R = 1 (the stored, gate-checked reward)."""
    return float(row["provenance"]["reward"]) == 1.0


def entry_pools(generated: list[dict], policy: list[dict]) -> dict[str, dict[str, dict | None]]:
    """Per entry id: the first own success / own failure / own failure that holds a call (sampling order), the
    expert row and the first near-miss row and the first base-model failure (file order). Generate-set entries
    come first (file order), then sampled-only entries."""
    pools: dict[str, dict[str, dict | None]] = {}
    for row in generated:
        source = row["provenance"]["source"]
        slot = "base_failure" if source == "policy" and not is_success(row) else \
            {"expert": "expert", "near_miss": "near_miss"}.get(source)
        if slot is not None:
            pool = pools.setdefault(row["entry_id"], dict.fromkeys(SLOTS))
            pool[slot] = pool[slot] or row
    for row in policy:
        slot = "own_success" if is_success(row) else "own_failure"
        pool = pools.setdefault(row["entry_id"], dict.fromkeys(SLOTS))
        pool[slot] = pool[slot] or row
        if slot == "own_failure" and is_wrong_call(row.get("result"), success=False):
            pool["own_wrong_call"] = pool["own_wrong_call"] or row
    return pools


def choose(pool: dict[str, dict | None], failures: FailureRule) -> tuple[dict | None, dict | None]:
    """(success, failure) of one entry under the failure rule (None where it has none)."""
    success = pool["own_success"] or pool["expert"]
    failure = {"near_miss": pool["near_miss"], "on_policy": pool["own_failure"],
               "mixed": pool["own_failure"] or pool["near_miss"], "wrong_call": pool["own_wrong_call"]}[failures]
    return success, failure


def check_policy_rows(policy: list[dict], where: str) -> None:
    """Policy rows must be on-policy samples (not, say, the generate set passed twice)."""
    for i, row in enumerate(policy, 1):
        if row.get("provenance", {}).get("kind") != ON_POLICY_KIND:
            raise InputError(f"{where}: row {i} ({row.get('trajectory_id')}) is not an on-policy sample "
                             f"(provenance.kind {row.get('provenance', {}).get('kind')!r})")


def base_pairs(pools: dict[str, dict[str, dict | None]], used: set[str]) -> list[dict]:
    """(success, base-model failure) rows of every entry outside `used` that has both, in pool order."""
    return [r for e, p in pools.items() if e not in used and p["base_failure"] is not None
            and (p["own_success"] or p["expert"]) is not None
            for r in (p["own_success"] or p["expert"], p["base_failure"])]


def rctp_rows(generated: list[dict], policy: list[dict], failures: FailureRule, pairing: Pairing,
              seed: int = 0, base_failures: bool = False) -> tuple[list[dict], dict]:
    """(trajectory rows RCTP trains on, stats). Rows are the input dicts themselves, in prompt order."""
    if failures not in FAILURE_RULES or pairing not in PAIRINGS:
        raise ValueError(f"failures must be one of {FAILURE_RULES}, pairing one of {PAIRINGS}")
    if base_failures and pairing != "paired":
        raise ValueError("base_failures adds pairs: it needs pairing 'paired'")
    if pairing == "unpaired" and failures == "near_miss":
        return list(generated), rows_stats(list(generated), failures, pairing, Counter())
    pools = entry_pools(generated, policy)
    sampled = {r["entry_id"] for r in policy}
    if failures == "near_miss":  # the generate set's prompts (those with an expert or a near-miss)
        prompts = [e for e, p in pools.items() if p["expert"] or p["near_miss"]]
    else:  # the prompts the model was sampled on
        prompts = [e for e in pools if e in sampled]
    picks = {e: choose(pools[e], failures) for e in prompts}
    dropped: Counter = Counter()
    for s, f in picks.values():
        if s is None or f is None:
            dropped["neither" if s is None and f is None else "no_success" if s is None else "no_failure"] += 1
    extra: list[dict] = []
    if pairing == "paired":
        rows = [r for s, f in picks.values() if s is not None and f is not None for r in (s, f)]
        if base_failures:
            extra = base_pairs(pools, {r["entry_id"] for r in rows})
            rows += extra
    else:  # one outcome per prompt is enough; prompts left out only to reach 1:1 count as `balance`
        rows = unpaired_rows(picks, seed)
        usable = sum(1 for s, f in picks.values() if s is not None or f is not None)
        dropped = Counter({k: v for k, v in {"neither": dropped["neither"], "balance": usable - len(rows)}.items() if v})
    stats = rows_stats(rows, failures, pairing, dropped, len(prompts))
    return rows, stats | ({"base_pairs": len(extra) // 2} if base_failures else {})


def unpaired_rows(picks: dict[str, tuple[dict | None, dict | None]], seed: int) -> list[dict]:
    """One row per prompt, 1:1 overall: see the module docstring (`unpaired`)."""
    rng = random.Random(f"{seed}:unpaired")
    only_s = [e for e, (s, f) in picks.items() if s is not None and f is None]
    only_f = [e for e, (s, f) in picks.items() if s is None and f is not None]
    both = [e for e, (s, f) in picks.items() if s is not None and f is not None]
    rng.shuffle(both)
    # x of the `both` entries give their success: x = (|F| + |both| - |S|) / 2 evens the sides when it can.
    x = min(len(both), max(0, (len(only_f) + len(both) - len(only_s)) // 2))
    succ, fail = only_s + both[:x], only_f + both[x:]
    n = min(len(succ), len(fail))
    keep = set(rng.sample(succ, n)) | set(rng.sample(fail, n))
    side = {e: 0 for e in succ} | {e: 1 for e in fail}
    return [picks[e][side[e]] for e in picks if e in keep]


def rows_stats(rows: list[dict], failures: str, pairing: str, dropped: Counter, n_prompts: int | None = None) -> dict:
    """Counts of the RCTP set: rows, prompts, prompts under both outcomes, sources of each side, drops."""
    by_entry: dict[str, set[bool]] = {}
    for r in rows:
        by_entry.setdefault(r["entry_id"], set()).add(is_success(r))
    n_success = sum(1 for r in rows if is_success(r))
    return {
        "failures": failures, "pairing": pairing, "n_rows": len(rows), "n_success": n_success,
        "n_failure": len(rows) - n_success, "prompts_considered": n_prompts if n_prompts is not None else len(by_entry),
        "prompts_used": len(by_entry), "prompts_under_both_outcomes": sum(1 for v in by_entry.values() if len(v) == 2),
        "dropped": dict(sorted(dropped.items())),
        "success_sources": dict(sorted(Counter(r["provenance"]["source"] for r in rows if is_success(r)).items())),
        "failure_sources": dict(sorted(Counter(r["provenance"]["source"] for r in rows if not is_success(r)).items())),
    }
