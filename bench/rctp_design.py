"""RCTP designs on dev, over seeds: does the RCTP model read its reward token as RC-GRPO needs (q), and at what
cost to its success under `<|high_reward|>`?

Each (design, seed) is the pipeline's own `rctp@<seed>` run (`rcgrpo sft --variant rctp`) with params overrides
of the `sft.variants.rctp` section and `seed` set, followed by the pipeline's own controllability check
(`rcgrpo controllability --side dev`: the sampled arm at the RL temperature, paired rollouts) on the dev entries
(designs are chosen on dev; `--side test` only re-measures a chosen one), on the outputs `dvc repro
label_rewards@rctp` left (data/datasets/rctp.jsonl, models/sft/sft) or another RCTP set (`--data`, per design:
`NAME@path:...`), or one the design builds: its `label.<key>=value` overrides go to params `label_rewards` and
the pipeline's own `rcgrpo label-rewards --dataset rctp` writes the design's set (`<work>/<name>/rctp.jsonl`)
from the generate set and the SFT model's samples (`data/policy`), once for all seeds. A content premise:
`--design wrong_call:label.failures=wrong_call,label.base_failures=false` (the low side the model's own wrong
calls, never prose: `data.pairing`). Each run prints one JSON line (design, seed, RCTP seconds, q with its CI and discordant pairs,
R|high, R|low, the sampled gap with its CI, identical pairs, q split by the low rollout's failure kind and
each token's failures by kind, the premise gate, the check's seconds; the margin when `controllability.margin`
is on); the end prints the design table: q per seed, the least q, q by the low side's failure kind (mean over
seeds: no call / wrong function / wrong arguments), R|high per seed against `--bar` (the SFT model's dev
pass@1, `rcgrpo evaluate --side dev`), and whether the design meets the target (q >=
controllability.premise_min_q in every seed and mean R|high >= the bar).

Run: `python bench/rctp_design.py --seeds 0,1,2 --bar 0.2625 --design strat:row_order=stratified
--design strat_ul@data/rctp64.jsonl:row_order=stratified,unlikelihood=1 --set controllability.margin=false
--set controllability.n_entries=60 --set controllability.samples_per_token=4 --work sweeps/rctp`.
Measured: docs/rl.md, "RCTP design".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml


def _value(text: str):
    return yaml.safe_load(text)


LABEL = "label."
"""Prefix of a design's overrides of params `label_rewards` (the RCTP set it builds)."""
KINDS = ("no_call", "wrong_function", "wrong_arguments")


def design_params(base: dict, overrides: dict, sets: list[str]) -> dict:
    """params.yaml with `overrides` on sft.variants.rctp (`label.<key>` ones on label_rewards) and
    `section.key=value` sets."""
    params = json.loads(json.dumps(base))
    label = {k[len(LABEL):]: v for k, v in overrides.items() if k.startswith(LABEL)}
    rctp = {k: v for k, v in overrides.items() if not k.startswith(LABEL)}
    params["sft"]["variants"]["rctp"] = {**params["sft"]["variants"].get("rctp", {}), **rctp}
    params["label_rewards"] = {**params["label_rewards"], **label}
    for item in sets:
        key, value = item.split("=", 1)
        section, name = key.split(".", 1)
        params[section][name] = _value(value)
    return params


def build_set(name: str, overrides: dict, base: dict, sets: list[str], work: Path) -> str:
    """The design's own RCTP set (`label.<key>` overrides), written by the pipeline's label-rewards command from
    the generate set and the SFT model's samples; its path (built once, then read back)."""
    out = work / name / "rctp.jsonl"
    if not out.is_file():
        params = work / f"{name}-label.yaml"
        params.write_text(yaml.safe_dump(design_params(base, overrides, sets), sort_keys=False))
        subprocess.run(["rcgrpo", "label-rewards", "--params", str(params), "--dataset", "rctp", "--trajectories",
                        "data/trajectories.jsonl", "--validation", "data/validation", "--policy",
                        "data/policy/trajectories.jsonl", "--policy-validation", "data/policy/validation",
                        "--model-dir", "models/base", "--out", str(out), "--metrics", str(work / name / "label.json")],
                       check=True, stdout=subprocess.DEVNULL)
    return str(out)


