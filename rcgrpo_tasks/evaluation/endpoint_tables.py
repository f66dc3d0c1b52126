"""The endpoints table, as the report prints it and `rcgrpo endpoints --recompute` prints it again from the
committed per-unit files (`evaluation.endpoints`): one function, so the two cannot differ in anything but the
numbers. Each row: the unit-level estimate with its interval and p, the seed-level t beside it, and the
minimum detectable effect as the range over the two variance models. Nothing is printed as an interval that is
not one (`formats.ci`)."""

from __future__ import annotations

from rcgrpo_tasks.evaluation.endpoints import SINGLE
from rcgrpo_tasks.evaluation.formats import ci, missing, num

PERCENT = ("pass1", "greedy")
"""Measures printed in points (x 100)."""


def _spec(measure: str) -> tuple[float, str, str]:
    """(scale, format, unit word) of a measure's differences."""
    if measure in PERCENT:
        return 100.0, "+.1f", " pts"
    return 1.0, ("+.2f" if measure == "nonzero_adv_high" else "+.3f"), (
        " rollouts a group" if measure == "nonzero_adv_high" else "")


def _scaled(value, scale: float):
    return None if missing(value) else scale * value


def _interval(value, interval, spec: str) -> str:
    """`formats.ci`, but a value without an interval (one unit or seed, or no spread) keeps its value."""
    if not missing(value) and (not interval or any(missing(x) for x in interval)):
        return f"{format(value, spec)} [no interval]"
    return ci(value, interval, spec)


def estimate(r: dict) -> str:
    """The unit-level estimate with its interval and what it is made of."""
    m = r["spec"]["measure"]
    if m in SINGLE:
        return (f"{r['up']} up, {r['down']} down of {r['prompts']} prompts x seeds; share up "
                f"{_interval(r['diff'], r['ci'], '.2f')}")
    scale, fmt, word = _spec(m)
    text = _interval(_scaled(r["diff"], scale), [_scaled(x, scale) for x in r["ci"]], fmt) + word
    if m == "greedy":
        text += f" ({r['only_first']} up, {r['only_second']} down)"
    elif "only_first" in r:
        text = (f"{r['cell_share']:.3f} vs {r['versus_share']:.3f}: {text} ({r['only_first']} vs {r['only_second']} "
                f"discordant of {r['n']} groups)")
    return text


def seed_level(r: dict) -> str:
    """The seed-level t: per-seed values, their mean with its t interval, and p."""
    m, s = r["spec"]["measure"], r["seed_level"]
    if m in SINGLE:
        per = ", ".join(f"{u}/{d}" for u, d in r["per_seed"])
        return f"up/down per seed {per}; net share {_interval(s['diff'], s['ci'], '+.3f')}, p {num(s['p'], '.3g')}"
    scale, fmt, _ = _spec(m)
    per = ", ".join(format(scale * v, fmt) for v in r["per_seed"])
    mean = _interval(_scaled(s["diff"], scale), [_scaled(x, scale) for x in s["ci"]], fmt)
    return f"per seed {per}; {mean}, p {num(s['p'], '.3g')}"


def mde(r: dict) -> str:
    """The MDE at the unit level and at the seed level (a range where the two variance models disagree)."""
    m = r["spec"]["measure"]
    if m in SINGLE:
        return "n/a" if missing(r.get("mde")) else f"share up {0.5 + r['mde']:.2f} (unit level)"
    rng = r.get("mde_range")
    if not rng:
        return "n/a"
    scale, fmt, word = _spec(m)
    fmt = fmt.lstrip("+")
    lo, hi = (format(scale * v, fmt) for v in rng)
    return f"{lo}{word}" if lo == hi else f"{lo} to {hi}{word}"


def endpoints_table(results: list[dict], alpha: float, power: float, seeds: int) -> str:
    """The declared endpoints, primary first: estimate and p at the unit level, the seed-level t beside them,
    the MDE range, the units and the test."""
    n_primary = sum(r["rank"] == "primary" for r in results)
    lines = [f"{len(results)} comparisons reported ({n_primary} primary, {len(results) - n_primary} secondary), "
             f"declared in params `endpoints` before the run; over {seeds} seed(s); two-sided tests at alpha = "
             f"{alpha}, no multiplicity correction (secondary endpoints are descriptive). Unit level: the units "
             "(groups, entries, prompts) as independent; seed level: a t over the per-seed differences (the seeds "
             f"are the replicates). MDE: the smallest effect detected with power {power}, from the unit level to "
             "the seed level. The per-unit values behind each row: the report's `endpoints/` folder "
             "(`rcgrpo endpoints --recompute` prints this table from them).\n",
             f"| rank | endpoint | estimate [95% CI], unit level | p | seed level [95% t CI] | MDE (power {power}) | "
             "units; test |", "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['rank']} | {r['name']} | {estimate(r)} | {num(r['p'], '.3g')} | {seed_level(r)} | "
                     f"{mde(r)} | {r['units']}; {r['test']} |")
    return "\n".join(lines) + "\n"
