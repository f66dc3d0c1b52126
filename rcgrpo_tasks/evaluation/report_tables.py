"""The report as a reader takes it in: three Markdown tables over the rows of `results_table.build_report`.

1. Outcome: greedy accuracy (on the side of the split the rows measured) with its 95 % Wilson interval and pass@1 with its bootstrap interval
   (n entries, the same entry set in every row), each row's paired difference in both to its init (an RL
   row) or to the same model under its token (a no-token row), RC-GRPO against GRPO from the same init
   paired over entries, the paper's Table 1 number beside it (7B, GPU, multi-turn: a reference, not
   comparable), the cross-stage checks, and both measures per category.
2. RL: per cell, the fixed probe's mean reward at step 0 and at the end with the change and its paired CI
   over the probe's prompts (`train.rl.probe`), the zero-variance share of the groups trained on (flat at 0 /
   at 1), each RC-family cell against GRPO from the same init paired group by group (exact McNemar p), rollouts per
   useful group, and whether the run diverged.
3. Controllability: the teacher-forced margin overall and over the realistic kinds (without the empty
   answer), each with its CI over entries, and the token's sampled and greedy gaps with paired CIs.
Nothing is printed as an interval that is not one: a missing value is `n/a`.
"""

from __future__ import annotations

from pathlib import Path

from rcgrpo_tasks.env.paper import row_name
from rcgrpo_tasks.evaluation.formats import ci, num, side_name


def _versus(vs: dict | None) -> tuple[str, str]:
    """(greedy, pass@1) cells of a paired difference to another row: pts [95% paired CI] vs that row."""
    if not vs or not vs["n"]:
        return "", ""
    who = f" vs {row_name(vs['init'])}"
    greedy = ci(vs["diff"], vs["ci"], "+.1f") + f"{who} ({vs['up']} up, {vs['down']} down, p = {vs['p']:.2g})"
    p = vs.get("pass1")
    return greedy, (ci(p["diff"], p["ci"], "+.1f") + f"{who} (p = {p['p']:.2g})") if p else "n/a"


def _pct(c: dict | None) -> str:
    return "n/a" if not c else ci(c["accuracy"], c["ci"], ".1f")


