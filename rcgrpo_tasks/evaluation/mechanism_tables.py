"""What RC-GRPO's injected variance is made of, and whether its premise survives RL: the report's mechanism
tables over seeds (`seeded.Seed`), per RC-family cell against GRPO from the same init and seed.

- `crosstab`: the two cells' groups paired by step and slot (the same entry and sampling seeds:
  `results_table.paired_groups`), GRPO's flat type against the cell's: groups GRPO had flat at success that
  the cell made informative (`rescued_success`: a low token failing beside high successes, the manipulation
  itself), flat at failure (`rescued_failure`: the rescue the paper's claim needs), and groups the cell made
  flat that GRPO had not (`created_fail`, `created_success`);
- `parts`: that per seed and pooled, beside the high-token rollouts with a non-zero advantage in each cell
  (the signal on the policy that is evaluated);
- `failures`: each cell's rollouts per token level by what they are (success, no call, wrong function, wrong
  arguments: `env.failures`), pooled over seeds;
- `premise`: per seed, q and the sampled gap of the RCTP model (before RL) beside each RCTP-init cell's policy
  (after RL), q split by the low side's failure kind; `gap_thirds`: the token gap on RL's own pool by thirds of
  training (steps.tsv `reward_high`, `reward_low`).
"""

from __future__ import annotations

from rcgrpo_tasks.data.rl_steps import thirds
from rcgrpo_tasks.env.failures import FAILURE_KINDS
from rcgrpo_tasks.env.paper import row_name
from rcgrpo_tasks.evaluation.formats import ci, num
from rcgrpo_tasks.evaluation.results_table import paired_groups
from rcgrpo_tasks.ops.names import RC_ALGOS, split_cell

FLATS = (None, "fail", "success")
COUNTS = ("groups", "rescued_success", "rescued_failure", "created_fail", "created_success", "versus_fail",
          "cell_fail", "versus_success", "cell_success")


def crosstab(cell_groups: list[dict], versus_groups: list[dict]) -> dict:
    """Counts (`COUNTS`) of the paired groups of a cell and its GRPO (`diagnostics.group_flags` rows)."""
    pairs = [(v["flat"], c["flat"]) for v, c in paired_groups(cell_groups, versus_groups)]
    return {"groups": len(pairs),
            "rescued_success": sum(v == "success" and c is None for v, c in pairs),
            "rescued_failure": sum(v == "fail" and c is None for v, c in pairs),
            "created_fail": sum(v != "fail" and c == "fail" for v, c in pairs),
            "created_success": sum(v != "success" and c == "success" for v, c in pairs),
            "versus_fail": sum(v == "fail" for v, _ in pairs), "cell_fail": sum(c == "fail" for _, c in pairs),
            "versus_success": sum(v == "success" for v, _ in pairs),
            "cell_success": sum(c == "success" for _, c in pairs)}


def contrasts(cells: list[str]) -> list[tuple[str, str]]:
    """(RC-family cell, the GRPO cell of its init) for every such pair the grid runs."""
    out = []
    for cell in cells:
        init, algo = split_cell(cell) or ("", "")
        if algo in RC_ALGOS and f"{init}-grpo" in cells:
            out.append((cell, f"{init}-grpo"))
    return out


def parts(seeds: list, cells: list[str]) -> list[dict]:
    """Per contrast: per seed and pooled, `crosstab` and the high-token rollouts with a non-zero advantage in
    each cell (run totals: `nonzero_adv.high` of the RL summaries)."""
    out = []
    for cell, versus in contrasts(cells):
        per = []
        for s in seeds:
            c, v = s.rl[cell], s.rl[versus]
            per.append({"seed": s.seed, **crosstab(c.get("groups") or [], v.get("groups") or []),
                        "nonzero_adv_high": [(v.get("nonzero_adv") or {}).get("high"),
                                             (c.get("nonzero_adv") or {}).get("high")]})
        pooled = {k: sum(p[k] for p in per) for k in COUNTS}
        highs = [p["nonzero_adv_high"] for p in per]
        pooled["nonzero_adv_high"] = [None if any(h[i] is None for h in highs) else sum(h[i] for h in highs)
                                      for i in (0, 1)]
        out.append({"cell": cell, "versus": versus, "per_seed": per, "pooled": pooled})
    return out


def failures(seeds: list, cells: list[str]) -> list[dict]:
    """Per cell and token level: rollouts, successes and each failure kind, summed over seeds (RL summaries'
    `failures`)."""
    out = []
    for cell in cells:
        levels: dict[str, dict[str, int]] = {}
        for s in seeds:
            for level, c in (s.rl[cell].get("failures") or {}).items():
                acc = levels.setdefault(level, {})
                for k, v in c.items():
                    acc[k] = acc.get(k, 0) + v
        out += [{"cell": cell, "level": level, **c} for level, c in levels.items()]
    return out


def _check(ctl: dict) -> dict:
    s = ctl.get("sampled") or {}
    q = s.get("premise") or {}
    return {"q": q.get("q"), "q_ci": q.get("q_ci"), "gap": s.get("gap"), "gap_ci": s.get("gap_ci"),
            "high": s.get("success_rate_high"), "low": s.get("success_rate_low"), "q_by_kind": s.get("q_by_kind")}


