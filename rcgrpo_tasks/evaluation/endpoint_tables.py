"""The endpoints table, as the report prints it and `rcgrpo endpoints --recompute` prints it again from the
committed per-unit files (`evaluation.endpoints`): one function, so the two cannot differ in anything but the
numbers. Each row: the unit-level estimate with its interval and p, the seed-level t beside it, and the
minimum detectable effect as the range over the two variance models. Nothing is printed as an interval that is
not one (`formats.ci`)."""

from __future__ import annotations

from rcgrpo_tasks.evaluation.endpoints import OUTCOMES, PREMISE, SINGLE, EndpointsConfig, outcome, rule
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


def _premise(r: dict) -> str:
    per = ", ".join(ci(q, c, ".2f") if c else num(q, ".2f") for q, c in zip(r["per_seed"], r["per_seed_ci"]))
    kept = "" if r.get("kept") is None else f"; q >= {r['kept_q']} in every seed: {'yes' if r['kept'] else 'no'}"
    return f"q per seed {per}; least {num(r['least'], '.2f')}{kept}"


def estimate(r: dict) -> str:
    """The unit-level estimate with its interval and what it is made of."""
    m = r["spec"]["measure"]
    if m in PREMISE:
        return _premise(r)
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
    if m in PREMISE:
        return f"mean q {_interval(s['diff'], s['ci'], '.2f')}"
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
    if m in PREMISE:
        return "n/a"
    if m in SINGLE:
        return "n/a" if missing(r.get("mde")) else f"share up {0.5 + r['mde']:.2f} (unit level)"
    rng = r.get("mde_range")
    if not rng:
        return "n/a"
    scale, fmt, word = _spec(m)
    fmt = fmt.lstrip("+")
    lo, hi = (format(scale * v, fmt) for v in rng)
    return f"{lo}{word}" if lo == hi else f"{lo} to {hi}{word}"


WHEN = {"gain": "its lower end above 0", "no_gain": "its upper end below the smallest effect of interest",
        "inconclusive": "neither"}
"""Each outcome's condition on the decisive interval (`endpoints.outcome`)."""


def _effect(measure: str, value: float) -> str:
    scale, fmt, word = _spec(measure)
    return format(scale * value, fmt) + word


def decisions_section(results: list[dict], declared: dict) -> str:
    """The declared decision rule (`EndpointsConfig.decisions`) as a table, and what each primary endpoint's
    decisive interval reached (`endpoints.outcome`); a line saying none was declared otherwise."""
    if not declared.get("decisions"):
        return "\nNo decision rule was declared with these endpoints: they are read as estimates.\n"
    level, sesoi = declared["decisive"], declared["sesoi"]
    primary = [r for r in results if r["rank"] == "primary"]
    effects = "; ".join(f"{m} {_effect(m, v)}" for m, v in sesoi.items())
    lines = ["", f"Decision rule, declared with the endpoints: each primary endpoint is decided by its "
             f"{'unit' if level == 'unit' else 'seed'}-level 95 % interval against the smallest effect of interest "
             f"({effects}); the other level is printed above as a robustness reading.", "",
             "| outcome | when the interval has | decides |", "|---|---|---|"]
    for o in OUTCOMES:
        lines.append(f"| {o} | {WHEN[o]} | {declared['decisions'][o]} |")
    lines += ["", "Reached:"]
    for r in primary:
        m = r["spec"]["measure"]
        got = outcome(r, level, sesoi[m])
        lo, hi = (r["seed_level"]["ci"] if level == "seed" else r["ci"])
        text = declared["decisions"][got].format(cell=r["spec"]["cell"], versus=r["spec"]["versus"])
        lines.append(f"- {r['name']}: **{got}** (interval [{_effect(m, lo)}, {_effect(m, hi)}], smallest effect of "
                     f"interest {_effect(m, sesoi[m])}): {text}")
    return "\n".join(lines) + "\n"


def endpoints_table(results: list[dict], alpha: float, power: float, seeds: int,
                    declared: EndpointsConfig | dict | None = None) -> str:
    """The declared endpoints, primary first: estimate and p at the unit level, the seed-level t beside them,
    the MDE range, the units and the test; then the decision rule and what it reached (`decisions_section`)."""
    declared = rule(declared) if isinstance(declared, EndpointsConfig) else (declared or {})
    n_primary = sum(r["rank"] == "primary" for r in results)
    lines = [f"{len(results)} comparisons reported ({n_primary} primary, {len(results) - n_primary} secondary), "
             f"as params `endpoints` declares them (`git log -p` of the params file dates each declaration against "
             f"the run's outputs); over {seeds} seed(s); two-sided tests at alpha = "
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
    return "\n".join(lines) + "\n" + decisions_section(results, declared)
