"""The report as a reader takes it in: three Markdown tables over the rows of `results_table.build_report`.

1. Outcome: held-out accuracy with its 95 % Wilson interval (n entries, the same entry set in every row),
   the paired difference to the row's init (an RL row) or to the same model under its token (a no-token
   row), and the paper's Table 1 number beside it (7B, GPU, multi-turn: a reference, not comparable).
2. RL: per cell, the fixed probe's mean reward at step 0 and at the end with the change and its paired CI
   over the probe's prompts (`train.probe`), the zero-variance share of the groups trained on (flat at 0 /
   at 1), RC-GRPO against GRPO from the same init paired group by group (exact McNemar p), rollouts per
   useful group, and whether the run diverged.
3. Controllability: the teacher-forced margin overall and over the realistic kinds (without the empty
   answer), each with its CI over entries, and the token's sampled and greedy gaps with paired CIs.
Nothing is printed as an interval that is not one: a missing value is `n/a`.
"""

from __future__ import annotations

import math

from rcgrpo_tasks.env.paper import row_name


def _n(v, spec: str = ".2f") -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _ci(v, ci, spec: str = "+.3f") -> str:
    if v is None or ci is None or any(x is None or math.isnan(x) for x in (v, *ci)):
        return "n/a"
    return f"{format(v, spec)} [{format(ci[0], spec)}, {format(ci[1], spec)}]"


def outcome_table(rows: list[dict]) -> str:
    head = ["model", "held-out accuracy % [95% Wilson CI]", "n", "vs init (RL) / vs SFT (RCTP) / vs with token, pts [95% paired CI]",
            "paper Table 1 % (7B, GPU, multi-turn)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        o, vs = r["overall"], r.get("vs_init")
        versus = _ci(vs["diff"], vs["ci"], "+.1f") + f" vs {row_name(vs['init'])}" if vs and vs["n"] else ""
        lines.append(f"| {row_name(r['label'])} | {_ci(o['accuracy'], o['ci'], '.1f')} | {r['n']} | {versus} | "
                     f"{_n(r.get('paper_table1_overall'), '.2f') if r.get('paper_table1_overall') is not None else ''} |")
    return "\n".join(lines) + "\n"


def _probe(p: dict | None) -> tuple[str, str]:
    if not p:
        return "n/a", "n/a"
    c = p["change"]
    curve = " -> ".join(f"{x:.3f}" for x in p["reward"])
    return f"{curve} (steps {', '.join(map(str, p['steps']))})", f"{_ci(c['mean'], [c['ci_low'], c['ci_high']])} ({c['prompts']} prompts x {p['samples']})"


def _paired(cell: dict | None, rc: bool) -> str:
    if not cell:
        return ""
    z = cell["zero_std_paired"]
    if not rc:
        return f"{z['grpo']:.2f} of {z['groups']} groups"
    return (f"{z['rc_grpo']:.2f} vs GRPO {z['grpo']:.2f} ({z['groups']} groups; only GRPO flat {z['only_grpo']}, "
            f"only RC-GRPO {z['only_rc_grpo']}; McNemar p = {z['mcnemar_p']:.3g})")


def rl_table(rows: list[dict], contrast: dict) -> str:
    head = ["cell", "probe reward, step 0 -> end", "probe change [95% paired CI]",
            "zero-std groups trained (flat at 0 / at 1)", "zero-std paired with GRPO, same init", "rollouts / useful group",
            "diverged / updates skipped (non-finite gradient)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "-" not in r["label"] or r["label"].endswith("-notoken"):
            continue
        init, algo = r["label"].split("-", 1)
        curve, change = _probe(r.get("rl_probe"))
        flat = _n(r.get("rl_mean_frac_zero_std"), ".2f")
        if r.get("rl_mean_frac_flat_fail") is not None:
            flat += f" ({_n(r['rl_mean_frac_flat_fail'])} / {_n(r.get('rl_mean_frac_flat_success'))})"
        paired = _paired(contrast.get(init), algo == "rc_grpo") if algo in ("grpo", "rc_grpo") else ""
        div, skipped = r.get("rl_diverged"), r.get("rl_nonfinite_grad_steps")
        fate = div["reason"] + ", rolled back to step " + str(div["restored_step"]) if div else "no"
        if skipped:
            fate += f"; skipped at step{'s' if len(skipped) > 1 else ''} {', '.join(map(str, skipped))}"
        lines.append(f"| {row_name(r['label'])} | {curve} | {change} | {flat} | {paired} | "
                     f"{_n(r.get('rl_rollouts_per_useful_group'), '.1f')} | {fate} |")
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
        cells = [_ci(m["gap"], m["ci"]) + f" ({m['n']} entries)" if m else "n/a",
                 _ci(real["gap"], real["ci"]) if real else "n/a",
                 _ci(s["gap"], s["ci"]) if s else "n/a", _ci(g["gap"], g["ci"]) if g else "n/a",
                 f"{_n(z['all_high'], '.3f')} / {_n(z['mixed'], '.3f')} (G={z['G']})" if z else "n/a"]
        lines.append(f"| {row_name(r['label'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


NOTE = (
    "Accuracy: the evaluate stage's success (single_turn: BFCL's AST checker; multi_turn: the paper's binary reward "
    "under the paper protocol) on the held-out entries, greedy; intervals: 95 % Wilson score; differences: the "
    "same entries paired, 95 % bootstrap over entries. The paper's numbers are Qwen2.5-7B-Instruct on BFCL v4 "
    "multi-turn (80 held-out entries): the shape of the result, not a target here. Probe: the run's fixed "
    "prompts x samples at the rollouts' temperature, the same seeds at every checkpoint and in every cell of an "
    "init, conditioned as the cell is evaluated; its change is paired over prompts. Zero-std: groups whose "
    "reward has no spread (no learning signal); paired: GRPO and RC-GRPO groups of the same step and slot (the "
    "same entry and seeds). Margin: [lp(expert|high) - lp(expert|low)] - [lp(near miss|high) - lp(near "
    "miss|low)], 95 % bootstrap over held-out entries; without the empty answer: the kinds a model must read "
    "its task to separate. Gaps: E[R|high] - E[R|low] on held-out entries, paired over entries.\n")


def report_markdown(rows: list[dict], contrast: dict) -> str:
    """The three tables with their headings and the note."""
    return ("## Outcome\n\n" + outcome_table(rows) + "\n## RL\n\n" + rl_table(rows, contrast)
            + "\n## Controllability\n\n" + controllability_table(rows) + "\n" + NOTE)