def premise(seeds: list, steps: dict[str, list[dict]]) -> list[dict]:
    """Per seed: the RCTP model's check (before RL) and each RCTP-init cell's (after RL), and each cell's token
    gap on its pool by thirds of training (`steps`: {`<cell>@<seed>`: its steps.tsv rows})."""
    out = []
    for s in seeds:
        rows = [{"model": "rctp", **_check(s.controllability)}] if s.controllability else []
        rows += [{"model": cell, **_check(ctl)} for cell, ctl in s.controllability_rl.items()]
        gaps = {cell: thirds(steps[f"{cell}@{s.seed}"], ("reward_high", "reward_low", "controllability_gap"))
                for cell in s.rl if (split_cell(cell) or ("", ""))[1] in RC_ALGOS and f"{cell}@{s.seed}" in steps}
        out.append({"seed": s.seed, "checks": rows, "gap_thirds": gaps})
    return out


# ---------------------------------------------------------------- Markdown


def premise_table(rows: list[dict], side: str) -> str:
    """q and the gap before RL (the RCTP model) and after it (each cell's policy), per seed."""
    head = ("| seed | model | q = P(low fails \\| high succeeds) [95% CI] | q by the low side's failure: no call / wrong "
            "function / wrong arguments | sampled gap [95% CI] | R\\|high | R\\|low |\n|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        for c in r["checks"]:
            kinds = c.get("q_by_kind")
            split = " / ".join(num(kinds.get(k), ".2f") for k in FAILURE_KINDS) if kinds else "n/a"
            when = "before RL" if c["model"] == "rctp" else "after RL"
            lines.append(f"| {r['seed']} | {row_name(c['model'])} ({when}) | {ci(c['q'], c.get('q_ci'), '.3f')} | {split} | "
                         f"{ci(c['gap'], c.get('gap_ci'))} | {num(c['high'])} | {num(c['low'])} |")
    thirds_lines = []
    for r in rows:
        for cell, parts_ in r["gap_thirds"].items():
            cells = [f"{num(t['controllability_gap'], '+.3f')} ({num(t['reward_high'], '.2f')} / "
                     f"{num(t['reward_low'], '.2f')})" for t in parts_]
            cells += ["n/a"] * (3 - len(cells))  # a run of fewer than 3 steps
            thirds_lines.append(f"| {r['seed']} | {row_name(cell)} | " + " | ".join(cells) + " |")
    text = (f"The same check ({side} entries, the same row seeds) on each seed's RCTP model before RL and on each RL "
            "policy after it; a low side failing in prose is a contrast of format, wrong calls one of content.\n\n"
            + head + "\n".join(lines) + "\n")
    if thirds_lines:
        text += ("\nThe token gap on RL's own pool by thirds of training (steps.tsv: mean reward_high - reward_low, "
                 "(R|high / R|low)):\n\n| seed | cell | first third | second third | last third |\n|---|---|---|---|---|\n"
                 + "\n".join(thirds_lines) + "\n")
    return text


def _part_cells(p: dict) -> str:
    nz = p["nonzero_adv_high"]
    return (f"{p['groups']} | {p['rescued_success']} | {p['rescued_failure']} | {p['created_fail']} | "
            f"{p['created_success']} | {p['versus_fail']} -> {p['cell_fail']} | {p['versus_success']} -> "
            f"{p['cell_success']} | {num(nz[0], '.0f')} -> {num(nz[1], '.0f')} |")


def parts_table(rows: list[dict]) -> str:
    """Per contrast, per seed and pooled: what the cell changed in GRPO's groups, and the high-token signal."""
    lines = ["| cell vs GRPO | seed | groups paired | rescued at success | rescued at failure | created flat at failure "
             "| created flat at success | flat at failure: GRPO -> cell | flat at success: GRPO -> cell | high-token "
             "rollouts with A != 0: GRPO -> cell |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = row_name(r["cell"])
        lines += [f"| {name} | {p['seed']} | " + _part_cells(p) for p in r["per_seed"]]
        lines.append(f"| {name} | pooled | " + _part_cells(r["pooled"]))
    return "\n".join(lines) + "\n"


def failures_table(rows: list[dict]) -> str:
    """Per cell and token level: the shares of its rollouts that succeeded and that failed by kind."""
    lines = ["| cell | token | rollouts | success | no call | wrong function | wrong arguments |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        n = r.get("rollouts") or 0
        shares = [num(r.get(k, 0) / n if n else None, ".2f") for k in ("success", *FAILURE_KINDS)]
        lines.append(f"| {row_name(r['cell'])} | {r['level']} | {n} | " + " | ".join(shares) + " |")
    return "\n".join(lines) + "\n"


def mechanism_markdown(data: dict, side: str) -> str:
    """The three tables with their headings (`data`: {parts, failures, premise})."""
    return ("## What the injected variance is made of\n\nGRPO's and the cell's groups paired by step and slot (the "
            "same entry and seeds). Rescued at success: GRPO's group all succeeded, the cell's has spread (the low "
            "token failing beside high successes: the manipulation itself); rescued at failure: GRPO's all failed "
            "(the rescue the paper's claim needs); created: the cell's is flat where GRPO's was not.\n\n"
            + parts_table(data["parts"]) + "\n### Rollouts by what they are, per token (pooled over seeds)\n\n"
            + failures_table(data["failures"]) + "\n## RCTP's premise before and after RL\n\n"
            + premise_table(data["premise"], side))