def outcome_table(rows: list[dict]) -> str:
    head = ["model", "greedy accuracy % [95% Wilson CI]", "pass@1 % [95% CI]", "n",
            "greedy vs init (RL) / vs SFT (RCTP) / vs with token, pts [95% paired CI]", "pass@1 vs the same row, pts",
            "paper Table 1 % (7B, GPU, multi-turn)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        o = r["overall"]
        greedy, sampled = _versus(r.get("vs_init"))
        paper = r.get("paper_table1_overall")
        lines.append(f"| {row_name(r['label'])} | {_pct(o)} | {_pct(o.get('pass1'))} | {r['n']} | {greedy} | "
                     f"{sampled} | {num(paper, '.2f') if paper is not None else ''} |")
    for r in rows:  # RC-GRPO against GRPO from the same init: the paper's comparison
        if r.get("vs_grpo"):
            greedy, sampled = _versus(r["vs_grpo"])
            lines.append(f"\n{row_name(r['label'])} against {row_name(r['vs_grpo']['init'])}, paired over entries: "
                         f"greedy {greedy}; pass@1 {sampled}.")
    return "\n".join(lines) + "\n"


def category_table(rows: list[dict]) -> str:
    """Greedy accuracy and pass@1 per category (each with its interval), one row per model."""
    cats = list(dict.fromkeys(c for r in rows for c in r["categories"]))
    head = ["model"] + [f"{c}: greedy / pass@1 %" for c in cats]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{_pct(r['categories'][c])} / {_pct(r['categories'][c].get('pass1'))}" if c in r["categories"]
                 else "" for c in cats]
        lines.append(f"| {row_name(r['label'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def agreement_lines(checks: list[dict]) -> str:
    """One line per cross-stage check that passed (a failed one stops the report before it is written)."""
    return "".join(f"\nCross-stage check, {row_name(c['label'])}: its greedy answers and {c['other']}'s greedy arm "
                   f"under {c['reward_token']} on {c['entries']} shared entries: {c['identical']} identical, "
                   f"{c['tie']} parting at a near-tie (log-probs within {c['tol']}), 0 disagreeing; successes "
                   f"{c['successes'][0]} and {c['successes'][1]}.\n" for c in checks)


def _probe(p: dict | None) -> tuple[str, str]:
    if not p:
        return "n/a", "n/a"
    c = p["change"]
    curve = " -> ".join(f"{x:.3f}" for x in p["reward"])
    return f"{curve} (steps {', '.join(map(str, p['steps']))})", f"{ci(c['mean'], [c['ci_low'], c['ci_high']])} ({c['prompts']} prompts x {p['samples']})"


def _paired(cell: dict | None) -> str:
    if not cell:
        return ""
    z = cell["zero_std_paired"]
    return (f"{z['cell']:.2f} vs GRPO {z['grpo']:.2f} ({z['groups']} groups; only GRPO flat {z['only_grpo']}, "
            f"only this cell flat {z['only_cell']}; McNemar p = {z['mcnemar_p']:.3g})")


def rl_table(rows: list[dict], contrast: dict) -> str:
    head = ["cell", "probe reward, step 0 -> end", "probe change [95% paired CI]",
            "zero-std groups trained (flat at 0 / at 1)", "zero-std paired with GRPO, same init", "rollouts / useful group",
            "diverged / updates skipped (non-finite gradient) / resumed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "-" not in r["label"] or r["label"].endswith("-notoken"):
            continue
        init, algo = r["label"].split("-", 1)
        curve, change = _probe(r.get("rl_probe"))
        flat = num(r.get("rl_mean_frac_zero_std"), ".2f")
        if r.get("rl_mean_frac_flat_fail") is not None:
            flat += f" ({num(r['rl_mean_frac_flat_fail'], '.2f')} / {num(r.get('rl_mean_frac_flat_success'), '.2f')})"
        paired = _paired(contrast.get(r["label"]))
        div, skipped = r.get("rl_diverged"), r.get("rl_nonfinite_grad_steps")
        fate = div["reason"] + ", rolled back to step " + str(div["restored_step"]) if div else "no"
        if skipped:
            fate += f"; skipped at step{'s' if len(skipped) > 1 else ''} {', '.join(map(str, skipped))}"
        if r.get("rl_resumed_from"):
            fate += f"; resumed from {Path(r['rl_resumed_from']).name}"
        lines.append(f"| {row_name(r['label'])} | {curve} | {change} | {flat} | {paired} | "
                     f"{num(r.get('rl_rollouts_per_useful_group'), '.1f')} | {fate} |")
    return "\n".join(lines) + "\n"


def controllability_table(rows: list[dict]) -> str:
    head = ["model", "teacher-forced margin, nat [95% CI]", "margin without the empty answer [95% CI]",
            "sampled gap E[R|high] - E[R|low] [95% paired CI]", "greedy gap [95% paired CI]",
            "expected zero-variance share, all-high / mixed tokens"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        m, real = r.get("ctl_margin"), r.get("ctl_margin_realistic")
        s, g, z = r.get("ctl_gap_sampled"), r.get("ctl_gap_greedy"), r.get("ctl_zero_var")
        if not (m or s or g):
            continue
        cells = [ci(m["gap"], m["ci"]) + f" ({m['n']} entries)" if m else "n/a",
                 ci(real["gap"], real["ci"]) if real else "n/a",
                 ci(s["gap"], s["ci"]) if s else "n/a", ci(g["gap"], g["ci"]) if g else "n/a",
                 f"{num(z['all_high'], '.3f')} / {num(z['mixed'], '.3f')} (G={z['G']})" if z else "n/a"]
        lines.append(f"| {row_name(r['label'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def note(side: str) -> str:
    """The report's closing note: what each number is, on the `side` of the split its rows measured."""
    entries = f"{side_name(side)} entries"
    return (
        "Accuracy: the evaluate stage's success (single_turn: BFCL's AST checker; multi_turn: the paper's binary "
        f"reward under the paper protocol) on the {entries}, greedy; pass@1: the mean over entries of the share of "
        "the entry's answers sampled as RL samples them that succeed (the same row seeds in every model); "
        "intervals: 95 % Wilson score (greedy), 95 % bootstrap over entries (pass@1); differences: the same "
        "entries paired; greedy: the entries only this row / only the other got right (up, down), exact McNemar p, "
        "Tango's 95 % score interval; pass@1: the paired t over entries (interval and p). The paper's "
        "numbers are Qwen2.5-7B-Instruct on BFCL v4 multi-turn (its 80 test entries): the shape of the result, not "
        "a target here. Probe: the run's fixed prompts x samples at the rollouts' temperature, the same seeds at "
        "every checkpoint and in every cell of an init, conditioned as the cell is evaluated; its change is paired "
        "over prompts. Zero-std: groups whose reward has no spread (no learning signal); paired: GRPO and RC-GRPO "
        "groups of the same step and slot (the same entry and seeds). Resumed: the run was cut and went on from that "
        "checkpoint; on the CPU it trains bit for bit what the uncut run trains, on a GPU up to the run-to-run "
        "variation of its kernels (docs/rl.md, Resume). Margin: [lp(expert|high) - lp(expert|low)] "
        f"- [lp(near miss|high) - lp(near miss|low)], 95 % bootstrap over {entries}; without the empty answer: the "
        f"kinds a model must read its task to separate. Gaps: E[R|high] - E[R|low] on {entries}, paired over "
        "entries.\n")


def report_markdown(rows: list[dict], contrast: dict, side: str, checks: list[dict] = ()) -> str:
    """The three tables with their headings, the per-category table, the cross-stage checks and the note, on
    the `side` of the split the rows measured (`results_table.one_side`)."""
    return ("## Outcome\n\n" + outcome_table(rows) + agreement_lines(list(checks))
            + "\n### Per category\n\n" + category_table(rows) + "\n## RL\n\n" + rl_table(rows, contrast)
            + "\n## Controllability\n\n" + controllability_table(rows) + "\n" + note(side))