def run_design(name: str, overrides: dict, base: dict, sets: list[str], work: Path, data: str, side: str) -> dict:
    """One RCTP run and its controllability check; the row the table is built from."""
    params = work / f"{name}.yaml"
    params.write_text(yaml.safe_dump(design_params(base, overrides, sets), sort_keys=False))
    init = "models/sft/sft" if overrides.get("init", base["sft"]["variants"]["rctp"].get("init")) == "sft" else ""
    out = work / name
    t0 = time.perf_counter()
    subprocess.run(["rcgrpo", "sft", "--params", str(params), "--variant", "rctp", "--model-dir", "models/base",
                    "--data", data, "--init-adapter", init, "--entries", "data/entries.jsonl",
                    "--split", "data/split.json", "--out", str(out / "model"), "--checkpoints", str(out / "ck"),
                    "--metrics", str(out / "sft.json")], check=True, stdout=subprocess.DEVNULL)
    train_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    subprocess.run(["rcgrpo", "controllability", "--params", str(params), "--model-dir", "models/base",
                    "--adapter-dir", str(out / "model"), "--entries", "data/entries.jsonl", "--split",
                    "data/split.json", "--side", side, "--metrics", str(out / "ctl.json")], check=True,
                   stdout=subprocess.DEVNULL)
    check_s = time.perf_counter() - t0
    m = json.loads((out / "ctl.json").read_text())
    sft = json.loads((out / "sft.json").read_text())
    s, q = m["sampled"], m["sampled"]["premise"]
    row = {"design": name, "side": side, "overrides": overrides, "data": data, "rctp_steps": sft["steps"],
           "rctp_s": round(train_s, 1), "q": round(q["q"], 3), "q_ci": [round(x, 3) for x in q["q_ci"]],
           "high_only": q["high_only"], "low_only": q["low_only"], "mcnemar_p": q["mcnemar_p"],
           "sampled_high": round(s["success_rate_high"], 4), "sampled_low": round(s["success_rate_low"], 4),
           "sampled_gap": round(s["gap"], 4), "sampled_gap_ci": [round(x, 4) for x in s["gap_ci"]],
           "sampled_identical": f"{s['identical_outputs']}/{s['pairs']}", "gate": m["premise_gate"],
           "q_by_kind": s.get("q_by_kind"), "failures_low": s.get("failures_low"),
           "failures_high": s.get("failures_high"), "check_s": round(check_s, 1)}
    if "greedy" in m:
        row |= {"greedy_gap": m["greedy"]["gap"], "greedy_high": m["greedy"]["success_rate_high"]}
    if "margin" in m:
        row |= {"margin": round(m["margin"]["margin"], 3), "token_rows_ratio": round(m["token_rows"]["ratio"], 3)}
    return row


def parse_design(text: str) -> tuple[str, str | None, dict]:
    """`NAME[@data]:key=value,...` -> (name, data or None, overrides)."""
    head, _, body = text.partition(":")
    name, _, data = head.partition("@")
    return name, data or None, {k: _value(v) for k, v in (kv.split("=", 1) for kv in body.split(",") if kv)}


def table(rows: list[dict], min_q: float, bar: float | None) -> str:
    """One line per design: q and R|high per seed, the least q, the mean R|high, each half of the target (q >=
    `min_q` in every seed; mean R|high >= `bar`) met or not."""
    lines = ["| design | data | q per seed [95% CI] | least q | q by the low side's failure: no call / wrong function "
             "/ wrong arguments (mean) | R\\|high per seed | mean R\\|high | gap per seed "
             f"| q >= {min_q} every seed | mean R\\|high >= {bar} |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["design"].rsplit("-s", 1)[0] for r in rows):
        mine = [r for r in rows if r["design"].rsplit("-s", 1)[0] == name]
        qs = [r["q"] for r in mine]
        high = sum(r["sampled_high"] for r in mine) / len(mine)
        q_met, high_met = min(qs) >= min_q, bar is None or high >= bar
        lines.append(f"| {name} | {'/'.join(Path(mine[0]['data']).parts[-2:])} | "
                     + ", ".join(f"{r['q']:.2f} [{r['q_ci'][0]:.2f}, {r['q_ci'][1]:.2f}]" for r in mine)
                     + f" | {min(qs):.2f} | {by_kind(mine)} | " + ", ".join(f"{r['sampled_high']:.3f}" for r in mine)
                     + f" | {high:.3f} | " + ", ".join(f"{r['sampled_gap']:+.3f}" for r in mine)
                     + f" | {'met' if q_met else 'missed'} | {'met' if high_met else 'missed'} |")
    return "\n".join(lines) + "\n"


def by_kind(rows: list[dict]) -> str:
    """q split by the low rollout's failure kind, each the mean over `rows` (n/a where a row lacks it)."""
    split = [r.get("q_by_kind") for r in rows]
    if not all(split):
        return "n/a"
    return " / ".join(f"{sum(q[k] for q in split) / len(split):.2f}" for k in KINDS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--design", action="append", required=True, help="NAME[@data]:key=value,... over sft.variants.rctp")
    ap.add_argument("--seeds", default="0", help="comma-separated RCTP seeds (sft.variants.rctp.seed)")
    ap.add_argument("--set", action="append", default=[], help="section.key=value on the base params")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--data", default="data/datasets/rctp.jsonl", help="the RCTP set of designs that name none")
    ap.add_argument("--side", default="dev", help="controllability's entries: dev (choosing) | test (reporting)")
    ap.add_argument("--bar", type=float, default=None, help="R|high to keep: the SFT model's dev pass@1 (0..1)")
    ap.add_argument("--work", default=None, help="folder for the runs' outputs (default: a temp folder)")
    args = ap.parse_args()
    base = yaml.safe_load(Path(args.params).read_text())
    work = Path(args.work or tempfile.mkdtemp(prefix="rctp_design_"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for text in args.design:
        name, data, overrides = parse_design(text)
        if any(k.startswith(LABEL) for k in overrides):
            data = build_set(name, overrides, base, args.set, work)
        for seed in (int(s) for s in args.seeds.split(",")):
            done = work / f"{name}-s{seed}.json"
            if done.is_file():  # resumable: a finished run is read back
                row = json.loads(done.read_text())
            else:
                row = run_design(f"{name}-s{seed}", {**overrides, "seed": seed}, base, args.set, work,
                                 data or args.data, args.side)
                done.write_text(json.dumps(row))
            rows.append(row)
            print(json.dumps(row), flush=True)
    min_q = design_params(base, {}, args.set)["controllability"].get("premise_min_q", 0.3)
    text = table(rows, min_q, args.bar)
    (work / "table.md").write_text(text)
    print(text)
    print(f"outputs: {work}", file=sys.stderr)


if __name__ == "__main__":
    main()
