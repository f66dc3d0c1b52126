"""Project scorer vs bfcl-eval's `multi_turn_checker`: cost per entry on the same 800 entries.

Both score the ground truth of all 800 BFCL v4 multi-turn entries (plus, with --perturbed N, N perturbed
trajectories), interleaved in rounds so machine noise hits both alike. Prints seconds per entry of each
and the ratio ours / official (goal <= 1.0). Ours also computes partial credit and the paper reward in
the same pass; the official checker gives the verdict only.

Run: `python bench/score_speed.py [--rounds 3] [--perturbed 800]`
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from rcgrpo_tasks.env.multi_turn import perturb
from rcgrpo_tasks.env.multi_turn.entries import load_entries
from rcgrpo_tasks.env.multi_turn.scoring import score_entry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the reference checker is test code
from bfcl_reference import official_check  # noqa: E402


def _cases(n_perturbed: int) -> list:
    entries = load_entries()
    cases = [(e, [[list(t)] if t else [] for t in e.ground_truth]) for e in entries]
    rng = random.Random(0)
    while n_perturbed > 0:
        e = rng.choice(entries)
        p = perturb.perturb(e, rng.choice(perturb.PERTURBATIONS), rng)
        if p is not None:
            cases.append((e, [[list(t)] if t else [] for t in p.turns]))
            n_perturbed -= 1
    return cases


def _time(fn, cases) -> float:
    t0 = time.perf_counter()
    for e, result in cases:
        fn(e, result)
    return (time.perf_counter() - t0) / len(cases)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--perturbed", type=int, default=800)
    args = ap.parse_args()
    cases = _cases(args.perturbed)
    _time(score_entry, cases[:50]), _time(official_check, cases[:50])  # warm imports and caches
    ours, official = [], []
    for _ in range(args.rounds):
        ours.append(_time(score_entry, cases))
        official.append(_time(official_check, cases))
    o, b = statistics.median(ours), statistics.median(official)
    print(f"entries scored per round: {len(cases)} (800 gold + {args.perturbed} perturbed), rounds: {args.rounds}")
    print(f"rcgrpo scorer   : {o * 1e3:8.3f} ms/entry (verdict + partial credit + paper reward)")
    print(f"bfcl-eval check : {b * 1e3:8.3f} ms/entry (verdict only)")
    print(f"ratio ours/official: {o / b:.3f} (goal <= 1.0)")


if __name__ == "__main__":
    main()
