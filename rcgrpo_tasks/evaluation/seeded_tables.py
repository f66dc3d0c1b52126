"""The report's Markdown over seeds (`seeded`): RCTP's premise gate first, then the declared endpoints, the
rows pooled over seeds, RL learning per seed and cell, controllability per seed, and each seed's own tables
(`report_tables`). Nothing is printed as an interval that is not one: a missing value is `n/a`."""

from __future__ import annotations

from rcgrpo_tasks.env.paper import row_name
from rcgrpo_tasks.evaluation.endpoint_tables import endpoints_table
from rcgrpo_tasks.evaluation.formats import ci, num, side_name
from rcgrpo_tasks.evaluation.report_tables import agreement_lines, category_table, outcome_table, rl_table


def premise_lines(gates: list[dict], side: str) -> str:
    """The run's first line: did every seed's RCTP model read its token as RC-GRPO needs (on the `side` of
    the split the controllability checks measured)?"""
    if not gates:
        return "**RCTP premise gate: not measured** (no controllability metrics).\n"
    missed = [g for g in gates if not g["passed"]]
    rule = f"q >= {gates[0]['min_q']} and the sampled gap's 95 % CI above 0, on the {side_name(side)} entries"
    if missed:
        why = "; ".join(f"seed {g['seed']}: {g['why']}" for g in missed)
        head = (f"**RCTP premise gate MISSED in {len(missed)} of {len(gates)} seeds ({rule}): {why}. Where the RCTP "
                "model does not read its token, RC-GRPO's groups are GRPO's and this run does not test RC-GRPO.**\n")
    else:
        head = f"**RCTP premise gate passed in all {len(gates)} seeds** ({rule}).\n"
    rows = "".join(f"| {g['seed']} | {ci(g['q'], g.get('q_ci'), '.3f')} | {num(g.get('high'))} | {num(g.get('low'))} | "
                   f"{ci(g.get('gap'), g.get('gap_ci'))} | {'passed' if g['passed'] else 'missed'} |\n" for g in gates)
    return (head + "\n| seed | q = P(low fails \\| high succeeds) [95% CI] | R\\|high | R\\|low | sampled gap [95% CI] "
            "| gate |\n|---|---|---|---|---|---|\n" + rows)


def pooled_table(pooled: list[dict]) -> str:
    """Seeded models averaged over seeds, with two-level bootstrap intervals and the per-seed values."""
    lines = ["| model | greedy % [95% CI over seeds x entries] | per seed | pass@1 % [95% CI] | per seed | "
             "greedy vs init, pts [95% CI] | pass@1 vs init, pts [95% CI] |", "|---|---|---|---|---|---|---|"]
    for r in pooled:
        cells = []
        for key in ("correct", "pass1"):
            v = r.get(key)
            cells += [ci(v["mean"], v["ci"], ".1f"), ", ".join(f"{x:.1f}" for x in v["per_seed"])] if v else ["n/a", ""]
        vs = r.get("vs") or {}
        for key in ("correct", "pass1"):
            d = vs.get(key)
            cells.append(f"{ci(d['diff'], d['ci'], '+.1f')} vs {row_name(vs['init'])}" if d else "")
        lines.append(f"| {row_name(r['label'])} ({r['seeds']} seeds) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def learning_table(seeds: list) -> str:
    """Per seed and RL cell: its pool, learning on it (first vs last visit, on equal samples per visit where the
    run says: `pool_learning_equal`), the probe's pool half and its transfer half (prompts up / down, exact sign
    test)."""
    lines = ["| seed | cell | pool (prompts, init's success) | pool learning, equal samples a visit: up / down (sign p) "
             "| probe, pool half: change [95% CI], up / down (p) | probe, outside the pool: change, up / down (p) |",
             "|---|---|---|---|---|---|"]
    for s in seeds:
        for cell, m in s.rl.items():
            pool, probe = m.get("pool") or {}, m.get("probe") or {}
            learn = m.get("pool_learning_equal") or m.get("pool_learning") or {}
            cells = [f"{pool.get('size', 'n/a')}, {num(pool.get('step0_success'))}" if pool else "n/a",
                     f"{learn['up']} / {learn['down']} of {learn['prompts']} ({num(learn['sign_p'], '.3g')})"
                     if learn else "n/a"]
            for part in (probe.get("change"), (probe.get("transfer") or {}).get("change")):
                cells.append(f"{ci(part['mean'], [part['ci_low'], part['ci_high']])}, {part['up']} / {part['down']} "
                             f"({num(part['sign_p'], '.3g')})" if part else "n/a")
            lines.append(f"| {s.seed} | {row_name(cell)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def seeded_markdown(gates: list[dict], results: list[dict], pooled: list[dict], seeds: list, declared,
                    checks: dict[int, list[dict]], side: str, mechanism: str = "", premise_side: str | None = None
                    ) -> str:
    """The whole report: premise gate, endpoints (`declared`: `endpoints.EndpointsConfig`) and what they decide,
    pooled rows, learning, the `mechanism` sections (`mechanism_tables.mechanism_markdown`), then each seed's
    tables, on the `side` of the split every row measured (`results_table.one_side`); the premise on
    `premise_side` (the controllability checks'; default `side`)."""
    premise_side = premise_side or side
    agreement = "" if premise_side == side else (
        f"\nThe premise is read on the {side_name(premise_side)} entries and the outcome on the {side_name(side)} "
        "ones: the cross-stage check (the RCTP model's greedy answers in both stages) has no shared entry and is "
        "not run.\n")
    parts = ["## RCTP's premise\n\n" + premise_lines(gates, premise_side) + agreement,
             "## Endpoints\n\n" + endpoints_table(results, declared.alpha, declared.power, len(seeds), declared),
             f"## Outcome pooled over seeds ({side_name(side)} entries)\n\n" + pooled_table(pooled),
             "## Learning where RL trains\n\n" + learning_table(seeds)] + ([mechanism] if mechanism else [])
    for s in seeds:
        parts.append(f"## Seed {s.seed}\n\n" + outcome_table(s.rows) + agreement_lines(checks.get(s.seed, []))
                     + "\n### Per category\n\n" + category_table(s.rows) + "\n### RL\n\n" + rl_table(s.rows, s.contrast))
    return "\n".join(parts)
