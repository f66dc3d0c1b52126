"""RL's pool rule on the dev split: what each candidate (`rl.pool_band`, `rl.pool_solved_share`) would give RL.

Reads the controllability stage's trajectories run on the DEV side (`rcgrpo controllability --side dev
--trajectories F ...`: the RCTP init sampled `samples_per_token` times per dev entry under each token, at the
RL temperature) and treats the dev entries as a stand-in for RL's prompts: each entry's success share under
the high token is what `pool_rctp@<seed>` measures on an RL prompt. Per candidate rule it prints, over
the entries the rule keeps (`train.rl.pool.pool_ids`, the same function RL runs):
- the pool's share of the side and its mean step-0 success (all-high), the goal being 0.2-0.7;
- the expected share of GRPO groups of G flat at success and at failure (all-high tokens), the goal for
  flat-at-success being at most 0.3;
- the expected zero-variance share of RC-GRPO's groups (each rollout's token high with P = rl.p_high, the
  low token's own success share beside it: `controllability.zero_variance_share`), and the groups RC-GRPO
  gains over GRPO;
- the expected number of informative RC-GRPO groups per 100 drawn (pool share x (1 - zero-variance)).
Nothing here reads the held-out side. Run: `python bench/pool_rule.py --trajectories data/dev/ctl.jsonl`;
the choice and its table: docs/rl.md "RL's pool".
"""

from __future__ import annotations

import argparse
import itertools

from rcgrpo_tasks.engine.trajectory import read_trajectories
from rcgrpo_tasks.evaluation.controllability import zero_variance_share
from rcgrpo_tasks.train.rl.pool import pool_ids

BANDS = ((0.0, 1.0), (0.25, 1.0), (0.25, 0.75), (0.34, 0.67), (0.1, 0.9))
SHARES = (0.0, 0.15, 0.3)


def rates(path: str, high: str, low: str) -> dict[str, tuple[float, float]]:
    """Per dev entry: (success share under `high`, under `low`) of the sampled arm."""
    by: dict[str, dict[str, list[float]]] = {}
    for t in read_trajectories(path):
        if t.provenance.get("arm") == "sampled":
            by.setdefault(t.entry_id, {}).setdefault(t.reward_token, []).append(float(t.score["paper_reward"] == 1.0))
    return {e: (sum(v[high]) / len(v[high]), sum(v[low]) / len(v[low])) for e, v in by.items() if high in v and low in v}


def judge(per_entry: dict[str, tuple[float, float]], band, share: float, g: int, q: float, seed: int) -> dict:
    """The candidate's pool on these entries and what RL's groups would look like at step 0."""
    pool = pool_ids({e: h for e, (h, _) in per_entry.items()}, band, share, seed)
    if not pool:
        return {"size": 0}
    ph = [per_entry[e][0] for e in pool]
    z = [zero_variance_share(*per_entry[e], g, q) for e in pool]
    flat_success = sum(p ** g for p in ph) / len(ph)
    rc = sum(m for _, m in z) / len(z)
    return {"size": len(pool), "share": len(pool) / len(per_entry), "success": sum(ph) / len(ph),
            "flat_success": flat_success, "flat_fail": sum((1 - p) ** g for p in ph) / len(ph),
            "zv_grpo": sum(a for a, _ in z) / len(z), "zv_rc": rc,
            "informative_rc": 100 * len(pool) / len(per_entry) * (1 - rc)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", required=True, help="controllability --side dev trajectories")
    ap.add_argument("--high", default="<|high_reward|>")
    ap.add_argument("--low", default="<|low_reward|>")
    ap.add_argument("--g", type=int, default=4, help="rl.num_generations")
    ap.add_argument("--p-high", type=float, default=0.5, help="rl.p_high")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    per_entry = rates(args.trajectories, args.high, args.low)
    print(f"{len(per_entry)} dev entries; mean success under high {sum(h for h, _ in per_entry.values()) / len(per_entry):.3f}, "
          f"under low {sum(w for _, w in per_entry.values()) / len(per_entry):.3f}; G = {args.g}, p_high = {args.p_high}")
    print("| pool_band | pool_solved_share | pool size (share) | step-0 success | GRPO flat at 1 / at 0 | "
          "zero-variance GRPO / RC-GRPO | informative RC-GRPO groups per 100 prompts |")
    print("|---|---|---|---|---|---|---|")
    for band, share in itertools.product(BANDS, SHARES):
        r = judge(per_entry, band, share, args.g, args.p_high, args.seed)
        if not r["size"]:
            print(f"| {list(band)} | {share} | 0 | | | | |")
            continue
        print(f"| {list(band)} | {share} | {r['size']} ({r['share']:.2f}) | {r['success']:.3f} | "
              f"{r['flat_success']:.3f} / {r['flat_fail']:.3f} | {r['zv_grpo']:.3f} / {r['zv_rc']:.3f} | "
              f"{r['informative_rc']:.1f} |")


if __name__ == "__main__":
    main()
